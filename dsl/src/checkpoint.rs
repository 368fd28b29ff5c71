//! A Hugging Face Qwen2.5-VL `config.json` -> model dimensions and special tokens.
//!
//! Text fields are read from `text_config` when it exists (newer transformers) and from the top
//! level otherwise (the layout of the released checkpoints); `rope_scaling.mrope_section` (or
//! `rope_parameters.mrope_section`) gives the M-RoPE split; `vision_config` the vision tower
//! (`in_chans` or `in_channels`). Token ids come from the top level, falling back to
//! Qwen2.5-VL's. Fields with a Hugging Face class default (patch 14, temporal patch 2, merge 2,
//! window 112, 3 input channels, rope theta 1e6, eps 1e-6, untied embeddings) may be absent;
//! the core dimensions must be present.
//!
//! Invariant: pure — the text comes in, dims or a list of problems go out.

use crate::presets::qwen_tokens;
use rollplex_plan::spec::{SpecialTokens, TextDims, VisionDims};
use serde_json::Value;

/// What a config.json gives.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointConfig {
    pub vision: VisionDims,
    pub text: TextDims,
    pub tokens: SpecialTokens,
}

/// Reads a config.json's text; the error lists every missing or malformed field.
pub fn parse_config(text: &str) -> Result<CheckpointConfig, String> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| format!("config.json is not valid JSON: {e}"))?;
    if !root.is_object() {
        return Err("config.json is not a JSON object".into());
    }
    let mut problems: Vec<String> = Vec::new();
    let text_obj = root
        .get("text_config")
        .filter(|v| v.is_object())
        .unwrap_or(&root);
    let vis = match root.get("vision_config") {
        Some(v) if v.is_object() => v,
        _ => {
            problems.push("`vision_config` is missing".into());
            &Value::Null
        }
    };
    let mut r = Reader {
        problems: &mut problems,
    };

    let vision = VisionDims {
        depth: r.u32(vis, "vision_config", &["depth"], None),
        hidden_size: r.u32(vis, "vision_config", &["hidden_size", "embed_dim"], None),
        num_heads: r.u32(vis, "vision_config", &["num_heads"], None),
        intermediate_size: r.u32(vis, "vision_config", &["intermediate_size"], None),
        patch_size: r.u32(
            vis,
            "vision_config",
            &["patch_size", "spatial_patch_size"],
            Some(14),
        ),
        temporal_patch_size: r.u32(vis, "vision_config", &["temporal_patch_size"], Some(2)),
        spatial_merge_size: r.u32(vis, "vision_config", &["spatial_merge_size"], Some(2)),
        window_size: r.u32(vis, "vision_config", &["window_size"], Some(112)),
        fullatt_block_indexes: r.u32_list(vis, "vision_config", "fullatt_block_indexes"),
        in_channels: r.u32(vis, "vision_config", &["in_chans", "in_channels"], Some(3)),
        out_hidden_size: 0,
    };
    let tp = if std::ptr::eq(text_obj, &root) {
        ""
    } else {
        "text_config"
    };
    let mut text = TextDims {
        num_layers: r.u32(text_obj, tp, &["num_hidden_layers"], None),
        hidden_size: r.u32(text_obj, tp, &["hidden_size"], None),
        num_heads: r.u32(text_obj, tp, &["num_attention_heads"], None),
        num_kv_heads: 0,
        intermediate_size: r.u32(text_obj, tp, &["intermediate_size"], None),
        vocab_size: r.u32(text_obj, tp, &["vocab_size"], None),
        rope_theta: r.f64(text_obj, tp, "rope_theta", 1e6),
        mrope_section: [0, 0, 0],
        tie_word_embeddings: match root
            .get("tie_word_embeddings")
            .or_else(|| text_obj.get("tie_word_embeddings"))
        {
            Some(Value::Bool(b)) => *b,
            None => false,
            Some(_) => {
                r.problems
                    .push("`tie_word_embeddings` is not true/false".into());
                false
            }
        },
        rms_norm_eps: r.f64(text_obj, tp, "rms_norm_eps", 1e-6),
        max_position_embeddings: r.u32(text_obj, tp, &["max_position_embeddings"], Some(128000)),
    };
    text.num_kv_heads = r.u32(text_obj, tp, &["num_key_value_heads"], Some(text.num_heads));
    let rope = text_obj
        .get("rope_scaling")
        .or_else(|| text_obj.get("rope_parameters"))
        .or_else(|| root.get("rope_scaling"));
    match rope
        .and_then(|x| x.get("mrope_section"))
        .and_then(Value::as_array)
    {
        Some(a)
            if a.len() == 3
                && a.iter()
                    .all(|x| x.as_u64().is_some_and(|v| v <= u32::MAX as u64)) =>
        {
            for (i, x) in a.iter().enumerate() {
                text.mrope_section[i] = x.as_u64().unwrap_or(0) as u32;
            }
        }
        Some(_) => r
            .problems
            .push("`rope_scaling.mrope_section` is not a list of three whole numbers".into()),
        None => r
            .problems
            .push("`rope_scaling.mrope_section` is missing".into()),
    }
    let mut vision = vision;
    vision.out_hidden_size = r.u32(
        vis,
        "vision_config",
        &["out_hidden_size"],
        Some(text.hidden_size),
    );

    let dflt = qwen_tokens();
    let tok = |r: &mut Reader, k: &str, d: u32| r.u32(&root, "", &[k], Some(d));
    let tokens = SpecialTokens {
        image_token_id: tok(&mut r, "image_token_id", dflt.image_token_id),
        video_token_id: tok(&mut r, "video_token_id", dflt.video_token_id),
        vision_start_token_id: tok(&mut r, "vision_start_token_id", dflt.vision_start_token_id),
        vision_end_token_id: tok(&mut r, "vision_end_token_id", dflt.vision_end_token_id),
        eos_token_ids: match root
            .get("eos_token_id")
            .or_else(|| text_obj.get("eos_token_id"))
        {
            None => dflt.eos_token_ids,
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            Some(v) => match v.as_u64() {
                Some(x) => vec![x as u32],
                None => {
                    r.problems
                        .push("`eos_token_id` is not a token id or a list of them".into());
                    vec![]
                }
            },
        },
    };
    if problems.is_empty() {
        Ok(CheckpointConfig {
            vision,
            text,
            tokens,
        })
    } else {
        Err(problems.join("; "))
    }
}

struct Reader<'p> {
    problems: &'p mut Vec<String>,
}

impl Reader<'_> {
    fn u32(&mut self, obj: &Value, prefix: &str, keys: &[&str], default: Option<u32>) -> u32 {
        for k in keys {
            if let Some(v) = obj.get(*k) {
                return match v.as_u64() {
                    Some(x) if x <= u32::MAX as u64 => x as u32,
                    _ => {
                        self.problems
                            .push(format!("`{}` is not a whole number", dotted(prefix, k)));
                        0
                    }
                };
            }
        }
        match default {
            Some(d) => d,
            None => {
                if !obj.is_null() {
                    self.problems
                        .push(format!("`{}` is missing", dotted(prefix, keys[0])));
                }
                0
            }
        }
    }

    fn f64(&mut self, obj: &Value, prefix: &str, key: &str, default: f64) -> f64 {
        match obj.get(key) {
            None => default,
            Some(v) => v.as_f64().unwrap_or_else(|| {
                self.problems
                    .push(format!("`{}` is not a number", dotted(prefix, key)));
                default
            }),
        }
    }

    fn u32_list(&mut self, obj: &Value, prefix: &str, key: &str) -> Vec<u32> {
        match obj.get(key) {
            None if obj.is_null() => vec![],
            None => {
                self.problems
                    .push(format!("`{}` is missing", dotted(prefix, key)));
                vec![]
            }
            Some(Value::Array(a))
                if a.iter()
                    .all(|x| x.as_u64().is_some_and(|v| v <= u32::MAX as u64)) =>
            {
                a.iter().map(|x| x.as_u64().unwrap_or(0) as u32).collect()
            }
            Some(_) => {
                self.problems.push(format!(
                    "`{}` is not a list of whole numbers",
                    dotted(prefix, key)
                ));
                vec![]
            }
        }
    }
}

fn dotted(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    /// The released Qwen2.5-VL-3B-Instruct config.json (text fields at the top level).
    pub const QWEN25_VL_3B: &str = r#"{
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
        let c = parse_config(QWEN25_VL_3B).unwrap();
        let p = presets::model("qwen2.5-vl-3b").unwrap();
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
        let c = parse_config(j).unwrap();
        assert_eq!(c.text.num_layers, 2);
        assert_eq!(c.text.mrope_section, [2, 3, 3]);
        assert_eq!(c.vision.patch_size, 14);
        assert_eq!(c.tokens.eos_token_ids, vec![5, 6]);
        assert!(!c.text.tie_word_embeddings);
    }

    #[test]
    fn zero_dims_are_read_and_left_to_the_range_check() {
        // parse_config reads what is there; model.rs rejects out-of-range dims with a span
        let j = QWEN25_VL_3B.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 0");
        assert_eq!(parse_config(&j).unwrap().text.num_kv_heads, 0);
    }

    #[test]
    fn lists_every_problem() {
        let e =
            parse_config(r#"{"hidden_size": "big", "vision_config": {"depth": 2}}"#).unwrap_err();
        for want in [
            "`hidden_size` is not a whole number",
            "`num_hidden_layers` is missing",
            "`vision_config.hidden_size` is missing",
            "mrope_section` is missing",
        ] {
            assert!(e.contains(want), "{want} not in {e}");
        }
        assert!(parse_config("{").unwrap_err().contains("not valid JSON"));
        assert!(parse_config("[]")
            .unwrap_err()
            .contains("not a JSON object"));
    }
}
