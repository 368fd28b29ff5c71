//! Where the loop-carried state a plan moves to host memory is while an iteration runs, and the
//! check that every task reading it runs while it is on the device.
//!
//! A plan may keep the reference weights, or the fp32 masters and Adam moments, on the host
//! between their uses: a `Reload` brings each such buffer to the device before its first user
//! and, for state the iteration writes, an `Offload` writes it back after its last. Every
//! iteration starts with them on the host. Both backends follow the moves task by task in the
//! order they run them (the CUDA executor copying the data, `exec::placement`; the CPU backend,
//! one address space, moving nothing) and refuse a task that reads such state while the plan
//! has it on the host: a plan whose dependencies do not order a user after the reload is
//! caught, on either backend, instead of reading whatever lies in the buffer's range.
//! A plan that streams the optimizer state (`Plan::optimizer_stream`) has no such move for it:
//! its `master_weights` / `adam_moments` are only staging slots the optimizer step fills
//! itself, so they are not followed here.
//! Pure: no device work.

use std::collections::BTreeSet;

use rollplex_plan::plan::{BufferRole, Op, Plan, Residency, Task};
use rollplex_plan::{BufferId, GpuId};

use super::ExecError;

/// The moved buffers of a plan (every GPU program's: buffer ids are the plan's) and which of
/// them are on the device now.
#[derive(Clone, Debug, Default)]
pub struct HostResidency {
    /// `(device buffer, its role, its name)` for each loop-carried buffer on the host in some
    /// phase (what the plan's `Reload` tasks fill).
    moved: Vec<(BufferId, BufferRole, String, GpuId)>,
    on_device: BTreeSet<BufferId>,
}

impl HostResidency {
    /// The loop-carried buffers that `plan` keeps on the host in some phase, all on the host
    /// (an iteration's start).
    pub fn of(plan: &Plan) -> Self {
        let moved = plan
            .buffers
            .iter()
            .filter(|b| {
                matches!(
                    b.role,
                    BufferRole::RefWeights | BufferRole::MasterWeights | BufferRole::AdamMoments
                ) && b.residency.iter().any(|r| r.residency == Residency::Host)
            })
            .map(|b| (b.id, b.role, b.name.clone(), b.gpu))
            .collect();
        HostResidency {
            moved,
            on_device: BTreeSet::new(),
        }
    }

    /// Follows `task`: a reload brings its buffer to the device, an offload takes it back to
    /// the host; a task reading moved state of its GPU program while it is on the host is an
    /// error naming the buffer.
    pub fn step(&mut self, task: &Task) -> Result<(), ExecError> {
        let needs: &[BufferRole] = match &task.op {
            Op::Reload { to, .. } => {
                self.on_device.insert(*to);
                return Ok(());
            }
            Op::Offload { from, .. } => {
                self.on_device.remove(from);
                return Ok(());
            }
            Op::RefPrefix { .. } | Op::RefSuffix { .. } => &[BufferRole::RefWeights],
            Op::OptimizerStep { .. } => &[BufferRole::MasterWeights, BufferRole::AdamMoments],
            _ => return Ok(()),
        };
        match self.moved.iter().find(|(id, role, _, gpu)| {
            *gpu == task.gpu && needs.contains(role) && !self.on_device.contains(id)
        }) {
            Some((_, _, buffer, _)) => Err(ExecError::Plan(format!(
                "task {} reads {buffer} while the plan keeps it on the host: no reload of it \
                 runs before this task",
                task.name
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollplex_plan::work::{Work, WorkKind};
    use rollplex_plan::{Span, StreamId, TaskId};

    fn task(name: &str, op: Op, gpu: u32) -> Task {
        Task {
            id: TaskId::from_index(0),
            name: name.into(),
            kind: WorkKind::Transfer,
            op,
            gpu: GpuId(gpu),
            stream: StreamId::from_index(0),
            window: None,
            deps: vec![],
            reads: vec![],
            writes: vec![],
            work: Work::default(),
            sms: 1,
            start_s: 0.0,
            end_s: 0.0,
        }
    }

    fn moving(moved: &[(usize, BufferRole, &str, u32)]) -> HostResidency {
        HostResidency {
            moved: moved
                .iter()
                .map(|&(i, r, n, g)| (BufferId::from_index(i), r, n.to_string(), GpuId(g)))
                .collect(),
            on_device: BTreeSet::new(),
        }
    }

    #[test]
    fn users_must_run_between_reload_and_offload() {
        let id = BufferId::from_index;
        let mut r = moving(&[
            (1, BufferRole::RefWeights, "ref_weights", 0),
            (3, BufferRole::MasterWeights, "master_weights", 0),
            (5, BufferRole::RefWeights, "ref_weights.r1", 1),
        ]);
        let suffix = task("ref_suffix.slot0", Op::RefSuffix { slot: 0 }, 0);
        let e = r.step(&suffix).unwrap_err().to_string();
        assert!(
            e.contains("ref_weights") && e.contains("ref_suffix.slot0"),
            "{e}"
        );
        let reload = |from, to| Op::Reload {
            from: id(from),
            to: id(to),
        };
        r.step(&task("reload", reload(0, 1), 0)).unwrap();
        // GPU 1's reference is its own program's business
        r.step(&suffix).unwrap();
        assert!(r
            .step(&task("ref_suffix.r1", Op::RefSuffix { slot: 0 }, 1))
            .is_err());
        let optim = task("optim.s0", Op::OptimizerStep { step: 0 }, 0);
        assert!(r.step(&optim).is_err());
        r.step(&task("reload", reload(2, 3), 0)).unwrap();
        r.step(&optim).unwrap();
        let offload = Op::Offload {
            from: id(3),
            to: id(2),
        };
        r.step(&task("offload", offload, 0)).unwrap();
        assert!(r.step(&optim).is_err(), "written back: on the host again");
        // what the plan does not move is never checked
        let prefill = Op::Prefill {
            groups: Span::new(0, 1),
            copies: 1,
        };
        assert!(moving(&[]).step(&task("prefill", prefill, 0)).is_ok());
        assert!(moving(&[]).step(&suffix).is_ok());
    }
}
