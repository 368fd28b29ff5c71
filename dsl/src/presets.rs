//! Built-in GPU and model presets.
//!
//! GPU numbers are datasheet values (dense bf16 tensor-core rate, HBM capacity and bandwidth,
//! NVLink per direction); host bandwidth is what PCIe delivers in practice (Gen5 x16: ~55 GB/s,
//! Gen4 x16: ~25 GB/s); InfiniBand is one 400 Gb/s NIC per GPU (HDR 200 Gb/s on A100 systems).
//! The `cpu` preset is not a measurement: it is a nominal device that lets the planner run for
//! the CPU backend, whose timings nobody plans by; override any field in the `gpu` section.
//!
//! Model presets are the Hugging Face `config.json` values of Qwen2.5-VL-{3B,7B,32B}-Instruct,
//! and `tiny`, a model of about 0.19M parameters for CPU tests and examples.

use rollplex_plan::spec::{GpuSpec, SpecialTokens, TextDims, VisionDims};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A GPU preset: the device, and the interconnect it usually comes with.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuPreset {
    pub gpu: GpuSpec,
    /// NVLink, bytes/s per direction.
    pub nvlink: f64,
    /// InfiniBand per GPU, bytes/s.
    pub ib: f64,
    /// GPUs in one node.
    pub gpus_per_node: u32,
}

pub const GPU_PRESETS: &[&str] = &["H200", "H100", "H800", "A100", "cpu"];

pub fn gpu(name: &str) -> Option<GpuPreset> {
    #[allow(clippy::too_many_arguments)]
    fn p(
        name: &str,
        sms: u32,
        gran: u32,
        hbm: u64,
        bw: f64,
        bf16: f64,
        host: f64,
        nvlink: f64,
        ib: f64,
        node: u32,
    ) -> GpuPreset {
        GpuPreset {
            gpu: GpuSpec {
                name: name.to_string(),
                sms,
                sm_granularity: gran,
                hbm_bytes: hbm,
                hbm_bw: bw,
                bf16_flops: bf16,
                host_bw: host,
            },
            nvlink,
            ib,
            gpus_per_node: node,
        }
    }
    Some(match name {
        "H200" => p(
            "H200",
            132,
            8,
            143771 * MIB,
            4.8e12,
            989e12,
            55e9,
            450e9,
            50e9,
            8,
        ),
        "H100" => p(
            "H100",
            132,
            8,
            80 * GIB,
            3.35e12,
            989e12,
            55e9,
            450e9,
            50e9,
            8,
        ),
        "H800" => p(
            "H800",
            132,
            8,
            80 * GIB,
            3.35e12,
            989e12,
            55e9,
            200e9,
            50e9,
            8,
        ),
        "A100" => p(
            "A100",
            108,
            2,
            80 * GIB,
            2.0e12,
            312e12,
            25e9,
            300e9,
            25e9,
            8,
        ),
        "cpu" => p("cpu", 8, 1, 16 * GIB, 20e9, 100e9, 20e9, 20e9, 1e9, 1),
        _ => return None,
    })
}

/// A model preset's dimensions and special tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPreset {
    pub name: &'static str,
    pub vision: VisionDims,
    pub text: TextDims,
    pub tokens: SpecialTokens,
}

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

fn qwen_vision(out_hidden: u32) -> VisionDims {
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

#[allow(clippy::too_many_arguments)]
fn qwen_text(
    layers: u32,
    hidden: u32,
    heads: u32,
    kv: u32,
    ffn: u32,
    vocab: u32,
    tied: bool,
) -> TextDims {
    TextDims {
        num_layers: layers,
        hidden_size: hidden,
        num_heads: heads,
        num_kv_heads: kv,
        intermediate_size: ffn,
        vocab_size: vocab,
        rope_theta: 1e6,
        mrope_section: [16, 24, 24],
        tie_word_embeddings: tied,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 128000,
    }
}

pub fn model(name: &str) -> Option<ModelPreset> {
    Some(match name {
        "qwen2.5-vl-3b" => ModelPreset {
            name: "qwen2.5-vl-3b",
            vision: qwen_vision(2048),
            text: qwen_text(36, 2048, 16, 2, 11008, 151936, true),
            tokens: qwen_tokens(),
        },
        "qwen2.5-vl-7b" => ModelPreset {
            name: "qwen2.5-vl-7b",
            vision: qwen_vision(3584),
            text: qwen_text(28, 3584, 28, 4, 18944, 152064, false),
            tokens: qwen_tokens(),
        },
        "qwen2.5-vl-32b" => ModelPreset {
            name: "qwen2.5-vl-32b",
            vision: qwen_vision(5120),
            text: qwen_text(64, 5120, 40, 8, 27648, 152064, false),
            tokens: qwen_tokens(),
        },
        "tiny" => ModelPreset {
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
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollplex_plan::spec::{DType, ModelSpec, WeightsSource};

    fn spec(p: &ModelPreset) -> ModelSpec {
        ModelSpec {
            name: p.name.into(),
            vision: p.vision.clone(),
            text: p.text.clone(),
            tokens: p.tokens.clone(),
            dtype: DType::Bf16,
            weights: WeightsSource::Random { seed: 0 },
        }
    }

    #[test]
    fn presets_have_consistent_dims() {
        for name in MODEL_PRESETS {
            let p = model(name).unwrap();
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
        for name in GPU_PRESETS {
            assert_eq!(gpu(name).unwrap().gpu.name, *name);
        }
    }

    #[test]
    fn preset_sizes_match_their_names() {
        // Qwen2.5-VL-3B has 3.75B parameters, 7B 8.29B, 32B 33.45B (model cards).
        let b = |n: &str| spec(&model(n).unwrap()).param_count().total() as f64 / 1e9;
        assert!(
            (b("qwen2.5-vl-3b") - 3.75).abs() < 0.05,
            "{}",
            b("qwen2.5-vl-3b")
        );
        assert!(
            (b("qwen2.5-vl-7b") - 8.29).abs() < 0.05,
            "{}",
            b("qwen2.5-vl-7b")
        );
        assert!(
            (b("qwen2.5-vl-32b") - 33.45).abs() < 0.1,
            "{}",
            b("qwen2.5-vl-32b")
        );
        assert!(b("tiny") < 0.001);
    }
}
