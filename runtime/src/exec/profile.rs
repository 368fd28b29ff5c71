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
//! that never ran alone are counted in the file's header, not turned into points.
//!
//! Host copies (the plan's `Offload` and `Reload` tasks) are no points: their time is the host
//! link's, not a curve's. On a backend whose copies move data (the cuda executor's copies of
//! state the plan keeps on the host, [`ProfileRecorder::measure_host_copies`]) they give the
//! profile's measured host rates, per direction: each copy task's median run over the measured
//! iterations, and the rate is the direction's bytes over the sum of those medians
//! ([`rollplex_cost::HostCopies`]; `host_bw` host -> device from the reloads, `host_bw_to_host`
//! device -> host from the offloads). Copies run on the plan's copy stream, on the copy
//! engines and not on SMs, so every run counts, whether or not compute ran beside it (what an
//! overlap plan does: the reference weights reloaded beside decode). Copies that move nothing
//! (the cpu backend, one address space; kept prefix chunks, which the cuda executor keeps on
//! the device) measure no rate: the header says so, and the cost model keeps the GPU spec's.
//!
//! Co-running (a run of an overlap plan): one run gives no [`rollplex_cost::CorunPoint`] (that
//! needs each side's time alone on the same partition), but it gives what the planner prices
//! a decode window with: the cuda backend marks every decode step on the device
//! ([`ProfileRecorder::record_steps`]), and a decode window that co-ran is cut into its steps
//! ([`classify_steps`]):
//! - steps nothing ran beside (after the window's side work, or before it) are decode alone on
//!   the window's partition: one point per window, its work the window's prorated by the share
//!   of the window's steps they are (per measured iteration, averaged);
//! - steps that side tasks of one kind covered wholly are decode beside that kind: a
//!   [`BesidePoint`] per window and kind (prorated and averaged the same way);
//! - steps partly covered, or beside several kinds, are dropped (a window's boundary steps);
//! - a side task whose run lay wholly inside a decode window's and overlapped nothing else is
//!   that kind beside decode on the side partition: a [`BesidePoint`] of its median.
//!
//! [`Profile::fit_all`] turns beside points into ordered slowdowns against the fitted curves.
//! Beside points need partitions: under [`Execution::Shared`] (plain streams sharing the SMs),
//! and in a window without a split that something overlapped (a copy, a side task running
//! over from the window before), only the alone steps count. Host work (reward) neither slows nor is slowed
//! (the cost model's rule), so it is ignored when steps are classified. Prorating by steps
//! assumes a window's steps cost alike; they do not quite (the active samples fall and the KV
//! grows through a window), a bias of a few percent on a 64-step window.
//!
//! Invariants: at least the first iteration is warm-up and never measured; a point's `seconds`
//! is a median of measured durations (positive, finite), or for a window's steps a mean over
//! the measured iterations; tasks whose work the cost model cannot scale (no flops, bytes,
//! steps, host or network bytes) are listed, never fitted; a measured host rate counts only
//! copies the backend said move data, each with its host bytes and median run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rollplex_cost::defaults::is_host;
use rollplex_plan::plan::{Op, Plan, Task};
use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::{HostDir, Work, WorkKind};
use rollplex_plan::TaskId;

use super::ExecError;

mod fit;

pub use fit::MeasuredProfile;

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

/// The names a run over several plans gives each plan's output files (`iteration_bench
/// --profile-dir` / `--trace-dir`): the plan file's stem, and where two plans share a stem (the
/// same file name in two folders) `STEM.pI` with I the plan's position on the command line, so
/// that no plan's files overwrite another's.
pub fn plan_file_stems(paths: &[&str]) -> Vec<String> {
    let stems: Vec<String> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            std::path::Path::new(p)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| format!("plan{i}"))
        })
        .collect();
    stems
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if stems.iter().filter(|t| *t == s).count() > 1 {
                format!("{s}.p{i}")
            } else {
                s.clone()
            }
        })
        .collect()
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

/// What ran beside one decode step ([`classify_steps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StepSide {
    /// No GPU work of another task overlapped the step.
    Alone,
    /// Tasks of this one kind covered the whole step.
    Beside(WorkKind),
    /// Covered in part, or by tasks of several kinds: not used.
    Mixed,
}

/// For each decode step `[marks[i], marks[i + 1]]` (seconds, ascending), what of `others`
/// (other tasks' `(kind, start, end)` in the same iteration; host work left out by the
/// caller) ran beside it: nothing, one kind over the whole step (several back-to-back tasks
/// of it may share the step), or something else. Touching ends do not overlap.
pub fn classify_steps(marks: &[f64], others: &[(WorkKind, f64, f64)]) -> Vec<StepSide> {
    marks
        .windows(2)
        .map(|m| {
            let (a, b) = (m[0], m[1]);
            let mut over: Vec<(WorkKind, f64, f64)> = others
                .iter()
                .filter(|&&(_, s, e)| s < b && e > a)
                .map(|&(k, s, e)| (k, s.max(a), e.min(b)))
                .collect();
            let Some(&(kind, _, _)) = over.first() else {
                return StepSide::Alone;
            };
            if over.iter().any(|o| o.0 != kind) {
                return StepSide::Mixed;
            }
            // covered when the clipped intervals leave no gap in [a, b]
            over.sort_by(|x, y| x.1.total_cmp(&y.1));
            let mut reach = a;
            for &(_, s, e) in &over {
                if s > reach {
                    return StepSide::Mixed;
                }
                reach = reach.max(e);
            }
            if reach >= b {
                StepSide::Beside(kind)
            } else {
                StepSide::Mixed
            }
        })
        .collect()
}

/// A decode window's steps of one [`StepSide`], summed over the measured iterations.
#[derive(Clone, Debug, Default, PartialEq)]
struct Segment {
    /// Iterations in which the window had at least [`MIN_SEGMENT_STEPS`] such steps.
    runs: u32,
    /// Sum over those iterations of the steps' share of the window's steps.
    share: f64,
    steps: u32,
    seconds: f64,
}

/// Fewer steps of one side in a window's iteration are not used (a boundary, mostly).
pub const MIN_SEGMENT_STEPS: usize = 3;

/// What the recorder keeps of a plan task.
struct TaskMeta {
    name: String,
    kind: WorkKind,
    /// SMs it had when it ran alone (see [`Execution`]).
    sms: u32,
    work: Work,
    predicted: f64,
    /// A decode window's decode task.
    decode: bool,
    /// A side task of a decode window with a side partition (the window's side SMs).
    side: bool,
    /// A host copy (`Offload` / `Reload`): which way it goes.
    copy: Option<HostDir>,
    /// A host copy that moves data on this backend ([`ProfileRecorder::measure_host_copies`]).
    moves: bool,
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
    /// The running iteration's decode step marks per decode task (seconds from the origin).
    current_steps: Vec<(TaskId, Vec<f64>)>,
    /// Task metadata, indexed by task id.
    tasks: Vec<TaskMeta>,
    /// Decode windows that co-ran, cut by step ([`classify_steps`]).
    segments: BTreeMap<(TaskId, StepSide), Segment>,
    /// Side tasks' runs wholly beside their window's decode, seconds, in iteration order.
    beside_s: BTreeMap<TaskId, Vec<f64>>,
    /// Measured decode steps left out (boundary steps, several kinds, too few of a side).
    steps_dropped: u32,
    /// Host copies' runs (every measured run, beside compute or not), seconds, in iteration
    /// order.
    copy_s: BTreeMap<TaskId, Vec<f64>>,
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
                let win = t.window.and_then(|w| plan.windows.get(w.index()));
                TaskMeta {
                    name: t.name.clone(),
                    kind: t.kind,
                    sms,
                    work: t.work.clone(),
                    predicted: (t.end_s - t.start_s).max(0.0),
                    decode: matches!(t.op, Op::DecodeWindow { .. }),
                    side: win.is_some_and(|w| w.side_sms > 0 && w.side_stream == t.stream)
                        && !matches!(t.op, Op::DecodeWindow { .. }),
                    copy: matches!(t.op, Op::Offload { .. } | Op::Reload { .. })
                        .then(|| t.op.host_dir()),
                    moves: false,
                }
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
            current_steps: Vec::new(),
            tasks,
            segments: BTreeMap::new(),
            beside_s: BTreeMap::new(),
            steps_dropped: 0,
            copy_s: BTreeMap::new(),
        })
    }

    /// The host copies among `tasks` move data over the host link on this backend (the cuda
    /// executor's `Offload` / `Reload` of state the plan keeps on the host): their runs give the
    /// profile's measured host rates (see the module doc). Other tasks are ignored.
    pub fn measure_host_copies(mut self, tasks: impl IntoIterator<Item = TaskId>) -> Self {
        for id in tasks {
            if let Some(m) = self.tasks.get_mut(id.index()).filter(|m| m.copy.is_some()) {
                m.moves = true;
            }
        }
        self
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
        self.current_steps.clear();
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
        self.record(task, since(origin, start), since(origin, end));
    }

    /// The decode task `task` ran its steps between consecutive `marks` (seconds from the
    /// iteration's origin, as [`ProfileRecorder::record`]: step `i` from `marks[i]` to
    /// `marks[i + 1]`). Marks that are not ascending and finite are ignored, as are tasks that
    /// are not a decode window's.
    pub fn record_steps(&mut self, task: &Task, marks: &[f64]) {
        let ok = marks.len() >= 2
            && marks.iter().all(|m| m.is_finite())
            && marks.windows(2).all(|w| w[1] >= w[0]);
        if ok && matches!(task.op, Op::DecodeWindow { .. }) {
            self.current_steps.push((task.id, marks.to_vec()));
        }
    }

    /// [`ProfileRecorder::record_steps`] with marks on the host clock (the cuda backend's
    /// device events mapped onto it, as for [`ProfileRecorder::record_instants`]).
    pub fn record_step_instants(&mut self, task: &Task, marks: &[Instant]) {
        let Some(&first) = marks.first() else { return };
        let origin = *self.origin.get_or_insert(first);
        let m: Vec<f64> = marks.iter().map(|&t| since(origin, t)).collect();
        self.record_steps(task, &m);
    }

    /// Ends iteration `iteration` (wall time `wall`): decides which of its tasks ran alone and
    /// keeps their durations, unless it is a warm-up iteration.
    pub fn end_iteration(&mut self, iteration: u32, wall: Duration) {
        self.seen += 1;
        self.origin = None;
        let intervals = std::mem::take(&mut self.current);
        let steps = std::mem::take(&mut self.current_steps);
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
        if self.execution != Execution::OneAtATime {
            self.cut_windows(&intervals, &alone, &steps);
        }
        for ((id, start, end), alone) in intervals.into_iter().zip(alone) {
            let Some(m) = self.tasks.get(id.index()) else {
                continue;
            };
            if m.copy.is_some() {
                self.copy_s.entry(id).or_default().push(end - start);
            }
            let stat = self.stats.entry(id).or_insert_with(|| TaskStat {
                task: id,
                name: m.name.clone(),
                kind: m.kind,
                sms: m.sms,
                work: m.work.clone(),
                predicted_s: m.predicted,
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

    /// One measured iteration's co-runs (see the module doc): the steps of each decode window
    /// that did not run alone as a whole, and side tasks that ran wholly beside their decode.
    fn cut_windows(
        &mut self,
        intervals: &[(TaskId, f64, f64)],
        alone: &[bool],
        steps: &[(TaskId, Vec<f64>)],
    ) {
        let gpu_work = |id: TaskId| self.tasks.get(id.index()).filter(|m| !is_host(m.kind));
        for (id, marks) in steps {
            let Some(k) = intervals.iter().position(|iv| iv.0 == *id) else {
                continue;
            };
            if alone[k] {
                continue; // a point as a whole
            }
            let others: Vec<(WorkKind, f64, f64)> = intervals
                .iter()
                .filter(|iv| iv.0 != *id)
                .filter_map(|&(o, a, b)| gpu_work(o).map(|m| (m.kind, a, b)))
                .collect();
            let sides = classify_steps(marks, &others);
            let n = sides.len();
            let mut by: BTreeMap<StepSide, (usize, f64)> = BTreeMap::new();
            for (side, m) in sides.iter().zip(marks.windows(2)) {
                let e = by.entry(*side).or_default();
                e.0 += 1;
                e.1 += m[1] - m[0];
            }
            // beside points need a partition: the window's decode SMs leave some for the work
            // beside it (a window without a split that something overlapped gives none)
            let partitioned = self.execution == Execution::Partitioned
                && self
                    .tasks
                    .get(id.index())
                    .is_some_and(|m| m.sms < self.gpu.sms);
            for (side, (count, seconds)) in by {
                let used = side != StepSide::Mixed
                    && count >= MIN_SEGMENT_STEPS
                    && (partitioned || side == StepSide::Alone);
                if !used {
                    self.steps_dropped += count as u32;
                    continue;
                }
                let seg = self.segments.entry((*id, side)).or_default();
                seg.runs += 1;
                seg.share += count as f64 / n as f64;
                seg.steps += count as u32;
                seg.seconds += seconds;
            }
        }
        if self.execution != Execution::Partitioned {
            return;
        }
        for (k, &(id, a, b)) in intervals.iter().enumerate() {
            let side_task = self
                .tasks
                .get(id.index())
                .is_some_and(|m| m.side && !is_host(m.kind));
            if alone[k] || !side_task || b <= a {
                continue;
            }
            let over: Vec<&(TaskId, f64, f64)> = intervals
                .iter()
                .filter(|iv| iv.0 != id && iv.1 < b && iv.2 > a)
                .filter(|iv| gpu_work(iv.0).is_some())
                .collect();
            let inside = !over.is_empty()
                && over
                    .iter()
                    .all(|&&(o, s, e)| self.tasks[o.index()].decode && s <= a && e >= b);
            if inside {
                self.beside_s.entry(id).or_default().push(b - a);
            }
        }
    }

    /// The host copies that moved data, per direction: each copy task's host bytes and median
    /// run (every measured run counts, see the module doc). Empty when none moved data.
    pub fn host_copies(&self) -> rollplex_cost::HostCopies {
        let mut c = rollplex_cost::HostCopies::default();
        for (id, runs) in &self.copy_s {
            let Some(m) = self.tasks.get(id.index()).filter(|m| m.moves) else {
                continue;
            };
            let Some(med) = median(runs).filter(|&x| x >= 1e-9 && x.is_finite()) else {
                continue;
            };
            if m.work.host_bytes > 0.0 {
                let sum = match m.copy {
                    Some(HostDir::ToHost) => &mut c.to_host,
                    _ => &mut c.to_device,
                };
                // nanoseconds: what the clocks resolve
                sum.add(m.work.host_bytes, (med * 1e9).round() / 1e9);
            }
        }
        c
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
}

/// Seconds from `origin` to `t`, signed (a backend may report device times from before the
/// origin was taken).
fn since(origin: Instant, t: Instant) -> f64 {
    match t.checked_duration_since(origin) {
        Some(d) => d.as_secs_f64(),
        None => -origin.duration_since(t).as_secs_f64(),
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
mod tests;
