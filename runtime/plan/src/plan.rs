//! The plan: a static execution schedule of one RL iteration, as the compiler emits it and the
//! runtime executes it.
//!
//! Shape of a plan (field order is the YAML order; tables are `Vec`s indexed by typed ids):
//! - [`Target`], [`Mode`], [`Parallelism`]: what machine and layout the plan was compiled for;
//! - [`Predicted`], [`SolverStats`]: the planner's prediction and how it was found;
//! - `gpus`: the GPU programs. One [`Gpu`] is a set of ranks that run the same schedule SPMD,
//!   each on its own data shard (tensor-parallel peers and data-parallel replicas run identical
//!   schedules, so a 32-GPU colocated plan has one program);
//! - `streams` per GPU program, `windows` (decode windows with their SM split), `tasks` in
//!   issue order, `buffers` with their roles ([`BufferRole`]: what a program matches on; names
//!   are for display) and arena offsets, `reshards`, `memory` (arenas and peaks);
//! - `spec`: the job spec the plan was compiled from (the runtime builds models, data and the
//!   RL loop from it).
//!
//! Indexing conventions the runtime relies on:
//! - *groups* (prompt indices) are local to a replica: group `g` of rollout replica `r` is the
//!   global prompt `r * prompts_per_rollout_replica + g`; training-layout ops use the training
//!   replica the same way (a training replica with a larger TP degree covers consecutive rollout
//!   replicas). *Samples* are `group * group_size + member`.
//! - *slots* name groups by completion: slot `k` is the `k`-th group of the training replica to
//!   finish decoding, ordered by (finish step, group index). The order is a function of the
//!   sampled tokens only (not of timing), so it is identical in every mode; a slot is bound as
//!   soon as its group has finished, and a task naming a slot waits until it is bound.
//! - *training slots* name the groups training ops cover (`TrainMicroBatch` samples and
//!   `prefix_bwd_slots`, `ActorPrefix` over `Groups::Slots`): training slot `k` is completion
//!   slot `k` when every scored group trains; under dynamic sampling
//!   (`trained_groups_per_train_replica < prompts_per_train_replica`) it is the `k`-th group of
//!   `spec::pick_trained_groups`, bound once every group's rewards are known (the compiler makes
//!   every training op depend on every `Advantages` task then).
//!
//! Invariant: these types are plain data; everything a runtime needs to execute a task is in
//! its [`Op`], its buffers and its dependencies. `crate::validate` lists the checked invariants.

use crate::ids::{ArenaId, BufferId, GpuId, Groups, Span, StreamId, TaskId, WindowId};
use crate::spec::{JobSpec, Mode};
use crate::work::{HostDir, Work, WorkKind};
use serde::{Deserialize, Serialize};

/// A compiled plan. See the module docs for the layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub target: Target,
    pub mode: Mode,
    pub parallel: Parallelism,
    /// Where the policy loss's old log-probs come from.
    pub old_logprobs: OldLogProbSource,
    /// Where the micro-batches' kept prompt forwards come from.
    pub train_prefix: TrainPrefixSource,
    /// Text layers whose training activations are kept for backward (layers `0..this`); the
    /// others keep only their input and are recomputed in backward: the compiler's answer to
    /// the job's `train.recompute` (under `auto`, a residency decision of the ILP).
    pub kept_act_layers: u32,
    /// Text layers whose prompt rows keep their training activations in the kept prompt
    /// forwards (layers `0..this`, every training group); the others keep the rows' layer
    /// input and are recomputed in backward. Fixed with `kept_act_layers` by
    /// `recompute = none | full`; under `auto` a residency decision of the ILP of its own (the
    /// prompt rows live from their forward to the last micro-batch that reads them).
    pub kept_prompt_layers: u32,
    pub predicted: Predicted,
    pub solver: SolverStats,
    pub gpus: Vec<Gpu>,
    pub streams: Vec<Stream>,
    pub windows: Vec<Window>,
    pub tasks: Vec<Task>,
    pub buffers: Vec<Buffer>,
    pub reshards: Vec<Reshard>,
    /// How the actor's weights are shared between the training and the rollout layouts on the
    /// same GPUs (colocated modes; `None` when rollout has GPUs of its own).
    #[serde(default)]
    pub weight_sharing: Option<WeightSharing>,
    /// The training GPU program whose optimizer step streams its state through the device in
    /// chunks (`None`: the state is in HBM, or reloaded whole before the step and written back
    /// after it).
    pub optimizer_stream: Option<OptimizerStream>,
    pub memory: Memory,
    pub spec: JobSpec,
}

/// A streamed optimizer step: the fp32 master weights and Adam moments live in their host
/// copies (`master_weights.host`, `adam_moments.host`: the source of truth between steps), and
/// each optimizer step of `gpu` updates them chunk by chunk. Chunk `k` is the parameters
/// `k * chunk_elems .. min((k + 1) * chunk_elems, total)` of the flat state (trainable tensors
/// in table order; `total` = the masters' host copy bytes / 4). Its masters are staged in
/// slot `k % slots` of the device buffer `master_weights` (slot `j` at `j * chunk_elems` f32),
/// its moments in slot `k % slots` of `adam_moments` (first moments then second moments, each
/// `chunk_elems` f32, slot `j` at `2 * j * chunk_elems`). In a fixed order: the copy of chunk
/// `k + 1` host -> device and the write-back of chunk `k - 1` device -> host overlap the
/// update of chunk `k`; chunk `k` is copied in only once the write-back of the chunk that
/// last used its slot (`k - slots`) is done. The gradient norm and clip factor are computed
/// over every gradient before the first chunk, so the numbers are the in-HBM step's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerStream {
    pub gpu: GpuId,
    /// Parameters (f32 elements of each state tensor) per chunk.
    pub chunk_elems: u64,
    /// Chunks per step: `ceil(total / chunk_elems)`.
    pub chunks: u32,
    /// Staging slots on the device (2 or 3).
    pub slots: u32,
}

impl OptimizerStream {
    /// Device bytes of the masters' staging (`master_weights` of a streamed plan).
    pub fn master_bytes(&self) -> u64 {
        self.slots as u64 * self.chunk_elems * 4
    }
    /// Device bytes of the moments' staging (`adam_moments` of a streamed plan).
    pub fn moment_bytes(&self) -> u64 {
        2 * self.master_bytes()
    }
    /// The parameter range of chunk `k` of `total`.
    pub fn chunk(&self, k: u32, total: u64) -> std::ops::Range<u64> {
        let a = (k as u64 * self.chunk_elems).min(total);
        a..(a + self.chunk_elems).min(total)
    }
}

/// The machine a plan was compiled for; the runtime refuses to run on a different one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// GPU kind (`H200`, `H800`, `cpu`).
    pub gpu: String,
    /// Total GPUs (ranks).
    pub count: u32,
    /// Device memory of one GPU, bytes.
    pub hbm_bytes: u64,
    /// SMs of one GPU.
    pub sms: u32,
    /// SM partitions come in multiples of this.
    pub sm_granularity: u32,
}

/// How ranks are grouped into tensor-parallel replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Parallelism {
    pub rollout_tp: u32,
    pub train_tp: u32,
    pub rollout_replicas: u32,
    pub train_replicas: u32,
    /// Prompts (GRPO groups) each rollout replica generates.
    pub prompts_per_rollout_replica: u32,
    /// Prompts (GRPO groups) each training replica scores (completion slots `0..this`).
    pub prompts_per_train_replica: u32,
    /// GRPO groups each training replica trains on: `prompts_per_train_replica`, or fewer under
    /// dynamic sampling (`spec::pick_trained_groups` picks them after rewards, at run time).
    /// Training ops count *training slots* `0..this` (see the module docs).
    pub trained_groups_per_train_replica: u32,
    pub group_size: u32,
}

/// Where the policy loss's old log-probs (the importance ratio's denominator) come from: the
/// compiler's answer to the job's `train.old_logprobs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogProbSource {
    /// The plan's `ActorPrefix` / `ActorSuffix` tasks of `Purpose::OldLogProb` score them
    /// with the rollout's weights before training (an `old_logprobs` buffer holds them).
    Pass,
    /// No such tasks or buffers: the iteration takes one optimizer step over one epoch, so
    /// every micro-batch's training forward runs with the rollout's weights, and its own
    /// log-probs, detached, are the old ones (the ratio is exactly 1).
    TrainForward,
}

/// Where the training micro-batches' kept prompt forwards (each group's prompt forward with
/// grad, its layer inputs and keys and values kept for backward) come from: the compiler's
/// answer from the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainPrefixSource {
    /// The plan's `ActorPrefix` tasks of `Purpose::Train` run them in the training layout.
    Pass,
    /// No such tasks: the rollout's `Prefill` tasks run each group's prompt forward as the
    /// trainer does and keep it (the `train_prefix.s0` buffer) for step 0's micro-batches; the
    /// decode takes its prompt keys, values and first logits from it. Only where that forward is
    /// the training one ([`TrainPrefixSource::why_not_rollout`] says where it is not).
    Rollout,
}

impl TrainPrefixSource {
    /// Why the rollout's prefill is not the training prompt forward for a job laid out as
    /// `par` (`colocated`: rollout and training on the same GPUs) taking `steps` optimizer
    /// steps an iteration; empty where it is (the compiler then plans `Rollout`).
    pub fn why_not_rollout(
        spec: &JobSpec,
        colocated: bool,
        par: &Parallelism,
        steps: u32,
    ) -> Vec<String> {
        let mut why = Vec::new();
        if !colocated {
            why.push("rollout and training run on different GPUs".to_string());
        }
        if par.rollout_tp != par.train_tp || par.rollout_replicas != par.train_replicas {
            why.push(format!(
                "rollout runs {} replicas of TP {} and training {} of TP {}",
                par.rollout_replicas, par.rollout_tp, par.train_replicas, par.train_tp
            ));
        }
        if par.trained_groups_per_train_replica != par.prompts_per_train_replica {
            why.push("dynamic sampling trains a subset of the groups".to_string());
        }
        if steps != 1 {
            why.push(format!(
                "the iteration takes {steps} optimizer steps (later ones train on moved weights)"
            ));
        }
        let t = &spec.train;
        let media = !matches!(spec.rollout.media, crate::spec::MediaSpec::None);
        if media && !(t.freeze_vision && t.freeze_merger) {
            why.push("the vision tower or merger trains".to_string());
        }
        if t.prompt_forward == crate::spec::PromptForwardPass::Recompute {
            why.push("the job asks for their own pass (`prompt_forward = recompute`)".to_string());
        }
        why
    }
}

/// One GPU program: the ranks `first_rank .. first_rank + ranks` run this schedule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub id: GpuId,
    pub role: GpuRole,
    pub first_rank: u32,
    pub ranks: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuRole {
    /// Rollout and training on the same GPUs (serial and overlap modes).
    Colocated,
    /// Rollout only (disaggregated mode).
    Rollout,
    /// Scoring and training only (disaggregated mode).
    Train,
}

/// A CUDA stream (or the CPU backend's equivalent queue) of one GPU program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    pub id: StreamId,
    pub gpu: GpuId,
    /// `main`, `side`, `copy`.
    pub name: String,
    pub priority: Priority,
    /// SMs this stream may use outside decode windows (the whole GPU unless partitioned).
    pub sms: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    High,
    Normal,
}

/// A decode window: a run of decode steps during which the GPU is split between decode (on
/// `decode_stream`, `decode_sms` SMs) and side work (on `side_stream`, `side_sms` SMs).
/// `decode_sms` is a multiple of the SM granularity; `side_sms` is a multiple of it or the
/// remainder of the GPU. `side_sms == 0` means decode has the whole GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub id: WindowId,
    pub gpu: GpuId,
    /// First decode step (0-based) of the window.
    pub first_step: u32,
    /// Planned steps; the last window runs until every sample has stopped.
    pub steps: u32,
    pub decode_stream: StreamId,
    pub side_stream: StreamId,
    pub decode_sms: u32,
    pub side_sms: u32,
    /// Expected samples still decoding at the window's first step (from the length distribution).
    pub expected_active: f64,
    /// Expected groups finished when the window starts.
    pub expected_groups_done: u32,
    pub start_s: f64,
    pub end_s: f64,
}

/// One unit of work on one stream. Tasks are listed in issue order: each stream executes its
/// tasks in the order they appear in `plan.tasks`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: TaskId,
    /// Readable name, unique in the plan (`ref_prefix.g3`).
    pub name: String,
    pub kind: WorkKind,
    pub op: Op,
    pub gpu: GpuId,
    pub stream: StreamId,
    /// The decode window the task runs in (its SM share is the window's), if any.
    pub window: Option<WindowId>,
    /// Tasks that must finish before this one starts (besides stream order).
    pub deps: Vec<TaskId>,
    pub reads: Vec<BufferId>,
    pub writes: Vec<BufferId>,
    pub work: Work,
    /// SMs the prediction assumed.
    pub sms: u32,
    /// Predicted start and end, seconds from the iteration's start.
    pub start_s: f64,
    pub end_s: f64,
}

/// What a task computes. Ranges of groups/samples are local to the task's replica (see module
/// docs); `copies` is how many times each group's prefix is computed: 1 with prefix dedup (one
/// prefix per GRPO group), `group_size` without (every sample recomputes, as veRL does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Vision tower and merger over the media of `groups` (rollout layout); writes the merged
    /// embeddings that prefill (and, with a frozen tower, the reference and actor) read.
    EncodeMedia { groups: Span, copies: u32 },
    /// Rollout prompt prefill of `groups`: the prompt KV, shared by the group's samples when
    /// `copies == 1`; samples the first response token.
    Prefill { groups: Span, copies: u32 },
    /// Decode steps `first_step .. first_step + steps` of every unfinished sample of the
    /// replica; `until_done`: keep stepping until every sample has stopped (the last window).
    /// Publishes each finished group's slot at the end of the window.
    DecodeWindow {
        first_step: u32,
        steps: u32,
        until_done: bool,
    },
    /// Reference model over the prompts of `groups` (response-independent): keeps the prefix
    /// KV that [`Op::RefSuffix`] attends to.
    RefPrefix { groups: Span, copies: u32 },
    /// Reference model over the response tokens of the group in `slot`, attending to its kept
    /// prefix: per-token reference log-probs.
    RefSuffix { slot: u32 },
    /// Actor forward over the prompts of `groups` with the weights `purpose` names; with
    /// `Purpose::Train` it keeps what backward needs (activations or layer inputs, by the
    /// job's recompute policy). Groups are prompts when the work may run during decode, slots
    /// when it follows an optimizer step (mini-batches are formed in slot order).
    ActorPrefix {
        groups: Groups,
        copies: u32,
        purpose: Purpose,
    },
    /// Actor forward (no grad) over the response tokens of the group in `slot`: old log-probs.
    ActorSuffix { slot: u32, purpose: Purpose },
    /// Rewards of the samples of the group in `slot`.
    Reward { slot: u32 },
    /// Advantages of the samples of the group in `slot` (GRPO: group-normalised).
    Advantages { slot: u32 },
    /// Actor forward over the response tokens of `samples` with autograd, the policy loss
    /// (unscaled token sum; the mini-batch's normaliser is applied before the optimizer step),
    /// and backward, accumulating gradients in micro-batch order. `samples` count in slot
    /// order (`slot * group_size + member`). Backward also runs through the kept prefix of the
    /// groups in `prefix_bwd_slots` (those whose last sample is in this micro-batch).
    TrainMicroBatch {
        step: u32,
        micro_batch: u32,
        samples: Span,
        prefix_bwd_slots: Span,
    },
    /// Scale the accumulated gradients by the mini-batch normaliser, clip, AdamW update of the
    /// master weights, cast to the compute dtype; zero the gradients. `step` counts optimizer
    /// steps within the iteration (epoch * steps_per_epoch + mini-batch).
    OptimizerStep { step: u32 },
    /// Make the updated actor weights visible to the rollout engine (see `plan.reshards`).
    WeightSync { from_tp: u32, to_tp: u32 },
    /// Move data between layouts or GPU sets (see `plan.reshards`).
    Reshard {
        what: ReshardWhat,
        from_tp: u32,
        to_tp: u32,
    },
    /// Copy `from` (device) to `to` (host); `from`'s memory may be reused afterwards.
    Offload { from: BufferId, to: BufferId },
    /// Copy `from` (host) to `to` (device).
    Reload { from: BufferId, to: BufferId },
}

impl Op {
    /// The phase of a task running this op (side work inside a decode window, `in_window`,
    /// is rollout); `None` for transfers, which belong to the phase they serve.
    pub fn phase(&self, in_window: bool) -> Option<Phase> {
        if in_window {
            return Some(Phase::Rollout);
        }
        Some(match self {
            Op::EncodeMedia { .. } | Op::Prefill { .. } | Op::DecodeWindow { .. } => Phase::Rollout,
            Op::Reshard {
                what: ReshardWhat::Embeddings,
                ..
            } => Phase::Rollout,
            Op::RefPrefix { .. }
            | Op::RefSuffix { .. }
            | Op::ActorSuffix { .. }
            | Op::Reward { .. }
            | Op::Advantages { .. }
            | Op::Reshard {
                what: ReshardWhat::Samples,
                ..
            } => Phase::Scoring,
            Op::ActorPrefix { purpose, .. } => match purpose {
                Purpose::OldLogProb => Phase::Scoring,
                Purpose::Train { .. } => Phase::Training,
            },
            Op::TrainMicroBatch { .. } | Op::OptimizerStep { .. } => Phase::Training,
            Op::WeightSync { .. }
            | Op::Reshard {
                what: ReshardWhat::Weights,
                ..
            } => Phase::Sync,
            Op::Offload { .. } | Op::Reload { .. } => return None,
        })
    }

    /// Which way the task's host bytes go: device to host for an offload, host to device for
    /// everything else (a reload; the media and token uploads and the tokens read back of
    /// other tasks are kilobytes to megabytes, priced at the host-to-device rate too).
    pub fn host_dir(&self) -> HostDir {
        match self {
            Op::Offload { .. } => HostDir::ToHost,
            _ => HostDir::ToDevice,
        }
    }

    /// The optimizer step whose weights an actor op uses (`None`: not an actor-weight op).
    pub fn actor_weight_version(&self) -> Option<u32> {
        match self {
            Op::ActorPrefix { purpose, .. } | Op::ActorSuffix { purpose, .. } => {
                Some(purpose.weight_version())
            }
            Op::TrainMicroBatch { step, .. } => Some(*step),
            _ => None,
        }
    }
}

/// Why the actor runs a forward: which weights it must see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// Old log-probs with the rollout's weights (version 0), no grad.
    OldLogProb,
    /// The prefix of optimizer step `step`'s micro-batches, with grad; uses the weights after
    /// `step` optimizer steps of this iteration.
    Train { step: u32 },
}

impl Purpose {
    pub fn weight_version(self) -> u32 {
        match self {
            Purpose::OldLogProb => 0,
            Purpose::Train { step } => step,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReshardWhat {
    /// Actor weights, training layout -> rollout layout.
    Weights,
    /// Merged vision embeddings, rollout replicas -> training replica.
    Embeddings,
    /// Sampled tokens and lengths, rollout replicas -> training replica.
    Samples,
}

/// A buffer: `bytes` at `offset` of `arena`, alive from its first to its last task (or for the
/// whole run when `lifetime` is persistent).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufferId,
    /// Unique readable name (`kv.prefix`, `ref_weights.hbm`), for display only: programs go
    /// by `role`.
    pub name: String,
    pub role: BufferRole,
    pub class: BufferClass,
    pub gpu: GpuId,
    pub bytes: u64,
    /// Shape comment, e.g. `(groups 2, tokens 1126, layers 36, kv 2, heads 2, dim 128) bf16`.
    pub shape: String,
    pub lifetime: Lifetime,
    /// Where the buffer's data lives in each phase of the iteration.
    pub residency: Vec<PhaseResidency>,
    pub arena: ArenaId,
    pub offset: u64,
}

/// What a buffer holds: the compiler sets it where it creates the buffer, the runtime and the
/// compiler's own passes find buffers by it (the verifier's `roles` rule says which roles are
/// one buffer per GPU program). The names in the docs are the compiler's display names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferRole {
    /// The actor's weights in the training layout (`actor_weights`).
    ActorWeights,
    /// Rollout-layout weights beyond the training shard that each weight sync rebuilds, or a
    /// rollout GPU's own copy of the weights (`rollout_weights`).
    RolloutWeights,
    /// The frozen incompatible tensors' gathered rollout part, built once
    /// (`rollout_weights.frozen`).
    FrozenRolloutWeights,
    /// The reference model's weights (`ref_weights`).
    RefWeights,
    /// fp32 master weights (`master_weights`).
    MasterWeights,
    /// Adam's first and second moments (`adam_moments`).
    AdamMoments,
    /// Gradient sums of optimizer step `step` (`grads.sS`).
    Grads { step: u32 },
    /// The rollout's merged media embeddings (`vision_emb`).
    MediaEmbeddings,
    /// The media embeddings resharded to a training replica (`vision_emb.train`).
    TrainMediaEmbeddings,
    /// The decode KV arena's prompt rows (`kv.prompt`).
    KvPrompt,
    /// The decode KV arena's response rows (`kv.response`); `kv.prompt` follows it.
    KvResponse,
    /// Sampled tokens, lengths and the slot table (`samples`).
    Samples,
    /// The samples resharded to a training GPU program (`samples.train`).
    TrainSamples,
    /// The reference's kept prefix KV (`ref_prefix_kv`).
    RefPrefixKv,
    /// The actor's kept prefix KV for old log-probs (`old_prefix_kv`).
    OldPrefixKv,
    /// The kept prompt forwards (and a trained tower's kept inputs) of optimizer step `step`
    /// (`train_prefix.sS`).
    TrainPrefix { step: u32 },
    /// Per-token reference log-probs (`ref_logprobs`).
    RefLogProbs,
    /// Per-token old-policy log-probs (`old_logprobs`).
    OldLogProbs,
    /// Rewards and advantages (`scalars`).
    Scalars,
    /// One producer's chunk of a kept prefix state staged through host memory (`<state>[k]`).
    KeptChunk,
    /// The pinned-host copy of an offloaded buffer or chunk (`<name>.host`).
    HostCopy,
    /// One task's transient working set (`scratch.<task>`).
    Scratch,
}

impl BufferRole {
    /// Whether a GPU program has at most one buffer of this role.
    pub fn unique(self) -> bool {
        !matches!(
            self,
            BufferRole::KeptChunk | BufferRole::HostCopy | BufferRole::Scratch
        )
    }

    /// The class every buffer of this role has (`None`: the class of what it copies).
    pub fn class(self) -> Option<BufferClass> {
        Some(match self {
            BufferRole::ActorWeights => BufferClass::ActorWeights,
            BufferRole::RolloutWeights | BufferRole::FrozenRolloutWeights => {
                BufferClass::RolloutWeights
            }
            BufferRole::RefWeights => BufferClass::RefWeights,
            BufferRole::MasterWeights => BufferClass::MasterWeights,
            BufferRole::AdamMoments => BufferClass::OptimizerMoments,
            BufferRole::Grads { .. } => BufferClass::Grads,
            BufferRole::MediaEmbeddings | BufferRole::TrainMediaEmbeddings => {
                BufferClass::VisionEmbeddings
            }
            BufferRole::KvPrompt => BufferClass::KvPrefix,
            BufferRole::KvResponse => BufferClass::KvSuffix,
            BufferRole::Samples | BufferRole::TrainSamples => BufferClass::Samples,
            BufferRole::RefPrefixKv | BufferRole::OldPrefixKv => BufferClass::PrefixState,
            BufferRole::TrainPrefix { .. } => BufferClass::Activations,
            BufferRole::RefLogProbs | BufferRole::OldLogProbs => BufferClass::LogProbs,
            BufferRole::Scalars => BufferClass::Scalars,
            BufferRole::Scratch => BufferClass::Scratch,
            BufferRole::KeptChunk | BufferRole::HostCopy => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferClass {
    ActorWeights,
    RolloutWeights,
    RefWeights,
    MasterWeights,
    OptimizerMoments,
    Grads,
    VisionEmbeddings,
    KvPrefix,
    KvSuffix,
    PrefixState,
    Activations,
    Logits,
    LogProbs,
    Samples,
    Scalars,
    /// One task's transient working set.
    Scratch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifetime {
    /// Alive for the whole run (loop-carried: weights, optimizer state).
    Persistent,
    /// Alive from the start of `first` to the end of `last` within each iteration.
    Tasks { first: TaskId, last: TaskId },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Media encoding, prefill and decode windows (with the side work inside them).
    Rollout,
    /// After decode: suffix scoring, rewards, advantages.
    Scoring,
    /// Actor micro-batches and optimizer steps.
    Training,
    /// Weight sync to the rollout layout.
    Sync,
}

impl Phase {
    pub const ALL: [Phase; 4] = [Phase::Rollout, Phase::Scoring, Phase::Training, Phase::Sync];

    /// Its place in [`Phase::ALL`] (per-phase arrays are indexed by it).
    pub fn index(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// In device memory.
    Hbm,
    /// Offloaded to pinned host memory.
    Host,
    /// Dropped; recomputed by its consumer.
    Recompute,
    /// Not alive in this phase.
    Absent,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseResidency {
    pub phase: Phase,
    pub residency: Residency,
}

/// A point where data crosses layouts: weights from the training to the rollout TP layout, or
/// rollout outputs into the training replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reshard {
    pub task: TaskId,
    pub what: ReshardWhat,
    pub from_tp: u32,
    pub to_tp: u32,
    /// Bytes each rank receives.
    pub bytes_moved: u64,
    /// Bytes each rank reuses in place (aliased between the layouts).
    pub bytes_aliased: u64,
}

/// The actor's parameters under the training and the rollout TP layouts of the same GPUs:
/// which rollout shards alias training memory and which are rebuilt by the weight sync
/// (`docs/weight-sharing.md` has the rule and a worked example). Bytes are per GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightSharing {
    pub train_tp: u32,
    pub rollout_tp: u32,
    /// Training rank of each GPU of a block of `max(train_tp, rollout_tp)` consecutive GPUs
    /// (the pattern repeats over the job); communicators order their ranks by it.
    pub train_rank: Vec<u32>,
    /// Rollout rank of each GPU of the same block.
    pub rollout_rank: Vec<u32>,
    /// One entry per parameter class (tensors of the same role in every layer).
    pub params: Vec<ParamSharing>,
    /// Rollout-layout weights of one GPU: what a separate rollout copy would take.
    pub rollout_bytes: u64,
    /// Rollout-layout bytes that alias training memory (in place or through a view).
    pub aliased_bytes: u64,
    /// Device bytes beyond the training weights that the rollout layout needs.
    pub extra_bytes: u64,
    /// Of `extra_bytes`, what the weight sync rebuilds after each iteration's optimizer
    /// steps (trainable incompatible parameters); the rest is frozen and built once.
    pub resharded_bytes: u64,
    /// Whether the frozen extra (`extra_bytes - resharded_bytes`) is dropped after decode and
    /// rebuilt by every weight sync instead of kept in HBM (the planner's choice).
    #[serde(default)]
    pub frozen_rebuilt: bool,
    /// Where the weight sync runs (the planner's choice).
    #[serde(default)]
    pub reshard_point: ReshardPoint,
}

/// Where a colocated plan rebuilds the rollout layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReshardPoint {
    /// At the start of the iteration, on the main stream, before media encoding and prefill.
    #[default]
    IterationStart,
    /// At the start of the iteration on the copy stream, beside media encoding (which reads
    /// only frozen vision weights); prefill waits for it.
    BesideEncode,
}

/// One parameter class under both layouts; bytes per GPU over all `count` tensors, on the GPU
/// of the block where the class needs the most extra memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSharing {
    /// Hugging Face name with `*` for the layer index (`model.layers.*.mlp.down_proj.weight`).
    pub name: String,
    pub count: u32,
    /// How Megatron-style TP splits it (`rows by 28 heads`, `cols by 18944`, `replicated`).
    pub split: String,
    pub class: ShareClass,
    pub trainable: bool,
    pub train_bytes: u64,
    pub rollout_bytes: u64,
    pub aliased_bytes: u64,
    pub extra_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShareClass {
    /// The rollout shard is the training shard: the same memory.
    Identical,
    /// The rollout shard is a contiguous slice of the training shard (rows of a row-major
    /// tensor): aliased with an offset.
    SliceView,
    /// The rollout shard is inside the training shard but not contiguous (columns, or rows of
    /// fused q/k/v segments): aliased through a strided view (a GEMM's leading dimension).
    StridedView,
    /// The rollout shard needs data of other GPUs: rebuilt by the weight sync.
    Incompatible,
}

impl ShareClass {
    /// Whether the rollout shard lives wholly in training memory.
    pub fn shared(self) -> bool {
        self != ShareClass::Incompatible
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub arenas: Vec<Arena>,
    pub gpus: Vec<GpuMemory>,
}

impl Memory {
    /// The largest device arena of any GPU (what one GPU must hold).
    pub fn max_peak(&self) -> u64 {
        self.gpus.iter().map(|m| m.peak).max().unwrap_or(0)
    }

    /// The pinned host memory of every GPU's host copies together (what one host must hold).
    pub fn host_total(&self) -> u64 {
        self.gpus.iter().map(|m| m.host).sum()
    }
}

/// Alignment, in bytes, of every buffer's offset in an arena and of every tensor the runtime
/// places inside a buffer (cuBLASLt's default minimum for its operands); a buffer's size allows
/// it once per such tensor ([`placed_bytes`]).
pub const ALIGN: u64 = 256;

/// `offset` rounded up to the next multiple of [`ALIGN`]: where the compiler places a buffer
/// after another and where the runtime places a tensor after another in a buffer's range.
pub fn align_up(offset: u64) -> u64 {
    offset.next_multiple_of(ALIGN)
}

/// The bytes a buffer needs to hold `content` bytes as `tensors` tensors, each placed by the
/// runtime at an [`align_up`] address: at most [`ALIGN`] bytes of padding before each.
pub fn placed_bytes(content: u64, tensors: u64) -> u64 {
    content + ALIGN * tensors
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Arena {
    pub id: ArenaId,
    pub gpu: GpuId,
    pub kind: ArenaKind,
    /// Bytes to allocate: the highest `offset + bytes` of its buffers.
    pub bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArenaKind {
    Device,
    Host,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuMemory {
    pub gpu: GpuId,
    /// Device bytes the plan may use (the job's memory budget).
    pub budget: u64,
    /// Device arena bytes (what the runtime allocates).
    pub peak: u64,
    /// Largest sum of buffers alive at one task (a lower bound of `peak`).
    pub live_peak: u64,
    /// Where `live_peak` is reached.
    pub live_peak_at: TaskId,
    /// Pinned host bytes.
    pub host: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// Predicted time of one iteration, seconds.
    pub iteration_s: f64,
    pub phases: Vec<PhaseTime>,
    /// Side work (seconds on the whole GPU) moved into decode windows.
    pub hidden_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseTime {
    pub phase: Phase,
    pub start_s: f64,
    pub end_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SolverStats {
    /// `highs`, or `none` when the mode needs no optimisation.
    pub solver: String,
    pub status: SolveStatus,
    pub variables: u32,
    pub integer_variables: u32,
    pub constraints: u32,
    /// The objective of the accepted solution (predicted seconds, with tie-breakers).
    pub objective: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolveStatus {
    /// No solver ran.
    NotRun,
    Optimal,
    /// The node limit or the time limit stopped the solver; the plan uses its best feasible
    /// answer (the YAML keeps the name `time_limit`).
    TimeLimit,
}

impl Plan {
    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.tasks.get(id.index())
    }
    pub fn buffer(&self, id: BufferId) -> Option<&Buffer> {
        self.buffers.get(id.index())
    }
    pub fn stream(&self, id: StreamId) -> Option<&Stream> {
        self.streams.get(id.index())
    }
    pub fn window(&self, id: WindowId) -> Option<&Window> {
        self.windows.get(id.index())
    }
    /// Tasks of one stream in execution order.
    pub fn stream_tasks(&self, s: StreamId) -> impl Iterator<Item = &Task> {
        self.tasks.iter().filter(move |t| t.stream == s)
    }
}
