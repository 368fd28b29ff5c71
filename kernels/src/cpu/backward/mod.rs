//! Backward passes of the CPU ops: for each forward op `x_fwd`, `x_bwd` takes the gradient of
//! its output and returns the gradients of its inputs and parameters.
//!
//! | op | gradients | forward |
//! |---|---|---|
//! | `linear_bwd` | `dx = dy W`, `dW += dyᵀ x`, `db += Σ_rows dy` | `linear_fwd` |
//! | `rmsnorm_bwd` | `dx = r (g - x̂ mean(g x̂))` with `g = dy w`, `dw += Σ_rows dy x̂` | `rmsnorm_fwd` |
//! | `rope_bwd` | the transposed rotation, in place | `rope_fwd` |
//! | `swiglu_bwd`, `gelu_bwd`, `gelu_tanh_bwd` | elementwise | `swiglu_fwd`, `gelu_fwd` (tanh: the CUDA kernel's mode) |
//! | `embedding_bwd` | `dtable[ids[t]] += dout[t]` | `embedding_fwd` |
//! | `attention_bwd` | `dq`, `dk`, `dv`, and `dprefix_k/v +=` (shared prefix) | `attention_fwd` |
//! | `logprobs_bwd` | `dlogits` from `dlogp` (and `dentropy`) | `logprobs_fwd` |
//!
//! Conventions: activation gradients (`dx`, `dq`, ...) are written (`=`), or added when the op
//! says so; parameter gradients (`dw`, `db`, `dtable`, `dprefix_*`) are always *added* (`+=`),
//! because one parameter gathers gradient from several uses (tied embeddings, the fused vision
//! qkv, the G samples of a group over one prefix).
//!
//! Invariant: deterministic. Every sum runs in a fixed order that depends only on the shapes and
//! the sequence layout: parallel loops split over *outputs* (rows, columns, key rows), never
//! reduce across threads. Attention backward recomputes probabilities from the forward's
//! log-sum-exp (flash-attention style) in two passes: query-centric for `dq`, key-centric for
//! `dk`/`dv` (each key row sums over the queries that see it in ascending order; a shared
//! prefix row sums over sequences, then heads, then queries, all ascending).
//!
//! Files: `linear.rs`, `norm.rs`, `rope.rs`, `act.rs` (activations and the embedding),
//! `logprobs.rs`, `attention.rs`; each tests its op against central finite differences of an
//! f64 forward (`fd`).

mod act;
mod attention;
mod linear;
mod logprobs;
mod norm;
mod rope;

pub use act::{embedding_bwd, gelu_bwd, gelu_tanh_bwd, swiglu_bwd};
pub use attention::attention_bwd;
pub use linear::linear_bwd;
pub use logprobs::logprobs_bwd;
pub use norm::rmsnorm_bwd;
pub use rope::rope_bwd;

use rayon::prelude::*;

/// Elements per rayon task in elementwise ops.
const PAR_CHUNK: usize = 1 << 14;
/// Columns per rayon task in column reductions (bias and norm-weight gradients).
const COL_CHUNK: usize = 64;

/// `out[j] += Σ_r f(r, j)` for `r = 0..rows` in order, summed in f64; parallel over columns.
fn column_sums_add(out: &mut [f32], f: impl Fn(usize, usize) -> f64 + Sync, rows: usize) {
    out.par_chunks_mut(COL_CHUNK)
        .enumerate()
        .for_each(|(c, o)| {
            let j0 = c * COL_CHUNK;
            let mut acc = vec![0f64; o.len()];
            for r in 0..rows {
                for (jj, a) in acc.iter_mut().enumerate() {
                    *a += f(r, j0 + jj);
                }
            }
            for (o, a) in o.iter_mut().zip(acc) {
                *o = (*o as f64 + a) as f32;
            }
        });
}

#[cfg(test)]
pub(crate) mod fd {
    //! Each backward against central finite differences of an f64 forward, on fresh random
    //! inputs: `L = Σ c ⊙ f(inputs)` with random `c`, so `dL/dinput` is exactly what the
    //! backward computes for `dy = c`.

    const H: f64 = 1e-6;

    pub fn to64(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// Central differences of the scalar `f` with respect to every element of `x`.
    pub fn fd(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
        let mut x = x.to_vec();
        (0..x.len())
            .map(|i| {
                let v = x[i];
                x[i] = v + H;
                let a = f(&x);
                x[i] = v - H;
                let b = f(&x);
                x[i] = v;
                (a - b) / (2.0 * H)
            })
            .collect()
    }

    pub fn dotc(c: &[f32], y: &[f64]) -> f64 {
        c.iter().zip(y).map(|(c, y)| *c as f64 * y).sum()
    }
}
