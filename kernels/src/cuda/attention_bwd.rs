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
//! [`super::attention_bwd_tc`] where [`super::attention_bwd_tc::bwd_kernel_for`] says they take
//! the case (head_dim 64 or 128), else the SIMT kernels here; [`attention_bwd_bf16_with`] takes
//! the caller's choice ([`BwdKernel`]).
//!
//! Gradient buffers use their input's stride: `dq` the q stride, `dk`/`dv` the kv stride,
//! `dprefix_*` the prefix stride, `dout` the out stride, so a fused dqkv buffer is written in
//! place through views. Rows of `dq`, `dk`, `dv` that belong to no valid sequence are written
//! with zeros; descriptors that do not fit the buffers are ignored (as the forward ignores them).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::attention::{rows_of, AttnSeqGpu, RowStrides};
use super::attention_bwd_dprefix::{launch_dprefix_simt, DprefixArgs};
use super::attention_bwd_tc::{all_aligned16, attention_bwd_tc_bf16, bwd_kernel_for, BwdKernel};
use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};
use crate::cpu::{AttnDims, AttnMask};

/// The kernel source of this module (compiled by NVRTC on first use, cached).
pub const ATTENTION_BWD: KernelModule = KernelModule {
    name: "attention_bwd",
    source: include_str!("../../cuda/attention_bwd.cu"),
};

/// The extent both backward launchers (SIMT and tensor cores) pass their kernels, as u32: per
/// group of buffers that share a row stride (the query side: `q`, `dq`, `out`, `dout`; the
/// keys: `k`, `v`, `dk`, `dv`; the prefix: `prefix_k/v`, `dprefix_k/v`) the fewest rows any of
/// them holds (kernels touch only rows below these), and the strides.
pub(crate) struct BwdExtent {
    pub q_rows: u32,
    pub kv_rows: u32,
    pub prefix_rows: u32,
    pub q_stride: u32,
    pub kv_stride: u32,
    pub prefix_stride: u32,
    pub out_stride: u32,
}

/// [`BwdExtent`] from the buffers' lengths (in elements; each group in the order the struct's
/// doc names them); checks that `lse` (`lse_len` elements) covers every query row's heads.
/// Pure: tested without a GPU.
pub(crate) fn bwd_extent(
    op: &'static str,
    dims: &AttnDims,
    strides: RowStrides,
    q_lens: [usize; 4],
    kv_lens: [usize; 4],
    prefix_lens: [usize; 4],
    lse_len: usize,
) -> Result<BwdExtent> {
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let fewest = |lens: [usize; 4], strides: [usize; 4], width: usize| {
        lens.iter()
            .zip(strides)
            .map(|(&len, stride)| rows_of(len, width, stride))
            .min()
            .unwrap_or(0)
    };
    let q_rows = fewest(q_lens, [strides.q, strides.q, strides.out, strides.out], qw);
    let kv_rows = fewest(kv_lens, [strides.kv; 4], kvw);
    let prefix_rows = fewest(prefix_lens, [strides.prefix; 4], kvw);
    let want = q_rows * dims.num_heads;
    if lse_len < want {
        return Err(shape(
            op,
            format!("lse holds {lse_len} elements, needs at least {want}"),
        ));
    }
    Ok(BwdExtent {
        q_rows: u32_of(op, "q rows", q_rows)?,
        kv_rows: u32_of(op, "kv rows", kv_rows)?,
        prefix_rows: u32_of(op, "prefix rows", prefix_rows)?,
        q_stride: u32_of(op, "q stride", strides.q)?,
        kv_stride: u32_of(op, "kv stride", strides.kv)?,
        prefix_stride: u32_of(op, "prefix stride", strides.prefix)?,
        out_stride: u32_of(op, "out stride", strides.out)?,
    })
}

/// What both backward launchers hand their kernels, gathered once from their arguments: the
/// extent ([`bwd_extent`]), the widths as u32, the mask as the kernels' flag, and every
/// buffer's device address on the launch stream.
pub(crate) struct BwdArgs {
    pub ext: BwdExtent,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub n_seqs: u32,
    /// 1 for a causal mask.
    pub causal: u32,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dprefix_k: u64,
    pub dprefix_v: u64,
    pub dout: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub prefix_k: u64,
    pub prefix_v: u64,
    pub out: u64,
    pub lse: u64,
    pub seqs: u64,
}

/// [`BwdArgs`] of a backward's grads `g` and inputs `x` (their shapes checked by the caller
/// first): `seqs` must hold `n_seqs` descriptors and every buffer its extent.
pub(crate) fn bwd_args(
    op: &'static str,
    stream: &CudaStream,
    g: BwdGrads,
    x: &BwdInputs,
) -> Result<BwdArgs> {
    need(op, "seqs", x.seqs, x.n_seqs)?;
    let ext = bwd_extent(
        op,
        &x.dims,
        x.strides,
        [x.q.len(), g.dq.len(), x.out.len(), x.dout.len()],
        [x.k.len(), x.v.len(), g.dk.len(), g.dv.len()],
        [
            x.prefix_k.len(),
            x.prefix_v.len(),
            g.dprefix_k.len(),
            g.dprefix_v.len(),
        ],
        x.lse.len(),
    )?;
    Ok(BwdArgs {
        ext,
        heads: u32_of(op, "heads", x.dims.num_heads)?,
        kv_heads: u32_of(op, "kv heads", x.dims.num_kv_heads)?,
        head_dim: u32_of(op, "head_dim", x.dims.head_dim)?,
        n_seqs: u32_of(op, "n_seqs", x.n_seqs)?,
        causal: matches!(x.mask, AttnMask::Causal) as u32,
        dq: ptr_mut(g.dq, stream),
        dk: ptr_mut(g.dk, stream),
        dv: ptr_mut(g.dv, stream),
        dprefix_k: ptr_mut(g.dprefix_k, stream),
        dprefix_v: ptr_mut(g.dprefix_v, stream),
        dout: ptr(x.dout, stream),
        q: ptr(x.q, stream),
        k: ptr(x.k, stream),
        v: ptr(x.v, stream),
        prefix_k: ptr(x.prefix_k, stream),
        prefix_v: ptr(x.prefix_v, stream),
        out: ptr(x.out, stream),
        lse: ptr(x.lse, stream),
        seqs: ptr(x.seqs, stream),
    })
}

/// Warps (one output row-head each) per block.
const WARPS: u32 = 4;

fn launch_cfg(items: usize) -> Grid {
    Grid {
        grid: (items.div_ceil(WARPS as usize) as u32, 1, 1),
        block: (32 * WARPS, 1, 1),
        smem: 0,
    }
}

/// What an attention backward writes: `dq` `[T, heads*hd]` (the q stride), `dk`, `dv`
/// `[T, kv_heads*hd]` (the kv stride), bf16, overwritten; `dprefix_k`, `dprefix_v`
/// `[P, kv_heads*hd]` (the prefix stride), fp32, added into (the G samples of a group gather
/// their gradients into the one prefix). Give any two fp32 buffers of at least one row as the
/// prefix gradients when no sequence has a prefix.
pub struct BwdGrads<'a> {
    pub dq: &'a mut dyn DevicePtrMut<bf16>,
    pub dk: &'a mut dyn DevicePtrMut<bf16>,
    pub dv: &'a mut dyn DevicePtrMut<bf16>,
    pub dprefix_k: &'a mut dyn DevicePtrMut<f32>,
    pub dprefix_v: &'a mut dyn DevicePtrMut<f32>,
}

/// What an attention backward reads: the forward's inputs ([`super::attention::FwdInputs`]
/// without its `max_q_len` hint: `q`, `k`, `v`, `prefix_k`, `prefix_v` (`k`, `v` again when no
/// sequence has a prefix), `n_seqs` descriptors `seqs`, `dims`, `mask`, `scale`, `strides`), the
/// forward's `out` and natural-log `lse` `[T, heads]`, and `dout` (the out stride).
#[derive(Clone, Copy)]
pub struct BwdInputs<'a> {
    pub dout: &'a dyn DevicePtr<bf16>,
    pub q: &'a dyn DevicePtr<bf16>,
    pub k: &'a dyn DevicePtr<bf16>,
    pub v: &'a dyn DevicePtr<bf16>,
    pub prefix_k: &'a dyn DevicePtr<bf16>,
    pub prefix_v: &'a dyn DevicePtr<bf16>,
    pub out: &'a dyn DevicePtr<bf16>,
    pub lse: &'a dyn DevicePtr<f32>,
    pub seqs: &'a dyn DevicePtr<AttnSeqGpu>,
    pub n_seqs: usize,
    pub dims: AttnDims,
    pub mask: AttnMask,
    pub scale: f32,
    pub strides: RowStrides,
}

/// Backward of [`super::attention_fwd_bf16`]: writes the gradients `g` from the inputs `x`
/// ([`BwdGrads`], [`BwdInputs`]). `head_dim` <= 256. Runs [`BwdKernel::Auto`]'s choice
/// ([`bwd_kernel_for`]: the tensor cores where they take the case, else SIMT);
/// [`attention_bwd_bf16_with`] takes another.
pub fn attention_bwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: BwdGrads,
    x: BwdInputs,
) -> Result<()> {
    attention_bwd_bf16_with(BwdKernel::Auto, gpu, stream, g, x)
}

/// [`attention_bwd_bf16`] on a chosen kernel (tests and the bench run them side by side).
/// [`BwdKernel::TensorCores`] refuses what [`super::attention_bwd_tc::tc_bwd_refusal`] names;
/// [`BwdKernel::Auto`] falls back to SIMT there and for bf16 buffers off 16-byte boundaries.
pub fn attention_bwd_bf16_with(
    kernel: BwdKernel,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: BwdGrads,
    x: BwdInputs,
) -> Result<()> {
    let tc = match kernel {
        BwdKernel::TensorCores => true,
        BwdKernel::Simt => false,
        BwdKernel::Auto => {
            bwd_kernel_for(&x.dims, x.strides, x.n_seqs) == BwdKernel::TensorCores
                && all_aligned16(&[
                    ptr_mut(&mut *g.dq, stream),
                    ptr_mut(&mut *g.dk, stream),
                    ptr_mut(&mut *g.dv, stream),
                    ptr(x.dout, stream),
                    ptr(x.q, stream),
                    ptr(x.k, stream),
                    ptr(x.v, stream),
                    ptr(x.prefix_k, stream),
                    ptr(x.prefix_v, stream),
                    ptr(x.out, stream),
                ])
        }
    };
    if tc {
        attention_bwd_tc_bf16(gpu, stream, g, x)
    } else {
        attention_bwd_simt_bf16(gpu, stream, g, x)
    }
}

/// [`attention_bwd_bf16`] on the SIMT kernels (every head_dim up to 256, any alignment).
fn attention_bwd_simt_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: BwdGrads,
    x: BwdInputs,
) -> Result<()> {
    const OP: &str = "attention_bwd_bf16";
    let BwdInputs {
        dims,
        scale,
        strides,
        ..
    } = x;
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
    let BwdArgs {
        ext:
            BwdExtent {
                q_rows: nq32,
                kv_rows: nkv32,
                prefix_rows: np32,
                q_stride: qs,
                kv_stride: kvs,
                prefix_stride: ps,
                out_stride: os,
            },
        heads: h32,
        kv_heads: kvh32,
        head_dim: hd32,
        n_seqs: ns32,
        causal,
        dq: dqp,
        dk: dkp,
        dv: dvp,
        dprefix_k: dpkp,
        dprefix_v: dpvp,
        dout: dop,
        q: qp,
        k: kp,
        v: vp,
        prefix_k: pkp,
        prefix_v: pvp,
        out: op_,
        lse: lp,
        seqs: sp,
    } = bwd_args(OP, stream, g, &x)?;
    let (q_rows, kv_rows) = (nq32 as usize, nkv32 as usize);
    if q_rows > 0 {
        // SAFETY: the kernel touches rows below q_rows / kv_rows / p_rows only (descriptors
        // outside them are ignored), each of which every buffer of its kind holds (counted
        // above), lse holds q_rows*heads, seqs n_seqs; one warp writes each (row, head) of dq;
        // arguments match the kernel's signature in order.
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD,
                &[],
                "attention_bwd_dq_bf16",
                launch_cfg(q_rows * nh),
                &[
                    &dqp, &dop, &qp, &kp, &vp, &pkp, &pvp, &op_, &lp, &sp, &ns32, &nq32, &nkv32,
                    &np32, &h32, &kvh32, &hd32, &qs, &kvs, &ps, &os, &causal, &scale,
                ],
            )
        }?;
    }
    if kv_rows > 0 {
        // SAFETY: as above; one warp writes each (key row, kv head) of dk and dv.
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD,
                &[],
                "attention_bwd_dkv_bf16",
                launch_cfg(kv_rows * nkv),
                &[
                    &dkp, &dvp, &dop, &qp, &kp, &vp, &op_, &lp, &sp, &ns32, &nq32, &nkv32, &np32,
                    &h32, &kvh32, &hd32, &qs, &kvs, &os, &causal, &scale,
                ],
            )
        }?;
    }
    let pre = DprefixArgs {
        dpk: dpkp,
        dpv: dpvp,
        dout: dop,
        q: qp,
        pk: pkp,
        pv: pvp,
        lse: lp,
        seqs: sp,
        n_seqs: ns32,
        q_rows: nq32,
        kv_rows: nkv32,
        p_rows: np32,
        heads: h32,
        kv_heads: kvh32,
        head_dim: hd32,
        q_stride: qs,
        p_stride: ps,
        out_stride: os,
        scale,
    };
    // one warp adds into each (prefix row, kv head) of dprefix_k/v
    launch_dprefix_simt(gpu, stream, &pre, op_)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_takes_the_fewest_rows_per_stride_group_and_checks_the_lse() {
        // 4 query heads of 16 (width 64, stride 80), 2 kv heads (width 32, stride 32)
        let dims = AttnDims {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
        };
        let strides = RowStrides {
            q: 80,
            kv: 32,
            prefix: 40,
            out: 64,
        };
        // q side: q 10 rows, dq 9 rows (+ a partial row), out 12, dout 11 -> 9
        let q = [9 * 80 + 64, 8 * 80 + 64 + 10, 12 * 64, 11 * 64];
        let kv = [7 * 32, 7 * 32, 6 * 32, 7 * 32];
        let prefix = [3 * 40 + 32, 3 * 40 + 32, 5 * 40, 4 * 40];
        let e = bwd_extent("t", &dims, strides, q, kv, prefix, 9 * 4).unwrap();
        assert_eq!((e.q_rows, e.kv_rows, e.prefix_rows), (9, 6, 4));
        assert_eq!(
            (e.q_stride, e.kv_stride, e.prefix_stride, e.out_stride),
            (80, 32, 40, 64)
        );
        let err = bwd_extent("t", &dims, strides, q, kv, prefix, 9 * 4 - 1)
            .err()
            .expect("a short lse is refused");
        assert!(
            err.to_string()
                .contains("lse holds 35 elements, needs at least 36"),
            "{err}"
        );
    }
}
