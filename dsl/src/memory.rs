//! The lower bound on per-GPU memory of a job's training state, for the "cannot fit even with
//! offload" check (the compiler's memory plan is the real thing; this only rules out jobs no
//! plan could place).
//!
//! Per parameter: the weights in the model dtype; for trainable parameters also the gradient
//! (model dtype), an fp32 master copy (unless the dtype is already fp32) and AdamW's two fp32
//! moments; the reference model's weights (model dtype) when the reference is enabled. Every
//! term is sharded over the training TP degree. Activations, KV cache and workspaces come on
//! top and are left to the compiler.

use rollplex_plan::spec::{DType, JobSpec};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainingMemory {
    pub trainable_params: u64,
    pub frozen_params: u64,
    /// Bytes per GPU, each sharded by `train.tp`.
    pub weights: f64,
    pub grads: f64,
    pub master: f64,
    pub moments: f64,
    pub reference: f64,
}

impl TrainingMemory {
    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.master + self.moments + self.reference
    }
}

pub fn training_memory(spec: &JobSpec) -> TrainingMemory {
    let pc = spec.actor.param_count();
    let mut frozen = 0;
    if spec.train.freeze_vision {
        frozen += pc.vision;
    }
    if spec.train.freeze_merger {
        frozen += pc.merger;
    }
    let total = pc.total();
    let trainable = total - frozen;
    let w = spec.actor.dtype.bytes() as f64;
    let tp = spec.train.tp.max(1) as f64;
    let master = if spec.actor.dtype == DType::F32 {
        0.0
    } else {
        4.0
    };
    TrainingMemory {
        trainable_params: trainable,
        frozen_params: frozen,
        weights: total as f64 * w / tp,
        grads: trainable as f64 * w / tp,
        master: trainable as f64 * master / tp,
        moments: trainable as f64 * 8.0 / tp,
        reference: if spec.reference.enabled {
            total as f64 * w / tp
        } else {
            0.0
        },
    }
}
