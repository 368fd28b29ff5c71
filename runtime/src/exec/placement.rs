//! Which of a plan's buffers the CUDA executor places at the plan's offsets, and the regions of
//! the plan's device arena they make ([`crate::gpu::arena`] has the mechanism).
//!
//! Placed: the loop-carried state (actor and reference weights, fp32 master weights, Adam
//! moments), each step's gradient sums, and the iteration's kept data (media embeddings, the
//! decode KV arena over `kv.prompt` and `kv.response`, the reference's and the old policy's
//! prefix KV, the kept prompt forwards for training with a trained tower's kept inputs).
//!
//! Moved: loop-carried state the plan keeps on the host between its uses (reference weights,
//! optimizer state) is placed at its device buffer's offsets like the rest, and has a pinned
//! host image besides ([`HostImage`], filled from the device once the models are built or
//! restored): the plan's `Reload` copies the image into the buffer's range and `Offload` copies
//! the range back, on the plan's copy stream and in its order. Between them the plan lays
//! other buffers over that range.
//!
//! Streamed: a plan that streams the optimizer state (`Plan::optimizer_stream`) has its
//! `master_weights` / `adam_moments` hold only the staging slots; the trainer keeps the state
//! in pinned host images and allocates its own staging (`gpu::train::stream`).
//!
//! From the memory pool instead: the working
//! sets inside a task (the plan's `scratch.*`), small per-group tables (last-prompt logits,
//! rope tables), and what the plan keeps elsewhere:
//! - a kept prefix state the plan moves to host memory in chunks (the CUDA executor keeps it
//!   on the device, so its range would be reused under it; its `Offload` / `Reload` tasks move
//!   nothing);
//! - `vision_emb` of a plan with old-log-prob prefixes when the tower or merger trains: such a
//!   prefix reuses the rollout's embeddings where the plan encodes its own, a read the plan's
//!   lifetimes do not see;
//! - `train_prefix.sS` of a plan of several optimizer steps: the runtime keeps one store for
//!   every step's groups, alive until the last step's micro-batches, where the plan may reuse
//!   an earlier step's range.
//!
//! [`layout`] is pure; [`PlanArena`] allocates it on a GPU.

use std::collections::BTreeMap;
use std::sync::Arc;

use rollplex_kernels::cuda::CudaStream;
use rollplex_plan::plan::{ArenaKind, BufferRole, Lifetime, Op, Residency};
use rollplex_plan::{BufferId, GpuId, Plan};

use super::ExecError;
use crate::gpu::arena::{DeviceArena, HostImage, Region, RegionUsage};
use rollplex_kernels::cuda::Gpu;

/// What the runtime keeps in a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    ActorWeights,
    RefWeights,
    Masters,
    Moments,
    /// Gradient sums of optimizer step `S` (`grads.sS`).
    Grads(u32),
    Media,
    DecodeKv,
    RefPrefixes,
    OldPrefixes,
    TrainPrefixes,
}

impl Role {
    /// The region of a plan buffer of `role` (`None`: left to the pool).
    pub fn of(role: BufferRole) -> Option<Role> {
        Some(match role {
            BufferRole::ActorWeights => Role::ActorWeights,
            BufferRole::RefWeights => Role::RefWeights,
            BufferRole::MasterWeights => Role::Masters,
            BufferRole::AdamMoments => Role::Moments,
            BufferRole::Grads { step } => Role::Grads(step),
            BufferRole::MediaEmbeddings => Role::Media,
            BufferRole::KvPrompt | BufferRole::KvResponse => Role::DecodeKv,
            BufferRole::RefPrefixKv => Role::RefPrefixes,
            BufferRole::OldPrefixKv => Role::OldPrefixes,
            BufferRole::TrainPrefix { .. } => Role::TrainPrefixes,
            BufferRole::RolloutWeights
            | BufferRole::FrozenRolloutWeights
            | BufferRole::TrainMediaEmbeddings
            | BufferRole::Samples
            | BufferRole::TrainSamples
            | BufferRole::RefLogProbs
            | BufferRole::OldLogProbs
            | BufferRole::Scalars
            | BufferRole::KeptChunk
            | BufferRole::HostCopy
            | BufferRole::Scratch => return None,
        })
    }

    /// Whether the region holds state that lives across iterations (never reset).
    pub fn loop_carried(self) -> bool {
        matches!(
            self,
            Role::ActorWeights | Role::RefWeights | Role::Masters | Role::Moments
        )
    }

    /// Whether the region holds one iteration's data (reset as each iteration starts).
    pub fn per_iteration(self) -> bool {
        matches!(
            self,
            Role::Media
                | Role::DecodeKv
                | Role::RefPrefixes
                | Role::OldPrefixes
                | Role::TrainPrefixes
        )
    }
}

/// The placement of one GPU program's buffers: its device arena's size, each role's byte
/// ranges, and the buffers left to the pool with the reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub arena_bytes: u64,
    pub regions: BTreeMap<Role, Vec<(u64, u64)>>,
    /// The placed buffers that `Reload` / `Offload` tasks move: `(buffer, offset, bytes)`.
    pub moved: Vec<(BufferId, u64, u64)>,
    pub unplaced: Vec<(String, &'static str)>,
}

/// The placement of `program`'s buffers in its device arena (see the module docs).
pub fn layout(plan: &Plan, program: GpuId) -> Layout {
    let Some(arena) = plan
        .memory
        .arenas
        .iter()
        .find(|a| a.gpu == program && a.kind == ArenaKind::Device)
    else {
        return Layout::default();
    };
    let trains_vision = !(plan.spec.train.freeze_vision && plan.spec.train.freeze_merger);
    // with the tower trained, the plan has an old-log-prob prefix encode its own media, where
    // the executor reuses the rollout's (the same weights and bits): a read of `vision_emb` its
    // plan lifetime does not cover
    let old_prefixes = plan.tasks.iter().any(|t| {
        t.gpu == program
            && matches!(
                t.op,
                rollplex_plan::Op::ActorPrefix {
                    purpose: rollplex_plan::Purpose::OldLogProb,
                    ..
                }
            )
    });
    let mine = |b: &&rollplex_plan::plan::Buffer| b.gpu == program && b.arena == arena.id;
    let train_prefix_steps = plan
        .buffers
        .iter()
        .filter(mine)
        .filter(|b| Role::of(b.role) == Some(Role::TrainPrefixes))
        .count();
    // device buffers a `Reload` fills from their host copies
    let reloaded: Vec<BufferId> = plan
        .tasks
        .iter()
        .filter(|t| t.gpu == program)
        .filter_map(|t| match t.op {
            Op::Reload { to, .. } => Some(to),
            _ => None,
        })
        .collect();
    let mut out = Layout {
        arena_bytes: arena.bytes,
        ..Layout::default()
    };
    for b in plan.buffers.iter().filter(mine) {
        let Some(role) = Role::of(b.role) else {
            continue;
        };
        if role.loop_carried() && reloaded.contains(&b.id) {
            // on the device from its reload to its last use (or offload): the executor moves it
            out.moved.push((b.id, b.offset, b.bytes));
            out.regions
                .entry(role)
                .or_default()
                .push((b.offset, b.bytes));
            continue;
        }
        let streamed = plan
            .optimizer_stream
            .as_ref()
            .is_some_and(|st| st.gpu == program);
        let why = if streamed && matches!(role, Role::Masters | Role::Moments) {
            // the state lives in the trainer's pinned host images; these are the staging slots
            Some("staging of the streamed optimizer step (the trainer's own)")
        } else if b.residency.iter().any(|r| r.residency == Residency::Host) {
            Some("offloaded to host memory in a phase")
        } else if role == Role::Media && trains_vision && old_prefixes {
            Some("read past its plan lifetime by old-log-prob prefixes when the tower trains")
        } else if role == Role::TrainPrefixes && train_prefix_steps > 1 {
            // each step's range may be reused once its micro-batches are done, while the one
            // store still holds the later steps' groups
            Some("one store for every step's groups, where the plan has one buffer per step")
        } else if role.loop_carried() != matches!(b.lifetime, Lifetime::Persistent) {
            Some("lifetime not the one its runtime state has")
        } else {
            None
        };
        match why {
            Some(w) => out.unplaced.push((b.name.clone(), w)),
            None => out
                .regions
                .entry(role)
                .or_default()
                .push((b.offset, b.bytes)),
        }
    }
    out
}

/// A plan's device arena allocated on the GPU, with its regions.
pub struct PlanArena {
    layout: Layout,
    arena: Arc<DeviceArena>,
    regions: BTreeMap<Role, Arc<Region>>,
    /// The host image of each moved buffer, with its offset.
    images: BTreeMap<BufferId, (u64, HostImage)>,
}

impl PlanArena {
    /// Allocates the device arena of `plan`'s first GPU program (none when it has no device
    /// arena).
    pub fn new(plan: &Plan, gpu: &Gpu) -> Result<Option<Self>, ExecError> {
        let Some(program) = plan.gpus.first().map(|g| g.id) else {
            return Ok(None);
        };
        let layout = layout(plan, program);
        if layout.arena_bytes == 0 {
            return Ok(None);
        }
        let used: Vec<(u64, u64)> = layout.regions.values().flatten().copied().collect();
        let arena = DeviceArena::new(gpu, layout.arena_bytes, &used).map_err(|e| {
            ExecError::Machine(format!(
                "allocating the plan's device arena of {:.2} GiB: {e}",
                layout.arena_bytes as f64 / (1u64 << 30) as f64
            ))
        })?;
        let mut regions = BTreeMap::new();
        for (role, ranges) in &layout.regions {
            let name = format!("{role:?}");
            let r = Region::new(arena.clone(), name, ranges.clone()).map_err(ExecError::Plan)?;
            regions.insert(*role, Arc::new(r));
        }
        let mut images = BTreeMap::new();
        for &(id, offset, bytes) in &layout.moved {
            let image = HostImage::new(gpu, bytes as usize).map_err(|e| {
                ExecError::Machine(format!(
                    "allocating {:.2} GiB of pinned host memory for the plan's host copy of \
                     buffer {id}: {e}",
                    bytes as f64 / (1u64 << 30) as f64
                ))
            })?;
            images.insert(id, (offset, image));
        }
        Ok(Some(PlanArena {
            layout,
            arena,
            regions,
            images,
        }))
    }

    /// Fills every moved buffer's host image from its device range (the models just built or
    /// restored there); returns when the copies are done.
    pub fn capture(&self, stream: &CudaStream) -> Result<(), ExecError> {
        for (offset, image) in self.images.values() {
            self.arena.copy_to_host(stream, *offset, image)?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// The tasks of `plan` whose `Reload` / `Offload` moves data with this arena (those of a
    /// moved buffer, [`PlanArena::transfer`]): what a profile measures the host link by.
    pub fn copying_tasks(&self, plan: &Plan) -> Vec<rollplex_plan::TaskId> {
        plan.tasks
            .iter()
            .filter(|t| match t.op {
                Op::Reload { to: b, .. } | Op::Offload { from: b, .. } => {
                    self.images.contains_key(&b)
                }
                _ => false,
            })
            .map(|t| t.id)
            .collect()
    }

    /// Queues on `stream` what `op` moves when it is a `Reload` (host image -> device range)
    /// or an `Offload` (device range -> host image) of a moved buffer; `false` when it moves
    /// none (a kept prefix chunk, which stays on the device).
    pub fn transfer(&self, stream: &CudaStream, op: &Op) -> Result<bool, ExecError> {
        let (buffer, to_device) = match *op {
            Op::Reload { to, .. } => (to, true),
            Op::Offload { from, .. } => (from, false),
            _ => return Ok(false),
        };
        let Some((offset, image)) = self.images.get(&buffer) else {
            return Ok(false);
        };
        if to_device {
            self.arena.copy_from_host(stream, *offset, image)?;
        } else {
            self.arena.copy_to_host(stream, *offset, image)?;
        }
        Ok(true)
    }

    /// Bytes of pinned host memory holding moved buffers.
    pub fn host_bytes(&self) -> u64 {
        self.images.values().map(|(_, i)| i.bytes() as u64).sum()
    }

    /// Whether this arena was laid out for `plan` (the same arena size and regions).
    pub fn fits(&self, plan: &Plan) -> bool {
        plan.gpus
            .first()
            .is_some_and(|g| layout(plan, g.id) == self.layout)
    }

    pub fn region(&self, role: Role) -> Option<&Arc<Region>> {
        self.regions.get(&role)
    }

    /// A new iteration: its regions' earlier contents are dead.
    pub fn reset_iteration(&self) {
        for (_, r) in self.regions.iter().filter(|(k, _)| k.per_iteration()) {
            r.reset();
        }
    }

    pub fn bytes(&self) -> u64 {
        self.arena.bytes()
    }

    /// Device memory mapped under the arena (the placed buffers' ranges).
    pub fn mapped(&self) -> u64 {
        self.arena.mapped()
    }

    /// Each region's use so far.
    pub fn usage(&self) -> Vec<RegionUsage> {
        self.regions.values().map(|r| r.usage()).collect()
    }

    /// One line per region: capacity, peak, what spilled to the pool; then what was left to
    /// the pool and why.
    pub fn report(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let mut s = format!(
            "plan arena: {:.1} MiB of address space; {:.1} MiB of device memory mapped once \
             under the placed buffers' ranges (rounded to the allocation granularity; the rest \
             of the arena holds only tasks' working sets, which come from the pool); buffers \
             at the plan's offsets:\n",
            mib(self.bytes()),
            mib(self.mapped())
        );
        for u in self.usage() {
            s += &format!(
                "  {:<14} {:>10.1} MiB, peak {:>10.1} MiB{}\n",
                u.name,
                mib(u.capacity),
                mib(u.peak),
                if u.spills > 0 {
                    format!(
                        ", {} allocations ({:.1} MiB) did not fit: from the pool",
                        u.spills,
                        mib(u.spilled)
                    )
                } else {
                    String::new()
                }
            );
        }
        if !self.images.is_empty() {
            s += &format!(
                "  moved by the plan's reloads and offloads: {} buffers, {:.1} MiB of pinned \
                 host memory\n",
                self.images.len(),
                mib(self.host_bytes())
            );
        }
        for (n, why) in &self.layout.unplaced {
            s += &format!("  {n}: from the pool ({why})\n");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_by_buffer_role() {
        assert_eq!(Role::of(BufferRole::KvPrompt), Some(Role::DecodeKv));
        assert_eq!(Role::of(BufferRole::KvResponse), Some(Role::DecodeKv));
        assert_eq!(
            Role::of(BufferRole::Grads { step: 3 }),
            Some(Role::Grads(3))
        );
        assert_eq!(
            Role::of(BufferRole::TrainPrefix { step: 1 }),
            Some(Role::TrainPrefixes)
        );
        assert_eq!(Role::of(BufferRole::Scratch), None);
        assert_eq!(Role::of(BufferRole::KeptChunk), None);
        assert_eq!(Role::of(BufferRole::Samples), None);
    }
}
