//! The residency rules: `memory` (arenas hold their buffers, buffers are used only inside
//! their lifetimes, overlapping buffers of an arena are never alive together, device arenas fit
//! the budget) and `roles` (a buffer's class and uniqueness by role, host copies alone in host
//! arenas, an offload or reload moving one host copy and one device buffer, the optimizer's
//! buffers where steps run, the decode KV layout).

use super::{op_buffers, Checker, HappensBefore};
use crate::ids::{BufferId, GpuId, TaskId};
use crate::plan::{align_up, ArenaKind, BufferRole, Lifetime, Op};
use std::collections::{BTreeMap, BTreeSet};

impl Checker<'_> {
    pub(super) fn memory(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let mut users: Vec<Vec<TaskId>> = vec![Vec::new(); p.buffers.len()];
        for t in &p.tasks {
            for b in t
                .reads
                .iter()
                .chain(&t.writes)
                .chain(op_buffers(&t.op).iter())
            {
                users[b.index()].push(t.id);
            }
        }
        for b in &p.buffers {
            let a = &p.memory.arenas[b.arena.index()];
            if a.gpu != b.gpu {
                self.err(
                    "memory",
                    format!(
                        "{} `{}` is on {} but in {} of {}",
                        b.id, b.name, b.gpu, a.id, a.gpu
                    ),
                );
            }
            if b.offset
                .checked_add(b.bytes)
                .is_none_or(|end| end > a.bytes)
            {
                self.err(
                    "memory",
                    format!(
                        "{} `{}` at {}+{} overruns {} ({} bytes)",
                        b.id, b.name, b.offset, b.bytes, a.id, a.bytes
                    ),
                );
            }
            if let Lifetime::Tasks { first, last } = b.lifetime {
                for x in [first, last] {
                    if p.tasks[x.index()].gpu != b.gpu {
                        self.err(
                            "memory",
                            format!("{} `{}` has lifetime task {x} on another GPU", b.id, b.name),
                        );
                    }
                }
                if !hb.before_or_same(first, last) {
                    self.err(
                        "memory",
                        format!(
                            "{} `{}`: lifetime start {first} does not happen before its end {last}",
                            b.id, b.name
                        ),
                    );
                }
                for &u in &users[b.id.index()] {
                    if !(hb.before_or_same(first, u) && hb.before_or_same(u, last)) {
                        self.err(
                            "memory",
                            format!(
                                "{} `{}` is used by {u} outside its lifetime {first}..{last}",
                                b.id, b.name
                            ),
                        );
                    }
                }
            }
        }
        // Overlap check per arena: sort by offset, compare each buffer with those it overlaps.
        for a in &p.memory.arenas {
            let mut bufs: Vec<&crate::plan::Buffer> = p
                .buffers
                .iter()
                .filter(|b| b.arena == a.id && b.bytes > 0)
                .collect();
            bufs.sort_by_key(|b| (b.offset, b.id));
            for i in 0..bufs.len() {
                let x = bufs[i];
                let x_end = x.offset.saturating_add(x.bytes);
                for y in bufs.iter().skip(i + 1) {
                    if y.offset >= x_end {
                        break;
                    }
                    if !ordered(hb, x.lifetime, y.lifetime) {
                        self.err(
                            "memory",
                            format!(
                                "{} `{}` and {} `{}` overlap in {} while both may be alive",
                                x.id, x.name, y.id, y.name, a.id
                            ),
                        );
                    }
                }
            }
        }
        for m in &p.memory.gpus {
            let dev: u64 = p
                .memory
                .arenas
                .iter()
                .filter(|a| a.gpu == m.gpu && a.kind == ArenaKind::Device)
                .map(|a| a.bytes)
                .sum();
            if m.peak != dev {
                self.err(
                    "memory",
                    format!(
                        "{} reports peak {} but its device arenas hold {dev} bytes",
                        m.gpu, m.peak
                    ),
                );
            }
            if dev > m.budget {
                self.err(
                    "memory",
                    format!(
                        "{} needs {dev} device bytes, over its budget of {}",
                        m.gpu, m.budget
                    ),
                );
            }
            if m.live_peak > m.peak {
                self.err(
                    "memory",
                    format!(
                        "{} reports live peak {} above its arena peak {}",
                        m.gpu, m.live_peak, m.peak
                    ),
                );
            }
        }
    }

    pub(super) fn roles(&mut self) {
        let p = self.plan;
        let mut seen: BTreeMap<(GpuId, BufferRole), BufferId> = BTreeMap::new();
        for b in &p.buffers {
            if let Some(c) = b.role.class().filter(|&c| c != b.class) {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` has role {:?} but class {:?} (the role's is {c:?})",
                        b.id, b.name, b.role, b.class
                    ),
                );
            }
            if b.role.unique() {
                if let Some(other) = seen.insert((b.gpu, b.role), b.id) {
                    self.err(
                        "roles",
                        format!(
                            "{} `{}` and {other} are both {:?} of {}",
                            b.id, b.name, b.role, b.gpu
                        ),
                    );
                }
            }
            let host_arena = p.memory.arenas[b.arena.index()].kind == ArenaKind::Host;
            if host_arena != (b.role == BufferRole::HostCopy) {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` is {:?} in a {} arena",
                        b.id,
                        b.name,
                        b.role,
                        if host_arena { "host" } else { "device" }
                    ),
                );
            }
        }
        let mut steps: BTreeSet<(GpuId, u32)> = BTreeSet::new();
        for t in &p.tasks {
            let (host, dev) = match t.op {
                Op::Offload { from, to } => (to, from),
                Op::Reload { from, to } => (from, to),
                Op::OptimizerStep { step } => {
                    steps.insert((t.gpu, step));
                    continue;
                }
                _ => continue,
            };
            let role = |b: BufferId| p.buffers[b.index()].role;
            if role(host) != BufferRole::HostCopy || role(dev) == BufferRole::HostCopy {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` moves {host} ({:?}) and {dev} ({:?}): one host copy and one \
                         device buffer",
                        t.id,
                        t.name,
                        role(host),
                        role(dev)
                    ),
                );
            }
        }
        for &(gpu, step) in &steps {
            for role in [
                BufferRole::ActorWeights,
                BufferRole::MasterWeights,
                BufferRole::AdamMoments,
            ] {
                if !seen.contains_key(&(gpu, role)) {
                    self.err(
                        "roles",
                        format!("{gpu} runs optimizer step {step} but has no {role:?} buffer"),
                    );
                }
            }
        }
        for (&(gpu, role), &id) in &seen {
            if let BufferRole::Grads { step } | BufferRole::TrainPrefix { step } = role {
                if !steps.contains(&(gpu, step)) {
                    self.err(
                        "roles",
                        format!("{id} is {role:?} of {gpu}, which runs no optimizer step {step}"),
                    );
                }
            }
            if role != BufferRole::KvResponse {
                continue;
            }
            let resp = &p.buffers[id.index()];
            match seen.get(&(gpu, BufferRole::KvPrompt)) {
                Some(&q) => {
                    let prompt = &p.buffers[q.index()];
                    let end = align_up(resp.offset.saturating_add(resp.bytes));
                    if prompt.arena != resp.arena || prompt.offset != end {
                        self.err(
                            "roles",
                            format!(
                                "{q} `{}` is at {} of {} but {id} `{}` ends at {end} of {}",
                                prompt.name, prompt.offset, prompt.arena, resp.name, resp.arena
                            ),
                        );
                    }
                }
                None => self.err(
                    "roles",
                    format!("{gpu} has {id} `{}` without a KvPrompt buffer", resp.name),
                ),
            }
        }
    }
}

fn ordered(hb: &HappensBefore, a: Lifetime, b: Lifetime) -> bool {
    match (a, b) {
        (
            Lifetime::Tasks {
                first: fa,
                last: la,
            },
            Lifetime::Tasks {
                first: fb,
                last: lb,
            },
        ) => hb.strictly_before(la, fb) || hb.strictly_before(lb, fa),
        _ => false,
    }
}
