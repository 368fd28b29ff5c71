//! The optimizer step: the global grad-norm, the clip, AdamW on the fp32 masters writing the
//! bf16 compute copy.

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use half::bf16;
use rollplex_kernels::cuda::{
    adamw_step_f32, scale_f32, sumsq_partial_f32, AdamWScalars, CudaStream, Gpu, SUMSQ_BLOCKS,
};

use crate::train::adamw::{lr_at, StepReport};
use crate::train::loss::LossMetrics;
use crate::train::{TrainError, TrainStepReport};

use super::super::{alloc, download, GpuError};
use super::params::{weight_mut, Grads};
use super::{GpuTrainer, Result};

impl GpuTrainer {
    /// The global L2 norm of the accumulated gradient (f64 partial sums on the device, summed
    /// on the host in tensor order). Synchronises.
    pub fn grad_norm(&self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<f64> {
        let nt = self.grads.t.len();
        let mut partial = alloc::<f64>(gpu, s, nt * SUMSQ_BLOCKS)?;
        for (i, t) in self.grads.t.iter().enumerate() {
            let mut view = partial.slice_mut(i * SUMSQ_BLOCKS..(i + 1) * SUMSQ_BLOCKS);
            sumsq_partial_f32(gpu, s, Grads::of(t)?, t.numel, &mut view)?;
        }
        let p = download(s, &partial)?;
        let mut sq = 0f64;
        let mut culprit = None;
        for (i, t) in self.grads.t.iter().enumerate() {
            let part: f64 = p[i * SUMSQ_BLOCKS..(i + 1) * SUMSQ_BLOCKS].iter().sum();
            if !part.is_finite() && culprit.is_none() {
                culprit = Some(t.name.clone());
            }
            sq += part;
        }
        let norm = sq.sqrt();
        if !norm.is_finite() {
            return Err(TrainError::Invalid(format!(
                "gradient norm is not finite (first non-finite tensor: {}); the optimizer step \
                 was not taken",
                culprit.unwrap_or_else(|| "(overflow of the sum)".into())
            ))
            .into());
        }
        Ok(norm)
    }

    /// Clips the accumulated gradient (torch's `min(1, max_norm / (norm + 1e-6))`), takes one
    /// AdamW step on the fp32 masters writing the bf16 compute copy, frees the gradient sums and
    /// starts the next mini-batch. On error the weights are unchanged and the gradient is kept.
    pub fn optimizer_step(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<TrainStepReport> {
        let micro_batches = self.micro;
        if !self.queued.is_empty() {
            return Err(TrainError::Invalid(format!(
                "optimizer_step with {} queued micro-batches whose results were not taken \
                 (finish_queued first): the step's metrics would miss them",
                self.queued.len()
            ))
            .into());
        }
        if micro_batches == 0 {
            return Err(TrainError::Invalid(
                "optimizer_step before any micro-batch: nothing to apply".into(),
            )
            .into());
        }
        let grad_norm = self.grad_norm(gpu, s)?;
        if self.spec.grad_clip > 0.0 {
            let coef = (self.spec.grad_clip / (grad_norm + 1e-6)).min(1.0) as f32;
            if coef != 1.0 {
                for t in self.grads.t.iter_mut() {
                    let numel = t.numel;
                    scale_f32(gpu, s, Grads::of_mut(t)?, numel, coef)?;
                }
            }
        }
        let lr = lr_at(&self.spec, self.steps);
        let step = self.steps + 1;
        let sc = AdamWScalars::new(
            lr,
            self.spec.beta1,
            self.spec.beta2,
            self.spec.eps,
            self.spec.weight_decay,
            step,
        );
        if self.streamed.is_some() {
            // the state on the host: through the staging chunks (`stream.rs`)
            self.streamed_update(gpu, s, sc)?;
        } else {
            for t in self.grads.t.iter_mut() {
                let decay = t.decay && self.spec.weight_decay != 0.0;
                let out = weight_mut(&mut self.model.weights, t.slot).ok_or_else(|| {
                    GpuError::Input(format!("no device weight for trained tensor {}", t.name))
                })?;
                let grad = t.grad.as_ref().ok_or_else(|| Grads::no_sum(&t.name))?;
                adamw_step_f32(
                    gpu,
                    s,
                    &mut t.master,
                    &mut t.m,
                    &mut t.v,
                    Some(out as &mut dyn DevicePtrMut<bf16>),
                    grad,
                    t.numel,
                    decay,
                    sc,
                )?;
            }
        }
        self.grads.release(gpu, s)?;
        self.steps = step;
        self.micro = 0;
        let metrics = std::mem::take(&mut self.metrics);
        Ok(TrainStepReport {
            step: StepReport {
                step,
                lr,
                grad_norm,
            },
            metrics,
            micro_batches,
        })
    }

    /// Drops the accumulated gradient and metrics without stepping.
    pub fn discard(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        self.queued.clear();
        self.grads.release(gpu, s)?;
        self.micro = 0;
        self.metrics = LossMetrics::default();
        Ok(())
    }
}
