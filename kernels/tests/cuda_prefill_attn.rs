//! GPU tests of the tensor-core prefill attention (`attention_fwd_tc_bf16`, through
//! `attention_fwd_bf16_with(FwdKernel::TensorCores, ..)`): against the CPU twin
//! `cpu::attention_fwd` and against the SIMT kernel, on odd lengths (not multiples of the 64-row
//! / 64-key tiles), GQA, a shared prefix, causal and full masks, head_dim 64 / 80 / 128, with the
//! LSE output. Outputs are poisoned with NaN first, so an unwritten element fails. Each test
//! prints "skipped: no CUDA device" and passes where no GPU is present (CI); with
//! `ROLLPLEX_REQUIRE_GPU=1` that is a failure.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::attention::{
    attention_fwd_bf16_with, fwd_kernel_for, FwdKernel, RowStrides,
};
use rollplex_kernels::cuda::*;

mod common;
use common::{fresh_seed, gpu};

/// Uniform values in [-scale, scale) from a SplitMix64 stream, rounded to bf16, and the same
/// values as f32 (what the CPU twin reads).
fn rand_bf(n: usize, seed: u64, scale: f32) -> (Vec<bf16>, Vec<f32>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let v: Vec<bf16> = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            bf16::from_f32(u * scale)
        })
        .collect();
    let f = v.iter().map(|x| x.to_f32()).collect();
    (v, f)
}

/// ‖out − ref‖ / ‖ref‖; a non-finite output gives infinity.
fn rel_err(out: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (*o as f64 - *r as f64).powi(2);
        den += (*r as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

struct Case {
    label: &'static str,
    dims: AttnDims,
    lens: Vec<u32>,
    /// (start, len) into the prefix rows per sequence; missing = no prefix
    prefix: Vec<(u32, u32)>,
    p_rows: usize,
    mask: AttnMask,
}

/// Runs `kernel` on the case and returns (out, lse) as f32, with the grid sized from `hint`.
#[allow(clippy::too_many_arguments)]
fn launch(
    g: &Gpu,
    s: &Arc<CudaStream>,
    kernel: FwdKernel,
    c: &Case,
    bufs: &[CudaSlice<bf16>; 5],
    seqs: &CudaSlice<AttnSeqGpu>,
    t: usize,
    hint: usize,
) -> (Vec<f32>, Vec<f32>) {
    let d = c.dims;
    let mut out = s
        .clone_htod(&vec![bf16::from_bits(0x7fc0); t * d.q_width()])
        .unwrap();
    let mut lse = s.clone_htod(&vec![f32::NAN; t * d.num_heads]).unwrap();
    let mut lv = lse.as_view_mut();
    attention_fwd_bf16_with(
        kernel,
        g,
        s,
        &mut out,
        Some(&mut lv),
        FwdInputs {
            q: &bufs[0],
            k: &bufs[1],
            v: &bufs[2],
            prefix_k: &bufs[3],
            prefix_v: &bufs[4],
            seqs,
            n_seqs: c.lens.len(),
            max_q_len: hint,
            dims: d,
            mask: c.mask,
            scale: 1.0 / (d.head_dim as f32).sqrt(),
            strides: RowStrides::contiguous(d),
        },
    )
    .unwrap();
    let o: Vec<f32> = s
        .clone_dtoh(&out)
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    (o, s.clone_dtoh(&lse).unwrap())
}

fn run_case(g: &Gpu, s: &Arc<CudaStream>, c: &Case) {
    let d = c.dims;
    let t: usize = c.lens.iter().map(|&l| l as usize).sum();
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let sd = fresh_seed();
    let (q, qf) = rand_bf(t * qw, sd, 2.0);
    let (k, kf) = rand_bf(t * kvw, sd ^ 1, 2.0);
    let (v, vf) = rand_bf(t * kvw, sd ^ 2, 1.0);
    let pr = c.p_rows.max(1);
    let (pk, pkf) = rand_bf(pr * kvw, sd ^ 3, 2.0);
    let (pv, pvf) = rand_bf(pr * kvw, sd ^ 4, 1.0);
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
    let bufs = [
        s.clone_htod(&q).unwrap(),
        s.clone_htod(&k).unwrap(),
        s.clone_htod(&v).unwrap(),
        s.clone_htod(&pk).unwrap(),
        s.clone_htod(&pv).unwrap(),
    ];
    let dseqs = s.clone_htod(&gseqs).unwrap();
    let max_q = *c.lens.iter().max().unwrap() as usize;
    let (tc, tc_lse) = launch(g, s, FwdKernel::TensorCores, c, &bufs, &dseqs, t, max_q);
    let (simt, simt_lse) = launch(g, s, FwdKernel::Simt, c, &bufs, &dseqs, t, max_q);
    let e = rel_err(&tc, &want);
    let e_lse = rel_err(&tc_lse, &want_lse);
    let e_simt = rel_err(&tc, &simt);
    let e_simt_cpu = rel_err(&simt, &want);
    let e_lse_simt = rel_err(&tc_lse, &simt_lse);
    println!(
        "{}: tc vs cpu {e:.2e}, lse {e_lse:.2e}; tc vs simt {e_simt:.2e}, lse {e_lse_simt:.2e}; simt vs cpu {e_simt_cpu:.2e}",
        c.label
    );
    assert!(e <= 1e-2, "{}: tc vs cpu rel err {e:.3e}", c.label);
    assert!(
        e_lse <= 1e-4,
        "{}: tc lse vs cpu rel err {e_lse:.3e}",
        c.label
    );
    assert!(
        e_simt <= 1e-2,
        "{}: tc vs simt rel err {e_simt:.3e}",
        c.label
    );
    // a grid of one block along x (the hint says 1 query) still covers every query tile, with
    // the same bits: a tile's result does not depend on which block computes it
    let (tc1, tc1_lse) = launch(g, s, FwdKernel::TensorCores, c, &bufs, &dseqs, t, 1);
    assert!(
        tc1.iter().zip(&tc).all(|(a, b)| a.to_bits() == b.to_bits())
            && tc1_lse
                .iter()
                .zip(&tc_lse)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{}: the grid-size hint changed the result",
        c.label
    );
}

fn dims(h: usize, kv: usize, hd: usize) -> AttnDims {
    AttnDims {
        num_heads: h,
        num_kv_heads: kv,
        head_dim: hd,
    }
}

#[test]
fn tensor_core_prefill_matches_cpu_and_simt() {
    let Some(g) = gpu() else {
        println!("skipped: no CUDA device");
        return;
    };
    let s = g.stream(0).unwrap();
    let cases = [
        Case {
            label: "causal GQA 16/2 hd128, odd lengths",
            dims: dims(16, 2, 128),
            lens: vec![1, 63, 65, 200, 129, 7],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
        },
        Case {
            label: "causal GQA 7/1 hd128, shared prefix (scoring)",
            dims: dims(7, 1, 128),
            lens: vec![33, 5, 130, 64],
            prefix: vec![(0, 300), (0, 300), (300, 17), (317, 0)],
            p_rows: 317,
            mask: AttnMask::Causal,
        },
        Case {
            label: "full hd80 16/16 (vision windows), odd lengths",
            dims: dims(16, 16, 80),
            lens: vec![64, 100, 3, 257],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Full,
        },
        Case {
            label: "full hd80 with a prefix",
            dims: dims(4, 2, 80),
            lens: vec![70, 1],
            prefix: vec![(5, 90), (0, 3)],
            p_rows: 95,
            mask: AttnMask::Full,
        },
        Case {
            label: "causal GQA 12/4 hd64, prefix",
            dims: dims(12, 4, 64),
            lens: vec![150, 64, 31],
            prefix: vec![(0, 77), (77, 1), (0, 0)],
            p_rows: 78,
            mask: AttnMask::Causal,
        },
        Case {
            label: "causal hd32 3/1, long",
            dims: dims(3, 1, 32),
            lens: vec![1000],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
        },
    ];
    for c in &cases {
        run_case(g, &s, c);
    }
}

/// The dispatch rule: tensor cores for prompts (16+ queries) up to head_dim 128; the SIMT
/// kernel for one-query decode through the varlen kernel and for wider heads. A forced
/// tensor-core launch past head_dim 128 is refused, not run.
#[test]
fn dispatch_picks_tensor_cores_for_prompts() {
    assert_eq!(
        fwd_kernel_for(&dims(16, 2, 128), 1024),
        FwdKernel::TensorCores
    );
    assert_eq!(
        fwd_kernel_for(&dims(16, 16, 80), 64),
        FwdKernel::TensorCores
    );
    assert_eq!(fwd_kernel_for(&dims(16, 2, 128), 1), FwdKernel::Simt);
    assert_eq!(fwd_kernel_for(&dims(8, 8, 256), 4096), FwdKernel::Simt);
    let Some(g) = gpu() else {
        println!("skipped: no CUDA device");
        return;
    };
    let s = g.stream(0).unwrap();
    let d = dims(2, 2, 256);
    let x = s.clone_htod(&vec![bf16::ZERO; 64 * 512]).unwrap();
    let mut out = s.clone_htod(&vec![bf16::ZERO; 64 * 512]).unwrap();
    let seqs = s
        .clone_htod(&[AttnSeqGpu::from_fwd(&AttnSeq {
            start: 0,
            len: 64,
            prefix_start: 0,
            prefix_len: 0,
        })])
        .unwrap();
    let r = attention_fwd_bf16_with(
        FwdKernel::TensorCores,
        g,
        &s,
        &mut out,
        None,
        FwdInputs {
            q: &x,
            k: &x,
            v: &x,
            prefix_k: &x,
            prefix_v: &x,
            seqs: &seqs,
            n_seqs: 1,
            max_q_len: 64,
            dims: d,
            mask: AttnMask::Causal,
            scale: 1.0,
            strides: RowStrides::contiguous(d),
        },
    );
    assert!(
        r.is_err(),
        "head_dim 256 on the tensor-core kernel must be refused"
    );
}
