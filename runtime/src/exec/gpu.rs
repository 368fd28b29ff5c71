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
//!   reading the shared encoding.
//! - `TrainMicroBatch` / `OptimizerStep`: [`GpuTrainer`]: the suffixes' forward over the kept
//!   prompts, backward through both and, unless frozen, the merger and tower
//!   (`micro_batch_prefixed`). Its model *is* the actor: rollout reads the weights
//!   `optimizer_step` writes, so `WeightSync` has nothing to copy at TP 1.
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
//! streams with a warning where those are unavailable or `ROLLPLEX_NO_GREEN_CONTEXTS=1`). Results
//! never depend on the partition (that module's invariant). `ROLLPLEX_TASK_LOG=1` prints each
//! task to stderr as the host launches it. Every decode step is marked by a device event
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

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cuda::{logprobs_fwd_bf16, CudaSlice, CudaStream, Gpu};
use rollplex_plan::plan::{Lifetime, Op, Plan, Priority, Purpose, Task};
use rollplex_plan::spec::JobSpec;
use rollplex_plan::{Span, StreamId, TaskId};

use super::book::{range, Book};
use super::cpu::RewardFn;
use super::defer::DeferQueue;
use super::placement::{PlanArena, Role};
use super::walker::{self, TaskRunner};
use super::{ExecError, IterationMetrics, IterationResult, LoopModels, LoopObserver, PromptData};
use crate::gpu::arena::DevBuf;
use crate::gpu::arena::Region;
use crate::gpu::streams::{Priority as PartPriority, StreamSet};
use crate::gpu::text::DeviceScores;
use crate::gpu::train::{
    GpuTrainError, GpuTrainer, PrefixedGroup, PromptMedia, TrainPrefixes, TrainerPlacement,
};
use crate::gpu::{GpuEncodedMedia, GpuError, GpuKvArena, GpuModel, GpuPrefixState, GpuPrompt};
use crate::model::{DecodeSlot, GenerateConfig, MediaInput, Qwen25VL, SamplingParams};

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

/// The models and optimizer that live across iterations on the GPU.
pub struct GpuModels {
    /// The actor: its model is the rollout's, updated in place by each optimizer step.
    pub trainer: GpuTrainer,
    /// The frozen reference (initial actor weights); `None` when the job scores no reference.
    pub reference: Option<GpuModel>,
    /// The stream the models were uploaded on (also evaluation's).
    pub stream: Arc<CudaStream>,
    /// The device arena of the plan the models were built for ([`build_gpu_models_for`]):
    /// the weights, masters and moments lie at its offsets, and the loop places the
    /// iteration's buffers there too; `None`: everything from the memory pool.
    pub arena: Option<PlanArena>,
    /// Declared last: dropped after every buffer above (its drop synchronises the device).
    pub gpu: Gpu,
}

impl GpuModels {
    /// The bits of the actor's weights as the device holds them (bf16 compute copy), for
    /// comparing runs bitwise; synchronises.
    pub fn weight_bits(&self) -> Result<WeightBits, ExecError> {
        let w = &self.trainer.model().weights;
        let s = &self.stream;
        let mut vision: Vec<&DevBuf<bf16>> = vec![&w.patch_embed];
        vision.extend(w.vision.iter().flat_map(block_bufs));
        vision.extend([&w.merger_ln, &w.merger_fc1.w]);
        vision.extend(w.merger_fc1.b.as_ref());
        vision.push(&w.merger_fc2.w);
        vision.extend(w.merger_fc2.b.as_ref());
        let mut text = vec![&w.embed];
        text.extend(w.text.iter().flat_map(block_bufs));
        text.push(&w.final_norm);
        text.extend(w.lm_head.as_ref());
        let bits = |bufs: Vec<&DevBuf<bf16>>| -> Result<Vec<u16>, ExecError> {
            let mut out = Vec::new();
            for b in bufs {
                out.extend(s.clone_dtoh(&**b)?.into_iter().map(|x| x.to_bits()));
            }
            Ok(out)
        };
        let out = WeightBits {
            vision: bits(vision)?,
            text: bits(text)?,
        };
        s.synchronize()?;
        Ok(out)
    }
}

/// The bits of a model's bf16 weights on the device ([`GpuModels::weight_bits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightBits {
    /// The patch embedding, every vision block's norms and linears (weight, bias), the merger.
    pub vision: Vec<u16>,
    /// The token embeddings, every decoder layer's norms and linears, final norm, untied lm
    /// head.
    pub text: Vec<u16>,
}

/// A block's weight buffers: norms, then each linear's weight and bias.
fn block_bufs(b: &crate::gpu::weights::GpuBlock) -> Vec<&DevBuf<bf16>> {
    let mut v = vec![&b.norm1, &b.norm2];
    for l in [&b.qkv, &b.o, &b.gate_up, &b.down] {
        v.push(&l.w);
        v.extend(l.b.as_ref());
    }
    v
}

/// Opens GPU 0 and builds the job's models on it: the actor (random or from its checkpoint,
/// through the CPU model), the trainer around it, and the reference (a copy of the initial
/// actor). Returns once the uploads have finished.
pub fn build_gpu_models(spec: &JobSpec) -> Result<GpuModels, ExecError> {
    build_gpu_models_from(spec, &super::host_actor(spec)?)
}

/// [`build_gpu_models`] from the job's initial actor already on the host (`host_actor`), for
/// a caller that keeps it (checkpoints hash it and save through a host copy).
pub fn build_gpu_models_from(spec: &JobSpec, actor: &Qwen25VL) -> Result<GpuModels, ExecError> {
    build_models(spec, actor, None)
}

/// [`build_gpu_models_from`] for `plan`: its device arena is allocated once, first, and the
/// actor's and reference's weights, the fp32 masters and the Adam moments are uploaded at the
/// plan's offsets in it (`exec::placement`); [`run_gpu_loop`] of that plan places the
/// iteration's buffers there too.
pub fn build_gpu_models_for(plan: &Plan, actor: &Qwen25VL) -> Result<GpuModels, ExecError> {
    build_models(&plan.spec, actor, Some(plan))
}

fn build_models(
    spec: &JobSpec,
    actor: &Qwen25VL,
    plan: Option<&Plan>,
) -> Result<GpuModels, ExecError> {
    let gpu = open_gpu()?;
    let stream = gpu.stream(0)?;
    let arena = match plan {
        Some(p) => PlanArena::new(p, &gpu)?,
        None => None,
    };
    let region = |r: Role| arena.as_ref().and_then(|a| a.region(r)).cloned();
    let reference = if spec.reference.enabled {
        let r = region(Role::RefWeights);
        Some(GpuModel::upload_in(&gpu, &stream, actor, r.as_deref())?)
    } else {
        None
    };
    let trainer = GpuTrainer::new_in(
        &gpu,
        &stream,
        actor,
        super::cpu::train_config(spec)?,
        spec.train.optimizer.clone(),
        &TrainerPlacement {
            weights: region(Role::ActorWeights),
            masters: region(Role::Masters),
            moments: region(Role::Moments),
        },
    )?;
    stream.synchronize()?;
    Ok(GpuModels {
        trainer,
        reference,
        stream,
        arena,
        gpu,
    })
}

/// GPU 0, or a message saying why there is none.
pub fn open_gpu() -> Result<Gpu, ExecError> {
    Gpu::new(0).map_err(|e| {
        ExecError::Machine(format!(
            "--backend cuda needs a CUDA GPU: {e} (run a CPU-compiled plan with --backend cpu, or any plan with --backend sim)"
        ))
    })
}

/// Checks that `plan` can run on `gpu` with this executor (one GPU, TP 1, the plan's GPU kind,
/// the plan's device memory available).
pub fn check_gpu_plan(plan: &Plan, gpu: &Gpu) -> Result<(), ExecError> {
    let target = &plan.target;
    if target.gpu.eq_ignore_ascii_case("cpu") {
        return Err(ExecError::Machine(format!(
            "this plan was compiled for the CPU backend's pseudo-GPU: run it with --backend cpu, or compile the \
             pipeline for this GPU ({}) with `gpu {{ preset = {} count = 1 }}` for --backend cuda",
            gpu.name(),
            preset_of(gpu.name()).unwrap_or("<its preset>")
        )));
    }
    if !gpu
        .name()
        .to_ascii_lowercase()
        .contains(&target.gpu.to_ascii_lowercase())
    {
        return Err(ExecError::Machine(format!(
            "this plan was compiled for {} GPUs but this one is {}: its schedule (SM partitions, timings, memory) \
             would not hold here; recompile the pipeline with `gpu {{ preset = {} }}`",
            target.gpu,
            gpu.name(),
            preset_of(gpu.name()).unwrap_or("<this GPU's preset>")
        )));
    }
    if target.count != 1
        || plan.gpus.len() != 1
        || plan.parallel.rollout_tp != 1
        || plan.parallel.train_tp != 1
    {
        return Err(ExecError::Machine(format!(
            "the CUDA executor runs one GPU with TP 1; this plan targets {} x {} ({} GPU programs, rollout TP {}, \
             training TP {}): compile it with `gpu {{ preset = {} count = 1 }}`",
            target.count,
            target.gpu,
            plan.gpus.len(),
            plan.parallel.rollout_tp,
            plan.parallel.train_tp,
            target.gpu
        )));
    }
    let devices = rollplex_kernels::cuda::cuda_available()?;
    if devices < target.count as usize {
        return Err(ExecError::Machine(format!(
            "the plan needs {} GPUs, {devices} present",
            target.count
        )));
    }
    gpu.ctx().bind_to_thread()?;
    let (free, total) = cudarc::driver::result::mem_get_info()?;
    let need: u64 = plan.memory.gpus.iter().map(|m| m.peak).max().unwrap_or(0);
    if need > total as u64 {
        return Err(ExecError::Machine(format!(
            "the plan's device arena peak is {:.1} GiB but {} has {:.1} GiB ({:.1} GiB free): recompile with a \
             smaller batch or memory budget",
            need as f64 / GIB,
            gpu.name(),
            total as f64 / GIB,
            free as f64 / GIB
        )));
    }
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Device memory the plan does not count and an iteration may hold beyond its arena before the
/// loop warns: the runtime's fixed working buffers (a 32 MiB cuBLASLt workspace per stream,
/// decode attention workspaces, upload staging), about 0.3-0.5 GiB measured with the tiny
/// pipeline, whose plan arena is a few MiB.
const WORKSPACE_ALLOWANCE: u64 = 1 << 30;

/// The DSL preset of a device name, when there is one.
fn preset_of(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_uppercase();
    ["H200", "H100", "H800", "A100"]
        .into_iter()
        .find(|p| n.contains(p))
}

/// The plan's streams of one GPU program as CUDA streams. Outside decode windows a task runs
/// on its plan stream's own CUDA stream (`High` priority: the device's most urgent; `Normal`:
/// the least), on the whole GPU. Inside a window, its decode task runs on the window's decode
/// partition (`decode_sms` SMs) and its side tasks on the side partition (`side_sms`), from
/// [`StreamSet`] (green contexts; prioritised plain streams where those are unavailable).
pub struct PlanStreams {
    streams: Vec<Option<Arc<CudaStream>>>,
    /// Per window: (decode, side) partition streams.
    windows: Vec<Option<(Arc<CudaStream>, Arc<CudaStream>)>>,
    set: StreamSet,
}

impl PlanStreams {
    pub fn new(plan: &Plan, gpu: &Gpu) -> Result<Self, ExecError> {
        let set = StreamSet::new(gpu)?;
        let (least, most_urgent) = gpu.priority_range()?;
        let mut streams = vec![None; plan.streams.len()];
        let program = plan.gpus[0].id;
        for s in plan.streams.iter().filter(|s| s.gpu == program) {
            let prio = match s.priority {
                Priority::High => most_urgent,
                Priority::Normal => least,
            };
            streams[s.id.index()] = Some(gpu.stream(prio)?);
        }
        let total = set.total_sms();
        let mut windows = vec![None; plan.windows.len()];
        for w in plan.windows.iter().filter(|w| w.gpu == program) {
            // side_sms == 0: decode has the whole GPU (no side work in the window)
            let (d, sd) = if w.side_sms == 0 {
                (total, total)
            } else {
                (w.decode_sms, w.side_sms)
            };
            windows[w.id.index()] = Some((
                set.partition(d, PartPriority::High)?,
                set.partition(sd, PartPriority::Normal)?,
            ));
        }
        Ok(PlanStreams {
            streams,
            windows,
            set,
        })
    }

    pub fn get(&self, id: StreamId) -> Result<&Arc<CudaStream>, ExecError> {
        self.streams
            .get(id.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| ExecError::Plan(format!("{id} is not a stream of GPU program 0")))
    }

    /// Every CUDA stream of the plan's tasks (plan streams and window partitions).
    pub fn all(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        self.streams.iter().flatten().chain(
            self.windows
                .iter()
                .flatten()
                .flat_map(|(d, s)| [d, s].into_iter()),
        )
    }

    /// Whether windows run on real SM partitions (green contexts).
    pub fn green(&self) -> bool {
        self.set.green()
    }

    /// The CUDA stream `task` runs on (see the type's docs).
    pub fn for_task(&self, plan: &Plan, task: &Task) -> Result<Arc<CudaStream>, ExecError> {
        let Some(w) = task.window else {
            return Ok(self.get(task.stream)?.clone());
        };
        let window = plan
            .windows
            .get(w.index())
            .ok_or_else(|| ExecError::Plan(format!("{} names unknown {w}", task.id)))?;
        let (decode, side) = self
            .windows
            .get(w.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| ExecError::Plan(format!("{w} is not a window of GPU program 0")))?;
        Ok(if task.stream == window.decode_stream {
            decode.clone()
        } else {
            side.clone()
        })
    }
}

/// Whether the host waits for the device inside this op (see the module docs).
pub fn blocks_host(op: &Op) -> bool {
    matches!(
        op,
        Op::DecodeWindow { .. } | Op::TrainMicroBatch { .. } | Op::OptimizerStep { .. }
    )
}

type Media = Arc<Vec<GpuEncodedMedia>>;

/// One iteration's state on the CUDA backend.
pub struct GpuIteration<'a, 'r> {
    plan: &'a Plan,
    models: &'a mut GpuModels,
    streams: &'a PlanStreams,
    reward: &'a mut RewardFn<'r>,
    book: Book<'a>,
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
    slots: Vec<DecodeSlot>,
    /// Next-token logits `[active, vocab]` of the samples in `active` (ascending), on the
    /// decode stream.
    logits: Option<CudaSlice<bf16>>,
    active: Vec<usize>,
    /// Per task: events recorded on its CUDA stream before its first and after its last
    /// launch, and that stream.
    events: Vec<Option<(CudaEvent, CudaEvent, Arc<CudaStream>)>>,
    /// Per plan stream: the last task that ran on it.
    last_on_stream: Vec<Option<TaskId>>,
    /// Reference (`true`) or old log-probs of a group still on the device.
    pending: Vec<(usize, bool, DeviceScores)>,
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
    /// Per task: a decode window's step marks, by task index.
    decode_marks: Vec<Option<Vec<CudaEvent>>>,
    /// State to free before the iteration ends, and the task after whose launches the plan's
    /// buffers of it are dead (their `Lifetime::Tasks` end), ascending by task.
    retire: Vec<(TaskId, Held)>,
    /// Per [`Held`] (by discriminant): the streams its buffers were allocated on.
    made_on: [Vec<Arc<CudaStream>>; Held::ALL.len()],
}

/// Iteration state that follows plan buffers whose lifetimes end before the iteration does:
/// dropped once the last task of those buffers is launched (its streams waiting on that task's
/// end event first), so the pool's high-water mark follows the plan's lifetimes instead of
/// holding every iteration buffer to the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// `kv.prompt`, `kv.response`: the decode KV arena and the logits (the prefill states go
    /// once the arena holds their KV).
    DecodeKv,
    /// `vision_emb`: the rollout's media embeddings.
    Media,
    /// `ref_prefix_kv`: the reference's prefix states.
    RefPrefixes,
    /// `old_prefix_kv`: the actor's prefix states for old log-probs.
    OldPrefixes,
    /// `train_prefix.sS` (every step's: one store serves them all): the kept prompt forwards.
    TrainPrefixes,
}

impl Held {
    const ALL: [Held; 5] = [
        Held::DecodeKv,
        Held::Media,
        Held::RefPrefixes,
        Held::OldPrefixes,
        Held::TrainPrefixes,
    ];

    /// The held state of a plan buffer of `role`: that of its per-iteration [`Role`].
    fn of(role: rollplex_plan::BufferRole) -> Option<Held> {
        Some(match Role::of(role)? {
            Role::DecodeKv => Held::DecodeKv,
            Role::Media => Held::Media,
            Role::RefPrefixes => Held::RefPrefixes,
            Role::OldPrefixes => Held::OldPrefixes,
            Role::TrainPrefixes => Held::TrainPrefixes,
            Role::ActorWeights
            | Role::RefWeights
            | Role::Masters
            | Role::Moments
            | Role::Grads(_) => return None,
        })
    }

    /// What running `op` allocates of the iteration's held state.
    fn made_by(op: &Op) -> Option<Held> {
        match op {
            Op::EncodeMedia { .. } => Some(Held::Media),
            Op::Prefill { .. } | Op::DecodeWindow { .. } => Some(Held::DecodeKv),
            Op::RefPrefix { .. } => Some(Held::RefPrefixes),
            Op::ActorPrefix {
                purpose: Purpose::OldLogProb,
                ..
            } => Some(Held::OldPrefixes),
            Op::ActorPrefix {
                purpose: Purpose::Train { .. },
                ..
            } => Some(Held::TrainPrefixes),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// When each held state may go: the last task (in plan order) of its buffers on `gpu`;
    /// none for a state with a persistent buffer.
    fn retirements(plan: &Plan) -> Vec<(TaskId, Held)> {
        let gpu = plan.gpus.first().map(|g| g.id);
        let mut out: Vec<(TaskId, Held)> = Vec::new();
        for h in Held::ALL {
            let mut last: Option<TaskId> = None;
            let mut keep = false;
            for b in plan
                .buffers
                .iter()
                .filter(|b| Some(b.gpu) == gpu && Held::of(b.role) == Some(h))
            {
                match b.lifetime {
                    Lifetime::Tasks { last: l, .. } => last = Some(last.map_or(l, |x| x.max(l))),
                    Lifetime::Persistent => keep = true,
                }
            }
            if let (Some(t), false) = (last, keep) {
                out.push((t, h));
            }
        }
        out.sort_by_key(|&(t, _)| t);
        out
    }
}

/// Whether `ROLLPLEX_TASK_LOG` is set: log each task's launches and each decode window's
/// [`HostSplit`] to stderr.
fn task_log() -> bool {
    std::env::var_os("ROLLPLEX_TASK_LOG").is_some()
}

/// Where the host's time goes in a decode window (`ROLLPLEX_TASK_LOG=1` prints it per window):
/// launching the sampling and log-prob kernels, waiting for the step's tokens (the device
/// runs the step meanwhile), the bookkeeping and the next step's launches, and launching side
/// pieces. When the wait is near zero the decode loop is bound by the host, not the device.
#[derive(Default)]
struct HostSplit {
    steps: u32,
    pieces: u32,
    launch_sample: Duration,
    wait: Duration,
    launch_decode: Duration,
    launch_side: Duration,
}

impl std::fmt::Display for HostSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "{} steps, sample launch {:.1} ms, wait for tokens {:.1} ms, decode launch {:.1} ms, \
             {} side pieces launched in {:.1} ms",
            self.steps,
            ms(self.launch_sample),
            ms(self.wait),
            ms(self.launch_decode),
            self.pieces,
            ms(self.launch_side)
        )
    }
}

/// Deferred pieces the decode loop lets run at once (see [`GpuIteration::launch_paced`]). One:
/// a piece (a group's prefix forward, ~450 launches) launched while another still runs fills
/// CUDA's launch queue, and the host then waits in its launches for the side partition to drain
/// the first; the decode stream idles meanwhile. Measured on the H200 (session 8, 16 prompts
/// without dedup, `ROLLPLEX_TASK_LOG`): with two in flight each piece held the decode loop
/// ~37 ms. With one, the side stream idles at most until the end of the running decode step.
const PIECES_IN_FLIGHT: usize = 1;

/// A side task of a decode window is deferred ([`DeferQueue`]): the walker reaches a window's
/// side tasks before its decode task, and launching them all at once (a prefix forward is some
/// 450 kernels a group) would hold the host in CUDA's launch queue until the side partition has
/// drained most of them, starting the decode late (measured on the H200: 120-320 ms late per
/// window). The decode loop launches one piece after each step instead, while the device runs
/// the step, when the previous piece is done; what is left goes on to the next window's decode
/// loop, and the first task outside the windows launches the rest. The same calls on the same
/// streams as undeferred: no number changes. This names a piece's stream.
#[derive(Clone)]
struct StreamRef(Arc<CudaStream>);

impl PartialEq for StreamRef {
    fn eq(&self, other: &Self) -> bool {
        self.0.cu_stream() == other.0.cu_stream()
    }
}

/// A deferred task's unit of launching.
enum Piece {
    /// One group of a per-group prefix op.
    Group(Op, usize),
    /// The whole op.
    Whole(Op),
}

impl<'a, 'r> GpuIteration<'a, 'r> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut GpuModels,
        streams: &'a PlanStreams,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
    ) -> Result<Self, ExecError> {
        let book = Book::new(plan, iteration, prompts)?;
        let groups = book.groups();
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let rows = prefix_rows + book.samples() as u64 * plan.spec.rollout.max_new_tokens as u64;
        let arena_rows =
            u32::try_from(rows).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        Ok(GpuIteration {
            plan,
            models,
            streams,
            reward,
            book,
            encoded: vec![None; groups],
            encoded_ready: (0..groups).map(|_| None).collect(),
            ref_encoded: vec![None; groups],
            prefixes: vec![None; groups],
            ref_prefixes: vec![None; groups],
            old_prefixes: vec![None; groups],
            arena: None,
            arena_rows,
            slots: Vec::new(),
            logits: None,
            active: Vec::new(),
            events: (0..plan.tasks.len()).map(|_| None).collect(),
            last_on_stream: vec![None; plan.streams.len()],
            pending: Vec::new(),
            train_prefixes: None,
            deferred: DeferQueue::default(),
            deferred_start: (0..plan.tasks.len()).map(|_| None).collect(),
            inflight: VecDeque::new(),
            step_marks: Vec::new(),
            decode_marks: (0..plan.tasks.len()).map(|_| None).collect(),
            retire: Held::retirements(plan),
            made_on: Default::default(),
        })
    }

    /// The plan arena's region for `role`, when the models were built for the plan.
    fn region(&self, role: Role) -> Option<Arc<Region>> {
        self.models.arena.as_ref()?.region(role).cloned()
    }

    /// Notes that `held`'s buffers got memory allocated on `s`.
    fn note_made(&mut self, held: Held, s: &Arc<CudaStream>) {
        let on = &mut self.made_on[held.index()];
        if !on.iter().any(|x| x.cu_stream() == s.cu_stream()) {
            on.push(s.clone());
        }
    }

    /// Frees the held state whose buffers' last task has been launched: the streams its memory
    /// was allocated on (where the drops queue the frees) first wait for that task's end.
    fn retire_ready(&mut self) -> Result<(), ExecError> {
        while let Some(&(t, held)) = self.retire.first() {
            let Some((_, end, on)) = self.events.get(t.index()).and_then(Option::as_ref) else {
                break;
            };
            crate::gpu::wait_before_free(&self.made_on[held.index()], on, end)?;
            match held {
                Held::DecodeKv => {
                    self.arena = None;
                    self.logits = None;
                }
                Held::Media => {
                    self.encoded.iter_mut().for_each(|m| *m = None);
                    self.encoded_ready.iter_mut().for_each(|m| *m = None);
                }
                Held::RefPrefixes => self.ref_prefixes.iter_mut().for_each(|p| *p = None),
                Held::OldPrefixes => self.old_prefixes.iter_mut().for_each(|p| *p = None),
                Held::TrainPrefixes => self.train_prefixes = None,
            }
            self.made_on[held.index()].clear();
            self.retire.remove(0);
        }
        Ok(())
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

    fn media_inputs(p: &PromptData) -> Vec<MediaInput<'_>> {
        p.media
            .iter()
            .map(|m| MediaInput {
                kind: m.kind,
                pixels: &m.pixels,
                grid: m.grid,
            })
            .collect()
    }

    /// Encodes the media of `groups` with `model`, one call per group (`copies` copies of the
    /// group's media in it, the ablation's cost); returns each group's first copy. One call per
    /// group keeps every GEMM's shape a function of the group alone, so the bits do not depend
    /// on how a plan cut its tasks.
    fn encode(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        prompts: &[PromptData],
        groups: &[usize],
        copies: u32,
        region: Option<&Region>,
    ) -> Result<Vec<Media>, ExecError> {
        let mut out = Vec::with_capacity(groups.len());
        for &g in groups {
            let inputs = Self::media_inputs(&prompts[g]);
            if inputs.is_empty() {
                out.push(Arc::new(Vec::new()));
                continue;
            }
            let n = inputs.len();
            let mut items = Vec::with_capacity(n * copies.max(1) as usize);
            for _ in 0..copies.max(1) {
                items.extend_from_slice(&inputs);
            }
            let mut m = model.encode_media_in(gpu, s, &items, region)?;
            m.truncate(n);
            out.push(Arc::new(m));
        }
        Ok(out)
    }

    /// Prefills the prompts of `groups` with `model`, one packed call per group (`copies`
    /// copies of its prompt); returns each group's first copy (see [`Self::encode`] on why per
    /// group), its keys and values in `region` of the plan's arena when given.
    #[allow(clippy::too_many_arguments)] // the state it reads, borrowed apart from `self`
    fn prefill(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        prompts: &[PromptData],
        groups: &[usize],
        media: &[Media],
        copies: u32,
        region: Option<&Region>,
    ) -> Result<Vec<GpuPrefixState>, ExecError> {
        let mut out = Vec::with_capacity(groups.len());
        for (i, &g) in groups.iter().enumerate() {
            let refs: Vec<&GpuEncodedMedia> = media[i].iter().collect();
            let prompt = GpuPrompt {
                ids: &prompts[g].ids,
                media: &refs,
            };
            let batch = vec![prompt; copies.max(1) as usize];
            let state = model
                .prefill_in(gpu, s, &batch, region)?
                .into_iter()
                .next()
                .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))?;
            out.push(state);
        }
        Ok(out)
    }

    /// The actor's (rollout) media of `groups`, encoding those not encoded yet on `s`.
    fn actor_media(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
    ) -> Result<Vec<Media>, ExecError> {
        let missing: Vec<usize> = groups
            .iter()
            .copied()
            .filter(|&g| self.encoded[g].is_none())
            .collect();
        if !missing.is_empty() {
            self.note_made(Held::Media, s);
            let m = Self::encode(
                &self.models.gpu,
                s,
                self.models.trainer.model(),
                self.book.prompts,
                &missing,
                1,
                None,
            )?;
            for (g, m) in missing.into_iter().zip(m) {
                self.encoded[g] = Some(m);
            }
        }
        for &g in groups {
            if let Some((ready, on)) = &self.encoded_ready[g] {
                if on.cu_stream() != s.cu_stream() {
                    s.wait(ready)?;
                }
            }
        }
        Ok(groups
            .iter()
            .map(|&g| self.encoded[g].clone().expect("encoded above"))
            .collect())
    }

    /// The reference's media of `groups`: the actor's when the tower is frozen (same weights),
    /// else encoded with the reference (`copies` times, the ablation's cost).
    fn ref_media(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
    ) -> Result<Vec<Media>, ExecError> {
        if self.book.frozen_tower() {
            return self.actor_media(s, groups);
        }
        let missing: Vec<usize> = groups
            .iter()
            .copied()
            .filter(|&g| self.ref_encoded[g].is_none())
            .collect();
        if !missing.is_empty() {
            let reference = self.models.reference.as_ref().ok_or_else(no_reference)?;
            let m = Self::encode(
                &self.models.gpu,
                s,
                reference,
                self.book.prompts,
                &missing,
                copies,
                None,
            )?;
            for (g, m) in missing.into_iter().zip(m) {
                self.ref_encoded[g] = Some(m);
            }
        }
        Ok(groups
            .iter()
            .map(|&g| self.ref_encoded[g].clone().expect("encoded above"))
            .collect())
    }

    fn run_prefill(
        &mut self,
        s: &Arc<CudaStream>,
        groups: Span,
        copies: u32,
    ) -> Result<(), ExecError> {
        let groups: Vec<usize> = range(groups).collect();
        let media = self.actor_media(s, &groups)?;
        let states = Self::prefill(
            &self.models.gpu,
            s,
            self.models.trainer.model(),
            self.book.prompts,
            &groups,
            &media,
            copies,
            None,
        )?;
        for (g, st) in groups.into_iter().zip(states) {
            self.prefixes[g] = Some(st);
        }
        if self.prefixes.iter().all(Option::is_some) && self.slots.is_empty() {
            self.lay_out(s)?;
        }
        Ok(())
    }

    /// Once every group's prefix is known: the KV arena `[group prefixes | sample suffixes]`,
    /// the decode slots, and every sample's first logits (its group's last prompt logits).
    fn lay_out(&mut self, s: &Arc<CudaStream>) -> Result<(), ExecError> {
        let region = self.region(Role::DecodeKv);
        let model = self.models.trainer.model();
        let gpu = &self.models.gpu;
        let mut arena =
            GpuKvArena::for_model_in(model, gpu, s, self.arena_rows, region.as_deref())?;
        let mut off = 0u32;
        let mut spans = Vec::with_capacity(self.prefixes.len());
        for p in self.prefixes.iter().flatten() {
            spans.push(arena.store_prefix(s, off, p)?);
            off += p.len;
        }
        let max_new = self.book.spec.rollout.max_new_tokens;
        let samples = self.book.samples();
        let v = model.vocab();
        let mut logits = gpu.alloc::<bf16>(s, samples * v)?;
        for smp in 0..samples {
            let g = smp / self.book.group_size;
            let p = self.prefixes[g].as_ref().expect("all prefixes known");
            self.slots
                .push(DecodeSlot::new(spans[g], p.rope_delta, off, max_new));
            s.memcpy_dtod(
                &*p.last_logits,
                &mut logits.slice_mut(smp * v..(smp + 1) * v),
            )?;
            off += max_new;
        }
        self.arena = Some(arena);
        self.logits = Some(logits);
        self.active = (0..samples).collect();
        // the prefill states are in the arena now (without prefix dedup each holds every
        // copy's KV, the plan's `kv.prompt`): their frees wait for the copies above
        let copied = self.models.gpu.event()?;
        copied.record(s)?;
        crate::gpu::wait_before_free(&self.made_on[Held::DecodeKv.index()], s, &copied)?;
        self.prefixes.iter_mut().for_each(|p| *p = None);
        Ok(())
    }

    fn run_decode(
        &mut self,
        s: &Arc<CudaStream>,
        first_step: u32,
        steps: u32,
        until_done: bool,
    ) -> Result<(), ExecError> {
        if self.slots.is_empty() {
            return Err(ExecError::Plan(
                "decode before every group's prefill".into(),
            ));
        }
        let temp = self.book.temperature();
        let (seed, iteration) = (self.book.spec.seed, self.book.iteration);
        let mut step = first_step;
        self.step_marks.clear();
        let mut host = HostSplit::default();
        let window_start = Instant::now();
        while (until_done || step < first_step + steps) && !self.active.is_empty() {
            let t_step = Instant::now();
            let mark = self.models.gpu.timing_event()?;
            mark.record(s)?;
            self.step_marks.push(mark);
            let gpu = &self.models.gpu;
            let model = self.models.trainer.model();
            let arena = self.arena.as_mut().expect("laid out with the slots");
            let v = model.vocab();
            let n = self.active.len();
            for &smp in &self.active {
                self.book.check_step(smp, step)?;
            }
            let logits = self.logits.as_ref().expect("laid out with the slots");
            let ids: Vec<u32> = self.active.iter().map(|&x| x as u32).collect();
            let toks_d = model.sample_tokens(
                gpu,
                s,
                logits,
                &self.book.sampling,
                seed,
                iteration,
                &ids,
                &vec![step; n],
            )?;
            let mut lp_d = gpu.alloc::<f32>(s, n)?;
            logprobs_fwd_bf16(
                gpu,
                s,
                &mut lp_d,
                None::<&mut dyn DevicePtrMut<f32>>,
                None,
                logits,
                &toks_d,
                n,
                v,
                v,
                temp,
            )?;
            let t_wait = Instant::now();
            let toks = s.clone_dtoh(&toks_d)?;
            let lps = s.clone_dtoh(&lp_d)?;
            s.synchronize()?;
            host.launch_sample += t_wait.duration_since(t_step);
            host.wait += t_wait.elapsed();
            let t_decode = Instant::now();
            let mut feed = Vec::with_capacity(n);
            let mut feed_tokens = Vec::with_capacity(n);
            let mut feed_slots = Vec::with_capacity(n);
            for (i, &smp) in self.active.iter().enumerate() {
                if self.book.push_token(smp, toks[i], lps[i], step) {
                    feed.push(smp);
                    feed_tokens.push(toks[i]);
                    feed_slots.push(self.slots[smp]);
                }
            }
            if !feed.is_empty() {
                self.logits =
                    Some(model.decode_step(gpu, s, arena, &mut feed_slots, &feed_tokens)?);
                for (slot, &smp) in feed_slots.iter().zip(&feed) {
                    self.slots[smp] = *slot;
                }
            }
            self.active = feed;
            self.book.step_done(step);
            step += 1;
            host.launch_decode += t_decode.elapsed();
            // a piece of the window's side work, launched while the device runs this step
            let t_side = Instant::now();
            host.pieces += self.launch_paced()?;
            host.launch_side += t_side.elapsed();
            host.steps += 1;
        }
        if task_log() {
            eprintln!(
                "[decode steps {first_step}..{step}] host {:.1} ms: {}",
                window_start.elapsed().as_secs_f64() * 1e3,
                host
            );
        }
        let mark = self.models.gpu.timing_event()?;
        mark.record(s)?;
        self.step_marks.push(mark);
        // side pieces still deferred stay queued: the next window's decode loop launches them
        // paced (launching them all here would hold the host, and so the next window's first
        // step, until the side partition had drained them); the first task outside a window
        // launches what is left (`run`)
        self.book.end_window();
        Ok(())
    }

    /// Whether `task` is a side task of a decode window whose launches wait for the window's
    /// decode loop (see [`DeferQueue`]).
    fn defers(&self, task: &Task) -> bool {
        let Some(w) = task.window else { return false };
        let decode = self.plan.windows.get(w.index()).map(|w| w.decode_stream);
        decode != Some(task.stream) && !blocks_host(&task.op)
    }

    /// The pieces a deferred task launches in: one per group for the per-group prefix
    /// forwards (each one device call already), the whole op otherwise.
    fn pieces_of(&self, op: &Op) -> Result<Vec<Piece>, ExecError> {
        Ok(match op {
            Op::RefPrefix { groups, .. } => range(*groups)
                .map(|g| Piece::Group(op.clone(), g))
                .collect(),
            Op::ActorPrefix { groups, .. } => self
                .book
                .groups_of(groups)?
                .into_iter()
                .map(|g| Piece::Group(op.clone(), g))
                .collect(),
            _ => vec![Piece::Whole(op.clone())],
        })
    }

    /// From the decode loop: the next deferred piece, if fewer than [`PIECES_IN_FLIGHT`]
    /// launched pieces are still running (more would fill CUDA's launch queue, and the host
    /// would wait in a launch instead of issuing the next decode step).
    /// Returns how many pieces it launched (0 or 1).
    fn launch_paced(&mut self) -> Result<u32, ExecError> {
        while let Some(e) = self.inflight.front() {
            if e.try_is_complete()? {
                self.inflight.pop_front();
            } else {
                break;
            }
        }
        if self.inflight.len() < PIECES_IN_FLIGHT && !self.deferred.is_empty() {
            self.launch_deferred(1)?;
            return Ok(1);
        }
        Ok(0)
    }

    /// Launches up to `count` pieces of the deferred side tasks, oldest first; a task gets its
    /// start event before its first piece and its end event after its last (its dependents may
    /// then run).
    fn launch_deferred(&mut self, count: usize) -> Result<(), ExecError> {
        for _ in 0..count {
            let Some(x) = self.deferred.take() else {
                break;
            };
            let s = x.stream.0;
            if x.first {
                let e = self.models.gpu.timing_event()?;
                e.record(&s)?;
                self.deferred_start[x.task.index()] = Some(e);
            }
            match &x.piece {
                Some(Piece::Group(op, g)) => self.run_group_piece(&s, op, *g)?,
                Some(Piece::Whole(op)) => self.run_op(&s, op)?,
                None => {}
            }
            let done = self.models.gpu.event()?;
            done.record(&s)?;
            self.inflight.push_back(done);
            if x.last {
                let start = self.deferred_start[x.task.index()].take().ok_or_else(|| {
                    ExecError::Plan(format!("{}: deferred without a start", x.task))
                })?;
                let end = self.models.gpu.timing_event()?;
                end.record(&s)?;
                self.events[x.task.index()] = Some((start, end, s));
            }
        }
        Ok(())
    }

    /// Launches deferred pieces, oldest first, until none of the tasks `ids` is deferred any
    /// more (their end events exist, so a task that waits on one of them can run).
    fn flush_deferred_for(&mut self, ids: &[TaskId]) -> Result<(), ExecError> {
        while ids.iter().any(|&id| self.deferred.contains(id)) {
            self.launch_deferred(1)?;
        }
        Ok(())
    }

    /// Launches everything still deferred (the walk is over).
    pub fn flush_deferred(&mut self) -> Result<(), ExecError> {
        self.launch_deferred(usize::MAX)
    }

    /// One group's share of a per-group prefix op (a deferred task's piece).
    fn run_group_piece(&mut self, s: &Arc<CudaStream>, op: &Op, g: usize) -> Result<(), ExecError> {
        if let Some(h) = Held::made_by(op) {
            self.note_made(h, s);
        }
        match op {
            Op::RefPrefix { copies, .. } => self.run_prefix_states(s, &[g], *copies, true),
            Op::ActorPrefix {
                copies, purpose, ..
            } => match purpose {
                Purpose::OldLogProb => self.run_prefix_states(s, &[g], *copies, false),
                Purpose::Train { .. } => self.run_train_prefix(s, &[g], *copies),
            },
            _ => Err(ExecError::Plan(format!("{op:?} has no per-group pieces"))),
        }
    }

    /// Prefix states of `groups` (one device call per group, `copies` in it): the reference's
    /// (`reference`), kept for `RefSuffix`, or the actor's for old log-probs (`ActorSuffix`).
    fn run_prefix_states(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
        reference: bool,
    ) -> Result<(), ExecError> {
        let media = if reference {
            self.ref_media(s, groups, copies)?
        } else {
            self.actor_media(s, groups)?
        };
        let region = self.region(if reference {
            Role::RefPrefixes
        } else {
            Role::OldPrefixes
        });
        let model = if reference {
            self.models.reference.as_ref().ok_or_else(no_reference)?
        } else {
            self.models.trainer.model()
        };
        let states = Self::prefill(
            &self.models.gpu,
            s,
            model,
            self.book.prompts,
            groups,
            &media,
            copies,
            region.as_deref(),
        )?;
        let out = if reference {
            &mut self.ref_prefixes
        } else {
            &mut self.old_prefixes
        };
        for (&g, st) in groups.iter().zip(states) {
            out[g] = Some(st);
        }
        Ok(())
    }

    fn run_train_micro_batch(
        &mut self,
        s: &Arc<CudaStream>,
        step: u32,
        micro_batch: u32,
        samples: Span,
    ) -> Result<(), ExecError> {
        self.collect_scores()?;
        let mb = self.book.micro_batch("CUDA", step, micro_batch, samples)?;
        let (store, _) = self.train_prefixes.as_ref().ok_or_else(|| {
            ExecError::Plan(format!(
                "micro-batch {micro_batch} of step {step} before any ActorPrefix{{Train}} task \
                 kept its groups' prompt forwards"
            ))
        })?;
        let grads = self.region(Role::Grads(step));
        self.models.trainer.set_grads_region(grads);
        let responses = self.book.batches(&mb);
        let batch: Vec<PrefixedGroup<'_>> = mb
            .groups
            .iter()
            .enumerate()
            .map(|(i, &g)| PrefixedGroup {
                group: g,
                responses: &responses[i],
            })
            .collect();
        let out = self.models.trainer.micro_batch_prefixed(
            &self.models.gpu,
            s,
            micro_batch,
            &batch,
            mb.norm,
            store,
        )?;
        drop(batch);
        drop(responses);
        self.book.metrics.loss.add(&out.metrics);
        self.book.metrics.micro_batches += 1;
        Ok(())
    }

    /// `ActorPrefix{Train}`: the actor's prompt forward of `groups` with the current weights,
    /// `copies` per group, kept for the micro-batches (one device call per group).
    fn run_train_prefix(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
    ) -> Result<(), ExecError> {
        // a trained tower or merger: the trainer encodes each prompt's media itself, keeping
        // what its backward needs; frozen: the actor's shared encoding
        let trains_vision = self.models.trainer.trains_vision();
        let media = if trains_vision {
            Vec::new()
        } else {
            self.actor_media(s, groups)?
        };
        let copies = copies.max(1);
        if self.train_prefixes.is_none() {
            let lens: Vec<(usize, u32)> = self
                .book
                .prompts
                .iter()
                .map(|p| (p.ids.len(), copies))
                .collect();
            let region = self.region(Role::TrainPrefixes);
            let store = TrainPrefixes::new_in(
                &self.models.gpu,
                s,
                self.models.trainer.model(),
                &lens,
                region,
            )?;
            self.train_prefixes = Some((store, copies));
        }
        let (store, laid_out) = self.train_prefixes.as_mut().expect("made above");
        if *laid_out != copies {
            return Err(ExecError::Plan(format!(
                "ActorPrefix{{Train}} tasks of one iteration keep {laid_out} and {copies} copies \
                 per group"
            )));
        }
        for (i, &g) in groups.iter().enumerate() {
            let prompt = &self.book.prompts[g];
            let (raw, refs): (Vec<MediaInput<'_>>, Vec<&GpuEncodedMedia>);
            let m = if trains_vision {
                raw = Self::media_inputs(prompt);
                PromptMedia::Raw(&raw)
            } else {
                refs = media[i].iter().collect();
                PromptMedia::Encoded(&refs)
            };
            self.models
                .trainer
                .prefix_forward(&self.models.gpu, s, store, g, &prompt.ids, m)?;
        }
        Ok(())
    }

    fn run_op(&mut self, s: &Arc<CudaStream>, op: &Op) -> Result<(), ExecError> {
        if let Some(h) = Held::made_by(op) {
            self.note_made(h, s);
        }
        let temp = self.book.temperature();
        match op {
            Op::EncodeMedia { groups, copies } => {
                let groups: Vec<usize> = range(*groups).collect();
                let region = self.region(Role::Media);
                let m = Self::encode(
                    &self.models.gpu,
                    s,
                    self.models.trainer.model(),
                    self.book.prompts,
                    &groups,
                    *copies,
                    region.as_deref(),
                )?;
                let ready = self.models.gpu.event()?;
                ready.record(s)?;
                let ready = Arc::new(ready);
                for (g, m) in groups.into_iter().zip(m) {
                    self.encoded[g] = Some(m);
                    self.encoded_ready[g] = Some((ready.clone(), s.clone()));
                }
            }
            Op::Prefill { groups, copies } => self.run_prefill(s, *groups, *copies)?,
            Op::DecodeWindow {
                first_step,
                steps,
                until_done,
            } => self.run_decode(s, *first_step, *steps, *until_done)?,
            Op::RefPrefix { groups, copies } => {
                let groups: Vec<usize> = range(*groups).collect();
                self.run_prefix_states(s, &groups, *copies, true)?;
            }
            Op::RefSuffix { slot } => {
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.ref_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!("ref suffix of group {g} before its prefix"))
                })?;
                let reference = self.models.reference.as_ref().ok_or_else(no_reference)?;
                let scores = reference.score_on_device(
                    &self.models.gpu,
                    s,
                    prefix,
                    &self.book.responses(g),
                    temp,
                )?;
                self.pending.push((g, true, scores));
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => {
                let groups = self.book.groups_of(groups)?;
                match purpose {
                    Purpose::OldLogProb => self.run_prefix_states(s, &groups, *copies, false)?,
                    Purpose::Train { .. } => self.run_train_prefix(s, &groups, *copies)?,
                }
            }
            Op::ActorSuffix { slot, purpose } => {
                if *purpose != Purpose::OldLogProb {
                    return Err(ExecError::Unsupported(
                        "actor suffix forward for training outside a micro-batch".into(),
                    ));
                }
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.old_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!(
                        "old-log-prob suffix of group {g} before its prefix"
                    ))
                })?;
                let scores = self.models.trainer.model().score_on_device(
                    &self.models.gpu,
                    s,
                    prefix,
                    &self.book.responses(g),
                    temp,
                )?;
                self.pending.push((g, false, scores));
            }
            Op::Reward { slot } => self.book.reward(*slot, self.reward)?,
            Op::Advantages { slot } => self.book.advantages(*slot)?,
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(s, *step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                let report = self.models.trainer.optimizer_step(&self.models.gpu, s)?;
                self.book.metrics.grad_norm = report.step.grad_norm;
                self.book.metrics.optimizer_steps += 1;
            }
            // One address space, TP 1: the rollout reads the trainer's weights in place.
            Op::WeightSync { .. } | Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => {
            }
        }
        Ok(())
    }
}

fn no_reference() -> ExecError {
    ExecError::Plan("the plan scores a reference, but the job has none".into())
}

impl TaskRunner for GpuIteration<'_, '_> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.book.slots_bound()
    }

    /// Non-blocking tasks first: they are launched and run on the device while the host waits
    /// inside a blocking one.
    fn rank(&self, task: &Task) -> u8 {
        u8::from(blocks_host(&task.op))
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        let s = self.streams.for_task(self.plan, task)?;
        // Wait for every task this one depends on, and for the previous task of its plan
        // stream, that ran on another CUDA stream (a plan stream's tasks may run on different
        // partitions: inside and outside decode windows). Deferred ones are launched first.
        let prev = self.last_on_stream[task.stream.index()];
        let waits: Vec<TaskId> = task.deps.iter().copied().chain(prev).collect();
        // A deferred task it waits for is launched first, unless this task is deferred too
        // behind it on the same CUDA stream (deferred pieces launch in order, so the stream
        // orders them).
        let deferring = self.defers(task);
        if task.window.is_none() {
            // out of the decode windows nothing waits to be paced
            self.flush_deferred()?;
        }
        let first = self
            .deferred
            .launch_first(&waits, &StreamRef(s.clone()), deferring);
        self.flush_deferred_for(&first)?;
        for d in waits.iter().filter(|&&id| !self.deferred.contains(id)) {
            let (_, end, on) = self
                .events
                .get(d.index())
                .and_then(Option::as_ref)
                .ok_or_else(|| {
                    ExecError::Plan(format!("{} runs before its dependency {d}", task.id))
                })?;
            if on.cu_stream() != s.cu_stream() {
                s.wait(end)?;
            }
        }
        if matches!(
            task.op,
            Op::ActorPrefix {
                purpose: Purpose::Train { .. },
                ..
            }
        ) {
            self.book.metrics.train_prefix_tasks += 1;
        }
        if deferring {
            let pieces = self.pieces_of(&task.op)?;
            self.deferred.push(task.id, StreamRef(s), pieces);
            self.last_on_stream[task.stream.index()] = Some(task.id);
            self.book.metrics.tasks += 1;
            return self.retire_ready();
        }
        let start = self.models.gpu.timing_event()?;
        start.record(&s)?;
        self.run_op(&s, &task.op)?;
        let end = self.models.gpu.timing_event()?;
        end.record(&s)?;
        self.events[task.id.index()] = Some((start, end, s));
        if matches!(task.op, Op::DecodeWindow { .. }) {
            self.decode_marks[task.id.index()] = Some(std::mem::take(&mut self.step_marks));
        }
        self.last_on_stream[task.stream.index()] = Some(task.id);
        self.book.metrics.tasks += 1;
        self.retire_ready()
    }
}

/// Runs iterations `iterations` of `plan` on the GPU, telling `observer` about every task (with
/// its device start and end, mapped onto the host clock from the iteration's start) and every
/// iteration.
pub fn run_gpu_loop(
    plan: &Plan,
    models: &mut GpuModels,
    source: &mut dyn super::prompts::PromptSource,
    reward: &mut RewardFn<'_>,
    iterations: std::ops::Range<u32>,
    observer: &mut dyn LoopObserver,
) -> Result<(), ExecError> {
    check_gpu_plan(plan, &models.gpu)?;
    let streams = PlanStreams::new(plan, &models.gpu)?;
    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    let program = plan.gpus[0].id;
    let tasks = plan.tasks.iter().filter(|t| t.gpu == program).count();
    let origin_stream = streams.get(
        plan.streams
            .iter()
            .find(|s| s.gpu == program)
            .ok_or_else(|| ExecError::Plan("GPU program 0 has no stream".into()))?
            .id,
    )?;
    // The next iteration's prompts are drawn on a host thread while this one runs.
    // Memory. Models built for this plan (`build_gpu_models_for`) sit in its device arena,
    // allocated once, and each iteration's kept buffers go at their plan offsets in it
    // (`exec::placement`); the working sets inside tasks come from the memory pool. Models
    // built without a plan (benchmarks that run several plans on one set of models): the
    // plan's arena is reserved in the pool once instead, and every buffer comes from the pool.
    // Either way state whose plan buffers end early is let go then (`Held`), and an iteration
    // that holds more than the plan counts (plus an allowance for fixed workspaces) is
    // reported.
    let arena: u64 = plan
        .memory
        .arenas
        .iter()
        .filter(|a| a.gpu == program && a.kind == rollplex_plan::plan::ArenaKind::Device)
        .map(|a| a.bytes)
        .sum();
    let placed = match &models.arena {
        Some(a) if !a.fits(plan) => {
            return Err(ExecError::Plan(
                "the models were placed in another plan's device arena: build them for this \
                 plan (build_gpu_models_for)"
                    .into(),
            ))
        }
        Some(a) => a.mapped(),
        None => {
            let (used, _) = models.gpu.pool_usage()?;
            models
                .gpu
                .reserve_pool(&models.stream, arena.saturating_sub(used))?;
            0
        }
    };
    // with the arena placed, the pool holds the tasks' working sets the arena also leaves room
    // for (its `scratch.*` ranges): the bound is then the job's budget
    let budget = plan
        .memory
        .gpus
        .iter()
        .find(|m| m.gpu == program)
        .map_or(0, |m| m.budget);
    let limit = if placed > 0 {
        budget.max(arena + WORKSPACE_ALLOWANCE)
    } else {
        arena + WORKSPACE_ALLOWANCE
    };
    let mut over_arena = false;
    let ran = super::prompts::for_each_prefetched(source, iterations, groups, |it, prompts, t0| {
        models.gpu.ctx().synchronize()?;
        models.gpu.reset_pool_peak()?;
        if let Some(a) = &models.arena {
            // the device is idle: the last iteration's buffers are dead
            a.reset_iteration();
        }
        let origin = models.gpu.timing_event()?;
        origin.record(origin_stream)?;
        // the host instant of `origin` (device times map onto the host clock from here)
        let t_origin = Instant::now();
        observer.iteration_started(it, tasks);
        let (result, times) = {
            let mut iter = GpuIteration::new(plan, models, &streams, reward, it, &prompts)?;
            let mut started = Started {
                inner: &mut iter,
                observer: &mut *observer,
                iteration: it,
                log: task_log().then_some(t0),
            };
            walker::walk(plan, program, &mut started, |_, _| {})?;
            iter.flush_deferred()?;
            iter.models.gpu.ctx().synchronize()?;
            let times = iter.task_times(&origin)?;
            let steps = iter.step_times(&origin)?;
            let mut result = iter.finish()?;
            let peak = placed + models.gpu.pool_usage()?.1;
            result.metrics.peak_mem_bytes = Some(peak);
            if peak > limit && !over_arena {
                // once per run: the plan's memory numbers are what a user sizes GPUs by
                over_arena = true;
                eprintln!(
                    "warning: iteration {it} held {:.2} GiB of device memory at its peak, more \
                     than {} ({:.2} GiB): the runtime kept memory the plan does not count",
                    peak as f64 / GIB,
                    if placed > 0 {
                        "the job's memory budget"
                    } else {
                        "1 GiB above the plan's device arena"
                    },
                    limit as f64 / GIB
                );
            }
            (result, (times, steps))
        };
        let (times, steps) = times;
        let wall = t0.elapsed();
        let at = |ms: f64| t_origin + Duration::from_secs_f64(ms.max(0.0) / 1e3);
        for (i, a, b) in times {
            observer.task_done(it, &plan.tasks[i], at(a), at(b));
        }
        for (i, marks) in steps {
            let marks: Vec<Instant> = marks.into_iter().map(at).collect();
            observer.decode_steps(it, &plan.tasks[i], &marks);
        }
        observer.iteration_done(it, &result, LoopModels::Gpu(models), t0, wall)
    });
    // the loop's streams go with it: so do the GEMM workspaces and handles made for them
    let forgot = models.gpu.forget_streams(streams.all());
    ran?;
    Ok(forgot?)
}

/// Tells the observer when each task is launched (its device times come after the iteration).
struct Started<'a, 'b, 'r> {
    inner: &'a mut GpuIteration<'b, 'r>,
    observer: &'a mut dyn LoopObserver,
    iteration: u32,
    /// `ROLLPLEX_TASK_LOG=1`: the iteration's start, to log each task to stderr as it runs.
    log: Option<Instant>,
}

impl TaskRunner for Started<'_, '_, '_> {
    type Error = ExecError;
    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        self.observer.task_started(self.iteration, task);
        let t0 = Instant::now();
        self.inner.run(task)?;
        if let Some(start) = self.log {
            // host times: when the launches of `task` began and how long the host spent in them;
            // the memory pool's bytes in use once they are queued (stream-ordered allocations
            // count when queued) and its high-water mark of the iteration so far
            let (used, high) = self.inner.models.gpu.pool_usage().unwrap_or((0, 0));
            eprintln!(
                "[iteration {} +{:.3} s] {} ({}): host {:.1} ms, pool {:.2} GiB, high {:.2} GiB",
                self.iteration,
                t0.duration_since(start).as_secs_f64(),
                task.name,
                task.id,
                t0.elapsed().as_secs_f64() * 1e3,
                used as f64 / GIB,
                high as f64 / GIB
            );
        }
        Ok(())
    }
    fn slots_bound(&self) -> u32 {
        self.inner.slots_bound()
    }
    fn rank(&self, task: &Task) -> u8 {
        self.inner.rank(task)
    }
}

/// Runs iterations `first .. first + count` of `plan` on the GPU. `on_iteration` sees each
/// iteration's result and wall time as soon as it is done.
pub fn run_gpu_iterations(
    plan: &Plan,
    models: &mut GpuModels,
    source: &mut dyn super::prompts::PromptSource,
    reward: &mut RewardFn<'_>,
    first: u32,
    count: u32,
    on_iteration: impl FnMut(u32, &IterationResult, Duration) -> Result<(), ExecError>,
) -> Result<(), ExecError> {
    run_gpu_loop(
        plan,
        models,
        source,
        reward,
        first..first + count,
        &mut super::EachIteration(on_iteration),
    )
}

/// Greedy tokens of one prompt with the GPU model (evaluation): encode, prefill, generate.
pub fn greedy_tokens(
    models: &GpuModels,
    prompt: &PromptData,
    sample: u32,
    cfg: &GenerateConfig,
) -> Result<Vec<u32>, ExecError> {
    let (gpu, s) = (&models.gpu, &models.stream);
    let model = models.trainer.model();
    let media = GpuIteration::encode(gpu, s, model, std::slice::from_ref(prompt), &[0], 1, None)?;
    let state = GpuIteration::prefill(
        gpu,
        s,
        model,
        std::slice::from_ref(prompt),
        &[0],
        &media,
        1,
        None,
    )?
    .pop()
    .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))?;
    let cfg = GenerateConfig {
        sampling: SamplingParams::greedy(),
        ..cfg.clone()
    };
    let mut out = model.generate_group(gpu, s, &state, &[sample], &cfg)?;
    Ok(out.pop().map(|r| r.tokens).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::Held;
    use rollplex_plan::plan::Plan;

    fn plan(rel: &str) -> Plan {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(rel);
        let yaml = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        rollplex_plan::from_yaml(&yaml).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Each held state is retired after a task that uses one of its buffers, and no task
    /// later in plan order (the walker's) uses any of them; the states the 3B plan ends
    /// early are all there.
    #[test]
    fn held_state_retires_after_its_buffers_last_task() {
        for rel in [
            "examples/h200-3b-video.plan.yaml",
            "examples/tiny.plan.yaml",
            "tests/out/plans/no_dedup.yaml",
            "tests/out/plans/overlap_images_steps.yaml",
        ] {
            let p = plan(rel);
            let r = Held::retirements(&p);
            assert!(
                r.windows(2).all(|w| w[0].0 <= w[1].0),
                "{rel}: in task order"
            );
            for &(t, h) in &r {
                let bufs: Vec<_> = p
                    .buffers
                    .iter()
                    .filter(|b| Held::of(b.role) == Some(h))
                    .map(|b| b.id)
                    .collect();
                let uses = |i: usize| {
                    let task = &p.tasks[i];
                    task.reads
                        .iter()
                        .chain(&task.writes)
                        .any(|b| bufs.contains(b))
                };
                assert!(
                    uses(t.index()),
                    "{rel}: {h:?} retires after {t}, which does not use it"
                );
                for i in t.index() + 1..p.tasks.len() {
                    assert!(
                        !uses(i),
                        "{rel}: {h:?} retires after {t} but {} uses it",
                        p.tasks[i].name
                    );
                }
            }
            if rel.contains("h200-3b") {
                let held: Vec<Held> = r.iter().map(|&(_, h)| h).collect();
                for h in [
                    Held::DecodeKv,
                    Held::Media,
                    Held::RefPrefixes,
                    Held::TrainPrefixes,
                ] {
                    assert!(held.contains(&h), "{rel}: {h:?} is never retired: {r:?}");
                }
            }
        }
        use rollplex_plan::BufferRole;
        assert_eq!(
            Held::of(BufferRole::TrainPrefix { step: 12 }),
            Some(Held::TrainPrefixes)
        );
        assert_eq!(Held::of(BufferRole::KeptChunk), None);
        assert_eq!(Held::of(BufferRole::TrainMediaEmbeddings), None);
    }
}
