// Backward kernels of the elementwise, norm, embedding and log-prob ops: the CUDA twins of
// kernels/src/cpu/backward.rs. Activations and activation gradients are bf16 (read and written
// once, math in fp32); parameter gradients are fp32 and always added (+=). Every reduction runs
// in an order fixed by the shapes alone (no float atomics), so two runs give the same bits.

// RMSNorm backward, dx part. One warp per row (DX_ROWS rows a block); with xh = x * r,
// g = dy * w:
//   dx = r * (g - xh * mean(g * xh))    (written, or added to dx when accumulate != 0)
// Lane l takes the 8-element chunks l, l + 32, ... (16-byte loads where the row allows, else
// elements l, l + 32, ...), in that order, and the row's sum runs in the fixed warp_sum order.
// The second pass reads the row again (from L1: the warp has just read it).
#define DX_ROWS 8
extern "C" __global__ void __launch_bounds__(32 * DX_ROWS)
rmsnorm_bwd_dx_bf16(bf16* dx, const bf16* __restrict__ dy, const bf16* __restrict__ x,
                    const bf16* __restrict__ w, const float* __restrict__ rstd, u32 rows,
                    u32 cols, u32 accumulate) {
    const u32 row = blockIdx.x * DX_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const u64 o = (u64)row * cols;
    const float r = rstd[row];
    const bf16 *xr = x + o, *dyr = dy + o;
    bf16* dxr = dx + o;
    const bool vec = (cols & 7u) == 0 &&
                     ((((u64)xr) | ((u64)dyr) | ((u64)dxr) | ((u64)w)) & 15u) == 0;
    float c = 0.0f;
    if (vec) {
        for (u32 i = lane; i < cols / 8; i += 32) {
            float a[8], b[8], g[8];
            unpack8(((const uint4*)dyr)[i], a);
            unpack8(((const uint4*)w)[i], g);
            unpack8(((const uint4*)xr)[i], b);
#pragma unroll
            for (int k = 0; k < 8; k++) c += (a[k] * g[k]) * (b[k] * r);
        }
    } else {
        for (u32 i = lane; i < cols; i += 32) c += (bf2f(dyr[i]) * bf2f(w[i])) * (bf2f(xr[i]) * r);
    }
    c = warp_sum(c) / (float)cols;
    if (vec) {
        for (u32 i = lane; i < cols / 8; i += 32) {
            float a[8], b[8], g[8], d[8];
            unpack8(((const uint4*)dyr)[i], a);
            unpack8(((const uint4*)w)[i], g);
            unpack8(((const uint4*)xr)[i], b);
            if (accumulate) unpack8(((const uint4*)dxr)[i], d);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float v = r * (a[k] * g[k] - (b[k] * r) * c);
                d[k] = accumulate ? v + d[k] : v;
            }
            ((uint4*)dxr)[i] = pack8(d);
        }
    } else {
        for (u32 i = lane; i < cols; i += 32) {
            const float xh = bf2f(xr[i]) * r;
            float v = r * (bf2f(dyr[i]) * bf2f(w[i]) - xh * c);
            if (accumulate) v += bf2f(dxr[i]);
            dxr[i] = f2bf(v);
        }
    }
}

// RMSNorm backward, weight part: dw[j] += sum over rows of dy[r, j] * x[r, j] * rstd[r].
// Block (DW_COLS, 16): threadIdx.x picks the column, threadIdx.y the rows r = ty, ty + 16, ...
// (ascending, DW_UNROLL rows' loads issued before their sums); the 16 partial sums are then
// added in ty order. The order depends on the shape only.
#define DW_COLS 16
#define DW_UNROLL 8
extern "C" __global__ void rmsnorm_bwd_dw_f32(float* dw, const bf16* __restrict__ dy,
                                              const bf16* __restrict__ x,
                                              const float* __restrict__ rstd, u32 rows, u32 cols) {
    __shared__ float part[16][DW_COLS + 1];
    const u32 j = blockIdx.x * DW_COLS + threadIdx.x;
    float acc = 0.0f;
    if (j < cols) {
        u32 r = threadIdx.y;
        for (; r + 16 * (DW_UNROLL - 1) < rows; r += 16 * DW_UNROLL) {
            float a[DW_UNROLL], b[DW_UNROLL], q[DW_UNROLL];
#pragma unroll
            for (int k = 0; k < DW_UNROLL; k++) {
                const u64 o = (u64)(r + 16 * k) * cols + j;
                a[k] = bf2f(dy[o]);
                b[k] = bf2f(x[o]);
                q[k] = rstd[r + 16 * k];
            }
#pragma unroll
            for (int k = 0; k < DW_UNROLL; k++) acc += a[k] * (b[k] * q[k]);
        }
        for (; r < rows; r += 16) {
            const u64 o = (u64)r * cols + j;
            acc += bf2f(dy[o]) * (bf2f(x[o]) * rstd[r]);
        }
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        float s = 0.0f;
        for (int k = 0; k < 16; k++) s += part[k][threadIdx.x];
        dw[j] += s;
    }
}

// RoPE backward in place (the transposed rotation): on each of `n_heads` heads of row t,
//   dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1     (c, s = cos/sin[t, :], fp32; one rounding)
// 8 consecutive pairs a thread with 16-byte accesses where half a head is a multiple of 8 and
// the row and tables are 16-byte aligned (the same arithmetic).
extern "C" __global__ void rope_bwd_bf16(bf16* dx, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, u32 tokens,
                                         u32 row_stride, u32 n_heads, u32 head_dim) {
    const u32 t = blockIdx.x;
    if (t >= tokens) return;
    bf16* xr = dx + (u64)t * row_stride;
    const float* c = cos_t + (u64)t * head_dim;
    const float* s = sin_t + (u64)t * head_dim;
    const u32 half = head_dim / 2;
    const bool vec = (half & 7u) == 0 && ((((u64)xr) | ((u64)c) | ((u64)s)) & 15u) == 0;
    if (vec) {
        const u32 q = half / 8;
        for (u32 e = threadIdx.x; e < n_heads * q; e += blockDim.x) {
            const u32 h = e / q, i = (e - h * q) * 8;
            bf16* xh = xr + h * head_dim;
            float d1[8], d2[8], c1[8], s1[8], c2[8], s2[8];
            unpack8(*(const uint4*)(xh + i), d1);
            unpack8(*(const uint4*)(xh + i + half), d2);
            rope_tables8(c, s, i, half, c1, s1, c2, s2);
            float o1[8], o2[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                o1[k] = d1[k] * c1[k] + d2[k] * s2[k];
                o2[k] = d2[k] * c2[k] - d1[k] * s1[k];
            }
            *(uint4*)(xh + i) = pack8(o1);
            *(uint4*)(xh + i + half) = pack8(o2);
        }
        return;
    }
    for (u32 e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
        const u32 h = e / half, i = e % half;
        bf16* xh = xr + h * head_dim;
        const float d1 = bf2f(xh[i]), d2 = bf2f(xh[i + half]);
        xh[i] = f2bf(d1 * c[i] + d2 * s[i + half]);
        xh[i + half] = f2bf(d2 * c[i + half] - d1 * s[i]);
    }
}

// SwiGLU backward (out = silu(gate) * up), fp32 math:
//   dgate = dout * up * sig * (1 + g (1 - sig)),  dup = dout * g * sig
// Each buffer has its own row stride (a fused [rows, 2F] dgate|dup output works). 8 elements a
// thread with 16-byte accesses where the columns and every row start allow (the same math).
__device__ __forceinline__ void swiglu_bwd_one(float g, float u, float d, float& dg, float& du) {
    const float sig = 1.0f / (1.0f + expf(-g));
    dg = d * u * (sig * (1.0f + g * (1.0f - sig)));
    du = d * (g * sig);
}
extern "C" __global__ void swiglu_bwd_bf16(bf16* dgate, bf16* dup, const bf16* __restrict__ dout,
                                           const bf16* __restrict__ gate,
                                           const bf16* __restrict__ up, u32 rows, u32 cols,
                                           u32 dgate_stride, u32 dup_stride, u32 dout_stride,
                                           u32 gate_stride, u32 up_stride) {
    const u32 row = blockIdx.y;
    if (row >= rows) return;
    bf16* dgr = dgate + (u64)row * dgate_stride;
    bf16* dur = dup + (u64)row * dup_stride;
    const bf16* dr = dout + (u64)row * dout_stride;
    const bf16* gr = gate + (u64)row * gate_stride;
    const bf16* ur = up + (u64)row * up_stride;
    const bool vec = (cols & 7u) == 0 &&
                     ((((u64)dgr) | ((u64)dur) | ((u64)dr) | ((u64)gr) | ((u64)ur)) & 15u) == 0;
    if (vec) {
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < cols / 8; i += gridDim.x * blockDim.x) {
            float g[8], u[8], d[8], a[8], b[8];
            unpack8(((const uint4*)gr)[i], g);
            unpack8(((const uint4*)ur)[i], u);
            unpack8(((const uint4*)dr)[i], d);
#pragma unroll
            for (int k = 0; k < 8; k++) swiglu_bwd_one(g[k], u[k], d[k], a[k], b[k]);
            ((uint4*)dgr)[i] = pack8(a);
            ((uint4*)dur)[i] = pack8(b);
        }
        return;
    }
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += gridDim.x * blockDim.x) {
        float a, b;
        swiglu_bwd_one(bf2f(gr[i]), bf2f(ur[i]), bf2f(dr[i]), a, b);
        dgr[i] = f2bf(a);
        dur[i] = f2bf(b);
    }
}

// GELU backward (the vision merger's nn.GELU()), fp32 math, one rounding:
//   exact (tanh_approx = 0): dx = dy (Phi(x) + x phi(x)) = dy (0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi))
//   tanh: u = sqrt(2/pi) (x + k x^3), t = tanh(u) (k = 0.044715):
//         dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 k x^2))
// as PyTorch's GeluBackward computes it for bf16 tensors (in fp32, rounded once).
extern "C" __global__ void gelu_bwd_bf16(bf16* __restrict__ dx, const bf16* __restrict__ dy,
                                         const bf16* __restrict__ x, u64 n, u32 tanh_approx) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float v = bf2f(x[i]);
        float d;
        if (tanh_approx) {
            const float k = 0.7978845608028654f, kappa = 0.044715f;
            const float t = tanhf(k * (v + kappa * v * v * v));
            d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * k * (1.0f + 3.0f * kappa * v * v);
        } else {
            const float cdf = 0.5f * (1.0f + erff(v * 0.7071067811865476f));
            const float pdf = expf(-0.5f * v * v) * 0.3989422804014327f;
            d = cdf + v * pdf;
        }
        dx[i] = f2bf(bf2f(dy[i]) * d);
    }
}

// Embedding backward: dtable[ids[t], j] += dout[t, j], tokens in ascending order for every
// table element (the CPU twin's order, so the result is bitwise the CPU's). No atomics: block
// (blockIdx.x, blockIdx.y) owns columns blockIdx.x*blockDim.x + threadIdx.x of the table rows
// whose id falls in slice blockIdx.y (ids with id % gridDim.y == blockIdx.y); every thread scans
// all ids in order. Ids >= vocab are skipped (the launcher's contract: the caller checks them).
extern "C" __global__ void embedding_bwd_f32(float* dtable, const bf16* __restrict__ dout,
                                             const u32* __restrict__ ids, u32 tokens, u32 hidden,
                                             u32 vocab, u32 dout_stride) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    for (u32 t = 0; t < tokens; t++) {
        const u32 id = ids[t];
        if (id >= vocab || id % gridDim.y != blockIdx.y) continue;
        dtable[(u64)id * hidden + j] += bf2f(dout[(u64)t * dout_stride + j]);
    }
}

// Log-prob backward through the (temperature-scaled) log-softmax. One block per row; with
// z = logits / T, p = softmax(z), e = sum_k p_k z_k:
//   dlogits_j = (dlogp (1[j = target] - p_j) - dentropy p_j (z_j - e)) / T
// dentropy may be null (no entropy term). Two passes over the row: the log-sum-exp and e as
// logprobs_fwd_bf16 computes them (row_lse3, merged in a fixed order), then dlogits, 8 values
// per 16-byte load and store where both rows allow. A target >= vocab writes NaN over the row.
extern "C" __global__ void logprobs_bwd_bf16(bf16* dlogits, const float* __restrict__ dlogp,
                                             const float* __restrict__ dentropy,
                                             const bf16* __restrict__ logits,
                                             const u32* __restrict__ targets, u32 rows, u32 vocab,
                                             u32 row_stride, u32 out_stride, float temperature) {
    __shared__ Lse3 part[32];
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const bf16* x = logits + (u64)row * row_stride;
    bf16* o = dlogits + (u64)row * out_stride;
    const bool unit = temperature == 1.0f;
    const float inv_t = 1.0f / temperature;
    const Lse3 r = lse3_block(row_lse3(x, vocab, temperature), part);
    const float lse = r.m + logf(r.s), ez = r.t / r.s;
    const float gl = dlogp[row];
    const float ge = dentropy != nullptr ? dentropy[row] : 0.0f;
    const u32 tgt = targets[row];
    const bool bad = tgt >= vocab;
    auto grad = [&](float xv, u32 i) -> float {
        const float z = unit ? xv : xv / temperature;
        const float p = expf(z - lse);
        const float onehot = i == tgt ? 1.0f : 0.0f;
        return bad ? __int_as_float(0x7fc00000) : (gl * (onehot - p) - ge * p * (z - ez)) * inv_t;
    };
    if ((vocab & 7u) == 0 && ((((u64)x) | ((u64)o)) & 15u) == 0) {
        for (u32 i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
            float z[8];
            unpack8(((const uint4*)x)[i], z);
#pragma unroll
            for (int k = 0; k < 8; k++) z[k] = grad(z[k], 8 * i + k);
            ((uint4*)o)[i] = pack8(z);
        }
    } else {
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) o[i] = f2bf(grad(bf2f(x[i]), i));
    }
}
