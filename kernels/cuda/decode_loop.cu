// The device side of a decode loop that the host does not drive step by step: after each step's
// sampling, `decode_advance` records every live row's token and log-prob, applies the stop test
// and writes the next forward's inputs (token, RoPE rows, attention descriptor, KV write row) and
// the next draw's key; `decode_gather_rows` compacts the row table. The CPU twin in
// src/cuda/decode_loop.rs (`decode_advance_ref`) computes the same, field for field.

// One decode row (`DecodeRow` in decode_loop.rs: same fields, same order).
struct DecodeRow {
    u32 sample;         // the sample this row decodes (its output table row)
    u32 key;            // the sample id its draws are keyed by
    u32 prefix_offset;  // the group's prefix in the KV arena
    u32 prefix_len;
    u32 suffix_offset;  // the sample's own rows in the KV arena
    u32 suffix_len;     // tokens fed so far
    u32 rope_row;       // RoPE table row of suffix position 0
    u32 forced;         // 1: the sample stops at `stop_len` tokens, whatever it draws
    u32 stop_len;
    u32 done;           // 1 once the sample stopped (and for padding rows)
    u32 step;           // the step whose token this row draws next
};

// One block per row. Thread 0 keeps the books; the block copies the RoPE rows.
// A live row at step s that draws `tok`: out_tok/out_lp[sample, s] = tok/lp; it stops when
// forced ? s + 1 >= stop_len : (tok is a stop id || s + 1 >= max_new), and then
// done_step[sample] = s; otherwise `tok` is fed: position rope_row + suffix_len, KV row
// suffix_offset + suffix_len, attending the prefix and suffix_len + 1 own rows. A done row feeds
// token 0, writes no KV (row 0xffffffff) and attends its group's first prefix row twice, so its
// (discarded) work is small and reads only written memory; with `keep_prefix` (group-shared
// attention, which reads each group's prefix from its first row's descriptor) it attends the
// whole prefix and that row.
extern "C" __global__ void decode_advance(
    DecodeRow* __restrict__ rows, u32 n_rows, const u32* __restrict__ toks,
    const float* __restrict__ lps, const u32* __restrict__ stop_ids, u32 n_stop, u32 max_new,
    u32 keep_prefix,
    u32* __restrict__ out_tok, float* __restrict__ out_lp, u32* __restrict__ done_step,
    const float* __restrict__ cos_tab, const float* __restrict__ sin_tab, u32 tab_rows,
    u32 head_dim, u32* __restrict__ feed, float* __restrict__ cos, float* __restrict__ sin,
    AttnSeq* __restrict__ seqs, u32* __restrict__ write_rows, u32* __restrict__ sample_ids,
    u32* __restrict__ steps) {
    pdl_wait();
    const u32 r = blockIdx.x;
    if (r >= n_rows) return;
    __shared__ u32 s_pos;
    if (threadIdx.x == 0) {
        DecodeRow row = rows[r];
        u32 live = 0, pos = 0;
        if (!row.done) {
            const u32 tok = toks[r], step = row.step, len = step + 1;
            const u64 at = (u64)row.sample * max_new + step;
            out_tok[at] = tok;
            out_lp[at] = lps[r];
            bool stop;
            if (row.forced) {
                stop = len >= row.stop_len;
            } else {
                stop = len >= max_new;
                for (u32 i = 0; i < n_stop; i++) stop = stop || tok == stop_ids[i];
            }
            if (stop) {
                row.done = 1;
                done_step[row.sample] = step;
            } else {
                live = 1;
                pos = row.rope_row + row.suffix_len;
                feed[r] = tok;
                AttnSeq s;
                s.q_start = r;
                s.q_len = 1;
                s.p_start = row.prefix_offset;
                s.p_len = row.prefix_len;
                s.k_start = row.suffix_offset;
                s.k_len = row.suffix_len + 1;
                seqs[r] = s;
                write_rows[r] = row.suffix_offset + row.suffix_len;
                row.suffix_len += 1;
            }
            row.step = len;
            rows[r] = row;
        }
        if (!live) {
            feed[r] = 0;
            AttnSeq s;
            s.q_start = r;
            s.q_len = 1;
            s.p_start = row.prefix_offset;
            s.p_len = keep_prefix ? row.prefix_len : 1;
            s.k_start = row.prefix_offset;
            s.k_len = 1;
            seqs[r] = s;
            write_rows[r] = 0xffffffffu;
        }
        sample_ids[r] = row.key;
        steps[r] = row.step;
        s_pos = pos < tab_rows ? pos : tab_rows - 1;
    }
    __syncthreads();
    const float* cs = cos_tab + (u64)s_pos * head_dim;
    const float* sn = sin_tab + (u64)s_pos * head_dim;
    for (u32 i = threadIdx.x; i < head_dim; i += blockDim.x) {
        cos[(u64)r * head_dim + i] = cs[i];
        sin[(u64)r * head_dim + i] = sn[i];
    }
}

// dst[i] = src[map[i]] for i < n, and the next draw's key of each row.
extern "C" __global__ void decode_gather_rows(DecodeRow* __restrict__ dst,
                                              const DecodeRow* __restrict__ src,
                                              const u32* __restrict__ map, u32 n,
                                              u32* __restrict__ sample_ids,
                                              u32* __restrict__ steps) {
    pdl_wait();
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const DecodeRow row = src[map[i]];
    dst[i] = row;
    sample_ids[i] = row.key;
    steps[i] = row.step;
}
