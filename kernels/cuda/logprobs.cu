// Per-token log-probabilities of given tokens under softmax(logits / temperature), with entropy,
// fp32 accumulation, as cpu::logprobs_fwd defines them (z = logits / temperature):
//   logp[row] = z[target] - lse,  lse = log sum_j exp z_j,  entropy = lse - sum_j p_j z_j.
// The division is IEEE (skipped when temperature == 1). One block per row; per-thread running
// (max, sum exp, sum exp*z) triples are merged in a fixed tree order: deterministic. A target
// >= vocab gives NaN. entropy and lse may be null.

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

extern "C" __global__ void logprobs_fwd_bf16(float* __restrict__ logp, float* __restrict__ entropy,
                                             float* __restrict__ lse,
                                             const bf16* __restrict__ logits,
                                             const u32* __restrict__ targets, u32 rows,
                                             u32 vocab, u32 row_stride, float temperature) {
    pdl_wait();
    __shared__ float sm[32], ss[32], st[32];
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const bf16* x = logits + (u64)row * row_stride;
    const bool unit = temperature == 1.0f;
    Lse3 a = {NEG_INF_F, 0.0f, 0.0f};
    const bool vec = (vocab & 7u) == 0 && ((((u64)x) & 15u) == 0);
    if (vec) {
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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Lse3 b;
        b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        b.t = __shfl_xor_sync(0xffffffffu, a.t, o);
        lse_merge(a, b);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) { sm[warp] = a.m; ss[warp] = a.s; st[warp] = a.t; }
    __syncthreads();
    if (threadIdx.x == 0) {
        Lse3 r = {sm[0], ss[0], st[0]};
        for (int w = 1; w < nw; w++) {
            const Lse3 b = {sm[w], ss[w], st[w]};
            lse_merge(r, b);
        }
        const float lz = r.m + logf(r.s);
        const u32 t = targets[row];
        float zt = __int_as_float(0x7fc00000);
        if (t < vocab) {
            zt = bf2f(x[t]);
            if (!unit) zt = zt / temperature;
        }
        logp[row] = zt - lz;
        if (entropy != nullptr) entropy[row] = lz - r.t / r.s;
        if (lse != nullptr) lse[row] = lz;
    }
}
