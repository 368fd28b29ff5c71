//! The trained tensors: their slots on the device (q|k|v and gate|up fused), the fp32 gradient
//! sums, and the map between a fused device tensor and the CPU model's tensors.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{CudaSlice, CudaStream, Gpu};

use crate::model::weights::{Layout, ParamTable};
use crate::model::Qwen25VL;
use crate::train::TrainConfig;

use super::super::arena::{zeros_in, DevBuf, Region};
use super::super::block_bwd::{BlockTensor, GradSink};
use super::super::vision_train::{
    vision_cpu_parts, vision_host_values, vision_slot_meta, vision_slots, vision_weight_mut,
    VisionSink, VisionSlot,
};
use super::super::weights::{fuse_linears, GpuWeights};
use super::super::GpuError;
use super::Result;

pub use crate::model::weights::Lin;

/// A trained tensor of the text decoder, as the device holds it (q|k|v and gate|up fused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Embed,
    /// Only when not tied to the embeddings.
    LmHead,
    FinalNorm,
    Norm1(usize),
    Norm2(usize),
    Weight(usize, Lin),
    Bias(usize, Lin),
    /// A tensor of the vision tower or merger (trained unless the pipeline freezes it).
    Vision(VisionSlot),
}

pub(super) struct TrainTensor {
    pub(super) slot: Slot,
    pub(super) name: String,
    pub(super) numel: usize,
    pub(super) decay: bool,
    pub(super) master: DevBuf<f32>,
    pub(super) m: DevBuf<f32>,
    pub(super) v: DevBuf<f32>,
    /// The fp32 gradient sum of the running mini-batch: made (zeroed) by its first micro-batch,
    /// freed by the optimizer step, as the plan's `grads.sS` lives (see [`Grads`]).
    pub(super) grad: Option<DevBuf<f32>>,
}

/// The bf16 compute copy of a slot (the buffer the forward reads).
pub(super) fn weight_mut(w: &mut GpuWeights, s: Slot) -> Option<&mut DevBuf<bf16>> {
    match s {
        Slot::Embed => Some(&mut w.embed),
        Slot::LmHead => w.lm_head.as_mut(),
        Slot::FinalNorm => Some(&mut w.final_norm),
        Slot::Norm1(l) => Some(&mut w.text[l].norm1),
        Slot::Norm2(l) => Some(&mut w.text[l].norm2),
        Slot::Weight(l, k) => Some(&mut w.text[l].lin_mut(k).w),
        Slot::Bias(l, k) => w.text[l].lin_mut(k).b.as_mut(),
        Slot::Vision(v) => vision_weight_mut(w, v),
    }
}

/// The fp32 gradient accumulators, one per trained tensor, in a fixed order. They exist only
/// from a mini-batch's first micro-batch to its optimizer step (the plan's `grads.sS` lifetime),
/// so that rollout and scoring do not hold them (11.5 GiB at 3B): [`Grads::ensure`] makes them
/// zeroed on the micro-batch's stream, [`Grads::release`] frees them after the step.
pub(super) struct Grads {
    pub(super) t: Vec<TrainTensor>,
    /// Where the next mini-batch's sums go: the plan's `grads.sS` region of the running step
    /// (set by the executor), or the memory pool.
    pub(super) region: Option<Arc<Region>>,
}

impl GradSink<BlockTensor> for Grads {
    fn grad(&mut self, t: BlockTensor) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.get(match t {
            BlockTensor::Weight(l, k) => Slot::Weight(l, k),
            BlockTensor::Bias(l, k) => Slot::Bias(l, k),
            BlockTensor::Norm1(l) => Slot::Norm1(l),
            BlockTensor::Norm2(l) => Slot::Norm2(l),
        })
    }
}

impl Grads {
    pub(super) fn get(&mut self, s: Slot) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        let t = self
            .t
            .iter_mut()
            .find(|t| t.slot == s)
            .ok_or_else(|| GpuError::Input(format!("no trained tensor {s:?}")))?;
        Grads::of_mut(t)
    }

    /// The error of a tensor without a gradient sum (no micro-batch of this mini-batch ran).
    pub(super) fn no_sum(name: &str) -> GpuError {
        GpuError::Input(format!("no gradient sum for {name}: no micro-batch began"))
    }

    /// A tensor's sum, or [`Grads::no_sum`].
    pub(super) fn of(t: &TrainTensor) -> std::result::Result<&CudaSlice<f32>, GpuError> {
        t.grad.as_deref().ok_or_else(|| Grads::no_sum(&t.name))
    }

    pub(super) fn of_mut(
        t: &mut TrainTensor,
    ) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        match t.grad.as_deref_mut() {
            Some(g) => Ok(g),
            None => Err(Grads::no_sum(&t.name)),
        }
    }

    /// Zeroed sums on `s` for the tensors that have none (a mini-batch's first micro-batch):
    /// a new lifetime of the step's region when none has one.
    pub(super) fn ensure(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        let region = self.region.as_deref();
        if let Some(r) = region.filter(|_| self.t.iter().all(|t| t.grad.is_none())) {
            r.reset();
        }
        for t in self.t.iter_mut().filter(|t| t.grad.is_none()) {
            t.grad = Some(zeros_in::<f32>(gpu, s, t.numel, region)?);
        }
        Ok(())
    }

    /// Frees the sums once the work queued on `s` so far (the optimizer step) is done: the
    /// stream each was made on, where its drop queues the free, waits for that first.
    pub(super) fn release(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        let done = gpu.event()?;
        done.record(s)?;
        let sums: Vec<DevBuf<f32>> = self.t.iter_mut().filter_map(|t| t.grad.take()).collect();
        super::super::wait_before_free(sums.iter().map(|g| g.stream()), s, &done)?;
        drop(sums);
        Ok(())
    }
}

/// The trainer's gradient sums seen by the vision backward: a block's tensors are the vision
/// tower's (`Slot::Vision`), not the decoder's.
pub(super) struct VisionView<'a>(pub(super) &'a mut Grads);

impl GradSink<VisionSlot> for VisionView<'_> {
    fn grad(&mut self, v: VisionSlot) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.0.get(Slot::Vision(v))
    }
}

impl GradSink<BlockTensor> for VisionView<'_> {
    fn grad(&mut self, t: BlockTensor) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.0.get(Slot::Vision(match t {
            BlockTensor::Weight(l, k) => VisionSlot::Weight(l, k),
            BlockTensor::Bias(l, k) => VisionSlot::Bias(l, k),
            BlockTensor::Norm1(l) => VisionSlot::Norm1(l),
            BlockTensor::Norm2(l) => VisionSlot::Norm2(l),
        }))
    }
}

impl VisionSink for VisionView<'_> {
    fn holds_tower(&self) -> bool {
        self.0
            .t
            .iter()
            .any(|t| matches!(t.slot, Slot::Vision(v) if v.in_tower()))
    }
    fn holds_merger(&self) -> bool {
        self.0
            .t
            .iter()
            .any(|t| matches!(t.slot, Slot::Vision(v) if !v.in_tower()))
    }
}

/// The host f32 values of a slot from the CPU model (fused as `GpuWeights::upload` fuses).
pub(super) fn host_values(model: &Qwen25VL, s: Slot) -> Option<(Vec<f32>, String, Vec<usize>)> {
    let w = &model.weights;
    let l = &w.layout;
    let named = |id| {
        let e = w.table.entry(id);
        (w.get(id).to_vec(), e.name.clone(), e.shape.clone())
    };
    let parts = |layer: usize, k: Lin| l.text_layers[layer].fused(k);
    match s {
        Slot::Embed => Some(named(l.embed)),
        Slot::LmHead => (l.lm_head != l.embed).then(|| named(l.lm_head)),
        Slot::FinalNorm => Some(named(l.final_norm)),
        Slot::Norm1(i) => Some(named(l.text_layers[i].norm1)),
        Slot::Norm2(i) => Some(named(l.text_layers[i].norm2)),
        Slot::Weight(i, k) => {
            let ps = parts(i, k);
            let (wt, _, out) = fuse_linears(w, &ps);
            let e = w.table.entry(ps[0].w);
            Some((wt, e.name.clone(), vec![out, ps[0].inp]))
        }
        Slot::Bias(i, k) => {
            let ps = parts(i, k);
            let (_, b, out) = fuse_linears(w, &ps);
            let id = ps.iter().find_map(|p| p.b)?;
            Some((b?, w.table.entry(id).name.clone(), vec![out]))
        }
        Slot::Vision(v) => {
            let (name, shape) = vision_slot_meta(&w.table, l, v);
            Some((vision_host_values(model, v), name, shape))
        }
    }
}

/// The CPU model's parameter slots a device tensor splits into: `(param id, first row, rows)`
/// of the fused tensor, with the part's row width.
pub(super) fn cpu_parts(layout: &Layout, s: Slot) -> Vec<(crate::model::ParamId, usize, usize)> {
    let parts = |layer: usize, k: Lin| layout.text_layers[layer].fused(k);
    match s {
        Slot::Embed => vec![(layout.embed, 0, 0)],
        Slot::LmHead => vec![(layout.lm_head, 0, 0)],
        Slot::FinalNorm => vec![(layout.final_norm, 0, 0)],
        Slot::Norm1(i) => vec![(layout.text_layers[i].norm1, 0, 0)],
        Slot::Norm2(i) => vec![(layout.text_layers[i].norm2, 0, 0)],
        Slot::Weight(i, k) => {
            let mut row = 0;
            parts(i, k)
                .into_iter()
                .map(|p| {
                    let r = (p.w, row, p.out);
                    row += p.out;
                    r
                })
                .collect()
        }
        Slot::Bias(i, k) => {
            let mut row = 0;
            parts(i, k)
                .into_iter()
                .filter_map(|p| {
                    let r = p.b.map(|b| (b, row, p.out));
                    row += p.out;
                    r
                })
                .collect()
        }
        Slot::Vision(v) => vision_cpu_parts(layout, v),
    }
}

/// The trained slots of a model on the device, in the trainer's fixed order: embeddings, the
/// untied lm head, the final norm, per layer its norms and fused linears with their biases,
/// then the vision tower's and the merger's unless frozen ([`vision_slots`]' order).
pub(super) fn train_slots(layout: &Layout, cfg: &TrainConfig) -> Vec<Slot> {
    let mut slots = vec![Slot::Embed];
    if layout.lm_head != layout.embed {
        slots.push(Slot::LmHead);
    }
    slots.push(Slot::FinalNorm);
    for (l, p) in layout.text_layers.iter().enumerate() {
        slots.push(Slot::Norm1(l));
        slots.push(Slot::Norm2(l));
        for k in Lin::ALL {
            slots.push(Slot::Weight(l, k));
            // as `fuse_linears`: a fused bias when any part has one
            if p.fused(k).iter().any(|x| x.b.is_some()) {
                slots.push(Slot::Bias(l, k));
            }
        }
    }
    let (tower, merger) = (!cfg.freeze_vision, !cfg.freeze_merger);
    slots.extend(
        vision_slots(layout, tower, merger)
            .into_iter()
            .map(Slot::Vision),
    );
    slots
}

/// Where each CPU-model tensor of a fused device tensor of `numel` values lies in it: `(param
/// id, element range)` per part of [`cpu_parts`]. Rows of a fused tensor whose CPU tensor does
/// not exist (a missing bias, zero in the fused copy) belong to no part.
fn part_ranges(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    numel: usize,
) -> Result<Vec<(crate::model::ParamId, std::ops::Range<usize>)>> {
    parts
        .iter()
        .map(|&(id, row0, rows)| {
            let e = table.entry(id);
            let r = match e.len.checked_div(rows) {
                // a part of a fused tensor: its rows
                Some(width) => row0 * width..(row0 + rows) * width,
                // a whole tensor
                None => 0..e.len,
            };
            if r.len() != e.len || r.end > numel {
                return Err(GpuError::Input(format!(
                    "tensor {} ({} values) does not fit elements {r:?} of a fused tensor of {numel}",
                    e.name, e.len
                ))
                .into());
            }
            Ok((id, r))
        })
        .collect()
}

/// The CPU-model tensors of a fused device tensor's values: `(param id, its values)` per part.
pub(super) fn split_fused<'a>(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    fused: &'a [f32],
) -> Result<Vec<(crate::model::ParamId, &'a [f32])>> {
    Ok(part_ranges(table, parts, fused.len())?
        .into_iter()
        .map(|(id, r)| (id, &fused[r]))
        .collect())
}

/// The inverse of [`split_fused`]: a fused tensor of `numel` values from its parts' values
/// (`part(id)`), zero where no CPU tensor lies (a missing bias, as `fuse_linears` fills it).
pub(super) fn fuse_parts<'a>(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    numel: usize,
    mut part: impl FnMut(crate::model::ParamId) -> Result<&'a [f32]>,
) -> Result<Vec<f32>> {
    let mut out = vec![0f32; numel];
    for (id, r) in part_ranges(table, parts, numel)? {
        let src = part(id)?;
        if src.len() != r.len() {
            return Err(GpuError::Input(format!(
                "tensor {} has {} values, the model's has {}",
                table.entry(id).name,
                src.len(),
                r.len()
            ))
            .into());
        }
        out[r].copy_from_slice(src);
    }
    Ok(out)
}
