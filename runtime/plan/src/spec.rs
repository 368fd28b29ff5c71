//! The job specification: everything a `.rpx` pipeline says, resolved and checked.
//!
//! This is the one description of a job that crosses every boundary: the DSL produces it
//! (after name resolution and semantic checks), the compiler lowers it into a [`crate::Plan`],
//! and the plan carries a copy so that the runtime can build the models, the data and the RL
//! loop without knowing the DSL. All sizes are in plain units: bytes, bytes/s, FLOP/s.
//!
//! Invariant: nothing here depends on the DSL, the solver or the GPU; every type is plain data
//! with a stable serde form (field order is the YAML order).

use serde::{Deserialize, Serialize};

/// One RL post-training job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The pipeline's name (`pipeline <name> { ... }`).
    pub name: String,
    /// Global seed: weights (when random), sampling, data order.
    pub seed: u64,
    pub cluster: ClusterSpec,
    /// The actor (trained) model; the reference model is a frozen copy of its initial weights.
    pub actor: ModelSpec,
    pub reference: ReferenceSpec,
    pub rollout: RolloutSpec,
    pub reward: RewardSpec,
    pub train: TrainSpec,
    pub schedule: ScheduleSpec,
}

/// The GPUs of the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    pub gpu: GpuSpec,
    /// Total number of GPUs.
    pub count: u32,
    /// GPUs per node (the rest of `count` is spread over further nodes).
    pub gpus_per_node: u32,
    /// GPU-GPU bandwidth inside a node, bytes/s per direction (NVLink).
    pub intra_node_bw: f64,
    /// GPU-GPU bandwidth across nodes, bytes/s per GPU (InfiniBand).
    pub inter_node_bw: f64,
}

/// One GPU model, as the cost model sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// e.g. "H200", "H800", or "cpu" for the CPU backend.
    pub name: String,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// SM partitions come in multiples of this (8 on Hopper green contexts).
    pub sm_granularity: u32,
    /// Device memory, bytes.
    pub hbm_bytes: u64,
    /// Device memory bandwidth, bytes/s (datasheet or measured).
    pub hbm_bw: f64,
    /// Dense bf16 tensor-core rate, FLOP/s.
    pub bf16_flops: f64,
    /// Host <-> device bandwidth, bytes/s per direction.
    pub host_bw: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Bf16,
    F16,
    F32,
}

impl DType {
    pub fn bytes(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// A Qwen2.5-VL-family model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Human name ("qwen2.5-vl-3b", "tiny").
    pub name: String,
    pub vision: VisionDims,
    pub text: TextDims,
    pub tokens: SpecialTokens,
    /// Compute dtype of weights and activations on the GPU (the CPU backend computes in f32).
    pub dtype: DType,
    pub weights: WeightsSource,
}

/// Vision tower dimensions (Hugging Face `vision_config`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VisionDims {
    pub depth: u32,
    pub hidden_size: u32,
    pub num_heads: u32,
    pub intermediate_size: u32,
    pub patch_size: u32,
    pub temporal_patch_size: u32,
    pub spatial_merge_size: u32,
    /// Window attention window, in pixels (112 in Qwen2.5-VL).
    pub window_size: u32,
    /// Blocks that use full attention instead of window attention.
    pub fullatt_block_indexes: Vec<u32>,
    pub in_channels: u32,
    /// Width of the merger output (= the text hidden size).
    pub out_hidden_size: u32,
}

impl VisionDims {
    /// Values in one patch: channels x temporal x spatial patch size (the patch GEMM's width).
    pub fn patch_dim(&self) -> u64 {
        (self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size) as u64
    }
}

/// Text decoder dimensions (Hugging Face `text_config`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextDims {
    pub num_layers: u32,
    pub hidden_size: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub intermediate_size: u32,
    pub vocab_size: u32,
    pub rope_theta: f64,
    /// M-RoPE sections (temporal, height, width), in rotary half-dims; sum = head_dim / 2.
    pub mrope_section: [u32; 3],
    pub tie_word_embeddings: bool,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: u32,
}

impl TextDims {
    pub fn head_dim(&self) -> u32 {
        self.hidden_size / self.num_heads
    }
}

/// Token ids with a meaning to the model (Qwen2.5-VL defaults for the real vocabulary).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpecialTokens {
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// End-of-sequence ids (generation stops on any of them unless the rollout overrides).
    pub eos_token_ids: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsSource {
    /// A Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json).
    Checkpoint { path: String },
    /// Random initialisation from a seed (benchmarks, tests).
    Random { seed: u64 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReferenceSpec {
    /// Whether a reference model is scored at all (false when the KL coefficient is 0).
    pub enabled: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RolloutSpec {
    pub tp: u32,
    /// Distinct prompts per iteration.
    pub prompts_per_iter: u32,
    /// GRPO group size: samples per prompt.
    pub group_size: u32,
    pub media: MediaSpec,
    /// Text tokens of each prompt (besides the media tokens).
    pub prompt_text_tokens: u32,
    pub max_new_tokens: u32,
    /// Expected response lengths: the planner sizes decode windows with it, and benchmarks with
    /// random weights stop each sample at a length drawn from it.
    pub response_len: LengthDist,
    pub sampling: SamplingSpec,
    /// Dataset: JSONL/Parquet path, or a built-in generator name.
    pub dataset: DatasetSpec,
}

impl RolloutSpec {
    /// Samples per iteration (prompts x group size).
    pub fn samples(&self) -> u32 {
        self.prompts_per_iter * self.group_size
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MediaSpec {
    None,
    /// `count` images per prompt, each `height` x `width` pixels.
    Image {
        count: u32,
        height: u32,
        width: u32,
    },
    /// One video per prompt, `frames` frames of `height` x `width` pixels.
    Video {
        frames: u32,
        height: u32,
        width: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthDist {
    /// Every response has this many tokens (capped at max_new_tokens).
    Fixed {
        tokens: u32,
    },
    Uniform {
        min: u32,
        max: u32,
    },
    /// Log-normal with the given median and sigma (of the log), capped at max_new_tokens.
    LogNormal {
        median: f64,
        sigma: f64,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingSpec {
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: u32,
    /// Extra stop token ids besides the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Benchmarks with random weights: stop each sample at a length drawn from `response_len`.
    pub forced_lengths: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetSpec {
    /// JSONL or Parquet file with prompt, media paths, answer.
    File { path: String },
    /// A built-in generator (e.g. "moving_shapes"), deterministic from the job seed.
    Generated { name: String, size: u32 },
    /// Synthetic prompts of the declared shape (benchmarks).
    Synthetic,
}

/// The built-in rewards' names, as a pipeline writes them in `builtin("...")`.
pub const BUILTIN_REWARDS: &[&str] = &["exact_match", "choice_letter", "numeric", "math", "format"];

/// The tag names the `format` reward looks for unless the pipeline names others.
pub const FORMAT_THINK_TAG: &str = "think";
pub const FORMAT_ANSWER_TAG: &str = "answer";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardSpec {
    /// A built-in reward by name: "exact_match", "choice_letter", "numeric" (`tolerance`:
    /// absolute), "math" (`tolerance`: relative, for values with an irrational part).
    Builtin { name: String, tolerance: f64 },
    /// An external command speaking JSON lines over stdin/stdout.
    Command { argv: Vec<String>, timeout_s: f64 },
    /// The built-in `format` reward: reasoning in `<think>` tags, then the answer in `<answer>`
    /// tags or `\boxed{}`; the tag names (without brackets; an empty `think` asks for no
    /// reasoning block).
    Format { think: String, answer: String },
    /// A weighted sum of rewards, `sum_i weight_i * reward_i`, added in the order written.
    Sum { terms: Vec<WeightedReward> },
}

/// One term of [`RewardSpec::Sum`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightedReward {
    pub weight: f64,
    pub reward: RewardSpec,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    pub tp: u32,
    pub algorithm: Algorithm,
    pub optimizer: AdamWSpec,
    /// Samples per micro-batch (one forward/backward).
    pub micro_batch: u32,
    /// Samples per optimizer step; samples per iteration / mini_batch = optimizer steps.
    pub mini_batch: u32,
    /// Passes over the iteration's samples (PPO epochs).
    pub epochs: u32,
    pub freeze_vision: bool,
    pub freeze_merger: bool,
    pub recompute: Recompute,
    /// Where the optimizer state lives between steps and how the step reaches it
    /// (`train { optimizer_state }`); under `auto` the planner decides.
    pub optimizer_state: OptimizerState,
    /// GRPO groups trained per iteration (`train { groups }`); `None`: every rolled-out group.
    /// Fewer than `rollout.prompts_per_iter` is dynamic sampling (DAPO): more groups are rolled
    /// out and scored than trained, and the runtime picks the trained ones after rewards by
    /// [`pick_trained_groups`]'s rule, so every shape of the plan stays static.
    pub groups: Option<u32>,
    /// Whether the old log-probs get a forward pass of their own (`train { old_logprobs }`);
    /// the compiler's decision is the plan's `old_logprobs`.
    pub old_logprobs: OldLogProbPass,
    /// Whether the training prompt forwards get a pass of their own in the training layout
    /// (`train { prompt_forward }`); the compiler's decision is the plan's `train_prefix`.
    pub prompt_forward: PromptForwardPass,
}

impl TrainSpec {
    /// GRPO groups trained per iteration.
    pub fn trained_groups(&self, rollout: &RolloutSpec) -> u32 {
        self.groups.unwrap_or(rollout.prompts_per_iter)
    }
}

/// Dynamic sampling's deterministic rule: which `trained` of the groups (in prompt order, each
/// with the rewards of its samples) train this iteration. The groups whose rewards are not all
/// equal (non-zero variance: they carry a learning signal) come first, in prompt order; when
/// fewer than `trained` have variance, the rest are padded with the others in prompt order.
/// Returns the picked group indices in ascending (prompt) order; every backend and every mode
/// applies this one function, so the pick is a function of the rewards alone.
pub fn pick_trained_groups(rewards: &[Vec<f32>], trained: usize) -> Vec<usize> {
    let varied = |r: &Vec<f32>| r.iter().any(|&x| x != r[0]);
    let mut picked: Vec<usize> = (0..rewards.len())
        .filter(|&g| !rewards[g].is_empty() && varied(&rewards[g]))
        .take(trained)
        .collect();
    let pad: Vec<usize> = (0..rewards.len())
        .filter(|g| !picked.contains(g))
        .take(trained.saturating_sub(picked.len()))
        .collect();
    picked.extend(pad);
    picked.sort_unstable();
    picked
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Group-normalised advantages, clipped ratio, KL to the reference.
    Grpo(PolicyLoss),
    /// PPO-clip with advantages given per sample (same loss code path).
    PpoClip(PolicyLoss),
}

impl Algorithm {
    pub fn loss(&self) -> &PolicyLoss {
        match self {
            Algorithm::Grpo(l) | Algorithm::PpoClip(l) => l,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyLoss {
    /// Lower clip: ratio >= 1 - clip_low.
    pub clip_low: f64,
    /// Upper clip: ratio <= 1 + clip_high.
    pub clip_high: f64,
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub loss_agg: LossAgg,
    /// Divide advantages by the group's std (GRPO); false keeps mean-centring only (Dr. GRPO).
    pub norm_adv_by_std: bool,
    /// How rewards become advantages.
    pub advantage: AdvantageEstimator,
    /// Where the importance ratio is taken: per token (PPO, GRPO, DAPO) or per sequence (GSPO).
    pub ratio: RatioLevel,
    /// Truncated importance sampling against the sampler (veRL's `tis_imp_ratio_cap`): each
    /// token's policy-gradient term is weighted by `min(pi_old / pi_sampler, cap)`; `None`: off.
    pub tis_cap: Option<f64>,
    /// DAPO's overlong reward shaping; `None`: off.
    pub overlong: Option<Overlong>,
}

/// How rewards become per-sample advantages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GRPO: reward minus the group mean, over the group's std when `norm_adv_by_std`.
    Group,
    /// REINFORCE++ with a baseline (OpenRLHF's `reinforce_baseline`): reward minus the group
    /// mean, then whitened over every response token of the iteration's trained samples
    /// (token-weighted mean and biased std).
    ReinforceBaseline,
}

/// The level of the importance ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// `exp(logp - old)` per token.
    Token,
    /// GSPO: `exp(mean_t(logp - old))` per sequence, clipped per sequence, the gradient
    /// through every token (the paper's GSPO-token form).
    Sequence,
}

/// DAPO's soft overlong punishment: a response of `L` tokens with `L > max_new_tokens -
/// buffer` gets `-(L - (max_new_tokens - buffer)) / buffer * penalty` added to its reward.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Overlong {
    /// Tokens before the maximum length over which the penalty grows (>= 1).
    pub buffer: u32,
    /// The penalty at the maximum length.
    pub penalty: f64,
}

impl Overlong {
    /// The reward added to a response of `len` tokens when responses stop at `max_len`.
    pub fn shaping(&self, len: u32, max_len: u32) -> f64 {
        let expected = max_len.saturating_sub(self.buffer);
        if len <= expected || self.buffer == 0 {
            return 0.0;
        }
        -((len - expected) as f64) / self.buffer as f64 * self.penalty
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    K1,
    K2,
    K3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAgg {
    /// Mean over all response tokens of the mini-batch.
    TokenMean,
    /// Mean over sequences of each sequence's token mean.
    SeqMeanTokenMean,
    /// Mean over sequences of each sequence's token sum.
    SeqMeanTokenSum,
    /// Dr. GRPO: the token sum over the mini-batch divided by a constant, the maximum response
    /// length (`rollout.max_new_tokens`) times the mini-batch's sequences, so that no sequence's
    /// tokens weigh by its own length.
    SeqMeanTokenSumNorm,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWSpec {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global grad-norm clip; 0 disables.
    pub grad_clip: f64,
    pub lr_schedule: LrSchedule,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    Constant,
    LinearWarmup {
        warmup_steps: u32,
    },
    Cosine {
        warmup_steps: u32,
        total_steps: u32,
        min_lr_ratio: f64,
    },
}

/// What a pipeline asks of the training prompt forwards (each group's prompt forward with grad
/// that the micro-batches train through).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptForwardPass {
    /// Keep the rollout's prefill as that forward where it is the same one (see
    /// `TrainPrefixSource::why_not_rollout`); a pass of their own elsewhere.
    Auto,
    /// Always a pass of their own in the training layout (what the reuse saves, measured).
    Recompute,
}

/// What a pipeline asks of the old-log-prob pass (the actor's forward with the rollout's
/// weights that gives the importance ratio its denominator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogProbPass {
    /// Run it only when it can differ from the training forward: several optimizer steps per
    /// iteration (mini-batches or epochs), or truncated importance sampling, which weighs each
    /// token by `pi_old / pi_sampler` before the loss. Otherwise every micro-batch's forward
    /// runs with the rollout's weights and its own log-probs, detached, are the old ones.
    Auto,
    /// Always run it.
    Recompute,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every activation backward needs.
    None,
    /// Keep only each layer's input and recompute the layer in backward.
    Full,
    /// The planner decides per layer: the first text layers keep every activation, the rest
    /// keep their input and are recomputed, as many kept as the memory budget allows (the
    /// plan's [`crate::Plan::kept_act_layers`]).
    Auto,
}

/// Residency of the optimizer state (fp32 master weights and Adam moments):
/// `train { optimizer_state }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerState {
    /// The planner decides (an ILP choice among the three below, under the memory rows).
    Auto,
    /// In HBM throughout.
    Hbm,
    /// On the host between steps: reloaded whole before the first optimizer step and written
    /// back after the last.
    Host,
    /// On the host, streamed through the device in chunks by each optimizer step
    /// ([`crate::OptimizerStream`]).
    Stream,
}

impl Recompute {
    /// Text layers (of `layers`) whose activations are kept, where the policy fixes it;
    /// `None` for `Auto` (the plan's answer).
    pub fn kept_layers(self, layers: u32) -> Option<u32> {
        match self {
            Recompute::None => Some(layers),
            Recompute::Full => Some(0),
            Recompute::Auto => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Serial,
    Overlap,
    Disaggregated,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    pub mode: Mode,
    /// One prefix per GRPO group and one vision encoding per media item (true), or every phase
    /// recomputes every sample's prefix (false, as veRL does).
    pub prefix_dedup: bool,
    /// Decode steps per window.
    pub decode_window: u32,
    /// Device memory the plan may use per GPU, bytes (defaults to the GPU's HBM).
    pub memory_budget: u64,
    /// Host memory available for offload per GPU, bytes.
    pub host_memory: u64,
}

/// Parameter counts of a model, by part (weights only; biases included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamCount {
    pub vision: u64,
    pub merger: u64,
    pub text: u64,
}

impl ParamCount {
    pub fn total(&self) -> u64 {
        self.vision + self.merger + self.text
    }
}

impl ModelSpec {
    /// Parameters of each part, as the Hugging Face Qwen2.5-VL implementation lays them out.
    pub fn param_count(&self) -> ParamCount {
        let v = &self.vision;
        let (vh, vi) = (v.hidden_size as u64, v.intermediate_size as u64);
        let patch_in = v.patch_dim();
        // per block: norm1, norm2 (RMSNorm weights), qkv (+bias), proj (+bias), gate/up (+bias), down (+bias)
        let block =
            2 * vh + (3 * vh * vh + 3 * vh) + (vh * vh + vh) + 2 * (vh * vi + vi) + (vi * vh + vh);
        let vision = patch_in * vh + v.depth as u64 * block;
        // merger: ln_q (RMSNorm over vh), mlp: Linear(vh*m^2 -> vh*m^2) GELU Linear(vh*m^2 -> out)
        let m2 = (v.spatial_merge_size * v.spatial_merge_size) as u64;
        let mh = vh * m2;
        let out = v.out_hidden_size as u64;
        let merger = vh + (mh * mh + mh) + (mh * out + out);
        let t = &self.text;
        let (h, f, voc) = (
            t.hidden_size as u64,
            t.intermediate_size as u64,
            t.vocab_size as u64,
        );
        let hd = t.head_dim() as u64;
        let (nq, nkv) = (t.num_heads as u64, t.num_kv_heads as u64);
        let attn = h * nq * hd + nq * hd + 2 * (h * nkv * hd + nkv * hd) + nq * hd * h;
        let layer = 2 * h + attn + 3 * h * f;
        let head = if t.tie_word_embeddings { 0 } else { voc * h };
        let text = voc * h + t.num_layers as u64 * layer + h + head;
        ParamCount {
            vision,
            merger,
            text,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_shaping_by_hand() {
        // max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4 * penalty.
        let o = Overlong {
            buffer: 4,
            penalty: 1.0,
        };
        assert_eq!(o.shaping(6, 10), 0.0);
        assert_eq!(o.shaping(8, 10), -0.5);
        assert_eq!(o.shaping(10, 10), -1.0);
        let half = Overlong {
            buffer: 4,
            penalty: 0.5,
        };
        assert_eq!(half.shaping(9, 10), -0.375);
        // a buffer longer than the responses starts at length 0
        assert_eq!(o.shaping(2, 3), -0.5);
    }

    #[test]
    fn dynamic_sampling_picks_varied_groups_in_prompt_order() {
        let r = |v: &[f32]| v.to_vec();
        let groups = [
            r(&[1.0, 1.0]),
            r(&[0.0, 1.0]),
            r(&[0.0, 0.0]),
            r(&[1.0, 0.0]),
        ];
        // two with variance: groups 1 and 3
        assert_eq!(pick_trained_groups(&groups, 2), vec![1, 3]);
        // only the first with variance when one is trained
        assert_eq!(pick_trained_groups(&groups, 1), vec![1]);
        // too few: padded with the others in prompt order (group 0 first)
        assert_eq!(pick_trained_groups(&groups, 3), vec![0, 1, 3]);
        assert_eq!(pick_trained_groups(&groups, 4), vec![0, 1, 2, 3]);
        let flat = [r(&[0.0, 0.0]), r(&[1.0, 1.0])];
        assert_eq!(pick_trained_groups(&flat, 1), vec![0]);
    }
}
