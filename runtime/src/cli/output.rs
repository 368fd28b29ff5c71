//! A training run's output (cpu, cuda): its observer of the loop (metrics.jsonl and the console
//! table, the trace, progress bars, checkpoints, the measured profile), its inputs (prompts,
//! reward, metrics log) and the held-out evaluations' reports.

use std::time::{Duration, Instant};

use rollplex_plan::plan::Task;
use rollplex_plan::roofline::{phase_name, roofline};
use rollplex_plan::spec::{DatasetSpec, JobSpec};
use rollplex_plan::{Phase, Plan};

use super::{io_err, RunArgs};
use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::data::{score_held_out, Decoding, Generate, HeldOut};
use crate::exec::{self, ExecError, IterationResult};
use crate::metrics::{LoopProgress, MetricsLog};
use crate::trace::PlanTrace;

/// A training run's observer (cpu, cuda): metrics file and table, trace, progress bars,
/// checkpoints.
pub(super) struct LoopRun<'a> {
    pub(super) args: &'a RunArgs,
    pub(super) metrics: MetricsLog,
    pub(super) progress: LoopProgress,
    pub(super) trace: Option<PlanTrace>,
    /// What checkpoints are stamped with (computed only when saving or resuming).
    pub(super) identity: Option<RunIdentity>,
    /// Seconds per phase (rollout, scoring, training, sync) of the running iteration.
    pub(super) phase_s: [f64; 4],
    /// The plan's roofline per phase and its measured time summed over the run's iterations.
    pub(super) roof: RunRoofline,
    /// `--profile`: every task's measured time.
    pub(super) profile: Option<exec::profile::ProfileRecorder>,
    /// cuda with `--save-every` or `--eval-every`: the host copy of the actor that checkpoints
    /// are written through (`checkpoint::save_gpu`).
    pub(super) host: Option<crate::model::Qwen25VL>,
    /// `--eval-every`: the held-out scores during training and the best checkpoint.
    pub(super) validation: Option<super::validate::Validation>,
    /// `--eval`: the held-out prompts (`validate::held_out`), scored before and after training.
    pub(super) held_out: Option<std::sync::Arc<HeldOut>>,
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
            self.phase_s[phase.index()] += end.duration_since(start).as_secs_f64();
        }
        if let Some(t) = &mut self.trace {
            t.task(it, task, start, end);
        }
        if let Some(p) = &mut self.profile {
            p.record_instants(task, start, end);
        }
        self.progress.task_done();
    }

    fn stop_requested(&self) -> bool {
        super::interrupt::requested()
    }

    fn reward_span(&mut self, span: &exec::RewardSpan) {
        if let Some(t) = &mut self.trace {
            t.reward(span);
        }
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
        let done = it + 1;
        let scores = match &self.validation {
            Some(v) if v.due(done) => Some((v.score(models, done)?, v.prompts())),
            _ => None,
        };
        let mut line = metrics_json(it, r, dt, &self.phase_s, &self.roof);
        if let Some((s, prompts)) = &scores {
            line["val_reward_greedy"] = serde_json::json!(s.greedy);
            line["val_reward_sampled"] = serde_json::json!(s.sampled);
            line["val_prompts"] = serde_json::json!(prompts);
        }
        self.roof.add(&self.phase_s, dt);
        self.metrics
            .log_line(&line.to_string())
            .map_err(|e| ExecError::Data(e.to_string()))?;
        self.progress.iteration_done();
        if !self.args.quiet {
            self.progress
                .println(&table_row(it, r, dt, self.roof.serial_s));
        }
        let every = self.args.save_every;
        let stop = super::interrupt::requested();
        let mut saved = None;
        if let Some(identity) = self
            .identity
            .as_ref()
            .filter(|_| stop || (every > 0 && done.is_multiple_of(every)))
        {
            let root = self.args.out.join(checkpoint::CHECKPOINTS_DIR);
            let keep = self.args.keep_checkpoints;
            let path = match models {
                exec::LoopModels::Cpu(Some(state)) => checkpoint::save(
                    &root,
                    done,
                    state,
                    identity,
                    &checkpoint::Slot::Newest { keep },
                )?,
                exec::LoopModels::Cpu(None) if stop => {
                    return Err(ExecError::Interrupted {
                        done,
                        checkpoint: None,
                    })
                }
                exec::LoopModels::Cpu(None) => {
                    return Err(ExecError::Plan(format!(
                        "iteration {done} is to be checkpointed but the ranks did not gather \
                         their state (CpuModels::set_save_every not called)"
                    )))
                }
                exec::LoopModels::Gpu(m) => {
                    let host = self.host.as_mut().ok_or_else(|| {
                        ExecError::Checkpoint("no host copy of the actor to save through".into())
                    })?;
                    checkpoint::save_gpu(
                        &root,
                        done,
                        m,
                        host,
                        identity,
                        &checkpoint::Slot::Newest { keep },
                    )?
                }
            };
            if !self.args.quiet {
                self.progress
                    .println(&format!("checkpoint: {}", path.display()));
            }
            saved = Some(path);
        }
        if let (Some((s, _)), Some(v)) = (scores, self.validation.as_mut()) {
            let best = v.is_best(&s);
            if best {
                let identity = self.identity.as_ref().ok_or_else(|| {
                    ExecError::Plan(
                        "--eval-every saves a best checkpoint but the run has no identity".into(),
                    )
                })?;
                v.save_best(models, self.host.as_mut(), identity, done, s)?;
            }
            if !self.args.quiet {
                self.progress.println(&v.line(done, &s, best));
            }
        }
        if stop {
            return Err(ExecError::Interrupted {
                done,
                checkpoint: saved,
            });
        }
        Ok(())
    }
}

/// What a resume from a checkpoint with `first` iterations done says when `--iterations`
/// (`all`) asks for no more.
pub(super) fn nothing_to_run(first: u32, all: u32) {
    println!(
        "nothing to run: the checkpoint has {first} iterations done and --iterations asks for {all} in all"
    );
}

impl LoopRun<'_> {
    /// Closes the bars and writes the trace (also when the loop failed: the trace shows how far
    /// it got).
    pub(super) fn finish(&self) -> Result<(), ExecError> {
        self.progress.finish();
        if !self.args.quiet {
            print!("{}", self.roof.summary());
        }
        if let (Some(path), Some(t)) = (&self.args.trace, &self.trace) {
            t.write(path).map_err(|e| ExecError::Data(e.to_string()))?;
            if !self.args.quiet {
                println!(
                    "trace: {} ({} tasks measured)",
                    path.display(),
                    t.events().len()
                );
            }
            if let Some(why) = t.truncated() {
                eprintln!("warning: {why}: trace fewer iterations to see them all");
            }
        }
        Ok(())
    }

    /// `--profile`: fits the measured task times and writes the profile.
    pub(super) fn write_profile(&self, plan: &Plan) -> Result<(), ExecError> {
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

/// A run's prompt source and reward.
pub(super) type RunSources = (
    Box<dyn exec::prompts::PromptSource>,
    Box<exec::cpu::SendRewardFn<'static>>,
);

pub(super) type RunInputs = (
    Box<dyn exec::prompts::PromptSource>,
    Box<exec::cpu::SendRewardFn<'static>>,
    MetricsLog,
);

/// The prompt source, the reward and the metrics log of a training run (cpu, cuda), and its
/// first console line.
pub(super) fn open_run(
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
    let reward: Box<exec::cpu::SendRewardFn<'static>> = crate::exec::reward_fn(spec)?;
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
            "rollplex-run: {} ({:?}, {} groups x {}, {backend} backend), iterations {first}..{}; metrics -> {} (TensorBoard events beside it)",
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

/// `--eval N` before or after training (`when`): the mean reward of greedy answers to the
/// held-out prompts (`None`: there are none, nothing to do) by `generate`, printed and written
/// to `<out>/eval-<when>.json`.
pub(super) fn eval_greedy(
    spec: &JobSpec,
    args: &RunArgs,
    held: Option<&HeldOut>,
    generate: &mut Generate<'_>,
    when: &str,
) -> Result<(), ExecError> {
    let Some(held) = held else {
        return Ok(());
    };
    let prompts = held.count(args.eval);
    let acc = score_held_out(spec, held, args.eval, Decoding::Greedy, generate)?;
    println!(
        "eval ({when}): mean reward of greedy answers to {prompts} held-out prompts = {acc:.3}"
    );
    let line =
        serde_json::json!({"eval": when, "prompts": prompts, "reward_mean": acc}).to_string();
    std::fs::write(args.out.join(format!("eval-{when}.json")), line).map_err(io_err(&args.out))?;
    Ok(())
}

pub(super) fn table_header() -> String {
    format!(
        "{:>5} {:>8} {:>7} {:>7} {:>9} {:>9} {:>6} {:>8} {:>8} {:>8} {:>7} {:>6}",
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
        "mem_GiB",
        "roof%"
    )
}

/// A console row; `roof%` is the plan's roofline over the iteration's time.
fn table_row(it: u32, r: &IterationResult, dt: Duration, roofline_s: f64) -> String {
    let m = &r.metrics;
    format!(
        "{:>5} {:>8.3} {:>7.3} {:>7.1} {:>9.4} {:>9.5} {:>6.3} {:>8.3} {:>8.2} {:>8.0} {:>7} {:>6.1}",
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
            .unwrap_or_else(|| "-".into()),
        100.0 * roofline_s / dt.as_secs_f64().max(1e-12)
    )
}

fn metrics_json(
    it: u32,
    r: &IterationResult,
    dt: Duration,
    phase_s: &[f64; 4],
    roof: &RunRoofline,
) -> serde_json::Value {
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
        "decode_device_s": m.decode_device_s,
        "decode_gb": m.decode_bytes / 1e9,
        "decode_rows": m.decode_rows,
        "decode_live_rows": m.decode_live_rows,
        "micro_batches": m.micro_batches,
        "optimizer_steps": m.optimizer_steps,
        "time_s": dt.as_secs_f64(),
        "tokens_per_s": r.response_tokens() as f64 / dt.as_secs_f64().max(1e-9),
        "peak_mem_gib": m.peak_mem_bytes.map(|b| b as f64 / (1u64 << 30) as f64),
        "groups_trained": m.groups_trained,
        "rollout_logp_diff_mean": m.rollout_agreement.map(|a| a.abs_diff_mean()),
        "rollout_logp_diff_max": m.rollout_agreement.map(|a| a.abs_diff_max),
        "rollout_kl_k3": m.rollout_agreement.map(|a| a.k3_mean()),
    });
    if let Some(n) = m.groups_with_variance {
        v["groups_with_variance"] = serde_json::json!(n);
    }
    // Measured time per phase (sum of its tasks' host times; side work in decode windows is
    // rollout, as in the simulator's summary).
    for (p, s) in Phase::ALL.iter().zip(phase_s) {
        v[format!("{}_s", phase_name(*p))] = serde_json::json!(s);
    }
    // The plan's roofline (`rollplexc --stats`) and the share of it achieved: roofline / time.
    v["roofline_s"] = serde_json::json!(roof.serial_s);
    v["roofline_frac"] = serde_json::json!(roof.serial_s / dt.as_secs_f64().max(1e-12));
    // decode's share of the copy rate on the bytes its steps moved (cuda)
    if m.decode_device_s > 0.0 {
        v["decode_copy_frac"] =
            serde_json::json!(m.decode_bytes / m.decode_device_s / roof.copy_rate);
    }
    // each decode window: its steps, device time, bytes, share of the copy rate and the
    // longest the device waited for the host between two of its steps (cuda)
    if !m.decode_windows.is_empty() {
        let max_gap = m
            .decode_windows
            .iter()
            .map(|w| w.max_gap_s)
            .fold(0.0, f64::max);
        v["decode_max_gap_us"] = serde_json::json!(max_gap * 1e6);
        v["decode_windows"] = m
            .decode_windows
            .iter()
            .map(|w| {
                serde_json::json!({
                    "first_step": w.first_step,
                    "steps": w.steps,
                    "device_ms": w.device_s * 1e3,
                    "gb": w.bytes / 1e9,
                    "copy_frac": w.copy_frac(roof.copy_rate),
                    "max_gap_us": w.max_gap_s * 1e6,
                })
            })
            .collect();
    }
    for ((p, s), floor) in Phase::ALL.iter().zip(phase_s).zip(&roof.phase_s) {
        if *s > 0.0 && *floor > 0.0 {
            v[format!("{}_roofline_frac", phase_name(*p))] = serde_json::json!(floor / s);
        }
    }
    v
}

/// The plan's roofline per phase (`rollplex_plan::roofline`, phases in [`Phase::ALL`] order)
/// beside the time the run measured in each.
pub(super) struct RunRoofline {
    pub(super) phase_s: [f64; 4],
    pub(super) serial_s: f64,
    ceilings: &'static str,
    /// The device copy rate of the ceilings, bytes/s.
    copy_rate: f64,
    /// Measured seconds per phase and of whole iterations, summed, and the iterations.
    measured: [f64; 4],
    measured_total: f64,
    iterations: u32,
}

impl RunRoofline {
    pub(super) fn of(plan: &Plan) -> Self {
        let r = roofline(plan);
        let mut phase_s = [0.0; 4];
        for (p, roof) in &r.phases {
            phase_s[p.index()] = roof.seconds;
        }
        RunRoofline {
            phase_s,
            serial_s: r.serial_s,
            ceilings: r.ceilings.source,
            copy_rate: r.ceilings.bytes,
            measured: [0.0; 4],
            measured_total: 0.0,
            iterations: 0,
        }
    }

    fn add(&mut self, phase_s: &[f64; 4], dt: Duration) {
        for (m, s) in self.measured.iter_mut().zip(phase_s) {
            *m += s;
        }
        self.measured_total += dt.as_secs_f64();
        self.iterations += 1;
    }

    /// Mean achieved time per phase and per iteration against the roofline (printed at the
    /// end of a run).
    fn summary(&self) -> String {
        if self.iterations == 0 {
            return String::new();
        }
        let n = self.iterations as f64;
        let mut s = format!(
            "roofline ({}): per iteration {:.3} s achieved, {:.3} s roofline ({:.1}%)\n",
            self.ceilings,
            self.measured_total / n,
            self.serial_s,
            100.0 * self.serial_s * n / self.measured_total.max(1e-12)
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            let (m, floor) = (self.measured[i] / n, self.phase_s[i]);
            if floor > 0.0 || m >= 5e-4 {
                s.push_str(&format!(
                    "  {:<8} {:>8.3} s achieved, {:>8.3} s roofline ({:.1}%)\n",
                    phase_name(*p),
                    m,
                    floor,
                    if m > 0.0 { 100.0 * floor / m } else { 0.0 }
                ));
            }
        }
        s
    }
}
