//! The CUDA backend's executor: each plan op on one GPU with the CUDA model engine
//! ([`crate::gpu`]), each plan stream a CUDA stream, each dependency on a task of another stream
//! an event (record on the producer's stream, wait on the consumer's; never a device-wide sync
//! inside an iteration).
//!
//! What each op does here is what it does on the CPU backend (`cpu.rs`, whose module doc lists
//! them); the host-side decisions (stops, slots, rewards, advantages, normalisers) are the same
//! code ([`super::book`]). Differences, all in where things live:
//! - `EncodeMedia` / `Prefill` / `RefPrefix` / `ActorPrefix{OldLogProb}` make one device call
//!   per group (without prefix dedup, the `copies` of the group packed in it; the first copy's
//!   result is kept). Per group, because GEMM algorithms are fixed per shape, not across
//!   shapes: a group's bits must not depend on which groups a plan put in the same task.
//!   Media embeddings and prefix states stay on the device.
//! - `DecodeWindow`: the active samples' next-token logits stay on the device; each step draws
//!   the tokens on the device with the Philox key (seed, iteration, sample, step), takes their
//!   log-probs there, and brings tokens and log-probs back (the host decides who stops).
//! - `ActorPrefix{Train}`: the actor's prompt forward of each group with the current weights,
//!   `copies` per group (one shared by the group's samples with prefix dedup, one per sample
//!   without: what veRL recomputes), every layer's input and K/V kept in the iteration's
//!   [`TrainPrefixes`] (`GpuTrainer::prefix_forward`). These tasks are where the plan puts the
//!   actor's prefix work into decode windows. With the tower or merger trained, each task
//!   encodes its groups' media itself (keeping what the vision backward needs) instead of
//!   reading the shared encoding. A plan whose `train_prefix` is `Rollout` has no such tasks:
//!   its `Prefill` runs the same forward into the store, and decode takes each group's prompt
//!   keys, values and first logits from it (`GpuTrainer::prefix_state`, bitwise the prefill's).
//! - `TrainMicroBatch` / `OptimizerStep`: [`GpuTrainer`]: the suffixes' forward over the kept
//!   prompts, backward through both and, unless frozen, the merger and tower
//!   (`micro_batch_prefixed`). Its model *is* the actor: rollout reads the weights
//!   `optimizer_step` writes, so `WeightSync` has nothing to copy at TP 1. In a plan without
//!   an old-log-prob pass the loss takes the micro-batch's own log-probs on the device as the
//!   old ones (nothing uploaded: the ratio is exactly 1). A plan that streams the optimizer
//!   state has the trainer keep it in pinned host memory and go through it in chunks
//!   (`gpu::train::stream`).
//!
//! Where the host waits for the device (the walker has one host thread): every decode step
//! (tokens come back for the stop checks), a micro-batch (its log-probs come down for the
//! loss; it first collects the reference and old log-probs, which `RefSuffix` / `ActorSuffix`
//! leave on the device), an optimizer step (the grad norm). Each such wait is on one stream
//! only. To keep the GPU busy while the host waits, [`GpuIteration`] asks the walker to run
//! every ready non-blocking task before a blocking one ([`walker::TaskRunner::rank`]). A side
//! task of a decode window is not launched when the walker runs it but deferred: the window's
//! decode loop launches it a group call at a time between its steps, keeping at most two such
//! calls running (thousands of launches queued at once would hold the host in CUDA's launch
//! queue and start the decode late), and launches what is left when its steps are done. A task
//! that waits for a deferred one launches it first (unless both are deferred on one stream).
//!
//! Streams: outside decode windows each plan stream is a plain CUDA stream on the whole GPU;
//! inside a window the decode task runs on the window's decode partition and its side tasks on
//! the side partition ([`crate::gpu::streams::StreamSet`]: green contexts, or prioritised plain
//! streams with a warning where those are unavailable or [`GpuExecOptions::streams`] turns them
//! off). Results never depend on the partition (that module's invariant).
//! [`GpuExecOptions::task_log`] prints each task to stderr as the host launches it. Every decode step is marked by a device event
//! ([`GpuIteration::step_times`], told to the observer's `decode_steps`), so that `--profile`
//! can cut a window that co-ran with side work into its steps (`exec::profile`).
//!
//! Memory: with models built for the plan ([`build_gpu_models_for`], what `rollplex-run` does),
//! the plan's device arena is reserved once and the iteration's kept buffers go at their plan
//! offsets in it (the region of each [`Role`], `exec::placement`; reset as each iteration
//! starts, never freed: the plan's layout decides when bytes are reused); without, the arena
//! is reserved in the memory pool before the first iteration and everything comes from the
//! pool. Either way state whose plan buffers' lifetimes end before the iteration does
//! ([`Held`]: the decode KV arena, the media embeddings, the reference's and the old-log-prob
//! prefix states, the kept prompt forwards) is dropped once the last task of those buffers is
//! launched, after the streams it was allocated on wait for that task's end event (so they
//! order its frees after every use: what of it came from the pool goes back then); an
//! iteration that holds more than the plan counts prints a warning.
//!
//! Invariants: a task's launches all go to one CUDA stream; a buffer made on one stream is read
//! on another only after an event of the producing task; everything an iteration allocated is
//! freed after the device has finished it (early, as above, or when the iteration ends: the
//! loop synchronises between iterations, where the next iteration's rollout must see the
//! trained weights anyway).

mod held;
mod models;
mod ops;
mod pacing;
mod rollout;
mod run;
mod streams;

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::CudaEvent;
use rollplex_kernels::cuda::CudaStream;
use rollplex_plan::plan::Plan;
use rollplex_plan::TaskId;

use super::book::{Book, MicroBatchInputs};
use super::cpu::RewardFn;
use super::defer::DeferQueue;
use super::placement::Role;
use super::residency::HostResidency;
use super::{ExecError, IterationMetrics, IterationResult, PromptData};
use crate::gpu::arena::Region;
use crate::gpu::streams::StreamOptions;
use crate::gpu::text::DeviceScores;
use crate::gpu::train::{GpuTrainError, TrainPrefixes};
use crate::gpu::{GpuEncodedMedia, GpuError, GpuKvArena, GpuPrefixState};
use held::Held;
use pacing::{Piece, StreamRef};

pub use models::{
    build_gpu_models, build_gpu_models_for, build_gpu_models_from, check_gpu_plan,
    check_host_memory, check_host_memory_against, open_gpu, preset_of, GpuModels, WeightBits,
};
pub use run::{generate_tokens, run_gpu_iterations, run_gpu_loop, run_gpu_loop_with};
pub use streams::{blocks_host, PlanStreams};

impl From<GpuError> for ExecError {
    fn from(e: GpuError) -> Self {
        ExecError::Gpu(e)
    }
}

impl From<GpuTrainError> for ExecError {
    fn from(e: GpuTrainError) -> Self {
        match e {
            GpuTrainError::Gpu(e) => ExecError::Gpu(e),
            GpuTrainError::Train(e) => ExecError::Train(e),
        }
    }
}

impl From<rollplex_kernels::cuda::CudaError> for ExecError {
    fn from(e: rollplex_kernels::cuda::CudaError) -> Self {
        ExecError::Gpu(e.into())
    }
}

impl From<cudarc::driver::DriverError> for ExecError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        ExecError::Gpu(e.into())
    }
}

type Media = Arc<Vec<GpuEncodedMedia>>;

/// The CUDA executor's options (`rollplex-run --task-log`, `--no-green-contexts`). None changes
/// a number: they say what is logged and how decode windows' SM partitions are made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuExecOptions {
    /// Print to stderr each task's host launch time with the memory pool's use, and each decode
    /// window's host split ([`pacing::HostSplit`]).
    pub task_log: bool,
    /// How the decode windows' partitions are made (green contexts, or plain streams).
    pub streams: StreamOptions,
    /// Launch each decode step's kernels one at a time instead of replaying the step's CUDA
    /// graph (the same launches, so the same bits: a check and a measurement).
    pub eager_decode: bool,
}

/// One iteration's state on the CUDA backend.
pub struct GpuIteration<'a, 'r> {
    plan: &'a Plan,
    models: &'a mut GpuModels,
    streams: &'a PlanStreams,
    book: Book<'a, 'r>,
    encoded: Vec<Option<Media>>,
    /// Per group: an event after its `EncodeMedia` task's launches and that task's stream. The
    /// plan orders the readers it knows of after the encode (a frozen tower's prefixes); an
    /// old-log-prob prefix with a trained tower is planned to encode its own media but reuses
    /// the rollout's (same weights, same bits) with no plan edge, so a reader on another stream
    /// waits on this.
    encoded_ready: Vec<Option<(Arc<CudaEvent>, Arc<CudaStream>)>>,
    ref_encoded: Vec<Option<Media>>,
    prefixes: Vec<Option<GpuPrefixState>>,
    ref_prefixes: Vec<Option<GpuPrefixState>>,
    old_prefixes: Vec<Option<GpuPrefixState>>,
    arena: Option<GpuKvArena>,
    arena_rows: u32,
    /// The samples still decoding as the book knows them (ascending).
    active: Vec<usize>,
    /// Launch decode steps one kernel at a time instead of replaying graphs
    /// ([`GpuExecOptions::eager_decode`]).
    eager_decode: bool,
    /// Per task: events recorded on its CUDA stream before its first and after its last
    /// launch, and that stream.
    events: Vec<Option<(CudaEvent, CudaEvent, Arc<CudaStream>)>>,
    /// Per plan stream: the last task that ran on it.
    last_on_stream: Vec<Option<TaskId>>,
    /// Reference (`true`) or old log-probs of a group still on the device.
    pending: Vec<(usize, bool, DeviceScores)>,
    /// Queued micro-batches (optimizer step, inputs) whose results the trainer has not given
    /// back yet, in plan order.
    trained: Vec<(u32, MicroBatchInputs)>,
    /// The actor's kept prompt forwards for training (`ActorPrefix{Train}`), with the copies
    /// per group they were laid out for; made by the iteration's first such task.
    train_prefixes: Option<(TrainPrefixes, u32)>,
    /// Side tasks of decode windows not yet (fully) launched, in walker order (see
    /// [`StreamRef`]).
    deferred: DeferQueue<Piece, StreamRef>,
    /// Start events of deferred tasks whose first piece is launched, by task index.
    deferred_start: Vec<Option<CudaEvent>>,
    /// Events behind the launched pieces that may still be running (oldest first).
    inflight: VecDeque<CudaEvent>,
    /// The running decode window's step marks: an event before each step, one after the last
    /// (`--profile` cuts a window that co-ran by step: `exec::profile`).
    step_marks: Vec<CudaEvent>,
    /// The running decode window's events after each step (the device's idle gaps between
    /// steps: from one step's end mark to the next one's start mark).
    step_ends: Vec<CudaEvent>,
    /// Per task: a decode window's step marks, by task index.
    decode_marks: Vec<Option<Vec<CudaEvent>>>,
    /// State to free before the iteration ends, and the task after whose launches the plan's
    /// buffers of it are dead (their `Lifetime::Tasks` end), ascending by task.
    retire: Vec<(TaskId, Held)>,
    /// Per [`Held`] (by discriminant): the streams its buffers were allocated on.
    made_on: [Vec<Arc<CudaStream>>; Held::ALL.len()],
    /// Log each decode window's host split ([`GpuExecOptions::task_log`]).
    task_log: bool,
    /// Where the state the plan keeps on the host between uses is (`exec::residency`).
    residency: HostResidency,
}

impl<'a, 'r> GpuIteration<'a, 'r> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut GpuModels,
        streams: &'a PlanStreams,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
        options: &GpuExecOptions,
    ) -> Result<Self, ExecError> {
        let book = Book::new(plan, iteration, prompts, reward)?;
        let groups = book.groups();
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let rows = prefix_rows + book.samples() as u64 * plan.spec.rollout.max_new_tokens as u64;
        let arena_rows =
            u32::try_from(rows).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        Ok(GpuIteration {
            plan,
            models,
            streams,
            book,
            encoded: vec![None; groups],
            encoded_ready: (0..groups).map(|_| None).collect(),
            ref_encoded: vec![None; groups],
            prefixes: vec![None; groups],
            ref_prefixes: vec![None; groups],
            old_prefixes: vec![None; groups],
            arena: None,
            arena_rows,
            active: Vec::new(),
            eager_decode: options.eager_decode,
            events: (0..plan.tasks.len()).map(|_| None).collect(),
            last_on_stream: vec![None; plan.streams.len()],
            pending: Vec::new(),
            trained: Vec::new(),
            train_prefixes: None,
            deferred: DeferQueue::default(),
            deferred_start: (0..plan.tasks.len()).map(|_| None).collect(),
            inflight: VecDeque::new(),
            step_marks: Vec::new(),
            step_ends: Vec::new(),
            decode_marks: (0..plan.tasks.len()).map(|_| None).collect(),
            retire: Held::retirements(plan),
            made_on: Default::default(),
            task_log: options.task_log,
            residency: HostResidency::of(plan),
        })
    }

    /// The plan arena's region for `role`, when the models were built for the plan.
    fn region(&self, role: Role) -> Option<Arc<Region>> {
        self.models.arena.as_ref()?.region(role).cloned()
    }

    pub fn metrics(&self) -> &IterationMetrics {
        &self.book.metrics
    }

    /// Device start and end of each task that ran, relative to `origin` (an event recorded
    /// before the iteration's first launch), in milliseconds. Call after the device finished.
    pub fn task_times(&self, origin: &CudaEvent) -> Result<Vec<(usize, f64, f64)>, ExecError> {
        let mut out = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            if let Some((a, b, _)) = e {
                out.push((
                    i,
                    origin.elapsed_ms(a)? as f64,
                    origin.elapsed_ms(b)? as f64,
                ));
            }
        }
        Ok(out)
    }

    /// Device times of each decode window's step marks relative to `origin`, in milliseconds,
    /// by task index. Call after the device finished.
    pub fn step_times(&self, origin: &CudaEvent) -> Result<Vec<(usize, Vec<f64>)>, ExecError> {
        let mut out = Vec::new();
        for (i, marks) in self.decode_marks.iter().enumerate() {
            if let Some(marks) = marks {
                let ms = marks
                    .iter()
                    .map(|m| origin.elapsed_ms(m).map(f64::from))
                    .collect::<Result<Vec<f64>, _>>()?;
                out.push((i, ms));
            }
        }
        Ok(out)
    }

    /// Results of the iteration (downloads the scores still on the device).
    pub fn finish(mut self) -> Result<IterationResult, ExecError> {
        self.flush_deferred()?;
        self.collect_scores()?;
        self.collect_trained()?;
        Ok(self.book.finish())
    }

    /// Brings the log-probs still on the device to the book (waits for their streams).
    fn collect_scores(&mut self) -> Result<(), ExecError> {
        for (g, reference, scores) in std::mem::take(&mut self.pending) {
            let lps = scores.to_host()?.into_iter().map(|t| t.logp).collect();
            if reference {
                self.book.set_ref_logp(g, lps);
            } else {
                self.book.set_old_logp(g, lps);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
