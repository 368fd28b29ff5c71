//! The training step the RL loop drives, on one rank: micro-batches in the plan's order, then
//! one optimizer step per mini-batch. The single-rank trainer is rank 0 of a group of one
//! ([`Trainer::new`]: the whole model, collectives over `SoloComm`); a tensor-parallel rank is
//! the same code with its shard and its group ([`Trainer::for_shard`]).
//!
//! ```text
//! let norm = Normaliser over every response of the mini-batch (loss::Normaliser::of / merge);
//! for (i, mb) in micro_batches.iter().enumerate() {      // plan order, i = 0, 1, ...
//!     trainer.micro_batch(&comm, i as u32, mb, norm)?;   // forward + loss + backward, accumulate
//! }
//! let report = trainer.optimizer_step(&comm)?;           // global clip, AdamW, new weights
//! ```
//!
//! Accumulation contract: micro-batch `i`'s gradient is computed whole into a zeroed buffer,
//! then added to the running sum after micro-batches `0..i` (an out-of-order index is refused).
//! So the accumulated gradient is `((g_0 + g_1) + g_2) + ...` whatever order the micro-batches
//! *finished* in, bitwise. Splitting one group's responses over two micro-batches gives
//! `g_a + g_b` (each recomputes the group's prefix, whose gradient is then summed), which equals
//! the one-micro-batch gradient up to float rounding, not bitwise.
//!
//! The optimizer is [`TpAdamW`]: AdamW over the rank's shard with the grad-norm clip of the
//! whole model; at degree 1 it is bitwise plain AdamW with torch's clip (`train::tests`).
//!
//! Invariant: the rank's weights (the compute copy) change only in [`Trainer::optimizer_step`]
//! and [`Trainer::restore`].

use std::sync::Arc;

use rollplex_plan::spec::AdamWSpec;

use super::adamw::{GradAccumulator, StepReport};
use super::backward::{GroupBatch, MicroBatchOutput, TrainConfig};
use super::loss::{LossMetrics, Normaliser};
use super::TrainError;
use crate::model::{Qwen25VL, Weights};
use crate::tp::{Communicator, TpAdamW, TpError, TpModel, TpPlan};

/// One rank's actor, its optimizer and the gradient sum of the current mini-batch.
#[derive(Debug)]
pub struct Trainer {
    actor: TpModel,
    cfg: TrainConfig,
    opt: TpAdamW,
    acc: GradAccumulator,
    /// Metrics of the micro-batches accumulated so far.
    metrics: LossMetrics,
}

/// What an optimizer step reports: the optimizer's numbers and the mini-batch's loss metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainStepReport {
    pub step: StepReport,
    pub metrics: LossMetrics,
    pub micro_batches: u32,
}

impl Trainer {
    /// The whole model as rank 0 of a group of one; the optimizer's master weights start from
    /// its weights.
    pub fn new(model: Qwen25VL, cfg: TrainConfig, optimizer: AdamWSpec) -> Result<Self, TpError> {
        let plan = Arc::new(TpPlan::new(&model.config, 1)?);
        let actor = TpModel::shard(plan, &model.weights, 0)?;
        Self::for_shard(actor, cfg, optimizer)
    }

    /// One rank's shard; the optimizer's master weights start from the shard's weights.
    pub fn for_shard(
        actor: TpModel,
        cfg: TrainConfig,
        optimizer: AdamWSpec,
    ) -> Result<Self, TpError> {
        let opt = TpAdamW::new(&actor, optimizer, |n| cfg.trainable(n))?;
        let acc = GradAccumulator::new(actor.weights.table.total());
        Ok(Trainer {
            actor,
            cfg,
            opt,
            acc,
            metrics: LossMetrics::default(),
        })
    }

    /// The rank's actor with its current (compute-copy) weights.
    pub fn actor(&self) -> &TpModel {
        &self.actor
    }
    /// The rank's current weights (the whole model's at degree 1).
    pub fn weights(&self) -> &Weights {
        &self.actor.weights
    }
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    /// Trains with `plan`'s kept activation layers from now on (what a plan decides: memory
    /// and time, never the results).
    pub fn follow_plan(&mut self, plan: &rollplex_plan::Plan) {
        self.cfg = self.cfg.clone().with_plan(plan);
    }
    pub fn optimizer(&self) -> &TpAdamW {
        &self.opt
    }
    /// The gradient accumulated since the last optimizer step (shard-sized buffer).
    pub fn grads(&self) -> &[f32] {
        self.acc.grads()
    }

    /// Forward, loss and backward of micro-batch `index` (0-based, in plan order) of the current
    /// mini-batch, whose normaliser is `norm`; its gradient joins the sum. Every rank of the
    /// group calls it with the same batch.
    pub fn micro_batch<C: Communicator>(
        &mut self,
        comm: &C,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput, TpError> {
        if index != self.acc.count() {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} given, but micro-batch {} is next in plan order",
                self.acc.count()
            ))
            .into());
        }
        let mut g = vec![0f32; self.actor.weights.table.total()];
        let out = self
            .actor
            .as_rank()
            .forward_backward(comm, &self.cfg, groups, norm, &mut g)?;
        self.acc.add(index, &g)?;
        self.metrics.add(&out.metrics);
        Ok(out)
    }

    /// Clips the accumulated gradient by the whole model's norm, takes one AdamW step, writes
    /// the new weights into the rank's shard, and starts the next mini-batch. On error (no
    /// micro-batch yet, non-finite gradient) the weights are unchanged and the gradient is
    /// kept; [`Trainer::discard`] drops it.
    pub fn optimizer_step<C: Communicator>(
        &mut self,
        comm: &C,
    ) -> Result<TrainStepReport, TpError> {
        self.optimizer_step_with(comm, None)
    }

    /// [`Trainer::optimizer_step`], the optimizer state streamed as `stream` says when given (a
    /// plan's streamed optimizer step: bitwise the same result).
    pub fn optimizer_step_with<C: Communicator>(
        &mut self,
        comm: &C,
        stream: Option<&rollplex_plan::OptimizerStream>,
    ) -> Result<TrainStepReport, TpError> {
        let micro_batches = self.acc.count();
        if micro_batches == 0 {
            return Err(TrainError::Invalid(
                "optimizer step before any micro-batch: nothing to apply".into(),
            )
            .into());
        }
        let step = self
            .opt
            .step_with(comm, &mut self.actor, self.acc.grads_mut(), stream)?;
        self.acc.reset();
        let metrics = std::mem::take(&mut self.metrics);
        Ok(TrainStepReport {
            step,
            metrics,
            micro_batches,
        })
    }

    /// Continues from a checkpoint: the rank's weights (`weights`, laid out as its shard) and
    /// the optimizer's masters, moments (in [`TpAdamW::table`]'s carving) and steps taken; any
    /// accumulated gradient is dropped.
    pub fn restore(
        &mut self,
        weights: Weights,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        step: u64,
    ) -> Result<(), TpError> {
        if weights.table != self.actor.weights.table {
            return Err(TpError::Config(format!(
                "restore on rank {}: the weights are not laid out as this rank's shard",
                self.actor.rank
            )));
        }
        self.opt.restore(master, m, v, step)?;
        self.actor.weights = weights;
        self.discard();
        Ok(())
    }

    /// Drops the accumulated gradient and metrics without stepping.
    pub fn discard(&mut self) {
        self.acc.reset();
        self.metrics = LossMetrics::default();
    }

    /// The whole model (degree 1 only: a shard is not a model).
    pub fn into_model(self) -> Result<Qwen25VL, TpError> {
        if self.actor.plan.degree != 1 {
            return Err(TpError::Config(format!(
                "rank {} holds a shard of a TP-{} model, not the whole model",
                self.actor.rank, self.actor.plan.degree
            )));
        }
        Ok(Qwen25VL::new(
            self.actor.plan.config.clone(),
            self.actor.weights,
        )?)
    }
}
