//! GPU tests of the backward kernels: each against its CPU twin (`cpu::backward`) on fresh random
//! bf16 inputs (the CPU reads the same values as f32), outputs poisoned with NaN first so an
//! unwritten element fails; relative error ‖out − ref‖ / ‖ref‖ under a bf16 tolerance for bf16
//! outputs, tighter for fp32 parameter gradients, exact for the embedding scatter-add (same adds
//! in the same order). Every op runs twice and must give the same bits (determinism). Bad shapes
//! must come back as `CudaError::Shape`. Each test prints "skipped: no CUDA device" and passes
//! where no GPU or driver is present.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

fn rand_f32(n: usize, scale: f32) -> Vec<f32> {
    rand_vec(n, fresh_seed())
        .iter()
        .map(|x| x * scale)
        .collect()
}

fn bits_bf(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Largest |out - ref| / max |ref| (printed beside the relative error).
fn max_err(out: &[f32], reference: &[f32]) -> f64 {
    let scale = reference
        .iter()
        .fold(0f64, |m, r| m.max((*r as f64).abs()))
        .max(f64::MIN_POSITIVE);
    out.iter()
        .zip(reference)
        .fold(0f64, |m, (o, r)| m.max((*o as f64 - *r as f64).abs()))
        / scale
}

/// The prefix keys' gradients through `attention_bwd_bf16`'s default kernel: the tensor cores
/// round P and dS to bf16 as for dk / dv (measured on the H200: 1.6e-3 at GQA 4:1 hd 128), so
/// the same tolerance; the SIMT kernel alone (fp32 throughout) is held to 1e-3 in
/// cuda_attn_bwd_tc.rs.
const DPREFIX_TOL: f64 = 1e-2;

fn check(name: &str, out: &[f32], reference: &[f32], tol: f64) {
    let e = rel_err(out, reference);
    println!(
        "{name}: rel err {e:.2e}, max err / max|ref| {:.2e} (tol {tol:.0e})",
        max_err(out, reference)
    );
    assert!(e <= tol, "{name}: rel err {e:.3e} > {tol:.0e}");
}

fn is_shape_err<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(CudaError::Shape { .. }))
}

#[test]
fn rmsnorm_bwd_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &(rows, d, acc) in &[
        (1, 1, false),
        (7, 33, true),
        (37, 1280, false),
        (9, 3584, true),
    ] {
        let (x, xf) = rand_bf(rows * d, 3.0);
        let (w, wf) = rand_bf(d, 1.0);
        let (dy, dyf) = rand_bf(rows * d, 1.0);
        let (dx0, dx0f) = rand_bf(rows * d, 1.0);
        let dw0 = rand_f32(d, 1.0);
        let mut y = vec![0f32; rows * d];
        let mut rstd = vec![0f32; rows];
        cpu::rmsnorm_fwd(&mut y, Some(&mut rstd), &xf, &wf, rows, d, 1e-6).unwrap();
        let mut want_dx = if acc {
            dx0f.clone()
        } else {
            vec![0f32; rows * d]
        };
        let mut want_dw = dw0.clone();
        cpu::backward::rmsnorm_bwd(
            &mut want_dx,
            Some(&mut want_dw),
            &dyf,
            &xf,
            &wf,
            &rstd,
            rows,
            d,
            acc,
        )
        .unwrap();
        let (gx, gw, gdy, gr) = (up(&s, &x), up(&s, &w), up(&s, &dy), up(&s, &rstd));
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut gdx = if acc {
                up(&s, &dx0)
            } else {
                poison_bf(&s, rows * d)
            };
            let mut gdw = up(&s, &dw0);
            let mut dwv = gdw.as_view_mut();
            rmsnorm_bwd_bf16(
                g,
                &s,
                &mut gdx,
                Some(&mut dwv),
                &gdy,
                &gx,
                &gw,
                &gr,
                rows,
                d,
                acc,
            )
            .unwrap();
            runs.push((down(&s, &gdx), down(&s, &gdw)));
        }
        let label = format!("rmsnorm_bwd_bf16 {rows}x{d} acc={acc}");
        check(&format!("{label} dx"), &to_f32(&runs[0].0), &want_dx, 8e-3);
        check(&format!("{label} dw"), &runs[0].1, &want_dw, 1e-5);
        assert_eq!(bits_bf(&runs[0].0), bits_bf(&runs[1].0), "{label}: dx bits");
        assert_eq!(
            bits_f32(&runs[0].1),
            bits_f32(&runs[1].1),
            "{label}: dw bits"
        );
    }
    // Shapes: a short dx and a short rstd are refused.
    let (a, b) = (up(&s, &[bf16::ZERO; 10]), up(&s, &[0f32; 1]));
    let mut dx = poison_bf(&s, 9);
    assert!(is_shape_err(rmsnorm_bwd_bf16(
        g, &s, &mut dx, None, &a, &a, &a, &b, 2, 5, false
    )));
    let mut dx = poison_bf(&s, 10);
    assert!(is_shape_err(rmsnorm_bwd_bf16(
        g, &s, &mut dx, None, &a, &a, &a, &b, 2, 5, false
    )));
}

#[test]
fn rope_bwd_matches_cpu_on_a_fused_dqkv_row() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let (tokens, nh, nkv, hd) = (23, 4, 2, 128);
    let stride = (nh + 2 * nkv) * hd;
    let heads = nh + nkv;
    let (dx, dxf) = rand_bf(tokens * stride, 1.0);
    let cos = rand_f32(tokens * hd, 1.0);
    let sin = rand_f32(tokens * hd, 1.0);
    // CPU twin on the rotated heads only, contiguous.
    let mut want: Vec<f32> = (0..tokens)
        .flat_map(|t| dxf[t * stride..t * stride + heads * hd].to_vec())
        .collect();
    cpu::backward::rope_bwd(&mut want, &cos, &sin, tokens, heads, hd).unwrap();
    let (gc, gs) = (up(&s, &cos), up(&s, &sin));
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut gx = up(&s, &dx);
        rope_bwd_bf16(g, &s, &mut gx, &gc, &gs, tokens, stride, heads, hd).unwrap();
        runs.push(down(&s, &gx));
    }
    let got: Vec<f32> = to_f32(&runs[0]);
    let rot: Vec<f32> = (0..tokens)
        .flat_map(|t| got[t * stride..t * stride + heads * hd].to_vec())
        .collect();
    check("rope_bwd_bf16", &rot, &want, 8e-3);
    // The v heads are untouched.
    for t in 0..tokens {
        assert_eq!(
            &runs[0][t * stride + heads * hd..(t + 1) * stride],
            &dx[t * stride + heads * hd..(t + 1) * stride],
        );
    }
    assert_eq!(bits_bf(&runs[0]), bits_bf(&runs[1]), "rope_bwd bits");
    let mut short = up(&s, &dx[..stride * (tokens - 1)]);
    assert!(is_shape_err(rope_bwd_bf16(
        g, &s, &mut short, &gc, &gs, tokens, stride, heads, hd
    )));
    assert!(is_shape_err(rope_bwd_bf16(
        g, &s, &mut short, &gc, &gs, 1, stride, heads, 127
    )));
}

#[test]
fn swiglu_bwd_matches_cpu_fused_and_contiguous() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let (rows, f) = (13, 700);
    let (gu, guf) = rand_bf(rows * 2 * f, 4.0);
    let (dout, doutf) = rand_bf(rows * f, 1.0);
    let gate: Vec<f32> = (0..rows)
        .flat_map(|r| guf[r * 2 * f..r * 2 * f + f].to_vec())
        .collect();
    let upv: Vec<f32> = (0..rows)
        .flat_map(|r| guf[r * 2 * f + f..(r + 1) * 2 * f].to_vec())
        .collect();
    let (mut wg, mut wu) = (vec![0f32; rows * f], vec![0f32; rows * f]);
    cpu::backward::swiglu_bwd(&mut wg, &mut wu, &doutf, &gate, &upv).unwrap();
    let (ggu, gdo) = (up(&s, &gu), up(&s, &dout));
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut out = poison_bf(&s, rows * 2 * f);
        swiglu_bwd_fused_bf16(g, &s, &mut out, &gdo, &ggu, rows, f).unwrap();
        runs.push(down(&s, &out));
    }
    let got = to_f32(&runs[0]);
    let dg: Vec<f32> = (0..rows)
        .flat_map(|r| got[r * 2 * f..r * 2 * f + f].to_vec())
        .collect();
    let du: Vec<f32> = (0..rows)
        .flat_map(|r| got[r * 2 * f + f..(r + 1) * 2 * f].to_vec())
        .collect();
    check("swiglu_bwd_fused_bf16 dgate", &dg, &wg, 8e-3);
    check("swiglu_bwd_fused_bf16 dup", &du, &wu, 8e-3);
    assert_eq!(bits_bf(&runs[0]), bits_bf(&runs[1]), "swiglu_bwd bits");
    // Gate/up read in place from the fused input, gradients contiguous: the same bits.
    let (mut a, mut b) = (poison_bf(&s, rows * f), poison_bf(&s, rows * f));
    swiglu_bwd_bf16(
        g,
        &s,
        &mut a,
        &mut b,
        &gdo,
        &ggu.slice(..),
        &ggu.slice(f..),
        rows,
        f,
        SwigluBwdStrides::fused_inputs(f),
    )
    .unwrap();
    let (a, b) = (to_f32(&down(&s, &a)), to_f32(&down(&s, &b)));
    assert_eq!(bits_f32(&a), bits_f32(&dg), "strided dgate = fused");
    assert_eq!(bits_f32(&b), bits_f32(&du), "strided dup = fused");
    // Contiguous buffers: the same bits.
    let gate_b: Vec<bf16> = gate.iter().map(|&v| bf16::from_f32(v)).collect();
    let up_b: Vec<bf16> = upv.iter().map(|&v| bf16::from_f32(v)).collect();
    let (gg, gup) = (up(&s, &gate_b), up(&s, &up_b));
    let (mut a, mut b) = (poison_bf(&s, rows * f), poison_bf(&s, rows * f));
    swiglu_bwd_bf16(
        g,
        &s,
        &mut a,
        &mut b,
        &gdo,
        &gg,
        &gup,
        rows,
        f,
        SwigluBwdStrides::contiguous(f),
    )
    .unwrap();
    let (a, b) = (to_f32(&down(&s, &a)), to_f32(&down(&s, &b)));
    assert_eq!(bits_f32(&a), bits_f32(&dg), "contiguous dgate = fused");
    assert_eq!(bits_f32(&b), bits_f32(&du), "contiguous dup = fused");
    let mut fused_short = poison_bf(&s, rows * 2 * f - 1);
    assert!(is_shape_err(swiglu_bwd_fused_bf16(
        g,
        &s,
        &mut fused_short,
        &gdo,
        &ggu,
        rows,
        f
    )));
    let mut short = poison_bf(&s, rows * f - 1);
    let mut ok = poison_bf(&s, rows * f);
    assert!(is_shape_err(swiglu_bwd_bf16(
        g,
        &s,
        &mut short,
        &mut ok,
        &gdo,
        &gg,
        &gup,
        rows,
        f,
        SwigluBwdStrides::contiguous(f),
    )));
}

#[test]
fn embedding_bwd_is_bitwise_the_cpu_scatter_add() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let (vocab, d, tokens) = (1000, 200, 700);
    // Many repeats: ids drawn from the first 40 rows and a few from the rest.
    let r = rand_vec(tokens, fresh_seed());
    let ids: Vec<u32> = r
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let u = ((x + 1.0) * 0.5 * 1e6) as u32;
            if i % 7 == 0 {
                u % vocab as u32
            } else {
                u % 40
            }
        })
        .collect();
    let (dout, doutf) = rand_bf(tokens * d, 1.0);
    let table0 = rand_f32(vocab * d, 0.1);
    let mut want = table0.clone();
    cpu::backward::embedding_bwd(&mut want, &doutf, &ids, d).unwrap();
    let (gdo, gid) = (up(&s, &dout), up(&s, &ids));
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut t = up(&s, &table0);
        embedding_bwd_f32(g, &s, &mut t, &gdo, &gid, tokens, d, vocab, d).unwrap();
        runs.push(down(&s, &t));
    }
    check("embedding_bwd_f32", &runs[0], &want, 0.0);
    assert_eq!(bits_f32(&runs[0]), bits_f32(&want), "bitwise the CPU twin");
    assert_eq!(bits_f32(&runs[0]), bits_f32(&runs[1]), "embedding_bwd bits");
    let mut small = up(&s, &table0[..vocab * d - 1]);
    assert!(is_shape_err(embedding_bwd_f32(
        g, &s, &mut small, &gdo, &gid, tokens, d, vocab, d
    )));
}

/// bf16 values in the order of the reals, as integers (the distance between two is in ulps).
fn bf16_ordinal(x: bf16) -> i32 {
    let b = x.to_bits() as i32;
    if b & 0x8000 != 0 {
        -(b & 0x7fff)
    } else {
        b
    }
}

/// Largest distance in bf16 ulps between `out` and the CPU twin's f32 result rounded to bf16.
fn max_ulps(out: &[bf16], reference: &[f32]) -> i32 {
    out.iter()
        .zip(reference)
        .map(|(o, r)| (bf16_ordinal(*o) - bf16_ordinal(bf16::from_f32(*r))).abs())
        .max()
        .unwrap_or(0)
}

#[test]
fn gelu_bwd_matches_cpu_in_both_forms() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for &n in &[1usize, 1000, 100_003] {
        let (x, xf) = rand_bf(n, 4.0);
        let (dy, dyf) = rand_bf(n, 1.0);
        let (gx, gdy) = (up(&s, &x), up(&s, &dy));
        for tanh in [false, true] {
            let mut want = vec![0f32; n];
            if tanh {
                cpu::backward::gelu_tanh_bwd(&mut want, &dyf, &xf).unwrap();
            } else {
                cpu::backward::gelu_bwd(&mut want, &dyf, &xf).unwrap();
            }
            let mut runs = Vec::new();
            for _ in 0..2 {
                let mut dx = poison_bf(&s, n);
                gelu_bwd_bf16(g, &s, &mut dx, &gdy, &gx, n, tanh).unwrap();
                runs.push(down(&s, &dx));
            }
            let label = format!("gelu_bwd_bf16 n={n} tanh={tanh}");
            check(&label, &to_f32(&runs[0]), &want, 8e-3);
            // fp32 math rounded once: at most one bf16 ulp from the f64 twin rounded to bf16
            let ulps = max_ulps(&runs[0], &want);
            println!("{label}: max {ulps} bf16 ulp from the CPU twin");
            assert!(ulps <= 1, "{label}: {ulps} ulps from the CPU twin");
            assert_eq!(bits_bf(&runs[0]), bits_bf(&runs[1]), "{label}: bits");
        }
    }
    // On [-3.5, -1.5] the two forms' derivatives differ by up to 29 bf16 ulps (computed in f64):
    // each mode must match its own twin there, not the other's (the flag is not ignored).
    let n = 256;
    let x: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(-3.5 + 2.0 * i as f32 / n as f32))
        .collect();
    let xf = to_f32(&x);
    let dyf = vec![1f32; n];
    let dy = vec![bf16::ONE; n];
    let (mut exact, mut approx) = (vec![0f32; n], vec![0f32; n]);
    cpu::backward::gelu_bwd(&mut exact, &dyf, &xf).unwrap();
    cpu::backward::gelu_tanh_bwd(&mut approx, &dyf, &xf).unwrap();
    let (gx, gdy) = (up(&s, &x), up(&s, &dy));
    for (tanh, own, other) in [(false, &exact, &approx), (true, &approx, &exact)] {
        let mut dx = poison_bf(&s, n);
        gelu_bwd_bf16(g, &s, &mut dx, &gdy, &gx, n, tanh).unwrap();
        let got = down(&s, &dx);
        assert!(max_ulps(&got, own) <= 1, "tanh={tanh}: off its own twin");
        assert!(
            max_ulps(&got, other) >= 2,
            "tanh={tanh}: equals the other form"
        );
    }
    let mut short = poison_bf(&s, n - 1);
    assert!(is_shape_err(gelu_bwd_bf16(
        g, &s, &mut short, &gdy, &gx, n, false
    )));
    let mut dx = poison_bf(&s, n);
    assert!(is_shape_err(gelu_bwd_bf16(
        g,
        &s,
        &mut dx,
        &gdy.slice(..n - 1),
        &gx,
        n,
        true
    )));
}

#[test]
fn logprobs_bwd_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // 5003: the scalar path; 4104 (a multiple of 8): 16-byte loads and stores
    for &(rows, vocab, temp, with_entropy) in &[
        (9, 5003, 1.0f32, false),
        (9, 5003, 0.7, true),
        (5, 4104, 1.0, true),
        (5, 4104, 0.7, false),
    ] {
        let (logits, lf) = rand_bf(rows * vocab, 6.0);
        let r = rand_vec(rows, fresh_seed());
        let targets: Vec<u32> = r
            .iter()
            .map(|x| (((x + 1.0) * 0.5 * vocab as f32) as u32).min(vocab as u32 - 1))
            .collect();
        let dlogp = rand_f32(rows, 1.0);
        let dent = rand_f32(rows, 1.0);
        let mut want = vec![0f32; rows * vocab];
        cpu::backward::logprobs_bwd(
            &mut want,
            &dlogp,
            with_entropy.then_some(&dent[..]),
            &lf,
            &targets,
            rows,
            vocab,
            temp,
        )
        .unwrap();
        let (gl, gt, gdl, gde) = (
            up(&s, &logits),
            up(&s, &targets),
            up(&s, &dlogp),
            up(&s, &dent),
        );
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut out = poison_bf(&s, rows * vocab);
            let de: Option<&dyn cudarc::driver::DevicePtr<f32>> =
                if with_entropy { Some(&gde) } else { None };
            logprobs_bwd_bf16(
                g, &s, &mut out, &gdl, de, &gl, &gt, rows, vocab, vocab, vocab, temp,
            )
            .unwrap();
            runs.push(down(&s, &out));
        }
        check(
            &format!("logprobs_bwd_bf16 vocab={vocab} T={temp} entropy={with_entropy}"),
            &to_f32(&runs[0]),
            &want,
            8e-3,
        );
        assert_eq!(bits_bf(&runs[0]), bits_bf(&runs[1]), "logprobs_bwd bits");
    }
    let (gl, gt, gdl) = (
        up(&s, &[bf16::ZERO; 10]),
        up(&s, &[0u32; 2]),
        up(&s, &[0f32; 2]),
    );
    let mut out = poison_bf(&s, 10);
    assert!(is_shape_err(logprobs_bwd_bf16(
        g, &s, &mut out, &gdl, None, &gl, &gt, 2, 5, 5, 5, 0.0
    )));
    assert!(is_shape_err(logprobs_bwd_bf16(
        g, &s, &mut out, &gdl, None, &gl, &gt, 2, 6, 6, 6, 1.0
    )));
}

struct AttnCase {
    label: &'static str,
    dims: AttnDims,
    lens: Vec<u32>,
    /// (start, len) into the prefix rows per sequence.
    prefix: Vec<(u32, u32)>,
    p_rows: usize,
    mask: AttnMask,
    /// Rows after the last sequence that belong to none (their gradients must be zeros).
    spare_rows: usize,
}

fn run_attention_bwd(g: &Gpu, s: &Arc<CudaStream>, c: &AttnCase) {
    let d = c.dims;
    let t = c.lens.iter().map(|&l| l as usize).sum::<usize>() + c.spare_rows;
    let (qw, kvw, nh) = (d.q_width(), d.kv_width(), d.num_heads);
    let (q, qf) = rand_bf(t * qw, 1.0);
    let (k, kf) = rand_bf(t * kvw, 1.0);
    let (v, vf) = rand_bf(t * kvw, 1.0);
    let (dout, doutf) = rand_bf(t * qw, 1.0);
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
    let (pkf_, pvf_) = if c.p_rows == 0 {
        (&[][..], &[][..])
    } else {
        (&pkf[..], &pvf[..])
    };
    let mut out = vec![0f32; t * qw];
    let mut lse = vec![0f32; t * nh];
    cpu::attention_fwd(
        &mut out,
        Some(&mut lse),
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
    // The GPU keeps `out` in bf16: give the CPU twin the same values.
    let out_b: Vec<bf16> = out.iter().map(|&x| bf16::from_f32(x)).collect();
    let out_r = to_f32(&out_b);
    let (mut wdq, mut wdk, mut wdv) =
        (vec![0f32; t * qw], vec![0f32; t * kvw], vec![0f32; t * kvw]);
    let (mut wdpk, mut wdpv) = (vec![0f32; c.p_rows * kvw], vec![0f32; c.p_rows * kvw]);
    cpu::backward::attention_bwd(
        &mut wdq, &mut wdk, &mut wdv, &mut wdpk, &mut wdpv, &doutf, &qf, &kf, &vf, pkf_, pvf_,
        &out_r, &lse, &seqs, d, c.mask, scale,
    )
    .unwrap();
    let gseqs: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
    let (gq, gk, gv, gpk, gpv, gs, go, gl, gdo) = (
        up(s, &q),
        up(s, &k),
        up(s, &v),
        up(s, &pk),
        up(s, &pv),
        up(s, &gseqs),
        up(s, &out_b),
        up(s, &lse),
        up(s, &dout),
    );
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (mut dq, mut dk, mut dv) = (
            poison_bf(s, t * qw),
            poison_bf(s, t * kvw),
            poison_bf(s, t * kvw),
        );
        let (mut dpk, mut dpv) = (up(s, &vec![0f32; pr * kvw]), up(s, &vec![0f32; pr * kvw]));
        attention_bwd_bf16(
            g,
            s,
            BwdGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                dprefix_k: &mut dpk,
                dprefix_v: &mut dpv,
            },
            BwdInputs {
                dout: &gdo,
                q: &gq,
                k: &gk,
                v: &gv,
                prefix_k: &gpk,
                prefix_v: &gpv,
                out: &go,
                lse: &gl,
                seqs: &gs,
                n_seqs: seqs.len(),
                dims: d,
                mask: c.mask,
                scale,
                strides: RowStrides::contiguous(d),
            },
        )
        .unwrap();
        runs.push((
            down(s, &dq),
            down(s, &dk),
            down(s, &dv),
            down(s, &dpk),
            down(s, &dpv),
        ));
    }
    let l = c.label;
    let r = &runs[0];
    check(
        &format!("attention_bwd_bf16 {l} dq"),
        &to_f32(&r.0),
        &wdq,
        1e-2,
    );
    check(
        &format!("attention_bwd_bf16 {l} dk"),
        &to_f32(&r.1),
        &wdk,
        1e-2,
    );
    check(
        &format!("attention_bwd_bf16 {l} dv"),
        &to_f32(&r.2),
        &wdv,
        1e-2,
    );
    if c.p_rows > 0 {
        check(
            &format!("attention_bwd_bf16 {l} dprefix_k"),
            &r.3,
            &wdpk,
            DPREFIX_TOL,
        );
        check(
            &format!("attention_bwd_bf16 {l} dprefix_v"),
            &r.4,
            &wdpv,
            DPREFIX_TOL,
        );
    } else {
        assert!(
            r.3.iter().all(|&x| x == 0.0),
            "{l}: no prefix, dprefix untouched"
        );
    }
    for row in t - c.spare_rows..t {
        assert!(r.0[row * qw..(row + 1) * qw]
            .iter()
            .all(|x| x.to_f32() == 0.0));
        assert!(r.1[row * kvw..(row + 1) * kvw]
            .iter()
            .all(|x| x.to_f32() == 0.0));
    }
    let r2 = &runs[1];
    assert_eq!(bits_bf(&r.0), bits_bf(&r2.0), "{l}: dq bits");
    assert_eq!(bits_bf(&r.1), bits_bf(&r2.1), "{l}: dk bits");
    assert_eq!(bits_bf(&r.2), bits_bf(&r2.2), "{l}: dv bits");
    assert_eq!(bits_f32(&r.3), bits_f32(&r2.3), "{l}: dprefix_k bits");
    assert_eq!(bits_f32(&r.4), bits_f32(&r2.4), "{l}: dprefix_v bits");
}

#[test]
fn attention_bwd_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let cases = [
        AttnCase {
            label: "causal gqa 2:1 hd64 + spare rows",
            dims: AttnDims {
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 64,
            },
            lens: vec![17, 40, 5],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
            spare_rows: 3,
        },
        AttnCase {
            label: "causal gqa 4:1 hd128 shared prefix",
            dims: AttnDims {
                num_heads: 4,
                num_kv_heads: 1,
                head_dim: 128,
            },
            lens: vec![9, 20, 13, 6],
            prefix: vec![(0, 24), (0, 24), (0, 24), (24, 10)],
            p_rows: 34,
            mask: AttnMask::Causal,
            spare_rows: 0,
        },
        AttnCase {
            label: "full hd80",
            dims: AttnDims {
                num_heads: 2,
                num_kv_heads: 2,
                head_dim: 80,
            },
            lens: vec![16, 33],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Full,
            spare_rows: 0,
        },
    ];
    for c in &cases {
        run_attention_bwd(g, &s, c);
    }
    // Shapes: kv heads not dividing heads, head_dim over 256, a short lse.
    let a = up(&s, &[bf16::ZERO; 64]);
    let f = up(&s, &vec![0f32; 64]);
    let sq = up(&s, &[AttnSeqGpu::default()]);
    let b = || (poison_bf(&s, 64), poison_bf(&s, 64), poison_bf(&s, 64));
    for (dims, lse_len) in [
        (
            AttnDims {
                num_heads: 3,
                num_kv_heads: 2,
                head_dim: 8,
            },
            64,
        ),
        (
            AttnDims {
                num_heads: 1,
                num_kv_heads: 1,
                head_dim: 272,
            },
            64,
        ),
        (
            AttnDims {
                num_heads: 2,
                num_kv_heads: 1,
                head_dim: 8,
            },
            3,
        ),
    ] {
        let (mut dq, mut dk, mut dv) = b();
        let (mut p1, mut p2) = (up(&s, &vec![0f32; 64]), up(&s, &vec![0f32; 64]));
        let lse = f.slice(..lse_len);
        let r = attention_bwd_bf16(
            g,
            &s,
            BwdGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                dprefix_k: &mut p1,
                dprefix_v: &mut p2,
            },
            BwdInputs {
                dout: &a,
                q: &a,
                k: &a,
                v: &a,
                prefix_k: &a,
                prefix_v: &a,
                out: &a,
                lse: &lse,
                seqs: &sq,
                n_seqs: 1,
                dims,
                mask: AttnMask::Causal,
                scale: 1.0,
                strides: RowStrides::contiguous(dims),
            },
        );
        let msg = format!("{r:?}");
        assert!(is_shape_err(r), "{dims:?} lse {lse_len}: {msg}");
    }
}
