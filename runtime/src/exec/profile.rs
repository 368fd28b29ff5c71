//! Measured profiles: what `rollplex-run --profile OUT.yaml` writes and `rollplexc --profile`
//! reads (the format of `rollplex_cost::Profile`, docs/cost-model.md "Profiles").
//!
//! A [`ProfileRecorder`] hangs off a backend's [`super::LoopObserver`] (as the trace does: the
//! cpu run's observer forwards `iteration_started` / `task_done` / `iteration_done` to
//! [`ProfileRecorder::begin_iteration`] / [`ProfileRecorder::record_instants`] /
//! [`ProfileRecorder::end_iteration`]; the cuda loop's observer does the same with its event
//! times): it keeps each task's durations after the warm-up iterations, and at the end turns the median
//! duration of every task that ran *alone* into one `Point {kind, sms, work, seconds}` (work
//! and kind from the plan), which [`Profile::fit`] turns into the per-kind curves the compiler
//! plans with.
//!
//! Which measurements are times alone, and on how many SMs, depends on how the backend ran the
//! tasks ([`Execution`]): a task's time while another task ran beside it is not its time alone,
//! and the cost model's `points` are times alone (co-runs are priced separately).
//! - [`Execution::OneAtATime`] (the cpu backend): the walker runs one task at a time and every
//!   task uses the whole device (rayon over all cores; SM partitions are not enforced), so every
//!   task is a point on all of the GPU's SMs, whatever its plan share was;
//! - [`Execution::Partitioned`] (cuda with green contexts): a task is a point only in the
//!   iterations in which no other task's measured interval overlapped its own, on its plan SM
//!   share (`task.sms`: the window's partition, or the whole GPU);
//! - [`Execution::Shared`] (cuda on plain streams): as `Partitioned`, but a task alone had the
//!   whole GPU.
//!
//! Tasks that co-ran in some iterations and ran alone in others keep only the alone runs; tasks
//! that never ran alone are counted in the file's header, not turned into points. One run gives
//! no co-run points: a [`rollplex_cost::CorunPoint`] needs each side's time alone on the same
//! partition, which one run of one plan does not measure.
//!
//! Invariants: at least the first iteration is warm-up and never measured; a point's `seconds`
//! is a median of measured durations (positive, finite); tasks whose work the cost model cannot
//! scale (no flops, bytes, steps, host or network bytes) are listed, never fitted.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use rollplex_cost::{Point, Profile};
use rollplex_plan::plan::{Plan, Task};
use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::{Work, WorkKind};
use rollplex_plan::TaskId;

use super::ExecError;

/// How a backend ran the tasks of an iteration: decides which measured durations are times
/// alone and on how many SMs (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Execution {
    /// One task at a time, each with the whole device (cpu backend).
    OneAtATime,
    /// Tasks on their plan SM partitions, possibly overlapping in time (cuda, green contexts).
    Partitioned,
    /// Tasks on shared SMs, possibly overlapping in time (cuda, plain streams).
    Shared,
}

impl Execution {
    /// One line for the profile's header and source.
    pub fn describe(self) -> &'static str {
        match self {
            Execution::OneAtATime => {
                "one task at a time, each on the whole device: every task ran alone on all SMs"
            }
            Execution::Partitioned => {
                "tasks on their plan SM partitions, overlapping: a task's run counts only when no other task overlapped it"
            }
            Execution::Shared => {
                "tasks on shared SMs, overlapping: a task's run counts only when no other task overlapped it (on all SMs)"
            }
        }
    }
}

/// What was measured of one task of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskStat {
    pub task: TaskId,
    pub name: String,
    pub kind: WorkKind,
    /// SMs the task had when it ran alone (see [`Execution`]).
    pub sms: u32,
    pub work: Work,
    /// The plan's predicted duration (`end_s - start_s`), seconds.
    pub predicted_s: f64,
    /// Measured durations of the runs it ran alone, seconds, in iteration order.
    pub alone_s: Vec<f64>,
    /// Measured iterations in which it overlapped another task.
    pub co_ran: u32,
}

impl TaskStat {
    /// Median of the alone runs, if any.
    pub fn median_s(&self) -> Option<f64> {
        median(&self.alone_s)
    }
}

/// Measured against predicted time of one kind's tasks ([`ProfileRecorder::kind_sums`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KindSum {
    pub kind: WorkKind,
    pub tasks: u32,
    /// Sum of the tasks' median alone times, seconds.
    pub measured_s: f64,
    /// Sum of the plan's predicted durations of the same tasks, seconds.
    pub predicted_s: f64,
}

/// Median of `xs` (mean of the middle two for an even count); `None` when empty.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Whether the cost model can scale `work` (some amount it charges time for is positive).
fn modelled(w: &Work) -> bool {
    w.flops > 0.0 || w.bytes > 0.0 || w.steps > 0 || w.host_bytes > 0.0 || w.net_bytes > 0.0
}

/// Records task durations of a run and turns them into a [`Profile`] (see the module doc).
pub struct ProfileRecorder {
    gpu: GpuSpec,
    plan_name: String,
    plan_mode: String,
    backend: String,
    execution: Execution,
    warmup: u32,
    /// The plan's predicted iteration time, seconds.
    predicted_iteration_s: f64,
    /// Iterations seen so far (warm-up included).
    seen: u32,
    /// First and last measured iteration numbers.
    measured_range: Option<(u32, u32)>,
    stats: BTreeMap<TaskId, TaskStat>,
    /// Measured iterations' wall times, seconds.
    iterations_s: Vec<f64>,
    /// Measured iterations' time inside tasks that ran alone (sum of their durations), seconds.
    alone_sums_s: Vec<f64>,
    /// The running iteration: its origin and its tasks' intervals (seconds from the origin).
    origin: Option<Instant>,
    current: Vec<(TaskId, f64, f64)>,
    /// Task metadata, indexed by task id (kind, sms when alone, work, predicted, name).
    tasks: Vec<(String, WorkKind, u32, Work, f64)>,
}

impl ProfileRecorder {
    /// A recorder for runs of `plan` on `backend` (a name for the file), which runs tasks as
    /// `execution` says; the first `warmup` iterations (at least 1) are not measured.
    pub fn new(
        plan: &Plan,
        backend: &str,
        execution: Execution,
        warmup: u32,
    ) -> Result<Self, ExecError> {
        if warmup == 0 {
            return Err(ExecError::Machine(
                "a profile skips at least one warm-up iteration (caches, allocations, NVRTC): warm-up must be >= 1"
                    .into(),
            ));
        }
        let gpu = plan.spec.cluster.gpu.clone();
        let tasks = plan
            .tasks
            .iter()
            .map(|t| {
                let sms = match execution {
                    Execution::Partitioned => t.sms.clamp(1, gpu.sms.max(1)),
                    Execution::OneAtATime | Execution::Shared => gpu.sms.max(1),
                };
                (
                    t.name.clone(),
                    t.kind,
                    sms,
                    t.work.clone(),
                    (t.end_s - t.start_s).max(0.0),
                )
            })
            .collect();
        Ok(ProfileRecorder {
            gpu,
            plan_name: plan.spec.name.clone(),
            plan_mode: format!("{:?}", plan.mode).to_lowercase(),
            backend: backend.to_string(),
            execution,
            warmup,
            predicted_iteration_s: plan.predicted.iteration_s,
            seen: 0,
            measured_range: None,
            stats: BTreeMap::new(),
            iterations_s: Vec::new(),
            alone_sums_s: Vec::new(),
            origin: None,
            current: Vec::new(),
            tasks,
        })
    }

    /// The recorder of a run of `iterations` iterations (`--profile`): one warm-up iteration;
    /// refuses a run too short to measure anything, before it starts.
    pub fn for_run(
        plan: &Plan,
        backend: &str,
        execution: Execution,
        iterations: u32,
    ) -> Result<Self, ExecError> {
        let rec = ProfileRecorder::new(plan, backend, execution, 1)?;
        if iterations < rec.iterations_needed() {
            return Err(ExecError::Machine(format!(
                "--profile needs at least {} iterations in this run (the first is warm-up); this run has {iterations}",
                rec.iterations_needed()
            )));
        }
        Ok(rec)
    }

    /// Iterations needed for a profile: the warm-up plus one measured.
    pub fn iterations_needed(&self) -> u32 {
        self.warmup + 1
    }

    /// Starts an iteration; task times of [`ProfileRecorder::record`] are seconds from `origin`.
    pub fn begin_iteration(&mut self, origin: Instant) {
        self.origin = Some(origin);
        self.current.clear();
    }

    /// `task` ran from `start_s` to `end_s` (seconds from a common origin within the
    /// iteration: host clock or GPU events).
    pub fn record(&mut self, task: &Task, start_s: f64, end_s: f64) {
        if start_s.is_finite() && end_s.is_finite() && end_s >= start_s {
            self.current.push((task.id, start_s, end_s));
        }
    }

    /// `task` ran from `start` to `end` on the host clock (the cuda backend maps its events onto
    /// it); times are taken from the origin of [`ProfileRecorder::begin_iteration`], or from the
    /// first task's start if none was given.
    pub fn record_instants(&mut self, task: &Task, start: Instant, end: Instant) {
        let origin = *self.origin.get_or_insert(start);
        // signed: a backend may report device times from before the origin was taken
        let s = |t: Instant| match t.checked_duration_since(origin) {
            Some(d) => d.as_secs_f64(),
            None => -origin.duration_since(t).as_secs_f64(),
        };
        self.record(task, s(start), s(end));
    }

    /// Ends iteration `iteration` (wall time `wall`): decides which of its tasks ran alone and
    /// keeps their durations, unless it is a warm-up iteration.
    pub fn end_iteration(&mut self, iteration: u32, wall: Duration) {
        self.seen += 1;
        self.origin = None;
        let intervals = std::mem::take(&mut self.current);
        if self.seen <= self.warmup {
            return;
        }
        self.measured_range = Some(match self.measured_range {
            None => (iteration, iteration),
            Some((a, _)) => (a, iteration),
        });
        self.iterations_s.push(wall.as_secs_f64());
        let alone = alone_flags(&intervals, self.execution);
        self.alone_sums_s.push(
            intervals
                .iter()
                .zip(&alone)
                .filter(|(_, &a)| a)
                .map(|((_, s, e), _)| e - s)
                .sum(),
        );
        for ((id, start, end), alone) in intervals.into_iter().zip(alone) {
            let Some((name, kind, sms, work, predicted)) = self.tasks.get(id.index()) else {
                continue;
            };
            let stat = self.stats.entry(id).or_insert_with(|| TaskStat {
                task: id,
                name: name.clone(),
                kind: *kind,
                sms: *sms,
                work: work.clone(),
                predicted_s: *predicted,
                alone_s: Vec::new(),
                co_ran: 0,
            });
            if alone {
                stat.alone_s.push(end - start);
            } else {
                stat.co_ran += 1;
            }
        }
    }

    /// Measured iterations' wall times, seconds (warm-up excluded).
    pub fn iterations_s(&self) -> &[f64] {
        &self.iterations_s
    }

    /// Median measured iteration time, seconds.
    pub fn iteration_median_s(&self) -> Option<f64> {
        median(&self.iterations_s)
    }

    /// Every task measured, in task order.
    pub fn tasks(&self) -> impl Iterator<Item = &TaskStat> {
        self.stats.values()
    }

    /// Per kind (in kind order): tasks with alone runs, the sum of their medians and of their
    /// predicted durations.
    pub fn kind_sums(&self) -> Vec<KindSum> {
        let mut by: BTreeMap<WorkKind, KindSum> = BTreeMap::new();
        for s in self.stats.values() {
            let Some(m) = s.median_s() else { continue };
            let e = by.entry(s.kind).or_insert(KindSum {
                kind: s.kind,
                tasks: 0,
                measured_s: 0.0,
                predicted_s: 0.0,
            });
            e.tasks += 1;
            e.measured_s += m;
            e.predicted_s += s.predicted_s;
        }
        by.into_values().collect()
    }

    /// One point per task that ran alone in some measured iteration and whose work the cost
    /// model can scale: the median of its alone runs. In task order.
    pub fn points(&self) -> Vec<Point> {
        self.stats
            .values()
            .filter(|s| modelled(&s.work))
            .filter_map(|s| {
                let m = s.median_s()?;
                (m >= 1e-9).then(|| Point {
                    kind: s.kind,
                    sms: s.sms,
                    work: s.work.clone(),
                    // nanoseconds: what the clocks resolve
                    seconds: (m * 1e9).round() / 1e9,
                    note: format!(
                        "{} ({}): median of {} alone runs, min {:.3e} s, max {:.3e} s",
                        s.name,
                        s.task,
                        s.alone_s.len(),
                        s.alone_s.iter().copied().fold(f64::INFINITY, f64::min),
                        s.alone_s.iter().copied().fold(0.0, f64::max),
                    ),
                })
            })
            .collect()
    }

    /// Fits the profile: [`Profile::fit`] over [`ProfileRecorder::points`], its `source` saying
    /// what was run and how. Errors when nothing was measured.
    pub fn profile(&self) -> Result<MeasuredProfile, ExecError> {
        if self.iterations_s.is_empty() {
            return Err(ExecError::Machine(format!(
                "no iteration was measured: a profile needs at least {} iterations (the first {} are warm-up)",
                self.iterations_needed(),
                self.warmup
            )));
        }
        let points = self.points();
        if points.is_empty() {
            return Err(ExecError::Machine(
                "no task ran alone in a measured iteration, so there is no time alone to fit: \
                 profile a serial plan (rollplexc --mode serial)"
                    .into(),
            ));
        }
        let mut profile = Profile::fit(&self.gpu, points, Vec::new())
            .map_err(|e| ExecError::Data(format!("fitting the measured profile: {e}")))?;
        let (first, last) = self.measured_range.unwrap_or((0, 0));
        profile.source = format!(
            "rollplex-run --profile: plan {} ({}), backend {} ({}); iterations {first}..={last} measured \
             after {} warm-up, median per task",
            self.plan_name,
            self.plan_mode,
            self.backend,
            self.execution.describe(),
            self.warmup
        );
        Ok(MeasuredProfile {
            header: self.header(&profile),
            profile,
            iteration_median_s: self.iteration_median_s().unwrap_or(0.0),
        })
    }

    /// The YAML comment block of the written file: how it was measured, what was left out.
    fn header(&self, fitted: &Profile) -> String {
        let mut h = String::new();
        let mut line = |s: String| {
            h.push_str("# ");
            h.push_str(&s);
            h.push('\n');
        };
        line(format!(
            "Measured by rollplex-run --profile: plan `{}`, mode {}, backend {}.",
            self.plan_name, self.plan_mode, self.backend
        ));
        line(format!("Execution: {}.", self.execution.describe()));
        line(format!(
            "Rule: `points` are times alone only (medians per task over the measured iterations); \
             the first {} iteration(s) are warm-up and not measured; no co-run points (one run \
             does not measure each side alone on the same partition).",
            self.warmup
        ));
        let measured = self.iteration_median_s().unwrap_or(0.0);
        line(format!(
            "Measured iterations: {}, wall time median {measured:.6} s; the plan predicted {:.6} s \
             (predicted / measured = {:.3}).",
            self.iterations_s.len(),
            self.predicted_iteration_s,
            self.predicted_iteration_s / measured.max(1e-12)
        ));
        let sum_of_medians: f64 = self.stats.values().filter_map(TaskStat::median_s).sum();
        line(format!(
            "Time in tasks alone: sum of the tasks' medians {sum_of_medians:.6} s, median of the \
             iterations' sums {:.6} s (a gap is run-to-run variability: per-task medians drop \
             each task's slow runs, an iteration has some).",
            median(&self.alone_sums_s).unwrap_or(0.0)
        ));
        let never_alone: Vec<&str> = self
            .stats
            .values()
            .filter(|s| s.alone_s.is_empty())
            .map(|s| s.name.as_str())
            .collect();
        let co_ran: u32 = self.stats.values().map(|s| s.co_ran).sum();
        line(format!(
            "Runs that overlapped another task (not used): {co_ran}; tasks never alone: {}.",
            if never_alone.is_empty() {
                "none".to_string()
            } else {
                never_alone.join(", ")
            }
        ));
        let unmodelled: Vec<String> = self
            .stats
            .values()
            .filter(|s| !modelled(&s.work))
            .filter_map(|s| Some(format!("{} {:.3e} s", s.name, s.median_s()?)))
            .collect();
        line(format!(
            "Tasks with no work the cost model scales (not fitted; median alone): {}.",
            if unmodelled.is_empty() {
                "none".to_string()
            } else {
                unmodelled.join(", ")
            }
        ));
        line(
            "Per kind, seconds summed over its tasks: measured medians; the plan's prediction; \
             the fitted model's (this file's curves)."
                .into(),
        );
        let model = rollplex_cost::CostModel::new(&fitted.gpu, Some(fitted));
        for k in self.kind_sums() {
            let refit: f64 = fitted
                .points
                .iter()
                .filter(|p| p.kind == k.kind)
                .map(|p| model.time(p.kind, &p.work, p.sms))
                .sum();
            line(format!(
                "  {:<16} {:>3} tasks  measured {:.6}  plan {:.6} ({:.2}x)  fitted {:.6} ({:.2}x)",
                rollplex_cost::defaults::kind_name(k.kind),
                k.tasks,
                k.measured_s,
                k.predicted_s,
                k.predicted_s / k.measured_s.max(1e-12),
                refit,
                refit / k.measured_s.max(1e-12)
            ));
        }
        line(
            "Recompile with it: rollplexc PIPELINE.rpx --profile THIS.yaml (same GPU name: \
             the measured absolute rates hold)."
                .to_string(),
        );
        h
    }
}

impl ProfileRecorder {
    /// Fits the profile and writes it to `path` atomically (a temporary file beside it, then a
    /// rename); returns what was written.
    pub fn write(&self, path: &Path) -> Result<MeasuredProfile, ExecError> {
        let measured = self.profile()?;
        let io = |p: &Path| {
            let p = p.display().to_string();
            move |source| ExecError::Io { path: p, source }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, measured.to_yaml()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(path)(e)
        })?;
        Ok(measured)
    }
}

/// A fitted profile of a run, with the header that says how it was measured.
#[derive(Clone, Debug)]
pub struct MeasuredProfile {
    pub profile: Profile,
    /// YAML comment lines (`# ...`).
    pub header: String,
    /// Median measured iteration wall time, seconds.
    pub iteration_median_s: f64,
}

impl MeasuredProfile {
    /// The file's text: the header, then the profile (what `Profile::from_yaml` reads).
    pub fn to_yaml(&self) -> String {
        format!("{}{}", self.header, self.profile.to_yaml())
    }
}

/// For each interval, whether it ran alone: always under [`Execution::OneAtATime`]; else
/// whether no other interval of the iteration overlaps it (touching ends do not overlap).
fn alone_flags(intervals: &[(TaskId, f64, f64)], execution: Execution) -> Vec<bool> {
    if execution == Execution::OneAtATime {
        return vec![true; intervals.len()];
    }
    let mut order: Vec<usize> = (0..intervals.len()).collect();
    order.sort_by(|&a, &b| intervals[a].1.total_cmp(&intervals[b].1));
    let mut alone = vec![true; intervals.len()];
    let mut max_end = f64::NEG_INFINITY;
    let mut max_at: Option<usize> = None;
    for (k, &i) in order.iter().enumerate() {
        let (_, start, end) = intervals[i];
        if max_end > start {
            alone[i] = false;
            if let Some(j) = max_at {
                alone[j] = false;
            }
        }
        if let Some(&next) = order.get(k + 1) {
            if intervals[next].1 < end {
                alone[i] = false;
            }
        }
        if end > max_end {
            max_end = end;
            max_at = Some(i);
        }
    }
    alone
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(spans: &[(f64, f64)]) -> Vec<(TaskId, f64, f64)> {
        spans
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| (TaskId(i as u32), a, b))
            .collect()
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn overlapping_intervals_are_not_alone() {
        // 0 alone; 1 and 2 overlap; 3 touches 2's end (alone); 4 lies inside 5
        let spans = [
            (0.0, 1.0),
            (1.0, 3.0),
            (2.0, 4.0),
            (4.0, 5.0),
            (6.5, 7.0),
            (6.0, 9.0),
        ];
        let got = alone_flags(&iv(&spans), Execution::Partitioned);
        assert_eq!(got, vec![true, false, false, true, false, false]);
        // a long task overlapping a later short one that starts after an intermediate one
        let spans = [(0.0, 10.0), (1.0, 2.0), (3.0, 4.0), (11.0, 12.0)];
        let got = alone_flags(&iv(&spans), Execution::Shared);
        assert_eq!(got, vec![false, false, false, true]);
        assert!(alone_flags(&iv(&spans), Execution::OneAtATime)
            .iter()
            .all(|&a| a));
    }
}
