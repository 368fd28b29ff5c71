//! Tensor parallelism (TP) of the Qwen2.5-VL model on the CPU backend: ranks run as threads of
//! one process and talk through an in-process communicator, so the sharded numerics are tested
//! without GPUs, or as processes (one per GPU) talking over TCP with bitwise the same results;
//! a CUDA/NCCL backend implements the same [`Communicator`] later.
//!
//! The model itself is not here: `model` (forward, decode, scoring) and `train` (the
//! micro-batch's forward, loss and backward) run on one rank's part of the model
//! ([`RankModel`](crate::model::RankModel)) over any [`Communicator`]; the single-rank model is
//! rank 0 of a group of one ([`SoloComm`], whose collectives are no-ops). This module holds what
//! only a group needs.
//!
//! Module map: `comm` (the [`Communicator`] trait, [`SoloComm`], [`ThreadComm`], [`run_ranks`]),
//! `shard` ([`TpPlan`]: which part of every parameter each rank holds; `shard`/`unshard` to and
//! from Hugging Face layout), [`TpModel`] (a rank's shard; `as_rank` is what the engine runs),
//! `optim` ([`TpAdamW`]: AdamW over a shard with the global grad-norm clip), `tcp`
//! ([`TcpComm`]: the communicator between processes, its rendezvous and liveness), `launch`
//! (one process per GPU: `rollplex-run` as launcher, or a rank of a torchrun/slurm job), `check`
//! (what `rollplex-run --tp-check` runs on each launched rank: the TP forward, compared across
//! ranks and with TP = 1).
//!
//! What it knows: how parameters split over ranks and how ranks talk. What it does not know:
//! the RL loop, devices, plans (the binary's `cli` loads them and starts the ranks).
//!
//! Invariants: (1) every rank of a group holds the same replicated values and, after each
//! collective, the same replicated activations (all-reduce results are bitwise equal on every
//! rank), so ranks never diverge; (2) a TP run is bitwise reproducible for a given degree
//! (collectives reduce in rank order); (3) at degree 1 every operation (forward and gradients) is
//! bitwise the single-rank model's and trainer's: they are the same code over `SoloComm`.

pub mod check;
pub mod comm;
pub mod launch;
pub mod optim;
pub mod shard;
pub mod tcp;

use std::sync::Arc;

use rollplex_kernels::KernelError;

pub use comm::{
    all_gather_uneven, run_ranks, CommError, Communicator, Elem, RankError, ReduceOp, SoloComm,
    ThreadComm,
};
pub use optim::TpAdamW;
pub use shard::{split_range, RankDims, Split, TpPlan};
pub use tcp::{run_ranks_tcp, TcpComm, TcpOptions};

use crate::model::{ModelError, RankModel, Weights};

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// The model does not split over the requested degree, or shards do not fit their plan.
    #[error("tensor parallelism: {0}")]
    Config(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Model(ModelError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// A model error; a failed collective inside the model stays a communicator error (which rank
/// failed decides who is blamed).
impl From<ModelError> for TpError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Comm(c) => TpError::Comm(c),
            other => TpError::Model(other),
        }
    }
}

/// A trainer error: a failed collective stays a communicator error, a kernel's stays a kernel
/// error, the rest name the input that was refused.
impl From<crate::train::TrainError> for TpError {
    fn from(e: crate::train::TrainError) -> Self {
        match e {
            crate::train::TrainError::Kernel(k) => TpError::Kernel(k),
            crate::train::TrainError::Model(m) => m.into(),
            other => TpError::Config(other.to_string()),
        }
    }
}

/// One rank's part of a tensor-parallel model: the plan every rank shares and this rank's shard.
#[derive(Clone, Debug)]
pub struct TpModel {
    pub plan: Arc<TpPlan>,
    pub rank: usize,
    /// The rank's shard: every parameter of the model with this rank's shape (see `shard`).
    pub weights: Weights,
}

impl TpModel {
    /// Rank `rank`'s shard of full weights.
    pub fn shard(plan: Arc<TpPlan>, full: &Weights, rank: usize) -> Result<Self, TpError> {
        let weights = plan.shard(full, rank)?;
        Ok(TpModel {
            plan,
            rank,
            weights,
        })
    }

    pub fn dims(&self) -> &RankDims {
        self.plan.dims(self.rank)
    }

    /// This rank's part as the model engine runs it (borrowed: nothing is copied).
    pub fn as_rank(&self) -> RankModel<'_> {
        RankModel {
            config: &self.plan.config,
            weights: &self.weights,
            dims: self.dims().clone(),
            rank: self.rank,
            degree: self.plan.degree,
        }
    }
}

/// Rank `rank`'s shard of `weights` (a model of `config`) at degree `tp`; a shorthand for
/// [`TpPlan::new`] + [`TpPlan::shard`] (keep the plan when sharding for several ranks).
pub fn shard(
    config: &crate::model::ModelConfig,
    weights: &Weights,
    tp: usize,
    rank: usize,
) -> Result<Weights, TpError> {
    TpPlan::new(config, tp)?.shard(weights, rank)
}

/// Full weights in Hugging Face layout from every rank's shard (in rank order); a shorthand for
/// [`TpPlan::new`] + [`TpPlan::unshard`].
pub fn unshard(config: &crate::model::ModelConfig, shards: &[Weights]) -> Result<Weights, TpError> {
    TpPlan::new(config, shards.len())?.unshard(shards)
}

/// Shards a model for `degree` ranks: the plan and every rank's [`TpModel`], in rank order.
pub fn shard_all(full: &crate::model::Qwen25VL, degree: usize) -> Result<Vec<TpModel>, TpError> {
    let plan = Arc::new(TpPlan::new(&full.config, degree)?);
    (0..degree)
        .map(|r| TpModel::shard(Arc::clone(&plan), &full.weights, r))
        .collect()
}

#[cfg(test)]
mod tcp_tests;
#[cfg(test)]
mod tests;
