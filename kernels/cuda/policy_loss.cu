// The GRPO / PPO-clip policy loss of runtime/src/train/loss.rs on the device: per token its
// gradient d loss / d logp (f32), and the loss metrics as order-fixed f64 sums. The ratio is each
// token's own, or (GSPO's sequence ratio) its sequence's, from the mean log-ratio that
// policy_loss_seq_ratio_f64 computes first.
//
// Numerics: the CPU computes every token in f64 from f32 inputs and rounds dlogp once to f32.
// Here every token runs the same f64 operations in the same order, each multiply and add an
// explicitly rounded intrinsic (no fused multiply-add), the clamps and the tie rules of torch's
// autograd written as the CPU writes them (Rust's f64::clamp; max/min split the gradient in
// half at exact ties), so dlogp is the CPU's bit for bit wherever exp() rounds as the host's
// libm does (CUDA's double exp is within 1 ulp; a difference in its last bit survives the f32
// rounding of dlogp about once in 2^29 tokens).
//
// Sequence ratio: one thread per sequence sums its counted rows' log-ratios serially in row order
// (the CPU's token order, cpu::seq_log_ratio), each load batch of PL_SEQ_CHUNK rows in flight
// before its adds, so the mean is the CPU's bit for bit and no function of the grid.
//
// Metrics: block b sums the terms of its PL_TOKENS_PER_BLOCK tokens (each thread its 4 tokens in
// order, then a fixed tree over the block's threads) into partial[b][PL_PARTS]; one block of
// policy_loss_reduce_f64 sums the partials (threads stride over blocks, then the same tree) and
// adds this call's totals into the accumulator. No atomics: two runs give the same bits.
//
// Layout of partial[b][k]: 0 pg, 1 kl, 2 clip_frac, 3 clip_frac_lower, 4 approx_kl,
// 5 entropy, 6 masked tokens, 7 tokens whose sequence index is out of range.
// Layout of acc[k] (the Rust side's ACC_* constants): 0 loss, 1 pg_loss, 2 kl, 3 clip_frac,
// 4 clip_frac_lower, 5 approx_kl, 6 entropy, 7 calls that carried entropy, 8 masked tokens,
// 9 calls, 10 calls whose masked tokens exceed the normaliser's, 11 calls whose per-sequence
// counts do not add up to their masked tokens, 12 tokens with an out-of-range sequence index,
// 13 sequences whose row span does not match their rows (sequence ratio only).

#define PL_THREADS 256
#define PL_PER_THREAD 4
#define PL_TOKENS_PER_BLOCK (PL_THREADS * PL_PER_THREAD)
#define PL_PARTS 8
#define PL_ACC 14
#define PL_SEQ_CHUNK 8

#define PL_LOG_RATIO_CLAMP 20.0
#define PL_K3_CLAMP 10.0

// Rust's f64::clamp (NaN stays NaN).
__device__ __forceinline__ double pl_clamp(double x, double lo, double hi) {
    if (x < lo) x = lo;
    if (x > hi) x = hi;
    return x;
}

struct PlVg {
    double v, g;
};

// max(x, y) with torch's gradient: ties split it in half.
__device__ __forceinline__ PlVg pl_max(double x, double dx, double y, double dy) {
    PlVg r;
    if (x > y) {
        r.v = x; r.g = dx;
    } else if (y > x) {
        r.v = y; r.g = dy;
    } else {
        r.v = x; r.g = __dmul_rn(0.5, __dadd_rn(dx, dy));
    }
    return r;
}

__device__ __forceinline__ PlVg pl_min(double x, double dx, double y, double dy) {
    PlVg r;
    if (x < y) {
        r.v = x; r.g = dx;
    } else if (y < x) {
        r.v = y; r.g = dy;
    } else {
        r.v = x; r.g = __dmul_rn(0.5, __dadd_rn(dx, dy));
    }
    return r;
}

// Sums v[k] over the block's threads in a fixed tree order into sh[k][0]. The caller writes
// sh[k][threadIdx.x] first; blockDim.x == PL_THREADS.
template <int K>
__device__ __forceinline__ void pl_tree(double (*sh)[PL_THREADS]) {
    __syncthreads();
#pragma unroll 1
    for (int stride = PL_THREADS / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) {
#pragma unroll
            for (int k = 0; k < K; ++k)
                sh[k][threadIdx.x] = __dadd_rn(sh[k][threadIdx.x], sh[k][threadIdx.x + stride]);
        }
        __syncthreads();
    }
}

// The sequence pass of the sequence ratio: thread s (blocks of PL_THREADS) writes lr[s], the
// mean of logp - old_logp over sequence s's counted rows (rows spans[2s] .. spans[2s + 1], in row
// order), and bad[s] = 0; a span that ends before it starts or past n, a row in it whose sequence
// index is not s, or a number of counted rows other than seq_tokens[s] gives lr[s] NaN and
// bad[s] = 1 (policy_loss_reduce_f64 counts them).
extern "C" __global__ void __launch_bounds__(PL_THREADS) policy_loss_seq_ratio_f64(
    double* __restrict__ lr, u32* __restrict__ bad, const float* __restrict__ logp,
    const float* __restrict__ old_logp, const unsigned char* __restrict__ mask,
    const u32* __restrict__ seq, const u32* __restrict__ seq_tokens,
    const u32* __restrict__ spans, u32 n, u32 n_seqs) {
    const u64 s = (u64)blockIdx.x * PL_THREADS + threadIdx.x;
    if (s >= n_seqs) return;
    const u64 first = spans[2 * s], end = spans[2 * s + 1];
    bool ok = first <= end && end <= n;
    double sum = 0.0;
    u32 counted = 0;
#pragma unroll 1
    for (u64 r0 = first; ok && r0 < end; r0 += PL_SEQ_CHUNK) {
        // the chunk's loads first, then its adds in row order
        double d[PL_SEQ_CHUNK];
        bool m[PL_SEQ_CHUNK];
#pragma unroll
        for (int j = 0; j < PL_SEQ_CHUNK; ++j) {
            const u64 r = r0 + j;
            m[j] = false;
            d[j] = 0.0;
            if (r < end) {
                m[j] = mask[r] != 0;
                d[j] = __dsub_rn((double)logp[r], (double)old_logp[r]);
                if (seq[r] != (u32)s) ok = false;
            }
        }
#pragma unroll
        for (int j = 0; j < PL_SEQ_CHUNK; ++j) {
            if (m[j]) {
                sum = __dadd_rn(sum, d[j]);
                ++counted;
            }
        }
    }
    ok = ok && counted == seq_tokens[s];
    const double inv_len = counted == 0 ? 0.0 : __ddiv_rn(1.0, (double)counted);
    lr[s] = ok ? __dmul_rn(sum, inv_len) : __longlong_as_double(0x7ff8000000000000LL);
    bad[s] = ok ? 0u : 1u;
}

// One thread per token slot (PL_PER_THREAD tokens each, PL_THREADS apart), blocks of
// PL_THREADS covering PL_TOKENS_PER_BLOCK consecutive tokens.
//   est: 1 k1, 2 k2, 3 k3.  agg: 0 token_mean, 1 seq_mean_token_mean, 2 seq_mean_token_sum.
//   lo = 1 - clip_low, hi = 1 + clip_high (rounded on the host as the CPU rounds them).
//   ref_logp, entropy: null when absent. seq_lr: null for each token's own ratio, else the
//   sequence ratio's per-sequence mean log-ratio (policy_loss_seq_ratio_f64). Masked-out tokens
//   get dlogp 0; a token whose sequence index is not below n_seqs gets NaN and is counted in
//   partial slot 7.
extern "C" __global__ void __launch_bounds__(PL_THREADS) policy_loss_f32(
    float* __restrict__ dlogp, double* __restrict__ partial, const float* __restrict__ logp,
    const float* __restrict__ old_logp, const float* __restrict__ ref_logp,
    const float* __restrict__ adv, const unsigned char* __restrict__ mask,
    const float* __restrict__ entropy, const u32* __restrict__ seq,
    const u32* __restrict__ seq_tokens, const double* __restrict__ seq_lr, u32 n, u32 n_seqs,
    double lo, double hi, u32 has_dual, double dual_c, double kl_coef, u32 est, u32 agg,
    double inv_tokens, double inv_seqs) {
    __shared__ double sh[PL_PARTS][PL_THREADS];
    double acc[PL_PARTS];
#pragma unroll
    for (int k = 0; k < PL_PARTS; ++k) acc[k] = 0.0;
    const u64 base = (u64)blockIdx.x * PL_TOKENS_PER_BLOCK + threadIdx.x;
#pragma unroll 1
    for (int j = 0; j < PL_PER_THREAD; ++j) {
        const u64 t = base + (u64)j * PL_THREADS;
        if (t >= n) break;
        const u32 s = seq[t];
        if (s >= n_seqs) {
            dlogp[t] = __int_as_float(0x7fc00000);  // quiet NaN
            acc[7] = __dadd_rn(acc[7], 1.0);
            continue;
        }
        if (mask[t] == 0) {
            dlogp[t] = 0.0f;
            continue;
        }
        // weight of one masked token of sequence s in the aggregate
        double w;
        if (agg == 0) {
            w = inv_tokens;
        } else if (agg == 1) {
            const u32 len = seq_tokens[s];
            const double inv_len = len == 0 ? 0.0 : __ddiv_rn(1.0, (double)len);
            w = __dmul_rn(inv_len, inv_seqs);
        } else {
            w = inv_seqs;
        }
        const double lp = (double)logp[t], old = (double)old_logp[t], a = (double)adv[t];
        // ratio and the clipped surrogate: of the token's own log-ratio, or of its sequence's
        // mean (whose derivative w.r.t. this token's logp is taken as 1, GSPO-token)
        const double own = __dsub_rn(lp, old);
        const double raw = seq_lr != nullptr ? seq_lr[s] : own;
        const double log_ratio = pl_clamp(raw, -PL_LOG_RATIO_CLAMP, PL_LOG_RATIO_CLAMP);
        const double dlog_ratio = fabs(raw) <= PL_LOG_RATIO_CLAMP ? 1.0 : 0.0;
        const double ratio = exp(log_ratio);
        const double dratio = __dmul_rn(ratio, dlog_ratio);
        const double clamped = pl_clamp(ratio, lo, hi);
        const double dclamped = (ratio >= lo && ratio <= hi) ? 1.0 : 0.0;
        const double na = -a;
        const double l1 = __dmul_rn(na, ratio);
        const double l2 = __dmul_rn(na, clamped);
        const double d1 = __dmul_rn(na, dratio);
        const double d2 = __dmul_rn(__dmul_rn(na, dclamped), dratio);
        PlVg pg = pl_max(l1, d1, l2, d2);
        const bool clipped = l2 > l1;
        bool clipped_lower = false;
        if (has_dual && a < 0.0) {
            const double l3 = __dmul_rn(na, dual_c);
            clipped_lower = pg.v > l3;
            pg = pl_min(l3, 0.0, pg.v, pg.g);
        }
        // KL to the reference
        double kl = 0.0, dkl = 0.0;
        if (ref_logp != nullptr) {
            const double r = (double)ref_logp[t];
            if (est == 1) {
                kl = __dsub_rn(lp, r);
                dkl = 1.0;
            } else if (est == 2) {
                const double d = __dsub_rn(lp, r);
                kl = __dmul_rn(__dmul_rn(0.5, d), d);
                dkl = d;
            } else {
                const double raw3 = __dsub_rn(r, lp);
                const double x = pl_clamp(raw3, -PL_LOG_RATIO_CLAMP, PL_LOG_RATIO_CLAMP);
                const double dx = fabs(raw3) <= PL_LOG_RATIO_CLAMP ? -1.0 : 0.0;
                const double e = exp(x);
                const double v = __dsub_rn(__dsub_rn(e, x), 1.0);
                const double dv = __dmul_rn(__dsub_rn(e, 1.0), dx);
                kl = pl_clamp(v, -PL_K3_CLAMP, PL_K3_CLAMP);
                dkl = fabs(v) <= PL_K3_CLAMP ? dv : 0.0;
            }
        }
        dlogp[t] = __double2float_rn(__dmul_rn(w, __dadd_rn(pg.g, __dmul_rn(kl_coef, dkl))));
        acc[0] = __dadd_rn(acc[0], __dmul_rn(w, pg.v));
        acc[1] = __dadd_rn(acc[1], __dmul_rn(w, kl));
        acc[2] = __dadd_rn(acc[2], __dmul_rn(inv_tokens, clipped ? 1.0 : 0.0));
        acc[3] = __dadd_rn(acc[3], __dmul_rn(inv_tokens, clipped_lower ? 1.0 : 0.0));
        acc[4] = __dadd_rn(acc[4], __dmul_rn(inv_tokens, -pl_clamp(own, -PL_LOG_RATIO_CLAMP,
                                                                   PL_LOG_RATIO_CLAMP)));
        if (entropy != nullptr) acc[5] = __dadd_rn(acc[5], __dmul_rn(w, (double)entropy[t]));
        acc[6] = __dadd_rn(acc[6], 1.0);
    }
#pragma unroll
    for (int k = 0; k < PL_PARTS; ++k) sh[k][threadIdx.x] = acc[k];
    pl_tree<PL_PARTS>(sh);
    if (threadIdx.x < PL_PARTS) partial[(u64)blockIdx.x * PL_PARTS + threadIdx.x] = sh[threadIdx.x][0];
}

// One block of PL_THREADS: sums the n_blocks partials of policy_loss_f32, the n_seqs
// per-sequence counts and (seq_bad: null for token ratios) the sequence pass's flags, then adds
// this call's totals into acc (layout at the top). loss is pg + kl_coef * kl, as the CPU forms it
// per call.
extern "C" __global__ void __launch_bounds__(PL_THREADS) policy_loss_reduce_f64(
    double* __restrict__ acc, const double* __restrict__ partial, u32 n_blocks,
    const u32* __restrict__ seq_tokens, const u32* __restrict__ seq_bad, u32 n_seqs,
    double kl_coef, u32 has_entropy, double norm_tokens) {
    __shared__ double sh[PL_PARTS + 2][PL_THREADS];
    double v[PL_PARTS + 2];
#pragma unroll
    for (int k = 0; k < PL_PARTS + 2; ++k) v[k] = 0.0;
#pragma unroll 1
    for (u32 b = threadIdx.x; b < n_blocks; b += PL_THREADS) {
#pragma unroll
        for (int k = 0; k < PL_PARTS; ++k)
            v[k] = __dadd_rn(v[k], partial[(u64)b * PL_PARTS + k]);
    }
#pragma unroll 1
    for (u32 s = threadIdx.x; s < n_seqs; s += PL_THREADS) {
        v[PL_PARTS] = __dadd_rn(v[PL_PARTS], (double)seq_tokens[s]);
        if (seq_bad != nullptr) v[PL_PARTS + 1] = __dadd_rn(v[PL_PARTS + 1], (double)seq_bad[s]);
    }
#pragma unroll
    for (int k = 0; k < PL_PARTS + 2; ++k) sh[k][threadIdx.x] = v[k];
    pl_tree<PL_PARTS + 2>(sh);
    if (threadIdx.x != 0) return;
    const double pg = sh[0][0], kl = sh[1][0], masked = sh[6][0], bad = sh[7][0];
    const double counted = sh[PL_PARTS][0];
    acc[0] = __dadd_rn(acc[0], __dadd_rn(pg, __dmul_rn(kl_coef, kl)));
    acc[1] = __dadd_rn(acc[1], pg);
    acc[2] = __dadd_rn(acc[2], kl);
    acc[3] = __dadd_rn(acc[3], sh[2][0]);
    acc[4] = __dadd_rn(acc[4], sh[3][0]);
    acc[5] = __dadd_rn(acc[5], sh[4][0]);
    if (has_entropy) {
        acc[6] = __dadd_rn(acc[6], sh[5][0]);
        acc[7] = __dadd_rn(acc[7], 1.0);
    }
    acc[8] = __dadd_rn(acc[8], masked);
    acc[9] = __dadd_rn(acc[9], 1.0);
    if (masked > norm_tokens) acc[10] = __dadd_rn(acc[10], 1.0);
    if (counted != masked) acc[11] = __dadd_rn(acc[11], 1.0);
    acc[12] = __dadd_rn(acc[12], bad);
    acc[13] = __dadd_rn(acc[13], sh[PL_PARTS + 1][0]);
}
