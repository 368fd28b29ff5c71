//! Memory layout: lifetimes from the tasks that use each buffer, arena offsets, peaks.
//!
//! Lifetimes are defined by happens-before (dependencies and stream order), not by predicted
//! times, so a layout stays correct however long tasks really take: a buffer's lifetime runs
//! from a task that happens before (or is) every user to a task that happens after (or is)
//! every user. Two buffers may share bytes only when one's last task happens before the
//! other's first. Persistent buffers share with nothing.
//!
//! Placement: per arena (one device and, when anything is offloaded, one pinned-host arena per
//! GPU program), persistent buffers first, then the rest by size (largest first), each at the
//! lowest aligned offset ([`align_up`]) where it overlaps no conflicting buffer placed before it
//! (first fit over the gaps); a pair of [`TOGETHER`] is placed as one block. Peak = the device arena's size; `live_peak` = the largest sum of
//! buffers certainly alive at one task (those pairwise conflict, so it is a lower bound).
//!
//! Invariant of an `Ok` layout: the plan's `memory` rule of `validate` holds, including the
//! budget.

use crate::error::gib;
use rollplex_plan::validate::HappensBefore;
use rollplex_plan::{
    align_up, Arena, ArenaId, ArenaKind, BufferId, BufferRole, GpuId, GpuMemory, Lifetime, Plan,
    Residency, TaskId,
};

/// Buffers placed back to back, the first's (aligned) end at the second's start: the CUDA
/// executor's decode KV arena holds its keys, then its values, each over the prompt and the
/// response rows of every layer, in the two buffers' bytes.
const TOGETHER: [(BufferRole, BufferRole); 1] = [(BufferRole::KvResponse, BufferRole::KvPrompt)];

/// Why a layout does not fit: the numbers a user needs.
#[derive(Clone, Debug, PartialEq)]
pub struct OverBudget {
    pub gpu: GpuId,
    pub peak: u64,
    pub budget: u64,
    /// The largest buffers alive where the live peak is reached: (name, bytes).
    pub largest: Vec<(String, u64)>,
    /// The task where the live peak is reached.
    pub at: TaskId,
}

impl OverBudget {
    pub fn message(&self) -> String {
        let list: Vec<String> = self
            .largest
            .iter()
            .map(|(n, b)| format!("{n} {}", gib(*b)))
            .collect();
        format!(
            "the plan needs {} of device memory per GPU, {} over the budget of {} (largest buffers alive together: {})",
            gib(self.peak),
            gib(self.peak.saturating_sub(self.budget)),
            gib(self.budget),
            list.join(", ")
        )
    }
}

fn is_host(b: &rollplex_plan::Buffer) -> bool {
    !b.residency.is_empty() && b.residency.iter().all(|r| r.residency == Residency::Host)
}

/// Sets every buffer's lifetime, arena and offset, and the plan's memory summary.
pub fn layout(plan: &mut Plan) -> Result<(), OverBudget> {
    let hb = HappensBefore::new(plan);
    let nb = plan.buffers.len();
    let mut users: Vec<Vec<TaskId>> = vec![Vec::new(); nb];
    for t in &plan.tasks {
        let mut bs: Vec<BufferId> = t.reads.iter().chain(&t.writes).copied().collect();
        if let rollplex_plan::Op::Offload { from, to } | rollplex_plan::Op::Reload { from, to } =
            &t.op
        {
            bs.push(*from);
            bs.push(*to);
        }
        bs.sort_unstable();
        bs.dedup();
        for b in bs {
            users[b.index()].push(t.id);
        }
    }
    let n = plan.tasks.len();
    for (i, b) in plan.buffers.iter_mut().enumerate() {
        if b.lifetime == Lifetime::Persistent {
            continue;
        }
        let u = &users[i];
        let Some(&lo) = u.iter().min() else {
            b.lifetime = Lifetime::Persistent;
            continue;
        };
        let hi = *u.iter().max().unwrap_or(&lo);
        let first = (0..=lo.index())
            .rev()
            .map(TaskId::from_index)
            .find(|&c| u.iter().all(|&x| hb.before_or_same(c, x)));
        let last = (hi.index()..n)
            .map(TaskId::from_index)
            .find(|&c| u.iter().all(|&x| hb.before_or_same(x, c)));
        b.lifetime = match (first, last) {
            (Some(first), Some(last)) => Lifetime::Tasks { first, last },
            // No single task bounds the users: keep the buffer for the whole iteration.
            _ => Lifetime::Persistent,
        };
    }

    // Arenas: device then host per GPU program.
    let mut arenas: Vec<Arena> = Vec::new();
    for g in &plan.gpus {
        arenas.push(Arena {
            id: ArenaId::from_index(arenas.len()),
            gpu: g.id,
            kind: ArenaKind::Device,
            bytes: 0,
        });
        if plan.buffers.iter().any(|b| b.gpu == g.id && is_host(b)) {
            arenas.push(Arena {
                id: ArenaId::from_index(arenas.len()),
                gpu: g.id,
                kind: ArenaKind::Host,
                bytes: 0,
            });
        }
    }
    let arena_of = |gpu: GpuId, host: bool| {
        arenas
            .iter()
            .find(|a| a.gpu == gpu && (a.kind == ArenaKind::Host) == host)
            .map(|a| a.id)
            .unwrap_or(ArenaId(0))
    };
    for b in plan.buffers.iter_mut() {
        b.arena = arena_of(b.gpu, is_host(b));
    }

    for a in arenas.iter_mut() {
        let mut members: Vec<usize> = (0..nb).filter(|&i| plan.buffers[i].arena == a.id).collect();
        members.sort_by_key(|&i| {
            let b = &plan.buffers[i];
            (
                b.lifetime != Lifetime::Persistent,
                std::cmp::Reverse(b.bytes),
                i,
            )
        });
        // the second of a pair placed back to back goes with its first
        let partner = |i: usize| -> Option<usize> {
            let b = &plan.buffers[i];
            let (_, second) = TOGETHER.iter().find(|(f, _)| *f == b.role)?;
            members
                .iter()
                .copied()
                .find(|&j| plan.buffers[j].role == *second && plan.buffers[j].gpu == b.gpu)
        };
        let pairs: Vec<(usize, Option<usize>)> = members.iter().map(|&i| (i, partner(i))).collect();
        let seconds: Vec<usize> = pairs.iter().filter_map(|p| p.1).collect();
        let mut placed: Vec<usize> = Vec::new();
        for &(i, second) in pairs.iter().filter(|(i, _)| !seconds.contains(i)) {
            let lts: Vec<Lifetime> = std::iter::once(i)
                .chain(second)
                .map(|k| plan.buffers[k].lifetime)
                .collect();
            // the second starts where the first ends, aligned
            let first = align_up(plan.buffers[i].bytes);
            let bytes = match second {
                Some(p) => first + plan.buffers[p].bytes,
                None => plan.buffers[i].bytes,
            };
            let mut busy: Vec<(u64, u64)> = placed
                .iter()
                .filter(|&&j| {
                    lts.iter()
                        .any(|&lt| !ordered(&hb, lt, plan.buffers[j].lifetime))
                })
                .map(|&j| {
                    (
                        plan.buffers[j].offset,
                        plan.buffers[j].offset + plan.buffers[j].bytes,
                    )
                })
                .collect();
            busy.sort_unstable();
            let mut off = 0u64;
            for (s, e) in busy {
                if off + bytes <= s {
                    break;
                }
                off = off.max(align_up(e));
            }
            plan.buffers[i].offset = off;
            a.bytes = a.bytes.max(off + bytes);
            placed.push(i);
            if let Some(p) = second {
                plan.buffers[p].offset = off + first;
                placed.push(p);
            }
        }
    }

    // Peaks.
    let budget = plan.spec.schedule.memory_budget;
    let mut gpus = Vec::new();
    let mut over = None;
    for g in &plan.gpus {
        let dev = arenas
            .iter()
            .filter(|a| a.gpu == g.id && a.kind == ArenaKind::Device)
            .map(|a| a.bytes)
            .sum::<u64>();
        let host = arenas
            .iter()
            .filter(|a| a.gpu == g.id && a.kind == ArenaKind::Host)
            .map(|a| a.bytes)
            .sum::<u64>();
        let dev_bufs: Vec<usize> = (0..nb)
            .filter(|&i| plan.buffers[i].gpu == g.id && !is_host(&plan.buffers[i]))
            .collect();
        let mut best = (0u64, TaskId(0));
        for t in plan.tasks.iter().filter(|t| t.gpu == g.id) {
            let live: u64 = dev_bufs
                .iter()
                .filter(|&&i| alive_at(&hb, plan.buffers[i].lifetime, t.id))
                .map(|&i| plan.buffers[i].bytes)
                .sum();
            if live > best.0 {
                best = (live, t.id);
            }
        }
        if dev > budget && over.is_none() {
            let mut largest: Vec<(String, u64)> = dev_bufs
                .iter()
                .filter(|&&i| alive_at(&hb, plan.buffers[i].lifetime, best.1))
                .map(|&i| (plan.buffers[i].name.clone(), plan.buffers[i].bytes))
                .collect();
            largest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            largest.truncate(5);
            over = Some(OverBudget {
                gpu: g.id,
                peak: dev,
                budget,
                largest,
                at: best.1,
            });
        }
        gpus.push(GpuMemory {
            gpu: g.id,
            budget,
            peak: dev,
            live_peak: best.0,
            live_peak_at: best.1,
            host,
        });
    }
    plan.memory.arenas = arenas;
    plan.memory.gpus = gpus;
    match over {
        Some(o) => Err(o),
        None => Ok(()),
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

fn alive_at(hb: &HappensBefore, lt: Lifetime, t: TaskId) -> bool {
    match lt {
        Lifetime::Persistent => true,
        Lifetime::Tasks { first, last } => {
            hb.before_or_same(first, t) && hb.before_or_same(t, last)
        }
    }
}
