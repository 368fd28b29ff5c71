//! The tensor-parallel vision tower: `Qwen25VL::encode_media` on one rank's shard. The patch
//! embedding and every norm are replicated; each block runs [`super::block::block_fwd`] with the
//! rank's heads (rows of the fused qkv) and intermediate rows; the merger's first linear is
//! column-parallel (GELU is element-wise, so it stays local) and its second row-parallel,
//! all-reduced. The embeddings every rank returns are bitwise equal.
//!
//! Backward ([`TpModel::vision_forward_backward`]): the merger's mlp.2 (row-parallel) needs no
//! communication, mlp.0 (column-parallel) all-reduces its input gradient, each block as in the
//! text decoder (`super::backward`); the patch embedding's and norms' gradients come from
//! replicated values and are bitwise equal on every rank.

use rollplex_kernels::cpu::{
    gelu_bwd, gelu_fwd, linear_bwd, linear_fwd, rmsnorm_bwd, rmsnorm_fwd, AttnDims, AttnMask,
    AttnSeq,
};

use crate::model::block::Attend;
use crate::model::config::VISION_RMS_EPS;
use crate::model::positions::{
    vision_cu_seqlens, vision_patch_hw, vision_rope_tables, vision_window_index,
};
use crate::model::{CacheMode, EncodedMedia, LayerCache, MediaInput, ModelError, VisionCache};

use super::backward::{train_err, BwdCtx};
use super::block::{block_fwd, column, row_parallel};
use super::comm::Communicator;
use super::{TpError, TpModel};
use crate::train::block_bwd::{grad_of, linear_backward};

impl TpModel {
    /// Encodes media items on this rank (one vision-tower pass over all of them); every rank
    /// passes the same items and gets the same embeddings.
    pub fn encode_media<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
    ) -> Result<Vec<EncodedMedia>, TpError> {
        self.encode_impl(comm, items, None)
    }

    /// [`TpModel::encode_media`], keeping in `cache` (when given) every activation the backward
    /// reads, as `CacheMode::Full` (the merger's fc1/GELU rows and the blocks' q/k/v/attention/
    /// MLP activations at the rank's widths).
    pub(crate) fn encode_impl<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
        mut cache: Option<&mut VisionCache>,
    ) -> Result<Vec<EncodedMedia>, TpError> {
        self.check_comm(comm)?;
        let cfg = &self.plan.config;
        let v = cfg.vision();
        let m = v.spatial_merge_size;
        let unit = (m * m) as usize;
        let pd = cfg.patch_dim();
        let vh = v.hidden_size as usize;
        let mut grids = Vec::with_capacity(items.len());
        let mut pixels = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let [t, h, w] = it.grid;
            if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
                return Err(ModelError::Input(format!(
                    "media item {i}: grid {:?} must be positive with h and w multiples of the merge size {m}",
                    it.grid
                ))
                .into());
            }
            let n = (t * h * w) as usize;
            if it.pixels.len() != n * pd {
                return Err(ModelError::Input(format!(
                    "media item {i}: {} pixel values, expected {n} patches x {pd} = {}",
                    it.pixels.len(),
                    n * pd
                ))
                .into());
            }
            grids.push(it.grid);
            pixels.extend_from_slice(it.pixels);
        }
        let n = pixels.len() / pd.max(1);
        if n == 0 {
            return Ok(Vec::new());
        }
        let w = &self.weights;
        let lw = &w.layout;
        let mut x0 = vec![0f32; n * vh];
        linear_fwd(&mut x0, &pixels, w.get(lw.patch_embed), None, n, pd, vh)?;
        let (window_index, cu_window) = vision_window_index(&grids, m, v.window_size, v.patch_size);
        let permute = |src: &[f32], width: usize| -> Vec<f32> {
            let mut out = vec![0f32; src.len()];
            for (i, &g) in window_index.iter().enumerate() {
                let (d, s) = (i * unit * width, g as usize * unit * width);
                out[d..d + unit * width].copy_from_slice(&src[s..s + unit * width]);
            }
            out
        };
        let mut x = permute(&x0, vh);
        drop(x0);
        let hd = cfg.vision_head_dim();
        let hw = vision_patch_hw(&grids, m);
        let (cos0, sin0) = vision_rope_tables(&hw, hd, cfg.vision_rope_theta);
        let (cos, sin) = (permute(&cos0, hd), permute(&sin0, hd));
        let full_seqs = AttnSeq::from_cu_seqlens(&vision_cu_seqlens(&grids));
        let window_seqs = AttnSeq::from_cu_seqlens(&cu_window);
        let heads = self.dims().vision_heads;
        let dims = AttnDims {
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: hd,
        };
        let mut lc = LayerCache::default();
        for (bi, bp) in lw.vision_blocks.iter().enumerate() {
            let seqs = if v.fullatt_block_indexes.contains(&(bi as u32)) {
                &full_seqs
            } else {
                &window_seqs
            };
            let attend = Attend::Packed {
                seqs,
                mask: AttnMask::Full,
                prefix_k: &[],
                prefix_v: &[],
            };
            block_fwd(
                comm,
                w,
                bp,
                &mut x,
                n,
                dims,
                VISION_RMS_EPS,
                &cos,
                &sin,
                attend,
                cache.is_some().then_some(&mut lc),
            )?;
            if let Some(c) = cache.as_deref_mut() {
                c.blocks.push(std::mem::take(&mut lc));
            }
        }
        let mut xn = vec![0f32; n * vh];
        let mut rstd = vec![0f32; n];
        rmsnorm_fwd(
            &mut xn,
            Some(&mut rstd),
            &x,
            w.get(lw.merger_ln),
            n,
            vh,
            VISION_RMS_EPS,
        )?;
        let groups = n / unit;
        let fc1 = column(w, &lw.merger_fc1, &xn, groups)?;
        let mut g = vec![0f32; fc1.len()];
        gelu_fwd(&mut g, &fc1)?;
        let merged = row_parallel(comm, w, &lw.merger_fc2, &g, groups)?;
        let out_w = lw.merger_fc2.out;
        let mut unperm = vec![0f32; merged.len()];
        for (i, &gi) in window_index.iter().enumerate() {
            let gi = gi as usize;
            unperm[gi * out_w..(gi + 1) * out_w]
                .copy_from_slice(&merged[i * out_w..(i + 1) * out_w]);
        }
        if let Some(c) = cache {
            c.mode = CacheMode::Full;
            c.window_index = window_index.clone();
            c.full_seqs = full_seqs;
            c.window_seqs = window_seqs;
            c.pixels = pixels;
            c.cos = cos;
            c.sin = sin;
            c.merger_in = x;
            c.merger_rstd = rstd;
            c.merger_xn = xn;
            c.merger_fc1 = fc1;
            c.merger_gelu = g;
        }
        let mut out = Vec::with_capacity(items.len());
        let mut off = 0;
        for it in items {
            let toks = (it.grid[0] * it.grid[1] * it.grid[2]) as usize / unit;
            out.push(EncodedMedia {
                kind: it.kind,
                grid: it.grid,
                embeds: unperm[off * out_w..(off + toks) * out_w].to_vec(),
            });
            off += toks;
        }
        Ok(out)
    }
}

impl TpModel {
    /// Encodes media and back-propagates `d_embeds` (the gradient of the items' embeddings,
    /// concatenated in order, as the text decoder's backward hands it to the tower) into this
    /// rank's merger and vision-tower gradients (added into `grads`). Returns the embeddings.
    pub fn vision_forward_backward<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
        d_embeds: &[f32],
        grads: &mut [f32],
    ) -> Result<Vec<EncodedMedia>, TpError> {
        let w = &self.weights;
        if grads.len() != w.table.total() {
            return Err(ModelError::Input(format!(
                "gradient buffer has {} elements, rank {}'s shard {}",
                grads.len(),
                self.rank,
                w.table.total()
            ))
            .into());
        }
        let mut vc = VisionCache::new(CacheMode::Full);
        let enc = self.encode_impl(comm, items, Some(&mut vc))?;
        self.vision_backward(comm, (true, true), &vc, d_embeds, grads)?;
        Ok(enc)
    }

    /// Backward of the merger and the tower from a forward's cache (`encode_impl` with a
    /// cache): `d_embeds` as in [`TpModel::vision_forward_backward`]. A part not trained
    /// (`train_merger`, `train_tower` false) gets no gradient; a frozen merger still passes the
    /// gradient through to a trained tower.
    pub(crate) fn vision_backward<C: Communicator>(
        &self,
        comm: &C,
        (train_merger, train_tower): (bool, bool),
        vc: &VisionCache,
        d_embeds: &[f32],
        grads: &mut [f32],
    ) -> Result<(), TpError> {
        if !train_merger && !train_tower {
            return Ok(());
        }
        let w = &self.weights;
        let lay = &w.layout;
        let cfg = &self.plan.config;
        let v = cfg.vision();
        let unit = (v.spatial_merge_size * v.spatial_merge_size) as usize;
        let vh = v.hidden_size as usize;
        let pd = cfg.patch_dim();
        let n = vc.pixels.len() / pd.max(1);
        let groups = n / unit;
        let (mh_local, mh_in, out_w) = (lay.merger_fc1.out, lay.merger_fc1.inp, lay.merger_fc2.out);
        if d_embeds.len() != groups * out_w {
            return Err(ModelError::Input(format!(
                "media embedding gradient has {} values, the items have {groups} x {out_w}",
                d_embeds.len()
            ))
            .into());
        }
        if n == 0 {
            return Ok(());
        }
        let mut d_merged = vec![0f32; groups * out_w];
        for (i, &gi) in vc.window_index.iter().enumerate() {
            let gi = gi as usize;
            d_merged[i * out_w..(i + 1) * out_w]
                .copy_from_slice(&d_embeds[gi * out_w..(gi + 1) * out_w]);
        }
        // a frozen merger passes its input gradient on without gradients of its own
        let lb = |l: &crate::model::weights::Linear,
                  dx: &mut [f32],
                  dy: &[f32],
                  x: &[f32],
                  rows: usize,
                  g: &mut [f32]|
         -> Result<(), TpError> {
            let g = train_merger.then_some(g);
            linear_backward(w, l, Some(dx), dy, x, rows, g, false).map_err(train_err)
        };
        // mlp.2 row-parallel: the rank's input columns, no communication
        let mut dg = vec![0f32; groups * mh_local];
        lb(
            &lay.merger_fc2,
            &mut dg,
            &d_merged,
            &vc.merger_gelu,
            groups,
            grads,
        )?;
        let mut dfc1 = vec![0f32; groups * mh_local];
        gelu_bwd(&mut dfc1, &dg, &vc.merger_fc1)?;
        drop(dg);
        // mlp.0 column-parallel: partial input gradients, all-reduced
        let mut dxn = vec![0f32; groups * mh_in];
        lb(
            &lay.merger_fc1,
            &mut dxn,
            &dfc1,
            &vc.merger_xn,
            groups,
            grads,
        )?;
        drop(dfc1);
        comm.all_reduce_sum(&mut dxn)?;
        let mut dx = vec![0f32; n * vh];
        rmsnorm_bwd(
            &mut dx,
            train_merger.then(|| grad_of(w, grads, lay.merger_ln)),
            &dxn,
            &vc.merger_in,
            w.get(lay.merger_ln),
            &vc.merger_rstd,
            n,
            vh,
            false,
        )?;
        drop(dxn);
        if !train_tower {
            return Ok(());
        }
        let heads = self.dims().vision_heads;
        let dims = AttnDims {
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: cfg.vision_head_dim(),
        };
        for (b, bp) in lay.vision_blocks.iter().enumerate().rev() {
            let ctx = BwdCtx {
                seqs: if v.fullatt_block_indexes.contains(&(b as u32)) {
                    &vc.full_seqs
                } else {
                    &vc.window_seqs
                },
                mask: AttnMask::Full,
                dims,
                cos: &vc.cos,
                sin: &vc.sin,
                prefix_k: &[],
                prefix_v: &[],
            };
            dx = self.block_bwd(comm, bp, &vc.blocks[b], n, &ctx, &dx, None, None, grads)?;
        }
        // undo the window permutation; the patch embedding (replicated) gets its weight gradient
        let mut dx0 = vec![0f32; n * vh];
        for (i, &gi) in vc.window_index.iter().enumerate() {
            let (d, s) = (gi as usize * unit * vh, i * unit * vh);
            dx0[d..d + unit * vh].copy_from_slice(&dx[s..s + unit * vh]);
        }
        linear_bwd(
            None,
            Some(grad_of(w, grads, lay.patch_embed)),
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
