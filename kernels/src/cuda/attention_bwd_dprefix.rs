//! The shared-prefix part of the attention backward: the gradients of the prefix keys and values
//! (`dprefix_k`, `dprefix_v`, fp32, *added* into, so that the G responses of a GRPO group, and
//! successive calls, gather into one prefix), on the tensor cores (`attention_bwd_tc_dprefix_f32`
//! and `attention_bwd_tc_dprefix_reduce` in `cuda/attention_bwd_tc.cu`) or on the SIMT kernel
//! `attention_bwd_dprefix_f32` (`cuda/attention_bwd.cu`).
//!
//! [`super::attention_bwd_tc::attention_bwd_tc_bf16`] runs the tensor-core kernel for its prefix
//! part; [`attention_bwd_dprefix_bf16`] runs the prefix part alone on a chosen kernel (tests,
//! bench).
//!
//! The tensor-core kernel is key-centric over the prefix buffer: a block owns 64 prefix rows (a
//! tile) of one kv head; the tile's work is the list of (sequence, query head, query tile) items
//! of the sequences whose prefix span meets the tile ([`plan`], the pure twin of the kernel's
//! list, tested without a GPU). To fill the GPU when the prefix has few tiles, each tile's list
//! is cut into `split` contiguous chunks, one block each ([`tc_dprefix_split`]); the chunks'
//! fp32 partial sums go to a scratch buffer and a last kernel adds them in chunk order.
//!
//! Invariants: deterministic, no atomics: `split` is a function of the shapes alone (never of the
//! device's SM count or the stream's SM partition), every sum runs in an order fixed by the
//! descriptors and shapes. A prefix row that no valid descriptor's span holds is left untouched.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::attention::{AttnSeqGpu, RowStrides};
use super::attention_bwd::{bwd_extent, BwdExtent, ATTENTION_BWD};
use super::attention_bwd_tc::{
    all_aligned16, launch_tc_prep, tc_bwd_refusal, warps_cfg, ATTENTION_BWD_TC, THREADS, TILE_ROWS,
};
use super::launch::{aligned16, launch, need, ptr, ptr_mut, u32_of, Grid};
use super::{shape, Gpu, Result};
use crate::cpu::AttnDims;

/// Which kernel [`attention_bwd_dprefix_bf16`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DprefixKernel {
    /// The tensor cores where [`tc_bwd_refusal`] takes the case and the buffers are 16-byte
    /// aligned (what the whole tensor-core backward runs); else SIMT.
    Auto,
    /// `attention_bwd_dprefix_f32`: one warp per (prefix row, kv head), fp32 FMAs.
    Simt,
    /// `attention_bwd_tc_dprefix_f32`, each tile's items cut into `split` chunks
    /// (1..=[`DPREFIX_MAX_SPLIT`]; 0: [`tc_dprefix_split`]'s choice).
    TensorCores { split: usize },
}

/// Blocks the split aims at: about two resident blocks (103 KiB of shared memory, 128 threads
/// of up to 255 registers each) per SM of a 132-SM H200. A constant, not the device's SM count,
/// so that the chunks (hence the bits) do not depend on the device or its SM partition.
pub const DPREFIX_TARGET_BLOCKS: usize = 256;

/// The most chunks a prefix tile's work is cut into.
pub const DPREFIX_MAX_SPLIT: usize = 16;

/// How many chunks [`DprefixKernel::TensorCores`] `{ split: 0 }` cuts each prefix tile's work
/// into: enough for the (prefix tiles x kv heads x chunks) blocks to reach
/// [`DPREFIX_TARGET_BLOCKS`] without passing it, at most [`DPREFIX_MAX_SPLIT`], and at most one
/// chunk per (query head, query tile) that the tile could get were every query row to see it.
/// A one-row prefix buffer is how callers without a prefix fill the argument
/// ([`super::attention_bwd_bf16`]'s doc): one chunk, so no scratch and no reduce launch.
pub fn tc_dprefix_split(dims: &AttnDims, q_rows: usize, p_rows: usize) -> usize {
    let blocks = p_rows.div_ceil(TILE_ROWS) * dims.num_kv_heads;
    if blocks == 0 || p_rows == 1 {
        return 1;
    }
    let rep = dims.heads_per_kv();
    let items = rep * q_rows.div_ceil(TILE_ROWS);
    (DPREFIX_TARGET_BLOCKS / blocks)
        .clamp(1, DPREFIX_MAX_SPLIT)
        .min(items.max(1))
}

/// The arguments both prefix kernels take (raw device addresses, as u32 sizes), checked by the
/// caller: `*_rows` are what every buffer of the kind holds, `seqs` holds `n_seqs` descriptors,
/// `lse` `q_rows * heads`.
pub(crate) struct DprefixArgs {
    pub dpk: u64,
    pub dpv: u64,
    pub dout: u64,
    pub q: u64,
    pub pk: u64,
    pub pv: u64,
    pub lse: u64,
    pub seqs: u64,
    pub n_seqs: u32,
    pub q_rows: u32,
    pub kv_rows: u32,
    pub p_rows: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub q_stride: u32,
    pub p_stride: u32,
    pub out_stride: u32,
    pub scale: f32,
}

/// The SIMT prefix kernel (`out`: the forward's output, for D = dout . out).
pub(crate) fn launch_dprefix_simt(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    a: &DprefixArgs,
    out: u64,
) -> Result<()> {
    if a.p_rows == 0 || a.n_seqs == 0 {
        return Ok(());
    }
    // SAFETY: the kernel touches rows below q_rows / p_rows only (descriptors outside the
    // buffers are ignored), which every buffer of its kind holds (the caller's check); one warp
    // adds into each (prefix row < p_rows, kv head) of dpk / dpv; arguments match the kernel's
    // signature in order.
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION_BWD,
            &[],
            "attention_bwd_dprefix_f32",
            warps_cfg(a.p_rows as usize * a.kv_heads as usize),
            &[
                &a.dpk,
                &a.dpv,
                &a.dout,
                &a.q,
                &a.pk,
                &a.pv,
                &out,
                &a.lse,
                &a.seqs,
                &a.n_seqs,
                &a.q_rows,
                &a.kv_rows,
                &a.p_rows,
                &a.heads,
                &a.kv_heads,
                &a.head_dim,
                &a.q_stride,
                &a.p_stride,
                &a.out_stride,
                &a.scale,
            ],
        )
    }?;
    Ok(())
}

/// The tensor-core prefix kernels, each tile's items in `split` chunks (1..=DPREFIX_MAX_SPLIT;
/// the caller checks), `dsum` = D per (query row, head) as `attention_bwd_tc_prep` writes it.
/// The caller checked what [`tc_bwd_refusal`] checks and the 16-byte alignment of dout, q, pk,
/// pv.
pub(crate) fn launch_dprefix_tc(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    a: &DprefixArgs,
    dsum: u64,
    split: usize,
) -> Result<()> {
    if a.p_rows == 0 || a.n_seqs == 0 {
        return Ok(());
    }
    let (p_rows, kvh, hd) = (a.p_rows as usize, a.kv_heads as usize, a.head_dim as usize);
    let defs = [("HEAD_DIM", a.head_dim)];
    let nsplit = split as u32;
    // fp32 partial dk (split chunks) then dv (split chunks), each [p_rows][kv heads][head_dim]
    let mut part = if split > 1 {
        Some(gpu.alloc::<f32>(stream, 2 * split * p_rows * kvh * hd)?)
    } else {
        None
    };
    let partp = part.as_mut().map(|p| ptr_mut(p, stream)).unwrap_or(0);
    let tile_bytes = TILE_ROWS * (hd + 8) * 2;
    // K and V of the block's prefix rows, then 2 stages of (q, dout, lse, D)
    let smem = (2 * tile_bytes + 2 * (2 * tile_bytes + 2 * TILE_ROWS * 4)) as u32;
    let cfg = Grid {
        grid: (
            p_rows.div_ceil(TILE_ROWS).clamp(1, 65535) as u32,
            a.kv_heads,
            nsplit,
        ),
        block: (THREADS, 1, 1),
        smem,
    };
    // SAFETY: the kernel reads only descriptors that fit q_rows / kv_rows / p_rows and rows
    // below them, which every buffer of each kind holds; bf16 buffers are 16-byte aligned and
    // strides multiples of 8 (the caller's checks), as cp.async needs; lse and dsum hold
    // q_rows * heads; block (x, g, c) adds into (split == 1) only the dpk / dpv rows of its own
    // tiles and kv head, or writes only its chunk c of `part`, which holds
    // 2 * split * p_rows * kv_width floats (allocated above whenever split > 1); the grid's z
    // is split and its y the kv heads, as the kernel reads them; arguments match its signature.
    unsafe {
        launch(
            gpu,
            stream,
            &ATTENTION_BWD_TC,
            &defs,
            "attention_bwd_tc_dprefix_f32",
            cfg,
            &[
                &a.dpk,
                &a.dpv,
                &a.dout,
                &a.q,
                &a.pk,
                &a.pv,
                &a.lse,
                &dsum,
                &a.seqs,
                &a.n_seqs,
                &a.q_rows,
                &a.kv_rows,
                &a.p_rows,
                &a.heads,
                &a.kv_heads,
                &a.q_stride,
                &a.p_stride,
                &a.out_stride,
                &a.scale,
                &nsplit,
                &partp,
            ],
        )
    }?;
    if split > 1 {
        // SAFETY: one warp per (prefix row < p_rows, kv head) reads its split chunks of `part`
        // (the kernel above wrote every row < p_rows of every chunk) and adds into that row.
        unsafe {
            launch(
                gpu,
                stream,
                &ATTENTION_BWD_TC,
                &defs,
                "attention_bwd_tc_dprefix_reduce",
                warps_cfg(p_rows * kvh),
                &[
                    &a.dpk,
                    &a.dpv,
                    &partp,
                    &a.seqs,
                    &a.n_seqs,
                    &a.q_rows,
                    &a.kv_rows,
                    &a.p_rows,
                    &a.kv_heads,
                    &a.p_stride,
                    &nsplit,
                    &a.scale,
                ],
            )
        }?;
    }
    // freed in stream order, after the kernels reading it
    drop(part);
    Ok(())
}

/// What the shared-prefix part of the backward reads ([`attention_bwd_dprefix_bf16`]): the
/// whole backward's `dout`, `q`, prefix K/V, forward `out` and natural-log `lse`, the `n_seqs`
/// descriptors `seqs`, dims, scale and strides ([`super::attention_bwd::BwdInputs`]), and
/// `kv_rows`: the own-key rows the descriptors may name (the `k`/`v` buffers' rows in the whole
/// backward; a descriptor whose own keys end past it is ignored there, and so here). No mask:
/// every query of a sequence sees all its prefix keys.
#[derive(Clone, Copy)]
pub struct DprefixInputs<'a> {
    pub dout: &'a dyn DevicePtr<bf16>,
    pub q: &'a dyn DevicePtr<bf16>,
    pub prefix_k: &'a dyn DevicePtr<bf16>,
    pub prefix_v: &'a dyn DevicePtr<bf16>,
    pub out: &'a dyn DevicePtr<bf16>,
    pub lse: &'a dyn DevicePtr<f32>,
    pub seqs: &'a dyn DevicePtr<AttnSeqGpu>,
    pub n_seqs: usize,
    pub kv_rows: usize,
    pub dims: AttnDims,
    pub scale: f32,
    pub strides: RowStrides,
}

/// The shared-prefix part of [`super::attention_bwd_bf16`] alone, on `kernel`: adds the prefix
/// keys' and values' gradients into `dprefix_k`, `dprefix_v` (fp32, the prefix stride) from the
/// inputs `x`.
pub fn attention_bwd_dprefix_bf16(
    kernel: DprefixKernel,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dprefix_k: &mut impl DevicePtrMut<f32>,
    dprefix_v: &mut impl DevicePtrMut<f32>,
    x: DprefixInputs,
) -> Result<()> {
    const OP: &str = "attention_bwd_dprefix_bf16";
    let DprefixInputs {
        dout,
        q,
        prefix_k,
        prefix_v,
        out,
        lse,
        seqs,
        n_seqs,
        kv_rows,
        dims,
        scale,
        strides,
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
    let BwdExtent {
        q_rows,
        prefix_rows,
        q_stride,
        prefix_stride,
        out_stride,
        ..
    } = bwd_extent(
        OP,
        &dims,
        strides,
        [q.len(), q.len(), out.len(), dout.len()],
        [0; 4],
        [
            prefix_k.len(),
            prefix_v.len(),
            dprefix_k.len(),
            dprefix_v.len(),
        ],
        lse.len(),
    )?;
    let a = DprefixArgs {
        dpk: ptr_mut(dprefix_k, stream),
        dpv: ptr_mut(dprefix_v, stream),
        dout: ptr(dout, stream),
        q: ptr(q, stream),
        pk: ptr(prefix_k, stream),
        pv: ptr(prefix_v, stream),
        lse: ptr(lse, stream),
        seqs: ptr(seqs, stream),
        n_seqs: u32_of(OP, "n_seqs", n_seqs)?,
        q_rows,
        kv_rows: u32_of(OP, "kv rows", kv_rows)?,
        p_rows: prefix_rows,
        heads: u32_of(OP, "heads", nh)?,
        kv_heads: u32_of(OP, "kv heads", nkv)?,
        head_dim: hd as u32,
        q_stride,
        p_stride: prefix_stride,
        out_stride,
        scale,
    };
    let outp = ptr(out, stream);
    let split = match kernel {
        DprefixKernel::Simt => None,
        DprefixKernel::TensorCores { split } => {
            if let Some(why) = tc_bwd_refusal(&dims, strides, n_seqs) {
                return Err(shape(OP, why));
            }
            if split > DPREFIX_MAX_SPLIT {
                return Err(shape(
                    OP,
                    format!("split {split} must be at most {DPREFIX_MAX_SPLIT} (0: automatic)"),
                ));
            }
            for (name, p) in [
                ("dout", a.dout),
                ("q", a.q),
                ("prefix_k", a.pk),
                ("prefix_v", a.pv),
            ] {
                aligned16(OP, name, p)?;
            }
            Some(split)
        }
        DprefixKernel::Auto => (tc_bwd_refusal(&dims, strides, n_seqs).is_none()
            && all_aligned16(&[a.dout, a.q, a.pk, a.pv]))
        .then_some(0),
    };
    let Some(split) = split else {
        return launch_dprefix_simt(gpu, stream, &a, outp);
    };
    let split = if split == 0 {
        tc_dprefix_split(&dims, q_rows as usize, prefix_rows as usize)
    } else {
        split
    };
    if a.p_rows == 0 || a.n_seqs == 0 {
        return Ok(());
    }
    // D = rowsum(dout * out) per (row, head), fp32 (prep with no dq to zero); freed in stream
    // order when dropped, after the kernels reading it
    let mut dsum = gpu.alloc::<f32>(stream, q_rows as usize * nh)?;
    let dsp = ptr_mut(&mut dsum, stream);
    launch_tc_prep(gpu, stream, &a, dsp, 0, outp)?;
    launch_dprefix_tc(gpu, stream, &a, dsp, split)?;
    drop(dsum);
    Ok(())
}

/// The pure twin of the tensor-core prefix kernel's work lists (`dp_hits`, `dp_covered`,
/// `dp_count`, `dp_item_at`, `dp_item_next` and the chunk bounds in `attention_bwd_tc.cu`), one
/// function per device function, with the same arithmetic; tested against the SIMT kernel's
/// definition of which (prefix row, sequence, head, query) terms a prefix row sums.
pub mod plan {
    use super::AttnSeqGpu;

    /// Rows per prefix tile and per query tile (the kernel's BT).
    pub const BT: u32 = 64;

    /// The row counts the kernel checks descriptors against.
    #[derive(Clone, Copy, Debug)]
    pub struct Rows {
        pub q: u32,
        pub kv: u32,
        pub p: u32,
    }

    /// `tc_seq_ok`: the descriptor fits the buffers.
    pub fn seq_ok(s: &AttnSeqGpu, r: Rows) -> bool {
        s.q_start as u64 + s.q_len as u64 <= r.q as u64
            && s.k_start as u64 + s.k_len as u64 <= r.kv as u64
            && s.p_start as u64 + s.p_len as u64 <= r.p as u64
            && s.q_len <= s.k_len
    }

    /// `dp_hits`: sequence `s` has items in the prefix tile starting at row `k0`.
    pub fn hits(s: &AttnSeqGpu, k0: u32, r: Rows) -> bool {
        seq_ok(s, r)
            && s.q_len > 0
            && s.p_len > 0
            && (s.p_start as u64) < k0 as u64 + BT as u64
            && k0 < s.p_start + s.p_len
    }

    /// `dp_covered`: some valid sequence's prefix span holds row `j`.
    pub fn covered(seqs: &[AttnSeqGpu], j: u32, r: Rows) -> bool {
        seqs.iter()
            .any(|s| seq_ok(s, r) && j >= s.p_start && j < s.p_start + s.p_len)
    }

    /// (sequence, query head, query tile), as `struct DpItem`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Item {
        pub si: u32,
        pub h: u32,
        pub qt: u32,
    }

    /// `dp_count`: the items of the tile at `k0`.
    pub fn count(seqs: &[AttnSeqGpu], k0: u32, rep: u32, r: Rows) -> u64 {
        seqs.iter()
            .filter(|s| hits(s, k0, r))
            .map(|s| rep as u64 * s.q_len.div_ceil(BT) as u64)
            .sum()
    }

    /// `dp_item_at`: item `idx` of the tile at `k0` (`None` past the last, where the kernel
    /// returns an end marker it never uses).
    pub fn item_at(
        mut idx: u64,
        seqs: &[AttnSeqGpu],
        k0: u32,
        h_first: u32,
        rep: u32,
        r: Rows,
    ) -> Option<Item> {
        for (si, s) in seqs.iter().enumerate() {
            if !hits(s, k0, r) {
                continue;
            }
            let nqt = s.q_len.div_ceil(BT);
            let cnt = rep as u64 * nqt as u64;
            if idx < cnt {
                return Some(Item {
                    si: si as u32,
                    h: h_first + (idx / nqt as u64) as u32,
                    qt: (idx % nqt as u64) as u32,
                });
            }
            idx -= cnt;
        }
        None
    }

    /// `dp_item_next`: the item after `it` (not the tile's last).
    pub fn item_next(it: &mut Item, seqs: &[AttnSeqGpu], k0: u32, h_first: u32, rep: u32, r: Rows) {
        it.qt += 1;
        if it.qt < seqs[it.si as usize].q_len.div_ceil(BT) {
            return;
        }
        it.qt = 0;
        it.h += 1;
        if it.h < h_first + rep {
            return;
        }
        it.h = h_first;
        loop {
            it.si += 1;
            if it.si as usize >= seqs.len() || hits(&seqs[it.si as usize], k0, r) {
                break;
            }
        }
    }

    /// Chunk `c` of `nsplit` of a tile's `n` items: `[n c / nsplit, n (c + 1) / nsplit)`.
    pub fn chunk(n: u64, c: u32, nsplit: u32) -> (u64, u64) {
        (
            n * c as u64 / nsplit as u64,
            n * (c as u64 + 1) / nsplit as u64,
        )
    }

    /// The items block (tile at `k0`, kv head `kvh`, chunk `c`) computes, in its order: item_at
    /// for the first, item_next for each next, as the kernel walks them.
    pub fn block_items(
        seqs: &[AttnSeqGpu],
        k0: u32,
        kvh: u32,
        rep: u32,
        c: u32,
        nsplit: u32,
        r: Rows,
    ) -> Vec<Item> {
        let h_first = kvh * rep;
        let (lo, hi) = chunk(count(seqs, k0, rep, r), c, nsplit);
        let mut out = Vec::new();
        if hi == lo {
            return out;
        }
        let mut it = item_at(lo, seqs, k0, h_first, rep, r).expect("lo < the item count");
        for i in lo..hi {
            out.push(it);
            if i + 1 < hi {
                item_next(&mut it, seqs, k0, h_first, rep, r);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::plan::{self, Item, Rows, BT};
    use super::*;

    fn seq(q_start: u32, q_len: u32, p_start: u32, p_len: u32) -> AttnSeqGpu {
        AttnSeqGpu {
            q_start,
            q_len,
            p_start,
            p_len,
            k_start: q_start,
            k_len: q_len,
        }
    }

    /// A small xorshift stream (deterministic cases).
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u32) -> u32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n.max(1) as u64) as u32
        }
    }

    /// How often each (prefix row, sequence, head, query) term is added, densely indexed.
    struct Terms {
        n: Vec<u8>,
        dims: [usize; 3], // sequences, heads, longest q_len
    }
    impl Terms {
        fn new(seqs: &[AttnSeqGpu], r: Rows, heads: u32) -> Terms {
            let ql = seqs
                .iter()
                .map(|s| s.q_len as usize)
                .max()
                .unwrap_or(0)
                .max(1);
            let dims = [seqs.len(), heads as usize, ql];
            Terms {
                n: vec![0; r.p as usize * dims[0] * dims[1] * dims[2]],
                dims,
            }
        }
        fn add(&mut self, j: u32, si: u32, h: u32, qi: u32) {
            let [ns, nh, nq] = self.dims;
            let i = ((j as usize * ns + si as usize) * nh + h as usize) * nq + qi as usize;
            self.n[i] += 1;
        }
        /// The first term added a different number of times than in `other`.
        fn first_difference(&self, other: &Terms) -> Option<(usize, u8, u8)> {
            let [ns, nh, nq] = self.dims;
            let i = (0..self.n.len()).find(|&i| self.n[i] != other.n[i])?;
            let (qi, rest) = (i % nq, i / nq);
            let (h, rest) = (rest % nh, rest / nh);
            let (si, j) = (rest % ns, rest / ns);
            println!("row {j} sequence {si} head {h} query {qi}");
            Some((i, self.n[i], other.n[i]))
        }
    }

    /// Every (prefix row, sequence, head, query) term the kernel's blocks add, walked as the
    /// kernel walks them (tiles, kv heads, chunks; items; warps; the lane rows and query columns
    /// of `tc_keys_step` under the warp skip and the mask), and the rows the results are added
    /// to.
    fn kernel_terms(
        seqs: &[AttnSeqGpu],
        r: Rows,
        heads: u32,
        kv_heads: u32,
        nsplit: u32,
    ) -> (Terms, Vec<u32>) {
        let rep = heads / kv_heads;
        let mut terms = Terms::new(seqs, r, heads);
        for k0 in (0..r.p).step_by(BT as usize) {
            for kvh in 0..kv_heads {
                for c in 0..nsplit {
                    for Item { si, h, qt } in plan::block_items(seqs, k0, kvh, rep, c, nsplit, r) {
                        let s = seqs[si as usize];
                        assert!(
                            plan::hits(&s, k0, r),
                            "item of a sequence that misses the tile"
                        );
                        assert!(h / rep == kvh, "head {h} is not in kv head {kvh}'s group");
                        let (p_lo, p_hi) = (s.p_start, s.p_start + s.p_len);
                        for warp in 0..4 {
                            let kw = k0 + warp * 16;
                            if !(kw < p_hi && kw + 16 > p_lo) {
                                continue; // the warp skip
                            }
                            for lane in 0..32u32 {
                                let (g, t) = (lane >> 2, lane & 3);
                                let (ka, kb) = (kw + g, kw + g + 8);
                                for j in 0..(BT / 8) {
                                    for e in 0..4u32 {
                                        let kj = if e < 2 { ka } else { kb };
                                        let qi = qt * BT + 8 * j + 2 * t + (e & 1);
                                        if kj >= p_lo && kj < p_hi && qi < s.q_len {
                                            terms.add(kj, si, h, qi);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        let written = (0..r.p).filter(|&j| plan::covered(seqs, j, r)).collect();
        (terms, written)
    }

    /// The SIMT kernel's definition: prefix row j sums, over valid sequences whose span holds
    /// it, every head of the group and every query; rows held by none are not written.
    fn simt_terms(seqs: &[AttnSeqGpu], r: Rows, heads: u32) -> (Terms, Vec<u32>) {
        let mut terms = Terms::new(seqs, r, heads);
        let mut written = Vec::new();
        for j in 0..r.p {
            let mut any = false;
            for (si, s) in seqs.iter().enumerate() {
                if !plan::seq_ok(s, r) || j < s.p_start || j >= s.p_start + s.p_len {
                    continue;
                }
                any = true;
                for h in 0..heads {
                    for qi in 0..s.q_len {
                        terms.add(j, si as u32, h, qi);
                    }
                }
            }
            if any {
                written.push(j);
            }
        }
        (terms, written)
    }

    #[test]
    fn dprefix_blocks_add_every_term_once_and_only_to_covered_rows() {
        let r = |q, kv, p| Rows { q, kv, p };
        // (a) a GRPO group over one 200-row prefix; (b) two groups at 0 and 137 (not 64-aligned)
        // and a span 130..140 across the second one's start, rows 120..130 and past 287 held by
        // none; a sequence without a prefix; one without queries; one whose prefix runs past the
        // buffer (ignored) and one whose queries do
        let lens_a = [1u32, 37, 300, 64, 65, 129, 250, 17];
        let mut a = Vec::new();
        let mut at = 0;
        for &l in &lens_a {
            a.push(seq(at, l, 0, 200));
            at += l;
        }
        let case_a = (a, r(at, at, 211), 16, 2);
        let mut b = Vec::new();
        let mut at = 0;
        for (l, ps, pl) in [
            (40, 0, 120),
            (90, 0, 120),
            (7, 0, 120),
            (50, 0, 0),
            (130, 137, 150),
            (1, 137, 150),
            (66, 137, 150),
            (0, 137, 150),
            (200, 137, 150),
            (9, 250, 60),
            (25, 130, 10),
        ] {
            b.push(seq(at, l, ps, pl));
            at += l;
        }
        b.push(seq(at - 5, 10, 0, 64)); // queries past q_rows: ignored
        let case_b = (b, r(at, at, 300), 8, 2);
        let mut cases = vec![case_a, case_b];
        // random descriptor sets, spans anywhere (some past the buffer)
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..40 {
            let p = 1 + rng.below(400);
            let n = 1 + rng.below(7);
            let mut v = Vec::new();
            let mut at = 0;
            for _ in 0..n {
                let l = rng.below(150);
                let ps = rng.below(p + 20);
                let pl = rng.below(p + 1);
                v.push(seq(at, l, ps, pl));
                at += l;
            }
            let (h, kv) = [(4, 1), (16, 2), (6, 3), (2, 2)][rng.below(4) as usize];
            cases.push((v, r(at + rng.below(3), at, p), h, kv));
        }
        for (ci, (seqs, rows, h, kv)) in cases.iter().enumerate() {
            let (want, want_rows) = simt_terms(seqs, *rows, *h);
            assert!(want.n.contains(&1) || ci >= 2, "case {ci} has terms");
            for nsplit in [1, 2, 3, 6, 16] {
                let (got, got_rows) = kernel_terms(seqs, *rows, *h, *kv, nsplit);
                assert_eq!(
                    got_rows, want_rows,
                    "case {ci} split {nsplit}: rows written"
                );
                let diff = got.first_difference(&want);
                assert!(
                    diff.is_none(),
                    "case {ci} split {nsplit}: (index, times added, times wanted) {diff:?}"
                );
            }
        }
    }

    #[test]
    fn dprefix_chunks_partition_the_tile_list_in_order() {
        // the chunks, concatenated, are the tile's list in (sequence, head, query tile) order
        let seqs = [seq(0, 65, 0, 100), seq(65, 3, 50, 10), seq(68, 130, 90, 64)];
        let r = Rows {
            q: 198,
            kv: 198,
            p: 160,
        };
        let (rep, kvh, k0) = (3, 1, 64);
        let mut direct = Vec::new();
        for si in 0..3u32 {
            if !plan::hits(&seqs[si as usize], k0, r) {
                continue;
            }
            for h in kvh * rep..(kvh + 1) * rep {
                for qt in 0..seqs[si as usize].q_len.div_ceil(BT) {
                    direct.push(Item { si, h, qt });
                }
            }
        }
        // rows 64..127 meet sequences 0 (0..100) and 2 (90..154), not 1 (50..60)
        assert_eq!(direct.len(), 3 * 2 + 3 * 3);
        assert_eq!(plan::count(&seqs, k0, rep, r), direct.len() as u64);
        for nsplit in 1..=16 {
            let joined: Vec<Item> = (0..nsplit)
                .flat_map(|c| plan::block_items(&seqs, k0, kvh, rep, c, nsplit, r))
                .collect();
            assert_eq!(joined, direct, "split {nsplit}");
        }
    }

    #[test]
    fn dprefix_split_fills_the_target_from_shapes_alone() {
        let d = |h, kv, hd| AttnDims {
            num_heads: h,
            num_kv_heads: kv,
            head_dim: hd,
        };
        // Qwen2.5-VL 3B: 1226 prefix rows = 20 tiles x 2 kv heads = 40 blocks -> 6 chunks (240)
        assert_eq!(tc_dprefix_split(&d(16, 2, 128), 2320, 1226), 6);
        // a long prefix already fills the target
        assert_eq!(tc_dprefix_split(&d(16, 2, 128), 2320, 64 * 128), 1);
        // a short one is capped at DPREFIX_MAX_SPLIT, and by the queries' (head, tile) items
        assert_eq!(
            tc_dprefix_split(&d(16, 2, 128), 4096, 100),
            DPREFIX_MAX_SPLIT
        );
        assert_eq!(tc_dprefix_split(&d(4, 1, 128), 112, 124), 8);
        assert_eq!(tc_dprefix_split(&d(4, 4, 64), 0, 124), 1);
        assert_eq!(tc_dprefix_split(&d(4, 4, 64), 10, 0), 1);
        // the one-row stand-in of a batch without a prefix
        assert_eq!(tc_dprefix_split(&d(16, 2, 128), 2320, 1), 1);
        assert_eq!(tc_dprefix_split(&d(16, 2, 128), 2320, 2), DPREFIX_MAX_SPLIT);
        for (h, kv, q, p) in [(16, 2, 2320, 1226), (8, 2, 700, 300), (2, 1, 1, 1)] {
            let s = tc_dprefix_split(&d(h, kv, 64), q, p);
            let blocks = p.div_ceil(64) * kv * s;
            assert!((1..=DPREFIX_MAX_SPLIT).contains(&s));
            assert!(
                s == 1 || blocks <= DPREFIX_TARGET_BLOCKS,
                "{h}/{kv} {q} {p}: {s}"
            );
        }
    }
}
