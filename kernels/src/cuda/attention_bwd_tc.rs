//! `attention_bwd_tc_bf16` (kernels in `cuda/attention_bwd_tc.cu`): the backward of
//! [`super::attention_fwd_bf16`] on the tensor cores, FlashAttention-2 style, with the arguments,
//! results and conventions of the SIMT [`super::attention_bwd::attention_bwd_bf16`] (the twin of
//! [`crate::cpu::attention_bwd`]) up to the bf16 rounding of P and dS before their MMAs.
//!
//! Launches, in order: `attention_bwd_tc_prep` (D = rowsum(dout * out) in fp32 into a scratch
//! buffer allocated here on the stream, zeros for dq rows no sequence owns),
//! `attention_bwd_tc_zero_kv` (zeros for dk/dv rows no sequence owns), `attention_bwd_tc_dq_bf16`
//! (query-centric: a block owns 64 queries of one (sequence, head), loops over the key tiles,
//! prefix keys included), `attention_bwd_tc_dkv_bf16` (key-centric: a block owns 64 own keys of
//! one (sequence, kv head) and a slice of the group's query heads ([`tc_bwd_head_split_for`]), loops
//! over those heads then the query tiles, ascending), `attention_bwd_tc_dkv_reduce` (sums the
//! slices in order, when there are several), and, when prefix rows exist, the shared prefix
//! keys' gradients: `attention_bwd_tc_dprefix_f32` (+ `attention_bwd_tc_dprefix_reduce`), see
//! [`super::attention_bwd_dprefix`].
//!
//! Invariant: deterministic, no atomics; every sum runs in an order fixed by the shapes alone.
//! Supported: head_dim in [`TC_BWD_HEAD_DIMS`], row strides multiples of 8, every bf16 buffer
//! 16-byte aligned, at most 65535 sequences and heads ([`tc_bwd_refusal`]); anything else is
//! refused with [`super::CudaError::Shape`] and [`BwdKernel::Auto`] takes the SIMT kernel.
//!
//! Kernel choice: the caller's [`BwdKernel`]; [`BwdKernel::Auto`] takes the tensor cores wherever
//! [`tc_bwd_refusal`] accepts the case ([`bwd_kernel_for`]).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::attention::RowStrides;
use super::attention_bwd::{bwd_args, BwdArgs, BwdExtent, BwdGrads, BwdInputs};
use super::attention_bwd_dprefix::{launch_dprefix_tc, tc_dprefix_split, DprefixArgs};
use super::launch::{aligned16, launch, ptr_mut, Grid};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};
use crate::cpu::AttnDims;

/// The kernel source of this module (compiled by NVRTC per head_dim on first use, cached).
pub const ATTENTION_BWD_TC: KernelModule = KernelModule {
    name: "attention_bwd_tc",
    source: include_str!("../../cuda/attention_bwd_tc.cu"),
};

/// Which kernel [`super::attention_bwd::attention_bwd_bf16_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdKernel {
    /// [`bwd_kernel_for`]'s choice (what [`super::attention_bwd_bf16`] runs).
    Auto,
    /// One warp per (row, head), fp32 FMAs: head_dim up to 256.
    Simt,
    /// [`attention_bwd_tc_bf16`]: the cases [`tc_bwd_refusal`] accepts.
    TensorCores,
}

/// The head dims the tensor-core backward is compiled and tested for.
pub const TC_BWD_HEAD_DIMS: [usize; 2] = [64, 128];

/// How many slices the key-centric kernel cuts a GQA group's query heads into (4, 2 or 1: the
/// largest that divides heads / kv heads): more, smaller blocks balance the causal mask's
/// unequal key tiles over the SMs; the slices' fp32 partial dk/dv (a scratch of
/// 2 * split * kv_rows * kv_width floats) are summed in slice order by a last kernel.
pub fn tc_bwd_head_split(dims: &AttnDims) -> usize {
    let rep = dims.heads_per_kv();
    [4, 2, 1]
        .into_iter()
        .find(|d| rep.is_multiple_of(*d))
        .unwrap_or(1)
}

/// The head split of a key-centric launch over `kv_rows` key rows on `sm_count` SMs:
/// [`tc_bwd_head_split`], or 8 slices (one or more query heads each) where that leaves fewer
/// than two blocks an SM (a single causal sequence, such as one GRPO group's prompt: there the
/// first key tile's block, which every query tile sees, sets the kernel's time, and 8 slices
/// halve it against 4). The split fixes the dk/dv summation order, so it depends on the shapes
/// and the device's SM count only.
pub fn tc_bwd_head_split_for(dims: &AttnDims, kv_rows: usize, sm_count: usize) -> usize {
    let base = tc_bwd_head_split(dims);
    let rep = dims.heads_per_kv();
    let blocks = kv_rows.div_ceil(TILE_ROWS) * dims.num_kv_heads * base;
    if blocks < 2 * sm_count && rep.is_multiple_of(8) {
        8
    } else {
        base
    }
}

/// Rows (queries or keys) per tile; 4 warps of 16.
pub(crate) const TILE_ROWS: usize = 64;
/// Threads per block of every kernel here.
pub(crate) const THREADS: u32 = 128;

/// Why the tensor-core backward cannot take this case (`None`: it can). Buffer alignment is
/// checked at launch.
pub fn tc_bwd_refusal(dims: &AttnDims, strides: RowStrides, n_seqs: usize) -> Option<String> {
    let (nh, nkv, hd) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    if !TC_BWD_HEAD_DIMS.contains(&hd) {
        return Some(format!(
            "the tensor-core attention backward takes head_dim {TC_BWD_HEAD_DIMS:?}, not {hd}"
        ));
    }
    if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) {
        return Some(format!("{nh} heads is not a multiple of {nkv} kv heads"));
    }
    if nh > 65535 || n_seqs > 65535 {
        return Some(format!(
            "{nh} heads and {n_seqs} sequences must each be at most 65535 (grid limits)"
        ));
    }
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    for (name, s, w) in [
        ("q", strides.q, qw),
        ("out", strides.out, qw),
        ("kv", strides.kv, kvw),
        ("prefix", strides.prefix, kvw),
    ] {
        if s < w || !s.is_multiple_of(8) {
            return Some(format!(
                "{name} row stride {s} must be >= {w} and a multiple of 8"
            ));
        }
    }
    None
}

/// The kernel [`BwdKernel::Auto`] runs: the tensor cores where [`tc_bwd_refusal`] accepts the
/// case (the default since its tests passed on the H200: docs/perf.md, "Kernels"), else SIMT.
pub fn bwd_kernel_for(dims: &AttnDims, strides: RowStrides, n_seqs: usize) -> BwdKernel {
    if tc_bwd_refusal(dims, strides, n_seqs).is_none() {
        BwdKernel::TensorCores
    } else {
        BwdKernel::Simt
    }
}

/// Whether every address is 16-byte aligned (the tensor-core kernels copy rows in 16 bytes).
pub(crate) fn all_aligned16(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0)
}

/// One warp per item, 4 warps per block.
pub(crate) fn warps_cfg(items: usize) -> Grid {
    let warps = (THREADS / 32) as usize;
    Grid {
        grid: (items.div_ceil(warps).max(1) as u32, 1, 1),
        block: (THREADS, 1, 1),
        smem: 0,
    }
}

/// `attention_bwd_tc_prep`: D = rowsum(dout * out) per (query row, head) into `dsum` (q_rows *
/// heads floats), and zeros for the `dq` rows no valid sequence owns (`dq` = 0: D only). Reads
/// dout, the descriptors, sizes and strides from `a` (checked by the caller).
pub(crate) fn launch_tc_prep(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    a: &DprefixArgs,
    dsum: u64,
    dq: u64,
    out: u64,
) -> Result<()> {
    if a.q_rows == 0 {
        return Ok(());
    }
    // SAFETY: one warp per (row < q_rows, head): dsum holds q_rows*heads, dout/out (and dq when
    // not null) hold q_rows rows of their stride (the caller's check); seqs holds n_seqs;
    // arguments match the kernel's signature in order.
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION_BWD_TC,
            &[("HEAD_DIM", a.head_dim)],
            "attention_bwd_tc_prep",
            warps_cfg(a.q_rows as usize * a.heads as usize),
            &[
                &dsum,
                &dq,
                &a.dout,
                &out,
                &a.seqs,
                &a.n_seqs,
                &a.q_rows,
                &a.kv_rows,
                &a.p_rows,
                &a.heads,
                &a.q_stride,
                &a.out_stride,
            ],
        )
    }?;
    Ok(())
}

/// [`super::attention_bwd_bf16`] on the tensor cores (same arguments and results): writes `dq`,
/// `dk`, `dv` (bf16) and adds the shared prefix keys' gradients into `dprefix_k`, `dprefix_v`
/// (fp32; on the tensor cores too, `attention_bwd_tc_dprefix_f32`). Cases [`tc_bwd_refusal`]
/// names, and bf16 buffers not on 16-byte boundaries, are refused with a shape error.
pub fn attention_bwd_tc_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    g: BwdGrads,
    x: BwdInputs,
) -> Result<()> {
    const OP: &str = "attention_bwd_tc_bf16";
    let BwdInputs {
        n_seqs,
        dims,
        scale,
        strides,
        ..
    } = x;
    if let Some(why) = tc_bwd_refusal(&dims, strides, n_seqs) {
        return Err(shape(OP, why));
    }
    let (nh, nkv, hd, kvw) = (
        dims.num_heads,
        dims.num_kv_heads,
        dims.head_dim,
        dims.kv_width(),
    );
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
    let (q_rows, kv_rows, p_rows) = (nq32 as usize, nkv32 as usize, np32 as usize);
    for (name, p) in [
        ("dq", dqp),
        ("dk", dkp),
        ("dv", dvp),
        ("dout", dop),
        ("q", qp),
        ("k", kp),
        ("v", vp),
        ("prefix_k", pkp),
        ("prefix_v", pvp),
        ("out", op_),
    ] {
        aligned16(OP, name, p)?;
    }
    let defs = [("HEAD_DIM", hd32)];
    // D = rowsum(dout * out) per (row, head), fp32; lives until the kernels reading it finish
    // (freed in stream order when dropped at the end of this function).
    let mut dsum = gpu.alloc::<f32>(stream, q_rows * nh)?;
    let dsp = ptr_mut(&mut dsum, stream);
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
    launch_tc_prep(gpu, stream, &pre, dsp, dqp, op_)?;
    if kv_rows > 0 {
        // SAFETY: one warp per (key row < kv_rows, kv head), writing only inside dk/dv rows.
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD_TC,
                &defs,
                "attention_bwd_tc_zero_kv",
                warps_cfg(kv_rows * nkv),
                &[&dkp, &dvp, &sp, &ns32, &nq32, &nkv32, &np32, &kvh32, &kvs],
            )
        }?;
    }
    let tile_bytes = TILE_ROWS * (hd + 8) * 2;
    if q_rows > 0 && n_seqs > 0 {
        // 2 stages of a K and a V tile
        let smem = (4 * tile_bytes) as u32;
        let cfg = Grid {
            grid: (q_rows.div_ceil(TILE_ROWS).clamp(1, 65535) as u32, h32, ns32),
            block: (THREADS, 1, 1),
            smem,
        };
        // SAFETY: the kernel checks each descriptor against q_rows / kv_rows / p_rows (counted
        // from every buffer of each kind) and touches only rows inside them; bf16 buffers are
        // 16-byte aligned and strides multiples of 8 (checked), as cp.async needs; lse and dsum
        // hold q_rows*heads; the block (z, h) writes only the dq rows its sequence owns; the
        // arguments match the kernel's signature in order.
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD_TC,
                &defs,
                "attention_bwd_tc_dq_bf16",
                cfg,
                &[
                    &dqp, &dop, &qp, &kp, &vp, &pkp, &pvp, &lp, &dsp, &sp, &ns32, &nq32, &nkv32,
                    &np32, &h32, &kvh32, &qs, &kvs, &ps, &os, &causal, &scale,
                ],
            )
        }?;
    }
    let hsplit = tc_bwd_head_split_for(&dims, kv_rows, gpu.sm_count() as usize);
    let hs32 = hsplit as u32;
    // fp32 partial dk (hsplit slices) then dv (hsplit slices), each [kv_rows][kv heads][head_dim]
    let mut part = if hsplit > 1 && kv_rows > 0 && n_seqs > 0 {
        Some(gpu.alloc::<f32>(stream, 2 * hsplit * kv_rows * kvw)?)
    } else {
        None
    };
    let partp = part.as_mut().map(|p| ptr_mut(p, stream)).unwrap_or(0);
    if kv_rows > 0 && n_seqs > 0 {
        // K and V of the block's keys, then 2 stages of (q, dout, lse, D)
        let smem = (2 * tile_bytes + 2 * (2 * tile_bytes + 2 * TILE_ROWS * 4)) as u32;
        let cfg = Grid {
            grid: (
                kv_rows.div_ceil(TILE_ROWS).clamp(1, 65535) as u32,
                kvh32 * hs32,
                ns32,
            ),
            block: (THREADS, 1, 1),
            smem,
        };
        // SAFETY: as above; the block (z, y) writes only the dk/dv rows its sequence owns
        // (hsplit == 1), or their slice y % hsplit of `part`, which holds 2 * hsplit * kv_rows *
        // kv_width floats (allocated above whenever hsplit > 1).
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD_TC,
                &defs,
                "attention_bwd_tc_dkv_bf16",
                cfg,
                &[
                    &dkp, &dvp, &dop, &qp, &kp, &vp, &lp, &dsp, &sp, &ns32, &nq32, &nkv32, &np32,
                    &h32, &kvh32, &qs, &kvs, &os, &causal, &scale, &hs32, &partp,
                ],
            )
        }?;
        if hsplit > 1 {
            // SAFETY: one warp per (key row < kv_rows, kv head) reads its hsplit slices of
            // `part` (written above for every row a valid sequence owns) and writes that row.
            unsafe {
                launch(
                    gpu,
                    stream,
                    &ATTENTION_BWD_TC,
                    &defs,
                    "attention_bwd_tc_dkv_reduce",
                    warps_cfg(kv_rows * nkv),
                    &[
                        &dkp, &dvp, &partp, &sp, &ns32, &nq32, &nkv32, &np32, &kvh32, &kvs, &hs32,
                        &scale,
                    ],
                )
            }?;
        }
    }
    // the shared prefix keys (the launcher returns at once without prefix rows or sequences)
    let split = tc_dprefix_split(&dims, q_rows, p_rows);
    launch_dprefix_tc(gpu, stream, &pre, dsp, split)?;
    drop((dsum, part));
    Ok(())
}
