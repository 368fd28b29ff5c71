//! The built-in model presets, one table for every crate: the Hugging Face `config.json` values
//! of Qwen2.5-VL-{3B,7B,32B}-Instruct, and `tiny`, a model of about 0.19M parameters for CPU
//! tests and examples (its special tokens at the top of its 512-token vocabulary).

use crate::spec::{DType, ModelSpec, SpecialTokens, TextDims, VisionDims, WeightsSource};

/// A model preset's dimensions and special tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPreset {
    pub name: &'static str,
    pub vision: VisionDims,
    pub text: TextDims,
    pub tokens: SpecialTokens,
}

impl ModelPreset {
    /// The preset as a model spec with `dtype` and `weights`.
    pub fn spec(&self, dtype: DType, weights: WeightsSource) -> ModelSpec {
        ModelSpec {
            name: self.name.to_string(),
            vision: self.vision.clone(),
            text: self.text.clone(),
            tokens: self.tokens.clone(),
            dtype,
            weights,
        }
    }
}

/// The presets' names, as a pipeline's `preset` gives them.
pub const MODEL_PRESETS: &[&str] = &["qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "tiny"];

/// Qwen2.5-VL's special token ids (the real 151k vocabulary).
pub fn qwen_tokens() -> SpecialTokens {
    SpecialTokens {
        image_token_id: 151655,
        video_token_id: 151656,
        vision_start_token_id: 151652,
        vision_end_token_id: 151653,
        eos_token_ids: vec![151645, 151643],
    }
}

/// The tiny preset's special tokens: the top of its 512-token vocabulary, in Qwen's order
/// (`<|endoftext|>` 504, `<|im_end|>` 505, vision start/end 508/509, image 510, video 511);
/// ids 0-503 are ordinary text tokens.
pub fn tiny_tokens() -> SpecialTokens {
    SpecialTokens {
        image_token_id: 510,
        video_token_id: 511,
        vision_start_token_id: 508,
        vision_end_token_id: 509,
        eos_token_ids: vec![505, 504],
    }
}

/// The Qwen2.5-VL vision tower (the same for every released size), merging into `out_hidden`.
pub fn qwen_vision(out_hidden: u32) -> VisionDims {
    VisionDims {
        depth: 32,
        hidden_size: 1280,
        num_heads: 16,
        intermediate_size: 3420,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        window_size: 112,
        fullatt_block_indexes: vec![7, 15, 23, 31],
        in_channels: 3,
        out_hidden_size: out_hidden,
    }
}

/// A released size's text decoder: one row of the table below.
struct QwenText {
    layers: u32,
    hidden: u32,
    heads: u32,
    kv_heads: u32,
    ffn: u32,
    vocab: u32,
    tied: bool,
}

/// The released sizes' text decoders (config.json of Qwen/Qwen2.5-VL-*-Instruct).
const QWEN_SIZES: [(&str, QwenText); 3] = [
    (
        "qwen2.5-vl-3b",
        QwenText {
            layers: 36,
            hidden: 2048,
            heads: 16,
            kv_heads: 2,
            ffn: 11008,
            vocab: 151936,
            tied: true,
        },
    ),
    (
        "qwen2.5-vl-7b",
        QwenText {
            layers: 28,
            hidden: 3584,
            heads: 28,
            kv_heads: 4,
            ffn: 18944,
            vocab: 152064,
            tied: false,
        },
    ),
    (
        "qwen2.5-vl-32b",
        QwenText {
            layers: 64,
            hidden: 5120,
            heads: 40,
            kv_heads: 8,
            ffn: 27648,
            vocab: 152064,
            tied: false,
        },
    ),
];

impl QwenText {
    fn dims(&self) -> TextDims {
        TextDims {
            num_layers: self.layers,
            hidden_size: self.hidden,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            intermediate_size: self.ffn,
            vocab_size: self.vocab,
            rope_theta: 1e6,
            mrope_section: [16, 24, 24],
            tie_word_embeddings: self.tied,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 128000,
        }
    }
}

/// The tiny model: two vision blocks of width 32, two text layers of width 64, vocabulary 512.
fn tiny() -> ModelPreset {
    ModelPreset {
        name: "tiny",
        vision: VisionDims {
            depth: 2,
            hidden_size: 32,
            num_heads: 2,
            intermediate_size: 64,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: 112,
            fullatt_block_indexes: vec![1],
            in_channels: 3,
            out_hidden_size: 64,
        },
        text: TextDims {
            num_layers: 2,
            hidden_size: 64,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 128,
            vocab_size: 512,
            rope_theta: 1e6,
            // head_dim 16 -> 8 rotary half-dims, split like Qwen's 16/24/24 of 64
            mrope_section: [2, 3, 3],
            tie_word_embeddings: true,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
        },
        tokens: tiny_tokens(),
    }
}

/// Small model shapes for tests, one builder for every crate's tests: a test states the widths
/// it exercises and takes the rest. The defaults are the CPU engine tests' model (3 vision
/// blocks of width 32 with 2 heads, 2 text layers of width 48 with 4 query and 2 kv heads of 12,
/// vocabulary 300, f32).
#[derive(Clone, Debug)]
pub struct TestModel {
    pub name: &'static str,
    pub vision_depth: u32,
    pub vision_heads: u32,
    pub vision_ffn: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u32,
    pub vocab: u32,
    pub mrope_section: [u32; 3],
    pub tie: bool,
    /// The special tokens are consecutive from here: EOS, vision start, vision end, image,
    /// video.
    pub first_special: u32,
    pub dtype: DType,
    /// The spec's `Random { seed }`.
    pub seed: u64,
}

impl Default for TestModel {
    fn default() -> Self {
        TestModel {
            name: "tiny",
            vision_depth: 3,
            vision_heads: 2,
            vision_ffn: 40,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 12,
            ffn: 64,
            vocab: 300,
            mrope_section: [2, 2, 2],
            tie: false,
            first_special: 287,
            dtype: DType::F32,
            seed: 1,
        }
    }
}

impl TestModel {
    /// The CUDA engine tests' shapes: vision head_dim 16, 3 text layers of `heads` x `head_dim`
    /// (32: the tensor-core decode; 16: the varlen decode), odd FFN (99) and vocabulary (301)
    /// sizes, bf16.
    pub fn gpu(heads: u32, kv_heads: u32, head_dim: u32, tie: bool) -> Self {
        TestModel {
            name: "tiny-gpu",
            vision_ffn: 45,
            layers: 3,
            heads,
            kv_heads,
            head_dim,
            ffn: 99,
            vocab: 301,
            mrope_section: mrope_for(head_dim),
            tie,
            first_special: 295,
            dtype: DType::Bf16,
            seed: 3,
            ..TestModel::default()
        }
    }

    /// The model spec (vision width 32, patch 4, window 16, the second block full-attention
    /// where there is one; the merger outputs the text width).
    pub fn spec(&self) -> ModelSpec {
        let hidden = self.heads * self.head_dim;
        let s = self.first_special;
        ModelSpec {
            name: self.name.into(),
            vision: VisionDims {
                depth: self.vision_depth,
                hidden_size: 32,
                num_heads: self.vision_heads,
                intermediate_size: self.vision_ffn,
                patch_size: 4,
                temporal_patch_size: 2,
                spatial_merge_size: 2,
                window_size: 16,
                fullatt_block_indexes: vec![1.min(self.vision_depth.saturating_sub(1))],
                in_channels: 3,
                out_hidden_size: hidden,
            },
            text: TextDims {
                num_layers: self.layers,
                hidden_size: hidden,
                num_heads: self.heads,
                num_kv_heads: self.kv_heads,
                intermediate_size: self.ffn,
                vocab_size: self.vocab,
                rope_theta: 10000.0,
                mrope_section: self.mrope_section,
                tie_word_embeddings: self.tie,
                rms_norm_eps: 1e-6,
                max_position_embeddings: 4096,
            },
            tokens: SpecialTokens {
                eos_token_ids: vec![s],
                vision_start_token_id: s + 1,
                vision_end_token_id: s + 2,
                image_token_id: s + 3,
                video_token_id: s + 4,
            },
            dtype: self.dtype,
            weights: WeightsSource::Random { seed: self.seed },
        }
    }
}

/// M-RoPE sections for a head of `head_dim`, split like Qwen's 16/24/24 of 64.
pub fn mrope_for(head_dim: u32) -> [u32; 3] {
    let half = head_dim / 2;
    let a = half / 4;
    let b = (half - a) / 2;
    [a, b, half - a - b]
}

/// The preset called `name` (one of [`MODEL_PRESETS`]).
pub fn model(name: &str) -> Option<ModelPreset> {
    if name == "tiny" {
        return Some(tiny());
    }
    let (name, t) = QWEN_SIZES.iter().find(|(n, _)| *n == name)?;
    Some(ModelPreset {
        name,
        vision: qwen_vision(t.hidden),
        text: t.dims(),
        tokens: qwen_tokens(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_models_have_their_widths_and_tokens_inside_the_vocabulary() {
        assert_eq!(mrope_for(64), [8, 12, 12]);
        assert_eq!(mrope_for(32), [4, 6, 6]);
        for m in [
            TestModel::default(),
            TestModel::gpu(4, 2, 32, true),
            TestModel::gpu(2, 1, 16, false),
        ] {
            let s = m.spec();
            let t = &s.text;
            assert_eq!(t.hidden_size, t.num_heads * m.head_dim);
            assert_eq!(s.vision.out_hidden_size, t.hidden_size);
            assert!(t.mrope_section.iter().sum::<u32>() * 2 <= m.head_dim);
            let k = &s.tokens;
            let ids = [k.image_token_id, k.video_token_id, k.vision_start_token_id];
            assert!(ids
                .iter()
                .chain(&k.eos_token_ids)
                .all(|&i| i < t.vocab_size));
            assert!(s
                .vision
                .fullatt_block_indexes
                .iter()
                .all(|&b| b < s.vision.depth));
        }
    }

    #[test]
    fn presets_have_consistent_dims() {
        for name in MODEL_PRESETS {
            let p = model(name).unwrap();
            assert_eq!(p.name, *name);
            let t = &p.text;
            assert_eq!(t.hidden_size % t.num_heads, 0, "{name}");
            assert_eq!(
                t.mrope_section.iter().sum::<u32>(),
                t.head_dim() / 2,
                "{name}"
            );
            assert_eq!(p.vision.out_hidden_size, t.hidden_size, "{name}");
            assert!(
                p.tokens.eos_token_ids.iter().all(|&i| i < t.vocab_size),
                "{name}"
            );
            assert!(p.tokens.video_token_id < t.vocab_size, "{name}");
        }
        assert!(model("qwen2.5-vl-72b").is_none());
    }

    #[test]
    fn preset_sizes_match_their_names() {
        // Qwen2.5-VL-3B has 3.75B parameters, 7B 8.29B, 32B 33.45B (model cards).
        let b = |n: &str| {
            let spec = model(n)
                .unwrap()
                .spec(DType::Bf16, WeightsSource::Random { seed: 0 });
            spec.param_count().total() as f64 / 1e9
        };
        for (name, want, tol) in [
            ("qwen2.5-vl-3b", 3.75, 0.05),
            ("qwen2.5-vl-7b", 8.29, 0.05),
            ("qwen2.5-vl-32b", 33.45, 0.1),
        ] {
            assert!((b(name) - want).abs() < tol, "{name}: {}", b(name));
        }
        assert!(b("tiny") < 0.001);
    }
}
