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

/// The row tables of a gather ([`gather_sum_rows_bf16`]) on the host: destination rows and
/// the source lists flattened (`idx[off[d]..off[d + 1]]` are destination `d`'s), every row
/// checked against the row counts of the buffers it will run on. A caller that must not wait
/// for its stream uploads the three tables through page-locked memory and launches
/// [`gather_sum_rows_dev`]; [`gather_sum_rows_bf16`] uploads them itself.
#[derive(Clone, Debug)]
pub struct RowGather {
    pub dst: Vec<u32>,
    pub off: Vec<u32>,
    pub idx: Vec<u32>,
    dst_n: usize,
    src_n: usize,
}

impl RowGather {
    /// Destination row `dst_rows[d]` of a `dst_n`-row buffer gets the sum of source rows
    /// `lists[d]` of a `src_n`-row buffer.
    pub fn new(dst_rows: &[u32], lists: &[Vec<u32>], dst_n: usize, src_n: usize) -> Result<Self> {
        const OP: &str = "gather_sum_rows_bf16";
        if dst_rows.len() != lists.len() {
            return Err(shape(OP, "one list per destination row"));
        }
        if dst_rows.iter().any(|&r| r as usize >= dst_n)
            || lists.iter().flatten().any(|&r| r as usize >= src_n)
        {
            return Err(shape(
                OP,
                format!("a row outside {dst_n} destination or {src_n} source rows"),
            ));
        }
        let mut off = vec![0u32];
        let mut idx = Vec::new();
        for l in lists {
            idx.extend_from_slice(l);
            off.push(idx.len() as u32);
        }
        Ok(RowGather {
            dst: dst_rows.to_vec(),
            off,
            idx,
            dst_n,
            src_n,
        })
    }

    /// The tables on the device (`dst`, `off`, `idx` holding [`RowGather::dst`],
    /// [`RowGather::off`] and [`RowGather::idx`]; an empty table may be any buffer).
    pub fn on_device<'a>(
        &self,
        dst: &'a dyn DevicePtr<u32>,
        off: &'a dyn DevicePtr<u32>,
        idx: &'a dyn DevicePtr<u32>,
    ) -> Result<RowGatherDev<'a>> {
        if dst.len() < self.dst.len() || off.len() < self.off.len() || idx.len() < self.idx.len() {
            return Err(shape(
                "gather_sum_rows_bf16",
                "a device table shorter than its host table",
            ));
        }
        Ok(RowGatherDev {
            rows: self.dst.len(),
            dst_n: self.dst_n,
            src_n: self.src_n,
            dst,
            off,
            idx,
        })
    }
}

/// A [`RowGather`]'s tables on the device.
pub struct RowGatherDev<'a> {
    rows: usize,
    dst_n: usize,
    src_n: usize,
    dst: &'a dyn DevicePtr<u32>,
    off: &'a dyn DevicePtr<u32>,
    idx: &'a dyn DevicePtr<u32>,
}

/// Row `dst_rows[d]` of `dst` (`[_, width]`) = the fp32 sum, in list order, of the rows
/// `lists[d]` of `src` (`[_, width]`), rounded once to bf16. Rows of `dst` not named are left as
/// they are; every named row must lie inside its buffer (checked on the host). The row tables go
/// to the device on `stream` from pageable memory (the host waits for the stream's earlier work;
/// see [`RowGather`] for the form that does not), freed stream-ordered after the kernel.
pub fn gather_sum_rows_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dst: &mut impl DevicePtrMut<bf16>,
    dst_rows: &[u32],
    src: &impl DevicePtr<bf16>,
    lists: &[Vec<u32>],
    width: usize,
) -> Result<()> {
    let w = width.max(1);
    let g = RowGather::new(dst_rows, lists, dst.len() / w, src.len() / w)?;
    if g.dst.is_empty() {
        return Ok(());
    }
    let (dr, offd, idxd) = (
        table(stream, &g.dst)?,
        table(stream, &g.off)?,
        table(stream, &g.idx)?,
    );
    gather_sum_rows_dev(
        gpu,
        stream,
        dst,
        src,
        &g.on_device(&dr, &offd, &idxd)?,
        width,
    )
    // the index buffers are freed at the end of this scope, stream-ordered after the kernel
}

/// [`gather_sum_rows_bf16`] with its tables already on the device: nothing waits.
pub fn gather_sum_rows_dev(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dst: &mut impl DevicePtrMut<bf16>,
    src: &impl DevicePtr<bf16>,
    g: &RowGatherDev<'_>,
    width: usize,
) -> Result<()> {
    const OP: &str = "gather_sum_rows_bf16";
    let w = width.max(1);
    if dst.len() / w < g.dst_n || src.len() / w < g.src_n {
        return Err(shape(
            OP,
            format!(
                "the gather's tables were checked against {} destination and {} source rows; \
                 the buffers hold {} and {}",
                g.dst_n,
                g.src_n,
                dst.len() / w,
                src.len() / w
            ),
        ));
    }
    if g.rows == 0 {
        return Ok(());
    }
    let dp = ptr_mut(dst, stream);
    let (rp, sp, op, ip) = (
        ptr(g.dst, stream),
        ptr(src, stream),
        ptr(g.off, stream),
        ptr(g.idx, stream),
    );
    let w = width as u32;
    // SAFETY: every named row lies inside dst and src (checked by RowGather::new against row
    // counts the buffers hold, checked above); off has one entry more than the grid's blocks;
    // arguments match (dst, dst_rows, src, off, idx, width).
    unsafe {
        launch(
            gpu,
            stream,
            &GRAD,
            &[],
            "gather_sum_rows_bf16",
            Grid::new((g.rows as u32, 1, 1), THREADS),
            &[&dp, &rp, &sp, &op, &ip, &w],
        )
    }?;
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
