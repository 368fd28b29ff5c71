//! One tensor-parallel transformer block (vision block or text layer), as `model::block` but
//! over a rank's shard: q/k/v and gate/up are column-parallel (the rank's heads and intermediate
//! rows, no communication), o and down are row-parallel: each rank multiplies its columns, the
//! partial products are all-reduced (sum in rank order), then the replicated bias is added once
//! and the result joins the residual. Two all-reduces of `[rows, H]` per block.
//!
//! Invariant: at degree 1 the arithmetic is exactly `model::block::block_fwd`'s.

use rollplex_kernels::cpu::{
    add_fwd, attention_decode, attention_fwd, linear_fwd, rmsnorm_fwd, rope_fwd, swiglu_fwd,
    AttnDims,
};

use crate::model::block::Attend;
use crate::model::weights::{BlockParams, Linear, Weights};
use crate::model::{LayerCache, ModelError};

use super::comm::Communicator;
use super::TpError;

/// A column-parallel (or replicated) linear: the rank's output rows, its bias part included.
pub fn column(w: &Weights, l: &Linear, x: &[f32], rows: usize) -> Result<Vec<f32>, TpError> {
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
) -> Result<Vec<f32>, TpError> {
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
/// local heads. Returns the rank's k and v after RoPE (`[rows, local KV]`). With a cache, keeps
/// every activation backward needs (as `CacheMode::Full`; widths are the rank's).
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
    cache: Option<&mut LayerCache>,
) -> Result<(Vec<f32>, Vec<f32>), TpError> {
    let h = p.o.out;
    let x_in = cache.is_some().then(|| x.to_vec());
    let mut xn1 = vec![0f32; rows * h];
    let mut rstd1 = vec![0f32; rows];
    rmsnorm_fwd(&mut xn1, Some(&mut rstd1), x, w.get(p.norm1), rows, h, eps)?;
    let mut q = column(w, &p.q, &xn1, rows)?;
    let mut k = column(w, &p.k, &xn1, rows)?;
    let v = column(w, &p.v, &xn1, rows)?;
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
        } => attention_fwd(
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
        )?,
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
                    return Err(TpError::Model(ModelError::Input(format!(
                        "KV arena row {r} is past its capacity"
                    ))));
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
    let x_mid = cache.is_some().then(|| x.to_vec());
    let mut xn2 = vec![0f32; rows * h];
    let mut rstd2 = vec![0f32; rows];
    rmsnorm_fwd(&mut xn2, Some(&mut rstd2), x, w.get(p.norm2), rows, h, eps)?;
    let gate = column(w, &p.gate, &xn2, rows)?;
    let up = column(w, &p.up, &xn2, rows)?;
    let mut act = vec![0f32; gate.len()];
    swiglu_fwd(&mut act, &gate, &up)?;
    let down = row_parallel(comm, w, &p.down, &act, rows)?;
    add_fwd(x, &down)?;
    if let Some(c) = cache {
        *c = LayerCache {
            x_in: x_in.unwrap_or_default(),
            rstd1,
            xn1,
            q,
            k: k.clone(),
            v: v.clone(),
            attn,
            lse,
            x_mid: x_mid.unwrap_or_default(),
            rstd2,
            xn2,
            gate,
            up,
            act,
        };
    }
    Ok((k, v))
}
