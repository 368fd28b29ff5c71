//! `attention_decode_bf16`: one query per sequence, split-K over the keys ([`decode_plan`]),
//! then an ordered merge. The passes here (`split_pass`, `group_pass`, `reduce_pass`) are also
//! those of the grouped decode (`grouped.rs`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtrMut, DeviceSlice};
use half::bf16;

use super::{check_dims, check_stride, rows_of, AttnSeqGpu, DecodeInputs, KvSrc, RowStrides};
use crate::cpu::AttnDims;
use crate::cuda::launch::{aligned16, launch, need, ptr, ptr_mut, u32_of, Grid};
use crate::cuda::nvrtc::ATTENTION;
use crate::cuda::{shape, Gpu, Result};

/// How a decode attention is split over the keys (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    pub batch: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub splits: usize,
    pub chunk: usize,
    /// Tensor cores (the default) or the SIMT kernel (`attention_decode_simt_bf16`, kept for
    /// side-by-side timing: feature `bench`). Same results within bf16 rounding; each is
    /// deterministic. Without the feature the tensor cores always run
    /// ([`DecodePlan::uses_tensor_cores`]).
    #[cfg(feature = "bench")]
    pub tensor_cores: bool,
    /// With `tensor_cores`: the block-pipelined kernel (`attention_decode_grouped_bf16` in its
    /// per-sample form, the default of [`decode_plan`]: one block per (sample, kv head, chunk),
    /// a block-wide 4-stage pipeline, 3 blocks per SM) or the warp-split one
    /// (`attention_decode_bf16`: each of 4 warps streams its own tiles; 1 block per SM; what
    /// `decode_plan_for_blocks` plans, kept for timing).
    pub pipelined: bool,
}

impl DecodePlan {
    /// f32 elements of scratch the decode needs (partial outputs, then (max, sum) pairs).
    pub fn workspace_len(&self) -> usize {
        self.batch * self.num_heads * self.splits * (self.head_dim + 2)
    }

    /// Whether the tensor-core kernels run: always, unless a workbench (feature `bench`) asked
    /// for the SIMT kernel.
    pub fn uses_tensor_cores(&self) -> bool {
        #[cfg(feature = "bench")]
        {
            self.tensor_cores
        }
        #[cfg(not(feature = "bench"))]
        {
            true
        }
    }
}

/// Blocks `decode_plan_for_blocks`'s default and the group pass of [`super::grouped_decode_plan`]
/// aim at: 2 per SM of a 132-SM H200 (the warp-split kernel holds one 139 KiB block per SM; 264
/// blocks measured fastest of 264/528/1056/2112 for it, and for the group pass at batch 64;
/// docs/perf.md). A constant, so that the split (and the rounding) never depends on which
/// partition runs the kernel.
pub const DECODE_TARGET_BLOCKS: usize = 264;

/// The split of a decode over `batch` sequences of at most `max_kv_len` keys, for the
/// block-pipelined kernel: chunks of a multiple of 64 keys chosen by [`pipelined_split`].
pub fn decode_plan(batch: usize, dims: AttnDims, max_kv_len: usize) -> DecodePlan {
    let units = batch * dims.num_kv_heads;
    let r = dims.heads_per_kv();
    let (splits, chunk) = pipelined_split(units, max_kv_len, 64, r);
    DecodePlan {
        batch,
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        splits,
        chunk,
        #[cfg(feature = "bench")]
        tensor_cores: true,
        pipelined: r <= 64,
    }
}

/// Blocks of the block-pipelined decode kernel an H200 runs at once (3 per SM: 68 KiB of shared
/// memory and 144 registers a thread at head_dim 128).
pub const PIPELINED_SLOTS: usize = 396;

/// How the block-pipelined kernel cuts `len` keys for `units` independent (rows, kv head) units
/// of `rows` query rows each: `(splits, chunk)`, chunk a multiple of `mult`. A cost model fitted
/// to the H200 measurements (docs/perf.md, "Decode step"): a block costs its chunk plus about 128
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
/// [`DECODE_TARGET_BLOCKS`]); for the workbench, which times it beside [`decode_plan`]'s
/// (feature `bench`).
#[cfg(feature = "bench")]
pub fn decode_plan_for_blocks(
    batch: usize,
    dims: AttnDims,
    max_kv_len: usize,
    target_blocks: usize,
) -> DecodePlan {
    let rep = dims.heads_per_kv();
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

/// The buffer checks every decode launcher makes (row strides; q, out, seqs and workspace
/// lengths; V as long as K) and what they give: the cache's row count and the LSE output's
/// address (0 when not asked for). `b` > 0.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_decode_io(
    op: &'static str,
    stream: &CudaStream,
    dims: &AttnDims,
    strides: &RowStrides,
    b: usize,
    workspace_len: usize,
    out: &impl DeviceSlice<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &impl DeviceSlice<f32>,
    q: &(impl DeviceSlice<bf16> + ?Sized),
    k_cache: &(impl DeviceSlice<bf16> + ?Sized),
    v_cache: &(impl DeviceSlice<bf16> + ?Sized),
    seqs: &(impl DeviceSlice<AttnSeqGpu> + ?Sized),
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

/// Decode attention, as [`crate::cpu::attention_decode`]: writes `out` `[B, heads*hd]` (rows
/// `x.strides.out` apart) and, if given, `lse` `[B, heads]` from the inputs `x`
/// ([`DecodeInputs`]: `seqs` `[B]` made by [`AttnSeqGpu::from_decode`]), split as `plan` says;
/// `workspace` holds `plan.workspace_len()` floats.
pub fn attention_decode_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &mut impl DevicePtrMut<f32>,
    x: DecodeInputs,
    plan: DecodePlan,
) -> Result<()> {
    const OP: &str = "attention_decode_bf16";
    let DecodeInputs {
        q,
        k_cache,
        v_cache,
        seqs,
        dims,
        scale,
        strides,
    } = x;
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
    let tensor_cores = plan.uses_tensor_cores();
    if tensor_cores && plan.pipelined && dims.heads_per_kv() <= 64 {
        let g = GroupPass {
            pass: &pass,
            k: kp,
            v: vp,
            kv_stride: strides.kv,
            total: plan.splits,
            scale_log2,
            starts: 0,
            wide: false,
        };
        let a = (1, 1, b, plan.chunk, plan.splits);
        group_pass(OP, gpu, stream, &dims, &g, a, (1, 0, 0), None)?;
    } else {
        let sp_args = (plan.chunk, plan.splits, 0, 0, plan.splits);
        split_pass(
            OP,
            gpu,
            stream,
            tensor_cores,
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
pub(super) struct SplitPass {
    pub(super) part_o: u64,
    pub(super) part_ml: u64,
    pub(super) q: u64,
    pub(super) q_stride: usize,
    pub(super) src: KvSrc,
    pub(super) seqs: u64,
    pub(super) batch: usize,
    pub(super) kv_rows: u32,
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
    // The tensor-core kernel: 4 warps x 2 stages x (K + V) tiles of 32 keys, rows padded by 8.
    let smem = if tensor_cores {
        (4 * 2 * 2 * 32 * (dims.head_dim + 8) * 2) as u32
    } else {
        0
    };
    let (nh, nkv) = (dims.num_heads as u32, dims.num_kv_heads as u32);
    let (chunk, splits) = (u32_of(op, "chunk", chunk)?, u32_of(op, "splits", splits)?);
    let (base, total) = (
        u32_of(op, "split base", split_base)?,
        u32_of(op, "total splits", total_splits)?,
    );
    let qs = p.q_stride as u32;
    let hg = (dims.heads_per_kv().div_ceil(8) * dims.num_kv_heads) as u32;
    let bz = u32_of(op, "batch", p.batch)?;
    let cfg1 = Grid {
        grid: (splits, hg, bz),
        block: (128, 1, 1),
        smem,
    };
    // SAFETY: q holds batch rows; the workspace holds batch*heads*total_splits*(hd+2) floats
    // and split_base + splits <= total_splits (callers), so the partial slots written are
    // inside it; the kernel checks each descriptor against kv_rows and reads only rows inside
    // the caches; arguments match (part_o, part_ml, q, q_stride, src, seqs, n_heads, n_kv,
    // chunk, splits, scale_log2, p_rows, kv_rows, skip_prefix, split_base, total_splits).
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION,
            &[("HEAD_DIM", hd)],
            name,
            cfg1,
            &[
                &p.part_o,
                &p.part_ml,
                &p.q,
                &qs,
                &p.src,
                &p.seqs,
                &nh,
                &nkv,
                &chunk,
                &splits,
                &scale_log2,
                &p.kv_rows,
                &p.kv_rows,
                &skip_prefix,
                &base,
                &total,
            ],
        )
    }?;
    Ok(())
}

/// The ordered merge of `total_splits` partial slots per (sample, head).
#[allow(clippy::too_many_arguments)]
pub(super) fn reduce_pass(
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
    let nh = dims.num_heads as u32;
    let splits = u32_of(op, "total splits", total_splits)?;
    let bz = u32_of(op, "batch", p.batch)?;
    let os = out_stride as u32;
    let cfg2 = Grid {
        grid: (nh, bz, 1),
        block: (hd.min(128), 1, 1),
        smem: 0,
    };
    // SAFETY: out holds batch rows of heads*hd (checked by callers), lse batch*heads (checked);
    // the partials were written by the passes before on the same stream; arguments match (out,
    // out_stride, lse, part_o, part_ml, n_heads, splits).
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION,
            &[("HEAD_DIM", hd)],
            "attention_decode_reduce_bf16",
            cfg2,
            &[&out, &os, &lse, &p.part_o, &p.part_ml, &nh, &splits],
        )
    }?;
    Ok(())
}

/// What both passes of the grouped decode share.
pub(super) struct GroupPass<'a> {
    pub(super) pass: &'a SplitPass,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) kv_stride: usize,
    pub(super) total: usize,
    pub(super) scale_log2: f32,
    /// The group table's device address (`attention_decode_grouped_bf16`'s `starts`), or 0.
    pub(super) starts: u64,
    /// 64-key tiles through 2 stages (`attention_decode_grouped_wide_bf16`) instead of 32-key
    /// tiles through 4 (`attention_decode_grouped_bf16`); the same shared memory.
    pub(super) wide: bool,
}

/// One launch of `attention_decode_grouped_bf16` (or its wide form, `g.wide`). `a`: (group,
/// per_block, units (groups x parts, or samples), chunk, splits); `mode`: (per_sample,
/// skip_prefix, split_base). `then`: (chunk, splits) of a per-sample pass over every sample's
/// own keys run by the same launch after the group pass `a` describes (`splits * n_kv * batch`
/// more blocks, slots from `a`'s splits on). The grid holds exactly the blocks both passes
/// need.
#[allow(clippy::too_many_arguments)]
pub(super) fn group_pass(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dims: &AttnDims,
    g: &GroupPass,
    a: (usize, usize, usize, usize, usize),
    mode: (u32, u32, usize),
    then: Option<(usize, usize)>,
) -> Result<()> {
    let (group, per_block, units, chunk, splits) = a;
    let first = splits * dims.num_kv_heads * units;
    let (blocks, (chunk_b, splits_b)) = match then {
        Some((c, sp)) => (first + sp * dims.num_kv_heads * g.pass.batch, (c, sp)),
        None => (first, (chunk, splits)),
    };
    let hd = dims.head_dim as u32;
    // stages x (K + V) tiles of padded rows: the kernels' instantiations, 4 x 32 keys or 2 x 64
    let (name, stages, keys) = if g.wide {
        ("attention_decode_grouped_wide_bf16", 2, 64)
    } else {
        ("attention_decode_grouped_bf16", 4, 32)
    };
    let smem = (stages * 2 * keys * (dims.head_dim + 8) * 2) as u32;
    let cfg = Grid {
        grid: (u32_of(op, "blocks", blocks)?, 1, 1),
        block: (128, 1, 1),
        smem,
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
    let (fb, cb, sb) = (
        u32_of(op, "first pass blocks", first)?,
        u32_of(op, "chunk", chunk_b)?,
        splits_b as u32,
    );
    // SAFETY: q holds batch rows and the workspace batch*heads*total*(hd+2) floats (checked by
    // the caller); the pass writes slots split_base + split < total of samples < batch only;
    // the kernel checks the descriptors it reads keys through against kv_rows (computed from
    // the caches' lengths) and reads only rows inside; rows are 16-byte aligned (checked);
    // arguments match (part_o, part_ml, q, q_stride, k, v, kv_stride, seqs, batch, group,
    // per_block, n_heads, n_kv, chunk, splits, total_splits, scale_log2, kv_rows, per_sample,
    // skip_prefix, split_base, first_blocks, chunk_b, splits_b, group_starts); group_starts is
    // 0 or a table of more than units / parts entries (checked by the caller), read by the
    // group pass only.
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION,
            &[("HEAD_DIM", hd)],
            name,
            cfg,
            &[
                &p.part_o,
                &p.part_ml,
                &p.q,
                &qs,
                &g.k,
                &g.v,
                &kvs,
                &p.seqs,
                &bb,
                &gg,
                &pb,
                &nh,
                &nkv,
                &ch,
                &sp,
                &ts,
                &g.scale_log2,
                &p.kv_rows,
                &per_sample,
                &skip,
                &base,
                &fb,
                &cb,
                &sb,
                &g.starts,
            ],
        )
    }?;
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

    /// The splits docs/perf.md ("Decode step") measured as the defaults stay the defaults.
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
            assert!(p.uses_tensor_cores() && p.pipelined);
            assert!(p.splits * p.chunk >= 2048);
        }
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
