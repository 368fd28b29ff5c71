// Skinny GEMM for decode: y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) with m <= 128 (bf16 in and
// out, fp32 accumulate on the tensor cores), the nn.Linear layout. Decode GEMMs are weight
// streaming: every weight byte is read once, x (m rows) is small and sits in L2. cuBLASLt's
// heuristic picks tiles that leave most SMs idle at these sizes; this kernel instead cuts the
// weight rows into R-row tiles and k into `splits` slices so that the grid fills the GPU, and
// sums the slices through distributed shared memory inside a thread-block cluster of `splits`
// blocks (fixed order: deterministic, no workspace, one launch).
//
// Compile-time sizes (-D...): GEMV_MT m-tiles of 8 rows (m <= 8*GEMV_MT), GEMV_RT row tiles of
// 64 weight rows per warpgroup, GEMV_S the cluster size = number of k slices, GEMV_SWIGLU 1 for
// the gate|up form and GEMV_ROPE 1 for the q|k|v rotary form (see below), GEMV_WG the form
// (below), GEMV_STAGES the pipeline's depth.
//
// GEMV_WG 0, `gemv_bf16` (mma.sync, any sm_80+): one warpgroup of 4 warps, R = 64*GEMV_RT;
// warp w owns rows rt*64 + w*16 .. +16 of every row tile rt. Weights and x go through a
// cp.async pipeline of 64-k stages. MMA m16n8k16 with the weight rows as A (16 rows) and x as B
// (8 columns = 8 of the m rows). The k order inside a 16-k MMA step is permuted identically for
// A and B (a dot product does not care), so every thread reads whole 16-byte units: thread t of
// a quad takes unit 4c+t of the 64-k stage (c = 0, 1), whose 4 bf16 pairs feed a0/a2 (b0/b1) of
// two consecutive MMA steps. Shared rows are 128 bytes, unit u of row r stored at u ^ 4*(r & 1):
// the 8 lanes of a 16-byte load phase hit 8 distinct bank groups.
//
// GEMV_WG 1, `gemv_tma_bf16` (Hopper, sm_90a): GEMV_WGS consumer warpgroups (R = 64*GEMV_RT*
// GEMV_WGS rows a block, warpgroup c owning row tiles c*GEMV_RT ..) and one producer warp. The
// producer's lane 0 loads each 64-k stage of the block's weight rows and of x with the tensor
// memory accelerator (one 2D box each, two weight boxes in the SwiGLU form; rows and k past the
// ends arrive as zeros), in the 128-byte swizzle the wgmma descriptors name (unit u of row r at
// u ^ (r & 7), 8-row atoms of 1024 bytes, stage buffers 1024-aligned), announcing the bytes on
// the stage's `full` barrier. Each consumer warpgroup runs one
// wgmma.m64nNk16 per row tile and 16 k with the weight tile as A and the x tile as B (N =
// 8*GEMV_MT = 16, 32, 64 or 128 rows of x), both read by the tensor cores from shared memory,
// keeps one stage of MMAs in flight and releases a stage's buffer on its `empty` barrier once
// its MMAs are done. The accumulator fragment of a warp (rows 16w..16w+15 of its tile, 8 columns
// per 4 registers) is that of the mma.sync form, so the partial-sum tile and everything after
// it are shared. x is read from L2 once per block: R/64 times less often than per 64-row tile.
//
// GEMV_SWIGLU: w holds gate rows [0, n) then up rows [up_off, up_off + n); a block's first R/2
// rows are gate rows j0.., its last R/2 the matching up rows, and the epilogue writes
// y[m, j] = bf16(bf16(silu(bf16(gate))) * bf16(up)), bitwise what swiglu_fwd_bf16 makes of the
// rounded GEMM outputs.
//
// GEMV_ROPE: decode's q|k|v projection with the rotary embedding and the KV append in its
// epilogue. w is [heads + 2 kv_heads] x head_dim rows (q, k, v heads); up_off = head_dim / 2
// and n = the rows' pairs (half the rows): pair p is row a = (p / up_off) * head_dim +
// p % up_off and its rotation partner a + up_off. A block's first R/2 rows are the rows a of
// pairs j0.., its last R/2 the partners (R/2 divides up_off, so each half is one box of
// consecutive rows). The epilogue rounds each output with its bias to bf16 as the plain form
// does, rotates the q and k heads' pairs with rope_pair in HF's text rounding (cos / sin
// tables of head_dim floats per row of x), writes every head to y, and the k and v heads of
// row i also to row slots[i] of the caches (rows of kv_heads * head_dim; slots[i] >= n_slots
// writes none): bitwise the plain form followed by rope_kv_append_bf16.

#ifndef GEMV_MT
#define GEMV_MT 8
#endif
#ifndef GEMV_RT
#define GEMV_RT 2
#endif
#ifndef GEMV_S
#define GEMV_S 1
#endif
#ifndef GEMV_SWIGLU
#define GEMV_SWIGLU 0
#endif
#ifndef GEMV_ROPE
#define GEMV_ROPE 0
#endif
#ifndef GEMV_WG
#define GEMV_WG 0
#endif
// Rows taken in pairs (a row and the row up_off after it): the SwiGLU and the rotary forms.
#define GV_PAIRED (GEMV_SWIGLU || GEMV_ROPE)
#ifndef GEMV_STAGES
#define GEMV_STAGES 4
#endif

#ifndef GEMV_WGS
#define GEMV_WGS 1
#endif

#if GEMV_WG
#define GV_THREADS (128 * GEMV_WGS + 32)  // consumer warpgroups + the producer warp
#define GV_R (64 * GEMV_RT * GEMV_WGS)    // weight rows per block
#else
#define GV_THREADS 128
#define GV_R (64 * GEMV_RT)
#endif
#define GV_KC 64                 // k per pipeline stage
#define GV_STAGES GEMV_STAGES
#define GV_M (8 * GEMV_MT)       // x rows per block (padded)
#define GV_WB (GV_R * GV_KC * 2) // weight bytes per stage
#define GV_XB (GV_M * GV_KC * 2) // x bytes per stage
#define GV_SB (GV_WB + GV_XB)
#define GV_RS (GV_M + 4)         // floats per row of the partial-sum tile

#if GEMV_WG
static_assert(GV_M == 16 || GV_M == 32 || GV_M == 64 || GV_M == 128, "wgmma N: 16, 32, 64 or 128");
#else
static_assert(GEMV_MT >= 1 && GEMV_MT <= 8, "m must be at most 64");
#endif
static_assert(!(GEMV_SWIGLU && GEMV_ROPE), "one epilogue form");
static_assert(GV_STAGES >= 2 && GV_STAGES <= 8, "2 to 8 pipeline stages");
static_assert(GEMV_S >= 1 && GEMV_S <= 8, "at most 8 blocks per cluster (portable size)");
static_assert(GEMV_WGS == 1 || (GEMV_WG && GEMV_WGS == 2), "two consumer warpgroups: wgmma form only");
static_assert(GV_R <= 256, "a TMA box has at most 256 rows");
static_assert(GV_R * GV_RS * 4 <= GV_STAGES * GV_SB, "the partial tile reuses the stages");

__device__ __forceinline__ uint4 gv_lds(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}
// Where unit u (16 bytes) of shared row r lives in the mma.sync form (the row-parity swizzle).
__device__ __forceinline__ u32 gv_swz(u32 r, u32 u) { return r * 128 + ((u ^ ((r & 1) << 2)) << 4); }
#if GEMV_WG
// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle: start address,
// leading offset 16 (unused by this layout), 1024 bytes between 8-row groups, layout 1 = SW128.
// Advancing k by 16 within a 64-k row adds 32 bytes to the start address.
__device__ __forceinline__ u64 gv_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
#define GV_D8(i)                                                                                  \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#if GV_M == 16
#define GV_WG_ASM                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                   \
    "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"                        \
    "%0, %1, %2, %3, %4, %5, %6, %7"  \
    "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
#define GV_WG_D GV_D8(0)
#elif GV_M == 32
#define GV_WG_ASM                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                   \
    "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"  \
    "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
#define GV_WG_D GV_D8(0), GV_D8(8)
#elif GV_M == 64
#define GV_WG_ASM                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                   \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"  \
    "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
#define GV_WG_D GV_D8(0), GV_D8(8), GV_D8(16), GV_D8(24)
#elif GV_M == 128
#define GV_WG_ASM                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                   \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"  \
    "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
#define GV_WG_D GV_D8(0), GV_D8(8), GV_D8(16), GV_D8(24), GV_D8(32), GV_D8(40), GV_D8(48), GV_D8(56)
#endif
// d[4*mt + c] += A(64 x 16, weights) . B(16 x N, x^T): the fragment of acc[rt] ([GEMV_MT][4]).
__device__ __forceinline__ void gv_wgmma(float* d, u64 da, u64 db) {
    asm volatile(GV_WG_ASM : GV_WG_D : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void gv_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void gv_wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void gv_wg_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void gv_wg_wait1() {
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
#endif
#if GEMV_S > 1
__device__ __forceinline__ void gv_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
#define GV_CLUSTER __cluster_dims__(GEMV_S, 1, 1)
#else
#define GV_CLUSTER
#endif

// The rotary form's tables and caches (unused by the other forms, passed zeroed). Mirrors
// `GvRope` in skinny.rs.
struct GvRope {
    const float* cos;  // [m, head_dim]
    const float* sin;
    bf16* k_cache;     // rows of n_kv * head_dim
    bf16* v_cache;
    const u32* slots;  // [m]: the cache row of each row of x
    u32 n_heads;
    u32 n_kv;
    u32 n_slots;       // cache rows
    u32 pad;
};

// The first weight row of pair p: p itself in the SwiGLU form (gate row p, up row up_off + p),
// in the rotary form row (p / up_off) * 2 up_off + p % up_off of its head (partner + up_off).
__device__ __forceinline__ u32 gv_pair_row(u32 p, u32 up_off) {
#if GEMV_ROPE
    return (p / up_off) * 2 * up_off + p % up_off;
#else
    (void)up_off;
    return p;
#endif
}

// The sum over the cluster's k slices of 4 consecutive floats at element `off` of the partial
// tiles (16-byte aligned), in rank order: 0 + p0 + p1 + ... (every slice loaded first, so the
// remote loads are in flight together); the block's own tile alone without a cluster.
__device__ __forceinline__ float4 gv_sum4(const float* red, u32 off) {
#if GEMV_S > 1
    const u32 a = smem_u32(red + off);
    float4 p[GEMV_S];
#pragma unroll
    for (u32 r = 0; r < GEMV_S; r++) {
        u32 ra;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(r));
        asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                     : "=f"(p[r].x), "=f"(p[r].y), "=f"(p[r].z), "=f"(p[r].w)
                     : "r"(ra)
                     : "memory");
    }
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (u32 r = 0; r < GEMV_S; r++) {
        s.x += p[r].x;
        s.y += p[r].y;
        s.z += p[r].z;
        s.w += p[r].w;
    }
    return s;
#else
    return *reinterpret_cast<const float4*>(red + off);
#endif
}


// This block's partial sums acc (rows of the block's row tiles `tile0`.. owned by warp `wq` of
// its warpgroup) into the shared tile red[row][col] (row = weight row in the block, col = x row).
__device__ __forceinline__ void gv_store_partials(float* red, float (*acc)[GEMV_MT][4], u32 tile0,
                                                  u32 wq, u32 g, u32 t) {
#pragma unroll
    for (int rt = 0; rt < GEMV_RT; rt++)
#pragma unroll
        for (int mt = 0; mt < GEMV_MT; mt++) {
            const u32 ra = (tile0 + rt) * 64 + wq * 16 + g, col = 8 * mt + 2 * t;
            red[ra * GV_RS + col] = acc[rt][mt][0];
            red[ra * GV_RS + col + 1] = acc[rt][mt][1];
            red[(ra + 8) * GV_RS + col] = acc[rt][mt][2];
            red[(ra + 8) * GV_RS + col + 1] = acc[rt][mt][3];
        }
}

// Block `split` of the cluster finishes rows [split*per, (split+1)*per) of the partial tiles,
// 4 x rows at a time, summing the slices in rank order 0, 1, ... (the same order whatever the
// timing), adds the bias and writes y (or, in the SwiGLU form, silu(gate) * up). Called by every
// thread of the block once every block of the cluster has written its tile.
__device__ __forceinline__ void gv_finish(bf16* __restrict__ y, const bf16* __restrict__ bias,
                                          const float* red, u32 split, u32 j0, u32 m, u32 n,
                                          u32 ldy, u32 up_off, const GvRope& rp) {
    constexpr u32 C4 = GV_M / 4;
#if GEMV_ROPE
    constexpr u32 HALF = GV_R / 2;
    constexpr u32 per = (HALF + GEMV_S - 1) / GEMV_S;
    const u32 hd = 2 * up_off, kvw = rp.n_kv * hd;
    for (u32 idx = threadIdx.x; idx < per * C4; idx += GV_THREADS) {
        const u32 jl = split * per + idx % per, m0 = 4 * (idx / per);
        if (jl >= HALF || m0 >= m || j0 + jl >= n) continue;
        const u32 a = gv_pair_row(j0 + jl, up_off), b = a + up_off;
        const u32 head = a / hd, i = a - head * hd;  // i < up_off: a is the pair's first row
        const float4 as4 = gv_sum4(red, jl * GV_RS + m0), bs4 = gv_sum4(red, (HALF + jl) * GV_RS + m0);
        const float asv[4] = {as4.x, as4.y, as4.z, as4.w}, bsv[4] = {bs4.x, bs4.y, bs4.z, bs4.w};
        const float ab = bias != nullptr ? bf2f(bias[a]) : 0.0f;
        const float bb = bias != nullptr ? bf2f(bias[b]) : 0.0f;
        // q and k heads are rotated; the k heads, then the v heads, go to the caches too
        const bool rotate = head < rp.n_heads + rp.n_kv;
        const bool cached = head >= rp.n_heads;
        bf16* cache = rotate ? rp.k_cache : rp.v_cache;
        const u32 col = (head - rp.n_heads - (rotate ? 0 : rp.n_kv)) * hd + i;
#pragma unroll
        for (u32 c = 0; c < 4; c++) {
            const u32 r = m0 + c;
            if (r >= m) break;
            float av = asv[c], bv = bsv[c];
            if (bias != nullptr) {
                av += ab;
                bv += bb;
            }
            const float xa = bf2f(f2bf(av)), xb = bf2f(f2bf(bv));
            float o1 = xa, o2 = xb;
            if (rotate) {
                const float* cs = rp.cos + (u64)r * hd;
                const float* sn = rp.sin + (u64)r * hd;
                rope_pair(xa, xb, cs[i], sn[i], cs[i + up_off], sn[i + up_off], 1u, o1, o2);
            }
            const bf16 y1 = f2bf(o1), y2 = f2bf(o2);
            y[(u64)r * ldy + a] = y1;
            y[(u64)r * ldy + b] = y2;
            if (cached) {
                const u32 slot = rp.slots[r];
                if (slot < rp.n_slots) {
                    cache[(u64)slot * kvw + col] = y1;
                    cache[(u64)slot * kvw + col + up_off] = y2;
                }
            }
        }
    }
#elif GEMV_SWIGLU
    constexpr u32 HALF = GV_R / 2;
    constexpr u32 per = (HALF + GEMV_S - 1) / GEMV_S;
    for (u32 idx = threadIdx.x; idx < per * C4; idx += GV_THREADS) {
        const u32 jl = split * per + idx % per, m0 = 4 * (idx / per);
        if (jl >= HALF || m0 >= m || j0 + jl >= n) continue;
        const u32 j = j0 + jl;
        const float4 gs4 = gv_sum4(red, jl * GV_RS + m0), us4 = gv_sum4(red, (HALF + jl) * GV_RS + m0);
        const float gsv[4] = {gs4.x, gs4.y, gs4.z, gs4.w}, usv[4] = {us4.x, us4.y, us4.z, us4.w};
        const float gb = bias != nullptr ? bf2f(bias[j]) : 0.0f;
        const float ub = bias != nullptr ? bf2f(bias[up_off + j]) : 0.0f;
#pragma unroll
        for (u32 c = 0; c < 4; c++) {
            if (m0 + c >= m) break;
            float gs = gsv[c], us = usv[c];
            if (bias != nullptr) {
                gs += gb;
                us += ub;
            }
            const float gr = bf2f(f2bf(gs)), ur = bf2f(f2bf(us));
            const float si = bf2f(f2bf(gr / (1.0f + expf(-gr))));
            y[(u64)(m0 + c) * ldy + j] = f2bf(si * ur);
        }
    }
#else
    (void)up_off;
    (void)rp;
    constexpr u32 per = (GV_R + GEMV_S - 1) / GEMV_S;
    for (u32 idx = threadIdx.x; idx < per * C4; idx += GV_THREADS) {
        const u32 rl = split * per + idx % per, m0 = 4 * (idx / per);
        if (rl >= GV_R || m0 >= m || j0 + rl >= n) continue;
        const float4 v4 = gv_sum4(red, rl * GV_RS + m0);
        const float vv[4] = {v4.x, v4.y, v4.z, v4.w};
        const float b = bias != nullptr ? bf2f(bias[j0 + rl]) : 0.0f;
#pragma unroll
        for (u32 c = 0; c < 4; c++) {
            if (m0 + c >= m) break;
            float v = vv[c];
            if (bias != nullptr) v += b;
            y[(u64)(m0 + c) * ldy + j0 + rl] = f2bf(v);
        }
    }
#endif
}

// The first output column (the first pair in the SwiGLU and rotary forms) of row block `by`.
__device__ __forceinline__ u32 gv_first_col(u32 by) {
#if GV_PAIRED
    return by * (GV_R / 2);
#else
    return by * GV_R;
#endif
}

// The block's partial sums (acc, where `holds`: the rows of row tiles `tile0`.. owned by warp
// `wq` of its warpgroup) into the shared tile `red`, summed over the cluster's k slices and
// written to y (gv_finish). Called by every thread of the block once the stages are free.
__device__ __forceinline__ void gv_epilogue(bf16* __restrict__ y, const bf16* __restrict__ bias,
                                            float* red, float (*acc)[GEMV_MT][4], bool holds,
                                            u32 tile0, u32 wq, u32 g, u32 t, u32 split, u32 j0,
                                            u32 m, u32 n, u32 ldy, u32 up_off, const GvRope& rp) {
    if (holds) gv_store_partials(red, acc, tile0, wq, g, t);
#if GEMV_S > 1
    gv_cluster_sync();  // every block's partial tile is written and visible cluster-wide
#else
    __syncthreads();
#endif
    gv_finish(y, bias, red, split, j0, m, n, ldy, up_off, rp);
#if GEMV_S > 1
    gv_cluster_sync();  // no block leaves while another may still read its shared memory
#endif
}

#if !GEMV_WG
// Grid (GEMV_S, row blocks): blockIdx.x is the k slice (= rank in the cluster), blockIdx.y the
// R-row block. Block x covers k in [x*kslice, min(k, (x+1)*kslice)); kslice is a multiple of 64.
// Needs k % 8 == 0, 16-byte aligned x / w rows (ldx % 8 == 0); dynamic shared memory
// GV_STAGES * GV_SB bytes.
extern "C" __global__ void __launch_bounds__(GV_THREADS) GV_CLUSTER
gemv_bf16(bf16* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w,
          const bf16* __restrict__ bias, u32 m, u32 n, u32 k, u32 ldx, u32 ldy, u32 kslice,
          u32 up_off, const GvRope rp) {
    pdl_wait();
    extern __shared__ __align__(128) unsigned char gsm[];
    const u32 split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 j0 = gv_first_col(blockIdx.y);
    const u32 k0 = split * kslice, k1 = min(k, k0 + kslice);
    const u32 nst = k1 > k0 ? (k1 - k0 + GV_KC - 1) / GV_KC : 0;
    const u32 base = smem_u32(gsm);

    // Copies of stage `st` into buffer st % GV_STAGES (rows past the ends zero-filled).
    auto issue = [&](u32 st) {
        const u32 kk = k0 + st * GV_KC;
        const u32 wsb = base + (st % GV_STAGES) * GV_SB, xsb = wsb + GV_WB;
#pragma unroll
        for (int j = 0; j < GV_R * 8 / GV_THREADS; j++) {
            const u32 i = threadIdx.x + j * GV_THREADS, r = i >> 3, u = i & 7;
#if GV_PAIRED
            const u32 jr = j0 + (r < GV_R / 2 ? r : r - GV_R / 2);
            const u32 pr = gv_pair_row(jr, up_off);
            const u32 wr = r < GV_R / 2 ? pr : up_off + pr;
#else
            const u32 jr = j0 + r, wr = jr;
#endif
            const u32 kc = kk + 8 * u;
            const bool ok = jr < n && kc < k1;
            const bf16* src = ok ? w + (u64)wr * k + kc : w;
            cp_async16(wsb + gv_swz(r, u), src, ok);
        }
        for (u32 i = threadIdx.x; i < GV_M * 8; i += GV_THREADS) {
            const u32 r = i >> 3, u = i & 7, kc = kk + 8 * u;
            const bool ok = r < m && kc < k1;
            const bf16* src = ok ? x + (u64)r * ldx + kc : x;
            cp_async16(xsb + gv_swz(r, u), src, ok);
        }
    };

    float acc[GEMV_RT][GEMV_MT][4];
#pragma unroll
    for (int rt = 0; rt < GEMV_RT; rt++)
#pragma unroll
        for (int mt = 0; mt < GEMV_MT; mt++) acc[rt][mt][0] = acc[rt][mt][1] = acc[rt][mt][2] = acc[rt][mt][3] = 0.0f;

#pragma unroll
    for (u32 s = 0; s < GV_STAGES - 1; s++) {
        if (s < nst) issue(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    const u32 sw = (g & 1) << 2;  // row parity swizzle (rows g, g + 8, 8 mt + g share it)
    for (u32 st = 0; st < nst; st++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GV_STAGES - 2));
        __syncthreads();  // stage st landed for everyone; buffer (st - 1) % STAGES is free
        if (st + GV_STAGES - 1 < nst) issue(st + GV_STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        const u32 wsb = base + (st % GV_STAGES) * GV_SB, xsb = wsb + GV_WB;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const u32 uo = ((4 * c + t) ^ sw) << 4;
            uint4 xf[GEMV_MT];
#pragma unroll
            for (int mt = 0; mt < GEMV_MT; mt++) xf[mt] = gv_lds(xsb + (8 * mt + g) * 128 + uo);
#pragma unroll
            for (int rt = 0; rt < GEMV_RT; rt++) {
                const u32 ra = rt * 64 + warp * 16 + g;
                const uint4 pa = gv_lds(wsb + ra * 128 + uo);
                const uint4 pb = gv_lds(wsb + (ra + 8) * 128 + uo);
#pragma unroll
                for (int mt = 0; mt < GEMV_MT; mt++) {
                    mma16(acc[rt][mt], pa.x, pb.x, pa.y, pb.y, xf[mt].x, xf[mt].y);
                    mma16(acc[rt][mt], pa.z, pb.z, pa.w, pb.w, xf[mt].z, xf[mt].w);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // every warp is done with the stages: reuse them for the partial tile

    gv_epilogue(y, bias, (float*)gsm, acc, true, 0, warp, g, t, split, j0, m, n, ldy, up_off, rp);
}
#else   // GEMV_WG

// A CUtensorMap (the driver's 128-byte tiled-tensor descriptor), passed by value as a
// __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};
__device__ __forceinline__ void prefetch_tmap(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)map) : "memory");
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also announces `bytes` of asynchronous copies the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nGV_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra GV_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// The 2D box at (c0 = k, c1 = row) of the tensor `map` into shared memory at dst; its bytes
// complete a transaction on barrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, u32 bar, u32 c0, u32 c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Grid (GEMV_S, row blocks) as gemv_bf16's, block GV_THREADS. wmap: the weights as a 2D tensor
// (k, weight rows: n, or up_off + n in the SwiGLU form) with boxes of 64 x GV_R rows (GV_R / 2
// in the SwiGLU form); xmap: x as (k, m) with boxes of 64 x GV_M; both in the 128-byte swizzle
// with zero fill. Dynamic shared memory GV_STAGES * GV_SB + 1024 (alignment) + 16 * GV_STAGES
// (the barriers).
extern "C" __global__ void __launch_bounds__(GV_THREADS, 1) GV_CLUSTER
gemv_tma_bf16(bf16* __restrict__ y, const bf16* __restrict__ bias, const __grid_constant__ TmaMap wmap,
              const __grid_constant__ TmaMap xmap, u32 m, u32 n, u32 k, u32 ldy, u32 kslice,
              u32 up_off, const GvRope rp) {
    extern __shared__ __align__(128) unsigned char gsm[];
    const u32 split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 wg = warp >> 2;  // consumer warpgroup; GEMV_WGS for the producer warp
    const u32 j0 = gv_first_col(blockIdx.y);
    const u32 k0 = split * kslice, k1 = min(k, k0 + kslice);
    const u32 nst = k1 > k0 ? (k1 - k0 + GV_KC - 1) / GV_KC : 0;
    const u32 base = (smem_u32(gsm) + 1023u) & ~1023u;  // swizzle atoms are 1024-aligned
    const u32 full = base + GV_STAGES * GV_SB, empty = full + 8 * GV_STAGES;
    const bool producer = wg == GEMV_WGS && lane == 0;
    if (threadIdx.x == 0) {
        prefetch_tmap(&wmap);
        prefetch_tmap(&xmap);
#pragma unroll
        for (u32 s = 0; s < GV_STAGES; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, GEMV_WGS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    pdl_wait();

    float acc[GEMV_RT][GEMV_MT][4];
#pragma unroll
    for (int rt = 0; rt < GEMV_RT; rt++)
#pragma unroll
        for (int mt = 0; mt < GEMV_MT; mt++) acc[rt][mt][0] = acc[rt][mt][1] = acc[rt][mt][2] = acc[rt][mt][3] = 0.0f;

    if (producer) {
        for (u32 st = 0; st < nst; st++) {
            const u32 s = st % GV_STAGES, wsb = base + s * GV_SB, kk = k0 + st * GV_KC;
            const u32 bar = full + 8 * s;
            // the buffer's last use released (the first GV_STAGES stages find it free)
            if (st >= GV_STAGES) mbar_wait(empty + 8 * s, ((st / GV_STAGES) + 1) & 1);
            mbar_expect_tx(bar, GV_SB);
#if GV_PAIRED
            // the pairs' first rows, then their partners (the matching up rows, or the rotation
            // partners up_off further in the same head)
            tma_load_2d(wsb, &wmap, bar, kk, gv_pair_row(j0, up_off));
            tma_load_2d(wsb + GV_WB / 2, &wmap, bar, kk, up_off + gv_pair_row(j0, up_off));
#else
            tma_load_2d(wsb, &wmap, bar, kk, j0);
#endif
            tma_load_2d(wsb + GV_WB, &xmap, bar, kk, 0);
        }
    } else if (wg < GEMV_WGS) {
        for (u32 st = 0; st < nst; st++) {
            const u32 s = st % GV_STAGES;
            mbar_wait(full + 8 * s, (st / GV_STAGES) & 1);
            const u32 wsb = base + s * GV_SB, xsb = wsb + GV_WB;
            gv_wg_fence();
#pragma unroll
            for (int ks = 0; ks < GV_KC / 16; ks++)
#pragma unroll
                for (int rt = 0; rt < GEMV_RT; rt++)
                    gv_wgmma(&acc[rt][0][0], gv_desc(wsb + (wg * GEMV_RT + rt) * 64 * 128 + ks * 32),
                             gv_desc(xsb + ks * 32));
            gv_wg_commit();
            gv_wg_wait1();  // stage st - 1's MMAs are done: release its buffer
            if (st > 0 && (threadIdx.x & 127) == 0) mbar_arrive(empty + 8 * ((st - 1) % GV_STAGES));
        }
        gv_wg_wait0();
    }
    __syncthreads();  // every stage consumed: reuse them for the partial tile

    float* red = (float*)(gsm + (base - smem_u32(gsm)));
    gv_epilogue(y, bias, red, acc, wg < GEMV_WGS, wg * GEMV_RT, warp & 3, g, t, split, j0, m, n,
                ldy, up_off, rp);
}
#endif  // GEMV_WG
