//! GPU tests of the tensor-core attention backward (`attention_bwd_tc_bf16`, through
//! `attention_bwd_bf16_with(BwdKernel::TensorCores, ..)`): against the CPU twin
//! `cpu::backward::attention_bwd` on fresh random bf16 inputs (the forward's `out` and `lse` from
//! `cpu::attention_fwd`, `out` rounded to bf16 as the GPU keeps it), outputs poisoned with NaN
//! first so an unwritten element fails; relative error ‖out − ref‖ / ‖ref‖ under the SIMT
//! kernel's tolerances (cuda_backward.rs); two runs give the same bits (determinism); the SIMT
//! kernel on the same inputs agrees; rows outside every sequence come back as zeros; unsupported
//! head dims are refused. Each test prints "skipped: no CUDA device" and passes without a GPU.
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

fn bits_bf(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

struct Case {
    label: &'static str,
    dims: AttnDims,
    lens: Vec<u32>,
    /// (start, len) into the prefix rows per sequence (missing: no prefix).
    prefix: Vec<(u32, u32)>,
    p_rows: usize,
    mask: AttnMask,
    /// Rows after the last sequence that belong to none (their gradients must be zeros).
    spare_rows: usize,
}

fn dims(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> AttnDims {
    AttnDims {
        num_heads,
        num_kv_heads,
        head_dim,
    }
}

/// (dq, dk, dv, dprefix_k, dprefix_v) of one run.
type Grads = (Vec<bf16>, Vec<bf16>, Vec<bf16>, Vec<f32>, Vec<f32>);

fn run_case(g: &Gpu, s: &Arc<CudaStream>, c: &Case) {
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
    let run = |kernel: BwdKernel| -> Grads {
        let (mut dq, mut dk, mut dv) = (
            poison_bf(s, t * qw),
            poison_bf(s, t * kvw),
            poison_bf(s, t * kvw),
        );
        let (mut dpk, mut dpv) = (up(s, &vec![0f32; pr * kvw]), up(s, &vec![0f32; pr * kvw]));
        attention_bwd_bf16_with(
            kernel,
            g,
            s,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut dpk,
            &mut dpv,
            &gdo,
            &gq,
            &gk,
            &gv,
            &gpk,
            &gpv,
            &go,
            &gl,
            &gs,
            seqs.len(),
            d,
            c.mask,
            scale,
            RowStrides::contiguous(d),
        )
        .unwrap();
        (
            down(s, &dq),
            down(s, &dk),
            down(s, &dv),
            down(s, &dpk),
            down(s, &dpv),
        )
    };
    let tc = run(BwdKernel::TensorCores);
    let tc2 = run(BwdKernel::TensorCores);
    let simt = run(BwdKernel::Simt);
    let l = c.label;
    for (name, got, want) in [
        ("dq", &tc.0, &wdq),
        ("dk", &tc.1, &wdk),
        ("dv", &tc.2, &wdv),
    ] {
        check(&format!("tc {l} {name} vs cpu"), &to_f32(got), want, 1e-2);
    }
    for (name, got, want) in [
        ("dq", &tc.0, &simt.0),
        ("dk", &tc.1, &simt.1),
        ("dv", &tc.2, &simt.2),
    ] {
        check(
            &format!("tc {l} {name} vs simt"),
            &to_f32(got),
            &to_f32(want),
            1e-2,
        );
    }
    if c.p_rows > 0 {
        check(&format!("tc {l} dprefix_k vs cpu"), &tc.3, &wdpk, 1e-3);
        check(&format!("tc {l} dprefix_v vs cpu"), &tc.4, &wdpv, 1e-3);
    } else {
        assert!(
            tc.3.iter().chain(&tc.4).all(|&x| x == 0.0),
            "{l}: no prefix, dprefix untouched"
        );
    }
    for row in t - c.spare_rows..t {
        for (name, v, w) in [("dq", &tc.0, qw), ("dk", &tc.1, kvw), ("dv", &tc.2, kvw)] {
            assert!(
                v[row * w..(row + 1) * w].iter().all(|x| x.to_f32() == 0.0),
                "{l}: {name} of spare row {row} must be zeros"
            );
        }
    }
    assert_eq!(
        bits_bf(&tc.0),
        bits_bf(&tc2.0),
        "{l}: dq bits differ between runs"
    );
    assert_eq!(
        bits_bf(&tc.1),
        bits_bf(&tc2.1),
        "{l}: dk bits differ between runs"
    );
    assert_eq!(
        bits_bf(&tc.2),
        bits_bf(&tc2.2),
        "{l}: dv bits differ between runs"
    );
    assert_eq!(bits_f32(&tc.3), bits_f32(&tc2.3), "{l}: dprefix_k bits");
    assert_eq!(bits_f32(&tc.4), bits_f32(&tc2.4), "{l}: dprefix_v bits");
}

#[test]
fn attention_bwd_tc_matches_cpu_and_simt() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let cases = [
        Case {
            label: "causal gqa 16/2 hd128 varlen 1,17,200,1031 + spare rows",
            dims: dims(16, 2, 128),
            lens: vec![1, 17, 200, 1031],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
            spare_rows: 3,
        },
        Case {
            label: "full gqa 16/2 hd128 varlen 17,200",
            dims: dims(16, 2, 128),
            lens: vec![17, 200],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Full,
            spare_rows: 0,
        },
        Case {
            label: "causal mha 4/4 hd64 varlen 1,17,200,131",
            dims: dims(4, 4, 64),
            lens: vec![1, 17, 200, 131],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
            spare_rows: 2,
        },
        Case {
            label: "full mha 2/2 hd64 varlen 64,65,1,300",
            dims: dims(2, 2, 64),
            lens: vec![64, 65, 1, 300],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Full,
            spare_rows: 0,
        },
        Case {
            label: "causal gqa 4/1 hd128 shared prefix",
            dims: dims(4, 1, 128),
            lens: vec![9, 20, 13, 70],
            prefix: vec![(0, 24), (0, 24), (0, 24), (24, 100)],
            p_rows: 124,
            mask: AttnMask::Causal,
            spare_rows: 1,
        },
        Case {
            label: "causal gqa 8/2 hd64 8x128 packed",
            dims: dims(8, 2, 64),
            lens: vec![128; 8],
            prefix: vec![],
            p_rows: 0,
            mask: AttnMask::Causal,
            spare_rows: 0,
        },
    ];
    for c in &cases {
        run_case(g, &s, c);
    }
}

#[test]
fn attention_bwd_tc_refuses_unsupported_head_dims() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let a = up(&s, &[bf16::ZERO; 1024]);
    let f = up(&s, &vec![0f32; 64]);
    let sq = up(&s, &[AttnSeqGpu::default()]);
    for d in [dims(1, 1, 80), dims(1, 1, 256), dims(2, 1, 32)] {
        let (mut dq, mut dk, mut dv) = (
            poison_bf(&s, 1024),
            poison_bf(&s, 1024),
            poison_bf(&s, 1024),
        );
        let (mut p1, mut p2) = (up(&s, &vec![0f32; 1024]), up(&s, &vec![0f32; 1024]));
        let r = attention_bwd_bf16_with(
            BwdKernel::TensorCores,
            g,
            &s,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut p1,
            &mut p2,
            &a,
            &a,
            &a,
            &a,
            &a,
            &a,
            &a,
            &f,
            &sq,
            1,
            d,
            AttnMask::Causal,
            1.0,
            RowStrides::contiguous(d),
        );
        let msg = format!("{r:?}");
        assert!(
            matches!(r, Err(CudaError::Shape { .. })),
            "{d:?}: expected a shape error, got {msg}"
        );
    }
}

/// The host-side choices (no GPU needed): which cases the tensor cores take, and how the
/// key-centric kernel slices a GQA group's query heads.
#[test]
fn attention_bwd_tc_case_checks_and_head_split() {
    use rollplex_kernels::cuda::attention_bwd_tc::{tc_bwd_head_split, tc_bwd_refusal};
    let d = dims(16, 2, 128);
    assert_eq!(tc_bwd_refusal(&d, RowStrides::contiguous(d), 8), None);
    let fused = RowStrides {
        q: 2560,
        kv: 2560,
        prefix: 256,
        out: 2048,
    };
    assert_eq!(tc_bwd_refusal(&d, fused, 8), None);
    for (bad, why) in [(dims(16, 2, 80), "head_dim"), (dims(16, 3, 64), "multiple")] {
        let r = tc_bwd_refusal(&bad, RowStrides::contiguous(bad), 1);
        assert!(
            r.as_deref().is_some_and(|m| m.contains(why)),
            "{bad:?}: {r:?}"
        );
    }
    let odd = RowStrides {
        q: 2052,
        ..RowStrides::contiguous(d)
    };
    assert!(tc_bwd_refusal(&d, odd, 1).is_some_and(|m| m.contains("multiple of 8")));
    assert!(tc_bwd_refusal(&d, RowStrides::contiguous(d), 70000).is_some());
    for (nh, nkv, want) in [(16, 2, 4), (4, 1, 4), (6, 3, 2), (4, 4, 1), (12, 4, 1)] {
        assert_eq!(tc_bwd_head_split(&dims(nh, nkv, 64)), want, "{nh}/{nkv}");
    }
}
