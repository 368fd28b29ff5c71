use super::*;

/// The released Qwen2.5-VL-3B-Instruct config.json (text fields at the top level).
const QWEN25_VL_3B: &str = r#"{
  "architectures": ["Qwen2_5_VLForConditionalGeneration"],
  "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
  "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
  "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008,
  "max_position_embeddings": 128000, "max_window_layers": 70, "model_type": "qwen2_5_vl",
  "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
  "use_sliding_window": false,
  "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
"intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048,
"patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
"fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
  "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
  "vocab_size": 151936
}"#;

#[test]
fn reads_the_released_3b_layout() {
    let c = parse(QWEN25_VL_3B).unwrap();
    let p = crate::models::model("qwen2.5-vl-3b").unwrap();
    assert_eq!(c.vision, p.vision);
    assert_eq!(c.text, p.text);
    assert_eq!(c.tokens.eos_token_ids, vec![151645]);
    assert_eq!(c.tokens.image_token_id, 151655);
}

#[test]
fn reads_text_config_layout() {
    let j = r#"{"text_config": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
      "rope_scaling": {"mrope_section": [2, 3, 3]}},
      "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
      "fullatt_block_indexes": [1], "out_hidden_size": 64}, "eos_token_id": [5, 6]}"#;
    let c = parse(j).unwrap();
    assert_eq!(c.text.num_layers, 2);
    assert_eq!(c.text.mrope_section, [2, 3, 3]);
    assert_eq!(c.vision.patch_size, 14);
    assert_eq!(c.tokens.eos_token_ids, vec![5, 6]);
    assert!(!c.text.tie_word_embeddings);
}

#[test]
fn zero_dims_are_read_and_left_to_the_range_check() {
    // parse reads what is there; the callers check ranges (the DSL with a span)
    let j = QWEN25_VL_3B.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 0");
    assert_eq!(parse(&j).unwrap().text.num_kv_heads, 0);
}

#[test]
fn lists_every_problem() {
    let e = parse(r#"{"hidden_size": "big", "vision_config": {"depth": 2}}"#).unwrap_err();
    for want in [
        "`hidden_size` is not a whole number",
        "`num_hidden_layers` is missing",
        "`vision_config.hidden_size` is missing",
        "mrope_section` is missing",
    ] {
        assert!(e.contains(want), "{want} not in {e}");
    }
    assert!(parse("{").unwrap_err().contains("not valid JSON"));
    assert!(parse("[]").unwrap_err().contains("not a JSON object"));
}

#[test]
fn reads_what_the_runtime_needs_beyond_the_spec() {
    let c = parse(QWEN25_VL_3B).unwrap();
    assert_eq!(c.dtype, DType::Bf16);
    assert_eq!(c.tokens_per_second, 2);
    assert_eq!(c.vision_rope_theta, 1e4);
    assert_eq!(c.text.rope_theta, 1e6);
    assert_eq!(c.text.max_position_embeddings, 128000);
    assert!(c.text.tie_word_embeddings);
}

#[test]
fn reads_the_transformers_5_layout() {
    // rope_theta and mrope_section inside text_config.rope_parameters, dtype at the top
    let j = r#"{"dtype": "float32", "tie_word_embeddings": false,
      "text_config": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 128, "vocab_size": 512, "hidden_act": "silu",
      "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 5e5}},
      "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
      "fullatt_block_indexes": [1], "out_hidden_size": 64, "tokens_per_second": 2,
      "rope_parameters": {"rope_type": "axial", "rope_theta": 20000.0}}}"#;
    let c = parse(j).unwrap();
    assert_eq!(c.text.rope_theta, 5e5);
    assert_eq!(c.text.mrope_section, [2, 3, 3]);
    assert_eq!(c.text.num_kv_heads, 4);
    assert_eq!(c.dtype, DType::F32);
    assert_eq!(c.vision_rope_theta, 20000.0);
    assert_eq!(c.tokens_per_second, 2);
    assert_eq!(
        c.tokens.eos_token_ids,
        crate::models::qwen_tokens().eos_token_ids
    );
}

#[test]
fn text_fields_fall_back_to_the_top_level() {
    // a text_config without the vocabulary: the top level's is read
    let j = QWEN25_VL_3B.replace(
        "\"vocab_size\": 151936",
        "\"vocab_size\": 151936, \"text_config\": {\"hidden_size\": 2048}",
    );
    let c = parse(&j).unwrap();
    assert_eq!(c.text.vocab_size, 151936);
    // missing from both: named in text_config
    let j = j.replace("\"vocab_size\": 151936,", "");
    assert!(parse(&j)
        .unwrap_err()
        .contains("`text_config.vocab_size` is missing"));
}

#[test]
fn refuses_another_activation() {
    let j = QWEN25_VL_3B.replace(
        "\"hidden_act\": \"silu\", \"hidden_size\": 1280",
        "\"hidden_act\": \"gelu\", \"hidden_size\": 1280",
    );
    let e = parse(&j).unwrap_err();
    assert!(
        e.contains("`vision_config.hidden_act` is \"gelu\": only silu is supported"),
        "{e}"
    );
}
