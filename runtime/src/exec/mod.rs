//! Executing plans: the RL loop around the plan's iteration schedule.
//!
//! `rollplex-run` decodes a plan, checks it against the machine, and hands it here. Per
//! iteration the loop draws the prompts, then [`walker::walk`]s the plan's tasks on the chosen
//! backend, then records metrics. The backends share the walker; `cpu` is [`cpu`] (one rank or
//! a tensor-parallel group, one code path), `cuda` is [`gpu`], `sim` is [`crate::sim`] (timing
//! only).
//!
//! Module map: `walker` (the order tasks run in), `cpu` (the CPU backend: one rank's models and
//! engine, the plan's ops on a rank, the loop over the ranks), `prompts`
//! (prompt sources: synthetic shapes for benchmarks, datasets for training), `checkpoint`
//! (`--save-every` / `--resume`: the loop's state on disk), `profile` (`--profile`: measured
//! task times as a cost-model profile). [`run_cpu_loop`] tells a
//! [`LoopObserver`] when each task starts and ends (host clock) and when each iteration is
//! done: traces, progress bars and metrics hang off it.
//!
//! Invariant: nothing here decides *what* to compute: the plan does. The loop only supplies
//! data, runs tasks when they are ready and records what came out.

pub mod book;
pub mod checkpoint;
pub mod cpu;
pub mod data;
pub mod defer;
pub mod gpu;
pub mod placement;
pub mod profile;
pub mod prompts;
pub mod residency;
pub mod rewards;
pub mod walker;

use std::time::{Duration, Instant};

use rollplex_plan::plan::GpuRole;
use rollplex_plan::plan::Task;
use rollplex_plan::spec::{JobSpec, LengthDist, Mode};
use rollplex_plan::Plan;

pub use cpu::{build_cpu_models, run_cpu_iterations, run_cpu_loop};
pub use data::{data_source, evaluate};
pub use rewards::{reward_fn, GroupKey, GroupReward, JobReward, RewardSpan};

use crate::model::{Grid, MediaKind, ModelError};
use crate::train::loss::LossMetrics;
use crate::train::TrainError;
use rollplex_kernels::cpu::{philox4x32_10, uniform_open01};

/// Errors of running a plan. `is_user_error` decides the exit code.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The plan does not fit this machine or backend (the message says what to do).
    #[error("{0}")]
    Machine(String),
    /// The plan is inconsistent (a compiler bug or a hand-edited plan).
    #[error("plan: {0}")]
    Plan(String),
    /// The backend cannot run what the plan asks yet.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// Bad input data (dataset, checkpoint, reward).
    #[error("data: {0}")]
    Data(String),
    #[error("reward: {0}")]
    Reward(String),
    /// A checkpoint to resume from is missing, corrupt or of another run (the message names
    /// the file).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error(transparent)]
    Model(ModelError),
    #[error(transparent)]
    Train(TrainError),
    #[error(transparent)]
    Kernel(#[from] rollplex_kernels::KernelError),
    /// The CUDA backend failed (a driver or kernel error, or a model the kernels cannot run).
    #[error("CUDA backend: {0}")]
    Gpu(crate::gpu::GpuError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// Tensor parallelism: a model that does not split, or a collective that failed.
    #[error(transparent)]
    Tp(#[from] crate::tp::TpError),
    /// SIGINT or SIGTERM stopped the run at an iteration boundary, after `done` iterations.
    #[error("stopped by a signal after {done} iterations; {}", match checkpoint {
        Some(p) => format!("checkpoint {} (continue with --resume)", p.display()),
        None => "no checkpoint was saved (this run saves none: see --save-every)".into(),
    })]
    Interrupted {
        done: u32,
        checkpoint: Option<std::path::PathBuf>,
    },
    /// The error that ended a tensor-parallel group, and the rank it happened on.
    #[error("tensor-parallel rank {rank}: {source}")]
    Rank { rank: usize, source: Box<ExecError> },
}

impl From<crate::tp::CommError> for ExecError {
    fn from(e: crate::tp::CommError) -> Self {
        ExecError::Tp(e.into())
    }
}

/// A model error; a failed collective inside the model is a tensor-parallel error (the rank it
/// names decides the exit status).
impl From<ModelError> for ExecError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Comm(c) => c.into(),
            other => ExecError::Model(other),
        }
    }
}

/// A trainer error; a failed collective inside the trainer is a tensor-parallel error.
impl From<TrainError> for ExecError {
    fn from(e: TrainError) -> Self {
        match e {
            TrainError::Model(ModelError::Comm(c)) => c.into(),
            other => ExecError::Train(other),
        }
    }
}

impl From<String> for ExecError {
    fn from(s: String) -> Self {
        ExecError::Plan(s)
    }
}

/// `rollplex-run`'s exit status after a SIGINT or SIGTERM stopped it (128 + SIGINT, as shells
/// report an interrupted command).
pub const EXIT_INTERRUPTED: u8 = 130;

impl ExecError {
    /// The exit status of `rollplex-run`: 1 when the user can fix it, 2 for a bug, and 3
    /// ([`crate::tp::launch::EXIT_PEER_FAILED`]) for a rank of a TP group that only stopped
    /// because another rank failed (the launcher then names the root cause).
    pub fn exit_code(&self) -> u8 {
        use crate::tp::{CommError, TpError};
        if let ExecError::Rank { rank, source } = self {
            let blames_another = match &**source {
                ExecError::Tp(TpError::Comm(
                    CommError::PeerFailed { rank: r, .. } | CommError::PeerExited { rank: r, .. },
                )) => r != rank,
                ExecError::Tp(TpError::Comm(CommError::Timeout { missing, .. })) => {
                    !missing.contains(rank)
                }
                _ => false,
            };
            if blames_another {
                return crate::tp::launch::EXIT_PEER_FAILED;
            }
        }
        if let ExecError::Interrupted { .. } = self {
            return EXIT_INTERRUPTED;
        }
        if self.is_user_error() {
            1
        } else {
            2
        }
    }

    /// Whether the user can fix it (exit 1) or it is a bug (exit 2).
    pub fn is_user_error(&self) -> bool {
        match self {
            ExecError::Plan(_) | ExecError::Kernel(_) => false,
            ExecError::Gpu(e) => matches!(e, crate::gpu::GpuError::Unsupported(_)),
            ExecError::Tp(e) => matches!(
                e,
                crate::tp::TpError::Config(_) | crate::tp::TpError::Model(_)
            ),
            ExecError::Rank { source, .. } => source.is_user_error(),
            _ => true,
        }
    }
}

/// One media item of a prompt, preprocessed as the model's processor does.
#[derive(Clone, Debug, PartialEq)]
pub struct MediaData {
    pub kind: MediaKind,
    /// `[t*h*w, C * temporal_patch * patch * patch]`.
    pub pixels: Vec<f32>,
    pub grid: Grid,
}

/// One prompt (one GRPO group) of an iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptData {
    /// Dataset id of the example.
    pub id: String,
    /// The user's prompt text (what a reward sees).
    pub text: String,
    /// Token ids, media placeholder runs included.
    pub ids: Vec<u32>,
    pub media: Vec<MediaData>,
    /// The reference answer the reward compares against.
    pub answer: String,
}

/// What one iteration measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IterationMetrics {
    /// Sum over micro-batches of their (mini-batch-normalised) loss metrics.
    pub loss: LossMetrics,
    pub grad_norm: f64,
    pub decode_steps: u32,
    /// Device seconds of the decode windows' steps (cuda), and the least bytes those steps
    /// moved ([`crate::gpu::decode::DeviceDecode::step_bytes`]): their ratio against the copy
    /// rate is decode's share of the bandwidth limit.
    pub decode_device_s: f64,
    pub decode_bytes: f64,
    /// Rows the decode steps ran, summed over steps (cuda), and the samples live in them: rows
    /// of stopped samples run until a compaction drops them.
    pub decode_rows: u64,
    pub decode_live_rows: u64,
    /// The decode windows one by one (cuda), in order.
    pub decode_windows: Vec<DecodeWindow>,
    pub micro_batches: u32,
    pub optimizer_steps: u32,
    pub tasks: u32,
    /// `ActorPrefix{Train}` tasks (on the CPU backend, folded into their micro-batch).
    pub train_prefix_tasks: u32,
    /// Peak memory during the iteration, bytes: on cuda the device memory pool's high-water
    /// mark (weights, optimizer state and every buffer the iteration allocated); on cpu the
    /// process's resident-set high-water mark. `None` where it could not be read.
    pub peak_mem_bytes: Option<u64>,
    /// The sampler's token log-probs against the trainer's (the old-log-prob pass, or the
    /// training forward when the plan has none); `None` when nothing was compared.
    pub rollout_agreement: Option<Agreement>,
    /// Dynamic sampling: the rolled-out groups whose rewards were not all equal.
    pub groups_with_variance: Option<u32>,
    /// Groups trained this iteration.
    pub groups_trained: u32,
}

/// One decode window's steps on the device (cuda): how long they took, the least bytes they
/// moved ([`crate::gpu::decode::DeviceDecode::step_bytes`]) and the longest the device sat idle
/// between two of them waiting for the host to launch the next.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeWindow {
    pub first_step: u32,
    pub steps: u32,
    /// From the first step's start to the last one's end, seconds.
    pub device_s: f64,
    pub bytes: f64,
    /// The longest device-side gap from one step's end to the next one's start, seconds.
    pub max_gap_s: f64,
}

impl DecodeWindow {
    /// The window's bytes per second as a share of `copy_rate` (bytes/s).
    pub fn copy_frac(&self, copy_rate: f64) -> f64 {
        self.bytes / self.device_s.max(1e-12) / copy_rate
    }
}

/// How far the sampler's log-probs of its tokens are from another forward's of the same tokens
/// (rollout/trainer agreement): absolute differences and the k3 estimate of
/// KL(sampler ‖ trainer) from the sampler's own tokens, `exp(d) - d - 1` with
/// `d = trainer - sampler` (clamped to ±20 before `exp`, as the loss clamps log-ratios).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Agreement {
    pub tokens: u64,
    pub abs_diff_sum: f64,
    pub abs_diff_max: f64,
    pub k3_sum: f64,
}

impl Agreement {
    /// The agreement of `sampler` and `trainer`, token by token (the shorter length counts).
    pub fn of(sampler: &[f32], trainer: &[f32]) -> Self {
        let mut a = Agreement::default();
        for (&s, &t) in sampler.iter().zip(trainer) {
            let d = t as f64 - s as f64;
            let dc = d.clamp(
                -crate::train::loss::LOG_RATIO_CLAMP,
                crate::train::loss::LOG_RATIO_CLAMP,
            );
            a.tokens += 1;
            a.abs_diff_sum += d.abs();
            a.abs_diff_max = a.abs_diff_max.max(d.abs());
            a.k3_sum += dc.exp() - dc - 1.0;
        }
        a
    }

    /// Both together.
    pub fn merge(self, o: &Agreement) -> Self {
        Agreement {
            tokens: self.tokens + o.tokens,
            abs_diff_sum: self.abs_diff_sum + o.abs_diff_sum,
            abs_diff_max: self.abs_diff_max.max(o.abs_diff_max),
            k3_sum: self.k3_sum + o.k3_sum,
        }
    }

    /// Mean absolute difference per token (0 without tokens).
    pub fn abs_diff_mean(&self) -> f64 {
        self.abs_diff_sum / self.tokens.max(1) as f64
    }

    /// Mean k3 per token (0 without tokens).
    pub fn k3_mean(&self) -> f64 {
        self.k3_sum / self.tokens.max(1) as f64
    }
}

/// Everything an iteration produced: what the bitwise invariant compares.
#[derive(Clone, Debug, PartialEq)]
pub struct IterationResult {
    /// Sampled tokens per sample (`group * G + member`).
    pub tokens: Vec<Vec<u32>>,
    /// Log-probs of the sampled tokens as the rollout computed them.
    pub rollout_logp: Vec<Vec<f32>>,
    pub ref_logp: Vec<Option<Vec<f32>>>,
    /// Old log-probs: the old-log-prob pass's (every scored sample) or, in a plan without one,
    /// the training forward's (the trained samples; the loss's ratio is exactly 1 then).
    pub old_logp: Vec<Option<Vec<f32>>>,
    pub rewards: Vec<f32>,
    pub advantages: Vec<f32>,
    /// Groups in completion-slot order.
    pub slot_groups: Vec<u32>,
    /// The groups trained, in training-slot order (dynamic sampling: the picked ones).
    pub trained_groups: Vec<u32>,
    pub group_size: u32,
    pub metrics: IterationMetrics,
}

impl IterationResult {
    pub fn reward_mean(&self) -> f64 {
        mean(self.rewards.iter().map(|&r| r as f64))
    }
    pub fn reward_std(&self) -> f64 {
        let m = self.reward_mean();
        mean(self.rewards.iter().map(|&r| (r as f64 - m).powi(2))).sqrt()
    }
    pub fn response_len_mean(&self) -> f64 {
        mean(self.tokens.iter().map(|t| t.len() as f64))
    }
    pub fn response_tokens(&self) -> usize {
        self.tokens.iter().map(Vec::len).sum()
    }
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// The response length a benchmark forces on sample `sample` of `iteration` (when the job sets
/// `forced_lengths`): drawn from the declared distribution with a Philox key of its own, capped
/// at max_new_tokens, at least 1.
pub fn forced_length(spec: &JobSpec, iteration: u32, sample: u32) -> u32 {
    let r = philox4x32_10(
        [iteration, sample, 0, 0x4C45_4E47],
        [spec.seed as u32, (spec.seed >> 32) as u32],
    );
    let (u1, u2) = (uniform_open01(r[0], r[1]), uniform_open01(r[2], r[3]));
    let max = spec.rollout.max_new_tokens.max(1);
    let len = match spec.rollout.response_len {
        LengthDist::Fixed { tokens } => tokens as f64,
        LengthDist::Uniform { min, max: hi } => {
            min as f64 + (u1 * ((hi.max(min) - min + 1) as f64)).floor()
        }
        LengthDist::LogNormal { median, sigma } => {
            // Box-Muller: a standard normal from two uniforms
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            median * (sigma * z).exp()
        }
    };
    (len.round() as u32).clamp(1, max)
}

/// Checks that a plan can run on the CPU backend and returns its tensor-parallel degree: 1
/// (also a disaggregated plan of one rollout and one training GPU, whose two programs one rank
/// runs in turn) or the `N` of rollout TP = training TP = GPU count = `N`; [`run_cpu_loop`]
/// runs either.
pub fn cpu_plan_degree(plan: &Plan) -> Result<usize, ExecError> {
    let (rt, tt, n) = (
        plan.parallel.rollout_tp,
        plan.parallel.train_tp,
        plan.target.count,
    );
    if rt != tt {
        return Err(ExecError::Unsupported(format!(
            "the CPU backend runs tensor parallelism with one shard per rank for rollout and training alike; \
             this plan has rollout TP {rt} and training TP {tt} (reshards between them are not implemented): \
             compile it with equal `rollout {{ tp }}` and `train {{ tp }}`"
        )));
    }
    if plan.mode == Mode::Disaggregated {
        check_cpu_disaggregated(plan)?;
    } else if n != tt {
        return Err(ExecError::Machine(format!(
            "the CPU backend runs one TP group: this plan targets {n} x {} with TP {tt}, i.e. {} replicas \
             (data parallelism is not implemented on the CPU backend): set `gpu {{ count = {tt} }}`, \
             or use --backend sim",
            plan.target.gpu,
            n / tt.max(1)
        )));
    } else if plan.gpus.len() != 1 {
        return Err(ExecError::Machine(format!(
            "the CPU backend runs one GPU program; this {:?} plan has {}",
            plan.mode,
            plan.gpus.len()
        )));
    }
    let params = plan.spec.actor.param_count().total();
    const CPU_PARAM_LIMIT: u64 = 200_000_000;
    if params > CPU_PARAM_LIMIT {
        return Err(ExecError::Machine(format!(
            "the actor has {:.2} B parameters; the CPU backend is for small models (<= {} M): run it on a GPU or with --backend sim",
            params as f64 / 1e9,
            CPU_PARAM_LIMIT / 1_000_000
        )));
    }
    Ok(tt as usize)
}

/// A disaggregated plan the CPU backend runs: one rollout GPU program and one training GPU
/// program, TP 1 each (a larger TP on either side would need ranks as threads on both sides and
/// reshards between the two layouts).
fn check_cpu_disaggregated(plan: &Plan) -> Result<(), ExecError> {
    let (rt, tt) = (plan.parallel.rollout_tp, plan.parallel.train_tp);
    let roles: Vec<GpuRole> = plan.gpus.iter().map(|g| g.role).collect();
    if rt != 1 || tt != 1 || roles != [GpuRole::Rollout, GpuRole::Train] {
        return Err(ExecError::Unsupported(format!(
            "the CPU backend runs a disaggregated plan with one rollout GPU and one training GPU \
             (`rollout {{ tp = 1 }}`, `train {{ tp = 1 }}`, `gpu {{ count = 2 }}`); this one has rollout \
             TP {rt}, training TP {tt} and GPU programs {roles:?}: run it with --backend sim"
        )));
    }
    Ok(())
}

/// Whether the job's rollout and training run on separate GPUs (each holding its own copy of
/// the actor's weights).
pub fn disaggregated(spec: &JobSpec) -> bool {
    spec.schedule.mode == Mode::Disaggregated
}

/// The job's initial actor on the host: random weights or its checkpoint.
pub fn host_actor(spec: &JobSpec) -> Result<crate::model::Qwen25VL, ExecError> {
    use crate::model::Qwen25VL;
    use rollplex_plan::spec::WeightsSource;
    Ok(match &spec.actor.weights {
        WeightsSource::Random { seed } => Qwen25VL::random(spec.actor.clone(), *seed)?,
        WeightsSource::Checkpoint { path } => Qwen25VL::load(std::path::Path::new(path))?,
    })
}

/// The models of a backend after an iteration, as the observer sees them.
#[derive(Clone, Copy)]
pub enum LoopModels<'a> {
    /// The CPU backend (rank 0 observes): the whole model's training state gathered from the
    /// ranks after an iteration whose state is to be checkpointed (`CpuModels::set_save_every`),
    /// `None` after the others.
    Cpu(Option<&'a cpu::TrainState>),
    Gpu(&'a gpu::GpuModels),
}

/// What the loop tells its caller while it runs (traces, progress bars, metrics). Every method
/// but [`LoopObserver::iteration_done`] has an empty default.
pub trait LoopObserver {
    /// Iteration `iteration` starts; its GPU program runs `tasks` tasks.
    fn iteration_started(&mut self, _iteration: u32, _tasks: usize) {}
    /// `task` of `iteration` is about to run.
    fn task_started(&mut self, _iteration: u32, _task: &Task) {}
    /// `task` of `iteration` ran from `start` to `end` (cpu: host clock around the task; cuda:
    /// the device's events around its launches, told after the iteration, mapped onto the host
    /// clock from the iteration's start).
    fn task_done(&mut self, _iteration: u32, _task: &Task, _start: Instant, _end: Instant) {}
    /// The decode window task `task` of `iteration` ran its steps between consecutive `marks`
    /// (cuda: a device event before each step and one after the last, told after the
    /// iteration's `task_done`s on the same clock; the cpu backend does not mark steps).
    fn decode_steps(&mut self, _iteration: u32, _task: &Task, _marks: &[Instant]) {}
    /// A group's reward was computed on a host thread from `span.start` to `span.end` (told
    /// after the iteration, before [`LoopObserver::iteration_done`]; rewards computed at their
    /// reward task are that task's time).
    fn reward_span(&mut self, _span: &rewards::RewardSpan) {}
    /// Whether the run is to stop after the running iteration (a signal): its state is then
    /// handed to [`LoopObserver::iteration_done`] to save, as at a `--save-every` boundary.
    fn stop_requested(&self) -> bool {
        false
    }
    /// `iteration` is done: its results, the models after it (to checkpoint), its start and its
    /// wall time. An error stops the loop.
    fn iteration_done(
        &mut self,
        iteration: u32,
        result: &IterationResult,
        models: LoopModels<'_>,
        start: Instant,
        wall: Duration,
    ) -> Result<(), ExecError>;
}

/// An observer that only hands each iteration's result and wall time to a closure.
pub struct EachIteration<F>(pub F);

impl<F: FnMut(u32, &IterationResult, Duration) -> Result<(), ExecError>> LoopObserver
    for EachIteration<F>
{
    fn iteration_done(
        &mut self,
        it: u32,
        r: &IterationResult,
        _: LoopModels<'_>,
        _: Instant,
        wall: Duration,
    ) -> Result<(), ExecError> {
        (self.0)(it, r, wall)
    }
}

/// Runs a backend's tasks and tells the observer when each starts and ends.
struct Timed<'a, R> {
    inner: &'a mut R,
    observer: &'a mut dyn LoopObserver,
    iteration: u32,
}

impl<R: walker::TaskRunner> walker::TaskRunner for Timed<'_, R> {
    type Error = R::Error;
    fn run(&mut self, task: &Task) -> Result<(), R::Error> {
        self.observer.task_started(self.iteration, task);
        let start = Instant::now();
        self.inner.run(task)?;
        let end = Instant::now();
        self.observer.task_done(self.iteration, task, start, end);
        Ok(())
    }
    fn slots_bound(&self) -> u32 {
        self.inner.slots_bound()
    }
    fn rank(&self, task: &Task) -> u8 {
        self.inner.rank(task)
    }
}

/// Starts a new resident-set high-water mark of this process (Linux: `/proc/self/clear_refs`;
/// elsewhere, or where refused, the mark keeps counting from the process start).
fn reset_rss_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// This process's resident-set high-water mark, bytes (Linux `VmHWM`), if readable.
fn rss_peak() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::Agreement;

    #[test]
    fn agreement_by_hand() {
        // sampler [-1, -2], trainer [-1.1, -1.5]: d = [-0.1, 0.5]; |d| mean 0.3, max 0.5;
        // k3 = (e^-0.1 + 0.1 - 1 + e^0.5 - 0.5 - 1) / 2 = (0.0048374 + 0.1487213) / 2.
        let a = Agreement::of(&[-1.0, -2.0], &[-1.1, -1.5]);
        assert_eq!(a.tokens, 2);
        let d0 = -1.1f32 as f64 + 1.0;
        assert!((a.abs_diff_mean() - (d0.abs() + 0.5) / 2.0).abs() < 1e-12);
        assert!((a.abs_diff_mean() - 0.3).abs() < 1e-7);
        assert_eq!(a.abs_diff_max, 0.5);
        let k3 = (d0.exp() - d0 - 1.0 + 0.5f64.exp() - 0.5 - 1.0) / 2.0;
        assert!((a.k3_mean() - k3).abs() < 1e-12);
        assert!((a.k3_mean() - 0.0767793).abs() < 1e-6);
        // merging adds the sums and keeps the larger maximum; nothing compared gives zeros
        let b = a.merge(&Agreement::of(&[0.0], &[-0.75]));
        assert_eq!((b.tokens, b.abs_diff_max), (3, 0.75));
        assert_eq!(Agreement::default().abs_diff_mean(), 0.0);
    }
}
