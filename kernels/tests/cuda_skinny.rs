//! GPU tests of the decode-speed kernels against their CPU twins: the skinny split-k GEMM
//! (`gemv_bf16`: `skinny_linear_fwd_bf16`, `skinny_gate_up_swiglu_bf16`, `skinny_qkv_rope_bf16`)
//! and the group-shared
//! decode attention (`attention_decode_grouped_bf16`). Fresh random inputs each run, outputs
//! poisoned with NaN first (an unwritten element fails). Each test prints "skipped: no CUDA
//! device" and passes where no GPU is present.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, DecodeSeq};
use rollplex_kernels::cuda::attention::{
    attention_decode_grouped_bf16, grouped_decode_plan, grouped_decode_plan_for_blocks,
    grouped_decode_plan_tabled, DecodeInputs, RowStrides,
};
use rollplex_kernels::cuda::gemm::{
    gate_up_swiglu_bf16, linear_fwd_bf16_cublaslt, qkv_rope_fuses, skinny_gate_up_swiglu_bf16,
    skinny_linear_fwd_bf16, skinny_linear_fwd_bf16_with, skinny_plan, skinny_plan_with,
    skinny_qkv_rope_bf16, skinny_qkv_rope_plan,
};
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

/// The skinny GEMM against `cpu::linear_fwd` on decode shapes (bias or not, m from 1 to 128, k
/// not a multiple of 64, n not a multiple of the block), under its default plan and under other
/// plans (1 and 2 row tiles, 1 to 8 k slices, both the `mma.sync` and the `wgmma` form where m
/// allows, one and two consumer warpgroups in the `wgmma` form); the default plan twice gives
/// the same bits. The `wgmma` form runs where the device
/// has it (Hopper) and is reported as skipped elsewhere.
#[test]
fn skinny_linear_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, n, bias) in &[
        (1usize, 64usize, 48usize, true),
        (8, 2048, 2560, true),
        (64, 2048, 2560, true),
        (37, 520, 300, false),
        (64, 11008, 2048, false),
        (17, 3584, 4608, true),
        (128, 2048, 2560, true),
        (72, 11008, 2048, false),
        (100, 520, 300, true),
        (9, 2048, 22016, false),
        (33, 3584, 3584, true),
    ] {
        if m > 8 && !g.has_wgmma() {
            println!("m{m}: skipped, {} has no warpgroup MMAs", g.name());
            continue;
        }
        let (x, xf) = rand_bf(m * k, 1.0);
        let (w, wf) = rand_bf(n * k, 0.05);
        let (b, bfv) = rand_bf(n, 1.0);
        let mut want = vec![0f32; m * n];
        let bias_f = if bias { Some(&bfv[..]) } else { None };
        cpu::linear_fwd(&mut want, &xf, &wf, bias_f, m, k, n).unwrap();
        let (dx, dw, db) = (up(&s, &x), up(&s, &w), up(&s, &b));
        let bias_d = if bias {
            Some(&db as &dyn cudarc::driver::DevicePtr<bf16>)
        } else {
            None
        };
        let mut dy = poison_bf(&s, m * n);
        skinny_linear_fwd_bf16(g, &s, &mut dy, &dx, &dw, bias_d, m, k, n).unwrap();
        let first = down(&s, &dy);
        check(
            &format!(
                "skinny_linear_fwd_bf16 m{m} k{k} n{n} {:?}",
                skinny_plan(m, k, n)
            ),
            &to_f32(&first),
            &want,
            8e-3,
        );
        let mut dy2 = poison_bf(&s, m * n);
        skinny_linear_fwd_bf16(g, &s, &mut dy2, &dx, &dw, bias_d, m, k, n).unwrap();
        assert_eq!(first, down(&s, &dy2), "same plan, same bits");
        let mut plans = Vec::new();
        for (rt, splits) in [(1, 1), (2, 8), (1, 5), (2, 3)] {
            let plan = skinny_plan_with(m, k, n, rt, splits);
            plans.push(plan);
            if m <= 64 && (plan.wgmma || g.has_wgmma()) {
                plans.push(plan.with_form(m, !plan.wgmma));
            }
            // two consumer warpgroups sharing each x tile
            if plan.wgmma {
                plans.extend(plan.with_warpgroups(2));
            }
        }
        for plan in plans {
            let mut dy = poison_bf(&s, m * n);
            skinny_linear_fwd_bf16_with(g, &s, &mut dy, &dx, &dw, bias_d, m, k, n, k, n, plan)
                .unwrap();
            check(
                &format!("skinny_linear_fwd_bf16 m{m} k{k} n{n} {plan:?}"),
                &to_f32(&down(&s, &dy)),
                &want,
                8e-3,
            );
        }
    }
    // strided rows: x rows 2k apart, y rows n + 40 apart (the gaps stay poisoned), in the
    // mma.sync form (m = 8) and the TMA-fed form (m = 24, its x descriptor with that stride)
    let (k, n) = (256, 200);
    for m in [8, 24] {
        if m > 8 && !g.has_wgmma() {
            println!("strided m{m}: skipped, {} has no warpgroup MMAs", g.name());
            continue;
        }
        let (x, xf) = rand_bf(m * 2 * k, 1.0);
        let (w, wf) = rand_bf(n * k, 0.05);
        let xc: Vec<f32> = (0..m)
            .flat_map(|r| xf[r * 2 * k..r * 2 * k + k].to_vec())
            .collect();
        let mut want = vec![0f32; m * n];
        cpu::linear_fwd(&mut want, &xc, &wf, None, m, k, n).unwrap();
        let (dx, dw) = (up(&s, &x), up(&s, &w));
        let ldy = n + 40;
        let mut dy = poison_bf(&s, m * ldy);
        let plan = skinny_plan(m, k, n);
        skinny_linear_fwd_bf16_with(g, &s, &mut dy, &dx, &dw, None, m, k, n, 2 * k, ldy, plan)
            .unwrap();
        let got = to_f32(&down(&s, &dy));
        let rows: Vec<f32> = (0..m)
            .flat_map(|r| got[r * ldy..r * ldy + n].to_vec())
            .collect();
        check(
            &format!("skinny_linear_fwd_bf16 strided m{m} {plan:?}"),
            &rows,
            &want,
            8e-3,
        );
        assert!(got[n..ldy].iter().all(|v| v.is_nan()), "gap written");
    }
    // bad shapes are errors, not launches
    let (dx, dw) = (
        up(&s, &rand_bf(129 * k, 1.0).0),
        up(&s, &rand_bf(n * k, 0.05).0),
    );
    let mut dy = poison_bf(&s, 129 * n);
    assert!(skinny_linear_fwd_bf16(g, &s, &mut dy, &dx, &dw, None, 129, k, n).is_err());
    assert!(skinny_linear_fwd_bf16(g, &s, &mut dy, &dx, &dw, None, 8, 12, n).is_err());
}

/// The fused gate|up GEMM + SwiGLU against `cpu::linear_fwd` + `cpu::swiglu_fwd`, and bitwise
/// against the unfused pair (skinny GEMM into `[m, 2f]` then `swiglu_fwd_bf16`).
#[test]
fn skinny_gate_up_swiglu_matches_cpu_and_the_unfused_pair() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, f) in &[
        (64usize, 2048usize, 1376usize),
        (8, 512, 1000),
        (3, 64, 40),
        (128, 2048, 11008),
        (24, 520, 1000),
    ] {
        if m > 8 && !g.has_wgmma() {
            println!("m{m}: skipped, {} has no warpgroup MMAs", g.name());
            continue;
        }
        let (x, xf) = rand_bf(m * k, 1.0);
        let (w, wf) = rand_bf(2 * f * k, 0.05);
        let mut gu = vec![0f32; m * 2 * f];
        cpu::linear_fwd(&mut gu, &xf, &wf, None, m, k, 2 * f).unwrap();
        let (mut gate, mut upv) = (Vec::new(), Vec::new());
        for r in 0..m {
            gate.extend_from_slice(&gu[r * 2 * f..r * 2 * f + f]);
            upv.extend_from_slice(&gu[r * 2 * f + f..(r + 1) * 2 * f]);
        }
        let mut want = vec![0f32; m * f];
        cpu::swiglu_fwd(&mut want, &gate, &upv).unwrap();
        let (dx, dw) = (up(&s, &x), up(&s, &w));
        // the default plan (what `None` takes), and with two consumer warpgroups (the gate rows
        // on one, the up rows on the other) where the wgmma form runs
        let def = skinny_plan(m, k, 2 * f);
        let plans = [Some(def), def.with_warpgroups(2).filter(|p| p.wgmma)];
        for (i, plan) in plans.into_iter().flatten().enumerate() {
            let mut act = poison_bf(&s, m * f);
            let arg = if i == 0 { None } else { Some(plan) };
            skinny_gate_up_swiglu_bf16(g, &s, &mut act, &dx, &dw, m, k, f, arg).unwrap();
            let fused = down(&s, &act);
            let what = format!("skinny_gate_up_swiglu_bf16 m{m} k{k} f{f} {plan:?}");
            check(&what, &to_f32(&fused), &want, 1e-2);
            let mut dgu = poison_bf(&s, m * 2 * f);
            let (kk, n) = (k, 2 * f);
            skinny_linear_fwd_bf16_with(g, &s, &mut dgu, &dx, &dw, None, m, k, n, kk, n, plan)
                .unwrap();
            let mut act2 = poison_bf(&s, m * f);
            let upview = dgu.slice(f..);
            swiglu_fwd_bf16(g, &s, &mut act2, &dgu, &upview, m, f, f, 2 * f, 2 * f).unwrap();
            assert_eq!(
                fused,
                down(&s, &act2),
                "{what}: fused = GEMM then swiglu_fwd_bf16, bitwise"
            );
        }
    }
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The q|k|v projection with the rotary embedding and the KV append in its epilogue, bitwise
/// the skinny GEMM under the same plan followed by `rope_kv_append_bf16` (the rotated rows and
/// both caches), with a bias, m from 1 to 128 (the `mma.sync` and `wgmma` forms, 1 to 8 k
/// slices), 3B / 7B dims and a small head_dim of 64; every fifth row's slot lies past the
/// caches (nothing of it may land there). The dispatching `qkv_rope_append_bf16` gives the same
/// bits where it fuses (m <= 64) and those of `linear_fwd_bf16` + `rope_kv_append_bf16` where
/// it does not; shapes the fused form cannot take are refused.
#[test]
fn skinny_qkv_rope_is_the_gemm_then_rope_kv_append() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, nh, nkv, hd) in &[
        (1usize, 2048usize, 16usize, 2usize, 128usize),
        (8, 2048, 16, 2, 128),
        (5, 520, 4, 2, 64),
        (13, 520, 4, 2, 64),
        (40, 2048, 16, 2, 128),
        (64, 2048, 16, 2, 128),
        (100, 2048, 16, 2, 128),
        (128, 2048, 16, 2, 128),
        (24, 3584, 28, 4, 128),
    ] {
        if m > 8 && !g.has_wgmma() {
            println!("m{m}: skipped, {} has no warpgroup MMAs", g.name());
            continue;
        }
        let n = (nh + 2 * nkv) * hd;
        let (kvw, rows) = (nkv * hd, 2 * m + 3);
        let (x, _) = rand_bf(m * k, 1.0);
        let (w, _) = rand_bf(n * k, 0.05);
        let (b, _) = rand_bf(n, 0.5);
        let (cache0, _) = rand_bf(rows * kvw, 1.0);
        let seed = fresh_seed();
        let cos: Vec<f32> = rand_vec(m * hd, seed);
        let sin: Vec<f32> = rand_vec(m * hd, seed ^ 1);
        let slots: Vec<u32> = (0..m)
            .map(|i| {
                if i % 5 == 4 {
                    (rows + i) as u32
                } else {
                    (2 * i + 1) as u32
                }
            })
            .collect();
        let (dx, dw, db) = (up(&s, &x), up(&s, &w), up(&s, &b));
        let (dcos, dsin, dslots) = (up(&s, &cos), up(&s, &sin), up(&s, &slots));
        let bias = Some(&db as &dyn cudarc::driver::DevicePtr<bf16>);
        let plan = skinny_qkv_rope_plan(m, k, n, hd).expect("a plan for these dims");
        let what = format!("skinny_qkv_rope_bf16 m{m} k{k} heads {nh}/{nkv}x{hd} {plan:?}");
        // the reference: the plain skinny GEMM, then the rotary + append kernel
        let mut want = poison_bf(&s, m * n);
        skinny_linear_fwd_bf16_with(g, &s, &mut want, &dx, &dw, bias, m, k, n, k, n, plan).unwrap();
        let (mut kw, mut vw) = (up(&s, &cache0), up(&s, &cache0));
        rope_kv_append_bf16(
            g, &s, &mut want, &mut kw, &mut vw, &dcos, &dsin, &dslots, m, nh, nkv, hd, true,
        )
        .unwrap();
        let (want, kw, vw) = (
            bits(&down(&s, &want)),
            bits(&down(&s, &kw)),
            bits(&down(&s, &vw)),
        );
        assert_ne!(kw, bits(&cache0), "{what}: the reference appended rows");
        // where the dispatch does not fuse: the dispatching GEMM, then the same kernel
        let fuses = qkv_rope_fuses(g, m, k, n, hd);
        assert_eq!(fuses, m <= 64, "{what}: the dispatch fuses up to 64 rows");
        let unfused = {
            let mut y = poison_bf(&s, m * n);
            linear_fwd_bf16(g, &s, &mut y, &dx, &dw, bias, m, k, n).unwrap();
            let (mut kc, mut vc) = (up(&s, &cache0), up(&s, &cache0));
            rope_kv_append_bf16(
                g, &s, &mut y, &mut kc, &mut vc, &dcos, &dsin, &dslots, m, nh, nkv, hd, true,
            )
            .unwrap();
            (
                bits(&down(&s, &y)),
                bits(&down(&s, &kc)),
                bits(&down(&s, &vc)),
            )
        };
        // the fused launch, then the dispatching entry point
        for dispatch in [false, true] {
            let mut y = poison_bf(&s, m * n);
            let (mut kc, mut vc) = (up(&s, &cache0), up(&s, &cache0));
            let rope = QkvRope {
                k_cache: &mut kc,
                v_cache: &mut vc,
                cos: &dcos,
                sin: &dsin,
                slots: &dslots,
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
            };
            if dispatch {
                qkv_rope_append_bf16(g, &s, &mut y, &dx, &dw, bias, m, k, rope).unwrap();
            } else {
                skinny_qkv_rope_bf16(g, &s, &mut y, &dx, &dw, bias, m, k, rope, None).unwrap();
            }
            let (tag, (want, kw, vw)) = match (dispatch, fuses) {
                (false, _) => ("fused", (&want, &kw, &vw)),
                (true, true) => ("qkv_rope_append_bf16, fused", (&want, &kw, &vw)),
                (true, false) => (
                    "qkv_rope_append_bf16, not fused",
                    (&unfused.0, &unfused.1, &unfused.2),
                ),
            };
            assert_eq!(
                &bits(&down(&s, &y)),
                want,
                "{what}: {tag} q|k|v rows, bitwise"
            );
            assert_eq!(&bits(&down(&s, &kc)), kw, "{what}: {tag} k cache, bitwise");
            assert_eq!(&bits(&down(&s, &vc)), vw, "{what}: {tag} v cache, bitwise");
        }
    }
    // refused: query heads not a multiple of the kv heads, and a head whose half (20 rows) the
    // block's 32 pairs do not divide
    let (m, k) = (8, 64);
    for (nh, nkv, hd) in [(3usize, 2usize, 64usize), (2, 1, 40)] {
        let n = (nh + 2 * nkv) * hd;
        let (dx, dw) = (
            up(&s, &rand_bf(m * k, 1.0).0),
            up(&s, &rand_bf(n * k, 0.1).0),
        );
        let (mut kc, mut vc) = (poison_bf(&s, 4 * nkv * hd), poison_bf(&s, 4 * nkv * hd));
        let (dcos, dsin) = (poison_f32(&s, m * hd), poison_f32(&s, m * hd));
        let dslots = up(&s, &vec![0u32; m]);
        let mut y = poison_bf(&s, m * n);
        let rope = QkvRope {
            k_cache: &mut kc,
            v_cache: &mut vc,
            cos: &dcos,
            sin: &dsin,
            slots: &dslots,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        };
        let r = skinny_qkv_rope_bf16(g, &s, &mut y, &dx, &dw, None, m, k, rope, None);
        assert!(r.is_err(), "heads {nh}/{nkv}x{hd} refused");
    }
    assert!(
        !qkv_rope_fuses(g, 8, 64, 160, 40),
        "head_dim 40 is not fused"
    );
}

/// Attention dims: `h` query heads, `kv` kv heads of `hd`.
fn d(h: usize, kv: usize, hd: usize) -> AttnDims {
    AttnDims {
        num_heads: h,
        num_kv_heads: kv,
        head_dim: hd,
    }
}

/// Runs the group-shared decode attention over `case` with `plan` (and group table `starts`)
/// into poisoned buffers and checks its outputs and log-sum-exps against the CPU twin's.
fn grouped_against_cpu(
    g: &Gpu,
    s: &Arc<CudaStream>,
    case: &GroupedDecodeCase,
    dims: AttnDims,
    plan: GroupedDecodePlan,
    starts: Option<&CudaSlice<u32>>,
    label: &str,
) {
    let b = case.b;
    let mut ws = poison_f32(s, plan.workspace_len());
    let mut dout = poison_bf(s, b * dims.q_width());
    let mut dlse = poison_f32(s, b * dims.num_heads);
    let mut lv = dlse.as_view_mut();
    attention_decode_grouped_bf16(
        g,
        s,
        &mut dout,
        Some(&mut lv),
        &mut ws,
        case.inputs(dims, &case.seqs),
        plan,
        starts,
    )
    .unwrap();
    check(
        &format!("attention_decode_grouped_bf16 {label}"),
        &to_f32(&down(s, &dout)),
        &case.want,
        1e-2,
    );
    check(
        &format!("attention_decode_grouped_bf16 lse {label}"),
        &down(s, &dlse),
        &case.want_lse,
        1e-4,
    );
}

/// Group-shared decode attention against `cpu::attention_decode`: GRPO groups whose samples
/// share a prefix (read once per group), random suffix lengths, GQA 8:1 (3B), 7:1 (7B) and
/// 12:1 (head_dim 64, two head groups), a group larger than one block's rows, and a sample whose
/// prefix differs from its group's (it must come out NaN, loudly, not silently wrong).
#[test]
fn attention_decode_grouped_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for (dims, groups, gsize, prefix_len) in [
        (d(16, 2, 128), 3usize, 8usize, 700usize),
        (d(28, 4, 128), 2, 8, 1500),
        (d(16, 2, 128), 1, 16, 333),
        (d(12, 1, 64), 2, 5, 200),
        (d(16, 2, 128), 2, 4, 0),
    ] {
        let case = grouped_decode_case(&s, dims, groups, gsize, prefix_len);
        let b = case.b;

        let max_suffix = *case.suffix_lens.iter().max().unwrap();
        // the default plan (a group pass only with enough groups); forced group passes with the
        // planned and with short hints (the last chunks take the rest); no group pass at all
        let plans = [
            grouped_decode_plan(b, gsize, dims, prefix_len, max_suffix),
            grouped_decode_plan_for_blocks(b, gsize, dims, prefix_len, max_suffix, 264),
            grouped_decode_plan_for_blocks(
                b,
                gsize,
                dims,
                prefix_len / 3 + 1,
                max_suffix / 4 + 1,
                264,
            ),
            grouped_decode_plan(b, gsize, dims, 0, prefix_len + max_suffix),
        ];
        // each cut in both tile forms (32-key tiles through 4 stages, 64 through 2)
        for plan in plans
            .into_iter()
            .flat_map(|p| [p, GroupedDecodePlan { wide: !p.wide, ..p }])
        {
            let label = format!("{dims:?} B{b} G{gsize} prefix {prefix_len} {plan:?}");
            grouped_against_cpu(g, &s, &case, dims, plan, None, &label);
        }
        if prefix_len > 0 && gsize > 1 {
            // sample 1 names another prefix start than its group's first sample: NaN rows
            let mut bad = case.gseqs.clone();
            bad[1].p_start += 1;
            let dbad = up(&s, &bad);
            let plan = grouped_decode_plan_for_blocks(b, gsize, dims, prefix_len, max_suffix, 264);
            assert!(plan.p_splits > 0);
            let mut ws = poison_f32(&s, plan.workspace_len());
            let mut dout = poison_bf(&s, b * dims.q_width());
            attention_decode_grouped_bf16(
                g,
                &s,
                &mut dout,
                None,
                &mut ws,
                case.inputs(dims, &dbad),
                plan,
                None,
            )
            .unwrap();
            let got = to_f32(&down(&s, &dout));
            let qw = dims.q_width();
            assert!(
                got[qw..2 * qw].iter().all(|v| v.is_nan()),
                "mismatched prefix not flagged"
            );
            check(
                "attention_decode_grouped_bf16 sample 0 beside a mismatched one",
                &got[..qw],
                &case.want[..qw],
                1e-2,
            );
        }
    }
}

/// Group-shared decode over a group table (a batch compacted sample by sample): groups of 0-8
/// samples, empty groups inside and at the end (the table padded to the plan's group count),
/// against `cpu::attention_decode`; a group wider than one block's samples (head_dim 64, 12:1);
/// a table too short for the plan is refused.
#[test]
fn attention_decode_grouped_over_a_group_table_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let sizes = [3usize, 8, 1, 0, 5, 8, 2, 7, 0, 4, 8, 8, 6, 1, 8, 0, 0];
    for (dims, prefix_len) in [
        (d(16, 2, 128), 700usize),
        (d(28, 4, 128), 1500),
        (d(12, 1, 64), 200),
    ] {
        let case = grouped_decode_case_sized(&s, dims, &sizes, prefix_len);
        let b = case.b;
        let max_suffix = *case.suffix_lens.iter().max().unwrap();
        let table = up(&s, &case.starts);
        let plan = grouped_decode_plan_tabled(b, 8, sizes.len(), dims, prefix_len, max_suffix);
        assert!(plan.p_splits > 0, "{plan:?}: the group pass runs");
        assert_eq!(plan.groups, sizes.len());
        for plan in [
            plan,
            GroupedDecodePlan {
                wide: !plan.wide,
                ..plan
            },
        ] {
            let label =
                format!("tabled {dims:?} B{b} groups {sizes:?} prefix {prefix_len} {plan:?}");
            grouped_against_cpu(g, &s, &case, dims, plan, Some(&table), &label);
        }
        let mut dout = poison_bf(&s, b * dims.q_width());
        let short = up(&s, &case.starts[..sizes.len()]);
        let mut ws = poison_f32(&s, plan.workspace_len());
        assert!(attention_decode_grouped_bf16(
            g,
            &s,
            &mut dout,
            None,
            &mut ws,
            case.inputs(dims, &case.seqs),
            plan,
            Some(&short),
        )
        .is_err());
    }
}

/// `attention_decode_bf16` under both tensor-core kernels (block-pipelined, the default plan;
/// warp-split, the older one) against `cpu::attention_decode`, and the pipelined one twice for
/// the same bits.
#[test]
fn attention_decode_pipelined_and_warp_split_match_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for (dims, b, len) in [
        (
            AttnDims {
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 128,
            },
            12usize,
            1000usize,
        ),
        (
            AttnDims {
                num_heads: 28,
                num_kv_heads: 4,
                head_dim: 128,
            },
            3,
            2100,
        ),
    ] {
        let kvw = dims.kv_width();
        let mut seqs = Vec::new();
        let mut rows = 0usize;
        for i in 0..b {
            let l = len - 37 * i;
            seqs.push(DecodeSeq {
                prefix_offset: rows as u32,
                prefix_len: (l / 2) as u32,
                suffix_offset: (rows + l / 2 + 5) as u32,
                suffix_len: (l - l / 2) as u32,
            });
            rows += l + 5;
        }
        let (kc, kcf) = rand_bf(rows * kvw, 1.0);
        let (vc, vcf) = rand_bf(rows * kvw, 1.0);
        let (q, qf) = rand_bf(b * dims.q_width(), 1.0);
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let mut want = vec![0f32; b * dims.q_width()];
        cpu::attention_decode(&mut want, None, &qf, &kcf, &vcf, &seqs, dims, scale).unwrap();
        let gseqs: Vec<AttnSeqGpu> = seqs
            .iter()
            .enumerate()
            .map(|(i, sq)| AttnSeqGpu::from_decode(i as u32, sq))
            .collect();
        let (dq, dk, dv, ds) = (up(&s, &q), up(&s, &kc), up(&s, &vc), up(&s, &gseqs));
        let mut first = None;
        for (pipelined, rep) in [(true, 0), (true, 1), (false, 0)] {
            let plan = DecodePlan {
                pipelined,
                ..decode_plan(b, dims, len)
            };
            let mut ws = poison_f32(&s, plan.workspace_len());
            let mut dout = poison_bf(&s, b * dims.q_width());
            attention_decode_bf16(
                g,
                &s,
                &mut dout,
                None,
                &mut ws,
                DecodeInputs {
                    q: &dq,
                    k_cache: &dk,
                    v_cache: &dv,
                    seqs: &ds,
                    dims,
                    scale,
                    strides: RowStrides::contiguous(dims),
                },
                plan,
            )
            .unwrap();
            let got = down(&s, &dout);
            check(
                &format!("attention_decode_bf16 {dims:?} B{b} {plan:?}"),
                &to_f32(&got),
                &want,
                1e-2,
            );
            if pipelined && rep == 0 {
                first = Some(got);
            } else if pipelined {
                assert_eq!(first.as_ref(), Some(&got), "same plan, same bits");
            }
        }
    }
}

/// The dispatching entry points: `linear_fwd_bf16` (skinny where `skinny_pays`, cuBLASLt
/// elsewhere) and `gate_up_swiglu_bf16` (fused where skinny) against the CPU twins and the
/// cuBLASLt path.
#[test]
fn dispatching_linear_and_gate_up_match_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, n) in &[
        (1usize, 2048usize, 2560usize),
        (8, 1024, 768),
        (9, 512, 640),
        (64, 256, 512),
        (48, 256, 2048),
        (64, 2048, 256),
        (128, 2048, 2560),
        (200, 256, 512),
    ] {
        let (x, xf) = rand_bf(m * k, 1.0);
        let (w, wf) = rand_bf(n * k, 0.05);
        let (b, bfv) = rand_bf(n, 1.0);
        let mut want = vec![0f32; m * n];
        cpu::linear_fwd(&mut want, &xf, &wf, Some(&bfv), m, k, n).unwrap();
        let (dx, dw, db) = (up(&s, &x), up(&s, &w), up(&s, &b));
        let bias = Some(&db as &dyn cudarc::driver::DevicePtr<bf16>);
        let mut dy = poison_bf(&s, m * n);
        linear_fwd_bf16(g, &s, &mut dy, &dx, &dw, bias, m, k, n).unwrap();
        check(
            &format!("linear_fwd_bf16 m{m}"),
            &to_f32(&down(&s, &dy)),
            &want,
            8e-3,
        );
        let mut dy = poison_bf(&s, m * n);
        linear_fwd_bf16_cublaslt(g, &s, &mut dy, &dx, &dw, bias, m, k, n).unwrap();
        check(
            &format!("linear_fwd_bf16_cublaslt m{m}"),
            &to_f32(&down(&s, &dy)),
            &want,
            8e-3,
        );
        // gate|up: w as [2f, k] with f = n / 2
        let f = n / 2;
        let mut gu = vec![0f32; m * n];
        cpu::linear_fwd(&mut gu, &xf, &wf, None, m, k, n).unwrap();
        let (mut gate, mut upv) = (Vec::new(), Vec::new());
        for r in 0..m {
            gate.extend_from_slice(&gu[r * n..r * n + f]);
            upv.extend_from_slice(&gu[r * n + f..(r + 1) * n]);
        }
        let mut want_act = vec![0f32; m * f];
        cpu::swiglu_fwd(&mut want_act, &gate, &upv).unwrap();
        let mut act = poison_bf(&s, m * f);
        let mut scratch = poison_bf(&s, m * n);
        gate_up_swiglu_bf16(g, &s, &mut act, &mut scratch, &dx, &dw, m, k, f).unwrap();
        check(
            &format!("gate_up_swiglu_bf16 m{m}"),
            &to_f32(&down(&s, &act)),
            &want_act,
            1e-2,
        );
    }
}
