//! Backward of one pre-norm transformer block (the model's `block_fwd`), shared by the vision
//! tower and the text decoder, and its recomputation from the block input.
//!
//! Forward, for reference (`block_fwd`):
//! ```text
//! xn1 = rmsnorm(x_in, norm1); q, k, v = lin(xn1); q, k = rope(q, k)
//! attn = attention(q, [prefix_k | k], [prefix_v | v]); x_mid = x_in + o(attn)
//! xn2 = rmsnorm(x_mid, norm2); act = silu(gate(xn2)) * up(xn2); x_out = x_mid + down(act)
//! ```
//! Backward runs it in reverse with the `*_bwd` kernels. A block's own k/v may have further
//! consumers (a group prefix's k/v are read by the G response suffixes): their gradient enters
//! as `extra_dkv` and is added to the block's own `dk`/`dv` (after RoPE) before RoPE's backward.
//! A block that reads a shared prefix adds the prefix k/v gradient into `dprefix`.
//!
//! On one rank of a tensor-parallel group the conjugate collectives of the forward join in:
//! row-parallel o/down (forward: all-reduce) get a replicated output gradient, so each rank
//! computes its input columns' gradient with no communication and the replicated bias gradient
//! identically; column-parallel q/k/v and gate/up (forward: no communication) give partial input
//! gradients, all-reduced. Over `SoloComm` both all-reduces are no-ops.
//!
//! Invariant: parameter gradients are *added* into the rank's gradient buffer at the shard's
//! offsets, in a fixed order (down, up, gate, norm2, o, v, k, q, norm1); the result depends only
//! on the cache's bits, so a block recomputed from `x_in` ([`recompute_block`]) gives bitwise
//! the gradients of a kept cache; every replicated parameter's gradient is bitwise equal on
//! every rank (it is computed from replicated values only).

use rollplex_kernels::cpu::{
    attention_bwd, linear_bwd, rmsnorm_bwd, rope_bwd, swiglu_bwd, AttnDims, AttnMask, AttnSeq,
};

use super::Result;
use crate::model::block::{block_fwd, Attend};
use crate::model::weights::{BlockParams, Linear, ParamId};
use crate::model::{CacheMode, LayerCache, Weights};
use crate::tp::Communicator;

/// How a block's attention found its keys, and its RoPE tables (what backward re-reads).
#[derive(Clone, Copy)]
pub(crate) struct BlockCtx<'a> {
    pub seqs: &'a [AttnSeq],
    pub mask: AttnMask,
    /// This layer's shared prefix k/v `[P, KV]` (empty for none).
    pub prefix_k: &'a [f32],
    pub prefix_v: &'a [f32],
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub dims: AttnDims,
    pub eps: f32,
}

/// Runs the block forward from its input, keeping every activation. Returns the cache and the
/// block output.
pub(crate) fn recompute_block<C: Communicator>(
    comm: &C,
    w: &Weights,
    p: &BlockParams,
    x_in: &[f32],
    rows: usize,
    ctx: &BlockCtx<'_>,
) -> Result<(LayerCache, Vec<f32>)> {
    let mut x = x_in.to_vec();
    let mut cache = LayerCache::default();
    let attend = Attend::Packed {
        seqs: ctx.seqs,
        mask: ctx.mask,
        prefix_k: ctx.prefix_k,
        prefix_v: ctx.prefix_v,
    };
    block_fwd(
        comm,
        w,
        p,
        &mut x,
        rows,
        ctx.dims,
        ctx.eps,
        ctx.cos,
        ctx.sin,
        attend,
        Some((CacheMode::Full, &mut cache)),
    )?;
    Ok((cache, x))
}

/// The gradient slice of a whole parameter.
pub(crate) fn grad_of<'g>(w: &Weights, grads: &'g mut [f32], id: ParamId) -> &'g mut [f32] {
    let e = w.table.entry(id);
    &mut grads[e.offset..e.offset + e.len]
}

/// `linear_bwd` of one [`Linear`] (which may be a row range of a fused weight): `dx` written
/// (or added), weight and bias gradients added when `grads` is given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_backward(
    w: &Weights,
    l: &Linear,
    dx: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    rows: usize,
    grads: Option<&mut [f32]>,
    accumulate_dx: bool,
) -> Result<()> {
    match grads {
        Some(g) => {
            let we = w.table.entry(l.w);
            let (ws, wl) = (we.offset + l.row0 * l.inp, l.out * l.inp);
            // The weight rows and the bias are disjoint parameters: split the borrow.
            let (dw, db) = match l.b {
                Some(b) => {
                    let be = w.table.entry(b);
                    let bs = be.offset + l.row0;
                    if bs >= ws + wl {
                        let (lo, hi) = g.split_at_mut(bs);
                        (&mut lo[ws..ws + wl], Some(&mut hi[..l.out]))
                    } else {
                        let (lo, hi) = g.split_at_mut(ws);
                        (&mut hi[..wl], Some(&mut lo[bs..bs + l.out]))
                    }
                }
                None => (&mut g[ws..ws + wl], None),
            };
            linear_bwd(
                dx,
                Some(dw),
                db,
                dy,
                x,
                w.lin_w(l),
                rows,
                l.inp,
                l.out,
                accumulate_dx,
            )?;
        }
        None => linear_bwd(
            dx,
            None,
            None,
            dy,
            x,
            w.lin_w(l),
            rows,
            l.inp,
            l.out,
            accumulate_dx,
        )?,
    }
    Ok(())
}

/// Backward of one block. `c` is a `Full` cache of the block over `rows` rows, `dy` the
/// gradient of its output `[rows, H]` (replicated). Returns the gradient of its input
/// (replicated).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_bwd<C: Communicator>(
    comm: &C,
    w: &Weights,
    p: &BlockParams,
    c: &LayerCache,
    rows: usize,
    ctx: &BlockCtx<'_>,
    dy: &[f32],
    extra_dkv: Option<(&[f32], &[f32])>,
    dprefix: Option<(&mut [f32], &mut [f32])>,
    mut grads: Option<&mut [f32]>,
) -> Result<Vec<f32>> {
    let h = p.o.out;
    let f = p.gate.out;
    let dims = ctx.dims;
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    // MLP
    let mut dact = vec![0f32; rows * f];
    linear_backward(
        w,
        &p.down,
        Some(&mut dact),
        dy,
        &c.act,
        rows,
        grads.as_deref_mut(),
        false,
    )?;
    let (mut dgate, mut dup) = (vec![0f32; rows * f], vec![0f32; rows * f]);
    swiglu_bwd(&mut dgate, &mut dup, &dact, &c.gate, &c.up)?;
    drop(dact);
    let mut dxn2 = vec![0f32; rows * h];
    linear_backward(
        w,
        &p.up,
        Some(&mut dxn2),
        &dup,
        &c.xn2,
        rows,
        grads.as_deref_mut(),
        false,
    )?;
    linear_backward(
        w,
        &p.gate,
        Some(&mut dxn2),
        &dgate,
        &c.xn2,
        rows,
        grads.as_deref_mut(),
        true,
    )?;
    drop((dgate, dup));
    comm.all_reduce_sum(&mut dxn2)?;
    let mut dmid = dy.to_vec();
    let dnorm2 = grads.as_deref_mut().map(|g| grad_of(w, g, p.norm2));
    rmsnorm_bwd(
        &mut dmid,
        dnorm2,
        &dxn2,
        &c.x_mid,
        w.get(p.norm2),
        &c.rstd2,
        rows,
        h,
        true,
    )?;
    drop(dxn2);
    // attention
    let mut dattn = vec![0f32; rows * qw];
    linear_backward(
        w,
        &p.o,
        Some(&mut dattn),
        &dmid,
        &c.attn,
        rows,
        grads.as_deref_mut(),
        false,
    )?;
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; rows * qw],
        vec![0f32; rows * kvw],
        vec![0f32; rows * kvw],
    );
    let scale = 1.0 / (dims.head_dim as f32).sqrt();
    let (mut none_k, mut none_v) = ([0f32; 0], [0f32; 0]);
    let (dpk, dpv, pk, pv) = match dprefix {
        Some((a, b)) => (a, b, ctx.prefix_k, ctx.prefix_v),
        None => {
            if ctx.seqs.iter().any(|s| s.prefix_len > 0) {
                return Err(super::TrainError::Invalid(
                    "block_bwd: a block that reads a shared prefix needs buffers for the prefix k/v gradient".into(),
                ));
            }
            (&mut none_k[..], &mut none_v[..], &[][..], &[][..])
        }
    };
    attention_bwd(
        &mut dq, &mut dk, &mut dv, dpk, dpv, &dattn, &c.q, &c.k, &c.v, pk, pv, &c.attn, &c.lse,
        ctx.seqs, dims, ctx.mask, scale,
    )?;
    drop(dattn);
    if let Some((ek, ev)) = extra_dkv {
        for (d, e) in dk.iter_mut().zip(ek) {
            *d += e;
        }
        for (d, e) in dv.iter_mut().zip(ev) {
            *d += e;
        }
    }
    rope_bwd(
        &mut dq,
        ctx.cos,
        ctx.sin,
        rows,
        dims.num_heads,
        dims.head_dim,
    )?;
    rope_bwd(
        &mut dk,
        ctx.cos,
        ctx.sin,
        rows,
        dims.num_kv_heads,
        dims.head_dim,
    )?;
    let mut dxn1 = vec![0f32; rows * h];
    linear_backward(
        w,
        &p.v,
        Some(&mut dxn1),
        &dv,
        &c.xn1,
        rows,
        grads.as_deref_mut(),
        false,
    )?;
    linear_backward(
        w,
        &p.k,
        Some(&mut dxn1),
        &dk,
        &c.xn1,
        rows,
        grads.as_deref_mut(),
        true,
    )?;
    linear_backward(
        w,
        &p.q,
        Some(&mut dxn1),
        &dq,
        &c.xn1,
        rows,
        grads.as_deref_mut(),
        true,
    )?;
    drop((dq, dk, dv));
    comm.all_reduce_sum(&mut dxn1)?;
    let dnorm1 = grads.map(|g| grad_of(w, g, p.norm1));
    rmsnorm_bwd(
        &mut dmid,
        dnorm1,
        &dxn1,
        &c.x_in,
        w.get(p.norm1),
        &c.rstd1,
        rows,
        h,
        true,
    )?;
    Ok(dmid)
}
