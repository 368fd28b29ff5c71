//! The pre-norm block stack both towers share, on the device:
//! `x += o(attn(rope(qkv(n1 x))))`, then `x += down(swiglu(gate_up(n2 x)))`, with each residual
//! add fused into the next norm (`add_rmsnorm_fwd_bf16`, bitwise the add then the norm).
//! How a block's attention finds its keys (and where its k/v go) is an [`AttnStep`].
//!
//! Buffers: one set of activations `[rows, width]` per call, reused by every block; `x` holds
//! the residual stream and ends as the input of the tower's final norm.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu::AttnDims;
use rollplex_kernels::cuda::{
    add_fwd_bf16_inplace, add_rmsnorm_fwd_bf16, linear_fwd_bf16, rmsnorm_fwd_bf16, swiglu_fwd_bf16,
    CudaSlice, CudaStream, Gpu,
};

use super::arena::DevBuf;
use super::weights::{GpuBlock, GpuLinear};
use super::{alloc, Result};

/// A block's attention: reads the fused `qkv [rows, (h + 2 kvh) hd]` (rotating q and k in
/// place as it needs), writes `out [rows, h hd]`.
pub(crate) trait AttnStep {
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()>;
}

/// `y[rows, l.out] = x l.w^T + l.b`.
pub(crate) fn linear(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    l: &GpuLinear,
    rows: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let b =
        l.b.as_ref()
            .map(|b| b as &dyn cudarc::driver::DevicePtr<bf16>);
    linear_fwd_bf16(gpu, stream, y, x, &l.w, b, rows, l.inp, l.out)?;
    Ok(())
}

/// Runs `blocks` over `x [rows, hidden]` in place; `x` ends as the final norm's input.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_blocks(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    blocks: &[GpuBlock],
    x: &mut CudaSlice<bf16>,
    rows: usize,
    hidden: usize,
    dims: AttnDims,
    eps: f32,
    attn: &mut dyn AttnStep,
) -> Result<()> {
    run_blocks_keeping(gpu, stream, blocks, x, rows, hidden, dims, eps, attn, None)
}

/// [`run_blocks`], also copying each block's input (the residual stream entering it, `[rows,
/// hidden]`) into `keep[block]` when given (one buffer per block, each at least `rows *
/// hidden`): what a training backward recomputes the block from. The same launches as without.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_blocks_keeping(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    blocks: &[GpuBlock],
    x: &mut CudaSlice<bf16>,
    rows: usize,
    hidden: usize,
    dims: AttnDims,
    eps: f32,
    attn: &mut dyn AttnStep,
    mut keep: Option<&mut [DevBuf<bf16>]>,
) -> Result<()> {
    if let Some(k) = keep.as_deref() {
        if k.len() != blocks.len() || k.iter().any(|b| b.len() < rows * hidden) {
            return Err(super::GpuError::Input(format!(
                "kept block inputs: {} buffers for {} blocks, each needs {} values",
                k.len(),
                blocks.len(),
                rows * hidden
            )));
        }
    }
    if rows == 0 || blocks.is_empty() {
        return Ok(());
    }
    let qkv_w = blocks[0].qkv.out;
    let ffn = blocks[0].ffn;
    let mut xn = alloc::<bf16>(gpu, stream, rows * hidden)?;
    let mut qkv = alloc::<bf16>(gpu, stream, rows * qkv_w)?;
    let mut att = alloc::<bf16>(gpu, stream, rows * dims.q_width())?;
    let mut delta = alloc::<bf16>(gpu, stream, rows * hidden)?;
    let mut gu = alloc::<bf16>(gpu, stream, rows * 2 * ffn)?;
    let mut act = alloc::<bf16>(gpu, stream, rows * ffn)?;
    for (l, b) in blocks.iter().enumerate() {
        if l == 0 {
            rmsnorm_fwd_bf16(gpu, stream, &mut xn, None, x, &b.norm1, rows, hidden, eps)?;
        } else {
            // the previous block's MLP output joins the residual, then this block's norm
            add_rmsnorm_fwd_bf16(
                gpu, stream, &mut xn, None, x, &delta, &b.norm1, rows, hidden, eps,
            )?;
        }
        if let Some(k) = keep.as_deref_mut() {
            // x now holds this block's input
            stream.memcpy_dtod(&x.slice(..rows * hidden), &mut k[l])?;
        }
        linear(gpu, stream, &mut qkv, &xn, &b.qkv, rows)?;
        attn.attend(gpu, stream, l, &mut qkv, &mut att)?;
        linear(gpu, stream, &mut delta, &att, &b.o, rows)?;
        add_rmsnorm_fwd_bf16(
            gpu, stream, &mut xn, None, x, &delta, &b.norm2, rows, hidden, eps,
        )?;
        linear(gpu, stream, &mut gu, &xn, &b.gate_up, rows)?;
        let up = gu.slice(ffn..);
        swiglu_fwd_bf16(
            gpu,
            stream,
            &mut act,
            &gu,
            &up,
            rows,
            ffn,
            ffn,
            2 * ffn,
            2 * ffn,
        )?;
        linear(gpu, stream, &mut delta, &act, &b.down, rows)?;
    }
    add_fwd_bf16_inplace(gpu, stream, x, &delta, rows * hidden)?;
    Ok(())
}
