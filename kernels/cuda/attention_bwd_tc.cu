// Attention backward on the tensor cores (FlashAttention-2 style): the same results and argument
// conventions as attention_bwd.cu (the SIMT twin of crate::cpu::attention_bwd) up to the bf16
// rounding of P and dS before their MMAs. Probabilities are recomputed from the forward's
// natural-log LSE: P = exp2(S * scale*log2(e) - lse*log2(e)), dS = P (dP - D), D_i = dout_i . out_i
// (precomputed in fp32 by attention_bwd_tc_prep). Launches:
//   attention_bwd_tc_prep     one warp per (query row, head): D; zeros dq rows no sequence owns;
//   attention_bwd_tc_zero_kv  one warp per (key row, kv head): zeros dk / dv rows no sequence owns;
//   attention_bwd_tc_dq_bf16  query-centric: a block owns BT queries of (sequence, head), loops over
//                             the K/V tiles (prefix keys then own keys, ascending): dq += dS K;
//   attention_bwd_tc_dkv_bf16 key-centric: a block owns BT own keys of (sequence, kv head) and a
//                             slice of the group's query heads (hsplit slices), loops over those
//                             heads, then the query tiles, ascending: dv += P^T dout, dk += dS^T q;
//   attention_bwd_tc_dkv_reduce (hsplit > 1) sums the slices' fp32 partials in slice order;
//   attention_bwd_tc_dprefix_f32 key-centric over the shared-prefix buffer: a block owns BT prefix
//                             rows of a kv head and one of nsplit chunks of the (sequence, head,
//                             query tile) items that reach them; adds dprefix_k/v in fp32;
//   attention_bwd_tc_dprefix_reduce (nsplit > 1) adds the chunks' fp32 partials in chunk order.
// (The SIMT attention_bwd_dprefix_f32 in attention_bwd.cu computes the same prefix gradients.)
// Every sum runs in a fixed order (tile loops ascending, MMAs in fixed k order, no atomics), so
// the result depends only on the inputs and launch arguments. 4 warps per block, each 16 rows of
// the block's tile; S/dP (and S^T/dP^T) in fp32 registers from mma.sync m16n8k16 (bf16 in, fp32
// accumulate); the accumulator layout of S is the A operand layout of the next MMA (as in
// attention_fwd_tc_bf16). Tiles stream through a 2-stage cp.async pipeline in dynamic shared
// memory. A row written by two descriptors is written by the first valid one only (its owner),
// as in the SIMT kernels.
//
// HEAD_DIM is a compile-time constant (-DHEAD_DIM=...), a multiple of 32 (64 and 128 are tested).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define BT 64                  // rows per tile (queries or keys): 4 warps x 16
#define BPAD 8                 // bf16 padding per shared row (16 bytes) against bank conflicts
#define BROW (HEAD_DIM + BPAD)  // shared row, in bf16
#define BNT 128                // threads per block

static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32");
static_assert((BT * (HEAD_DIM / 8)) % BNT == 0, "a tile must split evenly over the block");

// The descriptor fits the buffers (the SIMT kernels' bwd_seq_ok).
__device__ __forceinline__ bool tc_seq_ok(const AttnSeq& s, u32 q_rows, u32 kv_rows, u32 p_rows) {
    return (u64)s.q_start + s.q_len <= q_rows && (u64)s.k_start + s.k_len <= kv_rows &&
           (u64)s.p_start + s.p_len <= p_rows && s.q_len <= s.k_len;
}
// The first valid sequence whose queries (keys) hold row i, or -1.
__device__ __forceinline__ int tc_q_owner(const AttnSeq* seqs, u32 n_seqs, u32 i, u32 q_rows,
                                          u32 kv_rows, u32 p_rows) {
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (tc_seq_ok(s, q_rows, kv_rows, p_rows) && i >= s.q_start && i < s.q_start + s.q_len)
            return (int)si;
    }
    return -1;
}
__device__ __forceinline__ int tc_k_owner(const AttnSeq* seqs, u32 n_seqs, u32 j, u32 q_rows,
                                          u32 kv_rows, u32 p_rows) {
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (tc_seq_ok(s, q_rows, kv_rows, p_rows) && j >= s.k_start && j < s.k_start + s.k_len)
            return (int)si;
    }
    return -1;
}

// D[i * n_heads + h] = dout_i . out_i over head h (fp32, 0 for rows no sequence owns); zeros
// the dq row-heads no sequence owns (dq may be null: D only, for the prefix part run alone).
// One warp per (row, head), 4 warps per block.
extern "C" __global__ void attention_bwd_tc_prep(float* __restrict__ dsum, bf16* __restrict__ dq,
                                                 const bf16* __restrict__ dout,
                                                 const bf16* __restrict__ out,
                                                 const AttnSeq* __restrict__ seqs, u32 n_seqs,
                                                 u32 q_rows, u32 kv_rows, u32 p_rows,
                                                 u32 n_heads, u32 q_stride, u32 out_stride) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)q_rows * n_heads) return;  // warp-uniform
    const u32 i = (u32)(w / n_heads), h = (u32)(w % n_heads);
    float acc = 0.0f;
    if (tc_q_owner(seqs, n_seqs, i, q_rows, kv_rows, p_rows) >= 0) {
        const bf16* a = dout + (u64)i * out_stride + h * HEAD_DIM;
        const bf16* b = out + (u64)i * out_stride + h * HEAD_DIM;
        for (u32 e = lane; e < HEAD_DIM; e += 32) acc += bf2f(a[e]) * bf2f(b[e]);
        acc = warp_sum(acc);
    } else if (dq != nullptr) {
        bf16* o = dq + (u64)i * q_stride + h * HEAD_DIM;
        for (u32 e = lane; e < HEAD_DIM; e += 32) o[e] = (bf16)0;
    }
    if (lane == 0) dsum[w] = acc;
}

// Zeros the dk / dv row-heads no sequence owns. One warp per (key row, kv head).
extern "C" __global__ void attention_bwd_tc_zero_kv(bf16* __restrict__ dk, bf16* __restrict__ dv,
                                                    const AttnSeq* __restrict__ seqs, u32 n_seqs,
                                                    u32 q_rows, u32 kv_rows, u32 p_rows,
                                                    u32 n_kv, u32 kv_stride) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)kv_rows * n_kv) return;
    const u32 j = (u32)(w / n_kv), g = (u32)(w % n_kv);
    if (tc_k_owner(seqs, n_seqs, j, q_rows, kv_rows, p_rows) >= 0) return;
    const u64 o = (u64)j * kv_stride + g * HEAD_DIM;
    for (u32 e = lane; e < HEAD_DIM; e += 32) {
        dk[o + e] = (bf16)0;
        dv[o + e] = (bf16)0;
    }
}

// dq. Grid (x, n_heads, n_seqs), block BNT: block (x, h, z) takes query tiles x, x + gridDim.x,
// ... of sequence z, counted from the last (the longest under a causal mask). Each warp holds
// its 16 query rows of q and dout as A fragments; per K/V tile of BT logical keys (prefix keys
// then own keys): S = q K^T, dP = dout V^T, dS = P (dP - D), dq += dS K. dq = scale * the sum.
extern "C" __global__ void __launch_bounds__(BNT)
attention_bwd_tc_dq_bf16(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                         const bf16* __restrict__ q, const bf16* __restrict__ k,
                         const bf16* __restrict__ v, const bf16* __restrict__ pk,
                         const bf16* __restrict__ pv, const float* __restrict__ lse,
                         const float* __restrict__ dsum, const AttnSeq* __restrict__ seqs,
                         u32 n_seqs, u32 q_rows, u32 kv_rows, u32 p_rows, u32 n_heads, u32 n_kv,
                         u32 q_stride, u32 kv_stride, u32 p_stride, u32 out_stride, u32 causal,
                         float scale) {
    constexpr int KSTEPS = HEAD_DIM / 16;
    constexpr int DT = HEAD_DIM / 8;
    constexpr int VPR = HEAD_DIM / 8;      // 16-byte chunks per row
    constexpr u32 TILE = BT * BROW * 2;    // bytes of one K (or V) tile
    extern __shared__ __align__(16) unsigned char dsmem[];
    const u32 z = blockIdx.z;
    const AttnSeq s = seqs[z];
    if (!tc_seq_ok(s, q_rows, kv_rows, p_rows)) return;
    const u32 h = blockIdx.y, kvh = h / (n_heads / n_kv);
    const u32 L = s.p_len + s.k_len;
    const u32 off = L - s.q_len;  // logical index of query 0's own key
    const u32 n_qt = (s.q_len + BT - 1) / BT;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 base = smem_u32(dsmem);  // stage st: K at base + 2*st*TILE, V right after
    const float scale_log2 = scale * LOG2E_F;

    for (u32 ti = blockIdx.x; ti < n_qt; ti += gridDim.x) {
        const u32 q0 = (n_qt - 1 - ti) * BT;
        const u32 q_end = min(s.q_len, q0 + BT);
        const u32 kend = causal ? off + q_end : L;  // keys any row of the tile sees
        const u32 ntiles = (kend + BT - 1) / BT;
        const u32 r0 = q0 + warp * 16;
        const bool w_active = r0 < s.q_len;
        const u32 w_kend = !w_active ? 0 : (causal ? off + min(r0 + 16, s.q_len) : L);
        const u32 ia = r0 + g, ib = ia + 8;
        const bool va = ia < s.q_len, vb = ib < s.q_len;
        const u32 lim_a = causal ? min(off + ia + 1, L) : L;
        const u32 lim_b = causal ? min(off + ib + 1, L) : L;
        const u64 ra = (u64)s.q_start + (va ? ia : 0), rb = (u64)s.q_start + (vb ? ib : 0);
        const bf16* qa = q + ra * q_stride + h * HEAD_DIM;
        const bf16* qb = q + rb * q_stride + h * HEAD_DIM;
        const bf16* da = dout + ra * out_stride + h * HEAD_DIM;
        const bf16* db = dout + rb * out_stride + h * HEAD_DIM;
        u32 qf[KSTEPS][4], df[KSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            qf[kk][0] = va ? *(const u32*)(qa + 16 * kk + 2 * t) : 0u;
            qf[kk][1] = vb ? *(const u32*)(qb + 16 * kk + 2 * t) : 0u;
            qf[kk][2] = va ? *(const u32*)(qa + 16 * kk + 8 + 2 * t) : 0u;
            qf[kk][3] = vb ? *(const u32*)(qb + 16 * kk + 8 + 2 * t) : 0u;
            df[kk][0] = va ? *(const u32*)(da + 16 * kk + 2 * t) : 0u;
            df[kk][1] = vb ? *(const u32*)(db + 16 * kk + 2 * t) : 0u;
            df[kk][2] = va ? *(const u32*)(da + 16 * kk + 8 + 2 * t) : 0u;
            df[kk][3] = vb ? *(const u32*)(db + 16 * kk + 8 + 2 * t) : 0u;
        }
        const float la = va ? lse[ra * n_heads + h] * LOG2E_F : 0.0f;
        const float lb = vb ? lse[rb * n_heads + h] * LOG2E_F : 0.0f;
        const float Da = va ? dsum[ra * n_heads + h] : 0.0f;
        const float Db = vb ? dsum[rb * n_heads + h] : 0.0f;

        const KeyRows<HEAD_DIM, BNT> rows(pk, pv, p_stride, k, v, kv_stride, s, kvh);
        auto issue = [&](u32 it) {
            const u32 ks = base + (it & 1) * 2 * TILE;
            rows.copy_tile<BT, BROW>(ks, ks + TILE, it * BT, kend);
        };

        float acc[DT][4];
#pragma unroll
        for (int j = 0; j < DT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

        __syncthreads();  // the previous query tile's last reads of the stages are done
        if (ntiles > 0) issue(0);
        cp_async_commit();
        for (u32 it = 0; it < ntiles; it++) {
            if (it + 1 < ntiles) issue(it + 1);
            cp_async_commit();
            cp_async_wait1();  // tile `it` landed (this thread's copies) ...
            __syncthreads();   // ... and everyone's
            const u32 t0 = it * BT;
            if (t0 < w_kend) {  // warp-uniform
                const u32 ks = base + (it & 1) * 2 * TILE, vs = ks + TILE;
                float sc[BT / 8][4], dp[BT / 8][4];
#pragma unroll
                for (int j = 0; j < BT / 8; j++) {
                    sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
                    dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
                    const u32 row = 8 * j + (lane & 7);
#pragma unroll
                    for (int kk = 0; kk < KSTEPS; kk += 2) {
                        const u32 so = (row * BROW + 16 * kk + 8 * (lane >> 3)) * 2;
                        u32 b0, b1, b2, b3;
                        ldsm_x4(ks + so, b0, b1, b2, b3);
                        mma16(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                        mma16(sc[j], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], b2, b3);
                        ldsm_x4(vs + so, b0, b1, b2, b3);
                        mma16(dp[j], df[kk][0], df[kk][1], df[kk][2], df[kk][3], b0, b1);
                        mma16(dp[j], df[kk + 1][0], df[kk + 1][1], df[kk + 1][2], df[kk + 1][3], b2, b3);
                    }
                }
                // dS (in sc): rows A = ia (elements 0, 1), B = ib (2, 3); keys 8j + 2t (+1)
#pragma unroll
                for (int j = 0; j < BT / 8; j++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const u32 kk = t0 + 8 * j + 2 * t + (e & 1);
                        const bool ok = e < 2 ? (va && kk < lim_a) : (vb && kk < lim_b);
                        const float p = ok ? ex2(sc[j][e] * scale_log2 - (e < 2 ? la : lb)) : 0.0f;
                        sc[j][e] = p * (dp[j][e] - (e < 2 ? Da : Db));
                    }
                }
                // dq += dS K: BT/16 k-steps of 16 keys, DT n-tiles of 8 dims (two per ldmatrix)
#pragma unroll
                for (int kk2 = 0; kk2 < BT / 16; kk2++) {
                    const u32 a0 = pack_bf2(sc[2 * kk2][0], sc[2 * kk2][1]);
                    const u32 a1 = pack_bf2(sc[2 * kk2][2], sc[2 * kk2][3]);
                    const u32 a2 = pack_bf2(sc[2 * kk2 + 1][0], sc[2 * kk2 + 1][1]);
                    const u32 a3 = pack_bf2(sc[2 * kk2 + 1][2], sc[2 * kk2 + 1][3]);
                    const u32 row = 16 * kk2 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
                    for (int jd = 0; jd < DT; jd += 2) {
                        u32 b0, b1, b2, b3;
                        const u32 col = 8 * (jd + (lane >> 4));
                        ldsm_x4_t(ks + (row * BROW + col) * 2, b0, b1, b2, b3);
                        mma16(acc[jd], a0, a1, a2, a3, b0, b1);
                        mma16(acc[jd + 1], a0, a1, a2, a3, b2, b3);
                    }
                }
            }
            __syncthreads();  // stage `it & 1` is refilled by the next iteration's issue
        }
        cp_async_wait0();
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const bool ok = half ? vb : va;
            if (!ok) continue;
            const u32 i = s.q_start + (half ? ib : ia);
            if (tc_q_owner(seqs, n_seqs, i, q_rows, kv_rows, p_rows) != (int)z) continue;
            bf16* orow = dq + (u64)i * q_stride + h * HEAD_DIM;
#pragma unroll
            for (int jd = 0; jd < DT; jd++)
                *(u32*)(orow + 8 * jd + 2 * t) =
                    pack_bf2(acc[jd][2 * half] * scale, acc[jd][2 * half + 1] * scale);
        }
    }  // query tiles
}

// ---- key-centric machinery (attention_bwd_tc_dkv_bf16 and attention_bwd_tc_dprefix_f32) ----
// Shared memory of a key-centric block: the K tile at byte 0, the V tile at TC_TILE, then two
// stages of TC_STAGE bytes (q tile, dout tile, BT floats lse * log2(e), BT floats D).
constexpr int TC_KSTEPS = HEAD_DIM / 16;  // k-steps of 16 dims
constexpr int TC_DT = HEAD_DIM / 8;       // n-tiles of 8 dims (accumulator columns)
constexpr int TC_VPR = HEAD_DIM / 8;      // 16-byte chunks per row
constexpr u32 TC_TILE = BT * BROW * 2;    // bytes of one shared tile
constexpr u32 TC_STAGE = 2 * TC_TILE + 2 * BT * 4;

// Issues (cp.async, not committed) the copies of key rows k0 .. k0 + BT - 1 of K and V, head kvh,
// into the shared tiles at ks and vs: tile row r is global row row_base + k0 + r when
// k0 + r < k_end, else zeros.
__device__ __forceinline__ void tc_load_keys(u32 ks, u32 vs, const bf16* __restrict__ k,
                                             const bf16* __restrict__ v, u32 row_base, u32 k0,
                                             u32 k_end, u32 stride, u32 kvh) {
#pragma unroll
    for (int i = 0; i < BT * TC_VPR / BNT; i++) {
        const u32 c = threadIdx.x + BNT * i, row = c / TC_VPR, col = c % TC_VPR, kj = k0 + row;
        const bool valid = kj < k_end;
        const u64 o = valid ? (u64)(row_base + kj) * stride + kvh * HEAD_DIM + col * 8 : 0;
        const u32 so = (row * BROW + col * 8) * 2;
        cp_async16(ks + so, k + o, valid);
        cp_async16(vs + so, v + o, valid);
    }
}

// Fills the stage at shared address sb (generic address of its float part: fl) with query rows
// q0 .. q0 + BT - 1 of a sequence whose queries are rows q_start .. q_start + q_len - 1 (zeros
// past q_len), head h: q and dout by cp.async (not committed), lse * log2(e) and D into
// fl[0 .. BT) and fl[BT .. 2 BT) by plain stores (read after a __syncthreads).
__device__ __forceinline__ void tc_issue_queries(u32 sb, float* fl, const bf16* __restrict__ q,
                                                 const bf16* __restrict__ dout,
                                                 const float* __restrict__ lse,
                                                 const float* __restrict__ dsum, u32 q_start,
                                                 u32 q_len, u32 q0, u32 h, u32 n_heads,
                                                 u32 q_stride, u32 out_stride) {
#pragma unroll
    for (int i = 0; i < BT * TC_VPR / BNT; i++) {
        const u32 c = threadIdx.x + BNT * i, row = c / TC_VPR, col = c % TC_VPR, qi = q0 + row;
        const bool valid = qi < q_len;
        const u64 r = (u64)q_start + (valid ? qi : 0);
        const u32 so = (row * BROW + col * 8) * 2;
        cp_async16(sb + so, q + r * q_stride + h * HEAD_DIM + col * 8, valid);
        cp_async16(sb + TC_TILE + so, dout + r * out_stride + h * HEAD_DIM + col * 8, valid);
    }
    if (threadIdx.x < BT) {
        const u32 qi = q0 + threadIdx.x;
        const bool valid = qi < q_len;
        const u64 li = ((u64)q_start + (valid ? qi : 0)) * n_heads + h;
        fl[threadIdx.x] = valid ? lse[li] * LOG2E_F : 0.0f;
        fl[BT + threadIdx.x] = valid ? dsum[li] : 0.0f;
    }
}

// One query tile's share of a key-centric block's gradients, for this warp's 16 keys (K tile at
// ks, V tile at vs; the lane's accumulator rows are keys ka and kb = ka + 8, in the caller's
// numbering) against the stage at qs (q; dout at qs + TC_TILE; fl: lse * log2(e), then D, of
// queries q0 .. q0 + BT - 1): S^T = K q^T, dP^T = V dout^T, P^T = exp2(S^T scale_log2 - lse)
// where ok(key, query) and 0 elsewhere, dS^T = P^T (dP^T - D); adv += P^T dout, adk += dS^T q
// (unscaled). Warp-synchronous: every lane of the warp calls it.
template <class Ok>
__device__ __forceinline__ void tc_keys_step(u32 ks, u32 vs, u32 qs, const float* fl, u32 ka,
                                             u32 kb, u32 q0, float scale_log2, Ok ok,
                                             float (&adk)[TC_DT][4], float (&adv)[TC_DT][4]) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const u32 ds = qs + TC_TILE;
    float sc[BT / 8][4], dp[BT / 8][4];
#pragma unroll
    for (int j = 0; j < BT / 8; j++) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < TC_KSTEPS; kk += 2) {
        // A fragments of this warp's 16 keys (K and V), dims 16kk.. and 16(kk+1)..
        const u32 ao = ((warp * 16 + (lane & 15)) * BROW + 16 * kk + 8 * (lane >> 4)) * 2;
        u32 k0a, k1a, k2a, k3a, k0b, k1b, k2b, k3b;
        u32 v0a, v1a, v2a, v3a, v0b, v1b, v2b, v3b;
        ldsm_x4(ks + ao, k0a, k1a, k2a, k3a);
        ldsm_x4(ks + ao + 32, k0b, k1b, k2b, k3b);
        ldsm_x4(vs + ao, v0a, v1a, v2a, v3a);
        ldsm_x4(vs + ao + 32, v0b, v1b, v2b, v3b);
#pragma unroll
        for (int j = 0; j < BT / 8; j++) {
            const u32 so = ((8 * j + (lane & 7)) * BROW + 16 * kk + 8 * (lane >> 3)) * 2;
            u32 b0, b1, b2, b3;
            ldsm_x4(qs + so, b0, b1, b2, b3);
            mma16(sc[j], k0a, k1a, k2a, k3a, b0, b1);
            mma16(sc[j], k0b, k1b, k2b, k3b, b2, b3);
            ldsm_x4(ds + so, b0, b1, b2, b3);
            mma16(dp[j], v0a, v1a, v2a, v3a, b0, b1);
            mma16(dp[j], v0b, v1b, v2b, v3b, b2, b3);
        }
    }
    // P^T (in sc) and dS^T (in dp): rows = keys ka (elements 0, 1), kb (2, 3);
    // columns = queries q0 + 8j + 2t (+1)
#pragma unroll
    for (int j = 0; j < BT / 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const u32 kj = e < 2 ? ka : kb;
            const u32 c = 8 * j + 2 * t + (e & 1), qi = q0 + c;
            const float p = ok(kj, qi) ? ex2(sc[j][e] * scale_log2 - fl[c]) : 0.0f;
            sc[j][e] = p;
            dp[j][e] = p * (dp[j][e] - fl[BT + c]);
        }
    }
    // dv += P^T dout, dk += dS^T q: BT/16 k-steps of 16 queries, TC_DT n-tiles of 8 dims
#pragma unroll
    for (int kk2 = 0; kk2 < BT / 16; kk2++) {
        const u32 p0 = pack_bf2(sc[2 * kk2][0], sc[2 * kk2][1]);
        const u32 p1 = pack_bf2(sc[2 * kk2][2], sc[2 * kk2][3]);
        const u32 p2 = pack_bf2(sc[2 * kk2 + 1][0], sc[2 * kk2 + 1][1]);
        const u32 p3 = pack_bf2(sc[2 * kk2 + 1][2], sc[2 * kk2 + 1][3]);
        const u32 d0_ = pack_bf2(dp[2 * kk2][0], dp[2 * kk2][1]);
        const u32 d1_ = pack_bf2(dp[2 * kk2][2], dp[2 * kk2][3]);
        const u32 d2_ = pack_bf2(dp[2 * kk2 + 1][0], dp[2 * kk2 + 1][1]);
        const u32 d3_ = pack_bf2(dp[2 * kk2 + 1][2], dp[2 * kk2 + 1][3]);
        const u32 row = 16 * kk2 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
        for (int jd = 0; jd < TC_DT; jd += 2) {
            u32 b0, b1, b2, b3;
            const u32 so = (row * BROW + 8 * (jd + (lane >> 4))) * 2;
            ldsm_x4_t(ds + so, b0, b1, b2, b3);
            mma16(adv[jd], p0, p1, p2, p3, b0, b1);
            mma16(adv[jd + 1], p0, p1, p2, p3, b2, b3);
            ldsm_x4_t(qs + so, b0, b1, b2, b3);
            mma16(adk[jd], d0_, d1_, d2_, d3_, b0, b1);
            mma16(adk[jd + 1], d0_, d1_, d2_, d3_, b2, b3);
        }
    }
}

// dk, dv of own keys. Grid (x, n_kv * hsplit, n_seqs), block BNT: block (x, y, z) takes key
// tiles x, x + gridDim.x, ... of sequence z (tile 0, the longest under a causal mask, first) for
// kv head g = y / hsplit and the y % hsplit-th of hsplit equal slices of the group's query heads.
// K and V of the tile stay in shared memory; each warp owns 16 keys. For each query head of the
// slice (ascending), each query tile that sees a key of the tile (ascending): S^T = K q^T,
// dP^T = V dout^T, P^T, dS^T = P^T (dP^T - D); dv += P^T dout, dk += dS^T q. hsplit == 1: writes
// dk = scale * the sum and dv (bf16); else the fp32 sums go to part (dk slices, then dv slices,
// each [hsplit][kv_rows][n_kv][HEAD_DIM]) for attention_bwd_tc_dkv_reduce.
extern "C" __global__ void __launch_bounds__(BNT)
attention_bwd_tc_dkv_bf16(bf16* __restrict__ dk, bf16* __restrict__ dv,
                          const bf16* __restrict__ dout, const bf16* __restrict__ q,
                          const bf16* __restrict__ k, const bf16* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ dsum,
                          const AttnSeq* __restrict__ seqs, u32 n_seqs, u32 q_rows, u32 kv_rows,
                          u32 p_rows, u32 n_heads, u32 n_kv, u32 q_stride, u32 kv_stride,
                          u32 out_stride, u32 causal, float scale, u32 hsplit,
                          float* __restrict__ part) {
    constexpr int DT = TC_DT;
    extern __shared__ __align__(16) unsigned char dsmem[];
    const u32 z = blockIdx.z;
    const AttnSeq s = seqs[z];
    if (!tc_seq_ok(s, q_rows, kv_rows, p_rows)) return;
    const u32 kvh = blockIdx.y / hsplit, hs = blockIdx.y % hsplit;
    const u32 rep = n_heads / n_kv / hsplit;  // query heads of this block's slice
    const u32 h_first = kvh * (n_heads / n_kv) + hs * rep;
    const u32 n_kt = (s.k_len + BT - 1) / BT;
    const u32 n_qt = (s.q_len + BT - 1) / BT;
    const u32 d0 = s.k_len - s.q_len;  // own key index of query 0 (query qi sees kj <= d0 + qi)
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 base = smem_u32(dsmem);
    const u32 ks = base, vs = base + TC_TILE, st0 = base + 2 * TC_TILE;
    const float scale_log2 = scale * LOG2E_F;

    for (u32 kt = blockIdx.x; kt < n_kt; kt += gridDim.x) {
        const u32 k0 = kt * BT;
        const u32 kw = k0 + warp * 16;       // this warp's first key
        const u32 ka = kw + g, kb = ka + 8;  // this lane's accumulator rows
        const u32 qi_min = causal && k0 > d0 ? k0 - d0 : 0;
        const u32 qt0 = qi_min / BT;
        const u32 nq = n_qt - qt0;  // >= 1: k0 < k_len, so k0 - d0 < q_len
        const u32 total = rep * nq;

        __syncthreads();  // the previous key tile is done with K, V and the stages
        tc_load_keys(ks, vs, k, v, s.k_start, k0, s.k_len, kv_stride, kvh);
        cp_async_commit();

        auto issue = [&](u32 it) {
            const u32 h = h_first + it / nq, q0 = (qt0 + it % nq) * BT;
            const u32 sb = st0 + (it & 1) * TC_STAGE;  // q at sb, dout at sb + TC_TILE
            float* fl = (float*)(dsmem + 2 * TC_TILE + (it & 1) * TC_STAGE + 2 * TC_TILE);
            tc_issue_queries(sb, fl, q, dout, lse, dsum, s.q_start, s.q_len, q0, h, n_heads,
                             q_stride, out_stride);
        };

        float adk[DT][4], adv[DT][4];
#pragma unroll
        for (int j = 0; j < DT; j++) {
            adk[j][0] = adk[j][1] = adk[j][2] = adk[j][3] = 0.0f;
            adv[j][0] = adv[j][1] = adv[j][2] = adv[j][3] = 0.0f;
        }

        if (total > 0) issue(0);  // total == 0: a sequence without queries (dk = dv = 0)
        cp_async_commit();
        for (u32 it = 0; it < total; it++) {
            if (it + 1 < total) issue(it + 1);
            cp_async_commit();
            cp_async_wait1();  // K, V and stage `it` landed (this thread's copies) ...
            __syncthreads();   // ... and everyone's (the lse / D stores too)
            const u32 q0 = (qt0 + it % nq) * BT;
            const u32 q_end = min(s.q_len, q0 + BT);
            // does any (key of this warp, query of the tile) pair count? (warp-uniform)
            if (kw < s.k_len && (!causal || q_end - 1 + d0 >= kw)) {
                const u32 qs = st0 + (it & 1) * TC_STAGE;
                const float* fl =
                    (const float*)(dsmem + 2 * TC_TILE + (it & 1) * TC_STAGE + 2 * TC_TILE);
                tc_keys_step(
                    ks, vs, qs, fl, ka, kb, q0, scale_log2,
                    [&](u32 kj, u32 qi) {
                        return kj < s.k_len && qi < s.q_len && (!causal || qi + d0 >= kj);
                    },
                    adk, adv);
            }
            __syncthreads();  // stage `it & 1` is refilled by the next iteration's issue
        }
        cp_async_wait0();
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const u32 kj = half ? kb : ka;
            if (kj >= s.k_len) continue;
            const u32 j = s.k_start + kj;
            if (tc_k_owner(seqs, n_seqs, j, q_rows, kv_rows, p_rows) != (int)z) continue;
            if (hsplit == 1) {
                const u64 o = (u64)j * kv_stride + kvh * HEAD_DIM;
#pragma unroll
                for (int jd = 0; jd < DT; jd++) {
                    *(u32*)(dk + o + 8 * jd + 2 * t) =
                        pack_bf2(adk[jd][2 * half] * scale, adk[jd][2 * half + 1] * scale);
                    *(u32*)(dv + o + 8 * jd + 2 * t) =
                        pack_bf2(adv[jd][2 * half], adv[jd][2 * half + 1]);
                }
            } else {
                const u64 slice = (u64)kv_rows * n_kv * HEAD_DIM;
                float* pk_ = part + hs * slice + ((u64)j * n_kv + kvh) * HEAD_DIM;
                float* pv_ = pk_ + hsplit * slice;
#pragma unroll
                for (int jd = 0; jd < DT; jd++) {
                    pk_[8 * jd + 2 * t] = adk[jd][2 * half];
                    pk_[8 * jd + 2 * t + 1] = adk[jd][2 * half + 1];
                    pv_[8 * jd + 2 * t] = adv[jd][2 * half];
                    pv_[8 * jd + 2 * t + 1] = adv[jd][2 * half + 1];
                }
            }
        }
    }  // key tiles
}

// hsplit > 1: dk = scale * (sum of the dk slices), dv = sum of the dv slices, slices in order,
// for the key rows a valid sequence owns (attention_bwd_tc_zero_kv wrote the others). One warp
// per (key row, kv head).
extern "C" __global__ void attention_bwd_tc_dkv_reduce(bf16* __restrict__ dk, bf16* __restrict__ dv,
                                                       const float* __restrict__ part,
                                                       const AttnSeq* __restrict__ seqs, u32 n_seqs,
                                                       u32 q_rows, u32 kv_rows, u32 p_rows,
                                                       u32 n_kv, u32 kv_stride, u32 hsplit,
                                                       float scale) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)kv_rows * n_kv) return;
    const u32 j = (u32)(w / n_kv), g = (u32)(w % n_kv);
    if (tc_k_owner(seqs, n_seqs, j, q_rows, kv_rows, p_rows) < 0) return;
    const u64 slice = (u64)kv_rows * n_kv * HEAD_DIM;
    const float* pk_ = part + w * HEAD_DIM;
    const float* pv_ = pk_ + hsplit * slice;
    const u64 o = (u64)j * kv_stride + g * HEAD_DIM;
    for (u32 e = lane; e < HEAD_DIM; e += 32) {
        float a = 0.0f, b = 0.0f;
        for (u32 hs = 0; hs < hsplit; hs++) {
            a += pk_[hs * slice + e];
            b += pv_[hs * slice + e];
        }
        dk[o + e] = f2bf(a * scale);
        dv[o + e] = f2bf(b);
    }
}

// ---- shared-prefix keys (attention_bwd_tc_dprefix_f32, attention_bwd_tc_dprefix_reduce) ----
// A prefix tile is BT rows k0 .. k0 + BT - 1 of the prefix buffer. Its work is a list of items
// (sequence si, query head h, query tile qt): the valid sequences with queries whose prefix span
// [p_start, p_start + p_len) meets the tile, ascending; for each, the kv head's query heads
// h_first .. h_first + rep - 1 ascending; for each, the query tiles ascending. Every query of a
// sequence sees every key of its prefix (they come before its own keys, so no causal mask);
// keys of the tile outside the span count nothing for that sequence. The launcher's pure twin of
// this list (attention_bwd_dprefix.rs, module `plan`) is tested without a GPU.

// Whether sequence s has items in the prefix tile starting at row k0.
__device__ __forceinline__ bool dp_hits(const AttnSeq& s, u32 k0, u32 q_rows, u32 kv_rows,
                                        u32 p_rows) {
    return tc_seq_ok(s, q_rows, kv_rows, p_rows) && s.q_len > 0 && s.p_len > 0 &&
           (u64)s.p_start < (u64)k0 + BT && k0 < s.p_start + s.p_len;
}
// Whether some valid sequence's prefix span holds prefix row j (the rows dpk / dpv get added to;
// the SIMT kernel's `any`).
__device__ __forceinline__ bool dp_covered(const AttnSeq* seqs, u32 n_seqs, u32 j, u32 q_rows,
                                           u32 kv_rows, u32 p_rows) {
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (tc_seq_ok(s, q_rows, kv_rows, p_rows) && j >= s.p_start && j < s.p_start + s.p_len)
            return true;
    }
    return false;
}
struct DpItem {
    u32 si, h, qt;  // sequence, query head, query tile (queries qt*BT ..)
};
// The number of items of the prefix tile at k0 (rep query heads per kv head).
__device__ __forceinline__ u64 dp_count(const AttnSeq* seqs, u32 n_seqs, u32 k0, u32 rep,
                                        u32 q_rows, u32 kv_rows, u32 p_rows) {
    u64 n = 0;
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (dp_hits(s, k0, q_rows, kv_rows, p_rows)) n += (u64)rep * ((s.q_len + BT - 1) / BT);
    }
    return n;
}
// Item idx (< dp_count) of the prefix tile at k0.
__device__ __forceinline__ DpItem dp_item_at(u64 idx, const AttnSeq* seqs, u32 n_seqs, u32 k0,
                                             u32 h_first, u32 rep, u32 q_rows, u32 kv_rows,
                                             u32 p_rows) {
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (!dp_hits(s, k0, q_rows, kv_rows, p_rows)) continue;
        const u32 nqt = (s.q_len + BT - 1) / BT;
        const u64 cnt = (u64)rep * nqt;
        if (idx < cnt) {
            DpItem it;
            it.si = si;
            it.h = h_first + (u32)(idx / nqt);
            it.qt = (u32)(idx % nqt);
            return it;
        }
        idx -= cnt;
    }
    DpItem end;  // past the last item (callers never ask for it)
    end.si = n_seqs;
    end.h = h_first;
    end.qt = 0;
    return end;
}
// Steps `it` (an item of the tile at k0, not the last) to the next one.
__device__ __forceinline__ void dp_item_next(DpItem& it, const AttnSeq* seqs, u32 n_seqs, u32 k0,
                                             u32 h_first, u32 rep, u32 q_rows, u32 kv_rows,
                                             u32 p_rows) {
    if (++it.qt < (seqs[it.si].q_len + BT - 1) / BT) return;
    it.qt = 0;
    if (++it.h < h_first + rep) return;
    it.h = h_first;
    do {
        it.si++;
    } while (it.si < n_seqs && !dp_hits(seqs[it.si], k0, q_rows, kv_rows, p_rows));
}

// Shared-prefix keys' gradients, added in fp32. Grid (x, n_kv, nsplit), block BNT: block
// (x, g, c) takes prefix tiles x, x + gridDim.x, ... for kv head g, and of each tile's item list
// the c-th of nsplit contiguous chunks, [n c / nsplit, n (c + 1) / nsplit) of its n items. K and
// V of the tile (prefix rows, p_stride) stay in shared memory; each warp owns 16 rows; per item
// (ascending), as attention_bwd_tc_dkv_bf16 per query tile: dv += P^T dout, dk += dS^T q, with
// P = 0 where the row is outside the item's sequence's prefix span or the query past its q_len.
// nsplit == 1: dpk += scale * the dk sum, dpv += the dv sum, at the rows dp_covered names (the
// others are left untouched); else the fp32 sums of every row < p_rows of the tile go to part
// (dk chunks, then dv chunks, each [nsplit][p_rows][n_kv][HEAD_DIM]; zeros for a chunk without
// items) for attention_bwd_tc_dprefix_reduce.
extern "C" __global__ void __launch_bounds__(BNT)
attention_bwd_tc_dprefix_f32(float* __restrict__ dpk, float* __restrict__ dpv,
                             const bf16* __restrict__ dout, const bf16* __restrict__ q,
                             const bf16* __restrict__ pk, const bf16* __restrict__ pv,
                             const float* __restrict__ lse, const float* __restrict__ dsum,
                             const AttnSeq* __restrict__ seqs, u32 n_seqs, u32 q_rows,
                             u32 kv_rows, u32 p_rows, u32 n_heads, u32 n_kv, u32 q_stride,
                             u32 p_stride, u32 out_stride, float scale, u32 nsplit,
                             float* __restrict__ part) {
    extern __shared__ __align__(16) unsigned char dsmem[];
    const u32 kvh = blockIdx.y, chunk = blockIdx.z;
    const u32 rep = n_heads / n_kv, h_first = kvh * rep;
    const u32 n_pt = (p_rows + BT - 1) / BT;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 base = smem_u32(dsmem);
    const u32 ks = base, vs = base + TC_TILE, st0 = base + 2 * TC_TILE;
    const float scale_log2 = scale * LOG2E_F;

    for (u32 pt = blockIdx.x; pt < n_pt; pt += gridDim.x) {
        const u32 k0 = pt * BT;
        const u32 kw = k0 + warp * 16;       // this warp's first prefix row
        const u32 ka = kw + g, kb = ka + 8;  // this lane's accumulator rows
        const u64 n_items = dp_count(seqs, n_seqs, k0, rep, q_rows, kv_rows, p_rows);
        const u64 lo = n_items * chunk / nsplit, hi = n_items * (chunk + 1) / nsplit;
        const u64 total = hi - lo;

        __syncthreads();  // the previous tile is done with K, V and the stages
        if (total > 0) tc_load_keys(ks, vs, pk, pv, 0, k0, p_rows, p_stride, kvh);
        cp_async_commit();

        // nxt: the item issued next (the stage pipeline runs one ahead); cur: the one computed
        DpItem nxt = dp_item_at(lo, seqs, n_seqs, k0, h_first, rep, q_rows, kv_rows, p_rows);
        DpItem cur = nxt;
        auto issue = [&](u64 it) {
            const AttnSeq s = seqs[nxt.si];
            const u32 st = (u32)(it & 1);
            float* fl = (float*)(dsmem + 2 * TC_TILE + st * TC_STAGE + 2 * TC_TILE);
            tc_issue_queries(st0 + st * TC_STAGE, fl, q, dout, lse, dsum, s.q_start, s.q_len,
                             nxt.qt * BT, nxt.h, n_heads, q_stride, out_stride);
        };

        float adk[TC_DT][4], adv[TC_DT][4];
#pragma unroll
        for (int j = 0; j < TC_DT; j++) {
            adk[j][0] = adk[j][1] = adk[j][2] = adk[j][3] = 0.0f;
            adv[j][0] = adv[j][1] = adv[j][2] = adv[j][3] = 0.0f;
        }

        if (total > 0) issue(0);
        cp_async_commit();
        for (u64 it = 0; it < total; it++) {
            if (it + 1 < total) {
                dp_item_next(nxt, seqs, n_seqs, k0, h_first, rep, q_rows, kv_rows, p_rows);
                issue(it + 1);
            }
            cp_async_commit();
            cp_async_wait1();  // K, V and stage `it` landed (this thread's copies) ...
            __syncthreads();   // ... and everyone's (the lse / D stores too)
            const AttnSeq s = seqs[cur.si];
            const u32 p_lo = s.p_start, p_hi = s.p_start + s.p_len;
            // does one of this warp's 16 rows lie in the span? (warp-uniform)
            if (kw < p_hi && kw + 16 > p_lo) {
                const u32 st = (u32)(it & 1);
                const float* fl =
                    (const float*)(dsmem + 2 * TC_TILE + st * TC_STAGE + 2 * TC_TILE);
                const u32 q_len = s.q_len;
                tc_keys_step(
                    ks, vs, st0 + st * TC_STAGE, fl, ka, kb, cur.qt * BT, scale_log2,
                    [&](u32 kj, u32 qi) { return kj >= p_lo && kj < p_hi && qi < q_len; }, adk,
                    adv);
            }
            __syncthreads();  // stage `it & 1` is refilled by the next iteration's issue
            if (it + 1 < total)
                dp_item_next(cur, seqs, n_seqs, k0, h_first, rep, q_rows, kv_rows, p_rows);
        }
        cp_async_wait0();
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const u32 kj = half ? kb : ka;
            if (kj >= p_rows) continue;
            if (nsplit == 1) {
                if (!dp_covered(seqs, n_seqs, kj, q_rows, kv_rows, p_rows)) continue;
                const u64 o = (u64)kj * p_stride + kvh * HEAD_DIM;
#pragma unroll
                for (int jd = 0; jd < TC_DT; jd++) {
                    dpk[o + 8 * jd + 2 * t] += adk[jd][2 * half] * scale;
                    dpk[o + 8 * jd + 2 * t + 1] += adk[jd][2 * half + 1] * scale;
                    dpv[o + 8 * jd + 2 * t] += adv[jd][2 * half];
                    dpv[o + 8 * jd + 2 * t + 1] += adv[jd][2 * half + 1];
                }
            } else {
                const u64 slice = (u64)p_rows * n_kv * HEAD_DIM;
                float* pk_ = part + chunk * slice + ((u64)kj * n_kv + kvh) * HEAD_DIM;
                float* pv_ = pk_ + nsplit * slice;
#pragma unroll
                for (int jd = 0; jd < TC_DT; jd++) {
                    pk_[8 * jd + 2 * t] = adk[jd][2 * half];
                    pk_[8 * jd + 2 * t + 1] = adk[jd][2 * half + 1];
                    pv_[8 * jd + 2 * t] = adv[jd][2 * half];
                    pv_[8 * jd + 2 * t + 1] = adv[jd][2 * half + 1];
                }
            }
        }
    }  // prefix tiles
}

// nsplit > 1: dpk += scale * (sum of the dk chunks), dpv += sum of the dv chunks, chunks in
// order, at the prefix rows dp_covered names (the others are left untouched). One warp per
// (prefix row, kv head).
extern "C" __global__ void attention_bwd_tc_dprefix_reduce(float* __restrict__ dpk,
                                                           float* __restrict__ dpv,
                                                           const float* __restrict__ part,
                                                           const AttnSeq* __restrict__ seqs,
                                                           u32 n_seqs, u32 q_rows, u32 kv_rows,
                                                           u32 p_rows, u32 n_kv, u32 p_stride,
                                                           u32 nsplit, float scale) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)p_rows * n_kv) return;
    const u32 j = (u32)(w / n_kv), g = (u32)(w % n_kv);
    if (!dp_covered(seqs, n_seqs, j, q_rows, kv_rows, p_rows)) return;
    const u64 slice = (u64)p_rows * n_kv * HEAD_DIM;
    const float* pk_ = part + w * HEAD_DIM;
    const float* pv_ = pk_ + nsplit * slice;
    const u64 o = (u64)j * p_stride + g * HEAD_DIM;
    for (u32 e = lane; e < HEAD_DIM; e += 32) {
        float a = 0.0f, b = 0.0f;
        for (u32 c = 0; c < nsplit; c++) {
            a += pk_[c * slice + e];
            b += pv_[c * slice + e];
        }
        dpk[o + e] += a * scale;
        dpv[o + e] += b;
    }
}
