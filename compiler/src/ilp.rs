//! The overlap MILP (good_lp + HiGHS): per decode window, the SM split and how many items of
//! each side class run in it; which classes' buffers must fit next to decode.
//!
//! Items of a class are interchangeable (same shapes) and run in item order, so the model
//! counts them instead of placing each: its size grows with the number of windows and split
//! options, not with the batch.
//!
//! Variables: `y[w][j]` (binary: window `w` uses split option `j`), `n[c][w][j]` (items of
//! class `c` in window `w` under option `j`; zero unless `y[w][j]`; continuous, the answer's
//! cumulative counts are floored: the binaries carry the combinatorics, and an integer `n`
//! made HiGHS hit its time limit on the paper-scale jobs), `z[c][w]` (binary:
//! every item of `c` is done by window `w`; only for classes others wait on in full), `u[c]`
//! (binary: class `c` runs in some window, so its buffers live next to decode). Write
//! `n[c][w] = sum_j n[c][w][j]` and `cum(c, w) = sum_{w' <= w} n[c][w']`.
//!
//! Constraints:
//! - one option per window: `sum_j y[w][j] = 1`;
//! - side work fits in the window's decode time under its option (no big-M: the per-option
//!   item counts make the relaxation tight): `sum_c n[c][w][j] * item_time[c][j] <=
//!   decode_time[w][j] * y[w][j]`; the option without side SMs admits no item;
//! - readiness: `cum(c, w) <= ready[c][w]` (items whose groups finish before `w` starts);
//! - precedence, cumulative over windows: `All` (`n[succ][w] <= N_succ z[pred][w]`,
//!   `N_pred z[pred][w] <= cum(pred, w)`), `Ratio` (`a cum(pred, w) >= b cum(succ, w)`);
//! - memory: `u[c] N_c >= sum_w n[c][w]`, `sum_c u[c] bytes[c] <= headroom`.
//!
//! Objective: `sum_w sum_j decode_time[w][j] y[w][j] + sum_c (N_c - sum_w n[c][w]) post_time[c]`
//! (the windows, then what is left for after decode on the whole GPU) plus tie-breakers (1e-7
//! scale) that prefer smaller side partitions and earlier windows, so equal-time plans come
//! out the same on every run. HiGHS runs single-threaded under a node limit ([`MAX_NODES`])
//! and a time limit, so the answer is the same on every machine unless the time limit strikes
//! first; the all-after-decode placement is given as the starting solution, so any limit still
//! yields a feasible answer.
//!
//! Each window is offered decode alone plus a few splits (see [`KNEES`]), not every multiple of
//! the granularity: that keeps the binaries to windows x 5 and the solve well under a second
//! on the paper-scale jobs.

// Variables are indexed by (class, window, option) triples; index loops read best here.
#![allow(clippy::needless_range_loop)]

use good_lp::solvers::highs::highs;
use good_lp::{
    constraint, variable, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, WithInitialSolution,
};
use rollplex_plan::SolveStatus;
use std::time::Instant;

/// One way to split a window's SMs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitOption {
    pub decode_sms: u32,
    /// 0: decode has the whole GPU and no side work runs.
    pub side_sms: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClassInput {
    pub name: &'static str,
    pub count: u32,
    /// Per window: how many items may have started by the end of it (readiness).
    pub ready: Vec<u32>,
    /// Per option: seconds per item on the option's side SMs, co-running with decode.
    pub item_time: Vec<f64>,
    /// Seconds per item after decode, on the whole GPU.
    pub post_time: f64,
    /// Device bytes that must live next to decode if any item runs in a window.
    pub bytes: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PrecKind {
    /// Every item of the successor waits for every item of the predecessor.
    All,
    /// `pred_mul * cum(pred) >= succ_mul * cum(succ)`.
    Ratio { pred_mul: f64, succ_mul: f64 },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prec {
    pub pred: usize,
    pub succ: usize,
    pub kind: PrecKind,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub options: Vec<SplitOption>,
    /// `decode_time[w][j]`: seconds of window `w`'s decode under option `j`.
    pub decode_time: Vec<Vec<f64>>,
    pub classes: Vec<ClassInput>,
    pub precs: Vec<Prec>,
    pub headroom: f64,
    pub time_limit_s: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// Option index per window.
    pub option: Vec<usize>,
    /// `counts[c][w]`.
    pub counts: Vec<Vec<u32>>,
    pub status: SolveStatus,
    pub objective: f64,
    pub variables: u32,
    pub integer_variables: u32,
    pub constraints: u32,
    pub solve_s: f64,
}

/// Branch-and-bound node limit. Unlike the wall-clock limit it stops the search at the same
/// point on every machine, so plans (and the checked-in examples) are reproducible; the time
/// limit is only a safety net. Reaching either is reported as a time limit.
pub const MAX_NODES: i32 = 20_000;

/// Relative optimality gap at which HiGHS stops: plans within 0.1% of the best predicted time
/// are as good as the cost model can tell apart.
pub const MIP_REL_GAP: f32 = 1e-3;

/// Decode slowdowns (relative to decode on the whole GPU, co-run factor included) at which a
/// split is offered: for each, the split with the fewest decode SMs within it.
pub const KNEES: [f64; 4] = [0.02, 0.08, 0.2, 0.4];

/// Options offered for one window: decode alone, and per knee the split that gives decode the
/// fewest SMs while keeping its time within the knee. Splits in between are dominated in
/// practice (the measured decode curves are flat past their knee and steep below it), and
/// fewer options keep the model small: its binaries are windows x offered options.
fn useful_options(p: &Problem, w: usize) -> Vec<usize> {
    let nos = (0..p.options.len()).find(|&j| p.options[j].side_sms == 0);
    let base = nos.map(|j| p.decode_time[w][j]).unwrap_or(f64::INFINITY);
    let mut splits: Vec<usize> = (0..p.options.len())
        .filter(|&j| p.options[j].side_sms > 0 && p.decode_time[w][j].is_finite())
        .collect();
    splits.sort_by_key(|&j| p.options[j].decode_sms);
    let mut keep: Vec<usize> = Vec::new();
    for k in KNEES {
        if let Some(&j) = splits
            .iter()
            .find(|&&j| p.decode_time[w][j] <= base * (1.0 + k))
        {
            if !keep.contains(&j) {
                keep.push(j);
            }
        }
    }
    keep.extend(nos);
    keep.sort_unstable();
    keep
}

pub fn solve(p: &Problem) -> Result<Answer, String> {
    let nw = p.decode_time.len();
    let nj = p.options.len();
    let nc = p.classes.len();
    let opts: Vec<Vec<usize>> = (0..nw).map(|w| useful_options(p, w)).collect();
    let mut vars = ProblemVariables::new();
    // y[w][j] only for the useful options of each window.
    let y: Vec<Vec<Option<Variable>>> = (0..nw)
        .map(|w| {
            (0..nj)
                .map(|j| opts[w].contains(&j).then(|| vars.add(variable().binary())))
                .collect()
        })
        .collect();
    let all_pred: Vec<bool> = (0..nc)
        .map(|c| {
            p.precs
                .iter()
                .any(|q| q.pred == c && q.kind == PrecKind::All)
        })
        .collect();
    let z: Vec<Vec<Option<Variable>>> = (0..nc)
        .map(|c| {
            (0..nw)
                .map(|_| all_pred[c].then(|| vars.add(variable().binary())))
                .collect()
        })
        .collect();
    let u: Vec<Variable> = (0..nc).map(|_| vars.add(variable().binary())).collect();
    // n[c][w][j] (continuous, see the module docs) only where option j has side SMs.
    let n: Vec<Vec<Vec<Option<Variable>>>> = p
        .classes
        .iter()
        .map(|cl| {
            (0..nw)
                .map(|w| {
                    (0..nj)
                        .map(|j| {
                            let usable = y[w][j].is_some()
                                && p.options[j].side_sms > 0
                                && cl.count > 0
                                && cl.item_time[j].is_finite();
                            usable.then(|| vars.add(variable().min(0).max(cl.count as f64)))
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    // cum[c][w] = items of class c in windows 0..=w (keeps the rows sparse).
    let cum_v: Vec<Vec<Variable>> = p
        .classes
        .iter()
        .map(|cl| {
            (0..nw)
                .map(|_| vars.add(variable().min(0).max(cl.count as f64)))
                .collect()
        })
        .collect();
    let count = |v: &Vec<Vec<Option<Variable>>>| v.iter().flatten().flatten().count() as u32;
    let nints = count(&y) + count(&z) + u.len() as u32;
    let nvars = nints + n.iter().map(count).sum::<u32>() + (nc * nw) as u32;
    let nw_expr = |c: usize, w: usize| -> Expression {
        n[c][w].iter().flatten().map(|&v| Expression::from(v)).sum()
    };
    let cum = |c: usize, w: usize| -> Expression { Expression::from(cum_v[c][w]) };

    let mut obj = Expression::from(0.0);
    for w in 0..nw {
        for j in 0..nj {
            if let Some(yv) = y[w][j] {
                obj += (p.decode_time[w][j] + 1e-7 * p.options[j].side_sms as f64 / 1000.0) * yv;
            }
        }
    }
    for (c, cl) in p.classes.iter().enumerate() {
        obj += cl.count as f64 * cl.post_time;
        for w in 0..nw {
            obj += (1e-7 * (w as f64 + 1.0) - cl.post_time) * nw_expr(c, w);
        }
    }
    let model = vars
        .minimise(obj)
        .using(highs)
        .set_threads(1)
        .set_time_limit(p.time_limit_s.max(0.01))
        .set_mip_rel_gap(MIP_REL_GAP)
        .map_err(|e| format!("cannot set the MIP gap: {e:?}"))?;
    let mut model = model.set_option("mip_max_nodes", MAX_NODES);
    let mut ncons = 0u32;
    macro_rules! add {
        ($c:expr) => {{
            model.add_constraint($c);
            ncons += 1;
        }};
    }
    for c in 0..nc {
        for w in 0..nw {
            let prev: Expression = if w == 0 {
                Expression::from(0.0)
            } else {
                Expression::from(cum_v[c][w - 1])
            };
            add!(constraint!(cum_v[c][w] == prev + nw_expr(c, w)));
        }
    }
    for w in 0..nw {
        let one: Expression = y[w].iter().flatten().map(|&v| Expression::from(v)).sum();
        add!(constraint!(one == 1.0));
        for j in 0..nj {
            let Some(yv) = y[w][j] else { continue };
            let load: Expression = (0..nc)
                .filter_map(|c| n[c][w][j].map(|v| p.classes[c].item_time[j] * v))
                .sum();
            if (0..nc).any(|c| n[c][w][j].is_some()) {
                add!(constraint!(load <= p.decode_time[w][j] * yv));
            }
        }
    }
    for (c, cl) in p.classes.iter().enumerate() {
        for w in 0..nw {
            add!(constraint!(
                cum(c, w) <= cl.ready.get(w).copied().unwrap_or(0) as f64
            ));
            if let Some(zv) = z[c][w] {
                add!(constraint!(cl.count as f64 * zv <= cum(c, w)));
            }
        }
        if nw > 0 {
            add!(constraint!(cum_v[c][nw - 1] <= cl.count as f64 * u[c]));
        }
    }
    for q in &p.precs {
        for w in 0..nw {
            match q.kind {
                PrecKind::All => {
                    if let Some(zv) = z[q.pred][w] {
                        add!(constraint!(
                            nw_expr(q.succ, w) <= p.classes[q.succ].count as f64 * zv
                        ));
                    }
                }
                PrecKind::Ratio { pred_mul, succ_mul } => {
                    add!(constraint!(
                        pred_mul * cum(q.pred, w) >= succ_mul * cum(q.succ, w)
                    ));
                }
            }
        }
    }
    let gib = (1u64 << 30) as f64;
    let mem: Expression = (0..nc).map(|c| p.classes[c].bytes / gib * u[c]).sum();
    add!(constraint!(mem <= p.headroom.max(0.0) / gib));

    // Start from the feasible all-after-decode answer: no items, decode on the whole GPU.
    let nos = p.options.iter().position(|o| o.side_sms == 0).unwrap_or(0);
    let mut init: Vec<(Variable, f64)> = Vec::new();
    for w in 0..nw {
        for j in 0..nj {
            if let Some(yv) = y[w][j] {
                init.push((yv, if j == nos { 1.0 } else { 0.0 }));
            }
            for c in 0..nc {
                if let Some(v) = n[c][w][j] {
                    init.push((v, 0.0));
                }
            }
        }
    }
    for c in 0..nc {
        init.push((u[c], 0.0));
        for w in 0..nw {
            init.push((cum_v[c][w], 0.0));
        }
        for w in 0..nw {
            if let Some(zv) = z[c][w] {
                init.push((zv, if p.classes[c].count == 0 { 1.0 } else { 0.0 }));
            }
        }
    }
    let model = model.with_initial_solution(init);
    let started = Instant::now();
    let sol = model
        .solve()
        .map_err(|e: ResolutionError| format!("HiGHS found no answer: {e}"))?;
    let solve_s = started.elapsed().as_secs_f64();
    let status = match sol.status() {
        SolutionStatus::Optimal | SolutionStatus::GapLimit => SolveStatus::Optimal,
        SolutionStatus::TimeLimit => SolveStatus::TimeLimit,
    };
    let option: Vec<usize> = (0..nw)
        .map(|w| {
            (0..nj)
                .filter_map(|j| y[w][j].map(|v| (j, sol.value(v))))
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .map(|(j, _)| j)
                .unwrap_or(nos)
        })
        .collect();
    // Items: floor the cumulative counts (keeps readiness and order; a window may gain part
    // of an item, which the timing pass accounts for).
    let counts: Vec<Vec<u32>> = (0..nc)
        .map(|c| {
            let mut prev = 0u32;
            let mut acc = 0.0;
            (0..nw)
                .map(|w| {
                    acc += n[c][w].iter().flatten().map(|&v| sol.value(v)).sum::<f64>();
                    let cum = (acc + 1e-6).floor().max(0.0) as u32;
                    let k = cum.saturating_sub(prev);
                    prev = prev.max(cum);
                    k
                })
                .collect()
        })
        .collect();
    let mut objective = 0.0;
    for w in 0..nw {
        objective += p.decode_time[w][option[w]];
    }
    for (c, cl) in p.classes.iter().enumerate() {
        let placed: u32 = counts[c].iter().sum();
        objective += cl.count.saturating_sub(placed) as f64 * cl.post_time;
    }
    Ok(Answer {
        option,
        counts,
        status,
        objective,
        variables: nvars,
        integer_variables: nints,
        constraints: ncons,
        solve_s,
    })
}
