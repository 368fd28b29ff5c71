// Token sampling: temperature, top-k, top-p, with a counter-based RNG so that a token depends
// only on (logits, seed, iteration, sample, step), never on the batch it ran in or the schedule.
// The definition (the CPU twin in src/cuda/sampling.rs computes the same):
//   - temperature <= 0: greedy argmax, lowest index on ties.
//   - z_i = logit_i / T (IEEE division). Ranks use the bf16 logit's order key (NaN ranks lowest
//     and is never drawn).
//   - top-k (0 < k < vocab): keep logits >= the k-th largest (ties at the threshold all kept).
//   - top-p (p < 1): q_i = trunc(exp(z_i - z_max) * 2^32) as an integer (so the sum is exact and
//     order-free); Z = sum of q over kept; keep logits >= tau, tau the largest logit with
//     sum_{kept, logit >= tau} q >= ceil(p * Z).
//   - draw: argmax over kept of z_i + g_i, g_i = -ln(-ln(u_i)) (Gumbel-max), ties to the lowest
//     index, a NaN score (a -inf logit whose u_i rounds to 1) never drawn; u_i = ((x >> 8) + 0.5)
//     * 2^-24 with x word (i mod 4) of
//     Philox4x32-10(counter = (i / 4, step, sample, iteration), key = (seed_lo, seed_hi)).
// One block of 1024 threads per row; all reductions are integer or fixed-order: deterministic.

#define SAMPLE_THREADS 1024

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

// Order-preserving 16-bit key of a bf16 value; NaN maps to 0 (below -inf, which maps to 0x7f).
__device__ __forceinline__ u32 bf_key(bf16 b) {
    const u32 x = b;
    if ((x & 0x7fffu) > 0x7f80u) return 0;
    return (x & 0x8000u) ? (~x & 0xffffu) : (x | 0x8000u);
}

// Test hook: fills out[4*i .. 4*i+4] with Philox4x32-10(counter = (i, c1, c2, c3), key).
extern "C" __global__ void philox_fill(u32* out, u32 n_blocks, u32 c1, u32 c2, u32 c3, u32 k0,
                                       u32 k1) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks) return;
    const uint4 r = philox4x32_10(make_uint4(i, c1, c2, c3), make_uint2(k0, k1));
    out[4 * i] = r.x; out[4 * i + 1] = r.y; out[4 * i + 2] = r.z; out[4 * i + 3] = r.w;
}

// Radix select over the 16-bit keys of the row (two 8-bit digits, most significant first):
// returns the largest key t with sum_{key_i >= t, key_i >= kmin} w_i >= need, or kmin when the
// total weight is below need. w_i = 1 (counts) when `weighted` is false, else the fixed-point
// probability weight. hist: 256 u64 in shared memory; res: 4 u64 of shared scratch.
__device__ u32 radix_select(const bf16* x, u32 vocab, u32 kmin, u64 need, bool weighted,
                            float zmax, float temperature, u64* hist, u64* res) {
    u32 prefix = 0;  // selected high digit (valid in pass 1)
    u64 above = 0;   // weight strictly above the selected bucket
    for (int pass = 0; pass < 2; pass++) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const u32 key = bf_key(x[i]);
            if (key < kmin) continue;
            if (pass == 1 && (key >> 8) != prefix) continue;
            u64 w = 1;
            if (weighted) w = __float2ull_rz(expf(bf2f(x[i]) / temperature - zmax) * 4294967296.0f);
            atomicAdd(&hist[pass == 0 ? (key >> 8) : (key & 255u)], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const u64 want = need - above;
            u64 cum = 0;
            int sel = -1;
            for (int b = 255; b >= 0; b--) {
                if (cum + hist[b] >= want) { sel = b; break; }
                cum += hist[b];
            }
            res[0] = (u64)sel;
            res[1] = cum;
        }
        __syncthreads();
        const int sel = (int)(long long)res[0];
        const u64 cum = res[1];
        __syncthreads();
        if (sel < 0) return kmin;  // uniform: total weight below need, keep all
        if (pass == 0) {
            prefix = (u32)sel;
            above = cum;
        } else {
            const u32 t = (prefix << 8) | (u32)sel;
            return t > kmin ? t : kmin;
        }
    }
    return kmin;
}

// Logits 4g .. 4g + 3 of a row into v (NaN past vocab): one 8-byte load when the row is 8-byte
// aligned (`vec`) and the group lies inside it.
__device__ __forceinline__ void load_group4(const bf16* __restrict__ x, u32 g, u32 vocab, bool vec,
                                            bf16 v[4]) {
    if (vec && g * 4 + 3 < vocab) {
        const uint2 w = *(const uint2*)(x + g * 4);
        v[0] = (bf16)(w.x & 0xffffu); v[1] = (bf16)(w.x >> 16);
        v[2] = (bf16)(w.y & 0xffffu); v[3] = (bf16)(w.y >> 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = g * 4 + k < vocab ? x[g * 4 + k] : (bf16)0x7fc0;
    }
}

// The draw's score of logit v with Philox word `word`: z + g, z = v / T (v itself when `unit`),
// g = -ln(-ln(u)), u = ((word >> 8) + 0.5) * 2^-24.
__device__ __forceinline__ float gumbel_score(bf16 v, u32 word, float temperature, bool unit) {
    const float u = ((float)(word >> 8) + 0.5f) * 5.9604644775390625e-08f;
    const float z = unit ? bf2f(v) : bf2f(v) / temperature;
    return z - logf(-logf(u));
}

// One row's draw (block `row` of either entry point below).
__device__ __forceinline__ void sample_row(const bf16* __restrict__ logits, u32 row_stride,
                                           u32 rows, u32 vocab, float temperature, u32 top_k,
                                           float top_p, u32 seed_lo, u32 seed_hi, u32 iteration,
                                           const u32* __restrict__ sample_ids,
                                           const u32* __restrict__ steps,
                                           u32* __restrict__ tokens) {
    __shared__ u64 hist[256];
    __shared__ u64 res[4];
    __shared__ u64 red64[32];
    __shared__ float redf[32];
    __shared__ u32 redi[32];
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const bf16* x = logits + (u64)row * row_stride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

    const bool unit = temperature == 1.0f;  // z = logit exactly: the division is skipped
    const uint2 key = make_uint2(seed_lo, seed_hi);
    if (temperature > 0.0f && !(top_k > 0 && top_k < vocab) && !(top_p < 1.0f)) {
        // No top-k / top-p: the greedy fallback's argmax and the draw in one pass over the row
        // (the same token as the passes below would give: both maxima are order-free).
        const u32 sample = sample_ids[row], step = steps[row];
        const bool vec = (((u64)x) & 7u) == 0;
        u64 best = 0;
        float bs = NEG_INF_F;
        u32 bi = 0xffffffffu;
        for (u32 g = threadIdx.x; g * 4 < vocab; g += blockDim.x) {
            const uint4 r = philox4x32_10(make_uint4(g, step, sample, iteration), key);
            const u32 words[4] = {r.x, r.y, r.z, r.w};
            bf16 v[4];
            load_group4(x, g, vocab, vec, v);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 i = g * 4 + k;
                if (i >= vocab) break;
                const u32 kk = bf_key(v[k]);
                const u64 cand = ((u64)kk << 32) | (u64)(0xffffffffu - i);
                best = cand > best ? cand : best;
                if (kk < 1) continue;  // NaN is never drawn
                const float sc = gumbel_score(v[k], words[k], temperature, unit);
                if (sc > bs || (sc == bs && i < bi)) { bs = sc; bi = i; }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
            const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
            const u32 i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            if (s2 > bs || (s2 == bs && i2 < bi)) { bs = s2; bi = i2; }
        }
        if (lane == 0) { red64[warp] = best; redf[warp] = bs; redi[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 b = red64[0];
            float sb = redf[0];
            u32 ib = redi[0];
            for (int w = 1; w < nw; w++) {
                b = red64[w] > b ? red64[w] : b;
                if (redf[w] > sb || (redf[w] == sb && redi[w] < ib)) { sb = redf[w]; ib = redi[w]; }
            }
            tokens[row] = ib == 0xffffffffu ? 0xffffffffu - (u32)(b & 0xffffffffu) : ib;
        }
        return;
    }

    // Pass 1: the largest key, lowest index among equals.
    u64 best = 0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const u64 cand = ((u64)bf_key(x[i]) << 32) | (u64)(0xffffffffu - i);
        best = cand > best ? cand : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if (lane == 0) red64[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 b = red64[0];
        for (int w = 1; w < nw; w++) b = red64[w] > b ? red64[w] : b;
        res[2] = b;
    }
    __syncthreads();
    best = res[2];
    const u32 argmax = 0xffffffffu - (u32)(best & 0xffffffffu);
    if (!(temperature > 0.0f)) {
        if (threadIdx.x == 0) tokens[row] = argmax;
        return;
    }
    const float zmax = unit ? bf2f(x[argmax]) : bf2f(x[argmax]) / temperature;
    u32 kmin = 1;  // excludes NaN
    if (top_k > 0 && top_k < vocab)
        kmin = radix_select(x, vocab, kmin, (u64)top_k, false, zmax, temperature, hist, res);
    if (top_p < 1.0f) {
        // Z: the exact integer sum of the kept weights (fixed-order block reduction).
        u64 z = 0;
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
            if (bf_key(x[i]) >= kmin)
                z += __float2ull_rz(expf(bf2f(x[i]) / temperature - zmax) * 4294967296.0f);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
        __syncthreads();
        if (lane == 0) red64[warp] = z;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 t = 0;
            for (int w = 0; w < nw; w++) t += red64[w];
            u64 need = (u64)ceil((double)top_p * (double)t);
            res[3] = need > 0 ? need : 1;
        }
        __syncthreads();
        const u64 need = res[3];
        kmin = radix_select(x, vocab, kmin, need, true, zmax, temperature, hist, res);
    }

    // Gumbel-max draw over the kept set.
    const u32 sample = sample_ids[row], step = steps[row];
    float bs = NEG_INF_F;
    u32 bi = 0xffffffffu;
    for (u32 g = threadIdx.x; g * 4 < vocab; g += blockDim.x) {
        const uint4 r = philox4x32_10(make_uint4(g, step, sample, iteration), key);
        const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 i = g * 4 + k;
            if (i >= vocab) break;
            if (bf_key(x[i]) < kmin) continue;
            const float sc = gumbel_score(x[i], words[k], temperature, unit);
            if (sc > bs || (sc == bs && i < bi)) { bs = sc; bi = i; }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
        const u32 i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (s2 > bs || (s2 == bs && i2 < bi)) { bs = s2; bi = i2; }
    }
    if (lane == 0) { redf[warp] = bs; redi[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = redf[0];
        u32 i = redi[0];
        for (int w = 1; w < nw; w++)
            if (redf[w] > s || (redf[w] == s && redi[w] < i)) { s = redf[w]; i = redi[w]; }
        tokens[row] = i == 0xffffffffu ? argmax : i;
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_bf16(const bf16* __restrict__ logits, u32 row_stride, u32 rows, u32 vocab,
            float temperature, u32 top_k, float top_p, u32 seed_lo, u32 seed_hi, u32 iteration,
            const u32* __restrict__ sample_ids, const u32* __restrict__ steps,
            u32* __restrict__ tokens) {
    pdl_wait();
    sample_row(logits, row_stride, rows, vocab, temperature, top_k, top_p, seed_lo, seed_hi,
               iteration, sample_ids, steps, tokens);
}

// The same draw with (seed_lo, seed_hi, iteration) read from the device (`key[0..3]`), so that a
// captured CUDA graph serves every iteration.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_bf16_keyed(const bf16* __restrict__ logits, u32 row_stride, u32 rows, u32 vocab,
                  float temperature, u32 top_k, float top_p, const u32* __restrict__ key,
                  const u32* __restrict__ sample_ids, const u32* __restrict__ steps,
                  u32* __restrict__ tokens) {
    pdl_wait();
    sample_row(logits, row_stride, rows, vocab, temperature, top_k, top_p, key[0], key[1],
               key[2], sample_ids, steps, tokens);
}

// Order-preserving 32-bit key of a float that is not NaN (-0 keyed as +0, as `==` treats them).
__device__ __forceinline__ u32 f_key(float f) {
    const u32 x = __float_as_uint(f + 0.0f);
    return (x & 0x80000000u) ? ~x : (x | 0x80000000u);
}

// The draw of sample_row's plain path (temperature > 0, no top-k / top-p) and greedy rows
// (temperature <= 0), each row's vocabulary split over gridDim.x blocks of SPLIT_THREADS, so
// that a few rows still fill the GPU. Both maxima are order-free: the argmax as the largest
// (bf16 key, lowest index) pair, the draw as the largest (f_key(z + g), lowest index) pair
// (sample_row's `sc > bs || (sc == bs && i < bi)` order, NaN never drawn), so the tokens are
// bitwise sample_row's whatever the split. Block (split, row) takes Philox groups
// [split * per, (split + 1) * per) of its row and folds its two maxima into the row's scratch
// words with 64-bit atomicMax; the row's last block to count itself in (a third word) writes
// the token and sets the three words back to zero (zero before the launch, zero after it, so a
// CUDA graph replays it). (seed_lo, seed_hi, iteration) come from `key` when it is not null.
#define SPLIT_THREADS 256
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sample_split_bf16(const bf16* __restrict__ logits, u32 row_stride, u32 rows, u32 vocab,
                  float temperature, u32 seed_lo, u32 seed_hi, u32 iteration,
                  const u32* __restrict__ key, const u32* __restrict__ sample_ids,
                  const u32* __restrict__ steps, u32* __restrict__ tokens,
                  unsigned long long* __restrict__ scratch) {
    pdl_wait();
    const u32 row = blockIdx.y;
    if (row >= rows) return;
    if (key != nullptr) {
        seed_lo = key[0];
        seed_hi = key[1];
        iteration = key[2];
    }
    const bf16* x = logits + (u64)row * row_stride;
    const bool draw = temperature > 0.0f, unit = temperature == 1.0f;
    const uint2 k2 = make_uint2(seed_lo, seed_hi);
    const u32 sample = sample_ids[row], step = steps[row];
    const u32 ngroups = (vocab + 3) / 4, per = (ngroups + gridDim.x - 1) / gridDim.x;
    const u32 g0 = blockIdx.x * per, g1 = min(ngroups, g0 + per);
    const bool vec = (((u64)x) & 7u) == 0;
    u64 best = 0, drawn = 0;  // 0: nothing yet (every real candidate's key is above 0)
    for (u32 g = g0 + threadIdx.x; g < g1; g += SPLIT_THREADS) {
        bf16 v[4];
        load_group4(x, g, vocab, vec, v);
        uint4 r = make_uint4(0, 0, 0, 0);
        if (draw) r = philox4x32_10(make_uint4(g, step, sample, iteration), k2);
        const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 i = g * 4 + k;
            if (i >= vocab) break;
            const u32 kk = bf_key(v[k]);
            const u64 cand = ((u64)kk << 32) | (u64)(0xffffffffu - i);
            best = cand > best ? cand : best;
            if (!draw || kk < 1) continue;  // NaN is never drawn
            const float sc = gumbel_score(v[k], words[k], temperature, unit);
            // a -inf logit whose u rounds to 1 scores -inf - (-inf) = NaN: never drawn, as in
            // sample_row's compares (f_key would put NaN above +inf)
            if (isnan(sc)) continue;
            const u64 d = ((u64)f_key(sc) << 32) | (u64)(0xffffffffu - i);
            drawn = d > drawn ? d : drawn;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 b2 = __shfl_xor_sync(0xffffffffu, best, o);
        const u64 d2 = __shfl_xor_sync(0xffffffffu, drawn, o);
        best = b2 > best ? b2 : best;
        drawn = d2 > drawn ? d2 : drawn;
    }
    __shared__ u64 rb[SPLIT_THREADS / 32], rd[SPLIT_THREADS / 32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { rb[warp] = best; rd[warp] = drawn; }
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < SPLIT_THREADS / 32; w++) {
        best = rb[w] > best ? rb[w] : best;
        drawn = rd[w] > drawn ? rd[w] : drawn;
    }
    unsigned long long* s = scratch + 3 * (u64)row;
    atomicMax(s, (unsigned long long)best);
    if (draw) atomicMax(s + 1, (unsigned long long)drawn);
    __threadfence();  // the maxima land before the count
    if (atomicAdd(s + 2, 1ull) != gridDim.x - 1) return;
    __threadfence();
    const u64 b = atomicExch(s, 0ull), d = atomicExch(s + 1, 0ull);
    atomicExch(s + 2, 0ull);
    const u32 argmax = 0xffffffffu - (u32)(b & 0xffffffffu);
    tokens[row] = (!draw || d == 0) ? argmax : 0xffffffffu - (u32)(d & 0xffffffffu);
}
