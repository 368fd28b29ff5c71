//! Workbench: the attention backward, SIMT (`attention_bwd_bf16` on `BwdKernel::Simt`) beside
//! the tensor-core FlashAttention-2 kernels (`BwdKernel::TensorCores`), at Qwen2.5-VL 3B shapes
//! (16 query heads, 2 kv heads, head_dim 128, causal) for 8 sequences of 1024 and of 1536 tokens.
//! FLOPs counted: 2.5x the forward's causal FLOPs (forward: 2 matmuls, 4 * hd * heads per
//! (query, visible key) pair; backward: 5 matmuls, S recomputed, dP, dV, dK, dQ). Also prints the
//! relative difference ‖tc − simt‖ / ‖simt‖ of dq, dk, dv.
//!
//! `prefix`: the shared-prefix keys' gradients alone (`attention_bwd_dprefix_bf16`) at the 3B
//! shape of a training micro-batch of G GRPO groups: one prefix buffer holding each group's
//! 1226-row prompt in turn, and per group 8 responses of 120..512 rows (mean 290) attending to
//! their group's prompt, packed one after another; SIMT (`attention_bwd_dprefix_f32`, one group
//! only: it is slow) beside the tensor cores (`attention_bwd_tc_dprefix_f32`, D prep and chunk
//! reduce included) at the automatic split and at fixed ones. FLOPs counted: 4 matmuls (S, dP,
//! dV, dK) = 8 * hd * heads per (query, prefix key) pair. Also the whole tensor-core backward of
//! the same batch, and the relative difference of each variant from the first. With G > 1 also
//! the same groups with each prompt starting a 64-row tile of the buffer (1280 rows apart).
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_attn_bwd [full|prefix [G,..]]`
//! (needs a GPU; no argument: both, prefix at G = 1). Random data; warm-up first; each number is
//! the median of timed repeats (CUDA events).

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::*;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn rand_bf(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect()
}

/// Median milliseconds of `reps` timed runs of `f` on `s` after `warm` untimed ones.
fn time_ms(
    g: &Gpu,
    s: &Arc<CudaStream>,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> Res<()>,
) -> Res<f64> {
    for _ in 0..warm {
        f()?;
    }
    s.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let (a, b) = (g.timing_event()?, g.timing_event()?);
        a.record(s)?;
        f()?;
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    ts.sort_by(|x, y| x.total_cmp(y));
    Ok(ts[ts.len() / 2])
}

/// ‖a − b‖ / ‖b‖ over f32 values.
fn rel_diff_f32(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        num += (x - y) * (x - y);
        den += y * y;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// ‖a − b‖ / ‖b‖ over bf16 values.
fn rel_diff(a: &[bf16], b: &[bf16]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_f32() as f64, y.to_f32() as f64);
        num += (x - y) * (x - y);
        den += y * y;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn bench(g: &Gpu, s: &Arc<CudaStream>, n_seqs: u32, len: u32) -> Res<()> {
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let t = (n_seqs * len) as usize;
    let seqs: Vec<AttnSeqGpu> = (0..n_seqs)
        .map(|i| {
            AttnSeqGpu::from_fwd(&AttnSeq {
                start: i * len,
                len,
                prefix_start: 0,
                prefix_len: 0,
            })
        })
        .collect();
    let gs = s.clone_htod(&seqs)?;
    let (q, k, v, dout) = (
        s.clone_htod(&rand_bf(t * qw, 8, 1.0))?,
        s.clone_htod(&rand_bf(t * kvw, 9, 1.0))?,
        s.clone_htod(&rand_bf(t * kvw, 10, 1.0))?,
        s.clone_htod(&rand_bf(t * qw, 11, 1.0))?,
    );
    let scale = 1.0 / (128f32).sqrt();
    let mut out = g.alloc::<bf16>(s, t * qw)?;
    let mut lse = g.alloc::<f32>(s, t * dims.num_heads)?;
    {
        let mut lv = lse.as_view_mut();
        attention_fwd_bf16(
            g,
            s,
            &mut out,
            Some(&mut lv),
            FwdInputs {
                q: &q,
                k: &k,
                v: &v,
                prefix_k: &k,
                prefix_v: &v,
                seqs: &gs,
                n_seqs: n_seqs as usize,
                max_q_len: len as usize,
                dims,
                mask: AttnMask::Causal,
                scale,
                strides: RowStrides::contiguous(dims),
            },
        )?;
    }
    let pairs = n_seqs as f64 * (len as f64) * (len as f64 + 1.0) / 2.0;
    let fwd_flops = 4.0 * pairs * 128.0 * 16.0;
    let flops = 2.5 * fwd_flops;
    let mut results = Vec::new();
    for (name, kernel, reps) in [
        ("simt", BwdKernel::Simt, 3),
        ("tc", BwdKernel::TensorCores, 20),
    ] {
        let (mut dq, mut dk, mut dv) = (
            g.alloc::<bf16>(s, t * qw)?,
            g.alloc::<bf16>(s, t * kvw)?,
            g.alloc::<bf16>(s, t * kvw)?,
        );
        let (mut dpk, mut dpv) = (
            s.clone_htod(&vec![0f32; kvw])?,
            s.clone_htod(&vec![0f32; kvw])?,
        );
        let ms = time_ms(g, s, 1, reps, || {
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
                    dout: &dout,
                    q: &q,
                    k: &k,
                    v: &v,
                    prefix_k: &k,
                    prefix_v: &v,
                    out: &out,
                    lse: &lse,
                    seqs: &gs,
                    n_seqs: n_seqs as usize,
                    dims,
                    mask: AttnMask::Causal,
                    scale,
                    strides: RowStrides::contiguous(dims),
                },
            )?;
            Ok(())
        })?;
        println!(
            "attention_bwd {name:>4} {n_seqs}x{len} causal, 16/2 heads, hd 128: {ms:.3} ms (median of \
             {reps}), {:.1} TFLOP/s (2.5x forward causal FLOPs = {:.1} GFLOP)",
            flops / (ms * 1e-3) / 1e12,
            flops / 1e9
        );
        results.push((
            ms,
            s.clone_dtoh(&dq)?,
            s.clone_dtoh(&dk)?,
            s.clone_dtoh(&dv)?,
        ));
    }
    let (simt, tc) = (&results[0], &results[1]);
    println!(
        "  {n_seqs}x{len}: tc / simt time = {:.4} (tc {:.1}x faster); rel diff tc vs simt: dq {:.2e}, \
         dk {:.2e}, dv {:.2e}",
        tc.0 / simt.0,
        simt.0 / tc.0,
        rel_diff(&tc.1, &simt.1),
        rel_diff(&tc.2, &simt.2),
        rel_diff(&tc.3, &simt.3)
    );
    Ok(())
}

/// The prefix part alone at the 3B GRPO shape, `groups` groups in one call (see the module doc),
/// each group's prompt `stride` rows after the one before in the prefix buffer (the prompt's
/// 1226 rows: packed, as the trainer lays them; 1280: each prompt starting a 64-row tile).
fn bench_prefix(g: &Gpu, s: &Arc<CudaStream>, groups: usize, stride: u32) -> Res<()> {
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let p_len: u32 = 1226;
    let group_lens: [u32; 8] = [120, 512, 200, 350, 160, 420, 240, 318]; // 2320 rows, mean 290
    let lens: Vec<u32> = (0..groups).flat_map(|_| group_lens).collect();
    let t: usize = lens.iter().map(|&l| l as usize).sum();
    let mut seqs = Vec::new();
    let mut at = 0;
    for (i, &l) in lens.iter().enumerate() {
        seqs.push(AttnSeqGpu::from_fwd(&AttnSeq {
            start: at,
            len: l,
            prefix_start: (i / group_lens.len()) as u32 * stride,
            prefix_len: p_len,
        }));
        at += l;
    }
    let n = seqs.len();
    let max_len = *lens.iter().max().unwrap_or(&1) as usize;
    let gs = s.clone_htod(&seqs)?;
    let pr = (groups - 1) * stride as usize + p_len as usize;
    let (q, k, v, dout, pk, pv) = (
        s.clone_htod(&rand_bf(t * qw, 18, 1.0))?,
        s.clone_htod(&rand_bf(t * kvw, 19, 1.0))?,
        s.clone_htod(&rand_bf(t * kvw, 20, 1.0))?,
        s.clone_htod(&rand_bf(t * qw, 21, 1.0))?,
        s.clone_htod(&rand_bf(pr * kvw, 22, 1.0))?,
        s.clone_htod(&rand_bf(pr * kvw, 23, 1.0))?,
    );
    let scale = 1.0 / (128f32).sqrt();
    let strides = RowStrides::contiguous(dims);
    let mut out = g.alloc::<bf16>(s, t * qw)?;
    let mut lse = g.alloc::<f32>(s, t * dims.num_heads)?;
    {
        let mut lv = lse.as_view_mut();
        attention_fwd_bf16(
            g,
            s,
            &mut out,
            Some(&mut lv),
            FwdInputs {
                q: &q,
                k: &k,
                v: &v,
                prefix_k: &pk,
                prefix_v: &pv,
                seqs: &gs,
                n_seqs: n,
                max_q_len: max_len,
                dims,
                mask: AttnMask::Causal,
                scale,
                strides,
            },
        )?;
    }
    let pairs: f64 = lens.iter().map(|&l| l as f64 * p_len as f64).sum();
    let flops = 8.0 * pairs * 128.0 * 16.0;
    println!(
        "dprefix {groups} group(s) of 8 (120..512, {t} rows in all), each over its {p_len}-row \
         prefix (prompts {stride} rows apart), 16/2 heads, hd 128: {:.1} GFLOP (4 matmuls); \
         automatic split {}",
        flops / 1e9,
        attention_bwd_dprefix::tc_dprefix_split(&dims, t, pr)
    );
    let mut rows = Vec::new();
    let simt = (groups == 1).then(|| ("simt".to_string(), DprefixKernel::Simt, 5));
    let variants: Vec<(String, DprefixKernel, usize)> = simt
        .into_iter()
        .chain([0usize, 1, 2, 3, 4, 6, 8, 12, 16].into_iter().map(|split| {
            let name = if split == 0 {
                "tc auto".to_string()
            } else {
                format!("tc split {split}")
            };
            (name, DprefixKernel::TensorCores { split }, 20)
        }))
        .collect();
    for (name, kernel, reps) in variants {
        let (mut dpk, mut dpv) = (
            s.clone_htod(&vec![0f32; pr * kvw])?,
            s.clone_htod(&vec![0f32; pr * kvw])?,
        );
        let ms = time_ms(g, s, 1, reps, || {
            attention_bwd_dprefix_bf16(
                kernel,
                g,
                s,
                &mut dpk,
                &mut dpv,
                DprefixInputs {
                    dout: &dout,
                    q: &q,
                    prefix_k: &pk,
                    prefix_v: &pv,
                    out: &out,
                    lse: &lse,
                    seqs: &gs,
                    n_seqs: n,
                    kv_rows: t,
                    dims,
                    scale,
                    strides,
                },
            )?;
            Ok(())
        })?;
        // one more call from zeros for the comparison
        let (mut ck, mut cv) = (
            s.clone_htod(&vec![0f32; pr * kvw])?,
            s.clone_htod(&vec![0f32; pr * kvw])?,
        );
        attention_bwd_dprefix_bf16(
            kernel,
            g,
            s,
            &mut ck,
            &mut cv,
            DprefixInputs {
                dout: &dout,
                q: &q,
                prefix_k: &pk,
                prefix_v: &pv,
                out: &out,
                lse: &lse,
                seqs: &gs,
                n_seqs: n,
                kv_rows: t,
                dims,
                scale,
                strides,
            },
        )?;
        rows.push((name, ms, reps, s.clone_dtoh(&ck)?, s.clone_dtoh(&cv)?));
    }
    let (first, first_ms) = (&rows[0].0, rows[0].1);
    for (name, ms, reps, ck, cv) in &rows {
        println!(
            "  dprefix {name:>11}: {ms:8.3} ms (median of {reps}), {:6.1} TFLOP/s, {first} / this = \
             {:6.2}x; rel diff vs {first}: dpk {:.2e}, dpv {:.2e}",
            flops / (ms * 1e-3) / 1e12,
            first_ms / ms,
            rel_diff_f32(ck, &rows[0].3),
            rel_diff_f32(cv, &rows[0].4)
        );
    }
    // the whole tensor-core backward of this batch (its prefix part on the tensor cores)
    let (mut dq, mut dk, mut dv) = (
        g.alloc::<bf16>(s, t * qw)?,
        g.alloc::<bf16>(s, t * kvw)?,
        g.alloc::<bf16>(s, t * kvw)?,
    );
    let (mut dpk, mut dpv) = (
        s.clone_htod(&vec![0f32; pr * kvw])?,
        s.clone_htod(&vec![0f32; pr * kvw])?,
    );
    let ms = time_ms(g, s, 1, 20, || {
        attention_bwd_bf16_with(
            BwdKernel::TensorCores,
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
                dout: &dout,
                q: &q,
                k: &k,
                v: &v,
                prefix_k: &pk,
                prefix_v: &pv,
                out: &out,
                lse: &lse,
                seqs: &gs,
                n_seqs: n,
                dims,
                mask: AttnMask::Causal,
                scale,
                strides,
            },
        )?;
        Ok(())
    })?;
    println!(
        "  whole TC backward of this batch (prefix part on the tensor cores): {ms:.3} ms (median of 20)"
    );
    Ok(())
}

fn main() -> Res<()> {
    let which = std::env::args().nth(1).unwrap_or_default();
    if !["", "full", "prefix"].contains(&which.as_str()) {
        return Err(format!("unknown case {which:?}: full, prefix or nothing (both)").into());
    }
    let groups: Vec<usize> = match std::env::args().nth(2) {
        None => vec![1],
        Some(list) => list
            .split(',')
            .map(|g| match g.parse::<usize>() {
                Ok(g) if g > 0 => Ok(g),
                _ => Err(format!(
                    "groups: {g:?} is not a positive count (e.g. 1,2,4)"
                )),
            })
            .collect::<std::result::Result<_, _>>()?,
    };
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.sm_count());
    if which != "prefix" {
        for len in [1024, 1536] {
            bench(&g, &s, 8, len)?;
        }
    }
    if which != "full" {
        for &n in &groups {
            bench_prefix(&g, &s, n, 1226)?;
            if n > 1 {
                bench_prefix(&g, &s, n, 1280)?;
            }
        }
    }
    Ok(())
}
