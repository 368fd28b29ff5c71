//! Forward and backward of the whole actor over one micro-batch of GRPO groups.
//!
//! One group is a prompt (token ids and media) with G responses. Its forward is the model's own
//! RL operations, with a [`ForwardCache`]/[`VisionCache`] kept for backward:
//! `encode_media` (vision tower + merger) → `prefill` of the prompt, **once per group** → `score`
//! of the G responses as one packed suffix batch attending the kept prefix KV. Response token 0
//! is scored from the prefix's last row; tokens `1..` from the suffix rows. The policy loss
//! ([`super::loss`]) gives `d loss / d logp` per token; backward then runs in reverse:
//!
//! 1. suffix rows: log-softmax → lm head → final norm → decoder layers top-down; the attention
//!    backward of every layer *adds* the prefix k/v gradient of all G suffixes into one
//!    per-layer buffer; then the suffix token embeddings;
//! 2. token 0 of every response: the G gradients of the prefix's last logits are summed (in
//!    response order), then lm head → final norm of the prefix's last row;
//! 3. prefix rows: decoder layers top-down, each adding the suffixes' k/v gradient to its own
//!    rows' k/v gradient; then prompt text embeddings, and the media rows' gradient to
//!    4. the merger, then the vision tower (window-permuted), then the patch embedding — unless
//!    frozen.
//!
//! Activation policy ([`TrainConfig::kept_layers`], the plan's kept activation layers): the
//! first `kept_layers` text layers keep every activation (`CacheMode::Full`), the others their
//! input (`CacheMode::LayerInputs`) and are recomputed just before their backward; the vision
//! tower keeps everything only when every text layer does. The forward ops are deterministic
//! and row-independent, so a recomputed layer has bitwise the kept activations and every
//! policy gives bitwise the same gradients.
//!
//! The trainer runs on one rank's part of the model ([`RankModel::forward_backward`]) over a
//! communicator; [`forward_backward`] is rank 0 of a group of one. Under tensor parallelism the
//! loss runs on replicated log-probs (every rank computes the same `dlogp`), the vocab-parallel
//! head's `dlogits` come from the global log-sum-exp the forward kept and `d xn` is all-reduced,
//! each block backward brings its own collectives (`block_bwd`), a rank adds the embedding rows
//! of the ids it owns, and with kv heads replicated over ranks their gradients are summed over
//! the ranks holding each head (an all-reduce with one slot per kv head).
//!
//! Invariant: gradients are *added* into the caller's rank-sized buffer (the shard's
//! [`ParamTable`](crate::model::ParamTable) offsets) in a fixed order: groups in order; in a group
//! suffix, token 0, prefix, merger, vision; within each, layers top-down. Frozen parts get no
//! gradient (their slots are left as they were). Every replicated parameter's gradient is
//! bitwise equal on every rank, so `TpPlan::unshard` of the gradients gives the full gradient.

use rollplex_kernels::cpu::{embedding_bwd, rmsnorm_bwd, rmsnorm_fwd, AttnMask};
use rollplex_plan::spec::{Recompute, TrainSpec};

use super::block_bwd::{block_bwd, grad_of, linear_backward, recompute_block, BlockCtx};
use super::loss::{policy_loss, LossBatch, LossConfig, LossMetrics, Normaliser};
use super::{check_len, Result, TrainError};
use crate::model::text::LM_CHUNK;
use crate::model::weights::{BlockParams, Linear};
use crate::model::{
    CacheMode, EncodedMedia, ForwardCache, LayerCache, MediaInput, ParamId, Prompt, Qwen25VL,
    RankModel, VisionCache,
};
use crate::tp::{Communicator, SoloComm};

#[cfg(test)]
pub(crate) use super::vision_bwd::vision_backward;

/// How the actor trains (from the job's [`TrainSpec`] and the rollout's sampling temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub loss: LossConfig,
    /// Text layers `0..kept_layers` keep every activation for backward, the others only their
    /// input (recomputed in backward); `usize::MAX` (or any count at least the model's layers)
    /// keeps all, and then also the vision tower's activations and the GPU head's logits. Set
    /// from the job (`recompute = none`: all, `full` and `auto`: none) and by each plan the
    /// trainer runs ([`TrainConfig::with_plan`]).
    pub kept_layers: usize,
    /// Text layers `0..kept_prompt_layers` keep every activation of the prompt rows in the
    /// kept prompt forwards (the GPU trainer's), the others only the rows' input (recomputed
    /// in backward). Set like `kept_layers` ([`TrainConfig::with_plan`]: the plan's
    /// `kept_prompt_layers`).
    pub kept_prompt_layers: usize,
    pub freeze_vision: bool,
    pub freeze_merger: bool,
    /// The rollout's sampling temperature: log-probs are those of `logits / temperature`.
    pub temperature: f32,
}

impl TrainConfig {
    /// `horizon`: the maximum response length (the Dr. GRPO aggregation's constant).
    pub fn from_spec(
        train: &TrainSpec,
        temperature: f32,
        dual_clip: Option<f64>,
        horizon: usize,
    ) -> Result<Self> {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "temperature {temperature} must be positive and finite"
            )));
        }
        let kept = match train.recompute {
            Recompute::None => usize::MAX,
            Recompute::Full | Recompute::Auto => 0,
        };
        Ok(TrainConfig {
            loss: LossConfig::from_spec(train.algorithm.loss(), dual_clip, horizon)?,
            kept_layers: kept,
            kept_prompt_layers: kept,
            freeze_vision: train.freeze_vision,
            freeze_merger: train.freeze_merger,
            temperature,
        })
    }

    /// The plan's kept activation layers (the compiler's answer to `recompute`).
    pub fn with_plan(mut self, plan: &rollplex_plan::Plan) -> Self {
        self.kept_layers = plan.kept_act_layers as usize;
        self.kept_prompt_layers = plan.kept_prompt_layers as usize;
        self
    }

    /// Whether every one of `layers` text layers keeps its activations.
    pub fn keeps_all(&self, layers: usize) -> bool {
        self.kept_layers >= layers
    }

    /// Whether parameter `name` (a transformers 5 name of the model's table) is trained.
    pub fn trainable(&self, name: &str) -> bool {
        if name.starts_with("model.visual.merger.") {
            !self.freeze_merger
        } else if name.starts_with("model.visual.") {
            !self.freeze_vision
        } else {
            true
        }
    }
}

/// One response of a group and its per-token training inputs (all `[tokens.len()]`).
#[derive(Clone, Copy, Debug)]
pub struct ResponseBatch<'a> {
    pub tokens: &'a [u32],
    /// Log-probs under the rollout policy (the ratio's denominator); `None`: the forward's own
    /// log-probs, detached, are the old ones (the forward runs with the rollout's weights: one
    /// optimizer step per iteration), so the ratio is exactly 1.
    pub old_logp: Option<&'a [f32]>,
    /// Log-probs under the reference model (required when `kl_coef > 0`).
    pub ref_logp: Option<&'a [f32]>,
    /// Per-token advantages (GRPO: the sample's advantage on every token).
    pub advantages: &'a [f32],
    /// Which tokens count in the loss.
    pub mask: &'a [bool],
}

/// A GRPO group: one prompt (with media) and its responses.
#[derive(Clone, Copy, Debug)]
pub struct GroupBatch<'a> {
    /// Prompt token ids, media placeholder runs included.
    pub prompt_ids: &'a [u32],
    /// The media filling the placeholder runs, in order (raw patches: the vision tower runs).
    pub media: &'a [MediaInput<'a>],
    pub responses: &'a [ResponseBatch<'a>],
}

/// What a micro-batch's forward/backward reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MicroBatchOutput {
    /// Loss metrics, normalised by the mini-batch (they add up over micro-batches).
    pub metrics: LossMetrics,
    /// Current-policy log-probs and entropies of every response, groups then responses in order.
    pub logp: Vec<Vec<f32>>,
    pub entropy: Vec<Vec<f32>>,
}

/// Forward, loss and backward of one micro-batch. Gradients are **added** into `grads` (a
/// buffer of `model.weights.table.total()` elements; zero it for a fresh micro-batch).
pub fn forward_backward(
    model: &Qwen25VL,
    cfg: &TrainConfig,
    groups: &[GroupBatch<'_>],
    norm: Normaliser,
    grads: &mut [f32],
) -> Result<MicroBatchOutput> {
    model
        .as_rank()
        .forward_backward(&SoloComm, cfg, groups, norm, grads)
}

/// The text forward's cache mode under `cfg` for a model of `layers` text layers, and the
/// vision tower's.
pub(crate) fn cache_modes(cfg: &TrainConfig, layers: usize) -> (CacheMode, CacheMode) {
    if cfg.keeps_all(layers) {
        (CacheMode::Full, CacheMode::Full)
    } else if cfg.kept_layers == 0 {
        (CacheMode::LayerInputs, CacheMode::LayerInputs)
    } else {
        (
            CacheMode::FirstLayers(cfg.kept_layers),
            CacheMode::LayerInputs,
        )
    }
}

/// A layer's full activations: the kept ones, or recomputed from the layer input.
pub(crate) enum LayerActs<'c> {
    Kept(&'c LayerCache),
    Recomputed(Box<LayerCache>),
}

impl LayerActs<'_> {
    pub(crate) fn get(&self) -> &LayerCache {
        match self {
            LayerActs::Kept(c) => c,
            LayerActs::Recomputed(c) => c,
        }
    }
}

/// `dlogits` of one row of a rank's logits (`logp` backward over the rank's vocabulary, which
/// starts at `start`): `(dlogp (1[j = target] - exp(z_j - lse))) / T`, `z = logits / T`.
fn dlogits_row(
    out: &mut [f32],
    logits: &[f32],
    start: usize,
    lse: f64,
    dlogp: f32,
    target: u32,
    t: f32,
) {
    let (tt, gl) = (t as f64, dlogp as f64);
    for (j, (o, v)) in out.iter_mut().zip(logits).enumerate() {
        let z = *v as f64 / tt;
        let p = (z - lse).exp();
        let onehot = if start + j == target as usize {
            1.0
        } else {
            0.0
        };
        *o = ((gl * (onehot - p)) / tt) as f32;
    }
}

impl RankModel<'_> {
    /// Forward, loss and backward of one micro-batch on this rank; gradients are **added** into
    /// `grads` (this rank's `weights.table.total()` elements). Every rank of a group passes the
    /// same groups and gets the same output.
    pub fn forward_backward<C: Communicator>(
        &self,
        comm: &C,
        cfg: &TrainConfig,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
        grads: &mut [f32],
    ) -> Result<MicroBatchOutput> {
        self.check_comm(comm)?;
        check_len("gradient buffer", self.weights.table.total(), grads.len())?;
        if !(cfg.temperature > 0.0 && cfg.temperature.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "temperature {} must be positive and finite",
                cfg.temperature
            )));
        }
        let prior = self.kv_set_aside(grads);
        let mut out = MicroBatchOutput::default();
        for (gi, g) in groups.iter().enumerate() {
            self.group_fwd_bwd(comm, cfg, gi, g, norm, grads, &mut out)?;
        }
        self.kv_sum_replicas(comm, prior, grads)?;
        Ok(out)
    }

    /// Forward and backward of a packed batch of text sequences (causal, no shared prefix, no
    /// loss: the caller's `dlogp`). Sequence `s` of length `n` scores its tokens `1..n` (row `j`
    /// predicts token `j + 1`); `dlogp` holds the gradient of those log-probs, sequences in
    /// order (`Σ (n_s - 1)` values, the same on every rank). Returns the log-probs (equal on
    /// every rank) and adds this rank's gradients into `grads`.
    pub fn text_forward_backward<C: Communicator>(
        &self,
        comm: &C,
        seqs: &[&[u32]],
        dlogp: &[f32],
        temperature: f32,
        grads: &mut [f32],
    ) -> Result<Vec<f32>> {
        self.check_comm(comm)?;
        check_len("gradient buffer", self.weights.table.total(), grads.len())?;
        if seqs.iter().any(|s| s.len() < 2) {
            return Err(TrainError::Invalid(
                "text_forward_backward: every sequence needs at least 2 tokens".into(),
            ));
        }
        let prompts: Vec<Prompt<'_>> = seqs
            .iter()
            .map(|s| Prompt {
                ids: &s[..s.len() - 1],
                media: &[],
            })
            .collect();
        let targets: Vec<u32> = seqs.iter().flat_map(|s| s[1..].iter().copied()).collect();
        check_len("dlogp", targets.len(), dlogp.len())?;
        let mut c = ForwardCache::new(CacheMode::Full);
        self.prefill(comm, &prompts, Some(&mut c))?;
        let (h, rows) = (self.hidden(), c.tokens);
        let mut logp = Vec::with_capacity(rows);
        for (ci, ch) in (0..rows).collect::<Vec<_>>().chunks(LM_CHUNK).enumerate() {
            let (o, n) = (ci * LM_CHUNK, ch.len());
            let logits = self.lm_head(&c.final_out[o * h..(o + n) * h], n)?;
            let (l, _, s) =
                self.vocab_logprobs_lse(comm, &logits, &targets[o..o + n], temperature)?;
            logp.extend(l);
            c.lse.extend(s);
        }
        let prior = self.kv_set_aside(grads);
        let mut dx = vec![0f32; rows * h];
        let all: Vec<usize> = (0..rows).collect();
        self.head_backward(comm, &c, &all, dlogp, &targets, temperature, &mut dx, grads)?;
        let lay = &self.weights.layout;
        for l in (0..lay.text_layers.len()).rev() {
            let ctx = self.text_ctx(&c, None);
            dx = block_bwd(
                comm,
                self.weights,
                &lay.text_layers[l],
                &c.layers[l],
                rows,
                &ctx,
                &dx,
                None,
                None,
                Some(&mut *grads),
            )?;
        }
        self.embedding_bwd_own(&c.ids, &dx, grads)?;
        self.kv_sum_replicas(comm, prior, grads)?;
        Ok(logp)
    }

    /// How a text layer's attention ran over a cache's rows (and a shared prefix's KV).
    fn text_ctx<'c>(
        &self,
        c: &'c ForwardCache,
        prefix: Option<(&'c [f32], &'c [f32])>,
    ) -> BlockCtx<'c> {
        let (prefix_k, prefix_v) = prefix.unwrap_or((&[], &[]));
        BlockCtx {
            seqs: &c.seqs,
            mask: AttnMask::Causal,
            prefix_k,
            prefix_v,
            cos: &c.cos,
            sin: &c.sin,
            dims: self.text_dims(),
            eps: self.eps(),
        }
    }

    /// A layer's activations: the kept ones, or recomputed from its input where its cache
    /// `mode` (one layer's: `Full` or `LayerInputs`) kept only that.
    pub(crate) fn layer_acts<'c, C: Communicator>(
        &self,
        comm: &C,
        p: &BlockParams,
        kept: &'c LayerCache,
        mode: CacheMode,
        rows: usize,
        ctx: &BlockCtx<'_>,
    ) -> Result<LayerActs<'c>> {
        Ok(match mode {
            CacheMode::LayerInputs => LayerActs::Recomputed(Box::new(
                recompute_block(comm, self.weights, p, &kept.x_in, rows, ctx)?.0,
            )),
            CacheMode::Full | CacheMode::FirstLayers(_) => LayerActs::Kept(kept),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn group_fwd_bwd<C: Communicator>(
        &self,
        comm: &C,
        cfg: &TrainConfig,
        gi: usize,
        g: &GroupBatch<'_>,
        norm: Normaliser,
        grads: &mut [f32],
        out: &mut MicroBatchOutput,
    ) -> Result<()> {
        let w = self.weights;
        let lay = &w.layout;
        let (mode, vision_mode) = cache_modes(cfg, lay.text_layers.len());
        let h = self.hidden();
        let vl = self.dims.vocab.len();
        let temp = cfg.temperature;

        for (r, resp) in g.responses.iter().enumerate() {
            let n = resp.tokens.len();
            let what = |x: &str| format!("group {gi} response {r} {x}");
            if let Some(old) = resp.old_logp {
                check_len(&what("old_logp"), n, old.len())?;
            }
            check_len(&what("advantages"), n, resp.advantages.len())?;
            check_len(&what("mask"), n, resp.mask.len())?;
            if let Some(rl) = resp.ref_logp {
                check_len(&what("ref_logp"), n, rl.len())?;
            }
        }
        if cfg.loss.kl_coef > 0.0 && g.responses.iter().any(|r| r.ref_logp.is_none()) {
            return Err(TrainError::Invalid(format!(
                "group {gi}: kl_coef = {} needs reference log-probs for every response",
                cfg.loss.kl_coef
            )));
        }

        // ---- forward ----
        // a frozen tower and merger need no activations: no gradient flows into them
        let vision_grad = !g.media.is_empty() && (!cfg.freeze_vision || !cfg.freeze_merger);
        let mut vcache = VisionCache::new(vision_mode);
        let enc = self.encode_media(comm, g.media, vision_grad.then_some(&mut vcache))?;
        let refs: Vec<&EncodedMedia> = enc.iter().collect();
        let mut pcache = ForwardCache::new(mode);
        let prompt = Prompt {
            ids: g.prompt_ids,
            media: &refs,
        };
        let prefix = self.prefill(comm, &[prompt], Some(&mut pcache))?.remove(0);
        let tokens: Vec<&[u32]> = g.responses.iter().map(|r| r.tokens).collect();
        let mut scache = ForwardCache::new(mode);
        let scores = self.score(comm, &prefix, &tokens, temp, Some(&mut scache))?;

        // ---- loss (replicated) ----
        let mut offsets = vec![0usize];
        let (mut logp, mut old, mut refl, mut adv, mut mask, mut ent) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let has_ref = g.responses.iter().all(|r| r.ref_logp.is_some());
        for (resp, sc) in g.responses.iter().zip(&scores) {
            logp.extend_from_slice(&sc.logp);
            ent.extend_from_slice(&sc.entropy);
            old.extend_from_slice(resp.old_logp.unwrap_or(&sc.logp));
            adv.extend_from_slice(resp.advantages);
            mask.extend_from_slice(resp.mask);
            if let Some(rl) = resp.ref_logp.filter(|_| has_ref) {
                refl.extend_from_slice(rl);
            }
            offsets.push(logp.len());
        }
        let batch = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: has_ref.then_some(&refl[..]),
            advantages: &adv,
            mask: &mask,
            entropy: Some(&ent),
        };
        let lo = policy_loss(&cfg.loss, &batch, norm)?;
        out.metrics.add(&lo.metrics);
        for sc in scores {
            out.logp.push(sc.logp);
            out.entropy.push(sc.entropy);
        }
        let dlogp = lo.dlogp;

        // ---- backward: suffix rows ----
        let layers = lay.text_layers.len();
        let pr = prefix.len as usize;
        let n_kv = pr * self.kv_width();
        let mut dpk = vec![0f32; layers * n_kv];
        let mut dpv = vec![0f32; layers * n_kv];
        let rows = scache.tokens;
        if rows > 0 {
            let mut row_dlogp = vec![0f32; rows];
            let mut targets = vec![0u32; rows];
            for (r, s) in scache.seqs.iter().enumerate() {
                for j in 0..s.len as usize {
                    row_dlogp[s.start as usize + j] = dlogp[offsets[r] + j + 1];
                    targets[s.start as usize + j] = tokens[r][j + 1];
                }
            }
            let mut dx = vec![0f32; rows * h];
            let all: Vec<usize> = (0..rows).collect();
            self.head_backward(
                comm, &scache, &all, &row_dlogp, &targets, temp, &mut dx, grads,
            )?;
            for l in (0..layers).rev() {
                let ctx = self.text_ctx(&scache, Some((prefix.layer_k(l), prefix.layer_v(l))));
                let lp = &lay.text_layers[l];
                let acts =
                    self.layer_acts(comm, lp, &scache.layers[l], mode.layer(l), rows, &ctx)?;
                let dprefix = (
                    &mut dpk[l * n_kv..(l + 1) * n_kv],
                    &mut dpv[l * n_kv..(l + 1) * n_kv],
                );
                dx = block_bwd(
                    comm,
                    w,
                    lp,
                    acts.get(),
                    rows,
                    &ctx,
                    &dx,
                    None,
                    Some(dprefix),
                    Some(&mut *grads),
                )?;
            }
            self.embedding_bwd_own(&scache.ids, &dx, grads)?;
        }

        // ---- backward: token 0 of every response, from the prefix's last row ----
        let mut dxp = vec![0f32; pr * h];
        if let Some(&first) = tokens.iter().find_map(|t| t.first()) {
            // the last row's log-sum-exp (one row: it does not depend on the target)
            let (_, _, lse0) =
                self.vocab_logprobs_lse(comm, &prefix.last_logits, &[first], temp)?;
            let start = self.dims.vocab.start;
            let mut dlast = vec![0f32; vl];
            let mut row = vec![0f32; vl];
            for (r, tk) in tokens.iter().enumerate() {
                if tk.is_empty() {
                    continue;
                }
                let d = dlogp[offsets[r]];
                dlogits_row(
                    &mut row,
                    &prefix.last_logits,
                    start,
                    lse0[0],
                    d,
                    tk[0],
                    temp,
                );
                for (a, b) in dlast.iter_mut().zip(&row) {
                    *a += b;
                }
            }
            let (x_last, xn_last, rstd_last) = self.final_norm_rows(&pcache, &[pr - 1])?;
            let mut dxn = vec![0f32; h];
            linear_backward(
                w,
                &self.head(),
                Some(&mut dxn),
                &dlast,
                &xn_last,
                1,
                Some(&mut *grads),
                false,
            )?;
            comm.all_reduce_sum(&mut dxn)?;
            rmsnorm_bwd(
                &mut dxp[(pr - 1) * h..],
                Some(grad_of(w, grads, lay.final_norm)),
                &dxn,
                &x_last,
                w.get(lay.final_norm),
                &rstd_last,
                1,
                h,
                false,
            )?;
        }

        // ---- backward: prefix rows ----
        for l in (0..layers).rev() {
            let ctx = self.text_ctx(&pcache, None);
            let lp = &lay.text_layers[l];
            let acts = self.layer_acts(comm, lp, &pcache.layers[l], mode.layer(l), pr, &ctx)?;
            let extra = (
                &dpk[l * n_kv..(l + 1) * n_kv],
                &dpv[l * n_kv..(l + 1) * n_kv],
            );
            dxp = block_bwd(
                comm,
                w,
                lp,
                acts.get(),
                pr,
                &ctx,
                &dxp,
                Some(extra),
                None,
                Some(&mut *grads),
            )?;
        }
        drop((dpk, dpv));
        // prompt inputs: text rows to the embedding table, media runs to their items
        let tok = &self.config.spec.tokens;
        let merge = self.config.vision().spatial_merge_size;
        let (mut text_ids, mut text_dx) = (Vec::new(), Vec::new());
        let mut media_d = Vec::new();
        let (mut i, mut item) = (0usize, 0usize);
        while i < pr {
            let id = g.prompt_ids[i];
            if id == tok.image_token_id || id == tok.video_token_id {
                let n = enc[item].tokens(merge);
                media_d.extend_from_slice(&dxp[i * h..(i + n) * h]);
                item += 1;
                i += n;
            } else {
                text_ids.push(id);
                text_dx.extend_from_slice(&dxp[i * h..(i + 1) * h]);
                i += 1;
            }
        }
        self.embedding_bwd_own(&text_ids, &text_dx, grads)?;

        // ---- backward: merger and vision tower ----
        if vision_grad {
            let train = (!cfg.freeze_merger, !cfg.freeze_vision);
            self.vision_backward(comm, train, g.media, &vcache, &media_d, grads)?;
        }
        Ok(())
    }

    /// The rank's lm head as a linear `[V_rank, H]`.
    fn head(&self) -> Linear {
        Linear {
            w: self.weights.layout.lm_head,
            b: None,
            out: self.dims.vocab.len(),
            inp: self.hidden(),
            row0: 0,
        }
    }

    /// `(x, rmsnorm(x), rstd)` of the given rows of a cache's final-norm input (kept values when
    /// the cache has them, recomputed otherwise: row-wise, so bitwise equal).
    fn final_norm_rows(
        &self,
        c: &ForwardCache,
        rows: &[usize],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let h = self.hidden();
        let mut x = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            x.extend_from_slice(&c.final_in[r * h..(r + 1) * h]);
        }
        if !c.final_out.is_empty() {
            let mut xn = Vec::with_capacity(x.len());
            let mut rs = Vec::with_capacity(rows.len());
            for &r in rows {
                xn.extend_from_slice(&c.final_out[r * h..(r + 1) * h]);
                rs.push(c.final_rstd[r]);
            }
            return Ok((x, xn, rs));
        }
        let w = self.weights;
        let mut xn = vec![0f32; x.len()];
        let mut rs = vec![0f32; rows.len()];
        rmsnorm_fwd(
            &mut xn,
            Some(&mut rs),
            &x,
            w.get(w.layout.final_norm),
            rows.len(),
            h,
            self.eps(),
        )?;
        Ok((x, xn, rs))
    }

    /// Backward of log-softmax, lm head (vocab-parallel: `d xn` all-reduced) and final norm over
    /// `rows` of a cache that kept each row's log-sum-exp, in chunks: writes `dx[rows, H]` (the
    /// final norm input's gradient) and adds the lm head and norm gradients.
    #[allow(clippy::too_many_arguments)]
    fn head_backward<C: Communicator>(
        &self,
        comm: &C,
        c: &ForwardCache,
        rows: &[usize],
        dlogp: &[f32],
        targets: &[u32],
        temp: f32,
        dx: &mut [f32],
        grads: &mut [f32],
    ) -> Result<()> {
        let w = self.weights;
        let lay = &w.layout;
        let (h, vl, start) = (self.hidden(), self.dims.vocab.len(), self.dims.vocab.start);
        check_len("kept log-sum-exp", rows.len(), c.lse.len())?;
        let head = self.head();
        for (ci, ch) in rows.chunks(LM_CHUNK).enumerate() {
            let n = ch.len();
            let o = ci * LM_CHUNK;
            let (x, xn, rs) = self.final_norm_rows(c, ch)?;
            let logits = self.lm_head(&xn, n)?;
            let mut dlogits = vec![0f32; n * vl];
            for i in 0..n {
                dlogits_row(
                    &mut dlogits[i * vl..(i + 1) * vl],
                    &logits[i * vl..(i + 1) * vl],
                    start,
                    c.lse[o + i],
                    dlogp[o + i],
                    targets[o + i],
                    temp,
                );
            }
            drop(logits);
            let mut dxn = vec![0f32; n * h];
            linear_backward(
                w,
                &head,
                Some(&mut dxn),
                &dlogits,
                &xn,
                n,
                Some(&mut *grads),
                false,
            )?;
            comm.all_reduce_sum(&mut dxn)?;
            rmsnorm_bwd(
                &mut dx[o * h..(o + n) * h],
                Some(grad_of(w, grads, lay.final_norm)),
                &dxn,
                &x,
                w.get(lay.final_norm),
                &rs,
                n,
                h,
                false,
            )?;
        }
        Ok(())
    }

    /// Vocab-parallel embedding backward: adds the rows of the ids this rank owns.
    fn embedding_bwd_own(&self, ids: &[u32], dx: &[f32], grads: &mut [f32]) -> Result<()> {
        let h = self.hidden();
        let range = self.dims.vocab.clone();
        let (mut own_ids, mut own_dx) = (Vec::new(), Vec::new());
        for (i, &id) in ids.iter().enumerate() {
            if range.contains(&(id as usize)) {
                own_ids.push(id - range.start as u32);
                own_dx.extend_from_slice(&dx[i * h..(i + 1) * h]);
            }
        }
        let w = self.weights;
        embedding_bwd(grad_of(w, grads, w.layout.embed), &own_dx, &own_ids, h)?;
        Ok(())
    }

    /// Whether the text kv heads are fewer than the ranks (each held by `degree / kv` ranks).
    fn kv_replicated(&self) -> bool {
        (self.config.text().num_kv_heads as usize) < self.degree
    }

    /// With replicated kv heads: takes the k/v gradients already in `grads` out (zeroing them),
    /// so that [`RankModel::kv_sum_replicas`] sums only this pass's replicas.
    fn kv_set_aside(&self, grads: &mut [f32]) -> Vec<(ParamId, Vec<f32>)> {
        if !self.kv_replicated() {
            return Vec::new();
        }
        let w = self.weights;
        w.layout
            .text_layers
            .iter()
            .flat_map(|lp| [lp.k.w, lp.v.w].into_iter().chain(lp.k.b).chain(lp.v.b))
            .map(|id| {
                let g = grad_of(w, grads, id);
                let p = g.to_vec();
                g.fill(0.0);
                (id, p)
            })
            .collect()
    }

    /// Sums this pass's k/v gradients over the ranks holding the same kv head (an all-reduce
    /// of a buffer with one slot per kv head, each rank filling its head's slot: adding zeros
    /// is exact), then adds back what [`RankModel::kv_set_aside`] took out.
    fn kv_sum_replicas<C: Communicator>(
        &self,
        comm: &C,
        prior: Vec<(ParamId, Vec<f32>)>,
        grads: &mut [f32],
    ) -> Result<()> {
        let t = self.config.text();
        let (nq, nkv) = (t.num_heads as usize, t.num_kv_heads as usize);
        for (id, p) in prior {
            let head = self.rank * (nq / self.degree) / (nq / nkv);
            let g = grad_of(self.weights, grads, id);
            let n = g.len();
            let mut all = vec![0f32; n * nkv];
            all[head * n..(head + 1) * n].copy_from_slice(g);
            comm.all_reduce_sum(&mut all)?;
            g.copy_from_slice(&all[head * n..(head + 1) * n]);
            for (g, p) in g.iter_mut().zip(p) {
                *g += p;
            }
        }
        Ok(())
    }
}
