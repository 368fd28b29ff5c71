//! Reading a solution back: the option per window, whole item counts, the residency and
//! reshard choices, and the objective of what was read (not the solver's value of the
//! relaxed counts).

// Counts are indexed by (class, window); index loops read best here.
#![allow(clippy::needless_range_loop)]

use super::model::{memory, Vars, GIB};
use super::options::{decode_alone, slowdown};
use super::{ActDecode, Answer, Problem, Residency};
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
    let ([act_layers, prompt_layers], [dec, train]) = kept_layers(p, res, v, sol);
    let room = match p.residency.is_some() {
        true => [
            (res.decode_budget - dec * GIB).max(0.0),
            (res.train_budget - train * GIB).max(0.0),
        ],
        false => [0.0; 2],
    };
    for (a, k) in res
        .layer_decisions()
        .iter()
        .zip([act_layers, prompt_layers])
    {
        if let (Some(a), Some(k)) = (a, k) {
            objective += a.recompute_s * a.layers.saturating_sub(k) as f64;
        }
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
        prompt_layers,
        room,
        over_gib,
        status,
        objective,
        variables: v.count,
        integer_variables: v.integers,
        constraints: stats.constraints,
        solve_s: stats.solve_s,
    }
}

/// The kept activation layers of each decision, raised to what the memory rows still have
/// room for with every other choice as answered (the objective only gains from more), the
/// decision that saves the most time per byte first: HiGHS stops inside its relative gap,
/// which counts the whole objective, so it may leave a layer whose recompute is worth less
/// than the gap. Also the decode and training rows (GiB) with the raised layers.
fn kept_layers(
    p: &Problem,
    res: &Residency,
    v: &Vars,
    sol: &impl Solution,
) -> ([Option<u32>; 2], [f64; 2]) {
    let decisions = res.layer_decisions();
    let mut kept = [None; 2];
    for k in 0..2 {
        if let (Some(a), Some(av)) = (decisions[k], v.act[k]) {
            kept[k] = Some(sol.value(av).round().clamp(0.0, a.layers as f64));
        }
    }
    let m = memory(p, res, v, &mut Vec::new());
    let (mut train, mut dec) = (m.train.eval_with(sol), m.dec.eval_with(sol));
    let per_byte = |k: usize| {
        decisions[k].map_or(0.0, |a| {
            a.recompute_s / a.bytes_per_layer.max(f64::MIN_POSITIVE)
        })
    };
    let mut order = [0, 1];
    order.sort_by(|&x, &y| per_byte(y).total_cmp(&per_byte(x)));
    for k in order {
        let (Some(a), Some(n)) = (decisions[k], kept[k]) else {
            continue;
        };
        let b = a.bytes_per_layer / GIB;
        if b <= 0.0 {
            kept[k] = Some(a.layers as f64);
            continue;
        }
        let room = |budget: f64, used: f64| ((budget / GIB - used) / b + 1e-9).floor().max(0.0);
        let in_decode = match a.decode {
            ActDecode::Never => false,
            ActDecode::Always => true,
            ActDecode::Class(c) => v.act_dec[k].is_some() && sol.value(v.u[c]) > 0.5,
        };
        let mut more = room(res.train_budget, train);
        if in_decode {
            more = more.min(room(res.decode_budget, dec));
        }
        let more = more.min(a.layers as f64 - n);
        train += b * more;
        if in_decode {
            dec += b * more;
        }
        kept[k] = Some(n + more);
    }
    (kept.map(|k| k.map(|k| k as u32)), [dec, train])
}
