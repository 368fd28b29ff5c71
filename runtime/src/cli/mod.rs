//! What `rollplex-run` does, behind its flag parsing: load and check the plan, pick the backend,
//! run it, write metrics and traces. IO lives here and in the binary, not in the engines.
//!
//! `args` (the flags), `sim`, `cpu`, `tp` (a tensor-parallel CPU plan, threads or processes),
//! `cuda` (one run per backend), `output` (a training run's observer, inputs and reports),
//! `tp_check` (`--tp-check`: the group check on every launched rank), `validate`
//! (`--eval`, `--eval-data`, `--eval-every`: held-out scores and the best checkpoint).

mod args;
mod cpu;
mod cuda;
mod interrupt;
mod output;
mod sim;
mod tp;
mod tp_check;
mod validate;

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use rollplex_plan::Plan;

pub use args::{BackendChoice, Command, PlotArgs, RunArgs, Tool};

use crate::exec::ExecError;

/// The whole of `rollplex-run` once its flags are parsed: a subcommand, the group check, the
/// launcher of a tensor-parallel plan's rank processes, or a run; an error is printed once and
/// mapped to the process's exit status.
pub fn main(cmd: Command) -> ExitCode {
    let result = match (cmd.tool, cmd.run) {
        (Some(Tool::Plot(p)), _) => plot(&p),
        (None, Some(run_args)) => {
            if let Some(rounds) = cmd.tp_check {
                return tp_check::main(&run_args.plan, rounds);
            }
            if cmd.tp_processes && std::env::var_os("RANK").is_none() {
                return tp::launch_tp_ranks(&run_args.plan);
            }
            run(&run_args)
        }
        (None, None) => Err(ExecError::Machine(
            "no plan given: `rollplex-run PLAN.bin [options]` runs one (see --help)".into(),
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ExecError + '_ {
    move |source| ExecError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `rollplex-run plot`: renders a run's metrics as an SVG.
fn plot(p: &PlotArgs) -> Result<(), ExecError> {
    let (path, iterations) = crate::plot::plot_run(&p.run, p.out.as_deref())
        .map_err(|e| ExecError::Data(e.to_string()))?;
    println!("plot: {} ({iterations} iterations)", path.display());
    Ok(())
}

/// Reads, decodes and verifies a plan file.
pub fn load_plan(path: &Path) -> Result<Plan, ExecError> {
    let bytes =
        rollplex_plan::files::read(path, rollplex_plan::files::PLAN_CAP).map_err(io_err(path))?;
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

/// Runs a plan: loads and verifies it, resolves `--backend auto`, refuses options the backend
/// cannot honour, and runs it.
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
    if backend == BackendChoice::Sim
        && (args.save_every > 0
            || args.resume.is_some()
            || args.eval_every > 0
            || args.eval_data.is_some())
    {
        return Err(ExecError::Machine(
            "--save-every, --resume, --eval-every and --eval-data apply to training backends (cpu, cuda); \
             the simulator keeps no state and scores nothing"
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
    if backend != BackendChoice::Sim {
        interrupt::install();
    }
    match backend {
        BackendChoice::Sim => sim::run_sim(&plan, args),
        BackendChoice::Cpu => cpu::run_cpu(&plan, args),
        BackendChoice::Cuda => cuda::run_cuda(&plan, args),
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
