//! Hugging Face checkpoint directories: `config.json` plus `model.safetensors`, or shards listed
//! by `model.safetensors.index.json`. Tensors in bf16, f16 or f32 are widened to f32 into the one
//! parameter buffer. Saving writes the same layout (transformers 5 names; a tied lm head is not
//! written, as transformers does), each file to a temporary name first and then renamed.
//!
//! Loading is strict: a tensor the model does not have, a shape that differs, or a parameter
//! the files do not provide is an error that names it.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use rollplex_plan::files;
use rollplex_plan::spec::DType;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::config::ModelConfig;
use super::weights::{canonical_name, Weights};
use super::{ModelError, Qwen25VL};

fn ck(msg: String) -> ModelError {
    ModelError::Checkpoint(msg)
}

/// The safetensors files of a checkpoint directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = files::read_to_string(&index, files::TEXT_CAP)
            .map_err(|e| ModelError::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ck(format!("{}: not valid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ck(format!("{}: no weight_map", index.display())))?;
        let files: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ck(format!(
            "{}: no model.safetensors, index file or *.safetensors",
            dir.display()
        )));
    }
    Ok(files)
}

fn to_f32(t: &TensorView<'_>, dst: &mut [f32], name: &str) -> Result<(), ModelError> {
    let d = t.data();
    match t.dtype() {
        Dtype::F32 => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::BF16 => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::F16 => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        other => {
            return Err(ck(format!(
                "tensor {name}: dtype {other:?} is not supported (bf16, f16, f32)"
            )))
        }
    }
    Ok(())
}

/// Loads a checkpoint directory.
pub fn load_checkpoint(dir: &Path) -> Result<Qwen25VL, ModelError> {
    let config = ModelConfig::load(dir)?;
    let mut weights = Weights::zeros(&config);
    let tied = config.text().tie_word_embeddings;
    let mut filled = vec![false; weights.table.entries().len()];
    let mut unknown = Vec::new();
    for file in weight_files(dir)? {
        let bytes = files::read(&file, files::NO_CAP).map_err(|e| ModelError::io(&file, e))?;
        let st =
            SafeTensors::deserialize(&bytes).map_err(|e| ck(format!("{}: {e}", file.display())))?;
        for (name, view) in st.tensors() {
            let id = match weights.table.find(&name) {
                Some(id) => id,
                None if tied && canonical_name(&name) == "lm_head.weight" => continue,
                None => {
                    unknown.push(name);
                    continue;
                }
            };
            let e = weights.table.entry(id).clone();
            if view.shape() != e.shape.as_slice() {
                return Err(ck(format!(
                    "{}: tensor {name} has shape {:?}, the config implies {:?}",
                    file.display(),
                    view.shape(),
                    e.shape
                )));
            }
            to_f32(&view, &mut weights.data[e.offset..e.offset + e.len], &name)?;
            filled[id.0 as usize] = true;
        }
    }
    if !unknown.is_empty() {
        unknown.sort();
        return Err(ck(format!(
            "{}: tensors the model does not have: {}",
            dir.display(),
            unknown.join(", ")
        )));
    }
    let missing: Vec<&str> = weights
        .table
        .entries()
        .iter()
        .zip(&filled)
        .filter(|(_, f)| !**f)
        .map(|(e, _)| e.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(ck(format!(
            "{}: missing tensors: {}",
            dir.display(),
            missing.join(", ")
        )));
    }
    Qwen25VL::new(config, weights)
}

fn write_atomic(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

/// Saves `model` to `dir` (created if needed): `config.json` and `model.safetensors` with
/// tensors in `dtype` (f32, bf16 or f16).
pub fn save_checkpoint(model: &Qwen25VL, dir: &Path, dtype: DType) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut cfg = model.config.clone();
    cfg.spec.dtype = dtype;
    let json =
        serde_json::to_string_pretty(&cfg.to_json()).expect("a JSON value always serialises");
    let cpath = dir.join("config.json");
    write_atomic(&cpath, |p| {
        std::fs::write(p, json.as_bytes()).map_err(|e| ModelError::io(p, e))
    })?;
    let (st_dtype, width) = match dtype {
        DType::F32 => (Dtype::F32, 4),
        DType::Bf16 => (Dtype::BF16, 2),
        DType::F16 => (Dtype::F16, 2),
    };
    let w = &model.weights;
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for e in w.table.entries() {
        let src = &w.data[e.offset..e.offset + e.len];
        let mut b = Vec::with_capacity(e.len * width);
        for &x in src {
            match dtype {
                DType::F32 => b.extend_from_slice(&x.to_le_bytes()),
                DType::Bf16 => b.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
                DType::F16 => b.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes()),
            }
        }
        blobs.push((e.name.clone(), e.shape.clone(), b));
    }
    let mut views = Vec::with_capacity(blobs.len());
    for (name, shape, b) in &blobs {
        let v = TensorView::new(st_dtype, shape.clone(), b)
            .map_err(|e| ck(format!("tensor {name}: {e}")))?;
        views.push((name.clone(), v));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mpath = dir.join("model.safetensors");
    write_atomic(&mpath, |p| {
        safetensors::tensor::serialize_to_file(views, Some(meta), p)
            .map_err(|e| ck(format!("{}: {e}", p.display())))
    })
}
