//! Prompt sources: where an iteration's prompts come from.
//!
//! - [`SyntheticPrompts`]: prompts of exactly the declared shape (media of the declared size
//!   with random pixels, random text tokens), for benchmarks and tests; deterministic from the
//!   job seed and the iteration.
//! - Dataset-backed sources turn examples (text, media files, answer) into token ids and
//!   patches with the tokenizer, chat template and processor (see `crate::data`).
//!
//! Invariant: the prompts of iteration `i` depend only on (source, seed, i), never on what ran
//! before, so a resumed run draws the same prompts as an uninterrupted one.

use rollplex_plan::spec::{JobSpec, MediaSpec};

use super::{ExecError, MediaData, PromptData};
use crate::model::philox::{philox4x32_10, uniform_open01};
use crate::model::{Grid, MediaKind};

/// Supplies the prompts (one per GRPO group) of each iteration.
pub trait PromptSource {
    fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError>;
}

/// The media grid `(t, h, w)` in patches of one media item of the declared shape.
pub fn media_grid(spec: &JobSpec) -> Option<(MediaKind, Grid, u32)> {
    let v = &spec.actor.vision;
    let (p, tp) = (v.patch_size, v.temporal_patch_size);
    match spec.rollout.media {
        MediaSpec::None => None,
        MediaSpec::Image {
            count,
            height,
            width,
        } => Some((MediaKind::Image, [1, height / p, width / p], count)),
        MediaSpec::Video {
            frames,
            height,
            width,
        } => Some((
            MediaKind::Video {
                second_per_grid_t: None,
            },
            [frames.div_ceil(tp), height / p, width / p],
            1,
        )),
    }
}

/// Prompts of the declared shape with random content.
pub struct SyntheticPrompts {
    spec: JobSpec,
}

impl SyntheticPrompts {
    pub fn new(spec: &JobSpec) -> Self {
        SyntheticPrompts { spec: spec.clone() }
    }

    fn rand(&self, a: u32, b: u32, c: u32) -> [u32; 4] {
        let s = self.spec.seed;
        philox4x32_10([a, b, c, 0x5359_4E54], [s as u32, (s >> 32) as u32])
    }
}

impl PromptSource for SyntheticPrompts {
    fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError> {
        let t = &self.spec.actor.tokens;
        let vocab = self.spec.actor.text.vocab_size;
        let mut special = vec![
            t.image_token_id,
            t.video_token_id,
            t.vision_start_token_id,
            t.vision_end_token_id,
        ];
        special.extend(&t.eos_token_ids);
        special.extend(&self.spec.rollout.sampling.stop_token_ids);
        let merge = self.spec.actor.vision.spatial_merge_size;
        let v = &self.spec.actor.vision;
        let patch_dim =
            (v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size) as usize;
        let mut out = Vec::with_capacity(count);
        for g in 0..count as u32 {
            let key = iteration.wrapping_mul(1 << 20).wrapping_add(g);
            let mut ids = Vec::new();
            let mut media = Vec::new();
            if let Some((kind, grid, items)) = media_grid(&self.spec) {
                let pad = match kind {
                    MediaKind::Image => t.image_token_id,
                    MediaKind::Video { .. } => t.video_token_id,
                };
                for item in 0..items {
                    let n = (grid[0] * grid[1] * grid[2]) as usize;
                    let mut pixels = Vec::with_capacity(n * patch_dim);
                    for i in 0..(n * patch_dim).div_ceil(2) {
                        let r = self.rand(key, item, i as u32);
                        // Box-Muller: two standard normals per block
                        let (u1, u2) = (uniform_open01(r[0], r[1]), uniform_open01(r[2], r[3]));
                        let rad = (-2.0 * u1.ln()).sqrt();
                        let th = 2.0 * std::f64::consts::PI * u2;
                        pixels.push((rad * th.cos()) as f32);
                        pixels.push((rad * th.sin()) as f32);
                    }
                    pixels.truncate(n * patch_dim);
                    ids.push(t.vision_start_token_id);
                    ids.extend(std::iter::repeat_n(pad, n / (merge * merge) as usize));
                    ids.push(t.vision_end_token_id);
                    media.push(MediaData { kind, pixels, grid });
                }
            }
            let mut i = 0u32;
            while (ids.len() as u32)
                < self.spec.rollout.prompt_text_tokens
                    + media
                        .iter()
                        .map(|m| (m.grid.iter().product::<u32>() / (merge * merge)) + 2)
                        .sum::<u32>()
            {
                let r = self.rand(key, u32::MAX, i);
                i += 1;
                let id = r[0] % vocab;
                if !special.contains(&id) {
                    ids.push(id);
                }
            }
            out.push(PromptData {
                id: format!("synthetic-{iteration}-{g}"),
                text: String::new(),
                ids,
                media,
                answer: String::new(),
            });
        }
        Ok(out)
    }
}
