//! The tensor-parallel vision tower: `Qwen25VL::encode_media` on one rank's shard. The patch
//! embedding and every norm are replicated; each block runs [`super::block::block_fwd`] with the
//! rank's heads (rows of the fused qkv) and intermediate rows; the merger's first linear is
//! column-parallel (GELU is element-wise, so it stays local) and its second row-parallel,
//! all-reduced. The embeddings every rank returns are bitwise equal.

use rollplex_kernels::cpu::{gelu_fwd, linear_fwd, rmsnorm_fwd, AttnDims, AttnMask, AttnSeq};

use crate::model::block::Attend;
use crate::model::config::VISION_RMS_EPS;
use crate::model::positions::{
    vision_cu_seqlens, vision_patch_hw, vision_rope_tables, vision_window_index,
};
use crate::model::{EncodedMedia, MediaInput, ModelError};

use super::block::{block_fwd, column, row_parallel};
use super::comm::Communicator;
use super::{TpError, TpModel};

impl TpModel {
    /// Encodes media items on this rank (one vision-tower pass over all of them); every rank
    /// passes the same items and gets the same embeddings.
    pub fn encode_media<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
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
                None,
            )?;
        }
        let mut xn = vec![0f32; n * vh];
        rmsnorm_fwd(
            &mut xn,
            None,
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
