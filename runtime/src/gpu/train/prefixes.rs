//! The kept prompt forwards ([`TrainPrefixes`]) and the prompt forward that fills them.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{
    embedding_fwd_bf16, kv_append_bf16, AttnSeqGpu, CudaSlice, CudaStream, Gpu,
};

use crate::train::TrainError;

use super::super::arena::{alloc_in, DevBuf, Region};
use super::super::plan::{check_ids, media_slot, PackedPrompts, PromptSpec};
use super::super::staging::staged_bytes;
use super::super::text::{GpuPrefixState, PrefillKv};
use super::super::train_pack::{layout_prefixes, PrefixLayout};
use super::super::vision::GpuEncodedMedia;
use super::super::vision_train::VisionTrainState;
use super::super::{alloc, GpuError, GpuModel};
use super::layer::{layer_fwd, Acts, LayerCtx};
use super::{GpuTrainer, PromptMedia, Result};

/// The actor's kept prompt forwards for training: per GRPO group, `copies` forwards of its
/// prompt (one with prefix dedup, one per sample without), every layer's input (bf16 residual
/// stream, for the recompute in backward) and K/V after RoPE (what the suffixes attend to) in
/// one store per iteration, rows laid out by [`layout_prefixes`]: `inputs [layers, rows, H]`,
/// `k`, `v` `[layers, rows, kv_width]`; `last [units, H]` holds each copy's last prompt row
/// after the final layer (token 0 of every response is scored from it). The trainer's first
/// [`TrainConfig::kept_prompt_layers`](crate::train::TrainConfig::kept_prompt_layers) layers
/// also keep every activation of each group's rows ([`KeptPrefix::acts`]), which backward
/// then reads instead of recomputing them.
///
/// Filled by [`GpuTrainer::prefix_forward`] (the plan's `ActorPrefix{Train}` tasks, which may
/// run inside decode windows), read by [`GpuTrainer::micro_batch_prefixed`]. A kept prefix is
/// valid only for the weights it was computed with: it records the optimizer step, and a
/// micro-batch of another step refuses it.
pub struct TrainPrefixes {
    pub(super) rows: usize,
    pub(super) layouts: Vec<PrefixLayout>,
    pub(super) kept: Vec<Option<KeptPrefix>>,
    pub(super) inputs: DevBuf<bf16>,
    pub(super) k: DevBuf<bf16>,
    pub(super) v: DevBuf<bf16>,
    pub(super) last: CudaSlice<bf16>,
    /// The plan's region the store lies in: each group's kept vision state goes there too.
    pub(super) region: Option<Arc<Region>>,
}

/// What a group's prefix forward leaves besides the store rows: the tables its backward
/// recomputes the layers with.
pub(super) struct KeptPrefix {
    /// Optimizer steps the trainer had taken when the prefix ran (its weight version).
    pub(super) version: u64,
    pub(super) rope_delta: i64,
    pub(super) cos: CudaSlice<f32>,
    pub(super) sin: CudaSlice<f32>,
    /// One causal sequence per copy, rows from 0.
    pub(super) seqs: CudaSlice<AttnSeqGpu>,
    /// Prompt ids with media rows set to `vocab` (the embedding backward skips them: their
    /// gradient goes to the vision backward, or nowhere when the tower and merger are frozen).
    pub(super) bwd_ids: CudaSlice<u32>,
    /// Every activation of the group's rows in layers `0..acts.len()` (the kept prompt
    /// layers), in the store's region.
    pub(super) acts: Vec<Acts>,
    /// The media's training forward when the tower or merger trains.
    pub(super) vision: Option<KeptVision>,
}

/// A prompt's media encoding kept for the vision backward.
pub(super) struct KeptVision {
    pub(super) state: VisionTrainState,
    /// Per media token (the items' tokens in item order), its row in each copy of the prompt
    /// (copy order), rows of the group's prompt store rows.
    pub(super) rows: Vec<Vec<u32>>,
}

impl TrainPrefixes {
    /// A store for groups given as `(prompt tokens, copies)`, in group order, for `model`'s text
    /// decoder (contents undefined until each group's prefix forward).
    pub fn new(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        groups: &[(usize, u32)],
    ) -> Result<Self> {
        Self::new_in(gpu, s, model, groups, None)
    }

    /// [`TrainPrefixes::new`] with the kept layer inputs, keys and values in `region` of the
    /// plan's arena (`train_prefix.sS`), and later each group's kept vision state.
    pub fn new_in(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        groups: &[(usize, u32)],
        region: Option<Arc<Region>>,
    ) -> Result<Self> {
        let r = region.as_deref();
        let (layouts, rows, units) = layout_prefixes(groups)?;
        let t = model.config.text();
        let (l, h) = (t.num_layers as usize, t.hidden_size as usize);
        let kvw = (t.num_kv_heads * t.head_dim()) as usize;
        Ok(TrainPrefixes {
            rows,
            kept: (0..layouts.len()).map(|_| None).collect(),
            layouts,
            inputs: alloc_in(gpu, s, l * rows * h, r)?,
            k: alloc_in(gpu, s, l * rows * kvw, r)?,
            v: alloc_in(gpu, s, l * rows * kvw, r)?,
            last: alloc(gpu, s, units * h)?,
            region,
        })
    }

    /// Groups the store was laid out for.
    pub fn groups(&self) -> usize {
        self.layouts.len()
    }

    /// Bytes of device memory the store holds.
    pub fn bytes(&self) -> usize {
        2 * (self.inputs.len() + self.k.len() + self.v.len() + self.last.len())
    }

    pub(super) fn layout(&self, group: usize) -> Result<PrefixLayout> {
        self.layouts.get(group).copied().ok_or_else(|| {
            GpuError::Input(format!(
                "group {group} is not in the prefix store ({} groups)",
                self.layouts.len()
            ))
            .into()
        })
    }
}

impl GpuTrainer {
    /// The prompt forward of `group` of `store` with the current weights (the plan's
    /// `ActorPrefix{Train}`): the store's `copies` of the prompt packed in one call, every
    /// layer's input and K/V kept in the group's store rows, each copy's last row after the
    /// final layer kept for token 0. One call per group, so a group's bits never depend on the
    /// others. Nothing synchronises.
    pub fn prefix_forward(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        store: &mut TrainPrefixes,
        group: usize,
        prompt_ids: &[u32],
        media: PromptMedia<'_>,
    ) -> Result<()> {
        let lay = store.layout(group)?;
        if prompt_ids.len() != lay.len {
            return Err(GpuError::Input(format!(
                "group {group}: a prompt of {} tokens for store rows laid out for {}",
                prompt_ids.len(),
                lay.len
            ))
            .into());
        }
        let owned;
        let mut vision_state = None;
        let media: Vec<&GpuEncodedMedia> = match media {
            PromptMedia::Encoded(m) => {
                if self.trains_vision() && !m.is_empty() {
                    return Err(TrainError::Invalid(
                        "this trainer trains the vision tower or merger: give the prompt's \
                         media as PromptMedia::Raw (embeddings of a frozen tower carry no \
                         gradient)"
                            .into(),
                    )
                    .into());
                }
                m.to_vec()
            }
            PromptMedia::Raw(items) => {
                owned = if self.trains_vision() && !items.is_empty() {
                    let (e, st) = self.model.encode_media_train_in(
                        gpu,
                        s,
                        items,
                        !self.cfg.freeze_vision,
                        store.region.as_deref(),
                    )?;
                    vision_state = Some(st);
                    e
                } else {
                    self.model.encode_media(gpu, s, items)?
                };
                owned.iter().collect()
            }
        };
        let cfg = &self.model.config;
        let t = cfg.text();
        let (h, vocab) = (t.hidden_size as usize, t.vocab_size as usize);
        let dims = self.text_dims()?;
        let spec = PromptSpec {
            ids: prompt_ids,
            media: media.iter().map(|m| media_slot(m.kind, m.grid)).collect(),
        };
        let p = PackedPrompts::new(cfg, &vec![spec; lay.copies])?;
        check_ids("train prefix", &p.ids, vocab)?;
        let rows = p.ids.len();
        let per_copy: usize = media.iter().map(|m| m.tokens).sum();
        let media_tokens = per_copy * lay.copies;
        if media_tokens != p.media_rows.len() {
            return Err(GpuError::Input(format!(
                "{} media placeholder tokens but the media carry {media_tokens} embeddings",
                p.media_rows.len()
            ))
            .into());
        }
        for m in &media {
            if m.embeds.len() < m.tokens * h {
                return Err(GpuError::Input(format!(
                    "a media item holds {} embedding values, expected {} x {h}",
                    m.embeds.len(),
                    m.tokens
                ))
                .into());
            }
        }
        let mut bwd_ids = p.ids.clone();
        for &r in &p.media_rows {
            bwd_ids[r as usize] = vocab as u32;
        }
        let gseqs: Vec<AttnSeqGpu> = p.seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let ones_v = vec![bf16::ONE; rows];
        // every table goes up through page-locked staging before the first launch: a pageable
        // upload would wait for the stream's earlier work, and this task may be one of several
        // queued on a decode window's side stream that the host must not wait for
        let bytes = staged_bytes(&p.ids)
            + staged_bytes(&p.cos)
            + staged_bytes(&p.sin)
            + staged_bytes(&gseqs)
            + staged_bytes(&bwd_ids)
            + staged_bytes(&ones_v)
            + staged_bytes(&p.media_rows);
        let (ids_d, cos, sin, seqs, bwd_ids, ones, slots) = {
            let mut up = self.model.stage(s, bytes)?;
            (
                up.put(gpu, &p.ids)?,
                up.put(gpu, &p.cos)?,
                up.put(gpu, &p.sin)?,
                up.put(gpu, &gseqs)?,
                up.put(gpu, &bwd_ids)?,
                up.put(gpu, &ones_v)?,
                up.put(gpu, &p.media_rows)?,
            )
        };
        let iota = self.model.iota(s, rows)?;
        let w = &self.model.weights;
        let mut x = alloc::<bf16>(gpu, s, rows * h)?;
        embedding_fwd_bf16(gpu, s, &mut x, &w.embed, &ids_d, rows, h, h)?;
        if media_tokens > 0 {
            let mut cat = alloc::<bf16>(gpu, s, media_tokens * h)?;
            let mut off = 0;
            for _ in 0..lay.copies {
                for m in &media {
                    let n = m.tokens * h;
                    s.memcpy_dtod(&m.embeds.slice(..n), &mut cat.slice_mut(off..off + n))?;
                    off += n;
                }
            }
            kv_append_bf16(gpu, s, &mut x, &cat, &slots, media_tokens, h, h, h)?;
        }
        let ctx = LayerCtx {
            rows,
            hidden: h,
            dims,
            eps: t.rms_norm_eps as f32,
            cos: &cos,
            sin: &sin,
            seqs: &seqs,
            n_seqs: lay.copies,
            max_q: lay.len,
            iota: &iota,
            ones: &ones,
        };
        let layers = w.text.len();
        if layers == 0 {
            return Err(GpuError::Input("the model has no text layers to train".into()).into());
        }
        // the first `kept_prompt_layers` layers' activations are kept (the same launches on
        // the same inputs as backward's recompute: bitwise the same activations); the others
        // share one buffer
        let kept_n = self.cfg.kept_prompt_layers.min(layers);
        let mut scratch = match kept_n < layers {
            true => Some(Acts::new(gpu, s, &ctx, &w.text[0])?),
            false => None,
        };
        let mut kept_acts = Vec::with_capacity(kept_n);
        let (all, kvw) = (store.rows, dims.kv_width());
        for (l, b) in w.text.iter().enumerate() {
            let first = l * all + lay.row0;
            let r = first * h..(first + rows) * h;
            s.memcpy_dtod(&x, &mut store.inputs.slice_mut(r.clone()))?;
            if l < kept_n {
                kept_acts.push(Acts::new_in(gpu, s, &ctx, b, store.region.as_deref())?);
            }
            let acts = match (kept_acts.get_mut(l), scratch.as_mut()) {
                (Some(a), _) | (None, Some(a)) => a,
                (None, None) => {
                    return Err(GpuError::Input(format!(
                        "layer {l}: neither kept nor recomputed activations"
                    ))
                    .into())
                }
            };
            layer_fwd(
                gpu,
                s,
                b,
                &ctx,
                &store.inputs.slice(r),
                acts,
                Some(&mut x),
                None,
            )?;
            let kr = first * kvw..(first + rows) * kvw;
            s.memcpy_dtod(&*acts.k, &mut store.k.slice_mut(kr.clone()))?;
            s.memcpy_dtod(&*acts.v, &mut store.v.slice_mut(kr))?;
        }
        for c in 0..lay.copies {
            let (row, u) = (c * lay.len + lay.len - 1, lay.unit0 + c);
            s.memcpy_dtod(
                &x.slice(row * h..(row + 1) * h),
                &mut store.last.slice_mut(u * h..(u + 1) * h),
            )?;
        }
        // the media rows are copy-major (each copy's items in order): token i of copy c is
        // media row c * per_copy + i
        let vision = vision_state.map(|state| KeptVision {
            state,
            rows: (0..per_copy)
                .map(|i| {
                    (0..lay.copies)
                        .map(|c| p.media_rows[c * per_copy + i])
                        .collect()
                })
                .collect(),
        });
        store.kept[group] = Some(KeptPrefix {
            version: self.steps,
            rope_delta: p.deltas[0],
            cos,
            sin,
            seqs,
            bwd_ids,
            acts: kept_acts,
            vision,
        });
        Ok(())
    }

    /// The rollout's prefix state of `group` from its kept prompt forward (a plan whose
    /// prefill keeps the training prompt forwards): copy 0's keys and values, and the logits of
    /// copy 0's last token from the final norm and lm head over every copy's last row (as
    /// `GpuModel::prefill` computes them for a group's packed copies). The forward must have run
    /// with the current weights. Nothing synchronises.
    pub fn prefix_state(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        store: &TrainPrefixes,
        group: usize,
    ) -> Result<GpuPrefixState> {
        let lay = store.layout(group)?;
        let kept = match &store.kept[group] {
            Some(k) if k.version == self.steps => k,
            Some(k) => {
                return Err(GpuError::Input(format!(
                    "group {group}'s kept prompt forward is of weight version {}, the trainer \
                     is at {}",
                    k.version, self.steps
                ))
                .into())
            }
            None => {
                return Err(
                    GpuError::Input(format!("group {group}'s prompt forward was not kept")).into(),
                )
            }
        };
        let kvw = self.text_dims()?.kv_width();
        let (layers, h) = (self.model.weights.text.len(), self.model.hidden());
        let n = lay.len * kvw;
        let mut k = alloc::<bf16>(gpu, s, layers * n)?;
        let mut v = alloc::<bf16>(gpu, s, layers * n)?;
        for l in 0..layers {
            let src = (l * store.rows + lay.row0) * kvw;
            s.memcpy_dtod(
                &store.k.slice(src..src + n),
                &mut k.slice_mut(l * n..(l + 1) * n),
            )?;
            s.memcpy_dtod(
                &store.v.slice(src..src + n),
                &mut v.slice_mut(l * n..(l + 1) * n),
            )?;
        }
        let c = lay.copies;
        let mut last = alloc::<bf16>(gpu, s, c * h)?;
        s.memcpy_dtod(
            &store.last.slice(lay.unit0 * h..(lay.unit0 + c) * h),
            &mut last,
        )?;
        let vocab = self.model.vocab();
        let mut xn = alloc::<bf16>(gpu, s, c * h)?;
        let mut logits = alloc::<bf16>(gpu, s, c * vocab)?;
        self.model
            .head_into(gpu, s, &last, c, &mut xn, &mut logits)?;
        let mut first = alloc::<bf16>(gpu, s, vocab)?;
        s.memcpy_dtod(&logits.slice(..vocab), &mut first)?;
        Ok(GpuPrefixState {
            len: lay.len as u32,
            rope_delta: kept.rope_delta,
            kv: Arc::new(PrefillKv {
                k: DevBuf::from(k),
                v: DevBuf::from(v),
                rows: lay.len,
                kv_width: kvw,
            }),
            row0: 0,
            last_logits: Arc::new(first),
        })
    }
}
