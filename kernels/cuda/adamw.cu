// AdamW step over n fp32 elements, op for op as runtime/src/train/adamw.rs computes it on the
// CPU (torch.optim.AdamW's single-tensor rule), with explicitly rounded intrinsics so that no
// multiply-add is fused: the result is bitwise the CPU's.
//   if decay: p = p * decay_mul
//   m = lerp(m, g, w1)             (torch's two-formula lerp)
//   v = v * b2 + (one_minus_b2 * g) * g
//   p = p + neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)
// The scalars are computed once on the host in f64 and rounded to f32 exactly as the CPU does.
// When out is not null it receives bf16(p) (the compute copy).
extern "C" __global__ void adamw_step_f32(float* __restrict__ p, float* __restrict__ m,
                                          float* __restrict__ v, const float* __restrict__ g,
                                          bf16* __restrict__ out, u64 n, u32 decay,
                                          float decay_mul, float w1, float b2,
                                          float one_minus_b2, float neg_step_size,
                                          float bc2_sqrt, float eps) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        const float gi = g[i];
        if (decay) pi = __fmul_rn(pi, decay_mul);
        if (fabsf(w1) < 0.5f) {
            mi = __fadd_rn(mi, __fmul_rn(w1, __fsub_rn(gi, mi)));
        } else {
            mi = __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, mi), __fsub_rn(1.0f, w1)));
        }
        vi = __fadd_rn(__fmul_rn(vi, b2), __fmul_rn(__fmul_rn(one_minus_b2, gi), gi));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step_size, mi), denom));
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (out != nullptr) out[i] = f2bf(pi);
    }
}
