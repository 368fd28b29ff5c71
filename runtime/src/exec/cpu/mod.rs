//! The CPU backend: a plan run with the CPU model engine (f32) on one rank or on a
//! tensor-parallel group of ranks, all through one code path. The single-rank run is rank 0 of
//! a group of one (the whole model, `SoloComm`); a plan with rollout TP = training TP = GPU
//! count = `N` runs the same code on `N` ranks, each with its shard.
//!
//! Module map: `engine` ([`CpuModels`]: one rank's models, its [`Trainer`](crate::train::Trainer)
//! and optional reference and disaggregated rollout copy; [`RankEngine`]: the model calls an
//! iteration makes, over the rank's communicator; [`TrainState`]: the whole model's training
//! state a checkpoint holds, gathered from and restored to the ranks), `iteration`
//! ([`CpuIteration`]: every plan op on one rank), `ranks` ([`run_cpu_loop`] and [`run_rank`]:
//! the loop, prompts and rewards shared from rank 0, the ranks' agreement check).

mod engine;
mod iteration;
mod ranks;

pub use engine::{
    build_cpu_models, build_rank, build_ranks, gather_actor, gather_train_state, restore_rank,
    train_config, unshard_actor, CpuEngine, CpuModels, RankEngine, Role, TrainState,
};
pub use iteration::{CpuIteration, RewardFn};
pub use ranks::{
    run_cpu_iterations, run_cpu_loop, run_rank, share_prompts, RootSide, SendRewardFn,
};
