//! The training step the RL loop drives: micro-batches in the plan's order, then one optimizer
//! step per mini-batch.
//!
//! ```text
//! let norm = Normaliser over every response of the mini-batch (loss::Normaliser::of / merge);
//! for (i, mb) in micro_batches.iter().enumerate() {      // plan order, i = 0, 1, ...
//!     trainer.micro_batch(i as u32, mb, norm)?;          // forward + loss + backward, accumulate
//! }
//! let report = trainer.optimizer_step()?;                // clip, AdamW, write the compute copy
//! ```
//!
//! Accumulation contract: micro-batch `i`'s gradient is computed whole into a zeroed buffer,
//! then added to the running sum after micro-batches `0..i` (an out-of-order index is refused).
//! So the accumulated gradient is `((g_0 + g_1) + g_2) + ...` whatever order the micro-batches
//! *finished* in, bitwise. Splitting one group's responses over two micro-batches gives
//! `g_a + g_b` (each recomputes the group's prefix, whose gradient is then summed), which equals
//! the one-micro-batch gradient up to float rounding, not bitwise.
//!
//! Invariant: the model's weights (the compute copy) change only in [`Trainer::optimizer_step`].

use rollplex_plan::spec::AdamWSpec;

use super::adamw::{AdamW, GradAccumulator, OptTable, StepReport};
use super::backward::{forward_backward, GroupBatch, MicroBatchOutput, TrainConfig};
use super::loss::{LossMetrics, Normaliser};
use super::{Result, TrainError};
use crate::model::Qwen25VL;

/// The actor, its optimizer and the gradient sum of the current mini-batch.
#[derive(Debug)]
pub struct Trainer {
    model: Qwen25VL,
    cfg: TrainConfig,
    opt: AdamW,
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
    /// Wraps a model for training; the optimizer's master weights start from its weights.
    pub fn new(model: Qwen25VL, cfg: TrainConfig, optimizer: AdamWSpec) -> Result<Self> {
        let table = OptTable::from_model(&model.weights.table, |name| cfg.trainable(name))?;
        let opt = AdamW::new(optimizer, table, &model.weights.data)?;
        let acc = GradAccumulator::new(model.weights.table.total());
        Ok(Trainer {
            model,
            cfg,
            opt,
            acc,
            metrics: LossMetrics::default(),
        })
    }

    /// The model with its current (compute-copy) weights.
    pub fn model(&self) -> &Qwen25VL {
        &self.model
    }
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }
    /// The gradient accumulated since the last optimizer step (model-sized buffer).
    pub fn grads(&self) -> &[f32] {
        self.acc.grads()
    }

    /// Forward, loss and backward of micro-batch `index` (0-based, in plan order) of the current
    /// mini-batch, whose normaliser is `norm`; its gradient joins the sum.
    pub fn micro_batch(
        &mut self,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput> {
        if index != self.acc.count() {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} given, but micro-batch {} is next in plan order",
                self.acc.count()
            )));
        }
        let mut g = vec![0f32; self.model.weights.table.total()];
        let out = forward_backward(&self.model, &self.cfg, groups, norm, &mut g)?;
        self.acc.add(index, &g)?;
        self.metrics.add(&out.metrics);
        Ok(out)
    }

    /// Clips the accumulated gradient, takes one AdamW step, writes the new weights into the
    /// model, and starts the next mini-batch. On error (no micro-batch yet, non-finite gradient)
    /// the weights are unchanged and the gradient is kept; [`Trainer::discard`] drops it.
    pub fn optimizer_step(&mut self) -> Result<TrainStepReport> {
        let micro_batches = self.acc.count();
        if micro_batches == 0 {
            return Err(TrainError::Invalid(
                "optimizer_step before any micro-batch: nothing to apply".into(),
            ));
        }
        let step = self
            .opt
            .step_f32(self.acc.grads_mut(), &mut self.model.weights.data)?;
        self.acc.reset();
        let metrics = std::mem::take(&mut self.metrics);
        Ok(TrainStepReport {
            step,
            metrics,
            micro_batches,
        })
    }

    /// Restores the optimizer from a checkpoint (flat buffers as [`AdamW::state`] returned them,
    /// and the steps taken) and drops any accumulated gradient. The model's weights are the
    /// caller's: build the trainer around the checkpoint's weights.
    pub fn restore_optimizer(
        &mut self,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        step: u64,
    ) -> Result<()> {
        self.opt.restore(master, m, v, step)?;
        self.discard();
        Ok(())
    }

    /// Drops the accumulated gradient and metrics without stepping.
    pub fn discard(&mut self) {
        self.acc.reset();
        self.metrics = LossMetrics::default();
    }

    /// Gives the model back (e.g. to save a checkpoint or hand weights to rollout).
    pub fn into_model(self) -> Qwen25VL {
        self.model
    }
}
