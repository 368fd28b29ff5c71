//! The trained tensors of the vision tower and merger: their slots on the device, how each
//! splits into the CPU model's tensors, their host values and device weights, and their fp32
//! gradient sums.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{CudaSlice, CudaStream, Gpu};

use crate::model::weights::{Layout, Linear, ParamTable};
use crate::model::{ParamId, Qwen25VL};

use super::super::arena::DevBuf;
use super::super::block_bwd::{BlockTensor, GradSink};
use super::super::train::Lin;
use super::super::weights::{fuse_linears, GpuWeights};
use super::super::{alloc, download, GpuError, Result};

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
    layout.vision_blocks[block].fused(k)
}

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
            for k in Lin::ALL {
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
        let (wt, b, _) = fuse_linears(w, parts);
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

/// The bf16 compute copy of a vision tensor on the device (the buffer the forward reads, the
/// one an optimizer step writes); `None` for a bias the device linear lacks.
pub fn vision_weight(w: &GpuWeights, s: VisionSlot) -> Option<&DevBuf<bf16>> {
    match s {
        VisionSlot::PatchEmbed => Some(&w.patch_embed),
        VisionSlot::Norm1(b) => w.vision.get(b).map(|x| &x.norm1),
        VisionSlot::Norm2(b) => w.vision.get(b).map(|x| &x.norm2),
        VisionSlot::Weight(b, k) => w.vision.get(b).map(|x| &x.lin(k).w),
        VisionSlot::Bias(b, k) => w.vision.get(b).and_then(|x| x.lin(k).b.as_ref()),
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
        VisionSlot::Weight(b, k) => w.vision.get_mut(b).map(|x| &mut x.lin_mut(k).w),
        VisionSlot::Bias(b, k) => w.vision.get_mut(b).and_then(|x| x.lin_mut(k).b.as_mut()),
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
pub(super) fn part_ranges(
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
}

impl VisionSink for VisionGrads {
    fn holds_tower(&self) -> bool {
        self.t.iter().any(|t| t.slot.in_tower())
    }
    fn holds_merger(&self) -> bool {
        self.t.iter().any(|t| !t.slot.in_tower())
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
