// RMSNorm as Hugging Face's Qwen2RMSNorm computes it:
//   y = w * bf16( x * rsqrt(mean(x^2) + eps) )      (mean in fp32; the normalised value is
// rounded to bf16 before the weight multiplies it, as `weight * hidden.to(input_dtype)` does).
// One block per row. x and y have `x_stride` / `y_stride` elements between rows; y may alias x.
// rstd (optional, may be null) receives rsqrt(mean + eps) per row, for the backward pass.
extern "C" __global__ void rmsnorm_fwd_bf16(const bf16* x, const bf16* __restrict__ w,
                                            bf16* y, float* __restrict__ rstd, u32 rows,
                                            u32 cols, u32 x_stride, u32 y_stride, float eps) {
    pdl_wait();
    __shared__ float scratch[32];
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const bf16* xr = x + (u64)row * x_stride;
    bf16* yr = y + (u64)row * y_stride;
    const bool vec = ((cols & 7u) == 0) && ((((u64)xr) & 15u) == 0) && ((((u64)yr) & 15u) == 0) &&
                     ((((u64)w) & 15u) == 0);
    float ss = 0.0f;
    if (vec) {
        for (u32 i = threadIdx.x; i < cols / 8; i += blockDim.x) {
            float f[8];
            unpack8(((const uint4*)xr)[i], f);
#pragma unroll
            for (int k = 0; k < 8; k++) ss += f[k] * f[k];
        }
    } else {
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
            float f = bf2f(xr[i]);
            ss += f * f;
        }
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)cols + eps);
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    if (vec) {
        for (u32 i = threadIdx.x; i < cols / 8; i += blockDim.x) {
            float f[8], g[8];
            unpack8(((const uint4*)xr)[i], f);
            unpack8(((const uint4*)w)[i], g);
#pragma unroll
            for (int k = 0; k < 8; k++) f[k] = g[k] * bf2f(f2bf(f[k] * r));
            ((uint4*)yr)[i] = pack8(f);
        }
    } else {
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x)
            yr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(xr[i]) * r)));
    }
}

// Residual add fused with the next RMSNorm (one pass instead of two kernels):
//   h = bf16(h + delta);  y = rmsnorm(h) exactly as rmsnorm_fwd_bf16 computes it.
// Bitwise the same as add_fwd_bf16 then rmsnorm_fwd_bf16. Rows are contiguous (`cols` apart).
extern "C" __global__ void add_rmsnorm_fwd_bf16(bf16* h, const bf16* __restrict__ delta,
                                                const bf16* __restrict__ w, bf16* __restrict__ y,
                                                float* __restrict__ rstd, u32 rows, u32 cols,
                                                float eps) {
    pdl_wait();
    __shared__ float scratch[32];
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    bf16* hr = h + (u64)row * cols;
    const bf16* dr = delta + (u64)row * cols;
    bf16* yr = y + (u64)row * cols;
    const bool vec = ((cols & 7u) == 0) && ((((u64)h) & 15u) == 0) && ((((u64)delta) & 15u) == 0) &&
                     ((((u64)y) & 15u) == 0) && ((((u64)w) & 15u) == 0);
    float ss = 0.0f;
    if (vec) {
        for (u32 i = threadIdx.x; i < cols / 8; i += blockDim.x) {
            float a[8], b[8];
            unpack8(((const uint4*)hr)[i], a);
            unpack8(((const uint4*)dr)[i], b);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                a[k] = bf2f(f2bf(a[k] + b[k]));
                ss += a[k] * a[k];
            }
            ((uint4*)hr)[i] = pack8(a);
        }
    } else {
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
            const float a = bf2f(f2bf(bf2f(hr[i]) + bf2f(dr[i])));
            hr[i] = f2bf(a);
            ss += a * a;
        }
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)cols + eps);
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    // Each thread reads back only the elements it wrote above.
    if (vec) {
        for (u32 i = threadIdx.x; i < cols / 8; i += blockDim.x) {
            float f[8], g[8];
            unpack8(((const uint4*)hr)[i], f);
            unpack8(((const uint4*)w)[i], g);
#pragma unroll
            for (int k = 0; k < 8; k++) f[k] = g[k] * bf2f(f2bf(f[k] * r));
            ((uint4*)yr)[i] = pack8(f);
        }
    } else {
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x)
            yr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(hr[i]) * r)));
    }
}
