//! bf16 GEMMs with fp32 accumulation through cuBLASLt: `matmul_bf16` (the twin of
//! [`crate::cpu::matmul`], same [`Gemm`] descriptor) and `linear_fwd_bf16` (`y = x W^T + b`,
//! Hugging Face weight layout `[out, in]`, bias fused as the GEMM epilogue).
//!
//! Row-major to column-major: cuBLAS is column-major, and a row-major `[r, c]` matrix is the
//! column-major `[c, r]` one with the same bytes. So row-major `C = op(A) op(B)` is computed as
//! column-major `C^T = op(B)^T op(A)^T`: cuBLASLt's first operand is our B, its second our A, its
//! `m, n` are our `n, m`. Our B stored `[n, k]` (trans_b, the nn.Linear layout) is column-major
//! `[k, n]` (ld k), used transposed; stored `[k, n]` it is column-major `[n, k]` (ld n), used as
//! is. Likewise A. The output is column-major `[n, m]` with ld n, row-major `[m, n]`.
//!
//! Plans: one per (shape, transposes, bias) with the algorithm chosen once by cuBLASLt's
//! heuristic and reused on every stream, so a GEMM's bits do not depend on the stream or its
//! SM partition. Workspaces: 32 MiB per stream.
//!
//! Decode-sized products (m <= 128 rows of x) can also run on our own kernel (`gemv_bf16` in
//! `cuda/gemv.cu`: [`skinny_linear_fwd_bf16`], [`skinny_gate_up_swiglu_bf16`]): weight-row
//! tiles x k slices, the slices of a tile summed in a thread-block cluster through distributed
//! shared memory in rank order (deterministic, one launch, no workspace), the products on
//! `mma.sync` at m <= 8 and on Hopper's warpgroup MMAs above; its cut ([`SkinnyPlan`]) is a
//! function of the shape. [`linear_fwd_bf16`] and [`gate_up_swiglu_bf16`] take it where
//! [`skinny_pays`], and cuBLASLt elsewhere.

use std::collections::HashMap;
use std::sync::Arc;

#[cfg(feature = "bench")]
use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{aligned16, launch, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::KernelModule;
use super::{shape, CudaError, Gpu, Result};
use crate::cpu::Gemm;

const WORKSPACE_BYTES: usize = 32 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    bias: bool,
    /// An fp32 output (`matmul_bf16_f32`) instead of bf16.
    out_f32: bool,
    /// Which of the heuristic's answers (0: its first, what every product runs; others for
    /// the benchmarks' comparison, feature `bench`).
    rank: u8,
}

/// How many of cuBLASLt's heuristic answers a benchmark may ask for.
pub const LT_RANKS: usize = 8;

struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    la: ltsys::cublasLtMatrixLayout_t,
    lb: ltsys::cublasLtMatrixLayout_t,
    lc: ltsys::cublasLtMatrixLayout_t,
    algo: ltsys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once in `LtState::plan` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.la);
            let _ = lt::destroy_matrix_layout(self.lb);
            let _ = lt::destroy_matrix_layout(self.lc);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// cuBLASLt handle, plans and per-stream workspaces (inside [`Gpu`], behind a mutex).
pub(crate) struct LtState {
    handle: ltsys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
    workspaces: HashMap<usize, CudaSlice<u8>>,
}

// SAFETY: the raw handles are only used while the owning mutex is held.
unsafe impl Send for LtState {}

impl Drop for LtState {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl LtState {
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: probing the library avoids cudarc's panic when it is missing.
        if !unsafe { ltsys::is_culib_present() } {
            return Err(CudaError::Unavailable("libcublasLt was not found".into()));
        }
        Ok(LtState {
            handle: lt::create_handle()?,
            plans: HashMap::new(),
            workspaces: HashMap::new(),
        })
    }

    /// Drops the workspace of the stream with handle `key` (the caller has synchronised).
    pub(crate) fn forget(&mut self, key: usize) {
        self.workspaces.remove(&key);
    }

    pub(crate) fn workspace(&mut self, stream: &Arc<CudaStream>) -> Result<u64> {
        let key = stream.cu_stream() as usize;
        if let std::collections::hash_map::Entry::Vacant(e) = self.workspaces.entry(key) {
            // Allocated on the context's default stream (which lives as long as the context),
            // not on `stream`: a green-context stream may be destroyed before the Gpu, and a
            // stream-ordered free on a destroyed stream would crash.
            let ds = stream.context().default_stream();
            // SAFETY: scratch memory, never read before cuBLASLt writes it.
            let w = unsafe { ds.alloc::<u8>(WORKSPACE_BYTES) }?;
            ds.synchronize()?; // ready for use on any stream
            e.insert(w);
        }
        Ok(ptr(&self.workspaces[&key], stream))
    }

    fn plan(&mut self, key: PlanKey) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            let p = self.make_plan(key)?;
            self.plans.insert(key, p);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, key: PlanKey) -> Result<Plan> {
        let PlanKey {
            m,
            n,
            k,
            trans_a,
            trans_b,
            bias,
            out_f32,
            rank,
        } = key;
        let bf = ltsys::cudaDataType_t::CUDA_R_16BF;
        let out = if out_f32 {
            ltsys::cudaDataType_t::CUDA_R_32F
        } else {
            bf
        };
        // cuBLASLt operand 1 = our B, operand 2 = our A (see the module doc).
        let (r1, c1, ld1) = if trans_b { (k, n, k) } else { (n, k, n) };
        let (r2, c2, ld2) = if trans_a { (m, k, m) } else { (k, m, k) };
        let la = lt::create_matrix_layout(bf, r1 as u64, c1 as u64, ld1 as i64)?;
        let lb = lt::create_matrix_layout(bf, r2 as u64, c2 as u64, ld2 as i64)?;
        let lc = lt::create_matrix_layout(out, n as u64, m as u64, n as i64)?;
        let desc = lt::create_matmul_desc(
            ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ltsys::cudaDataType_t::CUDA_R_32F,
        )?;
        let mut plan = Plan {
            desc,
            la,
            lb,
            lc,
            algo: unsafe { std::mem::zeroed() },
        };
        let set = |attr: ltsys::cublasLtMatmulDescAttributes_t, v: &i32| -> Result<()> {
            // SAFETY: attribute value of the documented 4-byte size.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, v as *const i32 as *const _, 4) }?;
            Ok(())
        };
        set(
            ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &(trans_b as i32),
        )?;
        set(
            ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &(trans_a as i32),
        )?;
        if bias {
            let epi = ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as i32;
            set(
                ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epi,
            )?;
        }
        let pref = lt::create_matmul_pref()?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: attribute value of the documented size (u64 / size_t).
        let r = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const _,
                std::mem::size_of::<usize>(),
            )
        };
        let h = r
            .map_err(CudaError::from)
            .and_then(|_| self.heuristic(desc, la, lb, lc, pref, rank as usize));
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        plan.algo = h?.algo;
        Ok(plan)
    }

    /// The heuristic's answer of rank `rank` (0: its first) for the handles of a plan.
    fn heuristic(
        &self,
        desc: ltsys::cublasLtMatmulDesc_t,
        la: ltsys::cublasLtMatrixLayout_t,
        lb: ltsys::cublasLtMatrixLayout_t,
        lc: ltsys::cublasLtMatrixLayout_t,
        pref: ltsys::cublasLtMatmulPreference_t,
        rank: usize,
    ) -> Result<ltsys::cublasLtMatmulHeuristicResult_t> {
        if rank == 0 {
            // SAFETY: valid handles, created by the caller.
            return Ok(unsafe {
                lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref)
            }?);
        }
        // SAFETY: an all-zero result is a valid value of this plain C struct; cuBLASLt writes
        // `count` of them.
        let mut res: [ltsys::cublasLtMatmulHeuristicResult_t; LT_RANKS] =
            unsafe { std::mem::zeroed() };
        let mut count = 0i32;
        let want = (rank + 1).min(LT_RANKS);
        // SAFETY: valid handles; `res` holds `want` results.
        unsafe {
            ltsys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                la,
                lb,
                lc,
                lc,
                pref,
                want as i32,
                res.as_mut_ptr(),
                &mut count,
            )
        }
        .result()?;
        if rank >= count.max(0) as usize {
            return Err(CudaError::Unavailable(format!(
                "cuBLASLt's heuristic gave {count} algorithms, not {}",
                rank + 1
            )));
        }
        res[rank].state.result()?;
        Ok(res[rank])
    }
}

fn check_gemm(op: &'static str, g: &Gemm, a: usize, b: usize, c: usize) -> Result<()> {
    if g.m == 0 || g.n == 0 || g.k == 0 {
        return Err(shape(
            op,
            format!("empty GEMM m={} n={} k={}", g.m, g.n, g.k),
        ));
    }
    for (name, have, want) in [
        ("a", a, g.m * g.k),
        ("b", b, g.k * g.n),
        ("c", c, g.m * g.n),
    ] {
        if have < want {
            return Err(shape(
                op,
                format!("{name} holds {have} elements, needs {want} for {g:?}"),
            ));
        }
    }
    if [g.m, g.n, g.k].iter().any(|&v| v > i32::MAX as usize) {
        return Err(shape(op, format!("dimension over 2^31 in {g:?}")));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn lt_matmul(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: &Gemm,
    c: u64,
    a: u64,
    b: u64,
    bias: Option<u64>,
    out_f32: bool,
    rank: u8,
) -> Result<()> {
    let mut st = gpu.lt()?;
    let ws = st.workspace(stream)?;
    let handle = st.handle;
    let key = PlanKey {
        m: g.m,
        n: g.n,
        k: g.k,
        trans_a: g.trans_a,
        trans_b: g.trans_b,
        bias: bias.is_some(),
        out_f32,
        rank,
    };
    let plan = st.plan(key)?;
    if let Some(bp) = bias {
        // SAFETY: the descriptor is only touched under the lock; the value is a device address.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bp as *const u64 as *const _,
                8,
            )
        }?;
    }
    let alpha = 1.0f32;
    let beta = if g.accumulate { 1.0f32 } else { 0.0 };
    // SAFETY: shapes were checked against the buffers (check_gemm); the layouts describe exactly
    // those shapes; the workspace belongs to this stream; operands are device addresses.
    unsafe {
        lt::matmul(
            handle,
            plan.desc,
            &alpha as *const f32 as *const _,
            &beta as *const f32 as *const _,
            b as *const _,
            plan.la,
            a as *const _,
            plan.lb,
            c as *const _,
            plan.lc,
            c as *mut _,
            plan.lc,
            &plan.algo,
            ws as *mut _,
            WORKSPACE_BYTES,
            stream.cu_stream() as *mut _,
        )
    }?;
    Ok(())
}

/// `c[m, n] (= or +=) op(a) op(b)` in bf16 with fp32 accumulation, as [`crate::cpu::matmul`].
pub fn matmul_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    c: &mut impl DevicePtrMut<bf16>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    g: Gemm,
) -> Result<()> {
    check_gemm("matmul_bf16", &g, a.len(), b.len(), c.len())?;
    let (cp, ap, bp) = (ptr_mut(c, stream), ptr(a, stream), ptr(b, stream));
    lt_matmul(gpu, stream, &g, cp, ap, bp, None, false, 0)
}

/// [`matmul_bf16`] with an fp32 `c`: `c[m, n] (= or +=) op(a) op(b)`, the product kept in fp32
/// (never rounded to bf16) and, with `g.accumulate`, added to `c` in the GEMM's epilogue. What
/// parameter gradients use: each micro-batch's `dy^T x` summed into the fp32 gradient in one
/// pass, as [`crate::cpu::matmul`] sums it.
pub fn matmul_bf16_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    c: &mut impl DevicePtrMut<f32>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    g: Gemm,
) -> Result<()> {
    check_gemm("matmul_bf16_f32", &g, a.len(), b.len(), c.len())?;
    let (cp, ap, bp) = (ptr_mut(c, stream), ptr(a, stream), ptr(b, stream));
    lt_matmul(gpu, stream, &g, cp, ap, bp, None, true, 0)
}

/// `nn.Linear`: `y[m, n] = x[m, k] w[n, k]^T + bias[n]` (bias optional, fused in the epilogue).
/// Decode-sized products (`m <= SKINNY_DISPATCH_MAX_M`, `k % 8 == 0`, 16-byte aligned `x` and
/// `w`) run on our skinny kernel ([`skinny_linear_fwd_bf16`]), the rest on cuBLASLt
/// ([`linear_fwd_bf16_cublaslt`]); the choice depends on the shape and alignment only.
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    if skinny_pays(gpu, m, k) && ptr(x, stream) % 16 == 0 && ptr(w, stream) % 16 == 0 && n > 0 {
        return skinny_linear_fwd_bf16(gpu, stream, y, x, w, bias, m, k, n);
    }
    linear_fwd_bf16_cublaslt(gpu, stream, y, x, w, bias, m, k, n)
}

/// The rows of x up to which [`linear_fwd_bf16`] and [`gate_up_swiglu_bf16`] take the skinny
/// kernel: its `mma.sync` form at m <= 8 (it beat cuBLASLt on every 3B / 7B decode GEMM in a
/// CUDA graph, by up to 12% on the small ones) and, on devices with warpgroup MMAs, its `wgmma`
/// form at 8 < m <= 16 (1.00-1.13x cuBLASLt per 3B decode GEMM at m = 16). Above, cuBLASLt was
/// faster on most 3B decode GEMMs (by 3-7% at m = 32, 1.1-2x at m = 64..128: this kernel runs
/// one warpgroup per block and re-reads x per 64 weight rows; docs/perf.md, "Decode GEMMs").
pub const SKINNY_DISPATCH_MAX_M: usize = 16;

/// Whether [`linear_fwd_bf16`] runs a product of `m` rows and depth `k` on the skinny kernel
/// on `gpu` (given 16-byte aligned operands).
pub fn skinny_pays(gpu: &Gpu, m: usize, k: usize) -> bool {
    skinny_fits(m, k) && m <= SKINNY_DISPATCH_MAX_M && (m <= SKINNY_SYNC_MAX_M || gpu.has_wgmma())
}

/// [`linear_fwd_bf16`] always through cuBLASLt (bias fused as the epilogue), whatever `m`.
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd_bf16_cublaslt(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    lt_linear(gpu, stream, y, x, w, bias, m, k, n, 0)
}

/// [`linear_fwd_bf16_cublaslt`] with the algorithm of rank `rank` (`< LT_RANKS`) among
/// cuBLASLt's heuristic answers, for comparing them; errors when the heuristic gives fewer.
#[cfg(feature = "bench")]
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd_bf16_cublaslt_ranked(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
    rank: usize,
) -> Result<()> {
    if rank >= LT_RANKS {
        return Err(shape(
            "linear_fwd_bf16",
            format!("rank {rank} >= {LT_RANKS}"),
        ));
    }
    lt_linear(gpu, stream, y, x, w, bias, m, k, n, rank as u8)
}

#[allow(clippy::too_many_arguments)]
fn lt_linear(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
    rank: u8,
) -> Result<()> {
    let g = Gemm::nt(m, k, n);
    check_gemm("linear_fwd_bf16", &g, x.len(), w.len(), y.len())?;
    let bp = match bias {
        Some(b) => {
            if b.len() < n {
                return Err(shape(
                    "linear_fwd_bf16",
                    format!("bias holds {} elements, needs {n}", b.len()),
                ));
            }
            Some(ptr(b, stream))
        }
        None => None,
    };
    let (yp, xp, wp) = (ptr_mut(y, stream), ptr(x, stream), ptr(w, stream));
    lt_matmul(gpu, stream, &g, yp, xp, wp, bp, false, rank)
}

/// The same product through the classic cuBLAS API (`cublasGemmEx`, fp32 compute), for
/// comparison with the cuBLASLt path (feature `bench`). Its algorithm is cuBLAS's choice per
/// call.
#[cfg(feature = "bench")]
pub fn matmul_bf16_cublas(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    c: &mut impl DevicePtrMut<bf16>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    g: Gemm,
) -> Result<()> {
    check_gemm("matmul_bf16_cublas", &g, a.len(), b.len(), c.len())?;
    let (cp, ap, bp) = (ptr_mut(c, stream), ptr(a, stream), ptr(b, stream));
    let op = |t: bool| {
        if t {
            bsys::cublasOperation_t::CUBLAS_OP_T
        } else {
            bsys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let lda = if g.trans_b { g.k } else { g.n } as i32;
    let ldb = if g.trans_a { g.m } else { g.k } as i32;
    let alpha = 1.0f32;
    let beta = if g.accumulate { 1.0f32 } else { 0.0 };
    gpu.with_blas(stream, |blas| {
        // SAFETY: shapes checked against the buffers; the handle is bound to `stream`.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                op(g.trans_b),
                op(g.trans_a),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &alpha as *const f32 as *const _,
                bp as *const _,
                bsys::cudaDataType_t::CUDA_R_16BF,
                lda,
                ap as *const _,
                bsys::cudaDataType_t::CUDA_R_16BF,
                ldb,
                &beta as *const f32 as *const _,
                cp as *mut _,
                bsys::cudaDataType_t::CUDA_R_16BF,
                g.n as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Skinny GEMMs (decode): our own tensor-core kernel, `kernels/cuda/gemv.cu`.

/// The skinny-GEMM kernel source (compiled per [`SkinnyPlan`] shape class by NVRTC).
pub const GEMV: KernelModule = KernelModule {
    name: "gemv",
    source: include_str!("../../cuda/gemv.cu"),
};

/// The most rows of `x` the skinny kernel takes (16 m-tiles of 8, the `wgmma` form).
pub const SKINNY_MAX_M: usize = 128;

/// The most dynamic shared memory a block may have (sm_90: 227 KiB).
const SKINNY_SMEM_MAX: usize = 227 << 10;

/// The rows of `x` up to which [`skinny_plan`] takes the `mma.sync` form.
pub const SKINNY_SYNC_MAX_M: usize = 8;

/// How [`skinny_linear_fwd_bf16`] cuts a GEMM: `m_tiles` tiles of 8 rows of x, blocks of
/// `64 * row_tiles` weight rows (output features; half gate, half up in the SwiGLU form), and k
/// cut into `splits` slices of `kslice` (a multiple of 64) summed in a cluster of `splits`
/// blocks; `wgmma`: the products on warpgroup MMAs (Hopper; `8 * m_tiles` is then 16, 32, 64 or
/// 128) rather than `mma.sync`; `stages`: the cp.async pipeline's depth (64 k each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub m_tiles: usize,
    pub row_tiles: usize,
    pub splits: usize,
    pub kslice: usize,
    pub wgmma: bool,
    pub stages: usize,
}

impl SkinnyPlan {
    /// Weight rows one block covers.
    pub fn block_rows(&self) -> usize {
        64 * self.row_tiles
    }
    /// Bytes of one pipeline stage (64 k of the block's weight rows and of x's padded rows).
    fn stage_bytes(&self) -> usize {
        (self.block_rows() + 8 * self.m_tiles) * 64 * 2
    }
    /// Dynamic shared memory one block uses (the stages; + 1 KiB to align them for `wgmma`).
    pub fn smem_bytes(&self) -> usize {
        self.stages * self.stage_bytes() + if self.wgmma { 1024 } else { 0 }
    }
    /// This plan with a `stages`-deep pipeline (`None` where the partial-sum tile would not fit
    /// in the stages, the stages not in a block's shared memory, or `stages` is outside 2..=8,
    /// 3..=8 for `wgmma`).
    pub fn with_stages(self, stages: usize) -> Option<SkinnyPlan> {
        let p = SkinnyPlan { stages, ..self };
        let red = p.block_rows() * (8 * p.m_tiles + 4) * 4;
        let least = if p.wgmma { 3 } else { 2 };
        ((least..=8).contains(&stages)
            && stages * p.stage_bytes() >= red
            && p.smem_bytes() <= SKINNY_SMEM_MAX)
            .then_some(p)
    }
    /// This plan in the `wgmma` form (`true`) or the `mma.sync` one, for `m` rows of x: the m
    /// tiles and the pipeline depth (6 stages for `wgmma`, of which 4 load ahead; 4 for
    /// `mma.sync`) follow the form; the cut of the weights and of k stays.
    pub fn with_form(self, m: usize, wgmma: bool) -> SkinnyPlan {
        SkinnyPlan {
            m_tiles: skinny_m_tiles(m, wgmma),
            wgmma,
            stages: if wgmma { 6 } else { 4 },
            ..self
        }
    }
}

/// m tiles of 8 rows the kernel pads `m` to: `wgmma`'s N is 16, 32, 64 or 128.
fn skinny_m_tiles(m: usize, wgmma: bool) -> usize {
    let m = m.clamp(1, SKINNY_MAX_M);
    if wgmma {
        [16, 32, 64, 128]
            .into_iter()
            .find(|&n| n >= m)
            .unwrap_or(128)
            / 8
    } else {
        m.div_ceil(8)
    }
}

/// The plan [`skinny_linear_fwd_bf16`] uses for `y[m, n] = x[m, k] w[n, k]^T` (`n` output
/// features; for the SwiGLU form the `2f` gate|up rows): a function of the shape only. The
/// `mma.sync` form at m <= 8 (4 stages), `wgmma` above (6 stages); blocks of 64 weight rows, k
/// cut into the fewest slices (1, 2, 4 or 8, each at least 256 k) that give at least 220 blocks.
/// Measured on the H200 (docs/perf.md, "Decode GEMMs"): at m = 8 this was the fastest or within
/// 3% of the fastest of 1/2 row tiles x 1/2/4/8 slices on every 3B / 7B decode GEMM; at m = 16
/// within 5% of the fastest of 1/2 row tiles x 1/2/4/8 slices x 3/4/6/8 stages (and of
/// cuBLASLt) on every 3B decode GEMM.
pub fn skinny_plan(m: usize, k: usize, n: usize) -> SkinnyPlan {
    let blocks = n.max(1).div_ceil(64);
    let mut plan = skinny_plan_with(m, k, n, 1, 1);
    for splits in [2, 4, 8] {
        if blocks * plan.splits >= 220 {
            break;
        }
        let p = skinny_plan_with(m, k, n, 1, splits);
        if p.kslice < 256 {
            break;
        }
        plan = p;
    }
    plan
}

/// The plan with `row_tiles` (1 or 2) and k cut into at most `splits` (1..=8) slices of a
/// multiple of 64 (the plan's `splits` may come out smaller when k is short), in the form
/// [`skinny_plan`] takes for `m` (`wgmma` above [`SKINNY_SYNC_MAX_M`]).
pub fn skinny_plan_with(
    m: usize,
    k: usize,
    _n: usize,
    row_tiles: usize,
    splits: usize,
) -> SkinnyPlan {
    let kslice = k.max(1).div_ceil(splits.clamp(1, 8)).div_ceil(64) * 64;
    SkinnyPlan {
        m_tiles: 1,
        row_tiles: row_tiles.clamp(1, 2),
        splits: k.max(1).div_ceil(kslice),
        kslice,
        wgmma: false,
        stages: 4,
    }
    .with_form(m, m > SKINNY_SYNC_MAX_M)
}

/// Whether the skinny kernel can run this GEMM (else use [`linear_fwd_bf16`]): `1 <= m <= 128`,
/// `k` a multiple of 8 (rows are read in 16-byte units); above [`SKINNY_SYNC_MAX_M`] rows only
/// on a device with warpgroup MMAs ([`Gpu::has_wgmma`]).
pub fn skinny_fits(m: usize, k: usize) -> bool {
    (1..=SKINNY_MAX_M).contains(&m) && k.is_multiple_of(8) && k > 0
}

#[allow(clippy::too_many_arguments)]
fn skinny_launch(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: u64,
    x: u64,
    w: u64,
    bias: u64,
    m: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
    up_off: usize,
    swiglu: bool,
    plan: SkinnyPlan,
) -> Result<()> {
    let tiles_ok = if plan.wgmma {
        [2, 4, 8, 16].contains(&plan.m_tiles)
    } else {
        plan.m_tiles <= 8
    };
    if plan.m_tiles * 8 < m
        || !tiles_ok
        || !(1..=2).contains(&plan.row_tiles)
        || !(1..=8).contains(&plan.splits)
        || !(if plan.wgmma { 3 } else { 2 }..=8).contains(&plan.stages)
        || plan.smem_bytes() > SKINNY_SMEM_MAX
        || !plan.kslice.is_multiple_of(64)
        || plan.splits * plan.kslice < k
    {
        return Err(shape(
            op,
            format!("plan {plan:?} does not cover m={m} k={k} (m_tiles*8 >= m with m_tiles 2, 4, 8 or 16 for wgmma and at most 8 else, 1..=2 row tiles, 1..=8 splits, 2..=8 stages (3..=8 for wgmma), kslice a multiple of 64, splits*kslice >= k)"),
        ));
    }
    if plan.wgmma && !gpu.has_wgmma() {
        return Err(shape(
            op,
            format!("plan {plan:?} uses warpgroup MMAs, which {} ({}) lacks: take the mma.sync form (SkinnyPlan::with_form) or linear_fwd_bf16", gpu.name(), gpu.arch()),
        ));
    }
    for (name, p) in [("y", y), ("x", x), ("w", w)] {
        if name != "y" {
            aligned16(op, name, p)?;
        }
    }
    let defines: Vec<(&'static str, u32)> = vec![
        ("GEMV_MT", plan.m_tiles as u32),
        ("GEMV_RT", plan.row_tiles as u32),
        ("GEMV_S", plan.splits as u32),
        ("GEMV_SWIGLU", swiglu as u32),
        ("GEMV_WG", plan.wgmma as u32),
        ("GEMV_STAGES", plan.stages as u32),
    ];
    let smem = plan.smem_bytes() as u32;
    let rows_per_block = if swiglu {
        plan.block_rows() / 2
    } else {
        plan.block_rows()
    };
    let gy = u32_of(op, "row blocks", n.div_ceil(rows_per_block))?;
    let cfg = Grid {
        grid: (plan.splits as u32, gy, 1),
        block: (128, 1, 1),
        smem,
    };
    let (mm, nn, kk) = (m as u32, u32_of(op, "n", n)?, u32_of(op, "k", k)?);
    let (lx, ly) = (u32_of(op, "ldx", ldx)?, u32_of(op, "ldy", ldy)?);
    let (ks, uo) = (plan.kslice as u32, u32_of(op, "up_off", up_off)?);
    // SAFETY: the callers checked that y holds (m-1)*ldy + n elements, x (m-1)*ldx + k, w every
    // weight row the kernel reads (n rows of k, or up_off + n rows in the SwiGLU form) and bias
    // n (up_off + n) elements; the kernel reads x rows < m and weight rows < n (+ up_off) only,
    // k < min(k, slice end), and writes y rows < m, columns < n; x and w are 16-byte aligned,
    // k % 8 == 0 and ldx % 8 == 0 (checked); grid.x == splits == the compiled cluster size;
    // arguments match (y, x, w, bias, m, n, k, ldx, ldy, kslice, up_off).
    unsafe {
        launch(
            gpu,
            stream,
            &GEMV,
            &defines,
            "gemv_bf16",
            cfg,
            &[&y, &x, &w, &bias, &mm, &nn, &kk, &lx, &ly, &ks, &uo],
        )
    }?;
    Ok(())
}

fn skinny_checks(
    op: &'static str,
    m: usize,
    k: usize,
    ldx: usize,
    ldy: usize,
    n: usize,
) -> Result<()> {
    if !skinny_fits(m, k) {
        return Err(shape(
            op,
            format!("m={m} k={k}: the skinny kernel takes 1 <= m <= {SKINNY_MAX_M} and k a positive multiple of 8 (use linear_fwd_bf16)"),
        ));
    }
    if ldx < k || !ldx.is_multiple_of(8) || ldy < n || n == 0 {
        return Err(shape(
            op,
            format!(
                "row strides ldx={ldx} (>= k={k}, multiple of 8), ldy={ldy} (>= n={n}) do not fit"
            ),
        ));
    }
    Ok(())
}

/// `y[m, n] = x[m, k] w[n, k]^T + bias[n]` for decode-sized `m <= 128` with our tensor-core
/// split-k kernel ([`skinny_plan`]); the same contract and CPU twin ([`crate::cpu::linear_fwd`])
/// as [`linear_fwd_bf16`], contiguous rows.
#[allow(clippy::too_many_arguments)]
pub fn skinny_linear_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    let plan = skinny_plan(m, k, n);
    skinny_linear_fwd_bf16_with(gpu, stream, y, x, w, bias, m, k, n, k, n, plan)
}

/// [`skinny_linear_fwd_bf16`] with row strides (`ldx` elements between rows of x, `ldy` of y)
/// and an explicit plan.
#[allow(clippy::too_many_arguments)]
pub fn skinny_linear_fwd_bf16_with(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
    plan: SkinnyPlan,
) -> Result<()> {
    const OP: &str = "skinny_linear_fwd_bf16";
    skinny_checks(OP, m, k, ldx, ldy, n)?;
    for (name, have, want) in [
        ("y", y.len(), (m - 1) * ldy + n),
        ("x", x.len(), (m - 1) * ldx + k),
        ("w", w.len(), n * k),
    ] {
        if have < want {
            return Err(shape(
                OP,
                format!("{name} holds {have} elements, needs {want}"),
            ));
        }
    }
    let bp = match bias {
        Some(b) => {
            if b.len() < n {
                return Err(shape(
                    OP,
                    format!("bias holds {} elements, needs {n}", b.len()),
                ));
            }
            ptr(b, stream)
        }
        None => 0,
    };
    let (yp, xp, wp) = (ptr_mut(y, stream), ptr(x, stream), ptr(w, stream));
    skinny_launch(
        OP, gpu, stream, yp, xp, wp, bp, m, k, n, ldx, ldy, 0, false, plan,
    )
}

/// The MLP's first half in one launch: `act[m, f] = silu(x Wg^T) * (x Wu^T)` where
/// `w_gate_up` is `[2f, k]`, gate rows then up rows (the fused gate|up weight), with the
/// roundings of [`linear_fwd_bf16`] into a `[m, 2f]` buffer followed by
/// [`super::swiglu_fwd_bf16`]. `plan`: `None` takes [`skinny_plan`]`(m, k, 2 f)`, the plan of
/// the unfused `[m, 2f]` GEMM: same k slices, so the result is bitwise that GEMM through
/// [`skinny_linear_fwd_bf16`] followed by `swiglu_fwd_bf16`.
#[allow(clippy::too_many_arguments)]
pub fn skinny_gate_up_swiglu_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    act: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w_gate_up: &impl DevicePtr<bf16>,
    m: usize,
    k: usize,
    f: usize,
    plan: Option<SkinnyPlan>,
) -> Result<()> {
    const OP: &str = "skinny_gate_up_swiglu_bf16";
    skinny_checks(OP, m, k, k, f, f)?;
    for (name, have, want) in [
        ("act", act.len(), m * f),
        ("x", x.len(), m * k),
        ("w_gate_up", w_gate_up.len(), 2 * f * k),
    ] {
        if have < want {
            return Err(shape(
                OP,
                format!("{name} holds {have} elements, needs {want}"),
            ));
        }
    }
    let plan = plan.unwrap_or_else(|| skinny_plan(m, k, 2 * f));
    let (yp, xp, wp) = (ptr_mut(act, stream), ptr(x, stream), ptr(w_gate_up, stream));
    skinny_launch(OP, gpu, stream, yp, xp, wp, 0, m, k, f, k, f, f, true, plan)
}

/// The MLP's first half, `act[m, f] = silu(x Wg^T) * (x Wu^T)` with `w_gate_up` `[2f, k]` (gate
/// rows then up rows): fused in one skinny launch when [`skinny_pays`] (and the operands are
/// 16-byte aligned), else [`linear_fwd_bf16`] into `gu` (`[m, 2f]` scratch) and
/// [`super::swiglu_fwd_bf16`]. Either way the roundings are those of the unfused pair.
#[allow(clippy::too_many_arguments)]
pub fn gate_up_swiglu_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    act: &mut impl DevicePtrMut<bf16>,
    gu: &mut CudaSlice<bf16>,
    x: &impl DevicePtr<bf16>,
    w_gate_up: &impl DevicePtr<bf16>,
    m: usize,
    k: usize,
    f: usize,
) -> Result<()> {
    if skinny_pays(gpu, m, k)
        && ptr(x, stream) % 16 == 0
        && ptr(w_gate_up, stream) % 16 == 0
        && f > 0
    {
        return skinny_gate_up_swiglu_bf16(gpu, stream, act, x, w_gate_up, m, k, f, None);
    }
    linear_fwd_bf16_cublaslt(gpu, stream, gu, x, w_gate_up, None, m, k, 2 * f)?;
    let up = gu.slice(f..);
    super::swiglu_fwd_bf16(gpu, stream, act, gu, &up, m, f, f, 2 * f, 2 * f)
}

#[cfg(test)]
mod skinny_tests {
    use super::*;
    use crate::cuda::nvrtc::{compile_uncached, nvrtc_or_skip, options, COMMON};

    #[test]
    fn plans_cover_k_and_fill_the_grid() {
        for &(m, k, n) in &[
            (64, 2048, 2560),
            (8, 11008, 2048),
            (64, 2048, 151_936),
            (3, 200, 48),
            (128, 11008, 2048),
            (17, 520, 300),
        ] {
            let p = skinny_plan(m, k, n);
            assert!(
                p.splits * p.kslice >= k && (p.splits - 1) * p.kslice < k,
                "{p:?}"
            );
            assert!(p.m_tiles * 8 >= m && p.kslice.is_multiple_of(64) && p.splits <= 8);
            assert_eq!(p.wgmma, m > SKINNY_SYNC_MAX_M, "{p:?}");
        }
        // a small-n GEMM is cut along k so that the grid is not a handful of blocks
        for m in [8, 64] {
            let p = skinny_plan(m, 2048, 2560);
            assert!(
                p.splits * 2560usize.div_ceil(p.block_rows()) >= 100,
                "{p:?}"
            );
        }
        assert!(!skinny_fits(129, 64) && !skinny_fits(8, 12) && skinny_fits(1, 8));
        // wgmma's N: the rows of x padded to 16, 32, 64 or 128
        for (m, tiles) in [
            (9, 2),
            (16, 2),
            (17, 4),
            (33, 8),
            (64, 8),
            (65, 16),
            (128, 16),
        ] {
            assert_eq!(skinny_plan(m, 2048, 2048).m_tiles, tiles, "m {m}");
        }
        // the decode shapes of 3B / 7B (qkv, o, gate|up, down, lm_head) at batch 128 to 8
        for m in [128, 64, 32, 16, 8] {
            for (k, n) in [
                (2048, 2560),
                (2048, 2048),
                (2048, 22016),
                (11008, 2048),
                (2048, 151_936),
                (3584, 4608),
                (3584, 3584),
                (3584, 37888),
                (18944, 3584),
                (3584, 152_064),
            ] {
                let p = skinny_plan(m, k, n);
                let blocks = n.div_ceil(p.block_rows()) * p.splits;
                println!("m{m} k{k} n{n}: {p:?}, {blocks} blocks");
                assert!(blocks >= 120 || p.splits == 8 || p.kslice < 512, "{p:?}");
                assert!(p.splits * p.kslice >= k && p.splits <= 8);
                // the partial tile fits in the stages it reuses
                assert!(
                    p.stages * p.stage_bytes() >= p.block_rows() * (8 * p.m_tiles + 4) * 4,
                    "{p:?}"
                );
                assert!(p.with_stages(p.stages) == Some(p), "{p:?}");
            }
        }
        // the forms convert into each other with the cut kept
        let p = skinny_plan(64, 2048, 2560);
        let q = p.with_form(64, false);
        assert!(!q.wgmma && q.m_tiles == 8 && q.splits == p.splits && q.kslice == p.kslice);
        assert_eq!(q.with_form(64, true), p);
    }

    /// Compiles the kernel's variants for sm_90 where libnvrtc loads (no GPU needed) and prints
    /// ptxas's register / spill report.
    #[test]
    fn gemv_variants_compile_for_sm90() {
        if !nvrtc_or_skip() {
            return;
        }
        let source = format!("{COMMON}\n#line 1 \"gemv.cu\"\n{}", GEMV.source);
        for (mt, rt, s, sw, wg, st) in [
            (8, 2, 1, 0, 0, 4),
            (8, 1, 8, 0, 0, 4),
            (1, 2, 4, 0, 0, 4),
            (8, 2, 2, 1, 0, 4),
            (3, 1, 7, 1, 0, 4),
            (16, 2, 8, 0, 1, 3),
            (16, 2, 4, 1, 1, 3),
            (8, 2, 1, 0, 1, 4),
            (4, 1, 2, 1, 1, 5),
            (2, 2, 8, 0, 1, 6),
        ] {
            let d = [
                ("GEMV_MT", mt),
                ("GEMV_RT", rt),
                ("GEMV_S", s),
                ("GEMV_SWIGLU", sw),
                ("GEMV_WG", wg),
                ("GEMV_STAGES", st),
            ];
            let arch = if wg == 1 { "sm_90a" } else { "sm_90" };
            match compile_uncached("gemv", &source, &options(arch, &d)) {
                Ok((cubin, log)) => {
                    assert!(!cubin.is_empty());
                    println!("== gemv {d:?}\n{log}");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}
