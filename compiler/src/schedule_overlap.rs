//! The overlap schedule: side work (reference and actor prefixes, and in the decode tail the
//! per-group suffixes, rewards, advantages and first-step micro-batches) moves into decode
//! windows on a side SM partition, as the ILP ([`crate::ilp`]) decides.
//!
//! This module turns the phase graph into the ILP's inputs (split options from the cost
//! model's partition sizes, per-window decode times alone on each split, per-class item times
//! and how much each class slows decode beside it, readiness from the
//! planned slot finish steps, precedences, memory headroom next to decode), and the answer
//! back into a [`Placement`]: the ILP's split per window, then a greedy fill with each item's
//! exact time (the ILP counts items of a class as equal and fractional): up to the ILP's
//! cumulative count per class first, then whatever else is eligible and fits. A repair pass
//! then keeps only placements whose predecessors run before decode, in an earlier window or
//! earlier in the same window, and whose groups are planned to have finished before the
//! window starts. Finally, each window whose side work may save less time (on the whole GPU
//! after decode) than its split costs decode is tried without a split, and kept so when the
//! predicted iteration gets shorter.
//!
//! The ILP prices a window's side work two ways ([`Pricing`]), one solve each, and the timing
//! pass (`crate::sched`, exact for both) picks the shorter plan: per item (decode is slowed
//! only while an item runs: what the timing pass computes, but the ILP's class means and
//! fractional counts can promise side work the fill and repair then do not place, leaving a
//! split that costs decode and holds little: examples/paper-7b-32xh800.rpx with the H200
//! profile gets 8.45 s this way against 8.28 s the other), and whole-window (decode slowed by
//! the worst class's factor for the whole window as soon as it splits: pessimistic, so it
//! splits only windows that side work fills; the fixture 7B job gets 7.87 s this way against
//! 7.66 s per item).
//!
//! The weight-version rule holds by construction: only version-0 work has a side class
//! (later steps' prefixes and micro-batches are `Role::Post`).

use crate::error::{CompileError, Result};
use crate::ilp::{self, ClassInput, IlpRun, Prec, PrecKind, Problem, SplitOption, FILL_SLACK};
use crate::ir::{NodeId, PhaseGraph, Placement, Role, SideClass, KEPT};
use crate::residency::Cuts;
use rollplex_cost::CostModel;
use rollplex_plan::work::WorkKind;
use rollplex_plan::{BufferRole, SolveStatus, SolverStats};
use std::collections::BTreeMap;

/// How the ILP prices the side work of a window (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pricing {
    /// Decode alone on the split's SMs, plus `(1 - 1/s)` of each item's time beside it.
    PerItem,
    /// Decode alone on the split's SMs times the worst class's slowdown, items free.
    WholeWindow,
}

/// Returns the placement (with the residency and reshard point the ILP chose), the solver
/// statistics for the plan and the run for `--stats`: of the two pricings' placements the one
/// the timing pass predicts shorter (per item on a tie; both solves' time is counted). `cuts`
/// lowers the memory rows' budgets by what earlier attempts overshot.
pub fn place(
    pg: &PhaseGraph,
    cost: &CostModel,
    cuts: Cuts,
    time_limit_s: f64,
) -> Result<(Placement, SolverStats, IlpRun)> {
    let per_item = place_priced(pg, cost, cuts, time_limit_s, Pricing::PerItem)?;
    let whole = place_priced(pg, cost, cuts, time_limit_s, Pricing::WholeWindow)?;
    let (mut best, other) = if whole.3 < per_item.3 - 1e-9 {
        (whole, per_item)
    } else {
        (per_item, whole)
    };
    best.2.solve_s += other.2.solve_s;
    Ok((best.0, best.1, best.2))
}

/// One pricing's placement, with its predicted iteration time.
fn place_priced(
    pg: &PhaseGraph,
    cost: &CostModel,
    cuts: Cuts,
    time_limit_s: f64,
    pricing: Pricing,
) -> Result<(Placement, SolverStats, IlpRun, f64)> {
    let gpu = &pg.spec.cluster.gpu;
    let total = gpu.sms;
    let gran = gpu.sm_granularity.max(1);
    let mut options: Vec<SplitOption> = (1..)
        .map(|i| i * gran)
        .take_while(|&a| a < total)
        .map(|a| SplitOption {
            decode_sms: a,
            side_sms: total - a,
        })
        .collect();
    options.push(SplitOption {
        decode_sms: total,
        side_sms: 0,
    });

    // Side classes and their items in item order.
    let mut classes: BTreeMap<SideClass, Vec<NodeId>> = BTreeMap::new();
    for id in pg.ids() {
        if let Role::Side { class, .. } = pg.node(id).role {
            classes.entry(class).or_default().push(id);
        }
    }
    for items in classes.values_mut() {
        items.sort_by_key(|&i| match pg.node(i).role {
            Role::Side { item, .. } => item,
            _ => 0,
        });
    }
    let class_list: Vec<SideClass> = SideClass::ALL
        .iter()
        .copied()
        .filter(|c| classes.contains_key(c))
        .collect();
    // Decode alone on each option's decode SMs; per item, what side work beside it costs it
    // is priced by the item (the ILP's module doc, `sched`'s timing pass); whole-window, the
    // split's decode is slowed by the worst class's factor.
    let whole_slow = match pricing {
        Pricing::PerItem => 1.0,
        Pricing::WholeWindow => class_list
            .iter()
            .map(|c| cost.corun_slowdown(WorkKind::Decode, pg.node(classes[c][0]).kind))
            .fold(1.0, f64::max),
    };
    let decodes = pg.decode_nodes();
    let decode_time: Vec<Vec<f64>> = decodes
        .iter()
        .map(|&d| {
            let n = pg.node(d);
            options
                .iter()
                .map(|o| {
                    cost.time(WorkKind::Decode, &n.work, o.decode_sms)
                        * if o.side_sms > 0 { whole_slow } else { 1.0 }
                })
                .collect()
        })
        .collect();

    let buf = |role: BufferRole| {
        pg.buffer_with(role)
            .map(|i| pg.buffer(i).bytes as f64)
            .unwrap_or(0.0)
    };
    let windows = &pg.windows;
    let g = pg.topo.parallel.group_size as f64;
    let batch = pg.topo.batch;
    let per_chunk_slots = classes
        .get(&SideClass::TrainPrefix)
        .and_then(|v| v.first())
        .map(|&i| match &pg.node(i).op {
            rollplex_plan::Op::ActorPrefix { groups, .. } => groups.span().len() as f64,
            _ => 1.0,
        })
        .unwrap_or(1.0);
    let mut inputs = Vec::new();
    for c in &class_list {
        let items = &classes[c];
        let kind = pg.node(items[0]).kind;
        let mean = |f: &dyn Fn(NodeId) -> f64| {
            items.iter().map(|&i| f(i)).sum::<f64>() / items.len() as f64
        };
        let item_time: Vec<f64> = options
            .iter()
            .map(|o| {
                if o.side_sms == 0 {
                    f64::INFINITY
                } else {
                    mean(&|i| cost.time(kind, &pg.node(i).work, o.side_sms))
                        * cost.corun_slowdown(kind, WorkKind::Decode)
                }
            })
            .collect();
        let post_time = mean(&|i| cost.time(kind, &pg.node(i).work, total));
        let ready: Vec<u32> = windows
            .iter()
            .map(|w| {
                items
                    .iter()
                    .filter(|&&i| pg.node(i).ready_step <= w.first)
                    .count() as u32
            })
            .collect();
        let bytes = match c {
            SideClass::RefPrefix => buf(BufferRole::RefPrefixKv),
            SideClass::OldPrefix => buf(BufferRole::OldPrefixKv),
            SideClass::TrainPrefix => buf(BufferRole::TrainPrefix { step: 0 }),
            SideClass::RefSuffix => buf(BufferRole::RefLogProbs),
            SideClass::OldSuffix => buf(BufferRole::OldLogProbs),
            SideClass::Reward => buf(BufferRole::Scalars),
            SideClass::Advantages => 0.0,
            SideClass::MicroBatch => buf(BufferRole::Grads { step: 0 }),
        };
        inputs.push(ClassInput {
            name: c.name(),
            count: items.len() as u32,
            ready,
            item_time,
            decode_slowdown: match pricing {
                Pricing::PerItem => cost.corun_slowdown(WorkKind::Decode, kind),
                Pricing::WholeWindow => 1.0,
            },
            post_time,
            bytes,
        });
    }
    let idx = |c: SideClass| class_list.iter().position(|&x| x == c);
    let mut precs = Vec::new();
    let mut prec = |a: SideClass, b: SideClass, kind: PrecKind| {
        if let (Some(pred), Some(succ)) = (idx(a), idx(b)) {
            precs.push(Prec { pred, succ, kind });
        }
    };
    let micro = batch.micro as f64;
    prec(SideClass::RefPrefix, SideClass::RefSuffix, PrecKind::All);
    prec(SideClass::OldPrefix, SideClass::OldSuffix, PrecKind::All);
    prec(
        SideClass::Reward,
        SideClass::Advantages,
        PrecKind::Ratio {
            pred_mul: 1.0,
            succ_mul: 1.0,
        },
    );
    for c in [
        SideClass::Advantages,
        SideClass::RefSuffix,
        SideClass::OldSuffix,
    ] {
        prec(
            c,
            SideClass::MicroBatch,
            PrecKind::Ratio {
                pred_mul: g,
                succ_mul: micro,
            },
        );
    }
    if batch.steps > 1 {
        prec(
            SideClass::TrainPrefix,
            SideClass::MicroBatch,
            PrecKind::Ratio {
                pred_mul: g * per_chunk_slots,
                succ_mul: micro,
            },
        );
    } else {
        prec(SideClass::TrainPrefix, SideClass::MicroBatch, PrecKind::All);
    }
    crate::residency::check_forced(pg, cuts)?;
    let rmodel = crate::residency::model(pg, cost, cuts, &|c| idx(c));
    let problem = Problem {
        options: options.clone(),
        decode_time,
        classes: inputs,
        precs,
        headroom: 0.0,
        residency: Some(rmodel.input.clone()),
        time_limit_s,
    };
    let ans = ilp::solve(&problem).map_err(CompileError::internal)?;
    let res = crate::residency::choice(&rmodel, &ans);
    // Consumers of a kept state on host run after decode (its reloads follow decode).
    let banned: Vec<SideClass> = KEPT
        .iter()
        .filter(|(p, _)| res.kept_host(*p))
        .map(|&(_, c)| c)
        .collect();

    // Answer -> placement: the ILP's split per window, then a greedy fill with the exact
    // item times (see `fill`).
    let side_opts: Vec<Option<SplitOption>> = ans
        .option
        .iter()
        .map(|&j| Some(options[j]).filter(|o| o.side_sms > 0))
        .collect();
    let caps: Vec<f64> = (0..windows.len())
        .map(|w| problem.decode_time[w][ans.option[w]])
        .collect();
    let targets: Vec<BTreeMap<SideClass, u32>> = (0..windows.len())
        .map(|w| {
            class_list
                .iter()
                .enumerate()
                .map(|(ci, &c)| (c, ans.counts[ci][..=w].iter().sum::<u32>()))
                .collect()
        })
        .collect();
    let fill_classes: Vec<SideClass> = class_list
        .iter()
        .copied()
        .filter(|c| !banned.contains(c))
        .collect();
    let mut in_window = fill(
        pg,
        cost,
        &classes,
        &fill_classes,
        &side_opts,
        &caps,
        &targets,
        pricing,
    );
    repair(pg, &mut in_window);
    // A window whose side work may save less than its split costs decode (by the full-GPU
    // time of its items) is tried without a split; the predicted makespan decides.
    let nos = options.iter().position(|o| o.side_sms == 0).unwrap_or(0);
    let splits_of = |placed: &BTreeMap<NodeId, u32>| -> Vec<(u32, u32)> {
        (0..windows.len())
            .map(|w| match side_opts[w] {
                Some(o) if placed.values().any(|&x| x as usize == w) => (o.decode_sms, o.side_sms),
                _ => (total, 0),
            })
            .collect()
    };
    let predict = |placed: &BTreeMap<NodeId, u32>| -> f64 {
        let p = Placement {
            single_stream: false,
            splits: splits_of(placed),
            in_window: placed.clone(),
            residency: res,
        };
        crate::assemble::assemble(pg, &p, cost)
            .map(|s| s.makespan())
            .unwrap_or(f64::INFINITY)
    };
    let mut best_t = predict(&in_window);
    for (w, opt) in side_opts.iter().enumerate() {
        let items: Vec<NodeId> = in_window
            .iter()
            .filter(|(_, &x)| x as usize == w)
            .map(|(&i, _)| i)
            .collect();
        if items.is_empty() {
            continue;
        }
        let saved: f64 = items
            .iter()
            .map(|&i| cost.time(pg.node(i).kind, &pg.node(i).work, total))
            .sum();
        // what the split costs decode: its partition, and the items' slowing it while they run
        let side = opt.map(|o| o.side_sms).unwrap_or(total);
        let beside: Vec<(f64, f64)> = items
            .iter()
            .map(|&i| beside_item(pg, cost, i, side))
            .collect();
        let split_dec = rollplex_cost::beside_time(problem.decode_time[w][ans.option[w]], &beside);
        let penalty = split_dec - problem.decode_time[w][nos];
        if saved > penalty {
            continue;
        }
        let mut cand = in_window.clone();
        cand.retain(|_, x| *x as usize != w);
        repair(pg, &mut cand);
        let t = predict(&cand);
        if t < best_t - 1e-9 {
            best_t = t;
            in_window = cand;
        }
    }
    let mut splits: Vec<(u32, u32)> = vec![(total, 0); windows.len()];
    for (w, s) in splits.iter_mut().enumerate() {
        if let Some(o) = side_opts[w] {
            if in_window.values().any(|&x| x as usize == w) {
                *s = (o.decode_sms, o.side_sms);
            }
        }
    }
    let stats = SolverStats {
        solver: "highs".into(),
        status: ans.status,
        variables: ans.variables,
        integer_variables: ans.integer_variables,
        constraints: ans.constraints,
        objective: (ans.objective * 1e6).round() / 1e6,
    };
    let run = IlpRun {
        label: String::new(),
        variables: ans.variables,
        integer_variables: ans.integer_variables,
        constraints: ans.constraints,
        solve_s: ans.solve_s,
        status: ans.status,
        objective: ans.objective,
    };
    debug_assert!(stats.status != SolveStatus::NotRun);
    Ok((
        Placement {
            single_stream: false,
            splits,
            in_window,
            residency: res,
        },
        stats,
        run,
        best_t,
    ))
}

/// An item of a window on `side_sms` SMs: its time beside decode, and decode's slowdown while
/// it runs (a piece of [`rollplex_cost::beside_time`]).
fn beside_item(pg: &PhaseGraph, cost: &CostModel, id: NodeId, side_sms: u32) -> (f64, f64) {
    let n = pg.node(id);
    (
        cost.time(n.kind, &n.work, side_sms) * cost.corun_slowdown(n.kind, WorkKind::Decode),
        cost.corun_slowdown(WorkKind::Decode, n.kind),
    )
}

/// Fills windows in order. In each window with a side partition, items are taken in side
/// order (class, then item) while they end before the window's decode (`caps`: the ILP's
/// decode time; priced per item, decode alone on the partition, which an item that runs `t`
/// s beside a decode it slows `s` times uses up `t / s` of; whole-window, the slowed decode,
/// which the item uses up `t` of): first up to the ILP's cumulative target per class, then any
/// other eligible item.
/// An item is eligible when its groups are planned to be done before the window starts and
/// each of its predecessors runs before decode, in an earlier window, or earlier in this
/// window.
#[allow(clippy::too_many_arguments)] // the phase graph, the model, then the ILP's answer per window
fn fill(
    pg: &PhaseGraph,
    cost: &CostModel,
    classes: &BTreeMap<SideClass, Vec<NodeId>>,
    class_list: &[SideClass],
    side_opts: &[Option<SplitOption>],
    caps: &[f64],
    targets: &[BTreeMap<SideClass, u32>],
    pricing: Pricing,
) -> BTreeMap<NodeId, u32> {
    let mut placed: BTreeMap<NodeId, u32> = BTreeMap::new();
    let mut next: BTreeMap<SideClass, usize> = class_list.iter().map(|&c| (c, 0)).collect();
    let rank = |id: NodeId| side_rank(pg, id);
    for (w, opt) in side_opts.iter().enumerate() {
        let Some(o) = opt else { continue };
        let first = pg.windows[w].first;
        let mut load = 0.0;
        for pass in 0..2 {
            for &c in class_list {
                let items = &classes[&c];
                loop {
                    let k = next[&c];
                    let Some(&id) = items.get(k) else { break };
                    if pass == 0 && k as u32 >= targets[w].get(&c).copied().unwrap_or(0) {
                        break;
                    }
                    let n = pg.node(id);
                    let eligible = n.ready_step <= first
                        && pg.deps(id).into_iter().all(|p| match pg.node(p).role {
                            Role::PreDecode | Role::Decode { .. } => true,
                            Role::Side { .. } => placed.get(&p).is_some_and(|&pw| {
                                (pw as usize) < w || (pw as usize == w && rank(p) < rank(id))
                            }),
                            Role::Post => false,
                        });
                    if !eligible {
                        break;
                    }
                    let (t, slow) = beside_item(pg, cost, id, o.side_sms);
                    let t = match pricing {
                        Pricing::PerItem => t / slow,
                        Pricing::WholeWindow => t,
                    };
                    if load + t > caps[w] * (1.0 + FILL_SLACK) {
                        break;
                    }
                    load += t;
                    placed.insert(id, w as u32);
                    next.insert(c, k + 1);
                }
            }
        }
    }
    placed
}

fn side_rank(pg: &PhaseGraph, id: NodeId) -> (usize, u32) {
    match pg.node(id).role {
        Role::Side { class, item } => (
            SideClass::ALL.iter().position(|&c| c == class).unwrap_or(0),
            item,
        ),
        _ => (0, 0),
    }
}

/// Drops placements that would wait on later work; repeats until stable.
fn repair(pg: &PhaseGraph, in_window: &mut BTreeMap<NodeId, u32>) {
    let side_rank = |id: NodeId| side_rank(pg, id);
    loop {
        let mut drop = Vec::new();
        for (&id, &w) in in_window.iter() {
            let n = pg.node(id);
            if n.ready_step > pg.windows[w as usize].first {
                drop.push(id);
                continue;
            }
            for p in pg.deps(id) {
                let ok = match pg.node(p).role {
                    Role::PreDecode | Role::Decode { .. } => true,
                    Role::Side { .. } => match in_window.get(&p) {
                        Some(&pw) => pw < w || (pw == w && side_rank(p) < side_rank(id)),
                        None => false,
                    },
                    Role::Post => false,
                };
                if !ok {
                    drop.push(id);
                    break;
                }
            }
        }
        if drop.is_empty() {
            return;
        }
        for id in drop {
            in_window.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{paper_job, QwenSize};
    use rollplex_plan::spec::Mode;

    /// The 7B paper job with the shipped H200 profile: the two pricings place side work
    /// differently and the timing pass keeps the shorter plan.
    #[test]
    fn the_timing_pass_keeps_the_shorter_pricing() {
        let spec = paper_job(QwenSize::B7);
        let profile = rollplex_cost::h200::shipped().unwrap();
        let cost = crate::driver::cost_model(&spec, Some(&profile));
        let topo = crate::topology::colocated(&spec, Mode::Overlap).unwrap();
        let mut pg = crate::lower::lower(&spec, topo, Default::default()).unwrap();
        crate::buffers::assign(&mut pg);
        let cuts = Cuts::default();
        let t = |pricing| place_priced(&pg, &cost, cuts, 5.0, pricing).unwrap().3;
        let (per_item, whole) = (t(Pricing::PerItem), t(Pricing::WholeWindow));
        let (placed, _, _) = place(&pg, &cost, cuts, 5.0).unwrap();
        let chosen = crate::assemble::assemble(&pg, &placed, &cost)
            .unwrap()
            .makespan();
        assert!(
            (chosen - per_item.min(whole)).abs() < 1e-9,
            "per item {per_item} s, whole window {whole} s, chosen {chosen} s"
        );
        assert!(
            (per_item - whole).abs() > 1e-3,
            "the pricings agree ({per_item} s): this job no longer tells them apart"
        );
    }
}
