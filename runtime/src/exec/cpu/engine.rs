//! One rank's models and the model calls a CPU iteration makes.
//!
//! [`CpuModels`] is what a rank keeps across iterations: its [`Trainer`] (the actor's shard,
//! `TpAdamW`, the gradient sum), the reference's shard, and in disaggregated plans the rollout
//! GPUs' own copy of the actor. The single-rank run is rank 0 of a group of one: the shard is
//! the whole model and the communicator is `SoloComm`. [`RankEngine`] (a rank's models and its
//! communicator) is the one [`CpuEngine`] the iteration runs on.
//!
//! [`gather_train_state`] and [`restore_rank`] move the training state between the ranks'
//! shards and [`TrainState`], the whole model's state that a checkpoint holds (at degree 1 the
//! gather is a copy).

use std::sync::Arc;

use rollplex_plan::spec::JobSpec;
use rollplex_plan::OptimizerStream;

use super::super::ExecError;
use crate::model::{
    sample_token, DecodeSlot, EncodedMedia, KvArena, MediaInput, PrefixState, Prompt, Qwen25VL,
    SampleKey, SamplingParams, Weights,
};
use crate::tp::{all_gather_uneven, Communicator, TpModel, TpPlan};
use crate::train::backward::{GroupBatch, MicroBatchOutput, TrainConfig};
use crate::train::loss::Normaliser;
use crate::train::{OptTable, Trainer};

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
/// what [`CpuEngine::decode_step`] returns, what [`CpuEngine::draw`] reads) are the rank's
/// vocabulary shard (the whole vocabulary on one rank).
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
    /// A KV arena of `capacity` rows for the rollout's decode.
    fn kv_arena(&self, capacity: u32) -> KvArena;
    /// One decode step of the rollout (see `RankModel::decode_step`); returns one logit row
    /// per slot, concatenated.
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
    /// Clip, AdamW, new weights; returns the global grad norm before clipping. With `stream`
    /// (a plan's streamed optimizer step) the state goes through staging chunk by chunk.
    fn optimizer_step(&mut self, stream: Option<&OptimizerStream>) -> Result<f64, ExecError>;
    /// The plan's `WeightSync`: the rollout gets the trainer's weights (nothing to do where
    /// it reads them in place).
    fn weight_sync(&mut self) -> Result<(), ExecError>;
}

/// What one rank keeps across iterations.
pub struct CpuModels {
    /// The actor's shard (the whole actor on one rank), its optimizer and gradient sum.
    pub trainer: Trainer,
    /// The frozen reference's shard (initial actor weights); `None` without a reference.
    pub reference: Option<TpModel>,
    /// Disaggregated plans (one rank): the rollout GPUs' copy of the actor, which the rollout
    /// runs and each `WeightSync` replaces with the trainer's weights. `None` (colocated): the
    /// rollout reads the trainer's shard.
    pub rollout: Option<TpModel>,
    /// `--save-every`: after every this many completed iterations (0: never) the ranks gather
    /// their training state on rank 0 (a collective: every rank must be given the same).
    save_every: u32,
    /// `--eval-every`: the same, for rank 0 to evaluate the state.
    eval_every: u32,
}

impl CpuModels {
    pub fn rank(&self) -> usize {
        self.trainer.actor().rank
    }
    pub fn degree(&self) -> usize {
        self.trainer.actor().plan.degree
    }
    /// The actor's shard with its current weights (the whole actor at degree 1).
    pub fn actor(&self) -> &TpModel {
        self.trainer.actor()
    }
    pub fn config(&self) -> &TrainConfig {
        self.trainer.config()
    }
    /// `--save-every` for this rank (every rank of the group must be given the same).
    pub fn set_save_every(&mut self, every: u32) {
        self.save_every = every;
    }
    /// `--eval-every` for this rank (every rank of the group must be given the same).
    pub fn set_eval_every(&mut self, every: u32) {
        self.eval_every = every;
    }
    /// Whether the state after `completed` iterations is to be gathered (saved or evaluated).
    pub(super) fn gather_due(&self, completed: u32) -> bool {
        [self.save_every, self.eval_every]
            .iter()
            .any(|&every| every > 0 && completed.is_multiple_of(every))
    }

    fn model(&self, role: Role) -> Result<&TpModel, ExecError> {
        match role {
            Role::Actor => Ok(self.actor()),
            Role::Rollout => Ok(self.rollout_model()),
            Role::Reference => self.reference.as_ref().ok_or_else(no_reference),
        }
    }

    /// The rollout's model (see [`Role::Rollout`]).
    fn rollout_model(&self) -> &TpModel {
        self.rollout.as_ref().unwrap_or(self.trainer.actor())
    }
}

pub(crate) fn no_reference() -> ExecError {
    ExecError::Plan("the plan scores a reference, but the job has none".into())
}

/// Builds the training config the trainer runs with.
pub fn train_config(spec: &JobSpec) -> Result<TrainConfig, ExecError> {
    let t = spec.rollout.sampling.temperature as f32;
    Ok(TrainConfig::from_spec(
        &spec.train,
        if t > 0.0 { t } else { 1.0 },
        None,
        spec.rollout.max_new_tokens as usize,
    )?)
}

/// The single-rank models for `spec`: the job's initial actor (random or its checkpoint), the
/// reference a copy of it, and for a disaggregated job the rollout GPUs' copy.
pub fn build_cpu_models(spec: &JobSpec) -> Result<CpuModels, ExecError> {
    build_rank(spec, &super::super::host_actor(spec)?, 1, 0)
}

/// Every rank's models for `spec` at degree `degree` (rank order) from the job's initial actor.
pub fn build_ranks(
    spec: &JobSpec,
    actor: &Qwen25VL,
    degree: usize,
) -> Result<Vec<CpuModels>, ExecError> {
    let plan = Arc::new(TpPlan::new(&actor.config, degree)?);
    (0..degree)
        .map(|r| rank_models(spec, actor, &plan, r))
        .collect()
}

/// Rank `rank`'s models alone (a process that is one rank of the group).
pub fn build_rank(
    spec: &JobSpec,
    actor: &Qwen25VL,
    degree: usize,
    rank: usize,
) -> Result<CpuModels, ExecError> {
    if rank >= degree {
        return Err(ExecError::Machine(format!(
            "rank {rank} is not a rank of a TP-{degree} group"
        )));
    }
    let plan = Arc::new(TpPlan::new(&actor.config, degree)?);
    rank_models(spec, actor, &plan, rank)
}

fn rank_models(
    spec: &JobSpec,
    actor: &Qwen25VL,
    plan: &Arc<TpPlan>,
    rank: usize,
) -> Result<CpuModels, ExecError> {
    let shard = TpModel::shard(Arc::clone(plan), &actor.weights, rank)?;
    let reference = spec.reference.enabled.then(|| shard.clone());
    let rollout = super::super::disaggregated(spec).then(|| shard.clone());
    let trainer = Trainer::for_shard(shard, train_config(spec)?, spec.train.optimizer.clone())?;
    Ok(CpuModels {
        trainer,
        reference,
        rollout,
        save_every: 0,
        eval_every: 0,
    })
}

/// The whole model's training state, in the layout a checkpoint holds (`checkpoint::save`,
/// `checkpoint::load`): the full actor, AdamW's fp32 masters and moments over the full model's
/// trainable tensors (`table`'s carving) and the steps taken. A TP group gathers it on rank 0
/// ([`gather_train_state`]); every rank takes its part back with [`restore_rank`].
pub struct TrainState {
    pub actor: Qwen25VL,
    pub table: OptTable,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub steps: u64,
}

/// `state` (in `table`'s dense carving) spread over a model buffer of `total` elements (zeros
/// where nothing is trained).
fn to_model_layout(table: &OptTable, state: &[f32], total: usize) -> Vec<f32> {
    let mut out = vec![0f32; total];
    for p in table.params() {
        out[p.offset..p.offset + p.numel]
            .copy_from_slice(&state[p.state_offset..p.state_offset + p.numel]);
    }
    out
}

/// The inverse of [`to_model_layout`].
fn from_model_layout(table: &OptTable, buf: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; table.state_len()];
    for p in table.params() {
        out[p.state_offset..p.state_offset + p.numel]
            .copy_from_slice(&buf[p.offset..p.offset + p.numel]);
    }
    out
}

/// Every rank's shard layout (rank order, zero data): the shapes [`gather_model_buffer`] fills.
fn shard_layouts(plan: &TpPlan) -> Result<Vec<Weights>, ExecError> {
    let (table, layout) = crate::model::weights::build_table(&plan.config);
    let full = Weights {
        data: vec![0f32; table.total()],
        table,
        layout,
    };
    Ok((0..plan.degree)
        .map(|r| plan.shard(&full, r))
        .collect::<Result<Vec<_>, _>>()?)
}

/// A buffer laid out as this rank's shard (`local`), unsharded into the full model's layout on
/// rank 0 (`None` on the others) through `shards` ([`shard_layouts`], overwritten): one uneven
/// all-gather. Replicated parameters must be bitwise equal on every rank (`TpPlan::unshard`
/// checks).
fn gather_model_buffer<C: Communicator>(
    comm: &C,
    plan: &TpPlan,
    shards: &mut [Weights],
    local: &[f32],
) -> Result<Option<Weights>, ExecError> {
    let counts: Vec<usize> = shards.iter().map(|w| w.data.len()).collect();
    let all = all_gather_uneven(comm, local, &counts)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let mut off = 0;
    for (w, &c) in shards.iter_mut().zip(&counts) {
        w.data.copy_from_slice(&all[off..off + c]);
        off += c;
    }
    Ok(Some(plan.unshard(shards)?))
}

/// The full actor on rank 0 (`None` on the others) from every rank's shard, over the
/// communicator (one uneven all-gather; a copy at degree 1).
pub fn gather_actor<C: Communicator>(
    comm: &C,
    models: &CpuModels,
) -> Result<Option<Qwen25VL>, ExecError> {
    let plan = &models.actor().plan;
    let mut shards = shard_layouts(plan)?;
    let weights = gather_model_buffer(comm, plan, &mut shards, &models.actor().weights.data)?;
    weights
        .map(|w| Ok(Qwen25VL::new(plan.config.clone(), w)?))
        .transpose()
}

/// Every rank's actor shard and AdamW state gathered into [`TrainState`] on rank 0 (`None` on
/// the others): a collective, every rank calls it at the same point.
pub fn gather_train_state<C: Communicator>(
    comm: &C,
    models: &CpuModels,
) -> Result<Option<TrainState>, ExecError> {
    let plan = &models.actor().plan;
    let mut shards = shard_layouts(plan)?;
    let opt = models.trainer.optimizer();
    let (table, total) = (opt.table(), models.actor().weights.table.total());
    let (master, m, v) = opt.state();
    let spread = [master, m, v].map(|b| to_model_layout(table, b, total));
    let mut full = Vec::with_capacity(4);
    for local in std::iter::once(&models.actor().weights.data).chain(&spread) {
        full.push(gather_model_buffer(comm, plan, &mut shards, local)?);
    }
    // rank 0 holds the four buffers, every other rank none
    let full: Option<Vec<Weights>> = full.into_iter().collect();
    let Some([weights, master, m, v]) = full.and_then(|f| <[Weights; 4]>::try_from(f).ok()) else {
        return Ok(None);
    };
    let actor = Qwen25VL::new(plan.config.clone(), weights)?;
    let full_table =
        OptTable::from_model(&actor.weights.table, |n| models.config().trainable(n))
            .map_err(|e| ExecError::Plan(format!("the gathered actor's optimizer table: {e}")))?;
    let [master, m, v] = [master, m, v].map(|w| from_model_layout(&full_table, &w.data));
    Ok(Some(TrainState {
        actor,
        table: full_table,
        master,
        m,
        v,
        steps: opt.steps(),
    }))
}

/// This rank's part of `state` (a checkpoint's): the actor's weights and AdamW's masters,
/// moments and steps; the reference stays (the job's initial actor), the running gradient sum
/// is cleared, and a disaggregated run's rollout copy gets the saved weights too (the
/// iteration's last task before the save was its weight sync).
pub fn restore_rank(models: &mut CpuModels, state: &TrainState) -> Result<(), ExecError> {
    let plan = Arc::clone(&models.actor().plan);
    let rank = models.rank();
    let weights = plan.shard(&state.actor.weights, rank)?;
    let mut local = Vec::with_capacity(3);
    for buf in [&state.master, &state.m, &state.v] {
        let full = Weights {
            table: state.actor.weights.table.clone(),
            layout: state.actor.weights.layout.clone(),
            data: to_model_layout(&state.table, buf, state.actor.weights.table.total()),
        };
        local.push(from_model_layout(
            models.trainer.optimizer().table(),
            &plan.shard(&full, rank)?.data,
        ));
    }
    models
        .trainer
        .restore(weights, &local[0], &local[1], &local[2], state.steps)?;
    if let Some(r) = &mut models.rollout {
        r.clone_from(models.trainer.actor());
    }
    Ok(())
}

/// The full actor in Hugging Face layout from every rank's models (rank order); checks that
/// every replicated parameter is bitwise equal on every rank.
pub fn unshard_actor(ranks: &[CpuModels]) -> Result<Qwen25VL, ExecError> {
    let first = ranks
        .first()
        .ok_or_else(|| ExecError::Plan("no ranks to unshard".into()))?;
    let plan = &first.actor().plan;
    if ranks.len() != plan.degree || ranks.iter().enumerate().any(|(i, r)| r.rank() != i) {
        return Err(ExecError::Plan(format!(
            "unshard needs the {} ranks of the group in rank order",
            plan.degree
        )));
    }
    let shards: Vec<_> = ranks.iter().map(|r| r.actor().weights.clone()).collect();
    let weights = plan.unshard(&shards)?;
    Ok(Qwen25VL::new(plan.config.clone(), weights)?)
}

/// One rank's models and its communicator: the [`CpuEngine`] a rank's iteration runs on
/// (`SoloComm` for the single-rank run).
pub struct RankEngine<'m, C: Communicator> {
    pub models: &'m mut CpuModels,
    pub comm: &'m C,
}

impl<C: Communicator> CpuEngine for RankEngine<'_, C> {
    fn has_reference(&self) -> bool {
        self.models.reference.is_some()
    }

    fn encode(&self, role: Role, media: &[MediaInput<'_>]) -> Result<Vec<EncodedMedia>, ExecError> {
        Ok(self
            .models
            .model(role)?
            .as_rank()
            .encode_media(self.comm, media, None)?)
    }

    fn prefill(&self, role: Role, prompt: Prompt<'_>) -> Result<PrefixState, ExecError> {
        self.models
            .model(role)?
            .as_rank()
            .prefill(self.comm, &[prompt], None)?
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
            .models
            .model(role)?
            .as_rank()
            .score(self.comm, prefix, responses, temperature, None)?
            .into_iter()
            .map(|s| s.logp)
            .collect())
    }

    fn kv_arena(&self, capacity: u32) -> KvArena {
        self.models.rollout_model().as_rank().kv_arena(capacity)
    }

    fn decode_step(
        &self,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ExecError> {
        Ok(self
            .models
            .rollout_model()
            .as_rank()
            .decode_step(self.comm, arena, slots, tokens)?)
    }

    /// One all-gather of the rows' shards (a copy on one rank), the same Philox draw on every
    /// rank from the full rows, then the vocab-parallel log-softmax of the drawn tokens (what
    /// `score` computes; on one rank bitwise the `logprobs_fwd` kernel).
    fn draw(
        &self,
        rows: &[&[f32]],
        keys: &[SampleKey],
        sampling: &SamplingParams,
        temperature: f32,
    ) -> Result<Vec<(u32, f32)>, ExecError> {
        if rows.len() != keys.len() {
            return Err(ExecError::Plan(format!(
                "draw: {} logit rows and {} keys",
                rows.len(),
                keys.len()
            )));
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let model = self.models.rollout_model().as_rank();
        let local = rows.concat();
        let full = model.gather_logits(self.comm, &local)?;
        let v = full.len() / rows.len();
        let tokens = keys
            .iter()
            .enumerate()
            .map(|(i, key)| sample_token(&full[i * v..(i + 1) * v], sampling, *key))
            .collect::<Result<Vec<u32>, _>>()?;
        let (logp, _) = model.vocab_logprobs(self.comm, &local, &tokens, temperature)?;
        Ok(tokens.into_iter().zip(logp).collect())
    }

    fn micro_batch(
        &mut self,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput, ExecError> {
        Ok(self
            .models
            .trainer
            .micro_batch(self.comm, index, groups, norm)?)
    }

    fn optimizer_step(&mut self, stream: Option<&OptimizerStream>) -> Result<f64, ExecError> {
        Ok(self
            .models
            .trainer
            .optimizer_step_with(self.comm, stream)?
            .step
            .grad_norm)
    }

    fn weight_sync(&mut self) -> Result<(), ExecError> {
        if let Some(r) = &mut self.models.rollout {
            r.weights
                .data
                .copy_from_slice(&self.models.trainer.actor().weights.data);
        }
        Ok(())
    }
}
