//! What `rollplex-run` does, behind its flag parsing: load and check the plan, pick the backend,
//! run it, write metrics and traces. IO lives here and in the binary, not in the engines.

use std::io::Write;
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use rollplex_plan::plan::Task;
use rollplex_plan::spec::DatasetSpec;
use rollplex_plan::{Phase, Plan};

use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::{self, ExecError, IterationResult};
use crate::metrics::{LoopProgress, MetricsLog};
use crate::tp::launch;
use crate::trace::PlanTrace;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Cuda,
    Cpu,
    Sim,
}

/// The run's options (see `rollplex-run --help`).
#[derive(Clone, Debug)]
pub struct RunArgs {
    pub plan: PathBuf,
    pub backend: BackendChoice,
    pub iterations: u32,
    pub out: PathBuf,
    pub trace: Option<PathBuf>,
    pub svg: Option<PathBuf>,
    /// Cost-model profile the simulator replays with (`--cost-profile`).
    pub cost_profile: Option<PathBuf>,
    /// Where to write the measured profile (`--profile`; cpu, cuda).
    pub profile: Option<PathBuf>,
    pub save_every: u32,
    /// Checkpoints to keep (the newest; 0: all).
    pub keep_checkpoints: usize,
    pub resume: Option<PathBuf>,
    pub eval: u32,
    pub quiet: bool,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ExecError + '_ {
    move |source| ExecError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads, decodes and verifies a plan file.
pub fn load_plan(path: &Path) -> Result<Plan, ExecError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let (_, plan) = rollplex_plan::decode(&bytes)
        .map_err(|e| ExecError::Machine(format!("{}: {e}", path.display())))?;
    rollplex_plan::validate(&plan).map_err(|v| {
        ExecError::Machine(format!(
            "{}: the plan fails verification (recompile it with rollplexc):\n{v}",
            path.display()
        ))
    })?;
    Ok(plan)
}

/// Whether a CUDA driver is present on this machine (without initialising CUDA).
pub fn cuda_present() -> bool {
    ["/dev/nvidia0", "/dev/nvidiactl"]
        .iter()
        .any(|p| Path::new(p).exists())
}

pub fn run(args: &RunArgs) -> Result<(), ExecError> {
    let plan = load_plan(&args.plan)?;
    let backend = match args.backend {
        BackendChoice::Auto if plan.target.gpu.eq_ignore_ascii_case("cpu") => BackendChoice::Cpu,
        BackendChoice::Auto if cuda_present() => BackendChoice::Cuda,
        BackendChoice::Auto => {
            return Err(ExecError::Machine(format!(
                "this plan targets {} x {} and no GPU is present here: run it with --backend sim for its predicted \
                 timeline, or compile a pipeline for the CPU backend (`gpu {{ preset = cpu }}`, see examples/tiny.rpx)",
                plan.target.count, plan.target.gpu
            )))
        }
        b => b,
    };
    if backend == BackendChoice::Sim && (args.save_every > 0 || args.resume.is_some()) {
        return Err(ExecError::Machine(
            "--save-every and --resume apply to training backends (cpu, cuda); the simulator keeps no state"
                .into(),
        ));
    }
    if backend == BackendChoice::Sim && args.profile.is_some() {
        return Err(ExecError::Machine(
            "--profile writes the times a run measures; the simulator measures nothing \
             (--cost-profile gives it a profile to replay with)"
                .into(),
        ));
    }
    match backend {
        BackendChoice::Sim => run_sim(&plan, args),
        BackendChoice::Cpu => run_cpu(&plan, args),
        BackendChoice::Cuda => run_cuda(&plan, args),
        BackendChoice::Auto => unreachable!("resolved above"),
    }
}

fn create_file(path: &Path) -> Result<std::io::BufWriter<std::fs::File>, ExecError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    Ok(std::io::BufWriter::new(
        std::fs::File::create(path).map_err(io_err(path))?,
    ))
}

/// Writes `path` atomically: to a temporary file beside it, then renamed.
pub fn write_atomic(
    path: &Path,
    f: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), ExecError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut w = create_file(&tmp)?;
        f(&mut w).map_err(io_err(&tmp))?;
        w.flush().map_err(io_err(&tmp))?;
        Ok::<_, ExecError>(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

fn run_sim(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    let gpu = &plan.spec.cluster.gpu;
    let profile = match &args.cost_profile {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(io_err(p))?;
            Some(
                rollplex_cost::Profile::from_yaml(&text)
                    .map_err(|e| ExecError::Data(format!("{}: {e}", p.display())))?,
            )
        }
        None if gpu.name.eq_ignore_ascii_case("h200") => Some(
            rollplex_cost::h200::shipped()
                .map_err(|e| ExecError::Plan(format!("built-in H200 profile: {e}")))?,
        ),
        None => None,
    };
    let cost = rollplex_cost::CostModel::for_cluster(&plan.spec.cluster, profile.as_ref());
    let report = crate::sim::simulate(plan, &cost).map_err(|e| ExecError::Plan(e.to_string()))?;
    let mut out = std::io::stdout().lock();
    report
        .print_summary(&mut out)
        .map_err(io_err(Path::new("stdout")))?;
    if let Some(t) = &args.trace {
        write_atomic(t, |w| report.write_chrome_trace(&mut WriteRef(w)))?;
        println!("trace: {}", t.display());
    }
    if let Some(s) = &args.svg {
        write_atomic(s, |w| report.write_svg(&mut WriteRef(w)))?;
        println!("timeline: {}", s.display());
    }
    Ok(())
}

/// Adapts `&mut dyn Write` to the `impl Write` the report writers take.
struct WriteRef<'a>(&'a mut dyn Write);
impl Write for WriteRef<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// A training run's observer (cpu, cuda): metrics file and table, trace, progress bars,
/// checkpoints.
struct LoopRun<'a> {
    args: &'a RunArgs,
    metrics: MetricsLog,
    progress: LoopProgress,
    trace: Option<PlanTrace>,
    /// What checkpoints are stamped with (computed only when saving or resuming).
    identity: Option<RunIdentity>,
    /// Seconds per phase (rollout, scoring, training, sync) of the running iteration.
    phase_s: [f64; 4],
    /// `--profile`: every task's measured time.
    profile: Option<exec::profile::ProfileRecorder>,
    /// cuda with `--save-every`: the host copy of the actor that checkpoints are written
    /// through (`checkpoint::save_gpu`).
    host: Option<crate::model::Qwen25VL>,
}

impl exec::LoopObserver for LoopRun<'_> {
    fn iteration_started(&mut self, it: u32, tasks: usize) {
        self.phase_s = [0.0; 4];
        if let Some(p) = &mut self.profile {
            p.begin_iteration(Instant::now());
        }
        self.progress.start_iteration(it, tasks);
    }

    fn task_started(&mut self, _: u32, task: &Task) {
        self.progress.task_started(&task.name);
    }

    fn task_done(&mut self, it: u32, task: &Task, start: Instant, end: Instant) {
        if let Some(phase) = task.op.phase(task.window.is_some()) {
            let i = Phase::ALL.iter().position(|p| *p == phase).unwrap_or(0);
            self.phase_s[i] += end.duration_since(start).as_secs_f64();
        }
        if let Some(t) = &mut self.trace {
            t.task(it, task, start, end);
        }
        if let Some(p) = &mut self.profile {
            p.record_instants(task, start, end);
        }
        self.progress.task_done();
    }

    fn decode_steps(&mut self, _: u32, task: &Task, marks: &[Instant]) {
        if let Some(p) = &mut self.profile {
            p.record_step_instants(task, marks);
        }
    }

    fn iteration_done(
        &mut self,
        it: u32,
        r: &IterationResult,
        models: exec::LoopModels<'_>,
        start: Instant,
        dt: Duration,
    ) -> Result<(), ExecError> {
        if let Some(t) = &mut self.trace {
            t.iteration(it, start, start + dt);
        }
        if let Some(p) = &mut self.profile {
            p.end_iteration(it, dt);
        }
        let line = metrics_json(it, r, dt, &self.phase_s);
        self.metrics
            .log_line(&line)
            .map_err(|e| ExecError::Data(e.to_string()))?;
        self.progress.iteration_done();
        if !self.args.quiet {
            self.progress.println(&table_row(it, r, dt));
        }
        let done = it + 1;
        let every = self.args.save_every;
        if let Some(identity) = self
            .identity
            .as_ref()
            .filter(|_| every > 0 && done.is_multiple_of(every))
        {
            let root = self.args.out.join(checkpoint::CHECKPOINTS_DIR);
            let keep = self.args.keep_checkpoints;
            let path = match models {
                exec::LoopModels::Cpu(m) => checkpoint::save(&root, done, m, identity, keep)?,
                exec::LoopModels::Gpu(m) => {
                    let host = self.host.as_mut().ok_or_else(|| {
                        ExecError::Checkpoint("no host copy of the actor to save through".into())
                    })?;
                    checkpoint::save_gpu(&root, done, m, host, identity, keep)?
                }
                exec::LoopModels::CpuTpState(s) => {
                    checkpoint::save_tp(&root, done, s, identity, keep)?
                }
                exec::LoopModels::CpuTp(_) => {
                    return Err(ExecError::Plan(format!(
                        "iteration {done} of a tensor-parallel run is to be checkpointed but its \
                         ranks did not gather their state (TpCheckpoints not set)"
                    )))
                }
            };
            if !self.args.quiet {
                self.progress
                    .println(&format!("checkpoint: {}", path.display()));
            }
        }
        Ok(())
    }
}

/// What a resume from a checkpoint with `first` iterations done says when `--iterations`
/// (`all`) asks for no more.
fn nothing_to_run(first: u32, all: u32) {
    println!(
        "nothing to run: the checkpoint has {first} iterations done and --iterations asks for {all} in all"
    );
}

fn run_cpu(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    let degree = exec::cpu_plan_degree(plan)?;
    if degree > 1 {
        return run_cpu_tp(plan, args, degree);
    }
    let spec = &plan.spec;
    // A checkpoint is loaded and checked before anything of the run is written.
    let fresh = exec::build_cpu_models(spec)?;
    // Hashing the plan and the reference costs a pass over the weights: only when needed.
    let identity = (args.save_every > 0 || args.resume.is_some())
        .then(|| RunIdentity::of(plan, &fresh))
        .transpose()?;
    let (mut models, first) = match (&args.resume, &identity) {
        (Some(p), Some(identity)) => {
            let dir = checkpoint::resolve(p)?;
            let r = checkpoint::load(&dir, identity, fresh)?;
            if !args.quiet {
                println!(
                    "resuming from {} after {} iterations",
                    r.dir.display(),
                    r.completed
                );
            }
            (r.models, r.completed)
        }
        _ => (fresh, 0),
    };
    if first >= args.iterations {
        nothing_to_run(first, args.iterations);
        return Ok(());
    }
    let profile = args
        .profile
        .as_ref()
        .map(|_| {
            use exec::profile::{Execution, ProfileRecorder};
            ProfileRecorder::for_run(plan, "cpu", Execution::OneAtATime, args.iterations - first)
        })
        .transpose()?;
    let (mut source, mut reward, metrics) = open_run(plan, args, first, "cpu")?;
    let eval = |models: &exec::cpu::CpuModels, when: &str| -> Result<(), ExecError> {
        let acc = exec::evaluate(spec, models.trainer.model(), args.eval)?;
        report_eval(args, acc, when)
    };
    // A resumed run's "before" is the original run's.
    if first == 0 {
        eval(&models, "before")?;
    }
    if !args.quiet {
        println!("{}", table_header());
    }
    let mut run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(first, args.iterations, args.quiet),
        trace: args.trace.as_ref().map(|_| PlanTrace::new(plan, "cpu")),
        identity,
        phase_s: [0.0; 4],
        profile,
        host: None,
    };
    let result = exec::run_cpu_loop(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        first..args.iterations,
        &mut run,
    );
    run.progress.finish();
    if let (Some(path), Some(t)) = (&args.trace, &run.trace) {
        // Written even when the loop failed: the trace shows how far it got.
        t.write(path).map_err(|e| ExecError::Data(e.to_string()))?;
        if !args.quiet {
            println!(
                "trace: {} ({} tasks measured)",
                path.display(),
                t.events().len()
            );
        }
    }
    result?;
    run.write_profile(plan)?;
    eval(&models, "after")
}

/// A CPU plan with rollout TP = training TP = GPU count = `degree` > 1: one thread per rank
/// (`exec::cpu_tp`), or, when `RANK` is set (children of `--tp-processes`, torchrun, slurm),
/// this process as that rank over TCP. Rank 0 alone writes metrics and the trace. The held-out
/// evaluations run on one rank (rank 0), before on the initial actor and after on the ranks'
/// weights gathered into Hugging Face layout.
fn run_cpu_tp(plan: &Plan, args: &RunArgs, degree: usize) -> Result<(), ExecError> {
    if args.profile.is_some() {
        return Err(ExecError::Unsupported(format!(
            "--profile: a tensor-parallel CPU run's {degree} ranks share this machine's cores, \
             so their task times would calibrate nothing; profile a plan for one rank \
             (`gpu {{ count = 1 }}` without `tp`)"
        )));
    }
    let env = launch::RankEnv::from_env().map_err(|e| ExecError::Machine(e.to_string()))?;
    let actor = exec::host_actor(&plan.spec)?;
    let rank0 = env.as_ref().is_none_or(|e| e.rank == 0);
    let start = TpStart::new(plan, args, &actor, rank0)?;
    if start.first >= args.iterations {
        if rank0 {
            nothing_to_run(start.first, args.iterations);
        }
        return Ok(());
    }
    match env {
        None => run_cpu_tp_threads(plan, args, degree, actor, start),
        Some(env) => run_cpu_tp_process(plan, args, degree, env, actor, start),
    }
}

/// Where a TP run starts: its checkpoint identity (when saving or resuming), the iterations a
/// resumed checkpoint has done and its state (every rank takes its part of it), and when the
/// ranks gather their state to save.
struct TpStart {
    identity: Option<RunIdentity>,
    first: u32,
    resumed: Option<exec::cpu_tp::TpTrainState>,
    checkpoints: Option<exec::cpu_tp::TpCheckpoints>,
}

impl TpStart {
    /// Loads and checks `--resume`'s checkpoint (each rank process reads it itself: the path
    /// must reach it from every rank) before anything of the run is written; `rank0`: this
    /// process speaks for the run.
    fn new(
        plan: &Plan,
        args: &RunArgs,
        actor: &crate::model::Qwen25VL,
        rank0: bool,
    ) -> Result<Self, ExecError> {
        let spec = &plan.spec;
        let identity = (args.save_every > 0 || args.resume.is_some())
            .then(|| RunIdentity::with_reference(plan, spec.reference.enabled.then_some(actor)))
            .transpose()?;
        let (first, resumed) = match (&args.resume, &identity) {
            (Some(p), Some(identity)) => {
                let dir = checkpoint::resolve(p)?;
                let cfg = exec::cpu::train_config(spec)?;
                let (completed, state) =
                    checkpoint::load_tp(&dir, identity, actor.config.clone(), |n| {
                        cfg.trainable(n)
                    })?;
                if !args.quiet && rank0 {
                    println!(
                        "resuming from {} after {completed} iterations",
                        dir.display()
                    );
                }
                (completed, Some(state))
            }
            _ => (0, None),
        };
        let checkpoints = (args.save_every > 0).then(|| exec::cpu_tp::TpCheckpoints {
            every: args.save_every,
            initial: std::sync::Arc::new(actor.clone()),
        });
        Ok(TpStart {
            identity,
            first,
            resumed,
            checkpoints,
        })
    }

    /// A rank's models as this run starts them: the checkpoint's part restored, saves set.
    fn prepare(&self, models: &mut exec::cpu_tp::TpRankModels) -> Result<(), ExecError> {
        if let Some(state) = &self.resumed {
            exec::cpu_tp::restore_rank(models, state)?;
        }
        models.set_checkpoints(self.checkpoints.clone());
        Ok(())
    }
}

/// Rank 0's observer of a TP run.
fn tp_observer<'a>(
    plan: &Plan,
    args: &'a RunArgs,
    degree: usize,
    how: &str,
    start: &TpStart,
) -> Result<(LoopRun<'a>, RunInputsNoMetrics), ExecError> {
    let (source, reward, metrics) = open_run(
        plan,
        args,
        start.first,
        &format!("cpu (TP {degree}, a {how} per rank)"),
    )?;
    let run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(start.first, args.iterations, args.quiet),
        trace: args
            .trace
            .as_ref()
            .map(|_| PlanTrace::new(plan, &format!("cpu, rank 0 of TP {degree}"))),
        identity: start.identity.clone(),
        phase_s: [0.0; 4],
        profile: None,
        host: None,
    };
    Ok((run, (source, reward)))
}

type RunInputsNoMetrics = (
    Box<dyn exec::prompts::PromptSource>,
    Box<exec::cpu_tp::SendRewardFn<'static>>,
);

fn tp_eval(
    plan: &Plan,
    args: &RunArgs,
    model: &crate::model::Qwen25VL,
    when: &str,
) -> Result<(), ExecError> {
    let acc = exec::evaluate(&plan.spec, model, args.eval)?;
    report_eval(args, acc, when)
}

fn run_cpu_tp_threads(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    actor: crate::model::Qwen25VL,
    start: TpStart,
) -> Result<(), ExecError> {
    let mut models = exec::cpu_tp::build_tp_models_from(&plan.spec, &actor, degree)?;
    for m in &mut models {
        start.prepare(m)?;
    }
    let (mut run, (mut source, mut reward)) = tp_observer(plan, args, degree, "thread", &start)?;
    // A resumed run's "before" is the original run's.
    if start.first == 0 {
        tp_eval(plan, args, &actor, "before")?;
    }
    drop(actor);
    if !args.quiet {
        println!("{}", table_header());
    }
    let result = exec::cpu_tp::run_cpu_tp_loop(
        plan,
        models,
        source.as_mut(),
        reward.as_mut(),
        start.first..args.iterations,
        &mut run,
    );
    run.finish()?;
    let ranks = result?;
    if args.eval > 0 {
        tp_eval(plan, args, &exec::cpu_tp::unshard_actor(&ranks)?, "after")?;
    }
    Ok(())
}

/// This process as rank `env.rank` of the plan's TP group, over TCP.
fn run_cpu_tp_process(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    env: launch::RankEnv,
    actor: crate::model::Qwen25VL,
    start: TpStart,
) -> Result<(), ExecError> {
    use crate::tp::Communicator;
    launch::watch_launcher(env.rank);
    let rank = env.rank;
    if env.world != degree {
        return Err(ExecError::Machine(format!(
            "WORLD_SIZE={} but the plan runs TP {degree}: start one rank per GPU of the plan",
            env.world
        )));
    }
    let job = format!("plan-{}", checkpoint::plan_hash(plan)?);
    let comm = launch::join(&env, &job, Vec::new(), crate::tp::TcpOptions::default())
        .map_err(|e| ExecError::Machine(format!("rank {rank}: {e}")))?;
    let result = (|| -> Result<(), ExecError> {
        let mut models = exec::cpu_tp::build_tp_rank(&plan.spec, &actor, degree, rank)?;
        start.prepare(&mut models)?;
        let iterations = start.first..args.iterations;
        if rank == 0 {
            let (mut run, (mut source, mut reward)) =
                tp_observer(plan, args, degree, "process", &start)?;
            if start.first == 0 {
                tp_eval(plan, args, &actor, "before")?;
            }
            if !args.quiet {
                println!("{}", table_header());
            }
            let root = exec::cpu_tp::RootSide {
                source: source.as_mut(),
                reward: reward.as_mut(),
                observer: &mut run,
            };
            let r = exec::cpu_tp::run_tp_rank(plan, &comm, &mut models, Some(root), iterations);
            run.finish()?;
            r?;
        } else {
            exec::cpu_tp::run_tp_rank(plan, &comm, &mut models, None, iterations)?;
        }
        if args.eval > 0 {
            if let Some(full) = exec::cpu_tp::gather_actor(&comm, &models, &actor)? {
                tp_eval(plan, args, &full, "after")?;
            }
        }
        Ok(())
    })();
    if let Err(e) = &result {
        comm.abort(&e.to_string());
    }
    result.map_err(|e| ExecError::Rank {
        rank,
        source: Box::new(e),
    })
}

/// `rollplex-run PLAN --tp-processes` without `RANK`: starts one process per rank of the
/// plan's TP group (this executable, these arguments) and waits for them (`tp::launch`).
pub fn launch_tp_ranks(plan_path: &Path) -> std::process::ExitCode {
    use std::process::ExitCode;
    let degree = match load_plan(plan_path).and_then(|p| exec::cpu_plan_degree(&p)) {
        Ok(d) if d > 1 => d,
        Ok(_) => {
            eprintln!(
                "error: --tp-processes runs a tensor-parallel plan's ranks as processes; this plan runs TP 1 (drop the flag)"
            );
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(e.exit_code());
        }
    };
    match launch::Launch::this_process(degree).and_then(|l| launch::launch(&l)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

impl LoopRun<'_> {
    /// Closes the bars and writes the trace (also when the loop failed: the trace shows how far
    /// it got).
    fn finish(&self) -> Result<(), ExecError> {
        self.progress.finish();
        if let (Some(path), Some(t)) = (&self.args.trace, &self.trace) {
            t.write(path).map_err(|e| ExecError::Data(e.to_string()))?;
            if !self.args.quiet {
                println!(
                    "trace: {} ({} tasks measured)",
                    path.display(),
                    t.events().len()
                );
            }
        }
        Ok(())
    }

    /// `--profile`: fits the measured task times and writes the profile.
    fn write_profile(&self, plan: &Plan) -> Result<(), ExecError> {
        if let (Some(path), Some(p)) = (&self.args.profile, &self.profile) {
            let measured = p.write(path)?;
            if !self.args.quiet {
                println!(
                    "profile: {} ({} points; measured iteration median {:.6} s, predicted {:.6} s)",
                    path.display(),
                    measured.profile.points.len(),
                    measured.iteration_median_s,
                    plan.predicted.iteration_s
                );
            }
        }
        Ok(())
    }
}

type RunInputs = (
    Box<dyn exec::prompts::PromptSource>,
    Box<exec::cpu_tp::SendRewardFn<'static>>,
    MetricsLog,
);

/// The prompt source, the reward and the metrics log of a training run (cpu, cuda), and its
/// first console line.
fn open_run(
    plan: &Plan,
    args: &RunArgs,
    first: u32,
    backend: &str,
) -> Result<RunInputs, ExecError> {
    let spec = &plan.spec;
    let source: Box<dyn exec::prompts::PromptSource> = match &spec.rollout.dataset {
        DatasetSpec::Synthetic => Box::new(exec::prompts::SyntheticPrompts::new(spec)),
        other => crate::exec::data_source(spec, other)?,
    };
    let reward = crate::exec::reward_fn(spec)?;
    std::fs::create_dir_all(&args.out).map_err(io_err(&args.out))?;
    let metrics_path = args.out.join("metrics.jsonl");
    let metrics = if args.resume.is_some() {
        MetricsLog::resume(&metrics_path, first as u64)
    } else {
        MetricsLog::create(&metrics_path)
    }
    .map_err(|e| ExecError::Data(e.to_string()))?
    .with_console(None);
    if !args.quiet {
        println!(
            "rollplex-run: {} ({:?}, {} groups x {}, {backend} backend), iterations {first}..{}; metrics -> {}",
            spec.name,
            plan.mode,
            plan.parallel.prompts_per_rollout_replica,
            spec.rollout.group_size,
            args.iterations,
            metrics_path.display()
        );
    }
    Ok((source, reward, metrics))
}

/// Prints and writes a held-out evaluation (`None`: the data has no test split).
fn report_eval(args: &RunArgs, acc: Option<f64>, when: &str) -> Result<(), ExecError> {
    if let Some(acc) = acc {
        println!(
            "eval ({when}): mean reward of greedy answers to {} held-out prompts = {acc:.3}",
            args.eval
        );
        let line =
            serde_json::json!({"eval": when, "prompts": args.eval, "reward_mean": acc}).to_string();
        std::fs::write(args.out.join(format!("eval-{when}.json")), line)
            .map_err(io_err(&args.out))?;
    }
    Ok(())
}

/// The CUDA run: one GPU, the plan's streams as CUDA streams (`exec::gpu`).
fn run_cuda(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    // Checked before the models are built (a large random model takes a while on the host).
    let gpu = exec::gpu::open_gpu()?;
    exec::gpu::check_gpu_plan(plan, &gpu)?;
    // Decode windows run on SM partitions when green contexts work (exec::gpu::PlanStreams),
    // else on plain streams sharing the SMs (exec::profile::Execution).
    let partitioned = exec::gpu::PlanStreams::new(plan, &gpu)?.green();
    drop(gpu);
    let spec = &plan.spec;
    let setup = std::time::Instant::now();
    // Checkpoints (the CPU path's format and checks, `checkpoint::save_gpu` / `load_gpu`): the
    // initial actor stays on the host, hashed for the run's identity and kept as the copy the
    // saves write through; a checkpoint is loaded and checked before anything is written.
    let (mut models, identity, host, first) = if args.save_every > 0 || args.resume.is_some() {
        let actor = exec::host_actor(spec)?;
        let identity = RunIdentity::with_reference(plan, spec.reference.enabled.then_some(&actor))?;
        let fresh = exec::gpu::build_gpu_models_for(plan, &actor)?;
        match &args.resume {
            Some(p) => {
                let dir = checkpoint::resolve(p)?;
                let r = checkpoint::load_gpu(&dir, &identity, fresh)?;
                if !args.quiet {
                    println!(
                        "resuming from {} after {} iterations",
                        r.dir.display(),
                        r.completed
                    );
                }
                (r.models, Some(identity), Some(r.host), r.completed)
            }
            None => (fresh, Some(identity), Some(actor), 0),
        }
    } else {
        let actor = exec::host_actor(spec)?;
        (
            exec::gpu::build_gpu_models_for(plan, &actor)?,
            None,
            None,
            0,
        )
    };
    if !args.quiet || std::env::var_os("ROLLPLEX_TASK_LOG").is_some() {
        eprintln!(
            "models built and uploaded in {:.1} s",
            setup.elapsed().as_secs_f64()
        );
    }
    if first >= args.iterations {
        println!(
            "nothing to run: the checkpoint has {first} iterations done and --iterations asks for {} in all",
            args.iterations
        );
        return Ok(());
    }
    let profile = args
        .profile
        .as_ref()
        .map(|_| {
            use exec::profile::{Execution, ProfileRecorder};
            let execution = if partitioned {
                Execution::Partitioned
            } else {
                Execution::Shared
            };
            ProfileRecorder::for_run(plan, "cuda", execution, args.iterations - first)
        })
        .transpose()?;
    let (mut source, mut reward, metrics) = open_run(plan, args, first, "cuda")?;
    let eval = |models: &exec::gpu::GpuModels, when: &str| -> Result<(), ExecError> {
        let acc = exec::data::evaluate_split_with(
            spec,
            crate::tasks::moving_shapes::Split::Test,
            args.eval,
            &mut |p, i, cfg| exec::gpu::greedy_tokens(models, p, i, cfg),
        )?;
        report_eval(args, acc, when)
    };
    // A resumed run's "before" is the original run's.
    if first == 0 {
        eval(&models, "before")?;
    }
    if !args.quiet {
        println!("{}", table_header());
    }
    let mut run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(first, args.iterations, args.quiet),
        trace: args.trace.as_ref().map(|_| PlanTrace::new(plan, "cuda")),
        identity,
        phase_s: [0.0; 4],
        profile,
        host,
    };
    let result = exec::gpu::run_gpu_loop(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        first..args.iterations,
        &mut run,
    );
    run.finish()?;
    result?;
    if let Some(a) = &models.arena {
        let spilled = a.usage().iter().any(|u| u.spills > 0);
        if spilled {
            eprintln!(
                "warning: some buffers did not fit their plan ranges and came from the memory \
                 pool (the plan sized them otherwise than this run's data)"
            );
        }
        if !args.quiet || spilled {
            eprint!("{}", a.report());
        }
    }
    run.write_profile(plan)?;
    eval(&models, "after")
}

fn table_header() -> String {
    format!(
        "{:>5} {:>8} {:>7} {:>7} {:>9} {:>9} {:>6} {:>8} {:>8} {:>8} {:>7}",
        "iter",
        "reward",
        "±std",
        "resp",
        "loss",
        "kl",
        "clip",
        "gnorm",
        "time_s",
        "tok/s",
        "mem_GiB"
    )
}

fn table_row(it: u32, r: &IterationResult, dt: Duration) -> String {
    let m = &r.metrics;
    format!(
        "{:>5} {:>8.3} {:>7.3} {:>7.1} {:>9.4} {:>9.5} {:>6.3} {:>8.3} {:>8.2} {:>8.0} {:>7}",
        it,
        r.reward_mean(),
        r.reward_std(),
        r.response_len_mean(),
        m.loss.loss,
        m.loss.kl,
        m.loss.clip_frac,
        m.grad_norm,
        dt.as_secs_f64(),
        r.response_tokens() as f64 / dt.as_secs_f64().max(1e-9),
        m.peak_mem_bytes
            .map(|b| format!("{:.2}", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_else(|| "-".into())
    )
}

fn metrics_json(it: u32, r: &IterationResult, dt: Duration, phase_s: &[f64; 4]) -> String {
    let m = &r.metrics;
    let mut v = serde_json::json!({
        "iteration": it,
        "reward_mean": r.reward_mean(),
        "reward_std": r.reward_std(),
        "response_len_mean": r.response_len_mean(),
        "response_tokens": r.response_tokens(),
        "loss": m.loss.loss,
        "pg_loss": m.loss.pg_loss,
        "kl": m.loss.kl,
        "clip_frac": m.loss.clip_frac,
        "approx_kl": m.loss.approx_kl,
        "entropy": m.loss.entropy,
        "grad_norm": m.grad_norm,
        "decode_steps": m.decode_steps,
        "micro_batches": m.micro_batches,
        "optimizer_steps": m.optimizer_steps,
        "time_s": dt.as_secs_f64(),
        "tokens_per_s": r.response_tokens() as f64 / dt.as_secs_f64().max(1e-9),
        "peak_mem_gib": m.peak_mem_bytes.map(|b| b as f64 / (1u64 << 30) as f64),
    });
    // Measured time per phase (sum of its tasks' host times; side work in decode windows is
    // rollout, as in the simulator's summary).
    for (p, s) in Phase::ALL.iter().zip(phase_s) {
        v[format!("{}_s", format!("{p:?}").to_lowercase())] = serde_json::json!(s);
    }
    v.to_string()
}
