// Runs attention_bwd_tc_prep, attention_bwd_tc_dprefix_f32 (+ reduce) and
// attention_bwd_tc_dkv_bf16 (+ reduce) of cuda/attention_bwd_tc.cu under the CPU emulation of
// emu.h and checks them against a double-precision reference of the SIMT kernels' definitions
// (cuda/attention_bwd.cu): D; the prefix gradients at splits 1, 2, 3, 16 (added to nonzero
// values; rows no span holds untouched; splits within fp32 rounding of each other); own-key
// dk/dv at hsplit 1, 2. Odd strides, two groups at unaligned prefix offsets, an overlapping
// span, a sequence without prefix, one without queries, an invalid descriptor, spare rows.
// DUMP=path writes dk, dv (hsplit h to path_h) and D, to compare two sources bit for bit.
// Build: kernels/emu/run.sh. Exit status 0 when every check passes.
#include "emu.h"
#include "kern.cu"  // common.cuh + the kernel source, asm helpers cut (gen.py)

#include <algorithm>
#include <random>
#include <string>

static std::mt19937_64 rng(12345);
static float urand() { return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng); }
static std::vector<bf16> rand_bf(size_t n) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = f2bf(urand());
    return v;
}
static double relerr(const std::vector<double>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}
static int failures = 0;
static void check(const std::string& name, double e, double tol) {
    printf("%-60s rel err %.3e (tol %.0e)%s\n", name.c_str(), e, tol, e <= tol ? "" : "  FAIL");
    if (!(e <= tol)) failures++;
}

int main() {
    const u32 H = HEADS, KV = 2, HD = HEAD_DIM, rep = H / KV;
    const u32 qw = H * HD, kvw = KV * HD;
    // two groups over one prefix buffer at rows 0 and 137, a sequence without a prefix, one
    // without queries, one whose prefix runs past the buffer (ignored)
    struct S { u32 len, ps, pl; };
    std::vector<S> spec = {{40, 0, 120}, {90, 0, 120}, {7, 0, 120},   {50, 0, 0},
                           {130, 137, 150}, {1, 137, 150}, {66, 137, 150}, {0, 137, 150},
                           {20, 137, 150}, {9, 250, 60}, {25, 130, 10}};
    const u32 p_rows = 300;
    std::vector<AttnSeq> seqs;
    u32 at = 0;
    for (auto& s : spec) {
        seqs.push_back(AttnSeq{at, s.len, s.ps, s.pl, at, s.len});
        at += s.len;
    }
    const u32 q_rows = at + 3, kv_rows = at + 3, n = seqs.size();  // 3 spare rows
    // strides wider than the rows (multiples of 8), as a fused buffer has
    const u32 q_stride = qw + 8, out_stride = qw + 16, p_stride = kvw + 8, kv_stride = kvw + 24;
    auto q = rand_bf((size_t)q_rows * q_stride), dout = rand_bf((size_t)q_rows * out_stride);
    auto out = rand_bf((size_t)q_rows * out_stride);
    auto pk = rand_bf((size_t)p_rows * p_stride), pv = rand_bf((size_t)p_rows * p_stride);
    auto k = rand_bf((size_t)kv_rows * kv_stride), v = rand_bf((size_t)kv_rows * kv_stride);
    const float scale = 1.0f / std::sqrt((float)HD);
    auto Q = [&](u32 i, u32 h, u32 e) { return (double)bf2f(q[(size_t)i * q_stride + h * HD + e]); };
    auto DO = [&](u32 i, u32 h, u32 e) { return (double)bf2f(dout[(size_t)i * out_stride + h * HD + e]); };
    auto O = [&](u32 i, u32 h, u32 e) { return (double)bf2f(out[(size_t)i * out_stride + h * HD + e]); };
    auto PK = [&](u32 j, u32 g, u32 e) { return (double)bf2f(pk[(size_t)j * p_stride + g * HD + e]); };
    auto PV = [&](u32 j, u32 g, u32 e) { return (double)bf2f(pv[(size_t)j * p_stride + g * HD + e]); };
    auto K = [&](u32 j, u32 g, u32 e) { return (double)bf2f(k[(size_t)j * kv_stride + g * HD + e]); };
    auto V = [&](u32 j, u32 g, u32 e) { return (double)bf2f(v[(size_t)j * kv_stride + g * HD + e]); };
    auto valid = [&](const AttnSeq& s) {
        return (u64)s.q_start + s.q_len <= q_rows && (u64)s.k_start + s.k_len <= kv_rows &&
               (u64)s.p_start + s.p_len <= p_rows && s.q_len <= s.k_len;
    };
    auto dot = [&](auto A, u32 i, u32 h, auto B, u32 j, u32 g) {
        double s = 0;
        for (u32 e = 0; e < HD; e++) s += A(i, h, e) * B(j, g, e);
        return s;
    };
    // lse: the natural-log LSE over every key a query sees (prefix, then causal own keys)
    std::vector<float> lse((size_t)q_rows * H, 0.0f);
    for (auto& s : seqs) {
        if (!valid(s)) continue;
        for (u32 qi = 0; qi < s.q_len; qi++)
            for (u32 h = 0; h < H; h++) {
                const u32 i = s.q_start + qi, g = h / rep;
                double m = -INFINITY, sum = 0;
                std::vector<double> sc;
                for (u32 j = s.p_start; j < s.p_start + s.p_len; j++) sc.push_back(dot(Q, i, h, PK, j, g) * scale);
                for (u32 kj = 0; kj <= s.k_len - s.q_len + qi; kj++) sc.push_back(dot(Q, i, h, K, s.k_start + kj, g) * scale);
                for (double x : sc) m = std::max(m, x);
                for (double x : sc) sum += std::exp(x - m);
                lse[(size_t)i * H + h] = (float)(m + std::log(sum));
            }
    }
    // ---- references ----
    std::vector<double> rpk((size_t)p_rows * kvw, 0), rpv((size_t)p_rows * kvw, 0);
    std::vector<bool> covered(p_rows, false);
    std::vector<double> rdk((size_t)kv_rows * kvw, 0), rdv((size_t)kv_rows * kvw, 0);
    for (auto& s : seqs) {
        if (!valid(s)) continue;
        for (u32 j = s.p_start; j < s.p_start + s.p_len; j++) covered[j] = true;
        for (u32 qi = 0; qi < s.q_len; qi++)
            for (u32 h = 0; h < H; h++) {
                const u32 i = s.q_start + qi, g = h / rep;
                double D = 0;
                for (u32 e = 0; e < HD; e++) D += DO(i, h, e) * O(i, h, e);
                const double L = lse[(size_t)i * H + h];
                auto term = [&](auto KK, auto VV, u32 j, std::vector<double>& dk, std::vector<double>& dv) {
                    const double p = std::exp(dot(Q, i, h, KK, j, g) * scale - L);
                    const double ds = p * (dot(DO, i, h, VV, j, g) - D);
                    for (u32 e = 0; e < HD; e++) {
                        dv[(size_t)j * kvw + g * HD + e] += p * DO(i, h, e);
                        dk[(size_t)j * kvw + g * HD + e] += ds * scale * Q(i, h, e);
                    }
                };
                for (u32 j = s.p_start; j < s.p_start + s.p_len; j++) term(PK, PV, j, rpk, rpv);
                for (u32 kj = 0; kj <= s.k_len - s.q_len + qi; kj++) term(K, V, s.k_start + kj, rdk, rdv);
            }
    }
    // ---- prep: D (no dq) ----
    std::vector<float> dsum((size_t)q_rows * H, NAN);
#ifdef PREP_WITH_DQ  // sources whose prep cannot take a null dq
    std::vector<bf16> dq_((size_t)q_rows * q_stride);
    bf16* dqp = dq_.data();
#else
    bf16* dqp = nullptr;
#endif
    emu_launch(EmuDim{(q_rows * H + 3) / 4, 1, 1}, 0, [&] {
        attention_bwd_tc_prep(dsum.data(), dqp, dout.data(), out.data(), seqs.data(), n,
                              q_rows, kv_rows, p_rows, H, q_stride, out_stride);
    });
    {
        std::vector<double> got, want;
        for (auto& s : seqs) {
            if (!valid(s)) continue;
            for (u32 qi = 0; qi < s.q_len; qi++)
                for (u32 h = 0; h < H; h++) {
                    const u32 i = s.q_start + qi;
                    double D = 0;
                    for (u32 e = 0; e < HD; e++) D += DO(i, h, e) * O(i, h, e);
                    got.push_back(dsum[(size_t)i * H + h]);
                    want.push_back(D);
                }
        }
        check("prep D (dq null)", relerr(got, want), 1e-5);
    }
    // ---- dprefix ----
    const size_t tile = 64 * (HD + 8) * 2, smem = 2 * tile + 2 * (2 * tile + 2 * 64 * 4);
    std::vector<float> base((size_t)p_rows * p_stride * 2);
    for (auto& x : base) x = urand() * 0.01f;
    std::vector<float> first_k, first_v;
#ifndef PREP_WITH_DQ
    for (u32 split : {1u, 2u, 3u, 16u}) {
        std::vector<float> dpk(base.begin(), base.begin() + (size_t)p_rows * p_stride);
        std::vector<float> dpv(base.begin() + (size_t)p_rows * p_stride, base.end());
        std::vector<float> part(split > 1 ? 2 * (size_t)split * p_rows * kvw : 1, NAN);
        emu_launch(EmuDim{(p_rows + 63) / 64, KV, split}, smem, [&] {
            attention_bwd_tc_dprefix_f32(dpk.data(), dpv.data(), dout.data(), q.data(), pk.data(),
                                         pv.data(), lse.data(), dsum.data(), seqs.data(), n,
                                         q_rows, kv_rows, p_rows, H, KV, q_stride, p_stride,
                                         out_stride, scale, split, split > 1 ? part.data() : nullptr);
        });
        if (split > 1) {
                    emu_launch(EmuDim{(p_rows * KV + 3) / 4, 1, 1}, 0, [&] {
                attention_bwd_tc_dprefix_reduce(dpk.data(), dpv.data(), part.data(), seqs.data(), n,
                                                q_rows, kv_rows, p_rows, KV, p_stride, split, scale);
            });
        }
        std::vector<double> gk, gv, wk, wv;
        int untouched_bad = 0;
        for (u32 j = 0; j < p_rows; j++)
            for (u32 c = 0; c < p_stride; c++) {
                const size_t o = (size_t)j * p_stride + c;
                const float bk = base[o], bv = base[(size_t)p_rows * p_stride + o];
                if (!covered[j] || c >= kvw) {
                    untouched_bad += memcmp(&dpk[o], &bk, 4) != 0 || memcmp(&dpv[o], &bv, 4) != 0;
                } else {
                    gk.push_back((double)dpk[o] - bk);
                    gv.push_back((double)dpv[o] - bv);
                    wk.push_back(rpk[(size_t)j * kvw + c]);
                    wv.push_back(rpv[(size_t)j * kvw + c]);
                }
            }
        const std::string l = "dprefix hd" + std::to_string(HD) + " split " + std::to_string(split);
        check(l + " dk", relerr(gk, wk), 1e-2);
        check(l + " dv", relerr(gv, wv), 1e-2);
        printf("%-60s %d elements changed that must not\n", (l + " untouched").c_str(), untouched_bad);
        if (untouched_bad) failures++;
        if (first_k.empty()) {
            first_k = dpk;
            first_v = dpv;
        } else {
            std::vector<double> a, b, c, d;
            for (size_t i = 0; i < dpk.size(); i++) {
                a.push_back(dpk[i]); b.push_back(first_k[i]); c.push_back(dpv[i]); d.push_back(first_v[i]);
            }
            check(l + " vs split 1 (dk, incl. base)", relerr(a, b), 1e-6);
            std::vector<double> da, db, dc, dd;
            for (u32 j = 0; j < p_rows; j++)
                for (u32 c = 0; c < kvw; c++) {
                    const size_t o = (size_t)j * p_stride + c;
                    da.push_back((double)dpk[o] - base[o]);
                    db.push_back((double)first_k[o] - base[o]);
                    dc.push_back((double)dpv[o] - base[(size_t)p_rows * p_stride + o]);
                    dd.push_back((double)first_v[o] - base[(size_t)p_rows * p_stride + o]);
                }
            check(l + " vs split 1 (dk deltas)", relerr(da, db), 1e-5);
            check(l + " vs split 1 (dv deltas)", relerr(dc, dd), 1e-5);
            check(l + " vs split 1 (dv, incl. base)", relerr(c, d), 1e-6);
        }
    }
#endif
    // ---- dkv (own keys), hsplit 1 and 2 ----
    for (u32 hsplit : {1u, 2u}) {
        if (rep % hsplit) continue;
        std::vector<bf16> dk((size_t)kv_rows * kv_stride, 0x7fc0), dv((size_t)kv_rows * kv_stride, 0x7fc0);
        std::vector<float> part(hsplit > 1 ? 2 * (size_t)hsplit * kv_rows * kvw : 1, NAN);
        emu_launch(EmuDim{(kv_rows + 63) / 64, KV * hsplit, n}, smem, [&] {
            attention_bwd_tc_dkv_bf16(dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                      lse.data(), dsum.data(), seqs.data(), n, q_rows, kv_rows, p_rows,
                                      H, KV, q_stride, kv_stride, out_stride, 1, scale, hsplit,
                                      hsplit > 1 ? part.data() : nullptr);
        });
        if (hsplit > 1) {
                    emu_launch(EmuDim{(kv_rows * KV + 3) / 4, 1, 1}, 0, [&] {
                attention_bwd_tc_dkv_reduce(dk.data(), dv.data(), part.data(), seqs.data(), n, q_rows,
                                            kv_rows, p_rows, KV, kv_stride, hsplit, scale);
            });
        }
        std::vector<double> gk, gv, wk, wv;
        for (auto& s : seqs) {
            if (!valid(s)) continue;
            for (u32 kj = 0; kj < s.k_len; kj++)
                for (u32 c = 0; c < kvw; c++) {
                    const u32 j = s.k_start + kj;
                    gk.push_back(bf2f(dk[(size_t)j * kv_stride + c]));
                    gv.push_back(bf2f(dv[(size_t)j * kv_stride + c]));
                    wk.push_back(rdk[(size_t)j * kvw + c]);
                    wv.push_back(rdv[(size_t)j * kvw + c]);
                }
        }
        const std::string l = "dkv hd" + std::to_string(HD) + " hsplit " + std::to_string(hsplit);
        if (getenv("DUMP")) {
            FILE* f = fopen((std::string(getenv("DUMP")) + "_" + std::to_string(hsplit)).c_str(), "wb");
            fwrite(dk.data(), 2, dk.size(), f);
            fwrite(dv.data(), 2, dv.size(), f);
            fwrite(dsum.data(), 4, dsum.size(), f);
            fclose(f);
        }
        check(l + " dk", relerr(gk, wk), 1e-2);
        check(l + " dv", relerr(gv, wv), 1e-2);
    }
    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures != 0;
}
