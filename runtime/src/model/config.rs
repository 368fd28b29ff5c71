//! Model configuration: the dimensions of a [`ModelSpec`] plus the few Qwen2.5-VL constants the
//! plan's spec does not carry, read from and written to a Hugging Face `config.json`.
//!
//! Both config layouts are read: transformers 5 (`text_config`, `vision_config`,
//! `rope_parameters`) and the flat layout of the released checkpoints (text fields at the top,
//! `rope_scaling.mrope_section`). Written configs use the transformers 5 layout.

use std::path::Path;

use rollplex_plan::spec::{DType, ModelSpec, SpecialTokens, TextDims, VisionDims, WeightsSource};
use serde_json::{json, Map, Value};

use super::ModelError;

/// Everything the forward needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub spec: ModelSpec,
    /// `vision_config.tokens_per_second`: temporal M-RoPE step of a video grid per second.
    pub tokens_per_second: u32,
    /// `vision_config.rope_parameters.rope_theta` (10000 in every released checkpoint).
    pub vision_rope_theta: f64,
}

/// RMSNorm epsilon of every vision norm (fixed in Hugging Face's code).
pub const VISION_RMS_EPS: f32 = 1e-6;

impl ModelConfig {
    /// A config for given dims, with the released checkpoints' values for the rest
    /// (`tokens_per_second` 2, vision RoPE theta 10000).
    pub fn from_spec(spec: ModelSpec) -> Result<Self, ModelError> {
        let c = ModelConfig {
            spec,
            tokens_per_second: 2,
            vision_rope_theta: 10000.0,
        };
        c.validate()?;
        Ok(c)
    }

    pub fn vision(&self) -> &VisionDims {
        &self.spec.vision
    }
    pub fn text(&self) -> &TextDims {
        &self.spec.text
    }
    pub fn vision_head_dim(&self) -> usize {
        (self.spec.vision.hidden_size / self.spec.vision.num_heads) as usize
    }
    /// Elements of one flattened patch: `in_channels * temporal_patch * patch * patch`.
    pub fn patch_dim(&self) -> usize {
        let v = &self.spec.vision;
        (v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size) as usize
    }

    /// Checks the relations the forward relies on; every violation is named.
    pub fn validate(&self) -> Result<(), ModelError> {
        let v = &self.spec.vision;
        let t = &self.spec.text;
        let mut errs = Vec::new();
        let nz = |errs: &mut Vec<String>, name: &str, x: u32| {
            if x == 0 {
                errs.push(format!("{name} must be positive"));
            }
        };
        for (n, x) in [
            ("vision.depth", v.depth),
            ("vision.hidden_size", v.hidden_size),
            ("vision.num_heads", v.num_heads),
            ("vision.intermediate_size", v.intermediate_size),
            ("vision.patch_size", v.patch_size),
            ("vision.temporal_patch_size", v.temporal_patch_size),
            ("vision.spatial_merge_size", v.spatial_merge_size),
            ("vision.in_channels", v.in_channels),
            ("vision.out_hidden_size", v.out_hidden_size),
            ("text.num_layers", t.num_layers),
            ("text.hidden_size", t.hidden_size),
            ("text.num_heads", t.num_heads),
            ("text.num_kv_heads", t.num_kv_heads),
            ("text.intermediate_size", t.intermediate_size),
            ("text.vocab_size", t.vocab_size),
        ] {
            nz(&mut errs, n, x);
        }
        if !errs.is_empty() {
            return Err(ModelError::Config(errs.join("; ")));
        }
        if v.hidden_size % v.num_heads != 0 || (v.hidden_size / v.num_heads) % 4 != 0 {
            errs.push(format!(
                "vision hidden_size {} / num_heads {} must give a head dim divisible by 4 (2D RoPE)",
                v.hidden_size, v.num_heads
            ));
        }
        if t.hidden_size % t.num_heads != 0 || t.head_dim() % 2 != 0 {
            errs.push(format!(
                "text hidden_size {} / num_heads {} must give an even head dim",
                t.hidden_size, t.num_heads
            ));
        }
        if t.num_heads % t.num_kv_heads != 0 {
            errs.push(format!(
                "text num_heads {} is not a multiple of num_kv_heads {}",
                t.num_heads, t.num_kv_heads
            ));
        }
        let sec: u32 = t.mrope_section.iter().sum();
        if t.hidden_size % t.num_heads == 0 && sec != t.head_dim() / 2 {
            errs.push(format!(
                "mrope_section {:?} sums to {sec}, expected head_dim/2 = {}",
                t.mrope_section,
                t.head_dim() / 2
            ));
        }
        if v.out_hidden_size != t.hidden_size {
            errs.push(format!(
                "vision out_hidden_size {} != text hidden_size {}",
                v.out_hidden_size, t.hidden_size
            ));
        }
        if let Some(b) = v.fullatt_block_indexes.iter().find(|&&b| b >= v.depth) {
            errs.push(format!(
                "fullatt_block_indexes has {b}, but the vision tower has {} blocks",
                v.depth
            ));
        }
        if v.window_size < v.patch_size * v.spatial_merge_size {
            errs.push(format!(
                "window_size {} is smaller than one merged patch ({} pixels)",
                v.window_size,
                v.patch_size * v.spatial_merge_size
            ));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ModelError::Config(errs.join("; ")))
        }
    }

    /// Reads `dir/config.json` (and `dir/generation_config.json` for extra EOS ids, if present).
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: not valid JSON: {e}", path.display())))?;
        let mut cfg = Self::from_json(&root, dir)?;
        let gpath = dir.join("generation_config.json");
        if let Ok(g) = std::fs::read_to_string(&gpath) {
            if let Ok(g) = serde_json::from_str::<Value>(&g) {
                for id in ids_of(g.get("eos_token_id")) {
                    if !cfg.spec.tokens.eos_token_ids.contains(&id) {
                        cfg.spec.tokens.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(cfg)
    }

    /// Parses a `config.json` value; `dir` only names the model and its weights source.
    pub fn from_json(root: &Value, dir: &Path) -> Result<Self, ModelError> {
        let empty = Value::Object(Map::new());
        let tc = root.get("text_config").unwrap_or(root);
        let vc = root
            .get("vision_config")
            .ok_or_else(|| ModelError::Config("config.json has no vision_config".into()))?;
        // text fields: text_config first, then the top level (flat released layout)
        let tget = |k: &str| {
            tc.get(k)
                .filter(|v| !v.is_null())
                .or_else(|| root.get(k).filter(|v| !v.is_null()))
        };
        let tu = |k: &str| -> Result<u32, ModelError> {
            tget(k)
                .and_then(Value::as_u64)
                .map(|x| x as u32)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "config.json: text field `{k}` missing or not an integer"
                    ))
                })
        };
        let vu = |k: &str, d: Option<u32>| -> Result<u32, ModelError> {
            match vc.get(k).and_then(Value::as_u64) {
                Some(x) => Ok(x as u32),
                None => d.ok_or_else(|| {
                    ModelError::Config(format!("config.json: vision_config.{k} missing"))
                }),
            }
        };
        for (act, where_) in [
            (tget("hidden_act"), "text"),
            (vc.get("hidden_act"), "vision"),
        ] {
            if let Some(a) = act.and_then(Value::as_str) {
                if a != "silu" {
                    return Err(ModelError::Config(format!(
                        "{where_} hidden_act `{a}` is not supported (only silu)"
                    )));
                }
            }
        }
        let rope = tget("rope_parameters")
            .or_else(|| tget("rope_scaling"))
            .unwrap_or(&empty);
        let rope_theta = rope
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or_else(|| tget("rope_theta").and_then(Value::as_f64))
            .unwrap_or(1_000_000.0);
        let sec: Vec<u32> = rope
            .get("mrope_section")
            .or_else(|| {
                root.get("rope_scaling")
                    .and_then(|r| r.get("mrope_section"))
            })
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect()
            })
            .ok_or_else(|| {
                ModelError::Config(
                    "config.json: no mrope_section in rope_parameters / rope_scaling".into(),
                )
            })?;
        if sec.len() != 3 {
            return Err(ModelError::Config(format!(
                "mrope_section must have 3 entries, got {sec:?}"
            )));
        }
        let heads = tu("num_attention_heads")?;
        let tie = root
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            || tc
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false);
        let text = TextDims {
            num_layers: tu("num_hidden_layers")?,
            hidden_size: tu("hidden_size")?,
            num_heads: heads,
            num_kv_heads: tget("num_key_value_heads")
                .and_then(Value::as_u64)
                .map(|x| x as u32)
                .unwrap_or(heads),
            intermediate_size: tu("intermediate_size")?,
            vocab_size: tu("vocab_size")?,
            rope_theta,
            mrope_section: [sec[0], sec[1], sec[2]],
            tie_word_embeddings: tie,
            rms_norm_eps: tget("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            max_position_embeddings: tget("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(32768) as u32,
        };
        let vision = VisionDims {
            depth: vu("depth", None)?,
            hidden_size: vu("hidden_size", None)?,
            num_heads: vu("num_heads", None)?,
            intermediate_size: vu("intermediate_size", None)?,
            patch_size: vu("patch_size", Some(14))?,
            temporal_patch_size: vu("temporal_patch_size", Some(2))?,
            spatial_merge_size: vu("spatial_merge_size", Some(2))?,
            window_size: vu("window_size", Some(112))?,
            fullatt_block_indexes: vc
                .get("fullatt_block_indexes")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_u64)
                        .map(|x| x as u32)
                        .collect()
                })
                .unwrap_or_else(|| vec![7, 15, 23, 31]),
            in_channels: vu("in_channels", None).or_else(|_| vu("in_chans", Some(3)))?,
            out_hidden_size: vu("out_hidden_size", None)?,
        };
        let top_u = |k: &str, d: u32| {
            root.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as u32)
                .unwrap_or(d)
        };
        let mut eos = ids_of(tget("eos_token_id"));
        if eos.is_empty() {
            eos.push(151645);
        }
        let tokens = SpecialTokens {
            image_token_id: top_u("image_token_id", 151655),
            video_token_id: top_u("video_token_id", 151656),
            vision_start_token_id: top_u("vision_start_token_id", 151652),
            vision_end_token_id: top_u("vision_end_token_id", 151653),
            eos_token_ids: eos,
        };
        let dtype = match root
            .get("torch_dtype")
            .or_else(|| root.get("dtype"))
            .and_then(Value::as_str)
        {
            Some("float32") => DType::F32,
            Some("float16") => DType::F16,
            _ => DType::Bf16,
        };
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let spec = ModelSpec {
            name,
            vision,
            text,
            tokens,
            dtype,
            weights: WeightsSource::Checkpoint {
                path: dir.display().to_string(),
            },
        };
        let cfg = ModelConfig {
            spec,
            tokens_per_second: vc
                .get("tokens_per_second")
                .and_then(Value::as_u64)
                .unwrap_or(4) as u32,
            vision_rope_theta: vc
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .or_else(|| vc.get("rope_theta").and_then(Value::as_f64))
                .unwrap_or(10000.0),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` of this model in the transformers 5 layout.
    pub fn to_json(&self) -> Value {
        let (v, t, k) = (&self.spec.vision, &self.spec.text, &self.spec.tokens);
        let eos: Value = if k.eos_token_ids.len() == 1 {
            json!(k.eos_token_ids[0])
        } else {
            json!(k.eos_token_ids)
        };
        let dtype = match self.spec.dtype {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::Bf16 => "bfloat16",
        };
        json!({
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "dtype": dtype,
            "image_token_id": k.image_token_id,
            "video_token_id": k.video_token_id,
            "vision_start_token_id": k.vision_start_token_id,
            "vision_end_token_id": k.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "hidden_act": "silu",
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_layers,
                "num_attention_heads": t.num_heads,
                "num_key_value_heads": t.num_kv_heads,
                "vocab_size": t.vocab_size,
                "rms_norm_eps": t.rms_norm_eps,
                "max_position_embeddings": t.max_position_embeddings,
                "tie_word_embeddings": t.tie_word_embeddings,
                "eos_token_id": eos,
                "rope_parameters": {
                    "rope_type": "default",
                    "type": "mrope",
                    "mrope_section": t.mrope_section,
                    "rope_theta": t.rope_theta,
                },
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "hidden_act": "silu",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "num_heads": v.num_heads,
                "intermediate_size": v.intermediate_size,
                "patch_size": v.patch_size,
                "temporal_patch_size": v.temporal_patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "window_size": v.window_size,
                "fullatt_block_indexes": v.fullatt_block_indexes,
                "in_channels": v.in_channels,
                "out_hidden_size": v.out_hidden_size,
                "tokens_per_second": self.tokens_per_second,
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.vision_rope_theta},
            },
        })
    }
}

fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}
