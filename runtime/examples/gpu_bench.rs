//! Throughput of the CUDA model forward at 3B-class dims: packed text prefill and vision
//! encoding, timed with CUDA events after warm-up (`tests/reference/bench_prefill.py` times
//! PyTorch on the same dims and shapes in the same run).
//!
//! The model is Qwen2.5-VL-3B's widths (text 2048 / 16 heads / 2 kv heads / FFN 11008 / vocab
//! 151936; vision 1280 / 16 heads / FFN 3420, window 112, patch 14) with fewer layers
//! (`--text-layers`, `--vision-blocks`; the last vision block uses full attention), random
//! weights. FLOPs counted: every GEMM (2 m n k) plus attention (4 hd heads per query-key pair
//! attended: causal pairs for text, window / frame pairs for vision); the lm head runs on the
//! last token of each prompt only (as a prefill does).
//!
//! Usage: gpu_bench [--text-layers 4] [--vision-blocks 4] [--prompts 8] [--prompt-len 1024]
//!                  [--images 2] [--grid 64] [--iters 10]

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::attention::{
    attention_fwd_bf16_with, FwdInputs, FwdKernel, RowStrides,
};
use rollplex_kernels::cuda::{bf16, linear_fwd_bf16, AttnSeqGpu};
use rollplex_kernels::cuda::{CudaStream, Gpu};
use rollplex_runtime::gpu::plan::VisionPlan;
use rollplex_runtime::gpu::weights::GpuBlock;
use rollplex_runtime::gpu::{GpuModel, GpuPrompt};
use rollplex_runtime::model::{MediaInput, MediaKind, Qwen25VL};

#[path = "common/widths.rs"]
mod widths;

fn arg(args: &[String], name: &str, default: usize) -> Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow!("{name} needs a value"))?
            .parse()
            .with_context(|| name.to_string()),
        None => Ok(default),
    }
}

/// Median milliseconds of `iters` timed runs of `f` (after 2 warm-up runs), each started on an
/// idle device and waited for: CUDA events around the call, so host work before the first
/// launch counts.
fn time_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    iters: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    Ok(time_calls(gpu, s, iters, f)?.0)
}

/// [`time_ms`] and the median host milliseconds inside the call (preparation + enqueue).
fn time_calls(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..2 {
        f()?;
    }
    s.synchronize()?;
    let mut ts = Vec::with_capacity(iters);
    let mut hs = Vec::with_capacity(iters);
    for _ in 0..iters {
        let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
        a.record(s)?;
        let h0 = std::time::Instant::now();
        f()?;
        hs.push(h0.elapsed().as_secs_f64() * 1e3);
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    ts.sort_by(|x, y| x.total_cmp(y));
    hs.sort_by(|x, y| x.total_cmp(y));
    Ok((ts[ts.len() / 2], hs[hs.len() / 2]))
}

/// Milliseconds per call of `iters` calls of `f` issued back to back without waiting (after 2
/// warm-up runs): the host prepares call n + 1 while the device runs call n, as a server loop
/// does; what is left is device time plus whatever still makes the host wait.
fn back_to_back_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    s.synchronize()?;
    let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
    a.record(s)?;
    for _ in 0..iters {
        f()?;
    }
    b.record(s)?;
    b.synchronize()?;
    Ok(a.elapsed_ms(&b)? as f64 / iters as f64)
}

/// Milliseconds of one block's four GEMMs (qkv, o, gate|up, down) over `rows` rows.
fn block_gemms_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    b: &GpuBlock,
    rows: usize,
    iters: usize,
) -> Result<f64> {
    let h = b.o.out;
    let x = s.alloc_zeros::<bf16>(rows * b.ffn.max(h))?;
    let mut y = s.alloc_zeros::<bf16>(rows * 2 * b.ffn.max(b.qkv.out))?;
    time_ms(gpu, s, iters, || {
        for l in [&b.qkv, &b.o, &b.gate_up, &b.down] {
            let bias =
                l.b.as_ref()
                    .map(|b| b as &dyn cudarc::driver::DevicePtr<bf16>);
            linear_fwd_bf16(gpu, s, &mut y, &x, &l.w, bias, rows, l.inp, l.out)?;
        }
        Ok(())
    })
}

/// Milliseconds of one block's attention (`attention_fwd_bf16` on `kernel`) over `seqs`,
/// reading q, k, v in place from a fused qkv buffer as the model does.
#[allow(clippy::too_many_arguments)]
fn attention_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    kernel: FwdKernel,
    seqs: &[AttnSeq],
    dims: AttnDims,
    mask: AttnMask,
    iters: usize,
) -> Result<f64> {
    let rows: usize = seqs.iter().map(|q| q.len as usize).sum();
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let row = qw + 2 * kvw;
    let qkv = s.alloc_zeros::<bf16>(rows * row)?;
    let mut out = s.alloc_zeros::<bf16>(rows * qw)?;
    let g: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
    let sd = s.clone_htod(&g)?;
    let maxq = seqs.iter().map(|q| q.len as usize).max().unwrap_or(0);
    let k = qkv.slice(qw..rows * row - kvw);
    let v = qkv.slice(qw + kvw..);
    let st = RowStrides {
        q: row,
        kv: row,
        prefix: row,
        out: qw,
    };
    let scale = 1.0 / (dims.head_dim as f32).sqrt();
    time_ms(gpu, s, iters, || {
        attention_fwd_bf16_with(
            kernel,
            gpu,
            s,
            &mut out,
            None,
            FwdInputs {
                q: &qkv,
                k: &k,
                v: &v,
                prefix_k: &k,
                prefix_v: &v,
                seqs: &sd,
                n_seqs: g.len(),
                max_q_len: maxq,
                dims,
                mask,
                scale,
                strides: st,
            },
        )?;
        Ok(())
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tl = arg(&args, "--text-layers", 4)? as u32;
    let vb = arg(&args, "--vision-blocks", 4)? as u32;
    let prompts = arg(&args, "--prompts", 8)?;
    let plen = arg(&args, "--prompt-len", 1024)?;
    let images = arg(&args, "--images", 2)?;
    let grid = arg(&args, "--grid", 64)? as u32;
    let iters = arg(&args, "--iters", 10)?;
    let gpu = Gpu::new(0).context("gpu_bench needs a CUDA device")?;
    let s = gpu.stream(0)?;
    let t0 = std::time::Instant::now();
    let model = Qwen25VL::random(widths::qwen3b_widths(tl, vb), 7)?;
    let gm = GpuModel::upload(&gpu, &s, &model)?;
    s.synchronize()?;
    println!(
        "device {}; model built and uploaded in {:.1} s ({:.2} GB of bf16 weights)",
        gpu.name(),
        t0.elapsed().as_secs_f64(),
        gm.weights.bytes as f64 / 1e9
    );
    let cfg = &model.config;
    let t = cfg.text();
    let (h, f, hd) = (
        t.hidden_size as f64,
        t.intermediate_size as f64,
        t.head_dim() as f64,
    );
    let (nq, nkv) = (t.num_heads as f64, t.num_kv_heads as f64);
    // ---- text prefill: `prompts` prompts of `plen` text tokens, packed
    let ids: Vec<Vec<u32>> = (0..prompts)
        .map(|p| {
            (0..plen)
                .map(|i| ((i * 7919 + p * 104729) % 150000) as u32)
                .collect()
        })
        .collect();
    let gp: Vec<GpuPrompt<'_>> = ids
        .iter()
        .map(|i| GpuPrompt { ids: i, media: &[] })
        .collect();
    let tokens = (prompts * plen) as f64;
    let lin_tok = 2.0 * (h * (nq + 2.0 * nkv) * hd + nq * hd * h + h * 2.0 * f + f * h);
    let pairs = prompts as f64 * (plen as f64 * (plen as f64 + 1.0) / 2.0);
    let text_flops = tl as f64 * (tokens * lin_tok + 4.0 * nq * hd * pairs)
        + prompts as f64 * 2.0 * h * t.vocab_size as f64;
    let text_gemm_flops = tl as f64 * tokens * lin_tok;
    let (ms, host_ms) = time_calls(&gpu, &s, iters, || {
        gm.prefill(&gpu, &s, &gp)?;
        Ok(())
    })?;
    println!(
        "prefill {prompts} x {plen} tokens, {tl} layers: {ms:.3} ms, {:.1} TFLOP/s (all), {:.1} TFLOP/s counting GEMMs only; {:.0} tokens/s/layer; host {host_ms:.3} ms inside the call",
        text_flops / ms / 1e9,
        text_gemm_flops / ms / 1e9,
        tokens * tl as f64 / ms * 1e3
    );
    let bb = back_to_back_ms(&gpu, &s, iters, || {
        gm.prefill(&gpu, &s, &gp)?;
        Ok(())
    })?;
    println!(
        "prefill back to back: {bb:.3} ms a call, {:.1} TFLOP/s (all)",
        text_flops / bb / 1e9
    );
    let gm_ms = tl as f64 * block_gemms_ms(&gpu, &s, &gm.weights.text[0], prompts * plen, iters)?;
    let tseqs: Vec<AttnSeq> = (0..prompts)
        .map(|p| AttnSeq {
            start: (p * plen) as u32,
            len: plen as u32,
            prefix_start: 0,
            prefix_len: 0,
        })
        .collect();
    let tdims = AttnDims {
        num_heads: t.num_heads as usize,
        num_kv_heads: t.num_kv_heads as usize,
        head_dim: t.head_dim() as usize,
    };
    let at = |k| attention_ms(&gpu, &s, k, &tseqs, tdims, AttnMask::Causal, iters);
    let at_ms = tl as f64 * at(FwdKernel::Auto)?;
    let simt_ms = tl as f64 * at(FwdKernel::Simt)?;
    let aflops = tl as f64 * 4.0 * nq * hd * pairs;
    println!(
        "  prefill parts: GEMMs {gm_ms:.3} ms ({:.1} TFLOP/s), attention {at_ms:.3} ms ({:.1} TFLOP/s; the SIMT kernel {simt_ms:.3} ms, {:.1} TFLOP/s), the rest (norms, rope, swiglu, copies, lm head, host work, launch gaps) {:.3} ms; back to back the rest is {:.3} ms",
        text_gemm_flops / gm_ms / 1e9,
        aflops / at_ms / 1e9,
        aflops / simt_ms / 1e9,
        ms - gm_ms - at_ms,
        bb - gm_ms - at_ms
    );
    // ---- vision: `images` images of grid [1, grid, grid]
    let v = cfg.vision();
    let pd = cfg.patch_dim();
    let n = (grid * grid) as usize;
    let px: Vec<f32> = (0..n * pd)
        .map(|i| ((i * 2654435761usize) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let items: Vec<MediaInput<'_>> = (0..images)
        .map(|_| MediaInput {
            kind: MediaKind::Image,
            pixels: &px,
            grid: [1, grid, grid],
        })
        .collect();
    let grids: Vec<[u32; 3]> = items.iter().map(|i| i.grid).collect();
    let plan = VisionPlan::new(cfg, &grids)?;
    let (vh, vi) = (v.hidden_size as f64, v.intermediate_size as f64);
    let np = plan.patches as f64;
    // per block
    let vlin = 2.0 * np * (vh * 3.0 * vh + vh * vh + vh * 2.0 * vi + vi * vh);
    let sq = |seqs: &[rollplex_kernels::cpu::AttnSeq]| -> f64 {
        seqs.iter().map(|s| (s.len as f64) * (s.len as f64)).sum()
    };
    let (wsq, fsq) = (sq(&plan.window_seqs), sq(&plan.full_seqs));
    let nfull = v.fullatt_block_indexes.len() as f64;
    let vattn = 4.0 * vh * ((vb as f64 - nfull) * wsq + nfull * fsq);
    let groups = np / 4.0;
    let merger = 2.0 * groups * (4.0 * vh * 4.0 * vh + 4.0 * vh * v.out_hidden_size as f64);
    let patch = 2.0 * np * vh * pd as f64;
    let vision_gemm = vb as f64 * vlin + merger + patch;
    let vision_flops = vision_gemm + vattn;
    let (ms, host_ms) = time_calls(&gpu, &s, iters, || {
        gm.encode_media(&gpu, &s, &items)?;
        Ok(())
    })?;
    println!(
        "vision {images} x [1, {grid}, {grid}] ({} patches), {vb} blocks: {ms:.3} ms, {:.1} TFLOP/s (all), {:.1} TFLOP/s counting GEMMs only; host {host_ms:.3} ms inside the call",
        plan.patches,
        vision_flops / ms / 1e9,
        vision_gemm / ms / 1e9
    );
    let vbb = back_to_back_ms(&gpu, &s, iters, || {
        gm.encode_media(&gpu, &s, &items)?;
        Ok(())
    })?;
    println!(
        "vision back to back: {vbb:.3} ms a call, {:.1} TFLOP/s (all)",
        vision_flops / vbb / 1e9
    );
    let vgm = vb as f64 * block_gemms_ms(&gpu, &s, &gm.weights.vision[0], plan.patches, iters)?;
    let vdims = AttnDims {
        num_heads: v.num_heads as usize,
        num_kv_heads: v.num_heads as usize,
        head_dim: cfg.vision_head_dim(),
    };
    let va = |k, seqs: &[AttnSeq]| attention_ms(&gpu, &s, k, seqs, vdims, AttnMask::Full, iters);
    let wat = va(FwdKernel::Auto, &plan.window_seqs)?;
    let fat = va(FwdKernel::Auto, &plan.full_seqs)?;
    let fat_simt = va(FwdKernel::Simt, &plan.full_seqs)?;
    let wat_simt = va(FwdKernel::Simt, &plan.window_seqs)?;
    let vat = (vb as f64 - nfull) * wat + nfull * fat;
    println!(
        "  vision parts: block GEMMs {vgm:.3} ms ({:.1} TFLOP/s), attention {vat:.3} ms (window block {wat:.3} ms, full block {fat:.3} ms = {:.1} TFLOP/s; all {:.1} TFLOP/s; SIMT: window {wat_simt:.3} ms, full {fat_simt:.3} ms), the rest (patch embed, merger, norms, rope, copies, host work) {:.3} ms; back to back the rest is {:.3} ms",
        vb as f64 * vlin / vgm / 1e9,
        4.0 * vh * fsq / fat / 1e9,
        vattn / vat / 1e9,
        ms - vgm - vat,
        vbb - vgm - vat
    );
    Ok(())
}
