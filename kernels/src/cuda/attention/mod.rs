//! Attention launchers (kernels in `cuda/attention.cu`), one file each:
//! - `fwd.rs`: `attention_fwd_bf16`, the twin of [`crate::cpu::attention_fwd`] (varlen, causal
//!   or full, GQA, shared prefix; a tensor-core flash-attention kernel for head_dim <= 128 and
//!   prompts of 16+ tokens, else the SIMT one, [`fwd_kernel_for`]);
//! - `decode.rs`: `attention_decode_bf16`, the twin of [`crate::cpu::attention_decode`] (one
//!   query per sequence over a KV arena whose prefix rows are shared by a group's samples);
//! - `grouped.rs`: `attention_decode_grouped_bf16`, the same twin reading each GRPO group's
//!   shared prefix once for the whole group.
//!
//! This file holds what they share: the sequence descriptors, row strides and shape checks.
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
//! (`attention_decode_bf16`, `DecodePlan::pipelined == false`: what [`decode_plan`] plans past
//! 64 query heads per kv head, else kept for timing) and the SIMT one (`tensor_cores == false`,
//! only with the feature `bench`: kept for timing, no production path runs it).

mod decode;
mod fwd;
mod grouped;

#[cfg(feature = "bench")]
pub use decode::decode_plan_for_blocks;
pub use decode::{
    attention_decode_bf16, decode_plan, pipelined_split, DecodePlan, DECODE_TARGET_BLOCKS,
    PIPELINED_SLOTS,
};
pub use fwd::{
    attention_fwd_bf16, attention_fwd_bf16_with, fwd_kernel_for, FwdInputs, FwdKernel,
    TC_FWD_MAX_HEAD_DIM, TC_FWD_MIN_Q,
};
pub use grouped::{
    attention_decode_grouped_bf16, group_pass_units, grouped_decode_plan,
    grouped_decode_plan_for_blocks, grouped_decode_plan_for_targets, grouped_decode_plan_tabled,
    GroupedDecodePlan, GROUPED_MIN_CHUNK, GROUP_PASS_MIN_UNITS,
};

use cudarc::driver::{DevicePtr, DeviceRepr};
use half::bf16;

use super::{shape, Result};
use crate::cpu::{AttnDims, AttnSeq, DecodeSeq};

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

/// What a decode attention reads ([`attention_decode_bf16`], [`attention_decode_grouped_bf16`]):
/// `q` `[B, heads*hd]` (rows
/// `strides.q` apart), the KV arena `k_cache`, `v_cache` `[S, kv_heads*hd]` (rows `strides.kv`
/// apart; prefix and suffix rows in the same arena), the `seqs` `[B]` descriptors on the device
/// ([`AttnSeqGpu::from_decode`]), the dims and the softmax scale.
#[derive(Clone, Copy)]
pub struct DecodeInputs<'a> {
    pub q: &'a dyn DevicePtr<bf16>,
    pub k_cache: &'a dyn DevicePtr<bf16>,
    pub v_cache: &'a dyn DevicePtr<bf16>,
    pub seqs: &'a dyn DevicePtr<AttnSeqGpu>,
    pub dims: AttnDims,
    pub scale: f32,
    pub strides: RowStrides,
}

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

fn check_stride(op: &'static str, name: &str, stride: usize, width: usize) -> Result<()> {
    if stride < width || !stride.is_multiple_of(8) {
        return Err(shape(
            op,
            format!("{name} row stride {stride} must be >= {width} and a multiple of 8"),
        ));
    }
    Ok(())
}
