// Attention over keys held as rows: K and V rows are bf16 with kv head g of a row at columns
// [g*HEAD_DIM, (g+1)*HEAD_DIM). A sequence (AttnSeq, common.cuh) reads a prefix segment (rows
// of pk/pv, shared by the G samples of a GRPO group) and then its own keys (rows of k/v); for
// decode both are the same KV arena.
// Softmax in fp32 (log2 domain: scores are pre-multiplied by scale*log2(e)).
//
// HEAD_DIM is a compile-time constant (-DHEAD_DIM=...), a multiple of 16. Every launch below
// is deterministic: the work split depends only on the launch arguments, never on timing or on
// how many SMs the stream may use.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define KT 64    // keys per shared-memory tile
#define KPAD 8   // bf16 padding per shared row (16 bytes) against bank conflicts
#define NT 128   // threads per block, both kernels

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert((KT * (HEAD_DIM / 8)) % NT == 0, "tile must split evenly over the block");

// Where the keys come from: prefix rows then own rows, each with its own row stride.
struct KvSrc {
    const bf16* pk;
    const bf16* pv;
    u32 p_stride;
    const bf16* k;
    const bf16* v;
    u32 kv_stride;
};

// Loads N consecutive bf16 (N even) from p into f as floats; 16-byte loads when N % 8 == 0.
template <int N>
__device__ __forceinline__ void load_bf(const bf16* p, float* f) {
    if (N % 8 == 0) {
#pragma unroll
        for (int i = 0; i < N / 8; i++) unpack8(((const uint4*)p)[i], f + 8 * i);
    } else {
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            const u32 w = ((const u32*)p)[i];
            f[2 * i] = bf_lo(w);
            f[2 * i + 1] = bf_hi(w);
        }
    }
}
template <int N>
__device__ __forceinline__ void store_bf(bf16* p, const float* f) {
    if (N % 8 == 0) {
#pragma unroll
        for (int i = 0; i < N / 8; i++) ((uint4*)p)[i] = pack8(f + 8 * i);
    } else {
#pragma unroll
        for (int i = 0; i < N / 2; i++) ((u32*)p)[i] = pack_bf2(f[2 * i], f[2 * i + 1]);
    }
}

// Loads logical keys [t0, t0 + KT) of kv head kvh into shared memory; rows at or past `end` are
// zero. All loads are issued before the first store, so each thread has 2*PER 16-byte loads in
// flight.
__device__ __forceinline__ void load_kv_tile(bf16 (*Ks)[HEAD_DIM + KPAD], bf16 (*Vs)[HEAD_DIM + KPAD],
                                             const KvSrc& src, u32 kvh, const AttnSeq& s, u32 t0,
                                             u32 end) {
    constexpr int VPR = HEAD_DIM / 8;
    constexpr int PER = KT * VPR / NT;
    uint4 kr[PER], vr[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const u32 v = threadIdx.x + i * NT, row = v / VPR, col = v % VPR, kk = t0 + row;
        if (kk < end) {
            const bool pre = kk < s.p_len;
            const u64 off = pre ? (u64)(s.p_start + kk) * src.p_stride
                                : (u64)(s.k_start + kk - s.p_len) * src.kv_stride;
            const u32 col_off = kvh * HEAD_DIM + col * 8;
            kr[i] = *(const uint4*)((pre ? src.pk : src.k) + off + col_off);
            vr[i] = *(const uint4*)((pre ? src.pv : src.v) + off + col_off);
        } else {
            kr[i] = make_uint4(0, 0, 0, 0);
            vr[i] = make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const u32 v = threadIdx.x + i * NT, row = v / VPR, col = v % VPR;
        *(uint4*)&Ks[row][col * 8] = kr[i];
        *(uint4*)&Vs[row][col * 8] = vr[i];
    }
}

// Sums N partial values held by each of W lanes (W = N, a power of two, aligned lane groups) so
// that lane c of the group ends with the total of value c, using N-1 shuffles.
template <int N>
__device__ __forceinline__ float transpose_reduce(float* v, u32 c) {
#pragma unroll
    for (int s = N / 2; s >= 1; s >>= 1) {
        const bool upper = (c & s) != 0;
#pragma unroll
        for (int i = 0; i < s; i++) {
            const float send = upper ? v[i] : v[i + s];
            const float keep = upper ? v[i + s] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
        }
    }
    return v[0];
}

template <int W>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int s = W / 2; s >= 1; s >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, s));
    return x;
}
template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int s = W / 2; s >= 1; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
    return x;
}

// Decode, split-K pass, SIMT variant (fp32 FMAs; kept for the workbench's side-by-side timing;
// `attention_decode_bf16` below is the tensor-core one). Grid (splits, n_kv * ceil(r/8), batch)
// with r = n_heads / n_kv; block NT = 128 threads = 8 heads of one kv group x 16 lanes, each lane
// owning HEAD_DIM/16 dims.
// Block (split, kv group, b) reads logical keys [split*chunk, min(L, (split+1)*chunk)) of
// sequence b once from HBM and uses them for all the group's query heads. Writes unnormalised
// partial outputs part_o[b, h, split_base + split, :] and (max, sum) part_ml[b, h, split_base +
// split, 0..2] of total_splits per (b, h). skip_prefix = 1 attends only the own keys (logical
// [p_len, L)), the prefix being attended by attention_decode_group_prefix_bf16.
extern "C" __global__ void __launch_bounds__(NT)
attention_decode_simt_bf16(float* __restrict__ part_o, float* __restrict__ part_ml,
                      const bf16* __restrict__ q, u32 q_stride, KvSrc src,
                      const AttnSeq* __restrict__ seqs, u32 n_heads, u32 n_kv, u32 chunk,
                      u32 splits, float scale_log2, u32 p_rows, u32 kv_rows, u32 skip_prefix,
                      u32 split_base, u32 total_splits) {
    pdl_wait();
    constexpr int DS = HEAD_DIM / 16;
    __shared__ __align__(16) bf16 Ks[KT][HEAD_DIM + KPAD];
    __shared__ __align__(16) bf16 Vs[KT][HEAD_DIM + KPAD];
    __shared__ __align__(16) float Ps[8][KT + 4];
    const u32 split = blockIdx.x, b = blockIdx.z;
    const u32 r = n_heads / n_kv, n_hg = (r + 7) / 8;
    const u32 kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    const u32 hl = threadIdx.x >> 4, c = threadIdx.x & 15;
    const u32 hr = hg * 8 + hl;
    const bool active = hr < r;
    const u32 h = kvh * r + (active ? hr : 0);
    const AttnSeq s = seqs[b];
    // A descriptor outside the buffers reads nothing and yields NaN (loud, never out of bounds).
    const bool ok = (u64)s.p_start + s.p_len <= p_rows && (u64)s.k_start + s.k_len <= kv_rows;
    const u32 L = ok ? s.p_len + s.k_len : 0;
    // The last split takes every key left, so a length past splits*chunk is still attended.
    // skip_prefix: only the own keys (the prefix is another kernel's, read once per group).
    const u32 lo = (skip_prefix && ok) ? s.p_len : 0;
    const u32 start = lo + split * chunk, end = split + 1 == splits ? L : min(L, start + chunk);

    float qv[DS], o[DS];
    load_bf<DS>(q + (u64)b * q_stride + h * HEAD_DIM + c * DS, qv);
#pragma unroll
    for (int d = 0; d < DS; d++) {
        qv[d] = active ? qv[d] * scale_log2 : 0.0f;
        o[d] = 0.0f;
    }
    float m = NEG_INF_F, l = 0.0f;

    for (u32 t0 = start; t0 < end; t0 += KT) {
        __syncthreads();
        load_kv_tile(Ks, Vs, src, kvh, s, t0, end);
        __syncthreads();
        float sc[KT / 16];
#pragma unroll
        for (int jb = 0; jb < KT / 16; jb++) {
            float v[16];
#pragma unroll
            for (int jj = 0; jj < 16; jj++) {
                float kf[DS];
                load_bf<DS>(&Ks[jb * 16 + jj][c * DS], kf);
                float acc = 0.0f;
#pragma unroll
                for (int d = 0; d < DS; d++) acc = fmaf(qv[d], kf[d], acc);
                v[jj] = acc;
            }
            const float x = transpose_reduce<16>(v, c);
            sc[jb] = (t0 + jb * 16 + c < end) ? x : NEG_INF_F;
        }
        float mt = sc[0];
#pragma unroll
        for (int jb = 1; jb < KT / 16; jb++) mt = fmaxf(mt, sc[jb]);
        mt = group_max<16>(mt);
        const float m_new = fmaxf(m, mt);  // finite: key t0 < end is always valid
        const float corr = exp2f(m - m_new);
        float ls = 0.0f;
#pragma unroll
        for (int jb = 0; jb < KT / 16; jb++) {
            const float p = exp2f(sc[jb] - m_new);
            Ps[hl][jb * 16 + c] = p;
            ls += p;
        }
        ls = group_sum<16>(ls);
        l = l * corr + ls;
        m = m_new;
        __syncwarp();
#pragma unroll
        for (int d = 0; d < DS; d++) o[d] *= corr;
#pragma unroll 4
        for (int j4 = 0; j4 < KT; j4 += 4) {
            const float4 p4 = *(const float4*)&Ps[hl][j4];
            const float pj[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                float vf[DS];
                load_bf<DS>(&Vs[j4 + jj][c * DS], vf);
#pragma unroll
                for (int d = 0; d < DS; d++) o[d] = fmaf(pj[jj], vf[d], o[d]);
            }
        }
        __syncwarp();
    }
    if (active) {
        const u64 pidx = ((u64)b * n_heads + h) * total_splits + split_base + split;
        float* po = part_o + pidx * HEAD_DIM + c * DS;
#pragma unroll
        for (int d = 0; d < DS; d++) po[d] = ok ? o[d] : __int_as_float(0x7fc00000);
        if (c == 0) {
            part_ml[pidx * 2] = ok ? m : __int_as_float(0x7fc00000);
            part_ml[pidx * 2 + 1] = l;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core decode (mma.sync m16n8k16 bf16, fp32 accumulate). Same grid, arguments and
// partial-output layout as the SIMT variant. The block's 4 warps each stream their own 32-key
// tiles of the chunk (tiles w, w+4, ...) through a private 2-stage cp.async pipeline in dynamic
// shared memory; S = Q K^T and O += P V run on the tensor cores with the kv group's query heads
// as the MMA rows (8 used of 16); P stays in registers (the accumulator layout of S is the A
// operand layout of P V). The 4 warps' (max, sum, O) are merged in shared memory at the end.

#if HEAD_DIM % 32 == 0  // the tensor-core decode needs HEAD_DIM % 32 == 0 (text heads: 128)
#define DW 32          // keys per warp tile
#define DSTAGES 2
#define DROW (HEAD_DIM + KPAD)

// c += A B with A rows g+8 zero (a1 = a3 = 0).
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a2, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Issues the cp.async copies of logical keys [t0, t0 + DW) (rows past `end` zero-filled) into
// one stage: K at ks, V at vs (DW rows of DROW bf16 each).
__device__ __forceinline__ void issue_tile(u32 ks, u32 vs, const KvSrc& src, u32 kvh,
                                           const AttnSeq& s, u32 t0, u32 end, u32 lane) {
    constexpr int VPR = HEAD_DIM / 8;
#pragma unroll
    for (int i = 0; i < DW * VPR / 32; i++) {
        const u32 c = lane + 32 * i, row = c / VPR, col = c % VPR, kk = t0 + row;
        const bool valid = kk < end;
        const bf16* kp = src.k;
        const bf16* vp = src.v;
        if (valid) {
            const bool pre = kk < s.p_len;
            const u64 off = (pre ? (u64)(s.p_start + kk) * src.p_stride
                                 : (u64)(s.k_start + kk - s.p_len) * src.kv_stride) +
                            kvh * HEAD_DIM + col * 8;
            kp = (pre ? src.pk : src.k) + off;
            vp = (pre ? src.pv : src.v) + off;
        }
        const u32 so = (row * DROW + col * 8) * 2;
        cp_async16(ks + so, kp, valid);
        cp_async16(vs + so, vp, valid);
    }
}

extern "C" __global__ void __launch_bounds__(NT)
attention_decode_bf16(float* __restrict__ part_o, float* __restrict__ part_ml,
                      const bf16* __restrict__ q, u32 q_stride, KvSrc src,
                      const AttnSeq* __restrict__ seqs, u32 n_heads, u32 n_kv, u32 chunk,
                      u32 splits, float scale_log2, u32 p_rows, u32 kv_rows, u32 skip_prefix,
                      u32 split_base, u32 total_splits) {
    pdl_wait();
    constexpr int KSTEPS = HEAD_DIM / 16;
    constexpr int DT = HEAD_DIM / 8;  // 8-wide dim tiles of O
    extern __shared__ __align__(16) unsigned char dsmem[];
    const u32 split = blockIdx.x, b = blockIdx.z;
    const u32 r = n_heads / n_kv, n_hg = (r + 7) / 8;
    const u32 kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
    const AttnSeq s = seqs[b];
    const bool ok = (u64)s.p_start + s.p_len <= p_rows && (u64)s.k_start + s.k_len <= kv_rows;
    const u32 L = ok ? s.p_len + s.k_len : 0;
    const u32 lo = (skip_prefix && ok) ? s.p_len : 0;
    const u32 start = lo + split * chunk, end = split + 1 == splits ? L : min(L, start + chunk);
    const u32 ntiles = end > start ? (end - start + DW - 1) / DW : 0;

    // Q fragments of row g (head hg*8 + g of this kv group; zero when past r).
    const u32 hr = hg * 8 + g;
    const bool row_ok = hr < r;
    const bf16* qrow = q + (u64)b * q_stride + (kvh * r + (row_ok ? hr : 0)) * HEAD_DIM;
    u32 qa0[KSTEPS], qa2[KSTEPS];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        qa0[kk] = row_ok ? *(const u32*)(qrow + 16 * kk + 2 * t) : 0u;
        qa2[kk] = row_ok ? *(const u32*)(qrow + 16 * kk + 8 + 2 * t) : 0u;
    }

    const u32 stage_bytes = 2 * DW * DROW * 2;  // K then V
    const u32 base = smem_u32(dsmem) + warp * DSTAGES * stage_bytes;
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m = NEG_INF_F, l = 0.0f;  // l: this lane's columns only, summed over t at the end

    u32 it = warp;
    if (it < ntiles) issue_tile(base, base + DW * DROW * 2, src, kvh, s, start + it * DW, end, lane);
    cp_async_commit();
    for (u32 k = 0; it < ntiles; k++, it += 4) {
        const u32 nxt = it + 4;
        const u32 nb = base + ((k + 1) & 1) * stage_bytes;
        if (nxt < ntiles) issue_tile(nb, nb + DW * DROW * 2, src, kvh, s, start + nxt * DW, end, lane);
        cp_async_commit();
        cp_async_wait1();
        __syncwarp();
        const u32 ks = base + (k & 1) * stage_bytes, vs = ks + DW * DROW * 2;
        const u32 t0 = start + it * DW;

        // S = Q K^T: 4 n-tiles of 8 keys.
        float sc[DW / 8][4];
#pragma unroll
        for (int j = 0; j < DW / 8; j++) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                u32 b0, b1, b2, b3;
                const u32 row = 8 * j + (lane & 7), col = 16 * kk + 8 * (lane >> 3);
                ldsm_x4(ks + (row * DROW + col) * 2, b0, b1, b2, b3);
                mma_bf16(sc[j], qa0[kk], qa2[kk], b0, b1);
                mma_bf16(sc[j], qa0[kk + 1], qa2[kk + 1], b2, b3);
            }
        }
        // Online softmax on row g: this lane holds keys 8j + 2t, 8j + 2t + 1.
        float mt = NEG_INF_F;
#pragma unroll
        for (int j = 0; j < DW / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const u32 key = t0 + 8 * j + 2 * t + e;
                const float x = key < end ? sc[j][e] * scale_log2 : NEG_INF_F;
                sc[j][e] = x;
                mt = fmaxf(mt, x);
            }
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float m_new = fmaxf(m, mt);  // finite: key t0 < end is valid
        const float corr = ex2(m - m_new);
        m = m_new;
        float ls = 0.0f;
        u32 pa[DW / 8];  // P as bf16 pairs: pa[j] = keys 8j + 2t, +1 of row g
#pragma unroll
        for (int j = 0; j < DW / 8; j++) {
            const float p0 = ex2(sc[j][0] - m_new), p1 = ex2(sc[j][1] - m_new);
            ls += p0 + p1;
            pa[j] = pack_bf2(p0, p1);
        }
        l = l * corr + ls;
#pragma unroll
        for (int jd = 0; jd < DT; jd++) {
            o[jd][0] *= corr;
            o[jd][1] *= corr;
        }
        // O += P V: 2 k-steps of 16 keys, DT n-tiles of 8 dims (two per ldmatrix.x4.trans).
#pragma unroll
        for (int kk2 = 0; kk2 < DW / 16; kk2++) {
#pragma unroll
            for (int jd = 0; jd < DT; jd += 2) {
                u32 b0, b1, b2, b3;
                const u32 row = 16 * kk2 + (lane & 7) + 8 * ((lane >> 3) & 1);
                const u32 col = 8 * (jd + (lane >> 4));
                ldsm_x4_t(vs + (row * DROW + col) * 2, b0, b1, b2, b3);
                mma_bf16(o[jd], pa[2 * kk2], pa[2 * kk2 + 1], b0, b1);
                mma_bf16(o[jd + 1], pa[2 * kk2], pa[2 * kk2 + 1], b2, b3);
            }
        }
        __syncwarp();  // this stage is refilled two tiles on
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);

    // Merge the 4 warps in shared memory (reusing the tile buffers).
    __syncthreads();
    float* sm = (float*)dsmem;           // [4][8] maxima
    float* sl = sm + 32;                 // [4][8] sums
    float* so = sl + 32;                 // [4][8][HEAD_DIM] outputs
    if (t == 0) {
        sm[warp * 8 + g] = m;
        sl[warp * 8 + g] = l;
    }
#pragma unroll
    for (int jd = 0; jd < DT; jd++) {
        so[(warp * 8 + g) * HEAD_DIM + 8 * jd + 2 * t] = o[jd][0];
        so[(warp * 8 + g) * HEAD_DIM + 8 * jd + 2 * t + 1] = o[jd][1];
    }
    __syncthreads();
    for (u32 idx = threadIdx.x; idx < 8 * HEAD_DIM; idx += NT) {
        const u32 row = idx / HEAD_DIM, d = idx % HEAD_DIM;
        if (hg * 8 + row >= r) continue;
        float M = NEG_INF_F;
#pragma unroll
        for (int w = 0; w < 4; w++) M = fmaxf(M, sm[w * 8 + row]);
        float acc = 0.0f, Ls = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const float mw = sm[w * 8 + row];
            const float wt = mw == NEG_INF_F ? 0.0f : ex2(mw - M);
            acc += wt * so[(w * 8 + row) * HEAD_DIM + d];
            Ls += wt * sl[w * 8 + row];
        }
        const u32 h = kvh * r + hg * 8 + row;
        const u64 pidx = ((u64)b * n_heads + h) * total_splits + split_base + split;
        part_o[pidx * HEAD_DIM + d] = ok ? acc : __int_as_float(0x7fc00000);
        if (d == 0) {
            part_ml[pidx * 2] = ok ? M : __int_as_float(0x7fc00000);
            part_ml[pidx * 2 + 1] = Ls;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Group-shared decode (attention_decode_grouped_bf16's passes). The G samples of a GRPO group
// attend the same prompt prefix, so in the group pass (per_sample = 0) one block takes up to 64
// query rows = per_block samples x r query heads of one kv head (4 warps x 16 MMA rows, all 16
// used) and reads each prefix key once for all of them instead of once per sample. Block
// (split, kvh, z) (numbered split-fastest, see below) takes group z / parts, samples
// part * per_block .. of it, prefix keys [split*chunk, ...) (the last split takes the rest).
// Samples gi*group .. gi*group + group - 1 form group gi, or, with a group table
// (group_starts non-null, the group pass only), samples group_starts[gi] ..
// group_starts[gi + 1] - 1 (at most group of them; an empty group's blocks do nothing), so that
// a batch compacted sample by sample keeps its groups' prefixes shared. The prefix is the group's first
// sample's (p_start, p_len); a member whose descriptor names another prefix, or lies outside
// the arena, gets NaN partials (loud).
// The per-sample pass (per_sample = 1, group = per_block = 1, z = sample) runs the same
// pipeline over one sample's logical keys [lo, p_len + k_len), lo = p_len when skip_prefix
// (the group pass took the prefix) else 0, with the sample's r query heads as rows.
// K/V tiles of GKT keys go through a block-wide GSTG-stage cp.async pipeline (GSTG - 1 tiles in
// flight): 32 keys through 4 stages (attention_decode_grouped_bf16), or 64 keys through 2
// (attention_decode_grouped_wide_bf16: half the tiles, so half the per-tile softmax and
// barrier costs, for launches with enough blocks to cover the shallower pipeline; the same
// shared memory). Every warp with rows runs S = Q K^T, the online softmax and O += P V over
// every tile. Partials go to slot split_base + split of total_splits;
// attention_decode_reduce_bf16 merges the slots.
// One launch can hold both passes. The grid is one-dimensional and holds exactly the blocks
// the passes need (no block returns at once): blocks [0, first_blocks) are the first pass's,
// (split, kv head, z) with split fastest, then kv head; the rest the per-sample pass's, in the
// same order with z = sample.
#define GROW (HEAD_DIM + KPAD)
// The grouped kernels' parameters (GROUPED_ARGS) and the same names passed on (GROUPED_PASS).
#define GROUPED_ARGS                                                                        \
    float* __restrict__ part_o, float* __restrict__ part_ml, const bf16* __restrict__ q,    \
        u32 q_stride, const bf16* __restrict__ kc, const bf16* __restrict__ vc,             \
        u32 kv_stride, const AttnSeq* __restrict__ seqs, u32 batch, u32 group_a,            \
        u32 per_block_a, u32 n_heads, u32 n_kv, u32 chunk_a, u32 splits_a, u32 total_splits, \
        float scale_log2, u32 kv_rows, u32 per_sample_a, u32 skip_prefix_a,                 \
        u32 split_base_a, u32 first_blocks, u32 chunk_b, u32 splits_b,                      \
        const u32* __restrict__ group_starts
#define GROUPED_PASS                                                                        \
    part_o, part_ml, q, q_stride, kc, vc, kv_stride, seqs, batch, group_a, per_block_a,     \
        n_heads, n_kv, chunk_a, splits_a, total_splits, scale_log2, kv_rows, per_sample_a,  \
        skip_prefix_a, split_base_a, first_blocks, chunk_b, splits_b, group_starts

template <int GKT, int GSTG>
__device__ __forceinline__ void grouped_decode(GROUPED_ARGS) {
    static_assert(GSTG >= 2 && GKT % 16 == 0, "tiles of 16-key steps, at least two stages");
    // Blocks from first_blocks on run the per-sample pass behind a group pass in the same
    // launch (group = per_block = 1, own keys only, slots splits_a ..); the others the pass
    // the first parameters describe.
    const bool second = blockIdx.x >= first_blocks;
    const u32 group = second ? 1u : group_a, per_block = second ? 1u : per_block_a;
    const u32 chunk = second ? chunk_b : chunk_a, splits = second ? splits_b : splits_a;
    const u32 per_sample = second ? 1u : per_sample_a, skip_prefix = second ? 1u : skip_prefix_a;
    const u32 split_base = second ? splits_a : split_base_a;
    const u32 bid = second ? blockIdx.x - first_blocks : blockIdx.x;
    const u32 zi = bid / (splits * n_kv);
    constexpr int KSTEPS = HEAD_DIM / 16;
    constexpr int DT = HEAD_DIM / 8;
    constexpr int VPR = HEAD_DIM / 8;
    constexpr u32 STAGE = 2 * GKT * GROW * 2;  // bytes: K then V
    extern __shared__ __align__(16) unsigned char dsmem[];
    const u32 split = bid % splits, kvh = (bid / splits) % n_kv;
    const u32 r = n_heads / n_kv;
    const u32 parts = (group + per_block - 1) / per_block;
    const u32 gi = zi / parts, pi = zi % parts;
    const u32* gs = per_sample ? nullptr : group_starts;
    const u32 g_first = gs ? gs[gi] : gi * group;
    const u32 g_end = min(batch, gs ? min(gs[gi + 1], g_first + group) : g_first + group);
    if (g_first >= g_end) return;
    const u32 b0 = g_first + pi * per_block;
    const u32 nsamp = b0 < g_end ? min(per_block, g_end - b0) : 0;
    const u32 nrows = nsamp * r;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const AttnSeq lead = seqs[g_first];
    const bool p_ok = (u64)lead.p_start + lead.p_len <= kv_rows;
    const bool k_ok = (u64)lead.k_start + lead.k_len <= kv_rows;
    // Logical keys of this pass: group pass [0, p_len) (the shared prefix); per-sample pass
    // [lo, p_len + k_len). Logical key kk < p_len is row p_start + kk, else k_start + kk - p_len.
    const bool lead_ok = per_sample ? (p_ok && k_ok) : p_ok;
    const u32 P = lead_ok ? (per_sample ? lead.p_len + lead.k_len : lead.p_len) : 0;
    const u32 lo = (per_sample && skip_prefix && lead_ok) ? lead.p_len : 0;
    const u32 start = lo + split * chunk, end = split + 1 == splits ? P : min(P, start + chunk);
    const u32 ntiles = (nrows > 0 && end > start) ? (end - start + GKT - 1) / GKT : 0;
    const bool active = warp * 16 < nrows;  // warp-uniform: this warp has rows to compute

    // Rows A = warp*16 + g and B = A + 8 of the block's (sample, head) list.
    const u32 ra = warp * 16 + g, rb = ra + 8;
    const bool va = ra < nrows, vb = rb < nrows;
    const bf16* qa_row = q + (u64)(b0 + (va ? ra / r : 0)) * q_stride + (kvh * r + (va ? ra % r : 0)) * HEAD_DIM;
    const bf16* qb_row = q + (u64)(b0 + (vb ? rb / r : 0)) * q_stride + (kvh * r + (vb ? rb % r : 0)) * HEAD_DIM;
    u32 qf[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        qf[kk][0] = va ? *(const u32*)(qa_row + 16 * kk + 2 * t) : 0u;
        qf[kk][1] = vb ? *(const u32*)(qb_row + 16 * kk + 2 * t) : 0u;
        qf[kk][2] = va ? *(const u32*)(qa_row + 16 * kk + 8 + 2 * t) : 0u;
        qf[kk][3] = vb ? *(const u32*)(qb_row + 16 * kk + 8 + 2 * t) : 0u;
    }

    const u32 base = smem_u32(dsmem);
    auto issue = [&](u32 it) {
        const u32 ks = base + (it % GSTG) * STAGE, vs = ks + GKT * GROW * 2;
        const u32 t0 = start + it * GKT;
#pragma unroll
        for (int i = 0; i < GKT * VPR / NT; i++) {
            const u32 c = threadIdx.x + NT * i, row = c / VPR, col = c % VPR, kk = t0 + row;
            const bool valid = kk < end;
            const u32 krow = kk < lead.p_len ? lead.p_start + kk : lead.k_start + kk - lead.p_len;
            const u64 off = valid ? (u64)krow * kv_stride + kvh * HEAD_DIM + col * 8 : 0;
            const u32 so = (row * GROW + col * 8) * 2;
            cp_async16(ks + so, kc + off, valid);
            cp_async16(vs + so, vc + off, valid);
        }
    };

    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_a = NEG_INF_F, m_b = NEG_INF_F, l_a = 0.0f, l_b = 0.0f;

#pragma unroll
    for (u32 s0 = 0; s0 < GSTG - 1; s0++) {
        if (s0 < ntiles) issue(s0);
        cp_async_commit();
    }
    for (u32 it = 0; it < ntiles; it++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GSTG - 2));
        __syncthreads();  // tile `it` landed for all; buffer (it - 1) % GSTG is free again
        if (it + GSTG - 1 < ntiles) issue(it + GSTG - 1);
        cp_async_commit();
        if (!active) continue;
        const u32 ks = base + (it % GSTG) * STAGE, vs = ks + GKT * GROW * 2;
        const u32 t0 = start + it * GKT;
        float sc[GKT / 8][4];
#pragma unroll
        for (int j = 0; j < GKT / 8; j++) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                u32 b0_, b1_, b2_, b3_;
                const u32 row = 8 * j + (lane & 7), col = 16 * kk + 8 * (lane >> 3);
                ldsm_x4(ks + (row * GROW + col) * 2, b0_, b1_, b2_, b3_);
                mma16(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0_, b1_);
                mma16(sc[j], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], b2_, b3_);
            }
        }
        float mta = NEG_INF_F, mtb = NEG_INF_F;
#pragma unroll
        for (int j = 0; j < GKT / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool kv_ok = t0 + 8 * j + 2 * t + e < end;
                sc[j][e] = kv_ok ? sc[j][e] * scale_log2 : NEG_INF_F;
                sc[j][e + 2] = kv_ok ? sc[j][e + 2] * scale_log2 : NEG_INF_F;
                mta = fmaxf(mta, sc[j][e]);
                mtb = fmaxf(mtb, sc[j][e + 2]);
            }
        }
        mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 1));
        mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 2));
        mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 1));
        mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 2));
        const float mna = fmaxf(m_a, mta), mnb = fmaxf(m_b, mtb);  // finite: key t0 < end
        const float ca = ex2(m_a - mna), cb = ex2(m_b - mnb);
        m_a = mna;
        m_b = mnb;
        float lsa = 0.0f, lsb = 0.0f;
        u32 pa[GKT / 8], pb[GKT / 8];  // P of rows A / B as bf16 pairs (keys 8j + 2t, +1)
#pragma unroll
        for (int j = 0; j < GKT / 8; j++) {
            const float p0 = ex2(sc[j][0] - mna), p1 = ex2(sc[j][1] - mna);
            const float p2 = ex2(sc[j][2] - mnb), p3 = ex2(sc[j][3] - mnb);
            lsa += p0 + p1;
            lsb += p2 + p3;
            pa[j] = pack_bf2(p0, p1);
            pb[j] = pack_bf2(p2, p3);
        }
        l_a = l_a * ca + lsa;
        l_b = l_b * cb + lsb;
#pragma unroll
        for (int jd = 0; jd < DT; jd++) {
            o[jd][0] *= ca;
            o[jd][1] *= ca;
            o[jd][2] *= cb;
            o[jd][3] *= cb;
        }
#pragma unroll
        for (int kk2 = 0; kk2 < GKT / 16; kk2++) {
#pragma unroll
            for (int jd = 0; jd < DT; jd += 2) {
                u32 b0_, b1_, b2_, b3_;
                const u32 row = 16 * kk2 + (lane & 7) + 8 * ((lane >> 3) & 1);
                const u32 col = 8 * (jd + (lane >> 4));
                ldsm_x4_t(vs + (row * GROW + col) * 2, b0_, b1_, b2_, b3_);
                mma16(o[jd], pa[2 * kk2], pb[2 * kk2], pa[2 * kk2 + 1], pb[2 * kk2 + 1], b0_, b1_);
                mma16(o[jd + 1], pa[2 * kk2], pb[2 * kk2], pa[2 * kk2 + 1], pb[2 * kk2 + 1], b2_, b3_);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const u32 row = half ? rb : ra;
        if (row >= nrows) continue;
        const u32 b = b0 + row / r, h = kvh * r + row % r;
        const AttnSeq sb = seqs[b];
        // Loud on a member that does not share the leader's prefix or lies outside the arena.
        const bool ok = lead_ok && sb.p_start == lead.p_start && sb.p_len == lead.p_len &&
                        (u64)sb.k_start + sb.k_len <= kv_rows;
        const float nan = __int_as_float(0x7fc00000);
        const u64 pidx = ((u64)b * n_heads + h) * total_splits + split_base + split;
        float* po = part_o + pidx * HEAD_DIM;
#pragma unroll
        for (int jd = 0; jd < DT; jd++) {
            po[8 * jd + 2 * t] = ok ? o[jd][2 * half] : nan;
            po[8 * jd + 2 * t + 1] = ok ? o[jd][2 * half + 1] : nan;
        }
        if (t == 0) {
            part_ml[pidx * 2] = ok ? (half ? m_b : m_a) : nan;
            part_ml[pidx * 2 + 1] = half ? l_b : l_a;
        }
    }
}

// The two tile forms; the launcher (group_pass) sizes their shared memory from the same shapes.
extern "C" __global__ void __launch_bounds__(NT) attention_decode_grouped_bf16(GROUPED_ARGS) {
    pdl_wait();
    grouped_decode<32, 4>(GROUPED_PASS);
}
extern "C" __global__ void __launch_bounds__(NT)
attention_decode_grouped_wide_bf16(GROUPED_ARGS) {
    pdl_wait();
    grouped_decode<64, 2>(GROUPED_PASS);
}
#endif  // HEAD_DIM % 32 == 0

// Decode, reduction pass: out[b, h, :] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s over the
// splits in order (fixed order: deterministic). Grid (n_heads, batch); an empty sequence gives 0
// (and lse -inf). lse (may be null): [batch, n_heads], natural-log logsumexp of scaled scores.
extern "C" __global__ void attention_decode_reduce_bf16(bf16* __restrict__ out, u32 out_stride,
                                                        float* __restrict__ lse,
                                                        const float* __restrict__ part_o,
                                                        const float* __restrict__ part_ml,
                                                        u32 n_heads, u32 splits) {
    pdl_wait();
    const u32 h = blockIdx.x, b = blockIdx.y;
    const u64 base = ((u64)b * n_heads + h) * splits;
    float M = NEG_INF_F;
    bool bad = false;  // a split flagged an invalid descriptor (NaN max)
    for (u32 s = 0; s < splits; s++) {
        const float ms = part_ml[(base + s) * 2];
        bad |= isnan(ms);
        M = fmaxf(M, ms);
    }
    float Lsum = 0.0f;
    if (M != NEG_INF_F)
        for (u32 s = 0; s < splits; s++)
            Lsum += exp2f(part_ml[(base + s) * 2] - M) * part_ml[(base + s) * 2 + 1];
    if (lse != nullptr && threadIdx.x == 0)
        lse[(u64)b * n_heads + h] = bad ? __int_as_float(0x7fc00000)
                                        : (M == NEG_INF_F ? NEG_INF_F : (M + log2f(Lsum)) * LN2_F);
    bf16* orow = out + (u64)b * out_stride + h * HEAD_DIM;
    for (u32 d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float acc = 0.0f;
        if (M != NEG_INF_F)
            for (u32 s = 0; s < splits; s++)
                acc += exp2f(part_ml[(base + s) * 2] - M) * part_o[(base + s) * HEAD_DIM + d];
        orow[d] = bad ? (bf16)0x7fc0 : f2bf(Lsum > 0.0f ? acc / Lsum : 0.0f);
    }
}

// Prefill / scoring attention (the CUDA twin of cpu::attention_fwd) (varlen, GQA, optional causal mask, shared prefix). Grid
// (ceil(max_q_len / 16), n_heads, n_seqs); block NT = 128 threads = 16 queries x 8 lanes, each
// lane owning HEAD_DIM/8 dims of its query. Writes out[q_start + i, h, :] (bf16) and, when lse
// is not null, lse[q_start + i, h] = natural-log logsumexp of the scaled scores (for backward).
extern "C" __global__ void __launch_bounds__(NT)
attention_fwd_bf16(bf16* __restrict__ out, u32 o_stride, float* __restrict__ lse,
                   const bf16* __restrict__ q, u32 q_stride, KvSrc src,
                   const AttnSeq* __restrict__ seqs, u32 n_heads, u32 n_kv, u32 causal,
                   float scale_log2, u32 q_rows, u32 p_rows, u32 kv_rows) {
    constexpr int QT = 16;
    constexpr int DS = HEAD_DIM / 8;
    __shared__ __align__(16) bf16 Ks[KT][HEAD_DIM + KPAD];
    __shared__ __align__(16) bf16 Vs[KT][HEAD_DIM + KPAD];
    __shared__ __align__(16) float Ps[QT][KT + 4];
    const AttnSeq s = seqs[blockIdx.z];
    const u32 h = blockIdx.y, kvh = h / (n_heads / n_kv);
    // A descriptor outside the buffers (or with more queries than own keys) writes nothing.
    if ((u64)s.q_start + s.q_len > q_rows || (u64)s.p_start + s.p_len > p_rows ||
        (u64)s.k_start + s.k_len > kv_rows || s.q_len > s.k_len)
        return;
    const u32 L = s.p_len + s.k_len;
    const u32 off = L - s.q_len;  // logical index of query 0's own key
    // Query tiles blockIdx.x, blockIdx.x + gridDim.x, ...: every query is covered whatever the
    // grid's x size (the launcher sizes it from a hint).
    for (u32 q0 = blockIdx.x * QT; q0 < s.q_len; q0 += gridDim.x * QT) {
    const u32 qi = threadIdx.x >> 3, c = threadIdx.x & 7, i = q0 + qi;
    const bool valid = i < s.q_len;
    const u32 lim = causal ? off + i + 1 : L;
    const u32 block_end = causal ? min(L, off + min(q0 + QT, s.q_len)) : L;

    float qv[DS], o[DS];
    load_bf<DS>(q + (u64)(s.q_start + (valid ? i : 0)) * q_stride + h * HEAD_DIM + c * DS, qv);
#pragma unroll
    for (int d = 0; d < DS; d++) {
        qv[d] = valid ? qv[d] * scale_log2 : 0.0f;
        o[d] = 0.0f;
    }
    float m = NEG_INF_F, l = 0.0f;

    for (u32 t0 = 0; t0 < block_end; t0 += KT) {
        __syncthreads();
        load_kv_tile(Ks, Vs, src, kvh, s, t0, block_end);
        __syncthreads();
        float sc[KT / 8];
#pragma unroll
        for (int jb = 0; jb < KT / 8; jb++) {
            float v[8];
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                float kf[DS];
                load_bf<DS>(&Ks[jb * 8 + jj][c * DS], kf);
                float acc = 0.0f;
#pragma unroll
                for (int d = 0; d < DS; d++) acc = fmaf(qv[d], kf[d], acc);
                v[jj] = acc;
            }
            const float x = transpose_reduce<8>(v, c);
            sc[jb] = (valid && t0 + jb * 8 + c < lim) ? x : NEG_INF_F;
        }
        float mt = sc[0];
#pragma unroll
        for (int jb = 1; jb < KT / 8; jb++) mt = fmaxf(mt, sc[jb]);
        mt = group_max<8>(mt);
        const float m_new = fmaxf(m, mt);
        const bool none = (m_new == NEG_INF_F);  // nothing visible yet (invalid query)
        const float corr = none ? 1.0f : exp2f(m - m_new);
        float ls = 0.0f;
#pragma unroll
        for (int jb = 0; jb < KT / 8; jb++) {
            const float p = none ? 0.0f : exp2f(sc[jb] - m_new);
            Ps[qi][jb * 8 + c] = p;
            ls += p;
        }
        ls = group_sum<8>(ls);
        l = l * corr + ls;
        m = m_new;
        __syncwarp();
#pragma unroll
        for (int d = 0; d < DS; d++) o[d] *= corr;
#pragma unroll 2
        for (int j4 = 0; j4 < KT; j4 += 4) {
            const float4 p4 = *(const float4*)&Ps[qi][j4];
            const float pj[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                float vf[DS];
                load_bf<DS>(&Vs[j4 + jj][c * DS], vf);
#pragma unroll
                for (int d = 0; d < DS; d++) o[d] = fmaf(pj[jj], vf[d], o[d]);
            }
        }
        __syncwarp();
    }
    if (valid) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int d = 0; d < DS; d++) o[d] *= inv;
        store_bf<DS>(out + (u64)(s.q_start + i) * o_stride + h * HEAD_DIM + c * DS, o);
        if (lse != nullptr && c == 0)
            lse[(u64)(s.q_start + i) * n_heads + h] = (m + log2f(l)) * LN2_F;
    }
    }  // query tiles
}

// ---------------------------------------------------------------------------------------------
// Prefill / scoring attention on the tensor cores (flash-attention style; the same arguments,
// descriptors and results as attention_fwd_bf16 up to the bf16 rounding of P in O += P V).
// Grid (x, n_heads, n_seqs), block NT = 128 threads = 4 warps x 16 query rows: block (x, h, z)
// takes query tiles x, x + gridDim.x, ... of FQ rows of sequence z, counted from the last tile
// (the longest under a causal mask), so every query is covered whatever the grid's x size and
// the heavy tiles start first. K/V tiles of FK keys go through a 2-stage cp.async pipeline in
// dynamic shared memory; S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16, fp32
// accumulate) with Q and P in registers (the accumulator layout of S is the A operand layout of
// P V); the online softmax is in fp32 (log2 domain). The causal / length mask is applied only
// on the tiles that cross it; a warp skips the key tiles past its own last row.
#define FQ 64  // query rows per block tile (4 warps x 16)
#define FK 64  // keys per K/V tile
#define FROW (HEAD_DIM + KPAD)

// Scales a tile of scores into the log2 domain, masks keys at or past `lim_a` / `lim_b` (rows
// A / B) when `masked`, and returns the rows' maxima over this lane's columns.
template <bool MASKED>
__device__ __forceinline__ void scale_mask(float (*sc)[4], u32 t0, u32 t, u32 lim_a, u32 lim_b,
                                           float scale_log2, float& mta, float& mtb) {
#pragma unroll
    for (int j = 0; j < FK / 8; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const u32 kk = t0 + 8 * j + 2 * t + e;
            sc[j][e] = (!MASKED || kk < lim_a) ? sc[j][e] * scale_log2 : NEG_INF_F;
            sc[j][e + 2] = (!MASKED || kk < lim_b) ? sc[j][e + 2] * scale_log2 : NEG_INF_F;
            mta = fmaxf(mta, sc[j][e]);
            mtb = fmaxf(mtb, sc[j][e + 2]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT)
attention_fwd_tc_bf16(bf16* __restrict__ out, u32 o_stride, float* __restrict__ lse,
                      const bf16* __restrict__ q, u32 q_stride, KvSrc src,
                      const AttnSeq* __restrict__ seqs, u32 n_heads, u32 n_kv, u32 causal,
                      float scale_log2, u32 q_rows, u32 p_rows, u32 kv_rows) {
    constexpr int KSTEPS = HEAD_DIM / 16;
    constexpr int DT = HEAD_DIM / 8;   // 8-wide dim tiles of O (even: HEAD_DIM % 16 == 0)
    constexpr int VPR = HEAD_DIM / 8;  // 16-byte chunks per K/V row
    constexpr u32 TILE = FK * FROW * 2;  // bytes of one K (or V) tile
    static_assert((FK * VPR) % NT == 0, "a K/V tile must split evenly over the block");
    extern __shared__ __align__(16) unsigned char dsmem[];
    const AttnSeq s = seqs[blockIdx.z];
    const u32 h = blockIdx.y, kvh = h / (n_heads / n_kv);
    // A descriptor outside the buffers (or with more queries than own keys) writes nothing.
    if ((u64)s.q_start + s.q_len > q_rows || (u64)s.p_start + s.p_len > p_rows ||
        (u64)s.k_start + s.k_len > kv_rows || s.q_len > s.k_len)
        return;
    const u32 L = s.p_len + s.k_len;
    const u32 off = L - s.q_len;  // logical index of query 0's own key
    const u32 n_qt = (s.q_len + FQ - 1) / FQ;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 base = smem_u32(dsmem);  // stage st: K at base + 2*st*TILE, V right after

    for (u32 ti = blockIdx.x; ti < n_qt; ti += gridDim.x) {
        const u32 q0 = (n_qt - 1 - ti) * FQ;
        const u32 q_end = min(s.q_len, q0 + FQ);
        const u32 kend = causal ? off + q_end : L;  // keys any row of the tile sees
        const u32 ntiles = (kend + FK - 1) / FK;
        const u32 r0 = q0 + warp * 16;  // this warp's first row
        const bool w_active = r0 < s.q_len;
        // keys this warp's rows see: all below w_kend; all rows see every key below w_full
        const u32 w_kend = !w_active ? 0 : (causal ? off + min(r0 + 16, s.q_len) : L);
        const u32 w_full = causal ? off + r0 + 1 : L;
        const u32 ia = r0 + g, ib = ia + 8;
        const bool va = ia < s.q_len, vb = ib < s.q_len;
        const u32 lim_a = causal ? min(off + ia + 1, L) : L;
        const u32 lim_b = causal ? min(off + ib + 1, L) : L;

        const bf16* qa = q + (u64)(s.q_start + (va ? ia : 0)) * q_stride + h * HEAD_DIM;
        const bf16* qb = q + (u64)(s.q_start + (vb ? ib : 0)) * q_stride + h * HEAD_DIM;
        u32 qf[KSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            qf[kk][0] = va ? *(const u32*)(qa + 16 * kk + 2 * t) : 0u;
            qf[kk][1] = vb ? *(const u32*)(qb + 16 * kk + 2 * t) : 0u;
            qf[kk][2] = va ? *(const u32*)(qa + 16 * kk + 8 + 2 * t) : 0u;
            qf[kk][3] = vb ? *(const u32*)(qb + 16 * kk + 8 + 2 * t) : 0u;
        }

        const KeyRows<HEAD_DIM, NT> rows(src.pk, src.pv, src.p_stride, src.k, src.v, src.kv_stride, s,
                           kvh);
        auto issue = [&](u32 it) {
            const u32 ks = base + (it & 1) * 2 * TILE;
            rows.copy_tile<FK, FROW>(ks, ks + TILE, it * FK, kend);
        };

        float o[DT][4];
#pragma unroll
        for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
        float m_a = NEG_INF_F, m_b = NEG_INF_F, l_a = 0.0f, l_b = 0.0f;

        __syncthreads();  // the previous query tile's last reads of the stages are done
        if (ntiles > 0) issue(0);
        cp_async_commit();
        for (u32 it = 0; it < ntiles; it++) {
            if (it + 1 < ntiles) issue(it + 1);
            cp_async_commit();
            cp_async_wait1();  // tile `it` landed (this thread's copies) ...
            __syncthreads();   // ... and everyone's
            const u32 t0 = it * FK;
            if (t0 < w_kend) {  // warp-uniform
                const u32 ks = base + (it & 1) * 2 * TILE, vs = ks + TILE;
                float sc[FK / 8][4];
#pragma unroll
                for (int j = 0; j < FK / 8; j++) {
                    sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
                    const u32 row = 8 * j + (lane & 7);
#pragma unroll
                    for (int kk = 0; kk + 1 < KSTEPS; kk += 2) {
                        u32 b0, b1, b2, b3;
                        ldsm_x4(ks + (row * FROW + 16 * kk + 8 * (lane >> 3)) * 2, b0, b1, b2, b3);
                        mma16(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                        mma16(sc[j], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], b2, b3);
                    }
                    if (KSTEPS & 1) {  // head_dim 80: one 16-dim step left
                        constexpr int kk = KSTEPS - 1;
                        u32 b0, b1;
                        ldsm_x2(ks + (row * FROW + 16 * kk + 8 * ((lane >> 3) & 1)) * 2, b0, b1);
                        mma16(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                    }
                }
                float mta = NEG_INF_F, mtb = NEG_INF_F;
                if (t0 + FK > w_full)
                    scale_mask<true>(sc, t0, t, lim_a, lim_b, scale_log2, mta, mtb);
                else
                    scale_mask<false>(sc, t0, t, lim_a, lim_b, scale_log2, mta, mtb);
                mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 1));
                mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 2));
                mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 1));
                mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 2));
                const float mna = fmaxf(m_a, mta), mnb = fmaxf(m_b, mtb);
                // a row that sees no key yet keeps max -inf; subtract 0 then (p = 0, o stays 0)
                const float ua = mna == NEG_INF_F ? 0.0f : mna;
                const float ub = mnb == NEG_INF_F ? 0.0f : mnb;
                const float ca = ex2(m_a - ua), cb = ex2(m_b - ub);
                m_a = mna;
                m_b = mnb;
                float lsa = 0.0f, lsb = 0.0f;
                u32 pa[FK / 8], pb[FK / 8];  // P of rows A / B as bf16 pairs (keys 8j + 2t, +1)
#pragma unroll
                for (int j = 0; j < FK / 8; j++) {
                    const float p0 = ex2(sc[j][0] - ua), p1 = ex2(sc[j][1] - ua);
                    const float p2 = ex2(sc[j][2] - ub), p3 = ex2(sc[j][3] - ub);
                    lsa += p0 + p1;
                    lsb += p2 + p3;
                    pa[j] = pack_bf2(p0, p1);
                    pb[j] = pack_bf2(p2, p3);
                }
                l_a = l_a * ca + lsa;
                l_b = l_b * cb + lsb;
#pragma unroll
                for (int jd = 0; jd < DT; jd++) {
                    o[jd][0] *= ca;
                    o[jd][1] *= ca;
                    o[jd][2] *= cb;
                    o[jd][3] *= cb;
                }
#pragma unroll
                for (int kk2 = 0; kk2 < FK / 16; kk2++) {
                    const u32 row = 16 * kk2 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
                    for (int jd = 0; jd < DT; jd += 2) {
                        u32 b0, b1, b2, b3;
                        const u32 col = 8 * (jd + (lane >> 4));
                        ldsm_x4_t(vs + (row * FROW + col) * 2, b0, b1, b2, b3);
                        mma16(o[jd], pa[2 * kk2], pb[2 * kk2], pa[2 * kk2 + 1], pb[2 * kk2 + 1], b0, b1);
                        mma16(o[jd + 1], pa[2 * kk2], pb[2 * kk2], pa[2 * kk2 + 1], pb[2 * kk2 + 1], b2, b3);
                    }
                }
            }
            __syncthreads();  // stage `it & 1` is refilled by the next iteration's issue
        }
        asm volatile("cp.async.wait_group 0;\n" ::);
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const bool v = half ? vb : va;
            if (!v) continue;
            const u32 i = half ? ib : ia;
            const float l = half ? l_b : l_a, m = half ? m_b : m_a;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            bf16* orow = out + (u64)(s.q_start + i) * o_stride + h * HEAD_DIM;
#pragma unroll
            for (int jd = 0; jd < DT; jd++)
                *(u32*)(orow + 8 * jd + 2 * t) =
                    pack_bf2(o[jd][2 * half] * inv, o[jd][2 * half + 1] * inv);
            if (lse != nullptr && t == 0)
                lse[(u64)(s.q_start + i) * n_heads + h] = (m + log2f(l)) * LN2_F;
        }
    }  // query tiles
}
