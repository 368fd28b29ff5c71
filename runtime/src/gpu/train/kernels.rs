//! The trainer's own kernels: the grad-norm partial sums, the clip's scaling, the fixed-order
//! row sums of the token-0 and media-row gradients, and the fp32-into-bf16 add of the prefix
//! K/V gradients.

use std::sync::Arc;

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;
use rollplex_kernels::cuda::nvrtc::KernelModule;
use rollplex_kernels::cuda::{CudaSlice, CudaStream, Gpu};

use super::super::{upload, GpuError};
use super::Result;

/// Blocks of the grad-norm partial-sum kernel (fixed: the sum's order depends on nothing else).
/// 1024 blocks of 256 threads with four loads in flight each keep enough bytes in flight to
/// stream a gradient at near the copy rate: at 619M parameters on the H200 the optimizer step
/// went from 13.1 ms (128 blocks, one load in flight) to 6.5 ms, its AdamW alone being 5.2 ms
/// (docs/perf.md, "Training step speed").
pub(super) const NORM_BLOCKS: usize = 1024;

/// The small kernels of this module: the grad-norm partial sums (f64, fixed order: four
/// strided accumulators per thread, added in a fixed order, then a fixed tree over the block),
/// the clip's scaling (`g *= c`, one rounding, as the CPU's `*g *= coef`), the fixed-order sum
/// of the token-0 row gradients into a kept prompt's last row, and the add of the suffixes'
/// fp32 prefix K/V gradients into the prefix rows' own (bf16).
pub(super) const TRAIN_KERNELS: KernelModule = KernelModule {
    name: "gpu_train",
    source: r#"
extern "C" __global__ void sumsq_partial_f32(const float* __restrict__ g, u64 n,
                                             double* __restrict__ out) {
    __shared__ double s[256];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const double x0 = (double)g[i], x1 = (double)g[i + stride];
        const double x2 = (double)g[i + 2 * stride], x3 = (double)g[i + 3 * stride];
        a0 = __dadd_rn(a0, __dmul_rn(x0, x0));
        a1 = __dadd_rn(a1, __dmul_rn(x1, x1));
        a2 = __dadd_rn(a2, __dmul_rn(x2, x2));
        a3 = __dadd_rn(a3, __dmul_rn(x3, x3));
    }
    for (; i < n; i += stride) {
        const double x = (double)g[i];
        a0 = __dadd_rn(a0, __dmul_rn(x, x));
    }
    s[threadIdx.x] = __dadd_rn(__dadd_rn(a0, a1), __dadd_rn(a2, a3));
    __syncthreads();
    for (u32 w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] = __dadd_rn(s[threadIdx.x], s[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

extern "C" __global__ void scale_f32(float* __restrict__ g, u64 n, float c) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        g[i] = __fmul_rn(g[i], c);
    }
}

// dst row dst_rows[d] = the fp32 sum of src rows idx[off[d] .. off[d + 1]] in list order, rounded
// once to bf16. One block per destination row.
extern "C" __global__ void gather_sum_rows_bf16(bf16* __restrict__ dst,
                                                const u32* __restrict__ dst_rows,
                                                const bf16* __restrict__ src,
                                                const u32* __restrict__ off,
                                                const u32* __restrict__ idx, u32 width) {
    const u32 d = blockIdx.x, a = off[d], b = off[d + 1];
    for (u32 c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 i = a; i < b; i++) acc = __fadd_rn(acc, bf2f(src[(u64)idx[i] * width + c]));
        dst[(u64)dst_rows[d] * width + c] = f2bf(acc);
    }
}

// x = bf16(x + y), one rounding (a bf16 gradient plus an fp32 one).
extern "C" __global__ void add_f32_into_bf16(bf16* __restrict__ x, const float* __restrict__ y,
                                             u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        x[i] = f2bf(__fadd_rn(bf2f(x[i]), y[i]));
    }
}
"#,
};

/// `x = bf16(x + y)` over `n` elements (`add_f32_into_bf16`).
pub(super) fn add_f32_into_bf16(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &mut CudaSlice<bf16>,
    y: &CudaView<'_, f32>,
    n: usize,
) -> Result<()> {
    if x.len() < n || y.len() < n {
        return Err(GpuError::Input(format!(
            "add_f32_into_bf16: {n} elements but buffers of {} and {}",
            x.len(),
            y.len()
        ))
        .into());
    }
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&TRAIN_KERNELS, &[], "add_f32_into_bf16")?;
    let (xp, _x) = x.device_ptr_mut(s);
    let (yp, _y) = y.device_ptr(s);
    let n64 = n as u64;
    let mut b = s.launch_builder(&f);
    b.arg(&xp).arg(&yp).arg(&n64);
    // SAFETY: x and y hold at least n elements (checked); arguments match (x, y, n).
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}

/// Row `dst_rows[d]` of `dst` (`[_, width]`) = the fp32 sum, in list order, of the rows
/// `lists[d]` of `src` (`gather_sum_rows_bf16`). Rows of `dst` not named are left as they are.
pub(super) fn gather_sum_rows(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    dst: &mut CudaSlice<bf16>,
    dst_rows: &[u32],
    src: &CudaSlice<bf16>,
    lists: &[Vec<u32>],
    width: usize,
) -> Result<()> {
    if dst_rows.len() != lists.len() {
        return Err(GpuError::Input("gather_sum_rows: one list per destination row".into()).into());
    }
    let (dst_n, src_n) = (dst.len() / width.max(1), src.len() / width.max(1));
    if dst_rows.iter().any(|&r| r as usize >= dst_n)
        || lists.iter().flatten().any(|&r| r as usize >= src_n)
    {
        return Err(GpuError::Input(format!(
            "gather_sum_rows: a row outside {dst_n} destination or {src_n} source rows"
        ))
        .into());
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
    let (dr, offd, idxd) = (upload(s, dst_rows)?, upload(s, &off)?, upload(s, &idx)?);
    let f = gpu.function(&TRAIN_KERNELS, &[], "gather_sum_rows_bf16")?;
    let (dp, _d) = dst.device_ptr_mut(s);
    let (rp, _r) = dr.device_ptr(s);
    let (sp, _s) = src.device_ptr(s);
    let (op, _o) = offd.device_ptr(s);
    let (ip, _i) = idxd.device_ptr(s);
    let w = width as u32;
    let mut b = s.launch_builder(&f);
    b.arg(&dp).arg(&rp).arg(&sp).arg(&op).arg(&ip).arg(&w);
    // SAFETY: every named row lies inside dst and src (checked); off has one entry more than
    // the grid's blocks; arguments match (dst, dst_rows, src, off, idx, width).
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (dst_rows.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    // the index buffers are freed at the end of this scope, stream-ordered after the kernel
    Ok(())
}
