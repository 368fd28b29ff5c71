//! `attention_decode_grouped_bf16`: decode attention reading each GRPO group's shared prefix
//! once for the group ([`grouped_decode_plan`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use half::bf16;

use super::decode::{
    check_decode_io, group_pass, pipelined_split, reduce_pass, GroupPass, SplitPass,
    DECODE_TARGET_BLOCKS,
};
use super::{check_dims, DecodeInputs, KvSrc};
use crate::cpu::AttnDims;
use crate::cuda::launch::{aligned16, ptr, ptr_mut};
use crate::cuda::{shape, Gpu, Result};

/// How a group-shared decode ([`attention_decode_grouped_bf16`]) is cut: samples
/// `i * group .. (i + 1) * group` form GRPO group `i` and share its first sample's prefix, or,
/// with a group table, each of `groups` runs of at most `group` consecutive samples does. The
/// group pass (skipped when `p_splits == 0`) gives a block `per_block` samples of one group (all
/// query heads of one kv head: at most 64 MMA rows) over `p_chunk` prefix keys; the per-sample
/// pass gives a block one sample's query heads of one kv head over `s_chunk` of its own keys
/// (all its keys when there is no group pass); an ordered merge of the `p_splits + s_splits`
/// slots ends it. `wide`: both passes stream 64-key tiles through 2 stages instead of 32-key
/// tiles through 4 ([`GROUPED_WIDE_MIN_BLOCKS`]). A function of (batch, group, groups, dims,
/// length hints) only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedDecodePlan {
    pub batch: usize,
    /// The most samples a group holds.
    pub group: usize,
    /// The groups the group pass runs blocks for: `batch.div_ceil(group)` for fixed groups, the
    /// entries of the group table less one otherwise.
    pub groups: usize,
    pub per_block: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub p_splits: usize,
    pub p_chunk: usize,
    pub s_splits: usize,
    pub s_chunk: usize,
    pub wide: bool,
}

impl GroupedDecodePlan {
    /// f32 elements of scratch (partial outputs, then (max, sum) pairs, for every slot).
    pub fn workspace_len(&self) -> usize {
        self.batch * self.num_heads * (self.p_splits + self.s_splits) * (self.head_dim + 2)
    }
}

/// The plan of a cut: the group pass's (splits, chunk) and the per-sample pass's, with `wide`
/// set when a group pass runs and the launch has at least [`GROUPED_WIDE_MIN_BLOCKS`] blocks
/// (the cuts measured; a per-sample pass alone, cut finely for a small batch, keeps the deeper
/// pipeline).
fn cut(
    batch: usize,
    (group, groups): (usize, usize),
    dims: &AttnDims,
    (p_splits, p_chunk): (usize, usize),
    (s_splits, s_chunk): (usize, usize),
) -> GroupedDecodePlan {
    let blocks =
        p_splits * group_pass_units(groups, group, dims) + s_splits * batch * dims.num_kv_heads;
    GroupedDecodePlan {
        batch,
        group,
        groups,
        per_block: group_block_samples(group, dims),
        num_heads: dims.num_heads,
        head_dim: dims.head_dim,
        p_splits,
        p_chunk,
        s_splits,
        s_chunk,
        wide: p_splits > 0 && blocks >= GROUPED_WIDE_MIN_BLOCKS,
    }
}

/// The fewest blocks a grouped launch with a group pass has for its passes to take 64-key tiles
/// through 2 stages (the wide form) rather than 32-key tiles through 4: with fewer, the deeper
/// pipeline keeps more bytes in flight for the few blocks an SM holds. At 3B dims, groups of 8
/// over a 1,226-key prefix and 256 own keys, the wide form took 1.108 against 1.262 ms over 36
/// layers at batch 128 (352 blocks); a build taking it at every batch measured the same at
/// batch 64 (176 blocks) and 5% longer at batch 32 (88 blocks) (docs/perf.md, "Decode step").
pub const GROUPED_WIDE_MIN_BLOCKS: usize = 264;

/// The fewest (group part, kv head) units for which the group pass pays. With one group of 8
/// at 3B / 7B dims (2 or 4 units) the per-sample pass won (0.40-0.45 ms against 0.68-0.71 ms
/// over 28-36 layers, group pass cut for the block target). With 8 units (3B, batch 32 in groups
/// of 8 over a 1,226-key prefix, 512 own keys) the group pass in chunks of
/// [`GROUPED_MIN_CHUNK`] won, 0.567 ms against 0.682 ms (docs/perf.md, "Decode step").
pub const GROUP_PASS_MIN_UNITS: usize = 8;

/// The fewest keys a block of either pass of the grouped decode takes (unless the pass has
/// fewer): a group-pass block writes 64 rows of fp32 partial outputs (the bytes of 64 keys' K
/// and V) that the merge reads back, and a per-sample block has its query fragments and its
/// pipeline's fill to pay for, so the block target ([`DECODE_TARGET_BLOCKS`]) may not cut the
/// keys finer. At 3B dims over a 1,226-key prefix and 512 own keys this gives group pass 3 x 416,
/// per-sample 1 x 512: the fastest cut or within 2-4% of it at batch 32, 64 and 128, and
/// 1.04-1.20x faster than chunks of 256 (docs/perf.md, "Decode step").
pub const GROUPED_MIN_CHUNK: usize = 512;

/// Samples of one group a group-pass block takes: all query heads of one kv head for each, at
/// most 64 MMA rows in all.
fn group_block_samples(group: usize, dims: &AttnDims) -> usize {
    (64 / dims.heads_per_kv()).clamp(1, group.max(1))
}

/// The group pass's (group part, kv head) units (its blocks per split) for `groups` groups of
/// at most `group` samples.
pub fn group_pass_units(groups: usize, group: usize, dims: &AttnDims) -> usize {
    groups * group.div_ceil(group_block_samples(group, dims)) * dims.num_kv_heads
}

/// The grouped plan for `batch` samples in groups of `group` sharing a prefix of at most
/// `max_prefix_len` keys, each with at most `max_suffix_len` own keys. Hints only: the last
/// chunk of each pass takes every key left, so a short hint costs speed, never results. With a
/// prefix and at least [`GROUP_PASS_MIN_UNITS`] (group part, kv head) units, both passes aim at
/// [`DECODE_TARGET_BLOCKS`] blocks, in chunks of at least [`GROUPED_MIN_CHUNK`] keys
/// ([`grouped_decode_plan_for_targets`]; measured faster than [`pipelined_split`]'s cut at 3B
/// and 7B dims, batch 64, groups of 8); otherwise there is no group pass and every sample reads
/// all its keys in the per-sample pass, cut by [`pipelined_split`] (the fastest measured there).
pub fn grouped_decode_plan(
    batch: usize,
    group: usize,
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
) -> GroupedDecodePlan {
    let group = group.clamp(1, batch.max(1));
    let groups = batch.div_ceil(group);
    grouped_decode_plan_tabled(batch, group, groups, dims, max_prefix_len, max_suffix_len)
}

/// [`grouped_decode_plan`] for a batch whose groups a table gives (a batch compacted sample
/// by sample): `groups` runs of at most `group` consecutive samples, some possibly empty.
/// Whether the group pass runs is decided as for the same rows in whole groups (the sharing
/// full groups would give: a small batch of rows from many groups shares little); the group
/// pass's cut counts the table's groups.
pub fn grouped_decode_plan_tabled(
    batch: usize,
    group: usize,
    groups: usize,
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
) -> GroupedDecodePlan {
    let group = group.clamp(1, batch.max(1));
    let groups = groups.clamp(1, batch.max(1));
    // whether the group pass runs: decided as for the same rows in whole groups
    let whole = group_pass_units(batch.div_ceil(group), group, &dims);
    if max_prefix_len > 0 && whole >= GROUP_PASS_MIN_UNITS {
        // the block target, or fewer blocks where it would cut chunks under the floor
        let target = |units: usize, len: usize| {
            DECODE_TARGET_BLOCKS.min(units * len.div_ceil(GROUPED_MIN_CHUNK).max(1))
        };
        let targets = (
            target(group_pass_units(groups, group, &dims), max_prefix_len),
            target(batch * dims.num_kv_heads, max_suffix_len),
        );
        return plan_for_targets(
            batch,
            (group, groups),
            dims,
            max_prefix_len,
            max_suffix_len,
            targets,
        );
    }
    let own = max_prefix_len + max_suffix_len;
    let (s_splits, s_chunk) =
        pipelined_split(batch * dims.num_kv_heads, own, 32, dims.heads_per_kv());
    cut(batch, (group, groups), &dims, (0, 32), (s_splits, s_chunk))
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
    grouped_decode_plan_for_targets(
        batch,
        group,
        dims,
        max_prefix_len,
        max_suffix_len,
        (target_blocks, target_blocks),
    )
}

/// [`grouped_decode_plan_for_blocks`] with its own block target for each pass: (group pass,
/// per-sample pass).
pub fn grouped_decode_plan_for_targets(
    batch: usize,
    group: usize,
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
    targets: (usize, usize),
) -> GroupedDecodePlan {
    let group = group.clamp(1, batch.max(1));
    let groups = batch.div_ceil(group);
    plan_for_targets(
        batch,
        (group, groups),
        dims,
        max_prefix_len,
        max_suffix_len,
        targets,
    )
}

/// The cut aiming at (group pass, per-sample pass) block targets, for `groups` groups of at
/// most `group` samples.
fn plan_for_targets(
    batch: usize,
    (group, groups): (usize, usize),
    dims: AttnDims,
    max_prefix_len: usize,
    max_suffix_len: usize,
    (p_target, s_target): (usize, usize),
) -> GroupedDecodePlan {
    let split = |target: usize, units: usize, len: usize| {
        let splits = target
            .max(1)
            .div_ceil(units.max(1))
            .clamp(1, len.div_ceil(32).max(1));
        let chunk = len.max(1).div_ceil(splits).div_ceil(32) * 32;
        (len.max(1).div_ceil(chunk), chunk)
    };
    let (p_splits, p_chunk) = if max_prefix_len == 0 {
        (0, 32)
    } else {
        split(
            p_target,
            group_pass_units(groups, group, &dims),
            max_prefix_len,
        )
    };
    let (s_splits, s_chunk) = split(s_target, batch * dims.num_kv_heads, max_suffix_len);
    cut(
        batch,
        (group, groups),
        &dims,
        (p_splits, p_chunk),
        (s_splits, s_chunk),
    )
}

/// Decode attention with each GRPO group's shared prefix read once per group (the CPU twin is
/// still [`crate::cpu::attention_decode`]): the same buffers and descriptors as
/// [`super::attention_decode_bf16`] (the inputs in `x`), plus the grouping in `plan` and, for a
/// batch whose groups vary in size, `starts`: `plan.groups + 1` non-decreasing sample indices,
/// group `i` being samples `starts[i] .. starts[i + 1]` (at most `plan.group` of them; an
/// empty group costs a few idle blocks). Samples of a group must name the same prefix rows
/// (`p_start`, `p_len`) as the group's first sample; one that does not gets NaN outputs.
/// Launches on `stream`: the group pass (when `plan.p_splits > 0`) and the per-sample pass as
/// one launch, then the merge.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_grouped_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    workspace: &mut impl DevicePtrMut<f32>,
    x: DecodeInputs,
    plan: GroupedDecodePlan,
    starts: Option<&CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "attention_decode_grouped_bf16";
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
    let r = dims.heads_per_kv();
    if plan.num_heads != dims.num_heads
        || plan.head_dim != dims.head_dim
        || plan.group == 0
        || plan.groups == 0
        || plan.groups > b.max(1)
        || (starts.is_none() && plan.groups != b.div_ceil(plan.group))
        || plan.per_block == 0
        || plan.per_block * r > 64
        || plan.p_chunk == 0
        || plan.s_splits == 0
        || plan.s_chunk == 0
    {
        return Err(shape(
            OP,
            format!(
                "plan {plan:?} does not fit dims {dims:?} (per_block * heads per kv head <= 64, \
                 nothing zero, groups <= batch, fixed groups without a table)"
            ),
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
    let starts_p = match starts {
        Some(t) if t.len() <= plan.groups => {
            return Err(shape(
                OP,
                format!(
                    "a group table of {} entries for {} groups",
                    t.len(),
                    plan.groups
                ),
            ))
        }
        Some(t) => ptr(t, stream),
        None => 0,
    };
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
        starts: starts_p,
        wide: plan.wide,
    };
    // 1. the group pass over the shared prefixes (slots 0..p_splits) and, in the same launch,
    // every sample's own keys (slots p_splits..total); without a group pass, every sample's
    // keys alone
    if plan.p_splits > 0 {
        let z = plan.groups * plan.group.div_ceil(plan.per_block);
        let a = (plan.group, plan.per_block, z, plan.p_chunk, plan.p_splits);
        let then = Some((plan.s_chunk, plan.s_splits));
        group_pass(OP, gpu, stream, &dims, &g, a, (0, 0, 0), then)?;
    } else {
        let a = (1, 1, b, plan.s_chunk, plan.s_splits);
        group_pass(OP, gpu, stream, &dims, &g, a, (1, 0, 0), None)?;
    }
    // 2. the ordered merge of all slots
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

    /// Groups of 8 sharing 1226 of 1738 keys: a group pass from 8 (group part, kv head) units
    /// on (batch 32 at 3B dims), none with one group (every sample reads its own keys); chunks
    /// of at least GROUPED_MIN_CHUNK keys, as many as the block target asks for above that.
    #[test]
    fn group_pass_only_with_enough_groups() {
        for d in [dims(16, 2), dims(28, 4)] {
            let p = grouped_decode_plan(64, 8, d, 1226, 512);
            assert_eq!((p.p_splits, p.p_chunk, p.per_block), (3, 416, 8), "{p:?}");
            let p = grouped_decode_plan(8, 8, d, 1226, 512);
            assert_eq!(p.p_splits, 0);
            assert!(p.s_splits * p.s_chunk >= 1738);
        }
        for b in [32, 64, 128] {
            let p = grouped_decode_plan(b, 8, dims(16, 2), 1226, 512);
            assert_eq!(
                (p.p_splits, p.p_chunk, p.s_splits, p.s_chunk),
                (3, 416, 1, 512),
                "batch {b}"
            );
        }
        assert_eq!(
            grouped_decode_plan(16, 8, dims(16, 2), 1226, 512).p_splits,
            0
        );
        // the block target still cuts finer where the chunks stay over the floor: a long
        // prefix over few units
        let p = grouped_decode_plan(32, 8, dims(16, 2), 16384, 512);
        assert_eq!((p.p_splits, p.p_chunk), (32, 512));
        let p = grouped_decode_plan(32, 8, dims(16, 2), 65536, 512);
        assert_eq!((p.p_splits, p.p_chunk), (33, 2016));
    }

    /// A table of as many groups as the fixed layout has gives the fixed plan; more (smaller)
    /// groups cut a long prefix into fewer splits for the same block target; whether the group
    /// pass runs follows the rows (8 rows: none, however many groups they come from).
    #[test]
    fn tabled_plans_count_the_tables_groups() {
        let d = dims(16, 2);
        let fixed = grouped_decode_plan(64, 8, d, 16384, 256);
        assert_eq!(fixed.groups, 8);
        assert_eq!(grouped_decode_plan_tabled(64, 8, 8, d, 16384, 256), fixed);
        let many = grouped_decode_plan_tabled(64, 8, 16, d, 16384, 256);
        assert_eq!(many.groups, 16);
        assert!(many.p_splits < fixed.p_splits, "{many:?} against {fixed:?}");
        // at the loop's lengths the chunk floor decides, not the groups
        let short = grouped_decode_plan_tabled(64, 8, 16, d, 1226, 512);
        assert_eq!(
            short.p_splits,
            grouped_decode_plan(64, 8, d, 1226, 512).p_splits
        );
        assert_eq!(grouped_decode_plan(8, 8, d, 1226, 512).p_splits, 0);
        let tabled = grouped_decode_plan_tabled(8, 8, 8, d, 1226, 512);
        assert_eq!((tabled.p_splits, tabled.groups), (0, 8), "{tabled:?}");
        // groups never exceed the rows
        assert_eq!(grouped_decode_plan_tabled(4, 8, 16, d, 1226, 512).groups, 4);
    }

    /// The wide tiles from GROUPED_WIDE_MIN_BLOCKS blocks: at 3B dims, groups of 8 over a
    /// 1,226-key prefix and 256 own keys, batch 128 launches 3 x 32 group-pass and 256
    /// per-sample blocks; batch 64 half as many.
    #[test]
    fn wide_tiles_from_enough_blocks() {
        let d = dims(16, 2);
        let p = grouped_decode_plan(128, 8, d, 1226, 256);
        assert_eq!((p.p_splits, p.s_splits), (3, 1), "{p:?}");
        assert!(p.wide, "{p:?}");
        for b in [64, 32, 8] {
            let p = grouped_decode_plan(b, 8, d, 1226, 256);
            assert!(!p.wide, "{p:?}");
        }
        // without a group pass, however many blocks: the deeper pipeline
        for (b, prefix) in [(128, 0), (8, 1226)] {
            let p = grouped_decode_plan(b, 8, d, prefix, 1500);
            assert_eq!(p.p_splits, 0);
            assert!(p.s_splits * b * 2 >= GROUPED_WIDE_MIN_BLOCKS, "{p:?}");
            assert!(!p.wide, "{p:?}");
        }
    }
}
