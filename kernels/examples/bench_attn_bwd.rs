//! Workbench: the attention backward, SIMT (`attention_bwd_bf16` on `BwdKernel::Simt`) beside
//! the tensor-core FlashAttention-2 kernels (`BwdKernel::TensorCores`), at Qwen2.5-VL 3B shapes
//! (16 query heads, 2 kv heads, head_dim 128, causal) for 8 sequences of 1024 and of 1536 tokens.
//! FLOPs counted: 2.5x the forward's causal FLOPs (forward: 2 matmuls, 4 * hd * heads per
//! (query, visible key) pair; backward: 5 matmuls, S recomputed, dP, dV, dK, dQ). Also prints the
//! relative difference ‖tc − simt‖ / ‖simt‖ of dq, dk, dv.
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_attn_bwd` (needs a GPU).
//! Random data; warm-up first; each number is the median of timed repeats (CUDA events).

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
            &q,
            &k,
            &v,
            &k,
            &v,
            &gs,
            n_seqs as usize,
            len as usize,
            dims,
            AttnMask::Causal,
            scale,
            RowStrides::contiguous(dims),
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
                &mut dq,
                &mut dk,
                &mut dv,
                &mut dpk,
                &mut dpv,
                &dout,
                &q,
                &k,
                &v,
                &k,
                &v,
                &out,
                &lse,
                &gs,
                n_seqs as usize,
                dims,
                AttnMask::Causal,
                scale,
                RowStrides::contiguous(dims),
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

fn main() -> Res<()> {
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.sm_count());
    for len in [1024, 1536] {
        bench(&g, &s, 8, len)?;
    }
    Ok(())
}
