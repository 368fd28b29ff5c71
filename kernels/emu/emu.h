// A CPU emulation of the CUDA execution model, enough to run the attention backward kernels of
// cuda/attention_bwd_tc.cu (kernels/emu/run.sh):
// one block at a time, its 128 threads as cooperative contexts (ucontext), __syncthreads and
// warp collectives (ldmatrix, mma.sync m16n8k16 bf16, shfl) through barriers, cp.async
// deferred to the wait_group that must complete it.
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __shared__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __launch_bounds__(...)

struct EmuDim { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
static EmuDim emu_block_idx, emu_grid_dim, emu_block_dim;
static int g_tid = 0;
static unsigned char* g_smem = nullptr;
static size_t emu_smem_bytes = 0;  // the launch's dynamic shared memory
inline EmuDim emu_thread_idx() { return EmuDim{(unsigned)g_tid, 0, 0}; }
#define threadIdx (emu_thread_idx())
#define blockIdx emu_block_idx
#define gridDim emu_grid_dim
#define blockDim emu_block_dim

static const int NT = 128;
typedef unsigned int u32_;
// cp.async state per thread: copies issued since the last commit, committed groups in order
struct Copy { u32_ dst; const void* src; bool valid; };
static std::vector<Copy> pend[NT];
static std::vector<std::vector<Copy>> groups[NT];

static ucontext_t g_sched, g_ctx[NT];
static bool g_done[NT];
static std::vector<char> g_stacks[NT];
static std::function<void()> g_kernel;

inline void emu_yield() { swapcontext(&g_ctx[g_tid], &g_sched); }

// barriers: block and per warp, counted over live threads
static int blk_cnt = 0, blk_gen = 0;
static int warp_cnt[4], warp_gen[4];
inline int live_in(int lo, int hi) {
    int n = 0;
    for (int i = lo; i < hi; i++) n += !g_done[i];
    return n;
}
inline void __syncthreads() {
    int gen = blk_gen;
    if (++blk_cnt == live_in(0, NT)) {
        blk_cnt = 0;
        blk_gen++;
    } else {
        while (blk_gen == gen) emu_yield();
    }
}
inline void warp_sync() {
    int w = g_tid / 32, gen = warp_gen[w];
    if (++warp_cnt[w] == live_in(32 * w, 32 * w + 32)) {
        warp_cnt[w] = 0;
        warp_gen[w]++;
    } else {
        while (warp_gen[w] == gen) emu_yield();
    }
}

static void emu_entry() {
    g_kernel();
    g_done[g_tid] = true;
    // a thread that leaves may complete a barrier the others wait at
    int w = g_tid / 32;
    if (warp_cnt[w] > 0 && warp_cnt[w] == live_in(32 * w, 32 * w + 32)) {
        warp_cnt[w] = 0;
        warp_gen[w]++;
    }
    if (blk_cnt > 0 && blk_cnt == live_in(0, NT)) {
        blk_cnt = 0;
        blk_gen++;
    }
}

// Runs kernel body `k` over the grid, blocks in order, with `smem` bytes of shared memory.
inline void emu_launch(EmuDim grid, size_t smem, std::function<void()> k) {
    std::vector<unsigned char> sm(smem + 16);
    emu_grid_dim = grid;
    emu_block_dim = EmuDim{(unsigned)NT, 1, 1};
    g_kernel = k;
    emu_smem_bytes = smem;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                emu_block_idx = EmuDim{x, y, z};
                // poison shared memory: a read of what no copy wrote shows up
                memset(sm.data(), 0xff, sm.size());
                g_smem = sm.data();
                blk_cnt = blk_gen = 0;
                for (int w = 0; w < 4; w++) warp_cnt[w] = warp_gen[w] = 0;
                for (int t = 0; t < NT; t++) {
                    g_done[t] = false;
                    g_stacks[t].resize(256 * 1024);
                    getcontext(&g_ctx[t]);
                    g_ctx[t].uc_stack.ss_sp = g_stacks[t].data();
                    g_ctx[t].uc_stack.ss_size = g_stacks[t].size();
                    g_ctx[t].uc_link = &g_sched;
                    makecontext(&g_ctx[t], emu_entry, 0);
                }
                for (;;) {
                    bool any = false;
                    for (int t = 0; t < NT; t++) {
                        if (g_done[t]) continue;
                        any = true;
                        g_tid = t;
                        swapcontext(&g_sched, &g_ctx[t]);
                    }
                    if (!any) break;
                }
                for (int t = 0; t < NT; t++)
                    if (!pend[t].empty() || !groups[t].empty()) {
                        fprintf(stderr, "thread %d left cp.async copies unwaited\n", t);
                        abort();
                    }
            }
}

// ---- device functions NVRTC provides ----
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

static float xch_f[NT];
inline float __shfl_xor_sync(unsigned, float v, int o, int = 32) {
    xch_f[g_tid] = v;
    warp_sync();
    float r = xch_f[(g_tid & ~31) | ((g_tid & 31) ^ o)];
    warp_sync();
    return r;
}

// ---- the inline-PTX helpers of attention_bwd_tc.cu ----
inline u32_ smem_u32(const void* p) { return (u32_)((const unsigned char*)p - g_smem); }
inline void cp_async16(u32_ dst, const void* src, bool valid) {
    if (dst % 16 != 0 || dst + 16 > emu_smem_bytes) {
        fprintf(stderr, "cp.async to bad shared address %u\n", dst);
        abort();
    }
    if (valid && ((uintptr_t)src % 16) != 0) {
        fprintf(stderr, "cp.async from unaligned global address %p\n", src);
        abort();
    }
    pend[g_tid].push_back(Copy{dst, src, valid});
}
inline void cp_async_commit() {
    groups[g_tid].push_back(pend[g_tid]);
    pend[g_tid].clear();
}
inline void emu_complete(size_t keep) {
    auto& gs = groups[g_tid];
    while (gs.size() > keep) {
        for (auto& c : gs.front()) {
            if (c.valid) memcpy(g_smem + c.dst, c.src, 16);
            else memset(g_smem + c.dst, 0, 16);
        }
        gs.erase(gs.begin());
    }
}
inline void cp_async_wait1() { emu_complete(1); }
inline void cp_async_wait0() { emu_complete(0); }

static u32_ xch_addr[NT];
inline unsigned short lds16(u32_ a) {
    if (a + 2 > emu_smem_bytes) { fprintf(stderr, "ldmatrix past shared memory\n"); abort(); }
    unsigned short v; memcpy(&v, g_smem + a, 2); return v;
}
inline void ldsm_impl(u32_ addr, bool trans, u32_* r) {
    xch_addr[g_tid] = addr;
    warp_sync();
    const int base = g_tid & ~31, l = g_tid & 31;
    for (int i = 0; i < 4; i++) {
        if (!trans) {
            const u32_ row = xch_addr[base + 8 * i + l / 4];
            r[i] = (u32_)lds16(row + 4 * (l % 4)) | ((u32_)lds16(row + 4 * (l % 4) + 2) << 16);
        } else {
            const u32_ r0 = xch_addr[base + 8 * i + 2 * (l % 4)];
            const u32_ r1 = xch_addr[base + 8 * i + 2 * (l % 4) + 1];
            r[i] = (u32_)lds16(r0 + 2 * (l / 4)) | ((u32_)lds16(r1 + 2 * (l / 4)) << 16);
        }
    }
    warp_sync();
}
inline void ldsm_x4(u32_ addr, u32_& r0, u32_& r1, u32_& r2, u32_& r3) {
    u32_ r[4]; ldsm_impl(addr, false, r); r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void ldsm_x4_t(u32_ addr, u32_& r0, u32_& r1, u32_& r2, u32_& r3) {
    u32_ r[4]; ldsm_impl(addr, true, r); r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
static u32_ xch_a[NT][4], xch_b[NT][2];
inline float bfv(u32_ w, int hi) { return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16)); }
inline void mma16(float* c, u32_ a0, u32_ a1, u32_ a2, u32_ a3, u32_ b0, u32_ b1) {
    xch_a[g_tid][0] = a0; xch_a[g_tid][1] = a1; xch_a[g_tid][2] = a2; xch_a[g_tid][3] = a3;
    xch_b[g_tid][0] = b0; xch_b[g_tid][1] = b1;
    warp_sync();
    const int base = g_tid & ~31;
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        const int g = L >> 2, t = L & 3;
        const u32_* a = xch_a[base + L];
        const u32_* b = xch_b[base + L];
        for (int h = 0; h < 2; h++) {
            A[g][2 * t + h] = bfv(a[0], h);
            A[g + 8][2 * t + h] = bfv(a[1], h);
            A[g][2 * t + 8 + h] = bfv(a[2], h);
            A[g + 8][2 * t + 8 + h] = bfv(a[3], h);
            B[2 * t + h][g] = bfv(b[0], h);
            B[2 * t + 8 + h][g] = bfv(b[1], h);
        }
    }
    const int l = g_tid & 31, g = l >> 2, t = l & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; e++) {
        float s = 0.0f;
        for (int k = 0; k < 16; k++) s += A[rows[e]][k] * B[k][cols[e]];
        c[e] += s;
    }
    warp_sync();
}
