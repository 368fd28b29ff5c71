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
//! - streaming ([`StreamOption`], the optimizer state): `st[i]` (binary: off HBM and streamed
//!   through it in chunks by its users instead of reloaded whole), `st[i] <= off[i]`; the
//!   training row counts only the staging bytes (`- (bytes[i] - train_bytes[i]) st[i]`), the
//!   objective `stream_s` instead of `off_s` (`+ (stream_s[i] - off_s[i]) st[i]`); a choice
//!   the job forces fixes `off[i]` and `st[i]` by rows;
//! - kept prefix states ([`KeptState`]): `h[k]` (binary: the state its class produces in
//!   windows goes to host chunk by chunk and comes back after decode); `h[k] <= u[class]`
//!   (only what is produced next to decode moves; a class left out of the windows is the
//!   drop-and-recompute choice: produced after decode, not in the decode row);
//!   `h[k] + u[consumer] <= 1` (reloads follow decode, so consumers do too); the decode row
//!   counts `host_resident` instead of the class's bytes (`- (bytes[c] - host_resident) h[k]`),
//!   the host row `host_bytes h[k]`, the objective `host_s h[k]`;
//! - kept training activations ([`ActLayers`], `recompute = auto`), two decisions of one form,
//!   the micro-batches' response rows and the kept prompt forwards' prompt rows: `a`
//!   (integer, `0..=L`): the first `a` text layers keep every activation for backward, the
//!   others only their input (recomputed in backward); the training row counts
//!   `bytes_per_layer a`, the objective `recompute_s (L - a)`; the decode row counts them as
//!   [`ActDecode`] says: not at all, in full (the prompt rows of a prefill that keeps the
//!   training forward live through decode), or while their class `m` may run in windows:
//!   `e >= bytes_per_layer (a - L (1 - u[m]))`, `e >= 0` (the kept layers' bytes while the
//!   class is next to decode, nothing otherwise); layers kept in a kept prefix state's buffer
//!   keep that state in HBM: `a <= L (1 - h[k])`;
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
//!
//! Files: this one holds the problem and answer types and [`solve`]; `options` the split
//! options offered per window and how many items fit beside a decode; `model` the variables,
//! objective, rows and starting solution; `answer` reads the solution back.

mod answer;
mod model;
mod options;
#[cfg(test)]
mod tests;

pub use options::{FILL_SLACK, KNEES};

use good_lp::solvers::highs::highs;
use good_lp::{ProblemVariables, ResolutionError, SolverModel, WithInitialSolution};
use rollplex_plan::SolveStatus;
use std::time::Instant;

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
    /// A third choice, off HBM and streamed through it in chunks by its users (the optimizer
    /// state): `None` where the item has none.
    pub stream: Option<StreamOption>,
    /// The choice the job forces (`None`: the ILP's).
    pub fixed: Option<ItemChoice>,
}

/// What streaming an item costs: the training row counts only its staging bytes, the
/// objective its exposed streaming time instead of `off_s`.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamOption {
    pub train_bytes: f64,
    pub stream_s: f64,
}

/// A residency item's choice, where a job forces one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemChoice {
    Hbm,
    Off,
    Stream,
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

/// How many text layers keep their training activations (the rest are recomputed from their
/// kept input in backward): what one more kept layer costs in memory and saves in time.
#[derive(Clone, Debug, PartialEq)]
pub struct ActLayers {
    /// Text layers `L`.
    pub layers: u32,
    /// Device bytes one more kept layer adds to the training phase's peak (the activations
    /// beyond the layer input: of the largest micro-batch, or of every kept prompt forward).
    pub bytes_per_layer: f64,
    /// Seconds one more recomputed layer adds to the iteration (its forward over every row it
    /// keeps, counted as exposed).
    pub recompute_s: f64,
    /// Whether the decode row counts the kept layers too.
    pub decode: ActDecode,
    /// The kept prefix state (index into [`Residency::kept`]) whose buffer holds the layers:
    /// while any layer is kept, it stays in HBM (`a <= L (1 - h[k])`).
    pub in_state: Option<usize>,
}

/// Where kept activation layers are in the decode row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActDecode {
    /// Never next to decode (made and used after it).
    Never,
    /// Always (made before or during decode, used after it).
    Always,
    /// While their side class (index into [`Problem::classes`]) runs in decode windows.
    Class(usize),
}

/// Residency and reshard-point part of the model: memory rows for the decode and the
/// training phase (the two peaks of an iteration), a host-memory row, the options.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Kept activation layers of the micro-batches' response rows and of the kept prompt
    /// forwards' prompt rows, each when the planner decides it (`None`: fixed by the job).
    pub act_layers: Option<ActLayers>,
    pub prompt_layers: Option<ActLayers>,
}

impl Residency {
    /// The two kept-layers decisions, response rows first.
    pub fn layer_decisions(&self) -> [Option<&ActLayers>; 2] {
        [self.act_layers.as_ref(), self.prompt_layers.as_ref()]
    }
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
    /// Per residency item: streamed (then also `off`).
    pub streamed: Vec<bool>,
    /// The chosen reshard option.
    pub reshard: usize,
    /// Per kept prefix state: on host.
    pub kept_host: Vec<bool>,
    /// Text layers that keep their training activations, of the response rows and of the
    /// prompt rows (`None` without that [`ActLayers`]).
    pub act_layers: Option<u32>,
    pub prompt_layers: Option<u32>,
    /// Bytes the decode and the training row leave below their budgets (the rows' estimate:
    /// the exact layout may need more; zero without a residency part).
    pub room: [f64; 2],
    /// GiB over budget, summed over the memory rows (the rows are soft).
    pub over_gib: f64,
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

/// Solves `p` (see the module docs for the model). Errors: HiGHS refused an option or found
/// no answer.
///
/// An answer that leaves a memory row over budget is solved again without presolve, and the
/// better of the two (objective with the over-budget penalty) is kept: on the 7B video job
/// with the runtime profile of both H200 jobs, presolve (dual fixing already off) reported as
/// optimal an answer keeping the reference weights in HBM with the training row 13.3 GiB over
/// budget (13,300 s of penalty) where moving them to host costs 0.3 s, so no plan fitted.
/// Answers within budget are kept as they are: without presolve HiGHS stops at other answers
/// inside the optimality gap, and the checked-in plans would change for nothing.
pub fn solve(p: &Problem) -> Result<Answer, String> {
    let first = solve_with(p, true)?;
    if first.over_gib <= 1e-6 {
        return Ok(first);
    }
    let second = solve_with(p, false)?;
    let cost = |a: &Answer| a.objective + OVER_BUDGET_S_PER_GIB * a.over_gib;
    Ok(if cost(&second) < cost(&first) {
        Answer {
            solve_s: first.solve_s + second.solve_s,
            ..second
        }
    } else {
        Answer {
            solve_s: first.solve_s + second.solve_s,
            ..first
        }
    })
}

fn solve_with(p: &Problem, presolve: bool) -> Result<Answer, String> {
    let none = Residency::default();
    let res = p.residency.as_ref().unwrap_or(&none);
    let mut vars = ProblemVariables::new();
    let v = model::Vars::new(p, res, &mut vars);
    let model = vars
        .minimise(model::objective(p, res, &v))
        .using(highs)
        .set_threads(1)
        .set_time_limit(p.time_limit_s.max(0.01))
        .set_mip_rel_gap(MIP_REL_GAP)
        .map_err(|e| format!("cannot set the MIP gap: {e:?}"))?;
    let model = model.set_option("mip_max_nodes", MAX_NODES);
    let mut model = if presolve {
        model.set_option("presolve_rule_off", PRESOLVE_RULES_OFF)
    } else {
        model.set_option("presolve", "off")
    };
    let rows = model::rows(p, res, &v);
    let constraints = rows.len() as u32;
    for row in rows {
        model.add_constraint(row);
    }
    let model = model.with_initial_solution(model::start(p, res, &v));
    let started = Instant::now();
    let sol = model
        .solve()
        .map_err(|e: ResolutionError| format!("HiGHS found no answer: {e}"))?;
    let solve_s = started.elapsed().as_secs_f64();
    Ok(answer::read(
        p,
        res,
        &v,
        &sol,
        answer::SolveStats {
            constraints,
            solve_s,
        },
    ))
}
