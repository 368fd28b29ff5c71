//! The command line of `rollplexc`: flags (clap derive) and the IO around the pure compiler.
//!
//! ```text
//! rollplexc PIPELINE.rpx -o PLAN.bin [--emit-yaml PLAN.yaml] [--profile PROF.yaml] [--stats] [--mode M]
//! rollplexc check PIPELINE.rpx
//! rollplexc explain PLAN.bin
//! rollplexc diff A B
//! rollplexc merge-profiles A.yaml B.yaml... -o MERGED.yaml
//! ```
//!
//! Files are read through `rollplex_plan::files` (regular files only, with a size cap) and
//! written whole or not at all (a synced temporary sibling renamed over the target). An output
//! that is one of the inputs, or another output, is refused before anything is read or written.

use clap::{Args, Parser, Subcommand, ValueEnum};
use rollplex_compiler::{compile, CompileError, Options, Stats};
use rollplex_plan::files::{self, PLAN_CAP, TEXT_CAP};
use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The name and version written into every plan's header.
pub const PRODUCER: &str = concat!("rollplexc ", env!("CARGO_PKG_VERSION"));

#[derive(Parser, Debug)]
#[command(
    name = "rollplexc",
    version,
    about = "Compile a Rollplex pipeline (.rpx) into an execution plan",
    long_about = "Compiles a pipeline description into a static execution plan for rollplex-run: \
                  per GPU the streams and SM partitions, every task with its dependencies, every \
                  buffer with its offset, and the predicted timeline.\n\n\
                  Exit codes: 0 ok, 1 user error (diagnostics are printed), 2 internal error.",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub compile: CompileArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Compile a pipeline into a plan (the default command).
    Compile(CompileArgs),
    /// Check a pipeline (parse, resolve, semantic checks, lowering) without writing a plan.
    Check(CheckArgs),
    /// Print the YAML form of a binary plan (byte-identical to what --emit-yaml wrote).
    Explain(ExplainArgs),
    /// Summarise what changed between two plans (binary or YAML), then the raw YAML diff.
    Diff(DiffArgs),
    /// Fit one cost-model profile to the measurements of several (`rollplex-run --profile` of
    /// serial and overlap plans, with and without prefix dedup); prints the fit per kind.
    MergeProfiles(MergeArgs),
}

#[derive(Args, Debug, Default)]
pub struct CompileArgs {
    /// The pipeline to compile (.rpx).
    #[arg(value_name = "PIPELINE", required = true)]
    pub pipeline: Option<PathBuf>,
    /// Write the binary plan here.
    #[arg(short = 'o', long = "output", value_name = "PLAN")]
    pub output: Option<PathBuf>,
    /// Also write the plan's YAML review form here.
    #[arg(long, value_name = "YAML")]
    pub emit_yaml: Option<PathBuf>,
    /// Calibrate the cost model with a measured profile (YAML). Default: datasheet numbers.
    #[arg(long, value_name = "PROFILE")]
    pub profile: Option<PathBuf>,
    /// Override the pipeline's schedule mode.
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Print pass times, the candidates considered, the ILP size and solve time, and the
    /// roofline: each phase's and the iteration's least time at the GPU's ceilings (stderr).
    #[arg(long)]
    pub stats: bool,
    /// Time limit of one ILP solve, seconds; on reaching it the best answer found is used. A
    /// safety net: a node limit stops long searches first, at the same point on every machine,
    /// so a plan does not depend on how busy the machine was.
    #[arg(long, value_name = "SECONDS", default_value_t = rollplex_compiler::driver::DEFAULT_TIME_LIMIT_S)]
    pub time_limit: f64,
    #[command(flatten)]
    pub color: ColorArg,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The pipeline to check (.rpx).
    #[arg(value_name = "PIPELINE")]
    pub pipeline: PathBuf,
    #[command(flatten)]
    pub color: ColorArg,
}

#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// A binary plan written by `rollplexc -o`.
    #[arg(value_name = "PLAN")]
    pub plan: PathBuf,
}

#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The old plan (binary or YAML).
    #[arg(value_name = "A")]
    pub a: PathBuf,
    /// The new plan (binary or YAML).
    #[arg(value_name = "B")]
    pub b: PathBuf,
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Profiles measured on one GPU (YAML, as `rollplex-run --profile` writes them).
    #[arg(value_name = "PROFILE", required = true)]
    pub profiles: Vec<PathBuf>,
    /// Write the merged profile here (what `rollplexc --profile` reads).
    #[arg(short = 'o', long = "output", value_name = "MERGED")]
    pub output: PathBuf,
    /// Also print every measurement next to the merged model (stderr).
    #[arg(long)]
    pub residuals: bool,
}

#[derive(Args, Debug, Default)]
pub struct ColorArg {
    /// Color diagnostics: auto (when stderr is a terminal and NO_COLOR is unset), always, never.
    #[arg(long, value_enum, default_value_t = ColorWhen::Auto)]
    pub color: ColorWhen,
}

#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ColorWhen {
    #[default]
    Auto,
    Always,
    Never,
}

impl ColorArg {
    fn enabled(&self) -> bool {
        match self.color {
            ColorWhen::Always => true,
            ColorWhen::Never => false,
            ColorWhen::Auto => {
                std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
            }
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeArg {
    Serial,
    Overlap,
    Disaggregated,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Serial => Mode::Serial,
            ModeArg::Overlap => Mode::Overlap,
            ModeArg::Disaggregated => Mode::Disaggregated,
        }
    }
}

/// A failure to report: the text (already rendered) and the exit code.
pub struct Failure {
    pub text: String,
    pub code: u8,
}

fn user(text: impl Into<String>) -> Failure {
    Failure {
        text: format!("error: {}", text.into()),
        code: 1,
    }
}

fn internal(text: impl Into<String>) -> Failure {
    Failure {
        text: format!(
            "internal error: {}\nthis is a bug in rollplexc; please report it with the pipeline",
            text.into()
        ),
        code: 2,
    }
}

/// Parses the command line; `--help`/`--version` print and return exit code 0, usage errors 1.
pub fn parse() -> Result<Cli, ExitCode> {
    match Cli::try_parse() {
        Ok(c) => Ok(c),
        Err(e) => {
            let _ = e.print();
            Err(if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}

pub fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Some(Command::Compile(a)) => run_compile(a),
        Some(Command::Check(a)) => run_check(a),
        Some(Command::Explain(a)) => run_explain(a),
        Some(Command::Diff(a)) => run_diff(a),
        Some(Command::MergeProfiles(a)) => run_merge(a),
        None => run_compile(cli.compile),
    }
}

struct FsEnv {
    base: PathBuf,
}

impl rollplex_dsl::Env for FsEnv {
    fn read_file(&self, path: &str) -> Result<String, String> {
        let p = Path::new(path);
        let full = if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base.join(p)
        };
        files::read_to_string(&full, TEXT_CAP).map_err(|e| format!("{}: {e}", full.display()))
    }
}

/// The text of a pipeline. Bytes that are not UTF-8 are a diagnostic at the line and column of
/// the first bad byte.
fn read_source(path: &Path) -> Result<String, Failure> {
    let bytes = files::read(path, TEXT_CAP)
        .map_err(|e| user(format!("cannot read {}: {e}", path.display())))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let before = &e.as_bytes()[..at];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        // Columns count characters, as diagnostics do; what precedes `at` is valid UTF-8.
        let col = String::from_utf8_lossy(&before[line_start..]).chars().count() + 1;
        user(format!(
            "{}:{line}:{col}: the file is not UTF-8 text (byte 0x{:02x} at offset {at} starts no character)",
            path.display(),
            e.as_bytes()[at]
        ))
    })
}

/// Refuses outputs that would overwrite an input or each other: `rollplexc X.rpx -o X.rpx`
/// must not destroy the pipeline. `outputs` and `inputs` are (flag, path) pairs for the message.
fn check_outputs(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<(), Failure> {
    for (i, (oflag, out)) in outputs.iter().enumerate() {
        for (iflag, input) in inputs {
            if files::same_file(out, input) {
                return Err(user(format!(
                    "{oflag} {} is the {iflag} {}: writing it would overwrite the input; choose another output path",
                    out.display(),
                    input.display()
                )));
            }
        }
        for (flag2, other) in &outputs[..i] {
            if files::same_file(out, other) {
                return Err(user(format!(
                    "{oflag} {} and {flag2} {} are the same file; give each output its own path",
                    out.display(),
                    other.display()
                )));
            }
        }
    }
    Ok(())
}

/// Reads and checks a pipeline; diagnostics are rendered into the failure.
fn load(path: &Path, color: bool) -> Result<(String, String, rollplex_dsl::Checked), Failure> {
    let src = read_source(path)?;
    let name = path.display().to_string();
    let env = FsEnv {
        base: path.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    match rollplex_dsl::compile_source(&name, &src, &env) {
        Ok(c) => {
            if !c.warnings.is_empty() {
                eprint!("{}", c.warnings.render(&name, &src, color));
            }
            Ok((name, src, c))
        }
        Err(d) => Err(Failure {
            text: d.render(&name, &src, color),
            code: 1,
        }),
    }
}

/// Renders a compile error against the source when it names a field.
fn compile_failure(
    e: CompileError,
    name: &str,
    src: &str,
    checked: &rollplex_dsl::Checked,
    color: bool,
) -> Failure {
    match e {
        CompileError::User {
            message,
            field,
            help,
        } => {
            let span = field.as_deref().and_then(|f| checked.spans.get(f));
            let text = match span {
                Some(s) => {
                    let _ = color;
                    rollplex_dsl::render_one(name, src, s, &message, help.as_deref())
                }
                None => {
                    let mut t = format!("error: {message}\n");
                    if let Some(h) = help {
                        t.push_str(&format!("  help: {h}\n"));
                    }
                    t
                }
            };
            Failure { text, code: 1 }
        }
        CompileError::Internal(m) => internal(m),
    }
}

fn run_compile(a: CompileArgs) -> Result<(), Failure> {
    let path = a
        .pipeline
        .clone()
        .ok_or_else(|| user("no pipeline given (see rollplexc --help)"))?;
    if a.output.is_none() && a.emit_yaml.is_none() && !a.stats {
        return Err(user("nothing to write: give `-o PLAN.bin` and/or `--emit-yaml PLAN.yaml` (or `rollplexc check` to only check)"));
    }
    if !(a.time_limit > 0.0 && a.time_limit.is_finite()) {
        return Err(user(format!(
            "--time-limit must be a positive number of seconds, not {}",
            a.time_limit
        )));
    }
    let mut outputs = Vec::new();
    if let Some(o) = &a.output {
        outputs.push(("-o", o.as_path()));
    }
    if let Some(o) = &a.emit_yaml {
        outputs.push(("--emit-yaml", o.as_path()));
    }
    let mut inputs = vec![("pipeline", path.as_path())];
    if let Some(p) = &a.profile {
        inputs.push(("--profile", p.as_path()));
    }
    check_outputs(&outputs, &inputs)?;
    let color = a.color.enabled();
    let (name, src, checked) = load(&path, color)?;
    let profile = match &a.profile {
        Some(p) => {
            let text = files::read_to_string(p, TEXT_CAP)
                .map_err(|e| user(format!("cannot read profile {}: {e}", p.display())))?;
            Some(
                rollplex_cost::Profile::from_yaml(&text)
                    .map_err(|e| user(format!("profile {}: {e}", p.display())))?,
            )
        }
        None => None,
    };
    let opts = Options {
        mode: a.mode.map(Mode::from),
        profile,
        time_limit_s: a.time_limit,
        ..Options::default()
    };
    let compiled = compile(&checked.spec, &opts)
        .map_err(|e| compile_failure(e, &name, &src, &checked, color))?;
    let plan = compiled.plan;
    if let Some(out) = &a.output {
        let bytes = rollplex_plan::encode(&plan, PRODUCER).map_err(|e| internal(e.to_string()))?;
        write_atomic(out, &bytes)?;
    }
    if let Some(out) = &a.emit_yaml {
        let text = rollplex_plan::to_yaml(&plan).map_err(internal)?;
        write_atomic(out, text.as_bytes())?;
    }
    if a.stats {
        eprint!("{}", stats_text(&plan, &compiled.stats));
    }
    let peak = plan.memory.gpus.iter().map(|g| g.peak).max().unwrap_or(0);
    eprintln!(
        "compiled {name}: {} mode, {} tasks, predicted {:.3} s/iteration, peak {:.2} GiB per GPU{}",
        format!("{:?}", plan.mode).to_lowercase(),
        plan.tasks.len(),
        plan.predicted.iteration_s,
        peak as f64 / (1u64 << 30) as f64,
        if plan.solver.status == rollplex_plan::SolveStatus::TimeLimit {
            " (the ILP stopped at its node or time limit: best answer found)"
        } else {
            ""
        }
    );
    Ok(())
}

fn run_check(a: CheckArgs) -> Result<(), Failure> {
    let color = a.color.enabled();
    let (name, src, checked) = load(&a.pipeline, color)?;
    // Lowering checks what the language cannot (replicas, batch splits, memory).
    let opts = Options {
        mode: Some(Mode::Serial),
        ..Options::default()
    };
    compile(&checked.spec, &opts).map_err(|e| compile_failure(e, &name, &src, &checked, color))?;
    eprintln!("{name}: ok");
    Ok(())
}

/// Reads a plan from its binary form, or from its YAML form when the file is text that does
/// not start like a binary plan.
fn read_plan(path: &Path) -> Result<Plan, Failure> {
    let bytes = files::read(path, PLAN_CAP)
        .map_err(|e| user(format!("cannot read {}: {e}", path.display())))?;
    match std::str::from_utf8(&bytes) {
        Ok(text) if !bytes.starts_with(&rollplex_plan::codec::MAGIC) => {
            rollplex_plan::from_yaml(text).map_err(|e| user(format!("{}: {e}", path.display())))
        }
        _ => rollplex_plan::decode(&bytes)
            .map(|(_, p)| p)
            .map_err(|e| user(format!("{}: {e}", path.display()))),
    }
}

fn run_diff(a: DiffArgs) -> Result<(), Failure> {
    let (pa, pb) = (read_plan(&a.a)?, read_plan(&a.b)?);
    let text = rollplex_compiler::diff::diff_plans_named(
        &pa,
        &pb,
        &a.a.display().to_string(),
        &a.b.display().to_string(),
    );
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| user(format!("cannot write to stdout: {e}")))
}

fn run_explain(a: ExplainArgs) -> Result<(), Failure> {
    let bytes = files::read(&a.plan, PLAN_CAP)
        .map_err(|e| user(format!("cannot read {}: {e}", a.plan.display())))?;
    let (_, plan) =
        rollplex_plan::decode(&bytes).map_err(|e| user(format!("{}: {e}", a.plan.display())))?;
    let text = rollplex_plan::to_yaml(&plan).map_err(internal)?;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| user(format!("cannot write to stdout: {e}")))
}

fn run_merge(a: MergeArgs) -> Result<(), Failure> {
    let named: Vec<(&str, &Path)> = a
        .profiles
        .iter()
        .map(|p| ("profile", p.as_path()))
        .collect();
    check_outputs(&[("-o", a.output.as_path())], &named)?;
    let mut inputs = Vec::new();
    for p in &a.profiles {
        let text = files::read_to_string(p, TEXT_CAP)
            .map_err(|e| user(format!("cannot read profile {}: {e}", p.display())))?;
        let prof = rollplex_cost::Profile::from_yaml(&text)
            .map_err(|e| user(format!("profile {}: {e}", p.display())))?;
        inputs.push((p.display().to_string(), prof));
    }
    let merged = rollplex_cost::Profile::merge(&inputs).map_err(|e| user(e.to_string()))?;
    let (points, corun, beside): (usize, usize, usize) = (
        merged.points.len(),
        merged.corun_points.len(),
        merged.beside_points.len(),
    );
    let host = if merged.host_copies.is_empty() {
        String::new()
    } else {
        format!(
            "# Host link, measured copies of every input together (bytes over seconds per \
             direction): {}.\n",
            merged.host_copies.describe()
        )
    };
    let header = format!(
        "# Merged by rollplexc merge-profiles from {} profiles: {points} points alone, {corun} \
         co-run points, {beside} beside points.\n{host}# Recompile with it: rollplexc \
         PIPELINE.rpx --profile THIS.yaml\n",
        inputs.len()
    );
    write_atomic(
        &a.output,
        format!("{header}{}", merged.to_yaml()).as_bytes(),
    )?;
    eprint!("{}", merge_summary(&merged, a.residuals));
    eprintln!(
        "merged {} profiles into {}: {points} points alone, {corun} co-run points, {beside} beside points",
        inputs.len(),
        a.output.display()
    );
    Ok(())
}

/// Per kind (and per co-run pair): how many measurements, and how far the merged model is from
/// them (root mean square and worst of predicted / measured - 1); with `all`, every row.
fn merge_summary(p: &rollplex_cost::Profile, all: bool) -> String {
    use std::collections::BTreeMap;
    let rows = p.residuals();
    let mut s = String::new();
    if all {
        for r in &rows {
            s.push_str(&format!(
                "{:<40} measured {:>10.3} ms  model {:>10.3} ms  {:>+7.1}%  {}\n",
                r.what,
                r.measured_s * 1e3,
                r.predicted_s * 1e3,
                r.rel_err() * 100.0,
                r.note
            ));
        }
    }
    // `what` is `kind@sms`, `kind@sms beside other` or `a || b`: group by kind (and pair).
    let mut by: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in &rows {
        let key = match r.what.split_once(" beside ") {
            Some((a, b)) => format!("{} beside {b}", a.split('@').next().unwrap_or(a)),
            None if r.what.contains(" || ") => "co-run pairs (bench)".to_string(),
            None => r.what.split('@').next().unwrap_or(&r.what).to_string(),
        };
        by.entry(key).or_default().push(r.rel_err());
    }
    s.push_str(&format!(
        "{:<36} {:>6} {:>8} {:>8}\n",
        "fit of the merged model", "count", "rms", "worst"
    ));
    for (k, e) in by {
        let rms = (e.iter().map(|x| x * x).sum::<f64>() / e.len() as f64).sqrt();
        let worst = e
            .iter()
            .copied()
            .fold(0.0f64, |a, b| if b.abs() > a.abs() { b } else { a });
        s.push_str(&format!(
            "{k:<36} {:>6} {:>7.1}% {:>+7.1}%\n",
            e.len(),
            rms * 100.0,
            worst * 100.0
        ));
    }
    for e in &p.corun {
        s.push_str(&format!(
            "slowdown of {} beside {}: {:.4}\n",
            rollplex_cost::defaults::kind_name(e.kind),
            rollplex_cost::defaults::kind_name(e.other),
            e.slowdown
        ));
    }
    s.push_str(&format!(
        "slowdown of pairs not measured: {:.4}\n",
        p.default_corun
    ));
    if !p.host_copies.is_empty() {
        s.push_str(&format!("host link: {}\n", p.host_copies.describe()));
    }
    s
}

/// Writes `bytes` to `path` whole or not at all ([`files::write_atomic`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Failure> {
    files::write_atomic(path, bytes)
        .map_err(|e| user(format!("cannot write {}: {e}", path.display())))
}

fn stats_text(plan: &Plan, st: &Stats) -> String {
    let mut s = String::new();
    s.push_str(&format!("cost model: {}\n", st.cost_source));
    s.push_str("passes:");
    for (p, t) in &st.passes {
        s.push_str(&format!(" {p} {:.1} ms,", t * 1e3));
    }
    s.pop();
    s.push('\n');
    for c in &st.candidates {
        s.push_str(&format!(
            "candidate {}: {:.3} s/iteration, peak {:.2} GiB{}\n",
            c.label,
            c.predicted_s,
            c.peak as f64 / (1u64 << 30) as f64,
            if c.fits { "" } else { " (over budget)" }
        ));
    }
    for r in &st.ilp {
        s.push_str(&format!(
            "ilp [{}]: {} variables ({} binary), {} constraints, solved in {:.3} s, {}, objective {:.4} s\n",
            r.label,
            r.variables,
            r.integer_variables,
            r.constraints,
            r.solve_s,
            match r.status {
                rollplex_plan::SolveStatus::Optimal => "optimal",
                rollplex_plan::SolveStatus::TimeLimit => "node or time limit reached (best feasible answer used)",
                rollplex_plan::SolveStatus::NotRun => "not run",
            },
            r.objective
        ));
    }
    if let Some(w) = &plan.weight_sharing {
        s.push_str(&sharing_text(w));
    }
    s.push_str(&rollplex_plan::roofline::roofline(plan).text());
    s.push_str(&format!(
        "plan: {} tasks, {} buffers, {} windows; predicted {:.3} s/iteration, {:.3} s of side work hidden in decode windows\n",
        plan.tasks.len(),
        plan.buffers.len(),
        plan.windows.len(),
        plan.predicted.iteration_s,
        plan.predicted.hidden_s
    ));
    s
}

/// The weight-sharing lines of `--stats`: totals, then the classes that need extra memory.
fn sharing_text(w: &rollplex_plan::WeightSharing) -> String {
    use rollplex_compiler::sharing::{shared_class_fraction, shared_fraction};
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut s = format!(
        "weight sharing (train tp {}, rollout tp {}; rollout ranks {:?} over train ranks {:?}): {:.1}% of the rollout layout aliased ({:.1}% in wholly shared tensors); {:.2} GiB extra per GPU instead of {:.2} GiB for a separate copy; weight sync rebuilds {:.2} GiB per iteration\n",
        w.train_tp,
        w.rollout_tp,
        w.rollout_rank,
        w.train_rank,
        100.0 * shared_fraction(w),
        100.0 * shared_class_fraction(w),
        gib(w.extra_bytes),
        gib(w.rollout_bytes),
        gib(w.resharded_bytes),
    );
    for p in w.params.iter().filter(|p| p.extra_bytes > 0) {
        s.push_str(&format!(
            "  {:?} {} x{} ({}{}): {:.3} GiB extra\n",
            p.class,
            p.name,
            p.count,
            p.split,
            if p.trainable { "" } else { ", frozen" },
            gib(p.extra_bytes)
        ));
    }
    s
}
