// Pointwise and row-copy kernels: rotary embedding, SwiGLU, GELU, residual add, embedding
// gather, KV-cache append. Each rounds where Hugging Face's bf16 PyTorch code rounds, noted per
// kernel, so results sit as close to the reference implementation as bf16 allows.

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15u) == 0; }

// Rotates heads [0, n_heads) of one row in place (the block's threads split the pairs); with
// `copy`, head h >= copy_from is also written, rotated, to copy[(h - copy_from) * head_dim].
// Where half a head is a multiple of 8 and the row, tables and copy are 16-byte aligned, a
// thread takes 8 consecutive pairs with 16-byte loads and stores (the same arithmetic).
__device__ __forceinline__ void rope_row(bf16* xr, const float* c, const float* s, u32 n_heads,
                                         u32 head_dim, u32 hf_text_rounding,
                                         u32 copy_from = 0xffffffffu, bf16* copy = nullptr) {
    const u32 half = head_dim / 2;
    const bool vec = (half & 7u) == 0 && aligned16(xr) && aligned16(c) && aligned16(s) &&
                     (copy == nullptr || aligned16(copy));
    if (vec) {
        const u32 q = half / 8;  // 8-pair chunks per head
        for (u32 p = threadIdx.x; p < n_heads * q; p += blockDim.x) {
            const u32 h = p / q, i = (p - h * q) * 8;
            bf16* xh = xr + (u64)h * head_dim;
            float a[8], b[8], c1[8], s1[8], c2[8], s2[8];
            unpack8(*(const uint4*)(xh + i), a);
            unpack8(*(const uint4*)(xh + i + half), b);
            rope_tables8(c, s, i, half, c1, s1, c2, s2);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float o1, o2;
                rope_pair(a[k], b[k], c1[k], s1[k], c2[k], s2[k], hf_text_rounding, o1, o2);
                a[k] = o1;
                b[k] = o2;
            }
            const uint4 y1 = pack8(a), y2 = pack8(b);
            *(uint4*)(xh + i) = y1;
            *(uint4*)(xh + i + half) = y2;
            if (copy != nullptr && h >= copy_from) {
                bf16* dh = copy + (u64)(h - copy_from) * head_dim;
                *(uint4*)(dh + i) = y1;
                *(uint4*)(dh + i + half) = y2;
            }
        }
        return;
    }
    for (u32 p = threadIdx.x; p < n_heads * half; p += blockDim.x) {
        const u32 h = p / half, i = p - h * half;
        bf16* xh = xr + (u64)h * head_dim;
        float o1, o2;
        rope_pair(bf2f(xh[i]), bf2f(xh[i + half]), c[i], s[i], c[i + half], s[i + half],
                  hf_text_rounding, o1, o2);
        const bf16 y1 = f2bf(o1), y2 = f2bf(o2);
        xh[i] = y1;
        xh[i + half] = y2;
        if (copy != nullptr && h >= copy_from) {
            bf16* dh = copy + (u64)(h - copy_from) * head_dim;
            dh[i] = y1;
            dh[i + half] = y2;
        }
    }
}

// Rotate-half rotary embedding, in place, on heads [0, n_heads) of each token row:
//   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin   (x1, x2: first and second half of a head)
// cos/sin: f32 tables [tokens, head_dim] (M-RoPE sections already resolved by the host; the
// first half's entries rotate x1, the second half's x2, as cpu::rope_fwd reads them).
// hf_text_rounding = 1 rounds as the HF text decoder does (cos/sin cast to bf16, each product
// and the sum rounded to bf16); 0 computes in fp32 and rounds once (the HF vision tower).
extern "C" __global__ void rope_fwd_bf16(bf16* x, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, u32 tokens,
                                         u32 row_stride, u32 n_heads, u32 head_dim,
                                         u32 hf_text_rounding) {
    const u32 t = blockIdx.x;
    if (t >= tokens) return;
    bf16* xr = x + (u64)t * row_stride;
    const float* c = cos_t + (u64)t * head_dim;
    const float* s = sin_t + (u64)t * head_dim;
    rope_row(xr, c, s, n_heads, head_dim, hf_text_rounding);
}

__device__ __forceinline__ float silu_bf16_rounded(float g) {
    return bf2f(f2bf(g / (1.0f + expf(-g))));
}

// SwiGLU: out = bf16( bf16(silu(gate)) * up ), as `act_fn(gate_proj(x)) * up_proj(x)` in bf16.
// gate/up/out rows have their own strides, so a fused [rows, 2F] gate|up GEMM output works
// (gate = base, up = base + F, both stride 2F). One block row-strip per blockIdx.y row.
extern "C" __global__ void swiglu_fwd_bf16(const bf16* gate, const bf16* up, bf16* out, u32 rows,
                                           u32 cols, u32 gate_stride, u32 up_stride,
                                           u32 out_stride) {
    pdl_wait();
    const u32 row = blockIdx.y;
    if (row >= rows) return;
    const bf16* g = gate + (u64)row * gate_stride;
    const bf16* u = up + (u64)row * up_stride;
    bf16* o = out + (u64)row * out_stride;
    const bool vec = (cols & 7u) == 0 && aligned16(g) && aligned16(u) && aligned16(o);
    if (vec) {
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < cols / 8; i += gridDim.x * blockDim.x) {
            float a[8], b[8];
            unpack8(((const uint4*)g)[i], a);
            unpack8(((const uint4*)u)[i], b);
#pragma unroll
            for (int k = 0; k < 8; k++) a[k] = silu_bf16_rounded(a[k]) * b[k];
            ((uint4*)o)[i] = pack8(a);
        }
    } else {
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += gridDim.x * blockDim.x)
            o[i] = f2bf(silu_bf16_rounded(bf2f(g[i])) * bf2f(u[i]));
    }
}

// GELU over n elements: exact erf form (torch.nn.GELU(), the Qwen2.5-VL patch merger) when
// tanh_approx = 0, else the tanh approximation. One rounding to bf16.
extern "C" __global__ void gelu_fwd_bf16(const bf16* x, bf16* y, u64 n, u32 tanh_approx) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float v = bf2f(x[i]);
        float r;
        if (tanh_approx) {
            r = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        } else {
            r = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
        }
        y[i] = f2bf(r);
    }
}

// out = bf16(a + b) over n elements (the residual add). out may alias a or b.
extern "C" __global__ void add_fwd_bf16(const bf16* a, const bf16* b, bf16* out, u64 n) {
    pdl_wait();
    const bool vec = (n & 7u) == 0 && aligned16(a) && aligned16(b) && aligned16(out);
    if (vec) {
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n / 8; i += (u64)gridDim.x * blockDim.x) {
            float x[8], y[8];
            unpack8(((const uint4*)a)[i], x);
            unpack8(((const uint4*)b)[i], y);
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] += y[k];
            ((uint4*)out)[i] = pack8(x);
        }
    } else {
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
            out[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
    }
}

// Row copy shared by the gather and the scatter below: dst row dst_rows[r] (or r when dst_rows is
// null) <- src row src_rows[r] (or r when src_rows is null), `width` elements each. A src index
// >= src_limit writes a NaN row (a bad token id shows up loudly instead of reading out of
// bounds); a dst index >= dst_limit writes nothing.
__device__ __forceinline__ void copy_row(const bf16* __restrict__ src, bf16* __restrict__ dst,
                                         const u32* __restrict__ src_rows,
                                         const u32* __restrict__ dst_rows, u32 rows, u32 width,
                                         u32 src_stride, u32 dst_stride, u32 src_limit,
                                         u32 dst_limit) {
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    const u32 si = src_rows ? src_rows[r] : r;
    const u32 di = dst_rows ? dst_rows[r] : r;
    if (di >= dst_limit) return;
    bf16* d = dst + (u64)di * dst_stride;
    if (si >= src_limit) {
        for (u32 i = threadIdx.x; i < width; i += blockDim.x) d[i] = (bf16)0x7fc0;
        return;
    }
    const bf16* s = src + (u64)si * src_stride;
    if ((width & 7u) == 0 && aligned16(s) && aligned16(d)) {
        for (u32 i = threadIdx.x; i < width / 8; i += blockDim.x) ((uint4*)d)[i] = ((const uint4*)s)[i];
    } else {
        for (u32 i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
    }
}

// Embedding gather: out[t, :] = table[ids[t], :]. One block per token.
extern "C" __global__ void embedding_fwd_bf16(const bf16* __restrict__ table,
                                              const u32* __restrict__ ids, bf16* __restrict__ out,
                                              u32 tokens, u32 hidden, u32 vocab, u32 out_stride) {
    pdl_wait();
    copy_row(table, out, ids, nullptr, tokens, hidden, hidden, out_stride, vocab, 0xffffffffu);
}

// KV-cache append: cache[slots[t], :] = src[t, :] for t < tokens (src rows `src_stride` apart, so
// the K or V part of a fused qkv output can be read in place). Slots >= n_slots are skipped.
extern "C" __global__ void kv_append_bf16(const bf16* __restrict__ src,
                                          const u32* __restrict__ slots, bf16* __restrict__ cache,
                                          u32 tokens, u32 width, u32 src_stride, u32 cache_stride,
                                          u32 n_slots) {
    copy_row(src, cache, nullptr, slots, tokens, width, src_stride, cache_stride, 0xffffffffu,
             n_slots);
}

// Decode-step fusion of rope_fwd_bf16 and two kv_append_bf16: on each fused qkv row
// [q heads | k heads | v heads], rotate the q and k heads in place, then copy the (rotated) k
// part to k_cache[slots[t]] and the v part to v_cache[slots[t]]. Bitwise the same as the three
// kernels. Slots >= n_slots are skipped. One block per token; rope_row's threads write the
// rotated k pairs they computed to the cache themselves, so nothing waits on the rest of the
// block.
extern "C" __global__ void rope_kv_append_bf16(bf16* qkv, const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t,
                                               bf16* __restrict__ k_cache,
                                               bf16* __restrict__ v_cache,
                                               const u32* __restrict__ slots, u32 tokens,
                                               u32 n_heads, u32 n_kv, u32 head_dim,
                                               u32 hf_text_rounding, u32 n_slots) {
    pdl_wait();
    const u32 t = blockIdx.x;
    if (t >= tokens) return;
    const u32 qk = n_heads + n_kv, kvw = n_kv * head_dim;
    bf16* xr = qkv + (u64)t * (qk + n_kv) * head_dim;
    const float* c = cos_t + (u64)t * head_dim;
    const float* s = sin_t + (u64)t * head_dim;
    const u32 slot = slots[t];
    const bool write = slot < n_slots;
    bf16* kd = k_cache + (u64)(write ? slot : 0) * kvw;
    bf16* vd = v_cache + (u64)(write ? slot : 0) * kvw;
    rope_row(xr, c, s, qk, head_dim, hf_text_rounding, n_heads, write ? kd : nullptr);
    if (!write) return;
    // v is not rotated: its copy needs nothing from the loop above.
    const bf16* vs = xr + (u64)qk * head_dim;
    if ((kvw & 7u) == 0 && aligned16(vs) && aligned16(vd)) {
        for (u32 i = threadIdx.x; i < kvw / 8; i += blockDim.x) ((uint4*)vd)[i] = ((const uint4*)vs)[i];
    } else {
        for (u32 i = threadIdx.x; i < kvw; i += blockDim.x) vd[i] = vs[i];
    }
}
