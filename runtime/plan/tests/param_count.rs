//! Parameter counts against the numbers Hugging Face reports for the same configs.
use rollplex_plan::spec::*;

fn qwen_vision(out: u32) -> VisionDims {
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
        out_hidden_size: out,
    }
}

fn model(text: TextDims) -> ModelSpec {
    ModelSpec {
        name: "m".into(),
        vision: qwen_vision(text.hidden_size),
        text,
        tokens: SpecialTokens {
            image_token_id: 151655,
            video_token_id: 151656,
            vision_start_token_id: 151652,
            vision_end_token_id: 151653,
            eos_token_ids: vec![151645],
        },
        dtype: DType::Bf16,
        weights: WeightsSource::Random { seed: 0 },
    }
}

/// transformers 5.17 reported 3.75 B parameters for this 3B-shaped config
/// (shared/bench/hf_baseline.py, "params 3.754... B").
#[test]
fn qwen25_vl_3b_matches_hf_count() {
    let m = model(TextDims {
        num_layers: 36,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 2,
        intermediate_size: 11008,
        vocab_size: 151936,
        rope_theta: 1e6,
        mrope_section: [16, 24, 24],
        tie_word_embeddings: true,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 128000,
    });
    let p = m.param_count();
    let total = p.total() as f64 / 1e9;
    assert!((total - 3.754).abs() < 0.01, "3B total {total} B, {p:?}");
}
