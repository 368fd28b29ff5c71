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

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{ptr, ptr_mut};
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
}

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
        } = key;
        let bf = ltsys::cudaDataType_t::CUDA_R_16BF;
        // cuBLASLt operand 1 = our B, operand 2 = our A (see the module doc).
        let (r1, c1, ld1) = if trans_b { (k, n, k) } else { (n, k, n) };
        let (r2, c2, ld2) = if trans_a { (m, k, m) } else { (k, m, k) };
        let la = lt::create_matrix_layout(bf, r1 as u64, c1 as u64, ld1 as i64)?;
        let lb = lt::create_matrix_layout(bf, r2 as u64, c2 as u64, ld2 as i64)?;
        let lc = lt::create_matrix_layout(bf, n as u64, m as u64, n as i64)?;
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
        // SAFETY: valid handles, created above.
        let h = r.and_then(|_| unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref)
        });
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        plan.algo = h?.algo;
        Ok(plan)
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
    lt_matmul(gpu, stream, &g, cp, ap, bp, None)
}

/// `nn.Linear`: `y[m, n] = x[m, k] w[n, k]^T + bias[n]` (bias optional, fused in the epilogue).
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
    lt_matmul(gpu, stream, &g, yp, xp, wp, bp)
}

/// The same product through the classic cuBLAS API (`cublasGemmEx`, fp32 compute), for
/// comparison with the cuBLASLt path. Its algorithm is cuBLAS's choice per call.
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
