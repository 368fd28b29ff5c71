//! The backward stages of a micro-batch's step: the lm head and final norm, token 0's rows,
//! the layers top-down (each layer's MLP half over the suffix and prompt rows stacked, then its
//! attention half for the suffix rows, then each group's prompt rows), the token embeddings and
//! each group's media rows into the merger and the tower.

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use half::bf16;
use rollplex_kernels::cpu::Gemm;
use rollplex_kernels::cuda::{
    embedding_bwd_f32, gather_sum_rows_dev, kv_append_bf16, linear_fwd_bf16, logprobs_bwd_bf16,
    matmul_bf16, matmul_bf16_f32, rmsnorm_bwd_bf16, CudaSlice, CudaStream, Gpu, RowGather,
    RowGatherDev,
};

use super::super::block_bwd::{mlp_saved, BlockBwd, MlpSet};
use super::super::staging::{staged_bytes, StagedBatch};
use super::super::vision_train::vision_backward;
use super::super::{alloc, GpuError};
use super::layer::{layer_bwd_attn, layer_fwd, Acts, LayerCtx, PrefixGrad};
use super::params::{Slot, VisionView};
use super::step::{Batch, HeadChunk, LayerGrads, RowTables, SuffixActs, LM_CHUNK};
use super::{GpuTrainer, Result};

impl GpuTrainer {
    /// Backward through the log-softmax, the lm head and the final norm, chunk by chunk (the
    /// logits recomputed unless kept): the gradient of the head's input rows (`[frows, H]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        fin: &CudaSlice<bf16>,
        head_rows: &CudaSlice<u32>,
        targets: &CudaSlice<u32>,
        dlogp_d: &CudaSlice<f32>,
        kept_head: Vec<HeadChunk>,
    ) -> Result<CudaSlice<bf16>> {
        let (n_head, h, vocab, frows, temp) = (b.n_head, b.h, b.vocab, b.frows, b.temp);
        let head_slot = if self.model.weights.lm_head.is_some() {
            Slot::LmHead
        } else {
            Slot::Embed
        };
        let mut dfin = alloc::<bf16>(gpu, s, frows * h)?;
        s.memset_zeros(&mut dfin)?;
        let mut kept_head = kept_head.into_iter();
        for c0 in (0..n_head).step_by(LM_CHUNK) {
            let n = LM_CHUNK.min(n_head - c0);
            let idx = head_rows.slice(c0..c0 + n);
            let head = self.model.weights.lm_head();
            let (g, xn, rstd, logits) = match kept_head.next() {
                Some(k) => k,
                None => {
                    let (g, xn, rstd) = self.head_rows(gpu, s, fin, frows, &idx, n)?;
                    let mut logits = alloc::<bf16>(gpu, s, n * vocab)?;
                    linear_fwd_bf16(gpu, s, &mut logits, &xn, head, None, n, h, vocab)?;
                    (g, xn, rstd, logits)
                }
            };
            let mut dlogits = alloc::<bf16>(gpu, s, n * vocab)?;
            logprobs_bwd_bf16(
                gpu,
                s,
                &mut dlogits,
                &dlogp_d.slice(c0..c0 + n),
                None,
                &logits,
                &targets.slice(c0..c0 + n),
                n,
                vocab,
                vocab,
                vocab,
                temp,
            )?;
            drop(logits);
            let mut dxn = alloc::<bf16>(gpu, s, n * h)?;
            matmul_bf16(gpu, s, &mut dxn, &dlogits, head, Gemm::nn(n, vocab, h))?;
            let gw = Gemm::tn(vocab, n, h).accumulate();
            matmul_bf16_f32(gpu, s, self.grads.get(head_slot)?, &dlogits, &xn, gw)?;
            let mut dg = alloc::<bf16>(gpu, s, n * h)?;
            rmsnorm_bwd_bf16(
                gpu,
                s,
                &mut dg,
                Some(self.grads.get(Slot::FinalNorm)? as &mut dyn DevicePtrMut<f32>),
                &dxn,
                &g,
                &self.model.weights.final_norm,
                &rstd,
                n,
                h,
                false,
            )?;
            // rows are distinct (one token-0 row per response): a scatter
            kv_append_bf16(gpu, s, &mut dfin, &dg, &idx, n, h, h, h)?;
        }
        Ok(dfin)
    }

    /// Backward through the layers top-down. Per layer: each training group's prompt rows
    /// recomputed from their kept inputs (the suffix rows' activations kept, or recomputed);
    /// the MLP halves of the suffix and prompt rows at once, stacked (one GEMM over all rows
    /// per weight, [`BlockBwd::mlp_stacked`]); then the attention halves, the suffix rows first
    /// (their attention adds the prefix keys' gradients into `d.pk`, `d.pv`), then each group's
    /// prompt rows with those gradients added to their own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layers_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        rt: &RowTables,
        sctx: &LayerCtx<'_>,
        mut suffix: Option<&mut SuffixActs>,
        d: &mut LayerGrads<'_>,
    ) -> Result<()> {
        let (srows, h, dims, eps) = (b.srows, b.h, b.dims, b.eps);
        let (all, kvw, lo) = (b.store.rows, dims.kv_width(), b.pk.lo);
        let w = &self.model.weights;
        let layers = w.text.len();
        for l in (0..layers).rev() {
            let blk = &w.text[l];
            s.memset_zeros(d.pk)?;
            s.memset_zeros(d.pv)?;
            // the suffix rows' activations: kept (used once, then freed) or recomputed
            let mut kept_l = None;
            let sfx = match suffix.as_deref_mut() {
                Some(SuffixActs { inputs, acts, kept }) => {
                    let xin = inputs.slice(l * srows * h..(l + 1) * srows * h);
                    let pre = b.pre_kv(l);
                    kept_l = kept.get_mut(l).and_then(Option::take);
                    let a = match (&kept_l, acts.as_mut()) {
                        (Some(k), _) => k,
                        (None, Some(a)) => {
                            layer_fwd(gpu, s, blk, sctx, &xin, a, None, Some(&pre))?;
                            &*a
                        }
                        (None, None) => {
                            return Err(GpuError::Input(format!(
                                "layer {l}: neither kept nor recomputable activations"
                            ))
                            .into())
                        }
                    };
                    Some((xin, pre, a))
                }
                None => None,
            };
            // each training group's prompt rows: kept by its prompt forward, or recomputed from
            // their kept inputs
            let mut prompts = Vec::new();
            for (gi, p) in b.packs.iter().enumerate() {
                if !b.trains[gi] {
                    continue;
                }
                let (lay, k) = (p.layout, b.kept[gi]);
                let rows = lay.rows();
                let pctx = LayerCtx {
                    rows,
                    hidden: h,
                    dims,
                    eps,
                    cos: &k.cos,
                    sin: &k.sin,
                    seqs: &k.seqs,
                    n_seqs: lay.copies,
                    max_q: lay.len,
                    iota: &rt.iota,
                    ones: &rt.ones,
                };
                let first = l * all + lay.row0;
                let xin = b.store.inputs.slice(first * h..(first + rows) * h);
                let acts = match k.acts.get(l) {
                    Some(a) => PromptActs::Kept(a),
                    None => {
                        let mut a = Acts::new(gpu, s, &pctx, blk)?;
                        layer_fwd(gpu, s, blk, &pctx, &xin, &mut a, None, None)?;
                        PromptActs::Recomputed(Box::new(a))
                    }
                };
                prompts.push((gi, pctx, xin, acts));
            }
            // the MLP halves of every row set at once
            {
                let mut sets = Vec::with_capacity(prompts.len() + 1);
                if let Some((_, _, a)) = &sfx {
                    sets.push(MlpSet {
                        saved: mlp_saved!(a),
                        dx: &mut *d.suffix,
                        rows: srows,
                    });
                }
                // the training groups' gradients, in the order `prompts` holds them
                let dprompt = (d.prompt.iter_mut().enumerate())
                    .filter(|(gi, _)| b.trains[*gi])
                    .map(|(_, dx)| dx);
                for ((_, pctx, _, acts), dx) in prompts.iter().zip(dprompt) {
                    sets.push(MlpSet {
                        saved: mlp_saved!(acts),
                        dx,
                        rows: pctx.rows,
                    });
                }
                let bb = BlockBwd {
                    gpu,
                    s,
                    layer: l,
                    b: blk,
                    rows: sets.iter().map(|x| x.rows).sum(),
                    hidden: h,
                    ones: &rt.ones,
                };
                bb.mlp_stacked(&mut self.grads, &mut sets)?;
            }
            if let Some((xin, pre, a)) = &sfx {
                layer_bwd_attn(
                    gpu,
                    s,
                    l,
                    blk,
                    sctx,
                    xin,
                    a,
                    d.suffix,
                    &mut self.grads,
                    PrefixGrad::Attend {
                        pre,
                        dk: d.pk,
                        dv: d.pv,
                    },
                )?;
            }
            drop(kept_l);
            for (gi, pctx, xin, acts) in &prompts {
                let p = &b.packs[*gi];
                let rows = pctx.rows;
                let r0 = p.layout.row0 - lo;
                layer_bwd_attn(
                    gpu,
                    s,
                    l,
                    blk,
                    pctx,
                    xin,
                    acts,
                    &mut d.prompt[*gi],
                    &mut self.grads,
                    PrefixGrad::Extra {
                        dk: d.pk.slice(r0 * kvw..(r0 + rows) * kvw),
                        dv: d.pv.slice(r0 * kvw..(r0 + rows) * kvw),
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Backward into the token embeddings: the suffix rows, then each training group's prompt
    /// rows (media rows skipped: their gradient goes to the vision backward).
    pub(super) fn embed_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        ids_d: &CudaSlice<u32>,
        dsuffix: &CudaSlice<bf16>,
        dprompt: &[CudaSlice<bf16>],
    ) -> Result<()> {
        let (srows, h, vocab) = (b.srows, b.h, b.vocab);
        let embed = self.grads.get(Slot::Embed)?;
        if srows > 0 {
            embedding_bwd_f32(gpu, s, embed, dsuffix, ids_d, srows, h, vocab, h)?;
        }
        for (gi, p) in b.packs.iter().enumerate() {
            if b.trains[gi] {
                let rows = p.layout.rows();
                embedding_bwd_f32(
                    gpu,
                    s,
                    embed,
                    &dprompt[gi],
                    &b.kept[gi].bwd_ids,
                    rows,
                    h,
                    vocab,
                    h,
                )?;
            }
        }
        Ok(())
    }

    /// Backward of each training group's media rows (summed over its copies) into the merger
    /// and the tower, group by group (`gathers`: each group's media-row gather, staged).
    pub(super) fn media_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        b: &Batch<'_, '_>,
        dprompt: &[CudaSlice<bf16>],
        gathers: &[Option<StagedGather>],
    ) -> Result<()> {
        let h = b.h;
        let train_tower = !self.cfg.freeze_vision;
        for (gi, k) in b.kept.iter().enumerate() {
            let (Some(kv), Some(g)) = (k.vision.as_ref(), gathers[gi].as_ref()) else {
                continue;
            };
            let mt = kv.rows.len();
            let mut d = alloc::<bf16>(gpu, s, mt.max(1) * h)?;
            gather_sum_rows_dev(gpu, s, &mut d, &dprompt[gi], &g.dev()?, h)?;
            let mut sink = VisionView(&mut self.grads);
            vision_backward(gpu, s, &self.model, &kv.state, &d, train_tower, &mut sink)?;
        }
        Ok(())
    }
}

/// A gather's host tables ([`RowGather`], checked against its buffers' rows) and their copies
/// on the device, staged with the micro-batch's other tables before its first launch.
pub(super) struct StagedGather {
    host: RowGather,
    dst: CudaSlice<u32>,
    off: CudaSlice<u32>,
    idx: CudaSlice<u32>,
}

impl StagedGather {
    /// Staging bytes of `g`'s tables.
    pub(super) fn bytes(g: &RowGather) -> usize {
        staged_bytes(&g.dst) + staged_bytes(&g.off) + staged_bytes(&g.idx)
    }

    pub(super) fn put(host: RowGather, up: &mut StagedBatch<'_>, gpu: &Gpu) -> Result<Self> {
        Ok(StagedGather {
            dst: up.put(gpu, &host.dst)?,
            off: up.put(gpu, &host.off)?,
            idx: up.put(gpu, &host.idx)?,
            host,
        })
    }

    fn dev(&self) -> Result<RowGatherDev<'_>> {
        Ok(self.host.on_device(&self.dst, &self.off, &self.idx)?)
    }
}

/// A table per group, `None` where the group has none.
type PerGroup = Vec<Option<RowGather>>;

/// One group's prompt-row activations of a layer in backward: kept by its prompt forward, or
/// recomputed here from the layer's kept input.
enum PromptActs<'a> {
    Kept(&'a Acts),
    Recomputed(Box<Acts>),
}

impl std::ops::Deref for PromptActs<'_> {
    type Target = Acts;
    fn deref(&self) -> &Acts {
        match self {
            PromptActs::Kept(a) => a,
            PromptActs::Recomputed(a) => a,
        }
    }
}

/// The gathers of a micro-batch's backward on the host, per group (`None` where the group
/// trains nothing or has no such rows): each copy's token-0 rows into its last prompt row,
/// and each group's media rows summed over its copies.
pub(super) fn gathers(b: &Batch<'_, '_>) -> Result<(PerGroup, PerGroup)> {
    let mut token0 = Vec::with_capacity(b.packs.len());
    let mut media = Vec::with_capacity(b.packs.len());
    for (gi, p) in b.packs.iter().enumerate() {
        let l = p.layout;
        token0.push(match b.trains[gi] {
            true => {
                let lists = b.pk.first_rows_of(gi, l.copies);
                let dst: Vec<u32> = (0..l.copies)
                    .map(|c| (c * l.len + l.len - 1) as u32)
                    .collect();
                Some(RowGather::new(&dst, &lists, l.rows(), b.frows)?)
            }
            false => None,
        });
        media.push(match (b.trains[gi], b.kept[gi].vision.as_ref()) {
            (true, Some(kv)) => {
                let mt = kv.rows.len();
                let dst: Vec<u32> = (0..mt as u32).collect();
                Some(RowGather::new(&dst, &kv.rows, mt.max(1), l.rows())?)
            }
            _ => None,
        });
    }
    Ok((token0, media))
}

/// Token 0's gradients: each copy's last prompt row gets the sum of its responses' token-0
/// rows of `dfin` (fixed order; `gathers`: each group's token-0 gather, staged); returns each
/// group's prompt-row gradients (`[rows, H]`, zero elsewhere) and the suffix rows'
/// (`[max(srows, 1), H]`).
pub(super) fn token0_grads(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    b: &Batch<'_, '_>,
    dfin: &CudaSlice<bf16>,
    gathers: &[Option<StagedGather>],
) -> Result<(Vec<CudaSlice<bf16>>, CudaSlice<bf16>)> {
    let (srows, h) = (b.srows, b.h);
    let mut dprompt = Vec::with_capacity(b.packs.len());
    for (gi, p) in b.packs.iter().enumerate() {
        let l = p.layout;
        let mut d = alloc::<bf16>(gpu, s, l.rows() * h)?;
        s.memset_zeros(&mut d)?;
        if let Some(g) = gathers[gi].as_ref() {
            gather_sum_rows_dev(gpu, s, &mut d, dfin, &g.dev()?, h)?;
        }
        dprompt.push(d);
    }
    let mut dsuffix = alloc::<bf16>(gpu, s, srows.max(1) * h)?;
    if srows > 0 {
        s.memcpy_dtod(
            &dfin.slice(..srows * h),
            &mut dsuffix.slice_mut(..srows * h),
        )?;
    }
    Ok((dprompt, dsuffix))
}
