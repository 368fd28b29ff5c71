//! Workbench: the backward kernels at Qwen2.5-VL 3B training shapes (hidden 2048, 16 heads, 2 kv
//! heads, head_dim 128, intermediate 11008, vocab 151936), 4096 tokens as 4 causal sequences
//! of 1024; bytes (minimum a kernel must move) and FLOPs per kernel, with the device-copy
//! ceiling measured in the same run. `kernels/examples/torch_backward.py` times PyTorch's
//! autograd of the same ops.
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_backward` (needs a GPU).
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
    ts.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(ts[ts.len() / 2])
}

fn report(name: &str, ms: f64, bytes: f64, copy_tbs: f64) {
    let tbs = bytes / (ms * 1e-3) / 1e12;
    println!(
        "{name}: {ms:.3} ms, {:.1} MB moved, {tbs:.2} TB/s = {:.0}% of copy",
        bytes / 1e6,
        100.0 * tbs / copy_tbs
    );
}

fn main() -> Res<()> {
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.sm_count());

    // Copy ceiling (1 GiB read + 1 GiB written).
    let n = 1usize << 29;
    let src = s.clone_htod(&rand_bf(1 << 22, 1, 1.0))?;
    let mut a = g.alloc::<bf16>(&s, n)?;
    let mut b = g.alloc::<bf16>(&s, n)?;
    for i in 0..(n >> 22) {
        s.memcpy_dtod(&src, &mut a.slice_mut(i << 22..(i + 1) << 22))?;
    }
    let ms = time_ms(&g, &s, 3, 10, || {
        s.memcpy_dtod(&a, &mut b)?;
        Ok(())
    })?;
    let copy = 2.0 * (n * 2) as f64 / (ms * 1e-3) / 1e12;
    println!("device copy 1 GiB: {ms:.3} ms = {copy:.2} TB/s (read + write)");
    drop((a, b));

    let (t, d, f, vocab) = (4096usize, 2048usize, 11008usize, 151936usize);

    // RMSNorm backward, dx and dw.
    let (x, dy, w) = (
        s.clone_htod(&rand_bf(t * d, 2, 2.0))?,
        s.clone_htod(&rand_bf(t * d, 3, 1.0))?,
        s.clone_htod(&rand_bf(d, 4, 1.0))?,
    );
    let rstd = s.clone_htod(&vec![0.7f32; t])?;
    let mut dx = g.alloc::<bf16>(&s, t * d)?;
    let mut dw = s.clone_htod(&vec![0f32; d])?;
    let ms = time_ms(&g, &s, 3, 20, || {
        let mut dwv = dw.as_view_mut();
        rmsnorm_bwd_bf16(
            &g,
            &s,
            &mut dx,
            Some(&mut dwv),
            &dy,
            &x,
            &w,
            &rstd,
            t,
            d,
            false,
        )?;
        Ok(())
    })?;
    report(
        &format!("rmsnorm_bwd_bf16 {t}x{d} (dx + dw)"),
        ms,
        (3 * t * d * 2) as f64,
        copy,
    );

    // SwiGLU backward on the fused gate|up layout.
    let gu = s.clone_htod(&rand_bf(t * 2 * f, 5, 3.0))?;
    let dout = s.clone_htod(&rand_bf(t * f, 6, 1.0))?;
    let mut dgu = g.alloc::<bf16>(&s, t * 2 * f)?;
    let ms = time_ms(&g, &s, 3, 20, || {
        swiglu_bwd_fused_bf16(&g, &s, &mut dgu, &dout, &gu, t, f)?;
        Ok(())
    })?;
    report(
        &format!("swiglu_bwd_fused_bf16 {t}x{f}"),
        ms,
        (5 * t * f * 2) as f64,
        copy,
    );
    drop((gu, dout, dgu));

    // Embedding backward into an fp32 table (ids spread over the vocabulary, some repeats).
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 3) % vocab as u32 % 60000)
        .collect();
    let gids = s.clone_htod(&ids)?;
    let mut table = g.alloc::<f32>(&s, vocab * d)?;
    s.memset_zeros(&mut table)?;
    let ms = time_ms(&g, &s, 2, 10, || {
        embedding_bwd_f32(&g, &s, &mut table, &dy, &gids, t, d, vocab, d)?;
        Ok(())
    })?;
    report(
        &format!("embedding_bwd_f32 {t} tokens x {d} (vocab {vocab})"),
        ms,
        (t * d * (2 + 8)) as f64,
        copy,
    );
    drop(table);

    // Log-prob backward over the vocabulary (1024 rows), with the entropy term.
    let rows = 1024usize;
    let logits = s.clone_htod(&rand_bf(rows * vocab, 7, 8.0))?;
    let tg: Vec<u32> = (0..rows as u32).map(|i| i * 97 % vocab as u32).collect();
    let (gt, dl, de) = (
        s.clone_htod(&tg)?,
        s.clone_htod(&vec![0.3f32; rows])?,
        s.clone_htod(&vec![0.01f32; rows])?,
    );
    let mut dlog = g.alloc::<bf16>(&s, rows * vocab)?;
    for (label, ent) in [("", false), (" + entropy", true)] {
        let ms = time_ms(&g, &s, 3, 20, || {
            let e: Option<&dyn cudarc::driver::DevicePtr<f32>> = if ent { Some(&de) } else { None };
            logprobs_bwd_bf16(
                &g, &s, &mut dlog, &dl, e, &logits, &gt, rows, vocab, vocab, vocab, 1.0,
            )?;
            Ok(())
        })?;
        report(
            &format!("logprobs_bwd_bf16 {rows}x{vocab}{label}"),
            ms,
            (2 * rows * vocab * 2) as f64,
            copy,
        );
    }
    drop((logits, dlog));

    // Attention backward: 4 causal sequences of 1024, 16 heads, 2 kv heads, head_dim 128.
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let len = 1024u32;
    let seqs: Vec<AttnSeqGpu> = (0..4)
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
    let mut out = g.alloc::<bf16>(&s, t * qw)?;
    let mut lse = g.alloc::<f32>(&s, t * dims.num_heads)?;
    {
        let mut lv = lse.as_view_mut();
        attention_fwd_bf16(
            &g,
            &s,
            &mut out,
            Some(&mut lv),
            FwdInputs {
                q: &q,
                k: &k,
                v: &v,
                prefix_k: &k,
                prefix_v: &v,
                seqs: &gs,
                n_seqs: 4,
                max_q_len: len as usize,
                dims,
                mask: AttnMask::Causal,
                scale,
                strides: RowStrides::contiguous(dims),
            },
        )?;
    }
    let (mut dq, mut dk, mut dv) = (
        g.alloc::<bf16>(&s, t * qw)?,
        g.alloc::<bf16>(&s, t * kvw)?,
        g.alloc::<bf16>(&s, t * kvw)?,
    );
    let (mut dpk, mut dpv) = (
        s.clone_htod(&vec![0f32; kvw])?,
        s.clone_htod(&vec![0f32; kvw])?,
    );
    let ms = time_ms(&g, &s, 1, 5, || {
        attention_bwd_bf16(
            &g,
            &s,
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
                n_seqs: 4,
                dims,
                mask: AttnMask::Causal,
                scale,
                strides: RowStrides::contiguous(dims),
            },
        )?;
        Ok(())
    })?;
    // Useful work: 5 matmul-shaped passes (S recompute, dP, dV, dQ, dK) over the causal pairs.
    let pairs = 4.0 * (len as f64) * (len as f64 + 1.0) / 2.0;
    let flops = 5.0 * 2.0 * pairs * 128.0 * 16.0;
    println!(
        "attention_bwd_bf16 4x{len} causal, 16/2 heads, hd 128: {ms:.3} ms, {:.2} TFLOP/s \
         (5 matmuls over the causal pairs: {:.1} GFLOP)",
        flops / (ms * 1e-3) / 1e12,
        flops / 1e9
    );
    Ok(())
}
