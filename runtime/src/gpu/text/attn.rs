//! The text decoder's attention steps: over a packed batch (prefill, scoring) and over the
//! decode KV arena (one token per sample).

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::{
    attention_decode_bf16, attention_decode_grouped_bf16, attention_fwd_bf16, decode_plan,
    grouped_decode_plan_tabled, kv_append_bf16, qkv_rope_append_bf16, rope_fwd_bf16, AttnSeqGpu,
    CudaSlice, CudaStream, DecodeInputs, FwdInputs, Gpu, GroupedDecodePlan, QkvRope,
};

use super::super::block::AttnStep;
use super::super::plan::DecodeKernel;
use super::super::weights::GpuLinear;
use super::super::{alloc, Result};
use super::decode::Grouping;
use super::{GpuKvArena, PrefillKv};

/// Text attention over a packed batch: rotate q and k (HF's bf16 text rounding), attend each
/// sequence causally (after an optional prefix KV of this layer), keep k/v when asked.
pub(super) struct PackedAttn<'a> {
    pub(super) cos: &'a CudaSlice<f32>,
    pub(super) sin: &'a CudaSlice<f32>,
    pub(super) seqs: &'a CudaSlice<AttnSeqGpu>,
    pub(super) n_seqs: usize,
    pub(super) max_q: usize,
    pub(super) dims: AttnDims,
    pub(super) rows: usize,
    /// A prefix KV (`[layers, prefix_rows, kvw]`) the sequences' prefix spans index.
    pub(super) prefix: Option<&'a PrefillKv>,
    /// Where to keep this batch's k/v (`[layers, rows, kvw]`) and the identity slots.
    pub(super) keep: Option<(&'a mut PrefillKv, &'a CudaSlice<u32>)>,
}

impl AttnStep for PackedAttn<'_> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let d = self.dims;
        let (qw, kvw) = (d.q_width(), d.kv_width());
        let row = qw + 2 * kvw;
        rope_fwd_bf16(
            gpu,
            stream,
            qkv,
            self.cos,
            self.sin,
            self.rows,
            row,
            d.num_heads + d.num_kv_heads,
            d.head_dim,
            true,
        )?;
        if let Some((kv, iota)) = self.keep.as_mut() {
            let n = kv.rows * kvw;
            let (a, b) = (layer * n, (layer + 1) * n);
            let ks = qkv.slice(qw..);
            let vs = qkv.slice(qw + kvw..);
            kv_append_bf16(
                gpu,
                stream,
                &mut kv.k.slice_mut(a..b),
                &ks,
                *iota,
                self.rows,
                kvw,
                row,
                kvw,
            )?;
            kv_append_bf16(
                gpu,
                stream,
                &mut kv.v.slice_mut(a..b),
                &vs,
                *iota,
                self.rows,
                kvw,
                row,
                kvw,
            )?;
        }
        let k = qkv.slice(qw..qkv.len() - kvw);
        let v = qkv.slice(qw + kvw..);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        match self.prefix {
            Some(p) => {
                let n = p.rows * kvw;
                let pk = p.k.slice(layer * n..(layer + 1) * n);
                let pv = p.v.slice(layer * n..(layer + 1) * n);
                let strides = RowStrides {
                    q: row,
                    kv: row,
                    prefix: kvw,
                    out: qw,
                };
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    FwdInputs {
                        q: qkv,
                        k: &k,
                        v: &v,
                        prefix_k: &pk,
                        prefix_v: &pv,
                        seqs: self.seqs,
                        n_seqs: self.n_seqs,
                        max_q_len: self.max_q,
                        dims: d,
                        mask: AttnMask::Causal,
                        scale,
                        strides,
                    },
                )?;
            }
            None => {
                let strides = RowStrides {
                    q: row,
                    kv: row,
                    prefix: row,
                    out: qw,
                };
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    FwdInputs {
                        q: qkv,
                        k: &k,
                        v: &v,
                        prefix_k: &k,
                        prefix_v: &v,
                        seqs: self.seqs,
                        n_seqs: self.n_seqs,
                        max_q_len: self.max_q,
                        dims: d,
                        mask: AttnMask::Causal,
                        scale,
                        strides,
                    },
                )?;
            }
        }
        Ok(())
    }
}

/// The split-K scratch (f32 elements) the tensor-core decode attention needs for `batch` rows
/// of at most `max_kv` keys, per sample or by GRPO group (`grouped`: the most rows a group
/// holds, the groups, the longest prefix; the split hints [`DecodeAttn`] passes).
pub(super) fn decode_workspace_len(
    batch: usize,
    dims: AttnDims,
    max_kv: usize,
    grouped: Option<(usize, usize, usize)>,
) -> usize {
    match grouped {
        Some((group, groups, max_prefix)) => {
            grouped_plan(batch, group, groups, dims, max_kv, max_prefix).workspace_len()
        }
        None => decode_plan(batch, dims, max_kv).workspace_len(),
    }
}

/// The decode attention's split-K scratch, `ws`, grown to at least `len` elements.
fn scratch<'w>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    ws: &'w mut Option<CudaSlice<f32>>,
    len: usize,
) -> Result<&'w mut CudaSlice<f32>> {
    if ws.as_ref().is_none_or(|w| w.len() < len) {
        *ws = Some(alloc::<f32>(gpu, stream, len)?);
    }
    Ok(ws.as_mut().expect("allocated above"))
}

/// The group-shared attention's cut for `batch` rows in `groups` groups of at most `group`.
fn grouped_plan(
    batch: usize,
    group: usize,
    groups: usize,
    dims: AttnDims,
    max_kv: usize,
    max_prefix: usize,
) -> GroupedDecodePlan {
    let suffix = max_kv.saturating_sub(max_prefix);
    grouped_decode_plan_tabled(batch, group, groups, dims, max_prefix, suffix)
}

/// Decode attention: project q|k|v, rotate q and k and append k/v at each sample's next suffix
/// row (one launch where the skinny kernel fuses them), attend `[prefix | suffix]` of each
/// sample in the arena.
pub(super) struct DecodeAttn<'a> {
    pub(super) cos: &'a CudaSlice<f32>,
    pub(super) sin: &'a CudaSlice<f32>,
    pub(super) slots: &'a CudaSlice<u32>,
    pub(super) seqs: &'a CudaSlice<AttnSeqGpu>,
    pub(super) dims: AttnDims,
    pub(super) batch: usize,
    pub(super) max_kv: usize,
    pub(super) kernel: DecodeKernel,
    /// Rows in GRPO groups sharing a prefix: the tensor-core kernel reads each group's prefix
    /// once.
    pub(super) grouped: Option<Grouping<'a>>,
    /// The split-K scratch; (re)allocated here when missing or short.
    pub(super) workspace: &'a mut Option<CudaSlice<f32>>,
    pub(super) arena: &'a mut GpuKvArena,
}

impl AttnStep for DecodeAttn<'_> {
    /// The projection, the rotary embedding of q and k and the append of k and v at each
    /// sample's slot: one launch where the skinny kernel takes them (`qkv_rope_append_bf16`).
    fn project(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        xn: &CudaSlice<bf16>,
        l: &GpuLinear,
        rows: usize,
    ) -> Result<()> {
        let d = self.dims;
        let cache = self.arena.layer_range(layer);
        let mut kc = self.arena.k.slice_mut(cache.clone());
        let mut vc = self.arena.v.slice_mut(cache);
        let rope = QkvRope {
            k_cache: &mut kc,
            v_cache: &mut vc,
            cos: self.cos,
            sin: self.sin,
            slots: self.slots,
            heads: d.num_heads,
            kv_heads: d.num_kv_heads,
            head_dim: d.head_dim,
        };
        qkv_rope_append_bf16(gpu, stream, qkv, xn, &l.w, l.bias(), rows, l.inp, rope)?;
        Ok(())
    }

    /// Attends the rows `project` rotated and appended.
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let d = self.dims;
        let (qw, kvw) = (d.q_width(), d.kv_width());
        let row = qw + 2 * kvw;
        let cache = self.arena.layer_range(layer);
        let kc = self.arena.k.slice(cache.clone());
        let vc = self.arena.v.slice(cache);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let strides = RowStrides {
            q: row,
            kv: kvw,
            prefix: kvw,
            out: qw,
        };
        match self.kernel {
            DecodeKernel::TensorCores => {
                let x = DecodeInputs {
                    q: qkv,
                    k_cache: &kc,
                    v_cache: &vc,
                    seqs: self.seqs,
                    dims: d,
                    scale,
                    strides,
                };
                // each kind's cut, computed once a step, sizes the scratch and drives the launch
                match self.grouped {
                    Some(gr) => {
                        let groups = gr.groups(self.batch);
                        let plan = grouped_plan(
                            self.batch,
                            gr.group,
                            groups,
                            d,
                            self.max_kv,
                            gr.max_prefix,
                        );
                        let ws = scratch(gpu, stream, self.workspace, plan.workspace_len())?;
                        let starts = gr.table.map(|(t, _)| t);
                        attention_decode_grouped_bf16(gpu, stream, out, None, ws, x, plan, starts)?;
                    }
                    None => {
                        let plan = decode_plan(self.batch, d, self.max_kv);
                        let ws = scratch(gpu, stream, self.workspace, plan.workspace_len())?;
                        attention_decode_bf16(gpu, stream, out, None, ws, x, plan)?;
                    }
                }
            }
            DecodeKernel::Varlen => {
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    FwdInputs {
                        q: qkv,
                        k: &kc,
                        v: &vc,
                        prefix_k: &kc,
                        prefix_v: &vc,
                        seqs: self.seqs,
                        n_seqs: self.batch,
                        max_q_len: 1,
                        dims: d,
                        mask: AttnMask::Causal,
                        scale,
                        strides,
                    },
                )?;
            }
        }
        Ok(())
    }
}
