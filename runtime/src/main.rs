//! `rollplex-run`: executes a compiled plan. A main that only dispatches: parse flags, call
//! `run`, print the error chain once, map it to an exit code (0 ok, 1 user error, 2 internal,
//! 3 a tensor-parallel rank that stopped because another rank failed).

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
    /// RL iterations of the whole run (cpu/cuda); a resumed run continues up to this count.
    #[arg(long, default_value_t = 1)]
    iterations: u32,
    /// Directory for metrics.jsonl, checkpoints and traces (default: ./rollplex-out).
    #[arg(long, default_value = "rollplex-out")]
    out: PathBuf,
    /// Write a Chrome/Perfetto trace (sim: the predicted iteration; cpu: every task of every
    /// iteration as measured, on the same tracks as the simulator's).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write an SVG timeline (sim).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Cost-model profile the simulator replays the plan with (default: the built-in profile of
    /// the plan's GPU, if any).
    #[arg(long, value_name = "PROFILE")]
    cost_profile: Option<PathBuf>,
    /// Measure every task (after one warm-up iteration, so --iterations >= 2) and write a
    /// cost-model profile here that `rollplexc --profile` reads (cpu, cuda).
    #[arg(long, value_name = "OUT.yaml")]
    profile: Option<PathBuf>,
    /// Save a checkpoint (HF layout + optimizer and RNG state) to <out>/checkpoints/iter-<k>
    /// after every N-th iteration (0: never).
    #[arg(long, default_value_t = 0)]
    save_every: u32,
    /// Checkpoints to keep, the newest (0: all).
    #[arg(long, default_value_t = 2)]
    keep_checkpoints: usize,
    /// Resume from a checkpoint: its directory, or an output directory (its newest complete
    /// checkpoint). Pass the same --out to continue its metrics.jsonl.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Evaluate on N held-out prompts (greedy) before and after training, when the dataset has a test split.
    #[arg(long, default_value_t = 0)]
    eval: u32,
    /// Print less: no progress bars, no table.
    #[arg(long, short)]
    quiet: bool,
    /// Check the tensor-parallel group instead of training: one process per GPU of the plan
    /// (started here, or joined as RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), the actor's TP
    /// forward repeated ROUNDS times, ranks compared bitwise and against TP=1 (docs/tp.md).
    #[arg(long, value_name = "ROUNDS", num_args = 0..=1, default_missing_value = "3")]
    tp_check: Option<u32>,
    /// Run a tensor-parallel CPU plan as one process per rank talking over TCP, started here
    /// (ranks started by torchrun or slurm join from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    /// without this flag). Default: one thread per rank of this process; same results bitwise.
    #[arg(long)]
    tp_processes: bool,
    /// Print each task's host launch time and the memory pool's use, and each decode window's
    /// host split, to stderr (cuda).
    #[arg(long)]
    task_log: bool,
    /// Run decode windows on prioritised plain streams sharing the SMs instead of green-context
    /// SM partitions (cuda).
    #[arg(long)]
    no_green_contexts: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(rounds) = args.tp_check {
        return rollplex_runtime::tp::check::main(&args.plan, rounds);
    }
    if args.tp_processes && std::env::var_os("RANK").is_none() {
        return cli::launch_tp_ranks(&args.plan);
    }
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
        cost_profile: args.cost_profile,
        profile: args.profile,
        save_every: args.save_every,
        keep_checkpoints: args.keep_checkpoints,
        resume: args.resume,
        eval: args.eval,
        quiet: args.quiet,
        task_log: args.task_log,
        no_green_contexts: args.no_green_contexts,
    };
    match cli::run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
