//! Weights on the device: every tensor the forward reads, in bf16 (round to nearest even, as
//! `half::bf16::from_f32` and PyTorch's `.to(torch.bfloat16)`), laid out as the kernels read
//! them: one fused `[q | k | v]` linear per block (rows of q, then k, then v; the vision tower's
//! `attn.qkv` already is), one fused `[gate | up]` linear (`[2F, H]`, so one GEMM writes the
//! `[rows, 2F]` buffer `swiglu_fwd_bf16` reads in place), the patch embedding as a `[vh, pd]`
//! GEMM weight, and the lm head shared with the embeddings when they are tied.
//!
//! Invariant: a fused linear computes, row for row, exactly what its parts compute (the GEMM
//! reduces over the same `k` for every output column); `fuse_linears` is tested on the CPU.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{CudaSlice, CudaStream, Gpu};

use super::arena::{upload_in, DevBuf, Region};

use crate::model::weights::{BlockParams, Lin, Linear};
use crate::model::{Qwen25VL, Weights};

use super::Result;

/// A linear layer on the device: `w [out, inp]`, optional `b [out]`.
pub struct GpuLinear {
    pub w: DevBuf<bf16>,
    pub b: Option<DevBuf<bf16>>,
    pub out: usize,
    pub inp: usize,
}

impl GpuLinear {
    /// The bias as the GEMM entry points take it.
    pub fn bias(&self) -> Option<&dyn cudarc::driver::DevicePtr<bf16>> {
        self.b
            .as_ref()
            .map(|b| b as &dyn cudarc::driver::DevicePtr<bf16>)
    }
}

/// One block (vision block or text layer) on the device.
pub struct GpuBlock {
    pub norm1: DevBuf<bf16>,
    pub norm2: DevBuf<bf16>,
    /// `[q | k | v]` rows.
    pub qkv: GpuLinear,
    pub o: GpuLinear,
    /// `[gate | up]` rows (`out = 2 * ffn`).
    pub gate_up: GpuLinear,
    pub down: GpuLinear,
    pub ffn: usize,
}

impl GpuBlock {
    /// Fused linear `k`.
    pub fn lin(&self, k: Lin) -> &GpuLinear {
        match k {
            Lin::Qkv => &self.qkv,
            Lin::O => &self.o,
            Lin::GateUp => &self.gate_up,
            Lin::Down => &self.down,
        }
    }
    pub fn lin_mut(&mut self, k: Lin) -> &mut GpuLinear {
        match k {
            Lin::Qkv => &mut self.qkv,
            Lin::O => &mut self.o,
            Lin::GateUp => &mut self.gate_up,
            Lin::Down => &mut self.down,
        }
    }
}

/// All weights of a model on one device.
pub struct GpuWeights {
    /// `[vision_hidden, patch_dim]`.
    pub patch_embed: DevBuf<bf16>,
    pub vision: Vec<GpuBlock>,
    pub merger_ln: DevBuf<bf16>,
    pub merger_fc1: GpuLinear,
    pub merger_fc2: GpuLinear,
    /// `[vocab, hidden]`.
    pub embed: DevBuf<bf16>,
    pub text: Vec<GpuBlock>,
    pub final_norm: DevBuf<bf16>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<DevBuf<bf16>>,
    /// Bytes held on the device.
    pub bytes: usize,
}

/// The host side of a fused linear: the parts' weight rows stacked in order, and their biases
/// (zeros for a part without one) when any part has a bias.
pub fn fuse_linears(w: &Weights, parts: &[Linear]) -> (Vec<f32>, Option<Vec<f32>>, usize) {
    let inp = parts[0].inp;
    let out: usize = parts.iter().map(|l| l.out).sum();
    let mut wt = Vec::with_capacity(out * inp);
    for l in parts {
        wt.extend_from_slice(w.lin_w(l));
    }
    let bias = parts.iter().any(|l| l.b.is_some()).then(|| {
        let mut b = Vec::with_capacity(out);
        for l in parts {
            match w.lin_b(l) {
                Some(x) => b.extend_from_slice(x),
                None => b.extend(std::iter::repeat_n(0.0, l.out)),
            }
        }
        b
    });
    (wt, bias, out)
}

/// Round to nearest even, element by element (in parallel: a 3B model is 3.75 G values).
fn to_bf16(x: &[f32]) -> Vec<bf16> {
    use rayon::prelude::*;
    x.par_iter().map(|&v| bf16::from_f32(v)).collect()
}

struct Up<'a> {
    gpu: &'a Gpu,
    stream: &'a Arc<CudaStream>,
    region: Option<&'a Region>,
    bytes: usize,
}

impl Up<'_> {
    fn t(&mut self, x: &[f32]) -> Result<DevBuf<bf16>> {
        self.bytes += x.len() * 2;
        upload_in(self.gpu, self.stream, &to_bf16(x), self.region)
    }
    fn lin(&mut self, w: &Weights, parts: &[Linear]) -> Result<GpuLinear> {
        if let Some(bad) = parts.iter().find(|l| l.inp != parts[0].inp) {
            return Err(super::GpuError::Input(format!(
                "fused linear parts have different input widths ({} vs {})",
                bad.inp, parts[0].inp
            )));
        }
        let (wt, b, out) = fuse_linears(w, parts);
        Ok(GpuLinear {
            w: self.t(&wt)?,
            b: match b {
                Some(b) => Some(self.t(&b)?),
                None => None,
            },
            out,
            inp: parts[0].inp,
        })
    }
    fn block(&mut self, w: &Weights, p: &BlockParams) -> Result<GpuBlock> {
        Ok(GpuBlock {
            norm1: self.t(w.get(p.norm1))?,
            norm2: self.t(w.get(p.norm2))?,
            qkv: self.lin(w, &p.fused(Lin::Qkv))?,
            o: self.lin(w, &p.fused(Lin::O))?,
            gate_up: self.lin(w, &p.fused(Lin::GateUp))?,
            down: self.lin(w, &p.fused(Lin::Down))?,
            ffn: p.gate.out,
        })
    }
}

impl GpuWeights {
    /// Converts to bf16 and uploads on `stream`, into `region` of the plan's arena (or the
    /// memory pool).
    pub fn upload(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        model: &Qwen25VL,
        region: Option<&Region>,
    ) -> Result<Self> {
        let w = &model.weights;
        let l = &w.layout;
        let mut up = Up {
            gpu,
            stream,
            region,
            bytes: 0,
        };
        let patch_embed = up.t(w.get(l.patch_embed))?;
        let vision = l
            .vision_blocks
            .iter()
            .map(|b| up.block(w, b))
            .collect::<Result<Vec<_>>>()?;
        let merger_ln = up.t(w.get(l.merger_ln))?;
        let merger_fc1 = up.lin(w, &[l.merger_fc1])?;
        let merger_fc2 = up.lin(w, &[l.merger_fc2])?;
        let embed = up.t(w.get(l.embed))?;
        let text = l
            .text_layers
            .iter()
            .map(|b| up.block(w, b))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = up.t(w.get(l.final_norm))?;
        let lm_head = if l.lm_head == l.embed {
            None
        } else {
            Some(up.t(w.get(l.lm_head))?)
        };
        Ok(GpuWeights {
            patch_embed,
            vision,
            merger_ln,
            merger_fc1,
            merger_fc2,
            embed,
            text,
            final_norm,
            lm_head,
            bytes: up.bytes,
        })
    }

    /// The lm head `[vocab, hidden]` (the embeddings when tied).
    pub fn lm_head(&self) -> &CudaSlice<bf16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
