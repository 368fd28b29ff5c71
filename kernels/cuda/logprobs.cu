// Per-token log-probabilities of given tokens under softmax(logits / temperature), with entropy,
// fp32 accumulation, as cpu::logprobs_fwd defines them (z = logits / temperature):
//   logp[row] = z[target] - lse,  lse = log sum_j exp z_j,  entropy = lse - sum_j p_j z_j.
// The division is IEEE (skipped when temperature == 1). One block per row; per-thread running
// (max, sum exp, sum exp*z) triples are merged in a fixed tree order: deterministic. A target
// >= vocab gives NaN. entropy and lse may be null.

extern "C" __global__ void logprobs_fwd_bf16(float* __restrict__ logp, float* __restrict__ entropy,
                                             float* __restrict__ lse,
                                             const bf16* __restrict__ logits,
                                             const u32* __restrict__ targets, u32 rows,
                                             u32 vocab, u32 row_stride, float temperature) {
    pdl_wait();
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const bf16* x = logits + (u64)row * row_stride;
    const bool unit = temperature == 1.0f;
    const Lse3 a = row_lse3(x, vocab, temperature);
    __shared__ Lse3 part[32];
    const Lse3 r = lse3_block(a, part);
    if (threadIdx.x == 0) {
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
