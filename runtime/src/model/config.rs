//! Model configuration: the dimensions of a [`ModelSpec`] plus the few Qwen2.5-VL constants the
//! plan's spec does not carry, read from and written to a Hugging Face `config.json`.
//!
//! Reading is `rollplex_plan::hf_config`'s, the reader the DSL uses too (both layouts: the
//! transformers 5 one and the flat one of the released checkpoints); this module adds the
//! generation config's EOS ids and the checks the forward relies on. Written configs use the
//! transformers 5 layout.

use std::path::Path;

use rollplex_plan::spec::{DType, ModelSpec, TextDims, VisionDims, WeightsSource};
use rollplex_plan::{files, hf_config};
use serde_json::{json, Value};

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
        if !v.hidden_size.is_multiple_of(v.num_heads)
            || !(v.hidden_size / v.num_heads).is_multiple_of(4)
        {
            errs.push(format!(
                "vision hidden_size {} / num_heads {} must give a head dim divisible by 4 (2D RoPE)",
                v.hidden_size, v.num_heads
            ));
        }
        if !t.hidden_size.is_multiple_of(t.num_heads) || !t.head_dim().is_multiple_of(2) {
            errs.push(format!(
                "text hidden_size {} / num_heads {} must give an even head dim",
                t.hidden_size, t.num_heads
            ));
        }
        if !t.num_heads.is_multiple_of(t.num_kv_heads) {
            errs.push(format!(
                "text num_heads {} is not a multiple of num_kv_heads {}",
                t.num_heads, t.num_kv_heads
            ));
        }
        let sec: u32 = t.mrope_section.iter().sum();
        if t.hidden_size.is_multiple_of(t.num_heads) && sec != t.head_dim() / 2 {
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

    /// Reads `dir/config.json` (and `dir/generation_config.json` for extra EOS ids, if present)
    /// with the one reader of that file (`rollplex_plan::hf_config`); an error names the file
    /// and every field at fault.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text =
            files::read_to_string(&path, files::TEXT_CAP).map_err(|e| ModelError::io(&path, e))?;
        let mut cfg = Self::parse(&text, dir)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        let gpath = dir.join("generation_config.json");
        if let Ok(g) = files::read_to_string(&gpath, files::TEXT_CAP) {
            if let Ok(g) = serde_json::from_str::<Value>(&g) {
                let ids = g.get("eos_token_id").and_then(hf_config::token_ids);
                for id in ids.unwrap_or_default() {
                    if !cfg.spec.tokens.eos_token_ids.contains(&id) {
                        cfg.spec.tokens.eos_token_ids.push(id);
                    }
                }
            }
        }
        cfg.validate().map_err(|e| match e {
            ModelError::Config(m) => ModelError::Config(format!("{}: {m}", path.display())),
            e => e,
        })?;
        Ok(cfg)
    }

    /// Parses the text of a `config.json`, unvalidated; `dir` names the model and its weights
    /// source.
    fn parse(text: &str, dir: &Path) -> Result<Self, String> {
        let c = hf_config::parse(text)?;
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        Ok(ModelConfig {
            spec: ModelSpec {
                name,
                vision: c.vision,
                text: c.text,
                tokens: c.tokens,
                dtype: c.dtype,
                weights: WeightsSource::Checkpoint {
                    path: dir.display().to_string(),
                },
            },
            tokens_per_second: c.tokens_per_second,
            vision_rope_theta: c.vision_rope_theta,
        })
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
