//! `attention_fwd_bf16`: varlen prefill attention on the tensor cores or the SIMT kernel.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{check_dims, check_stride, rows_of, AttnSeqGpu, KvSrc, RowStrides};
use crate::cpu::{AttnDims, AttnMask};
use crate::cuda::launch::{aligned16, launch, need, ptr, ptr_mut, u32_of, Grid};
use crate::cuda::nvrtc::ATTENTION;
use crate::cuda::{shape, Gpu, Result};

/// Which kernel [`attention_fwd_bf16_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdKernel {
    /// [`fwd_kernel_for`]'s choice (what [`attention_fwd_bf16`] runs).
    Auto,
    /// The tensor-core flash-attention kernel (`attention_fwd_tc_bf16`): 64-query tiles,
    /// head_dim a multiple of 16 up to [`TC_FWD_MAX_HEAD_DIM`].
    TensorCores,
    /// The SIMT kernel (16-query tiles, fp32 FMAs): head_dim a multiple of 16 up to 256.
    Simt,
}

/// The largest head_dim the tensor-core prefill kernel takes (Q, S and O live in registers:
/// 249 registers a thread at 128).
pub const TC_FWD_MAX_HEAD_DIM: usize = 128;

/// The shortest longest-query hint for which [`FwdKernel::Auto`] takes the tensor cores: below
/// it (decode through the varlen kernel: one query per sequence) a 64-row tile would be mostly
/// empty and the SIMT kernel's 16-row tiles waste less.
pub const TC_FWD_MIN_Q: usize = 16;

/// The kernel [`FwdKernel::Auto`] runs for `dims` and the `max_q_len` hint: the tensor cores
/// when head_dim <= [`TC_FWD_MAX_HEAD_DIM`] and `max_q_len >= TC_FWD_MIN_Q`, else SIMT.
pub fn fwd_kernel_for(dims: &AttnDims, max_q_len: usize) -> FwdKernel {
    if dims.head_dim <= TC_FWD_MAX_HEAD_DIM && max_q_len >= TC_FWD_MIN_Q {
        FwdKernel::TensorCores
    } else {
        FwdKernel::Simt
    }
}

/// What a prefill attention reads ([`attention_fwd_bf16`]), as [`crate::cpu::attention_fwd`]
/// takes it: `q` `[T, heads*hd]`; `k`, `v` `[T, kv_heads*hd]`; `prefix_k`, `prefix_v`
/// `[P, kv_heads*hd]` (give `k`, `v` again when no sequence has a prefix); rows `strides`
/// apart. `seqs` holds `n_seqs` descriptors on the device; `max_q_len` (a hint) sizes the grid
/// and picks the kernel ([`fwd_kernel_for`]); every query is attended whatever it says.
#[derive(Clone, Copy)]
pub struct FwdInputs<'a> {
    pub q: &'a dyn DevicePtr<bf16>,
    pub k: &'a dyn DevicePtr<bf16>,
    pub v: &'a dyn DevicePtr<bf16>,
    pub prefix_k: &'a dyn DevicePtr<bf16>,
    pub prefix_v: &'a dyn DevicePtr<bf16>,
    pub seqs: &'a dyn DevicePtr<AttnSeqGpu>,
    pub n_seqs: usize,
    pub max_q_len: usize,
    pub dims: AttnDims,
    pub mask: AttnMask,
    pub scale: f32,
    pub strides: RowStrides,
}

/// Varlen attention over a packed batch, as [`crate::cpu::attention_fwd`]: writes `out`
/// `[T, heads*hd]` (rows `x.strides.out` apart) and, if given, the natural-log `lse`
/// `[T, heads]` from the inputs `x`, on [`fwd_kernel_for`]'s kernel.
pub fn attention_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    x: FwdInputs,
) -> Result<()> {
    attention_fwd_bf16_with(FwdKernel::Auto, gpu, stream, out, lse, x)
}

/// [`attention_fwd_bf16`] on a chosen kernel (tests and the bench run both side by side).
/// [`FwdKernel::TensorCores`] with a head_dim past [`TC_FWD_MAX_HEAD_DIM`] is refused.
pub fn attention_fwd_bf16_with(
    kernel: FwdKernel,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    x: FwdInputs,
) -> Result<()> {
    let FwdInputs {
        q,
        k,
        v,
        prefix_k,
        prefix_v,
        seqs,
        n_seqs,
        max_q_len,
        dims,
        mask,
        scale,
        strides,
    } = x;
    const OP: &str = "attention_fwd_bf16";
    check_dims(OP, &dims, false)?;
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    check_stride(OP, "q", strides.q, qw)?;
    check_stride(OP, "out", strides.out, qw)?;
    check_stride(OP, "kv", strides.kv, kvw)?;
    check_stride(OP, "prefix", strides.prefix, kvw)?;
    need(OP, "seqs", seqs, n_seqs)?;
    if v.len() < k.len() || prefix_v.len() < prefix_k.len() {
        return Err(shape(
            OP,
            "v (prefix_v) must hold as many elements as k (prefix_k)",
        ));
    }
    let q_rows = rows_of(q.len(), qw, strides.q).min(rows_of(out.len(), qw, strides.out));
    let kv_rows = rows_of(k.len(), kvw, strides.kv);
    let p_rows = rows_of(prefix_k.len(), kvw, strides.prefix);
    let lse_p = match lse {
        Some(l) => {
            need(OP, "lse", l, q_rows * dims.num_heads)?;
            ptr_mut(l, stream)
        }
        None => 0,
    };
    if n_seqs == 0 || max_q_len == 0 {
        return Ok(());
    }
    let src = KvSrc {
        pk: ptr(prefix_k, stream),
        pv: ptr(prefix_v, stream),
        p_stride: strides.prefix as u32,
        k: ptr(k, stream),
        v: ptr(v, stream),
        kv_stride: strides.kv as u32,
    };
    let (op_, qp, sp) = (ptr_mut(out, stream), ptr(q, stream), ptr(seqs, stream));
    for (name, p) in [
        ("out", op_),
        ("q", qp),
        ("k", src.k),
        ("v", src.v),
        ("prefix_k", src.pk),
        ("prefix_v", src.pv),
    ] {
        aligned16(OP, name, p)?;
    }
    let kernel = match kernel {
        FwdKernel::Auto => fwd_kernel_for(&dims, max_q_len),
        FwdKernel::TensorCores if dims.head_dim > TC_FWD_MAX_HEAD_DIM => {
            return Err(shape(
                OP,
                format!(
                    "the tensor-core kernel takes head_dim up to {TC_FWD_MAX_HEAD_DIM}, not {}",
                    dims.head_dim
                ),
            ))
        }
        k => k,
    };
    let tc = kernel == FwdKernel::TensorCores;
    let hd = dims.head_dim as u32;
    let name = if tc {
        "attention_fwd_tc_bf16"
    } else {
        "attention_fwd_bf16"
    };
    // the tensor-core kernel: 2 stages of a 64-key K and V tile, rows padded by 8 bf16
    let smem = if tc {
        (2 * 2 * 64 * (dims.head_dim + 8) * 2) as u32
    } else {
        0
    };
    let (os, qs) = (strides.out as u32, strides.q as u32);
    let (nh, nkv) = (dims.num_heads as u32, dims.num_kv_heads as u32);
    let causal = matches!(mask, AttnMask::Causal) as u32;
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let (qr, pr, kr) = (
        u32_of(OP, "q rows", q_rows)?,
        u32_of(OP, "prefix rows", p_rows)?,
        u32_of(OP, "kv rows", kv_rows)?,
    );
    let q_tile = if tc { 64 } else { 16 };
    let gx = u32_of(OP, "max_q_len", max_q_len.div_ceil(q_tile))?.min(65535);
    let gz = u32_of(OP, "n_seqs", n_seqs)?;
    let cfg = Grid {
        grid: (gx, nh, gz),
        block: (128, 1, 1),
        smem,
    };
    // SAFETY: the kernel checks each descriptor against q_rows / p_rows / kv_rows (computed from
    // the buffers' lengths and strides, out and lse included) and touches only rows inside them;
    // rows are 16-byte aligned (checked); arguments match both kernels' signature
    // (out, o_stride, lse, q, q_stride, src, seqs, n_heads, n_kv, causal, scale_log2, q_rows,
    // p_rows, kv_rows).
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION,
            &[("HEAD_DIM", hd)],
            name,
            cfg,
            &[
                &op_,
                &os,
                &lse_p,
                &qp,
                &qs,
                &src,
                &sp,
                &nh,
                &nkv,
                &causal,
                &scale_log2,
                &qr,
                &pr,
                &kr,
            ],
        )
    }?;
    Ok(())
}
