//! The text decoder and the operations the RL loop runs on it: `prefill` (prompt -> prefix
//! state, once per GRPO group), `decode_step` (one token per sample over a KV arena laid out as
//! [shared group prefix | per-sample suffix]), `score` (log-probs of given responses from a kept
//! prefix state plus the response suffix), and `forward_logits` (a full-sequence forward as
//! Hugging Face's `model(...)`, for checks).
//!
//! Positions: prompt tokens get `get_rope_index` positions; every later token at sequence index
//! `n` gets `n + rope_delta` in all three sections (what `generate` does in transformers).
//!
//! The operations run on one rank's part of the model ([`RankModel`]) over a communicator; the
//! [`Qwen25VL`] methods are rank 0 of a group of one (`SoloComm`). Under tensor parallelism:
//! - the embedding is vocab-parallel: a rank copies the rows of the ids it owns, zeros elsewhere;
//!   an all-reduce sums them (exact: each element is one value plus zeros);
//! - decoder layers are [`block_fwd`] with the rank's heads; the KV a prefill keeps and the
//!   [`KvArena`] a rank decodes over hold the rank's kv heads only;
//! - the lm head is vocab-parallel: a rank computes the logits of its vocabulary range
//!   `[n, V/T]`. [`RankModel::vocab_logprobs`] computes log-softmax statistics without gathering
//!   logits: the max is all-reduced (Max), then `sum exp(z - max)` and `sum p z` (f64) are
//!   all-reduced (Sum), and the target's logit comes from its owning rank (the others add 0).
//!   [`RankModel::greedy`] gathers each rank's (max, index) and takes the first maximum;
//!   [`RankModel::gather_logits`] gathers full rows when a caller needs them.
//!
//! A rank's [`PrefixState`] has `kv_width` = the rank's kv heads x head dim and `last_logits` =
//! the rank's vocabulary shard of the last prompt token's logits.
//!
//! Invariants: (1) a response's log-probs from `score` are bitwise those of the logits that
//! `decode_step` produced for the same tokens (same attention key order, row-independent
//! matmuls); (2) scoring G responses in one call gives bitwise the scores of G separate calls;
//! (3) prefill-then-decode logits equal the full forward's rows bitwise when positions agree
//! (always, unless a video's temporal positions exceed its spatial ones; see `positions`);
//! (4) replicated activations (the residual stream, normed hidden states) are bitwise equal on
//! every rank, because every value entering them is either replicated or all-reduced.

use rollplex_kernels::cpu::{linear_fwd, rmsnorm_fwd, AttnDims, AttnMask, AttnSeq, DecodeSeq};

use super::block::{block_fwd, Attend};
use super::cache::{CacheMode, ForwardCache, LayerCache};
use super::positions::{mrope_tables, rope_index, MediaSlot};
use super::vision::EncodedMedia;
use super::{ModelError, Qwen25VL, RankModel};
use crate::tp::{split_range, Communicator, SoloComm};

/// A prompt: token ids (media placeholders included) and the encoded media filling its
/// placeholder runs, in order.
#[derive(Clone, Copy, Debug)]
pub struct Prompt<'a> {
    pub ids: &'a [u32],
    pub media: &'a [&'a EncodedMedia],
}

/// What a prompt leaves for its samples: the KV of every layer and the logits of its last token.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixState {
    /// Prompt tokens.
    pub len: u32,
    /// Position of the token at sequence index `n >= len` is `n + rope_delta` (all sections).
    pub rope_delta: i64,
    pub layers: usize,
    /// `kv_heads * head_dim`.
    pub kv_width: usize,
    /// `[layers, len, kv_width]`, after RoPE.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Logits of the last prompt token `[vocab]` (the first response token's distribution).
    pub last_logits: Vec<f32>,
}

impl PrefixState {
    pub fn layer_k(&self, l: usize) -> &[f32] {
        let n = self.len as usize * self.kv_width;
        &self.k[l * n..(l + 1) * n]
    }
    pub fn layer_v(&self, l: usize) -> &[f32] {
        let n = self.len as usize * self.kv_width;
        &self.v[l * n..(l + 1) * n]
    }
}

/// A contiguous run of rows of a [`KvArena`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvSpan {
    pub offset: u32,
    pub len: u32,
}

/// KV cache of every layer in one buffer: `k` and `v` are `[layers, capacity, kv_width]`.
/// Rows are handed out by the caller (the plan): a group's prefix span is written once by
/// [`KvArena::store_prefix`], each sample's suffix span is filled by `decode_step`.
#[derive(Clone, Debug, PartialEq)]
pub struct KvArena {
    pub(crate) layers: usize,
    pub(crate) kv_width: usize,
    pub(crate) capacity: u32,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl KvArena {
    pub fn new(layers: usize, kv_width: usize, capacity: u32) -> Self {
        let n = layers * capacity as usize * kv_width;
        KvArena {
            layers,
            kv_width,
            capacity,
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }
    /// An arena for `model` with `capacity` rows.
    pub fn for_model(model: &Qwen25VL, capacity: u32) -> Self {
        model.as_rank().kv_arena(capacity)
    }
    pub fn capacity(&self) -> u32 {
        self.capacity
    }
    /// Bytes of the arena (both K and V).
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }
    pub(crate) fn layer_len(&self) -> usize {
        self.capacity as usize * self.kv_width
    }
    /// Copies a prefix's KV into rows `offset..offset + prefix.len`.
    pub fn store_prefix(
        &mut self,
        offset: u32,
        prefix: &PrefixState,
    ) -> Result<KvSpan, ModelError> {
        if prefix.layers != self.layers || prefix.kv_width != self.kv_width {
            return Err(ModelError::Input(format!(
                "prefix of {} layers x {} KV width does not fit an arena of {} x {}",
                prefix.layers, prefix.kv_width, self.layers, self.kv_width
            )));
        }
        let end = offset as u64 + prefix.len as u64;
        if end > self.capacity as u64 {
            return Err(ModelError::Input(format!(
                "prefix rows {offset}..{end} exceed the arena's {} rows",
                self.capacity
            )));
        }
        let (ll, w) = (self.layer_len(), self.kv_width);
        for l in 0..self.layers {
            let dst = l * ll + offset as usize * w;
            let n = prefix.len as usize * w;
            self.k[dst..dst + n].copy_from_slice(prefix.layer_k(l));
            self.v[dst..dst + n].copy_from_slice(prefix.layer_v(l));
        }
        Ok(KvSpan {
            offset,
            len: prefix.len,
        })
    }
}

/// One sample's place in a [`KvArena`] during decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeSlot {
    /// The group's shared prefix.
    pub prefix: KvSpan,
    pub rope_delta: i64,
    /// First row of this sample's suffix and the rows reserved for it.
    pub suffix_offset: u32,
    pub suffix_capacity: u32,
    /// Tokens already decoded into the suffix.
    pub suffix_len: u32,
}

impl DecodeSlot {
    pub fn new(prefix: KvSpan, rope_delta: i64, suffix_offset: u32, suffix_capacity: u32) -> Self {
        DecodeSlot {
            prefix,
            rope_delta,
            suffix_offset,
            suffix_capacity,
            suffix_len: 0,
        }
    }

    /// The M-RoPE position (all three sections) of the token this step appends.
    pub fn next_position(&self) -> i64 {
        self.prefix.len as i64 + self.suffix_len as i64 + self.rope_delta
    }

    /// The arena row this step's K/V are written to.
    pub fn write_row(&self) -> u32 {
        self.suffix_offset + self.suffix_len
    }

    /// What this step's attention reads: the prefix, then the suffix including the new row.
    pub fn decode_seq(&self) -> DecodeSeq {
        DecodeSeq {
            prefix_offset: self.prefix.offset,
            prefix_len: self.prefix.len,
            suffix_offset: self.suffix_offset,
            suffix_len: self.suffix_len + 1,
        }
    }

    /// Checks a decode batch against an arena of `capacity` rows: every suffix has room for one
    /// more token, every span lies inside the arena, suffixes are disjoint from each other and
    /// from every prefix (prefixes may be shared). The message names the sample(s). Every
    /// backend's `decode_step` runs this check.
    pub fn check_batch(slots: &[DecodeSlot], capacity: u32) -> Result<(), String> {
        let mut suffixes: Vec<(u64, u64, usize)> = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            if s.suffix_len >= s.suffix_capacity {
                return Err(format!(
                    "decode_step: sample {i}'s suffix is full ({} rows)",
                    s.suffix_capacity
                ));
            }
            let send = s.suffix_offset as u64 + s.suffix_capacity as u64;
            let pend = s.prefix.offset as u64 + s.prefix.len as u64;
            if send > capacity as u64 || pend > capacity as u64 {
                return Err(format!(
                    "decode_step: sample {i}'s spans exceed the arena's {capacity} rows"
                ));
            }
            suffixes.push((s.suffix_offset as u64, send, i));
        }
        suffixes.sort();
        for w in suffixes.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(format!(
                    "decode_step: suffixes of samples {} and {} overlap",
                    w[0].2, w[1].2
                ));
            }
        }
        for s in slots {
            let (pa, pb) = (
                s.prefix.offset as u64,
                s.prefix.offset as u64 + s.prefix.len as u64,
            );
            if let Some(&(_, _, i)) = suffixes.iter().find(|(a, e, _)| *a < pb && pa < *e) {
                return Err(format!(
                    "decode_step: sample {i}'s suffix overlaps a prefix span"
                ));
            }
        }
        Ok(())
    }
}

/// Per-token scores of one response.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScores {
    /// `log p(token_j | prompt, tokens_<j)` at the given temperature, `[len]`.
    pub logp: Vec<f32>,
    /// Entropy of each token's distribution, `[len]`.
    pub entropy: Vec<f32>,
}

/// A prompt's embeddings `[len, H]`, 3D positions and rope delta.
type PromptInputs = (Vec<f32>, [Vec<i64>; 3], i64);

/// Rows of hidden states per lm-head chunk (bounds the logits buffer to `CHUNK x vocab`).
pub(crate) const LM_CHUNK: usize = 64;

pub(crate) fn input(msg: String) -> ModelError {
    ModelError::Input(msg)
}

impl RankModel<'_> {
    pub(crate) fn hidden(&self) -> usize {
        self.config.text().hidden_size as usize
    }
    pub(crate) fn vocab(&self) -> usize {
        self.config.text().vocab_size as usize
    }
    pub(crate) fn eps(&self) -> f32 {
        self.config.text().rms_norm_eps as f32
    }
    fn head_dim(&self) -> usize {
        self.config.text().head_dim() as usize
    }
    /// This rank's attention dims (its query and kv heads).
    pub(crate) fn text_dims(&self) -> AttnDims {
        AttnDims {
            num_heads: self.dims.q_heads,
            num_kv_heads: self.dims.kv_heads,
            head_dim: self.head_dim(),
        }
    }
    /// Width of this rank's KV rows.
    pub fn kv_width(&self) -> usize {
        self.dims.kv_heads * self.head_dim()
    }
    /// A KV arena for this rank's kv heads with `capacity` rows.
    pub fn kv_arena(&self, capacity: u32) -> KvArena {
        KvArena::new(
            self.config.text().num_layers as usize,
            self.kv_width(),
            capacity,
        )
    }
    /// Vocabulary entries each rank owns (the counts of a logits gather).
    pub fn vocab_counts(&self) -> Vec<usize> {
        (0..self.degree)
            .map(|r| split_range(self.vocab(), self.degree, r).len())
            .collect()
    }

    /// Token embeddings `[ids, H]`, vocab-parallel.
    pub fn embed<C: Communicator>(&self, comm: &C, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let (h, voc) = (self.hidden(), self.vocab());
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= voc) {
            return Err(input(format!(
                "token id {bad} outside the vocabulary of {voc}"
            )));
        }
        let range = self.dims.vocab.clone();
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
    ) -> Result<PromptInputs, ModelError> {
        let cfg = self.config;
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
        let h = self.hidden();
        // rope_index checked that runs and media agree; fill each run with its item's embeddings
        let mut item = 0;
        let mut i = 0;
        while i < p.ids.len() {
            let id = p.ids[i];
            if id == tok.image_token_id || id == tok.video_token_id {
                let e = p.media[item];
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

    /// Runs every decoder layer over a packed batch `x [T, H]` in place (x ends as the final
    /// norm's input). `prefix`: a shared prefix state whose KV every sequence's `prefix_*` span
    /// indexes. Returns the rank's k/v of every layer `[L, T, KV]` when `keep_kv`.
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
        mut cache: Option<&mut ForwardCache>,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let dims = self.text_dims();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        let mode = cache.as_ref().map(|c| c.mode);
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
            let mut lc = LayerCache::default();
            let (k, v) = block_fwd(
                comm,
                self.weights,
                lp,
                x,
                rows,
                dims,
                self.eps(),
                cos,
                sin,
                attend,
                mode.map(|m| (m.layer(l), &mut lc)),
            )?;
            if let Some(c) = cache.as_deref_mut() {
                c.layers.push(lc);
            }
            if keep_kv {
                ks.extend_from_slice(&k);
                vs.extend_from_slice(&v);
            }
        }
        Ok((ks, vs))
    }

    /// Final norm (replicated) of the given rows of `x [T, H]` -> `([rows, H], 1/rms [rows])`.
    pub(crate) fn final_norm(
        &self,
        x: &[f32],
        rows: &[usize],
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let h = self.hidden();
        let mut g = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            g.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        let mut out = vec![0f32; g.len()];
        let mut rstd = vec![0f32; rows.len()];
        rmsnorm_fwd(
            &mut out,
            Some(&mut rstd),
            &g,
            self.weights.get(self.weights.layout.final_norm),
            rows.len(),
            h,
            self.eps(),
        )?;
        Ok((out, rstd))
    }

    /// The rank's logits `[n, V_rank]` of normed hidden rows `[n, H]`.
    pub(crate) fn lm_head(&self, xn: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let (h, vl) = (self.hidden(), self.dims.vocab.len());
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

    /// Prefill: runs each prompt once (packed, causal) and returns its prefix state (the rank's
    /// kv heads, the rank's vocabulary shard of the last logits). With a cache, the cache covers
    /// the packed batch of all prompts.
    pub fn prefill<C: Communicator>(
        &self,
        comm: &C,
        prompts: &[Prompt<'_>],
        cache: Option<&mut ForwardCache>,
    ) -> Result<Vec<PrefixState>, ModelError> {
        Ok(self.prefill_impl(comm, prompts, false, cache)?.0)
    }

    /// Full-sequence forward of one prompt as Hugging Face computes `model(input_ids, ...)`:
    /// this rank's logits of every position `[len, V_rank]` (gather them with
    /// [`RankModel::gather_logits`]).
    pub fn forward_logits<C: Communicator>(
        &self,
        comm: &C,
        prompt: Prompt<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.prefill_impl(comm, &[prompt], true, None)?.1)
    }

    fn prefill_impl<C: Communicator>(
        &self,
        comm: &C,
        prompts: &[Prompt<'_>],
        all_logits: bool,
        mut cache: Option<&mut ForwardCache>,
    ) -> Result<(Vec<PrefixState>, Vec<f32>), ModelError> {
        self.check_comm(comm)?;
        let t = self.config.text();
        let hd = self.head_dim();
        let mut x = Vec::new();
        let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut seqs = Vec::new();
        let mut deltas = Vec::new();
        let mut ids = Vec::new();
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
            ids.extend_from_slice(p.ids);
        }
        let rows = ids.len();
        let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
        let (ks, vs) = self.decoder_packed(
            comm,
            &mut x,
            rows,
            &cos,
            &sin,
            &seqs,
            None,
            true,
            cache.as_deref_mut(),
        )?;
        let last: Vec<usize> = seqs
            .iter()
            .map(|s| (s.start + s.len - 1) as usize)
            .collect();
        let (xn, _) = self.final_norm(&x, &last)?;
        let last_logits = self.lm_head(&xn, last.len())?;
        let mut full = Vec::new();
        if all_logits {
            let all: Vec<usize> = (0..rows).collect();
            for ch in all.chunks(LM_CHUNK) {
                let (xn, _) = self.final_norm(&x, ch)?;
                full.extend(self.lm_head(&xn, ch.len())?);
            }
        }
        if let Some(c) = cache {
            self.finish_cache(c, &x, rows, seqs.clone(), ids, cos, sin)?;
        }
        let (layers, kvw, vl) = (
            t.num_layers as usize,
            self.kv_width(),
            self.dims.vocab.len(),
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

    #[allow(clippy::too_many_arguments)]
    fn finish_cache(
        &self,
        c: &mut ForwardCache,
        x: &[f32],
        rows: usize,
        seqs: Vec<AttnSeq>,
        ids: Vec<u32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
    ) -> Result<(), ModelError> {
        c.tokens = rows;
        c.seqs = seqs;
        c.ids = ids;
        c.cos = cos;
        c.sin = sin;
        c.final_in = x.to_vec();
        if c.mode != CacheMode::LayerInputs {
            let all: Vec<usize> = (0..rows).collect();
            let (xn, rstd) = self.final_norm(x, &all)?;
            c.final_out = xn;
            c.final_rstd = rstd;
        }
        Ok(())
    }

    /// One decode step on this rank: `tokens[b]` is appended to sample `b`'s suffix (its K/V
    /// written to the rank's arena at `suffix_offset + suffix_len`), attends `[prefix | suffix]`;
    /// returns the rank's next-token logits `[B, V_rank]`. Advances each slot's `suffix_len`.
    /// Every rank must pass the same slots and tokens.
    pub fn decode_step<C: Communicator>(
        &self,
        comm: &C,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        self.check_comm(comm)?;
        let b = slots.len();
        let t = self.config.text();
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
                 of this model ({} x {})",
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
        let dims = self.text_dims();
        let ll = arena.layer_len();
        for (l, lp) in self.weights.layout.text_layers.iter().enumerate() {
            let attend = Attend::Decode {
                k_cache: &mut arena.k[l * ll..(l + 1) * ll],
                v_cache: &mut arena.v[l * ll..(l + 1) * ll],
                seqs: &seqs,
                write_rows: &write_rows,
            };
            block_fwd(
                comm,
                self.weights,
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
        let (xn, _) = self.final_norm(&x, &all)?;
        let logits = self.lm_head(&xn, b)?;
        for s in slots.iter_mut() {
            s.suffix_len += 1;
        }
        Ok(logits)
    }

    /// Log-probs (and entropies) of `responses` given a kept prefix state (this rank's), at
    /// `temperature` (logits are divided by it, as the RL loop's sampling did), with the
    /// vocab-parallel log-softmax; every rank returns the same scores. Token 0 is scored from
    /// `prefix.last_logits`; tokens `1..` from one packed forward of every response's suffix
    /// over the shared prefix KV. With a cache, it covers that packed suffix batch (rows
    /// `responses[r][..len-1]`, in order) and keeps each row's log-sum-exp.
    pub fn score<C: Communicator>(
        &self,
        comm: &C,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temperature: f32,
        mut cache: Option<&mut ForwardCache>,
    ) -> Result<Vec<TokenScores>, ModelError> {
        self.check_comm(comm)?;
        let t = self.config.text();
        let hd = self.head_dim();
        if prefix.layers != t.num_layers as usize
            || prefix.kv_width != self.kv_width()
            || prefix.last_logits.len() != self.dims.vocab.len()
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
        let (mut lp, mut ent, mut lse) = (
            Vec::with_capacity(rows),
            Vec::with_capacity(rows),
            Vec::with_capacity(rows),
        );
        if rows > 0 {
            let mut x = self.embed(comm, &ids)?;
            let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
            self.decoder_packed(
                comm,
                &mut x,
                rows,
                &cos,
                &sin,
                &seqs,
                Some(prefix),
                false,
                cache.as_deref_mut(),
            )?;
            let all: Vec<usize> = (0..rows).collect();
            for (ci, ch) in all.chunks(LM_CHUNK).enumerate() {
                let (xn, _) = self.final_norm(&x, ch)?;
                let logits = self.lm_head(&xn, ch.len())?;
                let o = ci * LM_CHUNK;
                let (l, e, s) =
                    self.vocab_logprobs_lse(comm, &logits, &targets[o..o + ch.len()], temperature)?;
                lp.extend(l);
                ent.extend(e);
                lse.extend(s);
            }
            if let Some(c) = cache {
                self.finish_cache(c, &x, rows, seqs.clone(), ids.clone(), cos, sin)?;
                c.lse = lse;
            }
        }
        // token 0 of every non-empty response, from the prefix's last logits (one batch)
        let firsts: Vec<u32> = responses
            .iter()
            .filter_map(|r| r.first().copied())
            .collect();
        let (l0, e0) = if firsts.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let first_logits = prefix.last_logits.repeat(firsts.len());
            self.vocab_logprobs(comm, &first_logits, &firsts, temperature)?
        };
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
}

/// The whole model's operations: rank 0 of a group of one.
impl Qwen25VL {
    /// Prefill: runs each prompt once (packed, causal) and returns its prefix state.
    /// With a cache, the cache covers the packed batch of all prompts.
    pub fn prefill(
        &self,
        prompts: &[Prompt<'_>],
        cache: Option<&mut ForwardCache>,
    ) -> Result<Vec<PrefixState>, ModelError> {
        self.as_rank().prefill(&SoloComm, prompts, cache)
    }

    /// Full-sequence forward of one prompt as Hugging Face computes `model(input_ids, ...)`:
    /// logits of every position `[len, V]`.
    pub fn forward_logits(&self, prompt: Prompt<'_>) -> Result<Vec<f32>, ModelError> {
        self.as_rank().forward_logits(&SoloComm, prompt)
    }

    /// One decode step: `tokens[b]` is appended to sample `b`'s suffix (its K/V written to the
    /// arena at `suffix_offset + suffix_len`), attends `[prefix | suffix]`, and its next-token
    /// logits land in `logits[b]` (`[B, vocab]`). Advances each slot's `suffix_len`.
    pub fn decode_step(
        &self,
        arena: &mut KvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let want = slots.len() * self.as_rank().vocab();
        if logits.len() != want {
            return Err(input(format!(
                "decode_step: {} logits for {} slots (expected {want})",
                logits.len(),
                slots.len()
            )));
        }
        logits.copy_from_slice(
            &self
                .as_rank()
                .decode_step(&SoloComm, arena, slots, tokens)?,
        );
        Ok(())
    }

    /// Log-probs (and entropies) of `responses` given a kept prefix state, at `temperature`
    /// (see [`RankModel::score`]).
    pub fn score(
        &self,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temperature: f32,
        cache: Option<&mut ForwardCache>,
    ) -> Result<Vec<TokenScores>, ModelError> {
        self.as_rank()
            .score(&SoloComm, prefix, responses, temperature, cache)
    }
}
