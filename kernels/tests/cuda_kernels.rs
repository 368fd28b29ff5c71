//! GPU tests: every CUDA kernel against its CPU twin on fresh random inputs (bf16 tolerance by
//! ‖out − ref‖ / ‖ref‖; outputs poisoned with NaN first, so an unwritten element fails), plus the
//! properties the runtime relies on: bitwise equality across streams and SM partitions, event
//! ordering across partitions, CUDA-graph replay. Each test prints "skipped: no CUDA device" and
//! passes where no GPU or driver is present (CI).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq, DecodeSeq, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::green::Priority;
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
use rollplex_kernels::cuda::sampling::philox_fill;
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

#[test]
fn gemm_matches_cpu_all_transposes() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, n) in &[(37, 200, 72), (8, 512, 1536), (256, 1024, 384)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for acc in [false, true] {
                let gm = Gemm {
                    m,
                    k,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                    accumulate: acc,
                };
                let (a, af) = rand_bf(m * k, 1.0);
                let (b, bf) = rand_bf(k * n, 1.0);
                let (c0, c0f) = rand_bf(m * n, 1.0);
                let mut want = if acc { c0f.clone() } else { vec![0f32; m * n] };
                cpu::matmul(&mut want, &af, &bf, gm).unwrap();
                let (da, db) = (up(&s, &a), up(&s, &b));
                // the classic cuBLAS path exists for timing (feature `bench`)
                let apis: &[bool] = if cfg!(feature = "bench") {
                    &[true, false]
                } else {
                    &[true]
                };
                for &lt in apis {
                    let mut dc = if acc {
                        up(&s, &c0)
                    } else {
                        poison_bf(&s, m * n)
                    };
                    if lt {
                        matmul_bf16(g, &s, &mut dc, &da, &db, gm).unwrap();
                    } else {
                        #[cfg(feature = "bench")]
                        matmul_bf16_cublas(g, &s, &mut dc, &da, &db, gm).unwrap();
                    }
                    let got = to_f32(&down(&s, &dc));
                    let api = if lt { "cublasLt" } else { "cublas" };
                    check(&format!("matmul_bf16[{api}] {gm:?}"), &got, &want, 8e-3);
                }
            }
        }
    }
}

/// The fp32-output GEMM (weight gradients): against the CPU's fp32 product, summed onto an
/// fp32 `c` (tighter than bf16: the product is never rounded to bf16), the same bits on a
/// second run, and as the sum of two accumulations over halves of k within fp32 rounding.
#[test]
fn gemm_into_f32_matches_cpu_and_accumulates() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, n) in &[(37, 200, 72), (2048, 300, 512), (151, 1024, 96)] {
        for acc in [false, true] {
            let gm = Gemm {
                accumulate: acc,
                ..Gemm::tn(m, k, n)
            };
            let (a, af) = rand_bf(k * m, 1.0);
            let (b, bf) = rand_bf(k * n, 1.0);
            let c0: Vec<f32> = rand_bf(m * n, 4.0).1;
            let mut want = if acc { c0.clone() } else { vec![0f32; m * n] };
            cpu::matmul(&mut want, &af, &bf, gm).unwrap();
            let (da, db) = (up(&s, &a), up(&s, &b));
            let run = || {
                let mut dc = if acc {
                    up(&s, &c0)
                } else {
                    poison_f32(&s, m * n)
                };
                matmul_bf16_f32(g, &s, &mut dc, &da, &db, gm).unwrap();
                down(&s, &dc)
            };
            let got = run();
            check(&format!("matmul_bf16_f32 {gm:?}"), &got, &want, 1e-5);
            let again = run();
            assert!(
                got.iter()
                    .zip(&again)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "matmul_bf16_f32 {gm:?}: two runs differ"
            );
        }
    }
    let mut small = poison_f32(&s, 10);
    let (a, b) = (up(&s, &rand_bf(40, 1.0).0), up(&s, &rand_bf(40, 1.0).0));
    assert!(matmul_bf16_f32(g, &s, &mut small, &a, &b, Gemm::tn(4, 10, 4)).is_err());
}

#[test]
fn linear_fwd_with_bias_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(m, k, n) in &[(1, 64, 48), (64, 2048, 2560), (300, 1280, 3420)] {
        let (x, xf) = rand_bf(m * k, 1.0);
        let (w, wf) = rand_bf(n * k, 0.05);
        let (b, bfv) = rand_bf(n, 1.0);
        let mut want = vec![0f32; m * n];
        cpu::linear_fwd(&mut want, &xf, &wf, Some(&bfv), m, k, n).unwrap();
        let (dx, dw, db) = (up(&s, &x), up(&s, &w), up(&s, &b));
        let mut dy = poison_bf(&s, m * n);
        linear_fwd_bf16(g, &s, &mut dy, &dx, &dw, Some(&db), m, k, n).unwrap();
        check(
            &format!("linear_fwd_bf16 m{m} k{k} n{n}"),
            &to_f32(&down(&s, &dy)),
            &want,
            8e-3,
        );
    }
}

#[test]
fn rmsnorm_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(rows, d) in &[(1, 1), (7, 33), (64, 1280), (9, 3584)] {
        let (x, xf) = rand_bf(rows * d, 3.0);
        let (w, wf) = rand_bf(d, 1.0);
        let mut want = vec![0f32; rows * d];
        let mut want_r = vec![0f32; rows];
        cpu::rmsnorm_fwd(&mut want, Some(&mut want_r), &xf, &wf, rows, d, 1e-6).unwrap();
        let (dx, dw) = (up(&s, &x), up(&s, &w));
        let mut dy = poison_bf(&s, rows * d);
        let mut dr = poison_f32(&s, rows);
        let mut rv = dr.as_view_mut();
        rmsnorm_fwd_bf16(g, &s, &mut dy, Some(&mut rv), &dx, &dw, rows, d, 1e-6).unwrap();
        check(
            &format!("rmsnorm_fwd_bf16 {rows}x{d}"),
            &to_f32(&down(&s, &dy)),
            &want,
            8e-3,
        );
        check(
            &format!("rmsnorm_fwd_bf16 rstd {rows}x{d}"),
            &down(&s, &dr),
            &want_r,
            1e-5,
        );
    }
}

#[test]
fn rope_matches_cpu_on_a_fused_qkv_row() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // 5 tokens of a fused qkv row: 4 q heads + 2 k heads rotated, 2 v heads untouched.
    let (t, hq, hk, hd) = (5usize, 4usize, 2usize, 128usize);
    let width = (hq + 2 * hk) * hd;
    let (x, xf) = rand_bf(t * width, 2.0);
    let ang: Vec<f64> = rand_vec(t * hd, fresh_seed())
        .iter()
        .map(|v| *v as f64 * 40.0)
        .collect();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
    // CPU twin on the rotated part, rows compacted.
    let rot = (hq + hk) * hd;
    let mut part: Vec<f32> = (0..t)
        .flat_map(|i| xf[i * width..i * width + rot].to_vec())
        .collect();
    cpu::rope_fwd(&mut part, &cos, &sin, t, hq + hk, hd).unwrap();
    let mut want = xf.clone();
    for i in 0..t {
        want[i * width..i * width + rot].copy_from_slice(&part[i * rot..(i + 1) * rot]);
    }
    let (dc, ds) = (up(&s, &cos), up(&s, &sin));
    for hf in [false, true] {
        let mut dx = up(&s, &x);
        rope_fwd_bf16(g, &s, &mut dx, &dc, &ds, t, width, hq + hk, hd, hf).unwrap();
        let got = to_f32(&down(&s, &dx));
        check(
            &format!("rope_fwd_bf16 hf_text_rounding={hf}"),
            &got,
            &want,
            8e-3,
        );
        assert_eq!(
            &got[rot..width],
            &want[rot..width],
            "v heads must be untouched"
        );
    }
}

#[test]
fn pointwise_ops_match_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // swiglu on a fused [rows, 2F] gate|up buffer
    let (rows, f) = (33usize, 1000usize);
    let (gu, guf) = rand_bf(rows * 2 * f, 6.0);
    let gate: Vec<f32> = (0..rows)
        .flat_map(|r| guf[r * 2 * f..r * 2 * f + f].to_vec())
        .collect();
    let upv: Vec<f32> = (0..rows)
        .flat_map(|r| guf[r * 2 * f + f..(r + 1) * 2 * f].to_vec())
        .collect();
    let mut want = vec![0f32; rows * f];
    cpu::swiglu_fwd(&mut want, &gate, &upv).unwrap();
    let dgu = up(&s, &gu);
    let mut dout = poison_bf(&s, rows * f);
    swiglu_fwd_bf16(
        g,
        &s,
        &mut dout,
        &dgu,
        &dgu.slice(f..),
        rows,
        f,
        f,
        2 * f,
        2 * f,
    )
    .unwrap();
    check(
        "swiglu_fwd_bf16 fused",
        &to_f32(&down(&s, &dout)),
        &want,
        8e-3,
    );

    // gelu (exact)
    let n = 10_007;
    let (x, xf) = rand_bf(n, 5.0);
    let mut want = vec![0f32; n];
    cpu::gelu_fwd(&mut want, &xf).unwrap();
    let dx = up(&s, &x);
    let mut dy = poison_bf(&s, n);
    gelu_fwd_bf16(g, &s, &mut dy, &dx, n, false).unwrap();
    check("gelu_fwd_bf16", &to_f32(&down(&s, &dy)), &want, 8e-3);

    // add, out of place (vector path) and in place (odd length: scalar path)
    for n in [4096usize, 1001] {
        let (a, af) = rand_bf(n, 1.0);
        let (b, bfv) = rand_bf(n, 1.0);
        let mut want = af.clone();
        cpu::add_fwd(&mut want, &bfv).unwrap();
        let (da, db) = (up(&s, &a), up(&s, &b));
        let mut dy = poison_bf(&s, n);
        add_fwd_bf16(g, &s, &mut dy, &da, &db, n).unwrap();
        check(
            &format!("add_fwd_bf16 n{n}"),
            &to_f32(&down(&s, &dy)),
            &want,
            8e-3,
        );
        let mut dacc = up(&s, &a);
        add_fwd_bf16_inplace(g, &s, &mut dacc, &db, n).unwrap();
        check(
            &format!("add_fwd_bf16 in place n{n}"),
            &to_f32(&down(&s, &dacc)),
            &want,
            8e-3,
        );
    }

    // embedding gather (exact), with one id out of range -> NaN row
    let (vocab, d, t) = (500usize, 136usize, 40usize);
    let (table, tf) = rand_bf(vocab * d, 1.0);
    let ids: Vec<u32> = rand_vec(t, fresh_seed())
        .iter()
        .map(|v| ((v + 1.0) * 0.5 * vocab as f32) as u32 % vocab as u32)
        .collect();
    let mut want = vec![0f32; t * d];
    cpu::embedding_fwd(&mut want, &tf, &ids, d).unwrap();
    let (dt, di) = (up(&s, &table), up(&s, &ids));
    let mut dout = poison_bf(&s, t * d);
    embedding_fwd_bf16(g, &s, &mut dout, &dt, &di, t, d, d).unwrap();
    assert_eq!(
        to_f32(&down(&s, &dout)),
        want,
        "embedding_fwd_bf16 must copy exactly"
    );
    let mut bad = ids.clone();
    bad[3] = vocab as u32;
    let dbad = up(&s, &bad);
    embedding_fwd_bf16(g, &s, &mut dout, &dt, &dbad, t, d, d).unwrap();
    let got = to_f32(&down(&s, &dout));
    assert!(
        got[3 * d..4 * d].iter().all(|v| v.is_nan()),
        "an id past the vocabulary gives a NaN row"
    );
    assert!(got[..3 * d].iter().all(|v| v.is_finite()));
    println!("embedding_fwd_bf16: exact; bad id -> NaN row");

    // kv append: rows of a fused qkv output into scattered cache slots
    let (tok, w, stride, slots_n) = (6usize, 256usize, 768usize, 50usize);
    let (src, srcf) = rand_bf(tok * stride, 1.0);
    let slots: Vec<u32> = vec![7, 0, 49, 13, 22, 31];
    let dsrc = up(&s, &src);
    let dsl = up(&s, &slots);
    let mut cache = poison_bf(&s, slots_n * w);
    kv_append_bf16(
        g,
        &s,
        &mut cache,
        &dsrc.slice(256..),
        &dsl,
        tok,
        w,
        stride,
        w,
    )
    .unwrap();
    let got = to_f32(&down(&s, &cache));
    for (t_, &sl) in slots.iter().enumerate() {
        let sl = sl as usize;
        assert_eq!(
            &got[sl * w..(sl + 1) * w],
            &srcf[t_ * stride + 256..t_ * stride + 256 + w]
        );
    }
    println!("kv_append_bf16: exact");
}

struct AttnCase {
    dims: AttnDims,
    lens: Vec<u32>,
    prefix: Vec<(u32, u32)>, // (start, len) into the prefix arena per sequence
    p_rows: usize,
    mask: AttnMask,
}

fn run_attention_fwd(g: &Gpu, s: &Arc<CudaStream>, c: &AttnCase, label: &str) {
    let d = c.dims;
    let t: usize = c.lens.iter().map(|&l| l as usize).sum();
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let (q, qf) = rand_bf(t * qw, 1.0);
    let (k, kf) = rand_bf(t * kvw, 1.0);
    let (v, vf) = rand_bf(t * kvw, 1.0);
    let pr = c.p_rows.max(1);
    let (pk, pkf) = rand_bf(pr * kvw, 1.0);
    let (pv, pvf) = rand_bf(pr * kvw, 1.0);
    let mut seqs = Vec::new();
    let mut start = 0u32;
    for (i, &l) in c.lens.iter().enumerate() {
        let (ps, pl) = c.prefix.get(i).copied().unwrap_or((0, 0));
        seqs.push(AttnSeq {
            start,
            len: l,
            prefix_start: ps,
            prefix_len: pl,
        });
        start += l;
    }
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let mut want = vec![0f32; t * qw];
    let mut want_lse = vec![0f32; t * d.num_heads];
    let (pkf_, pvf_) = if c.p_rows == 0 {
        (&[][..], &[][..])
    } else {
        (&pkf[..], &pvf[..])
    };
    cpu::attention_fwd(
        &mut want,
        Some(&mut want_lse),
        &qf,
        &kf,
        &vf,
        pkf_,
        pvf_,
        &seqs,
        d,
        c.mask,
        scale,
    )
    .unwrap();
    let gseqs: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
    let (dq, dk, dv, dpk, dpv, ds) = (
        up(s, &q),
        up(s, &k),
        up(s, &v),
        up(s, &pk),
        up(s, &pv),
        up(s, &gseqs),
    );
    let mut dout = poison_bf(s, t * qw);
    let mut dlse = poison_f32(s, t * d.num_heads);
    let max_q = *c.lens.iter().max().unwrap() as usize;
    let mut lv = dlse.as_view_mut();
    attention_fwd_bf16(
        g,
        s,
        &mut dout,
        Some(&mut lv),
        FwdInputs {
            q: &dq,
            k: &dk,
            v: &dv,
            prefix_k: &dpk,
            prefix_v: &dpv,
            seqs: &ds,
            n_seqs: seqs.len(),
            max_q_len: max_q,
            dims: d,
            mask: c.mask,
            scale,
            strides: RowStrides::contiguous(d),
        },
    )
    .unwrap();
    check(
        &format!("attention_fwd_bf16 {label}"),
        &to_f32(&down(s, &dout)),
        &want,
        1e-2,
    );
    check(
        &format!("attention_fwd_bf16 lse {label}"),
        &down(s, &dlse),
        &want_lse,
        1e-4,
    );
    // A grid smaller than the longest sequence still covers every query (tile loop).
    let mut dout2 = poison_bf(s, t * qw);
    attention_fwd_bf16(
        g,
        s,
        &mut dout2,
        None,
        FwdInputs {
            q: &dq,
            k: &dk,
            v: &dv,
            prefix_k: &dpk,
            prefix_v: &dpv,
            seqs: &ds,
            n_seqs: seqs.len(),
            max_q_len: 16,
            dims: d,
            mask: c.mask,
            scale,
            strides: RowStrides::contiguous(d),
        },
    )
    .unwrap();
    assert_eq!(
        down(s, &dout2),
        down(s, &dout),
        "{label}: the grid-size hint must not change the result"
    );
}

#[test]
fn attention_fwd_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let text = AttnDims {
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
    };
    run_attention_fwd(
        g,
        &s,
        &AttnCase {
            dims: text,
            lens: vec![1, 77, 200, 64],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
        },
        "causal GQA 8/2 varlen",
    );
    run_attention_fwd(
        g,
        &s,
        &AttnCase {
            dims: AttnDims {
                num_heads: 7,
                num_kv_heads: 1,
                head_dim: 128,
            },
            lens: vec![33, 5, 130],
            prefix: vec![(0, 300), (0, 300), (300, 17)],
            p_rows: 317,
            mask: AttnMask::Causal,
        },
        "causal GQA 7/1 shared prefix",
    );
    run_attention_fwd(
        g,
        &s,
        &AttnCase {
            dims: AttnDims {
                num_heads: 16,
                num_kv_heads: 16,
                head_dim: 80,
            },
            lens: vec![64, 64, 100, 3],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Full,
        },
        "full (vision windows) hd 80",
    );
}

/// The SIMT decode kernel is kept for timing only (feature `bench`).
#[cfg(feature = "bench")]
#[test]
fn attention_decode_simt_matches_cpu_with_shared_prefix() {
    decode_case(false);
}

#[test]
fn attention_decode_tensor_cores_matches_cpu_with_shared_prefix() {
    decode_case(true);
}

/// Decode attention of both kernels against the CPU twin: GRPO groups sharing a prefix, random
/// suffix lengths, gaps in the arena, GQA 8:1 and 7:1 and 12:1 (two head groups).
fn decode_case(tensor_cores: bool) {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for (dims, groups, gsize, prefix_len) in [
        (
            AttnDims {
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 128,
            },
            3usize,
            4usize,
            700usize,
        ),
        (
            AttnDims {
                num_heads: 28,
                num_kv_heads: 4,
                head_dim: 128,
            },
            2,
            8,
            1500,
        ),
        (
            AttnDims {
                num_heads: 12,
                num_kv_heads: 1,
                head_dim: 64,
            },
            1,
            5,
            0,
        ),
    ] {
        let b = groups * gsize;
        let kvw = dims.kv_width();
        // arena: group prefixes, then per-sample suffixes of random length
        let suffix_lens: Vec<usize> = rand_vec(b, fresh_seed())
            .iter()
            .map(|v| 1 + ((v + 1.0) * 150.0) as usize)
            .collect();
        let mut rows = groups * prefix_len;
        let mut seqs = Vec::new();
        for (i, &suffix_len) in suffix_lens.iter().enumerate() {
            seqs.push(DecodeSeq {
                prefix_offset: ((i / gsize) * prefix_len) as u32,
                prefix_len: prefix_len as u32,
                suffix_offset: rows as u32,
                suffix_len: suffix_len as u32,
            });
            rows += suffix_len + 3; // gaps between suffixes
        }
        let (kc, kcf) = rand_bf(rows * kvw, 1.0);
        let (vc, vcf) = rand_bf(rows * kvw, 1.0);
        let (q, qf) = rand_bf(b * dims.q_width(), 1.0);
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let mut want = vec![0f32; b * dims.q_width()];
        let mut want_lse = vec![0f32; b * dims.num_heads];
        cpu::attention_decode(
            &mut want,
            Some(&mut want_lse),
            &qf,
            &kcf,
            &vcf,
            &seqs,
            dims,
            scale,
        )
        .unwrap();
        let gseqs: Vec<AttnSeqGpu> = seqs
            .iter()
            .enumerate()
            .map(|(i, sq)| AttnSeqGpu::from_decode(i as u32, sq))
            .collect();
        let (dq, dk, dv, ds) = (up(&s, &q), up(&s, &kc), up(&s, &vc), up(&s, &gseqs));
        let max_len = prefix_len + suffix_lens.iter().max().unwrap();
        let mut results = Vec::new();
        // the planned split, and a plan made for a shorter length (the last split takes the rest)
        for (hint, tc) in [(max_len, tensor_cores), (max_len / 3 + 1, tensor_cores)] {
            let plan = decode_plan(b, dims, hint);
            #[cfg(feature = "bench")]
            let plan = DecodePlan {
                tensor_cores: tc,
                ..plan
            };
            assert_eq!(plan.uses_tensor_cores(), tc);
            let mut ws = poison_f32(&s, plan.workspace_len());
            let mut dout = poison_bf(&s, b * dims.q_width());
            let mut dlse = poison_f32(&s, b * dims.num_heads);
            let mut lv = dlse.as_view_mut();
            attention_decode_bf16(
                g,
                &s,
                &mut dout,
                Some(&mut lv),
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
            let label = format!(
                "{dims:?} B{b} prefix {prefix_len} splits {} chunk {} tensor_cores {tc}",
                plan.splits, plan.chunk
            );
            let got = to_f32(&down(&s, &dout));
            check(&format!("attention_decode_bf16 {label}"), &got, &want, 1e-2);
            check(
                &format!("attention_decode_bf16 lse {label}"),
                &down(&s, &dlse),
                &want_lse,
                1e-4,
            );
            results.push(got);
        }
    }
}

#[test]
fn logprobs_match_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(rows, vocab, temp) in &[
        (5usize, 151_936usize, 1.0f32),
        (9, 1001, 0.7),
        (3, 152_064, 1.3),
    ] {
        let (x, xf) = rand_bf(rows * vocab, 8.0);
        let targets: Vec<u32> = rand_vec(rows, fresh_seed())
            .iter()
            .map(|v| ((v + 1.0) * 0.5 * vocab as f32) as u32 % vocab as u32)
            .collect();
        let (mut lp, mut ent, mut lse) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
        cpu::logprobs_fwd(
            &mut lp,
            Some(&mut ent),
            Some(&mut lse),
            &xf,
            &targets,
            rows,
            vocab,
            temp,
        )
        .unwrap();
        let (dx, dt) = (up(&s, &x), up(&s, &targets));
        let (mut dlp, mut dent, mut dlse) = (
            poison_f32(&s, rows),
            poison_f32(&s, rows),
            poison_f32(&s, rows),
        );
        let (mut ev, mut lv) = (dent.as_view_mut(), dlse.as_view_mut());
        logprobs_fwd_bf16(
            g,
            &s,
            &mut dlp,
            Some(&mut ev),
            Some(&mut lv),
            &dx,
            &dt,
            rows,
            vocab,
            vocab,
            temp,
        )
        .unwrap();
        let label = format!("{rows}x{vocab} T={temp}");
        check(
            &format!("logprobs_fwd_bf16 logp {label}"),
            &down(&s, &dlp),
            &lp,
            1e-5,
        );
        check(
            &format!("logprobs_fwd_bf16 entropy {label}"),
            &down(&s, &dent),
            &ent,
            1e-4,
        );
        check(
            &format!("logprobs_fwd_bf16 lse {label}"),
            &down(&s, &dlse),
            &lse,
            1e-6,
        );
    }
}

#[test]
fn philox_matches_host() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let n = 4096;
    let (c, key) = ([3u32, 77, 0xdead_beef], [0x1234_5678u32, 0x9abc_def0]);
    let mut d = up(&s, &vec![0u32; 4 * n]);
    philox_fill(g, &s, &mut d, n, c, key).unwrap();
    let got = down(&s, &d);
    for i in 0..n {
        assert_eq!(
            &got[4 * i..4 * i + 4],
            &philox4x32_10([i as u32, c[0], c[1], c[2]], key)[..],
            "block {i}"
        );
    }
    println!("philox_fill: {n} blocks bitwise equal to the host");
}

#[test]
fn sampling_matches_cpu_twin() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let rows = 64usize;
    // (vocab, params): the draw without top-k / top-p (one pass over the row) at temperature 1
    // and not, with an odd vocabulary (rows not 8-byte aligned) too; then top-k and top-p
    let settings = [
        SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            iteration: 0,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 3,
        },
        SampleParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 4,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 5,
        },
        SampleParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 1,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: fresh_seed(),
            iteration: 2,
        },
        SampleParams {
            temperature: 1.2,
            top_k: 1000,
            top_p: 0.5,
            seed: fresh_seed(),
            iteration: 9,
        },
    ];
    for (n, p) in settings.into_iter().enumerate() {
        let vocab = if n == 3 { 1_001 } else { 151_936 };
        let (x, _) = rand_bf(rows * vocab, 6.0);
        let sample_ids: Vec<u32> = (0..rows as u32).map(|r| r * 3 + 1).collect();
        let steps: Vec<u32> = (0..rows as u32).map(|r| 100 + r % 7).collect();
        let (dx, dsid, dst) = (up(&s, &x), up(&s, &sample_ids), up(&s, &steps));
        let mut dtok = up(&s, &vec![u32::MAX; rows]);
        sample_bf16(g, &s, &mut dtok, &dx, &dsid, &dst, rows, vocab, vocab, &p).unwrap();
        let got = down(&s, &dtok);
        let mut same = 0;
        for r in 0..rows {
            let want = sample_ref(&x[r * vocab..(r + 1) * vocab], &p, sample_ids[r], steps[r]);
            assert!(
                (got[r] as usize) < vocab,
                "row {r}: token {} out of range",
                got[r]
            );
            same += (want == got[r]) as usize;
        }
        println!("sample_bf16 {p:?}: {same}/{rows} rows pick the CPU twin's token");
        assert!(
            same + 1 >= rows,
            "at most one rounding-level disagreement allowed, got {}",
            rows - same
        );
    }
}

/// The CPU rule of runtime/src/train/adamw.rs, mirrored op for op.
fn adamw_cpu(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    decay: bool,
    s: &AdamWScalars,
) {
    for i in 0..p.len() {
        if decay {
            p[i] *= s.decay_mul;
        }
        m[i] = if s.w1.abs() < 0.5 {
            m[i] + s.w1 * (g[i] - m[i])
        } else {
            g[i] - (g[i] - m[i]) * (1.0 - s.w1)
        };
        v[i] = v[i] * s.b2 + s.one_minus_b2 * g[i] * g[i];
        let denom = v[i].sqrt() / s.bc2_sqrt + s.eps;
        p[i] += s.neg_step_size * m[i] / denom;
    }
}

#[test]
fn adamw_is_bitwise_the_cpu_rule() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let n = 100_003;
    let mut p = rand_vec(n, fresh_seed());
    let mut m: Vec<f32> = rand_vec(n, fresh_seed()).iter().map(|x| x * 0.01).collect();
    let mut v: Vec<f32> = rand_vec(n, fresh_seed())
        .iter()
        .map(|x| x * x * 1e-4)
        .collect();
    let (dp, dm, dv) = (up(&s, &p), up(&s, &m), up(&s, &v));
    let (mut dp, mut dm, mut dv) = (dp, dm, dv);
    let mut dout = poison_bf(&s, n);
    for step in 1..=3u64 {
        let gr: Vec<f32> = rand_vec(n, fresh_seed()).iter().map(|x| x * 0.1).collect();
        let sc = AdamWScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.01, step);
        let decay = step != 2;
        adamw_cpu(&mut p, &mut m, &mut v, &gr, decay, &sc);
        let dg = up(&s, &gr);
        let mut ov = dout.as_view_mut();
        adamw_step_f32(
            g,
            &s,
            &mut dp,
            &mut dm,
            &mut dv,
            Some(&mut ov),
            &dg,
            n,
            decay,
            sc,
        )
        .unwrap();
    }
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&down(&s, &dp)),
        bits(&p),
        "master weights differ from the CPU rule"
    );
    assert_eq!(bits(&down(&s, &dm)), bits(&m), "first moments differ");
    assert_eq!(bits(&down(&s, &dv)), bits(&v), "second moments differ");
    let want_bf: Vec<bf16> = p.iter().map(|x| bf16::from_f32(*x)).collect();
    assert_eq!(down(&s, &dout), want_bf, "bf16 copy differs");
    println!("adamw_step_f32: 3 steps over {n} elements bitwise equal to the CPU rule");
}

#[test]
fn green_partitions_give_identical_bits_and_events_order_them() {
    let g = gpu_or_skip!();
    let set = StreamSet::new(g).unwrap();
    let rest = g.sm_count() - set.granted(40, Priority::High).unwrap();
    println!(
        "StreamSet: green {}, layout {:?}, warning {:?}, driver {}",
        set.green(),
        set.layout(),
        set.warning(),
        rollplex_kernels::cuda::green::driver_version().unwrap()
    );
    let full = g.stream(0).unwrap();
    let (a, b) = (
        set.partition(40, Priority::High).unwrap(),
        set.partition(rest, Priority::Normal).unwrap(),
    );
    let (a_s, b_s) = (&a, &b);
    for st in [&full, a_s, b_s] {
        g.prepare_stream(st).unwrap();
    }
    // GEMM: same bits on the full GPU, on 40 SMs and on the rest.
    let (m, k, n) = (512usize, 4096usize, 4096usize);
    let (x, _) = rand_bf(m * k, 1.0);
    let (w, _) = rand_bf(n * k, 0.05);
    let (dx, dw) = (up(&full, &x), up(&full, &w));
    let mut outs = Vec::new();
    for st in [&full, a_s, b_s] {
        let mut dy = poison_bf(&full, m * n);
        full.synchronize().unwrap();
        linear_fwd_bf16(g, st, &mut dy, &dx, &dw, None, m, k, n).unwrap();
        st.synchronize().unwrap();
        outs.push(down(&full, &dy));
    }
    assert_eq!(
        outs[0], outs[1],
        "GEMM bits differ between the full GPU and a 40-SM partition"
    );
    assert_eq!(
        outs[0], outs[2],
        "GEMM bits differ between the full GPU and the remainder partition"
    );
    // Decode attention: same bits on the full GPU and on a partition.
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let (b, len) = (16usize, 1000usize);
    let (kc, _) = rand_bf(b * len * dims.kv_width(), 1.0);
    let (vc, _) = rand_bf(b * len * dims.kv_width(), 1.0);
    let (q, _) = rand_bf(b * dims.q_width(), 1.0);
    let seqs: Vec<AttnSeqGpu> = (0..b)
        .map(|i| {
            AttnSeqGpu::from_decode(
                i as u32,
                &DecodeSeq {
                    prefix_offset: 0,
                    prefix_len: 0,
                    suffix_offset: (i * len) as u32,
                    suffix_len: len as u32,
                },
            )
        })
        .collect();
    let (dk, dv, dq, ds) = (
        up(&full, &kc),
        up(&full, &vc),
        up(&full, &q),
        up(&full, &seqs),
    );
    // Both decode kernels: the same bits on the whole GPU and on a partition.
    // (the SIMT kernel only with the feature `bench`, which keeps it for timing)
    let kernels: &[bool] = if cfg!(feature = "bench") {
        &[false, true]
    } else {
        &[true]
    };
    for &tc in kernels {
        let plan = decode_plan(b, dims, len);
        #[cfg(feature = "bench")]
        let plan = DecodePlan {
            tensor_cores: tc,
            ..plan
        };
        let mut att = Vec::new();
        for st in [&full, a_s] {
            let mut ws = poison_f32(&full, plan.workspace_len());
            let mut o = poison_bf(&full, b * dims.q_width());
            full.synchronize().unwrap();
            let strides = RowStrides::contiguous(dims);
            attention_decode_bf16(
                g,
                st,
                &mut o,
                None,
                &mut ws,
                DecodeInputs {
                    q: &dq,
                    k_cache: &dk,
                    v_cache: &dv,
                    seqs: &ds,
                    dims,
                    scale: 0.088,
                    strides,
                },
                plan,
            )
            .unwrap();
            st.synchronize().unwrap();
            att.push(down(&full, &o));
        }
        assert_eq!(
            att[0], att[1],
            "decode attention (tensor_cores {tc}) bits differ between streams"
        );
    }
    // Events: a GEMM on partition A, then a copy on partition B that waits on A's event.
    let mut y = poison_bf(&full, m * n);
    let zero = up(&full, &vec![bf16::ZERO; m * n]);
    let mut z = poison_bf(&full, m * n);
    full.synchronize().unwrap();
    let ev = g.event().unwrap();
    for _ in 0..3 {
        linear_fwd_bf16(g, a_s, &mut y, &dx, &dw, None, m, k, n).unwrap();
    }
    ev.record(a_s).unwrap();
    b_s.wait(&ev).unwrap();
    add_fwd_bf16(g, b_s, &mut z, &y, &zero, m * n).unwrap();
    b_s.synchronize().unwrap();
    a_s.synchronize().unwrap();
    assert_eq!(
        down(&full, &z),
        outs[0],
        "partition B ran before partition A's event"
    );
    println!(
        "green partitions: GEMM and decode bits identical across partitions; event ordering holds"
    );
}

#[test]
fn graph_capture_replays_a_layer_slice() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    g.prepare_stream(&s).unwrap();
    let (m, k, n) = (64usize, 2048usize, 2560usize);
    let (x, _) = rand_bf(m * k, 2.0);
    let (w, _) = rand_bf(n * k, 0.05);
    let (nw, _) = rand_bf(k, 1.0);
    let (dx, dw, dnw) = (up(&s, &x), up(&s, &w), up(&s, &nw));
    let mut h = poison_bf(&s, m * k);
    let mut y = poison_bf(&s, m * n);
    // eager
    rmsnorm_fwd_bf16(g, &s, &mut h, None, &dx, &dnw, m, k, 1e-6).unwrap();
    linear_fwd_bf16(g, &s, &mut y, &h, &dw, None, m, k, n).unwrap();
    let eager = down(&s, &y);
    // captured
    let mut y2 = poison_bf(&s, m * n);
    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    rmsnorm_fwd_bf16(g, &s, &mut h, None, &dx, &dnw, m, k, 1e-6).unwrap();
    linear_fwd_bf16(g, &s, &mut y2, &h, &dw, None, m, k, n).unwrap();
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    graph.launch().unwrap();
    graph.launch().unwrap();
    assert_eq!(
        down(&s, &y2),
        eager,
        "graph replay differs from eager launches"
    );
    println!("graph capture: rmsnorm + cuBLASLt GEMM replay bitwise equal to eager");
}

#[test]
fn fused_decode_ops_equal_their_parts() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // add_rmsnorm = add then rmsnorm, bitwise; and near the CPU twins.
    let (rows, d) = (64usize, 2048usize);
    let (h, hf) = rand_bf(rows * d, 2.0);
    let (dl, dlf) = rand_bf(rows * d, 2.0);
    let (w, wf) = rand_bf(d, 1.0);
    let (ddl, dw) = (up(&s, &dl), up(&s, &w));
    let mut h1 = up(&s, &h);
    let mut y1 = poison_bf(&s, rows * d);
    add_fwd_bf16_inplace(g, &s, &mut h1, &ddl, rows * d).unwrap();
    rmsnorm_fwd_bf16(g, &s, &mut y1, None, &h1, &dw, rows, d, 1e-6).unwrap();
    let mut h2 = up(&s, &h);
    let mut y2 = poison_bf(&s, rows * d);
    add_rmsnorm_fwd_bf16(g, &s, &mut y2, None, &mut h2, &ddl, &dw, rows, d, 1e-6).unwrap();
    assert_eq!(
        down(&s, &h2),
        down(&s, &h1),
        "add_rmsnorm: residual differs from add_fwd_bf16"
    );
    assert_eq!(
        down(&s, &y2),
        down(&s, &y1),
        "add_rmsnorm: output differs from rmsnorm_fwd_bf16"
    );
    let mut hsum = hf.clone();
    cpu::add_fwd(&mut hsum, &dlf).unwrap();
    let mut want = vec![0f32; rows * d];
    cpu::rmsnorm_fwd(&mut want, None, &hsum, &wf, rows, d, 1e-6).unwrap();
    check(
        "add_rmsnorm_fwd_bf16 vs CPU",
        &to_f32(&down(&s, &y2)),
        &want,
        8e-3,
    );

    // rope_kv_append = rope + two kv appends, bitwise.
    let (t, hq, hk, hd) = (16usize, 16usize, 2usize, 128usize);
    let row = (hq + 2 * hk) * hd;
    let kvw = hk * hd;
    let (x, _) = rand_bf(t * row, 2.0);
    let ang: Vec<f32> = rand_vec(t * hd, fresh_seed())
        .iter()
        .map(|v| v * 30.0)
        .collect();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
    let slots: Vec<u32> = (0..t as u32).map(|i| (i * 7) % 40).collect();
    let n_slots = 40;
    let (dc, ds, dsl) = (up(&s, &cos), up(&s, &sin), up(&s, &slots));
    let mut x1 = up(&s, &x);
    let (mut k1, mut v1) = (poison_bf(&s, n_slots * kvw), poison_bf(&s, n_slots * kvw));
    rope_fwd_bf16(g, &s, &mut x1, &dc, &ds, t, row, hq + hk, hd, true).unwrap();
    kv_append_bf16(g, &s, &mut k1, &x1.slice(hq * hd..), &dsl, t, kvw, row, kvw).unwrap();
    kv_append_bf16(
        g,
        &s,
        &mut v1,
        &x1.slice((hq + hk) * hd..),
        &dsl,
        t,
        kvw,
        row,
        kvw,
    )
    .unwrap();
    let mut x2 = up(&s, &x);
    let (mut k2, mut v2) = (poison_bf(&s, n_slots * kvw), poison_bf(&s, n_slots * kvw));
    rope_kv_append_bf16(
        g, &s, &mut x2, &mut k2, &mut v2, &dc, &ds, &dsl, t, hq, hk, hd, true,
    )
    .unwrap();
    let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(down(&s, &x2)),
        bits(down(&s, &x1)),
        "rope_kv_append: rotated rows differ"
    );
    assert_eq!(
        bits(down(&s, &k2)),
        bits(down(&s, &k1)),
        "rope_kv_append: k cache differs"
    );
    assert_eq!(
        bits(down(&s, &v2)),
        bits(down(&s, &v1)),
        "rope_kv_append: v cache differs"
    );
    println!("add_rmsnorm_fwd_bf16 and rope_kv_append_bf16: bitwise equal to their parts");
}

/// `decode_advance` against its CPU twin, bitwise: live rows that go on, stop on a stop id, stop
/// at max_new, stop at a forced length (drawing a stop id that must not stop them), and rows
/// already done (which only get the padding inputs); then `decode_gather_rows`.
#[test]
fn decode_advance_matches_its_twin() {
    let g = gpu_or_skip!();
    for keep_prefix in [false, true] {
        decode_advance_case(g, keep_prefix);
    }
}

fn decode_advance_case(g: &Gpu, keep_prefix: bool) {
    use rollplex_kernels::cuda::decode_loop::DecodeAdvanceRef;
    let s = g.stream(0).unwrap();
    let (n, samples, max_new, hd, table_rows) = (9usize, 12usize, 6usize, 8usize, 20usize);
    let stop_ids = [7u32, 3];
    let rows: Vec<DecodeRow> = (0..n)
        .map(|r| DecodeRow {
            sample: (r * 5 % samples) as u32,
            key: 100 + r as u32,
            prefix_offset: 10 * r as u32,
            prefix_len: 3 + r as u32,
            suffix_offset: 200 + 8 * r as u32,
            suffix_len: (r % 4) as u32,
            rope_row: (r % 5) as u32,
            forced: (r % 3 == 2) as u32,
            stop_len: if r % 3 == 2 { (r % 4) as u32 + 1 } else { 0 },
            done: (r == 4) as u32,
            step: (r % 4) as u32 + if r == 5 { 1 } else { 0 },
        })
        .collect();
    // row 0 draws a stop id; row 5 reaches max_new; forced rows 2 and 8 draw a stop id
    let tokens: Vec<u32> = (0..n as u32)
        .map(|r| match r {
            0 | 2 | 8 => 7,
            _ => 20 + r,
        })
        .collect();
    let mut rows = rows;
    rows[5].step = max_new as u32 - 1;
    let logprobs: Vec<f32> = (0..n).map(|r| -0.25 * r as f32).collect();
    let cos_t: Vec<f32> = (0..table_rows * hd)
        .map(|i| (i as f32 * 0.37).cos())
        .collect();
    let sin_t: Vec<f32> = (0..table_rows * hd)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    // host twin
    let mut h_rows = rows.clone();
    let (mut h_ot, mut h_ol, mut h_done) = (
        vec![u32::MAX; samples * max_new],
        vec![f32::NAN; samples * max_new],
        vec![u32::MAX; samples],
    );
    let (mut h_feed, mut h_cos, mut h_sin) = (
        vec![9u32; n],
        vec![f32::NAN; n * hd],
        vec![f32::NAN; n * hd],
    );
    let mut h_seqs = vec![AttnSeqGpu::default(); n];
    let (mut h_w, mut h_ids, mut h_steps) = (vec![1u32; n], vec![1u32; n], vec![1u32; n]);
    decode_advance_ref(DecodeAdvanceRef {
        rows: &mut h_rows,
        tokens: &tokens,
        logprobs: &logprobs,
        stop_ids: &stop_ids,
        max_new,
        keep_prefix,
        out_tokens: &mut h_ot,
        out_logprobs: &mut h_ol,
        done_step: &mut h_done,
        cos_table: &cos_t,
        sin_table: &sin_t,
        head_dim: hd,
        feed: &mut h_feed,
        cos: &mut h_cos,
        sin: &mut h_sin,
        seqs: &mut h_seqs,
        write_rows: &mut h_w,
        sample_ids: &mut h_ids,
        steps: &mut h_steps,
    });
    // device, outputs poisoned the same way
    let mut d_rows = s.clone_htod(&rows).unwrap();
    let (d_tok, d_lp, d_stop) = (
        s.clone_htod(&tokens).unwrap(),
        s.clone_htod(&logprobs).unwrap(),
        s.clone_htod(&stop_ids).unwrap(),
    );
    let mut d_ot = s.clone_htod(&vec![u32::MAX; samples * max_new]).unwrap();
    let mut d_ol = s.clone_htod(&vec![f32::NAN; samples * max_new]).unwrap();
    let mut d_done = s.clone_htod(&vec![u32::MAX; samples]).unwrap();
    let (d_ct, d_st) = (s.clone_htod(&cos_t).unwrap(), s.clone_htod(&sin_t).unwrap());
    let mut d_feed = s.clone_htod(&vec![9u32; n]).unwrap();
    let mut d_cos = s.clone_htod(&vec![f32::NAN; n * hd]).unwrap();
    let mut d_sin = s.clone_htod(&vec![f32::NAN; n * hd]).unwrap();
    let mut d_seqs = s.clone_htod(&vec![AttnSeqGpu::default(); n]).unwrap();
    let mut d_w = s.clone_htod(&vec![1u32; n]).unwrap();
    let mut d_ids = s.clone_htod(&vec![1u32; n]).unwrap();
    let mut d_steps = s.clone_htod(&vec![1u32; n]).unwrap();
    decode_advance(
        g,
        &s,
        DecodeAdvance {
            rows: &mut d_rows,
            n_rows: n,
            tokens: &d_tok,
            logprobs: &d_lp,
            stop_ids: &d_stop,
            n_stop: stop_ids.len(),
            max_new,
            keep_prefix,
            out_tokens: &mut d_ot,
            out_logprobs: &mut d_ol,
            done_step: &mut d_done,
            samples,
            cos_table: &d_ct,
            sin_table: &d_st,
            head_dim: hd,
            feed: &mut d_feed,
            cos: &mut d_cos,
            sin: &mut d_sin,
            seqs: &mut d_seqs,
            write_rows: &mut d_w,
            sample_ids: &mut d_ids,
            steps: &mut d_steps,
        },
    )
    .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(s.clone_dtoh(&d_rows).unwrap(), h_rows);
    assert_eq!(s.clone_dtoh(&d_ot).unwrap(), h_ot);
    assert_eq!(bits(&s.clone_dtoh(&d_ol).unwrap()), bits(&h_ol));
    assert_eq!(s.clone_dtoh(&d_done).unwrap(), h_done);
    assert_eq!(s.clone_dtoh(&d_feed).unwrap(), h_feed);
    assert_eq!(bits(&s.clone_dtoh(&d_cos).unwrap()), bits(&h_cos));
    assert_eq!(bits(&s.clone_dtoh(&d_sin).unwrap()), bits(&h_sin));
    assert_eq!(s.clone_dtoh(&d_seqs).unwrap(), h_seqs);
    assert_eq!(s.clone_dtoh(&d_w).unwrap(), h_w);
    assert_eq!(s.clone_dtoh(&d_ids).unwrap(), h_ids);
    assert_eq!(s.clone_dtoh(&d_steps).unwrap(), h_steps);
    // what the cases mean, on the twin: stop id, max length, forced (stop id ignored), done
    assert_eq!(h_rows[0].done, 1);
    assert_eq!(h_rows[5].done, 1);
    assert_eq!(h_rows[4].step, rows[4].step, "a done row does not advance");
    assert_eq!(h_w[4], u32::MAX);
    let want_p = if keep_prefix { rows[4].prefix_len } else { 1 };
    assert_eq!(h_seqs[4].p_len, want_p);
    assert_eq!(
        h_rows[8].done,
        u32::from(rows[8].step + 1 >= rows[8].stop_len)
    );
    assert_eq!(h_rows[1].suffix_len, rows[1].suffix_len + 1);
    // gather: rows reversed, keys follow
    let map: Vec<u32> = (0..n as u32).rev().collect();
    let d_map = s.clone_htod(&map).unwrap();
    let mut d_dst = s.clone_htod(&vec![DecodeRow::default(); n]).unwrap();
    decode_gather_rows(
        g,
        &s,
        &mut d_dst,
        &d_rows,
        &d_map,
        n,
        &mut d_ids,
        &mut d_steps,
    )
    .unwrap();
    let got = s.clone_dtoh(&d_dst).unwrap();
    let want: Vec<DecodeRow> = map.iter().map(|&i| h_rows[i as usize]).collect();
    assert_eq!(got, want);
    let keys: Vec<u32> = want.iter().map(|r| r.key).collect();
    assert_eq!(s.clone_dtoh(&d_ids).unwrap(), keys);
}
