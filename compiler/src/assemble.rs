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
    kept_role, LBufId, LogicalBuffer, NodeId, Offload, PBuf, PBufId, PhaseGraph, Placement, Role,
    SStreamId, STask, STaskId, SWindow, Sched, SideClass, KEPT,
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
    let mut map: Vec<PBufId> = Vec::new(); // logical -> device copy (what tasks use)
    let mut reloads: Vec<Reload> = Vec::new();
    let mut stream_hosts: Vec<PBufId> = Vec::new(); // host copies a streamed step updates
    for (li, lb) in pg.buffers.iter().enumerate() {
        let host = match lb.class {
            BufferClass::RefWeights => p.residency.ref_host,
            BufferClass::MasterWeights | BufferClass::OptimizerMoments => {
                p.residency.optimizer_host
            }
            _ => false,
        } && lb.offload != Offload::No;
        let streamed = match (p.residency.optimizer_stream, lb.class) {
            (Some(sh), BufferClass::MasterWeights) if host => Some((sh, 1)),
            (Some(sh), BufferClass::OptimizerMoments) if host => Some((sh, 2)),
            _ => None,
        };
        if host {
            let h = s.next_buffer();
            let mut copy = pbuf(lb, format!("{}.host", lb.name), true, true);
            copy.role = BufferRole::HostCopy;
            s.buffers.push(copy);
            let d = s.next_buffer();
            let mut dev = pbuf(lb, lb.name.clone(), false, false);
            match streamed {
                // streamed: the host copy is the state; the device buffer is only the staging
                // slots each optimizer step copies chunks through
                Some((sh, per_slot)) => {
                    let st = rollplex_plan::OptimizerStream {
                        gpu: lb.gpu,
                        chunk_elems: sh.chunk_elems,
                        chunks: sh.chunks,
                        slots: sh.slots,
                    };
                    dev.bytes = per_slot * st.master_bytes();
                    dev.shape = format!(
                        "{} staging slots of {} x {} f32",
                        sh.slots, per_slot, sh.chunk_elems
                    );
                    stream_hosts.push(h);
                    s.optimizer_stream = Some(st);
                }
                None => {
                    dev.host_twin = true;
                    reloads.push(Reload {
                        logical: LBufId::from_index(li),
                        host: h,
                        device: d,
                        write_back: lb.offload == Offload::Mutable,
                    });
                }
            }
            s.buffers.push(dev);
            map.push(d);
        } else {
            map.push(s.next_buffer());
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
    let mut pos: Vec<Option<STaskId>> = vec![None; ids.len()]; // node index -> task
    let mut last_side: BTreeMap<GpuId, STaskId> = BTreeMap::new();
    let mut post_started: BTreeMap<GpuId, bool> = BTreeMap::new();
    for &i in &order {
        let id = ids[i];
        let n = pg.node(id);
        // `order` is topological, so every dependency already has its task.
        let mut t_deps: Vec<STaskId> = deps[i]
            .iter()
            .map(|&d| {
                pos[d].ok_or_else(|| {
                    CompileError::internal(format!("{} is ordered before its dependencies", n.name))
                })
            })
            .collect::<Result<_>>()?;
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
        let ti = STaskId::from_index(s.tasks.len());
        if window.is_some() && !matches!(n.role, Role::Decode { .. }) {
            last_side.insert(n.gpu, ti);
        }
        t_deps.sort_unstable();
        t_deps.dedup();
        let mut writes: Vec<PBufId> = n.writes.iter().map(|&b| map[b.index()]).collect();
        let mut work = n.work.clone();
        // A rebuilt frozen extra is part of every colocated weight sync.
        if let (Op::WeightSync { .. }, Role::PreDecode, true, Some(fb)) =
            (&n.op, n.role, p.residency.frozen_rebuilt, frozen_buf)
        {
            let b = s.buffer(fb).bytes as f64;
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
        pos[i] = Some(ti);
    }

    // ---- a streamed optimizer step reads and writes the host copies of its state ----
    if let Some(st) = &s.optimizer_stream {
        let gpu = st.gpu;
        for t in s.tasks.iter_mut() {
            if t.gpu == gpu && matches!(t.op, Op::OptimizerStep { .. }) {
                t.reads.extend(stream_hosts.iter().copied());
                t.writes.extend(stream_hosts.iter().copied());
                t.reads.sort_unstable();
                t.reads.dedup();
                t.writes.sort_unstable();
                t.writes.dedup();
            }
        }
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
        let Some(j) = s.task_ids().rev().find(|&j| s.task(j).gpu == gpu) else {
            continue;
        };
        let jstream = s.task(j).stream;
        let mut extra = Vec::new();
        for (st, stream) in s.streams.iter().enumerate() {
            let st = SStreamId::from_index(st);
            if st == jstream || stream.gpu != gpu {
                continue;
            }
            if let Some(k) = s.tasks[..j.index()].iter().rposition(|t| t.stream == st) {
                extra.push(STaskId::from_index(k));
            }
        }
        s.task_mut(j).add_deps(extra);
    }

    crate::sched::predict(&mut s, cost);
    set_residency(&mut s, pg);
    Ok(s)
}

struct Reload {
    logical: LBufId,
    host: PBufId,
    device: PBufId,
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
    let users = |s: &Sched| -> Vec<STaskId> {
        s.task_ids().filter(|&i| s.task(i).uses(r.device)).collect()
    };
    let u = users(s);
    let Some(&first) = u.first() else {
        return Ok(());
    };
    let gpu = s.task(first).gpu;
    let copy = if p.single_stream {
        s.stream(gpu, "main", Priority::High)
    } else {
        s.stream(gpu, "copy", Priority::Normal)
    };
    let bytes = pg.buffer(r.logical).bytes as f64;
    let name = pg.buffer(r.logical).name.clone();
    let before_first = || s.task_ids().take(first.index());
    let anchor = if s.task(first).window.is_some() {
        before_first().rev().find(|&i| {
            let t = s.task(i);
            t.gpu == gpu && t.window.is_none() && t.phase != Phase::Sync
        })
    } else {
        let ph = s.task(first).phase;
        let phase_start = before_first()
            .find(|&i| {
                let t = s.task(i);
                t.gpu == gpu && t.window.is_none() && t.phase == ph
            })
            .unwrap_or(first);
        s.task_ids()
            .take(phase_start.index())
            .rev()
            .find(|&i| s.task(i).gpu == gpu)
    };
    let transfer = |name: String,
                    op: Op,
                    phase: Phase,
                    deps: Vec<STaskId>,
                    reads: Vec<PBufId>,
                    writes: Vec<PBufId>| STask {
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
    let at = STaskId::from_index(anchor.map_or(0, |a| a.index() + 1));
    let phase = s.task(first).phase;
    insert_task(
        s,
        at,
        transfer(
            format!("reload.{name}"),
            Op::Reload {
                from: r.host.op_id(),
                to: r.device.op_id(),
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
            s.task_mut(i).add_deps([at]);
        }
    }
    if r.write_back {
        let users_only: Vec<STaskId> = u.into_iter().filter(|&i| i != at).collect();
        let Some(&last) = users_only.last() else {
            return Ok(());
        };
        let phase = s.task(last).phase;
        insert_task(
            s,
            STaskId::from_index(last.index() + 1),
            transfer(
                format!("offload.{name}"),
                Op::Offload {
                    from: r.device.op_id(),
                    to: r.host.op_id(),
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
    d: PBufId,
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
    let find = |s: &Sched, name: &str| -> Result<STaskId> {
        s.task_ids()
            .find(|&i| s.task(i).name == name)
            .ok_or_else(|| CompileError::internal(format!("task {name} vanished")))
    };
    let transfer = |name: String,
                    op: Op,
                    phase: Phase,
                    deps: Vec<STaskId>,
                    reads: Vec<PBufId>,
                    writes: Vec<PBufId>| STask {
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
    let mut chunks: Vec<(PBufId, PBufId, String)> = Vec::new(); // (device, host, offload name)
    for (k, pname) in producers.iter().enumerate() {
        let dev = s.next_buffer();
        let mut b = pbuf(lb, format!("{}[{k}]", lb.name), false, false);
        b.role = BufferRole::KeptChunk;
        b.host_twin = true;
        b.bytes = chunk;
        b.shape = format!("chunk {k} of {items}: {}", lb.shape);
        s.buffers.push(b.clone());
        let host = s.next_buffer();
        b.name = format!("{}[{k}].host", lb.name);
        b.role = BufferRole::HostCopy;
        b.host = true;
        b.host_twin = false;
        s.buffers.push(b);
        let at = find(s, pname)?;
        for w in s.task_mut(at).writes.iter_mut() {
            if *w == d {
                *w = dev;
            }
        }
        if k >= 2 {
            let before = find(s, &chunks[k - 2].2)?;
            s.task_mut(at).add_deps([before]);
        }
        let oname = format!("offload.{}[{k}]", lb.name);
        let phase = s.task(at).phase;
        insert_task(
            s,
            STaskId::from_index(at.index() + 1),
            transfer(
                oname.clone(),
                Op::Offload {
                    from: dev.op_id(),
                    to: host.op_id(),
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
    let last_on_gpu = |s: &Sched, f: &dyn Fn(&STask) -> bool| {
        s.task_ids().rev().find(|&i| {
            let t = s.task(i);
            t.gpu == gpu && f(t)
        })
    };
    let last_decode = last_on_gpu(s, &|t| matches!(t.op, Op::DecodeWindow { .. }))
        .ok_or_else(|| CompileError::internal("a kept state on host without decode"))?;
    let last_offload = find(s, &chunks[chunks.len() - 1].2)?;
    let last_window = last_on_gpu(s, &|t| t.window.is_some()).unwrap_or(STaskId(0));
    let mut at = last_decode.max(last_offload).max(last_window).index() + 1;
    if let Some(early) = s.task_ids().take(at).find(|&i| s.task(i).uses(d)) {
        return Err(CompileError::internal(format!(
            "{} is on host but {} uses it during decode",
            lb.name,
            s.task(early).name
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
        let id = STaskId::from_index(at);
        insert_task(
            s,
            id,
            transfer(
                format!("reload.{}[{k}]", lb.name),
                Op::Reload {
                    from: host.op_id(),
                    to: d.op_id(),
                },
                phase,
                deps,
                vec![*host],
                vec![d],
            ),
        );
        reloads.push(id);
        at += 1;
    }
    // Every other user of `d` comes after the reloads: consumers wait for all of them,
    // producers after decode for the first (so it bounds the buffer's lifetime).
    for t in &mut s.tasks[at..] {
        if t.reads.contains(&d) {
            t.add_deps(reloads.iter().copied());
        } else if t.writes.contains(&d) {
            t.add_deps([reloads[0]]);
        }
    }
    Ok(())
}

/// Inserts `t` so that it gets the id `at`, renumbering every dependency on a task at or after
/// it.
fn insert_task(s: &mut Sched, at: STaskId, t: STask) {
    for x in s.tasks.iter_mut() {
        for d in x.deps.iter_mut() {
            if *d >= at {
                *d = STaskId(d.0 + 1);
            }
        }
    }
    s.tasks.insert(at.index(), t);
}

/// Fills each buffer's residency per phase from the phases of the tasks that use it.
fn set_residency(s: &mut Sched, pg: &PhaseGraph) {
    let n = s.buffers.len();
    let mut used: Vec<Vec<Phase>> = vec![Vec::new(); n];
    for t in &s.tasks {
        for &b in t.reads.iter().chain(&t.writes) {
            used[b.index()].push(t.phase);
        }
    }
    let full_recompute = pg.kept.suffix == 0;
    for (b, used) in s.buffers.iter_mut().zip(&used) {
        let (first, last) = match (used.iter().min(), used.iter().max()) {
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
                    if used.contains(&ph) {
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
        b.residency = res;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(name: &str, deps: Vec<STaskId>) -> STask {
        STask::bare(name, crate::ir::SStreamId(0), deps)
    }

    /// Inserting at `at` moves every dependency on a task at or after it, and no other.
    #[test]
    fn insert_task_renumbers_dependencies() {
        let mut s = Sched::default();
        s.stream(GpuId(0), "main", Priority::High);
        s.tasks.push(task("a", vec![]));
        s.tasks.push(task("b", vec![STaskId(0)]));
        s.tasks.push(task("c", vec![STaskId(0), STaskId(1)]));
        insert_task(&mut s, STaskId(1), task("new", vec![STaskId(0)]));
        let names: Vec<&str> = s.tasks.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "new", "b", "c"]);
        assert_eq!(s.task(STaskId(2)).deps, vec![STaskId(0)]);
        assert_eq!(s.task(STaskId(3)).deps, vec![STaskId(0), STaskId(2)]);
        assert_eq!(crate::ir::verify_sched(&s), Ok(()));
    }
}
