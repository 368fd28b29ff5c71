//! The CPU backend: executes each plan op with the CPU model engine (f32), one task at a time,
//! in the order the [`walker`](super::walker) picks.
//!
//! What each op does here (the plan's `Op` docs say what it means):
//! - `EncodeMedia`: vision tower + merger over the groups' media with the actor's weights (the
//!   rollout's); a frozen tower's output is reused by the reference and the actor.
//! - `Prefill`: the groups' prompt prefill with the actor's weights; the prefix KV is copied
//!   once per group into the iteration's KV arena `[group prefixes | sample suffixes]`.
//! - `DecodeWindow`: steps of every unfinished sample; token `s` of a sample is drawn with the
//!   Philox key (seed, iteration, sample, s), so it does not depend on the window split. Groups
//!   that finished in the window are bound to completion slots in (finish step, group) order.
//! - `RefPrefix` / `RefSuffix`: the reference model's prefix state per group, then per-token
//!   log-probs of the slot's responses.
//! - `ActorPrefix{OldLogProb}` / `ActorSuffix`: the same with the actor's rollout weights.
//!   `ActorPrefix{Train}`: on this backend the micro-batch's forward recomputes its prefix (the
//!   forward is deterministic, so the numbers are those of a kept prefix); the task is counted.
//! - `Reward`, `Advantages`: per slot. `TrainMicroBatch`: forward + loss + backward of whole
//!   groups in slot order, accumulated in micro-batch order; `OptimizerStep`: AdamW.
//! - `WeightSync`: colocated, rollout reads the trainer's weights in place (one layout, TP 1):
//!   nothing to copy. Disaggregated (rollout on one GPU program, scoring and training on
//!   another), the rollout's own copy of the actor ([`CpuModels::rollout`]) is replaced by the
//!   trainer's weights: what the training GPUs send the rollout GPUs after each step.
//!   `Reshard`, `Offload`, `Reload`: no data moves in a single address space.
//!
//! The iteration is generic over a [`CpuEngine`]: the model calls an op makes (encode, prefill,
//! score, decode, draw, train, step). [`CpuModels`] is the single-rank engine; one rank of a
//! tensor-parallel group is another ([`super::cpu_tp`]), so both walk the plan with the same
//! code and [`Book`] decides the same stops, slots, rewards and advantages.
//!
//! Invariant: every number this engine produces is a function of (plan spec, seed, iteration,
//! data), never of the order the walker ran tasks in; `tests/tests/serial_overlap.rs` checks
//! serial and overlap plans bitwise.

use rollplex_kernels::cpu::logprobs_fwd;
use rollplex_plan::plan::{Op, Plan, Purpose, Task};
use rollplex_plan::spec::JobSpec;
use rollplex_plan::Span;

use super::book::{range, Book};
use super::walker::TaskRunner;
use super::{ExecError, IterationMetrics, PromptData};
use crate::model::{
    sample_token, DecodeSlot, EncodedMedia, KvArena, KvSpan, MediaInput, PrefixState, Prompt,
    Qwen25VL, SampleKey, SamplingParams,
};
use crate::train::backward::{GroupBatch, MicroBatchOutput, TrainConfig};
use crate::train::loss::Normaliser;
use crate::train::step::Trainer;

/// Scores responses: the reward function the loop was given.
/// Scores the responses of one group (one reward per response, in order).
pub type RewardFn<'a> = dyn FnMut(&PromptData, &[&[u32]]) -> Result<Vec<f32>, ExecError> + 'a;

/// The models and optimizer that live across iterations.
pub struct CpuModels {
    pub trainer: Trainer,
    /// The frozen reference (initial actor weights); `None` when the job scores no reference.
    pub reference: Option<Qwen25VL>,
    /// Disaggregated plans: the rollout GPUs' copy of the actor, which the rollout runs and
    /// each `WeightSync` replaces with the trainer's weights. `None` (colocated): the rollout
    /// reads the trainer's model.
    pub rollout: Option<Qwen25VL>,
}

/// Which of the job's models an engine call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The actor with its current weights (the rollout's, until the iteration's first
    /// optimizer step), as the training GPUs hold it.
    Actor,
    /// The actor as the rollout GPUs hold it: the same model when colocated; in disaggregated
    /// plans their copy, equal to the trainer's weights from each `WeightSync` to the next
    /// optimizer step, which is when the rollout runs.
    Rollout,
    /// The frozen reference.
    Reference,
}

/// The model operations a CPU iteration makes. Logit rows (a prefix state's `last_logits`,
/// what [`CpuEngine::decode_step`] returns, what [`CpuEngine::draw`] reads) are the engine's
/// own: the full vocabulary on one rank, the rank's vocabulary shard under TP.
///
/// Contract: every method is a deterministic function of its arguments and the models' state;
/// an engine that is one rank of a group returns on every rank the same values from every
/// method that returns replicated data (media embeddings, scores, drawn tokens and their
/// log-probs, micro-batch outputs, grad norms), so the host decisions built on them agree.
pub trait CpuEngine {
    /// Whether the job has a reference model.
    fn has_reference(&self) -> bool;
    /// Vision tower + merger over one group's media.
    fn encode(&self, role: Role, media: &[MediaInput<'_>]) -> Result<Vec<EncodedMedia>, ExecError>;
    /// One prompt's prefix state.
    fn prefill(&self, role: Role, prompt: Prompt<'_>) -> Result<PrefixState, ExecError>;
    /// Per-token log-probs of `responses` at `temperature` after a kept prefix.
    fn score(
        &self,
        role: Role,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ExecError>;
    /// A KV arena of `capacity` rows for the actor's decode.
    fn kv_arena(&self, capacity: u32) -> KvArena;
    /// One decode step of the actor (see `Qwen25VL::decode_step`); returns one logit row per
    /// slot, concatenated.
    fn decode_step(
        &self,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ExecError>;
    /// Draws each row's next token with its key and returns it with its log-prob at
    /// `temperature` (the rollout log-prob, bitwise what [`CpuEngine::score`] gives it).
    fn draw(
        &self,
        rows: &[&[f32]],
        keys: &[SampleKey],
        sampling: &SamplingParams,
        temperature: f32,
    ) -> Result<Vec<(u32, f32)>, ExecError>;
    /// Forward, loss and backward of micro-batch `index` (plan order) of the running
    /// mini-batch; its gradient joins the sum.
    fn micro_batch(
        &mut self,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput, ExecError>;
    /// Clip, AdamW, new weights; returns the global grad norm before clipping.
    fn optimizer_step(&mut self) -> Result<f64, ExecError>;
    /// The plan's `WeightSync`: the rollout gets the trainer's weights (nothing to do where
    /// it reads them in place).
    fn weight_sync(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

impl CpuModels {
    fn model(&self, role: Role) -> Result<&Qwen25VL, ExecError> {
        match role {
            Role::Actor => Ok(self.trainer.model()),
            Role::Rollout => Ok(self.rollout_model()),
            Role::Reference => self.reference.as_ref().ok_or_else(no_reference),
        }
    }

    /// The rollout's model (see [`Role::Rollout`]).
    fn rollout_model(&self) -> &Qwen25VL {
        self.rollout.as_ref().unwrap_or(self.trainer.model())
    }
}

pub(crate) fn no_reference() -> ExecError {
    ExecError::Plan("the plan scores a reference, but the job has none".into())
}

impl CpuEngine for CpuModels {
    fn has_reference(&self) -> bool {
        self.reference.is_some()
    }

    fn encode(&self, role: Role, media: &[MediaInput<'_>]) -> Result<Vec<EncodedMedia>, ExecError> {
        Ok(self.model(role)?.encode_media(media, None)?)
    }

    fn prefill(&self, role: Role, prompt: Prompt<'_>) -> Result<PrefixState, ExecError> {
        self.model(role)?
            .prefill(&[prompt], None)?
            .pop()
            .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))
    }

    fn score(
        &self,
        role: Role,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, ExecError> {
        Ok(self
            .model(role)?
            .score(prefix, responses, temperature, None)?
            .into_iter()
            .map(|s| s.logp)
            .collect())
    }

    fn kv_arena(&self, capacity: u32) -> KvArena {
        KvArena::for_model(self.rollout_model(), capacity)
    }

    fn decode_step(
        &self,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ExecError> {
        let model = self.rollout_model();
        let v = model.config.text().vocab_size as usize;
        let mut logits = vec![0f32; slots.len() * v];
        model.decode_step(arena, slots, tokens, &mut logits)?;
        Ok(logits)
    }

    fn draw(
        &self,
        rows: &[&[f32]],
        keys: &[SampleKey],
        sampling: &SamplingParams,
        temperature: f32,
    ) -> Result<Vec<(u32, f32)>, ExecError> {
        let v = self.trainer.model().config.text().vocab_size as usize;
        rows.iter()
            .zip(keys)
            .map(|(row, key)| {
                let tok = sample_token(row, sampling, *key)?;
                let mut lp = [0f32];
                logprobs_fwd(&mut lp, None, None, row, &[tok], 1, v, temperature)?;
                Ok((tok, lp[0]))
            })
            .collect()
    }

    fn micro_batch(
        &mut self,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput, ExecError> {
        Ok(self.trainer.micro_batch(index, groups, norm)?)
    }

    fn optimizer_step(&mut self) -> Result<f64, ExecError> {
        Ok(self.trainer.optimizer_step()?.step.grad_norm)
    }

    fn weight_sync(&mut self) -> Result<(), ExecError> {
        if let Some(r) = &mut self.rollout {
            r.clone_from(self.trainer.model());
        }
        Ok(())
    }
}

/// One iteration's state on the CPU backend, over engine `E` (the single-rank models, or one
/// rank of a TP group).
pub struct CpuIteration<'a, 'r, E: CpuEngine = CpuModels> {
    models: &'a mut E,
    reward: &'a mut RewardFn<'r>,
    book: Book<'a>,
    encoded: Vec<Option<Vec<EncodedMedia>>>,
    ref_encoded: Vec<Option<Vec<EncodedMedia>>>,
    prefixes: Vec<Option<PrefixState>>,
    ref_prefixes: Vec<Option<PrefixState>>,
    old_prefixes: Vec<Option<PrefixState>>,
    arena: KvArena,
    prefix_spans: Vec<Option<KvSpan>>,
    slots: Vec<DecodeSlot>,
    next_logits: Vec<Vec<f32>>,
}

impl<'a, 'r, E: CpuEngine> CpuIteration<'a, 'r, E> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut E,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
    ) -> Result<Self, ExecError> {
        let book = Book::new(plan, iteration, prompts)?;
        let groups = book.groups();
        let samples = book.samples();
        let max_new = plan.spec.rollout.max_new_tokens;
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let cap = prefix_rows + samples as u64 * max_new as u64;
        let cap =
            u32::try_from(cap).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        let arena = models.kv_arena(cap);
        Ok(CpuIteration {
            models,
            reward,
            book,
            encoded: vec![None; groups],
            ref_encoded: vec![None; groups],
            prefixes: vec![None; groups],
            ref_prefixes: vec![None; groups],
            old_prefixes: vec![None; groups],
            arena,
            prefix_spans: vec![None; groups],
            slots: Vec::new(),
            next_logits: vec![Vec::new(); samples],
        })
    }

    /// What the iteration measured so far.
    pub fn metrics(&self) -> &IterationMetrics {
        &self.book.metrics
    }

    fn media_inputs(p: &PromptData) -> Vec<MediaInput<'_>> {
        p.media
            .iter()
            .map(|m| MediaInput {
                kind: m.kind,
                pixels: &m.pixels,
                grid: m.grid,
            })
            .collect()
    }

    fn encode(
        models: &E,
        role: Role,
        p: &PromptData,
        copies: u32,
    ) -> Result<Vec<EncodedMedia>, ExecError> {
        let inputs = Self::media_inputs(p);
        let mut out = models.encode(role, &inputs)?;
        // Without prefix dedup every sample encodes its own copy (the ablation's cost); the
        // copies are identical by determinism, so one is kept.
        for _ in 1..copies {
            out = models.encode(role, &inputs)?;
        }
        Ok(out)
    }

    fn prefill_one(
        models: &E,
        role: Role,
        p: &PromptData,
        media: &[EncodedMedia],
        copies: u32,
    ) -> Result<PrefixState, ExecError> {
        let refs: Vec<&EncodedMedia> = media.iter().collect();
        let prompt = Prompt {
            ids: &p.ids,
            media: &refs,
        };
        let mut state = models.prefill(role, prompt)?;
        for _ in 1..copies {
            state = models.prefill(role, prompt)?;
        }
        Ok(state)
    }

    fn actor_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        match &self.encoded[g] {
            Some(m) => Ok(m.clone()),
            None => Self::encode(self.models, Role::Actor, &self.book.prompts[g], copies),
        }
    }

    fn ref_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        if self.book.frozen_tower() {
            if let Some(m) = &self.encoded[g] {
                return Ok(m.clone());
            }
        }
        if let Some(m) = &self.ref_encoded[g] {
            return Ok(m.clone());
        }
        if !self.models.has_reference() {
            return Err(no_reference());
        }
        let m = Self::encode(self.models, Role::Reference, &self.book.prompts[g], copies)?;
        self.ref_encoded[g] = Some(m.clone());
        Ok(m)
    }

    fn run_prefill(&mut self, groups: Span, copies: u32) -> Result<(), ExecError> {
        for g in range(groups) {
            let media = self.actor_media(g, copies)?;
            let state = Self::prefill_one(
                self.models,
                Role::Rollout,
                &self.book.prompts[g],
                &media,
                copies,
            )?;
            self.prefixes[g] = Some(state);
        }
        // Lay out the arena once every group's prefix is known: prefixes first (in group
        // order), then each sample's suffix of max_new_tokens rows.
        if self.prefixes.iter().all(Option::is_some) && self.slots.is_empty() {
            let mut off = 0u32;
            for g in 0..self.prefixes.len() {
                let p = self.prefixes[g].as_ref().expect("checked above");
                self.prefix_spans[g] = Some(self.arena.store_prefix(off, p)?);
                off += p.len;
            }
            let max_new = self.book.spec.rollout.max_new_tokens;
            for s in 0..self.book.samples() {
                let g = s / self.book.group_size;
                let p = self.prefixes[g].as_ref().expect("checked above");
                self.slots.push(DecodeSlot::new(
                    self.prefix_spans[g].expect("stored"),
                    p.rope_delta,
                    off,
                    max_new,
                ));
                self.next_logits[s] = p.last_logits.clone();
                off += max_new;
            }
        }
        Ok(())
    }

    fn run_decode(
        &mut self,
        first_step: u32,
        steps: u32,
        until_done: bool,
    ) -> Result<(), ExecError> {
        if self.slots.is_empty() {
            return Err(ExecError::Plan(
                "decode before every group's prefill".into(),
            ));
        }
        let temp = self.book.temperature();
        let mut step = first_step;
        while (until_done || step < first_step + steps) && self.book.any_active() {
            let mut active = Vec::new();
            let mut keys = Vec::new();
            for s in 0..self.book.samples() {
                if self.book.stopped[s] {
                    continue;
                }
                self.book.check_step(s, step)?;
                active.push(s);
                keys.push(SampleKey {
                    seed: self.book.spec.seed,
                    iteration: self.book.iteration,
                    sample: s as u32,
                    step,
                });
            }
            let rows: Vec<&[f32]> = active
                .iter()
                .map(|&s| self.next_logits[s].as_slice())
                .collect();
            let drawn = self.models.draw(&rows, &keys, &self.book.sampling, temp)?;
            let mut feed_slots = Vec::new();
            let mut feed_tokens = Vec::new();
            let mut feed_samples = Vec::new();
            for (&s, (tok, lp)) in active.iter().zip(drawn) {
                if self.book.push_token(s, tok, lp, step) {
                    feed_slots.push(self.slots[s]);
                    feed_tokens.push(tok);
                    feed_samples.push(s);
                }
            }
            if !feed_samples.is_empty() {
                let logits =
                    self.models
                        .decode_step(&mut self.arena, &mut feed_slots, &feed_tokens)?;
                let v = logits.len() / feed_samples.len();
                for (i, &s) in feed_samples.iter().enumerate() {
                    self.slots[s] = feed_slots[i];
                    self.next_logits[s] = logits[i * v..(i + 1) * v].to_vec();
                }
            }
            self.book.step_done(step);
            step += 1;
        }
        self.book.end_window();
        Ok(())
    }

    fn run_train_micro_batch(
        &mut self,
        step: u32,
        micro_batch: u32,
        samples: Span,
    ) -> Result<(), ExecError> {
        let mb = self.book.micro_batch("CPU", step, micro_batch, samples)?;
        let media: Vec<Vec<MediaInput<'_>>> = mb
            .groups
            .iter()
            .map(|&grp| Self::media_inputs(&self.book.prompts[grp]))
            .collect();
        let responses = self.book.batches(&mb);
        let batch: Vec<GroupBatch<'_>> = mb
            .groups
            .iter()
            .enumerate()
            .map(|(i, &grp)| GroupBatch {
                prompt_ids: &self.book.prompts[grp].ids,
                media: &media[i],
                responses: &responses[i],
            })
            .collect();
        let out = self.models.micro_batch(micro_batch, &batch, mb.norm)?;
        self.book.metrics.loss.add(&out.metrics);
        self.book.metrics.micro_batches += 1;
        Ok(())
    }

    /// Results of the iteration, for metrics, tests and the bitwise invariant.
    pub fn finish(self) -> super::IterationResult {
        self.book.finish()
    }
}

impl<E: CpuEngine> TaskRunner for CpuIteration<'_, '_, E> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.book.slots_bound()
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        let temp = self.book.temperature();
        match &task.op {
            Op::EncodeMedia { groups, copies } => {
                for g in range(*groups) {
                    self.encoded[g] = Some(Self::encode(
                        self.models,
                        Role::Rollout,
                        &self.book.prompts[g],
                        *copies,
                    )?);
                }
            }
            Op::Prefill { groups, copies } => self.run_prefill(*groups, *copies)?,
            Op::DecodeWindow {
                first_step,
                steps,
                until_done,
            } => self.run_decode(*first_step, *steps, *until_done)?,
            Op::RefPrefix { groups, copies } => {
                for g in range(*groups) {
                    let media = self.ref_media(g, *copies)?;
                    self.ref_prefixes[g] = Some(Self::prefill_one(
                        self.models,
                        Role::Reference,
                        &self.book.prompts[g],
                        &media,
                        *copies,
                    )?);
                }
            }
            Op::RefSuffix { slot } => {
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.ref_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!("ref suffix of group {g} before its prefix"))
                })?;
                let lps =
                    self.models
                        .score(Role::Reference, prefix, &self.book.responses(g), temp)?;
                self.book.set_ref_logp(g, lps);
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => match purpose {
                Purpose::OldLogProb => {
                    for g in self.book.groups_of(groups)? {
                        let media = self.actor_media(g, *copies)?;
                        self.old_prefixes[g] = Some(Self::prefill_one(
                            self.models,
                            Role::Actor,
                            &self.book.prompts[g],
                            &media,
                            *copies,
                        )?);
                    }
                }
                Purpose::Train { .. } => self.book.metrics.train_prefix_tasks += 1,
            },
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
                let lps = self
                    .models
                    .score(Role::Actor, prefix, &self.book.responses(g), temp)?;
                self.book.set_old_logp(g, lps);
            }
            Op::Reward { slot } => self.book.reward(*slot, self.reward)?,
            Op::Advantages { slot } => self.book.advantages(*slot)?,
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(*step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                self.book.metrics.grad_norm = self.models.optimizer_step()?;
                self.book.metrics.optimizer_steps += 1;
            }
            Op::WeightSync { .. } => self.models.weight_sync()?,
            Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => {}
        }
        self.book.metrics.tasks += 1;
        Ok(())
    }
}

/// Builds the training config the trainer runs with.
pub fn train_config(spec: &JobSpec) -> Result<TrainConfig, ExecError> {
    let t = spec.rollout.sampling.temperature as f32;
    Ok(TrainConfig::from_spec(
        &spec.train,
        if t > 0.0 { t } else { 1.0 },
        None,
    )?)
}
