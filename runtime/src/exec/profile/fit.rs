//! Turning a [`ProfileRecorder`]'s measurements into a cost-model profile: the points alone,
//! the decode windows' steps alone and beside side work, the fit, the file's header, and the
//! file.

use std::path::Path;

use rollplex_cost::defaults::kind_name;
use rollplex_cost::{BesidePoint, LatencyFit, Point, Profile};
use rollplex_plan::work::{Work, WorkKind};
use rollplex_plan::TaskId;

use super::{median, modelled, ProfileRecorder, Segment, StepSide, TaskStat, MIN_SEGMENT_STEPS};
use crate::exec::ExecError;

impl ProfileRecorder {
    /// One point per task that ran alone in some measured iteration and whose work the cost
    /// model can scale, host copies aside: the median of its alone runs; then one per decode
    /// window that co-ran and had steps alone on its partition (see the module doc). In task
    /// order.
    pub fn points(&self) -> Vec<Point> {
        let alone = self
            .stats
            .values()
            .filter(|s| modelled(&s.work))
            .filter(|s| {
                self.tasks
                    .get(s.task.index())
                    .is_some_and(|m| m.copy.is_none())
            })
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

    /// Fits the profile: [`Profile::refit`] over [`ProfileRecorder::points`] and
    /// [`ProfileRecorder::beside_points`], with the host rates of
    /// [`ProfileRecorder::host_copies`], its `source` saying what was run and how. Errors when
    /// nothing was measured.
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
        let mut unfitted =
            Profile::unfitted(&self.gpu, points, Vec::new(), beside, LatencyFit::PerKind);
        unfitted.set_host_copies(self.host_copies());
        let mut profile = unfitted
            .refit()
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
        line(self.host_line(fitted));
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
                .map(|s| {
                    let dir = self.tasks[s.task.index()].copy.unwrap_or_default();
                    model.time_dir(s.kind, &s.work, s.sms, dir)
                })
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
    /// The header's line on the host link: the measured rates and what they came from, or why
    /// none was measured and what the cost model uses instead.
    fn host_line(&self, fitted: &Profile) -> String {
        let copies = self.tasks.iter().filter(|m| m.copy.is_some()).count();
        let moving = self.tasks.iter().filter(|m| m.moves).count();
        let measured = fitted.host_copies.clone();
        let spec = format!("{:.2} GB/s", self.gpu.host_bw / 1e9);
        if copies == 0 {
            return format!(
                "Host copies: none in this plan (no offload or reload): no host rate measured; \
                 the cost model keeps the GPU spec's {spec}."
            );
        }
        if measured.is_empty() {
            return format!(
                "Host copies: {copies} offload/reload tasks, {moving} of which move data on this \
                 backend{}: no host rate measured; the cost model keeps the GPU spec's {spec}.",
                if moving == 0 {
                    " (one address space, or kept chunks that stay on the device)"
                } else {
                    " (none ran in a measured iteration)"
                }
            );
        }
        format!(
            "Host copies (`host_copies`; offloads and reloads on the copy stream, each task's \
             median over the measured iterations, beside compute or not; not points): {} (GPU \
             spec {spec}; {} of {copies} copy tasks move data on this backend).",
            measured.describe(),
            moving
        )
    }

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
