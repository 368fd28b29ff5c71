//! GPU tests of the tensor-core attention backward (`attention_bwd_tc_bf16`, through
//! `attention_bwd_bf16_with(BwdKernel::TensorCores, ..)`): against the CPU twin
//! `cpu::backward::attention_bwd` on fresh random bf16 inputs (the forward's `out` and `lse` from
//! `cpu::attention_fwd`, `out` rounded to bf16 as the GPU keeps it), outputs poisoned with NaN
//! first so an unwritten element fails; relative error ‖out − ref‖ / ‖ref‖ under the SIMT
//! kernel's tolerances (cuda_backward.rs); two runs give the same bits (determinism); the SIMT
//! kernel on the same inputs agrees; rows outside every sequence come back as zeros; unsupported
//! head dims are refused. Shared prefixes: `dprefix_k/v` start from nonzero values, the
//! gradients are added to them where a sequence's prefix span reaches and the rest keeps its
//! bits; the prefix part alone (`attention_bwd_dprefix_bf16`) at several splits. Each test
//! prints "skipped: no CUDA device" and passes without a GPU.
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

/// (dq, dk, dv, dprefix_k, dprefix_v) of the CPU twin.
type CpuGrads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// A case's inputs on the host and the device, and the CPU twin's gradients.
struct Inputs {
    t: usize,
    /// Prefix rows allocated (`p_rows`, at least 1: a stand-in when there is no prefix).
    pr: usize,
    seqs: Vec<AttnSeq>,
    scale: f32,
    /// What dprefix_k / dprefix_v hold before each run (the kernels add into them).
    base_pk: Vec<f32>,
    base_pv: Vec<f32>,
    /// The CPU twin's dq, dk, dv, dprefix_k, dprefix_v (the prefix ones from zeros).
    want: CpuGrads,
    g: DevInputs,
}

struct DevInputs {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    pk: CudaSlice<bf16>,
    pv: CudaSlice<bf16>,
    seqs: CudaSlice<AttnSeqGpu>,
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    dout: CudaSlice<bf16>,
}

fn inputs(s: &Arc<CudaStream>, c: &Case) -> Inputs {
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
    // small nonzero values: the prefix gradients are added to them (and must stay where no
    // sequence's span reaches)
    let base_pk: Vec<f32> = rand_vec(pr * kvw, fresh_seed())
        .iter()
        .map(|x| x * 0.01)
        .collect();
    let base_pv: Vec<f32> = rand_vec(pr * kvw, fresh_seed())
        .iter()
        .map(|x| x * 0.01)
        .collect();
    let gseqs: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
    let g = DevInputs {
        q: up(s, &q),
        k: up(s, &k),
        v: up(s, &v),
        pk: up(s, &pk),
        pv: up(s, &pv),
        seqs: up(s, &gseqs),
        out: up(s, &out_b),
        lse: up(s, &lse),
        dout: up(s, &dout),
    };
    Inputs {
        t,
        pr,
        seqs,
        scale,
        base_pk,
        base_pv,
        want: (wdq, wdk, wdv, wdpk, wdpv),
        g,
    }
}

/// Whether some sequence's prefix span holds prefix row `j` (every test descriptor is valid).
fn covered(seqs: &[AttnSeq], j: usize) -> bool {
    seqs.iter()
        .any(|s| j >= s.prefix_start as usize && j < (s.prefix_start + s.prefix_len) as usize)
}

/// Checks a run's prefix gradients: where a span reaches, (result - base) against `want`
/// (rel err <= tol); elsewhere the base's bits, untouched. Returns result - base.
fn check_prefix(
    label: &str,
    inp: &Inputs,
    kvw: usize,
    p_rows: usize,
    got: (&[f32], &[f32]),
    want: (&[f32], &[f32]),
    tol: f64,
) -> (Vec<f32>, Vec<f32>) {
    let mut deltas = Vec::new();
    for (name, got, base, want) in [
        ("dprefix_k", got.0, &inp.base_pk, want.0),
        ("dprefix_v", got.1, &inp.base_pv, want.1),
    ] {
        let delta: Vec<f32> = got.iter().zip(base.iter()).map(|(g, b)| g - b).collect();
        for j in 0..inp.pr {
            if j >= p_rows || !covered(&inp.seqs, j) {
                assert_eq!(
                    bits_f32(&got[j * kvw..(j + 1) * kvw]),
                    bits_f32(&base[j * kvw..(j + 1) * kvw]),
                    "{label}: {name} row {j} (no span holds it) must be left untouched"
                );
            }
        }
        if p_rows > 0 {
            check(
                &format!("{label} {name}"),
                &delta[..p_rows * kvw],
                want,
                tol,
            );
        }
        deltas.push(delta);
    }
    let dv = deltas.pop().unwrap();
    (deltas.pop().unwrap(), dv)
}

fn run_case(g: &Gpu, s: &Arc<CudaStream>, c: &Case) {
    let d = c.dims;
    let inp = inputs(s, c);
    let t = inp.t;
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let gi = &inp.g;
    let run = |kernel: BwdKernel| -> Grads {
        let (mut dq, mut dk, mut dv) = (
            poison_bf(s, t * qw),
            poison_bf(s, t * kvw),
            poison_bf(s, t * kvw),
        );
        let (mut dpk, mut dpv) = (up(s, &inp.base_pk), up(s, &inp.base_pv));
        attention_bwd_bf16_with(
            kernel,
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
                dout: &gi.dout,
                q: &gi.q,
                k: &gi.k,
                v: &gi.v,
                prefix_k: &gi.pk,
                prefix_v: &gi.pv,
                out: &gi.out,
                lse: &gi.lse,
                seqs: &gi.seqs,
                n_seqs: inp.seqs.len(),
                dims: d,
                mask: c.mask,
                scale: inp.scale,
                strides: RowStrides::contiguous(d),
            },
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
    let (wdq, wdk, wdv, wdpk, wdpv) = &inp.want;
    for (name, got, want) in [("dq", &tc.0, wdq), ("dk", &tc.1, wdk), ("dv", &tc.2, wdv)] {
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
    // the prefix gradients: added to the base where a span reaches, untouched elsewhere; the
    // tensor cores round P and dS to bf16 (tolerance as dk / dv), SIMT is fp32 throughout
    let tcp = check_prefix(
        &format!("tc {l} vs cpu"),
        &inp,
        kvw,
        c.p_rows,
        (&tc.3, &tc.4),
        (wdpk, wdpv),
        1e-2,
    );
    let simtp = check_prefix(
        &format!("simt {l} vs cpu"),
        &inp,
        kvw,
        c.p_rows,
        (&simt.3, &simt.4),
        (wdpk, wdpv),
        1e-3,
    );
    if c.p_rows > 0 {
        check(
            &format!("tc {l} dprefix_k vs simt"),
            &tcp.0[..c.p_rows * kvw],
            &simtp.0[..c.p_rows * kvw],
            1e-2,
        );
        check(
            &format!("tc {l} dprefix_v vs simt"),
            &tcp.1[..c.p_rows * kvw],
            &simtp.1[..c.p_rows * kvw],
            1e-2,
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

/// A GRPO group: 8 responses of varied lengths (1..300) over one 200-row prompt prefix; the
/// prefix buffer has 11 more rows no span holds.
fn grpo_group_case() -> Case {
    Case {
        label: "causal gqa 16/2 hd128 GRPO group 8 x (1..300) over one 200-row prefix",
        dims: dims(16, 2, 128),
        lens: vec![1, 37, 300, 64, 65, 129, 250, 17],
        prefix: vec![(0, 200); 8],
        p_rows: 211,
        mask: AttnMask::Causal,
        spare_rows: 2,
    }
}

/// Two groups over one prefix buffer at rows 0 and 137 (not 64-aligned), a sequence without a
/// prefix between them, and one whose span (130..140) straddles the second group's start; rows
/// 120..130 and from 287 on belong to no span.
fn two_groups_case(dims_: AttnDims, mask: AttnMask, label: &'static str) -> Case {
    Case {
        label,
        dims: dims_,
        lens: vec![40, 90, 7, 50, 130, 1, 66, 200, 25],
        prefix: vec![
            (0, 120),
            (0, 120),
            (0, 120),
            (0, 0),
            (137, 150),
            (137, 150),
            (137, 150),
            (137, 150),
            (130, 10),
        ],
        p_rows: 300,
        mask,
        spare_rows: 1,
    }
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

/// Shared prefixes (the prefix keys' gradients on the tensor cores): a GRPO group over one
/// prefix, two groups at unaligned offsets of one prefix buffer, hd 128 and 64, dprefix
/// pre-filled (added to; rows no span holds untouched).
#[test]
fn attention_bwd_tc_shared_prefix_cases_match_cpu_and_simt() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let cases = [
        grpo_group_case(),
        two_groups_case(
            dims(8, 2, 64),
            AttnMask::Causal,
            "causal gqa 8/2 hd64 two groups at prefix rows 0 and 137",
        ),
        two_groups_case(
            dims(16, 2, 128),
            AttnMask::Full,
            "full gqa 16/2 hd128 two groups at prefix rows 0 and 137",
        ),
    ];
    for c in &cases {
        run_case(g, &s, c);
    }
}

/// The prefix part alone (`attention_bwd_dprefix_bf16`): SIMT and every split of the tensor
/// cores against the CPU twin; each split bitwise the same on a second run and within fp32
/// rounding of split 1; a second call adds the gradient again; rows no span holds untouched;
/// `Auto` is the automatic split; a split past the limit is refused.
#[test]
fn attention_bwd_dprefix_tc_splits_match_cpu_and_add() {
    use rollplex_kernels::cuda::attention_bwd_dprefix::DPREFIX_MAX_SPLIT;
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for c in [
        two_groups_case(
            dims(16, 2, 128),
            AttnMask::Causal,
            "causal gqa 16/2 hd128 two groups",
        ),
        two_groups_case(
            dims(4, 1, 64),
            AttnMask::Full,
            "full gqa 4/1 hd64 two groups",
        ),
    ] {
        let d = c.dims;
        let kvw = d.kv_width();
        let inp = inputs(&s, &c);
        let gi = &inp.g;
        let run = |kernel: DprefixKernel, calls: usize| -> (Vec<f32>, Vec<f32>) {
            let (mut dpk, mut dpv) = (up(&s, &inp.base_pk), up(&s, &inp.base_pv));
            for _ in 0..calls {
                attention_bwd_dprefix_bf16(
                    kernel,
                    g,
                    &s,
                    &mut dpk,
                    &mut dpv,
                    DprefixInputs {
                        dout: &gi.dout,
                        q: &gi.q,
                        prefix_k: &gi.pk,
                        prefix_v: &gi.pv,
                        out: &gi.out,
                        lse: &gi.lse,
                        seqs: &gi.seqs,
                        n_seqs: inp.seqs.len(),
                        kv_rows: inp.t,
                        dims: d,
                        scale: inp.scale,
                        strides: RowStrides::contiguous(d),
                    },
                )
                .unwrap();
            }
            (down(&s, &dpk), down(&s, &dpv))
        };
        let l = c.label;
        let (_, _, _, wdpk, wdpv) = &inp.want;
        let n = c.p_rows * kvw;
        let simt = run(DprefixKernel::Simt, 1);
        check_prefix(
            &format!("alone simt {l} vs cpu"),
            &inp,
            kvw,
            c.p_rows,
            (&simt.0, &simt.1),
            (wdpk, wdpv),
            1e-3,
        );
        let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
        for split in [1, 2, 3, 16, 0] {
            let kernel = DprefixKernel::TensorCores { split };
            let (a, b) = (run(kernel, 1), run(kernel, 1));
            assert_eq!(
                bits_f32(&a.0),
                bits_f32(&b.0),
                "{l} split {split}: dpk bits"
            );
            assert_eq!(
                bits_f32(&a.1),
                bits_f32(&b.1),
                "{l} split {split}: dpv bits"
            );
            let delta = check_prefix(
                &format!("alone tc split {split} {l} vs cpu"),
                &inp,
                kvw,
                c.p_rows,
                (&a.0, &a.1),
                (wdpk, wdpv),
                1e-2,
            );
            match &first {
                None => first = Some(delta),
                Some(f) => {
                    check(
                        &format!("{l} split {split} vs 1 dpk"),
                        &delta.0[..n],
                        &f.0[..n],
                        1e-5,
                    );
                    check(
                        &format!("{l} split {split} vs 1 dpv"),
                        &delta.1[..n],
                        &f.1[..n],
                        1e-5,
                    );
                }
            }
        }
        // two calls add the gradient twice (a GRPO group's micro-batches into one prefix)
        let twice = run(DprefixKernel::TensorCores { split: 0 }, 2);
        let (w2k, w2v): (Vec<f32>, Vec<f32>) = (
            wdpk.iter().map(|x| 2.0 * x).collect(),
            wdpv.iter().map(|x| 2.0 * x).collect(),
        );
        check_prefix(
            &format!("alone tc two calls {l} vs 2 x cpu"),
            &inp,
            kvw,
            c.p_rows,
            (&twice.0, &twice.1),
            (&w2k, &w2v),
            1e-2,
        );
        let auto = run(DprefixKernel::Auto, 1);
        let split0 = run(DprefixKernel::TensorCores { split: 0 }, 1);
        assert_eq!(
            bits_f32(&auto.0),
            bits_f32(&split0.0),
            "{l}: Auto is split 0"
        );
        assert_eq!(
            bits_f32(&auto.1),
            bits_f32(&split0.1),
            "{l}: Auto is split 0"
        );
        let (mut dpk, mut dpv) = (up(&s, &inp.base_pk), up(&s, &inp.base_pv));
        let r = attention_bwd_dprefix_bf16(
            DprefixKernel::TensorCores {
                split: DPREFIX_MAX_SPLIT + 1,
            },
            g,
            &s,
            &mut dpk,
            &mut dpv,
            DprefixInputs {
                dout: &gi.dout,
                q: &gi.q,
                prefix_k: &gi.pk,
                prefix_v: &gi.pv,
                out: &gi.out,
                lse: &gi.lse,
                seqs: &gi.seqs,
                n_seqs: inp.seqs.len(),
                kv_rows: inp.t,
                dims: d,
                scale: inp.scale,
                strides: RowStrides::contiguous(d),
            },
        );
        assert!(
            matches!(&r, Err(CudaError::Shape { what, .. }) if what.contains("split")),
            "{l}: a split past the limit is refused, got {r:?}"
        );
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
                lse: &f,
                seqs: &sq,
                n_seqs: 1,
                dims: d,
                mask: AttnMask::Causal,
                scale: 1.0,
                strides: RowStrides::contiguous(d),
            },
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
    use rollplex_kernels::cuda::attention_bwd_tc::{
        tc_bwd_head_split, tc_bwd_head_split_for, tc_bwd_refusal,
    };
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
    // one 1,226-row prompt at 3B dims on 132 SMs: 20 key tiles x 2 kv heads x 4 slices = 160
    // blocks, so 8 slices; 2,160 response rows give 272 blocks with 4; no 8-way split of 7 heads
    let d3 = dims(16, 2, 128);
    assert_eq!(tc_bwd_head_split_for(&d3, 1226, 132), 8);
    assert_eq!(tc_bwd_head_split_for(&d3, 2160, 132), 4);
    assert_eq!(tc_bwd_head_split_for(&dims(28, 4, 128), 100, 132), 1);
}
