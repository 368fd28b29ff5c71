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
//! Numerics as the text trainer (`train.rs`): bf16 activations and activation gradients, fp32
//! math in every kernel; a weight gradient is a bf16 GEMM (`matmul_bf16`, transposed A) added
//! into its fp32 sum (`grad_accumulate_f32`); a bias gradient is the same GEMM against a row of
//! ones; norm gradients are fp32 directly.
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

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::attention_bwd_tc::{bwd_kernel_for, BwdKernel, TC_BWD_HEAD_DIMS};
use rollplex_kernels::cuda::{
    add_rmsnorm_fwd_bf16, attention_bwd_bf16_with, embedding_fwd_bf16, gelu_bwd_bf16,
    gelu_fwd_bf16, grad_accumulate_f32, kv_append_bf16, matmul_bf16, rmsnorm_bwd_bf16,
    rmsnorm_fwd_bf16, rope_bwd_bf16, swiglu_fwd_bf16, CudaSlice, CudaStream, Gpu,
};

use crate::model::config::VISION_RMS_EPS;
use crate::model::weights::{Layout, Linear, ParamTable};
use crate::model::{Grid, MediaInput, MediaKind, ParamId, Qwen25VL};

use super::arena::{alloc_in, keep_in, DevBuf, Region};
use super::block::linear;
use super::block_bwd::{linear_grads, BlockBwd, BlockTensor, GradSink, MlpSaved};
use super::train::Lin;
use super::vision::{GpuEncodedMedia, VisionAttn, VisionInputs};
use super::weights::{fuse_linears, GpuBlock, GpuLinear, GpuWeights};
use super::{alloc, download, upload, GpuError, GpuModel, Result};

// ---------------------------------------------------------------- tensors

/// A trained tensor of the vision tower or merger, as the device holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisionSlot {
    /// `[vision_hidden, patch_dim]`.
    PatchEmbed,
    Norm1(usize),
    Norm2(usize),
    /// A block's linear: `Qkv` (`attn.qkv`), `O` (`attn.proj`), `GateUp` (fused), `Down`.
    Weight(usize, Lin),
    Bias(usize, Lin),
    /// `merger.ln_q`.
    MergerLn,
    /// `merger.mlp.0` (fc1) and `merger.mlp.2` (fc2).
    MergerFc1,
    MergerFc1Bias,
    MergerFc2,
    MergerFc2Bias,
}

impl VisionSlot {
    /// Whether the tensor belongs to the tower (`freeze_vision`) rather than the merger.
    pub fn in_tower(self) -> bool {
        !matches!(
            self,
            VisionSlot::MergerLn
                | VisionSlot::MergerFc1
                | VisionSlot::MergerFc1Bias
                | VisionSlot::MergerFc2
                | VisionSlot::MergerFc2Bias
        )
    }
}

/// The CPU model's linears a block's device linear is made of (as `GpuWeights::upload` fuses).
fn block_parts(layout: &Layout, block: usize, k: Lin) -> Vec<Linear> {
    let p = &layout.vision_blocks[block];
    match k {
        Lin::Qkv => vec![p.q, p.k, p.v],
        Lin::O => vec![p.o],
        Lin::GateUp => vec![p.gate, p.up],
        Lin::Down => vec![p.down],
    }
}

const LINS: [Lin; 4] = [Lin::Qkv, Lin::O, Lin::GateUp, Lin::Down];

/// The vision tensors trained, in a fixed order (the CPU table's): with `tower`, the patch
/// embedding, then per block norm1, norm2 and each linear (qkv, proj, gate|up, down) followed by
/// its bias; with `merger`, `ln_q`, fc1, its bias, fc2, its bias. A bias slot exists when a part
/// of the linear has a bias (as `fuse_linears`).
pub fn vision_slots(layout: &Layout, tower: bool, merger: bool) -> Vec<VisionSlot> {
    let mut s = Vec::new();
    if tower {
        s.push(VisionSlot::PatchEmbed);
        for b in 0..layout.vision_blocks.len() {
            s.push(VisionSlot::Norm1(b));
            s.push(VisionSlot::Norm2(b));
            for k in LINS {
                s.push(VisionSlot::Weight(b, k));
                if block_parts(layout, b, k).iter().any(|l| l.b.is_some()) {
                    s.push(VisionSlot::Bias(b, k));
                }
            }
        }
    }
    if merger {
        s.push(VisionSlot::MergerLn);
        s.push(VisionSlot::MergerFc1);
        if layout.merger_fc1.b.is_some() {
            s.push(VisionSlot::MergerFc1Bias);
        }
        s.push(VisionSlot::MergerFc2);
        if layout.merger_fc2.b.is_some() {
            s.push(VisionSlot::MergerFc2Bias);
        }
    }
    s
}

/// `(param id, first row, rows)` entries of a fused linear's weight (`bias = false`) or bias:
/// parts that share one CPU tensor (the vision qkv) are that whole tensor; other parts are
/// whole CPU tensors at their row offset in the fused one.
fn linear_parts(parts: &[Linear], bias: bool) -> Vec<(ParamId, usize, usize)> {
    let id_of = |l: &Linear| if bias { l.b } else { Some(l.w) };
    if let Some(first) = id_of(&parts[0]) {
        if parts.iter().all(|l| id_of(l) == Some(first)) {
            return vec![(first, 0, 0)];
        }
    }
    let mut row = 0;
    parts
        .iter()
        .filter_map(|l| {
            let r = id_of(l).map(|id| (id, row, l.out));
            row += l.out;
            r
        })
        .collect()
}

/// The CPU model's tensors a device tensor splits into, in `gpu::train`'s `cpu_parts`
/// convention: `(param id, first row, rows)` of the fused tensor, `rows = 0` meaning the whole
/// device tensor is that one CPU tensor (the qkv of a vision block: the CPU holds it fused too;
/// the patch embedding: `[vh, C, T, P, P]` read as `[vh, patch_dim]`). gate|up splits into
/// `gate_proj` (rows `0..F`) and `up_proj` (rows `F..2F`).
pub fn vision_cpu_parts(layout: &Layout, s: VisionSlot) -> Vec<(ParamId, usize, usize)> {
    match s {
        VisionSlot::PatchEmbed => vec![(layout.patch_embed, 0, 0)],
        VisionSlot::Norm1(b) => vec![(layout.vision_blocks[b].norm1, 0, 0)],
        VisionSlot::Norm2(b) => vec![(layout.vision_blocks[b].norm2, 0, 0)],
        VisionSlot::Weight(b, k) => linear_parts(&block_parts(layout, b, k), false),
        VisionSlot::Bias(b, k) => linear_parts(&block_parts(layout, b, k), true),
        VisionSlot::MergerLn => vec![(layout.merger_ln, 0, 0)],
        VisionSlot::MergerFc1 => linear_parts(&[layout.merger_fc1], false),
        VisionSlot::MergerFc1Bias => linear_parts(&[layout.merger_fc1], true),
        VisionSlot::MergerFc2 => linear_parts(&[layout.merger_fc2], false),
        VisionSlot::MergerFc2Bias => linear_parts(&[layout.merger_fc2], true),
    }
}

/// A device tensor's name (its CPU tensor's; a fused gate|up is named by `gate_proj`, as
/// `gpu::train` names fused tensors by their first part) and shape on the device.
pub fn vision_slot_meta(
    table: &ParamTable,
    layout: &Layout,
    s: VisionSlot,
) -> (String, Vec<usize>) {
    let first = vision_cpu_parts(layout, s)[0].0;
    let e = table.entry(first);
    let lin = |l: &[Linear], bias: bool| {
        let out: usize = l.iter().map(|p| p.out).sum();
        if bias {
            vec![out]
        } else {
            vec![out, l[0].inp]
        }
    };
    let shape = match s {
        VisionSlot::PatchEmbed => vec![e.shape[0], e.len / e.shape[0].max(1)],
        VisionSlot::Norm1(_) | VisionSlot::Norm2(_) | VisionSlot::MergerLn => e.shape.clone(),
        VisionSlot::Weight(b, k) => lin(&block_parts(layout, b, k), false),
        VisionSlot::Bias(b, k) => lin(&block_parts(layout, b, k), true),
        VisionSlot::MergerFc1 => lin(&[layout.merger_fc1], false),
        VisionSlot::MergerFc1Bias => lin(&[layout.merger_fc1], true),
        VisionSlot::MergerFc2 => lin(&[layout.merger_fc2], false),
        VisionSlot::MergerFc2Bias => lin(&[layout.merger_fc2], true),
    };
    (e.name.clone(), shape)
}

/// The fp32 values of a device tensor from the CPU model (fused as `GpuWeights::upload`
/// fuses; a missing part bias is zero): the optimizer's master weights start from these.
pub fn vision_host_values(model: &Qwen25VL, s: VisionSlot) -> Vec<f32> {
    let w = &model.weights;
    let l = &w.layout;
    let lin = |parts: &[Linear], bias: bool| {
        let refs: Vec<&Linear> = parts.iter().collect();
        let (wt, b, _) = fuse_linears(w, &refs);
        if bias {
            b.unwrap_or_default()
        } else {
            wt
        }
    };
    match s {
        VisionSlot::PatchEmbed => w.get(l.patch_embed).to_vec(),
        VisionSlot::Norm1(b) => w.get(l.vision_blocks[b].norm1).to_vec(),
        VisionSlot::Norm2(b) => w.get(l.vision_blocks[b].norm2).to_vec(),
        VisionSlot::Weight(b, k) => lin(&block_parts(l, b, k), false),
        VisionSlot::Bias(b, k) => lin(&block_parts(l, b, k), true),
        VisionSlot::MergerLn => w.get(l.merger_ln).to_vec(),
        VisionSlot::MergerFc1 => lin(&[l.merger_fc1], false),
        VisionSlot::MergerFc1Bias => lin(&[l.merger_fc1], true),
        VisionSlot::MergerFc2 => lin(&[l.merger_fc2], false),
        VisionSlot::MergerFc2Bias => lin(&[l.merger_fc2], true),
    }
}

fn block_lin(b: &GpuBlock, k: Lin) -> &GpuLinear {
    match k {
        Lin::Qkv => &b.qkv,
        Lin::O => &b.o,
        Lin::GateUp => &b.gate_up,
        Lin::Down => &b.down,
    }
}

fn block_lin_mut(b: &mut GpuBlock, k: Lin) -> &mut GpuLinear {
    match k {
        Lin::Qkv => &mut b.qkv,
        Lin::O => &mut b.o,
        Lin::GateUp => &mut b.gate_up,
        Lin::Down => &mut b.down,
    }
}

/// The bf16 compute copy of a vision tensor on the device (the buffer the forward reads, the
/// one an optimizer step writes); `None` for a bias the device linear lacks.
pub fn vision_weight(w: &GpuWeights, s: VisionSlot) -> Option<&DevBuf<bf16>> {
    match s {
        VisionSlot::PatchEmbed => Some(&w.patch_embed),
        VisionSlot::Norm1(b) => w.vision.get(b).map(|x| &x.norm1),
        VisionSlot::Norm2(b) => w.vision.get(b).map(|x| &x.norm2),
        VisionSlot::Weight(b, k) => w.vision.get(b).map(|x| &block_lin(x, k).w),
        VisionSlot::Bias(b, k) => w.vision.get(b).and_then(|x| block_lin(x, k).b.as_ref()),
        VisionSlot::MergerLn => Some(&w.merger_ln),
        VisionSlot::MergerFc1 => Some(&w.merger_fc1.w),
        VisionSlot::MergerFc1Bias => w.merger_fc1.b.as_ref(),
        VisionSlot::MergerFc2 => Some(&w.merger_fc2.w),
        VisionSlot::MergerFc2Bias => w.merger_fc2.b.as_ref(),
    }
}

/// [`vision_weight`], writable (for the optimizer's bf16 copy and checkpoint restores).
pub fn vision_weight_mut(w: &mut GpuWeights, s: VisionSlot) -> Option<&mut DevBuf<bf16>> {
    match s {
        VisionSlot::PatchEmbed => Some(&mut w.patch_embed),
        VisionSlot::Norm1(b) => w.vision.get_mut(b).map(|x| &mut x.norm1),
        VisionSlot::Norm2(b) => w.vision.get_mut(b).map(|x| &mut x.norm2),
        VisionSlot::Weight(b, k) => w.vision.get_mut(b).map(|x| &mut block_lin_mut(x, k).w),
        VisionSlot::Bias(b, k) => w
            .vision
            .get_mut(b)
            .and_then(|x| block_lin_mut(x, k).b.as_mut()),
        VisionSlot::MergerLn => Some(&mut w.merger_ln),
        VisionSlot::MergerFc1 => Some(&mut w.merger_fc1.w),
        VisionSlot::MergerFc1Bias => w.merger_fc1.b.as_mut(),
        VisionSlot::MergerFc2 => Some(&mut w.merger_fc2.w),
        VisionSlot::MergerFc2Bias => w.merger_fc2.b.as_mut(),
    }
}

/// A CPU-model tensor inside a device tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionPart {
    pub id: ParamId,
    /// The CPU model's (Hugging Face) name, `model.visual.*`.
    pub name: String,
    /// The CPU model's shape (the patch embedding: `[vh, C, T, P, P]`).
    pub shape: Vec<usize>,
    /// Its elements in the device tensor.
    pub range: Range<usize>,
}

/// Element ranges of [`vision_cpu_parts`] entries in a device tensor of `numel` values.
fn part_ranges(
    table: &ParamTable,
    parts: &[(ParamId, usize, usize)],
    numel: usize,
) -> Result<Vec<VisionPart>> {
    parts
        .iter()
        .map(|&(id, row0, rows)| {
            let e = table.entry(id);
            let range = match e.len.checked_div(rows) {
                Some(width) => row0 * width..(row0 + rows) * width,
                None => 0..e.len,
            };
            if range.len() != e.len || range.end > numel {
                return Err(GpuError::Input(format!(
                    "tensor {} ({} values) does not fit elements {range:?} of a device tensor of \
                     {numel}",
                    e.name, e.len
                )));
            }
            Ok(VisionPart {
                id,
                name: e.name.clone(),
                shape: e.shape.clone(),
                range,
            })
        })
        .collect()
}

/// The fp32 gradient sum of one device tensor.
pub struct VisionGrad {
    pub slot: VisionSlot,
    /// The device tensor's name (see [`vision_slots`]; fused gate|up: `gate_proj`'s).
    pub name: String,
    /// The device shape (`[vh, patch_dim]`, `[2F, vh]` for gate|up).
    pub shape: Vec<usize>,
    pub numel: usize,
    /// `[numel]`, fp32, added into by [`vision_backward`].
    pub grad: CudaSlice<f32>,
    /// The CPU tensors it splits into (one for every tensor but gate|up and its bias).
    pub parts: Vec<VisionPart>,
}

/// The fp32 gradient sums of the trained vision and merger tensors, in [`vision_slots`] order.
pub struct VisionGrads {
    t: Vec<VisionGrad>,
}

impl GradSink<VisionSlot> for VisionGrads {
    fn grad(&mut self, s: VisionSlot) -> Result<&mut CudaSlice<f32>> {
        self.grad_mut(s)
    }
}

impl GradSink<BlockTensor> for VisionGrads {
    fn grad(&mut self, t: BlockTensor) -> Result<&mut CudaSlice<f32>> {
        self.grad_mut(match t {
            BlockTensor::Weight(l, k) => VisionSlot::Weight(l, k),
            BlockTensor::Bias(l, k) => VisionSlot::Bias(l, k),
            BlockTensor::Norm1(l) => VisionSlot::Norm1(l),
            BlockTensor::Norm2(l) => VisionSlot::Norm2(l),
        })
    }
}

/// Where [`vision_backward`] adds its gradients: the fp32 sum of a vision tensor by its slot,
/// a block's tensors by [`BlockTensor`] (the tower's blocks), and which tensors are held.
/// [`VisionGrads`] is one; the CUDA trainer's own sums are another (`gpu::train`).
pub(crate) trait VisionSink: GradSink<VisionSlot> + GradSink<BlockTensor> {
    /// Whether the tower's tensors / the merger's are held.
    fn holds_tower(&self) -> bool;
    fn holds_merger(&self) -> bool;
    /// Elements of the largest tensor held (sizes the weight-gradient scratch).
    fn max_numel(&self) -> usize;
}

impl VisionSink for VisionGrads {
    fn holds_tower(&self) -> bool {
        self.t.iter().any(|t| t.slot.in_tower())
    }
    fn holds_merger(&self) -> bool {
        self.t.iter().any(|t| !t.slot.in_tower())
    }
    fn max_numel(&self) -> usize {
        self.t.iter().map(|g| g.numel).max().unwrap_or(1)
    }
}

impl VisionGrads {
    /// Zeroed sums for the tower's tensors (`tower`) and the merger's (`merger`) of a model
    /// with this CPU table and layout (the model the `GpuModel` was uploaded from).
    pub fn new(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        table: &ParamTable,
        layout: &Layout,
        tower: bool,
        merger: bool,
    ) -> Result<Self> {
        let mut t = Vec::new();
        for slot in vision_slots(layout, tower, merger) {
            let (name, shape) = vision_slot_meta(table, layout, slot);
            let numel: usize = shape.iter().product();
            let parts = part_ranges(table, &vision_cpu_parts(layout, slot), numel)?;
            let mut grad = alloc::<f32>(gpu, stream, numel.max(1))?;
            stream.memset_zeros(&mut grad)?;
            t.push(VisionGrad {
                slot,
                name,
                shape,
                numel,
                grad,
                parts,
            });
        }
        Ok(VisionGrads { t })
    }

    /// The tensors in order.
    pub fn iter(&self) -> impl Iterator<Item = &VisionGrad> {
        self.t.iter()
    }

    /// Each tensor with its device weight (the bf16 compute copy), in order.
    pub fn iter_with_weights<'a>(
        &'a self,
        w: &'a GpuWeights,
    ) -> impl Iterator<Item = (&'a VisionGrad, Option<&'a DevBuf<bf16>>)> {
        self.t.iter().map(move |g| (g, vision_weight(w, g.slot)))
    }

    pub fn get(&self, s: VisionSlot) -> Option<&VisionGrad> {
        self.t.iter().find(|t| t.slot == s)
    }

    fn grad_mut(&mut self, s: VisionSlot) -> Result<&mut CudaSlice<f32>> {
        self.t
            .iter_mut()
            .find(|t| t.slot == s)
            .map(|t| &mut t.grad)
            .ok_or_else(|| GpuError::Input(format!("no vision gradient buffer for {s:?}")))
    }

    /// Zeroes every sum (stream-ordered).
    pub fn zero(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        for t in self.t.iter_mut() {
            stream.memset_zeros(&mut t.grad)?;
        }
        Ok(())
    }

    /// The sums in the CPU model's layout: a `table.total()` buffer, fused tensors split into
    /// their parts, every tensor not held zero. Synchronises.
    pub fn to_host(&self, stream: &Arc<CudaStream>, table: &ParamTable) -> Result<Vec<f32>> {
        let mut out = vec![0f32; table.total()];
        for t in &self.t {
            let g = download(stream, &t.grad)?;
            for p in &t.parts {
                let e = table.entry(p.id);
                out[e.offset..e.offset + e.len].copy_from_slice(&g[p.range.clone()]);
            }
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------- forward

/// What a training forward keeps for [`vision_backward`] (device buffers, freed on drop).
pub struct VisionTrainState {
    kept: Option<Kept>,
    items: Vec<(MediaKind, Grid, usize)>,
}

struct Kept {
    /// The forward's tables (`window_index` uploaded).
    inp: VisionInputs,
    /// Pixel rows in permuted order `[patches, patch_dim]` (the patch GEMM's input); only when
    /// the tower trains.
    pix: Option<DevBuf<bf16>>,
    /// Each block's input `[patches, vh]`; empty unless the tower trains.
    block_inputs: Vec<DevBuf<bf16>>,
    /// The merger's input `[patches, vh]` (the last block's output).
    merger_in: DevBuf<bf16>,
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

// ---------------------------------------------------------------- backward

/// One block's activations, recomputed from its input.
struct BlockActs {
    xn1: CudaSlice<bf16>,
    rstd1: CudaSlice<f32>,
    /// `[rows, (h + 2 kvh) hd]` after RoPE (q and k rotated).
    qkv: CudaSlice<bf16>,
    att: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    x_mid: CudaSlice<bf16>,
    delta: CudaSlice<bf16>,
    xn2: CudaSlice<bf16>,
    rstd2: CudaSlice<f32>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
}

impl BlockActs {
    fn new(gpu: &Gpu, s: &Arc<CudaStream>, b: &GpuBlock, c: &Ctx<'_>) -> Result<Self> {
        let (rows, h) = (c.rows, c.hidden);
        Ok(BlockActs {
            xn1: alloc(gpu, s, rows * h)?,
            rstd1: alloc(gpu, s, rows)?,
            qkv: alloc(gpu, s, rows * b.qkv.out)?,
            att: alloc(gpu, s, rows * c.dims.q_width())?,
            lse: alloc(gpu, s, rows * c.dims.num_heads)?,
            x_mid: alloc(gpu, s, rows * h)?,
            delta: alloc(gpu, s, rows * h)?,
            xn2: alloc(gpu, s, rows * h)?,
            rstd2: alloc(gpu, s, rows)?,
            gu: alloc(gpu, s, rows * 2 * b.ffn)?,
            act: alloc(gpu, s, rows * b.ffn)?,
        })
    }
}

/// What every block's backward shares.
struct Ctx<'a> {
    rows: usize,
    hidden: usize,
    dims: AttnDims,
    attn: VisionAttn<'a>,
    iota: &'a CudaSlice<u32>,
    /// `0..rows * num_heads`, for padding the attention heads ([`repad_heads`]).
    head_iota: &'a CudaSlice<u32>,
    ones: &'a CudaSlice<bf16>,
}

/// The dims the attention backward of `d` runs at on the tensor cores when `d`'s head_dim is
/// one they do not take (the vision tower's 80): the smallest supported head_dim above it,
/// heads zero-padded to it. Zero columns add exact zeros to every fp32 sum of q.k and
/// dout.out and give zero gradient columns, so the real columns are what a tensor-core kernel
/// at `d` would compute. None: `d` runs as it is (the tensor cores take it, or neither takes
/// the padded case: grid limits), on the kernel `Auto` picks.
fn tc_padded_dims(d: AttnDims, n_seqs: usize) -> Option<AttnDims> {
    if bwd_kernel_for(&d, RowStrides::contiguous(d), n_seqs) == BwdKernel::TensorCores {
        return None;
    }
    TC_BWD_HEAD_DIMS
        .iter()
        .filter(|&&hd| hd > d.head_dim)
        .map(|&head_dim| AttnDims { head_dim, ..d })
        .find(|p| bwd_kernel_for(p, RowStrides::contiguous(*p), n_seqs) == BwdKernel::TensorCores)
}

/// `x` (`heads` heads of `from` values, one after the other) with each head cut or zero-padded
/// to `to` values.
fn repad_heads(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &CudaSlice<bf16>,
    heads: usize,
    from: usize,
    to: usize,
    iota: &CudaSlice<u32>,
) -> Result<CudaSlice<bf16>> {
    let mut out = if to > from {
        s.alloc_zeros::<bf16>(heads * to)?
    } else {
        alloc::<bf16>(gpu, s, heads * to)?
    };
    kv_append_bf16(gpu, s, &mut out, x, iota, heads, from.min(to), from, to)?;
    Ok(out)
}

/// One vision block's attention backward over contiguous rows (no sequence has a prefix).
struct AttnBwd<'a, S> {
    gpu: &'a Gpu,
    s: &'a Arc<CudaStream>,
    rows: usize,
    seqs: &'a S,
    n_seqs: usize,
    scale: f32,
}

impl<S: DevicePtr<rollplex_kernels::cuda::attention::AttnSeqGpu>> AttnBwd<'_, S> {
    /// `(dq, dk, dv)` at `dims` from `[q, k, v, out, dout]` and the forward's `lse`, on `kernel`.
    fn run(
        &self,
        kernel: BwdKernel,
        dims: AttnDims,
        [q, k, v, out, dout]: [&CudaSlice<bf16>; 5],
        lse: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<bf16>)> {
        let (gpu, s, rows) = (self.gpu, self.s, self.rows);
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let (mut dq, mut dk, mut dv) = (
            alloc::<bf16>(gpu, s, rows * qw)?,
            alloc::<bf16>(gpu, s, rows * kvw)?,
            alloc::<bf16>(gpu, s, rows * kvw)?,
        );
        // no sequence has a prefix: one-row fp32 stand-ins
        let mut dpk = alloc::<f32>(gpu, s, kvw)?;
        let mut dpv = alloc::<f32>(gpu, s, kvw)?;
        attention_bwd_bf16_with(
            kernel,
            gpu,
            s,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut dpk,
            &mut dpv,
            dout,
            q,
            k,
            v,
            k,
            v,
            out,
            lse,
            self.seqs,
            self.n_seqs,
            dims,
            AttnMask::Full,
            self.scale,
            RowStrides::contiguous(dims),
        )?;
        Ok((dq, dk, dv))
    }
}

/// Block `layer`'s forward from `x_in`, as `block::run_blocks` runs it (the same launches: the
/// norm of the input, whose bits equal the fused add+norm's, qkv, `VisionAttn`'s RoPE and
/// attention, proj, the residual add fused into norm2, gate|up, SwiGLU), keeping every
/// activation the backward reads.
fn block_recompute(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &Ctx<'_>,
    x_in: &CudaSlice<bf16>,
    a: &mut BlockActs,
) -> Result<()> {
    let (rows, h, ffn) = (c.rows, c.hidden, b.ffn);
    rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn1,
        Some(&mut a.rstd1 as &mut dyn DevicePtrMut<f32>),
        x_in,
        &b.norm1,
        rows,
        h,
        VISION_RMS_EPS,
    )?;
    linear(gpu, s, &mut a.qkv, &a.xn1, &b.qkv, rows)?;
    c.attn
        .attend_lse(gpu, s, layer, &mut a.qkv, &mut a.att, Some(&mut a.lse))?;
    linear(gpu, s, &mut a.delta, &a.att, &b.o, rows)?;
    s.memcpy_dtod(&x_in.slice(..rows * h), &mut a.x_mid)?;
    add_rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn2,
        Some(&mut a.rstd2 as &mut dyn DevicePtrMut<f32>),
        &mut a.x_mid,
        &a.delta,
        &b.norm2,
        rows,
        h,
        VISION_RMS_EPS,
    )?;
    linear(gpu, s, &mut a.gu, &a.xn2, &b.gate_up, rows)?;
    let up = a.gu.slice(ffn..);
    swiglu_fwd_bf16(
        gpu,
        s,
        &mut a.act,
        &a.gu,
        &up,
        rows,
        ffn,
        ffn,
        2 * ffn,
        2 * ffn,
    )?;
    Ok(())
}

/// Backward of block `layer`: `dx` holds the gradient of the block's output and ends holding
/// that of its input; the block's parameter gradients are added into `grads`.
#[allow(clippy::too_many_arguments)]
fn block_backward(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &Ctx<'_>,
    x_in: &CudaSlice<bf16>,
    a: &BlockActs,
    dx: &mut CudaSlice<bf16>,
    grads: &mut impl VisionSink,
    scratch: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let bb = BlockBwd {
        gpu,
        s,
        layer,
        b,
        rows,
        hidden: h,
        ones: c.ones,
    };
    let saved = MlpSaved {
        x_mid: &a.x_mid,
        xn2: &a.xn2,
        rstd2: &a.rstd2,
        gu: &a.gu,
        act: &a.act,
        att: &a.att,
    };
    // MLP: delta = down(swiglu(gate_up(norm2(x_mid)))); attention: delta = proj(attn(...))
    let datt = bb.mlp_and_o(grads, scratch, &saved, dx)?;
    // q, k, v (rotated) into contiguous buffers: the attention backward writes each gradient at
    // its input's row stride, and three views of one fused buffer cannot be borrowed at once
    let (mut q, mut k, mut v) = (
        alloc::<bf16>(gpu, s, rows * qw)?,
        alloc::<bf16>(gpu, s, rows * kvw)?,
        alloc::<bf16>(gpu, s, rows * kvw)?,
    );
    kv_append_bf16(gpu, s, &mut q, &a.qkv, c.iota, rows, qw, row, qw)?;
    kv_append_bf16(
        gpu,
        s,
        &mut k,
        &a.qkv.slice(qw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut v,
        &a.qkv.slice(qw + kvw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    let (seqs, n_seqs, _) = c.attn.seqs(layer);
    let bwd = AttnBwd {
        gpu,
        s,
        rows,
        seqs,
        n_seqs,
        scale: 1.0 / (d.head_dim as f32).sqrt(),
    };
    let (dq, dk, dv) = match tc_padded_dims(d, n_seqs) {
        Some(pd) => {
            // the tensor-core backward on heads zero-padded to `pd.head_dim` (see
            // `tc_padded_dims`), then the gradients' real columns back to `d`'s layout
            // (q, out and dout hold `num_heads` heads a row, k and v `num_kv_heads`)
            let (nh, nkv) = (d.num_heads, d.num_kv_heads);
            let repad = |x: &CudaSlice<bf16>, heads: usize, from: usize, to: usize| {
                repad_heads(gpu, s, x, rows * heads, from, to, c.head_iota)
            };
            let pad = |x: &CudaSlice<bf16>, heads| repad(x, heads, d.head_dim, pd.head_dim);
            let (qp, kp, vp) = (pad(&q, nh)?, pad(&k, nkv)?, pad(&v, nkv)?);
            drop((q, k, v));
            let (op, dop) = (pad(&a.att, nh)?, pad(&datt, nh)?);
            drop(datt);
            let g = bwd.run(
                BwdKernel::TensorCores,
                pd,
                [&qp, &kp, &vp, &op, &dop],
                &a.lse,
            )?;
            drop((qp, kp, vp, op, dop));
            let unpad = |x: &CudaSlice<bf16>, heads| repad(x, heads, pd.head_dim, d.head_dim);
            (unpad(&g.0, nh)?, unpad(&g.1, nkv)?, unpad(&g.2, nkv)?)
        }
        None => {
            let g = bwd.run(BwdKernel::Auto, d, [&q, &k, &v, &a.att, &datt], &a.lse)?;
            drop((q, k, v, datt));
            g
        }
    };
    let mut dqkv = alloc::<bf16>(gpu, s, rows * row)?;
    kv_append_bf16(gpu, s, &mut dqkv, &dq, c.iota, rows, qw, qw, row)?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw..),
        &dk,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw + kvw..),
        &dv,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    drop((dq, dk, dv));
    // 2D RoPE's transposed rotation on the q and k heads of each row (v untouched)
    let (cos, sin) = c.attn.tables();
    rope_bwd_bf16(
        gpu,
        s,
        &mut dqkv,
        cos,
        sin,
        rows,
        row,
        d.num_heads + d.num_kv_heads,
        d.head_dim,
    )?;
    bb.qkv_and_norm1(grads, scratch, &dqkv, &a.xn1, &a.rstd1, x_in, dx)?;
    Ok(())
}

/// Backward of the merger and (with `train_tower`) the vision tower of one training forward.
///
/// `d_embeds` is the gradient of the items' embeddings concatenated in item order, `[tokens,
/// out_hidden]` bf16 (at least `state.tokens() * out_hidden` values), as the decoder reads the
/// embeddings. Gradients are added into `grads`: the merger's when it holds them (a frozen
/// merger: build `grads` without, its input gradient still flows), the tower's when
/// `train_tower` (then `grads` must hold them; without `train_tower` the tower's sums are left
/// as they are even when held). `model` must hold the weights the forward ran with. Nothing
/// synchronises.
pub(crate) fn vision_backward(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    model: &GpuModel,
    state: &VisionTrainState,
    d_embeds: &impl DevicePtr<bf16>,
    train_tower: bool,
    grads: &mut impl VisionSink,
) -> Result<()> {
    let s = stream;
    let cfg = &model.config;
    let v = cfg.vision();
    let w = &model.weights;
    let (vh, pd) = (v.hidden_size as usize, cfg.patch_dim());
    let (mh, ow) = (w.merger_fc1.out, w.merger_fc2.out);
    let tokens = state.tokens();
    if d_embeds.len() < tokens * ow {
        return Err(GpuError::Input(format!(
            "vision_backward: d_embeds holds {} values, the forward's {tokens} media tokens x \
             {ow} need {}",
            d_embeds.len(),
            tokens * ow
        )));
    }
    if train_tower && !grads.holds_tower() {
        return Err(GpuError::Input(
            "vision_backward: train_tower is set but the gradient buffers hold no tower tensor \
             (build VisionGrads with tower = true)"
                .into(),
        ));
    }
    let train_merger = grads.holds_merger();
    let Some(k) = state.kept.as_ref() else {
        return Ok(());
    };
    if !train_merger && !train_tower {
        return Ok(());
    }
    let plan = &k.inp.plan;
    let n = plan.patches;
    let groups = n / plan.unit;
    if groups * mh != n * vh || (train_tower && k.block_inputs.len() != w.vision.len()) {
        return Err(GpuError::Input(format!(
            "vision_backward: a state of {n} patches and {} kept block inputs does not fit this \
             model ({} blocks, merger width {mh}){}",
            k.block_inputs.len(),
            w.vision.len(),
            if train_tower && k.block_inputs.is_empty() {
                ": the state was encoded for the merger alone (tower = false)"
            } else {
                ""
            }
        )));
    }
    let window_index = k.inp.window_index.as_ref().ok_or_else(|| {
        GpuError::Input("vision_backward: the state has no window order on the device".into())
    })?;
    let ones = upload(s, &vec![bf16::ONE; n])?;
    let biggest = grads.max_numel();
    let mut scratch = alloc::<bf16>(gpu, s, biggest.max(1))?;
    let fc2_slots = (
        VisionSlot::MergerFc2,
        w.merger_fc2.b.as_ref().map(|_| VisionSlot::MergerFc2Bias),
    );
    let fc1_slots = (
        VisionSlot::MergerFc1,
        w.merger_fc1.b.as_ref().map(|_| VisionSlot::MergerFc1Bias),
    );

    // ---- merger: recompute from its input (the forward's launches) ----
    let mut rstd = alloc::<f32>(gpu, s, n)?;
    let xn = model.vision_merger_norm(gpu, s, &k.merger_in, n, Some(&mut rstd))?;
    let mut h1 = alloc::<bf16>(gpu, s, groups * mh)?;
    linear(gpu, s, &mut h1, &xn, &w.merger_fc1, groups)?;
    let mut gel = alloc::<bf16>(gpu, s, groups * mh)?;
    gelu_fwd_bf16(gpu, s, &mut gel, &h1, groups * mh, false)?;
    // the un-permute's adjoint: merged row i is embedding row window_index[i]
    let mut dm = alloc::<bf16>(gpu, s, groups * ow)?;
    embedding_fwd_bf16(gpu, s, &mut dm, d_embeds, window_index, groups, ow, ow)?;
    // fc2, GELU, fc1, ln_q
    let mut dg = alloc::<bf16>(gpu, s, groups * mh)?;
    matmul_bf16(
        gpu,
        s,
        &mut dg,
        &dm,
        &w.merger_fc2.w,
        Gemm::nn(groups, ow, mh),
    )?;
    if train_merger {
        linear_grads(
            gpu,
            s,
            grads,
            &mut scratch,
            &ones,
            fc2_slots,
            &w.merger_fc2,
            &dm,
            &gel,
            groups,
        )?;
    }
    drop((dm, gel));
    let mut dh1 = alloc::<bf16>(gpu, s, groups * mh)?;
    gelu_bwd_bf16(gpu, s, &mut dh1, &dg, &h1, groups * mh, false)?;
    drop((dg, h1));
    let mut dxn = alloc::<bf16>(gpu, s, groups * mh)?;
    matmul_bf16(
        gpu,
        s,
        &mut dxn,
        &dh1,
        &w.merger_fc1.w,
        Gemm::nn(groups, mh, mh),
    )?;
    if train_merger {
        linear_grads(
            gpu,
            s,
            grads,
            &mut scratch,
            &ones,
            fc1_slots,
            &w.merger_fc1,
            &dh1,
            &xn,
            groups,
        )?;
    }
    drop((dh1, xn));
    let mut dx = alloc::<bf16>(gpu, s, n * vh)?;
    let dln = if train_merger {
        Some(GradSink::<VisionSlot>::grad(grads, VisionSlot::MergerLn)?
            as &mut dyn DevicePtrMut<f32>)
    } else {
        None
    };
    rmsnorm_bwd_bf16(
        gpu,
        s,
        &mut dx,
        dln,
        &dxn,
        &k.merger_in,
        &w.merger_ln,
        &rstd,
        n,
        vh,
        false,
    )?;
    drop((dxn, rstd));
    if !train_tower {
        return Ok(());
    }

    // ---- blocks, top-down, each recomputed from its kept input ----
    let iota = model.iota(s, n)?;
    let head_iota = model.iota(s, n * k.inp.dims.num_heads)?;
    let c = Ctx {
        rows: n,
        hidden: vh,
        dims: k.inp.dims,
        attn: k.inp.attn(&v.fullatt_block_indexes),
        iota: &iota,
        head_iota: &head_iota,
        ones: &ones,
    };
    if let Some(b0) = w.vision.first() {
        let mut acts = BlockActs::new(gpu, s, b0, &c)?;
        for (l, b) in w.vision.iter().enumerate().rev() {
            let x_in = &k.block_inputs[l];
            block_recompute(gpu, s, l, b, &c, x_in, &mut acts)?;
            block_backward(gpu, s, l, b, &c, x_in, &acts, &mut dx, grads, &mut scratch)?;
        }
    }
    // ---- patch embedding: dW [vh, pd] += dx^T pix (rows in the same permuted order) ----
    let pix = k
        .pix
        .as_ref()
        .ok_or_else(|| GpuError::Input("vision_backward: the state kept no pixel rows".into()))?;
    matmul_bf16(gpu, s, &mut scratch, &dx, pix, Gemm::tn(vh, n, pd))?;
    grad_accumulate_f32(
        gpu,
        s,
        GradSink::<VisionSlot>::grad(grads, VisionSlot::PatchEmbed)?,
        &scratch,
        vh * pd,
    )?;
    Ok(())
}

#[cfg(test)]
#[path = "vision_train_tests.rs"]
mod tests;
