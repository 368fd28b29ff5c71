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
    add_fwd_bf16_inplace, add_rmsnorm_fwd_bf16, gate_up_swiglu_bf16, linear_fwd_bf16,
    rmsnorm_fwd_bf16, swiglu_gate_up_fwd_bf16, CudaSlice, CudaStream, Gpu,
};

use super::arena::DevBuf;
use super::weights::{GpuBlock, GpuLinear};
use super::{alloc, Result};

/// A block's attention: reads the fused `qkv [rows, (h + 2 kvh) hd]` (rotating q and k in
/// place as it needs), writes `out [rows, h hd]`. It also makes that `qkv` from the block's
/// normed input (`project`: the plain GEMM unless the step fuses more into it).
pub(crate) trait AttnStep {
    /// Block `layer`'s q|k|v projection `qkv = xn l.w^T + l.b` of `rows` rows.
    #[allow(clippy::too_many_arguments)]
    fn project(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        xn: &CudaSlice<bf16>,
        l: &GpuLinear,
        rows: usize,
    ) -> Result<()> {
        let _ = layer;
        linear(gpu, stream, qkv, xn, l, rows)
    }

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
    linear_fwd_bf16(gpu, stream, y, x, &l.w, l.bias(), rows, l.inp, l.out)?;
    Ok(())
}

/// The activations a block stack's pass works in, for up to `rows` rows: normed input, fused
/// qkv, attention output, the residual delta, fused gate|up and the SwiGLU output. Allocated
/// once by a caller that runs many passes of one shape (the decode loop: no allocation inside
/// a step, so a step can be replayed as a CUDA graph).
pub(crate) struct BlockBufs {
    rows: usize,
    xn: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    att: CudaSlice<bf16>,
    delta: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
}

impl BlockBufs {
    /// Buffers for `rows` rows of `blocks` (none when `blocks` is empty).
    pub(crate) fn new(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        blocks: &[GpuBlock],
        rows: usize,
        hidden: usize,
        dims: AttnDims,
    ) -> Result<Self> {
        let (qkv_w, ffn) = blocks.first().map_or((0, 0), |b| (b.qkv.out, b.ffn));
        Ok(BlockBufs {
            rows,
            xn: alloc::<bf16>(gpu, stream, rows * hidden)?,
            qkv: alloc::<bf16>(gpu, stream, rows * qkv_w)?,
            att: alloc::<bf16>(gpu, stream, rows * dims.q_width())?,
            delta: alloc::<bf16>(gpu, stream, rows * hidden)?,
            gu: alloc::<bf16>(gpu, stream, rows * 2 * ffn)?,
            act: alloc::<bf16>(gpu, stream, rows * ffn)?,
        })
    }
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
    run_blocks_keeping(
        gpu, stream, blocks, x, rows, hidden, dims, eps, attn, None, None,
    )
}

/// [`run_blocks`], also copying each block's input (the residual stream entering it, `[rows,
/// hidden]`) into `keep[block]` when given (one buffer per block, each at least `rows *
/// hidden`): what a training backward recomputes the block from. The same launches as without.
/// Works in `bufs` when given (at least `rows` rows), else in buffers of its own.
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
    bufs: Option<&mut BlockBufs>,
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
    let ffn = blocks[0].ffn;
    let mut own = None;
    let b = match bufs {
        Some(b) if b.rows >= rows => b,
        Some(b) => {
            return Err(super::GpuError::Input(format!(
                "block buffers for {} rows, {rows} asked",
                b.rows
            )))
        }
        None => own.insert(BlockBufs::new(gpu, stream, blocks, rows, hidden, dims)?),
    };
    let BlockBufs {
        xn,
        qkv,
        att,
        delta,
        gu,
        act,
        ..
    } = b;
    for (l, blk) in blocks.iter().enumerate() {
        if l == 0 {
            rmsnorm_fwd_bf16(gpu, stream, xn, None, x, &blk.norm1, rows, hidden, eps)?;
        } else {
            // the previous block's MLP output joins the residual, then this block's norm
            add_rmsnorm_fwd_bf16(
                gpu, stream, xn, None, x, delta, &blk.norm1, rows, hidden, eps,
            )?;
        }
        if let Some(k) = keep.as_deref_mut() {
            // x now holds this block's input
            stream.memcpy_dtod(&x.slice(..rows * hidden), &mut k[l])?;
        }
        attn.project(gpu, stream, l, qkv, xn, &blk.qkv, rows)?;
        attn.attend(gpu, stream, l, qkv, att)?;
        linear(gpu, stream, delta, att, &blk.o, rows)?;
        add_rmsnorm_fwd_bf16(
            gpu, stream, xn, None, x, delta, &blk.norm2, rows, hidden, eps,
        )?;
        if blk.gate_up.b.is_none() {
            // one launch where the skinny kernel takes it (SwiGLU in its epilogue), else the
            // GEMM into `gu` and SwiGLU: the same roundings either way
            let (w, k) = (&blk.gate_up.w, blk.gate_up.inp);
            gate_up_swiglu_bf16(gpu, stream, act, gu, xn, w, rows, k, ffn)?;
        } else {
            linear(gpu, stream, gu, xn, &blk.gate_up, rows)?;
            swiglu_gate_up_fwd_bf16(gpu, stream, act, gu, rows, ffn)?;
        }
        linear(gpu, stream, delta, act, &blk.down, rows)?;
    }
    add_fwd_bf16_inplace(gpu, stream, x, delta, rows * hidden)?;
    Ok(())
}
