//! The schedule every mode produces: streams, decode windows with their SM split, tasks in
//! issue order with stream, window, SM share and dependencies, and the device/host buffers
//! they use (after residency); plus the timing pass that predicts start and end of each task.
//!
//! Timing model (the same for every mode, deterministic):
//! - a task starts when its dependencies and the previous task of its stream have ended, and
//!   not before the planned decode step its groups wait for (`ready_step`) is reached;
//! - a decode window starts when the previous window's decode and side tasks have all ended
//!   (the planner sizes windows so that side work fits; if it does not, decode waits);
//! - inside a window decode runs on `decode_sms`, side tasks on `side_sms`; a side task is
//!   slowed by the cost model's co-run factor against decode for its whole time; decode is
//!   slowed by its factor against each side task only while that task runs (the window's side
//!   tasks one after another from the decode's start, in issue order), and runs alone on its
//!   partition after them ([`rollplex_cost::beside_time`]: what the runtime measures, a
//!   window's steps beside side work slower than its steps after it). Elsewhere a task has the
//!   whole GPU (transfers on the copy stream are assumed not to slow compute; an offload's
//!   host bytes go at the cost model's device -> host rate, every other task's at its
//!   host -> device rate: `Op::host_dir`); a streamed optimizer step (`optimizer_stream`)
//!   lasts its fill, one stage per chunk and its drain
//!   ([`crate::residency::streamed_step_s`]);
//! - a step inside a window is reached in proportion to the window's duration.
//!
//! Invariant: `tasks` is in issue order: every dependency index is smaller than the task's.

use crate::ir::Sched;
use rollplex_cost::CostModel;
use rollplex_plan::work::WorkKind;
use rollplex_plan::Op;

/// Computes `start`/`end` of every task and window (see the module docs).
pub fn predict(s: &mut Sched, cost: &CostModel) {
    let total_sms = cost.gpu().sms;
    let mut stream_end = vec![0.0f64; s.streams.len()];
    let nw = s.windows.len();
    // Per window: decode start/end and the latest side end.
    let mut dec: Vec<Option<(f64, f64)>> = vec![None; nw];
    let mut side_end = vec![0.0f64; nw];
    // Side work per window, in issue order: (its slowed time, decode's slowdown beside it).
    let mut side_load: Vec<Vec<(f64, f64)>> = vec![Vec::new(); nw];
    for t in &s.tasks {
        if let Some(w) = t.window {
            let win = &s.windows[w as usize];
            if t.stream == win.side_stream && t.kind != WorkKind::Decode && win.side_sms > 0 {
                let alone =
                    cost.time_dir(t.kind, &t.work, t.sms.clamp(1, total_sms), t.op.host_dir());
                side_load[w as usize].push((
                    alone * cost.corun_slowdown(t.kind, WorkKind::Decode),
                    cost.corun_slowdown(WorkKind::Decode, t.kind),
                ));
            }
        }
    }
    for i in 0..s.tasks.len() {
        let (deps_end, stream, window, kind) = {
            let t = &s.tasks[i];
            let d = t.deps.iter().map(|&d| s.task(d).end).fold(0.0, f64::max);
            (d, t.stream, t.window, t.kind)
        };
        let mut start = deps_end.max(stream_end[stream.index()]);
        let is_decode = matches!(s.tasks[i].op, Op::DecodeWindow { .. });
        if is_decode {
            if let Some(w) = window {
                let w = w as usize;
                if w > 0 {
                    start = start.max(side_end[w - 1]);
                    if let Some((_, e)) = dec[w - 1] {
                        start = start.max(e);
                    }
                }
            }
        }
        // Wait for the planned decode step this task's groups need.
        let ready = s.tasks[i].ready_step;
        if ready > 0 {
            start = start.max(step_time(s, &dec, ready));
        }
        let t = &s.tasks[i];
        let mut dur = cost.time_dir(kind, &t.work, t.sms.clamp(1, total_sms), t.op.host_dir());
        if let Some(st) = s.optimizer_stream.as_ref().filter(|st| st.gpu == t.gpu) {
            if matches!(t.op, Op::OptimizerStep { .. }) {
                dur = crate::residency::streamed_step_s(cost, dur, st.chunk_elems, st.chunks);
            }
        }
        if let Some(w) = window {
            let win = &s.windows[w as usize];
            if win.side_sms > 0 {
                if is_decode {
                    dur = rollplex_cost::beside_time(dur, &side_load[w as usize]);
                } else {
                    dur *= cost.corun_slowdown(kind, WorkKind::Decode);
                }
            }
        }
        if !dur.is_finite() {
            dur = 0.0;
        }
        let end = start + dur;
        let t = &mut s.tasks[i];
        t.start = start;
        t.end = end;
        stream_end[stream.index()] = end;
        if let Some(w) = window {
            let w = w as usize;
            if is_decode {
                dec[w] = Some((start, end));
            } else {
                side_end[w] = side_end[w].max(end);
            }
        }
    }
    for (w, win) in s.windows.iter_mut().enumerate() {
        if let Some((a, b)) = dec[w] {
            win.start = a;
            win.end = b.max(side_end[w]);
        }
    }
}

/// When decode reaches `step` (the start of that step), by linear progress inside windows.
fn step_time(s: &Sched, dec: &[Option<(f64, f64)>], step: u32) -> f64 {
    let mut last = 0.0;
    for (w, win) in s.windows.iter().enumerate() {
        let Some((a, b)) = dec[w] else { continue };
        last = b;
        if step < win.first_step + win.steps {
            let frac = (step.saturating_sub(win.first_step)) as f64 / win.steps.max(1) as f64;
            return a + frac * (b - a);
        }
    }
    last
}

/// Stable topological order of `n` items with `deps`, preferring smaller `key`s: Kahn's
/// algorithm with a priority queue. Returns `None` on a cycle.
pub fn topo_order<K: Ord + Copy>(
    n: usize,
    deps: &[Vec<usize>],
    key: impl Fn(usize) -> K,
) -> Option<Vec<usize>> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut indeg = vec![0usize; n];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds {
            indeg[i] += 1;
            out[d].push(i);
        }
    }
    let mut heap: BinaryHeap<Reverse<(K, usize)>> = (0..n)
        .filter(|&i| indeg[i] == 0)
        .map(|i| Reverse((key(i), i)))
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse((_, i))) = heap.pop() {
        order.push(i);
        for &j in &out[i] {
            indeg[j] -= 1;
            if indeg[j] == 0 {
                heap.push(Reverse((key(j), j)));
            }
        }
    }
    (order.len() == n).then_some(order)
}
