//! The training step's gradient kernels (kernel in `cuda/grad.cu`; CPU twins in
//! [`crate::cpu::grad`]):
//! - `sumsq_partial_f32`: the grad-norm's partial sums of squares, one f64 per block of a fixed
//!   grid of [`SUMSQ_BLOCKS`] (four strided accumulators per thread added in a fixed order, then
//!   a fixed tree over the block: the sum's order depends on nothing but the length);
//! - `scale_f32`: the clip's scaling `g *= c` (one rounding, as the CPU's `*g *= coef`);
//! - `gather_sum_rows_bf16`: rows of a bf16 matrix set to the fp32 sum of listed source rows,
//!   in list order, rounded once (the token-0 and media-row gradients of a kept prompt);
//! - `add_f32_into_bf16`: `x = bf16(x + y)`, one rounding (an fp32 gradient into a bf16 one).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::launch::{launch, need, ptr, ptr_mut, Grid};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};

/// The kernel source of this module (compiled by NVRTC on first use, cached).
pub const GRAD: KernelModule = KernelModule {
    name: "grad",
    source: include_str!("../../cuda/grad.cu"),
};

/// Blocks of the grad-norm partial-sum kernel (fixed: the sum's order depends on nothing else).
/// 1024 blocks of 256 threads with four loads in flight each keep enough bytes in flight to
/// stream a gradient at near the copy rate: at 619M parameters on the H200 the optimizer step
/// went from 13.1 ms (128 blocks, one load in flight) to 6.5 ms, its AdamW alone being 5.2 ms
/// (docs/perf.md, "Training step").
pub const SUMSQ_BLOCKS: usize = 1024;

/// Threads of every kernel's blocks (`sumsq_partial_f32`'s shared array is this long).
const THREADS: u32 = 256;

/// The partial sums of squares of `g[..n]` into `out[..SUMSQ_BLOCKS]` (f64): their sum, in any
/// order, is the squared L2 norm up to f64 rounding; the partials themselves are a function of
/// `g` and `n` alone.
pub fn sumsq_partial_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: &impl DevicePtr<f32>,
    n: usize,
    out: &mut impl DevicePtrMut<f64>,
) -> Result<()> {
    const OP: &str = "sumsq_partial_f32";
    need(OP, "g", g, n)?;
    need(OP, "out", out, SUMSQ_BLOCKS)?;
    let (gp, op) = (ptr(g, stream), ptr_mut(out, stream));
    let n = n as u64;
    // SAFETY: g holds n floats, out SUMSQ_BLOCKS doubles (checked); THREADS match the kernel's
    // shared array; arguments match (g, n, out).
    unsafe {
        launch(
            gpu,
            stream,
            &GRAD,
            &[],
            "sumsq_partial_f32",
            Grid::new((SUMSQ_BLOCKS as u32, 1, 1), THREADS),
            &[&gp, &n, &op],
        )
    }?;
    Ok(())
}

/// `g[..n] *= c`, one rounding per element.
pub fn scale_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: &mut impl DevicePtrMut<f32>,
    n: usize,
    c: f32,
) -> Result<()> {
    need("scale_f32", "g", g, n)?;
    let gp = ptr_mut(g, stream);
    let n64 = n as u64;
    // SAFETY: g holds n floats (checked); arguments match (g, n, c).
    unsafe {
        launch(
            gpu,
            stream,
            &GRAD,
            &[],
            "scale_f32",
            Grid::new((n.div_ceil(256).clamp(1, 4096) as u32, 1, 1), THREADS),
            &[&gp, &n64, &c],
        )
    }?;
    Ok(())
}

/// `x[..n] = bf16(x + y)`, one rounding per element (an fp32 gradient added into a bf16 one).
pub fn add_f32_into_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<bf16>,
    y: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    if x.len() < n || y.len() < n {
        return Err(shape(
            "add_f32_into_bf16",
            format!("{n} elements but buffers of {} and {}", x.len(), y.len()),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (xp, yp) = (ptr_mut(x, stream), ptr(y, stream));
    let n64 = n as u64;
    // SAFETY: x and y hold at least n elements (checked); arguments match (x, y, n).
    unsafe {
        launch(
            gpu,
            stream,
            &GRAD,
            &[],
            "add_f32_into_bf16",
            Grid::new((n.div_ceil(256).clamp(1, 4096) as u32, 1, 1), THREADS),
            &[&xp, &yp, &n64],
        )
    }?;
    Ok(())
}

/// Row `dst_rows[d]` of `dst` (`[_, width]`) = the fp32 sum, in list order, of the rows
/// `lists[d]` of `src` (`[_, width]`), rounded once to bf16. Rows of `dst` not named are left as
/// they are; every named row must lie inside its buffer (checked on the host). The row tables go
/// to the device on `stream` (freed, stream-ordered, after the kernel).
pub fn gather_sum_rows_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dst: &mut impl DevicePtrMut<bf16>,
    dst_rows: &[u32],
    src: &impl DevicePtr<bf16>,
    lists: &[Vec<u32>],
    width: usize,
) -> Result<()> {
    const OP: &str = "gather_sum_rows_bf16";
    if dst_rows.len() != lists.len() {
        return Err(shape(OP, "one list per destination row"));
    }
    let (dst_n, src_n) = (dst.len() / width.max(1), src.len() / width.max(1));
    if dst_rows.iter().any(|&r| r as usize >= dst_n)
        || lists.iter().flatten().any(|&r| r as usize >= src_n)
    {
        return Err(shape(
            OP,
            format!("a row outside {dst_n} destination or {src_n} source rows"),
        ));
    }
    if dst_rows.is_empty() {
        return Ok(());
    }
    let mut off = vec![0u32];
    let mut idx = Vec::new();
    for l in lists {
        idx.extend_from_slice(l);
        off.push(idx.len() as u32);
    }
    let (dr, offd, idxd) = (
        table(stream, dst_rows)?,
        table(stream, &off)?,
        table(stream, &idx)?,
    );
    let dp = ptr_mut(dst, stream);
    let (rp, sp, op, ip) = (
        ptr(&dr, stream),
        ptr(src, stream),
        ptr(&offd, stream),
        ptr(&idxd, stream),
    );
    let w = width as u32;
    // SAFETY: every named row lies inside dst and src (checked); off has one entry more than
    // the grid's blocks; arguments match (dst, dst_rows, src, off, idx, width).
    unsafe {
        launch(
            gpu,
            stream,
            &GRAD,
            &[],
            "gather_sum_rows_bf16",
            Grid::new((dst_rows.len() as u32, 1, 1), THREADS),
            &[&dp, &rp, &sp, &op, &ip, &w],
        )
    }?;
    // the index buffers are freed at the end of this scope, stream-ordered after the kernel
    Ok(())
}

/// A host table on the device; an empty one as one element, never read (the kernel's pointer
/// stays valid).
fn table<T: DeviceRepr>(stream: &Arc<CudaStream>, data: &[T]) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        // SAFETY: never read (an empty list sums nothing)
        return Ok(unsafe { stream.alloc::<T>(1) }?);
    }
    Ok(stream.clone_htod(data)?)
}
