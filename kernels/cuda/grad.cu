// The training step's gradient kernels (launchers in src/cuda/grad.rs): the grad-norm partial
// sums (f64, fixed order: four strided accumulators per thread, added in a fixed order, then a
// fixed tree over the block), the clip's scaling (`g *= c`, one rounding), the fixed-order sum
// of bf16 rows into a row (fp32, one rounding), and the add of an fp32 gradient into a bf16
// one.
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
