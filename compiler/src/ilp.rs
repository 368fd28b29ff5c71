//! The planner's MILP (good_lp + HiGHS): per decode window, the SM split and how many items
//! of each side class run in it; which classes' buffers must fit next to decode; which large
//! buffers stay in HBM and where the weight sync runs ([`Residency`], built by
//! the residency pass). Serial and disaggregated plans solve the residency part alone (no
//! windows, no classes).
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
//! - side work ends before the window's decode (no big-M: the per-option item counts make the
//!   relaxation tight), and `n[c][w][j]` is at most the whole items of `c` that fit beside
//!   that decode by themselves (so one large item is not spread over windows): while an item
//!   of class `c` runs, decode advances at `1 / s_c` of its speed alone (`s_c =
//!   decode_slowdown`), so the side work uses up `sum_c n[c][w][j] * item_time[c][j] / s_c <=
//!   decode_time[w][j] * y[w][j]` of the decode's time alone; the option without side SMs
//!   admits no item;
//! - readiness: `cum(c, w) <= ready[c][w]` (items whose groups finish before `w` starts);
//! - precedence, cumulative over windows: `All` (`n[succ][w] <= N_succ z[pred][w]`,
//!   `N_pred z[pred][w] <= cum(pred, w)`), `Ratio` (`a cum(pred, w) >= b cum(succ, w)`);
//! - memory: `u[c] N_c >= sum_w n[c][w]`, `sum_c u[c] bytes[c] <= headroom` (without a
//!   residency part; with one, the decode row below replaces it).
//!
//! Residency part: `off[i]` (binary: item `i` leaves HBM outside the phases that use it),
//! `v[i]` (in HBM during decode), `x[k]` (binary: reshard option `k`), `s_d, s_t >= 0`
//! (GiB over budget):
//! - `v[i] >= 1 - off[i]`, `v[i] >= u[c]` for the classes that need the item in a window;
//! - decode row: `decode_base + sum_i bytes[i] v[i] + sum_c u[c] bytes[c] <= budget_d + s_d`;
//! - training row: `train_base + sum_i bytes[i] (1 - off[i]) <= budget_t + s_t` (items needed
//!   in training whatever their residency count in full);
//! - host row: `sum_i host_bytes[i] off[i] <= host budget`;
//! - `sum_k x[k] = 1`; `x[k] + off[i] <= 1` where option `k` needs item `i` in HBM;
//! - kept prefix states ([`KeptState`]): `h[k]` (binary: the state its class produces in
//!   windows goes to host chunk by chunk and comes back after decode); `h[k] <= u[class]`
//!   (only what is produced next to decode moves; a class left out of the windows is the
//!   drop-and-recompute choice: produced after decode, not in the decode row);
//!   `h[k] + u[consumer] <= 1` (reloads follow decode, so consumers do too); the decode row
//!   counts `host_resident` instead of the class's bytes (`- (bytes[c] - host_resident) h[k]`),
//!   the host row `host_bytes h[k]`, the objective `host_s h[k]`;
//! - objective adds `sum_i off_s[i] off[i] + sum_k exposed_s[k] x[k] + 1000 (s_d + s_t)`: the
//!   transfer or rebuild time of every item moved off HBM, the sync time not hidden, and a
//!   steep price per GiB over budget (soft rows keep the model feasible; the driver reports a
//!   plan that still does not fit with its numbers).
//!
//! Objective: `sum_w sum_j (decode_time[w][j] y[w][j] + sum_c (1 - 1/s_c) item_time[c][j]
//! n[c][w][j]) + sum_c (N_c - sum_w n[c][w]) post_time[c]` (the windows: decode alone on its
//! partition plus what the side work beside it costs it, exactly the timing pass's
//! [`rollplex_cost::beside_time`] while the side work ends first; then what is left for after
//! decode on the whole GPU; with every `s_c = 1` and the slowdown folded into `decode_time` it
//! is the whole-window pricing the overlap scheduler also solves) plus tie-breakers (1e-7
//! scale) that prefer smaller side partitions and earlier windows, HBM over host (1e-6 per
//! item, in item order) and the first reshard option, so equal-time plans come
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

/// Fraction by which side work may exceed a window's decode time when filling.
pub const FILL_SLACK: f64 = 0.03;

/// One ILP solve.
#[derive(Clone, Debug, PartialEq)]
pub struct IlpRun {
    pub label: String,
    pub variables: u32,
    pub integer_variables: u32,
    pub constraints: u32,
    pub solve_s: f64,
    pub status: SolveStatus,
    pub objective: f64,
}

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
    /// How many times slower decode runs while an item of this class runs beside it (>= 1).
    pub decode_slowdown: f64,
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
    /// `decode_time[w][j]`: seconds of window `w`'s decode alone on option `j`'s decode SMs
    /// (what side work beside it adds is priced per item, see the module doc).
    pub decode_time: Vec<Vec<f64>>,
    pub classes: Vec<ClassInput>,
    pub precs: Vec<Prec>,
    pub headroom: f64,
    /// Residency and reshard-point decisions (see [`Residency`]); `None`: none to take.
    pub residency: Option<Residency>,
    pub time_limit_s: f64,
}

/// A large buffer the ILP may keep in HBM or move off it outside the phases that need it
/// (to host memory, or dropped and rebuilt).
#[derive(Clone, Debug, PartialEq)]
pub struct ResItem {
    pub name: String,
    pub bytes: f64,
    /// Host bytes it takes when off HBM (0 when dropped and rebuilt).
    pub host_bytes: f64,
    /// Seconds the iteration gets longer when it is off HBM (reloads, write-backs, rebuilds).
    pub off_s: f64,
    /// In the decode-phase memory row when kept in HBM.
    pub decode_kept: bool,
    /// In the decode-phase memory row even when off HBM (its users run in the rollout phase).
    pub decode_off: bool,
    /// Side classes whose items, when in a window, need it in HBM during decode.
    pub decode_if_class: Vec<usize>,
    /// In the training-phase memory row when kept / when off.
    pub train_kept: bool,
    pub train_off: bool,
}

/// Where the weight sync may run: its exposed seconds and the items whose being off HBM
/// rules it out.
#[derive(Clone, Debug, PartialEq)]
pub struct ReshardOption {
    pub name: &'static str,
    pub exposed_s: f64,
    pub excludes: Vec<usize>,
}

/// A kept prefix state a side class produces and a later class consumes: in HBM from its first
/// producer in a window (as the class's `bytes` in the decode row), on host (each producer's
/// chunk offloaded right after it, reloaded after decode: only `host_resident` bytes live next
/// to decode), or produced after decode (the class stays out of the windows).
#[derive(Clone, Debug, PartialEq)]
pub struct KeptState {
    pub name: String,
    /// Producer class (index into [`Problem::classes`]).
    pub class: usize,
    /// Consumer classes, kept out of the windows when the state is on host.
    pub consumers: Vec<usize>,
    /// Device bytes next to decode when on host (the chunks in flight).
    pub host_resident: f64,
    /// Host bytes it takes when on host.
    pub host_bytes: f64,
    /// Seconds the iteration gets longer when on host (transfers not hidden).
    pub host_s: f64,
}

/// Residency and reshard-point part of the model: memory rows for the decode and the
/// training phase (the two peaks of an iteration), a host-memory row, the options.
#[derive(Clone, Debug, PartialEq)]
pub struct Residency {
    pub items: Vec<ResItem>,
    /// Kept prefix states that may go to host (overlap plans only: they need classes).
    pub kept: Vec<KeptState>,
    /// Device bytes of the decode and the training phase besides the items and side classes.
    pub decode_base: f64,
    pub train_base: f64,
    /// Device budget of each row (the memory budget minus what earlier attempts overshot).
    pub decode_budget: f64,
    pub train_budget: f64,
    pub host_budget: f64,
    /// At least one option; the first is the fallback.
    pub reshard: Vec<ReshardOption>,
}

/// Seconds the objective charges per GiB over a memory row (soft rows keep the model
/// feasible; the driver reports a plan that does not fit with its numbers).
pub const OVER_BUDGET_S_PER_GIB: f64 = 1e3;

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
    /// Per residency item: off HBM.
    pub off: Vec<bool>,
    /// The chosen reshard option.
    pub reshard: usize,
    /// Per kept prefix state: on host.
    pub kept_host: Vec<bool>,
}

/// Branch-and-bound node limit: what stops a long search. Unlike a wall-clock limit it stops at
/// the same point on every machine and under any load, so plans (and the checked-in examples)
/// are reproducible; the time limit (`Options::time_limit_s` of the driver) is only a safety
/// net. Reaching either is reported as a time limit. Every checked-in example solves to
/// optimality well inside it; `examples/paper-32b-32xh800.rpx` with `max_new_tokens = 4096`
/// reaches it after ~7 s on the 2-core workspace machine with an objective 0.3% above the
/// optimum (30.251 against 30.155 s, which took 68.5 s and ~11,000 nodes to prove). At 20,000
/// nodes, as before, the 2 s time limit stopped that search first, wherever the machine got to.
pub const MAX_NODES: i32 = 1_000;

/// HiGHS presolve rules turned off (its `presolve_rule_off` bit mask): dual fixing (bit 17).
/// With it and the all-after-decode MIP start, HiGHS (highs-sys 1.16) reported the start as
/// optimal on a problem where moving a kept prefix state to host is better (objective 14 s
/// instead of 11 s, `tests::kept_state_in_hbm_on_host_or_after_decode`); turning off dual
/// fixing or probing gives the right answer, and the example plans come out the same.
pub const PRESOLVE_RULES_OFF: i32 = 1 << 17;

/// Relative optimality gap at which HiGHS stops: plans within 0.1% of the best predicted time
/// are as good as the cost model can tell apart.
pub const MIP_REL_GAP: f32 = 1e-3;

/// Decode slowdowns of a partition (decode alone on the split's decode SMs relative to decode
/// on the whole GPU; what side work beside it adds is priced per item) at which a split is
/// offered: for each, the split with the fewest decode SMs within it.
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

/// A slowdown as the model uses it: finite and at least 1.
/// How many items that each use up `per_item` of a decode's time alone fit beside a decode of
/// `decode` seconds (with the fill's slack, [`FILL_SLACK`]), at most
/// `count`.
fn whole_items(per_item: f64, decode: f64, count: u32) -> u32 {
    // zero (or NaN) time per item: nothing bounds the count but the class
    if per_item.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return count;
    }
    let fit = (decode * (1.0 + FILL_SLACK) / per_item).floor();
    if fit.is_finite() {
        (fit.max(0.0) as u64).min(count as u64) as u32
    } else {
        0
    }
}

fn slowdown(s: f64) -> f64 {
    if s.is_finite() {
        s.max(1.0)
    } else {
        1.0
    }
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
    // Residency: off[i] (binary), v[i] (in HBM during decode), x[k] (reshard option), slacks.
    let empty = Residency {
        items: vec![],
        kept: vec![],
        decode_base: 0.0,
        train_base: 0.0,
        decode_budget: 0.0,
        train_budget: 0.0,
        host_budget: 0.0,
        reshard: vec![],
    };
    let res = p.residency.as_ref().unwrap_or(&empty);
    let ni = res.items.len();
    let off: Vec<Variable> = (0..ni).map(|_| vars.add(variable().binary())).collect();
    let dv: Vec<Option<Variable>> = res
        .items
        .iter()
        .map(|it| (it.decode_kept && !it.decode_off).then(|| vars.add(variable().min(0).max(1))))
        .collect();
    let x: Vec<Variable> = if res.reshard.len() > 1 {
        res.reshard
            .iter()
            .map(|_| vars.add(variable().binary()))
            .collect()
    } else {
        vec![]
    };
    // h[k] only for states whose producer class exists.
    let h: Vec<Option<Variable>> = res
        .kept
        .iter()
        .map(|k| (k.class < nc).then(|| vars.add(variable().binary())))
        .collect();
    let slack: Vec<Variable> = if p.residency.is_some() {
        (0..2).map(|_| vars.add(variable().min(0))).collect()
    } else {
        vec![]
    };
    // n[c][w][j] (continuous, see the module docs) only where option j has side SMs, bounded
    // by the whole items that fit beside the window's decode (a continuous count would
    // otherwise spread one item too large for any window over several, which the fill cannot
    // place: the plan then kept none of the side work the objective had counted).
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
                            let fits = whole_items(
                                cl.item_time[j] / slowdown(cl.decode_slowdown),
                                p.decode_time[w][j],
                                cl.count,
                            );
                            (usable && fits > 0)
                                .then(|| vars.add(variable().min(0).max(fits as f64)))
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
    let nints = count(&y)
        + count(&z)
        + u.len() as u32
        + off.len() as u32
        + x.len() as u32
        + h.iter().flatten().count() as u32;
    let nvars = nints
        + n.iter().map(count).sum::<u32>()
        + (nc * nw) as u32
        + dv.iter().flatten().count() as u32
        + slack.len() as u32;
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
            // what each item costs the decode beside it
            let cost = 1.0 - 1.0 / slowdown(cl.decode_slowdown);
            for j in 0..nj {
                if let Some(v) = n[c][w][j] {
                    obj += cost * cl.item_time[j] * v;
                }
            }
        }
    }
    for (i, it) in res.items.iter().enumerate() {
        obj += (it.off_s + 1e-6 * (i as f64 + 1.0)) * off[i];
    }
    for (k, o) in res.reshard.iter().enumerate() {
        if let Some(&xv) = x.get(k) {
            obj += (o.exposed_s + 1e-7 * k as f64) * xv;
        }
    }
    // HBM over host for kept states, in state order, after the items.
    for (k, ks) in res.kept.iter().enumerate() {
        if let Some(hv) = h[k] {
            obj += (ks.host_s + 1e-6 * (ni + k + 1) as f64) * hv;
        }
    }
    for &sv in &slack {
        obj += OVER_BUDGET_S_PER_GIB * sv;
    }
    let model = vars
        .minimise(obj)
        .using(highs)
        .set_threads(1)
        .set_time_limit(p.time_limit_s.max(0.01))
        .set_mip_rel_gap(MIP_REL_GAP)
        .map_err(|e| format!("cannot set the MIP gap: {e:?}"))?;
    let mut model = model
        .set_option("mip_max_nodes", MAX_NODES)
        .set_option("presolve_rule_off", PRESOLVE_RULES_OFF);
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
            // the decode's time alone that the side work beside it uses up
            let load: Expression = (0..nc)
                .filter_map(|c| {
                    let cl = &p.classes[c];
                    n[c][w][j].map(|v| cl.item_time[j] / slowdown(cl.decode_slowdown) * v)
                })
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
    let side_mem: Expression = (0..nc).map(|c| p.classes[c].bytes / gib * u[c]).sum();
    if p.residency.is_none() {
        add!(constraint!(side_mem <= p.headroom.max(0.0) / gib));
    } else {
        // Decode row: base + items in HBM during decode + side classes' buffers.
        let mut dec = side_mem + res.decode_base / gib;
        let mut train = Expression::from(res.train_base / gib);
        let mut host = Expression::from(0.0);
        for (i, it) in res.items.iter().enumerate() {
            let b = it.bytes / gib;
            if it.decode_off {
                dec += b;
            } else if let Some(v) = dv[i] {
                add!(constraint!(v + off[i] >= 1.0));
                for &c in &it.decode_if_class {
                    if c < nc {
                        add!(constraint!(v >= u[c]));
                    }
                }
                dec += b * v;
            }
            if it.train_off {
                train += b;
            } else if it.train_kept {
                train += b - b * off[i];
            }
            host += it.host_bytes / gib * off[i];
        }
        for (k, ks) in res.kept.iter().enumerate() {
            let Some(hv) = h[k] else { continue };
            add!(constraint!(hv <= u[ks.class]));
            for &c in &ks.consumers {
                if c < nc {
                    add!(constraint!(hv + u[c] <= 1.0));
                }
            }
            let saved = (p.classes[ks.class].bytes - ks.host_resident).max(0.0) / gib;
            dec += -saved * hv;
            host += ks.host_bytes / gib * hv;
        }
        add!(constraint!(dec <= res.decode_budget / gib + slack[0]));
        add!(constraint!(train <= res.train_budget / gib + slack[1]));
        add!(constraint!(host <= res.host_budget.max(0.0) / gib));
        if !x.is_empty() {
            let one: Expression = x.iter().map(|&v| Expression::from(v)).sum();
            add!(constraint!(one == 1.0));
            for (k, o) in res.reshard.iter().enumerate() {
                for &i in &o.excludes {
                    if i < ni {
                        add!(constraint!(x[k] + off[i] <= 1.0));
                    }
                }
            }
        }
    }

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
    // Residency start: everything in HBM, the first reshard option, slacks as needed.
    if p.residency.is_some() {
        let mut dec = res.decode_base;
        let mut train = res.train_base;
        for (i, it) in res.items.iter().enumerate() {
            init.push((off[i], 0.0));
            if let Some(v) = dv[i] {
                init.push((v, 1.0));
            }
            if it.decode_kept || it.decode_off {
                dec += it.bytes;
            }
            if it.train_kept || it.train_off {
                train += it.bytes;
            }
        }
        for (k, &xv) in x.iter().enumerate() {
            init.push((xv, if k == 0 { 1.0 } else { 0.0 }));
        }
        init.push((slack[0], ((dec - res.decode_budget) / gib).max(0.0)));
        init.push((slack[1], ((train - res.train_budget) / gib).max(0.0)));
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
        let cost = 1.0 - 1.0 / slowdown(cl.decode_slowdown);
        for w in 0..nw {
            if counts[c][w] > 0 {
                objective += cost * counts[c][w] as f64 * cl.item_time[option[w]];
            }
        }
    }
    let off_ans: Vec<bool> = off.iter().map(|&v| sol.value(v) > 0.5).collect();
    let reshard = x
        .iter()
        .enumerate()
        .max_by(|a, b| {
            sol.value(*a.1)
                .total_cmp(&sol.value(*b.1))
                .then(b.0.cmp(&a.0))
        })
        .map(|(k, _)| k)
        .unwrap_or(0);
    for (i, it) in res.items.iter().enumerate() {
        if off_ans[i] {
            objective += it.off_s;
        }
    }
    objective += res.reshard.get(reshard).map(|o| o.exposed_s).unwrap_or(0.0);
    let kept_host: Vec<bool> = h
        .iter()
        .map(|v| v.is_some_and(|v| sol.value(v) > 0.5))
        .collect();
    for (k, ks) in res.kept.iter().enumerate() {
        if kept_host[k] {
            objective += ks.host_s;
        }
    }
    Ok(Answer {
        option,
        counts,
        off: off_ans,
        reshard,
        kept_host,
        status,
        objective,
        variables: nvars,
        integer_variables: nints,
        constraints: ncons,
        solve_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    fn item(name: &str, gib: f64, off_s: f64) -> ResItem {
        ResItem {
            name: name.into(),
            bytes: gib * GIB,
            host_bytes: gib * GIB,
            off_s,
            decode_kept: false,
            decode_off: false,
            decode_if_class: vec![],
            train_kept: true,
            train_off: false,
        }
    }

    /// Residency alone, hand-solved: A (10 GiB, 1.0 s off HBM), B (4 GiB, 0.2 s); the
    /// training row has `80 - 70 - 14 = -4` GiB of room with both in HBM.
    fn problem(train_budget_gib: f64, beside: bool) -> Problem {
        let mut reshard = vec![ReshardOption {
            name: "iteration_start",
            exposed_s: 0.5,
            excludes: vec![],
        }];
        if beside {
            reshard.push(ReshardOption {
                name: "beside_encode",
                exposed_s: 0.1,
                excludes: vec![1],
            });
        }
        Problem {
            options: vec![],
            decode_time: vec![],
            classes: vec![],
            precs: vec![],
            headroom: 0.0,
            residency: Some(Residency {
                items: vec![item("A", 10.0, 1.0), item("B", 4.0, 0.2)],
                kept: vec![],
                decode_base: 0.0,
                train_base: 70.0 * GIB,
                decode_budget: 80.0 * GIB,
                train_budget: train_budget_gib * GIB,
                host_budget: 100.0 * GIB,
                reshard,
            }),
            time_limit_s: 5.0,
        }
    }

    #[test]
    fn moves_the_cheapest_item_that_makes_room() {
        // 4 GiB short: B alone (0.2 s) beats A (1.0 s).
        let a = solve(&problem(80.0, false)).unwrap();
        assert_eq!(a.off, vec![false, true]);
        // 9 GiB short: B is too small, A alone is cheaper than both.
        let a = solve(&problem(75.0, false)).unwrap();
        assert_eq!(a.off, vec![true, false]);
        assert!((a.objective - 1.5).abs() < 1e-9, "{}", a.objective);
        // Room for both: nothing moves.
        let a = solve(&problem(90.0, false)).unwrap();
        assert_eq!(a.off, vec![false, false]);
    }

    #[test]
    fn reshard_point_trades_against_residency() {
        // Beside-encode (0.1 s) needs B in HBM, so it needs A off (1.0 s): 1.1 s against
        // B off at iteration start, 0.2 + 0.5 = 0.7 s.
        let a = solve(&problem(80.0, true)).unwrap();
        assert_eq!((a.off.clone(), a.reshard), (vec![false, true], 0));
        // With room for both, beside-encode wins alone.
        let a = solve(&problem(90.0, true)).unwrap();
        assert_eq!((a.off.clone(), a.reshard), (vec![false, false], 1));
    }

    #[test]
    fn over_budget_still_answers_with_everything_off() {
        let a = solve(&problem(50.0, false)).unwrap();
        assert_eq!(a.off, vec![true, true]);
    }

    #[test]
    fn host_budget_is_respected() {
        let mut p = problem(80.0, false);
        if let Some(r) = p.residency.as_mut() {
            r.host_budget = 5.0 * GIB;
        }
        // B fits on the host (4 GiB), A does not.
        assert_eq!(solve(&p).unwrap().off, vec![false, true]);
        if let Some(r) = p.residency.as_mut() {
            r.host_budget = 3.0 * GIB;
        }
        assert_eq!(solve(&p).unwrap().off, vec![false, false]);
    }

    /// One window, a class of 4 items (1 s each on the side partition or after decode) whose
    /// kept state is 8 GiB (4 GiB next to decode when on host, 0.5 s of transfers), decode
    /// base 70 GiB. Splitting costs decode 0.5 s, so running the class in the window saves
    /// 3.5 s: HBM when it fits (78 GiB), host when only 74 GiB do, after decode when even that
    /// does not or when host memory or transfers cost too much.
    fn kept(decode_budget_gib: f64, host_s: f64, host_budget_gib: f64) -> Problem {
        Problem {
            options: vec![
                SplitOption {
                    decode_sms: 64,
                    side_sms: 68,
                },
                SplitOption {
                    decode_sms: 132,
                    side_sms: 0,
                },
            ],
            decode_time: vec![vec![10.5, 10.0]],
            classes: vec![ClassInput {
                name: "train_prefix",
                count: 4,
                ready: vec![4],
                item_time: vec![1.0, f64::INFINITY],
                decode_slowdown: 1.0,
                post_time: 1.0,
                bytes: 8.0 * GIB,
            }],
            precs: vec![],
            headroom: 0.0,
            residency: Some(Residency {
                items: vec![],
                kept: vec![KeptState {
                    name: "train_prefix.s0".into(),
                    class: 0,
                    consumers: vec![],
                    host_resident: 4.0 * GIB,
                    host_bytes: 8.0 * GIB,
                    host_s,
                }],
                decode_base: 70.0 * GIB,
                train_base: 0.0,
                decode_budget: decode_budget_gib * GIB,
                train_budget: 80.0 * GIB,
                host_budget: host_budget_gib * GIB,
                reshard: vec![ReshardOption {
                    name: "iteration_start",
                    exposed_s: 0.0,
                    excludes: vec![],
                }],
            }),
            time_limit_s: 5.0,
        }
    }

    /// One window: decode takes 10 s alone on the split's 64 SMs, 9 s on the whole GPU; 4
    /// items of 1 s each (on the side partition, or after decode). An item slows decode `s`
    /// times while it runs, costing it `1 - 1/s` s: with s = 2 the window takes 10 + 4 x 0.5 =
    /// 12 s against 9 + 4 = 13 s without the split (a whole-window slowdown would have priced
    /// the split at 20 s); with s = 5, 10 + 4 x 0.8 = 13.2 s, and the items run after decode.
    #[test]
    fn side_items_cost_decode_only_while_they_run() {
        let p = |s: f64| {
            let mut p = kept(100.0, 0.0, 100.0);
            p.decode_time = vec![vec![10.0, 9.0]];
            p.classes[0].decode_slowdown = s;
            p.residency.as_mut().unwrap().kept.clear();
            p
        };
        let placed = |a: &Answer| a.counts[0].iter().sum::<u32>();
        let a = solve(&p(2.0)).unwrap();
        assert_eq!((placed(&a), a.option.clone()), (4, vec![0]));
        assert!((a.objective - 12.0).abs() < 1e-6, "{}", a.objective);
        let a = solve(&p(5.0)).unwrap();
        assert_eq!((placed(&a), a.option.clone()), (0, vec![1]));
        assert!((a.objective - 13.0).abs() < 1e-6, "{}", a.objective);
        // the side work must end before decode: at s = 2, 4 items use up 2 s of decode's 10 s;
        // with decode at 1.2 s alone on the split only 2 items fit (2 x 0.5 <= 1.2 < 3 x 0.5)
        let mut q = p(2.0);
        q.decode_time = vec![vec![1.2, 1.0]];
        let a = solve(&q).unwrap();
        assert_eq!(placed(&a), 2);
        assert!((a.objective - 4.2).abs() < 1e-6, "{}", a.objective);
    }

    /// Three windows of 1 s decode on the split (0.9 s on the whole GPU), one item of 1.5 s on
    /// the side partition (0.2 s after decode on the whole GPU): it fits no window by itself.
    /// A continuous count could put half of it in each of two windows (its cumulative count
    /// floors to 1, which no window can hold); the count is bounded by the whole items that fit,
    /// so the item runs after decode and no window splits.
    #[test]
    fn an_item_too_large_for_every_window_is_not_spread_over_several() {
        let mut p = kept(100.0, 0.0, 100.0);
        p.residency.as_mut().unwrap().kept.clear();
        p.decode_time = vec![vec![1.0, 0.9]; 3];
        p.classes[0].count = 1;
        p.classes[0].ready = vec![1; 3];
        p.classes[0].item_time = vec![1.5, f64::INFINITY];
        p.classes[0].post_time = 0.2;
        let a = solve(&p).unwrap();
        assert_eq!(a.counts[0], vec![0, 0, 0]);
        assert_eq!(a.option, vec![1, 1, 1]);
        assert!((a.objective - 2.9).abs() < 1e-6, "{}", a.objective);
        assert_eq!(whole_items(0.5, 1.2, 4), 2);
        assert_eq!(whole_items(1.5, 1.0, 4), 0);
        assert_eq!(whole_items(0.1, 10.0, 4), 4);
        assert_eq!(whole_items(0.0, 1.0, 4), 4);
        assert_eq!(whole_items(1.0, f64::NAN, 4), 0);
    }

    #[test]
    fn kept_state_in_hbm_on_host_or_after_decode() {
        let placed = |a: &Answer| a.counts[0].iter().sum::<u32>();
        let a = solve(&kept(80.0, 0.5, 100.0)).unwrap();
        assert_eq!((placed(&a), a.kept_host.clone()), (4, vec![false]));
        assert!((a.objective - 10.5).abs() < 1e-9, "{}", a.objective);
        let a = solve(&kept(75.0, 0.5, 100.0)).unwrap();
        assert_eq!((placed(&a), a.kept_host.clone()), (4, vec![true]));
        assert!((a.objective - 11.0).abs() < 1e-9, "{}", a.objective);
        // 72 GiB: not even the chunks fit next to decode.
        let a = solve(&kept(72.0, 0.5, 100.0)).unwrap();
        assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
        assert!((a.objective - 14.0).abs() < 1e-9, "{}", a.objective);
        // Transfers dearer than the overlap saves, or no host memory: after decode.
        let a = solve(&kept(75.0, 5.0, 100.0)).unwrap();
        assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
        let a = solve(&kept(75.0, 0.5, 4.0)).unwrap();
        assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
    }
}
