//! One decoder layer's training forward and backward over packed rows, with or without a kept
//! prefix to attend to.

use std::sync::Arc;

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::{
    add_f32_into_bf16, add_fwd_bf16_inplace, add_rmsnorm_fwd_bf16, attention_bwd_bf16,
    attention_fwd_bf16, kv_append_bf16, linear_fwd_bf16, rmsnorm_fwd_bf16, rope_bwd_bf16,
    rope_fwd_bf16, swiglu_gate_up_fwd_bf16, AttnSeqGpu, BwdGrads, BwdInputs, CudaSlice, CudaStream,
    FwdInputs, Gpu,
};

use super::super::alloc;
use super::super::arena::{alloc_in, DevBuf, Region};
use super::super::block_bwd::{mlp_saved, BlockBwd};
use super::super::weights::{GpuBlock, GpuLinear};
use super::params::Grads;
use super::Result;

/// One layer's activations: kept from the forward for backward (in a region of the plan's
/// arena where the plan placed them), or recomputed there from the layer's input.
pub(super) struct Acts {
    pub(super) xn1: DevBuf<bf16>,
    pub(super) rstd1: DevBuf<f32>,
    pub(super) qkv: DevBuf<bf16>,
    pub(super) q: DevBuf<bf16>,
    pub(super) k: DevBuf<bf16>,
    pub(super) v: DevBuf<bf16>,
    pub(super) att: DevBuf<bf16>,
    pub(super) lse: DevBuf<f32>,
    pub(super) x_mid: DevBuf<bf16>,
    pub(super) xn2: DevBuf<bf16>,
    pub(super) rstd2: DevBuf<f32>,
    pub(super) gu: DevBuf<bf16>,
    pub(super) act: DevBuf<bf16>,
    pub(super) delta: DevBuf<bf16>,
}

/// What a layer forward needs besides weights and activations.
pub(super) struct LayerCtx<'a> {
    pub(super) rows: usize,
    pub(super) hidden: usize,
    pub(super) dims: AttnDims,
    pub(super) eps: f32,
    pub(super) cos: &'a CudaSlice<f32>,
    pub(super) sin: &'a CudaSlice<f32>,
    pub(super) seqs: &'a CudaSlice<AttnSeqGpu>,
    pub(super) n_seqs: usize,
    pub(super) max_q: usize,
    pub(super) iota: &'a CudaSlice<u32>,
    pub(super) ones: &'a CudaSlice<bf16>,
}

impl Acts {
    pub(super) fn new(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        c: &LayerCtx<'_>,
        b: &GpuBlock,
    ) -> Result<Self> {
        Self::new_in(gpu, s, c, b, None)
    }

    /// [`Acts::new`] in `region` (what does not fit comes from the memory pool).
    pub(super) fn new_in(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        c: &LayerCtx<'_>,
        b: &GpuBlock,
        region: Option<&Region>,
    ) -> Result<Self> {
        let (r, h) = (c.rows, c.hidden);
        let (qw, kvw) = (c.dims.q_width(), c.dims.kv_width());
        let bf = |n: usize| alloc_in::<bf16>(gpu, s, n, region);
        let f = |n: usize| alloc_in::<f32>(gpu, s, n, region);
        Ok(Acts {
            xn1: bf(r * h)?,
            rstd1: f(r)?,
            qkv: bf(r * b.qkv.out)?,
            q: bf(r * qw)?,
            k: bf(r * kvw)?,
            v: bf(r * kvw)?,
            att: bf(r * qw)?,
            lse: f(r * c.dims.num_heads)?,
            x_mid: bf(r * h)?,
            xn2: bf(r * h)?,
            rstd2: f(r)?,
            gu: bf(r * 2 * b.ffn)?,
            act: bf(r * b.ffn)?,
            delta: bf(r * h)?,
        })
    }
}

pub(super) fn linear(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    l: &GpuLinear,
    rows: usize,
) -> Result<()> {
    linear_fwd_bf16(gpu, s, y, x, &l.w, l.bias(), rows, l.inp, l.out)?;
    Ok(())
}

/// The kept prefix K/V (this layer's store rows `lo..hi`) that suffix rows attend to; the
/// sequences' prefix spans count from `lo`.
pub(super) struct PreKv<'a> {
    pub(super) k: CudaView<'a, bf16>,
    pub(super) v: CudaView<'a, bf16>,
}

/// Causal attention of the layer's packed rows (q, k, v after RoPE) after each sequence's
/// prefix span in `pk` / `pv` (the rows' own k / v when no sequence has a prefix), with the LSE
/// the backward reads.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    c: &LayerCtx<'_>,
    att: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
    (q, k, v): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    pk: &impl DevicePtr<bf16>,
    pv: &impl DevicePtr<bf16>,
) -> Result<()> {
    let d = c.dims;
    attention_fwd_bf16(
        gpu,
        s,
        att,
        Some(lse as &mut dyn DevicePtrMut<f32>),
        FwdInputs {
            q,
            k,
            v,
            prefix_k: pk,
            prefix_v: pv,
            seqs: c.seqs,
            n_seqs: c.n_seqs,
            max_q_len: c.max_q,
            dims: d,
            mask: AttnMask::Causal,
            scale: 1.0 / (d.head_dim as f32).sqrt(),
            strides: RowStrides::contiguous(d),
        },
    )?;
    Ok(())
}

/// One decoder layer forward from `x_in`, filling `a`; when `x_out` is given the layer's output
/// (the next layer's input) is written there. With `pre`, each sequence attends to its prefix
/// span there before its own keys (as `score` does). Bitwise the model's `run_blocks` layer.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_fwd(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    b: &GpuBlock,
    c: &LayerCtx<'_>,
    x_in: &impl DevicePtr<bf16>,
    a: &mut Acts,
    x_out: Option<&mut CudaSlice<bf16>>,
    pre: Option<&PreKv<'_>>,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let ffn = b.ffn;
    rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn1,
        Some(&mut a.rstd1 as &mut dyn DevicePtrMut<f32>),
        x_in,
        &b.norm1,
        rows,
        h,
        c.eps,
    )?;
    linear(gpu, s, &mut a.qkv, &a.xn1, &b.qkv, rows)?;
    rope_fwd_bf16(
        gpu,
        s,
        &mut a.qkv,
        c.cos,
        c.sin,
        rows,
        row,
        d.num_heads + d.num_kv_heads,
        d.head_dim,
        true,
    )?;
    // q, k, v into contiguous buffers (the attention backward writes dq/dk/dv at its inputs'
    // strides, and three views of one fused gradient buffer cannot be borrowed at once)
    kv_append_bf16(gpu, s, &mut a.q, &a.qkv, c.iota, rows, qw, row, qw)?;
    kv_append_bf16(
        gpu,
        s,
        &mut a.k,
        &a.qkv.slice(qw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut a.v,
        &a.qkv.slice(qw + kvw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    let (q, k, v) = (&a.q, &a.k, &a.v);
    match pre {
        Some(p) => attend(gpu, s, c, &mut a.att, &mut a.lse, (q, k, v), &p.k, &p.v)?,
        None => attend(gpu, s, c, &mut a.att, &mut a.lse, (q, k, v), k, v)?,
    }
    linear(gpu, s, &mut a.delta, &a.att, &b.o, rows)?;
    s.memcpy_dtod(x_in, &mut a.x_mid)?;
    add_rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn2,
        Some(&mut a.rstd2 as &mut dyn DevicePtrMut<f32>),
        &mut a.x_mid,
        &a.delta,
        &b.norm2,
        rows,
        h,
        c.eps,
    )?;
    linear(gpu, s, &mut a.gu, &a.xn2, &b.gate_up, rows)?;
    swiglu_gate_up_fwd_bf16(gpu, s, &mut a.act, &a.gu, rows, ffn)?;
    if let Some(x) = x_out {
        linear(gpu, s, &mut a.delta, &a.act, &b.down, rows)?;
        s.memcpy_dtod(&a.x_mid, x)?;
        add_fwd_bf16_inplace(gpu, s, x, &a.delta, rows * h)?;
    }
    Ok(())
}

/// How a layer's attention backward meets a kept prefix.
pub(super) enum PrefixGrad<'a, 'b> {
    /// Suffix rows attending to `pre`: the prefix keys' gradients are added (fp32) into
    /// `dk`, `dv` (`[hi - lo, kv_width]`, the prefix spans' rows).
    Attend {
        pre: &'b PreKv<'a>,
        dk: &'b mut CudaSlice<f32>,
        dv: &'b mut CudaSlice<f32>,
    },
    /// Prefix rows whose K/V the suffixes also read: their gradients (fp32, these rows') are
    /// added to the rows' own before RoPE's backward.
    Extra {
        dk: CudaView<'a, f32>,
        dv: CudaView<'a, f32>,
    },
}

/// Backward of one layer's attention half, after its MLP half ([`BlockBwd::mlp_stacked`]):
/// `dx` holds the gradient of `x_mid` and ends holding the gradient of the layer's input;
/// parameter gradients are added into `grads` (see [`PrefixGrad`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_bwd_attn(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &LayerCtx<'_>,
    x_in: &impl DevicePtr<bf16>,
    a: &Acts,
    dx: &mut CudaSlice<bf16>,
    grads: &mut Grads,
    prefix: PrefixGrad<'_, '_>,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let bb = BlockBwd {
        gpu,
        s,
        layer,
        b,
        rows,
        hidden: h,
        ones: c.ones,
    };
    // attention: delta = o(attn(...))
    let datt = bb.o(grads, &mlp_saved!(a), dx)?;
    let mut dq = alloc::<bf16>(gpu, s, rows * qw)?;
    let mut dk = alloc::<bf16>(gpu, s, rows * kvw)?;
    let mut dv = alloc::<bf16>(gpu, s, rows * kvw)?;
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let strides = RowStrides::contiguous(d);
    match prefix {
        PrefixGrad::Attend {
            pre,
            dk: dpk,
            dv: dpv,
        } => attention_bwd_bf16(
            gpu,
            s,
            BwdGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                dprefix_k: dpk,
                dprefix_v: dpv,
            },
            BwdInputs {
                dout: &datt,
                q: &a.q,
                k: &a.k,
                v: &a.v,
                prefix_k: &pre.k,
                prefix_v: &pre.v,
                out: &a.att,
                lse: &a.lse,
                seqs: c.seqs,
                n_seqs: c.n_seqs,
                dims: d,
                mask: AttnMask::Causal,
                scale,
                strides,
            },
        )?,
        PrefixGrad::Extra { dk: ek, dv: ev } => {
            // no sequence has a prefix: one-row fp32 stand-ins
            let mut dpk = alloc::<f32>(gpu, s, kvw)?;
            let mut dpv = alloc::<f32>(gpu, s, kvw)?;
            attention_bwd_bf16(
                gpu,
                s,
                BwdGrads {
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                    dprefix_k: &mut dpk,
                    dprefix_v: &mut dpv,
                },
                BwdInputs {
                    dout: &datt,
                    q: &a.q,
                    k: &a.k,
                    v: &a.v,
                    prefix_k: &a.k,
                    prefix_v: &a.v,
                    out: &a.att,
                    lse: &a.lse,
                    seqs: c.seqs,
                    n_seqs: c.n_seqs,
                    dims: d,
                    mask: AttnMask::Causal,
                    scale,
                    strides,
                },
            )?;
            add_f32_into_bf16(gpu, s, &mut dk, &ek, rows * kvw)?;
            add_f32_into_bf16(gpu, s, &mut dv, &ev, rows * kvw)?;
        }
    }
    drop(datt);
    rope_bwd_bf16(
        gpu,
        s,
        &mut dq,
        c.cos,
        c.sin,
        rows,
        qw,
        d.num_heads,
        d.head_dim,
    )?;
    rope_bwd_bf16(
        gpu,
        s,
        &mut dk,
        c.cos,
        c.sin,
        rows,
        kvw,
        d.num_kv_heads,
        d.head_dim,
    )?;
    let mut dqkv = alloc::<bf16>(gpu, s, rows * row)?;
    kv_append_bf16(gpu, s, &mut dqkv, &dq, c.iota, rows, qw, qw, row)?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw..),
        &dk,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw + kvw..),
        &dv,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    drop((dq, dk, dv));
    bb.qkv_and_norm1(grads, &dqkv, &a.xn1, &a.rstd1, x_in, dx)?;
    Ok(())
}
