//! `rollplex-run`'s flags: [`Command`] is what the binary parses; [`RunArgs`], the options of a
//! run, is also what tests and tools build to run a plan through [`super::run`].

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// Where a plan runs (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
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
///
/// A run writes metrics.jsonl and TensorBoard events to its --out directory
/// (`tensorboard --logdir rollplex-out`); `rollplex-run plot rollplex-out` draws its curves.
#[derive(Debug, Parser)]
#[command(name = "rollplex-run", version, args_conflicts_with_subcommands = true)]
pub struct Command {
    #[command(subcommand)]
    pub tool: Option<Tool>,
    /// A run's options; absent only with a subcommand.
    #[command(flatten)]
    pub run: Option<RunArgs>,
    /// Check the tensor-parallel group instead of training: one process per GPU of the plan
    /// (started here, or joined as RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), the actor's TP
    /// forward repeated ROUNDS times, ranks compared bitwise and against TP=1 (docs/tp.md).
    #[arg(long, value_name = "ROUNDS", num_args = 0..=1, default_missing_value = "3")]
    pub tp_check: Option<u32>,
    /// Run a tensor-parallel CPU plan as one process per rank talking over TCP, started here
    /// (ranks started by torchrun or slurm join from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    /// without this flag). Default: one thread per rank of this process; same results bitwise.
    #[arg(long)]
    pub tp_processes: bool,
}

/// What `rollplex-run` does instead of running a plan.
#[derive(Debug, clap::Subcommand)]
pub enum Tool {
    /// Draw a run's learning curves (reward, response length, loss, KL) and per-phase times
    /// from its metrics.jsonl as an SVG.
    Plot(PlotArgs),
}

/// `rollplex-run plot`'s options.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The run's --out directory (or its metrics.jsonl).
    #[arg(value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// Where to write the SVG (default: metrics.svg in RUN_DIR).
    #[arg(short, long, value_name = "FILE.svg")]
    pub out: Option<PathBuf>,
}

/// The options of a run (see `rollplex-run --help`).
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// The compiled plan (`rollplexc pipeline.rpx -o plan.bin`).
    pub plan: PathBuf,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// RL iterations of the whole run (cpu/cuda); a resumed run continues up to this count.
    #[arg(long, default_value_t = 1)]
    pub iterations: u32,
    /// Directory for metrics.jsonl, checkpoints and traces (default: ./rollplex-out).
    #[arg(long, default_value = "rollplex-out")]
    pub out: PathBuf,
    /// Write a Chrome/Perfetto trace (sim: the predicted iteration; cpu: every task of every
    /// iteration as measured, on the same tracks as the simulator's). A measured trace keeps
    /// at most 250000 events (some 250 MiB in memory); past that it is truncated, with a
    /// warning and `otherData.truncated` in the file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write an SVG timeline (sim).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Cost-model profile the simulator replays the plan with (default: the built-in profile of
    /// the plan's GPU, if any).
    #[arg(long, value_name = "PROFILE")]
    pub cost_profile: Option<PathBuf>,
    /// Measure every task (after one warm-up iteration, so --iterations >= 2) and write a
    /// cost-model profile here that `rollplexc --profile` reads (cpu, cuda).
    #[arg(long, value_name = "OUT.yaml")]
    pub profile: Option<PathBuf>,
    /// Save a checkpoint (HF layout + optimizer and RNG state) to <out>/checkpoints/iter-<k>
    /// after every N-th iteration (0: never).
    #[arg(long, default_value_t = 0)]
    pub save_every: u32,
    /// Checkpoints to keep, the newest (0: all).
    #[arg(long, default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Resume from a checkpoint: its directory, or an output directory (its newest complete
    /// checkpoint). Pass the same --out to continue its metrics.jsonl.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Evaluate on N held-out prompts (greedy) before and after training: the first N of
    /// --eval-data, or of the moving-shapes task's test split.
    #[arg(long, default_value_t = 0)]
    pub eval: u32,
    /// Score the --eval held-out prompts after every K-th iteration too, greedy and sampled
    /// (the job's sampling, a fixed seed), in metrics.jsonl and on the console, and keep the
    /// state with the best greedy score in <out>/checkpoints/best (0: never).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub eval_every: u32,
    /// The held-out prompts of --eval and --eval-every: a JSONL or Parquet file in the training
    /// dataset's format (veRL's `data.val_files`), scored with the pipeline's reward against
    /// each record's answer. All of it when it holds fewer than --eval N.
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<PathBuf>,
    /// Print less: no progress bars, no table.
    #[arg(long, short)]
    pub quiet: bool,
    /// Print each task's host launch time and the memory pool's use, and each decode window's
    /// host split, to stderr (cuda).
    #[arg(long)]
    pub task_log: bool,
    /// Run decode windows on prioritised plain streams sharing the SMs instead of green-context
    /// SM partitions (cuda).
    #[arg(long)]
    pub no_green_contexts: bool,
    /// Launch each decode step's kernels one at a time instead of replaying the step's CUDA
    /// graph; the same bits, slower (cuda).
    #[arg(long)]
    pub eager_decode: bool,
}
