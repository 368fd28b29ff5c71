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

/// Supplies the prompts (one per GRPO group) of each iteration. `Send`, so the loops can draw
/// the next iteration's prompts on a background thread ([`for_each_prefetched`]).
pub trait PromptSource: Send {
    fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError>;
}

/// Runs `body(iteration, prompts, start)` for every iteration of `iterations` in order, drawing the
/// next iteration's `count` prompts from `source` on a background thread while `body` runs:
/// generating and preprocessing prompts (decoding and resizing video frames, patchifying) is
/// host work that the device need not wait for. At most one iteration is drawn ahead; the
/// source sees exactly the calls, in exactly the order, of a loop without prefetching (so the
/// prompts, and every number downstream, are unchanged). An error of either side stops both and
/// is returned; an error of `body` wins over one of a prefetch it never used. `start` is when
/// the loop began waiting for the iteration's prompts: an iteration's wall time counts whatever
/// part of their preparation the previous iteration did not hide (all of it for the first).
pub fn for_each_prefetched(
    source: &mut dyn PromptSource,
    iterations: std::ops::Range<u32>,
    count: usize,
    mut body: impl FnMut(u32, Vec<PromptData>, std::time::Instant) -> Result<(), ExecError>,
) -> Result<(), ExecError> {
    std::thread::scope(|scope| {
        // capacity 0: the producer hands over iteration i + 1 only when the consumer asks for
        // it, so it is at most one iteration ahead
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<PromptData>, ExecError>>(0);
        let drawn = iterations.clone();
        scope.spawn(move || {
            for it in drawn {
                let prompts = source.prompts(it, count);
                let failed = prompts.is_err();
                if tx.send(prompts).is_err() || failed {
                    break;
                }
            }
        });
        for it in iterations {
            let start = std::time::Instant::now();
            let prompts = rx.recv().map_err(|_| {
                ExecError::Data(format!(
                    "the prompt source stopped before iteration {it} (its thread panicked)"
                ))
            })??;
            body(it, prompts, start)?;
        }
        Ok(())
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records every call; fails at iteration `fail_at`.
    struct Recording {
        calls: Arc<Mutex<Vec<(u32, usize)>>>,
        fail_at: Option<u32>,
    }

    impl PromptSource for Recording {
        fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError> {
            self.calls.lock().unwrap().push((iteration, count));
            if self.fail_at == Some(iteration) {
                return Err(ExecError::Data(format!("no prompts for {iteration}")));
            }
            Ok((0..count)
                .map(|g| PromptData {
                    id: format!("{iteration}-{g}"),
                    text: String::new(),
                    ids: vec![iteration, g as u32],
                    media: Vec::new(),
                    answer: String::new(),
                })
                .collect())
        }
    }

    /// The (iteration, count) of every call a [`Recording`] answered.
    type Calls = Arc<Mutex<Vec<(u32, usize)>>>;

    fn source(fail_at: Option<u32>) -> (Recording, Calls) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let r = Recording {
            calls: calls.clone(),
            fail_at,
        };
        (r, calls)
    }

    #[test]
    fn prefetching_makes_the_same_calls_and_hands_each_iteration_its_prompts() {
        let (mut src, calls) = source(None);
        let mut seen = Vec::new();
        for_each_prefetched(&mut src, 3..7, 2, |it, p, _| {
            assert_eq!(p.len(), 2);
            assert!(p.iter().all(|p| p.ids[0] == it), "iteration {it} got {p:?}");
            seen.push(it);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![3, 4, 5, 6]);
        assert_eq!(*calls.lock().unwrap(), vec![(3, 2), (4, 2), (5, 2), (6, 2)]);
    }

    #[test]
    fn a_source_error_stops_the_loop_after_the_iterations_before_it() {
        let (mut src, _) = source(Some(5));
        let mut seen = Vec::new();
        let err = for_each_prefetched(&mut src, 3..9, 1, |it, _, _| {
            seen.push(it);
            Ok(())
        })
        .unwrap_err();
        assert_eq!(seen, vec![3, 4]);
        assert!(err.to_string().contains("no prompts for 5"), "{err}");
    }

    #[test]
    fn a_body_error_stops_the_prefetching_and_is_returned() {
        let (mut src, calls) = source(None);
        let err = for_each_prefetched(&mut src, 0..100, 1, |it, _, _| {
            if it == 2 {
                return Err(ExecError::Data("body failed".into()));
            }
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("body failed"), "{err}");
        // at most one iteration was drawn ahead of the failing one
        assert!(
            calls.lock().unwrap().len() <= 4,
            "{:?}",
            calls.lock().unwrap()
        );
    }
}
