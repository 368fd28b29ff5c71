//! Walks one iteration of a plan: every stream runs its tasks in plan order; a task starts when
//! its dependencies have finished and, if it names a completion slot, when that slot is bound
//! (its group has finished decoding). This is the whole of the runtime's scheduling: the plan
//! decided everything else.
//!
//! On a backend that runs one task at a time (cpu), the walker picks, among the streams whose
//! next task is ready, the one whose task comes first in plan order (the cuda backend first
//! ranks tasks by whether the host waits inside them, [`TaskRunner::rank`]). The choice only affects
//! *when* a task runs, never *what* it computes: ops are deterministic functions of their inputs,
//! and slots are bound in an order that depends on the sampled tokens only.
//!
//! Invariant: a plan that passed `rollplex_plan::validate` never deadlocks here; if the walker
//! finds no ready task while tasks remain, it returns an error naming the stuck stream heads
//! instead of spinning.

use rollplex_plan::plan::{Op, Plan, Task};
use rollplex_plan::{StreamId, TaskId};

/// What the walker needs from a backend.
pub trait TaskRunner {
    type Error: From<String>;
    /// Runs one task to completion.
    fn run(&mut self, task: &Task) -> Result<(), Self::Error>;
    /// Completion slots bound so far (slots `0..n` are bound).
    fn slots_bound(&self) -> u32;
    /// Among ready tasks the walker runs one of the lowest rank first (then plan order). A
    /// backend whose host waits inside some tasks ranks them after the others so that the
    /// device has work queued while the host waits; the CPU keeps plan order (rank 0 for all).
    /// Never changes a number: any ready task may run next.
    fn rank(&self, _task: &Task) -> u8 {
        0
    }
}

/// The completion slot a task waits for, if any.
pub fn waits_for_slot(op: &Op) -> Option<u32> {
    match op {
        Op::RefSuffix { slot }
        | Op::ActorSuffix { slot, .. }
        | Op::Reward { slot }
        | Op::Advantages { slot } => Some(*slot),
        Op::ActorPrefix {
            groups: rollplex_plan::Groups::Slots(s),
            ..
        } => s.end.checked_sub(1),
        // counted in samples, see `ready` in `walk`
        Op::TrainMicroBatch { samples, .. } => Some(samples.end.saturating_sub(1)),
        _ => None,
    }
}

/// Runs every task of one GPU program's streams once, in a valid order. `on_task` is called
/// after each task with its id and the order index (for traces and tests).
pub fn walk<R: TaskRunner>(
    plan: &Plan,
    gpu: rollplex_plan::GpuId,
    runner: &mut R,
    on_task: impl FnMut(TaskId, usize),
) -> Result<(), R::Error> {
    let streams: Vec<StreamId> = plan
        .streams
        .iter()
        .filter(|s| s.gpu == gpu)
        .map(|s| s.id)
        .collect();
    walk_streams(plan, &streams, runner, on_task)
}

/// Runs every task of every GPU program once, in a valid order: one host running the programs
/// of a disaggregated plan (rollout GPUs and training GPUs) in turn, a task of one waiting for
/// its dependencies on the other as for any other.
pub fn walk_all<R: TaskRunner>(
    plan: &Plan,
    runner: &mut R,
    on_task: impl FnMut(TaskId, usize),
) -> Result<(), R::Error> {
    let streams: Vec<StreamId> = plan.streams.iter().map(|s| s.id).collect();
    walk_streams(plan, &streams, runner, on_task)
}

fn walk_streams<R: TaskRunner>(
    plan: &Plan,
    streams: &[StreamId],
    runner: &mut R,
    mut on_task: impl FnMut(TaskId, usize),
) -> Result<(), R::Error> {
    let queues: Vec<Vec<&Task>> = streams
        .iter()
        .map(|&s| plan.stream_tasks(s).collect())
        .collect();
    let mut cursor = vec![0usize; queues.len()];
    let mut done = vec![false; plan.tasks.len()];
    let total: usize = queues.iter().map(Vec::len).sum();
    let group_size = plan.spec.rollout.group_size.max(1);
    let mini_batch = plan.spec.train.mini_batch.max(1);
    let ready = |t: &Task, done: &[bool], bound: u32| -> bool {
        t.deps
            .iter()
            .all(|d| done.get(d.index()).copied().unwrap_or(false))
            && match waits_for_slot(&t.op) {
                None => true,
                Some(slot) => match t.op {
                    // Samples count in slot order (sample s is in slot s / G). A micro-batch waits
                    // for its whole mini-batch: the loss is normalised by the mini-batch's tokens.
                    Op::TrainMicroBatch { .. } => {
                        let mb_end = (slot / mini_batch + 1) * mini_batch;
                        (mb_end - 1) / group_size < bound
                    }
                    _ => slot < bound,
                },
            }
    };
    for n in 0..total {
        let bound = runner.slots_bound();
        let next = queues
            .iter()
            .enumerate()
            .filter_map(|(q, tasks)| tasks.get(cursor[q]).map(|t| (q, *t)))
            .filter(|(_, t)| ready(t, &done, bound))
            .min_by_key(|(_, t)| (runner.rank(t), t.id));
        let Some((q, task)) = next else {
            let heads: Vec<String> = queues
                .iter()
                .enumerate()
                .filter_map(|(q, tasks)| {
                    tasks
                        .get(cursor[q])
                        .map(|t| format!("{} ({})", t.name, t.id))
                })
                .collect();
            return Err(R::Error::from(format!(
                "plan cannot make progress: no stream's next task is ready (heads: {}; slots bound: {bound}); \
                 the plan is inconsistent: recompile it",
                heads.join(", ")
            )));
        };
        runner.run(task)?;
        done[task.id.index()] = true;
        cursor[q] += 1;
        on_task(task.id, n);
    }
    Ok(())
}
