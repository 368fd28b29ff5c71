//! `rmsnorm_fwd_bf16`: the CUDA twin of [`crate::cpu::rmsnorm_fwd`] (kernel in `cuda/norm.cu`).
//! It rounds the normalised value to bf16 before the weight multiplies it, as Hugging Face's
//! bf16 module does; the CPU twin (f32) does not, which the tolerance covers.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::NORM;
use super::{Gpu, Result};

/// `y[rows, d] = w[d] * bf16(x * rsqrt(mean(x^2) + eps))`; `rstd[rows]` (optional) receives
/// `rsqrt(mean + eps)`. `y` may be the same memory as `x` only through separate views of it.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    rstd: Option<&mut dyn DevicePtrMut<f32>>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rmsnorm_fwd_bf16";
    need(OP, "x", x, rows * d)?;
    need(OP, "y", y, rows * d)?;
    need(OP, "w", w, d)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let rstd_p = match rstd {
        Some(r) => {
            need(OP, "rstd", r, rows)?;
            ptr_mut(r, stream)
        }
        None => 0u64,
    };
    let (xp, wp, yp) = (ptr(x, stream), ptr(w, stream), ptr_mut(y, stream));
    let (rows32, d32) = (u32_of(OP, "rows", rows)?, u32_of(OP, "d", d)?);
    let threads = if d >= 4096 { 512 } else { 256 };
    let cfg = Grid {
        grid: (rows32, 1, 1),
        block: (threads, 1, 1),
        smem: 0,
    };
    // SAFETY: x and y hold rows*d elements, w holds d, rstd (when given) rows; the argument list
    // matches the kernel's (x, w, y, rstd, rows, cols, x_stride, y_stride, eps) signature.
    unsafe {
        launch(
            gpu,
            stream,
            &NORM,
            &[],
            "rmsnorm_fwd_bf16",
            cfg,
            &[&xp, &wp, &yp, &rstd_p, &rows32, &d32, &d32, &d32, &eps],
        )
    }?;
    Ok(())
}

/// Residual add fused with RMSNorm: `h = bf16(h + delta)`, then `y = rmsnorm(h)` as
/// [`rmsnorm_fwd_bf16`]; bitwise the same as `add_fwd_bf16` followed by it. `[rows, d]`
/// contiguous; `rstd[rows]` optional.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    rstd: Option<&mut dyn DevicePtrMut<f32>>,
    h: &mut impl DevicePtrMut<bf16>,
    delta: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "add_rmsnorm_fwd_bf16";
    need(OP, "h", h, rows * d)?;
    need(OP, "delta", delta, rows * d)?;
    need(OP, "y", y, rows * d)?;
    need(OP, "w", w, d)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let rstd_p = match rstd {
        Some(r) => {
            need(OP, "rstd", r, rows)?;
            ptr_mut(r, stream)
        }
        None => 0u64,
    };
    let (hp, dp, wp, yp) = (
        ptr_mut(h, stream),
        ptr(delta, stream),
        ptr(w, stream),
        ptr_mut(y, stream),
    );
    let (rows32, d32) = (u32_of(OP, "rows", rows)?, u32_of(OP, "d", d)?);
    let threads = if d >= 4096 { 512 } else { 256 };
    let cfg = Grid {
        grid: (rows32, 1, 1),
        block: (threads, 1, 1),
        smem: 0,
    };
    // SAFETY: h, delta, y hold rows*d elements, w d, rstd rows (checked); each element of h is
    // read and written by one thread; arguments match (h, delta, w, y, rstd, rows, cols, eps).
    unsafe {
        launch(
            gpu,
            stream,
            &NORM,
            &[],
            "add_rmsnorm_fwd_bf16",
            cfg,
            &[&hp, &dp, &wp, &yp, &rstd_p, &rows32, &d32, &eps],
        )
    }?;
    Ok(())
}
