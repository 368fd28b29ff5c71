//! Training the vision tower and merger on CUDA: a forward that keeps what backward needs, and
//! the backward from the gradient of the media embeddings into fp32 gradient sums per tensor.
//!
//! ```text
//! let (media, state) = gm.encode_media_train(&gpu, &s, &items, true)?;  // == encode_media, bitwise
//! // (tower = false: the merger trains alone, only the merger's input is kept)
//! // ... the decoder's forward and backward give d_embeds [state.tokens(), out_hidden] (bf16),
//! //     the media rows' gradient in item order, as the decoder reads the embeddings ...
//! let mut grads = VisionGrads::new(&gpu, &s, &cpu.weights.table, &cpu.weights.layout, true, true)?;
//! vision_backward(&gpu, &s, &gm, &state, &d_embeds, true, &mut grads)?;     // adds into grads
//! for g in grads.iter() { (g.name, g.shape, &g.grad, vision_weight(&gm.weights, g.slot), g.parts) }
//! ```
//!
//! What is kept (`Recompute::Full`, the GPU text trainer's policy): the permuted pixel rows (the
//! patch GEMM's input), each block's input, the merger's input, and the forward's device tables
//! (RoPE, sequences, window order). Backward recomputes each block from its kept input right
//! before its backward, and the merger from its input, with the forward's own launches (the
//! pieces of `vision.rs`), so the recomputed activations are bitwise the forward's.
//!
//! Backward, in order: the un-permute's adjoint (merged row `i` takes embedding row
//! `window_index[i]`: a row gather), fc2, `gelu_bwd_bf16` (exact erf), fc1, `ln_q`'s RMSNorm;
//! then, when the tower trains, the blocks top-down (down, SwiGLU, gate|up, norm2, proj,
//! attention with the block's own sequences: window or per frame as the forward, 2D RoPE's
//! transposed rotation, qkv, norm1), and the patch embedding's weight gradient `dx^T pix` over
//! the permuted rows. No un-permute is needed there: the weight gradient sums over rows, and the
//! kept pixels are in the same permuted order as `dx`. The patch embedding has no bias (Conv3d
//! without bias in Qwen2.5-VL; the CPU model has none).
//!
//! Numerics as the text trainer (`train/`): bf16 activations and activation gradients, fp32
//! math in every kernel; a weight gradient is one GEMM (`matmul_bf16_f32`, transposed A) adding
//! its fp32 product into the fp32 sum; a bias gradient is the same GEMM against a row of ones;
//! norm gradients are fp32 directly.
//!
//! Tensors ([`VisionSlot`], in [`vision_slots`]' fixed order, the CPU table's): the patch
//! embedding `[vision_hidden, patch_dim]` (the CPU's `[vh, C, T, P, P]`, same values); per block
//! norm1, norm2, qkv (`attn.qkv`: one CPU tensor, q|k|v by rows, fused on the device exactly as
//! on the CPU), proj, gate|up (fused on the device from the CPU's `mlp.gate_proj` and
//! `mlp.up_proj`, split by rows), down, each linear with its bias; the merger's `ln_q`, `mlp.0`
//! and `mlp.2` with biases. [`vision_cpu_parts`] says how a device tensor splits into the CPU
//! model's tensors, in `gpu::train`'s `cpu_parts` convention.
//!
//! Invariants: every launch runs on the caller's stream and nothing synchronises; gradients are
//! *added* (`+=`) in a fixed order (merger, then blocks top-down, then the patch embedding) with
//! kernels whose sums run in shape-fixed orders, so two runs give the same bits; tensors the
//! container does not hold are never written (a frozen merger gets no gradient, yet its input
//! gradient still flows into a trained tower); a state is valid only with the weights its
//! forward ran with (the caller's contract: no optimizer step between the two).

mod backward;
mod params;

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{CudaStream, Gpu};

use crate::model::{Grid, MediaInput, MediaKind};

use super::arena::{alloc_in, keep_in, DevBuf, Region};
use super::vision::{GpuEncodedMedia, VisionInputs};
use super::{GpuModel, Result};

pub(crate) use backward::vision_backward;
pub(crate) use params::VisionSink;
pub use params::{
    vision_cpu_parts, vision_host_values, vision_slot_meta, vision_slots, vision_weight,
    vision_weight_mut, VisionGrad, VisionGrads, VisionPart, VisionSlot,
};

/// What a training forward keeps for [`vision_backward`] (device buffers, freed on drop).
pub struct VisionTrainState {
    pub(super) kept: Option<Kept>,
    pub(super) items: Vec<(MediaKind, Grid, usize)>,
}

pub(super) struct Kept {
    /// The forward's tables (`window_index` uploaded).
    pub(super) inp: VisionInputs,
    /// Pixel rows in permuted order `[patches, patch_dim]` (the patch GEMM's input); only when
    /// the tower trains.
    pub(super) pix: Option<DevBuf<bf16>>,
    /// Each block's input `[patches, vh]`; empty unless the tower trains.
    pub(super) block_inputs: Vec<DevBuf<bf16>>,
    /// The merger's input `[patches, vh]` (the last block's output).
    pub(super) merger_in: DevBuf<bf16>,
}

impl VisionTrainState {
    /// Patches of all items.
    pub fn patches(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| k.inp.plan.patches)
    }
    /// Merged tokens of all items (the rows of `d_embeds`).
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|i| i.2).sum()
    }
    /// Per item (kind, grid, tokens), in order.
    pub fn items(&self) -> &[(MediaKind, Grid, usize)] {
        &self.items
    }
    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| {
            2 * (k.pix.as_ref().map_or(0, |p| p.len())
                + k.merger_in.len()
                + k.block_inputs.iter().map(|b| b.len()).sum::<usize>())
        })
    }
}

impl GpuModel {
    /// [`GpuModel::encode_media`] for training: the same embeddings (bitwise: the same launches
    /// on the same shapes, plus copies of each block's input) and the state
    /// [`vision_backward`] needs: the merger's input, and with `tower` (the tower trains, not
    /// only the merger) the pixel rows and every block's input too. Nothing synchronises.
    pub fn encode_media_train(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        items: &[MediaInput<'_>],
        tower: bool,
    ) -> Result<(Vec<GpuEncodedMedia>, VisionTrainState)> {
        self.encode_media_train_in(gpu, stream, items, tower, None)
    }

    /// [`GpuModel::encode_media_train`] with the kept state in `region` of the plan's arena
    /// (the group's part of `train_prefix.sS`; the pixel rows and the merger's input are
    /// copied there from the forward's buffers).
    pub fn encode_media_train_in(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        items: &[MediaInput<'_>],
        tower: bool,
        region: Option<&Region>,
    ) -> Result<(Vec<GpuEncodedMedia>, VisionTrainState)> {
        let unit = {
            let m = self.config.vision().spatial_merge_size as usize;
            m * m
        };
        let metas: Vec<(MediaKind, Grid, usize)> = items
            .iter()
            .map(|it| {
                let n = (it.grid[0] * it.grid[1] * it.grid[2]) as usize;
                (it.kind, it.grid, n / unit)
            })
            .collect();
        let Some((pix, inp)) = self.vision_inputs(gpu, stream, items, true)? else {
            let state = VisionTrainState {
                kept: None,
                items: metas,
            };
            return Ok((Vec::new(), state));
        };
        let n = inp.plan.patches;
        let vh = self.config.vision().hidden_size as usize;
        let mut x = self.vision_patch_embed(gpu, stream, &pix, n)?;
        let mut block_inputs = if tower {
            (0..self.weights.vision.len())
                .map(|_| alloc_in::<bf16>(gpu, stream, n * vh, region))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let keep = tower.then_some(&mut block_inputs[..]);
        self.vision_blocks(gpu, stream, &inp, &mut x, keep)?;
        let xn = self.vision_merger_norm(gpu, stream, &x, n, None)?;
        let out = self.vision_merger_mlp(gpu, stream, &inp, &xn, items, None)?;
        let state = VisionTrainState {
            kept: Some(Kept {
                inp,
                pix: if tower {
                    Some(keep_in(gpu, stream, pix, region)?)
                } else {
                    None
                },
                block_inputs,
                merger_in: keep_in(gpu, stream, x, region)?,
            }),
            items: metas,
        };
        Ok((out, state))
    }
}

#[cfg(test)]
mod tests;
