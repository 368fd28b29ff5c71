//! The Qwen2.5-VL model engine on the CPU backend: weights, checkpoints, the vision tower, the
//! text decoder and the operations the RL loop runs (encode media, prefill a group's prompt once,
//! decode over a shared-prefix KV arena, score responses from a kept prefix, sample).
//!
//! Numerics follow Hugging Face transformers 5.17's `Qwen2_5_VLForConditionalGeneration` in
//! f32 (eager attention); `tests/reference/` compares the two.
//!
//! Module map: `config` (dims from config.json), `weights` (one buffer carved by a name/shape
//! table), `checkpoint` (safetensors load/save), `positions` (window index, 2D RoPE, M-RoPE
//! `get_rope_index`), `block` (the transformer block both towers share), `vision`
//! (`encode_media`), `text` (`prefill`, `decode_step`, `score`, KV arena), `generate` (a group's
//! rollout), `sampling` (temperature/top-k/top-p over Philox keys), `cache` (what backward needs).
//!
//! Invariant: the model never depends on batch composition: every public operation gives
//! bitwise the same per-sample results whether a sample runs alone or with others.

use std::path::{Path, PathBuf};

use rollplex_kernels::KernelError;
use rollplex_plan::spec::ModelSpec;

pub mod block;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod generate;
pub mod philox;
pub mod positions;
pub mod sampling;
pub mod text;
pub mod vision;
pub mod weights;

pub use cache::{CacheMode, ForwardCache, LayerCache, VisionCache};
pub use checkpoint::{load_checkpoint, save_checkpoint};
pub use config::ModelConfig;
pub use generate::{GenerateConfig, Rollout};
pub use positions::{Grid, MediaKind};
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
}

#[cfg(test)]
pub(crate) mod tests;
