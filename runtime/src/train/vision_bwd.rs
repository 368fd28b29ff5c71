//! Backward of the vision tower and the merger, from a forward's [`VisionCache`]: the merger
//! (unless frozen: then only its input gradient, for a trained tower), the blocks top-down
//! (kept activations, or recomputed from each block's input), the window permutation undone,
//! the patch embedding. On one rank of a tensor-parallel group with the collectives of the
//! forward's conjugate (see `block_bwd`); the whole model is rank 0 of a group of one.

use rollplex_kernels::cpu::{gelu_bwd, gelu_fwd, linear_bwd, rmsnorm_bwd, rmsnorm_fwd, AttnMask};

use super::block_bwd::{block_bwd, grad_of, linear_backward, recompute_block, BlockCtx};
use super::{check_len, Result};
use crate::model::block::linear;
use crate::model::config::VISION_RMS_EPS;
use crate::model::positions::{vision_patch_hw, vision_rope_tables};
use crate::model::{
    CacheMode, EncodedMedia, LayerCache, MediaInput, ModelConfig, RankModel, VisionCache,
};
use crate::tp::Communicator;

/// The vision RoPE tables of a media batch in window-permuted order (what `encode_media`
/// builds; recomputed when the cache kept only layer inputs).
fn vision_rope_permuted(
    config: &ModelConfig,
    media: &[MediaInput<'_>],
    window_index: &[u32],
) -> (Vec<f32>, Vec<f32>) {
    let v = config.vision();
    let m = v.spatial_merge_size;
    let unit = (m * m) as usize;
    let hd = config.vision_head_dim();
    let grids: Vec<_> = media.iter().map(|it| it.grid).collect();
    let (cos0, sin0) =
        vision_rope_tables(&vision_patch_hw(&grids, m), hd, config.vision_rope_theta);
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
/// (unless frozen) of the whole model. `d_embeds` is the gradient of the items' embeddings,
/// concatenated in order.
#[cfg(test)]
pub(crate) fn vision_backward(
    model: &crate::model::Qwen25VL,
    cfg: &super::TrainConfig,
    g: &super::GroupBatch<'_>,
    vc: &VisionCache,
    d_embeds: &[f32],
    grads: &mut [f32],
) -> Result<()> {
    let train = (!cfg.freeze_merger, !cfg.freeze_vision);
    model
        .as_rank()
        .vision_backward(&crate::tp::SoloComm, train, g.media, vc, d_embeds, grads)
}

impl RankModel<'_> {
    /// Encodes media and back-propagates `d_embeds` (the gradient of the items' embeddings,
    /// concatenated in order, as the text decoder's backward hands it to the tower) into this
    /// rank's merger and vision-tower gradients (added into `grads`). Returns the embeddings.
    pub fn vision_forward_backward<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
        d_embeds: &[f32],
        grads: &mut [f32],
    ) -> Result<Vec<EncodedMedia>> {
        check_len("gradient buffer", self.weights.table.total(), grads.len())?;
        let mut vc = VisionCache::new(CacheMode::Full);
        let enc = self.encode_media(comm, items, Some(&mut vc))?;
        self.vision_backward(comm, (true, true), items, &vc, d_embeds, grads)?;
        Ok(enc)
    }

    /// Backward of the merger and the tower on this rank from a forward's cache (`media` are
    /// the items it encoded). A part not trained (`train_merger`, `train_tower` false) gets no
    /// gradient; a frozen merger still passes the gradient through to a trained tower. The
    /// merger's mlp.2 (row-parallel) needs no communication, mlp.0 (column-parallel)
    /// all-reduces its input gradient, each block as in the text decoder; the patch
    /// embedding's and norms' gradients come from replicated values.
    pub(crate) fn vision_backward<C: Communicator>(
        &self,
        comm: &C,
        (train_merger, train_tower): (bool, bool),
        media: &[MediaInput<'_>],
        vc: &VisionCache,
        d_embeds: &[f32],
        grads: &mut [f32],
    ) -> Result<()> {
        if !train_merger && !train_tower {
            return Ok(());
        }
        let w = self.weights;
        let lay = &w.layout;
        let v = self.config.vision();
        let m = v.spatial_merge_size;
        let unit = (m * m) as usize;
        let vh = v.hidden_size as usize;
        let pd = self.config.patch_dim();
        let n = vc.pixels.len() / pd;
        let groups = n / unit;
        let (mh, mh_in, out_w) = (lay.merger_fc1.out, lay.merger_fc1.inp, lay.merger_fc2.out);
        check_len("media embedding gradient", groups * out_w, d_embeds.len())?;
        if n == 0 {
            return Ok(());
        }
        let dims = self.vision_dims();
        let (cos, sin) = if vc.cos.is_empty() {
            vision_rope_permuted(self.config, media, &vc.window_index)
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
                comm,
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
            let fc1 = linear(w, &lay.merger_fc1, &xn, groups)?;
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
        if !train_tower && !train_merger {
            return Ok(());
        }
        let mut dxn = vec![0f32; groups * mh_in];
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
        comm.all_reduce_sum(&mut dxn)?;
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
        if !train_tower {
            return Ok(());
        }
        drop((dxn, dfc1, merger_in, xn, fc1, gel));
        for b in (0..depth).rev() {
            let ctx = ctx_of(b);
            let bp = &lay.vision_blocks[b];
            let recomputed;
            let acts: &LayerCache = match (vc.mode.layer(b), last_block.take()) {
                (CacheMode::LayerInputs, Some(c)) if b == depth - 1 => {
                    recomputed = c;
                    &recomputed
                }
                (CacheMode::LayerInputs, _) => {
                    recomputed = recompute_block(comm, w, bp, &vc.blocks[b].x_in, n, &ctx)?.0;
                    &recomputed
                }
                (CacheMode::Full | CacheMode::FirstLayers(_), _) => &vc.blocks[b],
            };
            dx = block_bwd(
                comm,
                w,
                bp,
                acts,
                n,
                &ctx,
                &dx,
                None,
                None,
                Some(&mut *grads),
            )?;
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
}
