//! The vision tower on the device, as the CPU engine's `encode_media` (and Hugging Face's
//! `Qwen2_5_VisionTransformerPretrainedModel.forward`): patch embedding as one GEMM over the
//! flattened patches, blocks over window-permuted rows with 2D RoPE (f32 rotation, as HF's
//! vision rotary), window attention except at `fullatt_block_indexes` (attention within one
//! frame), merger (RMSNorm, `m²` patches per row, Linear-GELU-Linear), un-permute.
//!
//! The window permutation is applied to the pixel rows on the host before upload (the patch
//! embedding is row-wise, so this equals permuting its output) and undone on the device by a
//! row gather (`embedding_fwd_bf16` with the inverse permutation as ids).

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::{
    attention_fwd_bf16, embedding_fwd_bf16, gelu_fwd_bf16, linear_fwd_bf16, rmsnorm_fwd_bf16,
    rope_fwd_bf16, AttnSeqGpu, CudaSlice, CudaStream, Gpu,
};

use crate::model::config::VISION_RMS_EPS;
use crate::model::{EncodedMedia, Grid, MediaInput, MediaKind};

use super::block::{linear, run_blocks, AttnStep};
use super::plan::VisionPlan;
use super::staging::staged_bytes;
use super::{alloc, download, GpuError, GpuModel, Result};
use rollplex_kernels::cuda::attention::RowStrides;

/// A media item encoded on the device, ready to fill its placeholder tokens.
pub struct GpuEncodedMedia {
    pub kind: MediaKind,
    pub grid: Grid,
    /// `[tokens, text_hidden]`.
    pub embeds: CudaSlice<bf16>,
    pub tokens: usize,
}

impl GpuEncodedMedia {
    /// The embeddings on the host, as the CPU engine's [`EncodedMedia`] (synchronises).
    pub fn to_host(&self, stream: &Arc<CudaStream>) -> Result<EncodedMedia> {
        let e = download(stream, &self.embeds)?;
        Ok(EncodedMedia {
            kind: self.kind,
            grid: self.grid,
            embeds: e.iter().map(|x| x.to_f32()).collect(),
        })
    }
}

/// Vision attention: rotate q and k (f32), then full attention over each block's sequences.
struct VisionAttn<'a> {
    cfg_full: &'a [u32],
    cos: &'a CudaSlice<f32>,
    sin: &'a CudaSlice<f32>,
    full: (&'a CudaSlice<AttnSeqGpu>, usize, usize),
    window: (&'a CudaSlice<AttnSeqGpu>, usize, usize),
    dims: AttnDims,
    rows: usize,
}

impl AttnStep for VisionAttn<'_> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let d = self.dims;
        let (qw, kvw) = (d.q_width(), d.kv_width());
        let row = qw + 2 * kvw;
        rope_fwd_bf16(
            gpu,
            stream,
            qkv,
            self.cos,
            self.sin,
            self.rows,
            row,
            d.num_heads + d.num_kv_heads,
            d.head_dim,
            false,
        )?;
        let (seqs, n, maxq) = if self.cfg_full.contains(&(layer as u32)) {
            self.full
        } else {
            self.window
        };
        let k = qkv.slice(qw..qkv.len() - kvw);
        let v = qkv.slice(qw + kvw..);
        let strides = RowStrides {
            q: row,
            kv: row,
            prefix: row,
            out: qw,
        };
        attention_fwd_bf16(
            gpu,
            stream,
            out,
            None,
            qkv,
            &k,
            &v,
            &k,
            &v,
            seqs,
            n,
            maxq,
            d,
            AttnMask::Full,
            1.0 / (d.head_dim as f32).sqrt(),
            strides,
        )?;
        Ok(())
    }
}

impl GpuModel {
    /// Encodes media items (one vision-tower pass over all of them) on `stream`. The
    /// embeddings stay on the device; nothing synchronises.
    pub fn encode_media(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        items: &[MediaInput<'_>],
    ) -> Result<Vec<GpuEncodedMedia>> {
        let cfg = &self.config;
        let v = cfg.vision();
        let pd = cfg.patch_dim();
        let vh = v.hidden_size as usize;
        let hd = cfg.vision_head_dim();
        if !hd.is_multiple_of(16) {
            return Err(GpuError::Unsupported(format!(
                "vision head_dim {hd}: the CUDA attention kernel needs a multiple of 16"
            )));
        }
        let grids: Vec<Grid> = items.iter().map(|it| it.grid).collect();
        let plan = VisionPlan::new(cfg, &grids)?;
        for (i, it) in items.iter().enumerate() {
            let n = (it.grid[0] * it.grid[1] * it.grid[2]) as usize;
            if it.pixels.len() != n * pd {
                return Err(GpuError::Input(format!(
                    "media item {i}: {} pixel values, expected {n} patches x {pd} = {}",
                    it.pixels.len(),
                    n * pd
                )));
            }
        }
        let n = plan.patches;
        if n == 0 {
            return Ok(Vec::new());
        }
        let w = &self.weights;
        // patch embedding over permuted rows: [n, pd] x [vh, pd]^T
        let rows: Vec<&[f32]> = items.iter().map(|it| it.pixels).collect();
        let pix_host = plan.permute_rows_bf16(&rows, pd);
        let full_host: Vec<AttnSeqGpu> = plan.full_seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let window_host: Vec<AttnSeqGpu> =
            plan.window_seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        // every host table goes up before the first launch, through page-locked staging
        let bytes = staged_bytes(&pix_host)
            + staged_bytes(&plan.cos)
            + staged_bytes(&plan.sin)
            + staged_bytes(&full_host)
            + staged_bytes(&window_host)
            + staged_bytes(&plan.inverse);
        let (pix, cos, sin, full_d, window_d, inv) = {
            let mut up = self.stage(stream, bytes)?;
            (
                up.put(gpu, &pix_host)?,
                up.put(gpu, &plan.cos)?,
                up.put(gpu, &plan.sin)?,
                up.put(gpu, &full_host)?,
                up.put(gpu, &window_host)?,
                up.put(gpu, &plan.inverse)?,
            )
        };
        let maxq = |s: &[AttnSeq]| s.iter().map(|s| s.len as usize).max().unwrap_or(0);
        let full = (full_d, full_host.len(), maxq(&plan.full_seqs));
        let window = (window_d, window_host.len(), maxq(&plan.window_seqs));
        let mut x = alloc::<bf16>(gpu, stream, n * vh)?;
        linear_fwd_bf16(gpu, stream, &mut x, &pix, &w.patch_embed, None, n, pd, vh)?;
        drop(pix);
        let dims = AttnDims {
            num_heads: v.num_heads as usize,
            num_kv_heads: v.num_heads as usize,
            head_dim: hd,
        };
        let mut step = VisionAttn {
            cfg_full: &v.fullatt_block_indexes,
            cos: &cos,
            sin: &sin,
            full: (&full.0, full.1, full.2),
            window: (&window.0, window.1, window.2),
            dims,
            rows: n,
        };
        run_blocks(
            gpu,
            stream,
            &w.vision,
            &mut x,
            n,
            vh,
            dims,
            VISION_RMS_EPS,
            &mut step,
        )?;
        // merger: RMSNorm, [n / m², vh m²] rows, fc1, GELU, fc2
        let mut xn = alloc::<bf16>(gpu, stream, n * vh)?;
        rmsnorm_fwd_bf16(
            gpu,
            stream,
            &mut xn,
            None,
            &x,
            &w.merger_ln,
            n,
            vh,
            VISION_RMS_EPS,
        )?;
        drop(x);
        let groups = n / plan.unit;
        let mh = w.merger_fc1.out;
        let mut h1 = alloc::<bf16>(gpu, stream, groups * mh)?;
        linear(gpu, stream, &mut h1, &xn, &w.merger_fc1, groups)?;
        let mut g = alloc::<bf16>(gpu, stream, groups * mh)?;
        gelu_fwd_bf16(gpu, stream, &mut g, &h1, groups * mh, false)?;
        let ow = w.merger_fc2.out;
        let mut merged = alloc::<bf16>(gpu, stream, groups * ow)?;
        linear(gpu, stream, &mut merged, &g, &w.merger_fc2, groups)?;
        // un-permute: row r of the output is merged row inverse[r]
        let mut out = Vec::with_capacity(items.len());
        let mut off = 0usize;
        for it in items {
            let toks = (it.grid[0] * it.grid[1] * it.grid[2]) as usize / plan.unit;
            let mut e = alloc::<bf16>(gpu, stream, toks * ow)?;
            let ids = inv.slice(off..off + toks);
            embedding_fwd_bf16(gpu, stream, &mut e, &merged, &ids, toks, ow, ow)?;
            out.push(GpuEncodedMedia {
                kind: it.kind,
                grid: it.grid,
                embeds: e,
                tokens: toks,
            });
            off += toks;
        }
        // the temporaries above are freed in stream order after the gathers
        Ok(out)
    }
}
