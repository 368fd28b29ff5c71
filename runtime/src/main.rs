//! `rollplex-run`: executes a compiled plan. A main that only dispatches: parse flags, call
//! `run`, print the error chain once, map it to an exit code (0 ok, 1 user error, 2 internal).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use rollplex_runtime::cli;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// CUDA when a GPU is present, else the CPU backend.
    Auto,
    /// CUDA GPUs.
    Cuda,
    /// The CPU backend (small models; same plan, same results).
    Cpu,
    /// The simulator: replays the plan with the cost model (timing only, any scale).
    Sim,
}

/// Execute a Rollplex plan: the RL loop on GPUs, on the CPU, or in the simulator.
#[derive(Debug, Parser)]
#[command(name = "rollplex-run", version)]
struct Args {
    /// The compiled plan (`rollplexc pipeline.rpx -o plan.bin`).
    plan: PathBuf,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// RL iterations to run (cpu/cuda).
    #[arg(long, default_value_t = 1)]
    iterations: u32,
    /// Directory for metrics.jsonl, checkpoints and traces (default: ./rollplex-out).
    #[arg(long, default_value = "rollplex-out")]
    out: PathBuf,
    /// Write a Chrome/Perfetto trace of the iteration's timeline (sim: predicted; cpu: measured).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write an SVG timeline (sim).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Cost-model profile for the simulator (default: the built-in profile of the plan's GPU, if any).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Save a checkpoint (HF layout + optimizer and RNG state) every N iterations (0: never).
    #[arg(long, default_value_t = 0)]
    save_every: u32,
    /// Resume from a checkpoint directory written by --save-every.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Evaluate on N held-out prompts (greedy) before and after training, when the dataset has a test split.
    #[arg(long, default_value_t = 0)]
    eval: u32,
    /// Print less.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = cli::RunArgs {
        plan: args.plan,
        backend: match args.backend {
            Backend::Auto => cli::BackendChoice::Auto,
            Backend::Cuda => cli::BackendChoice::Cuda,
            Backend::Cpu => cli::BackendChoice::Cpu,
            Backend::Sim => cli::BackendChoice::Sim,
        },
        iterations: args.iterations,
        out: args.out,
        trace: args.trace,
        svg: args.svg,
        profile: args.profile,
        save_every: args.save_every,
        resume: args.resume,
        eval: args.eval,
        quiet: args.quiet,
    };
    match cli::run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(if e.is_user_error() { 1 } else { 2 })
        }
    }
}
