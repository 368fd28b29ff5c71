//! Attention launchers (kernels in `cuda/attention.cu`): `attention_fwd_bf16`, the twin of
//! [`crate::cpu::attention_fwd`] (varlen, causal or full, GQA, shared prefix; a tensor-core
//! flash-attention kernel for head_dim <= 128 and prompts of 16+ tokens, else the SIMT one,
//! [`fwd_kernel_for`]);
//! `attention_decode_bf16`, the twin of [`crate::cpu::attention_decode`] (one query per sequence
//! over a KV arena whose prefix rows are shared by a group's samples); and
//! `attention_decode_grouped_bf16`, the same twin reading each GRPO group's shared prefix once
//! for the whole group.
//!
//! Sequence descriptors live on the device ([`AttnSeqGpu`], one per sequence) so that a captured
//! CUDA graph can be replayed after the caller rewrites them in place. The kernels check every
//! descriptor against the buffers' row counts: a bad one reads and writes nothing (fwd) or gives
//! NaN (decode), never out of bounds. Host-side hints (`max_q_len`, [`DecodePlan`],
//! [`GroupedDecodePlan`]) only size the grid; every query and key is attended whatever they say.
//!
//! Decode runs split-K: [`decode_plan`] cuts each sequence into `splits` chunks of `chunk` keys
//! (a multiple of 64) by [`pipelined_split`]; [`grouped_decode_plan`] cuts the group pass and the
//! per-sample pass. Splits depend on (batch, group, heads, length hints) only, never on the
//! stream's SM partition, so a result is the same on any stream. A last kernel merges the chunks
//! in order. The partials need a workspace of `workspace_len()` floats of the plan.
//!
//! Decode kernels: the block-pipelined one (`attention_decode_grouped_bf16`: per-sample pass =
//! the default of `attention_decode_bf16`, group pass for shared prefixes), the warp-split one
//! (`attention_decode_bf16`, `DecodePlan::pipelined == false`) and the SIMT one
//! (`tensor_cores == false`), the last two kept for timing.

use std::sync::Arc;

use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::launch::{aligned16, need, ptr, ptr_mut, u32_of};
use super::nvrtc::ATTENTION;
use super::{shape, Gpu, Result};
use crate::cpu::{AttnDims, AttnMask, AttnSeq, DecodeSeq};

/// One sequence as the kernels read it: queries are rows `q_start..q_start + q_len` of `q`; keys
/// are prefix rows `p_start..p_start + p_len` then own rows `k_start..k_start + k_len`; the
/// queries are the last `q_len` own keys (causal: query `i` sees logical keys
/// `< p_len + k_len - q_len + i + 1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnSeqGpu {
    pub q_start: u32,
    pub q_len: u32,
    pub p_start: u32,
    pub p_len: u32,
    pub k_start: u32,
    pub k_len: u32,
}

// SAFETY: plain `repr(C)` struct of u32, the same layout as `struct AttnSeq` in common.cuh.
unsafe impl DeviceRepr for AttnSeqGpu {}

impl AttnSeqGpu {
    /// The descriptor of a [`crate::cpu::attention_fwd`] sequence (queries = own keys).
    pub fn from_fwd(s: &AttnSeq) -> Self {
        AttnSeqGpu {
            q_start: s.start,
            q_len: s.len,
            p_start: s.prefix_start,
            p_len: s.prefix_len,
            k_start: s.start,
            k_len: s.len,
        }
    }
    /// The descriptor of decode sequence `b` ([`crate::cpu::attention_decode`]; query row `b`).
    pub fn from_decode(b: u32, s: &DecodeSeq) -> Self {
        AttnSeqGpu {
            q_start: b,
            q_len: 1,
            p_start: s.prefix_offset,
            p_len: s.prefix_len,
            k_start: s.suffix_offset,
            k_len: s.suffix_len,
        }
    }
}

/// Where keys come from (`struct KvSrc` in attention.cu; same field order and padding).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct KvSrc {
    pk: u64,
    pv: u64,
    p_stride: u32,
    k: u64,
    v: u64,
    kv_stride: u32,
}
// SAFETY: repr(C) mirror of the device struct; passed by value.
unsafe impl DeviceRepr for KvSrc {}

/// Elements between consecutive rows of each buffer (a fused qkv output is read in place by
/// giving its row width as the q/kv stride and a view starting at the part).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowStrides {
    pub q: usize,
    pub kv: usize,
    pub prefix: usize,
    pub out: usize,
}

impl RowStrides {
    /// Contiguous rows, as the CPU twins take them.
    pub fn contiguous(d: AttnDims) -> Self {
        RowStrides {
            q: d.q_width(),
            kv: d.kv_width(),
            prefix: d.kv_width(),
            out: d.q_width(),
        }
    }
}

fn check_dims(op: &'static str, d: &AttnDims, decode: bool) -> Result<()> {
    if d.num_heads == 0 || d.num_kv_heads == 0 || !d.num_heads.is_multiple_of(d.num_kv_heads) {
        return Err(shape(
            op,
            format!(
                "{} heads is not a multiple of {} kv heads",
                d.num_heads, d.num_kv_heads
            ),
        ));
    }
    let m = if decode { 32 } else { 16 };
    if d.head_dim == 0 || !d.head_dim.is_multiple_of(m) || d.head_dim > 256 {
        return Err(shape(
            op,
            format!(
                "head_dim {} must be a multiple of {m} up to 256",
                d.head_dim
            ),
        ));
    }
    Ok(())
}

/// Rows of a buffer of `len` elements whose rows are `stride` apart and `width` wide.
pub(crate) fn rows_of(len: usize, width: usize, stride: usize) -> usize {
    if len < width {
        0
    } else {
        (len - width) / stride + 1
    }
}

/// The buffer checks every decode launcher makes (row strides; q, out, seqs and workspace
/// lengths; V as long as K) and what they give: the cache's row count and the LSE output's
/// address (0 when not asked for). `b` > 0.
#[allow(clippy::too_many_arguments)]
fn check_decode_io(
    op: &'static str,
    stream: &CudaStream,
    dims: &AttnDims,
    strides: &RowStrides,
    b: usize,
    workspace_len: usize,
    out: &impl DeviceSlice<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &impl DeviceSlice<f32>,
    q: &impl DeviceSlice<bf16>,
    k_cache: &impl DeviceSlice<bf16>,
    v_cache: &impl DeviceSlice<bf16>,
    seqs: &impl DeviceSlice<AttnSeqGpu>,
) -> Result<(u32, u64)> {
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    check_stride(op, "q", strides.q, qw)?;
    check_stride(op, "out", strides.out, qw)?;
    check_stride(op, "kv", strides.kv, kvw)?;
    need(op, "q", q, (b - 1) * strides.q + qw)?;
    need(op, "out", out, (b - 1) * strides.out + qw)?;
    need(op, "seqs", seqs, b)?;
    need(op, "workspace", workspace, workspace_len)?;
    if v_cache.len() < k_cache.len() {
        return Err(shape(op, "v_cache must hold as many elements as k_cache"));
    }
    let kv_rows = u32_of(op, "cache rows", rows_of(k_cache.len(), kvw, strides.kv))?;
    let lse_p = match lse {
        Some(l) => {
            need(op, "lse", l, b * dims.num_heads)?;
            ptr_mut(l, stream)
        }
        None => 0,
    };
    Ok((kv_rows, lse_p))
}

fn check_stride(op: &'static str, name: &str, stride: usize, width: usize) -> Result<()> {
    if stride < width || !stride.is_multiple_of(8) {
        return Err(shape(
            op,
            format!("{name} row stride {stride} must be >= {width} and a multiple of 8"),
        ));
    }
    Ok(())
}

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

/// Varlen attention over a packed batch, as [`crate::cpu::attention_fwd`]: `out`, `q`
/// `[T, heads*hd]`; `k`, `v` `[T, kv_heads*hd]`; `prefix_k`, `prefix_v` `[P, kv_heads*hd]` (pass
/// `k`, `v` again when no sequence has a prefix); `lse` `[T, heads]` if given; rows `strides`
/// apart. `seqs` holds `n_seqs` descriptors on the device; `max_q_len` (a hint) sizes the grid
/// and picks the kernel ([`fwd_kernel_for`]); every query is attended whatever it says.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    prefix_k: &impl DevicePtr<bf16>,
    prefix_v: &impl DevicePtr<bf16>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    n_seqs: usize,
    max_q_len: usize,
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
    strides: RowStrides,
) -> Result<()> {
    attention_fwd_bf16_with(
        FwdKernel::Auto,
        gpu,
        stream,
        out,
        lse,
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
    )
}

/// [`attention_fwd_bf16`] on a chosen kernel (tests and the bench run both side by side).
/// [`FwdKernel::TensorCores`] with a head_dim past [`TC_FWD_MAX_HEAD_DIM`] is refused.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_bf16_with(
    kernel: FwdKernel,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    prefix_k: &impl DevicePtr<bf16>,
    prefix_v: &impl DevicePtr<bf16>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    n_seqs: usize,
    max_q_len: usize,
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
    strides: RowStrides,
) -> Result<()> {
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
    let f = gpu.function(&ATTENTION, &[("HEAD_DIM", hd)], name)?;
    // the tensor-core kernel: 2 stages of a 64-key K and V tile, rows padded by 8 bf16
    let smem = if tc {
        (2 * 2 * 64 * (dims.head_dim + 8) * 2) as u32
    } else {
        0
    };
    if tc {
        // SAFETY: a valid function handle of this context; raises the dynamic shared-memory
        // limit to what this launch passes (68 KiB for head_dim 128).
        unsafe {
            cudarc::driver::sys::cuFuncSetAttribute(
                f.cu_function(),
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
        }
        .result()?;
    }
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
    let cfg = LaunchConfig {
        grid_dim: (gx, nh, gz),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&op_)
        .arg(&os)
        .arg(&lse_p)
        .arg(&qp)
        .arg(&qs)
        .arg(&src)
        .arg(&sp)
        .arg(&nh)
        .arg(&nkv)
        .arg(&causal);
    b.arg(&scale_log2).arg(&qr).arg(&pr).arg(&kr);
    // SAFETY: the kernel checks each descriptor against q_rows / p_rows / kv_rows (computed from
    // the buffers' lengths and strides, out and lse included) and touches only rows inside them;
    // rows are 16-byte aligned (checked); arguments match both kernels' signature
    // (out, o_stride, lse, q, q_stride, src, seqs, n_heads, n_kv, causal, scale_log2, q_rows,
    // p_rows, kv_rows).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// How a decode attention is split over the keys (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    pub batch: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub splits: usize,
    pub chunk: usize,
    /// Tensor cores (the default) or the SIMT kernel (`attention_decode_simt_bf16`, kept for
    /// side-by-side timing). Same results within bf16 rounding; each is deterministic.
    pub tensor_cores: bool,
    /// With `tensor_cores`: the block-pipelined kernel (`attention_decode_grouped_bf16` in its
    /// per-sample form, the default of [`decode_plan`]: one block per (sample, kv head, chunk),
    /// a block-wide 4-stage pipeline, 3 blocks per SM) or the warp-split one
    /// (`attention_decode_bf16`: each of 4 warps streams its own tiles; 1 block per SM; what
    /// [`decode_plan_for_blocks`] plans, kept for timing).
    pub pipelined: bool,
}

impl DecodePlan {
    /// f32 elements of scratch the decode needs (partial outputs, then (max, sum) pairs).
    pub fn workspace_len(&self) -> usize {
        self.batch * self.num_heads * self.splits * (self.head_dim + 2)
    }
}

/// Blocks [`decode_plan_for_blocks`]'s default and the group pass of [`grouped_decode_plan`]
/// aim at: 2 per SM of a 132-SM H200 (the warp-split kernel holds one 139 KiB block per SM; 264
/// blocks measured fastest of 264/528/1056/2112 for it, and for the group pass at batch 64;
/// docs/perf.md). A constant, so that the split (and the rounding) never depends on which
/// partition runs the kernel.
pub const DECODE_TARGET_BLOCKS: usize = 264;

/// The split of a decode over `batch` sequences of at most `max_kv_len` keys, for the
/// block-pipelined kernel: chunks of a multiple of 64 keys chosen by [`pipelined_split`].
pub fn decode_plan(batch: usize, dims: AttnDims, max_kv_len: usize) -> DecodePlan {
    let units = batch * dims.num_kv_heads;
    let r = dims.num_heads / dims.num_kv_heads.max(1);
    let (splits, chunk) = pipelined_split(units, max_kv_len, 64, r);
    DecodePlan {
        batch,
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        splits,
        chunk,
        tensor_cores: true,
        pipelined: r <= 64,
    }
}

/// Blocks of the block-pipelined decode kernel an H200 runs at once (3 per SM: 68 KiB of shared
/// memory and 144 registers a thread at head_dim 128).
pub const PIPELINED_SLOTS: usize = 396;

/// How the block-pipelined kernel cuts `len` keys for `units` independent (rows, kv head) units
/// of `rows` query rows each: `(splits, chunk)`, chunk a multiple of `mult`. A cost model fitted
/// to the H200 measurements (docs/perf.md, decode-perf): a block costs its chunk plus about 128
/// keys of fixed latency plus two passes over its partial outputs (`rows` keys' worth); blocks
/// run in waves of [`PIPELINED_SLOTS`]; the split with the least `waves * block cost` wins (the
/// fewest splits on a tie). It picks the fastest split measured at 3B / 7B dims, batch 64 and
/// 3B batch 8 (KV 2048); at 7B batch 8 it picks 11 x 192 keys, where 8 x 256 measured faster
/// in an earlier run (0.420 against 0.449 ms of attention per step). A function of its
/// arguments only.
pub fn pipelined_split(units: usize, len: usize, mult: usize, rows: usize) -> (usize, usize) {
    let (units, len, mult) = (units.max(1), len.max(1), mult.max(1));
    let mut best = (usize::MAX, 1, len.div_ceil(mult) * mult);
    for want in 1..=len.div_ceil(mult).min(64) {
        let chunk = len.div_ceil(want).div_ceil(mult) * mult;
        let splits = len.div_ceil(chunk);
        let waves = (units * splits).div_ceil(PIPELINED_SLOTS);
        let cost = waves * (chunk + 128 + 2 * rows);
        if cost < best.0 {
            best = (cost, splits, chunk);
        }
    }
    (best.1, best.2)
}

/// The warp-split kernel's plan aiming at `target_blocks` blocks (its default was
/// [`DECODE_TARGET_BLOCKS`]); for the workbench, which times it beside [`decode_plan`]'s.
pub fn decode_plan_for_blocks(
    batch: usize,
    dims: AttnDims,
    max_kv_len: usize,
    target_blocks: usize,
) -> DecodePlan {
    let rep = (dims.num_heads / dims.num_kv_heads.max(1)).max(1);
    let units = (batch * dims.num_kv_heads * rep.div_ceil(8)).max(1);
    let max_splits = max_kv_len.div_ceil(64).max(1);
    let splits = target_blocks.max(1).div_ceil(units).clamp(1, max_splits);
    let chunk = (max_kv_len.max(1).div_ceil(splits)).div_ceil(64) * 64;
    let splits = max_kv_len.max(1).div_ceil(chunk);
    DecodePlan {
        batch,
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        splits,
        chunk,
        tensor_cores: true,
        pipelined: false,
    }
}

/// Decode attention, as [`crate::cpu::attention_decode`]: `out`, `q` `[B, heads*hd]` (rows
/// `strides.out` / `strides.q` apart), `k_cache`, `v_cache` `[S, kv_heads*hd]` (rows `strides.kv`
/// apart; prefix and suffix rows in the same arena), `seqs` `[B]` on the device (see
/// [`AttnSeqGpu::from_decode`]), `lse` `[B, heads]` if given; `workspace` holds
/// `plan.workspace_len()` floats.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &mut impl DevicePtrMut<f32>,
    q: &impl DevicePtr<bf16>,
    k_cache: &impl DevicePtr<bf16>,
    v_cache: &impl DevicePtr<bf16>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    dims: AttnDims,
    scale: f32,
    strides: RowStrides,
    plan: DecodePlan,
) -> Result<()> {
    const OP: &str = "attention_decode_bf16";
    check_dims(OP, &dims, true)?;
    let b = plan.batch;
    if plan.num_heads != dims.num_heads
        || plan.head_dim != dims.head_dim
        || plan.splits == 0
        || plan.chunk == 0
    {
        return Err(shape(
            OP,
            format!("plan {plan:?} was made for other dims than {dims:?}"),
        ));
    }
    if b == 0 {
        return Ok(());
    }
    let (kv_rows, lse_p) = check_decode_io(
        OP,
        stream,
        &dims,
        &strides,
        b,
        plan.workspace_len(),
        &*out,
        lse,
        &*workspace,
        q,
        k_cache,
        v_cache,
        seqs,
    )?;
    let kp = ptr(k_cache, stream);
    let vp = ptr(v_cache, stream);
    let src = KvSrc {
        pk: kp,
        pv: vp,
        p_stride: strides.kv as u32,
        k: kp,
        v: vp,
        kv_stride: strides.kv as u32,
    };
    let (op_, qp, sp) = (ptr_mut(out, stream), ptr(q, stream), ptr(seqs, stream));
    for (name, p) in [("q", qp), ("k_cache", kp), ("v_cache", vp)] {
        aligned16(OP, name, p)?;
    }
    let wp = ptr_mut(workspace, stream);
    let part_o = wp;
    let part_ml = wp + (b * dims.num_heads * plan.splits * dims.head_dim * 4) as u64;
    let pass = SplitPass {
        part_o,
        part_ml,
        q: qp,
        q_stride: strides.q,
        src,
        seqs: sp,
        batch: b,
        kv_rows,
    };
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    if plan.tensor_cores && plan.pipelined && dims.num_heads / dims.num_kv_heads <= 64 {
        let g = GroupPass {
            pass: &pass,
            k: kp,
            v: vp,
            kv_stride: strides.kv,
            total: plan.splits,
            scale_log2,
        };
        let a = (1, 1, b, plan.chunk, plan.splits);
        group_pass(OP, gpu, stream, &dims, &g, a, (1, 0, 0))?;
    } else {
        let sp_args = (plan.chunk, plan.splits, 0, 0, plan.splits);
        split_pass(
            OP,
            gpu,
            stream,
            plan.tensor_cores,
            &dims,
            scale_log2,
            &pass,
            sp_args,
        )?;
    }
    reduce_pass(
        OP,
        gpu,
        stream,
        &dims,
        &pass,
        op_,
        strides.out,
        lse_p,
        plan.splits,
    )
}

/// Addresses and sizes the split pass and the merge share.
struct SplitPass {
    part_o: u64,
    part_ml: u64,
    q: u64,
    q_stride: usize,
    src: KvSrc,
    seqs: u64,
    batch: usize,
    kv_rows: u32,
}

/// The split-K pass (`attention_decode_bf16` or the SIMT twin). `args`: (chunk, splits,
/// skip_prefix, split_base, total_splits).
#[allow(clippy::too_many_arguments)]
fn split_pass(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    tensor_cores: bool,
    dims: &AttnDims,
    scale_log2: f32,
    p: &SplitPass,
    args: (usize, usize, u32, usize, usize),
) -> Result<()> {
    let (chunk, splits, skip_prefix, split_base, total_splits) = args;
    let hd = dims.head_dim as u32;
    let name = if tensor_cores {
        "attention_decode_bf16"
    } else {
        "attention_decode_simt_bf16"
    };
    let f1 = gpu.function(&ATTENTION, &[("HEAD_DIM", hd)], name)?;
    // The tensor-core kernel: 4 warps x 2 stages x (K + V) tiles of 32 keys, rows padded by 8.
    let smem = if tensor_cores {
        (4 * 2 * 2 * 32 * (dims.head_dim + 8) * 2) as u32
    } else {
        0
    };
    if smem > 0 {
        // SAFETY: a valid function handle of this context; the attribute only raises the
        // dynamic shared-memory limit to what this launch passes (139 KiB for head_dim 128,
        // within the 227 KiB a Hopper block may use).
        unsafe {
            cudarc::driver::sys::cuFuncSetAttribute(
                f1.cu_function(),
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
        }
        .result()?;
    }
    let (nh, nkv) = (dims.num_heads as u32, dims.num_kv_heads as u32);
    let (chunk, splits) = (u32_of(op, "chunk", chunk)?, u32_of(op, "splits", splits)?);
    let (base, total) = (
        u32_of(op, "split base", split_base)?,
        u32_of(op, "total splits", total_splits)?,
    );
    let qs = p.q_stride as u32;
    let hg = ((dims.num_heads / dims.num_kv_heads).div_ceil(8) * dims.num_kv_heads) as u32;
    let bz = u32_of(op, "batch", p.batch)?;
    let cfg1 = LaunchConfig {
        grid_dim: (splits, hg, bz),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut l1 = stream.launch_builder(&f1);
    l1.arg(&p.part_o)
        .arg(&p.part_ml)
        .arg(&p.q)
        .arg(&qs)
        .arg(&p.src)
        .arg(&p.seqs)
        .arg(&nh)
        .arg(&nkv);
    l1.arg(&chunk)
        .arg(&splits)
        .arg(&scale_log2)
        .arg(&p.kv_rows)
        .arg(&p.kv_rows)
        .arg(&skip_prefix)
        .arg(&base)
        .arg(&total);
    // SAFETY: q holds batch rows; the workspace holds batch*heads*total_splits*(hd+2) floats
    // and split_base + splits <= total_splits (callers), so the partial slots written are
    // inside it; the kernel checks each descriptor against kv_rows and reads only rows inside
    // the caches; arguments match (part_o, part_ml, q, q_stride, src, seqs, n_heads, n_kv,
    // chunk, splits, scale_log2, p_rows, kv_rows, skip_prefix, split_base, total_splits).
    unsafe { l1.launch(cfg1) }?;
    Ok(())
}

/// The ordered merge of `total_splits` partial slots per (sample, head).
#[allow(clippy::too_many_arguments)]
fn reduce_pass(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dims: &AttnDims,
    p: &SplitPass,
    out: u64,
    out_stride: usize,
    lse: u64,
    total_splits: usize,
) -> Result<()> {
    let hd = dims.head_dim as u32;
    let f2 = gpu.function(
        &ATTENTION,
        &[("HEAD_DIM", hd)],
        "attention_decode_reduce_bf16",
    )?;
    let nh = dims.num_heads as u32;
    let splits = u32_of(op, "total splits", total_splits)?;
    let bz = u32_of(op, "batch", p.batch)?;
    let os = out_stride as u32;
    let cfg2 = LaunchConfig {
        grid_dim: (nh, bz, 1),
        block_dim: (hd.min(128), 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l2 = stream.launch_builder(&f2);
    l2.arg(&out)
        .arg(&os)
        .arg(&lse)
        .arg(&p.part_o)
        .arg(&p.part_ml)
        .arg(&nh)
        .arg(&splits);
    // SAFETY: out holds batch rows of heads*hd (checked by callers), lse batch*heads (checked);
    // the partials were written by the passes before on the same stream; arguments match (out,
    // out_stride, lse, part_o, part_ml, n_heads, splits).
    unsafe { l2.launch(cfg2) }?;
    Ok(())
}

/// How a group-shared decode ([`attention_decode_grouped_bf16`]) is cut: samples
/// `i * group .. (i + 1) * group` form GRPO group `i` and share its first sample's prefix. The
/// group pass (skipped when `p_splits == 0`) gives a block `per_block` samples of one group (all
/// query heads of one kv head: at most 64 MMA rows) over `p_chunk` prefix keys; the per-sample
/// pass gives a block one sample's query heads of one kv head over `s_chunk` of its own keys
/// (all its keys when there is no group pass); an ordered merge of the `p_splits + s_splits`
/// slots ends it. A function of (batch, group, dims, length hints) only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedDecodePlan {
    pub batch: usize,
    pub group: usize,
    pub per_block: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub p_splits: usize,
    pub p_chunk: usize,
    pub s_splits: usize,
    pub s_chunk: usize,
}

impl GroupedDecodePlan {
    /// f32 elements of scratch (partial outputs, then (max, sum) pairs, for every slot).
    pub fn workspace_len(&self) -> usize {
        self.batch * self.num_heads * (self.p_splits + self.s_splits) * (self.head_dim + 2)
    }
}

/// The fewest (group part, kv head) units for which the group pass pays: with one group of 8
/// at 3B / 7B dims (2 or 4 units) the prefix must be cut into 32-key chunks to fill the GPU and
/// the partials (64 rows a block) cost more than the shared reads save: 0.68-0.71 ms against
/// 0.40-0.45 ms for the per-sample pass over 28-36 layers (docs/perf.md, decode-perf). At 16
/// and 32 units (8 groups of 8) the group pass won, 1.04-1.13 ms against 1.16-1.66 ms.
pub const GROUP_PASS_MIN_UNITS: usize = 16;

/// The grouped plan for `batch` samples in groups of `group` sharing a prefix of at most
/// `max_prefix_len` keys, each with at most `max_suffix_len` own keys. Hints only: the last
/// chunk of each pass takes every key left, so a short hint costs speed, never results. With a
/// prefix and at least [`GROUP_PASS_MIN_UNITS`] (group part, kv head) units, both passes aim at
/// [`DECODE_TARGET_BLOCKS`] blocks ([`grouped_decode_plan_for_blocks`]; measured faster than
/// [`pipelined_split`]'s cut at 3B and 7B dims, batch 64, groups of 8); otherwise there is no
/// group pass and every sample reads all its keys in the per-sample pass, cut by
/// [`pipelined_split`] (the fastest measured there).
pub fn grouped_decode_plan(
    batch: usize,
    group: usize,
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
) -> GroupedDecodePlan {
    let group = group.clamp(1, batch.max(1));
    let r = (dims.num_heads / dims.num_kv_heads.max(1)).max(1);
    let per_block = (64 / r).clamp(1, group);
    let units = batch.div_ceil(group) * group.div_ceil(per_block) * dims.num_kv_heads;
    if max_prefix_len > 0 && units >= GROUP_PASS_MIN_UNITS {
        return grouped_decode_plan_for_blocks(
            batch,
            group,
            dims,
            max_prefix_len,
            max_suffix_len,
            DECODE_TARGET_BLOCKS,
        );
    }
    let own = max_prefix_len + max_suffix_len;
    let (s_splits, s_chunk) = pipelined_split(batch * dims.num_kv_heads, own, 32, r);
    GroupedDecodePlan {
        batch,
        group,
        per_block,
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        p_splits: 0,
        p_chunk: 32,
        s_splits,
        s_chunk,
    }
}

/// A grouped plan aiming at `target_blocks` blocks per pass, always with a group pass when
/// `max_prefix_len > 0` (for the workbench, which times it beside [`grouped_decode_plan`]'s).
pub fn grouped_decode_plan_for_blocks(
    batch: usize,
    group: usize,
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
    target_blocks: usize,
) -> GroupedDecodePlan {
    let group = group.clamp(1, batch.max(1));
    let r = (dims.num_heads / dims.num_kv_heads.max(1)).max(1);
    let per_block = (64 / r).clamp(1, group);
    let split = |units: usize, len: usize| {
        let splits = target_blocks
            .max(1)
            .div_ceil(units.max(1))
            .clamp(1, len.div_ceil(32).max(1));
        let chunk = len.max(1).div_ceil(splits).div_ceil(32) * 32;
        (len.max(1).div_ceil(chunk), chunk)
    };
    let (p_splits, p_chunk) = if max_prefix_len == 0 {
        (0, 32)
    } else {
        let units = batch.div_ceil(group) * group.div_ceil(per_block) * dims.num_kv_heads;
        split(units, max_prefix_len)
    };
    let (s_splits, s_chunk) = split(batch * dims.num_kv_heads, max_suffix_len);
    GroupedDecodePlan {
        batch,
        group,
        per_block,
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        p_splits,
        p_chunk,
        s_splits,
        s_chunk,
    }
}

/// Decode attention with each GRPO group's shared prefix read once per group (the CPU twin is
/// still [`crate::cpu::attention_decode`]): the same buffers and descriptors as
/// [`attention_decode_bf16`], plus the grouping in `plan`. Samples of a group must name the
/// same prefix rows (`p_start`, `p_len`) as the group's first sample; one that does not gets
/// NaN outputs. Launches on `stream`: the group pass (when `plan.p_splits > 0`), the
/// per-sample pass, the merge.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_grouped_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &mut impl DevicePtrMut<f32>,
    q: &impl DevicePtr<bf16>,
    k_cache: &impl DevicePtr<bf16>,
    v_cache: &impl DevicePtr<bf16>,
    seqs: &impl DevicePtr<AttnSeqGpu>,
    dims: AttnDims,
    scale: f32,
    strides: RowStrides,
    plan: GroupedDecodePlan,
) -> Result<()> {
    const OP: &str = "attention_decode_grouped_bf16";
    check_dims(OP, &dims, true)?;
    let b = plan.batch;
    let r = dims.num_heads / dims.num_kv_heads;
    if plan.num_heads != dims.num_heads
        || plan.head_dim != dims.head_dim
        || plan.group == 0
        || plan.per_block == 0
        || plan.per_block * r > 64
        || plan.p_chunk == 0
        || plan.s_splits == 0
        || plan.s_chunk == 0
    {
        return Err(shape(
            OP,
            format!("plan {plan:?} does not fit dims {dims:?} (per_block * heads per kv head <= 64, nothing zero)"),
        ));
    }
    if b == 0 {
        return Ok(());
    }
    let (kv_rows, lse_p) = check_decode_io(
        OP,
        stream,
        &dims,
        &strides,
        b,
        plan.workspace_len(),
        &*out,
        lse,
        &*workspace,
        q,
        k_cache,
        v_cache,
        seqs,
    )?;
    let (kp, vp) = (ptr(k_cache, stream), ptr(v_cache, stream));
    let src = KvSrc {
        pk: kp,
        pv: vp,
        p_stride: strides.kv as u32,
        k: kp,
        v: vp,
        kv_stride: strides.kv as u32,
    };
    let (op_, qp, sp) = (ptr_mut(out, stream), ptr(q, stream), ptr(seqs, stream));
    for (name, p) in [("q", qp), ("k_cache", kp), ("v_cache", vp)] {
        aligned16(OP, name, p)?;
    }
    let total = plan.p_splits + plan.s_splits;
    let wp = ptr_mut(workspace, stream);
    let part_ml = wp + (b * dims.num_heads * total * dims.head_dim * 4) as u64;
    let pass = SplitPass {
        part_o: wp,
        part_ml,
        q: qp,
        q_stride: strides.q,
        src,
        seqs: sp,
        batch: b,
        kv_rows,
    };

    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let g = GroupPass {
        pass: &pass,
        k: kp,
        v: vp,
        kv_stride: strides.kv,
        total,
        scale_log2,
    };
    // 1. the group pass over the shared prefixes: slots 0..p_splits
    if plan.p_splits > 0 {
        let groups = b.div_ceil(plan.group);
        let z = groups * plan.group.div_ceil(plan.per_block);
        let a = (plan.group, plan.per_block, z, plan.p_chunk, plan.p_splits);
        group_pass(OP, gpu, stream, &dims, &g, a, (0, 0, 0))?;
    }
    // 2. every sample's own keys (all its keys without a group pass): slots p_splits..total
    let a = (1, 1, b, plan.s_chunk, plan.s_splits);
    let skip = (plan.p_splits > 0) as u32;
    group_pass(OP, gpu, stream, &dims, &g, a, (1, skip, plan.p_splits))?;
    // 3. the ordered merge of all slots
    reduce_pass(
        OP,
        gpu,
        stream,
        &dims,
        &pass,
        op_,
        strides.out,
        lse_p,
        total,
    )
}

/// What both passes of the grouped decode share.
struct GroupPass<'a> {
    pass: &'a SplitPass,
    k: u64,
    v: u64,
    kv_stride: usize,
    total: usize,
    scale_log2: f32,
}

/// One launch of `attention_decode_grouped_bf16`. `a`: (group, per_block, grid z, chunk,
/// splits); `mode`: (per_sample, skip_prefix, split_base).
fn group_pass(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dims: &AttnDims,
    g: &GroupPass,
    a: (usize, usize, usize, usize, usize),
    mode: (u32, u32, usize),
) -> Result<()> {
    let (group, per_block, z, chunk, splits) = a;
    let hd = dims.head_dim as u32;
    let f = gpu.function(
        &ATTENTION,
        &[("HEAD_DIM", hd)],
        "attention_decode_grouped_bf16",
    )?;
    let smem = (4 * 2 * 32 * (dims.head_dim + 8) * 2) as u32; // 4 stages of K + V, 32 keys
                                                              // SAFETY: a valid function handle of this context; raises the dynamic shared-memory limit
                                                              // to what this launch passes (68 KiB for head_dim 128).
    unsafe {
        cudarc::driver::sys::cuFuncSetAttribute(
            f.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
    }
    .result()?;
    let cfg = LaunchConfig {
        grid_dim: (
            u32_of(op, "splits", splits)?,
            dims.num_kv_heads as u32,
            u32_of(op, "blocks along z", z)?,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let p = g.pass;
    let (qs, kvs) = (p.q_stride as u32, g.kv_stride as u32);
    let (bb, gg, pb) = (
        u32_of(op, "batch", p.batch)?,
        u32_of(op, "group", group)?,
        per_block as u32,
    );
    let (nh, nkv) = (dims.num_heads as u32, dims.num_kv_heads as u32);
    let (ch, sp, ts) = (
        u32_of(op, "chunk", chunk)?,
        splits as u32,
        u32_of(op, "slots", g.total)?,
    );
    let (per_sample, skip, base) = (mode.0, mode.1, u32_of(op, "split base", mode.2)?);
    let mut l = stream.launch_builder(&f);
    l.arg(&p.part_o)
        .arg(&p.part_ml)
        .arg(&p.q)
        .arg(&qs)
        .arg(&g.k)
        .arg(&g.v)
        .arg(&kvs)
        .arg(&p.seqs)
        .arg(&bb)
        .arg(&gg)
        .arg(&pb);
    l.arg(&nh)
        .arg(&nkv)
        .arg(&ch)
        .arg(&sp)
        .arg(&ts)
        .arg(&g.scale_log2)
        .arg(&p.kv_rows)
        .arg(&per_sample)
        .arg(&skip)
        .arg(&base);
    // SAFETY: q holds batch rows and the workspace batch*heads*total*(hd+2) floats (checked by
    // the caller); the pass writes slots split_base + split < total of samples < batch only;
    // the kernel checks the descriptors it reads keys through against kv_rows (computed from
    // the caches' lengths) and reads only rows inside; rows are 16-byte aligned (checked);
    // arguments match (part_o, part_ml, q, q_stride, k, v, kv_stride, seqs, batch, group,
    // per_block, n_heads, n_kv, chunk, splits, total_splits, scale_log2, kv_rows, per_sample,
    // skip_prefix, split_base).
    unsafe { l.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    fn dims(h: usize, kv: usize) -> AttnDims {
        AttnDims {
            num_heads: h,
            num_kv_heads: kv,
            head_dim: 128,
        }
    }

    /// The splits docs/perf.md (decode-perf) measured as the defaults stay the defaults.
    #[test]
    fn default_splits_are_the_measured_ones() {
        let cases = [
            (dims(16, 2), 64, (3, 704)),
            (dims(16, 2), 8, (16, 128)),
            (dims(28, 4), 64, (3, 704)),
            (dims(28, 4), 8, (11, 192)),
        ];
        for (d, b, (splits, chunk)) in cases {
            let p = decode_plan(b, d, 2048);
            assert_eq!((p.splits, p.chunk), (splits, chunk), "{d:?} B{b}");
            assert!(p.tensor_cores && p.pipelined);
            assert!(p.splits * p.chunk >= 2048);
        }
    }

    /// Groups of 8 sharing 1792 of 2048 keys: a group pass at batch 64 (the 264-block plan),
    /// none at batch 8 (one group: every sample reads its own keys).
    #[test]
    fn group_pass_only_with_enough_groups() {
        for d in [dims(16, 2), dims(28, 4)] {
            let p = grouped_decode_plan(64, 8, d, 1792, 256);
            assert_eq!(p, grouped_decode_plan_for_blocks(64, 8, d, 1792, 256, 264));
            assert!(p.p_splits > 0 && p.per_block == 8);
            let p = grouped_decode_plan(8, 8, d, 1792, 256);
            assert_eq!(p.p_splits, 0);
            assert!(p.s_splits * p.s_chunk >= 2048);
        }
        let p = grouped_decode_plan(64, 8, dims(16, 2), 1792, 256);
        assert_eq!(
            (p.p_splits, p.p_chunk, p.s_splits, p.s_chunk),
            (14, 128, 3, 96)
        );
        let p = grouped_decode_plan(64, 8, dims(28, 4), 1792, 256);
        assert_eq!(
            (p.p_splits, p.p_chunk, p.s_splits, p.s_chunk),
            (8, 224, 2, 128)
        );
    }

    #[test]
    fn pipelined_split_covers_the_keys() {
        for (u, len) in [(1, 1), (3, 100), (128, 2048), (16, 5000), (1000, 64)] {
            let (s, c) = pipelined_split(u, len, 64, 8);
            assert!(
                s >= 1 && c % 64 == 0 && s * c >= len && (s - 1) * c < len,
                "{u} {len}"
            );
        }
    }
}
