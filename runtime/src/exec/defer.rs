//! The bookkeeping of deferred side tasks (pure: no GPU; the CUDA executor's use is in
//! `exec/gpu/`): a decode window's side tasks are queued when the walker runs them and their
//! pieces (one group call each) are launched later, in queue order, between the window's decode
//! steps.
//!
//! Rules, each tested below:
//! - pieces come out in the order tasks were queued, a task's pieces in order; the first piece
//!   of a task says so (its start is recorded then), and so does the last (its end);
//! - a task that is not deferred must have every deferred task it waits for launched first; a
//!   deferred task needs that only for tasks on another stream (on its own stream the queue's
//!   order is the stream's order).
//!
//! Invariant: the queue changes only which host moment a launch happens at, never what is
//! launched or on which stream, so no number depends on it.

use std::collections::VecDeque;

use rollplex_plan::TaskId;

struct Item<P, S> {
    task: TaskId,
    stream: S,
    pieces: VecDeque<P>,
    started: bool,
}

/// A piece taken from the queue.
#[derive(Debug, PartialEq)]
pub struct Taken<P, S> {
    pub task: TaskId,
    pub stream: S,
    pub piece: P,
    /// The task's first piece (record its start before launching it).
    pub first: bool,
    /// The task's last piece (record its end after launching it).
    pub last: bool,
}

/// Deferred tasks, oldest first; `S` names a stream, `P` a piece.
pub struct DeferQueue<P, S> {
    items: VecDeque<Item<P, S>>,
}

impl<P, S> Default for DeferQueue<P, S> {
    fn default() -> Self {
        DeferQueue {
            items: VecDeque::new(),
        }
    }
}

impl<P, S: Clone + PartialEq> DeferQueue<P, S> {
    /// Queues `task`'s pieces, to be launched on `stream` (a task without pieces is queued
    /// too: its one take has no piece to launch, only its start and end).
    pub fn push(&mut self, task: TaskId, stream: S, pieces: impl IntoIterator<Item = P>) {
        self.items.push_back(Item {
            task,
            stream,
            pieces: pieces.into_iter().collect(),
            started: false,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Whether `task` still has pieces to launch.
    pub fn contains(&self, task: TaskId) -> bool {
        self.items.iter().any(|i| i.task == task)
    }

    /// Of the tasks `waits` that a task on `stream` waits for, those that must be launched
    /// before it: every deferred one if the task itself is not deferred, else those deferred on
    /// another stream.
    pub fn launch_first(&self, waits: &[TaskId], stream: &S, deferring: bool) -> Vec<TaskId> {
        waits
            .iter()
            .copied()
            .filter(|&id| {
                self.items
                    .iter()
                    .any(|i| i.task == id && (!deferring || i.stream != *stream))
            })
            .collect()
    }

    /// The next piece in queue order (`None` for a task queued without pieces: then only
    /// `first` and `last` matter), or nothing when the queue is empty.
    pub fn take(&mut self) -> Option<Taken<Option<P>, S>> {
        let item = self.items.front_mut()?;
        let first = !item.started;
        item.started = true;
        let piece = item.pieces.pop_front();
        let last = item.pieces.is_empty();
        let (task, stream) = (item.task, item.stream.clone());
        if last {
            self.items.pop_front();
        }
        Some(Taken {
            task,
            stream,
            piece,
            first,
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(i: u32) -> TaskId {
        TaskId(i)
    }

    #[test]
    fn pieces_come_out_in_queue_order_with_first_and_last_marked() {
        let mut q: DeferQueue<char, u8> = DeferQueue::default();
        q.push(t(3), 1, ['a', 'b']);
        q.push(t(5), 2, ['c']);
        q.push(t(7), 1, []);
        let mut got = Vec::new();
        while let Some(x) = q.take() {
            got.push((x.task, x.stream, x.piece, x.first, x.last));
        }
        assert_eq!(
            got,
            [
                (t(3), 1, Some('a'), true, false),
                (t(3), 1, Some('b'), false, true),
                (t(5), 2, Some('c'), true, true),
                (t(7), 1, None, true, true),
            ]
        );
        assert!(q.is_empty());
    }

    #[test]
    fn a_task_waits_for_deferred_work_unless_both_are_deferred_on_one_stream() {
        let mut q: DeferQueue<char, u8> = DeferQueue::default();
        q.push(t(1), 1, ['a']);
        q.push(t(2), 2, ['b']);
        assert!(q.contains(t(1)) && !q.contains(t(9)));
        let waits = [t(1), t(2), t(9)];
        // not deferred: both deferred dependencies go first, a done one (9) does not matter
        assert_eq!(q.launch_first(&waits, &1, false), [t(1), t(2)]);
        // deferred on stream 1: only the one on stream 2
        assert_eq!(q.launch_first(&waits, &1, true), [t(2)]);
        assert_eq!(q.launch_first(&waits, &2, true), [t(1)]);
        // a partly launched task is still deferred until its last piece
        let mut q: DeferQueue<char, u8> = DeferQueue::default();
        q.push(t(1), 1, ['a', 'b']);
        assert!(q.take().is_some_and(|x| x.first && !x.last));
        assert!(q.contains(t(1)));
        assert!(q.take().is_some_and(|x| x.last));
        assert!(!q.contains(t(1)));
        assert!(q.take().is_none());
    }
}
