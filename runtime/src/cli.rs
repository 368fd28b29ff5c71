//! What `rollplex-run` does, behind its flag parsing: load and check the plan, pick the backend,
//! run it, write metrics and traces. IO lives here and in the binary, not in the engines.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rollplex_plan::spec::DatasetSpec;
use rollplex_plan::Plan;

use crate::exec::{self, ExecError, IterationResult};

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
    pub profile: Option<PathBuf>,
    pub save_every: u32,
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
    match backend {
        BackendChoice::Sim => run_sim(&plan, args),
        BackendChoice::Cpu => run_cpu(&plan, args),
        BackendChoice::Cuda => Err(ExecError::Unsupported(
            "the CUDA executor of the RL loop is not built yet (the CUDA kernels are: see docs/cuda.md); \
             run with --backend sim for the predicted timeline, or --backend cpu for a small model"
                .into(),
        )),
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
    let profile = match &args.profile {
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

fn run_cpu(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    exec::check_cpu_plan(plan)?;
    let spec = &plan.spec;
    let mut models = exec::build_cpu_models(spec)?;
    let mut source: Box<dyn exec::prompts::PromptSource> = match &spec.rollout.dataset {
        DatasetSpec::Synthetic => Box::new(exec::prompts::SyntheticPrompts::new(spec)),
        other => crate::exec::data_source(spec, other)?,
    };
    let mut reward = crate::exec::reward_fn(spec)?;
    std::fs::create_dir_all(&args.out).map_err(io_err(&args.out))?;
    let metrics_path = args.out.join("metrics.jsonl");
    let mut metrics = create_file(&metrics_path)?;
    if !args.quiet {
        println!(
            "rollplex-run: {} ({:?}, {} groups x {}, cpu backend), {} iterations; metrics -> {}",
            spec.name,
            plan.mode,
            plan.parallel.prompts_per_rollout_replica,
            spec.rollout.group_size,
            args.iterations,
            metrics_path.display()
        );
    }
    let eval = |models: &exec::cpu::CpuModels, when: &str| -> Result<(), ExecError> {
        if let Some(acc) = exec::evaluate(spec, models.trainer.model(), args.eval)? {
            println!(
                "eval ({when}): mean reward of greedy answers to {} held-out prompts = {acc:.3}",
                args.eval
            );
            let line = serde_json::json!({"eval": when, "prompts": args.eval, "reward_mean": acc})
                .to_string();
            std::fs::write(args.out.join(format!("eval-{when}.json")), line)
                .map_err(io_err(&args.out))?;
        }
        Ok(())
    };
    eval(&models, "before")?;
    if !args.quiet {
        println!("{}", table_header());
    }
    exec::run_cpu_iterations(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        0,
        args.iterations,
        |it, r, dt| {
            let line = metrics_json(it, r, dt);
            writeln!(metrics, "{line}")
                .and_then(|_| metrics.flush())
                .map_err(io_err(&metrics_path))?;
            if !args.quiet {
                println!("{}", table_row(it, r, dt));
            }
            Ok(())
        },
    )?;
    eval(&models, "after")
}

fn table_header() -> String {
    format!(
        "{:>5} {:>8} {:>7} {:>7} {:>9} {:>9} {:>6} {:>8} {:>8} {:>8}",
        "iter", "reward", "±std", "resp", "loss", "kl", "clip", "gnorm", "time_s", "tok/s"
    )
}

fn table_row(it: u32, r: &IterationResult, dt: Duration) -> String {
    let m = &r.metrics;
    format!(
        "{:>5} {:>8.3} {:>7.3} {:>7.1} {:>9.4} {:>9.5} {:>6.3} {:>8.3} {:>8.2} {:>8.0}",
        it,
        r.reward_mean(),
        r.reward_std(),
        r.response_len_mean(),
        m.loss.loss,
        m.loss.kl,
        m.loss.clip_frac,
        m.grad_norm,
        dt.as_secs_f64(),
        r.response_tokens() as f64 / dt.as_secs_f64().max(1e-9)
    )
}

fn metrics_json(it: u32, r: &IterationResult, dt: Duration) -> String {
    let m = &r.metrics;
    serde_json::json!({
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
    })
    .to_string()
}
