//! GPU tests of the forward and training kernels: each against its CPU twin on fresh random
//! inputs (bf16 tolerance by ‖out − ref‖ / ‖ref‖; outputs poisoned with NaN first, so an
//! unwritten element fails): GEMMs, norms, RoPE, pointwise ops, prefill attention, log-probs,
//! AdamW. The decode path and the partition and graph properties are in `cuda_decode.rs`, the
//! skinny GEMM in `cuda_skinny.rs`. Each test prints "skipped: no CUDA device" and passes where
//! no GPU or driver is present (CI).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
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
fn kernel_timing_counts_eager_launches_and_not_captured_ones() {
    let _ = gpu_or_skip!();
    // a device handle of its own: the timer and its scope are per handle, and the shared one's
    // launches from tests running beside this one must not count here
    let g = &Gpu::new(0).unwrap();
    let s = g.stream(0).unwrap();
    let (m, k, n) = (64, 256, 128);
    let (x, _) = rand_bf(m * k, 1.0);
    let (w, _) = rand_bf(k * n, 1.0);
    let (dx, dw) = (up(&s, &x), up(&s, &w));
    let run = |y: &mut CudaSlice<bf16>, c: &mut CudaSlice<bf16>| {
        for _ in 0..3 {
            add_fwd_bf16_inplace(g, &s, y, &dx, m * k).unwrap();
        }
        matmul_bf16(g, &s, c, &dx, &dw, Gemm::nn(m, k, n)).unwrap();
    };
    let (mut y0, mut c0) = (up(&s, &x), poison_bf(&s, m * n));
    run(&mut y0, &mut c0);
    let plain_gemm = down(&s, &c0);
    g.set_kernel_times(true);
    assert_eq!(g.set_kernel_scope(Some("probe")), None);
    let (mut y1, mut c1) = (up(&s, &x), poison_bf(&s, m * n));
    run(&mut y1, &mut c1);
    // launches while the stream captures are not timed; the replay is, where asked
    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    add_fwd_bf16_inplace(g, &s, &mut y1, &dx, m * k).unwrap();
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    g.timed(&s, "the graph", 0.0, || Ok(graph.launch()?))
        .unwrap();
    assert_eq!(g.set_kernel_scope(None).as_deref(), Some("probe"));
    let times = g.take_kernel_times().unwrap();
    assert_eq!(down(&s, &c1), plain_gemm, "a timed GEMM gives other bits");
    let find = |name: &str| {
        times
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no {name} in {times:?}"))
    };
    let add = find("add_fwd_bf16");
    assert_eq!((add.scope.as_str(), add.calls), ("probe", 3), "{times:?}");
    let gemm = find("cublasLt gemm");
    assert_eq!(gemm.calls, 1);
    assert_eq!(gemm.flops, 2.0 * (m * k * n) as f64);
    let replay = find("the graph");
    assert_eq!(replay.calls, 1);
    assert_eq!(times.len(), 3, "{times:?}");
    assert!(times.iter().all(|t| t.ms > 0.0 && t.ms < 1e3), "{times:?}");
    // the graph ran a fourth add into y1, as a fourth eager (untimed) one does into y0
    g.set_kernel_times(false);
    add_fwd_bf16_inplace(g, &s, &mut y0, &dx, m * k).unwrap();
    assert_eq!(down(&s, &y1), down(&s, &y0), "the replayed add differs");
    assert!(g.take_kernel_times().unwrap().is_empty());
    println!("kernel timing: {times:?}");
}
