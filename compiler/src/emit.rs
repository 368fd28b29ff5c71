//! Emission: a [`Sched`] becomes a [`Plan`] with typed ids, the prediction summary and the
//! reshard records. Buffers leave here without placement; [`crate::memory`] gives them
//! lifetimes, arenas and offsets.
//!
//! Tasks and streams keep their schedule index as their plan id ([`crate::ir::STaskId`] `i`
//! becomes `TaskId` `i`); buffers are renumbered, since unused ones are dropped.
//!
//! Invariants: buffers nothing uses and that do not persist are dropped; every task's
//! transient working set becomes a `scratch.<task>` buffer used by that task alone; times are
//! rounded to the microsecond (monotone, so the order of times is kept).

use crate::ir::{PBufId, PhaseGraph, Sched};
use rollplex_cost::CostModel;
use rollplex_plan::{
    Buffer, BufferClass, BufferId, BufferRole, Gpu, Lifetime, Memory, Op, Phase, PhaseResidency,
    PhaseTime, Plan, Predicted, Reshard, ReshardWhat, SolverStats, Stream, StreamId, Target, Task,
    TaskId, Window, WindowId,
};

/// Rounds seconds to the microsecond.
pub fn round_s(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

pub fn emit(pg: &PhaseGraph, s: &Sched, cost: &CostModel, solver: SolverStats) -> Plan {
    let gpu = &pg.spec.cluster.gpu;
    let total = gpu.sms;
    // Buffers: keep used or persistent ones, then one scratch buffer per task that needs one.
    let mut used = vec![false; s.buffers.len()];
    for t in &s.tasks {
        for &b in t.reads.iter().chain(&t.writes) {
            used[b.index()] = true;
        }
        if let Op::Offload { from, to } | Op::Reload { from, to } = &t.op {
            used[PBufId::of_op(*from).index()] = true;
            used[PBufId::of_op(*to).index()] = true;
        }
    }
    let mut remap = vec![None; s.buffers.len()];
    let mut buffers: Vec<Buffer> = Vec::new();
    for (i, b) in s.buffers.iter().enumerate() {
        if !(used[i] || b.persistent) {
            continue;
        }
        let id = BufferId::from_index(buffers.len());
        remap[i] = Some(id);
        buffers.push(Buffer {
            id,
            name: b.name.clone(),
            role: b.role,
            class: b.class,
            gpu: b.gpu,
            bytes: b.bytes,
            shape: b.shape.clone(),
            // Placeholder for non-persistent buffers: memory.rs derives the real lifetime.
            lifetime: if b.persistent {
                Lifetime::Persistent
            } else {
                Lifetime::Tasks {
                    first: TaskId(0),
                    last: TaskId(0),
                }
            },
            residency: b
                .residency
                .iter()
                .map(|&(phase, residency)| PhaseResidency { phase, residency })
                .collect(),
            arena: rollplex_plan::ArenaId(0),
            offset: 0,
        });
    }
    let map = |b: PBufId| remap[b.index()].expect("used buffers are kept");
    let mut tasks: Vec<Task> = Vec::with_capacity(s.tasks.len());
    for (i, t) in s.tasks.iter().enumerate() {
        let id = TaskId::from_index(i);
        let mut writes: Vec<BufferId> = t.writes.iter().map(|&b| map(b)).collect();
        if t.scratch > 0 {
            let sid = BufferId::from_index(buffers.len());
            buffers.push(Buffer {
                id: sid,
                name: format!("scratch.{}", t.name),
                role: BufferRole::Scratch,
                class: BufferClass::Scratch,
                gpu: t.gpu,
                bytes: t.scratch,
                shape: "transient working set".into(),
                lifetime: Lifetime::Tasks {
                    first: id,
                    last: id,
                },
                residency: Phase::ALL
                    .iter()
                    .map(|&phase| PhaseResidency {
                        phase,
                        residency: if phase == t.phase {
                            rollplex_plan::Residency::Hbm
                        } else {
                            rollplex_plan::Residency::Absent
                        },
                    })
                    .collect(),
                arena: rollplex_plan::ArenaId(0),
                offset: 0,
            });
            writes.push(sid);
        }
        let op = match &t.op {
            Op::Offload { from, to } => Op::Offload {
                from: map(PBufId::of_op(*from)),
                to: map(PBufId::of_op(*to)),
            },
            Op::Reload { from, to } => Op::Reload {
                from: map(PBufId::of_op(*from)),
                to: map(PBufId::of_op(*to)),
            },
            o => o.clone(),
        };
        tasks.push(Task {
            id,
            name: t.name.clone(),
            kind: t.kind,
            op,
            gpu: t.gpu,
            stream: StreamId(t.stream.0),
            window: t.window.map(WindowId),
            deps: t.deps.iter().map(|&d| TaskId(d.0)).collect(),
            reads: t.reads.iter().map(|&b| map(b)).collect(),
            writes,
            work: t.work.clone(),
            sms: t.sms,
            start_s: round_s(t.start),
            end_s: round_s(t.end),
        });
    }
    let streams = s
        .streams
        .iter()
        .enumerate()
        .map(|(i, st)| Stream {
            id: StreamId::from_index(i),
            gpu: st.gpu,
            name: st.name.to_string(),
            priority: st.priority,
            sms: total,
        })
        .collect();
    let windows = s
        .windows
        .iter()
        .enumerate()
        .map(|(i, w)| Window {
            id: WindowId::from_index(i),
            gpu: w.gpu,
            first_step: w.first_step,
            steps: w.steps,
            decode_stream: StreamId(w.decode_stream.0),
            side_stream: StreamId(w.side_stream.0),
            decode_sms: w.decode_sms,
            side_sms: w.side_sms,
            expected_active: (w.expected_active * 100.0).round() / 100.0,
            expected_groups_done: w.expected_groups_done,
            start_s: round_s(w.start),
            end_s: round_s(w.end),
        })
        .collect();
    let mut reshards = Vec::new();
    let par = &pg.topo.parallel;
    for t in &tasks {
        let (what, from_tp, to_tp) = match t.op {
            Op::WeightSync { from_tp, to_tp } => (ReshardWhat::Weights, from_tp, to_tp),
            Op::Reshard {
                what,
                from_tp,
                to_tp,
            } => (what, from_tp, to_tp),
            _ => continue,
        };
        let (moved, aliased) = match (what, &pg.sharing) {
            (ReshardWhat::Weights, Some(sh)) => (
                sh.resharded_bytes
                    + if s.frozen_rebuilt {
                        sh.extra_bytes - sh.resharded_bytes
                    } else {
                        0
                    },
                sh.aliased_bytes,
            ),
            (ReshardWhat::Weights, None) => (
                crate::lower::disaggregated_sync_bytes(&pg.shapes, par.rollout_tp),
                0,
            ),
            (ReshardWhat::Embeddings, _) => (
                crate::lower::embed_gather_bytes(&pg.spec, &pg.shapes, par),
                0,
            ),
            (ReshardWhat::Samples, _) => (0, 0),
        };
        reshards.push(Reshard {
            task: t.id,
            what,
            from_tp,
            to_tp,
            bytes_moved: moved,
            bytes_aliased: aliased,
        });
    }
    let mut phases = Vec::new();
    for ph in Phase::ALL {
        let ts: Vec<&Task> = tasks
            .iter()
            .filter(|t| s.tasks[t.id.index()].phase == ph)
            .collect();
        if ts.is_empty() {
            continue;
        }
        let a = ts.iter().map(|t| t.start_s).fold(f64::INFINITY, f64::min);
        let b = ts.iter().map(|t| t.end_s).fold(0.0, f64::max);
        phases.push(PhaseTime {
            phase: ph,
            start_s: a,
            end_s: b,
        });
    }
    let hidden: f64 = s
        .tasks
        .iter()
        .filter(|t| t.window.is_some() && !matches!(t.op, Op::DecodeWindow { .. }))
        .map(|t| cost.time_dir(t.kind, &t.work, total, t.op.host_dir()))
        .fold(0.0, |a, b| a + b);
    Plan {
        target: Target {
            gpu: gpu.name.clone(),
            count: pg.spec.cluster.count,
            hbm_bytes: gpu.hbm_bytes,
            sms: gpu.sms,
            sm_granularity: gpu.sm_granularity,
        },
        mode: pg.topo.mode,
        parallel: pg.topo.parallel.clone(),
        old_logprobs: pg.topo.batch.old_logprobs,
        train_prefix: pg.topo.batch.train_prefix,
        kept_act_layers: pg.kept.suffix,
        kept_prompt_layers: pg.kept.prompt,
        predicted: Predicted {
            iteration_s: round_s(s.makespan()),
            phases,
            hidden_s: round_s(hidden),
        },
        solver,
        gpus: pg
            .topo
            .gpus
            .iter()
            .map(|g| Gpu {
                id: g.id,
                role: g.role,
                first_rank: g.first_rank,
                ranks: g.ranks,
            })
            .collect::<Vec<Gpu>>(),
        streams,
        windows,
        tasks,
        buffers,
        reshards,
        weight_sharing: pg.sharing.clone().map(|mut w| {
            w.frozen_rebuilt = s.frozen_rebuilt;
            w.reshard_point = s.reshard_point.unwrap_or_default();
            w
        }),
        optimizer_stream: s.optimizer_stream.clone(),
        memory: Memory {
            arenas: Vec::new(),
            gpus: Vec::new(),
        },
        spec: pg.spec.clone(),
    }
}
