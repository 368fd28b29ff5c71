//! The tensor-parallel text decoder: the operations of `model::text` on one rank's shard.
//!
//! - Embedding, vocab-parallel: a rank copies the rows of the ids it owns, zeros elsewhere; an
//!   all-reduce sums them (exact: each element is one value plus zeros).
//! - Decoder layers: [`super::block::block_fwd`] with the rank's heads; the KV a prefill keeps
//!   and the [`KvArena`] a rank decodes over hold the rank's kv heads only.
//! - lm head, vocab-parallel: a rank computes the logits of its vocabulary range `[n, V/T]`.
//!   [`vocab_logprobs`] computes log-softmax statistics without gathering logits: the max is
//!   all-reduced (Max), then `sum exp(z - max)` and `sum p z` (f64, as the single-rank kernel)
//!   are all-reduced (Sum), and the target's logit comes from its owning rank (the others add
//!   0). [`greedy`] gathers each rank's (max, index) and takes the first maximum. [`gather_logits`]
//!   gathers full rows when a caller needs them (sampling, checks).
//!
//! A rank's [`PrefixState`] has `kv_width` = the rank's kv heads x head dim and `last_logits` =
//! the rank's vocabulary shard of the last prompt token's logits.
//!
//! Invariant: replicated activations (the residual stream, normed hidden states) are bitwise
//! equal on every rank, because every value entering them is either replicated or all-reduced.

use rollplex_kernels::cpu::{linear_fwd, rmsnorm_fwd, AttnDims, AttnMask, AttnSeq, DecodeSeq};

use crate::model::block::Attend;
use crate::model::positions::{mrope_tables, rope_index, MediaSlot};
use crate::model::{
    DecodeSlot, EncodedMedia, KvArena, ModelError, PrefixState, Prompt, TokenScores,
};

use super::comm::{all_gather_uneven, Communicator, ReduceOp};
use super::{split_range, TpError, TpModel};

/// Rows of hidden states per lm-head chunk (as the single-rank model).
const LM_CHUNK: usize = 64;

/// Log-probs `[n]`, entropies `[n]` and each row's log-sum-exp of `logits / T` (f64) `[n]`.
type LogprobsLse = (Vec<f32>, Vec<f32>, Vec<f64>);

/// A prompt's embeddings `[len, H]`, 3D positions and rope delta.
type PromptInputs = (Vec<f32>, [Vec<i64>; 3], i64);

fn input(msg: String) -> TpError {
    TpError::Model(ModelError::Input(msg))
}

impl TpModel {
    fn t_hidden(&self) -> usize {
        self.plan.config.text().hidden_size as usize
    }
    fn vocab(&self) -> usize {
        self.plan.config.text().vocab_size as usize
    }
    fn eps(&self) -> f32 {
        self.plan.config.text().rms_norm_eps as f32
    }
    fn head_dim(&self) -> usize {
        self.plan.config.text().head_dim() as usize
    }
    /// This rank's attention dims (its query and kv heads).
    pub(crate) fn local_dims(&self) -> AttnDims {
        let d = self.dims();
        AttnDims {
            num_heads: d.q_heads,
            num_kv_heads: d.kv_heads,
            head_dim: self.head_dim(),
        }
    }
    /// Width of this rank's KV rows.
    pub fn kv_width(&self) -> usize {
        self.dims().kv_heads * self.head_dim()
    }
    /// A KV arena for this rank's kv heads with `capacity` rows.
    pub fn kv_arena(&self, capacity: u32) -> KvArena {
        KvArena::new(
            self.plan.config.text().num_layers as usize,
            self.kv_width(),
            capacity,
        )
    }
    /// Vocabulary entries each rank owns (the counts of a logits gather).
    pub fn vocab_counts(&self) -> Vec<usize> {
        (0..self.plan.degree)
            .map(|r| split_range(self.vocab(), self.plan.degree, r).len())
            .collect()
    }

    /// Token embeddings `[ids, H]`, vocab-parallel.
    pub fn embed<C: Communicator>(&self, comm: &C, ids: &[u32]) -> Result<Vec<f32>, TpError> {
        self.check_comm(comm)?;
        let (h, voc) = (self.t_hidden(), self.vocab());
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= voc) {
            return Err(input(format!(
                "token id {bad} outside the vocabulary of {voc}"
            )));
        }
        let range = self.dims().vocab.clone();
        let table = self.weights.get(self.weights.layout.embed);
        let mut x = vec![0f32; ids.len() * h];
        for (row, &id) in x.chunks_mut(h.max(1)).zip(ids) {
            let id = id as usize;
            if range.contains(&id) {
                let j = id - range.start;
                row.copy_from_slice(&table[j * h..(j + 1) * h]);
            }
        }
        comm.all_reduce_sum(&mut x)?;
        Ok(x)
    }

    /// Embeddings of a prompt with its media placeholders filled, and its 3D positions.
    pub(crate) fn prompt_inputs<C: Communicator>(
        &self,
        comm: &C,
        p: &Prompt<'_>,
    ) -> Result<PromptInputs, TpError> {
        let cfg = &self.plan.config;
        let tok = &cfg.spec.tokens;
        let m = cfg.vision().spatial_merge_size;
        let slots: Vec<MediaSlot> = p
            .media
            .iter()
            .map(|e| MediaSlot {
                kind: e.kind,
                grid: e.grid,
            })
            .collect();
        let (pos, delta) = rope_index(
            p.ids,
            &slots,
            tok.image_token_id,
            tok.video_token_id,
            m,
            cfg.tokens_per_second,
        )?;
        let mut x = self.embed(comm, p.ids)?;
        let h = self.t_hidden();
        let mut item = 0;
        let mut i = 0;
        while i < p.ids.len() {
            let id = p.ids[i];
            if id == tok.image_token_id || id == tok.video_token_id {
                let e: &EncodedMedia = p.media[item];
                let n = e.tokens(m);
                if e.embeds.len() != n * h {
                    return Err(input(format!(
                        "media item {item}: {} embedding values, expected {n} x {h}",
                        e.embeds.len()
                    )));
                }
                x[i * h..(i + n) * h].copy_from_slice(&e.embeds);
                item += 1;
                i += n;
            } else {
                i += 1;
            }
        }
        Ok((x, pos, delta))
    }

    /// Every decoder layer over a packed batch, in place. Returns the rank's k/v of every layer
    /// `[L, T, local KV]` when `keep_kv`.
    #[allow(clippy::too_many_arguments)]
    fn decoder_packed<C: Communicator>(
        &self,
        comm: &C,
        x: &mut [f32],
        rows: usize,
        cos: &[f32],
        sin: &[f32],
        seqs: &[AttnSeq],
        prefix: Option<&PrefixState>,
        keep_kv: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), TpError> {
        let dims = self.local_dims();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (l, lp) in self.weights.layout.text_layers.iter().enumerate() {
            let (pk, pv) = match prefix {
                Some(p) => (p.layer_k(l), p.layer_v(l)),
                None => (&[][..], &[][..]),
            };
            let attend = Attend::Packed {
                seqs,
                mask: AttnMask::Causal,
                prefix_k: pk,
                prefix_v: pv,
            };
            let (k, v) = super::block::block_fwd(
                comm,
                &self.weights,
                lp,
                x,
                rows,
                dims,
                self.eps(),
                cos,
                sin,
                attend,
                None,
            )?;
            if keep_kv {
                ks.extend_from_slice(&k);
                vs.extend_from_slice(&v);
            }
        }
        Ok((ks, vs))
    }

    /// Final norm (replicated) of the given rows of `x [T, H]`.
    fn final_norm(&self, x: &[f32], rows: &[usize]) -> Result<Vec<f32>, TpError> {
        let h = self.t_hidden();
        let mut g = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            g.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        let mut out = vec![0f32; g.len()];
        rmsnorm_fwd(
            &mut out,
            None,
            &g,
            self.weights.get(self.weights.layout.final_norm),
            rows.len(),
            h,
            self.eps(),
        )?;
        Ok(out)
    }

    /// The rank's logits `[n, V_rank]` of normed hidden rows `[n, H]`.
    fn lm_head(&self, xn: &[f32], n: usize) -> Result<Vec<f32>, TpError> {
        let (h, vl) = (self.t_hidden(), self.dims().vocab.len());
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

    /// Prefill on this rank: each prompt once (packed, causal) -> its prefix state (the rank's
    /// KV heads, the rank's vocabulary shard of the last logits).
    pub fn prefill<C: Communicator>(
        &self,
        comm: &C,
        prompts: &[Prompt<'_>],
    ) -> Result<Vec<PrefixState>, TpError> {
        Ok(self.prefill_impl(comm, prompts, false)?.0)
    }

    /// Full-sequence forward of one prompt: this rank's logits of every position `[len, V_rank]`
    /// (gather them with [`TpModel::gather_logits`]).
    pub fn forward_logits<C: Communicator>(
        &self,
        comm: &C,
        prompt: Prompt<'_>,
    ) -> Result<Vec<f32>, TpError> {
        Ok(self.prefill_impl(comm, &[prompt], true)?.1)
    }

    fn prefill_impl<C: Communicator>(
        &self,
        comm: &C,
        prompts: &[Prompt<'_>],
        all_logits: bool,
    ) -> Result<(Vec<PrefixState>, Vec<f32>), TpError> {
        self.check_comm(comm)?;
        let t = self.plan.config.text();
        let hd = self.head_dim();
        let mut x = Vec::new();
        let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut seqs = Vec::new();
        let mut deltas = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if p.ids.is_empty() {
                return Err(input(format!("prompt {i} is empty")));
            }
            let (xe, pp, d) = self.prompt_inputs(comm, p)?;
            seqs.push(AttnSeq {
                start: pos[0].len() as u32,
                len: p.ids.len() as u32,
                prefix_start: 0,
                prefix_len: 0,
            });
            x.extend_from_slice(&xe);
            for s in 0..3 {
                pos[s].extend_from_slice(&pp[s]);
            }
            deltas.push(d);
        }
        let rows = pos[0].len();
        let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
        let (ks, vs) = self.decoder_packed(comm, &mut x, rows, &cos, &sin, &seqs, None, true)?;
        let last: Vec<usize> = seqs
            .iter()
            .map(|s| (s.start + s.len - 1) as usize)
            .collect();
        let xn = self.final_norm(&x, &last)?;
        let last_logits = self.lm_head(&xn, last.len())?;
        let mut full = Vec::new();
        if all_logits {
            let all: Vec<usize> = (0..rows).collect();
            for ch in all.chunks(LM_CHUNK) {
                let xn = self.final_norm(&x, ch)?;
                full.extend(self.lm_head(&xn, ch.len())?);
            }
        }
        let (layers, kvw, vl) = (
            t.num_layers as usize,
            self.kv_width(),
            self.dims().vocab.len(),
        );
        let states = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (a, n) = (s.start as usize, s.len as usize);
                let mut k = Vec::with_capacity(layers * n * kvw);
                let mut vv = Vec::with_capacity(layers * n * kvw);
                for l in 0..layers {
                    let base = l * rows * kvw;
                    k.extend_from_slice(&ks[base + a * kvw..base + (a + n) * kvw]);
                    vv.extend_from_slice(&vs[base + a * kvw..base + (a + n) * kvw]);
                }
                PrefixState {
                    len: s.len,
                    rope_delta: deltas[i],
                    layers,
                    kv_width: kvw,
                    k,
                    v: vv,
                    last_logits: last_logits[i * vl..(i + 1) * vl].to_vec(),
                }
            })
            .collect();
        Ok((states, full))
    }

    /// One decode step on this rank (see `Qwen25VL::decode_step`): `tokens[b]` joins sample
    /// `b`'s suffix in this rank's arena; returns the rank's logits `[B, V_rank]`. Advances each
    /// slot's `suffix_len`. Every rank must pass the same slots and tokens.
    pub fn decode_step<C: Communicator>(
        &self,
        comm: &C,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, TpError> {
        self.check_comm(comm)?;
        let b = slots.len();
        let t = self.plan.config.text();
        let hd = self.head_dim();
        if tokens.len() != b {
            return Err(input(format!(
                "decode_step: {b} slots and {} tokens",
                tokens.len()
            )));
        }
        if arena.layers != t.num_layers as usize || arena.kv_width != self.kv_width() {
            return Err(input(format!(
                "decode_step: the KV arena ({} layers x {} KV width) was not made for rank {} \
                 ({} x {}); use TpModel::kv_arena",
                arena.layers,
                arena.kv_width,
                self.rank,
                t.num_layers,
                self.kv_width()
            )));
        }
        DecodeSlot::check_batch(slots, arena.capacity).map_err(input)?;
        let mut x = self.embed(comm, tokens)?;
        let p: Vec<i64> = slots.iter().map(DecodeSlot::next_position).collect();
        let pos = [p.clone(), p.clone(), p];
        let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
        let seqs: Vec<DecodeSeq> = slots.iter().map(DecodeSlot::decode_seq).collect();
        let write_rows: Vec<u32> = slots.iter().map(DecodeSlot::write_row).collect();
        let dims = self.local_dims();
        let ll = arena.layer_len();
        for (l, lp) in self.weights.layout.text_layers.iter().enumerate() {
            let attend = Attend::Decode {
                k_cache: &mut arena.k[l * ll..(l + 1) * ll],
                v_cache: &mut arena.v[l * ll..(l + 1) * ll],
                seqs: &seqs,
                write_rows: &write_rows,
            };
            super::block::block_fwd(
                comm,
                &self.weights,
                lp,
                &mut x,
                b,
                dims,
                self.eps(),
                &cos,
                &sin,
                attend,
                None,
            )?;
        }
        let all: Vec<usize> = (0..b).collect();
        let xn = self.final_norm(&x, &all)?;
        let logits = self.lm_head(&xn, b)?;
        for s in slots.iter_mut() {
            s.suffix_len += 1;
        }
        Ok(logits)
    }

    /// Log-probs and entropies of `responses` given a kept prefix state (this rank's), at
    /// `temperature`, with the vocab-parallel log-softmax; every rank returns the same scores.
    pub fn score<C: Communicator>(
        &self,
        comm: &C,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temperature: f32,
    ) -> Result<Vec<TokenScores>, TpError> {
        self.check_comm(comm)?;
        let t = self.plan.config.text();
        let hd = self.head_dim();
        let vl = self.dims().vocab.len();
        if prefix.layers != t.num_layers as usize
            || prefix.kv_width != self.kv_width()
            || prefix.last_logits.len() != vl
        {
            return Err(input(format!(
                "score: the prefix state was not made by rank {} of this model",
                self.rank
            )));
        }
        let mut ids = Vec::new();
        let mut targets = Vec::new();
        let mut seqs = Vec::new();
        let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for r in responses {
            let n = r.len().saturating_sub(1);
            seqs.push(AttnSeq {
                start: ids.len() as u32,
                len: n as u32,
                prefix_start: 0,
                prefix_len: prefix.len,
            });
            for j in 0..n {
                ids.push(r[j]);
                targets.push(r[j + 1]);
                let p = prefix.len as i64 + j as i64 + prefix.rope_delta;
                for q in pos.iter_mut() {
                    q.push(p);
                }
            }
        }
        let rows = ids.len();
        let mut lp = Vec::with_capacity(rows);
        let mut ent = Vec::with_capacity(rows);
        if rows > 0 {
            let mut x = self.embed(comm, &ids)?;
            let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
            self.decoder_packed(comm, &mut x, rows, &cos, &sin, &seqs, Some(prefix), false)?;
            let all: Vec<usize> = (0..rows).collect();
            for (ci, ch) in all.chunks(LM_CHUNK).enumerate() {
                let xn = self.final_norm(&x, ch)?;
                let logits = self.lm_head(&xn, ch.len())?;
                let o = ci * LM_CHUNK;
                let (l, e) =
                    self.vocab_logprobs(comm, &logits, &targets[o..o + ch.len()], temperature)?;
                lp.extend(l);
                ent.extend(e);
            }
        }
        // token 0 of every non-empty response, from the prefix's last logits (one batch)
        let firsts: Vec<u32> = responses
            .iter()
            .filter_map(|r| r.first().copied())
            .collect();
        let mut first_logits = Vec::with_capacity(firsts.len() * vl);
        for _ in &firsts {
            first_logits.extend_from_slice(&prefix.last_logits);
        }
        let (l0, e0) = self.vocab_logprobs(comm, &first_logits, &firsts, temperature)?;
        let mut out = Vec::with_capacity(responses.len());
        let mut fi = 0;
        for (r, s) in responses.iter().zip(&seqs) {
            if r.is_empty() {
                out.push(TokenScores {
                    logp: Vec::new(),
                    entropy: Vec::new(),
                });
                continue;
            }
            let (a, n) = (s.start as usize, s.len as usize);
            let mut logp = vec![l0[fi]];
            logp.extend_from_slice(&lp[a..a + n]);
            let mut entropy = vec![e0[fi]];
            entropy.extend_from_slice(&ent[a..a + n]);
            fi += 1;
            out.push(TokenScores { logp, entropy });
        }
        Ok(out)
    }

    /// Vocab-parallel log-softmax at given targets: this rank's logits `[n, V_rank]`, global
    /// target ids `[n]` -> (log p(target), entropy), both `[n]`, equal on every rank.
    ///
    /// With `z = logits / temperature`, as `logprobs_fwd`: `m = max z` (all-reduce Max),
    /// `s = sum exp(z - m)` in f64 (all-reduce Sum), `lse = m + ln s`; then `sum exp(z - lse) z`
    /// in f64 and the target's `z` (owning rank; others add 0) in one all-reduce Sum.
    pub fn vocab_logprobs<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
        targets: &[u32],
        temperature: f32,
    ) -> Result<(Vec<f32>, Vec<f32>), TpError> {
        let (logp, ent, _) = self.vocab_logprobs_lse(comm, logits, targets, temperature)?;
        Ok((logp, ent))
    }

    /// [`TpModel::vocab_logprobs`] plus each row's global log-sum-exp of `z` (f64, what the
    /// backward reads).
    pub(crate) fn vocab_logprobs_lse<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
        targets: &[u32],
        temperature: f32,
    ) -> Result<LogprobsLse, TpError> {
        let n = targets.len();
        let range = self.dims().vocab.clone();
        let vl = range.len();
        if logits.len() != n * vl {
            return Err(input(format!(
                "vocab_logprobs: {} logits for {n} rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(input(format!(
                "temperature must be positive and finite, got {temperature}"
            )));
        }
        if let Some(bad) = targets.iter().find(|&&x| x as usize >= self.vocab()) {
            return Err(input(format!(
                "target id {bad} outside the vocabulary of {}",
                self.vocab()
            )));
        }
        let tt = temperature as f64;
        let rows = |r: usize| &logits[r * vl..(r + 1) * vl];
        let mut m: Vec<f64> = (0..n)
            .map(|r| {
                rows(r)
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64 / tt))
            })
            .collect();
        comm.all_reduce(&mut m, ReduceOp::Max)?;
        let mut s: Vec<f64> = (0..n)
            .map(|r| {
                if m[r] == f64::NEG_INFINITY {
                    return 0.0;
                }
                rows(r).iter().map(|v| (*v as f64 / tt - m[r]).exp()).sum()
            })
            .collect();
        comm.all_reduce_sum(&mut s)?;
        let lse: Vec<f64> = (0..n)
            .map(|r| {
                if m[r] == f64::NEG_INFINITY {
                    m[r]
                } else {
                    m[r] + s[r].ln()
                }
            })
            .collect();
        // [pz_0, zt_0, pz_1, zt_1, ...]
        let mut pz = vec![0f64; 2 * n];
        for r in 0..n {
            pz[2 * r] = rows(r)
                .iter()
                .map(|v| {
                    let z = *v as f64 / tt;
                    (z - lse[r]).exp() * z
                })
                .sum();
            let tg = targets[r] as usize;
            if range.contains(&tg) {
                pz[2 * r + 1] = rows(r)[tg - range.start] as f64 / tt;
            }
        }
        comm.all_reduce_sum(&mut pz)?;
        let logp = (0..n).map(|r| (pz[2 * r + 1] - lse[r]) as f32).collect();
        let ent = (0..n).map(|r| (lse[r] - pz[2 * r]) as f32).collect();
        Ok((logp, ent, lse))
    }

    /// Greedy tokens of rows of this rank's logits `[n, V_rank]`: the first index of the
    /// largest logit over the whole vocabulary (NaN never wins; as `argmax`). Equal on every
    /// rank.
    pub fn greedy<C: Communicator>(&self, comm: &C, logits: &[f32]) -> Result<Vec<u32>, TpError> {
        let range = self.dims().vocab.clone();
        let vl = range.len();
        if vl == 0 || !logits.len().is_multiple_of(vl) {
            return Err(input(format!(
                "greedy: {} logits are not rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        let n = logits.len() / vl;
        // (value, global index) per row; f64 holds both exactly
        let mut mine = vec![0f64; 2 * n];
        for (r, row) in logits.chunks(vl).enumerate() {
            let mut best = 0usize;
            let mut bv = f32::NEG_INFINITY;
            for (j, v) in row.iter().enumerate() {
                if *v > bv {
                    bv = *v;
                    best = j;
                }
            }
            mine[2 * r] = bv as f64;
            mine[2 * r + 1] = (range.start + best) as f64;
        }
        let w = comm.world();
        let mut all = vec![0f64; 2 * n * w];
        comm.all_gather(&mine, &mut all)?;
        Ok((0..n)
            .map(|r| {
                // ranks own ascending ranges: a strictly larger value on a later rank wins
                let mut bv = all[2 * r];
                let mut bi = all[2 * r + 1];
                for k in 1..w {
                    let v = all[k * 2 * n + 2 * r];
                    if v > bv {
                        bv = v;
                        bi = all[k * 2 * n + 2 * r + 1];
                    }
                }
                bi as u32
            })
            .collect())
    }

    /// Full logit rows `[n, V]` from every rank's `[n, V_rank]` (an all-gather, then each row
    /// assembled in vocabulary order).
    pub fn gather_logits<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
    ) -> Result<Vec<f32>, TpError> {
        let counts = self.vocab_counts();
        let vl = counts[self.rank];
        if vl == 0 || !logits.len().is_multiple_of(vl) {
            return Err(input(format!(
                "gather_logits: {} logits are not rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        let n = logits.len() / vl;
        let all_counts: Vec<usize> = counts.iter().map(|c| c * n).collect();
        let all = all_gather_uneven(comm, logits, &all_counts)?;
        let v = self.vocab();
        let mut out = vec![0f32; n * v];
        let (mut off, mut col) = (0, 0);
        for &c in &counts {
            for r in 0..n {
                out[r * v + col..r * v + col + c]
                    .copy_from_slice(&all[off + r * c..off + (r + 1) * c]);
            }
            off += c * n;
            col += c;
        }
        Ok(out)
    }
}
