//! bf16 GEMMs with fp32 accumulation: `matmul_bf16` (the twin of [`crate::cpu::matmul()`], same
//! [`crate::cpu::Gemm`] descriptor), `matmul_bf16_f32` (its fp32 output: weight gradients summed
//! in place) and `linear_fwd_bf16` (`y = x W^T + b`, Hugging Face weight layout `[out, in]`,
//! bias fused as the GEMM epilogue). Where they run: `lt` (cuBLASLt), `skinny` (our decode
//! kernel); this module picks between them.
//!
//! Row-major to column-major: cuBLAS is column-major, and a row-major `[r, c]` matrix is the
//! column-major `[c, r]` one with the same bytes. So row-major `C = op(A) op(B)` is computed as
//! column-major `C^T = op(B)^T op(A)^T`: cuBLASLt's first operand is our B, its second our A, its
//! `m, n` are our `n, m`. Our B stored `[n, k]` (trans_b, the nn.Linear layout) is column-major
//! `[k, n]` (ld k), used transposed; stored `[k, n]` it is column-major `[n, k]` (ld n), used as
//! is. Likewise A. The output is column-major `[n, m]` with ld n, row-major `[m, n]`.
//!
//! Plans: one per (shape, transposes, bias, output type) with the algorithm chosen once by cuBLASLt's
//! heuristic and reused on every stream, so a GEMM's bits do not depend on the stream or its
//! SM partition. Workspaces: 32 MiB per stream.
//!
//! Decode-sized products (m <= 128 rows of x) can also run on our own kernel (`gemv_bf16` in
//! `cuda/gemv.cu`: [`skinny_linear_fwd_bf16`], [`skinny_gate_up_swiglu_bf16`]): weight-row
//! tiles x k slices, the slices of a tile summed in a thread-block cluster through distributed
//! shared memory in rank order (deterministic, one launch, no workspace), the products on
//! `mma.sync` at m <= 8 and above on Hopper's warpgroup MMAs fed by the tensor memory
//! accelerator; its cut ([`SkinnyPlan`]) is a
//! function of the shape. [`linear_fwd_bf16`] and [`gate_up_swiglu_bf16`] take it where
//! [`skinny_pays`], and cuBLASLt elsewhere.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::ptr;
use super::{Gpu, Result};

mod lt;
mod skinny;

pub(crate) use lt::LtState;
pub use lt::{linear_fwd_bf16_cublaslt, matmul_bf16, matmul_bf16_f32, LT_RANKS};
#[cfg(feature = "bench")]
pub use lt::{linear_fwd_bf16_cublaslt_ranked, matmul_bf16_cublas};
pub use skinny::*;

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
    if skinny_pays(gpu, m, k, n) && ptr(x, stream) % 16 == 0 && ptr(w, stream) % 16 == 0 && n > 0 {
        return skinny_linear_fwd_bf16(gpu, stream, y, x, w, bias, m, k, n);
    }
    linear_fwd_bf16_cublaslt(gpu, stream, y, x, w, bias, m, k, n)
}

/// The rows of x up to which [`linear_fwd_bf16`] and [`gate_up_swiglu_bf16`] take the skinny
/// kernel for every shape: its `mma.sync` form at m <= 8 (it beat cuBLASLt on every 3B / 7B
/// decode GEMM in a CUDA graph, by up to 12% on the small ones) and, on devices with warpgroup
/// MMAs, its `wgmma` form at 8 < m <= 16 (1.00-1.13x cuBLASLt per 3B decode GEMM at m = 16).
pub const SKINNY_DISPATCH_MAX_M: usize = 16;

/// The rows of x up to which the skinny kernel also takes the lopsided GEMMs (many more
/// output features than depth, or the reverse: the MLP's gate|up and down, the lm head), where
/// it streams the weights at least as fast as cuBLASLt and fuses SwiGLU into gate|up; cuBLASLt
/// keeps the square ones (q|k|v, o) above [`SKINNY_DISPATCH_MAX_M`] (docs/perf.md, "Decode
/// GEMMs").
pub const SKINNY_LOPSIDED_MAX_M: usize = 64;

/// Whether [`linear_fwd_bf16`] runs a product of `m` rows, depth `k` and `n` output features
/// on the skinny kernel on `gpu` (given 16-byte aligned operands).
pub fn skinny_pays(gpu: &Gpu, m: usize, k: usize, n: usize) -> bool {
    let lopsided = n >= 4 * k || k >= 4 * n;
    skinny_fits(m, k)
        && (m <= SKINNY_DISPATCH_MAX_M || (lopsided && m <= SKINNY_LOPSIDED_MAX_M))
        && (m <= SKINNY_SYNC_MAX_M || gpu.has_wgmma())
}

/// Decode's q|k|v projection with the rotary embedding and the KV append (see [`QkvRope`]):
/// one skinny launch with both in its epilogue ([`skinny_qkv_rope_bf16`]) where
/// [`qkv_rope_fuses`], else [`linear_fwd_bf16`] into `qkv` followed by
/// [`super::rope_kv_append_bf16`]. The fused form is bitwise the skinny GEMM followed by that
/// kernel; either way `qkv` ends rotated and the caches hold the new rows.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_append_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    qkv: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    rope: QkvRope<'_>,
) -> Result<()> {
    let n = rope.width();
    if qkv_rope_fuses(gpu, m, k, n, rope.head_dim)
        && ptr(x, stream) % 16 == 0
        && ptr(w, stream) % 16 == 0
    {
        return skinny_qkv_rope_bf16(gpu, stream, qkv, x, w, bias, m, k, rope, None);
    }
    linear_fwd_bf16(gpu, stream, qkv, x, w, bias, m, k, n)?;
    super::rope_kv_append_bf16(
        gpu,
        stream,
        qkv,
        rope.k_cache,
        rope.v_cache,
        rope.cos,
        rope.sin,
        rope.slots,
        m,
        rope.heads,
        rope.kv_heads,
        rope.head_dim,
        true,
    )
}

/// The rows of x up to which [`qkv_rope_append_bf16`] fuses (docs/perf.md, "Decode GEMMs",
/// H100, 3B dims): q|k|v + rope + append alone took 8.4 / 8.6 / 10.1 / 17.9 us a layer fused
/// at m = 8 / 32 / 64 / 128 against 9.4 / 9.6 / 9.8 / 10.2 us for cuBLASLt's GEMM and
/// `rope_kv_append_bf16`; in the whole step the fused launch was 1.2% faster at 64 rows and 7%
/// slower at 128 (`wgmma`'s N of 128, where the skinny GEMM re-reads x most).
pub const QKV_ROPE_FUSED_MAX_M: usize = 64;

/// Whether [`qkv_rope_append_bf16`] takes the fused skinny launch for `m` rows, depth `k` and
/// `n` q|k|v rows of heads of `head_dim` (given 16-byte aligned operands): up to
/// [`QKV_ROPE_FUSED_MAX_M`] rows where the skinny kernel fits (above [`SKINNY_SYNC_MAX_M`] on
/// devices with warpgroup MMAs) and its block's pairs divide half a head. Up to m = 16 the
/// plain GEMM is already ours; above, the fused launch stands against cuBLASLt's GEMM followed
/// by the separate rotary and append kernel.
pub fn qkv_rope_fuses(gpu: &Gpu, m: usize, k: usize, n: usize, head_dim: usize) -> bool {
    skinny_fits(m, k)
        && m <= QKV_ROPE_FUSED_MAX_M
        && (m <= SKINNY_SYNC_MAX_M || gpu.has_wgmma())
        && skinny_qkv_rope_plan(m, k, n, head_dim).is_some()
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
    if skinny_pays(gpu, m, k, 2 * f)
        && ptr(x, stream) % 16 == 0
        && ptr(w_gate_up, stream) % 16 == 0
        && f > 0
    {
        return skinny_gate_up_swiglu_bf16(gpu, stream, act, x, w_gate_up, m, k, f, None);
    }
    linear_fwd_bf16_cublaslt(gpu, stream, gu, x, w_gate_up, None, m, k, 2 * f)?;
    super::swiglu_gate_up_fwd_bf16(gpu, stream, act, gu, m, f)
}
