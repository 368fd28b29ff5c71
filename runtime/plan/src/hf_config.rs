//! A Hugging Face Qwen2.5-VL `config.json` -> model dimensions, special tokens and the few
//! constants of the model a [`crate::spec::ModelSpec`] does not hold. The one reader of that
//! file: the DSL reads a checkpoint's dimensions with it (through its `Env`), the runtime loads
//! a checkpoint with it.
//!
//! Both layouts are read: transformers 5 (`text_config`, `vision_config`, `rope_parameters`)
//! and the flat layout of the released checkpoints (text fields at the top level,
//! `rope_scaling.mrope_section`). A text field is read from `text_config` when it has it, else
//! from the top level; `mrope_section` and `rope_theta` from `rope_parameters` or
//! `rope_scaling`, in `text_config` or at the top level; `vision_config` gives the vision tower
//! (`in_chans` or `in_channels`, `hidden_size` or `embed_dim`). Token ids come from the top
//! level, falling back to Qwen2.5-VL's. Fields with a Hugging Face class default (patch 14,
//! temporal patch 2, merge 2, window 112, 3 input channels, rope theta 1e6, eps 1e-6, 128000
//! positions, untied embeddings, 4 tokens per second, vision rope theta 1e4, bf16) may be
//! absent; the core dimensions, `fullatt_block_indexes` and `mrope_section` must be present.
//! Only the `silu` activation is accepted (the only one the model implements).
//!
//! Invariant: pure — the text comes in, the config or the list of every problem goes out
//! (each naming its field); range checks are the caller's.

use serde_json::Value;

use crate::models::qwen_tokens;
use crate::spec::{DType, SpecialTokens, TextDims, VisionDims};

/// What a config.json gives.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    pub vision: VisionDims,
    pub text: TextDims,
    pub tokens: SpecialTokens,
    /// `torch_dtype` (or `dtype`): float32, float16, else bfloat16.
    pub dtype: DType,
    /// `vision_config.tokens_per_second`: temporal M-RoPE step of a video grid per second.
    pub tokens_per_second: u32,
    /// `vision_config.rope_parameters.rope_theta` (or `vision_config.rope_theta`).
    pub vision_rope_theta: f64,
}

/// Reads a config.json's text; the error lists every missing or malformed field, `; `-joined.
pub fn parse(text: &str) -> Result<HfConfig, String> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| format!("config.json is not valid JSON: {e}"))?;
    if !root.is_object() {
        return Err("config.json is not a JSON object".into());
    }
    let mut problems: Vec<String> = Vec::new();
    let vis = match root.get("vision_config") {
        Some(v) if v.is_object() => v,
        _ => {
            problems.push("`vision_config` is missing".into());
            &Value::Null
        }
    };
    // the text fields' homes, in the order they are looked in
    let texts: Vec<(&Value, &str)> = match root.get("text_config").filter(|v| v.is_object()) {
        Some(tc) => vec![(tc, "text_config"), (&root, "")],
        None => vec![(&root, "")],
    };
    let v = [(vis, "vision_config")];
    let mut r = Reader {
        problems: &mut problems,
    };

    let mut vision = VisionDims {
        depth: r.u32(&v, &["depth"], None),
        hidden_size: r.u32(&v, &["hidden_size", "embed_dim"], None),
        num_heads: r.u32(&v, &["num_heads"], None),
        intermediate_size: r.u32(&v, &["intermediate_size"], None),
        patch_size: r.u32(&v, &["patch_size", "spatial_patch_size"], Some(14)),
        temporal_patch_size: r.u32(&v, &["temporal_patch_size"], Some(2)),
        spatial_merge_size: r.u32(&v, &["spatial_merge_size"], Some(2)),
        window_size: r.u32(&v, &["window_size"], Some(112)),
        fullatt_block_indexes: r.u32_list(vis, "vision_config", "fullatt_block_indexes"),
        in_channels: r.u32(&v, &["in_chans", "in_channels"], Some(3)),
        out_hidden_size: 0,
    };
    // rope_parameters (transformers 5) or rope_scaling (released), in text_config or at the top
    let ropes: Vec<&Value> = texts
        .iter()
        .flat_map(|(o, _)| ["rope_parameters", "rope_scaling"].map(|k| o.get(k)))
        .flatten()
        .collect();
    let num_layers = r.u32(&texts, &["num_hidden_layers"], None);
    let hidden_size = r.u32(&texts, &["hidden_size"], None);
    let num_heads = r.u32(&texts, &["num_attention_heads"], None);
    let intermediate_size = r.u32(&texts, &["intermediate_size"], None);
    let vocab_size = r.u32(&texts, &["vocab_size"], None);
    let rope_theta = match ropes.iter().find_map(|x| x.get("rope_theta")) {
        Some(t) => t.as_f64().unwrap_or_else(|| {
            r.problems
                .push("`rope_parameters.rope_theta` is not a number".into());
            1e6
        }),
        None => r.f64(&texts, "rope_theta", 1e6),
    };
    let mut text = TextDims {
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads: 0,
        intermediate_size,
        vocab_size,
        rope_theta,
        mrope_section: [0, 0, 0],
        tie_word_embeddings: match root
            .get("tie_word_embeddings")
            .or_else(|| texts[0].0.get("tie_word_embeddings"))
        {
            Some(Value::Bool(b)) => *b,
            None => false,
            Some(_) => {
                r.problems
                    .push("`tie_word_embeddings` is not true/false".into());
                false
            }
        },
        rms_norm_eps: r.f64(&texts, "rms_norm_eps", 1e-6),
        max_position_embeddings: r.u32(&texts, &["max_position_embeddings"], Some(128000)),
    };
    text.num_kv_heads = r.u32(&texts, &["num_key_value_heads"], Some(num_heads));
    match ropes
        .iter()
        .find_map(|x| x.get("mrope_section"))
        .map(|m| m.as_array())
    {
        Some(Some(a))
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
    vision.out_hidden_size = r.u32(&v, &["out_hidden_size"], Some(text.hidden_size));

    let dflt = qwen_tokens();
    let top = [(&root, "")];
    let tokens = SpecialTokens {
        image_token_id: r.u32(&top, &["image_token_id"], Some(dflt.image_token_id)),
        video_token_id: r.u32(&top, &["video_token_id"], Some(dflt.video_token_id)),
        vision_start_token_id: r.u32(
            &top,
            &["vision_start_token_id"],
            Some(dflt.vision_start_token_id),
        ),
        vision_end_token_id: r.u32(
            &top,
            &["vision_end_token_id"],
            Some(dflt.vision_end_token_id),
        ),
        eos_token_ids: match root
            .get("eos_token_id")
            .or_else(|| texts[0].0.get("eos_token_id"))
        {
            None => dflt.eos_token_ids,
            Some(v) => token_ids(v).unwrap_or_else(|| {
                r.problems
                    .push("`eos_token_id` is not a token id or a list of them".into());
                vec![]
            }),
        },
    };
    for (obj, prefix) in [texts[0], (vis, "vision_config")] {
        match obj.get("hidden_act") {
            None => {}
            Some(Value::String(a)) if a == "silu" => {}
            Some(a) => r.problems.push(format!(
                "`{}` is {a}: only silu is supported",
                dotted(prefix, "hidden_act")
            )),
        }
    }
    let dtype = match root
        .get("torch_dtype")
        .or_else(|| root.get("dtype"))
        .and_then(Value::as_str)
    {
        Some("float32") => DType::F32,
        Some("float16") => DType::F16,
        _ => DType::Bf16,
    };
    let tokens_per_second = r.u32(&v, &["tokens_per_second"], Some(4));
    let vision_rope_theta = match vis.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
        Some(t) => t.as_f64().unwrap_or_else(|| {
            r.problems
                .push("`vision_config.rope_parameters.rope_theta` is not a number".into());
            1e4
        }),
        None => r.f64(&v, "rope_theta", 1e4),
    };
    if problems.is_empty() {
        Ok(HfConfig {
            vision,
            text,
            tokens,
            dtype,
            tokens_per_second,
            vision_rope_theta,
        })
    } else {
        Err(problems.join("; "))
    }
}

/// A token id or a list of them (`eos_token_id` is either); `None` when it is neither.
pub fn token_ids(v: &Value) -> Option<Vec<u32>> {
    let id = |x: &Value| {
        x.as_u64()
            .filter(|&i| i <= u32::MAX as u64)
            .map(|i| i as u32)
    };
    match v {
        Value::Array(a) => a.iter().map(id).collect(),
        v => id(v).map(|i| vec![i]),
    }
}

/// Collects the problems of one config while reading it.
struct Reader<'p> {
    problems: &'p mut Vec<String>,
}

impl Reader<'_> {
    /// The first of `keys` found in the first of `objs` that has one (each object named by its
    /// path); `default` when none has any, else a problem naming the first object's key (none
    /// when that object is absent: its absence is the problem reported).
    fn u32(&mut self, objs: &[(&Value, &str)], keys: &[&str], default: Option<u32>) -> u32 {
        for (obj, prefix) in objs {
            for k in keys {
                if let Some(v) = obj.get(*k).filter(|v| !v.is_null()) {
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
        }
        match default {
            Some(d) => d,
            None => {
                let (obj, prefix) = objs[0];
                if !obj.is_null() {
                    self.problems
                        .push(format!("`{}` is missing", dotted(prefix, keys[0])));
                }
                0
            }
        }
    }

    fn f64(&mut self, objs: &[(&Value, &str)], key: &str, default: f64) -> f64 {
        for (obj, prefix) in objs {
            if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                return v.as_f64().unwrap_or_else(|| {
                    self.problems
                        .push(format!("`{}` is not a number", dotted(prefix, key)));
                    default
                });
            }
        }
        default
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
mod tests;
