//! What a task costs, in machine-independent terms: the cost model turns a [`Work`] and an SM
//! share into seconds. The compiler fills one per task from the shapes it lowers; the simulator
//! and the runtime's profiler read them back from the plan.

use serde::{Deserialize, Serialize};

/// The kind of a task, as the cost model distinguishes them (each kind has its own efficiency
/// curve in a profile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkKind {
    /// Vision tower over media patches (compute-bound).
    VisionEncode,
    /// Prompt prefill of the rollout engine (compute-bound).
    Prefill,
    /// A window of decode steps (memory-bound: weights + KV once per step).
    Decode,
    /// Reference model over the prompt prefix (compute-bound, response-independent).
    RefPrefix,
    /// Reference model over response tokens attending to the kept prefix.
    RefSuffix,
    /// Actor forward over the prompt prefix (old log-probs / first mini-batch).
    ActorPrefixFwd,
    /// Actor forward over response tokens.
    ActorSuffixFwd,
    /// Actor backward (suffix and prefix).
    ActorBwd,
    /// Optimizer step (memory-bound: master weights, moments, grads).
    Optimizer,
    /// Reward computation (host).
    Reward,
    /// Advantage computation (tiny).
    Advantage,
    /// Weight sync from training to rollout layout (copy or reshard).
    WeightSync,
    /// Device <-> host transfer of a buffer (offload / reload).
    Transfer,
}

/// Machine-independent amount of work of one task.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// Dense floating-point operations (2 per multiply-add).
    pub flops: f64,
    /// Minimum device-memory traffic, bytes read + written.
    pub bytes: f64,
    /// Sequential dependent steps (decode steps, layers x micro-batches): a latency floor.
    pub steps: u32,
    /// Host <-> device bytes.
    pub host_bytes: f64,
    /// GPU <-> GPU bytes (per GPU).
    pub net_bytes: f64,
}
