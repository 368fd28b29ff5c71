//! The training engine of the actor: the policy loss ([`loss`]), AdamW with fp32 master weights
//! ([`adamw`]), backward through the whole Qwen2.5-VL actor ([`backward`]; one block in
//! `block_bwd`, the vision tower and merger in `vision_bwd`), and the step API the RL loop calls
//! ([`step::Trainer`]). The backward runs on one rank's part of the model
//! (`RankModel::forward_backward`) over a communicator: the single-rank trainer is rank 0 of a
//! group of one, a tensor-parallel rank the same code with its shard and group.
//!
//! What this module knows: per-token log-probs, advantages and masks of response tokens; named
//! parameter tensors and their gradients; the model's saved activations. What it does not know:
//! plans, streams, the RL loop's data or rewards (rewards arrive as numbers).
//!
//! Invariant: every reduction runs in a fixed order that depends only on the shapes of its inputs
//! (never on thread timing or completion order), so a step is bitwise reproducible.

pub mod adamw;
pub mod backward;
pub(crate) mod block_bwd;
pub mod loss;
pub mod step;
#[cfg(test)]
mod tests;
mod vision_bwd;

pub use adamw::{AdamW, GradAccumulator, OptParam, OptTable, StepReport};
pub use backward::{forward_backward, GroupBatch, MicroBatchOutput, ResponseBatch, TrainConfig};
pub use loss::{
    broadcast_advantages, grpo_advantages, policy_loss, LossBatch, LossConfig, LossMetrics,
    Normaliser,
};
pub use step::{TrainStepReport, Trainer};

/// Errors of the training engine. Each names the offending input so the caller can fix it.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A tensor or per-token array has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        what: String,
        expected: usize,
        got: usize,
    },
    /// An input violates a documented precondition (message says which and why).
    #[error("{0}")]
    Invalid(String),
    /// The model's forward refused its input.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A kernel was called with inconsistent shapes (a bug in the caller; the message names it).
    #[error(transparent)]
    Kernel(#[from] rollplex_kernels::KernelError),
}

pub type Result<T> = std::result::Result<T, TrainError>;

/// A failed collective of the rank's group, as the model reports it.
impl From<crate::tp::CommError> for TrainError {
    fn from(e: crate::tp::CommError) -> Self {
        TrainError::Model(crate::model::ModelError::Comm(e))
    }
}

/// Checks that `got` elements are `expected`; the error names `what`.
pub(crate) fn check_len(what: &str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(TrainError::Shape {
            what: what.to_string(),
            expected,
            got,
        })
    }
}
