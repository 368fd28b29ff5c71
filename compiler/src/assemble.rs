//! From a phase graph and a mode's placement decisions to a [`Sched`]: streams, windows, tasks
//! in issue order with their SM shares and explicit dependencies, and the buffers after
//! residency (offloaded buffers become a host copy, a device copy and the transfer tasks that
//! move them; a kept prefix state on host becomes one chunk per producer in a window, offloaded
//! after it and reloaded into the whole buffer after decode: `offload_kept`).
//!
//! Streams per GPU program: `main` (high priority: prefill, decode, everything after decode),
//! `side` (side work in decode windows) and `copy` (offload/reload). Serial plans use `main`
//! only.
//!
//! Dependencies added here, beyond the phase graph's data dependencies:
//! - a side task of window `w` waits for decode window `w - 1` (the partition changes at the
//!   window boundary; window 0's side work waits for the last pre-decode task);
//! - the first post-decode task on `main` waits for the last side task (the side partition is
//!   released before the whole GPU is used again);
//! - a reload waits for its anchor (the phase boundary it belongs to) and its buffer's first
//!   user waits for it; an offload waits for the buffer's last user;
//! - the last task of each GPU program waits for the last task of every other stream of that
//!   program (every lifetime has a task that ends after it).
//! - kept prefix states on host: a chunk's offload waits for its producer, the producer of
//!   chunk `k` for the offload of chunk `k - 2`, each reload for its offload and the last decode
//!   task, consumers for every reload, producers after decode for the first reload.
//!
//! Invariant: the output is in issue order (every dependency precedes its task).

use crate::error::{CompileError, Result};
use crate::ir::{
    kept_role, LBufId, LogicalBuffer, NodeId, Offload, PBuf, PhaseGraph, Placement, Role, STask,
    SWindow, Sched, SideClass, KEPT,
};
use crate::sched::topo_order;
use crate::workload::Workload;
use rollplex_plan::work::WorkKind;
use rollplex_plan::{BufferClass, BufferRole, GpuId, Op, Phase, Priority, ReshardPoint, Residency};
use std::collections::BTreeMap;

/// Issue-order key: pre-decode work, then windows (decode before its side work), then the
/// rest by phase, class and item.
fn key(pg: &PhaseGraph, p: &Placement, id: NodeId) -> (u32, u32, u32, u32, u32) {
    let n = pg.node(id);
    let class_rank =
        |c: SideClass| SideClass::ALL.iter().position(|&x| x == c).unwrap_or(0) as u32 + 1;
    match n.role {
        Role::PreDecode => (0, 0, 0, 0, id.index() as u32),
        Role::Decode { window } => (1, window, 0, 0, 0),
        Role::Side { class, item } => match p.in_window.get(&id) {
            Some(&w) => (1, w, class_rank(class), item, 0),
            None => (
                2,
                phase_rank(n.phase),
                item_major(class),
                class_rank(class),
                item,
            ),
        },
        Role::Post => (2, phase_rank(n.phase), 100, 0, id.index() as u32),
    }
}

/// After decode, per-slot work runs slot by slot except micro-batches and prefixes, which
/// keep their own order.
fn item_major(c: SideClass) -> u32 {
    match c {
        SideClass::RefPrefix | SideClass::OldPrefix => 0,
        SideClass::TrainPrefix => 2,
        SideClass::MicroBatch => 3,
        _ => 1,
    }
}

fn phase_rank(p: Phase) -> u32 {
    match p {
        Phase::Rollout => 0,
        Phase::Scoring => 1,
        Phase::Training => 2,
        Phase::Sync => 3,
    }
}

/// Builds the schedule of `pg` under `p`, with predicted times.
pub fn assemble(pg: &PhaseGraph, p: &Placement, cost: &rollplex_cost::CostModel) -> Result<Sched> {
    let total = pg.spec.cluster.gpu.sms;
    let mut s = Sched::default();
    for g in &pg.topo.gpus {
        s.stream(g.id, "main", Priority::High);
        if !p.single_stream {
            s.stream(g.id, "side", Priority::Normal);
            s.stream(g.id, "copy", Priority::Normal);
        }
    }
    let main = |s: &mut Sched, g: GpuId| s.stream(g, "main", Priority::High);
    let rg = pg.topo.rollout_gpu;
    let side_of = |s: &mut Sched, g: GpuId| {
        if p.single_stream {
            s.stream(g, "main", Priority::High)
        } else {
            s.stream(g, "side", Priority::Normal)
        }
    };
    let g = pg.topo.parallel.group_size;
    let n_r = pg.topo.parallel.prompts_per_rollout_replica;
    for (w, wp) in pg.windows.iter().enumerate() {
        let (d, side) = p.splits.get(w).copied().unwrap_or((total, 0));
        let (ds, ss) = (main(&mut s, rg), side_of(&mut s, rg));
        let groups_done = n_r as f64 * pg.lengths.group_done(g, wp.first.saturating_sub(1));
        s.windows.push(SWindow {
            gpu: rg,
            first_step: wp.first,
            steps: wp.steps,
            decode_stream: ds,
            side_stream: ss,
            decode_sms: d,
            side_sms: side,
            expected_active: n_r as f64 * g as f64 * pg.lengths.active(wp.first),
            expected_groups_done: if wp.first == 0 {
                0
            } else {
                groups_done.floor() as u32
            },
            start: 0.0,
            end: 0.0,
        });
    }

    // ---- order the phase graph's nodes ----
    let ids: Vec<NodeId> = pg.ids().collect();
    let idx_of = |id: NodeId| id.index();
    let decode_nodes = pg.decode_nodes();
    let last_pre: Option<NodeId> = ids
        .iter()
        .copied()
        .filter(|&i| pg.node(i).role == Role::PreDecode && pg.node(i).gpu == rg)
        .max_by_key(|&i| key(pg, p, i));
    let mut deps: Vec<Vec<usize>> = ids
        .iter()
        .map(|&i| pg.deps(i).into_iter().map(idx_of).collect())
        .collect();
    for (&id, &w) in &p.in_window {
        let extra = if w == 0 {
            last_pre
        } else {
            decode_nodes.get(w as usize - 1).copied()
        };
        if let Some(e) = extra {
            deps[id.index()].push(e.index());
        }
    }
    let order = topo_order(ids.len(), &deps, |i| key(pg, p, ids[i]))
        .ok_or_else(|| CompileError::internal("scheduling constraints form a cycle"))?;

    // ---- buffers after residency ----
    let mut map: Vec<usize> = Vec::new(); // logical -> device copy (what tasks use)
    let mut reloads: Vec<Reload> = Vec::new();
    for (li, lb) in pg.buffers.iter().enumerate() {
        let host = match lb.class {
            BufferClass::RefWeights => p.residency.ref_host,
            BufferClass::MasterWeights | BufferClass::OptimizerMoments => {
                p.residency.optimizer_host
            }
            _ => false,
        } && lb.offload != Offload::No;
        if host {
            let h = s.buffers.len();
            let mut copy = pbuf(lb, format!("{}.host", lb.name), true, true);
            copy.role = BufferRole::HostCopy;
            s.buffers.push(copy);
            let d = s.buffers.len();
            let mut dev = pbuf(lb, lb.name.clone(), false, false);
            dev.host_twin = true;
            s.buffers.push(dev);
            map.push(d);
            reloads.push(Reload {
                logical: LBufId::from_index(li),
                host: h,
                device: d,
                write_back: lb.offload == Offload::Mutable,
            });
        } else {
            map.push(s.buffers.len());
            let persistent = lb.persistent
                && !(lb.role == BufferRole::FrozenRolloutWeights && p.residency.frozen_rebuilt);
            s.buffers.push(pbuf(lb, lb.name.clone(), persistent, false));
        }
    }
    let frozen_buf = pg
        .buffer_with(BufferRole::FrozenRolloutWeights)
        .map(|i| map[i.index()]);
    s.reshard_point = pg.sharing.as_ref().map(|_| p.residency.reshard);
    s.frozen_rebuilt = p.residency.frozen_rebuilt;

    // ---- tasks ----
    let mut pos: Vec<usize> = vec![usize::MAX; ids.len()]; // node index -> task index
    let mut last_side: BTreeMap<GpuId, usize> = BTreeMap::new();
    let mut post_started: BTreeMap<GpuId, bool> = BTreeMap::new();
    for &i in &order {
        let id = ids[i];
        let n = pg.node(id);
        let mut t_deps: Vec<usize> = deps[i].iter().map(|&d| pos[d]).collect();
        let beside = matches!(n.op, Op::WeightSync { .. })
            && n.role == Role::PreDecode
            && p.residency.reshard == ReshardPoint::BesideEncode
            && !p.single_stream;
        let (stream, window, sms, phase) = match n.role {
            Role::PreDecode if beside => (
                s.stream(n.gpu, "copy", Priority::Normal),
                None,
                total,
                Phase::Sync,
            ),
            Role::PreDecode => (
                main(&mut s, n.gpu),
                None,
                total,
                if n.phase == Phase::Sync {
                    Phase::Sync
                } else {
                    Phase::Rollout
                },
            ),
            Role::Decode { window } => (
                main(&mut s, n.gpu),
                Some(window),
                s.windows[window as usize].decode_sms,
                Phase::Rollout,
            ),
            _ => match p.in_window.get(&id) {
                Some(&w) => (
                    side_of(&mut s, n.gpu),
                    Some(w),
                    s.windows[w as usize].side_sms,
                    Phase::Rollout,
                ),
                None => {
                    // First post-decode task on main waits for the side stream to drain.
                    if !post_started.get(&n.gpu).copied().unwrap_or(false) {
                        post_started.insert(n.gpu, true);
                        if let Some(&ls) = last_side.get(&n.gpu) {
                            t_deps.push(ls);
                        }
                    }
                    (main(&mut s, n.gpu), None, total, n.phase)
                }
            },
        };
        let ti = s.tasks.len();
        if window.is_some() && !matches!(n.role, Role::Decode { .. }) {
            last_side.insert(n.gpu, ti);
        }
        t_deps.sort_unstable();
        t_deps.dedup();
        let mut writes: Vec<usize> = n.writes.iter().map(|&b| map[b.index()]).collect();
        let mut work = n.work.clone();
        // A rebuilt frozen extra is part of every colocated weight sync.
        if let (Op::WeightSync { .. }, Role::PreDecode, true, Some(fb)) =
            (&n.op, n.role, p.residency.frozen_rebuilt, frozen_buf)
        {
            let b = s.buffers[fb].bytes as f64;
            work.net_bytes += b;
            work.bytes += b;
            writes.push(fb);
        }
        s.tasks.push(STask {
            name: n.name.clone(),
            kind: n.kind,
            op: n.op.clone(),
            gpu: n.gpu,
            phase,
            stream,
            window,
            deps: t_deps,
            reads: n.reads.iter().map(|&b| map[b.index()]).collect(),
            writes,
            work: crate::workload::rounded(&work),
            scratch: n.scratch,
            sms,
            ready_step: n.ready_step,
            start: 0.0,
            end: 0.0,
        });
        pos[i] = ti;
    }

    // ---- transfers for offloaded buffers ----
    let wl = Workload {
        spec: &pg.spec,
        shapes: &pg.shapes,
        lengths: &pg.lengths,
    };
    for r in &reloads {
        insert_transfers(&mut s, pg, p, r, &wl)?;
    }
    if !p.single_stream {
        for (class, _) in KEPT {
            if p.residency.kept_host(class) {
                if let Some(li) = kept_role(class).and_then(|r| pg.buffer_with(r)) {
                    offload_kept(&mut s, pg, class, li, map[li.index()], &wl)?;
                }
            }
        }
    }

    // ---- final join per GPU ----
    for gi in 0..pg.topo.gpus.len() {
        let gpu = GpuId::from_index(gi);
        let Some(j) = s.tasks.iter().rposition(|t| t.gpu == gpu) else {
            continue;
        };
        let jstream = s.tasks[j].stream;
        let mut extra = Vec::new();
        for st in 0..s.streams.len() {
            if st == jstream || s.streams[st].gpu != gpu {
                continue;
            }
            if let Some(k) = s.tasks[..j].iter().rposition(|t| t.stream == st) {
                extra.push(k);
            }
        }
        let t = &mut s.tasks[j];
        t.deps.extend(extra);
        t.deps.sort_unstable();
        t.deps.dedup();
    }

    crate::sched::predict(&mut s, cost);
    set_residency(&mut s, pg);
    Ok(s)
}

struct Reload {
    logical: LBufId,
    host: usize,
    device: usize,
    write_back: bool,
}

fn pbuf(lb: &LogicalBuffer, name: String, persistent: bool, host: bool) -> PBuf {
    PBuf {
        name,
        role: lb.role,
        class: lb.class,
        gpu: lb.gpu,
        bytes: lb.bytes,
        shape: lb.shape.clone(),
        persistent,
        host,
        host_twin: false,
        residency: Vec::new(),
        offload: lb.offload,
    }
}

/// Inserts the reload of `r` and, for buffers the iteration writes, the offload after its
/// last user. The reload starts at the boundary of the phase of the buffer's first user (for
/// work inside decode windows: when decode starts), so the device copy is alive only from
/// then on; every user waits for the reload and the offload waits for every user.
fn insert_transfers(
    s: &mut Sched,
    pg: &PhaseGraph,
    p: &Placement,
    r: &Reload,
    wl: &Workload,
) -> Result<()> {
    let users = |s: &Sched| -> Vec<usize> {
        (0..s.tasks.len())
            .filter(|&i| {
                s.tasks[i].reads.contains(&r.device) || s.tasks[i].writes.contains(&r.device)
            })
            .collect()
    };
    let u = users(s);
    let Some(&first) = u.first() else {
        return Ok(());
    };
    let gpu = s.tasks[first].gpu;
    let copy = if p.single_stream {
        s.stream(gpu, "main", Priority::High)
    } else {
        s.stream(gpu, "copy", Priority::Normal)
    };
    let bytes = pg.buffer(r.logical).bytes as f64;
    let name = pg.buffer(r.logical).name.clone();
    let on_gpu = |i: usize| s.tasks[i].gpu == gpu;
    let anchor = if s.tasks[first].window.is_some() {
        (0..first)
            .rev()
            .find(|&i| on_gpu(i) && s.tasks[i].window.is_none() && s.tasks[i].phase != Phase::Sync)
    } else {
        let ph = s.tasks[first].phase;
        let phase_start = (0..first)
            .find(|&i| on_gpu(i) && s.tasks[i].window.is_none() && s.tasks[i].phase == ph)
            .unwrap_or(first);
        (0..phase_start).rev().find(|&i| on_gpu(i))
    };
    let transfer = |name: String,
                    op: Op,
                    phase: Phase,
                    deps: Vec<usize>,
                    reads: Vec<usize>,
                    writes: Vec<usize>| STask {
        name,
        kind: WorkKind::Transfer,
        op,
        gpu,
        phase,
        stream: copy,
        window: None,
        deps,
        reads,
        writes,
        work: crate::workload::rounded(&wl.transfer(0.0, bytes)),
        scratch: 0,
        sms: pg.spec.cluster.gpu.sms,
        ready_step: 0,
        start: 0.0,
        end: 0.0,
    };
    let (host, dev) = (
        rollplex_plan::BufferId::from_index(r.host),
        rollplex_plan::BufferId::from_index(r.device),
    );
    let at = anchor.map(|a| a + 1).unwrap_or(0);
    let phase = s.tasks[first].phase;
    insert_task(
        s,
        at,
        transfer(
            format!("reload.{name}"),
            Op::Reload {
                from: host,
                to: dev,
            },
            phase,
            anchor.into_iter().collect(),
            vec![r.host],
            vec![r.device],
        ),
    );
    let u = users(s);
    for &i in &u {
        if i != at {
            s.tasks[i].deps.push(at);
            s.tasks[i].deps.sort_unstable();
            s.tasks[i].deps.dedup();
        }
    }
    if r.write_back {
        let users_only: Vec<usize> = u.into_iter().filter(|&i| i != at).collect();
        let Some(&last) = users_only.last() else {
            return Ok(());
        };
        let phase = s.tasks[last].phase;
        insert_task(
            s,
            last + 1,
            transfer(
                format!("offload.{name}"),
                Op::Offload {
                    from: dev,
                    to: host,
                },
                phase,
                users_only,
                vec![r.device],
                vec![r.host],
            ),
        );
    }
    Ok(())
}

/// Moves the kept state `d` (logical buffer `li`) that `class` produces to host: each producer
/// in a decode window writes its own chunk `<name>[k]` instead, offloaded to `<name>[k].host`
/// on the copy stream right after it; producer `k` waits for the offload of chunk `k - 2`
/// (two chunks live next to decode). After the last decode task and every offload, each chunk
/// is reloaded into `d`; the first reload happens before every other user of `d` (producers
/// after decode write their part of `d` directly) and every consumer waits for every reload.
fn offload_kept(
    s: &mut Sched,
    pg: &PhaseGraph,
    class: SideClass,
    li: LBufId,
    d: usize,
    wl: &Workload,
) -> Result<()> {
    let lb = pg.buffer(li);
    let gpu = lb.gpu;
    let producers: Vec<String> = s
        .tasks
        .iter()
        .filter(|t| t.gpu == gpu && t.window.is_some() && t.writes.contains(&d))
        .map(|t| t.name.clone())
        .collect();
    if producers.is_empty() {
        return Ok(());
    }
    let items = pg
        .ids()
        .filter(|&i| matches!(pg.node(i).role, Role::Side { class: c, .. } if c == class))
        .count()
        .max(producers.len()) as u64;
    let chunk = lb.bytes.div_ceil(items);
    let copy = s.stream(gpu, "copy", Priority::Normal);
    let find = |s: &Sched, name: &str| -> Result<usize> {
        s.tasks
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| CompileError::internal(format!("task {name} vanished")))
    };
    let transfer = |name: String,
                    op: Op,
                    phase: Phase,
                    deps: Vec<usize>,
                    reads: Vec<usize>,
                    writes: Vec<usize>| STask {
        name,
        kind: WorkKind::Transfer,
        op,
        gpu,
        phase,
        stream: copy,
        window: None,
        deps,
        reads,
        writes,
        work: crate::workload::rounded(&wl.transfer(0.0, chunk as f64)),
        scratch: 0,
        sms: pg.spec.cluster.gpu.sms,
        ready_step: 0,
        start: 0.0,
        end: 0.0,
    };
    let mut chunks: Vec<(usize, usize, String)> = Vec::new(); // (device, host, offload name)
    for (k, pname) in producers.iter().enumerate() {
        let dev = s.buffers.len();
        let mut b = pbuf(lb, format!("{}[{k}]", lb.name), false, false);
        b.role = BufferRole::KeptChunk;
        b.host_twin = true;
        b.bytes = chunk;
        b.shape = format!("chunk {k} of {items}: {}", lb.shape);
        s.buffers.push(b.clone());
        let host = s.buffers.len();
        b.name = format!("{}[{k}].host", lb.name);
        b.role = BufferRole::HostCopy;
        b.host = true;
        b.host_twin = false;
        s.buffers.push(b);
        let at = find(s, pname)?;
        for w in s.tasks[at].writes.iter_mut() {
            if *w == d {
                *w = dev;
            }
        }
        if k >= 2 {
            let before = find(s, &chunks[k - 2].2)?;
            s.tasks[at].deps.push(before);
            s.tasks[at].deps.sort_unstable();
            s.tasks[at].deps.dedup();
        }
        let oname = format!("offload.{}[{k}]", lb.name);
        let phase = s.tasks[at].phase;
        insert_task(
            s,
            at + 1,
            transfer(
                oname.clone(),
                Op::Offload {
                    from: rollplex_plan::BufferId::from_index(dev),
                    to: rollplex_plan::BufferId::from_index(host),
                },
                phase,
                vec![at],
                vec![dev],
                vec![host],
            ),
        );
        chunks.push((dev, host, oname));
    }
    // Reloads go after every window task and offload of this GPU, waiting for the last decode.
    let on_gpu = |t: &STask| t.gpu == gpu;
    let last_decode = s
        .tasks
        .iter()
        .rposition(|t| on_gpu(t) && matches!(t.op, Op::DecodeWindow { .. }))
        .ok_or_else(|| CompileError::internal("a kept state on host without decode"))?;
    let last_offload = find(s, &chunks[chunks.len() - 1].2)?;
    let last_window = s
        .tasks
        .iter()
        .rposition(|t| on_gpu(t) && t.window.is_some())
        .unwrap_or(0);
    let mut at = last_decode.max(last_offload).max(last_window) + 1;
    if let Some(early) =
        (0..at).find(|&i| s.tasks[i].reads.contains(&d) || s.tasks[i].writes.contains(&d))
    {
        return Err(CompileError::internal(format!(
            "{} is on host but {} uses it during decode",
            lb.name, s.tasks[early].name
        )));
    }
    let phase = s.tasks[at..]
        .iter()
        .find(|t| t.reads.contains(&d))
        .map(|t| t.phase)
        .unwrap_or(Phase::Training);
    let mut reloads = Vec::new();
    for (k, (_, host, oname)) in chunks.iter().enumerate() {
        let off = find(s, oname)?;
        let mut deps = vec![off, last_decode];
        deps.sort_unstable();
        deps.dedup();
        insert_task(
            s,
            at,
            transfer(
                format!("reload.{}[{k}]", lb.name),
                Op::Reload {
                    from: rollplex_plan::BufferId::from_index(*host),
                    to: rollplex_plan::BufferId::from_index(d),
                },
                phase,
                deps,
                vec![*host],
                vec![d],
            ),
        );
        reloads.push(at);
        at += 1;
    }
    // Every other user of `d` comes after the reloads: consumers wait for all of them,
    // producers after decode for the first (so it bounds the buffer's lifetime).
    for i in at..s.tasks.len() {
        let t = &mut s.tasks[i];
        if t.reads.contains(&d) {
            t.deps.extend(&reloads);
        } else if t.writes.contains(&d) {
            t.deps.push(reloads[0]);
        } else {
            continue;
        }
        t.deps.sort_unstable();
        t.deps.dedup();
    }
    Ok(())
}

/// Inserts `t` at index `at`, renumbering every dependency.
fn insert_task(s: &mut Sched, at: usize, t: STask) {
    for x in s.tasks.iter_mut() {
        for d in x.deps.iter_mut() {
            if *d >= at {
                *d += 1;
            }
        }
    }
    s.tasks.insert(at, t);
}

/// Fills each buffer's residency per phase from the phases of the tasks that use it.
fn set_residency(s: &mut Sched, pg: &PhaseGraph) {
    let n = s.buffers.len();
    let mut used: Vec<Vec<Phase>> = vec![Vec::new(); n];
    for t in &s.tasks {
        for &b in t.reads.iter().chain(&t.writes) {
            used[b].push(t.phase);
        }
    }
    let full_recompute = pg.spec.train.recompute == rollplex_plan::spec::Recompute::Full;
    for i in 0..n {
        let b = &s.buffers[i];
        let (first, last) = match (used[i].iter().min(), used[i].iter().max()) {
            (Some(a), Some(z)) => (*a, *z),
            _ => (Phase::Rollout, Phase::Sync),
        };
        let res: Vec<(Phase, Residency)> = Phase::ALL
            .iter()
            .map(|&ph| {
                let alive = b.persistent || (ph >= first && ph <= last);
                let r = if b.host {
                    Residency::Host
                } else if b.host_twin {
                    if used[i].contains(&ph) {
                        Residency::Hbm
                    } else {
                        Residency::Host
                    }
                } else if !alive && b.role == BufferRole::FrozenRolloutWeights {
                    Residency::Recompute
                } else if !alive {
                    Residency::Absent
                } else if b.class == BufferClass::Activations && full_recompute {
                    Residency::Recompute
                } else {
                    Residency::Hbm
                };
                (ph, r)
            })
            .collect();
        s.buffers[i].residency = res;
    }
}
