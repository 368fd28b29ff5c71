//! The compile pipeline, top to bottom:
//!
//! 1. [`crate::topology`]: replicas and GPU programs of the mode (disaggregated: every valid
//!    split of the GPUs is a candidate);
//! 2. [`crate::lower`]: the phase graph with shapes and work;
//! 3. [`crate::buffers`]: buffer table, reads/writes, scratch;
//! 4. placement: the ILP ([`crate::ilp`]) decides residency and the reshard point
//!    ([`crate::residency`]) and, in overlap mode, the decode windows' SM splits and side work
//!    ([`crate::schedule_overlap`]); serial and disaggregated plans place the rest in order
//!    ([`crate::schedule_serial`]);
//! 5. [`crate::assemble`]: streams, windows, issue order, transfers, predicted times;
//! 6. [`crate::emit`]: the plan;
//! 7. [`crate::memory`]: lifetimes, arena offsets, peaks (a candidate over budget is dropped);
//! 8. `rollplex_plan::validate` on the chosen plan (a failure is a compiler bug).
//!
//! The passes hand each other the types of [`crate::ir`]; in debug builds (and with
//! [`Options::check_ir`]) the IR is verified after step 3 and step 5.
//!
//! A plan whose exact memory layout is over budget is planned again with what the ILP's
//! estimate missed (the overshoot, doubled at each further attempt, and the room the estimate
//! left) taken off the budget of its memory row (decode or training phase) where the peak
//! sits, up to [`MAX_ATTEMPTS`] solves per topology. Among the candidates that fit (one per
//! disaggregated split) the fastest predicted iteration wins (ties: the earlier). When none
//! fits, the error gives the numbers of the candidate that came closest.
//!
//! The driver is pure: the spec and an optional profile in, a plan and statistics out.

use crate::assemble::assemble;
use crate::error::{CompileError, Result};
use crate::ilp::IlpRun;
use crate::ir::{PhaseGraph, Placement};
use crate::lower::lower;
use crate::memory::OverBudget;
use crate::residency::Cuts;
use crate::topology::Topology;
use rollplex_cost::{CostModel, Profile};
use rollplex_plan::spec::{JobSpec, Mode};
use rollplex_plan::{Op, Plan, SolverStats};
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct Options {
    /// Overrides the pipeline's `schedule.mode`.
    pub mode: Option<Mode>,
    /// A measured profile for the cost model.
    pub profile: Option<Profile>,
    /// Time limit of one ILP solve, seconds: a safety net behind the node limit
    /// ([`crate::ilp::MAX_NODES`]), which is what stops a long search, the same on every machine.
    pub time_limit_s: f64,
    /// Check the IR between passes ([`crate::ir::verify_graph`], [`crate::ir::verify_sched`])
    /// in release builds too (debug builds always do).
    pub check_ir: bool,
}

/// The default [`Options::time_limit_s`] (and `rollplexc --time-limit`).
pub const DEFAULT_TIME_LIMIT_S: f64 = 60.0;

impl Default for Options {
    fn default() -> Self {
        Options {
            mode: None,
            profile: None,
            time_limit_s: DEFAULT_TIME_LIMIT_S,
            check_ir: false,
        }
    }
}

/// One candidate plan the driver considered.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub label: String,
    pub predicted_s: f64,
    pub peak: u64,
    pub fits: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Wall time of each pass, seconds (summed over candidates).
    pub passes: Vec<(&'static str, f64)>,
    pub candidates: Vec<Candidate>,
    pub ilp: Vec<IlpRun>,
    pub cost_source: String,
    pub tasks: usize,
    pub buffers: usize,
}

impl Stats {
    fn time<T>(&mut self, pass: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        let dt = t.elapsed().as_secs_f64();
        match self.passes.iter_mut().find(|(p, _)| *p == pass) {
            Some(e) => e.1 += dt,
            None => self.passes.push((pass, dt)),
        }
        r
    }
}

pub struct Compiled {
    pub plan: Plan,
    pub stats: Stats,
}

/// The cost model a job is planned with.
pub fn cost_model(spec: &JobSpec, profile: Option<&Profile>) -> CostModel {
    CostModel::for_cluster(&spec.cluster, profile)
}

/// Compiles `spec` into a plan.
pub fn compile(spec: &JobSpec, opts: &Options) -> Result<Compiled> {
    let mut st = Stats::default();
    let cost = cost_model(spec, opts.profile.as_ref());
    st.cost_source = cost.source().to_string();
    let mode = opts.mode.unwrap_or(spec.schedule.mode);
    // the plan's spec is the job as compiled: the runtime reads the mode from it (a
    // disaggregated job keeps a rollout copy of the actor)
    let overridden;
    let spec = if mode == spec.schedule.mode {
        spec
    } else {
        let mut s = spec.clone();
        s.schedule.mode = mode;
        overridden = s;
        &overridden
    };
    let topologies: Vec<Topology> = st.time("topology", || -> Result<Vec<Topology>> {
        match mode {
            Mode::Serial | Mode::Overlap => Ok(vec![crate::topology::colocated(spec, mode)?]),
            Mode::Disaggregated => {
                let splits = crate::topology::disaggregated_splits(spec);
                if splits.is_empty() {
                    crate::topology::check_counts(spec)?;
                    if spec.cluster.count < 2 {
                        // Says that one set rolls out and the other trains.
                        crate::topology::disaggregated(spec, 1)?;
                    }
                    let (n, rtp, ttp) = (spec.cluster.count, spec.rollout.tp, spec.train.tp);
                    return Err(CompileError::user(
                        "schedule.mode",
                        format!(
                            "disaggregated mode needs the {n} GPUs split into a rollout set (a multiple of rollout TP {rtp}) and a training set (a multiple of training TP {ttp}), each dividing the {} prompts into whole replicas; no split does",
                            spec.rollout.prompts_per_iter
                        ),
                        "use mode overlap or serial, or change the GPU count, the TP degrees or the prompts",
                    ));
                }
                splits.into_iter().map(|r| crate::topology::disaggregated(spec, r)).collect()
            }
        }
    })?;

    let check_ir = cfg!(debug_assertions) || opts.check_ir;
    let mut best: Option<(f64, Plan)> = None;
    let mut closest: Option<OverBudget> = None;
    let mut host_short: Option<(u64, u64)> = None;
    for topo in topologies {
        let label_topo = match mode {
            Mode::Disaggregated => format!(
                "rollout {} + train {} GPUs",
                topo.gpus[0].ranks,
                topo.gpus.get(1).map(|g| g.ranks).unwrap_or(0)
            ),
            _ => format!("{mode:?}").to_lowercase(),
        };
        let mut pg: PhaseGraph = st.time("lower", || {
            lower(spec, topo, crate::lower::fixed_kept_layers(spec))
        })?;
        st.time("buffers", || crate::buffers::assign(&mut pg));
        if check_ir {
            crate::ir::verify_graph(&pg).map_err(CompileError::internal)?;
        }
        // One ILP decides residency and the reshard point (and, in overlap mode, the
        // windows); when the exact layout is over budget, the memory row where the peak sits
        // gets what the estimate missed less and the ILP runs again.
        let mut cuts = Cuts::default();
        for attempt in 0..=MAX_ATTEMPTS {
            // The last attempt ignores the host budget: if that plan fits the device, the
            // error can say how much host memory the job needs.
            cuts.host_unlimited = attempt == MAX_ATTEMPTS;
            let (placement, solver) = match mode {
                Mode::Overlap => {
                    let (p, s, mut run) = st.time("schedule", || {
                        crate::schedule_overlap::place(&pg, &cost, cuts, opts.time_limit_s)
                    })?;
                    run.label = format!(
                        "{label_topo}, {}",
                        crate::residency::label(&p.residency, true)
                    );
                    st.ilp.push(run);
                    (p, s)
                }
                _ => {
                    let (res, s, mut run) = st.time("schedule", || {
                        crate::residency::solve_alone(&pg, &cost, cuts, opts.time_limit_s)
                    })?;
                    run.label = format!(
                        "{label_topo}, {}",
                        crate::residency::label(&res, mode == Mode::Serial)
                    );
                    st.ilp.push(run);
                    (crate::schedule_serial::place(&pg, res), s)
                }
            };
            let label = format!(
                "{label_topo}, {}",
                crate::residency::label(&placement.residency, mode != Mode::Disaggregated)
            );
            // Under `recompute = auto` the ILP decided the kept activation layers: the same
            // tasks, with the micro-batches' work and activations for that answer.
            let relowered;
            let run_pg = if placement.residency.kept == pg.kept {
                &pg
            } else {
                let k = placement.residency.kept;
                let mut g = st.time("lower", || lower(spec, pg.topo.clone(), k))?;
                st.time("buffers", || crate::buffers::assign(&mut g));
                relowered = g;
                &relowered
            };
            let outcome = build(&mut st, run_pg, &placement, &cost, solver, check_ir)?;
            match outcome {
                Ok(plan) => {
                    let t = plan.predicted.iteration_s;
                    st.candidates.push(Candidate {
                        label,
                        predicted_s: t,
                        peak: plan.memory.gpus.iter().map(|g| g.peak).max().unwrap_or(0),
                        fits: true,
                    });
                    if best.as_ref().is_none_or(|(bt, _)| t < *bt) {
                        best = Some((t, plan));
                    }
                    break;
                }
                Err((Unfit::Device(ob, in_decode), t)) => {
                    st.candidates.push(Candidate {
                        label,
                        predicted_s: t,
                        peak: ob.peak,
                        fits: false,
                    });
                    // the rows estimate the layout: the next estimate must leave room for what
                    // this one missed, the overshoot and the room it left (the overshoot
                    // doubled at each further attempt, where the miss changes with the answer)
                    let over = ob.peak.saturating_sub(ob.budget).max(1) << attempt;
                    let room = placement.residency.room;
                    if closest.as_ref().is_none_or(|c| ob.peak < c.peak) {
                        closest = Some(ob);
                    }
                    if in_decode {
                        cuts.decode += over + room.decode;
                    } else {
                        cuts.train += over + room.train;
                    }
                }
                Err((Unfit::Host(need, budget), t)) => {
                    st.candidates.push(Candidate {
                        label,
                        predicted_s: t,
                        peak: 0,
                        fits: false,
                    });
                    if host_short.is_none_or(|(n, _)| need < n) {
                        host_short = Some((need, budget));
                    }
                    break;
                }
            }
        }
    }
    let Some((_, plan)) = best else {
        if let Some((need, budget)) = host_short {
            return Err(CompileError::user(
                "schedule.host_memory",
                format!(
                    "the job fits in device memory only by offloading {} per GPU to host memory, but `schedule.host_memory` is {}",
                    crate::error::gib(need),
                    crate::error::gib(budget)
                ),
                format!("set `host_memory` to at least {}", crate::error::gib(need)),
            ));
        }
        let ob = closest.ok_or_else(|| CompileError::internal("no candidate plan was built"))?;
        return Err(CompileError::user(
            "schedule.memory_budget",
            format!("the job does not fit in device memory with any residency the planner tried (reference weights, optimizer state and kept prefix states on host, the frozen rollout extra rebuilt each iteration, prefix work after decode): {}", ob.message()),
            "raise the memory budget, use more GPUs or a larger TP degree, fewer prompts per iteration, or recompute = full",
        ));
    };
    st.time("validate", || rollplex_plan::validate(&plan))
        .map_err(|v| CompileError::internal(format!("the emitted plan fails validation:\n{v}")))?;
    st.tasks = plan.tasks.len();
    st.buffers = plan.buffers.len();
    Ok(Compiled { plan, stats: st })
}

/// Solves per topology: the first, then one per overshooting attempt (plus one that ignores
/// the host budget when none fits, to tell the user what host memory would do).
pub const MAX_ATTEMPTS: usize = 4;

/// Why a candidate plan cannot run.
enum Unfit {
    /// Over the device memory budget; whether the peak is in the rollout phase (decode
    /// windows and what runs before them) rather than after decode.
    Device(OverBudget, bool),
    /// Offloads more than the host memory the job allows: (bytes needed, budget).
    Host(u64, u64),
}

/// Steps 5-7 for one placement: a plan that fits, or why not and its predicted time.
fn build(
    st: &mut Stats,
    pg: &PhaseGraph,
    p: &Placement,
    cost: &CostModel,
    solver: SolverStats,
    check_ir: bool,
) -> Result<std::result::Result<Plan, (Unfit, f64)>> {
    let sched = st.time("assemble", || assemble(pg, p, cost))?;
    if check_ir {
        crate::ir::verify_sched(&sched).map_err(CompileError::internal)?;
    }
    let mut plan = st.time("emit", || crate::emit::emit(pg, &sched, cost, solver));
    let t = plan.predicted.iteration_s;
    if let Err(o) = st.time("memory", || crate::memory::layout(&mut plan)) {
        let in_decode = plan.task(o.at).is_some_and(|task| {
            task.window.is_some() || matches!(task.op, Op::EncodeMedia { .. } | Op::Prefill { .. })
        });
        return Ok(Err((Unfit::Device(o, in_decode), t)));
    }
    let host_budget = pg.spec.schedule.host_memory;
    if let Some(g) = plan.memory.gpus.iter().find(|g| g.host > host_budget) {
        return Ok(Err((Unfit::Host(g.host, host_budget), t)));
    }
    Ok(Ok(plan))
}
