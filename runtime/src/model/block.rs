//! One pre-norm transformer block, shared by the vision tower and the text decoder:
//! `x += o(attn(rope(q(n1 x)), rope(k(n1 x)), v(n1 x)))`, then `x += down(silu(gate(n2 x)) * up(n2 x))`.
//! The two differ only in their weights (biases, fused qkv) and in how attention finds its keys
//! ([`Attend`]).
//!
//! A block runs on one rank's shard over a [`Communicator`]: q/k/v and gate/up are
//! column-parallel (the rank's heads and intermediate rows, no communication), o and down are
//! row-parallel: each rank multiplies its columns, the partial products are all-reduced (sum in
//! rank order), then the replicated bias is added once and the result joins the residual. Two
//! all-reduces of `[rows, H]` per block; over [`SoloComm`](crate::tp::SoloComm) they are no-ops
//! and the block is the whole model's.
//!
//! Invariant: at degree 1 the arithmetic is exactly that of `linear_fwd` with its bias (the
//! kernel adds the bias after the matmul, as the row-parallel linear does after its all-reduce).

use rollplex_kernels::cpu::{
    add_fwd, attention_decode, attention_fwd, linear_fwd, rmsnorm_fwd, rope_fwd, swiglu_fwd,
    AttnDims, AttnMask, AttnSeq, DecodeSeq,
};

use super::cache::{CacheMode, LayerCache};
use super::weights::{BlockParams, Linear, Weights};
use super::ModelError;
use crate::tp::Communicator;

/// Where a block's attention reads its keys.
pub enum Attend<'a> {
    /// A packed batch: each sequence's own rows (causal or full), plus an optional shared
    /// prefix KV of this layer (`[P, KV]`, empty for none).
    Packed {
        seqs: &'a [AttnSeq],
        mask: AttnMask,
        prefix_k: &'a [f32],
        prefix_v: &'a [f32],
    },
    /// Decode: this layer's KV arena; row `b`'s new k/v are written at arena row `write_rows[b]`
    /// before attending.
    Decode {
        k_cache: &'a mut [f32],
        v_cache: &'a mut [f32],
        seqs: &'a [DecodeSeq],
        write_rows: &'a [u32],
    },
}

/// A column-parallel (or replicated) linear: the rank's output rows, its bias part included.
pub fn linear(w: &Weights, l: &Linear, x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
    let mut y = vec![0f32; rows * l.out];
    linear_fwd(&mut y, x, w.lin_w(l), w.lin_b(l), rows, l.inp, l.out)?;
    Ok(y)
}

/// A row-parallel linear: `x` holds the rank's input columns `[rows, l.inp]`; the partial
/// products are all-reduced and the (replicated) bias added after, as `linear_fwd` adds it after
/// its matmul. Every rank gets the same `[rows, l.out]`.
pub fn row_parallel<C: Communicator>(
    comm: &C,
    w: &Weights,
    l: &Linear,
    x: &[f32],
    rows: usize,
) -> Result<Vec<f32>, ModelError> {
    let mut y = vec![0f32; rows * l.out];
    linear_fwd(&mut y, x, w.lin_w(l), None, rows, l.inp, l.out)?;
    comm.all_reduce_sum(&mut y)?;
    if let Some(b) = w.lin_b(l) {
        for row in y.chunks_mut(l.out.max(1)) {
            for (o, bi) in row.iter_mut().zip(b) {
                *o += bi;
            }
        }
    }
    Ok(y)
}

/// Runs one block in place on `x` `[rows, H]` (replicated on every rank); `dims` are the rank's
/// heads. Returns this block's k and v after RoPE (`[rows, KV]`, the rank's kv heads), which a
/// prefill keeps as the prompt's KV. With a cache, keeps what `CacheMode` says.
#[allow(clippy::too_many_arguments)]
pub fn block_fwd<C: Communicator>(
    comm: &C,
    w: &Weights,
    p: &BlockParams,
    x: &mut [f32],
    rows: usize,
    dims: AttnDims,
    eps: f32,
    cos: &[f32],
    sin: &[f32],
    attend: Attend<'_>,
    cache: Option<(CacheMode, &mut LayerCache)>,
) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let h = p.o.out;
    let full = matches!(cache, Some((CacheMode::Full, _)));
    let mut cache = cache.map(|(_, c)| c);
    if let Some(c) = cache.as_deref_mut() {
        c.x_in = x.to_vec();
    }
    let mut rstd1 = vec![0f32; rows];
    let mut xn1 = vec![0f32; rows * h];
    rmsnorm_fwd(&mut xn1, Some(&mut rstd1), x, w.get(p.norm1), rows, h, eps)?;
    let mut q = linear(w, &p.q, &xn1, rows)?;
    let mut k = linear(w, &p.k, &xn1, rows)?;
    let v = linear(w, &p.v, &xn1, rows)?;
    rope_fwd(&mut q, cos, sin, rows, dims.num_heads, dims.head_dim)?;
    rope_fwd(&mut k, cos, sin, rows, dims.num_kv_heads, dims.head_dim)?;
    let scale = 1.0 / (dims.head_dim as f32).sqrt();
    let mut attn = vec![0f32; rows * dims.q_width()];
    let mut lse = vec![0f32; rows * dims.num_heads];
    match attend {
        Attend::Packed {
            seqs,
            mask,
            prefix_k,
            prefix_v,
        } => {
            attention_fwd(
                &mut attn,
                Some(&mut lse),
                &q,
                &k,
                &v,
                prefix_k,
                prefix_v,
                seqs,
                dims,
                mask,
                scale,
            )?;
        }
        Attend::Decode {
            k_cache,
            v_cache,
            seqs,
            write_rows,
        } => {
            let kvw = dims.kv_width();
            for (b, &r) in write_rows.iter().enumerate() {
                let r = r as usize;
                if (r + 1) * kvw > k_cache.len() {
                    return Err(ModelError::Input(format!(
                        "KV arena row {r} is past its capacity"
                    )));
                }
                k_cache[r * kvw..(r + 1) * kvw].copy_from_slice(&k[b * kvw..(b + 1) * kvw]);
                v_cache[r * kvw..(r + 1) * kvw].copy_from_slice(&v[b * kvw..(b + 1) * kvw]);
            }
            attention_decode(
                &mut attn,
                Some(&mut lse),
                &q,
                k_cache,
                v_cache,
                seqs,
                dims,
                scale,
            )?;
        }
    }
    let o = row_parallel(comm, w, &p.o, &attn, rows)?;
    add_fwd(x, &o)?;
    if full {
        if let Some(c) = cache.as_deref_mut() {
            c.x_mid = x.to_vec();
        }
    }
    let mut rstd2 = vec![0f32; rows];
    let mut xn2 = vec![0f32; rows * h];
    rmsnorm_fwd(&mut xn2, Some(&mut rstd2), x, w.get(p.norm2), rows, h, eps)?;
    let gate = linear(w, &p.gate, &xn2, rows)?;
    let up = linear(w, &p.up, &xn2, rows)?;
    let mut act = vec![0f32; gate.len()];
    swiglu_fwd(&mut act, &gate, &up)?;
    let down = row_parallel(comm, w, &p.down, &act, rows)?;
    add_fwd(x, &down)?;
    if full {
        if let Some(c) = cache {
            c.rstd1 = rstd1;
            c.xn1 = xn1;
            c.q = q;
            c.k = k.clone();
            c.v = v.clone();
            c.attn = attn;
            c.lse = lse;
            c.rstd2 = rstd2;
            c.xn2 = xn2;
            c.gate = gate;
            c.up = up;
            c.act = act;
        }
    }
    Ok((k, v))
}
