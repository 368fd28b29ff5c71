//! The vision tower: patch embedding, window-permuted blocks with 2D RoPE, patch merger.
//!
//! Input: `pixel_values [N, C*tp*p*p]` exactly as the Hugging Face processor flattens patches
//! (frame-major, merge blocks of `m x m` patches contiguous) and one `grid [t, h, w]` per item.
//! Output: `N / m²` embeddings of the text width per item, in the processor's (placeholder) order.
//!
//! Steps, as `Qwen2_5_VisionTransformerPretrainedModel.forward`: patch embed (the Conv3d with
//! kernel = stride is a linear over the flattened patch); permute merge groups by the window
//! index; RoPE tables from each patch's (h, w), permuted the same way; blocks, full attention per
//! frame at `fullatt_block_indexes`, window attention elsewhere; merger (RMSNorm, groups of m²
//! patches, Linear-GELU-Linear); undo the window permutation.
//!
//! Several items encoded together give bitwise the embeddings of each encoded alone (attention
//! never crosses a frame, every other op is row-wise).
//!
//! On one rank of a tensor-parallel group ([`RankModel::encode_media`]): the patch embedding and
//! every norm are replicated; each block runs with the rank's heads (rows of the fused qkv) and
//! intermediate rows; the merger's first linear is column-parallel (GELU is element-wise, so it
//! stays local) and its second row-parallel, all-reduced. The embeddings every rank returns are
//! bitwise equal. [`Qwen25VL::encode_media`] is rank 0 of a group of one.

use rollplex_kernels::cpu::{gelu_fwd, linear_fwd, rmsnorm_fwd, AttnDims, AttnMask, AttnSeq};

use super::block::{block_fwd, linear, row_parallel, Attend};
use super::cache::{CacheMode, LayerCache, VisionCache};
use super::config::VISION_RMS_EPS;
use super::positions::{
    vision_cu_seqlens, vision_patch_hw, vision_rope_tables, vision_window_index, Grid, MediaKind,
};
use super::{ModelError, Qwen25VL, RankModel};
use crate::tp::{Communicator, SoloComm};

/// One image or video to encode.
#[derive(Clone, Copy, Debug)]
pub struct MediaInput<'a> {
    pub kind: MediaKind,
    /// `[t*h*w, in_channels * temporal_patch * patch * patch]`.
    pub pixels: &'a [f32],
    pub grid: Grid,
}

/// A vision-encoded media item, ready to fill its placeholder tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedMedia {
    pub kind: MediaKind,
    pub grid: Grid,
    /// `[t*h*w / m², text_hidden]`.
    pub embeds: Vec<f32>,
}

impl EncodedMedia {
    /// Placeholder tokens this item fills.
    pub fn tokens(&self, merge: u32) -> usize {
        (self.grid[0] * self.grid[1] * self.grid[2] / (merge * merge)) as usize
    }
}

impl Qwen25VL {
    /// Encodes media items (one vision-tower pass over all of them).
    pub fn encode_media(
        &self,
        items: &[MediaInput<'_>],
        cache: Option<&mut VisionCache>,
    ) -> Result<Vec<EncodedMedia>, ModelError> {
        self.as_rank().encode_media(&SoloComm, items, cache)
    }
}

impl RankModel<'_> {
    /// This rank's attention dims in the vision tower (its heads).
    pub(crate) fn vision_dims(&self) -> AttnDims {
        let heads = self.dims.vision_heads;
        AttnDims {
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: self.config.vision_head_dim(),
        }
    }

    /// Encodes media items on this rank (one vision-tower pass over all of them); every rank
    /// passes the same items and gets the same embeddings. With a cache, keeps what its mode
    /// says (the blocks' activations at the rank's widths).
    pub fn encode_media<C: Communicator>(
        &self,
        comm: &C,
        items: &[MediaInput<'_>],
        cache: Option<&mut VisionCache>,
    ) -> Result<Vec<EncodedMedia>, ModelError> {
        self.check_comm(comm)?;
        let cfg = self.config;
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
                )));
            }
            let n = (t * h * w) as usize;
            if it.pixels.len() != n * pd {
                return Err(ModelError::Input(format!(
                    "media item {i}: {} pixel values, expected {n} patches x {pd} = {}",
                    it.pixels.len(),
                    n * pd
                )));
            }
            grids.push(it.grid);
            pixels.extend_from_slice(it.pixels);
        }
        let n = pixels.len() / pd.max(1);
        if n == 0 {
            return Ok(Vec::new());
        }
        let w = self.weights;
        let lw = &w.layout;
        // patch embedding: [N, pd] x [vh, pd]^T
        let mut x0 = vec![0f32; n * vh];
        linear_fwd(&mut x0, &pixels, w.get(lw.patch_embed), None, n, pd, vh)?;
        // window permutation of merge groups
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
        let dims = self.vision_dims();
        let mode = cache.as_ref().map(|c| c.mode);
        let mut blocks_cache = Vec::new();
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
            let mut lc = LayerCache::default();
            let c = mode.map(|md| (md, &mut lc));
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
                c,
            )?;
            if mode.is_some() {
                blocks_cache.push(lc);
            }
        }
        // merger
        let mut rstd = vec![0f32; n];
        let mut xn = vec![0f32; n * vh];
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
        let fc1 = linear(w, &lw.merger_fc1, &xn, groups)?;
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
            c.window_index = window_index.clone();
            c.full_seqs = full_seqs.clone();
            c.window_seqs = window_seqs.clone();
            c.blocks = blocks_cache;
            c.pixels = pixels;
            if c.mode == CacheMode::Full {
                c.cos = cos;
                c.sin = sin;
                c.merger_in = x;
                c.merger_rstd = rstd;
                c.merger_xn = xn;
                c.merger_fc1 = fc1;
                c.merger_gelu = g;
            }
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
