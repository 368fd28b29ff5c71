//! Host-side index work of the GPU forward: everything that is a function of shapes, token ids
//! and grids rather than of activations. Computed with the CPU engine's own position code
//! (`model::positions`), so both backends place every token, window and rotary angle the same.
//!
//! Pure and GPU-free (tested here without a device): the vision tower's window permutation and
//! its inverse, the permuted 2D RoPE tables and attention sequences; a packed prompt batch's
//! M-RoPE tables, sequences and media rows; the checks of decode slots against an arena.

use half::bf16;
use rollplex_kernels::cpu::AttnSeq;

use rayon::prelude::*;

use crate::model::positions::{
    inv_freq, rope_index, vision_cu_seqlens, vision_patch_hw, vision_window_index, MediaSlot,
};
use crate::model::{DecodeSlot, Grid, MediaKind, ModelConfig};

use super::{GpuError, Result};

/// The vision tower's host-side inputs for a batch of media items.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionPlan {
    /// Patches (all items).
    pub patches: usize,
    /// Patches per merge group (`m²`).
    pub unit: usize,
    /// `window_index[i]`: the merge group placed at permuted position `i`.
    pub window_index: Vec<u32>,
    /// `inverse[g]`: the permuted position of merge group `g` (gathers merged rows back into
    /// the processor's order).
    pub inverse: Vec<u32>,
    /// RoPE tables `[patches, head_dim]` in permuted order.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// Per-frame sequences (full-attention blocks) and windows (the others), over permuted rows.
    pub full_seqs: Vec<AttnSeq>,
    pub window_seqs: Vec<AttnSeq>,
}

impl VisionPlan {
    /// The plan for `grids` (each `[t, h, w]` with `h`, `w` multiples of the merge size).
    pub fn new(cfg: &ModelConfig, grids: &[Grid]) -> Result<Self> {
        let v = cfg.vision();
        let m = v.spatial_merge_size;
        for (i, g) in grids.iter().enumerate() {
            let [t, h, w] = *g;
            if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
                return Err(GpuError::Input(format!(
                    "media item {i}: grid {g:?} must be positive with h and w multiples of the merge size {m}"
                )));
            }
        }
        let unit = (m * m) as usize;
        let (window_index, cu_window) = vision_window_index(grids, m, v.window_size, v.patch_size);
        let groups = window_index.len();
        let mut inverse = vec![0u32; groups];
        for (i, &g) in window_index.iter().enumerate() {
            inverse[g as usize] = i as u32;
        }
        let hd = cfg.vision_head_dim();
        let hw = vision_patch_hw(grids, m);
        let (cos0, sin0) = vision_rope_tables_memo(&hw, hd, cfg.vision_rope_theta);
        let cos = permute_groups(&cos0, &window_index, unit, hd);
        let sin = permute_groups(&sin0, &window_index, unit, hd);
        Ok(VisionPlan {
            patches: groups * unit,
            unit,
            window_index,
            inverse,
            cos,
            sin,
            full_seqs: AttnSeq::from_cu_seqlens(&vision_cu_seqlens(grids)),
            window_seqs: AttnSeq::from_cu_seqlens(&cu_window),
        })
    }

    /// The patch rows (`items[k]`: item k's `[patches_k, width]`, in item order) in permuted
    /// order, as bf16 (the patch embedding is row-wise, so permuting its input equals permuting
    /// its output). Parallel over merge groups.
    pub fn permute_rows_bf16(&self, items: &[&[f32]], width: usize) -> Vec<bf16> {
        let gw = self.unit * width;
        // first global merge group of each item
        let mut starts = Vec::with_capacity(items.len());
        let mut g0 = 0usize;
        for it in items {
            starts.push(g0);
            g0 += it.len() / gw.max(1);
        }
        let mut out = vec![bf16::ZERO; self.window_index.len() * gw];
        out.par_chunks_mut(gw.max(1))
            .zip(self.window_index.par_iter())
            .for_each(|(dst, &g)| {
                let g = g as usize;
                let k = starts.partition_point(|&s| s <= g) - 1;
                let s = (g - starts[k]) * gw;
                for (d, x) in dst.iter_mut().zip(&items[k][s..s + gw]) {
                    *d = bf16::from_f32(*x);
                }
            });
        out
    }
}

/// Rows of `src` (`[groups * unit, width]`) in the order `index` gives (in groups of `unit`).
pub fn permute_groups(src: &[f32], index: &[u32], unit: usize, width: usize) -> Vec<f32> {
    let gw = unit * width;
    let mut out = Vec::with_capacity(src.len());
    for &g in index {
        let s = g as usize * gw;
        out.extend_from_slice(&src[s..s + gw]);
    }
    out
}

/// One prompt of a packed batch: its placeholder tokens and the media (kind, grid) filling them.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptSpec<'a> {
    pub ids: &'a [u32],
    pub media: Vec<MediaSlot>,
}

/// A packed prompt batch's host-side inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedPrompts {
    pub ids: Vec<u32>,
    pub seqs: Vec<AttnSeq>,
    pub deltas: Vec<i64>,
    /// M-RoPE tables `[rows, head_dim]`.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// Packed rows of the media placeholder tokens, in prompt and placeholder order (the order
    /// the media embeddings are concatenated in).
    pub media_rows: Vec<u32>,
}

impl PackedPrompts {
    pub fn new(cfg: &ModelConfig, prompts: &[PromptSpec<'_>]) -> Result<Self> {
        let t = cfg.text();
        let tok = &cfg.spec.tokens;
        let m = cfg.vision().spatial_merge_size;
        let mut ids = Vec::new();
        let mut seqs = Vec::new();
        let mut deltas = Vec::new();
        let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut media_rows = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if p.ids.is_empty() {
                return Err(GpuError::Input(format!("prompt {i} is empty")));
            }
            let (pp, d) = rope_index(
                p.ids,
                &p.media,
                tok.image_token_id,
                tok.video_token_id,
                m,
                cfg.tokens_per_second,
            )?;
            let start = ids.len() as u32;
            for (j, &id) in p.ids.iter().enumerate() {
                if id == tok.image_token_id || id == tok.video_token_id {
                    media_rows.push(start + j as u32);
                }
            }
            seqs.push(AttnSeq {
                start,
                len: p.ids.len() as u32,
                prefix_start: 0,
                prefix_len: 0,
            });
            ids.extend_from_slice(p.ids);
            for s in 0..3 {
                pos[s].extend_from_slice(&pp[s]);
            }
            deltas.push(d);
        }
        let (cos, sin) =
            mrope_tables_memo(&pos, t.head_dim() as usize, t.rope_theta, t.mrope_section);
        Ok(PackedPrompts {
            ids,
            seqs,
            deltas,
            cos,
            sin,
            media_rows,
        })
    }
}

/// M-RoPE tables of tokens whose positions are equal in all three sections (decode and
/// response tokens: `n + rope_delta`).
pub fn flat_rope_tables(cfg: &ModelConfig, positions: &[i64]) -> (Vec<f32>, Vec<f32>) {
    let t = cfg.text();
    let pos = [positions.to_vec(), positions.to_vec(), positions.to_vec()];
    mrope_tables_memo(&pos, t.head_dim() as usize, t.rope_theta, t.mrope_section)
}

/// cos/sin of `p * f[i]` for every `i`, computed once per distinct position `p` (as
/// `model::positions` computes each entry: `a = p as f32 * f[i]`, then f64 cos/sin).
struct AngleMemo<'a> {
    f: &'a [f32],
    rows: std::collections::HashMap<i64, Angles>,
}

/// cos and sin of one position's angles.
type Angles = (Vec<f32>, Vec<f32>);

impl<'a> AngleMemo<'a> {
    fn new(f: &'a [f32]) -> Self {
        AngleMemo {
            f,
            rows: std::collections::HashMap::new(),
        }
    }
    /// Computes the angles of every distinct position of `ps` not yet held, in parallel.
    fn fill(&mut self, ps: impl Iterator<Item = i64>) {
        let mut todo: Vec<i64> = ps.filter(|p| !self.rows.contains_key(p)).collect();
        todo.sort_unstable();
        todo.dedup();
        let f = self.f;
        let new: Vec<(i64, Angles)> = todo
            .into_par_iter()
            .map(|p| (p, Self::angles(f, p)))
            .collect();
        self.rows.extend(new);
    }
    fn angles(f: &[f32], p: i64) -> Angles {
        f.iter()
            .map(|&fi| {
                let a = p as f32 * fi;
                ((a as f64).cos() as f32, (a as f64).sin() as f32)
            })
            .unzip()
    }
}

/// `model::positions::mrope_tables`, bitwise, with each distinct position's angles computed
/// once (a packed batch repeats positions across prompts; the host would otherwise spend more
/// time on trigonometry than the device on the layer).
pub fn mrope_tables_memo(
    pos: &[Vec<i64>; 3],
    head_dim: usize,
    theta: f64,
    section: [u32; 3],
) -> (Vec<f32>, Vec<f32>) {
    let f = inv_freq(theta, head_dim);
    let half = head_dim / 2;
    let sec_of: Vec<usize> = (0..half)
        .map(|i| {
            if i < section[0] as usize {
                0
            } else if i < (section[0] + section[1]) as usize {
                1
            } else {
                2
            }
        })
        .collect();
    let n = pos[0].len();
    // every distinct position's angles once (serial, small), then the rows in parallel
    let mut memo = AngleMemo::new(&f);
    memo.fill(pos.iter().flat_map(|ps| ps.iter().copied()));
    let rows = &memo.rows;
    // section s owns the frequency slots [bounds[s], bounds[s + 1]) (as `sec_of` says)
    let s0 = (section[0] as usize).min(half);
    let s1 = ((section[0] + section[1]) as usize).min(half);
    let bounds = [0, s0, s1, half];
    debug_assert!((0..half).all(|i| i >= bounds[sec_of[i]] && i < bounds[sec_of[i] + 1]));
    let mut cos = vec![0f32; n * head_dim];
    let mut sin = vec![0f32; n * head_dim];
    cos.par_chunks_mut(head_dim)
        .zip(sin.par_chunks_mut(head_dim))
        .enumerate()
        .for_each(|(t, (c, sn))| {
            for (sec, ps) in pos.iter().enumerate() {
                let (rc, rs) = &rows[&ps[t]];
                let (a, b) = (bounds[sec], bounds[sec + 1]);
                c[a..b].copy_from_slice(&rc[a..b]);
                c[half + a..half + b].copy_from_slice(&rc[a..b]);
                sn[a..b].copy_from_slice(&rs[a..b]);
                sn[half + a..half + b].copy_from_slice(&rs[a..b]);
            }
        });
    (cos, sin)
}

/// `model::positions::vision_rope_tables`, bitwise, with each distinct row / column
/// coordinate's angles computed once.
pub fn vision_rope_tables_memo(
    hw: &[(u32, u32)],
    head_dim: usize,
    theta: f64,
) -> (Vec<f32>, Vec<f32>) {
    let f = inv_freq(theta, head_dim / 2);
    let q = f.len();
    let mut memo = AngleMemo::new(&f);
    memo.fill(hw.iter().flat_map(|&(h, w)| [h as i64, w as i64]));
    let rows = &memo.rows;
    let mut cos = vec![0f32; hw.len() * head_dim];
    let mut sin = vec![0f32; hw.len() * head_dim];
    cos.par_chunks_mut(head_dim)
        .zip(sin.par_chunks_mut(head_dim))
        .zip(hw.par_iter())
        .for_each(|((c, sn), &(h, w))| {
            for (slot0, p) in [(0, h), (q, w)] {
                let (rc, rs) = &rows[&(p as i64)];
                for off in [0, head_dim / 2] {
                    c[off + slot0..off + slot0 + q].copy_from_slice(&rc[..q]);
                    sn[off + slot0..off + slot0 + q].copy_from_slice(&rs[..q]);
                }
            }
        });
    (cos, sin)
}

/// Checks decode slots against an arena of `capacity` rows: room left in every suffix, spans
/// inside the arena, suffixes disjoint from each other and from every prefix (the same rules
/// as the CPU engine's `decode_step`).
pub fn check_decode_slots(capacity: u32, slots: &[DecodeSlot]) -> Result<()> {
    DecodeSlot::check_batch(slots, capacity).map_err(GpuError::Input)
}

/// The media slot of an encoded item (kind and grid).
pub fn media_slot(kind: MediaKind, grid: Grid) -> MediaSlot {
    MediaSlot { kind, grid }
}

/// Picks the decode attention kernel for a head dim: the tensor-core decode kernel needs a
/// multiple of 32; the varlen forward kernel (one query per sequence) takes multiples of 16.
pub fn decode_kernel_for(head_dim: usize) -> Result<DecodeKernel> {
    if head_dim.is_multiple_of(32) && head_dim <= 256 {
        Ok(DecodeKernel::TensorCores)
    } else if head_dim.is_multiple_of(16) && head_dim <= 256 {
        Ok(DecodeKernel::Varlen)
    } else {
        Err(GpuError::Unsupported(format!(
            "text head_dim {head_dim}: the CUDA attention kernels need a multiple of 16 up to 256"
        )))
    }
}

/// Which attention kernel a decode step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `attention_decode_bf16` (split-K over keys, tensor cores).
    TensorCores,
    /// `attention_fwd_bf16` with one query row per sequence.
    Varlen,
}

/// Every id must index the vocabulary (the device gather would give a NaN row instead of an
/// error).
pub fn check_ids(what: &str, ids: &[u32], vocab: usize) -> Result<()> {
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(GpuError::Input(format!(
            "{what}: token {i} is id {id}, outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}
