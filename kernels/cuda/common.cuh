// Shared device helpers, prepended to every kernel source before NVRTC compiles it.
// No #include: NVRTC needs no CUDA headers for this file, so the sources compile the same on any
// toolkit. bf16 is stored as its raw 16 bits; conversions below round to nearest even, exactly as
// half::bf16::from_f32 does on the host.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f
#define NEG_INF_F (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// Two bf16 packed in one u32 (element 0 in the low half, as in memory).
__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf2(float a, float b) {
    return (u32)f2bf(a) | ((u32)f2bf(b) << 16);
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
