//! The vision tower on the device, as the CPU engine's `encode_media` (and Hugging Face's
//! `Qwen2_5_VisionTransformerPretrainedModel.forward`): patch embedding as one GEMM over the
//! flattened patches, blocks over window-permuted rows with 2D RoPE (f32 rotation, as HF's
//! vision rotary), window attention except at `fullatt_block_indexes` (attention within one
//! frame), merger (RMSNorm, `m²` patches per row, Linear-GELU-Linear), un-permute.
//!
//! The window permutation is applied to the pixel rows on the host before upload (the patch
//! embedding is row-wise, so this equals permuting its output) and undone on the device by a
//! row gather (`embedding_fwd_bf16` with the inverse permutation as ids).
//!
//! The pass is cut into pieces (`vision_inputs`, `vision_patch_embed`, `vision_blocks`,
//! `vision_merger_norm`, `vision_merger_mlp`) that the training forward and the backward's
//! recompute (`vision_train/`) call too, so their activations are bitwise these.

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::{
    attention_fwd_bf16, embedding_fwd_bf16, gelu_fwd_bf16, linear_fwd_bf16, rmsnorm_fwd_bf16,
    rope_fwd_bf16, AttnSeqGpu, CudaSlice, CudaStream, FwdInputs, Gpu,
};

use crate::model::config::VISION_RMS_EPS;
use crate::model::{EncodedMedia, Grid, MediaInput, MediaKind};

use super::arena::{alloc_in, DevBuf, Region};
use super::block::{linear, run_blocks_keeping, AttnStep};
use super::plan::VisionPlan;
use super::staging::staged_bytes;
use super::{alloc, download, GpuError, GpuModel, Result};
use rollplex_kernels::cuda::attention::RowStrides;

/// A media item encoded on the device, ready to fill its placeholder tokens.
pub struct GpuEncodedMedia {
    pub kind: MediaKind,
    pub grid: Grid,
    /// `[tokens, text_hidden]`.
    pub embeds: DevBuf<bf16>,
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

/// Vision attention: rotate q and k (f32), then full attention over each block's sequences
/// (per frame at `fullatt_block_indexes`, per window elsewhere).
pub(crate) struct VisionAttn<'a> {
    cfg_full: &'a [u32],
    cos: &'a CudaSlice<f32>,
    sin: &'a CudaSlice<f32>,
    full: (&'a CudaSlice<AttnSeqGpu>, usize, usize),
    window: (&'a CudaSlice<AttnSeqGpu>, usize, usize),
    dims: AttnDims,
    rows: usize,
}

impl VisionAttn<'_> {
    /// The 2D RoPE tables `[rows, head_dim]` (permuted rows).
    pub(crate) fn tables(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (self.cos, self.sin)
    }

    /// Block `layer`'s sequences on the device, their count and the longest.
    pub(crate) fn seqs(&self, layer: usize) -> (&CudaSlice<AttnSeqGpu>, usize, usize) {
        if self.cfg_full.contains(&(layer as u32)) {
            self.full
        } else {
            self.window
        }
    }

    /// The attention step of block `layer`: RoPE on q and k of the fused `qkv` in place, then
    /// attention into `out`, with the log-sum-exp `[rows, heads]` into `lse` when given (what
    /// the backward reads; the kernel and its bits do not depend on it).
    pub(crate) fn attend_lse(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        lse: Option<&mut CudaSlice<f32>>,
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
        let (seqs, n, maxq) = self.seqs(layer);
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
            lse.map(|l| l as &mut dyn DevicePtrMut<f32>),
            FwdInputs {
                q: qkv,
                k: &k,
                v: &v,
                prefix_k: &k,
                prefix_v: &v,
                seqs,
                n_seqs: n,
                max_q_len: maxq,
                dims: d,
                mask: AttnMask::Full,
                scale: 1.0 / (d.head_dim as f32).sqrt(),
                strides,
            },
        )?;
        Ok(())
    }
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
        self.attend_lse(gpu, stream, layer, qkv, out, None)
    }
}

/// One vision-tower pass's host tables on the device (the pixel rows are handed out apart by
/// [`GpuModel::vision_inputs`], so that `encode_media` can free them after the patch GEMM).
pub(crate) struct VisionInputs {
    pub plan: VisionPlan,
    /// 2D RoPE tables `[patches, head_dim]`, permuted rows.
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
    /// Per-frame and per-window sequences: (descriptors, count, longest).
    pub full: (CudaSlice<AttnSeqGpu>, usize, usize),
    pub window: (CudaSlice<AttnSeqGpu>, usize, usize),
    /// `plan.inverse`: merged row of each output token (the un-permute gather's ids).
    pub inv: CudaSlice<u32>,
    /// `plan.window_index`, uploaded only when asked for (the training backward's gather).
    pub window_index: Option<CudaSlice<u32>>,
    pub dims: AttnDims,
}

impl VisionInputs {
    /// The blocks' attention step over these tables.
    pub(crate) fn attn<'a>(&'a self, fullatt_block_indexes: &'a [u32]) -> VisionAttn<'a> {
        VisionAttn {
            cfg_full: fullatt_block_indexes,
            cos: &self.cos,
            sin: &self.sin,
            full: (&self.full.0, self.full.1, self.full.2),
            window: (&self.window.0, self.window.1, self.window.2),
            dims: self.dims,
            rows: self.plan.patches,
        }
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
        self.encode_media_in(gpu, stream, items, None)
    }

    /// [`GpuModel::encode_media`] with the embeddings in `region` of the plan's arena
    /// (`vision_emb`).
    pub fn encode_media_in(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        items: &[MediaInput<'_>],
        region: Option<&Region>,
    ) -> Result<Vec<GpuEncodedMedia>> {
        let Some((pix, inp)) = self.vision_inputs(gpu, stream, items, false)? else {
            return Ok(Vec::new());
        };
        let mut x = self.vision_patch_embed(gpu, stream, &pix, inp.plan.patches)?;
        drop(pix);
        self.vision_blocks(gpu, stream, &inp, &mut x, None)?;
        let xn = self.vision_merger_norm(gpu, stream, &x, inp.plan.patches, None)?;
        drop(x);
        self.vision_merger_mlp(gpu, stream, &inp, &xn, items, region)
    }

    /// Checks `items`, builds their [`VisionPlan`] and uploads its tables through the staging
    /// buffer before any launch: `(pixel rows in permuted order [patches, patch_dim] bf16,
    /// tables)`, or `None` when there are no patches.
    pub(crate) fn vision_inputs(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        items: &[MediaInput<'_>],
        with_window_index: bool,
    ) -> Result<Option<(CudaSlice<bf16>, VisionInputs)>> {
        let cfg = &self.config;
        let v = cfg.vision();
        let pd = cfg.patch_dim();
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
        if plan.patches == 0 {
            return Ok(None);
        }
        // patch embedding over permuted rows: [n, pd] x [vh, pd]^T
        let rows: Vec<&[f32]> = items.iter().map(|it| it.pixels).collect();
        let pix_host = plan.permute_rows_bf16(&rows, pd);
        let full_host: Vec<AttnSeqGpu> = plan.full_seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let window_host: Vec<AttnSeqGpu> =
            plan.window_seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        // every host table goes up before the first launch, through page-locked staging
        let mut bytes = staged_bytes(&pix_host)
            + staged_bytes(&plan.cos)
            + staged_bytes(&plan.sin)
            + staged_bytes(&full_host)
            + staged_bytes(&window_host)
            + staged_bytes(&plan.inverse);
        if with_window_index {
            bytes += staged_bytes(&plan.window_index);
        }
        let (pix, cos, sin, full_d, window_d, inv, window_index) = {
            let mut up = self.stage(stream, bytes)?;
            (
                up.put(gpu, &pix_host)?,
                up.put(gpu, &plan.cos)?,
                up.put(gpu, &plan.sin)?,
                up.put(gpu, &full_host)?,
                up.put(gpu, &window_host)?,
                up.put(gpu, &plan.inverse)?,
                if with_window_index {
                    Some(up.put(gpu, &plan.window_index)?)
                } else {
                    None
                },
            )
        };
        let maxq = |s: &[AttnSeq]| s.iter().map(|s| s.len as usize).max().unwrap_or(0);
        let full = (full_d, full_host.len(), maxq(&plan.full_seqs));
        let window = (window_d, window_host.len(), maxq(&plan.window_seqs));
        let dims = AttnDims {
            num_heads: v.num_heads as usize,
            num_kv_heads: v.num_heads as usize,
            head_dim: hd,
        };
        Ok(Some((
            pix,
            VisionInputs {
                plan,
                cos,
                sin,
                full,
                window,
                inv,
                window_index,
                dims,
            },
        )))
    }

    /// The patch embedding: `[n, vision_hidden]` from the permuted pixel rows `[n, patch_dim]`.
    pub(crate) fn vision_patch_embed(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        pix: &CudaSlice<bf16>,
        n: usize,
    ) -> Result<CudaSlice<bf16>> {
        let (pd, vh) = (
            self.config.patch_dim(),
            self.config.vision().hidden_size as usize,
        );
        let mut x = alloc::<bf16>(gpu, stream, n * vh)?;
        linear_fwd_bf16(
            gpu,
            stream,
            &mut x,
            pix,
            &self.weights.patch_embed,
            None,
            n,
            pd,
            vh,
        )?;
        Ok(x)
    }

    /// The vision blocks over `x [patches, vision_hidden]` in place (`x` ends as the merger's
    /// input), each block's input copied into `keep[block]` when given.
    pub(crate) fn vision_blocks(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        inp: &VisionInputs,
        x: &mut CudaSlice<bf16>,
        keep: Option<&mut [DevBuf<bf16>]>,
    ) -> Result<()> {
        let v = self.config.vision();
        let mut step = inp.attn(&v.fullatt_block_indexes);
        run_blocks_keeping(
            gpu,
            stream,
            &self.weights.vision,
            x,
            inp.plan.patches,
            v.hidden_size as usize,
            inp.dims,
            VISION_RMS_EPS,
            &mut step,
            keep,
            None,
        )
    }

    /// The merger's RMSNorm (`ln_q`) of `x [n, vision_hidden]`, its `1/rms` into `rstd` when
    /// given.
    pub(crate) fn vision_merger_norm(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        n: usize,
        rstd: Option<&mut CudaSlice<f32>>,
    ) -> Result<CudaSlice<bf16>> {
        let vh = self.config.vision().hidden_size as usize;
        let mut xn = alloc::<bf16>(gpu, stream, n * vh)?;
        rmsnorm_fwd_bf16(
            gpu,
            stream,
            &mut xn,
            rstd.map(|r| r as &mut dyn DevicePtrMut<f32>),
            x,
            &self.weights.merger_ln,
            n,
            vh,
            VISION_RMS_EPS,
        )?;
        Ok(xn)
    }

    /// The merger's MLP over the normed rows (`[n / m², vision_hidden m²]`: fc1, GELU, fc2),
    /// then the un-permute into one embedding buffer per item.
    pub(crate) fn vision_merger_mlp(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        inp: &VisionInputs,
        xn: &CudaSlice<bf16>,
        items: &[MediaInput<'_>],
        region: Option<&Region>,
    ) -> Result<Vec<GpuEncodedMedia>> {
        let w = &self.weights;
        let plan = &inp.plan;
        let groups = plan.patches / plan.unit;
        let mh = w.merger_fc1.out;
        let mut h1 = alloc::<bf16>(gpu, stream, groups * mh)?;
        linear(gpu, stream, &mut h1, xn, &w.merger_fc1, groups)?;
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
            let mut e = alloc_in::<bf16>(gpu, stream, toks * ow, region)?;
            let ids = inp.inv.slice(off..off + toks);
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
