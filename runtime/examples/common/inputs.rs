//! What the reference examples share: the `inputs.safetensors` a case directory holds (written by
//! tests/reference/make_tiny*.py) and its media grids. Included with
//! `#[path = "common/inputs.rs"] mod inputs;`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, SafeTensors};

pub struct Inputs {
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

impl Inputs {
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        Ok(Inputs { tensors })
    }
    pub fn get(&self, name: &str) -> Option<&(String, Dtype, Vec<usize>, Vec<u8>)> {
        self.tensors.iter().find(|t| t.0 == name)
    }
    pub fn f32s(&self, name: &str) -> Result<Option<Vec<f32>>> {
        let Some((_, dt, _, d)) = self.get(name) else {
            return Ok(None);
        };
        if *dt != Dtype::F32 {
            bail!("{name}: expected f32, found {dt:?}");
        }
        Ok(Some(
            d.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
    pub fn i64s(&self, name: &str) -> Result<Option<Vec<i64>>> {
        let Some((_, dt, _, d)) = self.get(name) else {
            return Ok(None);
        };
        if *dt != Dtype::I64 {
            bail!("{name}: expected i64, found {dt:?}");
        }
        Ok(Some(
            d.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
        ))
    }
}

/// `[t, h, w]` triples from a flat `grid_thw` tensor (none if absent).
pub fn grids_of(v: Option<Vec<i64>>) -> Vec<[u32; 3]> {
    v.map(|g| {
        g.chunks_exact(3)
            .map(|c| [c[0] as u32, c[1] as u32, c[2] as u32])
            .collect()
    })
    .unwrap_or_default()
}
