//! Iteration state that follows plan buffers whose lifetimes end before the iteration does.

use std::sync::Arc;

use rollplex_kernels::cuda::CudaStream;
use rollplex_plan::plan::{Lifetime, Op, Plan, Purpose};
use rollplex_plan::TaskId;

use super::super::placement::Role;
use super::super::ExecError;
use super::GpuIteration;

/// Iteration state that follows plan buffers whose lifetimes end before the iteration does:
/// dropped once the last task of those buffers is launched (its streams waiting on that task's
/// end event first), so the pool's high-water mark follows the plan's lifetimes instead of
/// holding every iteration buffer to the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Held {
    /// `kv.prompt`, `kv.response`: the decode KV arena and the logits (the prefill states go
    /// once the arena holds their KV).
    DecodeKv,
    /// `vision_emb`: the rollout's media embeddings.
    Media,
    /// `ref_prefix_kv`: the reference's prefix states.
    RefPrefixes,
    /// `old_prefix_kv`: the actor's prefix states for old log-probs.
    OldPrefixes,
    /// `train_prefix.sS` (every step's: one store serves them all): the kept prompt forwards.
    TrainPrefixes,
}

impl Held {
    pub(super) const ALL: [Held; 5] = [
        Held::DecodeKv,
        Held::Media,
        Held::RefPrefixes,
        Held::OldPrefixes,
        Held::TrainPrefixes,
    ];

    /// The held state of a plan buffer of `role`: that of its per-iteration [`Role`].
    pub(super) fn of(role: rollplex_plan::BufferRole) -> Option<Held> {
        Some(match Role::of(role)? {
            Role::DecodeKv => Held::DecodeKv,
            Role::Media => Held::Media,
            Role::RefPrefixes => Held::RefPrefixes,
            Role::OldPrefixes => Held::OldPrefixes,
            Role::TrainPrefixes => Held::TrainPrefixes,
            Role::ActorWeights
            | Role::RefWeights
            | Role::Masters
            | Role::Moments
            | Role::Grads(_) => return None,
        })
    }

    /// What running `op` allocates of the iteration's held state.
    pub(super) fn made_by(op: &Op) -> Option<Held> {
        match op {
            Op::EncodeMedia { .. } => Some(Held::Media),
            Op::Prefill { .. } | Op::DecodeWindow { .. } => Some(Held::DecodeKv),
            Op::RefPrefix { .. } => Some(Held::RefPrefixes),
            Op::ActorPrefix {
                purpose: Purpose::OldLogProb,
                ..
            } => Some(Held::OldPrefixes),
            Op::ActorPrefix {
                purpose: Purpose::Train { .. },
                ..
            } => Some(Held::TrainPrefixes),
            _ => None,
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// When each held state may go: the last task (in plan order) of its buffers on `gpu`;
    /// none for a state with a persistent buffer.
    pub(super) fn retirements(plan: &Plan) -> Vec<(TaskId, Held)> {
        let gpu = plan.gpus.first().map(|g| g.id);
        let mut out: Vec<(TaskId, Held)> = Vec::new();
        for h in Held::ALL {
            let mut last: Option<TaskId> = None;
            let mut keep = false;
            for b in plan
                .buffers
                .iter()
                .filter(|b| Some(b.gpu) == gpu && Held::of(b.role) == Some(h))
            {
                match b.lifetime {
                    Lifetime::Tasks { last: l, .. } => last = Some(last.map_or(l, |x| x.max(l))),
                    Lifetime::Persistent => keep = true,
                }
            }
            if let (Some(t), false) = (last, keep) {
                out.push((t, h));
            }
        }
        out.sort_by_key(|&(t, _)| t);
        out
    }
}

impl GpuIteration<'_, '_> {
    /// Notes that `held`'s buffers got memory allocated on `s`.
    pub(super) fn note_made(&mut self, held: Held, s: &Arc<CudaStream>) {
        let on = &mut self.made_on[held.index()];
        if !on.iter().any(|x| x.cu_stream() == s.cu_stream()) {
            on.push(s.clone());
        }
    }

    /// Frees the held state whose buffers' last task has been launched: the streams its memory
    /// was allocated on (where the drops queue the frees) first wait for that task's end.
    pub(super) fn retire_ready(&mut self) -> Result<(), ExecError> {
        while let Some(&(t, held)) = self.retire.first() {
            let Some((_, end, on)) = self.events.get(t.index()).and_then(Option::as_ref) else {
                break;
            };
            crate::gpu::wait_before_free(&self.made_on[held.index()], on, end)?;
            match held {
                Held::DecodeKv => self.arena = None,
                Held::Media => {
                    self.encoded.iter_mut().for_each(|m| *m = None);
                    self.encoded_ready.iter_mut().for_each(|m| *m = None);
                }
                Held::RefPrefixes => self.ref_prefixes.iter_mut().for_each(|p| *p = None),
                Held::OldPrefixes => self.old_prefixes.iter_mut().for_each(|p| *p = None),
                Held::TrainPrefixes => self.train_prefixes = None,
            }
            self.made_on[held.index()].clear();
            self.retire.remove(0);
        }
        Ok(())
    }
}
