//! A micro-batch's training step, cut into its stages: the inputs' checks, the kept prompt
//! forwards it trains against, the loss's tables, the suffix forward, the lm head and the loss,
//! then the backward through the head, token 0, the layers, the embeddings and the media.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cpu::AttnDims;
use rollplex_kernels::cuda::{
    embedding_fwd_bf16, linear_fwd_bf16, logprobs_fwd_bf16, rmsnorm_fwd_bf16, AttnSeqGpu,
    CudaSlice, CudaStream, Gpu, PolicyLossAcc, PolicyLossInputs, PolicyLossSums, RowGather,
};

use crate::train::loss::Normaliser;
use crate::train::{MicroBatchOutput, TrainError};

use super::super::loss::{loss_metrics, policy_loss_device, LossTables};
use super::super::readback::Readback;
use super::super::staging::{staged_bytes, StagedBatch};
use super::super::train_pack::{PackGroup, SuffixPack};
use super::super::{alloc, GpuError};
use super::backward::{gathers, token0_grads, StagedGather};
use super::layer::{layer_fwd, Acts, LayerCtx, PreKv};
use super::prefixes::{KeptPrefix, TrainPrefixes};
use super::{GpuGroupBatch, GpuTrainer, PrefixedGroup, Result};

/// Rows of the lm head per chunk (bounds the logits buffer to `CHUNK x vocab`).
pub(super) const LM_CHUNK: usize = 1024;

/// A queued micro-batch ([`GpuTrainer::queue_micro_batch_prefixed`]) whose results are on
/// their way to the host.
pub(super) struct Queued {
    /// Per response, groups then responses in order: its rows of the head's outputs (`None`:
    /// an empty response).
    rows: Vec<Option<std::ops::Range<usize>>>,
    /// The copies of the log-probs, the entropies and the loss sums; `None` when the call
    /// trained nothing.
    back: Option<(Readback<f32>, Readback<f32>, Readback<f64>)>,
}

impl GpuTrainer {
    /// Forward, loss and backward of micro-batch `index` (0-based, plan order) of the current
    /// mini-batch whose normaliser is `norm`, for groups given with their prompts: each group's
    /// prompt runs once ([`GpuTrainer::prefix_forward`] into a store made for this call), then
    /// [`GpuTrainer::micro_batch_prefixed`]. Gradients are added into the fp32 sums.
    /// Synchronises once (the log-probs come down for the loss).
    pub fn micro_batch(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        index: u32,
        groups: &[GpuGroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput> {
        self.check_next(index)?;
        let lens: Vec<(usize, u32)> = groups.iter().map(|g| (g.prompt_ids.len(), 1)).collect();
        let mut store = TrainPrefixes::new(gpu, stream, &self.model, &lens)?;
        for (i, g) in groups.iter().enumerate() {
            self.prefix_forward(gpu, stream, &mut store, i, g.prompt_ids, g.media)?;
        }
        let kept: Vec<PrefixedGroup<'_>> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| PrefixedGroup {
                group: i,
                responses: g.responses,
            })
            .collect();
        self.micro_batch_prefixed(gpu, stream, index, &kept, norm, &store)
    }

    fn check_next(&self, index: u32) -> Result<()> {
        if index != self.micro {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} given, but micro-batch {} is next in plan order",
                self.micro
            ))
            .into());
        }
        Ok(())
    }

    pub(super) fn text_dims(&self) -> Result<AttnDims> {
        let t = self.model.config.text();
        let dims = AttnDims {
            num_heads: t.num_heads as usize,
            num_kv_heads: t.num_kv_heads as usize,
            head_dim: t.head_dim() as usize,
        };
        if !dims.head_dim.is_multiple_of(16) {
            return Err(GpuError::Unsupported(format!(
                "text head_dim {}: the CUDA attention kernels need a multiple of 16",
                dims.head_dim
            ))
            .into());
        }
        Ok(dims)
    }

    /// Forward, loss and backward of micro-batch `index` (plan order) over groups whose
    /// prompts' forwards are kept in `store` ([`GpuTrainer::prefix_forward`] with the current
    /// weights): the response suffixes run as one packed batch attending to their copy's kept
    /// K/V; backward runs the layers top-down, each layer's suffix rows first (their attention
    /// adds the prefix keys' gradients, fp32) and then each group's prompt rows (recomputed from
    /// their kept inputs, the suffixes' K/V gradients added to their own), and ends in the token
    /// embeddings. Token 0 of a response is scored from its copy's kept last row; its gradient
    /// reaches that row (summed over the copy's responses in order). Every group is whole in
    /// its micro-batch, so each prompt's backward runs once, here. Waits for the results:
    /// [`GpuTrainer::queue_micro_batch_prefixed`] then [`GpuTrainer::finish_queued`]; refused
    /// while other micro-batches are queued.
    pub fn micro_batch_prefixed(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        index: u32,
        groups: &[PrefixedGroup<'_>],
        norm: Normaliser,
        store: &TrainPrefixes,
    ) -> Result<MicroBatchOutput> {
        if !self.queued.is_empty() {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} run to completion while {} queued micro-batches are not \
                 finished (finish_queued first)",
                self.queued.len()
            ))
            .into());
        }
        self.queue_micro_batch_prefixed(gpu, stream, index, groups, norm, store)?;
        let mut out = self.finish_queued()?;
        out.pop().ok_or_else(|| {
            GpuError::Input(format!(
                "micro-batch {index}: no result after it was queued"
            ))
            .into()
        })
    }

    /// [`GpuTrainer::micro_batch_prefixed`] without waiting: every launch goes to `stream`,
    /// and the copies of its log-probs, entropies and loss sums into page-locked memory are
    /// queued behind them, so the host may prepare and queue the next micro-batch while the
    /// device runs this one. Its results come from [`GpuTrainer::finish_queued`], which the
    /// optimizer step requires first.
    pub fn queue_micro_batch_prefixed(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        index: u32,
        groups: &[PrefixedGroup<'_>],
        norm: Normaliser,
        store: &TrainPrefixes,
    ) -> Result<()> {
        self.check_next(index)?;
        self.grads.ensure(gpu, stream)?;
        let q = self.forward_backward(gpu, stream, groups, norm, store)?;
        self.micro += 1;
        self.queued.push_back(q);
        Ok(())
    }

    /// Waits for the queued micro-batches' results and returns them in plan order (their loss
    /// metrics are added to the mini-batch's). Refuses a micro-batch whose loss inputs the
    /// kernels found inconsistent (the gradient sums then hold its share: discard them).
    pub fn finish_queued(&mut self) -> Result<Vec<MicroBatchOutput>> {
        let mut outs = Vec::with_capacity(self.queued.len());
        while let Some(q) = self.queued.pop_front() {
            let mut out = MicroBatchOutput::default();
            match q.back {
                None => {
                    out.logp = vec![Vec::new(); q.rows.len()];
                    out.entropy = vec![Vec::new(); q.rows.len()];
                }
                Some((lp, ent, acc)) => {
                    let lp = self.readbacks.take(lp)?;
                    let ent = self.readbacks.take(ent)?;
                    let acc = self.readbacks.take(acc)?;
                    for rows in &q.rows {
                        let pick =
                            |v: &[f32]| rows.clone().map_or_else(Vec::new, |x| v[x].to_vec());
                        out.logp.push(pick(&lp));
                        out.entropy.push(pick(&ent));
                    }
                    out.metrics = loss_metrics(&PolicyLossSums::from_slots(&acc)?);
                }
            }
            self.metrics.add(&out.metrics);
            outs.push(out);
        }
        Ok(outs)
    }

    /// The step's stages in order: every launch of the micro-batch goes to `s`, then the copies
    /// of its results; the host waits for nothing.
    fn forward_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        groups: &[PrefixedGroup<'_>],
        norm: Normaliser,
        store: &TrainPrefixes,
    ) -> Result<Queued> {
        let cfg = self.model.config.clone();
        let t = cfg.text();
        let (h, vocab) = (t.hidden_size as usize, t.vocab_size as usize);
        let eps = t.rms_norm_eps as f32;
        let dims = self.text_dims()?;
        let temp = self.cfg.temperature;
        self.check_groups(groups)?;
        let trains: Vec<bool> = groups
            .iter()
            .map(|g| g.responses.iter().any(|r| !r.tokens.is_empty()))
            .collect();
        let responses = groups.iter().map(|g| g.responses.len()).sum();
        if !trains.iter().any(|&x| x) {
            return Ok(Queued {
                rows: vec![None; responses],
                back: None,
            });
        }
        let (packs, kept) = self.kept_groups(groups, store)?;
        let pk = SuffixPack::new(&cfg, &packs)?;
        let b = Batch {
            store,
            srows: pk.rows(),
            frows: pk.rows() + pk.first.len(),
            n_head: pk.head_rows.len(),
            pk,
            packs,
            kept,
            trains,
            dims,
            h,
            vocab,
            eps,
            temp,
        };
        // ---- every host table goes up through page-locked staging before the first launch: a
        // pageable upload would wait for the stream's earlier work (the micro-batch before) ----
        let lh = LossHost::new(groups, &b)?;
        let rh = RowHost::new(&b);
        let (t0_h, media_h) = gathers(&b)?;
        let gather_bytes: usize = t0_h
            .iter()
            .chain(&media_h)
            .flatten()
            .map(StagedGather::bytes)
            .sum();
        let bytes = lh.bytes()
            + rh.bytes(&b)
            + staged_bytes(&b.pk.head_rows)
            + staged_bytes(&b.pk.targets)
            + gather_bytes;
        let (li, rt, head_rows, targets, t0_g, media_g) = {
            let mut up = self.model.stage(s, bytes)?;
            let mut put_all = |hs: Vec<Option<RowGather>>| -> Result<Vec<Option<StagedGather>>> {
                hs.into_iter()
                    .map(|g| g.map(|g| StagedGather::put(g, &mut up, gpu)).transpose())
                    .collect()
            };
            let (t0_g, media_g) = (put_all(t0_h)?, put_all(media_h)?);
            (
                lh.put(&mut up, gpu)?,
                rh.put(&mut up, gpu, &b)?,
                up.put(gpu, &b.pk.head_rows)?,
                up.put(gpu, &b.pk.targets)?,
                t0_g,
                media_g,
            )
        };
        let sctx = rt.suffix_ctx(&b);
        let (fin, mut suffix) = self.suffix_forward(gpu, s, &b, &sctx, &rt.ids)?;
        let head = self.head_forward(gpu, s, &b, &fin, &head_rows, &targets)?;
        let (dlogp_d, acc) = self.loss(gpu, s, &b, norm, &li, &head)?;
        let HeadFwd {
            lp: lp_d,
            ent: ent_d,
            kept: kept_head,
        } = head;
        let dfin =
            self.head_backward(gpu, s, &b, &fin, &head_rows, &targets, &dlogp_d, kept_head)?;
        let (mut dprompt, mut dsuffix) = token0_grads(gpu, s, &b, &dfin, &t0_g)?;
        drop((dfin, fin));
        let span = (b.pk.hi - b.pk.lo).max(1) * dims.kv_width();
        let mut dpk = alloc::<f32>(gpu, s, span)?;
        let mut dpv = alloc::<f32>(gpu, s, span)?;
        let mut d = LayerGrads {
            suffix: &mut dsuffix,
            prompt: &mut dprompt,
            pk: &mut dpk,
            pv: &mut dpv,
        };
        self.layers_backward(gpu, s, &b, &rt, &sctx, suffix.as_mut(), &mut d)?;
        self.embed_backward(gpu, s, &b, &rt.ids, &dsuffix, &dprompt)?;
        self.media_backward(gpu, s, &b, &dprompt, &media_g)?;
        // ---- what the call returns: copies queued behind the whole backward
        let back = (
            self.readbacks.queue(gpu, s, &lp_d)?,
            self.readbacks.queue(gpu, s, &ent_d)?,
            self.readbacks.queue(gpu, s, acc.slots())?,
        );
        let rows = groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| {
                let starts = &b.pk.starts[gi];
                g.responses
                    .iter()
                    .enumerate()
                    .map(move |(r, resp)| starts[r].map(|a| a..a + resp.tokens.len()))
            })
            .collect();
        Ok(Queued {
            rows,
            back: Some(back),
        })
    }

    /// The responses' training inputs: one value per token, reference log-probs where the loss
    /// needs them, old log-probs for every response of the call or for none (the forward's
    /// own are the old ones then).
    fn check_groups(&self, groups: &[PrefixedGroup<'_>]) -> Result<()> {
        let all = groups.iter().flat_map(|g| g.responses);
        let with_old = all.clone().filter(|r| r.old_logp.is_some()).count();
        if with_old != 0 && with_old != all.count() {
            return Err(TrainError::Invalid(format!(
                "old log-probs given for {with_old} responses of a micro-batch but not for the \
                 others: give them for every response, or for none (the training forward's own \
                 log-probs are the old ones then)"
            ))
            .into());
        }
        for (gi, g) in groups.iter().enumerate() {
            for (r, resp) in g.responses.iter().enumerate() {
                let n = resp.tokens.len();
                let what = |x: &str| format!("group {gi} response {r} {x}");
                if let Some(old) = resp.old_logp {
                    crate::train::check_len(&what("old_logp"), n, old.len())?;
                }
                crate::train::check_len(&what("advantages"), n, resp.advantages.len())?;
                crate::train::check_len(&what("mask"), n, resp.mask.len())?;
                if let Some(rl) = resp.ref_logp {
                    crate::train::check_len(&what("ref_logp"), n, rl.len())?;
                }
            }
            if self.cfg.loss.kl_coef > 0.0 && g.responses.iter().any(|r| r.ref_logp.is_none()) {
                return Err(TrainError::Invalid(format!(
                    "group {gi}: kl_coef = {} needs reference log-probs for every response",
                    self.cfg.loss.kl_coef
                ))
                .into());
            }
        }
        Ok(())
    }

    /// Each group's kept prompt forward in `store`, refused unless it ran with the current
    /// weights, and the group as the suffix pack takes it.
    #[allow(clippy::type_complexity)]
    fn kept_groups<'s, 'g>(
        &self,
        groups: &[PrefixedGroup<'g>],
        store: &'s TrainPrefixes,
    ) -> Result<(Vec<PackGroup<'g>>, Vec<&'s KeptPrefix>)> {
        let mut packs = Vec::with_capacity(groups.len());
        let mut kept = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            let layout = store.layout(g.group)?;
            let k = store.kept[g.group].as_ref().ok_or_else(|| {
                TrainError::Invalid(format!(
                    "micro-batch group {gi} (prefix store group {}) trains before its prompt's \
                     forward (ActorPrefix) ran",
                    g.group
                ))
            })?;
            if k.version != self.steps {
                return Err(TrainError::Invalid(format!(
                    "the kept prompt forward of store group {} ran with the weights after {} \
                     optimizer steps, but {} steps have been taken: a kept prefix is valid only \
                     for the weights it ran with (recompute it after the optimizer step)",
                    g.group, k.version, self.steps
                ))
                .into());
            }
            kept.push(k);
            packs.push(PackGroup {
                layout,
                rope_delta: k.rope_delta,
                responses: g.responses.iter().map(|r| r.tokens).collect(),
            });
        }
        Ok((packs, kept))
    }

    /// Suffix forward: each layer's input kept; the final rows, then the token-0 rows (each
    /// copy's kept last prompt row), in the head's input `fin` (`[frows, H]`).
    fn suffix_forward(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        sctx: &LayerCtx<'_>,
        ids_d: &CudaSlice<u32>,
    ) -> Result<(CudaSlice<bf16>, Option<SuffixActs>)> {
        let (srows, h) = (b.srows, b.h);
        let w = &self.model.weights;
        let layers = w.text.len();
        let mut fin = alloc::<bf16>(gpu, s, b.frows * h)?;
        // The first `kept_layers` layers keep every activation of the suffix rows for the
        // backward, the others their input only and are recomputed there (the same launches on
        // the same inputs: bitwise the same activations, so the same gradient)
        let kept = self.cfg.kept_layers.min(layers);
        let mut suffix = None;
        if srows > 0 {
            let mut x = alloc::<bf16>(gpu, s, srows * h)?;
            embedding_fwd_bf16(gpu, s, &mut x, &w.embed, ids_d, srows, h, h)?;
            let mut inputs = alloc::<bf16>(gpu, s, layers * srows * h)?;
            // one buffer reused by every recomputed layer, one per kept layer
            let mut acts = match kept < layers {
                true => Some(Acts::new(gpu, s, sctx, &w.text[0])?),
                false => None,
            };
            let mut kept_acts: Vec<Option<Acts>> = Vec::with_capacity(layers);
            for (l, blk) in w.text.iter().enumerate() {
                let r = l * srows * h..(l + 1) * srows * h;
                s.memcpy_dtod(&x, &mut inputs.slice_mut(r.clone()))?;
                kept_acts.push(match l < kept {
                    true => Some(Acts::new(gpu, s, sctx, blk)?),
                    false => None,
                });
                let a = match (kept_acts[l].as_mut(), acts.as_mut()) {
                    (Some(k), _) => k,
                    (None, Some(a)) => a,
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
                    blk,
                    sctx,
                    &inputs.slice(r),
                    a,
                    Some(&mut x),
                    Some(&b.pre_kv(l)),
                )?;
            }
            s.memcpy_dtod(&x, &mut fin.slice_mut(..srows * h))?;
            suffix = Some(SuffixActs {
                inputs,
                acts,
                kept: kept_acts,
            });
        }
        for (i, f) in b.pk.first.iter().enumerate() {
            let r = srows + i;
            s.memcpy_dtod(
                &b.store.last.slice(f.unit * h..(f.unit + 1) * h),
                &mut fin.slice_mut(r * h..(r + 1) * h),
            )?;
        }
        Ok((fin, suffix))
    }

    /// Head forward: log-probs (and entropies) of every response token, `LM_CHUNK` rows at a
    /// time; with every layer kept, each chunk's rows, norm and logits kept for the backward.
    fn head_forward(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        fin: &CudaSlice<bf16>,
        head_rows: &CudaSlice<u32>,
        targets: &CudaSlice<u32>,
    ) -> Result<HeadFwd> {
        let (n_head, h, vocab) = (b.n_head, b.h, b.vocab);
        // the logits are kept when every layer's activations are
        let keep = self.cfg.keeps_all(self.model.weights.text.len());
        let mut lp_d = alloc::<f32>(gpu, s, n_head)?;
        let mut ent_d = alloc::<f32>(gpu, s, n_head)?;
        // per chunk (with `keep`): the head's input rows, their norm and rstd, and the logits
        let mut kept_head = Vec::new();
        for c0 in (0..n_head).step_by(LM_CHUNK) {
            let n = LM_CHUNK.min(n_head - c0);
            let (g, xn, rstd) =
                self.head_rows(gpu, s, fin, b.frows, &head_rows.slice(c0..c0 + n), n)?;
            let mut logits = alloc::<bf16>(gpu, s, n * vocab)?;
            linear_fwd_bf16(
                gpu,
                s,
                &mut logits,
                &xn,
                self.model.weights.lm_head(),
                None,
                n,
                h,
                vocab,
            )?;
            let mut e = ent_d.slice_mut(c0..c0 + n);
            logprobs_fwd_bf16(
                gpu,
                s,
                &mut lp_d.slice_mut(c0..c0 + n),
                Some(&mut e as &mut dyn DevicePtrMut<f32>),
                None,
                &logits,
                &targets.slice(c0..c0 + n),
                n,
                vocab,
                vocab,
                b.temp,
            )?;
            if keep {
                kept_head.push((g, xn, rstd, logits));
            }
        }
        Ok(HeadFwd {
            lp: lp_d,
            ent: ent_d,
            kept: kept_head,
        })
    }

    /// The loss on the device (one call over the groups; the CPU's per-token math): each
    /// token's `dlogp`, and the metrics in the returned accumulator.
    fn loss(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        norm: Normaliser,
        li: &LossInputs,
        head: &HeadFwd,
    ) -> Result<(CudaSlice<f32>, PolicyLossAcc)> {
        let n_head = b.n_head;
        let mut dlogp_d = alloc::<f32>(gpu, s, n_head.max(1))?;
        let mut acc = PolicyLossAcc::new(gpu, s)?;
        let x = PolicyLossInputs {
            tokens: n_head,
            logp: &head.lp,
            // without old log-probs the forward's own are the old ones (ratio exactly 1)
            old_logp: li.old.as_ref().unwrap_or(&head.lp),
            ref_logp: li.all_ref.then_some(&li.refl as &dyn DevicePtr<f32>),
            advantages: &li.adv,
            mask: &li.mask,
            entropy: Some(&head.ent),
            seq: &li.seq,
            seqs: li.seqs,
            seq_tokens: &li.seq_tokens,
            seq_spans: Some(&li.spans),
        };
        policy_loss_device(gpu, s, &self.cfg.loss, norm, &x, &mut dlogp_d, &mut acc)?;
        Ok((dlogp_d, acc))
    }

    /// Gathers rows `idx` of the final-norm input `x`: `(rows, rmsnorm(rows), rstd)`.
    pub(super) fn head_rows(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        total_rows: usize,
        idx: &impl DevicePtr<u32>,
        n: usize,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<f32>)> {
        let t = self.model.config.text();
        let h = t.hidden_size as usize;
        let mut g = alloc::<bf16>(gpu, s, n * h)?;
        embedding_fwd_bf16(gpu, s, &mut g, &x.slice(..total_rows * h), idx, n, h, h)?;
        let mut xn = alloc::<bf16>(gpu, s, n * h)?;
        let mut rstd = alloc::<f32>(gpu, s, n)?;
        rmsnorm_fwd_bf16(
            gpu,
            s,
            &mut xn,
            Some(&mut rstd as &mut dyn DevicePtrMut<f32>),
            &g,
            &self.model.weights.final_norm,
            n,
            h,
            t.rms_norm_eps as f32,
        )?;
        Ok((g, xn, rstd))
    }
}

/// What every stage of a micro-batch reads: its groups' kept prompt forwards and suffix pack,
/// and the text decoder's sizes.
pub(super) struct Batch<'s, 'g> {
    pub(super) store: &'s TrainPrefixes,
    pub(super) pk: SuffixPack,
    pub(super) packs: Vec<PackGroup<'g>>,
    pub(super) kept: Vec<&'s KeptPrefix>,
    /// Per group: whether any of its responses has a token (a group without trains nothing).
    pub(super) trains: Vec<bool>,
    /// Suffix rows, rows of the head's input (the suffix rows, then one per token 0), and
    /// response tokens scored.
    pub(super) srows: usize,
    pub(super) frows: usize,
    pub(super) n_head: usize,
    pub(super) dims: AttnDims,
    pub(super) h: usize,
    pub(super) vocab: usize,
    pub(super) eps: f32,
    pub(super) temp: f32,
}

impl Batch<'_, '_> {
    /// Layer `l`'s kept prefix K/V the suffixes attend to (store rows `pk.lo..pk.hi`).
    pub(super) fn pre_kv(&self, l: usize) -> PreKv<'_> {
        let (all, kvw, lo, hi) = (
            self.store.rows,
            self.dims.kv_width(),
            self.pk.lo,
            self.pk.hi,
        );
        PreKv {
            k: self
                .store
                .k
                .slice((l * all + lo) * kvw..(l * all + hi) * kvw),
            v: self
                .store
                .v
                .slice((l * all + lo) * kvw..(l * all + hi) * kvw),
        }
    }
}

/// The loss's per-token inputs on the device, in head-row order.
struct LossInputs {
    /// Whether every response carries reference log-probs (else `refl` is empty).
    all_ref: bool,
    /// `None`: the call's responses carry no old log-probs (the forward's own are the old ones).
    old: Option<CudaSlice<f32>>,
    adv: CudaSlice<f32>,
    refl: CudaSlice<f32>,
    seq: CudaSlice<u32>,
    mask: CudaSlice<u8>,
    seq_tokens: CudaSlice<u32>,
    /// Per sequence: its first and end row (the sequence ratio reads them).
    spans: CudaSlice<u32>,
    /// Sequences (responses) of the call.
    seqs: usize,
}

/// [`LossInputs`] on the host, before [`LossHost::put`] stages them.
struct LossHost {
    all_ref: bool,
    /// `None` unless every response carries old log-probs.
    old: Option<Vec<f32>>,
    adv: Vec<f32>,
    refl: Vec<f32>,
    tables: LossTables,
}

impl LossHost {
    fn new(groups: &[PrefixedGroup<'_>], b: &Batch<'_, '_>) -> Result<Self> {
        let (pk, n_head) = (&b.pk, b.n_head);
        let all_ref = groups
            .iter()
            .all(|g| g.responses.iter().all(|r| r.ref_logp.is_some()));
        let all_old = groups
            .iter()
            .all(|g| g.responses.iter().all(|r| r.old_logp.is_some()));
        let mut old = all_old.then(|| vec![0f32; n_head]);
        let mut adv = vec![0f32; n_head];
        let mut refl = vec![0f32; if all_ref { n_head } else { 0 }];
        let mut loss_seqs: Vec<(usize, &[bool])> = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            for (r, resp) in g.responses.iter().enumerate() {
                let Some(a) = pk.starts[gi][r] else {
                    loss_seqs.push((0, &[]));
                    continue;
                };
                let rows = a..a + resp.tokens.len();
                if let (Some(old), Some(o)) = (old.as_mut(), resp.old_logp) {
                    old[rows.clone()].copy_from_slice(o);
                }
                adv[rows.clone()].copy_from_slice(resp.advantages);
                if let (true, Some(rl)) = (all_ref, resp.ref_logp) {
                    refl[rows].copy_from_slice(rl);
                }
                loss_seqs.push((a, resp.mask));
            }
        }
        let tables = LossTables::new(n_head, &loss_seqs)?;
        Ok(LossHost {
            all_ref,
            old,
            adv,
            refl,
            tables,
        })
    }

    /// Staging bytes [`LossHost::put`] takes.
    fn bytes(&self) -> usize {
        let t = &self.tables;
        self.old.as_deref().map_or(0, staged_bytes)
            + staged_bytes(&self.adv)
            + staged_bytes(&self.refl)
            + staged_bytes(&t.seq)
            + staged_bytes(&t.mask)
            + staged_bytes(&t.seq_tokens)
            + staged_bytes(&t.spans)
    }

    fn put(&self, up: &mut StagedBatch<'_>, gpu: &Gpu) -> Result<LossInputs> {
        let t = &self.tables;
        Ok(LossInputs {
            all_ref: self.all_ref,
            old: self.old.as_deref().map(|o| up.put(gpu, o)).transpose()?,
            adv: up.put(gpu, &self.adv)?,
            refl: up.put(gpu, &self.refl)?,
            seq: up.put(gpu, &t.seq)?,
            mask: up.put(gpu, &t.mask)?,
            seq_tokens: up.put(gpu, &t.seq_tokens)?,
            spans: up.put(gpu, &t.spans)?,
            seqs: t.seq_tokens.len(),
        })
    }
}

/// The suffix rows' tables on the device, and the row index and ones columns every layer of
/// the micro-batch shares (the index sized for the suffix or the longest group's prompt rows,
/// the ones for all of them stacked).
pub(super) struct RowTables {
    pub(super) iota: CudaSlice<u32>,
    pub(super) ones: CudaSlice<bf16>,
    pub(super) ids: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    seqs: CudaSlice<AttnSeqGpu>,
    n_seqs: usize,
    max_q: usize,
}

/// The host side of [`RowTables`] not already in the suffix pack (`ids`, `cos`, `sin`).
struct RowHost {
    iota: Vec<u32>,
    ones: Vec<bf16>,
    seqs: Vec<AttnSeqGpu>,
}

impl RowHost {
    fn new(b: &Batch<'_, '_>) -> Self {
        let max_rows = b
            .packs
            .iter()
            .map(|p| p.layout.rows())
            .chain([b.srows])
            .max()
            .unwrap_or(1)
            .max(1);
        // bias gradients of the MLP backward run over the suffix and prompt rows stacked
        let stacked = b.srows + b.packs.iter().map(|p| p.layout.rows()).sum::<usize>();
        RowHost {
            iota: (0..max_rows as u32).collect(),
            ones: vec![bf16::ONE; max_rows.max(stacked)],
            seqs: b.pk.seqs.iter().map(AttnSeqGpu::from_fwd).collect(),
        }
    }

    /// Staging bytes [`RowHost::put`] takes.
    fn bytes(&self, b: &Batch<'_, '_>) -> usize {
        staged_bytes(&self.iota)
            + staged_bytes(&self.ones)
            + staged_bytes(&b.pk.ids)
            + staged_bytes(&b.pk.cos)
            + staged_bytes(&b.pk.sin)
            + staged_bytes(&self.seqs)
    }

    fn put(&self, up: &mut StagedBatch<'_>, gpu: &Gpu, b: &Batch<'_, '_>) -> Result<RowTables> {
        let pk = &b.pk;
        Ok(RowTables {
            iota: up.put(gpu, &self.iota)?,
            ones: up.put(gpu, &self.ones)?,
            ids: up.put(gpu, &pk.ids)?,
            cos: up.put(gpu, &pk.cos)?,
            sin: up.put(gpu, &pk.sin)?,
            seqs: up.put(gpu, &self.seqs)?,
            n_seqs: self.seqs.len(),
            max_q: pk.seqs.iter().map(|q| q.len as usize).max().unwrap_or(0),
        })
    }
}

impl RowTables {
    /// The suffix rows' layer context.
    fn suffix_ctx(&self, b: &Batch<'_, '_>) -> LayerCtx<'_> {
        LayerCtx {
            rows: b.srows,
            hidden: b.h,
            dims: b.dims,
            eps: b.eps,
            cos: &self.cos,
            sin: &self.sin,
            seqs: &self.seqs,
            n_seqs: self.n_seqs,
            max_q: self.max_q,
            iota: &self.iota,
            ones: &self.ones,
        }
    }
}

/// The suffix forward's kept state: every layer's input (`[layers, srows, H]`), the kept
/// layers' activations (each used once), and one activation buffer the backward recomputes
/// the other layers into (when there are any).
pub(super) struct SuffixActs {
    pub(super) inputs: CudaSlice<bf16>,
    pub(super) acts: Option<Acts>,
    pub(super) kept: Vec<Option<Acts>>,
}

/// The head forward's results: log-probs, entropies, and with every layer kept per chunk the
/// head's input rows, their norm and rstd, and the logits.
pub(super) struct HeadFwd {
    lp: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    pub(super) kept: Vec<HeadChunk>,
}

/// One lm-head chunk's input rows, their norm, rstd and logits.
pub(super) type HeadChunk = (
    CudaSlice<bf16>,
    CudaSlice<bf16>,
    CudaSlice<f32>,
    CudaSlice<bf16>,
);

/// The gradients the layers' backward carries: the suffix rows', each group's prompt rows',
/// and the suffixes' fp32 gradients of the kept prefix K/V (store rows `pk.lo..pk.hi`).
pub(super) struct LayerGrads<'a> {
    pub(super) suffix: &'a mut CudaSlice<bf16>,
    pub(super) prompt: &'a mut [CudaSlice<bf16>],
    pub(super) pk: &'a mut CudaSlice<f32>,
    pub(super) pv: &'a mut CudaSlice<f32>,
}
