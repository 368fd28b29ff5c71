// Skinny GEMM for decode: y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) with m <= 64 (bf16 in and
// out, fp32 accumulate on the tensor cores), the nn.Linear layout. Decode GEMMs are weight
// streaming: every weight byte is read once, x (m rows) is small and sits in L2. cuBLASLt's
// heuristic picks tiles that leave most SMs idle at these sizes; this kernel instead cuts the
// weight rows into R-row tiles and k into `splits` slices so that the grid fills the GPU, and
// sums the slices through distributed shared memory inside a thread-block cluster of `splits`
// blocks (fixed order: deterministic, no workspace, one launch).
//
// Compile-time sizes (-D...): GEMV_MT m-tiles of 8 rows (m <= 8*GEMV_MT), GEMV_RT row tiles of
// 64 weight rows per block (R = 64*GEMV_RT), GEMV_S the cluster size = number of k slices,
// GEMV_SWIGLU 1 for the gate|up form (see below).
//
// Block: 4 warps; warp w owns rows rt*64 + w*16 .. +16 of every row tile rt. Weights and x go
// through a 4-stage cp.async pipeline of 64-k stages. MMA m16n8k16 with the weight rows as A
// (16 rows) and x as B (8 columns = 8 of the m rows). The k order inside a 16-k MMA step is
// permuted identically for A and B (a dot product does not care), so every thread reads whole
// 16-byte units: thread t of a quad takes unit 4c+t of the 64-k stage (c = 0, 1), whose 4 bf16
// pairs feed a0/a2 (b0/b1) of two consecutive MMA steps. Shared rows are 128 bytes, unit u of row
// r stored at u ^ 4*(r & 1): the 8 lanes of a 16-byte load phase hit 8 distinct bank groups.
//
// GEMV_SWIGLU: w holds gate rows [0, n) then up rows [up_off, up_off + n); a block's first R/2
// rows are gate rows j0.., its last R/2 the matching up rows, and the epilogue writes
// y[m, j] = bf16(bf16(silu(bf16(gate))) * bf16(up)), bitwise what swiglu_fwd_bf16 makes of the
// rounded GEMM outputs.

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

#define GV_THREADS 128
#define GV_KC 64                 // k per pipeline stage
#define GV_STAGES 4
#define GV_R (64 * GEMV_RT)      // weight rows per block
#define GV_M (8 * GEMV_MT)       // x rows per block (padded)
#define GV_WB (GV_R * GV_KC * 2) // weight bytes per stage
#define GV_XB (GV_M * GV_KC * 2) // x bytes per stage
#define GV_SB (GV_WB + GV_XB)
#define GV_RS (GV_M + 4)         // floats per row of the partial-sum tile

static_assert(GEMV_MT >= 1 && GEMV_MT <= 8, "m must be at most 64");
static_assert(GEMV_S >= 1 && GEMV_S <= 8, "at most 8 blocks per cluster (portable size)");
static_assert(GV_R * GV_RS * 4 <= GV_STAGES * GV_SB, "the partial tile reuses the stages");

__device__ __forceinline__ u32 gv_smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void gv_cp16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;  // 0: zero-fill, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ uint4 gv_lds(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}
__device__ __forceinline__ void gv_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#if GEMV_S > 1
__device__ __forceinline__ void gv_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
// A float of block `rank`'s shared memory, at the address `p` has in this block.
__device__ __forceinline__ float gv_ld_cluster(const float* p, u32 rank) {
    u32 a = gv_smem_u32(p), ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(ra) : "memory");
    return v;
}
#define GV_CLUSTER __cluster_dims__(GEMV_S, 1, 1)
#else
#define GV_CLUSTER
#endif

// Grid (GEMV_S, row blocks): blockIdx.x is the k slice (= rank in the cluster), blockIdx.y the
// R-row block. Block x covers k in [x*kslice, min(k, (x+1)*kslice)); kslice is a multiple of 64.
// Needs k % 8 == 0, 16-byte aligned x / w rows (ldx % 8 == 0); dynamic shared memory
// GV_STAGES * GV_SB bytes.
extern "C" __global__ void __launch_bounds__(GV_THREADS) GV_CLUSTER
gemv_bf16(bf16* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w,
          const bf16* __restrict__ bias, u32 m, u32 n, u32 k, u32 ldx, u32 ldy, u32 kslice,
          u32 up_off) {
    extern __shared__ __align__(128) unsigned char gsm[];
    const u32 split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
#if GEMV_SWIGLU
    const u32 j0 = blockIdx.y * (GV_R / 2);  // first output column (gate / up row index)
#else
    const u32 j0 = blockIdx.y * GV_R;
#endif
    const u32 k0 = split * kslice, k1 = min(k, k0 + kslice);
    const u32 nst = k1 > k0 ? (k1 - k0 + GV_KC - 1) / GV_KC : 0;
    const u32 base = gv_smem_u32(gsm);

    // Copies of stage `st` into buffer st % GV_STAGES (rows past the ends zero-filled).
    auto issue = [&](u32 st) {
        const u32 kk = k0 + st * GV_KC;
        const u32 wsb = base + (st % GV_STAGES) * GV_SB, xsb = wsb + GV_WB;
#pragma unroll
        for (int j = 0; j < GV_R * 8 / GV_THREADS; j++) {
            const u32 i = threadIdx.x + j * GV_THREADS, r = i >> 3, u = i & 7;
#if GEMV_SWIGLU
            const u32 jr = j0 + (r < GV_R / 2 ? r : r - GV_R / 2);
            const u32 wr = r < GV_R / 2 ? jr : up_off + jr;
#else
            const u32 jr = j0 + r, wr = jr;
#endif
            const u32 kc = kk + 8 * u;
            const bool ok = jr < n && kc < k1;
            const bf16* src = ok ? w + (u64)wr * k + kc : w;
            gv_cp16(wsb + r * 128 + ((u ^ ((r & 1) << 2)) << 4), src, ok);
        }
        for (u32 i = threadIdx.x; i < GV_M * 8; i += GV_THREADS) {
            const u32 r = i >> 3, u = i & 7, kc = kk + 8 * u;
            const bool ok = r < m && kc < k1;
            const bf16* src = ok ? x + (u64)r * ldx + kc : x;
            gv_cp16(xsb + r * 128 + ((u ^ ((r & 1) << 2)) << 4), src, ok);
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
                    gv_mma(acc[rt][mt], pa.x, pb.x, pa.y, pb.y, xf[mt].x, xf[mt].y);
                    gv_mma(acc[rt][mt], pa.z, pb.z, pa.w, pb.w, xf[mt].z, xf[mt].w);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // every warp is done with the stages: reuse them for the partial tile

    // This block's partial sums: red[row][col], row = weight row in the block, col = x row.
    float* red = (float*)gsm;
#pragma unroll
    for (int rt = 0; rt < GEMV_RT; rt++)
#pragma unroll
        for (int mt = 0; mt < GEMV_MT; mt++) {
            const u32 ra = rt * 64 + warp * 16 + g, col = 8 * mt + 2 * t;
            red[ra * GV_RS + col] = acc[rt][mt][0];
            red[ra * GV_RS + col + 1] = acc[rt][mt][1];
            red[(ra + 8) * GV_RS + col] = acc[rt][mt][2];
            red[(ra + 8) * GV_RS + col + 1] = acc[rt][mt][3];
        }
#if GEMV_S > 1
    gv_cluster_sync();  // every block's partial tile is written and visible cluster-wide
#define GV_SUM(row, col, out)                                                   \
    {                                                                            \
        out = 0.0f;                                                              \
        for (u32 r_ = 0; r_ < GEMV_S; r_++) out += gv_ld_cluster(&red[(row) * GV_RS + (col)], r_); \
    }
#else
    __syncthreads();
#define GV_SUM(row, col, out) out = red[(row) * GV_RS + (col)];
#endif

    // Block `split` finishes rows [split*per, (split+1)*per) of the tile, summing the slices in
    // rank order 0, 1, ... (the same order whatever the timing).
#if GEMV_SWIGLU
    constexpr u32 HALF = GV_R / 2;
    constexpr u32 per = (HALF + GEMV_S - 1) / GEMV_S;
    for (u32 idx = threadIdx.x; idx < per * GV_M; idx += GV_THREADS) {
        const u32 jl = split * per + idx % per, mi = idx / per;
        if (jl >= HALF || mi >= m || j0 + jl >= n) continue;
        const u32 j = j0 + jl;
        float gs, us;
        GV_SUM(jl, mi, gs);
        GV_SUM(HALF + jl, mi, us);
        if (bias != nullptr) {
            gs += bf2f(bias[j]);
            us += bf2f(bias[up_off + j]);
        }
        const float gr = bf2f(f2bf(gs)), ur = bf2f(f2bf(us));
        const float si = bf2f(f2bf(gr / (1.0f + expf(-gr))));
        y[(u64)mi * ldy + j] = f2bf(si * ur);
    }
#else
    constexpr u32 per = (GV_R + GEMV_S - 1) / GEMV_S;
    for (u32 idx = threadIdx.x; idx < per * GV_M; idx += GV_THREADS) {
        const u32 rl = split * per + idx % per, mi = idx / per;
        if (rl >= GV_R || mi >= m || j0 + rl >= n) continue;
        float v;
        GV_SUM(rl, mi, v);
        if (bias != nullptr) v += bf2f(bias[j0 + rl]);
        y[(u64)mi * ldy + j0 + rl] = f2bf(v);
    }
#endif
#if GEMV_S > 1
    gv_cluster_sync();  // no block leaves while another may still read its shared memory
#endif
}
