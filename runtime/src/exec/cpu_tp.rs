//! The CPU backend under tensor parallelism: a plan whose rollout TP = training TP = GPU count
//! = `N` runs as `N` ranks, each holding its shard of the actor and of the reference
//! ([`TpRankModels`]) and walking the plan's one GPU program with the same
//! [`CpuIteration`](super::cpu::CpuIteration) as the single-rank backend, over a
//! [`TpEngine`]. Ranks are threads over [`ThreadComm`] ([`run_cpu_tp_loop`]) or processes over
//! `TcpComm` (`rollplex-run --tp-processes`, or ranks started by torchrun/slurm: `cli.rs`);
//! [`run_tp_rank`] is the per-rank loop over any [`Communicator`].
//!
//! What each op does on a rank: `EncodeMedia`, `Prefill`, `RefPrefix`/`RefSuffix`,
//! `ActorPrefix`/`ActorSuffix` run the model engine on the rank's shard (replicated outputs: embeddings and
//! log-probs are bitwise equal on every rank); `DecodeWindow` decodes over the rank's KV arena
//! (its kv heads), then gathers the active samples' logit rows and draws every token with the
//! same Philox key on every rank, so tokens agree without a broadcast; the rollout log-prob is
//! the vocab-parallel log-softmax, bitwise what `RankModel::score` gives the same token;
//! `TrainMicroBatch` is `RankModel::forward_backward` into a zeroed shard-sized buffer, added to
//! the running sum in plan order (`GradAccumulator`); `OptimizerStep` is [`TpAdamW`] (global
//! grad-norm clip across ranks); `WeightSync` is a no-op (rollout and training use the same
//! shards at equal degrees), as are `Reshard`, `Offload`, `Reload`.
//!
//! Only rank 0 holds the prompt source, the reward and the observer (metrics, traces): each
//! iteration's prompts are broadcast from rank 0, and each group's rewards too (the reward runs
//! once, an external command included). Every other host decision is made by [`Book`] on every
//! rank from bitwise-equal inputs. At the end of each iteration the ranks compare a fingerprint
//! of their sampled tokens and rewards and stop with an error if they differ.
//!
//! Invariants: (1) every rank issues the same collectives in the same order: the walker's
//! choice depends on the plan and the book only, and the book's state is replicated; (2) every
//! number is a function of (spec, seed, iteration, data, TP degree), never of thread timing (the
//! collectives reduce in rank order), so a TP run is bitwise reproducible at its degree.
//!
//! [`Book`]: super::book::Book

use std::ops::Range;
use std::sync::{Arc, Mutex};

use rollplex_plan::spec::JobSpec;
use rollplex_plan::Plan;

use super::cpu::{no_reference, CpuEngine, CpuIteration, RewardFn, Role};
use super::prompts::{self, PromptSource};
use super::{
    walker, EachIteration, ExecError, IterationResult, LoopModels, LoopObserver, MediaData,
    PromptData, Timed,
};
use crate::model::{
    sample_token, DecodeSlot, EncodedMedia, KvArena, MediaInput, MediaKind, PrefixState, Prompt,
    Qwen25VL, SampleKey, SamplingParams, Weights,
};
use crate::tp::{all_gather_uneven, run_ranks, Communicator, ThreadComm, TpAdamW, TpModel, TpPlan};
use crate::train::backward::{GroupBatch, MicroBatchOutput, TrainConfig};
use crate::train::loss::Normaliser;
use crate::train::{GradAccumulator, OptTable};

/// A reward the thread driver can hand to rank 0's thread.
pub type SendRewardFn<'a> =
    dyn FnMut(&PromptData, &[&[u32]]) -> Result<Vec<f32>, ExecError> + Send + 'a;

/// What one rank keeps across iterations: its shards of the actor and the reference, the
/// optimizer state of its actor shard, and the gradient sum of the running mini-batch.
pub struct TpRankModels {
    pub actor: TpModel,
    /// The frozen reference's shard (initial actor weights); `None` without a reference.
    pub reference: Option<TpModel>,
    opt: TpAdamW,
    acc: GradAccumulator,
    cfg: TrainConfig,
    /// `--save-every`: when the ranks gather their state for rank 0 to save.
    checkpoints: Option<TpCheckpoints>,
}

/// When a TP run gathers its training state on rank 0 (every rank must agree: the gather is a
/// collective), and the job's initial actor, which gives the shards' shapes.
#[derive(Clone)]
pub struct TpCheckpoints {
    /// After every `every` completed iterations (> 0).
    pub every: u32,
    pub initial: Arc<Qwen25VL>,
}

/// A TP run's training state gathered on rank 0, in the single-rank layout a checkpoint holds
/// (`checkpoint::save_tp`, `checkpoint::load_tp`): the full actor, AdamW's fp32 masters and
/// moments over the full model's trainable tensors (`table`'s carving) and the steps taken.
pub struct TpTrainState {
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

impl TpRankModels {
    pub fn rank(&self) -> usize {
        self.actor.rank
    }
    pub fn degree(&self) -> usize {
        self.actor.plan.degree
    }
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    pub fn optimizer(&self) -> &TpAdamW {
        &self.opt
    }
    /// `--save-every` for this rank (every rank of the group must be given the same).
    pub fn set_checkpoints(&mut self, c: Option<TpCheckpoints>) {
        self.checkpoints = c;
    }
}

/// Every rank's models for `spec` at degree `degree` (rank order): the job's initial actor
/// (random or its checkpoint) sharded, the reference a copy of each shard.
pub fn build_tp_models(spec: &JobSpec, degree: usize) -> Result<Vec<TpRankModels>, ExecError> {
    build_tp_models_from(spec, &super::host_actor(spec)?, degree)
}

/// [`build_tp_models`] from a given initial actor.
pub fn build_tp_models_from(
    spec: &JobSpec,
    actor: &Qwen25VL,
    degree: usize,
) -> Result<Vec<TpRankModels>, ExecError> {
    let plan = Arc::new(TpPlan::new(&actor.config, degree)?);
    (0..degree)
        .map(|r| rank_models(spec, actor, &plan, r))
        .collect()
}

/// Rank `rank`'s models alone (a process that is one rank of the group).
pub fn build_tp_rank(
    spec: &JobSpec,
    actor: &Qwen25VL,
    degree: usize,
    rank: usize,
) -> Result<TpRankModels, ExecError> {
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
) -> Result<TpRankModels, ExecError> {
    let cfg = super::cpu::train_config(spec)?;
    let shard = TpModel::shard(Arc::clone(plan), &actor.weights, rank)?;
    let opt = TpAdamW::new(&shard, spec.train.optimizer.clone(), |n| cfg.trainable(n))?;
    Ok(TpRankModels {
        reference: spec.reference.enabled.then(|| shard.clone()),
        acc: GradAccumulator::new(shard.weights.table.total()),
        actor: shard,
        opt,
        cfg,
        checkpoints: None,
    })
}

/// The full actor on rank 0 (`None` on the others) from every rank's shard, over the
/// communicator (one uneven all-gather); `initial` is the job's initial actor, which gives the
/// shards' shapes.
pub fn gather_actor<C: Communicator>(
    comm: &C,
    models: &TpRankModels,
    initial: &Qwen25VL,
) -> Result<Option<Qwen25VL>, ExecError> {
    let mut shards = shards_of(models, initial)?;
    let weights = gather_model_buffer(comm, models, &mut shards, &models.actor.weights.data)?;
    weights
        .map(|w| Ok(Qwen25VL::new(models.actor.plan.config.clone(), w)?))
        .transpose()
}

/// Every rank's shard of `initial` (rank order): the shapes [`gather_model_buffer`] fills.
fn shards_of(models: &TpRankModels, initial: &Qwen25VL) -> Result<Vec<Weights>, ExecError> {
    let plan = &models.actor.plan;
    Ok((0..plan.degree)
        .map(|r| plan.shard(&initial.weights, r))
        .collect::<Result<Vec<_>, _>>()?)
}

/// A buffer laid out as this rank's shard (`local`), unsharded into the full model's layout on
/// rank 0 (`None` on the others) through `shards` ([`shards_of`], overwritten): one uneven
/// all-gather. Replicated parameters must be bitwise equal on every rank (`TpPlan::unshard`
/// checks).
fn gather_model_buffer<C: Communicator>(
    comm: &C,
    models: &TpRankModels,
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
    Ok(Some(models.actor.plan.unshard(shards)?))
}

/// Every rank's actor shard and AdamW state gathered into [`TpTrainState`] on rank 0 (`None`
/// on the others): a collective, every rank calls it at the same point.
pub fn gather_train_state<C: Communicator>(
    comm: &C,
    models: &TpRankModels,
    initial: &Qwen25VL,
) -> Result<Option<TpTrainState>, ExecError> {
    let mut shards = shards_of(models, initial)?;
    let (table, total) = (models.opt.table(), models.actor.weights.table.total());
    let (master, m, v) = models.opt.state();
    let spread = [master, m, v].map(|b| to_model_layout(table, b, total));
    let mut full = Vec::with_capacity(4);
    for local in std::iter::once(&models.actor.weights.data).chain(&spread) {
        full.push(gather_model_buffer(comm, models, &mut shards, local)?);
    }
    // rank 0 holds the four buffers, every other rank none
    let full: Option<Vec<Weights>> = full.into_iter().collect();
    let Some([weights, master, m, v]) = full.and_then(|f| <[Weights; 4]>::try_from(f).ok()) else {
        return Ok(None);
    };
    let actor = Qwen25VL::new(models.actor.plan.config.clone(), weights)?;
    let full_table = OptTable::from_model(&actor.weights.table, |n| models.cfg.trainable(n))
        .map_err(|e| ExecError::Plan(format!("the gathered actor's optimizer table: {e}")))?;
    let [master, m, v] = [master, m, v].map(|w| from_model_layout(&full_table, &w.data));
    Ok(Some(TpTrainState {
        actor,
        table: full_table,
        master,
        m,
        v,
        steps: models.opt.steps(),
    }))
}

/// This rank's part of `state` (a checkpoint's): the actor's weights and AdamW's masters,
/// moments and steps; the reference shard stays (the job's initial actor) and the running
/// gradient sum is cleared.
pub fn restore_rank(models: &mut TpRankModels, state: &TpTrainState) -> Result<(), ExecError> {
    let plan = Arc::clone(&models.actor.plan);
    let rank = models.rank();
    let actor = TpModel::shard(Arc::clone(&plan), &state.actor.weights, rank)?;
    let mut local = Vec::with_capacity(3);
    for buf in [&state.master, &state.m, &state.v] {
        let full = Weights {
            table: state.actor.weights.table.clone(),
            layout: state.actor.weights.layout.clone(),
            data: to_model_layout(&state.table, buf, state.actor.weights.table.total()),
        };
        local.push(from_model_layout(
            models.opt.table(),
            &plan.shard(&full, rank)?.data,
        ));
    }
    models.actor = actor;
    models
        .opt
        .restore(&local[0], &local[1], &local[2], state.steps)?;
    models.acc.reset();
    Ok(())
}

/// The full actor in Hugging Face layout from every rank's models (rank order); checks that
/// every replicated parameter is bitwise equal on every rank.
pub fn unshard_actor(ranks: &[TpRankModels]) -> Result<Qwen25VL, ExecError> {
    let first = ranks
        .first()
        .ok_or_else(|| ExecError::Plan("no tensor-parallel ranks to unshard".into()))?;
    let plan = &first.actor.plan;
    if ranks.len() != plan.degree || ranks.iter().enumerate().any(|(i, r)| r.rank() != i) {
        return Err(ExecError::Plan(format!(
            "unshard needs the {} ranks of the group in rank order",
            plan.degree
        )));
    }
    let shards: Vec<_> = ranks.iter().map(|r| r.actor.weights.clone()).collect();
    let weights = plan.unshard(&shards)?;
    Ok(Qwen25VL::new(plan.config.clone(), weights)?)
}

/// One rank's models and its communicator: the [`CpuEngine`] a rank's iteration runs on.
pub struct TpEngine<'m, C: Communicator> {
    pub models: &'m mut TpRankModels,
    pub comm: &'m C,
}

impl<C: Communicator> TpEngine<'_, C> {
    fn model(&self, role: Role) -> Result<&TpModel, ExecError> {
        match role {
            Role::Actor | Role::Rollout => Ok(&self.models.actor),
            Role::Reference => self.models.reference.as_ref().ok_or_else(no_reference),
        }
    }
}

impl<C: Communicator> CpuEngine for TpEngine<'_, C> {
    fn has_reference(&self) -> bool {
        self.models.reference.is_some()
    }

    fn encode(&self, role: Role, media: &[MediaInput<'_>]) -> Result<Vec<EncodedMedia>, ExecError> {
        Ok(self
            .model(role)?
            .as_rank()
            .encode_media(self.comm, media, None)?)
    }

    fn prefill(&self, role: Role, prompt: Prompt<'_>) -> Result<PrefixState, ExecError> {
        self.model(role)?
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
            .model(role)?
            .as_rank()
            .score(self.comm, prefix, responses, temperature, None)?
            .into_iter()
            .map(|s| s.logp)
            .collect())
    }

    fn kv_arena(&self, capacity: u32) -> KvArena {
        self.models.actor.as_rank().kv_arena(capacity)
    }

    fn decode_step(
        &self,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ExecError> {
        Ok(self
            .models
            .actor
            .as_rank()
            .decode_step(self.comm, arena, slots, tokens)?)
    }

    /// One all-gather of the rows' shards, the same Philox draw on every rank from the full
    /// rows, then the vocab-parallel log-softmax of the drawn tokens (what `score` computes).
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
        let actor = self.models.actor.as_rank();
        let local = rows.concat();
        let full = actor.gather_logits(self.comm, &local)?;
        let v = full.len() / rows.len();
        let tokens = keys
            .iter()
            .enumerate()
            .map(|(i, key)| sample_token(&full[i * v..(i + 1) * v], sampling, *key))
            .collect::<Result<Vec<u32>, _>>()?;
        let (logp, _) = actor.vocab_logprobs(self.comm, &local, &tokens, temperature)?;
        Ok(tokens.into_iter().zip(logp).collect())
    }

    fn micro_batch(
        &mut self,
        index: u32,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput, ExecError> {
        let m = &mut *self.models;
        if index != m.acc.count() {
            return Err(ExecError::Plan(format!(
                "micro-batch {index} given, but micro-batch {} is next in plan order",
                m.acc.count()
            )));
        }
        let mut g = vec![0f32; m.actor.weights.table.total()];
        let out = m
            .actor
            .as_rank()
            .forward_backward(self.comm, &m.cfg, groups, norm, &mut g)?;
        m.acc.add(index, &g)?;
        Ok(out)
    }

    fn optimizer_step(&mut self) -> Result<f64, ExecError> {
        let m = &mut *self.models;
        if m.acc.count() == 0 {
            return Err(ExecError::Plan(
                "optimizer step before any micro-batch: nothing to apply".into(),
            ));
        }
        let report = m.opt.step(self.comm, &mut m.actor, m.acc.grads_mut())?;
        m.acc.reset();
        Ok(report.grad_norm)
    }
}

/// What only rank 0 holds: where prompts come from, the reward, and who is told about tasks
/// and iterations.
pub struct RootSide<'a, 'r> {
    pub source: &'a mut dyn PromptSource,
    pub reward: &'a mut RewardFn<'r>,
    pub observer: &'a mut dyn LoopObserver,
}

/// Runs iterations `iterations` of `plan` on one rank of its TP group. Rank 0 passes `root`,
/// every other rank `None`; every rank passes its own models and communicator.
pub fn run_tp_rank<C: Communicator>(
    plan: &Plan,
    comm: &C,
    models: &mut TpRankModels,
    root: Option<RootSide<'_, '_>>,
    iterations: Range<u32>,
) -> Result<(), ExecError> {
    let degree = super::cpu_plan_degree(plan)?;
    if comm.world() != degree || models.degree() != degree || models.rank() != comm.rank() {
        return Err(ExecError::Plan(format!(
            "rank {} of a TP-{} model on communicator rank {} of {}, for a plan of TP {degree}",
            models.rank(),
            models.degree(),
            comm.rank(),
            comm.world()
        )));
    }
    if root.is_some() != (comm.rank() == 0) {
        return Err(ExecError::Plan(format!(
            "rank {} {} the prompt source, reward and observer: rank 0 alone holds them",
            comm.rank(),
            if root.is_some() { "was given" } else { "lacks" }
        )));
    }
    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    let gpu = plan.gpus[0].id;
    let tasks = plan.tasks.iter().filter(|t| t.gpu == gpu).count();
    match root {
        Some(RootSide {
            source,
            reward,
            observer,
        }) => prompts::for_each_prefetched(source, iterations, groups, |it, prompts, t0| {
            let prompts = share_prompts(comm, Some(prompts))?;
            observer.iteration_started(it, tasks);
            super::reset_rss_peak();
            let mut result = tp_iteration(
                plan,
                comm,
                models,
                Some(&mut *reward),
                Some(&mut *observer),
                it,
                &prompts,
            )?;
            // the process's high-water mark: every rank's thread counts
            result.metrics.peak_mem_bytes = super::rss_peak();
            let wall = t0.elapsed();
            match save_due(models, it + 1) {
                Some(initial) => {
                    let state = gather_train_state(comm, models, &initial)?.ok_or_else(|| {
                        ExecError::Plan("rank 0 gathered no training state".into())
                    })?;
                    observer.iteration_done(it, &result, LoopModels::CpuTpState(&state), t0, wall)
                }
                None => observer.iteration_done(it, &result, LoopModels::CpuTp(models), t0, wall),
            }
        }),
        None => {
            for it in iterations {
                let prompts = share_prompts(comm, None)?;
                tp_iteration(plan, comm, models, None, None, it, &prompts)?;
                if let Some(initial) = save_due(models, it + 1) {
                    gather_train_state(comm, models, &initial)?;
                }
            }
            Ok(())
        }
    }
}

/// The initial actor when the state after `completed` iterations is to be saved (the same
/// answer on every rank: every rank was given the same [`TpCheckpoints`]).
fn save_due(models: &TpRankModels, completed: u32) -> Option<Arc<Qwen25VL>> {
    models
        .checkpoints
        .as_ref()
        .filter(|c| c.every > 0 && completed.is_multiple_of(c.every))
        .map(|c| Arc::clone(&c.initial))
}

/// One iteration on one rank: the plan's walk over a [`TpEngine`], rewards from rank 0, and the
/// ranks' agreement check.
fn tp_iteration<C: Communicator>(
    plan: &Plan,
    comm: &C,
    models: &mut TpRankModels,
    mut reward: Option<&mut RewardFn<'_>>,
    observer: Option<&mut dyn LoopObserver>,
    it: u32,
    prompts: &[PromptData],
) -> Result<IterationResult, ExecError> {
    let mut shared = |p: &PromptData, responses: &[&[u32]]| -> Result<Vec<f32>, ExecError> {
        let mut r = match reward.as_mut() {
            Some(f) => {
                let r = f(p, responses)?;
                if r.len() != responses.len() {
                    return Err(ExecError::Reward(format!(
                        "expected {} rewards for the group of prompt {:?}, got {}",
                        responses.len(),
                        p.id,
                        r.len()
                    )));
                }
                r
            }
            None => vec![0f32; responses.len()],
        };
        comm.broadcast(&mut r, 0)?;
        Ok(r)
    };
    let gpu = plan.gpus[0].id;
    let mut engine = TpEngine { models, comm };
    let result = {
        let mut iter = CpuIteration::new(plan, &mut engine, &mut shared, it, prompts)?;
        match observer {
            Some(observer) => {
                let mut timed = Timed {
                    inner: &mut iter,
                    observer,
                    iteration: it,
                };
                walker::walk(plan, gpu, &mut timed, |_, _| {})?;
            }
            None => walker::walk(plan, gpu, &mut iter, |_, _| {})?,
        }
        iter.finish()
    };
    check_ranks_agree(comm, it, &result)?;
    Ok(result)
}

/// FNV-1a over 32-bit words.
fn fnv(h: &mut u64, words: impl IntoIterator<Item = u32>) {
    for w in words {
        *h ^= w as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// Fingerprint of what the host decided from the ranks' replicated data: sampled tokens,
/// rewards, advantages, the grad norm.
fn fingerprint(r: &IterationResult) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in &r.tokens {
        fnv(&mut h, [t.len() as u32]);
        fnv(&mut h, t.iter().copied());
    }
    fnv(&mut h, r.rewards.iter().map(|x| x.to_bits()));
    fnv(&mut h, r.advantages.iter().map(|x| x.to_bits()));
    let g = r.metrics.grad_norm.to_bits();
    fnv(&mut h, [g as u32, (g >> 32) as u32]);
    h
}

/// Every rank's fingerprint of the iteration, compared with rank 0's.
fn check_ranks_agree<C: Communicator>(
    comm: &C,
    it: u32,
    r: &IterationResult,
) -> Result<(), ExecError> {
    let h = fingerprint(r);
    let mine = [(h & 0xffff_ffff) as f64, (h >> 32) as f64];
    let mut all = vec![0f64; 2 * comm.world()];
    comm.all_gather(&mine, &mut all)?;
    if let Some(k) = (1..comm.world()).find(|&k| all[2 * k..2 * k + 2] != all[..2]) {
        return Err(ExecError::Plan(format!(
            "tensor-parallel ranks diverged in iteration {it}: rank {k}'s sampled tokens, rewards \
             or grad norm differ from rank 0's (a bug: replicated values must be bitwise equal \
             on every rank)"
        )));
    }
    Ok(())
}

/// Rank 0's prompts on every rank: rank 0 passes `Some`, the others `None`. Three broadcasts:
/// the two lengths, the header (f64: counts, token ids, media kinds and grids; exact below
/// 2^53), the pixels (f32). Other ranks get empty `id`, `text` and `answer` (only rank 0
/// scores rewards).
pub fn share_prompts<C: Communicator>(
    comm: &C,
    mine: Option<Vec<PromptData>>,
) -> Result<Vec<PromptData>, ExecError> {
    let (mut header, mut pixels) = match &mine {
        Some(p) => encode_prompts(p),
        None => (Vec::new(), Vec::new()),
    };
    let mut lens = [header.len() as f64, pixels.len() as f64];
    comm.broadcast(&mut lens, 0)?;
    if mine.is_none() {
        header = vec![0f64; lens[0] as usize];
        pixels = vec![0f32; lens[1] as usize];
    }
    comm.broadcast(&mut header, 0)?;
    comm.broadcast(&mut pixels, 0)?;
    match mine {
        Some(p) => Ok(p),
        None => decode_prompts(&header, &pixels),
    }
}

/// The header and pixels [`share_prompts`] sends: `[prompts, per prompt: ids, id..., media, per
/// item: kind (0 image, 1 video), seconds per temporal patch (NaN: none), t, h, w, pixels]`.
fn encode_prompts(prompts: &[PromptData]) -> (Vec<f64>, Vec<f32>) {
    let mut h = vec![prompts.len() as f64];
    let mut px = Vec::new();
    for p in prompts {
        h.push(p.ids.len() as f64);
        h.extend(p.ids.iter().map(|&i| i as f64));
        h.push(p.media.len() as f64);
        for m in &p.media {
            let (kind, spg) = match m.kind {
                MediaKind::Image => (0.0, f64::NAN),
                MediaKind::Video { second_per_grid_t } => {
                    (1.0, second_per_grid_t.unwrap_or(f64::NAN))
                }
            };
            h.extend([kind, spg]);
            h.extend(m.grid.iter().map(|&g| g as f64));
            h.push(m.pixels.len() as f64);
            px.extend_from_slice(&m.pixels);
        }
    }
    (h, px)
}

fn decode_prompts(h: &[f64], px: &[f32]) -> Result<Vec<PromptData>, ExecError> {
    let bad = || ExecError::Plan("the prompts rank 0 broadcast do not decode".into());
    let mut i = 0usize;
    let mut next = || -> Result<f64, ExecError> {
        let v = *h.get(i).ok_or_else(bad)?;
        i += 1;
        Ok(v)
    };
    let mut off = 0usize;
    let n = next()? as usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = next()? as usize;
        let ids = (0..len)
            .map(|_| next().map(|v| v as u32))
            .collect::<Result<Vec<_>, _>>()?;
        let items = next()? as usize;
        let mut media = Vec::with_capacity(items);
        for _ in 0..items {
            let (kind, spg) = (next()?, next()?);
            let kind = if kind == 0.0 {
                MediaKind::Image
            } else {
                MediaKind::Video {
                    second_per_grid_t: (!spg.is_nan()).then_some(spg),
                }
            };
            let grid = [next()? as u32, next()? as u32, next()? as u32];
            let np = next()? as usize;
            let pixels = px.get(off..off + np).ok_or_else(bad)?.to_vec();
            off += np;
            media.push(MediaData { kind, pixels, grid });
        }
        out.push(PromptData {
            id: String::new(),
            text: String::new(),
            ids,
            media,
            answer: String::new(),
        });
    }
    if i != h.len() || off != px.len() {
        return Err(bad());
    }
    Ok(out)
}

/// Runs iterations `iterations` of `plan` with one thread per rank over [`ThreadComm`]: rank 0
/// draws the prompts from `source`, scores with `reward` and tells `observer`; returns every
/// rank's models afterwards (rank order). An error names the rank it happened on (the first
/// rank that failed: the others then stop with "rank K failed").
pub fn run_cpu_tp_loop(
    plan: &Plan,
    models: Vec<TpRankModels>,
    source: &mut dyn PromptSource,
    reward: &mut SendRewardFn<'_>,
    iterations: Range<u32>,
    observer: &mut (dyn LoopObserver + Send),
) -> Result<Vec<TpRankModels>, ExecError> {
    let degree = super::cpu_plan_degree(plan)?;
    if models.len() != degree {
        return Err(ExecError::Plan(format!(
            "{} rank models given for a plan of TP {degree}",
            models.len()
        )));
    }
    let slots: Vec<Mutex<Option<TpRankModels>>> =
        models.into_iter().map(|m| Mutex::new(Some(m))).collect();
    let root = Mutex::new(Some((source, reward, observer)));
    let lock_err = |what: &str| ExecError::Plan(format!("rank {what} taken twice"));
    run_ranks(
        degree,
        |comm: &ThreadComm| -> Result<TpRankModels, ExecError> {
            let rank = comm.rank();
            let mut m = slots[rank]
                .lock()
                .map_err(|_| lock_err("models"))?
                .take()
                .ok_or_else(|| lock_err("models"))?;
            let side = if rank == 0 {
                root.lock().map_err(|_| lock_err("0's inputs"))?.take()
            } else {
                None
            };
            match side {
                Some((source, reward, observer)) => {
                    let root = RootSide {
                        source,
                        reward,
                        observer,
                    };
                    run_tp_rank(plan, comm, &mut m, Some(root), iterations.clone())?
                }
                None => run_tp_rank(plan, comm, &mut m, None, iterations.clone())?,
            }
            Ok(m)
        },
    )
    .map_err(|e| ExecError::Rank {
        rank: e.rank,
        source: Box::new(e.error),
    })
}

/// Runs iterations `first .. first + count` of `plan` with one thread per rank;
/// `on_iteration` sees each iteration's result (rank 0's; every rank's agree, checked) and wall
/// time. Returns every rank's models afterwards.
pub fn run_cpu_tp_iterations(
    plan: &Plan,
    models: Vec<TpRankModels>,
    source: &mut dyn PromptSource,
    reward: &mut SendRewardFn<'_>,
    first: u32,
    count: u32,
    on_iteration: impl FnMut(u32, &IterationResult, std::time::Duration) -> Result<(), ExecError> + Send,
) -> Result<Vec<TpRankModels>, ExecError> {
    run_cpu_tp_loop(
        plan,
        models,
        source,
        reward,
        first..first + count,
        &mut EachIteration(on_iteration),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts() -> Vec<PromptData> {
        let media = |kind, n: usize, grid| MediaData {
            kind,
            pixels: (0..n).map(|i| i as f32 * 0.25 - 3.0).collect(),
            grid,
        };
        vec![
            PromptData {
                id: "a".into(),
                text: "what moves?".into(),
                ids: vec![1, 2, 3, 70_000],
                media: vec![
                    media(MediaKind::Image, 12, [1, 2, 2]),
                    media(
                        MediaKind::Video {
                            second_per_grid_t: Some(0.5),
                        },
                        24,
                        [2, 2, 2],
                    ),
                ],
                answer: "B".into(),
            },
            PromptData {
                id: "b".into(),
                text: String::new(),
                ids: vec![9],
                media: vec![media(
                    MediaKind::Video {
                        second_per_grid_t: None,
                    },
                    6,
                    [1, 1, 2],
                )],
                answer: "C".into(),
            },
        ]
    }

    #[test]
    fn prompts_reach_every_rank_with_their_ids_and_media() {
        let sent = prompts();
        let got = run_ranks(3, |c: &ThreadComm| {
            share_prompts(c, (c.rank() == 0).then(|| sent.clone()))
        })
        .unwrap();
        assert_eq!(got[0], sent, "rank 0 keeps its own prompts");
        for g in &got[1..] {
            assert_eq!(g.len(), sent.len());
            for (a, b) in g.iter().zip(&sent) {
                assert_eq!((&a.ids, &a.media), (&b.ids, &b.media));
                assert!(a.id.is_empty() && a.text.is_empty() && a.answer.is_empty());
            }
        }
        // a truncated header or stray pixels do not decode
        let (h, px) = encode_prompts(&sent);
        assert!(decode_prompts(&h[..h.len() - 1], &px).is_err());
        assert!(decode_prompts(&h, &px[1..]).is_err());
        assert_eq!(decode_prompts(&h, &px).unwrap().len(), 2);
    }

    #[test]
    fn ranks_that_sampled_differently_are_stopped_naming_the_rank() {
        let result = |tok: u32| IterationResult {
            tokens: vec![vec![1, tok]],
            rollout_logp: vec![vec![0.0, 0.0]],
            ref_logp: vec![None],
            old_logp: vec![None],
            rewards: vec![1.0],
            advantages: vec![0.0],
            slot_groups: vec![0],
            group_size: 1,
            metrics: Default::default(),
        };
        run_ranks(2, |c: &ThreadComm| check_ranks_agree(c, 4, &result(7))).unwrap();
        let e = run_ranks(3, |c: &ThreadComm| {
            check_ranks_agree(c, 4, &result(if c.rank() == 2 { 8 } else { 7 }))
        })
        .unwrap_err();
        let msg = e.error.to_string();
        assert!(
            msg.contains("iteration 4") && msg.contains("rank 2"),
            "{msg}"
        );
    }
}
