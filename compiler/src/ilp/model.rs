//! Building the model: its variables ([`Vars`]), objective, rows and the all-after-decode
//! starting solution, as the module docs of [`crate::ilp`] write them. Variables and rows are
//! created in a fixed order (HiGHS's answer may depend on it when plans tie).

// Variables are indexed by (class, window, option) triples; index loops read best here.
#![allow(clippy::needless_range_loop)]

use super::options::{decode_alone, slowdown, useful_options, whole_items};
use super::{ActDecode, PrecKind, Problem, Residency, OVER_BUDGET_S_PER_GIB};
use good_lp::{constraint, variable, Constraint, Expression, ProblemVariables, Variable};

/// Bytes per GiB: memory rows are written in GiB to keep the coefficients near 1.
pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// The model's variables (names as in the module docs of [`crate::ilp`]); `None` where a
/// variable would be fixed at zero and is left out.
pub(super) struct Vars {
    /// `y[w][j]`, only for the options offered to window `w`.
    pub y: Vec<Vec<Option<Variable>>>,
    /// `z[c][w]`, only for classes another class waits on in full.
    pub z: Vec<Vec<Option<Variable>>>,
    pub u: Vec<Variable>,
    /// `off[i]` per residency item.
    pub off: Vec<Variable>,
    /// `st[i]`: streamed, for items with a [`super::StreamOption`].
    pub st: Vec<Option<Variable>>,
    /// `v[i]`: in HBM during decode, for items the decode row counts only when kept.
    pub dv: Vec<Option<Variable>>,
    /// `x[k]`, only when there is more than one reshard option.
    pub x: Vec<Variable>,
    /// `h[k]`, only for kept states whose producer class exists.
    pub h: Vec<Option<Variable>>,
    /// `s_d`, `s_t` (with a residency part only).
    pub slack: Vec<Variable>,
    /// `a`: text layers keeping their activations, per decision of
    /// [`Residency::layer_decisions`] (with that [`super::ActLayers`] only).
    pub act: [Option<Variable>; 2],
    /// `e`: the kept layers' bytes in the decode row (GiB; [`ActDecode::Class`] only).
    pub act_dec: [Option<Variable>; 2],
    /// `n[c][w][j]`, only where option `j` has side SMs and a whole item fits.
    pub n: Vec<Vec<Vec<Option<Variable>>>>,
    /// `cum[c][w]`: items of class `c` in windows `0..=w` (keeps the rows sparse).
    pub cum: Vec<Vec<Variable>>,
    /// Variables in all, and of them binary.
    pub count: u32,
    pub integers: u32,
}

impl Vars {
    pub fn new(p: &Problem, res: &Residency, vars: &mut ProblemVariables) -> Vars {
        let nw = p.decode_time.len();
        let nj = p.options.len();
        let nc = p.classes.len();
        let opts: Vec<Vec<usize>> = (0..nw).map(|w| useful_options(p, w)).collect();
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
        let off: Vec<Variable> = (0..res.items.len())
            .map(|_| vars.add(variable().binary()))
            .collect();
        let st: Vec<Option<Variable>> = res
            .items
            .iter()
            .map(|it| it.stream.as_ref().map(|_| vars.add(variable().binary())))
            .collect();
        let dv: Vec<Option<Variable>> = res
            .items
            .iter()
            .map(|it| {
                (it.decode_kept && !it.decode_off).then(|| vars.add(variable().min(0).max(1)))
            })
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
        let decisions = res.layer_decisions();
        let act = decisions.map(|a| {
            a.filter(|_| p.residency.is_some())
                .map(|a| vars.add(variable().integer().min(0).max(a.layers as f64)))
        });
        let mut act_dec = [None; 2];
        for (k, a) in decisions.iter().enumerate() {
            if let (Some(a), Some(_)) = (a, act[k]) {
                if matches!(a.decode, ActDecode::Class(c) if c < nc) {
                    act_dec[k] = Some(vars.add(variable().min(0)));
                }
            }
        }
        // n[c][w][j] (continuous, see the module docs) only where option j has side SMs,
        // bounded by the whole items that fit beside the window's decode (a continuous count
        // would otherwise spread one item too large for any window over several, which the
        // fill cannot place: the plan then kept none of the side work the objective had
        // counted).
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
        let cum: Vec<Vec<Variable>> = p
            .classes
            .iter()
            .map(|cl| {
                (0..nw)
                    .map(|_| vars.add(variable().min(0).max(cl.count as f64)))
                    .collect()
            })
            .collect();
        let some = |v: &Vec<Vec<Option<Variable>>>| v.iter().flatten().flatten().count() as u32;
        let integers = some(&y)
            + some(&z)
            + u.len() as u32
            + off.len() as u32
            + st.iter().flatten().count() as u32
            + x.len() as u32
            + h.iter().flatten().count() as u32
            + act.iter().flatten().count() as u32;
        let count = integers
            + n.iter().map(some).sum::<u32>()
            + (nc * nw) as u32
            + dv.iter().flatten().count() as u32
            + slack.len() as u32
            + act_dec.iter().flatten().count() as u32;
        Vars {
            y,
            z,
            u,
            off,
            st,
            dv,
            x,
            h,
            slack,
            act,
            act_dec,
            n,
            cum,
            count,
            integers,
        }
    }

    /// `n[c][w]`: items of class `c` in window `w`, over its options.
    fn in_window(&self, c: usize, w: usize) -> Expression {
        self.n[c][w]
            .iter()
            .flatten()
            .map(|&v| Expression::from(v))
            .sum()
    }

    /// `cum(c, w)`.
    fn cum(&self, c: usize, w: usize) -> Expression {
        Expression::from(self.cum[c][w])
    }
}

/// The objective: windows, side work's cost to decode, work left for after decode, items off
/// HBM, the reshard option, kept states on host, GiB over budget, and the tie-breakers.
pub(super) fn objective(p: &Problem, res: &Residency, v: &Vars) -> Expression {
    let (nw, nj) = (p.decode_time.len(), p.options.len());
    let mut obj = Expression::from(0.0);
    for w in 0..nw {
        for j in 0..nj {
            if let Some(yv) = v.y[w][j] {
                obj += (p.decode_time[w][j] + 1e-7 * p.options[j].side_sms as f64 / 1000.0) * yv;
            }
        }
    }
    for (c, cl) in p.classes.iter().enumerate() {
        obj += cl.count as f64 * cl.post_time;
        for w in 0..nw {
            obj += (1e-7 * (w as f64 + 1.0) - cl.post_time) * v.in_window(c, w);
            // what each item costs the decode beside it
            let cost = 1.0 - 1.0 / slowdown(cl.decode_slowdown);
            for j in 0..nj {
                if let Some(nv) = v.n[c][w][j] {
                    obj += cost * cl.item_time[j] * nv;
                }
            }
        }
    }
    for (i, it) in res.items.iter().enumerate() {
        obj += (it.off_s + 1e-6 * (i as f64 + 1.0)) * v.off[i];
        if let (Some(so), Some(stv)) = (&it.stream, v.st[i]) {
            // at equal times, the whole reload over streaming
            obj += (so.stream_s - it.off_s + 0.5e-6) * stv;
        }
    }
    for (k, o) in res.reshard.iter().enumerate() {
        if let Some(&xv) = v.x.get(k) {
            obj += (o.exposed_s + 1e-7 * k as f64) * xv;
        }
    }
    // HBM over host for kept states, in state order, after the items.
    let ni = res.items.len();
    for (k, ks) in res.kept.iter().enumerate() {
        if let Some(hv) = v.h[k] {
            obj += (ks.host_s + 1e-6 * (ni + k + 1) as f64) * hv;
        }
    }
    for &sv in &v.slack {
        obj += OVER_BUDGET_S_PER_GIB * sv;
    }
    for (a, av) in res.layer_decisions().iter().zip(v.act) {
        if let (Some(a), Some(av)) = (a, av) {
            obj += a.recompute_s * a.layers as f64 - a.recompute_s * av;
        }
    }
    obj
}

/// The rows, in the order they are added to the model.
pub(super) fn rows(p: &Problem, res: &Residency, v: &Vars) -> Vec<Constraint> {
    let (nw, nj, nc) = (p.decode_time.len(), p.options.len(), p.classes.len());
    let ni = res.items.len();
    let (u, off) = (&v.u, &v.off);
    let mut rows = Vec::new();
    for c in 0..nc {
        for w in 0..nw {
            let prev: Expression = if w == 0 {
                Expression::from(0.0)
            } else {
                Expression::from(v.cum[c][w - 1])
            };
            rows.push(constraint!(v.cum[c][w] == prev + v.in_window(c, w)));
        }
    }
    for w in 0..nw {
        let one: Expression = v.y[w].iter().flatten().map(|&y| Expression::from(y)).sum();
        rows.push(constraint!(one == 1.0));
        for j in 0..nj {
            let Some(yv) = v.y[w][j] else { continue };
            // the decode's time alone that the side work beside it uses up
            let load: Expression = (0..nc)
                .filter_map(|c| {
                    let cl = &p.classes[c];
                    v.n[c][w][j].map(|n| cl.item_time[j] / slowdown(cl.decode_slowdown) * n)
                })
                .sum();
            if (0..nc).any(|c| v.n[c][w][j].is_some()) {
                rows.push(constraint!(load <= p.decode_time[w][j] * yv));
            }
        }
    }
    for (c, cl) in p.classes.iter().enumerate() {
        for w in 0..nw {
            rows.push(constraint!(
                v.cum(c, w) <= cl.ready.get(w).copied().unwrap_or(0) as f64
            ));
            if let Some(zv) = v.z[c][w] {
                rows.push(constraint!(cl.count as f64 * zv <= v.cum(c, w)));
            }
        }
        if nw > 0 {
            rows.push(constraint!(v.cum[c][nw - 1] <= cl.count as f64 * u[c]));
        }
    }
    for q in &p.precs {
        for w in 0..nw {
            match q.kind {
                PrecKind::All => {
                    if let Some(zv) = v.z[q.pred][w] {
                        rows.push(constraint!(
                            v.in_window(q.succ, w) <= p.classes[q.succ].count as f64 * zv
                        ));
                    }
                }
                PrecKind::Ratio { pred_mul, succ_mul } => {
                    rows.push(constraint!(
                        pred_mul * v.cum(q.pred, w) >= succ_mul * v.cum(q.succ, w)
                    ));
                }
            }
        }
    }
    if p.residency.is_none() {
        let side_mem: Expression = (0..nc).map(|c| p.classes[c].bytes / GIB * u[c]).sum();
        rows.push(constraint!(side_mem <= p.headroom.max(0.0) / GIB));
        return rows;
    }
    let Memory { dec, train, host } = memory(p, res, v, &mut rows);
    for (i, it) in res.items.iter().enumerate() {
        let Some(fix) = it.fixed else { continue };
        let (o, st) = match fix {
            super::ItemChoice::Hbm => (0.0, 0.0),
            super::ItemChoice::Off => (1.0, 0.0),
            super::ItemChoice::Stream => (1.0, 1.0),
        };
        rows.push(constraint!(off[i] == o));
        if let Some(stv) = v.st[i] {
            rows.push(constraint!(stv == st));
        }
    }
    rows.push(constraint!(dec <= res.decode_budget / GIB + v.slack[0]));
    rows.push(constraint!(train <= res.train_budget / GIB + v.slack[1]));
    rows.push(constraint!(host <= res.host_budget.max(0.0) / GIB));
    if !v.x.is_empty() {
        let one: Expression = v.x.iter().map(|&x| Expression::from(x)).sum();
        rows.push(constraint!(one == 1.0));
        for (k, o) in res.reshard.iter().enumerate() {
            for &i in &o.excludes {
                if i < ni {
                    rows.push(constraint!(v.x[k] + off[i] <= 1.0));
                }
            }
        }
    }
    rows
}

/// The memory rows' left-hand sides (GiB): the decode row, the training row and the host row,
/// with the linking rows they need pushed to `rows` (a residency part only).
pub(super) struct Memory {
    pub dec: Expression,
    pub train: Expression,
    pub host: Expression,
}

pub(super) fn memory(p: &Problem, res: &Residency, v: &Vars, rows: &mut Vec<Constraint>) -> Memory {
    let nc = p.classes.len();
    let (u, off) = (&v.u, &v.off);
    let side_mem: Expression = (0..nc).map(|c| p.classes[c].bytes / GIB * u[c]).sum();
    // Decode row: base + items in HBM during decode + side classes' buffers.
    let mut dec = side_mem + res.decode_base / GIB;
    let mut train = Expression::from(res.train_base / GIB);
    let mut host = Expression::from(0.0);
    for (i, it) in res.items.iter().enumerate() {
        let b = it.bytes / GIB;
        if it.decode_off {
            dec += b;
        } else if let Some(dv) = v.dv[i] {
            rows.push(constraint!(dv + off[i] >= 1.0));
            for &c in &it.decode_if_class {
                if c < nc {
                    rows.push(constraint!(dv >= u[c]));
                }
            }
            dec += b * dv;
        }
        if it.train_off {
            train += b;
        } else if it.train_kept {
            train += b - b * off[i];
        }
        if let (Some(so), Some(stv)) = (&it.stream, v.st[i]) {
            rows.push(constraint!(stv <= off[i]));
            train += -((it.bytes - so.train_bytes).max(0.0) / GIB) * stv;
        }
        host += it.host_bytes / GIB * off[i];
    }
    for (k, ks) in res.kept.iter().enumerate() {
        let Some(hv) = v.h[k] else { continue };
        rows.push(constraint!(hv <= u[ks.class]));
        for &c in &ks.consumers {
            if c < nc {
                rows.push(constraint!(hv + u[c] <= 1.0));
            }
        }
        let saved = (p.classes[ks.class].bytes - ks.host_resident).max(0.0) / GIB;
        dec += -saved * hv;
        host += ks.host_bytes / GIB * hv;
    }
    for (k, a) in res.layer_decisions().iter().enumerate() {
        let (Some(a), Some(av)) = (a, v.act[k]) else {
            continue;
        };
        let b = a.bytes_per_layer / GIB;
        train += b * av;
        if let Some(hv) = a.in_state.and_then(|s| v.h.get(s).copied().flatten()) {
            let l = a.layers as f64;
            rows.push(constraint!(av <= l - l * hv));
        }
        match (a.decode, v.act_dec[k]) {
            (ActDecode::Always, _) => dec += b * av,
            (ActDecode::Class(c), Some(ev)) => {
                let l = a.layers as f64;
                rows.push(constraint!(ev >= b * av - b * l + b * l * u[c]));
                dec += ev;
            }
            _ => {}
        }
    }
    Memory { dec, train, host }
}

/// The starting solution: the feasible all-after-decode answer (no items, decode on the whole
/// GPU), everything in HBM, the first reshard option, slacks as needed.
pub(super) fn start(p: &Problem, res: &Residency, v: &Vars) -> Vec<(Variable, f64)> {
    let (nw, nj, nc) = (p.decode_time.len(), p.options.len(), p.classes.len());
    let nos = decode_alone(p);
    let mut init: Vec<(Variable, f64)> = Vec::new();
    for w in 0..nw {
        for j in 0..nj {
            if let Some(yv) = v.y[w][j] {
                init.push((yv, if j == nos { 1.0 } else { 0.0 }));
            }
            for c in 0..nc {
                if let Some(nv) = v.n[c][w][j] {
                    init.push((nv, 0.0));
                }
            }
        }
    }
    for c in 0..nc {
        init.push((v.u[c], 0.0));
        for w in 0..nw {
            init.push((v.cum[c][w], 0.0));
        }
        for w in 0..nw {
            if let Some(zv) = v.z[c][w] {
                init.push((zv, if p.classes[c].count == 0 { 1.0 } else { 0.0 }));
            }
        }
    }
    if p.residency.is_some() {
        let mut dec = res.decode_base;
        let mut train = res.train_base;
        for (i, it) in res.items.iter().enumerate() {
            // everything in HBM, but what the job forces off it
            let (o, st) = match it.fixed {
                Some(super::ItemChoice::Off) => (1.0, 0.0),
                Some(super::ItemChoice::Stream) => (1.0, 1.0),
                _ => (0.0, 0.0),
            };
            init.push((v.off[i], o));
            if let Some(stv) = v.st[i] {
                init.push((stv, st));
            }
            if let Some(dv) = v.dv[i] {
                init.push((dv, 1.0 - o));
            }
            if it.decode_off || (it.decode_kept && o == 0.0) {
                dec += it.bytes;
            }
            if it.train_off || (it.train_kept && o == 0.0) {
                train += match (&it.stream, st == 1.0) {
                    (Some(so), true) => so.train_bytes,
                    _ => it.bytes,
                };
            }
        }
        for (k, &xv) in v.x.iter().enumerate() {
            init.push((xv, if k == 0 { 1.0 } else { 0.0 }));
        }
        for x in v.act.iter().chain(&v.act_dec).flatten() {
            init.push((*x, 0.0));
        }
        init.push((v.slack[0], ((dec - res.decode_budget) / GIB).max(0.0)));
        init.push((v.slack[1], ((train - res.train_budget) / GIB).max(0.0)));
    }
    init
}
