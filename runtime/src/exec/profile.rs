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
//! steps, host or network bytes) are listed, never fitted.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use rollplex_cost::defaults::{is_host, kind_name};
use rollplex_cost::{BesidePoint, LatencyFit, Point, Profile};
use rollplex_plan::plan::{Op, Plan, Task};
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
    /// model can scale: the median of its alone runs; then one per decode window that co-ran
    /// and had steps alone on its partition (see the module doc). In task order.
    pub fn points(&self) -> Vec<Point> {
        let alone = self
            .stats
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
            });
        let steps = self
            .segments
            .iter()
            .filter(|((_, side), _)| *side == StepSide::Alone)
            .filter_map(|(&(id, _), seg)| {
                let (work, seconds, note) = self.segment(id, seg, "alone on its partition")?;
                let m = &self.tasks[id.index()];
                Some(Point {
                    kind: m.kind,
                    sms: m.sms,
                    work,
                    seconds,
                    note,
                })
            });
        alone.chain(steps).collect()
    }

    /// Beside points (see the module doc): each co-run window's steps beside one kind of side
    /// work, then each side task's median run wholly beside its window's decode. In task order.
    pub fn beside_points(&self) -> Vec<BesidePoint> {
        let steps = self.segments.iter().filter_map(|(&(id, side), seg)| {
            let StepSide::Beside(kind) = side else {
                return None;
            };
            let what = format!("beside {}", kind_name(kind));
            let (work, seconds, note) = self.segment(id, seg, &what)?;
            let m = &self.tasks[id.index()];
            Some(BesidePoint {
                kind: m.kind,
                sms: m.sms,
                work,
                seconds,
                beside: kind,
                note,
            })
        });
        let side = self.beside_s.iter().filter_map(|(&id, runs)| {
            let m = self.tasks.get(id.index())?;
            let med = median(runs)?;
            (modelled(&m.work) && med >= 1e-9).then(|| BesidePoint {
                kind: m.kind,
                sms: m.sms,
                work: m.work.clone(),
                seconds: (med * 1e9).round() / 1e9,
                beside: WorkKind::Decode,
                note: format!(
                    "{} ({id}): median of {} runs wholly beside its window's decode",
                    m.name,
                    runs.len()
                ),
            })
        });
        steps.chain(side).collect()
    }

    /// A window's steps of one side as (work, seconds, note): the window's work prorated by
    /// the steps' mean share of its steps, their mean time per measured iteration.
    fn segment(&self, id: TaskId, seg: &Segment, what: &str) -> Option<(Work, f64, String)> {
        let m = self.tasks.get(id.index())?;
        if seg.runs == 0 || !modelled(&m.work) {
            return None;
        }
        let share = seg.share / seg.runs as f64;
        let seconds = ((seg.seconds / seg.runs as f64) * 1e9).round() / 1e9;
        let work = m.work.scaled(share);
        (seconds >= 1e-9).then(|| {
            let note = format!(
                "{} ({id}): {} steps {what} in {} iterations ({:.1}% of the window's), mean per iteration",
                m.name,
                seg.steps,
                seg.runs,
                share * 100.0
            );
            (work, seconds, note)
        })
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
        let beside = self.beside_points();
        if points.is_empty() {
            return Err(ExecError::Machine(
                "no task ran alone in a measured iteration, so there is no time alone to fit: \
                 profile a serial plan (rollplexc --mode serial)"
                    .into(),
            ));
        }
        let mut profile =
            Profile::fit_all(&self.gpu, points, Vec::new(), beside, LatencyFit::PerKind)
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
            "Rule: `points` are times alone (medians per task over the measured iterations, and a \
             co-run decode window's steps alone on its partition); `beside_points` are a co-run \
             window's steps beside one kind of side work and side tasks wholly beside decode; \
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
            "Runs that overlapped another task (not points as a whole): {co_ran}; tasks never alone: {}.",
            if never_alone.is_empty() {
                "none".to_string()
            } else {
                never_alone.join(", ")
            }
        ));
        let alone_steps: u32 = self
            .segments
            .iter()
            .filter(|((_, side), _)| *side == StepSide::Alone)
            .map(|(_, s)| s.steps)
            .sum();
        let beside_steps: u32 = self
            .segments
            .iter()
            .filter(|((_, side), _)| matches!(side, StepSide::Beside(_)))
            .map(|(_, s)| s.steps)
            .sum();
        line(format!(
            "Co-run decode windows cut by step: {alone_steps} steps alone on their partition, \
             {beside_steps} beside one kind of side work, {} dropped (boundaries, several kinds, \
             fewer than {MIN_SEGMENT_STEPS} of a side); {} side tasks wholly beside decode.",
            self.steps_dropped,
            self.beside_s.len()
        ));
        for e in &fitted.corun {
            line(format!(
                "  slowdown of {} beside {}: {:.4}",
                kind_name(e.kind),
                kind_name(e.other),
                e.slowdown
            ));
        }
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
            // the same tasks as `measured`: those with runs alone
            let refit: f64 = self
                .stats
                .values()
                .filter(|s| s.kind == k.kind && s.median_s().is_some())
                .map(|s| model.time(s.kind, &s.work, s.sms))
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
    fn steps_are_alone_beside_one_kind_or_mixed() {
        use StepSide::*;
        let (r, a) = (WorkKind::RefPrefix, WorkKind::ActorPrefixFwd);
        // 8 steps of 1 s; ref prefixes back to back over [0.5, 3.0] and [3.0, 4.0], an actor
        // prefix over [4.0, 5.5], then nothing
        let marks: Vec<f64> = (0..=8).map(f64::from).collect();
        let others = [(r, 0.5, 3.0), (r, 3.0, 4.0), (a, 4.0, 5.5)];
        assert_eq!(
            classify_steps(&marks, &others),
            vec![
                Mixed,
                Beside(r),
                Beside(r),
                Beside(r),
                Beside(a),
                Mixed,
                Alone,
                Alone
            ]
        );
        // two kinds in one step; a gap inside a step; touching ends
        let two = [(r, 0.0, 0.5), (a, 0.5, 1.0)];
        assert_eq!(classify_steps(&[0.0, 1.0], &two), vec![Mixed]);
        let gap = [(r, 0.0, 0.4), (r, 0.6, 1.0)];
        assert_eq!(classify_steps(&[0.0, 1.0], &gap), vec![Mixed]);
        let touch = [(r, 1.0, 2.0)];
        assert_eq!(
            classify_steps(&[0.0, 1.0, 2.0], &touch),
            vec![Alone, Beside(r)]
        );
        assert!(classify_steps(&[1.0], &others).is_empty());
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
