//! Every plan op on the CUDA backend: prefix states, the actor's kept prompt forwards, the
//! training micro-batches and the optimizer step, and the dispatch of each op.

use std::sync::Arc;

use rollplex_kernels::cuda::CudaStream;
use rollplex_plan::plan::{Op, Purpose};
use rollplex_plan::Span;

use super::super::book::range;
use super::super::placement::Role;
use super::super::ExecError;
use super::held::Held;
use super::GpuIteration;
use crate::gpu::train::{PrefixedGroup, PromptMedia, TrainPrefixes};
use crate::gpu::GpuEncodedMedia;
use crate::model::MediaInput;

impl GpuIteration<'_, '_> {
    /// One group's share of a per-group prefix op (a deferred task's piece).
    pub(super) fn run_group_piece(
        &mut self,
        s: &Arc<CudaStream>,
        op: &Op,
        g: usize,
    ) -> Result<(), ExecError> {
        if let Some(h) = Held::made_by(op) {
            self.note_made(h, s);
        }
        match op {
            Op::RefPrefix { copies, .. } => self.run_prefix_states(s, &[g], *copies, true),
            Op::ActorPrefix {
                copies, purpose, ..
            } => match purpose {
                Purpose::OldLogProb => self.run_prefix_states(s, &[g], *copies, false),
                Purpose::Train { .. } => self.run_train_prefix(s, &[g], *copies),
            },
            _ => Err(ExecError::Plan(format!("{op:?} has no per-group pieces"))),
        }
    }

    /// Prefix states of `groups` (one device call per group, `copies` in it): the reference's
    /// (`reference`), kept for `RefSuffix`, or the actor's for old log-probs (`ActorSuffix`).
    pub(super) fn run_prefix_states(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
        reference: bool,
    ) -> Result<(), ExecError> {
        let media = if reference {
            self.ref_media(s, groups, copies)?
        } else {
            self.actor_media(s, groups)?
        };
        let region = self.region(if reference {
            Role::RefPrefixes
        } else {
            Role::OldPrefixes
        });
        let model = if reference {
            self.models.reference.as_ref().ok_or_else(no_reference)?
        } else {
            self.models.trainer.model()
        };
        let states = Self::prefill(
            &self.models.gpu,
            s,
            model,
            self.book.prompts,
            groups,
            &media,
            copies,
            region.as_deref(),
        )?;
        let out = if reference {
            &mut self.ref_prefixes
        } else {
            &mut self.old_prefixes
        };
        for (&g, st) in groups.iter().zip(states) {
            out[g] = Some(st);
        }
        Ok(())
    }

    pub(super) fn run_train_micro_batch(
        &mut self,
        s: &Arc<CudaStream>,
        step: u32,
        micro_batch: u32,
        samples: Span,
    ) -> Result<(), ExecError> {
        self.collect_scores()?;
        let mb = self.book.micro_batch("CUDA", step, micro_batch, samples)?;
        let (store, _) = self.train_prefixes.as_ref().ok_or_else(|| {
            ExecError::Plan(format!(
                "micro-batch {micro_batch} of step {step} before any ActorPrefix{{Train}} task \
                 kept its groups' prompt forwards"
            ))
        })?;
        let grads = self.region(Role::Grads(step));
        self.models.trainer.set_grads_region(grads);
        let responses = self.book.batches(&mb);
        let batch: Vec<PrefixedGroup<'_>> = mb
            .groups
            .iter()
            .enumerate()
            .map(|(i, &g)| PrefixedGroup {
                group: g,
                responses: &responses[i],
            })
            .collect();
        // queued: the host goes on to the next task while the device runs it; its results are
        // taken before the optimizer step (`collect_trained`)
        self.models.trainer.queue_micro_batch_prefixed(
            &self.models.gpu,
            s,
            micro_batch,
            &batch,
            mb.norm,
            store,
        )?;
        drop(batch);
        drop(responses);
        self.trained.push((step, mb));
        Ok(())
    }

    /// Brings the queued micro-batches' results (log-probs, loss metrics) to the book, in plan
    /// order (waits for them).
    pub(super) fn collect_trained(&mut self) -> Result<(), ExecError> {
        if self.trained.is_empty() {
            return Ok(());
        }
        let outs = self.models.trainer.finish_queued()?;
        let done = std::mem::take(&mut self.trained);
        if outs.len() != done.len() {
            return Err(ExecError::Plan(format!(
                "{} micro-batches queued but {} results came back",
                done.len(),
                outs.len()
            )));
        }
        for ((step, mb), out) in done.iter().zip(&outs) {
            self.book.micro_batch_done(*step, mb, out);
        }
        Ok(())
    }

    /// `ActorPrefix{Train}`: the actor's prompt forward of `groups` with the current weights,
    /// `copies` per group, kept for the micro-batches (one device call per group).
    pub(super) fn run_train_prefix(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
    ) -> Result<(), ExecError> {
        // a trained tower or merger: the trainer encodes each prompt's media itself, keeping
        // what its backward needs; frozen: the actor's shared encoding
        let trains_vision = self.models.trainer.trains_vision();
        let media = if trains_vision {
            Vec::new()
        } else {
            self.actor_media(s, groups)?
        };
        let copies = copies.max(1);
        if self.train_prefixes.is_none() {
            let lens: Vec<(usize, u32)> = self
                .book
                .prompts
                .iter()
                .map(|p| (p.ids.len(), copies))
                .collect();
            let region = self.region(Role::TrainPrefixes);
            let store = TrainPrefixes::new_in(
                &self.models.gpu,
                s,
                self.models.trainer.model(),
                &lens,
                region,
            )?;
            self.train_prefixes = Some((store, copies));
        }
        let (store, laid_out) = self.train_prefixes.as_mut().expect("made above");
        if *laid_out != copies {
            return Err(ExecError::Plan(format!(
                "ActorPrefix{{Train}} tasks of one iteration keep {laid_out} and {copies} copies \
                 per group"
            )));
        }
        for (i, &g) in groups.iter().enumerate() {
            let prompt = &self.book.prompts[g];
            let (raw, refs): (Vec<MediaInput<'_>>, Vec<&GpuEncodedMedia>);
            let m = if trains_vision {
                raw = Self::media_inputs(prompt);
                PromptMedia::Raw(&raw)
            } else {
                refs = media[i].iter().collect();
                PromptMedia::Encoded(&refs)
            };
            self.models
                .trainer
                .prefix_forward(&self.models.gpu, s, store, g, &prompt.ids, m)?;
        }
        Ok(())
    }

    pub(super) fn run_op(&mut self, s: &Arc<CudaStream>, op: &Op) -> Result<(), ExecError> {
        if let Some(h) = Held::made_by(op) {
            self.note_made(h, s);
        }
        let temp = self.book.temperature();
        match op {
            Op::EncodeMedia { groups, copies } => {
                let groups: Vec<usize> = range(*groups).collect();
                let region = self.region(Role::Media);
                let m = Self::encode(
                    &self.models.gpu,
                    s,
                    self.models.trainer.model(),
                    self.book.prompts,
                    &groups,
                    *copies,
                    region.as_deref(),
                )?;
                let ready = self.models.gpu.event()?;
                ready.record(s)?;
                let ready = Arc::new(ready);
                for (g, m) in groups.into_iter().zip(m) {
                    self.encoded[g] = Some(m);
                    self.encoded_ready[g] = Some((ready.clone(), s.clone()));
                }
            }
            Op::Prefill { groups, copies } => self.run_prefill(s, *groups, *copies)?,
            Op::DecodeWindow {
                first_step,
                steps,
                until_done,
            } => self.run_decode(s, *first_step, *steps, *until_done)?,
            Op::RefPrefix { groups, copies } => {
                let groups: Vec<usize> = range(*groups).collect();
                self.run_prefix_states(s, &groups, *copies, true)?;
            }
            Op::RefSuffix { slot } => {
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.ref_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!("ref suffix of group {g} before its prefix"))
                })?;
                let reference = self.models.reference.as_ref().ok_or_else(no_reference)?;
                let scores = reference.score_on_device(
                    &self.models.gpu,
                    s,
                    prefix,
                    &self.book.responses(g),
                    temp,
                )?;
                self.pending.push((g, true, scores));
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => {
                let groups = self.book.groups_of(groups)?;
                match purpose {
                    Purpose::OldLogProb => self.run_prefix_states(s, &groups, *copies, false)?,
                    Purpose::Train { .. } => self.run_train_prefix(s, &groups, *copies)?,
                }
            }
            Op::ActorSuffix { slot, purpose } => {
                if *purpose != Purpose::OldLogProb {
                    return Err(ExecError::Unsupported(
                        "actor suffix forward for training outside a micro-batch".into(),
                    ));
                }
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.old_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!(
                        "old-log-prob suffix of group {g} before its prefix"
                    ))
                })?;
                let scores = self.models.trainer.model().score_on_device(
                    &self.models.gpu,
                    s,
                    prefix,
                    &self.book.responses(g),
                    temp,
                )?;
                self.pending.push((g, false, scores));
            }
            Op::Reward { slot } => self.book.reward(*slot)?,
            Op::Advantages { slot } => self.book.advantages(*slot)?,
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(s, *step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                self.collect_trained()?;
                let report = self.models.trainer.optimizer_step(&self.models.gpu, s)?;
                self.book.metrics.grad_norm = report.step.grad_norm;
                self.book.metrics.optimizer_steps += 1;
            }
            // One address space, TP 1: the rollout reads the trainer's weights in place.
            Op::WeightSync { .. } | Op::Reshard { .. } => {}
            // state the plan keeps on the host between uses: copied on this (the copy)
            // stream; kept prefix chunks and models built without the plan stay on the device
            Op::Offload { .. } | Op::Reload { .. } => {
                if let Some(a) = &self.models.arena {
                    a.transfer(s, op)?;
                }
            }
        }
        Ok(())
    }
}

pub(super) fn no_reference() -> ExecError {
    ExecError::Plan("the plan scores a reference, but the job has none".into())
}
