//! Tensor shapes of one iteration, from the job spec: media grids, token counts, bytes per
//! token of the KV cache and of kept activations, parameter bytes.
//!
//! Media follow Qwen2.5-VL's preprocessing: height and width are rounded to the nearest
//! multiple of `patch_size * spatial_merge_size` (at least one), video frames are padded up to a
//! multiple of `temporal_patch_size` and an image counts as one temporal patch. A media item of
//! grid (t, h, w) patches becomes `t*h*w` vision tokens and `t*h*w / merge^2` LLM tokens, framed by
//! a vision-start and a vision-end token.
//!
//! Everything here is per *unsharded* model; lowering divides by TP degrees.

use rollplex_plan::spec::{JobSpec, MediaSpec, ModelSpec};

/// Shapes of one job.
#[derive(Clone, Debug, PartialEq)]
pub struct Shapes {
    /// Media items per prompt.
    pub media_items: u32,
    /// Patch grid (t, h, w) of one media item.
    pub grid: (u32, u32, u32),
    /// Vision tokens (patches) of one media item.
    pub patches_per_item: u64,
    /// LLM tokens of one media item after the 2x2 merger.
    pub merged_per_item: u64,
    /// Tokens of one prompt: text + media tokens + 2 framing tokens per item.
    pub prompt_tokens: u64,
    pub max_new_tokens: u32,
    /// Bytes of one token's KV over all layers (both K and V), unsharded.
    pub kv_bytes_per_token: u64,
    /// Compute dtype bytes.
    pub dtype_bytes: u64,
    pub params: rollplex_plan::spec::ParamCount,
    /// Parameters the optimizer updates (frozen parts excluded).
    pub trainable_params: u64,
}

impl Shapes {
    pub fn new(spec: &JobSpec) -> Shapes {
        let m = &spec.actor;
        let v = &m.vision;
        let factor = (v.patch_size * v.spatial_merge_size).max(1);
        let round =
            |px: u32| -> u32 { (((px as f64) / factor as f64).round() as u32).max(1) * factor };
        let tp = v.temporal_patch_size.max(1);
        let (items, frames, h, w) = match spec.rollout.media {
            MediaSpec::None => (0, 0, 0, 0),
            MediaSpec::Image {
                count,
                height,
                width,
            } => (count, tp, round(height), round(width)),
            MediaSpec::Video {
                frames,
                height,
                width,
            } => (1, frames.div_ceil(tp) * tp, round(height), round(width)),
        };
        let p = v.patch_size.max(1);
        let grid = if items == 0 {
            (0, 0, 0)
        } else {
            (frames / tp, h / p, w / p)
        };
        let patches = grid.0 as u64 * grid.1 as u64 * grid.2 as u64;
        let m2 = (v.spatial_merge_size as u64).pow(2).max(1);
        let merged = patches / m2;
        let prompt_tokens = spec.rollout.prompt_text_tokens as u64 + items as u64 * (merged + 2);
        let t = &m.text;
        let kv =
            2 * t.num_layers as u64 * t.num_kv_heads as u64 * t.head_dim() as u64 * m.dtype.bytes();
        let params = m.param_count();
        let mut trainable = params.text;
        if !spec.train.freeze_vision {
            trainable += params.vision;
        }
        if !spec.train.freeze_merger {
            trainable += params.merger;
        }
        Shapes {
            media_items: items,
            grid,
            patches_per_item: patches,
            merged_per_item: merged,
            prompt_tokens,
            max_new_tokens: spec.rollout.max_new_tokens,
            kv_bytes_per_token: kv,
            dtype_bytes: m.dtype.bytes(),
            params,
            trainable_params: trainable,
        }
    }

    /// Vision (patch) tokens of one prompt.
    pub fn patches_per_prompt(&self) -> u64 {
        self.patches_per_item * self.media_items as u64
    }

    /// LLM tokens of one prompt that come from media.
    pub fn media_tokens_per_prompt(&self) -> u64 {
        self.merged_per_item * self.media_items as u64
    }
}

/// Tensors a layer's kept training activations take: what the GPU trainer keeps for a layer's
/// backward (its `Acts`), each placed apart.
pub const KEPT_ACT_TENSORS: u64 = 14;

/// Bytes, per token and layer, that a forward keeps for backward, sharded parts divided by
/// `tp`. With full recompute only the layer input (bf16). Otherwise the input and the
/// [`KEPT_ACT_TENSORS`] the GPU trainer keeps beside it: the first norm's output, the residual
/// after attention, the second norm's output and the output projections' result (with the
/// input 5 h, replicated), the norms' statistics (two fp32); q|k|v and q, k, v apart after RoPE
/// (2 (q + 2 kv)), the attention output (q), gate|up (2 f) and the activation (f), and the
/// attention's log-sum-exp per head (fp32).
pub fn kept_act_bytes_per_token_layer(m: &ModelSpec, tp: u32, full_recompute: bool) -> u64 {
    let t = &m.text;
    let b = m.dtype.bytes();
    let h = t.hidden_size as u64;
    if full_recompute {
        return h * b;
    }
    let tp = tp.max(1) as u64;
    let q = t.num_heads as u64 * t.head_dim() as u64;
    let kv = t.num_kv_heads as u64 * t.head_dim() as u64;
    let f = t.intermediate_size as u64;
    let replicated = 5 * h * b + 2 * 4;
    let sharded = ((2 * (q + 2 * kv) + q + 3 * f) * b + t.num_heads as u64 * 4) / tp;
    replicated + sharded
}

/// Bytes per token a training forward keeps over every text layer when the first `kept`
/// layers keep all their activations and the others only their input (tensor parallel as in
/// [`kept_act_bytes_per_token_layer`]).
pub fn kept_act_bytes_per_token(m: &ModelSpec, tp: u32, kept: u32) -> u64 {
    let layers = m.text.num_layers as u64;
    let kept = (kept as u64).min(layers);
    kept_act_bytes_per_token_layer(m, tp, true) * (layers - kept)
        + kept_act_bytes_per_token_layer(m, tp, false) * kept
}

/// Working set of one layer's forward (bf16), per token, sharded parts divided by `tp`: what a
/// pass needs in flight beyond what it keeps.
pub fn transient_bytes_per_token(m: &ModelSpec, tp: u32) -> u64 {
    let t = &m.text;
    let b = m.dtype.bytes();
    let tp = tp.max(1) as u64;
    let h = t.hidden_size as u64;
    let f = t.intermediate_size as u64;
    2 * h * b + (3 * f * b) / tp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::job;

    #[test]
    fn video_448_8_frames_is_1024_llm_tokens() {
        let spec = job(|s| {
            s.rollout.media = MediaSpec::Video {
                frames: 8,
                height: 448,
                width: 448,
            };
            s.rollout.prompt_text_tokens = 100;
        });
        let sh = Shapes::new(&spec);
        assert_eq!(sh.grid, (4, 32, 32));
        assert_eq!(sh.patches_per_item, 4096);
        assert_eq!(sh.merged_per_item, 1024);
        // cost/profiles/reference/README.md: 1,126 prompt tokens for this shape.
        assert_eq!(sh.prompt_tokens, 1126);
    }

    #[test]
    fn odd_sizes_round_like_qwen() {
        let spec = job(|s| {
            s.rollout.media = MediaSpec::Image {
                count: 2,
                height: 500,
                width: 30,
            }
        });
        let sh = Shapes::new(&spec);
        // 500/28 = 17.9 -> 18*28 = 504 -> 36 patches; 30/28 -> 28 -> 2 patches.
        assert_eq!(sh.grid, (1, 36, 2));
        assert_eq!(sh.merged_per_item, 18);
        assert_eq!(sh.media_items, 2);
    }
}
