//! Deferred side tasks of decode windows, launched a piece at a time between decode steps.

use std::sync::Arc;
use std::time::Duration;

use rollplex_cost::defaults::kind_name;
use rollplex_kernels::cuda::CudaStream;
use rollplex_plan::plan::{Op, Task};
use rollplex_plan::TaskId;

use super::super::book::range;
use super::super::ExecError;
use super::streams::blocks_host;
use super::GpuIteration;

/// Where the host's time goes in a decode window (`--task-log` prints it per window):
/// launching the sampling and log-prob kernels, waiting for the step's tokens (the device
/// runs the step meanwhile), the bookkeeping and the next step's launches (with the graph
/// captures of batch buckets new to the window's stream, each after one eager step), and
/// launching side pieces. When the wait is near zero the decode loop is bound by the host, not
/// the device.
#[derive(Default)]
pub(super) struct HostSplit {
    pub(super) steps: u32,
    pub(super) pieces: u32,
    pub(super) launch_sample: Duration,
    pub(super) wait: Duration,
    pub(super) launch_decode: Duration,
    pub(super) captures: usize,
    pub(super) launch_side: Duration,
    /// The longest of those side launches (the host holds the decode loop that long).
    pub(super) longest_side: Duration,
}

impl std::fmt::Display for HostSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "{} steps, sample launch {:.1} ms, wait for tokens {:.1} ms, decode launch {:.1} ms \
             ({} graphs captured), {} side pieces launched in {:.1} ms (longest {:.1} ms)",
            self.steps,
            ms(self.launch_sample),
            ms(self.wait),
            ms(self.launch_decode),
            self.captures,
            self.pieces,
            ms(self.launch_side),
            ms(self.longest_side)
        )
    }
}

/// Deferred pieces the decode loop lets run at once (see [`GpuIteration::launch_paced`]). One:
/// a piece (a group's prefix forward, ~450 launches) launched while another still runs fills
/// CUDA's launch queue, and the host then waits in its launches for the side partition to drain
/// the first; the decode stream idles meanwhile. Measured on the H200 (2026-12-01, 16 prompts
/// without dedup, `--task-log`): with two in flight each piece held the decode loop
/// ~37 ms. With one, the side stream idles at most until the end of the running decode step.
pub(super) const PIECES_IN_FLIGHT: usize = 1;

/// A side task of a decode window is deferred ([`DeferQueue`]): the walker reaches a window's
/// side tasks before its decode task, and launching them all at once (a prefix forward is some
/// 450 kernels a group) would hold the host in CUDA's launch queue until the side partition has
/// drained most of them, starting the decode late (measured on the H200: 120-320 ms late per
/// window). The decode loop launches one piece after each step instead, while the device runs
/// the step, when the previous piece is done; what is left goes on to the next window's decode
/// loop, and the first task outside the windows launches the rest. The same calls on the same
/// streams as undeferred: no number changes. This names a piece's stream.
#[derive(Clone)]
pub(super) struct StreamRef(pub(super) Arc<CudaStream>);

impl PartialEq for StreamRef {
    fn eq(&self, other: &Self) -> bool {
        self.0.cu_stream() == other.0.cu_stream()
    }
}

/// A deferred task's unit of launching.
pub(super) enum Piece {
    /// One group of a per-group prefix op.
    Group(Op, usize),
    /// The whole op.
    Whole(Op),
}

impl GpuIteration<'_, '_> {
    /// Whether `task` is a side task of a decode window whose launches wait for the window's
    /// decode loop (see [`DeferQueue`]).
    pub(super) fn defers(&self, task: &Task) -> bool {
        let Some(w) = task.window else { return false };
        let decode = self.plan.windows.get(w.index()).map(|w| w.decode_stream);
        decode != Some(task.stream) && !blocks_host(&task.op)
    }

    /// The pieces a deferred task launches in: one per group for the per-group prefix
    /// forwards (each one device call already), the whole op otherwise.
    pub(super) fn pieces_of(&self, op: &Op) -> Result<Vec<Piece>, ExecError> {
        Ok(match op {
            Op::RefPrefix { groups, .. } => range(*groups)
                .map(|g| Piece::Group(op.clone(), g))
                .collect(),
            Op::ActorPrefix { groups, .. } => self
                .book
                .groups_of(groups)?
                .into_iter()
                .map(|g| Piece::Group(op.clone(), g))
                .collect(),
            _ => vec![Piece::Whole(op.clone())],
        })
    }

    /// From the decode loop: the next deferred piece, if fewer than [`PIECES_IN_FLIGHT`]
    /// launched pieces are still running (more would fill CUDA's launch queue, and the host
    /// would wait in a launch instead of issuing the next decode step).
    /// Returns how many pieces it launched (0 or 1).
    pub(super) fn launch_paced(&mut self) -> Result<u32, ExecError> {
        while let Some(e) = self.inflight.front() {
            if e.try_is_complete()? {
                self.inflight.pop_front();
            } else {
                break;
            }
        }
        if self.inflight.len() < PIECES_IN_FLIGHT && !self.deferred.is_empty() {
            self.launch_deferred(1)?;
            return Ok(1);
        }
        Ok(0)
    }

    /// Launches up to `count` pieces of the deferred side tasks, oldest first; a task gets its
    /// start event before its first piece and its end event after its last (its dependents may
    /// then run).
    pub(super) fn launch_deferred(&mut self, count: usize) -> Result<(), ExecError> {
        for _ in 0..count {
            let Some(x) = self.deferred.take() else {
                break;
            };
            let s = x.stream.0;
            if x.first {
                let e = self.models.gpu.timing_event()?;
                e.record(&s)?;
                self.deferred_start[x.task.index()] = Some(e);
            }
            // its launches count as its kind's in the kernel timing table, not the window's
            let kind = self.plan.tasks[x.task.index()].kind;
            let outer = (self.models.gpu).set_kernel_scope(Some(kind_name(kind)));
            let ran = match &x.piece {
                Some(Piece::Group(op, g)) => self.run_group_piece(&s, op, *g),
                Some(Piece::Whole(op)) => self.run_op(&s, op),
                None => Ok(()),
            };
            self.models.gpu.set_kernel_scope(outer.as_deref());
            ran?;
            let done = self.models.gpu.event()?;
            done.record(&s)?;
            self.inflight.push_back(done);
            if x.last {
                let start = self.deferred_start[x.task.index()].take().ok_or_else(|| {
                    ExecError::Plan(format!("{}: deferred without a start", x.task))
                })?;
                let end = self.models.gpu.timing_event()?;
                end.record(&s)?;
                self.events[x.task.index()] = Some((start, end, s));
            }
        }
        Ok(())
    }

    /// Launches deferred pieces, oldest first, until none of the tasks `ids` is deferred any
    /// more (their end events exist, so a task that waits on one of them can run).
    pub(super) fn flush_deferred_for(&mut self, ids: &[TaskId]) -> Result<(), ExecError> {
        while ids.iter().any(|&id| self.deferred.contains(id)) {
            self.launch_deferred(1)?;
        }
        Ok(())
    }

    /// Launches everything still deferred (the walk is over).
    pub fn flush_deferred(&mut self) -> Result<(), ExecError> {
        self.launch_deferred(usize::MAX)
    }
}
