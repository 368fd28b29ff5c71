//! AdamW over one rank's shard ([`TpAdamW`]): `train::AdamW` (element-wise, so it runs on a
//! shard unchanged) plus the one thing that is not element-wise, global grad-norm clipping. The
//! norm is that of the unsharded model: each rank sums the squares of the elements it counts
//! ([`TpPlan::counts_once`](super::TpPlan::counts_once): its own parts, replicated parameters on
//! rank 0, a replicated kv head on its first holder) in f64, tensors in table order, and the
//! partial sums are all-reduced in rank order; at degree 1 this is `clip_grad_norm` exactly.
//!
//! Invariant: replicated parameters see bitwise-equal gradients on every rank (see `backward`),
//! so after a step they are still bitwise equal and `TpPlan::unshard` accepts the weights.

use rollplex_plan::spec::AdamWSpec;
use rollplex_plan::OptimizerStream;

use crate::train::{AdamW, OptTable, StepReport};

use super::comm::Communicator;
use super::{TpError, TpModel};

/// AdamW state of one rank: master weights and moments of its shard.
#[derive(Clone, Debug)]
pub struct TpAdamW {
    inner: AdamW,
    /// Global clip threshold (the inner optimizer's clipping is off).
    max_norm: f64,
}

impl TpAdamW {
    /// An optimizer over `model`'s shard, trainable tensors chosen by name (as
    /// `OptTable::from_model`), starting from the shard's weights.
    pub fn new(
        model: &TpModel,
        spec: AdamWSpec,
        trainable: impl Fn(&str) -> bool,
    ) -> Result<Self, TpError> {
        let table = OptTable::from_model(&model.weights.table, trainable)?;
        let max_norm = spec.grad_clip;
        let inner = AdamW::new(
            AdamWSpec {
                grad_clip: 0.0,
                ..spec
            },
            table,
            &model.weights.data,
        )?;
        Ok(TpAdamW { inner, max_norm })
    }

    /// The rank's trainable tensors: where each lies in its shard and in the state buffers.
    pub fn table(&self) -> &OptTable {
        self.inner.table()
    }

    /// The rank's (master, first moment, second moment) buffers, for checkpoints.
    pub fn state(&self) -> (&[f32], &[f32], &[f32]) {
        self.inner.state()
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.inner.steps()
    }

    /// Restores a checkpointed state of this rank's shard (buffers in [`TpAdamW::table`]'s
    /// carving).
    pub fn restore(
        &mut self,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        step: u64,
    ) -> Result<(), TpError> {
        Ok(self.inner.restore(master, m, v, step)?)
    }

    /// One step on every rank: global norm, clipping, the AdamW update of this rank's shard
    /// (written into `model.weights`). `grad_norm` in the report is the global norm before
    /// clipping, the same on every rank.
    pub fn step<C: Communicator>(
        &mut self,
        comm: &C,
        model: &mut TpModel,
        grads: &mut [f32],
    ) -> Result<StepReport, TpError> {
        self.step_with(comm, model, grads, None)
    }

    /// [`TpAdamW::step`], the state streamed as `stream` says when given
    /// ([`crate::train::adamw::AdamW::step_with`]: bitwise the same).
    pub fn step_with<C: Communicator>(
        &mut self,
        comm: &C,
        model: &mut TpModel,
        grads: &mut [f32],
        stream: Option<&OptimizerStream>,
    ) -> Result<StepReport, TpError> {
        model.as_rank().check_comm(comm)?;
        let table = self.inner.table();
        if grads.len() != table.buffer_len() || model.weights.data.len() != table.buffer_len() {
            return Err(TpError::Config(format!(
                "TpAdamW on rank {}: {} gradients and {} weights for a shard of {}",
                model.rank,
                grads.len(),
                model.weights.data.len(),
                table.buffer_len()
            )));
        }
        let mut sq = [0f64];
        for p in table.params() {
            let id = model.weights.table.find(&p.name).ok_or_else(|| {
                TpError::Config(format!("TpAdamW: {} is not in the shard", p.name))
            })?;
            if model.plan.counts_once(model.rank, id) {
                for &g in &grads[p.offset..p.offset + p.numel] {
                    sq[0] += (g as f64) * (g as f64);
                }
            }
        }
        comm.all_reduce_sum(&mut sq)?;
        let norm = sq[0].sqrt();
        if !norm.is_finite() {
            let culprit = crate::train::adamw::first_non_finite(table, grads)
                .map(|p| format!("{} on rank {}", p.name, model.rank))
                .unwrap_or_else(|| "(on another rank, or an overflow of the sum)".into());
            return Err(TpError::Config(format!(
                "gradient norm is not finite (first non-finite tensor: {culprit}); the optimizer \
                 step was not taken"
            )));
        }
        if self.max_norm > 0.0 {
            let coef = (self.max_norm / (norm + 1e-6)).min(1.0) as f32;
            for p in table.params() {
                grads[p.offset..p.offset + p.numel]
                    .iter_mut()
                    .for_each(|g| *g *= coef);
            }
        }
        let mut report = self
            .inner
            .step_f32_with(grads, &mut model.weights.data, stream)?;
        report.grad_norm = norm;
        Ok(report)
    }
}
