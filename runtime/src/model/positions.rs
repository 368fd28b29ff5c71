//! Positions: the vision tower's patch order, window permutation and 2D RoPE tables, and the
//! text decoder's 3D M-RoPE position ids (`get_rope_index`) and tables.
//!
//! Ported from transformers 5.17 (`vision_utils.get_vision_position_ids`,
//! `get_vision_window_index`, `get_vision_cu_seqlens`, `Qwen2_5_VLModel.get_rope_index`,
//! `Qwen2_5_VLRotaryEmbedding`, `Qwen2_5_VLVisionRotaryEmbedding`). Notable 5.17 behaviours
//! kept on purpose: a video's temporal step is `tokens_per_second * int(second_per_grid_t)`
//! (the seconds are truncated to an integer first), and the text position after a media item
//! advances by `max(h, w) / merge` (not by the largest position used).

use super::ModelError;

/// A media item's patch grid `[t, h, w]` (temporal patches, patch rows, patch columns).
pub type Grid = [u32; 3];

/// Image or video (videos carry the seconds one temporal patch spans).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MediaKind {
    Image,
    /// `second_per_grid_t`: seconds per temporal patch (`temporal_patch_size / fps`), `None`
    /// when the processor gave none (transformers then uses 1).
    Video {
        second_per_grid_t: Option<f64>,
    },
}

/// `(h, w)` patch coordinates of every patch in the processor's order (frame-major, then
/// merge blocks of `m x m` row-major, then row-major inside a block).
pub fn vision_patch_hw(grids: &[Grid], merge: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for &[t, h, w] in grids {
        let mut frame = Vec::with_capacity((h * w) as usize);
        for bh in 0..h / merge {
            for bw in 0..w / merge {
                for ih in 0..merge {
                    for iw in 0..merge {
                        frame.push((bh * merge + ih, bw * merge + iw));
                    }
                }
            }
        }
        for _ in 0..t {
            out.extend_from_slice(&frame);
        }
    }
    out
}

/// Window permutation of merged tokens and the cumulative window lengths (in patches), as
/// `get_vision_window_index`: `window_index[i]` is the merged token placed at position `i`.
pub fn vision_window_index(
    grids: &[Grid],
    merge: u32,
    window_size: u32,
    patch_size: u32,
) -> (Vec<u32>, Vec<u32>) {
    let ws = (window_size / merge / patch_size).max(1) as usize;
    let unit = merge * merge;
    let mut index = Vec::new();
    let mut cu = vec![0u32];
    let mut base = 0u32;
    for &[t, h, w] in grids {
        let (lh, lw) = ((h / merge) as usize, (w / merge) as usize);
        let pad_h = ws - lh % ws;
        let pad_w = ws - lw % ws;
        let (nwh, nww) = ((lh + pad_h) / ws, (lw + pad_w) / ws);
        for ti in 0..t as usize {
            for wh in 0..nwh {
                for ww in 0..nww {
                    let mut n = 0u32;
                    for r in wh * ws..(wh + 1) * ws {
                        for c in ww * ws..(ww + 1) * ws {
                            if r < lh && c < lw {
                                index.push(base + (ti * lh * lw + r * lw + c) as u32);
                                n += 1;
                            }
                        }
                    }
                    let last = *cu.last().unwrap_or(&0);
                    cu.push(last + n * unit);
                }
            }
        }
        base += t * (lh * lw) as u32;
    }
    cu.dedup(); // torch.unique_consecutive
    (index, cu)
}

/// Per-frame cumulative lengths (full-attention blocks attend within one frame).
pub fn vision_cu_seqlens(grids: &[Grid]) -> Vec<u32> {
    let mut cu = vec![0u32];
    for &[t, h, w] in grids {
        for _ in 0..t {
            let last = *cu.last().unwrap_or(&0);
            cu.push(last + h * w);
        }
    }
    cu
}

/// `1 / theta^(2i / dim)` for `i < dim / 2`, rounded as torch does in f32.
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            1.0f32 / (theta.powf(e as f64) as f32)
        })
        .collect()
}

/// cos/sin tables `[n, head_dim]` of the vision 2D RoPE for patches at `(h, w)`:
/// row = `[h f, w f, h f, w f]` with `f = inv_freq(theta, head_dim / 2)`.
pub fn vision_rope_tables(hw: &[(u32, u32)], head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let f = inv_freq(theta, head_dim / 2);
    let q = f.len(); // head_dim / 4
    let mut cos = vec![0f32; hw.len() * head_dim];
    let mut sin = vec![0f32; hw.len() * head_dim];
    for (i, &(h, w)) in hw.iter().enumerate() {
        for (j, fj) in f.iter().enumerate() {
            for (slot, pos) in [(j, h), (q + j, w)] {
                let a = pos as f32 * fj;
                let (c, s) = ((a as f64).cos() as f32, (a as f64).sin() as f32);
                for off in [0, head_dim / 2] {
                    cos[i * head_dim + off + slot] = c;
                    sin[i * head_dim + off + slot] = s;
                }
            }
        }
    }
    (cos, sin)
}

/// cos/sin tables `[n, head_dim]` of M-RoPE for 3D positions `pos[3][n]` (temporal, height,
/// width): half-dim `i` uses the position of section `s(i)` of `mrope_section`; both halves equal.
pub fn mrope_tables(
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
    let mut cos = vec![0f32; n * head_dim];
    let mut sin = vec![0f32; n * head_dim];
    for t in 0..n {
        for i in 0..half {
            let a = pos[sec_of[i]][t] as f32 * f[i];
            let (c, s) = ((a as f64).cos() as f32, (a as f64).sin() as f32);
            cos[t * head_dim + i] = c;
            cos[t * head_dim + half + i] = c;
            sin[t * head_dim + i] = s;
            sin[t * head_dim + half + i] = s;
        }
    }
    (cos, sin)
}

/// One media placeholder run of a prompt, for [`rope_index`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MediaSlot {
    pub kind: MediaKind,
    pub grid: Grid,
}

/// 3D position ids of a prompt and its rope delta, as `get_rope_index` (transformers 5.17).
///
/// Tokens equal to `image_token` / `video_token` form runs; each run takes the next item of
/// `media` in order (which must be of that kind, and whose merged token count must equal the run
/// length). Returns `([t, h, w] positions, delta)`; a later token at index `n` has position
/// `n + delta` in all three sections.
pub fn rope_index(
    ids: &[u32],
    media: &[MediaSlot],
    image_token: u32,
    video_token: u32,
    merge: u32,
    tokens_per_second: u32,
) -> Result<([Vec<i64>; 3], i64), ModelError> {
    let n = ids.len();
    let mut pos: [Vec<i64>; 3] = [
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    ];
    let kind_of = |id: u32| {
        if id == image_token {
            1
        } else if id == video_token {
            2
        } else {
            0
        }
    };
    let mut cur: i64 = 0;
    let mut i = 0;
    let mut next_media = 0;
    while i < n {
        let k = kind_of(ids[i]);
        let mut j = i;
        while j < n && kind_of(ids[j]) == k {
            j += 1;
        }
        if k == 0 {
            for _ in i..j {
                for p in pos.iter_mut() {
                    p.push(cur);
                }
                cur += 1;
            }
        } else {
            let m = media.get(next_media).ok_or_else(|| {
                ModelError::Input(format!(
                    "prompt has more media placeholder runs than the {} media given",
                    media.len()
                ))
            })?;
            next_media += 1;
            let want_kind = if k == 1 { "image" } else { "video" };
            let interval = match (k, m.kind) {
                (1, MediaKind::Image) => 1i64,
                (2, MediaKind::Video { second_per_grid_t }) => {
                    tokens_per_second as i64 * second_per_grid_t.unwrap_or(1.0).trunc() as i64
                }
                _ => {
                    return Err(ModelError::Input(format!(
                        "media item {} is {:?} but its placeholder tokens are {want_kind} tokens",
                        next_media - 1,
                        m.kind
                    )))
                }
            };
            let [t, h, w] = m.grid;
            let (lt, lh, lw) = (t as i64, (h / merge) as i64, (w / merge) as i64);
            if (lt * lh * lw) as usize != j - i {
                return Err(ModelError::Input(format!(
                    "media item {} (grid {:?}) has {} merged tokens but its placeholder run has {}",
                    next_media - 1,
                    m.grid,
                    lt * lh * lw,
                    j - i
                )));
            }
            for ti in 0..lt {
                for hi in 0..lh {
                    for wi in 0..lw {
                        pos[0].push(ti * interval + cur);
                        pos[1].push(hi + cur);
                        pos[2].push(wi + cur);
                    }
                }
            }
            cur += lh.max(lw);
        }
        i = j;
    }
    if next_media != media.len() {
        return Err(ModelError::Input(format!(
            "{} media given but the prompt has {next_media} placeholder runs",
            media.len()
        )));
    }
    let max = pos
        .iter()
        .flat_map(|p| p.iter())
        .copied()
        .max()
        .unwrap_or(-1);
    let delta = max + 1 - n as i64;
    Ok((pos, delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_index_of_one_image() {
        // grid 1x8x12 patches, merge 2 -> 4x6 merged tokens; window 112/2/14 = 4 merged tokens
        let (idx, cu) = vision_window_index(&[[1, 8, 12]], 2, 112, 14);
        assert_eq!(idx.len(), 24);
        // first window: rows 0..4, cols 0..4 of the 4x6 grid
        assert_eq!(
            &idx[..16],
            &[0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21]
        );
        assert_eq!(&idx[16..], &[4, 5, 10, 11, 16, 17, 22, 23]);
        assert_eq!(cu, vec![0, 64, 96]);
        let mut sorted = idx.clone();
        sorted.sort();
        assert_eq!(sorted, (0..24).collect::<Vec<_>>());
    }

    #[test]
    fn rope_index_text_image_video() {
        let (img, vid) = (9, 8);
        // 2 text, image grid 1x4x6 (merge 2 -> 6 tokens: 2x3), 1 text, video grid 2x4x4 (8 tokens)
        let mut ids = vec![1, 2];
        ids.extend([img; 6]);
        ids.push(3);
        ids.extend([vid; 8]);
        ids.push(4);
        let media = [
            MediaSlot {
                kind: MediaKind::Image,
                grid: [1, 4, 6],
            },
            MediaSlot {
                kind: MediaKind::Video {
                    second_per_grid_t: Some(2.7),
                },
                grid: [2, 4, 4],
            },
        ];
        let (pos, delta) = rope_index(&ids, &media, img, vid, 2, 2).unwrap();
        assert_eq!(&pos[0][..8], &[0, 1, 2, 2, 2, 2, 2, 2]);
        assert_eq!(&pos[1][..8], &[0, 1, 2, 2, 2, 3, 3, 3]);
        assert_eq!(&pos[2][..8], &[0, 1, 2, 3, 4, 2, 3, 4]);
        // text after the image: 2 + max(2, 3) = 5
        assert_eq!(pos[0][8], 5);
        // video starts at 6; temporal step = 2 * int(2.7) = 4
        assert_eq!(&pos[0][9..17], &[6, 6, 6, 6, 10, 10, 10, 10]);
        assert_eq!(&pos[1][9..13], &[6, 6, 7, 7]);
        assert_eq!(pos[0][17], 8);
        assert_eq!(delta, 10 + 1 - ids.len() as i64);
        assert!(rope_index(&ids, &media[..1], img, vid, 2, 2).is_err());
    }
}
