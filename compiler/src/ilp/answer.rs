//! Reading a solution back: the option per window, whole item counts, the residency and
//! reshard choices, and the objective of what was read (not the solver's value of the
//! relaxed counts).

// Counts are indexed by (class, window); index loops read best here.
#![allow(clippy::needless_range_loop)]

use super::model::{memory, Vars, GIB};
use super::options::{decode_alone, slowdown};
use super::{Answer, Problem, Residency};
use good_lp::{Solution, SolutionStatus};
use rollplex_plan::SolveStatus;

/// What the solver reports beside the solution.
pub(super) struct SolveStats {
    pub constraints: u32,
    pub solve_s: f64,
}

/// The answer `sol` gives to `p` under the variables `v`.
pub(super) fn read(
    p: &Problem,
    res: &Residency,
    v: &Vars,
    sol: &impl Solution,
    stats: SolveStats,
) -> Answer {
    let (nw, nj, nc) = (p.decode_time.len(), p.options.len(), p.classes.len());
    let status = match sol.status() {
        SolutionStatus::Optimal | SolutionStatus::GapLimit => SolveStatus::Optimal,
        SolutionStatus::TimeLimit => SolveStatus::TimeLimit,
    };
    let nos = decode_alone(p);
    let option: Vec<usize> = (0..nw)
        .map(|w| {
            (0..nj)
                .filter_map(|j| v.y[w][j].map(|y| (j, sol.value(y))))
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
                    acc += v.n[c][w]
                        .iter()
                        .flatten()
                        .map(|&n| sol.value(n))
                        .sum::<f64>();
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
    let off: Vec<bool> = v.off.iter().map(|&o| sol.value(o) > 0.5).collect();
    let reshard =
        v.x.iter()
            .enumerate()
            .max_by(|a, b| {
                sol.value(*a.1)
                    .total_cmp(&sol.value(*b.1))
                    .then(b.0.cmp(&a.0))
            })
            .map(|(k, _)| k)
            .unwrap_or(0);
    let streamed: Vec<bool> =
        v.st.iter()
            .map(|st| st.is_some_and(|st| sol.value(st) > 0.5))
            .collect();
    for (i, it) in res.items.iter().enumerate() {
        if off[i] {
            objective += match (&it.stream, streamed[i]) {
                (Some(so), true) => so.stream_s,
                _ => it.off_s,
            };
        }
    }
    objective += res.reshard.get(reshard).map(|o| o.exposed_s).unwrap_or(0.0);
    let kept_host: Vec<bool> =
        v.h.iter()
            .map(|h| h.is_some_and(|h| sol.value(h) > 0.5))
            .collect();
    for (k, ks) in res.kept.iter().enumerate() {
        if kept_host[k] {
            objective += ks.host_s;
        }
    }
    let act_layers = kept_layers(p, res, v, sol);
    if let (Some(a), Some(k)) = (&res.act_layers, act_layers) {
        objective += a.recompute_s * a.layers.saturating_sub(k) as f64;
    }
    let over_gib = v.slack.iter().map(|&x| sol.value(x).max(0.0)).sum();
    Answer {
        option,
        counts,
        off,
        streamed,
        reshard,
        kept_host,
        act_layers,
        over_gib,
        status,
        objective,
        variables: v.count,
        integer_variables: v.integers,
        constraints: stats.constraints,
        solve_s: stats.solve_s,
    }
}

/// The kept activation layers of the answer, raised to what the memory rows still have room
/// for with every other choice as answered (the objective only gains from more): HiGHS stops
/// inside its relative gap, which counts the whole objective, so it may leave a layer whose
/// recompute is worth less than the gap.
fn kept_layers(p: &Problem, res: &Residency, v: &Vars, sol: &impl Solution) -> Option<u32> {
    let (a, av) = (res.act_layers.as_ref()?, v.act?);
    let kept = sol.value(av).round().clamp(0.0, a.layers as f64);
    let b = a.bytes_per_layer / GIB;
    if b <= 0.0 {
        return Some(a.layers);
    }
    let m = memory(p, res, v, &mut Vec::new());
    let room = |budget: f64, used: f64| ((budget / GIB - used) / b + 1e-9).floor().max(0.0);
    let mut more = room(res.train_budget, m.train.eval_with(sol));
    if let (Some(c), Some(_)) = (a.decode_class, v.act_dec) {
        if sol.value(v.u[c]) > 0.5 {
            more = more.min(room(res.decode_budget, m.dec.eval_with(sol)));
        }
    }
    Some((kept + more).min(a.layers as f64) as u32)
}
