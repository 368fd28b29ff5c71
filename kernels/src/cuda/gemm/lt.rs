//! cuBLASLt: the plans (one per shape, transposes, bias and output type, the algorithm chosen
//! once by the heuristic and reused on every stream), per-stream workspaces, and the products
//! that run on it: [`matmul_bf16`], [`matmul_bf16_f32`], [`linear_fwd_bf16_cublaslt`] (and, for
//! the workbenches, the classic cuBLAS path and the heuristic's other answers).

use std::collections::HashMap;
use std::sync::Arc;

#[cfg(feature = "bench")]
use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::super::launch::{ptr, ptr_mut};
use super::super::{shape, CudaError, Gpu, Result};
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
    let timed = gpu.time_start(stream)?;
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
    drop(st);
    let name = match (out_f32, bias.is_some()) {
        (true, _) => "cublasLt gemm, fp32 out",
        (false, true) => "cublasLt gemm, bias",
        (false, false) => "cublasLt gemm",
    };
    gpu.time_end(stream, timed, name, 2.0 * (g.m * g.n * g.k) as f64)
}

/// `c[m, n] (= or +=) op(a) op(b)` in bf16 with fp32 accumulation, as [`crate::cpu::matmul()`].
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
/// pass, as [`crate::cpu::matmul()`] sums it.
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

/// [`super::linear_fwd_bf16`] always through cuBLASLt (bias fused as the epilogue), whatever `m`.
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
