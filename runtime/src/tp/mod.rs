//! Tensor parallelism (TP) of the Qwen2.5-VL model on the CPU backend: ranks run as threads of
//! one process and talk through an in-process communicator, so the sharded numerics are tested
//! without GPUs, or as processes (one per GPU) talking over TCP with bitwise the same results;
//! a CUDA/NCCL backend implements the same [`Communicator`] later.
//!
//! Module map: `comm` (the [`Communicator`] trait, [`ThreadComm`], [`run_ranks`]), `shard`
//! ([`TpPlan`]: which part of every parameter each rank holds; `shard`/`unshard` to and from
//! Hugging Face layout), `block` (one transformer block with column/row-parallel linears and
//! its two all-reduces), `text` (vocab-parallel embedding, prefill, decode over a per-rank KV
//! arena, scoring with a vocab-parallel log-softmax, greedy argmax), `vision` (the vision tower
//! and merger, heads split, and its backward), `backward` (the text decoder's backward and the
//! TP block backward both towers use: column/row-parallel with the conjugate collectives),
//! `train` (a GRPO micro-batch's forward, loss and backward, as `train::forward_backward`),
//! `optim` ([`TpAdamW`]: AdamW over a shard with the global grad-norm clip), `tcp`
//! ([`TcpComm`]: the communicator between processes, its rendezvous and liveness), `launch`
//! (one process per GPU: `rollplex-run` as launcher, or a rank of a torchrun/slurm job), `check`
//! (what `rollplex-run --tp-check` runs on each launched rank: the TP forward, compared across
//! ranks and with TP = 1).
//!
//! What it knows: the model's forward and backward, the policy loss's inputs, and where the
//! collectives go. What it does not know: the RL loop, devices, plans (the
//! binary's `cli` loads them and starts the ranks).
//!
//! Invariants: (1) every rank of a group holds the same replicated values and, after each
//! collective, the same replicated activations (all-reduce results are bitwise equal on every
//! rank), so ranks never diverge; (2) a TP run is bitwise reproducible for a given degree
//! (collectives reduce in rank order); (3) at degree 1 every operation (forward and gradients) is
//! bitwise the single-rank model's and trainer's (the row-parallel bias is added after the
//! matmul, as `linear_fwd` does).

pub mod backward;
pub mod block;
pub mod check;
pub mod comm;
pub mod launch;
pub mod optim;
pub mod shard;
pub mod tcp;
pub mod text;
pub mod train;
pub mod vision;

use std::sync::Arc;

use rollplex_kernels::KernelError;

pub use comm::{
    all_gather_uneven, run_ranks, CommError, Communicator, Elem, RankError, ReduceOp, ThreadComm,
};
pub use optim::TpAdamW;
pub use shard::{split_range, RankDims, Split, TpPlan};
pub use tcp::{run_ranks_tcp, TcpComm, TcpOptions};

use crate::model::{ModelError, Weights};

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// The model does not split over the requested degree, or shards do not fit their plan.
    #[error("tensor parallelism: {0}")]
    Config(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
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

    /// Checks that a communicator belongs to this model's group.
    pub(crate) fn check_comm<C: Communicator>(&self, comm: &C) -> Result<(), TpError> {
        if comm.world() != self.plan.degree || comm.rank() != self.rank {
            return Err(TpError::Config(format!(
                "rank {} of a TP-{} model called with communicator rank {} of {}",
                self.rank,
                self.plan.degree,
                comm.rank(),
                comm.world()
            )));
        }
        Ok(())
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
