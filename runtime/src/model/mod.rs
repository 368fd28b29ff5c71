//! The Qwen2.5-VL model engine on the CPU backend: weights, checkpoints, the vision tower, the
//! text decoder and the operations the RL loop runs (encode media, prefill a group's prompt once,
//! decode over a shared-prefix KV arena, score responses from a kept prefix, sample).
//!
//! Numerics follow Hugging Face transformers 5.17's `Qwen2_5_VLForConditionalGeneration` in
//! f32 (eager attention); `tests/reference/` compares the two.
//!
//! One engine for one rank and for a tensor-parallel group: every operation runs on a
//! [`RankModel`] (the config, the rank's weights, its widths) over a
//! [`Communicator`](crate::tp::Communicator). The [`Qwen25VL`] methods are rank 0 of a group of
//! one (`tp::SoloComm`, whose collectives are no-ops: no copies, the same arithmetic);
//! `tp::TpModel::as_rank` gives a shard's.
//!
//! Module map: `config` (dims from config.json), `weights` (one buffer carved by a name/shape
//! table), `checkpoint` (safetensors load/save), `positions` (window index, 2D RoPE, M-RoPE
//! `get_rope_index`), `block` (the transformer block both towers share: column- and
//! row-parallel linears), `vision` (`encode_media`), `text` (`prefill`, `decode_step`, `score`,
//! KV arena; vocab-parallel embedding and head), `vocab` (log-softmax, greedy and gathered
//! logits over a vocabulary split across ranks), `generate` (a group's rollout), `sampling`
//! (temperature/top-k/top-p over Philox keys), `cache` (what backward needs).
//!
//! Invariant: the model never depends on batch composition: every public operation gives
//! bitwise the same per-sample results whether a sample runs alone or with others.

use std::path::{Path, PathBuf};

use rollplex_kernels::KernelError;
use rollplex_plan::spec::ModelSpec;

use crate::tp::{CommError, Communicator, RankDims};

pub mod block;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod generate;
pub mod positions;
pub mod sampling;
pub mod text;
pub mod vision;
pub mod vocab;
pub mod weights;

pub use cache::{CacheMode, ForwardCache, LayerCache, VisionCache};
pub use checkpoint::{load_checkpoint, save_checkpoint};
pub use config::ModelConfig;
pub use generate::{GenerateConfig, Rollout};
pub use positions::{Grid, MediaKind};
/// The counter-based RNG of sampling and random weights (its one implementation is in kernels).
pub use rollplex_kernels::cpu::philox;
pub use sampling::{sample_token, SampleKey, SamplingParams, StopReason};
pub use text::{DecodeSlot, KvArena, KvSpan, PrefixState, Prompt, TokenScores};
pub use vision::{EncodedMedia, MediaInput};
pub use weights::{Layout, ParamId, ParamTable, Weights};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model config: {0}")]
    Config(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("model input: {0}")]
    Input(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A collective of the rank's tensor-parallel group failed (never over `SoloComm`).
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A Qwen2.5-VL model: its configuration and its weights.
#[derive(Clone, Debug)]
pub struct Qwen25VL {
    pub config: ModelConfig,
    pub weights: Weights,
}

impl Qwen25VL {
    /// Pairs a config with weights built for it.
    pub fn new(config: ModelConfig, weights: Weights) -> Result<Self, ModelError> {
        config.validate()?;
        let (table, _) = weights::build_table(&config);
        if table != weights.table || weights.data.len() != table.total() {
            return Err(ModelError::Config(
                "weights were built for another configuration".into(),
            ));
        }
        Ok(Qwen25VL { config, weights })
    }

    /// A randomly initialised model of the spec's dimensions (see [`Weights::random`]).
    pub fn random(spec: ModelSpec, seed: u64) -> Result<Self, ModelError> {
        let config = ModelConfig::from_spec(spec)?;
        let weights = Weights::random(&config, seed);
        Ok(Qwen25VL { config, weights })
    }

    /// Loads a Hugging Face checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        load_checkpoint(dir)
    }

    /// The whole model as the engine runs it: rank 0 of a group of one (over `SoloComm`).
    pub fn as_rank(&self) -> RankModel<'_> {
        RankModel {
            config: &self.config,
            weights: &self.weights,
            dims: RankDims::whole(&self.config),
            rank: 0,
            degree: 1,
        }
    }
}

/// One rank's part of a model, what the engine (`block`, `text`, `vision`, and the trainer)
/// runs on: the config, the rank's weights (the whole model at degree 1, its shard under tensor
/// parallelism) and the rank's widths. It borrows: making one copies no weights.
#[derive(Clone, Debug)]
pub struct RankModel<'a> {
    pub config: &'a ModelConfig,
    /// Every parameter of the model with this rank's shape (`tp::TpPlan::shard`).
    pub weights: &'a Weights,
    pub dims: RankDims,
    pub rank: usize,
    pub degree: usize,
}

impl RankModel<'_> {
    /// Checks that a communicator belongs to this rank's group.
    pub(crate) fn check_comm<C: Communicator>(&self, comm: &C) -> Result<(), ModelError> {
        if comm.world() != self.degree || comm.rank() != self.rank {
            return Err(ModelError::Config(format!(
                "rank {} of a TP-{} model called with communicator rank {} of {}",
                self.rank,
                self.degree,
                comm.rank(),
                comm.world()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests;
