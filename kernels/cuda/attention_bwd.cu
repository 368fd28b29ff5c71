// Attention backward (varlen, causal or full, GQA, shared prefix): the CUDA twin of
// crate::cpu::attention_bwd. A straightforward version: probabilities are recomputed from the
// forward's natural-log LSE, one warp per (row, head) output, each lane holding head_dim / 32
// elements (head_dim <= 256); every sum runs in a fixed order (keys or queries ascending, warp
// butterflies), so the result depends only on the inputs. With S = q.k * scale,
// P = exp(S - lse), D_i = dout_i . out_i, dS_ij = P_ij (dout_i . v_j - D_i):
//   dq_i = scale sum_j dS_ij k_j        (prefix keys, then own keys, ascending)
//   dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dout_i   (query heads of the group, then
//                                                              queries, ascending)
//   dprefix_k/v[j] += the same over every sequence whose prefix holds row j (sequences, heads,
//                     queries ascending), in fp32.
// Descriptors (struct AttnSeq in common.cuh) that do not fit the buffers are ignored; rows of dq,
// dk, dv that belong to no (valid) sequence are written with zeros. The first valid sequence
// holding a row owns it.

#define BWD_EPL 8

__device__ __forceinline__ bool bwd_seq_ok(const AttnSeq& s, u32 q_rows, u32 kv_rows,
                                           u32 p_rows) {
    return (u64)s.q_start + s.q_len <= q_rows && (u64)s.k_start + s.k_len <= kv_rows &&
           (u64)s.p_start + s.p_len <= p_rows && s.q_len <= s.k_len;
}

__device__ __forceinline__ void bwd_load(const bf16* p, float* r, u32 lane, u32 hd) {
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) {
        const u32 i = lane + 32u * e;
        r[e] = i < hd ? bf2f(p[i]) : 0.0f;
    }
}

__device__ __forceinline__ float bwd_dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) s += a[e] * b[e];
    return warp_sum(s);
}

// Adds the contribution of query row i (head h; qv, dov already loaded; D and L its
// dout.out and LSE) to a key row's dk / dv accumulators (kv, vv loaded).
__device__ __forceinline__ void bwd_key_pair(const float* qv, const float* dov, float D, float L,
                                             const float* kv, const float* vv, float scale,
                                             float* dk, float* dv) {
    const float p = expf(bwd_dot(qv, kv) * scale - L);
    const float ds = p * (bwd_dot(dov, vv) - D);
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) {
        dv[e] += p * dov[e];
        dk[e] += ds * scale * qv[e];
    }
}

// dq: one warp per (query row i, head h), i < q_rows.
extern "C" __global__ void attention_bwd_dq_bf16(
    bf16* __restrict__ dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
    const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ pk,
    const bf16* __restrict__ pv, const bf16* __restrict__ out, const float* __restrict__ lse,
    const AttnSeq* __restrict__ seqs, u32 n_seqs, u32 q_rows, u32 kv_rows, u32 p_rows,
    u32 n_heads, u32 n_kv, u32 hd, u32 q_stride, u32 kv_stride, u32 p_stride, u32 out_stride,
    u32 causal, float scale) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)q_rows * n_heads) return;
    const u32 i = (u32)(w / n_heads), h = (u32)(w % n_heads), g = h / (n_heads / n_kv);
    float acc[BWD_EPL];
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) acc[e] = 0.0f;
    int found = -1;
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (bwd_seq_ok(s, q_rows, kv_rows, p_rows) && i >= s.q_start && i < s.q_start + s.q_len) {
            found = (int)si;
            break;
        }
    }
    if (found >= 0) {
        const AttnSeq s = seqs[found];
        float qv[BWD_EPL], dov[BWD_EPL], ov[BWD_EPL], kv[BWD_EPL], vv[BWD_EPL];
        bwd_load(q + (u64)i * q_stride + h * hd, qv, lane, hd);
        bwd_load(dout + (u64)i * out_stride + h * hd, dov, lane, hd);
        bwd_load(out + (u64)i * out_stride + h * hd, ov, lane, hd);
        const float D = bwd_dot(dov, ov), L = lse[(u64)i * n_heads + h];
        const u32 qi = i - s.q_start;
        const u32 n_own = causal ? s.k_len - s.q_len + qi + 1 : s.k_len;
        for (u32 kk = 0; kk < s.p_len + n_own; kk++) {
            const bf16 *kr, *vr;
            if (kk < s.p_len) {
                const u64 o = (u64)(s.p_start + kk) * p_stride + g * hd;
                kr = pk + o;
                vr = pv + o;
            } else {
                const u64 o = (u64)(s.k_start + kk - s.p_len) * kv_stride + g * hd;
                kr = k + o;
                vr = v + o;
            }
            bwd_load(kr, kv, lane, hd);
            bwd_load(vr, vv, lane, hd);
            const float p = expf(bwd_dot(qv, kv) * scale - L);
            const float ds = p * (bwd_dot(dov, vv) - D);
#pragma unroll
            for (int e = 0; e < BWD_EPL; e++) acc[e] += ds * scale * kv[e];
        }
    }
    bf16* o = dq + (u64)i * q_stride + h * hd;
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) {
        const u32 idx = lane + 32u * e;
        if (idx < hd) o[idx] = f2bf(acc[e]);
    }
}

// dk, dv of own keys: one warp per (key row j, kv head g), j < kv_rows.
extern "C" __global__ void attention_bwd_dkv_bf16(
    bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
    const bf16* __restrict__ out, const float* __restrict__ lse, const AttnSeq* __restrict__ seqs,
    u32 n_seqs, u32 q_rows, u32 kv_rows, u32 p_rows, u32 n_heads, u32 n_kv, u32 hd,
    u32 q_stride, u32 kv_stride, u32 out_stride, u32 causal, float scale) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)kv_rows * n_kv) return;
    const u32 j = (u32)(w / n_kv), g = (u32)(w % n_kv), rep = n_heads / n_kv;
    float gk[BWD_EPL], gv[BWD_EPL];
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) gk[e] = gv[e] = 0.0f;
    int found = -1;
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (bwd_seq_ok(s, q_rows, kv_rows, p_rows) && j >= s.k_start && j < s.k_start + s.k_len) {
            found = (int)si;
            break;
        }
    }
    if (found >= 0) {
        const AttnSeq s = seqs[found];
        float kv[BWD_EPL], vv[BWD_EPL], qv[BWD_EPL], dov[BWD_EPL], ov[BWD_EPL];
        const u64 ko = (u64)j * kv_stride + g * hd;
        bwd_load(k + ko, kv, lane, hd);
        bwd_load(v + ko, vv, lane, hd);
        const u32 kk = j - s.k_start, off = s.k_len - s.q_len;
        const u32 qi0 = causal && kk > off ? kk - off : 0;
        for (u32 h = g * rep; h < (g + 1) * rep; h++)
            for (u32 qi = qi0; qi < s.q_len; qi++) {
                const u32 i = s.q_start + qi;
                bwd_load(q + (u64)i * q_stride + h * hd, qv, lane, hd);
                bwd_load(dout + (u64)i * out_stride + h * hd, dov, lane, hd);
                bwd_load(out + (u64)i * out_stride + h * hd, ov, lane, hd);
                bwd_key_pair(qv, dov, bwd_dot(dov, ov), lse[(u64)i * n_heads + h], kv, vv, scale,
                             gk, gv);
            }
    }
    const u64 o = (u64)j * kv_stride + g * hd;
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) {
        const u32 idx = lane + 32u * e;
        if (idx < hd) {
            dk[o + idx] = f2bf(gk[e]);
            dv[o + idx] = f2bf(gv[e]);
        }
    }
}

// Shared prefix keys: one warp per (prefix row j, kv head g), j < p_rows; adds (fp32) the
// gradient of every query of every sequence whose prefix span holds row j.
extern "C" __global__ void attention_bwd_dprefix_f32(
    float* __restrict__ dpk, float* __restrict__ dpv, const bf16* __restrict__ dout,
    const bf16* __restrict__ q, const bf16* __restrict__ pk, const bf16* __restrict__ pv,
    const bf16* __restrict__ out, const float* __restrict__ lse, const AttnSeq* __restrict__ seqs,
    u32 n_seqs, u32 q_rows, u32 kv_rows, u32 p_rows, u32 n_heads, u32 n_kv, u32 hd,
    u32 q_stride, u32 p_stride, u32 out_stride, float scale) {
    const u32 lane = threadIdx.x & 31u;
    const u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (u64)p_rows * n_kv) return;
    const u32 j = (u32)(w / n_kv), g = (u32)(w % n_kv), rep = n_heads / n_kv;
    float gk[BWD_EPL], gv[BWD_EPL], kv[BWD_EPL], vv[BWD_EPL], qv[BWD_EPL], dov[BWD_EPL],
        ov[BWD_EPL];
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) gk[e] = gv[e] = 0.0f;
    const u64 ko = (u64)j * p_stride + g * hd;
    bwd_load(pk + ko, kv, lane, hd);
    bwd_load(pv + ko, vv, lane, hd);
    bool any = false;
    for (u32 si = 0; si < n_seqs; si++) {
        const AttnSeq s = seqs[si];
        if (!bwd_seq_ok(s, q_rows, kv_rows, p_rows) || j < s.p_start || j >= s.p_start + s.p_len)
            continue;
        any = true;
        for (u32 h = g * rep; h < (g + 1) * rep; h++)
            for (u32 qi = 0; qi < s.q_len; qi++) {
                const u32 i = s.q_start + qi;
                bwd_load(q + (u64)i * q_stride + h * hd, qv, lane, hd);
                bwd_load(dout + (u64)i * out_stride + h * hd, dov, lane, hd);
                bwd_load(out + (u64)i * out_stride + h * hd, ov, lane, hd);
                bwd_key_pair(qv, dov, bwd_dot(dov, ov), lse[(u64)i * n_heads + h], kv, vv, scale,
                             gk, gv);
            }
    }
    if (!any) return;
#pragma unroll
    for (int e = 0; e < BWD_EPL; e++) {
        const u32 idx = lane + 32u * e;
        if (idx < hd) {
            dpk[ko + idx] += gk[e];
            dpv[ko + idx] += gv[e];
        }
    }
}
