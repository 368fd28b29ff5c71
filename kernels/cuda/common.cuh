// Shared device helpers, prepended to every kernel source before NVRTC compiles it.
// No #include: NVRTC needs no CUDA headers for this file, so the sources compile the same on any
// toolkit. bf16 is stored as its raw 16 bits; conversions below round to nearest even, as
// half::bf16::from_f32 does on the host (bit for bit, NaN aside: a NaN may come out as another
// quiet NaN).

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f
#define NEG_INF_F (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// One cvt.rn instruction where the target has it (round to nearest even, any NaN to the
// canonical one); the integer form below rounds the same way.
__device__ __forceinline__ bf16 f2bf(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return (bf16)r;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// Two bf16 packed in one u32 (element 0 in the low half, as in memory).
__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;  // cvt's first source goes to the high half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
#else
    return (u32)f2bf(a) | ((u32)f2bf(b) << 16);
#endif
}

// 2^x on the special-function unit with results below 2^-126 flushed to zero: for x >= -126 the
// same bits as exp2f, which spends three more instructions on the range below. For the online
// softmax, where such a term is lost beside the running sum anyway.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The RoPE tables' entries for 8 consecutive pairs i .. i + 7 of a head (16-byte aligned rows
// of cos / sin): c1, s1 rotate the first half (entries i ..), c2, s2 the second (i + half ..).
__device__ __forceinline__ void rope_tables8(const float* c, const float* s, u32 i, u32 half,
                                             float* c1, float* s1, float* c2, float* s2) {
#pragma unroll
    for (int k = 0; k < 8; k += 4) {
        *(float4*)(c1 + k) = *(const float4*)(c + i + k);
        *(float4*)(s1 + k) = *(const float4*)(s + i + k);
        *(float4*)(c2 + k) = *(const float4*)(c + i + half + k);
        *(float4*)(s2 + k) = *(const float4*)(s + i + half + k);
    }
}

// One rotated pair (x1, x2) of a head, rounded as `rope_fwd_bf16` documents (pointwise.cu; also
// the skinny GEMM's q|k|v epilogue, gemv.cu).
__device__ __forceinline__ void rope_pair(float a, float b, float c1, float s1, float c2, float s2,
                                          u32 hf_text_rounding, float& o1, float& o2) {
    if (hf_text_rounding) {
        c1 = bf2f(f2bf(c1)); s1 = bf2f(f2bf(s1));
        c2 = bf2f(f2bf(c2)); s2 = bf2f(f2bf(s2));
        o1 = bf2f(f2bf(a * c1)) + bf2f(f2bf(-b * s1));
        o2 = bf2f(f2bf(b * c2)) + bf2f(f2bf(a * s2));
    } else {
        o1 = a * c1 + (-b) * s1;
        o2 = b * c2 + a * s2;
    }
}

// Unpacks 8 bf16 held in a uint4 into floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    v.x = pack_bf2(f[0], f[1]); v.y = pack_bf2(f[2], f[3]);
    v.z = pack_bf2(f[4], f[5]); v.w = pack_bf2(f[6], f[7]);
    return v;
}

// Programmatic dependent launch (Hopper and later): a kernel launched with programmatic stream
// serialization (launch.rs, `PDL_KERNELS`) may be scheduled before the kernel ahead of it on the
// stream has finished; it waits here, before its first memory access, until that kernel has
// ended and its writes are visible. A no-op for a kernel launched the ordinary way. Every kernel
// named in `PDL_KERNELS` calls this first.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum in a fixed order (deterministic): warps reduce by butterfly, then warp 0 reduces
// the per-warp partials. `scratch` holds at least 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    return t;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : NEG_INF_F;
    return warp_max(t);
}

// Online log-sum-exp of a row of logits z (the log-prob kernels, forward and backward): the
// running max, sum exp(z - max) and sum exp(z - max) * z, pushed 8 values at a time and merged
// in a fixed order.
struct Lse3 {
    float m, s, t;  // running max, sum exp(z - m), sum exp(z - m) * z
};

__device__ __forceinline__ void lse_merge(Lse3& a, const Lse3& b) {
    const float M = fmaxf(a.m, b.m);
    if (M == NEG_INF_F) return;
    const float ea = a.m == NEG_INF_F ? 0.0f : expf(a.m - M);
    const float eb = b.m == NEG_INF_F ? 0.0f : expf(b.m - M);
    a.s = a.s * ea + b.s * eb;
    a.t = a.t * ea + b.t * eb;
    a.m = M;
}

__device__ __forceinline__ void lse_push8(Lse3& a, const float* z) {
    float mx = NEG_INF_F;
#pragma unroll
    for (int k = 0; k < 8; k++) mx = fmaxf(mx, z[k]);
    if (mx == NEG_INF_F) return;
    if (mx > a.m) {
        const float e = a.m == NEG_INF_F ? 0.0f : expf(a.m - mx);
        a.s *= e;
        a.t *= e;
        a.m = mx;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float e = expf(z[k] - a.m);
        a.s += e;
        if (e != 0.0f) a.t += e * z[k];  // a -inf logit (or padding) adds nothing, not 0 * -inf
    }
}

// This thread's triple over row x of `vocab` logits, z = x / temperature (IEEE division, none
// at temperature 1): 16-byte loads where the row allows, 8 values at a time either way (-inf
// pads the tail).
__device__ __forceinline__ Lse3 row_lse3(const bf16* x, u32 vocab, float temperature) {
    const bool unit = temperature == 1.0f;
    Lse3 a = {NEG_INF_F, 0.0f, 0.0f};
    if ((vocab & 7u) == 0 && (((u64)x) & 15u) == 0) {
        for (u32 i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
            float z[8];
            unpack8(((const uint4*)x)[i], z);
            if (!unit)
#pragma unroll
                for (int k = 0; k < 8; k++) z[k] = z[k] / temperature;
            lse_push8(a, z);
        }
    } else {
        for (u32 i0 = threadIdx.x * 8; i0 < vocab; i0 += blockDim.x * 8) {
            float z[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                z[k] = i0 + k < vocab ? bf2f(x[i0 + k]) : NEG_INF_F;
                if (!unit) z[k] = z[k] / temperature;
            }
            lse_push8(a, z);
        }
    }
    return a;
}

// Every thread's triple merged over the block in a fixed order (warp butterflies, then the warps
// in order): deterministic; every thread gets the result. `part` holds at least 32 triples.
__device__ __forceinline__ Lse3 lse3_block(Lse3 a, Lse3* part) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Lse3 b;
        b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        b.t = __shfl_xor_sync(0xffffffffu, a.t, o);
        lse_merge(a, b);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();  // `part` may still be read by an earlier call
    if (lane == 0) part[warp] = a;
    __syncthreads();
    Lse3 r = part[0];
    for (int w = 1; w < nw; w++) lse_merge(r, part[w]);
    return r;
}

// One KV-cache segment pair per sequence: a (possibly shared) prefix then the sequence's own
// keys. Logical key index kk < p_len reads slot p_start + kk, else slot k_start + kk - p_len.
// Queries are rows q_start .. q_start + q_len of Q; they are the LAST q_len of the own keys
// (causal: query i sees logical keys < p_len + k_len - q_len + i + 1).
struct AttnSeq {
    u32 q_start, q_len, p_start, p_len, k_start, k_len;
};


// Shared-memory addresses, cp.async, ldmatrix and mma.sync (the tensor-core kernels).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;  // 0: fill with zeros, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}
// c += A B, all 16 rows of A.
__device__ __forceinline__ void mma16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where one thread's K and V chunks of a logical key come from (AttnSeq's rule), for a block
// of NTH threads copying HD-wide K/V rows in 16-byte chunks: each side's row 0 at the thread's
// columns (its kv head and, when the chunks of a row divide the block, its chunk), so that a
// copy costs a compare, a multiply-add and the adds, with nothing re-derived per key.
template <int HD, int NTH>
struct KeyRows {
    static constexpr int VPR = HD / 8;  // 16-byte chunks per row
    // a thread copies the same chunk column of every row it copies (HD 128); else the column
    // is added per copy
    static constexpr bool COL_FIXED = NTH % VPR == 0;
    const bf16 *pk, *pv, *k, *v;
    u32 p_stride, kv_stride, p_len;
    __device__ __forceinline__ KeyRows(const bf16* ppk, const bf16* ppv, u32 pstride,
                                       const bf16* kk, const bf16* vv, u32 kvstride,
                                       const AttnSeq& s, u32 kvh)
        : p_stride(pstride), kv_stride(kvstride), p_len(s.p_len) {
        const u32 col = kvh * HD + (COL_FIXED ? threadIdx.x % VPR * 8 : 0);
        pk = ppk + (u64)s.p_start * pstride + col;
        pv = ppv + (u64)s.p_start * pstride + col;
        k = kk + (u64)s.k_start * kvstride + col;
        v = vv + (u64)s.k_start * kvstride + col;
    }
    // K and V addresses of logical key j (any j: a key past the sequence gets an address that
    // must not be read).
    __device__ __forceinline__ void at(u32 j, const bf16*& kp, const bf16*& vp) const {
        const bool pre = j < p_len;
        const u64 o = pre ? (u64)j * p_stride : (u64)(j - p_len) * kv_stride;
        kp = (pre ? pk : k) + o;
        vp = (pre ? pv : v) + o;
    }
    // Issues (cp.async, not committed) the copies of logical keys t0 .. t0 + T - 1 into the
    // shared K and V tiles at ks and vs (rows SROW bf16 apart); keys at or past `end` are zeros.
    template <int T, int SROW>
    __device__ __forceinline__ void copy_tile(u32 ks, u32 vs, u32 t0, u32 end) const {
        static_assert((T * VPR) % NTH == 0, "a K/V tile must split evenly over the block");
#pragma unroll
        for (int i = 0; i < T * VPR / NTH; i++) {
            const u32 c = threadIdx.x + NTH * i, row = c / VPR, col = c % VPR, j = t0 + row;
            const bf16 *kp, *vp;
            at(j, kp, vp);
            if (!COL_FIXED) {
                kp += col * 8;
                vp += col * 8;
            }
            const u32 so = (row * SROW + col * 8) * 2;
            cp_async16(ks + so, kp, j < end);
            cp_async16(vs + so, vp, j < end);
        }
    }
};
