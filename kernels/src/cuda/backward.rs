//! Backward launchers (kernels in `cuda/backward.cu`): the CUDA twins of the elementwise, norm,
//! embedding and log-prob ops of [`crate::cpu::backward`]. Attention backward is in
//! [`super::attention_bwd`]; GEMM backward is [`super::matmul_bf16`] with transposes.
//!
//! Dtypes: activations and activation gradients are bf16 (what the forward launchers keep and
//! what the GEMMs read), every kernel computes in fp32 and rounds once on the way out. Parameter
//! gradients (`dw`, `dtable`) are fp32 and always *added* (`+=`), as on the CPU: one parameter
//! gathers gradient from several uses and micro-batches. A GEMM's `dW` is summed into its fp32
//! gradient by the GEMM itself ([`super::matmul_bf16_f32`]).
//!
//! Invariant: deterministic. No float atomics; every sum runs in an order fixed by the shapes
//! (block and warp reductions of a fixed shape, column sums in row order), so two runs, on any
//! stream or SM partition, give the same bits. [`embedding_bwd_f32`] adds tokens in ascending
//! order per table element, the CPU twin's order: with the same (bf16-valued) inputs it is
//! bitwise [`crate::cpu::embedding_bwd`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{grid_for, launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};

/// The kernel source of this module (compiled by NVRTC on first use, cached).
pub const BACKWARD: KernelModule = KernelModule {
    name: "backward",
    source: include_str!("../../cuda/backward.cu"),
};

fn cfg(grid: (u32, u32), block: (u32, u32)) -> Grid {
    Grid {
        grid: (grid.0, grid.1, 1),
        block: (block.0, block.1, 1),
        smem: 0,
    }
}

/// Rows of `width` elements `stride` apart must fit `len` elements (`rows > 0`).
fn need_rows<T>(
    op: &'static str,
    name: &str,
    x: &(impl cudarc::driver::DeviceSlice<T> + ?Sized),
    rows: usize,
    width: usize,
    stride: usize,
) -> Result<()> {
    if stride < width {
        return Err(shape(
            op,
            format!("{name} row stride {stride} is smaller than the row width {width}"),
        ));
    }
    need(op, name, x, (rows - 1) * stride + width)
}

/// Backward of [`super::rmsnorm_fwd_bf16`] (`y = w * x̂`, `x̂ = x r`, `r = rstd[row]` from the
/// forward): `dx [rows, d] = r (g - x̂ mean(g x̂))` with `g = dy w` (bf16, written; with
/// `accumulate_dx`, `dx = bf16(dx + that)`, the residual stream's gradient); `dw [d] += Σ_rows dy
/// x̂` in fp32 when given. Contiguous rows, as the CPU twin [`crate::cpu::rmsnorm_bwd`].
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dx: &mut impl DevicePtrMut<bf16>,
    dw: Option<&mut dyn DevicePtrMut<f32>>,
    dy: &impl DevicePtr<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    rstd: &impl DevicePtr<f32>,
    rows: usize,
    d: usize,
    accumulate_dx: bool,
) -> Result<()> {
    const OP: &str = "rmsnorm_bwd_bf16";
    need(OP, "dx", dx, rows * d)?;
    need(OP, "dy", dy, rows * d)?;
    need(OP, "x", x, rows * d)?;
    need(OP, "w", w, d)?;
    need(OP, "rstd", rstd, rows)?;
    let dw_p = match dw {
        Some(g) => {
            need(OP, "dw", g, d)?;
            Some(ptr_mut(g, stream))
        }
        None => None,
    };
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let (rows32, d32) = (u32_of(OP, "rows", rows)?, u32_of(OP, "d", d)?);
    let (dxp, dyp, xp, wp, rp) = (
        ptr_mut(dx, stream),
        ptr(dy, stream),
        ptr(x, stream),
        ptr(w, stream),
        ptr(rstd, stream),
    );
    let acc = accumulate_dx as u32;
    // rows a block, one warp each (DX_ROWS in backward.cu)
    const DX_ROWS: u32 = 8;
    // SAFETY: dx, dy, x hold rows*d elements, w d, rstd rows (checked); arguments match (dx, dy,
    // x, w, rstd, rows, cols, accumulate); each dx element is touched by one thread.
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "rmsnorm_bwd_dx_bf16",
            cfg((rows32.div_ceil(DX_ROWS), 1), (32 * DX_ROWS, 1)),
            &[&dxp, &dyp, &xp, &wp, &rp, &rows32, &d32, &acc],
        )
    }?;
    if let Some(dwp) = dw_p {
        // SAFETY: dw holds d elements, dy and x rows*d, rstd rows (checked); column j of dw is
        // written by one thread only; arguments match (dw, dy, x, rstd, rows, cols). Blocks of
        // 16 columns x 16 row lanes (DW_COLS in backward.cu).
        unsafe {
            launch(
                gpu,
                stream,
                &BACKWARD,
                &[],
                "rmsnorm_bwd_dw_f32",
                cfg((d32.div_ceil(16), 1), (16, 16)),
                &[&dwp, &dyp, &xp, &rp, &rows32, &d32],
            )
        }?;
    }
    Ok(())
}

/// Backward of [`super::rope_fwd_bf16`] in place (the transposed rotation): `dx` holds the
/// gradient of the rotated heads on entry and that of the unrotated ones on exit, on heads
/// `0..heads` of rows `row_stride` apart (a fused dqkv row in one call); tables as the forward.
/// Computed in fp32 (the CPU twin [`crate::cpu::rope_bwd`]'s formula), one rounding.
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dx: &mut impl DevicePtrMut<bf16>,
    cos: &impl DevicePtr<f32>,
    sin: &impl DevicePtr<f32>,
    tokens: usize,
    row_stride: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "rope_bwd_bf16";
    if !head_dim.is_multiple_of(2) || heads * head_dim > row_stride {
        return Err(shape(
            OP,
            format!(
                "head_dim {head_dim} must be even and {heads} heads fit in a row of {row_stride}"
            ),
        ));
    }
    if tokens == 0 || heads == 0 || head_dim == 0 {
        return Ok(());
    }
    need_rows(OP, "dx", dx, tokens, heads * head_dim, row_stride)?;
    need(OP, "cos", cos, tokens * head_dim)?;
    need(OP, "sin", sin, tokens * head_dim)?;
    let (xp, cp, sp) = (ptr_mut(dx, stream), ptr(cos, stream), ptr(sin, stream));
    let (t, rs, h, hd) = (
        u32_of(OP, "tokens", tokens)?,
        u32_of(OP, "row_stride", row_stride)?,
        u32_of(OP, "heads", heads)?,
        u32_of(OP, "head_dim", head_dim)?,
    );
    // SAFETY: dx covers every rotated element of every row, cos/sin hold tokens*head_dim
    // (checked); each element pair is touched by one thread; arguments match (dx, cos, sin,
    // tokens, row_stride, n_heads, head_dim).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "rope_bwd_bf16",
            cfg((t, 1), (128, 1)),
            &[&xp, &cp, &sp, &t, &rs, &h, &hd],
        )
    }?;
    Ok(())
}

/// Row strides of the five buffers of [`swiglu_bwd_bf16`] (elements between rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwigluBwdStrides {
    pub dgate: usize,
    pub dup: usize,
    pub dout: usize,
    pub gate: usize,
    pub up: usize,
}

impl SwigluBwdStrides {
    /// Every buffer `[rows, cols]` contiguous.
    pub fn contiguous(cols: usize) -> Self {
        SwigluBwdStrides {
            dgate: cols,
            dup: cols,
            dout: cols,
            gate: cols,
            up: cols,
        }
    }
    /// Gate and up read in place from a fused gate|up `[rows, 2 cols]` output (views starting
    /// at 0 and `cols`), the gradients and `dout` contiguous. (To write dgate|dup into one fused
    /// buffer, use [`swiglu_bwd_fused_bf16`].)
    pub fn fused_inputs(cols: usize) -> Self {
        SwigluBwdStrides {
            dgate: cols,
            dup: cols,
            dout: cols,
            gate: 2 * cols,
            up: 2 * cols,
        }
    }
}

/// Backward of [`super::swiglu_fwd_bf16`] (`out = silu(gate) up`): `dgate = dout up σ (1 + g
/// (1 - σ))`, `dup = dout silu(gate)` over `rows x cols`, in fp32 as [`crate::cpu::swiglu_bwd`].
/// For gradients written into one fused `[rows, 2 cols]` buffer see [`swiglu_bwd_fused_bf16`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dgate: &mut impl DevicePtrMut<bf16>,
    dup: &mut impl DevicePtrMut<bf16>,
    dout: &impl DevicePtr<bf16>,
    gate: &impl DevicePtr<bf16>,
    up: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    strides: SwigluBwdStrides,
) -> Result<()> {
    const OP: &str = "swiglu_bwd_bf16";
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    need_rows(OP, "dgate", dgate, rows, cols, strides.dgate)?;
    need_rows(OP, "dup", dup, rows, cols, strides.dup)?;
    need_rows(OP, "dout", dout, rows, cols, strides.dout)?;
    need_rows(OP, "gate", gate, rows, cols, strides.gate)?;
    need_rows(OP, "up", up, rows, cols, strides.up)?;
    let (dgp, dup_, dop, gp, upp) = (
        ptr_mut(dgate, stream),
        ptr_mut(dup, stream),
        ptr(dout, stream),
        ptr(gate, stream),
        ptr(up, stream),
    );
    let r = u32_of(OP, "rows", rows)?;
    let c = u32_of(OP, "cols", cols)?;
    let s: Vec<u32> = [
        strides.dgate,
        strides.dup,
        strides.dout,
        strides.gate,
        strides.up,
    ]
    .iter()
    .map(|&v| u32_of(OP, "stride", v))
    .collect::<Result<_>>()?;
    // SAFETY: every buffer covers rows-1 strides plus one row of cols (checked); each output
    // element is written by one thread; arguments match (dgate, dup, dout, gate, up, rows, cols,
    // dgate_stride, dup_stride, dout_stride, gate_stride, up_stride).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "swiglu_bwd_bf16",
            cfg((grid_for(cols / 8 + 1, 256, 64), r), (256, 1)),
            &[
                &dgp, &dup_, &dop, &gp, &upp, &r, &c, &s[0], &s[1], &s[2], &s[3], &s[4],
            ],
        )
    }?;
    Ok(())
}

/// [`swiglu_bwd_bf16`] on the fused layout of [`super::gemm::gate_up_swiglu_bf16`]: `gate_up`
/// `[rows, 2 cols]` (gate in columns `0..cols`, up in `cols..2 cols`) is read in place and
/// `dgate_up` `[rows, 2 cols]` receives dgate and dup in the same columns (the input gradient of
/// the fused gate|up GEMM); `dout` `[rows, cols]` contiguous. Bitwise the same as the unfused
/// call on the two halves.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_bwd_fused_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dgate_up: &mut impl DevicePtrMut<bf16>,
    dout: &impl DevicePtr<bf16>,
    gate_up: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_bwd_fused_bf16";
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    need(OP, "dgate_up", dgate_up, rows * 2 * cols)?;
    need(OP, "gate_up", gate_up, rows * 2 * cols)?;
    need(OP, "dout", dout, rows * cols)?;
    let half = (cols * std::mem::size_of::<bf16>()) as u64;
    let (dgp, dop, gp) = (
        ptr_mut(dgate_up, stream),
        ptr(dout, stream),
        ptr(gate_up, stream),
    );
    let (dup_, upp) = (dgp + half, gp + half);
    let r = u32_of(OP, "rows", rows)?;
    let c = u32_of(OP, "cols", cols)?;
    let c2 = u32_of(OP, "2 cols", 2 * cols)?;
    // SAFETY: dgate_up and gate_up hold rows*2*cols elements, dout rows*cols (checked); the
    // dgate half (columns 0..cols) and the dup half (cols..2 cols) of a row are disjoint, each
    // element written by one thread; arguments match (dgate, dup, dout, gate, up, rows, cols,
    // dgate_stride, dup_stride, dout_stride, gate_stride, up_stride).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "swiglu_bwd_bf16",
            cfg((grid_for(cols / 8 + 1, 256, 64), r), (256, 1)),
            &[&dgp, &dup_, &dop, &gp, &upp, &r, &c, &c2, &c2, &c, &c2, &c2],
        )
    }?;
    Ok(())
}

/// Backward of [`super::gelu_fwd_bf16`] over `n` elements: `dx = bf16(dy gelu'(x))` in fp32,
/// exact erf form (the merger's `nn.GELU()`, CPU twin [`crate::cpu::gelu_bwd`]) or, with
/// `tanh_approx`, the tanh approximation's derivative ([`crate::cpu::gelu_tanh_bwd`]). `x` is
/// the forward's input. `dx` may not alias `dy` or `x`.
pub fn gelu_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dx: &mut impl DevicePtrMut<bf16>,
    dy: &impl DevicePtr<bf16>,
    x: &impl DevicePtr<bf16>,
    n: usize,
    tanh_approx: bool,
) -> Result<()> {
    const OP: &str = "gelu_bwd_bf16";
    need(OP, "dx", dx, n)?;
    need(OP, "dy", dy, n)?;
    need(OP, "x", x, n)?;
    if n == 0 {
        return Ok(());
    }
    let (dxp, dyp, xp) = (ptr_mut(dx, stream), ptr(dy, stream), ptr(x, stream));
    let (n64, t) = (n as u64, tanh_approx as u32);
    // SAFETY: dx, dy and x hold n elements (checked); element i is read and written by one
    // thread; arguments match (dx, dy, x, n, tanh_approx).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "gelu_bwd_bf16",
            cfg((grid_for(n, 256, 4096), 1), (256, 1)),
            &[&dxp, &dyp, &xp, &n64, &t],
        )
    }?;
    Ok(())
}

/// Vocabulary slices of [`embedding_bwd_f32`]: table rows `id` with `id % SLICES == s` belong to
/// grid row `s` (more parallelism than one thread per column, the same order per element).
const EMBED_SLICES: usize = 64;

/// Backward of [`super::embedding_fwd_bf16`]: `dtable[ids[t], :] += dout[t, :]` (fp32 table
/// `[vocab, d]`, `dout` rows `dout_stride` apart), tokens in ascending order for every element,
/// with no atomics. Ids >= `vocab` are skipped by the kernel (the device cannot report them
/// without a sync; [`crate::cpu::embedding_bwd`] returns an error instead).
#[allow(clippy::too_many_arguments)]
pub fn embedding_bwd_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dtable: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<bf16>,
    ids: &impl DevicePtr<u32>,
    tokens: usize,
    d: usize,
    vocab: usize,
    dout_stride: usize,
) -> Result<()> {
    const OP: &str = "embedding_bwd_f32";
    need(OP, "dtable", dtable, vocab * d)?;
    if tokens == 0 || d == 0 || vocab == 0 {
        return Ok(());
    }
    need(OP, "ids", ids, tokens)?;
    need_rows(OP, "dout", dout, tokens, d, dout_stride)?;
    let (tp, op_, ip) = (ptr_mut(dtable, stream), ptr(dout, stream), ptr(ids, stream));
    let (t, h, v, s) = (
        u32_of(OP, "tokens", tokens)?,
        u32_of(OP, "d", d)?,
        u32_of(OP, "vocab", vocab)?,
        u32_of(OP, "dout_stride", dout_stride)?,
    );
    let slices = EMBED_SLICES.min(vocab) as u32;
    // SAFETY: dtable holds vocab*d, ids tokens, dout covers tokens rows (checked); the kernel
    // skips ids >= vocab; element (id, j) is owned by one thread (column j, slice id % slices);
    // arguments match (dtable, dout, ids, tokens, hidden, vocab, dout_stride).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "embedding_bwd_f32",
            cfg((h.div_ceil(128), slices), (128, 1)),
            &[&tp, &op_, &ip, &t, &h, &v, &s],
        )
    }?;
    Ok(())
}

/// Backward of [`super::logprobs_fwd_bf16`] through the temperature-scaled log-softmax:
/// `dlogits [rows, vocab]` (bf16, rows `out_stride` apart, written) from `dlogp [rows]` and,
/// when given, `dentropy [rows]` (fp32): with `z = logits / T`, `p = softmax(z)`,
/// `dz_j = dlogp (1[j = target] - p_j) - dentropy p_j (z_j - Σ p z)`, `dlogits = dz / T`. The
/// row's max, log-sum-exp and `Σ p z` are recomputed in fp32 ([`crate::cpu::logprobs_bwd`] uses
/// f64). A target >= vocab gives a NaN row (the CPU twin returns an error).
#[allow(clippy::too_many_arguments)]
pub fn logprobs_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dlogits: &mut impl DevicePtrMut<bf16>,
    dlogp: &impl DevicePtr<f32>,
    dentropy: Option<&dyn DevicePtr<f32>>,
    logits: &impl DevicePtr<bf16>,
    targets: &impl DevicePtr<u32>,
    rows: usize,
    vocab: usize,
    row_stride: usize,
    out_stride: usize,
    temperature: f32,
) -> Result<()> {
    const OP: &str = "logprobs_bwd_bf16";
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(shape(
            OP,
            format!("temperature must be positive and finite, got {temperature}"),
        ));
    }
    if vocab == 0 {
        return Err(shape(OP, "vocab must be positive"));
    }
    if rows == 0 {
        return Ok(());
    }
    need_rows(OP, "logits", logits, rows, vocab, row_stride)?;
    need_rows(OP, "dlogits", dlogits, rows, vocab, out_stride)?;
    need(OP, "dlogp", dlogp, rows)?;
    need(OP, "targets", targets, rows)?;
    let dep = match dentropy {
        Some(d) => {
            need(OP, "dentropy", d, rows)?;
            ptr(d, stream)
        }
        None => 0u64,
    };
    let (dlp, gp, xp, tp) = (
        ptr_mut(dlogits, stream),
        ptr(dlogp, stream),
        ptr(logits, stream),
        ptr(targets, stream),
    );
    let (r, v, rs, os) = (
        u32_of(OP, "rows", rows)?,
        u32_of(OP, "vocab", vocab)?,
        u32_of(OP, "row_stride", row_stride)?,
        u32_of(OP, "out_stride", out_stride)?,
    );
    // SAFETY: logits and dlogits cover rows rows of vocab (checked), dlogp/targets/dentropy hold
    // rows; each dlogits element is written by one thread; arguments match (dlogits, dlogp,
    // dentropy, logits, targets, rows, vocab, row_stride, out_stride, temperature).
    unsafe {
        launch(
            gpu,
            stream,
            &BACKWARD,
            &[],
            "logprobs_bwd_bf16",
            cfg((r, 1), (512, 1)),
            &[&dlp, &gp, &dep, &xp, &tp, &r, &v, &rs, &os, &temperature],
        )
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::attention_bwd::ATTENTION_BWD;
    use super::super::nvrtc::{compile_uncached, nvrtc_or_skip, options, COMMON};
    use super::*;

    /// Both backward sources compile for sm_90 where libnvrtc loads (no GPU needed); prints the
    /// ptxas report (registers, spills).
    #[test]
    fn backward_modules_compile_for_sm90() {
        if !nvrtc_or_skip() {
            return;
        }
        for m in [BACKWARD, ATTENTION_BWD] {
            let source = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", m.name, m.source);
            let (cubin, log) =
                compile_uncached(m.name, &source, &options("sm_90", &[])).expect("compiles");
            assert!(!cubin.is_empty());
            println!("== {} ({} bytes)\n{log}", m.name, cubin.len());
        }
    }
}
