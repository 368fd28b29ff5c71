//! The trainer's state on the host: the gradient sums, and the masters and moments a checkpoint
//! saves and restores under the CPU model's tensor names.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::CudaStream;

use crate::model::Qwen25VL;
use crate::train::loss::LossMetrics;

use super::super::{download, GpuError};
use super::params::{cpu_parts, fuse_parts, split_fused, weight_mut};
use super::{GpuTrainer, Result};

/// The optimizer state of one trained tensor of the CPU model (the fused device tensors split
/// into their parts), as a checkpoint stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    /// The CPU model's tensor name (Hugging Face layout).
    pub name: String,
    pub shape: Vec<usize>,
    /// fp32 master weights, AdamW's first and second moments.
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// The trainer's state on the host, per CPU-model tensor, in the trainer's order: what a
/// checkpoint saves and [`GpuTrainer::import_state`] restores.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuTrainState {
    pub params: Vec<ParamState>,
    /// Optimizer steps taken.
    pub steps: u64,
}

impl GpuTrainer {
    /// The accumulated gradient in the CPU model's layout (a `table.total()` buffer, the fused
    /// tensors split into their parts; frozen tensors are zero). Synchronises.
    pub fn grads_host(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.table.total()];
        for t in &self.grads.t {
            let Some(grad) = &t.grad else { continue };
            let g = download(stream, grad)?;
            let parts = cpu_parts(&self.layout, t.slot);
            for (id, x) in split_fused(&self.table, &parts, &g[..t.numel])? {
                let e = self.table.entry(id);
                out[e.offset..e.offset + e.len].copy_from_slice(x);
            }
        }
        Ok(out)
    }

    /// The trainer's state on the host (synchronises): the fp32 masters written into `into`'s
    /// trained tensors (its frozen tensors are left as they are, so `into`
    /// should hold the weights the trainer was built from), and per trained CPU-model tensor
    /// its master and AdamW moments, with the optimizer step. The device's bf16 compute copy
    /// is the round-to-nearest-even of the masters (`adamw_step_f32`, `GpuWeights::upload`),
    /// so the state determines it.
    pub fn export_state(
        &self,
        stream: &Arc<CudaStream>,
        into: &mut Qwen25VL,
    ) -> Result<GpuTrainState> {
        if into.weights.table.total() != self.table.total() || into.weights.layout != self.layout {
            return Err(GpuError::Input(
                "export_state: the host model has another layout than the trained one".into(),
            )
            .into());
        }
        let mut params = Vec::new();
        for (i, t) in self.grads.t.iter().enumerate() {
            let parts = cpu_parts(&self.layout, t.slot);
            let [master, m, v] = match self.streamed_tensor(i)? {
                Some(x) => x,
                None => [
                    download(stream, &t.master)?,
                    download(stream, &t.m)?,
                    download(stream, &t.v)?,
                ],
            };
            let (master, m, v) = (&master[..t.numel], &m[..t.numel], &v[..t.numel]);
            let pieces = [
                split_fused(&self.table, &parts, master)?,
                split_fused(&self.table, &parts, m)?,
                split_fused(&self.table, &parts, v)?,
            ];
            for (i, &(id, x)) in pieces[0].iter().enumerate() {
                into.weights.get_mut(id).copy_from_slice(x);
                let e = self.table.entry(id);
                params.push(ParamState {
                    name: e.name.clone(),
                    shape: e.shape.clone(),
                    master: x.to_vec(),
                    m: pieces[1][i].1.to_vec(),
                    v: pieces[2][i].1.to_vec(),
                });
            }
        }
        Ok(GpuTrainState {
            params,
            steps: self.steps,
        })
    }

    /// Restores a state [`GpuTrainer::export_state`] produced (or a CPU-backend checkpoint's
    /// optimizer, same names): the fp32 masters, the moments, the optimizer step, and the bf16
    /// compute copy re-derived from the masters (round to nearest even, as the optimizer step
    /// writes it: bitwise what the run that saved the state computed with). Frozen tensors keep
    /// the weights the trainer was built from. Every trained tensor must be present with its
    /// shape, and nothing else; the accumulated gradient is dropped. Synchronises.
    pub fn import_state(&mut self, stream: &Arc<CudaStream>, state: &GpuTrainState) -> Result<()> {
        let by_name: std::collections::HashMap<&str, &ParamState> =
            state.params.iter().map(|p| (p.name.as_str(), p)).collect();
        if by_name.len() != state.params.len() {
            return Err(GpuError::Input("import_state: a tensor is listed twice".into()).into());
        }
        let mut used = 0usize;
        for i in 0..self.grads.t.len() {
            let (slot, numel) = (self.grads.t[i].slot, self.grads.t[i].numel);
            let parts = cpu_parts(&self.layout, slot);
            let table = &self.table;
            let find = |id: crate::model::ParamId| -> Result<&ParamState> {
                let e = table.entry(id);
                let p = by_name.get(e.name.as_str()).ok_or_else(|| {
                    GpuError::Input(format!(
                        "the state has no tensor {} (it trains other tensors than this model)",
                        e.name
                    ))
                })?;
                if p.shape != e.shape || [&p.master, &p.m, &p.v].iter().any(|x| x.len() != e.len) {
                    return Err(GpuError::Input(format!(
                        "tensor {} has shape {:?} ({}, {}, {} values), this model's is {:?}",
                        e.name,
                        p.shape,
                        p.master.len(),
                        p.m.len(),
                        p.v.len(),
                        e.shape
                    ))
                    .into());
                }
                Ok(p)
            };
            let master = fuse_parts(table, &parts, numel, |id| Ok(&find(id)?.master[..]))?;
            let m = fuse_parts(table, &parts, numel, |id| Ok(&find(id)?.m[..]))?;
            let v = fuse_parts(table, &parts, numel, |id| Ok(&find(id)?.v[..]))?;
            used += parts.len();
            let out = weight_mut(&mut self.model.weights, slot).ok_or_else(|| {
                GpuError::Input(format!(
                    "no device weight for trained tensor {}",
                    self.grads.t[i].name
                ))
            })?;
            let copy: Vec<bf16> = master.iter().map(|&x| bf16::from_f32(x)).collect();
            stream.memcpy_htod(&copy[..], &mut out.slice_mut(..numel))?;
            if !self.set_streamed_tensor(i, [&master[..], &m[..], &v[..]])? {
                let t = &mut self.grads.t[i];
                stream.memcpy_htod(&master[..], &mut t.master.slice_mut(..numel))?;
                stream.memcpy_htod(&m[..], &mut t.m.slice_mut(..numel))?;
                stream.memcpy_htod(&v[..], &mut t.v.slice_mut(..numel))?;
            }
            let t = &mut self.grads.t[i];
            // the host buffers must outlive the copies
            stream.synchronize()?;
            // a gradient sum of a mini-batch in progress does not survive the load (the
            // device is idle here: the drop's free has nothing to wait for)
            if let Some(g) = t.grad.take() {
                g.stream().synchronize()?;
            }
        }
        if used != state.params.len() {
            return Err(GpuError::Input(format!(
                "the state holds {} tensors, this model trains {used}",
                state.params.len()
            ))
            .into());
        }
        self.steps = state.steps;
        self.micro = 0;
        self.metrics = LossMetrics::default();
        Ok(())
    }
}
