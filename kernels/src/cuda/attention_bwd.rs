//! `attention_bwd_bf16` (kernels in `cuda/attention_bwd.cu`): the CUDA twin of
//! [`crate::cpu::attention_bwd`], the backward of [`super::attention_fwd_bf16`] (varlen, causal
//! or full, GQA, a shared prefix per sequence), with the forward's argument conventions:
//! device descriptors ([`AttnSeqGpu`]), [`RowStrides`], the forward's `out` and natural-log `lse`
//! `[rows, heads]`.
//!
//! A straightforward version: probabilities are recomputed from the LSE, one warp per output
//! (row, head), in three launches: `dq` (query-centric), `dk`/`dv` (key-centric over own keys),
//! and the prefix keys' `dprefix_k`/`dprefix_v` (fp32, added: the G samples of a group gather
//! their gradients into the one prefix). Invariant: deterministic, every sum in a fixed order
//! (see the kernel file), no atomics.
//!
//! [`attention_bwd_bf16`] dispatches: the tensor-core FlashAttention-2 kernels of
//! [`super::attention_bwd_tc`] when [`super::attention_bwd_tc::bwd_kernel_for`] says so
//! (`ROLLPLEX_ATTN_BWD=tc`, head_dim 64 or 128), else the SIMT kernels here;
//! [`attention_bwd_bf16_with`] picks one explicitly.
//!
//! Gradient buffers use their input's stride: `dq` the q stride, `dk`/`dv` the kv stride,
//! `dprefix_*` the prefix stride, `dout` the out stride, so a fused dqkv buffer is written in
//! place through views. Rows of `dq`, `dk`, `dv` that belong to no valid sequence are written
//! with zeros; descriptors that do not fit the buffers are ignored (as the forward ignores them).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::attention::{rows_of, AttnSeqGpu, RowStrides};
use super::attention_bwd_tc::{all_aligned16, attention_bwd_tc_bf16, bwd_kernel_for, BwdKernel};
use super::launch::{need, ptr, ptr_mut, u32_of};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};
use crate::cpu::{AttnDims, AttnMask};

/// The kernel source of this module (compiled by NVRTC on first use, cached).
pub const ATTENTION_BWD: KernelModule = KernelModule {
    name: "attention_bwd",
    source: include_str!("../../cuda/attention_bwd.cu"),
};

/// Warps (one output row-head each) per block.
const WARPS: u32 = 4;

fn launch_cfg(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(WARPS as usize) as u32, 1, 1),
        block_dim: (32 * WARPS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Backward of [`super::attention_fwd_bf16`] (the same `seqs`, `dims`, `mask`, `scale`,
/// `strides`, plus its `out` and `lse`): writes `dq`, `dk`, `dv` (bf16) and adds the shared
/// prefix keys' gradients into `dprefix_k`, `dprefix_v` (fp32). Pass `k`, `v` (and any two fp32
/// buffers of at least one row) as the prefix when no sequence has one. `head_dim` <= 256.
/// Runs [`BwdKernel::Auto`]'s choice ([`bwd_kernel_for`]: the tensor cores with
/// `ROLLPLEX_ATTN_BWD=tc` where they take the case, else SIMT).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dq: &mut impl DevicePtrMut<bf16>,
    dk: &mut impl DevicePtrMut<bf16>,
    dv: &mut impl DevicePtrMut<bf16>,
    dprefix_k: &mut impl DevicePtrMut<f32>,
    dprefix_v: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<bf16>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    prefix_k: &impl DevicePtr<bf16>,
    prefix_v: &impl DevicePtr<bf16>,
    out: &impl DevicePtr<bf16>,
    lse: &impl DevicePtr<f32>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    n_seqs: usize,
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
    strides: RowStrides,
) -> Result<()> {
    attention_bwd_bf16_with(
        BwdKernel::Auto,
        gpu,
        stream,
        dq,
        dk,
        dv,
        dprefix_k,
        dprefix_v,
        dout,
        q,
        k,
        v,
        prefix_k,
        prefix_v,
        out,
        lse,
        seqs,
        n_seqs,
        dims,
        mask,
        scale,
        strides,
    )
}

/// [`attention_bwd_bf16`] on a chosen kernel (tests and the bench run them side by side).
/// [`BwdKernel::TensorCores`] refuses what [`super::attention_bwd_tc::tc_bwd_refusal`] names;
/// [`BwdKernel::Auto`] falls back to SIMT there and for bf16 buffers off 16-byte boundaries.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_bf16_with(
    kernel: BwdKernel,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dq: &mut impl DevicePtrMut<bf16>,
    dk: &mut impl DevicePtrMut<bf16>,
    dv: &mut impl DevicePtrMut<bf16>,
    dprefix_k: &mut impl DevicePtrMut<f32>,
    dprefix_v: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<bf16>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    prefix_k: &impl DevicePtr<bf16>,
    prefix_v: &impl DevicePtr<bf16>,
    out: &impl DevicePtr<bf16>,
    lse: &impl DevicePtr<f32>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    n_seqs: usize,
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
    strides: RowStrides,
) -> Result<()> {
    let tc = match kernel {
        BwdKernel::TensorCores => true,
        BwdKernel::Simt => false,
        BwdKernel::Auto => {
            bwd_kernel_for(&dims, strides, n_seqs) == BwdKernel::TensorCores
                && all_aligned16(&[
                    ptr_mut(dq, stream),
                    ptr_mut(dk, stream),
                    ptr_mut(dv, stream),
                    ptr(dout, stream),
                    ptr(q, stream),
                    ptr(k, stream),
                    ptr(v, stream),
                    ptr(prefix_k, stream),
                    ptr(prefix_v, stream),
                    ptr(out, stream),
                ])
        }
    };
    if tc {
        attention_bwd_tc_bf16(
            gpu, stream, dq, dk, dv, dprefix_k, dprefix_v, dout, q, k, v, prefix_k, prefix_v, out,
            lse, seqs, n_seqs, dims, mask, scale, strides,
        )
    } else {
        attention_bwd_simt_bf16(
            gpu, stream, dq, dk, dv, dprefix_k, dprefix_v, dout, q, k, v, prefix_k, prefix_v, out,
            lse, seqs, n_seqs, dims, mask, scale, strides,
        )
    }
}

/// [`attention_bwd_bf16`] on the SIMT kernels (every head_dim up to 256, any alignment).
#[allow(clippy::too_many_arguments)]
fn attention_bwd_simt_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dq: &mut impl DevicePtrMut<bf16>,
    dk: &mut impl DevicePtrMut<bf16>,
    dv: &mut impl DevicePtrMut<bf16>,
    dprefix_k: &mut impl DevicePtrMut<f32>,
    dprefix_v: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<bf16>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    prefix_k: &impl DevicePtr<bf16>,
    prefix_v: &impl DevicePtr<bf16>,
    out: &impl DevicePtr<bf16>,
    lse: &impl DevicePtr<f32>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    n_seqs: usize,
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
    strides: RowStrides,
) -> Result<()> {
    const OP: &str = "attention_bwd_bf16";
    let (nh, nkv, hd) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) {
        return Err(shape(
            OP,
            format!("{nh} heads is not a multiple of {nkv} kv heads"),
        ));
    }
    if hd == 0 || hd > 256 {
        return Err(shape(OP, format!("head_dim {hd} must be in 1..=256")));
    }
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    for (name, s, w) in [
        ("q", strides.q, qw),
        ("out", strides.out, qw),
        ("kv", strides.kv, kvw),
        ("prefix", strides.prefix, kvw),
    ] {
        if s < w {
            return Err(shape(
                OP,
                format!("{name} row stride {s} is smaller than the row width {w}"),
            ));
        }
    }
    need(OP, "seqs", seqs, n_seqs)?;
    // Rows each buffer holds; a kernel only touches rows below these counts.
    let q_rows = [
        rows_of(q.len(), qw, strides.q),
        rows_of(dq.len(), qw, strides.q),
        rows_of(out.len(), qw, strides.out),
        rows_of(dout.len(), qw, strides.out),
    ]
    .into_iter()
    .min()
    .unwrap_or(0);
    let kv_rows = [
        rows_of(k.len(), kvw, strides.kv),
        rows_of(v.len(), kvw, strides.kv),
        rows_of(dk.len(), kvw, strides.kv),
        rows_of(dv.len(), kvw, strides.kv),
    ]
    .into_iter()
    .min()
    .unwrap_or(0);
    let p_rows = [
        rows_of(prefix_k.len(), kvw, strides.prefix),
        rows_of(prefix_v.len(), kvw, strides.prefix),
        rows_of(dprefix_k.len(), kvw, strides.prefix),
        rows_of(dprefix_v.len(), kvw, strides.prefix),
    ]
    .into_iter()
    .min()
    .unwrap_or(0);
    need(OP, "lse", lse, q_rows * nh)?;
    let (nq32, nkv32, np32) = (
        u32_of(OP, "q rows", q_rows)?,
        u32_of(OP, "kv rows", kv_rows)?,
        u32_of(OP, "prefix rows", p_rows)?,
    );
    let (h32, kvh32, hd32) = (
        u32_of(OP, "heads", nh)?,
        u32_of(OP, "kv heads", nkv)?,
        hd as u32,
    );
    let ns32 = u32_of(OP, "n_seqs", n_seqs)?;
    let (qs, kvs, ps, os) = (
        u32_of(OP, "q stride", strides.q)?,
        u32_of(OP, "kv stride", strides.kv)?,
        u32_of(OP, "prefix stride", strides.prefix)?,
        u32_of(OP, "out stride", strides.out)?,
    );
    let causal = matches!(mask, AttnMask::Causal) as u32;
    let (dqp, dkp, dvp, dpkp, dpvp) = (
        ptr_mut(dq, stream),
        ptr_mut(dk, stream),
        ptr_mut(dv, stream),
        ptr_mut(dprefix_k, stream),
        ptr_mut(dprefix_v, stream),
    );
    let (dop, qp, kp, vp, pkp, pvp, op_, lp, sp) = (
        ptr(dout, stream),
        ptr(q, stream),
        ptr(k, stream),
        ptr(v, stream),
        ptr(prefix_k, stream),
        ptr(prefix_v, stream),
        ptr(out, stream),
        ptr(lse, stream),
        ptr(seqs, stream),
    );
    if q_rows > 0 {
        let f = gpu.function(&ATTENTION_BWD, &[], "attention_bwd_dq_bf16")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&dqp)
            .arg(&dop)
            .arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&pkp)
            .arg(&pvp)
            .arg(&op_)
            .arg(&lp)
            .arg(&sp)
            .arg(&ns32)
            .arg(&nq32)
            .arg(&nkv32)
            .arg(&np32)
            .arg(&h32)
            .arg(&kvh32)
            .arg(&hd32)
            .arg(&qs)
            .arg(&kvs)
            .arg(&ps)
            .arg(&os)
            .arg(&causal)
            .arg(&scale);
        // SAFETY: the kernel touches rows below q_rows / kv_rows / p_rows only (descriptors
        // outside them are ignored), each of which every buffer of its kind holds (counted
        // above), lse holds q_rows*heads, seqs n_seqs; one warp writes each (row, head) of dq;
        // arguments match the kernel's signature in order.
        unsafe { b.launch(launch_cfg(q_rows * nh)) }?;
    }
    if kv_rows > 0 {
        let f = gpu.function(&ATTENTION_BWD, &[], "attention_bwd_dkv_bf16")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&dkp)
            .arg(&dvp)
            .arg(&dop)
            .arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&op_)
            .arg(&lp)
            .arg(&sp)
            .arg(&ns32)
            .arg(&nq32)
            .arg(&nkv32)
            .arg(&np32)
            .arg(&h32)
            .arg(&kvh32)
            .arg(&hd32)
            .arg(&qs)
            .arg(&kvs)
            .arg(&os)
            .arg(&causal)
            .arg(&scale);
        // SAFETY: as above; one warp writes each (key row, kv head) of dk and dv.
        unsafe { b.launch(launch_cfg(kv_rows * nkv)) }?;
    }
    if p_rows > 0 && n_seqs > 0 {
        let f = gpu.function(&ATTENTION_BWD, &[], "attention_bwd_dprefix_f32")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&dpkp)
            .arg(&dpvp)
            .arg(&dop)
            .arg(&qp)
            .arg(&pkp)
            .arg(&pvp)
            .arg(&op_)
            .arg(&lp)
            .arg(&sp)
            .arg(&ns32)
            .arg(&nq32)
            .arg(&nkv32)
            .arg(&np32)
            .arg(&h32)
            .arg(&kvh32)
            .arg(&hd32)
            .arg(&qs)
            .arg(&ps)
            .arg(&os)
            .arg(&scale);
        // SAFETY: as above; one warp adds into each (prefix row, kv head) of dprefix_k/v.
        unsafe { b.launch(launch_cfg(p_rows * nkv)) }?;
    }
    Ok(())
}
