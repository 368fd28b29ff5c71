//! Several plans of one job side by side in one process on the GPU: the models are built once,
//! then the plans run in turn, `--iterations` iterations each (iteration 0 of a run is its
//! warm-up: NVRTC, GEMM plans, pool growth), for `--rounds` rounds (plan A, B, C, A, B, C, ...).
//! Prints per plan the warm iterations' median wall time, phases (sums of task device times,
//! as `rollplex-run`'s metrics), peak device memory and predicted time, and every plan's ratio
//! to the first; with `--trace-dir` one Perfetto trace per plan run.
//!
//! The plans must train the same actor (model, weights, reference, loss, optimizer, freezing);
//! they may differ in schedule (serial / overlap), prefix dedup, decode window, batch. Timing
//! only: the actor keeps training from run to run (each run's optimizer steps move it), which
//! changes no timing of a job with forced response lengths (every run of a plan draws the same
//! lengths per iteration index), but the numbers of run k are not those of a fresh run.
//!
//! With `--profile-dir DIR`, every plan run also records what `rollplex-run --profile` records
//! (`exec::profile`: times alone, and for an overlap plan its decode windows cut by step beside
//! the side work) and writes `DIR/STEM.r{round}.profile.yaml` as soon as the run is done (STEM the
//! plan file's stem, `STEM.pI` where plans share one: `exec::profile::plan_file_stems`), and a
//! line `STEM round mode median_s predicted_s iteration_s...` to `DIR/measured.tsv` (the warm
//! iterations), so a run cut short by a time limit keeps what it finished; merge the profiles
//! with `rollplexc merge-profiles` (`runtime/examples/corun_calibrate.sh` does it all). Each
//! overlap plan with a serial plan of the same job in the run is then printed against overlap's
//! free bound from that serial run's profile (`rollplex_cost::bound`): the measured speedup, the
//! bound and the share of the bound's headroom captured.
//!
//! With `--placed` the models are built for the plan they run (`build_gpu_models_for`: its
//! device arena allocated once, the weights, optimizer state and every iteration's kept buffers
//! at the plan's offsets, as `rollplex-run` does), again from the host actor for a plan of
//! another arena layout (so the actor does not carry its training from plan to plan then).
//! Without it the models and every buffer come from the memory pool, reserved to the plan's
//! arena size, and a plan's reloads and offloads move nothing (so `--profile-dir` measures the
//! host link's rates only with `--placed`).
//!
//! With `--eager-decode` decode steps are launched one kernel at a time instead of replayed as
//! CUDA graphs (`rollplex-run --eager-decode`: the same bits). With `--task-log` each task and
//! each decode window's host split (launching steps and side pieces, waiting; the window's
//! device time and longest gap between steps) go to stderr as `rollplex-run --task-log` prints
//! them. With `--kernel-times` every launch made eagerly (and each decode step's graph replay) is
//! timed on the device (`Gpu::set_kernel_times`, `ROLLPLEX_KERNEL_TIMES=1` in `rollplex-run`)
//! and each plan's warm iterations get a table per (task kind, kernel): milliseconds an
//! iteration, calls, and the GEMMs' rates (the timing's events sit between kernels: the
//! iteration itself runs a little slower).
//!
//! Usage: iteration_bench PLAN.bin... [--iterations 2] [--rounds 2] [--trace-dir DIR]
//! [--profile-dir DIR] [--placed] [--eager-decode] [--task-log] [--kernel-times]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rollplex_kernels::cuda::{kernel_times_table, merge_kernel_times, KernelTime};
use rollplex_plan::plan::{Plan, Task};
use rollplex_plan::spec::{DatasetSpec, Mode};
use rollplex_runtime::exec::gpu::{
    build_gpu_models, build_gpu_models_for, check_gpu_plan, check_host_memory, open_gpu,
    run_gpu_loop_with, GpuExecOptions, PlanStreams,
};
use rollplex_runtime::exec::profile::{plan_file_stems, Execution, ProfileRecorder};
use rollplex_runtime::exec::{
    self, DecodeWindow, ExecError, IterationResult, LoopModels, LoopObserver,
};
use rollplex_runtime::trace::PlanTrace;

/// One plan run's measurements (warm iterations only).
#[derive(Default)]
struct Run {
    wall: Vec<f64>,
    phases: Vec<[f64; 4]>,
    peak: Vec<f64>,
    tokens: Vec<usize>,
    /// Per warm iteration: decode steps, their device seconds and least bytes, the rows they
    /// ran and the live samples among them.
    decode: Vec<(u32, f64, f64, u64, u64)>,
    /// The warm iterations' decode windows.
    windows: Vec<DecodeWindow>,
    /// A serial plan's free bound of overlap, from its run's profile (`--profile-dir`; the last
    /// round's).
    bound: Option<rollplex_cost::bound::FreeBound>,
    /// `--kernel-times`: the warm iterations' timed launches, per (task kind, kernel).
    kernels: Vec<KernelTime>,
}

struct Observer<'a> {
    run: &'a mut Run,
    phase_s: [f64; 4],
    trace: Option<PlanTrace>,
    profile: Option<ProfileRecorder>,
    /// `--kernel-times`: each iteration's timed launches taken at its end (the warm-up's dropped).
    kernel_times: bool,
}

impl LoopObserver for Observer<'_> {
    fn iteration_started(&mut self, _: u32, _: usize) {
        self.phase_s = [0.0; 4];
        if let Some(p) = &mut self.profile {
            p.begin_iteration(Instant::now());
        }
    }
    fn task_done(&mut self, it: u32, task: &Task, start: Instant, end: Instant) {
        if let Some(p) = task.op.phase(task.window.is_some()) {
            let i = p.index();
            self.phase_s[i] += end.duration_since(start).as_secs_f64();
        }
        if let Some(t) = &mut self.trace {
            t.task(it, task, start, end);
        }
        if let Some(p) = &mut self.profile {
            p.record_instants(task, start, end);
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
        models: LoopModels<'_>,
        start: Instant,
        wall: Duration,
    ) -> Result<(), ExecError> {
        if let (true, LoopModels::Gpu(m)) = (self.kernel_times, models) {
            let times = m
                .gpu
                .take_kernel_times()
                .map_err(|e| ExecError::Gpu(e.into()))?;
            if it > 0 {
                merge_kernel_times(&mut self.run.kernels, times);
            }
        }
        if let Some(t) = &mut self.trace {
            t.iteration(it, start, start + wall);
        }
        if let Some(p) = &mut self.profile {
            p.end_iteration(it, wall);
        }
        if it > 0 {
            self.run.wall.push(wall.as_secs_f64());
            self.run.phases.push(self.phase_s);
            self.run
                .peak
                .push(r.metrics.peak_mem_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64);
            self.run.tokens.push(r.response_tokens());
            let m = &r.metrics;
            self.run.decode.push((
                m.decode_steps,
                m.decode_device_s,
                m.decode_bytes,
                m.decode_rows,
                m.decode_live_rows,
            ));
            self.run.windows.extend_from_slice(&m.decode_windows);
        }
        Ok(())
    }
}

/// The runtime's median (the mean of the middle two for an even count, as `measured.tsv` and
/// the profiles take it), NaN when empty.
fn median(v: &[f64]) -> f64 {
    rollplex_runtime::exec::profile::median(v).unwrap_or(f64::NAN)
}

fn arg(args: &mut Vec<String>, name: &str) -> Option<String> {
    let i = args.iter().position(|a| a == name)?;
    let v = args.get(i + 1).cloned();
    args.drain(i..(i + 2).min(args.len()));
    v
}

/// What every plan must share with the first (the models and optimizer are built once).
fn check_same_job(a: &Plan, b: &Plan, name: &str) -> Result<()> {
    let (x, y) = (&a.spec, &b.spec);
    if x.actor != y.actor
        || x.reference.enabled != y.reference.enabled
        || x.train.optimizer != y.train.optimizer
        || x.train.algorithm != y.train.algorithm
        || x.train.freeze_vision != y.train.freeze_vision
        || x.train.freeze_merger != y.train.freeze_merger
        || x.rollout.sampling.temperature != y.rollout.sampling.temperature
    {
        bail!(
            "{name} trains another job than the first plan (actor, reference, loss, optimizer, \
             freezing or temperature differ): one process builds one set of models"
        );
    }
    Ok(())
}

/// `--profile-dir`: the run's profile, and its line of `measured.tsv` (appended, so a run cut
/// short keeps the plans it finished). A profile that cannot be fitted is reported and the
/// bench goes on (the measured times are still written): one plan's bad measurement must not
/// cost the run the plans after it. Returns the profile written, if one was.
fn write_measured(
    dir: &std::path::Path,
    stem: &str,
    round: u32,
    plan: &Plan,
    rec: &ProfileRecorder,
) -> Result<Option<rollplex_cost::Profile>> {
    use std::io::Write;
    let path = dir.join(format!("{stem}.r{round}.profile.yaml"));
    let written = match rec.write(&path) {
        Ok(m) => {
            println!(
                "profile {}: {} points, {} beside points; measured median {:.3} s, predicted {:.3} s",
                path.display(),
                m.profile.points.len(),
                m.profile.beside_points.len(),
                m.iteration_median_s,
                plan.predicted.iteration_s
            );
            Some(m.profile)
        }
        Err(e) => {
            eprintln!("warning: no profile for {stem} (round {round}): {e}");
            None
        }
    };
    let tsv = dir.join("measured.tsv");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&tsv)
        .with_context(|| format!("opening {}", tsv.display()))?;
    let iters: Vec<String> = rec
        .iterations_s()
        .iter()
        .map(|t| format!("{t:.6}"))
        .collect();
    writeln!(
        f,
        "{stem}\t{round}\t{}\t{:.6}\t{:.6}\t{}",
        format!("{:?}", plan.mode).to_lowercase(),
        rec.iteration_median_s().unwrap_or(f64::NAN),
        plan.predicted.iteration_s,
        iters.join("\t")
    )
    .with_context(|| format!("writing {}", tsv.display()))?;
    Ok(written)
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let iterations: u32 = arg(&mut args, "--iterations")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(2);
    let rounds: u32 = arg(&mut args, "--rounds")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(2);
    let trace_dir = arg(&mut args, "--trace-dir").map(PathBuf::from);
    let profile_dir = arg(&mut args, "--profile-dir").map(PathBuf::from);
    let mut flag = |name: &str| match args.iter().position(|a| a == name) {
        Some(i) => {
            args.remove(i);
            true
        }
        None => false,
    };
    let placed = flag("--placed");
    let kernel_times = flag("--kernel-times");
    let options = GpuExecOptions {
        eager_decode: flag("--eager-decode"),
        task_log: flag("--task-log"),
        ..GpuExecOptions::default()
    };
    if args.is_empty() || iterations < 2 {
        bail!("usage: iteration_bench PLAN.bin... [--iterations N >= 2] [--rounds R] [--trace-dir DIR] [--profile-dir DIR] [--placed] [--eager-decode] [--task-log] [--kernel-times]");
    }
    if let Some(dir) = &profile_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating --profile-dir {}", dir.display()))?;
    }
    let plans: Vec<(String, Plan)> = args
        .iter()
        .map(|p| {
            let plan = rollplex_runtime::cli::load_plan(std::path::Path::new(p))?;
            Ok((p.clone(), plan))
        })
        .collect::<Result<_, ExecError>>()?;
    for (name, p) in &plans[1..] {
        check_same_job(&plans[0].1, p, name)?;
    }
    // a machine without a GPU is told so before the host model (tens of GB at 7B) is built
    {
        let gpu = open_gpu()?;
        for (name, p) in &plans {
            check_gpu_plan(p, &gpu).with_context(|| name.clone())?;
            check_host_memory(p).with_context(|| name.clone())?;
        }
    }
    let t0 = Instant::now();
    let actor = if placed {
        Some(exec::host_actor(&plans[0].1.spec)?)
    } else {
        None
    };
    let host_s = t0.elapsed().as_secs_f64();
    let models = match &actor {
        Some(a) => build_gpu_models_for(&plans[0].1, a),
        None => build_gpu_models(&plans[0].1.spec),
    }
    .context("building the models")?;
    let models_gpu_name = models.gpu.name().to_string();
    if kernel_times {
        models.gpu.set_kernel_times(true);
    }
    let mut slot = Some(models);
    println!(
        "device {}; models built in {:.1} s ({}); {} plans x {rounds} rounds x {iterations} iterations (the first of each run is warm-up)",
        models_gpu_name,
        t0.elapsed().as_secs_f64(),
        if placed {
            format!("the host model {host_s:.1} s, then the device's at the first plan's arena offsets")
        } else {
            "from the memory pool".to_string()
        },
        plans.len()
    );
    let mut runs: Vec<Run> = (0..plans.len()).map(|_| Run::default()).collect();
    let names: Vec<&str> = plans.iter().map(|(n, _)| n.as_str()).collect();
    let stems = plan_file_stems(&names);
    for round in 0..rounds {
        for (i, (name, plan)) in plans.iter().enumerate() {
            if let (Some(a), Some(arena)) = (&actor, &slot.as_ref().and_then(|m| m.arena.as_ref()))
            {
                if !arena.fits(plan) {
                    print!("{}", arena.report());
                    // one arena at a time: the old models go first
                    drop(slot.take());
                    let t = Instant::now();
                    slot = Some(build_gpu_models_for(plan, a).context("building the models")?);
                    println!(
                        "{name}: another arena layout; device models rebuilt in {:.1} s",
                        t.elapsed().as_secs_f64()
                    );
                }
            }
            let models = slot.as_mut().expect("built above");
            let spec = &plan.spec;
            let mut source: Box<dyn exec::prompts::PromptSource> = match &spec.rollout.dataset {
                DatasetSpec::Synthetic => Box::new(exec::prompts::SyntheticPrompts::new(spec)),
                other => exec::data_source(spec, other)?,
            };
            let mut reward = exec::reward_fn(spec)?;
            let profile = match &profile_dir {
                Some(_) => {
                    // as rollplex-run: partitions where green contexts work, else shared SMs
                    let execution = if PlanStreams::new(plan, &models.gpu)?.green() {
                        Execution::Partitioned
                    } else {
                        Execution::Shared
                    };
                    // the host link's rates from the copies a placed plan moves (`--placed`)
                    let copies = models.arena.as_ref().map(|a| a.copying_tasks(plan));
                    Some(
                        ProfileRecorder::for_run(plan, "cuda", execution, iterations)?
                            .measure_host_copies(copies.into_iter().flatten()),
                    )
                }
                None => None,
            };
            let mut obs = Observer {
                run: &mut runs[i],
                phase_s: [0.0; 4],
                trace: trace_dir.as_ref().map(|_| PlanTrace::new(plan, "cuda")),
                profile,
                kernel_times,
            };
            run_gpu_loop_with(
                plan,
                models,
                source.as_mut(),
                reward.as_mut(),
                0..iterations,
                &mut obs,
                options,
            )
            .with_context(|| format!("running {name}"))?;
            let stem = &stems[i];
            if let (Some(dir), Some(t)) = (&trace_dir, obs.trace.take()) {
                std::fs::create_dir_all(dir)?;
                let path = dir.join(format!("{stem}.r{round}.json"));
                std::fs::write(&path, serde_json::to_string(&t.to_json())?)?;
            }
            if let (Some(dir), Some(rec)) = (&profile_dir, obs.profile.take()) {
                let profile = write_measured(dir, stem, round, plan, &rec)?;
                if plan.mode == Mode::Serial {
                    runs[i].bound = profile.and_then(|p| rollplex_cost::bound::free_bound(&p).ok());
                }
            }
            let r = &runs[i];
            let warm = iterations as usize - 1;
            let plan_peak = plan.memory.max_peak();
            println!(
                "round {round} {name}: warm iterations {:?} s; device peak {:?} GiB (plan {:.2})",
                &r.wall[r.wall.len() - warm..],
                &r.peak[r.peak.len() - warm..],
                plan_peak as f64 / (1u64 << 30) as f64
            );
        }
    }
    if let Some(a) = slot.as_ref().and_then(|m| m.arena.as_ref()) {
        print!("{}", a.report());
    }
    println!();
    println!(
        "{:<36} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>9}",
        "plan",
        "iter_s",
        "rollout",
        "scoring",
        "train",
        "sync",
        "mem_GiB",
        "tokens",
        "plan_s",
        "vs first"
    );
    let base = median(&runs[0].wall);
    for ((name, plan), r) in plans.iter().zip(&runs) {
        let m = median(&r.wall);
        let ph: Vec<f64> = (0..4)
            .map(|k| median(&r.phases.iter().map(|p| p[k]).collect::<Vec<_>>()))
            .collect();
        println!(
            "{:<36} {:>9.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.2} {:>9} {:>8.3} {:>8.3}x",
            file_name(name),
            m,
            ph[0],
            ph[1],
            ph[2],
            ph[3],
            median(&r.peak),
            r.tokens.first().copied().unwrap_or(0),
            plan.predicted.iteration_s,
            base / m
        );
    }
    println!("(vs first: the first plan's median iteration time / this plan's; above 1 is faster)");
    if kernel_times {
        for ((name, _), r) in plans.iter().zip(&runs) {
            println!();
            println!(
                "kernel times, {} (warm iterations; per task kind, eager launches and decode graph replays):",
                file_name(name)
            );
            print!(
                "{}",
                kernel_times_table(&r.kernels, r.wall.len() as u32, 0.005)
            );
        }
    }
    // decode against the copy rate: the steps' device time, the least bytes they moved
    let copy = rollplex_plan::roofline::roofline(&plans[0].1)
        .ceilings
        .bytes;
    println!(
        "\n{:<36} {:>6} {:>9} {:>9} {:>9} {:>10} {:>17} {:>11} {:>9} {:>6}",
        "decode (warm iterations)",
        "steps",
        "device_s",
        "ms/step",
        "GB/step",
        "copy_frac",
        "windows min..max",
        "max gap us",
        "rows/step",
        "live"
    );
    for ((name, _), r) in plans.iter().zip(&runs) {
        let steps: u32 = r.decode.iter().map(|d| d.0).sum();
        let s: f64 = r.decode.iter().map(|d| d.1).sum();
        let b: f64 = r.decode.iter().map(|d| d.2).sum();
        let rows: u64 = r.decode.iter().map(|d| d.3).sum();
        let live: u64 = r.decode.iter().map(|d| d.4).sum();
        let n = r.decode.len().max(1) as f64;
        let fracs = r.windows.iter().map(|w| 100.0 * w.copy_frac(copy));
        let lo = fracs.clone().fold(f64::INFINITY, f64::min);
        let hi = fracs.fold(0.0, f64::max);
        let gap = r.windows.iter().map(|w| w.max_gap_s).fold(0.0, f64::max);
        println!(
            "{:<36} {:>6.0} {:>9.3} {:>9.3} {:>9.3} {:>9.1}% {:>7.1}..{:>7.1}% {:>11.1} {:>9.1} {:>5.1}%",
            file_name(name),
            steps as f64 / n,
            s / n,
            1e3 * s / steps.max(1) as f64,
            b / 1e9 / steps.max(1) as f64,
            100.0 * b / s.max(1e-12) / copy,
            lo,
            hi,
            gap * 1e6,
            rows as f64 / steps.max(1) as f64,
            100.0 * live as f64 / rows.max(1) as f64
        );
    }
    print_overlap_bounds(&plans, &runs);
    Ok(())
}

/// A plan path's file name, as the tables print it.
fn file_name(path: &str) -> String {
    std::path::Path::new(path)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// With `--profile-dir`: each overlap plan against the serial plan of the same job in this
/// process (the same spec but for the mode), side by side with the free bound from that serial
/// run's profile and the share of the bound's headroom captured (`FreeBound::captured`).
fn print_overlap_bounds(plans: &[(String, Plan)], runs: &[Run]) {
    let mut header = false;
    for ((oname, o), orun) in plans.iter().zip(runs) {
        if o.mode != Mode::Overlap {
            continue;
        }
        let serial = plans.iter().zip(runs).find(|((_, s), _)| {
            let mut as_overlap = s.spec.clone();
            as_overlap.schedule.mode = Mode::Overlap;
            s.mode == Mode::Serial && as_overlap == o.spec
        });
        let Some(((sname, _), srun)) = serial else {
            continue;
        };
        let Some(b) = &srun.bound else { continue };
        if !header {
            println!(
                "\n{:<36} {:<24} {:>9} {:>9} {:>10} {:>9}",
                "overlap against its free bound",
                "serial",
                "serial_s",
                "overlap_s",
                "measured",
                "bound"
            );
            header = true;
        }
        let (ts, to) = (median(&srun.wall), median(&orun.wall));
        let measured = ts / to;
        println!(
            "{:<36} {:<24} {:>9.3} {:>9.3} {:>9.3}x {:>8.3}x  captured {}",
            file_name(oname),
            file_name(sname),
            ts,
            to,
            measured,
            b.speedup(),
            b.captured(measured)
                .map_or("- (no headroom)".into(), |c| format!("{:.0}%", 100.0 * c))
        );
    }
}
