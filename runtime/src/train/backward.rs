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
//! Activation policy ([`Recompute`]): `None` keeps every activation (`CacheMode::Full`); `Full`
//! keeps each layer's input (`CacheMode::LayerInputs`) and recomputes the layer just before its
//! backward. The forward ops are deterministic and row-independent, so a recomputed layer has
//! bitwise the kept activations and both policies give bitwise the same gradients.
//!
//! Invariant: gradients are *added* into the caller's model-sized buffer (the model's
//! [`ParamTable`](crate::model::ParamTable) offsets) in a fixed order: groups in order; in a group
//! suffix, token 0, prefix, merger, vision; within each, layers top-down. Frozen parts get no
//! gradient (their slots are left as they were).

use rollplex_kernels::cpu::{
    embedding_bwd, gelu_bwd, gelu_fwd, linear_bwd, linear_fwd, logprobs_bwd, rmsnorm_bwd,
    rmsnorm_fwd, AttnDims, AttnMask,
};
use rollplex_plan::spec::{Recompute, TrainSpec};

use super::block_bwd::{block_bwd, grad_of, linear_backward, recompute_block, BlockCtx};
use super::loss::{policy_loss, LossBatch, LossConfig, LossMetrics, Normaliser};
use super::{check_len, Result, TrainError};
use crate::model::config::VISION_RMS_EPS;
use crate::model::positions::{vision_patch_hw, vision_rope_tables};
use crate::model::{
    CacheMode, EncodedMedia, ForwardCache, LayerCache, MediaInput, Prompt, Qwen25VL, VisionCache,
};

/// Rows of the lm head per chunk in backward (bounds the logits buffer to `CHUNK x vocab`).
const LM_CHUNK: usize = 64;

/// How the actor trains (from the job's [`TrainSpec`] and the rollout's sampling temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub loss: LossConfig,
    pub recompute: Recompute,
    pub freeze_vision: bool,
    pub freeze_merger: bool,
    /// The rollout's sampling temperature: log-probs are those of `logits / temperature`.
    pub temperature: f32,
}

impl TrainConfig {
    pub fn from_spec(train: &TrainSpec, temperature: f32, dual_clip: Option<f64>) -> Result<Self> {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "temperature {temperature} must be positive and finite"
            )));
        }
        Ok(TrainConfig {
            loss: LossConfig::from_spec(train.algorithm.loss(), dual_clip)?,
            recompute: train.recompute,
            freeze_vision: train.freeze_vision,
            freeze_merger: train.freeze_merger,
            temperature,
        })
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
    /// Log-probs under the rollout policy (the ratio's denominator).
    pub old_logp: &'a [f32],
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
    check_len("gradient buffer", model.weights.table.total(), grads.len())?;
    if !(cfg.temperature > 0.0 && cfg.temperature.is_finite()) {
        return Err(TrainError::Invalid(format!(
            "temperature {} must be positive and finite",
            cfg.temperature
        )));
    }
    let mut out = MicroBatchOutput::default();
    for (gi, g) in groups.iter().enumerate() {
        group_fwd_bwd(model, cfg, gi, g, norm, grads, &mut out)?;
    }
    Ok(out)
}

fn text_dims(model: &Qwen25VL) -> AttnDims {
    let t = model.config.text();
    AttnDims {
        num_heads: t.num_heads as usize,
        num_kv_heads: t.num_kv_heads as usize,
        head_dim: t.head_dim() as usize,
    }
}

fn cache_mode(r: Recompute) -> CacheMode {
    match r {
        Recompute::None => CacheMode::Full,
        Recompute::Full => CacheMode::LayerInputs,
    }
}

/// A layer's full activations: the kept ones, or recomputed from the layer input.
enum LayerActs<'c> {
    Kept(&'c LayerCache),
    Recomputed(Box<LayerCache>),
}

impl LayerActs<'_> {
    fn get(&self) -> &LayerCache {
        match self {
            LayerActs::Kept(c) => c,
            LayerActs::Recomputed(c) => c,
        }
    }
}

fn layer_acts<'c>(
    model: &Qwen25VL,
    p: &crate::model::weights::BlockParams,
    kept: &'c LayerCache,
    mode: CacheMode,
    rows: usize,
    ctx: &BlockCtx<'_>,
) -> Result<LayerActs<'c>> {
    Ok(match mode {
        CacheMode::Full => LayerActs::Kept(kept),
        CacheMode::LayerInputs => LayerActs::Recomputed(Box::new(
            recompute_block(&model.weights, p, &kept.x_in, rows, ctx)?.0,
        )),
    })
}

#[allow(clippy::too_many_arguments)]
fn group_fwd_bwd(
    model: &Qwen25VL,
    cfg: &TrainConfig,
    gi: usize,
    g: &GroupBatch<'_>,
    norm: Normaliser,
    grads: &mut [f32],
    out: &mut MicroBatchOutput,
) -> Result<()> {
    let mode = cache_mode(cfg.recompute);
    let w = &model.weights;
    let lay = &w.layout;
    let t = model.config.text();
    let (h, vocab) = (t.hidden_size as usize, t.vocab_size as usize);
    let eps = t.rms_norm_eps as f32;
    let dims = text_dims(model);
    let temp = cfg.temperature;

    for (r, resp) in g.responses.iter().enumerate() {
        let n = resp.tokens.len();
        let what = |x: &str| format!("group {gi} response {r} {x}");
        check_len(&what("old_logp"), n, resp.old_logp.len())?;
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
    let vision_grad = !g.media.is_empty() && (!cfg.freeze_vision || !cfg.freeze_merger);
    let mut vcache = VisionCache::new(mode);
    let enc = model.encode_media(g.media, if vision_grad { Some(&mut vcache) } else { None })?;
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let mut pcache = ForwardCache::new(mode);
    let prefix = model
        .prefill(
            &[Prompt {
                ids: g.prompt_ids,
                media: &refs,
            }],
            Some(&mut pcache),
        )?
        .remove(0);
    let tokens: Vec<&[u32]> = g.responses.iter().map(|r| r.tokens).collect();
    let mut scache = ForwardCache::new(mode);
    let scores = model.score(&prefix, &tokens, temp, Some(&mut scache))?;

    // ---- loss ----
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
        old.extend_from_slice(resp.old_logp);
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
    let kvw = dims.kv_width();
    let mut dpk = vec![0f32; layers * pr * kvw];
    let mut dpv = vec![0f32; layers * pr * kvw];
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
        head_backward(
            model, &scache, &all, &row_dlogp, &targets, temp, &mut dx, grads,
        )?;
        for l in (0..layers).rev() {
            let ctx = BlockCtx {
                seqs: &scache.seqs,
                mask: AttnMask::Causal,
                prefix_k: prefix.layer_k(l),
                prefix_v: prefix.layer_v(l),
                cos: &scache.cos,
                sin: &scache.sin,
                dims,
                eps,
            };
            let lp = &lay.text_layers[l];
            let acts = layer_acts(model, lp, &scache.layers[l], mode, rows, &ctx)?;
            let n = pr * kvw;
            let dprefix = (&mut dpk[l * n..(l + 1) * n], &mut dpv[l * n..(l + 1) * n]);
            dx = block_bwd(
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
        embedding_bwd(grad_of(w, grads, lay.embed), &dx, &scache.ids, h)?;
    }

    // ---- backward: token 0 of every response, from the prefix's last row ----
    let mut dxp = vec![0f32; pr * h];
    let mut dlast = vec![0f32; vocab];
    let mut row = vec![0f32; vocab];
    let mut any_first = false;
    for (r, tk) in tokens.iter().enumerate() {
        if tk.is_empty() {
            continue;
        }
        any_first = true;
        logprobs_bwd(
            &mut row,
            &[dlogp[offsets[r]]],
            None,
            &prefix.last_logits,
            &tk[..1],
            1,
            vocab,
            temp,
        )?;
        for (a, b) in dlast.iter_mut().zip(&row) {
            *a += b;
        }
    }
    if any_first {
        let (x_last, xn_last, rstd_last) = final_norm_rows(model, &pcache, &[pr - 1])?;
        let mut dxn = vec![0f32; h];
        let head = grad_of(w, grads, lay.lm_head);
        linear_bwd(
            Some(&mut dxn),
            Some(head),
            None,
            &dlast,
            &xn_last,
            w.get(lay.lm_head),
            1,
            h,
            vocab,
            false,
        )?;
        let wn = w.get(lay.final_norm);
        rmsnorm_bwd(
            &mut dxp[(pr - 1) * h..],
            Some(grad_of(w, grads, lay.final_norm)),
            &dxn,
            &x_last,
            wn,
            &rstd_last,
            1,
            h,
            false,
        )?;
    }

    // ---- backward: prefix rows ----
    for l in (0..layers).rev() {
        let ctx = BlockCtx {
            seqs: &pcache.seqs,
            mask: AttnMask::Causal,
            prefix_k: &[],
            prefix_v: &[],
            cos: &pcache.cos,
            sin: &pcache.sin,
            dims,
            eps,
        };
        let lp = &lay.text_layers[l];
        let acts = layer_acts(model, lp, &pcache.layers[l], mode, pr, &ctx)?;
        let n = pr * kvw;
        let extra = (&dpk[l * n..(l + 1) * n], &dpv[l * n..(l + 1) * n]);
        dxp = block_bwd(
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
    let tok = &model.config.spec.tokens;
    let merge = model.config.vision().spatial_merge_size;
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
    embedding_bwd(grad_of(w, grads, lay.embed), &text_dx, &text_ids, h)?;

    // ---- backward: merger and vision tower ----
    if vision_grad {
        vision_backward(model, cfg, g, &vcache, &media_d, grads)?;
    }
    Ok(())
}

/// `(x, rmsnorm(x), rstd)` of the given rows of a cache's final-norm input (kept values when the
/// cache has them, recomputed otherwise: row-wise, so bitwise equal).
fn final_norm_rows(
    model: &Qwen25VL,
    c: &ForwardCache,
    rows: &[usize],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let h = model.config.text().hidden_size as usize;
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
    let w = &model.weights;
    let mut xn = vec![0f32; x.len()];
    let mut rs = vec![0f32; rows.len()];
    let eps = model.config.text().rms_norm_eps as f32;
    rmsnorm_fwd(
        &mut xn,
        Some(&mut rs),
        &x,
        w.get(w.layout.final_norm),
        rows.len(),
        h,
        eps,
    )?;
    Ok((x, xn, rs))
}

/// Backward of log-softmax, lm head and final norm over `rows` of a cache, in chunks: writes
/// `dx[rows, H]` (the final norm input's gradient) and adds the lm head and norm gradients.
#[allow(clippy::too_many_arguments)]
fn head_backward(
    model: &Qwen25VL,
    c: &ForwardCache,
    rows: &[usize],
    dlogp: &[f32],
    targets: &[u32],
    temp: f32,
    dx: &mut [f32],
    grads: &mut [f32],
) -> Result<()> {
    let w = &model.weights;
    let lay = &w.layout;
    let t = model.config.text();
    let (h, v) = (t.hidden_size as usize, t.vocab_size as usize);
    for (ci, ch) in rows.chunks(LM_CHUNK).enumerate() {
        let n = ch.len();
        let o = ci * LM_CHUNK;
        let (x, xn, rs) = final_norm_rows(model, c, ch)?;
        let mut logits = vec![0f32; n * v];
        linear_fwd(&mut logits, &xn, w.get(lay.lm_head), None, n, h, v)?;
        let mut dlogits = vec![0f32; n * v];
        logprobs_bwd(
            &mut dlogits,
            &dlogp[o..o + n],
            None,
            &logits,
            &targets[o..o + n],
            n,
            v,
            temp,
        )?;
        drop(logits);
        let mut dxn = vec![0f32; n * h];
        let head = grad_of(w, grads, lay.lm_head);
        linear_bwd(
            Some(&mut dxn),
            Some(head),
            None,
            &dlogits,
            &xn,
            w.get(lay.lm_head),
            n,
            h,
            v,
            false,
        )?;
        let wn = w.get(lay.final_norm);
        rmsnorm_bwd(
            &mut dx[o * h..(o + n) * h],
            Some(grad_of(w, grads, lay.final_norm)),
            &dxn,
            &x,
            wn,
            &rs,
            n,
            h,
            false,
        )?;
    }
    Ok(())
}

/// The vision RoPE tables of a media batch in window-permuted order (what `encode_media`
/// builds; recomputed when the cache kept only layer inputs).
fn vision_rope_permuted(
    model: &Qwen25VL,
    media: &[MediaInput<'_>],
    window_index: &[u32],
) -> (Vec<f32>, Vec<f32>) {
    let v = model.config.vision();
    let m = v.spatial_merge_size;
    let unit = (m * m) as usize;
    let hd = model.config.vision_head_dim();
    let grids: Vec<_> = media.iter().map(|it| it.grid).collect();
    let (cos0, sin0) = vision_rope_tables(
        &vision_patch_hw(&grids, m),
        hd,
        model.config.vision_rope_theta,
    );
    let permute = |src: &[f32]| {
        let mut out = vec![0f32; src.len()];
        for (i, &gi) in window_index.iter().enumerate() {
            let (d, s) = (i * unit * hd, gi as usize * unit * hd);
            out[d..d + unit * hd].copy_from_slice(&src[s..s + unit * hd]);
        }
        out
    };
    (permute(&cos0), permute(&sin0))
}

/// Backward of the merger (unless frozen: then only its input gradient) and the vision tower
/// (unless frozen). `d_embeds` is the gradient of the items' embeddings, concatenated in order.
pub(crate) fn vision_backward(
    model: &Qwen25VL,
    cfg: &TrainConfig,
    g: &GroupBatch<'_>,
    vc: &VisionCache,
    d_embeds: &[f32],
    grads: &mut [f32],
) -> Result<()> {
    let w = &model.weights;
    let lay = &w.layout;
    let v = model.config.vision();
    let m = v.spatial_merge_size;
    let unit = (m * m) as usize;
    let vh = v.hidden_size as usize;
    let pd = model.config.patch_dim();
    let n = vc.pixels.len() / pd;
    let groups = n / unit;
    let (mh, out_w) = (lay.merger_fc1.out, lay.merger_fc2.out);
    check_len("media embedding gradient", groups * out_w, d_embeds.len())?;
    let hd = model.config.vision_head_dim();
    let dims = AttnDims {
        num_heads: v.num_heads as usize,
        num_kv_heads: v.num_heads as usize,
        head_dim: hd,
    };
    let (cos, sin) = if vc.cos.is_empty() {
        vision_rope_permuted(model, g.media, &vc.window_index)
    } else {
        (vc.cos.clone(), vc.sin.clone())
    };
    let depth = lay.vision_blocks.len();
    let ctx_of = |b: usize| BlockCtx {
        seqs: if v.fullatt_block_indexes.contains(&(b as u32)) {
            &vc.full_seqs
        } else {
            &vc.window_seqs
        },
        mask: AttnMask::Full,
        prefix_k: &[],
        prefix_v: &[],
        cos: &cos,
        sin: &sin,
        dims,
        eps: VISION_RMS_EPS,
    };

    // merger activations: kept, or recomputed from the last block's input
    let mut last_block: Option<LayerCache> = None;
    let (merger_in, rstd, xn, fc1, gel) = if vc.merger_in.is_empty() {
        let (c, x) = recompute_block(
            w,
            &lay.vision_blocks[depth - 1],
            &vc.blocks[depth - 1].x_in,
            n,
            &ctx_of(depth - 1),
        )?;
        last_block = Some(c);
        let mut rstd = vec![0f32; n];
        let mut xn = vec![0f32; n * vh];
        rmsnorm_fwd(
            &mut xn,
            Some(&mut rstd),
            &x,
            w.get(lay.merger_ln),
            n,
            vh,
            VISION_RMS_EPS,
        )?;
        let mut fc1 = vec![0f32; groups * mh];
        linear_fwd(
            &mut fc1,
            &xn,
            w.lin_w(&lay.merger_fc1),
            w.lin_b(&lay.merger_fc1),
            groups,
            mh,
            mh,
        )?;
        let mut gel = vec![0f32; fc1.len()];
        gelu_fwd(&mut gel, &fc1)?;
        (x, rstd, xn, fc1, gel)
    } else {
        (
            vc.merger_in.clone(),
            vc.merger_rstd.clone(),
            vc.merger_xn.clone(),
            vc.merger_fc1.clone(),
            vc.merger_gelu.clone(),
        )
    };

    // unpermute: embeds row gi came from merged row i with window_index[i] = gi
    let mut d_merged = vec![0f32; groups * out_w];
    for (i, &gi) in vc.window_index.iter().enumerate() {
        let gi = gi as usize;
        d_merged[i * out_w..(i + 1) * out_w]
            .copy_from_slice(&d_embeds[gi * out_w..(gi + 1) * out_w]);
    }
    let train_merger = !cfg.freeze_merger;
    let mut dg = vec![0f32; groups * mh];
    linear_backward(
        w,
        &lay.merger_fc2,
        Some(&mut dg),
        &d_merged,
        &gel,
        groups,
        train_merger.then_some(&mut *grads),
        false,
    )?;
    let mut dfc1 = vec![0f32; groups * mh];
    gelu_bwd(&mut dfc1, &dg, &fc1)?;
    drop(dg);
    if cfg.freeze_vision && !train_merger {
        return Ok(());
    }
    let mut dxn = vec![0f32; groups * mh];
    let fc1_grads = train_merger.then_some(&mut *grads);
    linear_backward(
        w,
        &lay.merger_fc1,
        Some(&mut dxn),
        &dfc1,
        &xn,
        groups,
        fc1_grads,
        false,
    )?;
    let mut dx = vec![0f32; n * vh];
    let dln = if train_merger {
        Some(grad_of(w, grads, lay.merger_ln))
    } else {
        None
    };
    rmsnorm_bwd(
        &mut dx,
        dln,
        &dxn,
        &merger_in,
        w.get(lay.merger_ln),
        &rstd,
        n,
        vh,
        false,
    )?;
    if cfg.freeze_vision {
        return Ok(());
    }
    drop((dxn, dfc1, merger_in, xn, fc1, gel));
    for b in (0..depth).rev() {
        let ctx = ctx_of(b);
        let bp = &lay.vision_blocks[b];
        let recomputed;
        let acts: &LayerCache = match (&vc.mode, last_block.take()) {
            (CacheMode::Full, _) => &vc.blocks[b],
            (CacheMode::LayerInputs, Some(c)) if b == depth - 1 => {
                recomputed = c;
                &recomputed
            }
            (CacheMode::LayerInputs, _) => {
                recomputed = recompute_block(w, bp, &vc.blocks[b].x_in, n, &ctx)?.0;
                &recomputed
            }
        };
        dx = block_bwd(w, bp, acts, n, &ctx, &dx, None, None, Some(&mut *grads))?;
    }
    // undo the window permutation, then the patch embedding's weight gradient
    let mut dx0 = vec![0f32; n * vh];
    for (i, &gi) in vc.window_index.iter().enumerate() {
        let (d, s) = (gi as usize * unit * vh, i * unit * vh);
        dx0[d..d + unit * vh].copy_from_slice(&dx[s..s + unit * vh]);
    }
    let dpatch = grad_of(w, grads, lay.patch_embed);
    linear_bwd(
        None,
        Some(dpatch),
        None,
        &dx0,
        &vc.pixels,
        w.get(lay.patch_embed),
        n,
        pd,
        vh,
        false,
    )?;
    Ok(())
}
