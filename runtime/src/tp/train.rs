//! A training micro-batch under TP: `train::forward_backward` (GRPO groups: the vision tower,
//! the prompt prefilled once, every response scored over the prompt's KV, the policy loss, and
//! the backward through all of it) on one rank's shard.
//!
//! The loss runs on replicated log-probs (every rank computes the same `dlogp`); the backward
//! follows the single-rank order (suffix rows, token 0 from the prompt's last row, prompt rows,
//! prompt embeddings, merger and tower) with the collectives of `super::backward`. A rank's
//! prefix KV gradient covers its own kv heads.
//!
//! `freeze_vision` / `freeze_merger` as the single-rank trainer: a frozen part gets no gradient
//! (its slots in `grads` are left as they were); with both frozen the tower keeps no activations
//! and its backward does not run; with only the tower frozen the merger's gradients come from
//! its kept activations and the backward stops at the merger's input. Activations are always
//! kept in full (the `recompute` setting changes memory, not results, so results agree).

use rollplex_kernels::cpu::{
    embedding_bwd, linear_fwd, rmsnorm_bwd, rmsnorm_fwd, AttnMask, AttnSeq,
};

use crate::model::block::Attend;
use crate::model::positions::mrope_tables;
use crate::model::weights::Linear;
use crate::model::{CacheMode, EncodedMedia, LayerCache, Prompt, VisionCache};
use crate::train::backward::{GroupBatch, MicroBatchOutput, TrainConfig};
use crate::train::block_bwd::{grad_of, linear_backward};
use crate::train::loss::{policy_loss, LossBatch, Normaliser};

use super::backward::{input, train_err, BwdCtx};
use super::comm::Communicator;
use super::{TpError, TpModel};

/// Rows per lm-head chunk in backward (as the single-rank trainer).
const LM_CHUNK: usize = 64;

/// A text forward's kept activations on this rank.
struct TextActs {
    layers: Vec<LayerCache>,
    /// Final norm input `[T, H]`, `1/rms` `[T]`, output `[T, H]`.
    x: Vec<f32>,
    rstd: Vec<f32>,
    xn: Vec<f32>,
    /// Each layer's k/v `[L, T, local KV]`.
    k: Vec<f32>,
    v: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl TpModel {
    /// Forward, loss and backward of one micro-batch on this rank (see
    /// `train::forward_backward`); gradients are added into `grads` (this shard's size).
    /// Every rank passes the same groups and gets the same output.
    pub fn forward_backward<C: Communicator>(
        &self,
        comm: &C,
        cfg: &TrainConfig,
        groups: &[GroupBatch<'_>],
        norm: Normaliser,
        grads: &mut [f32],
    ) -> Result<MicroBatchOutput, TpError> {
        self.check_comm(comm)?;
        if grads.len() != self.weights.table.total() {
            return Err(input(format!(
                "gradient buffer has {} elements, rank {}'s shard {}",
                grads.len(),
                self.rank,
                self.weights.table.total()
            )));
        }
        if !(cfg.temperature > 0.0 && cfg.temperature.is_finite()) {
            return Err(input(format!(
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

    /// Runs the decoder over packed rows, keeping every activation.
    #[allow(clippy::too_many_arguments)]
    fn text_acts<C: Communicator>(
        &self,
        comm: &C,
        mut x: Vec<f32>,
        rows: usize,
        pos: &[Vec<i64>; 3],
        seqs: &[AttnSeq],
        prefix: Option<(&[f32], &[f32], usize)>,
    ) -> Result<TextActs, TpError> {
        let t = self.plan.config.text();
        let (h, hd) = (t.hidden_size as usize, t.head_dim() as usize);
        let eps = t.rms_norm_eps as f32;
        let (cos, sin) = mrope_tables(pos, hd, t.rope_theta, t.mrope_section);
        let dims = self.local_dims();
        let (mut layers, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (l, lp) in self.weights.layout.text_layers.iter().enumerate() {
            let (pk, pv) = match prefix {
                Some((k, v, n)) => (&k[l * n..(l + 1) * n], &v[l * n..(l + 1) * n]),
                None => (&[][..], &[][..]),
            };
            let mut c = LayerCache::default();
            let (k, v) = super::block::block_fwd(
                comm,
                &self.weights,
                lp,
                &mut x,
                rows,
                dims,
                eps,
                &cos,
                &sin,
                Attend::Packed {
                    seqs,
                    mask: AttnMask::Causal,
                    prefix_k: pk,
                    prefix_v: pv,
                },
                Some(&mut c),
            )?;
            layers.push(c);
            ks.extend_from_slice(&k);
            vs.extend_from_slice(&v);
        }
        let mut xn = vec![0f32; rows * h];
        let mut rstd = vec![0f32; rows];
        rmsnorm_fwd(
            &mut xn,
            Some(&mut rstd),
            &x,
            self.weights.get(self.weights.layout.final_norm),
            rows,
            h,
            eps,
        )?;
        Ok(TextActs {
            layers,
            x,
            rstd,
            xn,
            k: ks,
            v: vs,
            cos,
            sin,
        })
    }

    /// The rank's logits of normed rows `[n, H]`.
    fn head_logits(&self, xn: &[f32], n: usize) -> Result<Vec<f32>, TpError> {
        let h = self.plan.config.text().hidden_size as usize;
        let vl = self.dims().vocab.len();
        let mut logits = vec![0f32; n * vl];
        linear_fwd(
            &mut logits,
            xn,
            self.weights.get(self.weights.layout.lm_head),
            None,
            n,
            h,
            vl,
        )?;
        Ok(logits)
    }

    /// This rank's `dlogits` of one row (`logp` backward, vocab-parallel):
    /// `(dlogp (1[j = target] - exp(z_j - lse))) / T` over the rank's vocabulary.
    fn dlogits_row(
        &self,
        out: &mut [f32],
        logits: &[f32],
        lse: f64,
        dlogp: f32,
        target: u32,
        t: f32,
    ) {
        let start = self.dims().vocab.start;
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
    ) -> Result<(), TpError> {
        let w = &self.weights;
        let lay = &w.layout;
        let t = self.plan.config.text();
        let h = t.hidden_size as usize;
        let temp = cfg.temperature;
        let vl = self.dims().vocab.len();
        for (r, resp) in g.responses.iter().enumerate() {
            let n = resp.tokens.len();
            for (what, len) in [
                ("old_logp", resp.old_logp.len()),
                ("advantages", resp.advantages.len()),
                ("mask", resp.mask.len()),
            ] {
                if len != n {
                    return Err(input(format!(
                        "group {gi} response {r} {what}: expected {n} elements, got {len}"
                    )));
                }
            }
        }
        if cfg.loss.kl_coef > 0.0 && g.responses.iter().any(|r| r.ref_logp.is_none()) {
            return Err(input(format!(
                "group {gi}: kl_coef = {} needs reference log-probs for every response",
                cfg.loss.kl_coef
            )));
        }
        // ---- forward: media, prompt, responses ----
        // a frozen tower and merger need no activations: no gradient flows into them
        let vision_grad = !g.media.is_empty() && (!cfg.freeze_vision || !cfg.freeze_merger);
        let mut vc = VisionCache::new(CacheMode::Full);
        let enc = if g.media.is_empty() {
            Vec::new()
        } else {
            self.encode_impl(comm, g.media, vision_grad.then_some(&mut vc))?
        };
        let refs: Vec<&EncodedMedia> = enc.iter().collect();
        let prompt = Prompt {
            ids: g.prompt_ids,
            media: &refs,
        };
        if prompt.ids.is_empty() {
            return Err(input(format!("group {gi}: the prompt is empty")));
        }
        let (xp, ppos, delta) = self.prompt_inputs(comm, &prompt)?;
        let pr = g.prompt_ids.len();
        let pseqs = [AttnSeq {
            start: 0,
            len: pr as u32,
            prefix_start: 0,
            prefix_len: 0,
        }];
        let pacts = self.text_acts(comm, xp, pr, &ppos, &pseqs, None)?;
        let kvw = self.kv_width();
        let layers = lay.text_layers.len();
        // the prompt's last-row logits (token 0 of every response)
        let last_logits = self.head_logits(&pacts.xn[(pr - 1) * h..pr * h], 1)?;
        // responses: rows tokens[r][..len-1] over the prompt's KV
        let tokens: Vec<&[u32]> = g.responses.iter().map(|r| r.tokens).collect();
        let (mut ids, mut targets, mut sseqs) = (Vec::new(), Vec::new(), Vec::new());
        let mut spos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for tk in &tokens {
            let n = tk.len().saturating_sub(1);
            sseqs.push(AttnSeq {
                start: ids.len() as u32,
                len: n as u32,
                prefix_start: 0,
                prefix_len: pr as u32,
            });
            for j in 0..n {
                ids.push(tk[j]);
                targets.push(tk[j + 1]);
                let p = pr as i64 + j as i64 + delta;
                for q in spos.iter_mut() {
                    q.push(p);
                }
            }
        }
        let rows = ids.len();
        let sacts = if rows > 0 {
            let x = self.embed(comm, &ids)?;
            Some(self.text_acts(
                comm,
                x,
                rows,
                &spos,
                &sseqs,
                Some((&pacts.k, &pacts.v, pr * kvw)),
            )?)
        } else {
            None
        };
        // log-probs: suffix rows in chunks, then token 0 of each response
        let (mut lp, mut ent, mut lse) = (Vec::new(), Vec::new(), Vec::new());
        if let Some(a) = &sacts {
            for (ci, ch) in (0..rows).collect::<Vec<_>>().chunks(LM_CHUNK).enumerate() {
                let o = ci * LM_CHUNK;
                let n = ch.len();
                let logits = self.head_logits(&a.xn[o * h..(o + n) * h], n)?;
                let (l, e, s) = self.vocab_logprobs_lse(comm, &logits, &targets[o..o + n], temp)?;
                lp.extend(l);
                ent.extend(e);
                lse.extend(s);
            }
        }
        let firsts: Vec<u32> = tokens.iter().filter_map(|t| t.first().copied()).collect();
        let rep: Vec<f32> = firsts.iter().flat_map(|_| last_logits.clone()).collect();
        let (l0, e0, lse0) = self.vocab_logprobs_lse(comm, &rep, &firsts, temp)?;
        // ---- loss (replicated) ----
        let mut offsets = vec![0usize];
        let (mut logp, mut old, mut refl, mut adv, mut mask, mut entv) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let has_ref = g.responses.iter().all(|r| r.ref_logp.is_some());
        let mut fi = 0;
        for (resp, s) in g.responses.iter().zip(&sseqs) {
            let (mut rl, mut re) = (Vec::new(), Vec::new());
            if !resp.tokens.is_empty() {
                rl.push(l0[fi]);
                re.push(e0[fi]);
                fi += 1;
                let (a, n) = (s.start as usize, s.len as usize);
                rl.extend_from_slice(&lp[a..a + n]);
                re.extend_from_slice(&ent[a..a + n]);
            }
            logp.extend_from_slice(&rl);
            entv.extend_from_slice(&re);
            old.extend_from_slice(resp.old_logp);
            adv.extend_from_slice(resp.advantages);
            mask.extend_from_slice(resp.mask);
            if let Some(r) = resp.ref_logp.filter(|_| has_ref) {
                refl.extend_from_slice(r);
            }
            offsets.push(logp.len());
            out.logp.push(rl);
            out.entropy.push(re);
        }
        let batch = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: has_ref.then_some(&refl[..]),
            advantages: &adv,
            mask: &mask,
            entropy: Some(&entv),
        };
        let lo = policy_loss(&cfg.loss, &batch, norm).map_err(train_err)?;
        out.metrics.add(&lo.metrics);
        let dlogp = lo.dlogp;
        let head = Linear {
            w: lay.lm_head,
            b: None,
            out: vl,
            inp: h,
            row0: 0,
        };

        // ---- backward: suffix rows ----
        let n_kv = pr * kvw;
        let mut dpk = vec![0f32; layers * n_kv];
        let mut dpv = vec![0f32; layers * n_kv];
        if let Some(a) = &sacts {
            let mut row_dlogp = vec![0f32; rows];
            for (r, s) in sseqs.iter().enumerate() {
                for j in 0..s.len as usize {
                    row_dlogp[s.start as usize + j] = dlogp[offsets[r] + j + 1];
                }
            }
            let mut dx = vec![0f32; rows * h];
            for (ci, ch) in (0..rows).collect::<Vec<_>>().chunks(LM_CHUNK).enumerate() {
                let (o, n) = (ci * LM_CHUNK, ch.len());
                let xn = &a.xn[o * h..(o + n) * h];
                let logits = self.head_logits(xn, n)?;
                let mut dlogits = vec![0f32; n * vl];
                for i in 0..n {
                    self.dlogits_row(
                        &mut dlogits[i * vl..(i + 1) * vl],
                        &logits[i * vl..(i + 1) * vl],
                        lse[o + i],
                        row_dlogp[o + i],
                        targets[o + i],
                        temp,
                    );
                }
                let mut dxn = vec![0f32; n * h];
                linear_backward(
                    w,
                    &head,
                    Some(&mut dxn),
                    &dlogits,
                    xn,
                    n,
                    Some(&mut *grads),
                    false,
                )
                .map_err(train_err)?;
                comm.all_reduce_sum(&mut dxn)?;
                rmsnorm_bwd(
                    &mut dx[o * h..(o + n) * h],
                    Some(grad_of(w, grads, lay.final_norm)),
                    &dxn,
                    &a.x[o * h..(o + n) * h],
                    w.get(lay.final_norm),
                    &a.rstd[o..o + n],
                    n,
                    h,
                    false,
                )?;
            }
            for l in (0..layers).rev() {
                let ctx = BwdCtx {
                    seqs: &sseqs,
                    mask: AttnMask::Causal,
                    dims: self.local_dims(),
                    cos: &a.cos,
                    sin: &a.sin,
                    prefix_k: &pacts.k[l * n_kv..(l + 1) * n_kv],
                    prefix_v: &pacts.v[l * n_kv..(l + 1) * n_kv],
                };
                let dprefix = (
                    &mut dpk[l * n_kv..(l + 1) * n_kv],
                    &mut dpv[l * n_kv..(l + 1) * n_kv],
                );
                dx = self.block_bwd(
                    comm,
                    &lay.text_layers[l],
                    &a.layers[l],
                    rows,
                    &ctx,
                    &dx,
                    None,
                    Some(dprefix),
                    grads,
                )?;
            }
            self.embedding_bwd_own(&ids, &dx, grads)?;
        }

        // ---- backward: token 0 of every response, from the prompt's last row ----
        let mut dxp = vec![0f32; pr * h];
        if !firsts.is_empty() {
            let mut dlast = vec![0f32; vl];
            let mut row = vec![0f32; vl];
            let mut fi = 0;
            for (r, tk) in tokens.iter().enumerate() {
                if tk.is_empty() {
                    continue;
                }
                self.dlogits_row(
                    &mut row,
                    &last_logits,
                    lse0[fi],
                    dlogp[offsets[r]],
                    tk[0],
                    temp,
                );
                fi += 1;
                for (a, b) in dlast.iter_mut().zip(&row) {
                    *a += b;
                }
            }
            let xn_last = &pacts.xn[(pr - 1) * h..pr * h];
            let mut dxn = vec![0f32; h];
            linear_backward(
                w,
                &head,
                Some(&mut dxn),
                &dlast,
                xn_last,
                1,
                Some(&mut *grads),
                false,
            )
            .map_err(train_err)?;
            comm.all_reduce_sum(&mut dxn)?;
            rmsnorm_bwd(
                &mut dxp[(pr - 1) * h..],
                Some(grad_of(w, grads, lay.final_norm)),
                &dxn,
                &pacts.x[(pr - 1) * h..pr * h],
                w.get(lay.final_norm),
                &pacts.rstd[pr - 1..pr],
                1,
                h,
                false,
            )?;
        }

        // ---- backward: prompt rows ----
        for l in (0..layers).rev() {
            let ctx = BwdCtx {
                seqs: &pseqs,
                mask: AttnMask::Causal,
                dims: self.local_dims(),
                cos: &pacts.cos,
                sin: &pacts.sin,
                prefix_k: &[],
                prefix_v: &[],
            };
            let extra = (
                &dpk[l * n_kv..(l + 1) * n_kv],
                &dpv[l * n_kv..(l + 1) * n_kv],
            );
            dxp = self.block_bwd(
                comm,
                &lay.text_layers[l],
                &pacts.layers[l],
                pr,
                &ctx,
                &dxp,
                Some(extra),
                None,
                grads,
            )?;
        }
        // prompt inputs: text rows to the embedding table, media runs to their items
        let tok = &self.plan.config.spec.tokens;
        let merge = self.plan.config.vision().spatial_merge_size;
        let (mut text_ids, mut text_dx, mut media_d) = (Vec::new(), Vec::new(), Vec::new());
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
        // ---- backward: merger and vision tower (unless both frozen) ----
        if vision_grad {
            let train = (!cfg.freeze_merger, !cfg.freeze_vision);
            self.vision_backward(comm, train, &vc, &media_d, grads)?;
        }
        Ok(())
    }

    /// Vocab-parallel embedding backward: adds the rows of the ids this rank owns.
    fn embedding_bwd_own(&self, ids: &[u32], dx: &[f32], grads: &mut [f32]) -> Result<(), TpError> {
        let h = self.plan.config.text().hidden_size as usize;
        let range = self.dims().vocab.clone();
        let (mut own_ids, mut own_dx) = (Vec::new(), Vec::new());
        for (i, &id) in ids.iter().enumerate() {
            if range.contains(&(id as usize)) {
                own_ids.push(id - range.start as u32);
                own_dx.extend_from_slice(&dx[i * h..(i + 1) * h]);
            }
        }
        let w = &self.weights;
        embedding_bwd(grad_of(w, grads, w.layout.embed), &own_dx, &own_ids, h)?;
        Ok(())
    }
}
