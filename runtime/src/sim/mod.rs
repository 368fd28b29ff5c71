//! The simulator backend: replays a plan with the cost model instead of running it.
//!
//! [`simulate`] maps the plan's streams, tasks, dependencies, decode windows (SM partitions)
//! and buffers onto the event-driven model of [`engine`] and returns a [`SimReport`]: every
//! task's simulated start and end, the iteration time, a per-phase and per-kind breakdown,
//! SM use, HBM traffic and live HBM bytes over time for each GPU program. The report writes
//! itself as a console summary ([`SimReport::print_summary`]), a Chrome/Perfetto trace
//! ([`SimReport::write_chrome_trace`]) and an SVG timeline ([`SimReport::write_svg`]).
//!
//! What a task gets: inside a decode window, the decode stream gets the window's
//! `decode_sms` (the whole GPU when `side_sms == 0`) and the side stream `side_sms`; outside,
//! the task's planned `sms`, else its stream's. Reward and host<->device transfers take no
//! SMs. A GPU program stands for all its ranks (they run the same schedule SPMD), so the
//! simulation runs each program once.
//!
//! Invariants: the report's tasks are the plan's, in the plan's order (index = `TaskId`);
//! simulated times respect stream order and dependencies (tested); nothing here panics on a
//! plan that fails validation: ids out of range or a schedule that cannot progress come back
//! as a [`SimError`].

pub mod engine;
mod summary;
pub(crate) mod svg;
mod trace;

#[cfg(test)]
mod tests;

use rollplex_cost::CostModel;
use rollplex_plan::work::WorkKind;
use rollplex_plan::{ArenaKind, Lifetime, Phase, Plan};

pub use engine::DeviceSample;

/// Why a plan could not be simulated.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("plan is malformed for simulation: {0}")]
    Malformed(String),
    #[error(
        "the schedule cannot progress: {0} can never start (a dependency cycle, or a dependency \
         on a task queued behind it on the same stream); run `rollplexc explain` on the plan"
    )]
    Stuck(String),
    #[error("task {0} would never finish with the cost model given (zero SMs for GPU work?)")]
    Infinite(String),
}

/// One GPU program of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct SimDevice {
    /// `gpu0`.
    pub name: String,
    /// `colocated`, `rollout`, `train`.
    pub role: String,
    /// Ranks running this program.
    pub ranks: u32,
    pub sms: u32,
    pub hbm_bytes: u64,
    /// Dense bf16 peak of the cost model's GPU, FLOP/s (the scale of `samples[].flops`).
    pub bf16_flops: f64,
    /// SM use, HBM traffic and arithmetic rate, a step function (each sample holds until the next).
    pub samples: Vec<DeviceSample>,
    /// Live device bytes of the plan's buffers, a step function of (time, bytes).
    pub hbm_live: Vec<(f64, u64)>,
    /// Largest live bytes seen.
    pub hbm_peak: u64,
    /// What the plan allocates on this GPU (its device arenas), bytes.
    pub planned_peak: u64,
}

/// One stream of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct SimStream {
    /// Index into [`SimReport::devices`].
    pub device: usize,
    pub name: String,
}

/// One simulated task.
#[derive(Clone, Debug, PartialEq)]
pub struct SimTask {
    pub name: String,
    pub kind: WorkKind,
    pub phase: Phase,
    /// Index into [`SimReport::devices`] / [`SimReport::streams`].
    pub device: usize,
    pub stream: usize,
    pub window: Option<u32>,
    pub start_s: f64,
    pub end_s: f64,
    /// Time alone on its partition (what contention added is `end - start - alone`).
    pub alone_s: f64,
    pub avg_sms: f64,
    pub avg_slowdown: f64,
    /// What the compiler predicted.
    pub planned_start_s: f64,
    pub planned_end_s: f64,
    /// Device-memory bytes the task moves (for the HBM traffic view).
    pub bytes: f64,
}

impl SimTask {
    pub fn duration_s(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// One decode window as simulated.
#[derive(Clone, Debug, PartialEq)]
pub struct SimWindow {
    pub device: usize,
    pub decode_sms: u32,
    pub side_sms: u32,
    /// Simulated span of the window's decode task(s).
    pub start_s: f64,
    pub end_s: f64,
    /// Seconds of side work that ran inside the window's span.
    pub side_busy_s: f64,
}

/// A phase's span and work.
#[derive(Clone, Debug, PartialEq)]
pub struct SimPhase {
    pub phase: Phase,
    pub start_s: f64,
    pub end_s: f64,
    /// Sum of task durations in this phase (seconds; tasks on different streams add).
    pub task_s: f64,
    pub tasks: u32,
}

/// The simulator's result (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// The job's name.
    pub name: String,
    /// `serial`, `overlap`, `disaggregated`.
    pub mode: String,
    pub gpu: String,
    /// Total GPUs of the job.
    pub gpu_count: u32,
    /// Where the cost numbers come from.
    pub cost_source: String,
    pub iteration_s: f64,
    /// The plan's own prediction.
    pub planned_iteration_s: f64,
    pub devices: Vec<SimDevice>,
    pub streams: Vec<SimStream>,
    pub tasks: Vec<SimTask>,
    pub windows: Vec<SimWindow>,
    pub phases: Vec<SimPhase>,
    /// Things a reader should know (cost model for another GPU, ...).
    pub warnings: Vec<String>,
}

/// Whether a task of `kind` occupies SMs.
fn uses_sms(kind: WorkKind) -> bool {
    !matches!(kind, WorkKind::Reward | WorkKind::Transfer)
}

/// Replays `plan` with `cost` (see the module doc). A cost model without a GPU <-> GPU
/// bandwidth of its own gets the plan's intra-node link, as the compiler's does
/// ([`CostModel::for_cluster`]).
pub fn simulate(plan: &Plan, cost: &CostModel) -> Result<SimReport, SimError> {
    let with_link;
    let cost = if cost.explicit_net_bw().is_none() {
        with_link = cost.clone().with_net_bw(plan.spec.cluster.intra_node_bw);
        &with_link
    } else {
        cost
    };
    let bad = |m: String| SimError::Malformed(m);
    let all_sms = plan.target.sms.max(1);
    let mut warnings = Vec::new();
    if cost.gpu().sms != plan.target.sms || !cost.gpu().name.eq_ignore_ascii_case(&plan.target.gpu)
    {
        warnings.push(format!(
            "the cost model is for {} ({} SMs) but the plan targets {} ({} SMs)",
            cost.gpu().name,
            cost.gpu().sms,
            plan.target.gpu,
            plan.target.sms
        ));
    }
    let devices_in = vec![engine::DeviceIn { sms: all_sms }; plan.gpus.len()];
    let mut streams_in = Vec::with_capacity(plan.streams.len());
    for (i, s) in plan.streams.iter().enumerate() {
        if s.id.index() != i || s.gpu.index() >= plan.gpus.len() {
            return Err(bad(format!(
                "stream {i} ({}): id or gpu out of place",
                s.id
            )));
        }
        streams_in.push(s.gpu.index());
    }
    let mut tasks_in = Vec::with_capacity(plan.tasks.len());
    for (i, t) in plan.tasks.iter().enumerate() {
        if t.id.index() != i {
            return Err(bad(format!("task {i} has id {}", t.id)));
        }
        let stream = plan
            .stream(t.stream)
            .ok_or_else(|| bad(format!("{} ({}): no {}", t.id, t.name, t.stream)))?;
        let mut sms = if t.sms > 0 { t.sms } else { stream.sms };
        if let Some(w) = t.window {
            let w = plan
                .window(w)
                .ok_or_else(|| bad(format!("{} ({}): no {w}", t.id, t.name)))?;
            if t.stream == w.decode_stream {
                sms = if w.side_sms == 0 {
                    all_sms
                } else {
                    w.decode_sms
                };
            } else if t.stream == w.side_stream {
                sms = w.side_sms;
            }
        }
        if sms == 0 {
            sms = all_sms;
        }
        let deps = t
            .deps
            .iter()
            .map(|d| {
                if d.index() < plan.tasks.len() {
                    Ok(d.index())
                } else {
                    Err(bad(format!("{} ({}) depends on missing {d}", t.id, t.name)))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        tasks_in.push(engine::TaskIn {
            stream: t.stream.index(),
            device: t.gpu.index(),
            deps,
            kind: t.kind,
            work: t.work.clone(),
            host_dir: t.op.host_dir(),
            sms: sms.min(all_sms),
            uses_sms: uses_sms(t.kind),
        });
    }
    let input = engine::Input {
        devices: devices_in,
        streams: streams_in,
        tasks: tasks_in,
    };
    let name_of = |i: usize| format!("{} ({})", plan.tasks[i].id, plan.tasks[i].name);
    let out = engine::run(&input, cost).map_err(|e| match e {
        engine::EngineError::BadInput(m) => SimError::Malformed(m),
        engine::EngineError::Stuck(v) => {
            SimError::Stuck(v.iter().map(|&i| name_of(i)).collect::<Vec<_>>().join(", "))
        }
        engine::EngineError::Infinite(i) => SimError::Infinite(name_of(i)),
    })?;

    // tasks with phases; transfers take the phase running when they start
    let mut tasks: Vec<SimTask> = plan
        .tasks
        .iter()
        .zip(&out.tasks)
        .map(|(t, o)| SimTask {
            name: t.name.clone(),
            kind: t.kind,
            phase: t.op.phase(t.window.is_some()).unwrap_or(Phase::Training),
            device: t.gpu.index(),
            stream: t.stream.index(),
            window: t.window.map(|w| w.0),
            start_s: o.start_s,
            end_s: o.end_s,
            alone_s: o.alone_s,
            avg_sms: o.avg_sms,
            avg_slowdown: o.avg_slowdown,
            planned_start_s: t.start_s,
            planned_end_s: t.end_s,
            bytes: t.work.bytes,
        })
        .collect();
    let mut phases = phase_spans(plan, &tasks, |t| t.op.phase(t.window.is_some()).is_some());
    for (t, st) in plan.tasks.iter().zip(tasks.iter_mut()) {
        if t.op.phase(t.window.is_some()).is_none() {
            st.phase = phases
                .iter()
                .filter(|p| p.tasks > 0 && p.start_s <= st.start_s)
                .max_by(|a, b| a.start_s.total_cmp(&b.start_s))
                .map(|p| p.phase)
                .unwrap_or(Phase::Rollout);
        }
    }
    phases = phase_spans(plan, &tasks, |_| true);

    let windows = plan
        .windows
        .iter()
        .map(|w| {
            let decode: Vec<&SimTask> = tasks
                .iter()
                .filter(|t| t.window == Some(w.id.0) && t.stream == w.decode_stream.index())
                .collect();
            let start_s = decode
                .iter()
                .map(|t| t.start_s)
                .fold(f64::INFINITY, f64::min);
            let end_s = decode.iter().map(|t| t.end_s).fold(0.0, f64::max);
            let (start_s, end_s) = if decode.is_empty() {
                (0.0, 0.0)
            } else {
                (start_s, end_s)
            };
            let side_busy_s = tasks
                .iter()
                .filter(|t| t.device == w.gpu.index() && t.stream == w.side_stream.index())
                .map(|t| (t.end_s.min(end_s) - t.start_s.max(start_s)).max(0.0))
                .sum();
            SimWindow {
                device: w.gpu.index(),
                decode_sms: w.decode_sms,
                side_sms: w.side_sms,
                start_s,
                end_s,
                side_busy_s,
            }
        })
        .collect();

    let devices = plan
        .gpus
        .iter()
        .enumerate()
        .map(|(d, g)| {
            let hbm_live = hbm_series(plan, d, &tasks, out.makespan_s);
            let hbm_peak = hbm_live.iter().map(|&(_, b)| b).max().unwrap_or(0);
            let planned_peak = plan
                .memory
                .gpus
                .iter()
                .find(|m| m.gpu == g.id)
                .map(|m| m.peak)
                .unwrap_or(0);
            SimDevice {
                name: g.id.to_string(),
                role: format!("{:?}", g.role).to_lowercase(),
                ranks: g.ranks,
                sms: all_sms,
                hbm_bytes: plan.target.hbm_bytes,
                bf16_flops: cost.gpu().bf16_flops,
                samples: out.samples.get(d).cloned().unwrap_or_default(),
                hbm_live,
                hbm_peak,
                planned_peak,
            }
        })
        .collect();
    let streams = plan
        .streams
        .iter()
        .map(|s| SimStream {
            device: s.gpu.index(),
            name: s.name.clone(),
        })
        .collect();
    Ok(SimReport {
        name: plan.spec.name.clone(),
        mode: format!("{:?}", plan.mode).to_lowercase(),
        gpu: plan.target.gpu.clone(),
        gpu_count: plan.target.count,
        cost_source: cost.source().to_string(),
        iteration_s: out.makespan_s,
        planned_iteration_s: plan.predicted.iteration_s,
        devices,
        streams,
        tasks,
        windows,
        phases,
        warnings,
    })
}

/// Span and work of each phase over the tasks `keep` admits.
fn phase_spans(
    plan: &Plan,
    tasks: &[SimTask],
    keep: impl Fn(&rollplex_plan::Task) -> bool,
) -> Vec<SimPhase> {
    Phase::ALL
        .iter()
        .map(|&phase| {
            let mut p = SimPhase {
                phase,
                start_s: f64::INFINITY,
                end_s: 0.0,
                task_s: 0.0,
                tasks: 0,
            };
            for (t, s) in plan.tasks.iter().zip(tasks) {
                if s.phase == phase && keep(t) {
                    p.start_s = p.start_s.min(s.start_s);
                    p.end_s = p.end_s.max(s.end_s);
                    p.task_s += s.duration_s();
                    p.tasks += 1;
                }
            }
            if p.tasks == 0 {
                p.start_s = 0.0;
            }
            p
        })
        .collect()
}

/// Live bytes of device `d`'s device-arena buffers over the simulated timeline.
fn hbm_series(plan: &Plan, d: usize, tasks: &[SimTask], end_s: f64) -> Vec<(f64, u64)> {
    let device_arena = |b: &rollplex_plan::Buffer| {
        plan.memory
            .arenas
            .iter()
            .find(|a| a.id == b.arena)
            .is_some_and(|a| a.kind == ArenaKind::Device)
    };
    // (time, +1 alloc / -1 free, bytes); frees sort before allocations at the same time
    let mut events: Vec<(f64, i8, u64)> = Vec::new();
    for b in plan
        .buffers
        .iter()
        .filter(|b| b.gpu.index() == d && device_arena(b))
    {
        let (from, to) = match b.lifetime {
            Lifetime::Persistent => (0.0, f64::INFINITY),
            Lifetime::Tasks { first, last } => {
                match (tasks.get(first.index()), tasks.get(last.index())) {
                    (Some(f), Some(l)) => (f.start_s, l.end_s.max(f.start_s)),
                    _ => continue,
                }
            }
        };
        events.push((from, 1, b.bytes));
        if to.is_finite() {
            events.push((to, -1, b.bytes));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut series: Vec<(f64, u64)> = vec![(0.0, 0)];
    let mut live: u64 = 0;
    for (t, sign, bytes) in events {
        live = if sign > 0 {
            live.saturating_add(bytes)
        } else {
            live.saturating_sub(bytes)
        };
        match series.last_mut() {
            Some(last) if last.0 == t => last.1 = live,
            _ => series.push((t, live)),
        }
    }
    if series.last().is_some_and(|l| l.0 < end_s) {
        series.push((end_s, live));
    }
    series
}
