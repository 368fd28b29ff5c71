//! Backward of the tensor-parallel text decoder (and [`TpModel::block_bwd`], which the vision
//! tower's backward in `super::vision` shares): the gradient of `Σ dlogp_t · log p(token_t)`
//! over a packed batch of token sequences (text only, causal, no shared prefix) with respect to
//! this rank's shard. `dlogp` is what a policy loss hands back (`train::loss`), so a TP trainer
//! computes the loss on replicated log-probs and calls this.
//!
//! The conjugate collectives of the forward:
//! - vocab-parallel head: each rank's `dlogits` come from the global log-sum-exp (kept from the
//!   forward); `d xn = Σ_ranks dlogits_r W_r` is all-reduced;
//! - row-parallel o/down (forward: all-reduce): the output gradient is replicated, so each rank
//!   gets its input columns' gradient with no communication, and the replicated bias gradient is
//!   computed identically on every rank;
//! - column-parallel q/k/v, gate/up (forward: no communication): the input gradient is a sum of
//!   the ranks' partial products, all-reduced;
//! - replicated kv heads (kv heads < degree): the ranks holding one head add their weight and
//!   bias gradients (an all-reduce over a buffer with one slot per kv head);
//! - vocab-parallel embedding: each rank adds the rows of the ids it owns.
//!
//! Invariant: every replicated parameter's gradient is bitwise equal on every rank (it is
//! computed from replicated values only), so `TpPlan::unshard` of the gradients succeeds and
//! gives the full gradient in Hugging Face layout. Gradients are *added* into `grads`.

use rollplex_kernels::cpu::{
    attention_bwd, embedding_bwd, linear_fwd, rmsnorm_bwd, rmsnorm_fwd, rope_bwd, swiglu_bwd,
    AttnDims, AttnMask, AttnSeq,
};

use crate::model::block::Attend;
use crate::model::positions::mrope_tables;
use crate::model::weights::{BlockParams, Linear};
use crate::model::{LayerCache, ModelError, ParamId, Weights};
use crate::train::block_bwd::{grad_of, linear_backward};

use super::comm::Communicator;
use super::{TpError, TpModel};

pub(crate) fn input(msg: String) -> TpError {
    TpError::Model(ModelError::Input(msg))
}

impl TpModel {
    /// Forward and backward of a packed batch of text sequences on this rank. Sequence `s` of
    /// length `n` scores its tokens `1..n` (row `j` predicts token `j + 1`); `dlogp` holds the
    /// loss gradient of those log-probs, sequences in order (`Σ (n_s - 1)` values, the same on
    /// every rank). Returns the log-probs (equal on every rank) and adds this rank's gradients
    /// into `grads` (`weights.table.total()` elements).
    pub fn text_forward_backward<C: Communicator>(
        &self,
        comm: &C,
        seqs: &[&[u32]],
        dlogp: &[f32],
        temperature: f32,
        grads: &mut [f32],
    ) -> Result<Vec<f32>, TpError> {
        self.check_comm(comm)?;
        let w = &self.weights;
        let lay = &w.layout;
        let t = self.plan.config.text();
        let (h, hd) = (t.hidden_size as usize, t.head_dim() as usize);
        let eps = t.rms_norm_eps as f32;
        if grads.len() != w.table.total() {
            return Err(input(format!(
                "gradient buffer has {} elements, rank {}'s shard {}",
                grads.len(),
                self.rank,
                w.table.total()
            )));
        }
        // ---- inputs ----
        let (mut ids, mut targets, mut aseqs) = (Vec::new(), Vec::new(), Vec::new());
        let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for s in seqs {
            if s.len() < 2 {
                return Err(input(
                    "text_forward_backward: every sequence needs at least 2 tokens".into(),
                ));
            }
            let n = s.len() - 1;
            aseqs.push(AttnSeq {
                start: ids.len() as u32,
                len: n as u32,
                prefix_start: 0,
                prefix_len: 0,
            });
            for j in 0..n {
                ids.push(s[j]);
                targets.push(s[j + 1]);
                for q in pos.iter_mut() {
                    q.push(j as i64);
                }
            }
        }
        let rows = ids.len();
        if dlogp.len() != rows {
            return Err(input(format!(
                "dlogp has {} values, the sequences score {rows} tokens",
                dlogp.len()
            )));
        }
        // ---- forward, keeping activations ----
        let mut x = self.embed(comm, &ids)?;
        let (cos, sin) = mrope_tables(&pos, hd, t.rope_theta, t.mrope_section);
        let dims = self.local_dims();
        let mut caches = Vec::with_capacity(lay.text_layers.len());
        for lp in &lay.text_layers {
            let mut c = LayerCache::default();
            let attend = Attend::Packed {
                seqs: &aseqs,
                mask: AttnMask::Causal,
                prefix_k: &[],
                prefix_v: &[],
            };
            super::block::block_fwd(
                comm,
                w,
                lp,
                &mut x,
                rows,
                dims,
                eps,
                &cos,
                &sin,
                attend,
                Some(&mut c),
            )?;
            caches.push(c);
        }
        let mut xn = vec![0f32; rows * h];
        let mut rstd = vec![0f32; rows];
        rmsnorm_fwd(
            &mut xn,
            Some(&mut rstd),
            &x,
            w.get(lay.final_norm),
            rows,
            h,
            eps,
        )?;
        let vl = self.dims().vocab.len();
        let mut logits = vec![0f32; rows * vl];
        linear_fwd(&mut logits, &xn, w.get(lay.lm_head), None, rows, h, vl)?;
        let (logp, _, lse) = self.vocab_logprobs_lse(comm, &logits, &targets, temperature)?;

        // replicated kv heads: this call's k/v gradients are summed over the replicas below, so
        // the gradient already in `grads` is set aside and added back after the sum
        let kv_prior = self.kv_set_aside(grads);

        // ---- head backward (vocab-parallel) ----
        let range = self.dims().vocab.clone();
        let tt = temperature as f64;
        let mut dlogits = vec![0f32; rows * vl];
        for r in 0..rows {
            let gl = dlogp[r] as f64;
            let xr = &logits[r * vl..(r + 1) * vl];
            for (j, (o, v)) in dlogits[r * vl..(r + 1) * vl].iter_mut().zip(xr).enumerate() {
                let z = *v as f64 / tt;
                let p = (z - lse[r]).exp();
                let onehot = if range.start + j == targets[r] as usize {
                    1.0
                } else {
                    0.0
                };
                *o = ((gl * (onehot - p)) / tt) as f32;
            }
        }
        drop(logits);
        let head = Linear {
            w: lay.lm_head,
            b: None,
            out: vl,
            inp: h,
            row0: 0,
        };
        let mut dxn = vec![0f32; rows * h];
        linear_backward(
            w,
            &head,
            Some(&mut dxn),
            &dlogits,
            &xn,
            rows,
            Some(&mut *grads),
            false,
        )
        .map_err(train_err)?;
        drop(dlogits);
        comm.all_reduce_sum(&mut dxn)?;
        let mut dx = vec![0f32; rows * h];
        rmsnorm_bwd(
            &mut dx,
            Some(grad_of(w, grads, lay.final_norm)),
            &dxn,
            &x,
            w.get(lay.final_norm),
            &rstd,
            rows,
            h,
            false,
        )?;
        // ---- layers, last to first ----
        let ctx = BwdCtx {
            seqs: &aseqs,
            mask: AttnMask::Causal,
            dims: self.local_dims(),
            cos: &cos,
            sin: &sin,
            prefix_k: &[],
            prefix_v: &[],
        };
        for (l, lp) in lay.text_layers.iter().enumerate().rev() {
            dx = self.block_bwd(comm, lp, &caches[l], rows, &ctx, &dx, None, None, grads)?;
        }
        // ---- embedding (vocab-parallel): the rows of the ids this rank owns ----
        let (mut own_ids, mut own_dx) = (Vec::new(), Vec::new());
        for (i, &id) in ids.iter().enumerate() {
            if range.contains(&(id as usize)) {
                own_ids.push(id - range.start as u32);
                own_dx.extend_from_slice(&dx[i * h..(i + 1) * h]);
            }
        }
        embedding_bwd(grad_of(w, grads, lay.embed), &own_dx, &own_ids, h)?;
        self.kv_sum_replicas(comm, kv_prior, grads)?;
        Ok(logp)
    }

    /// Backward of one TP block (forward: `super::block::block_fwd`), text layer or vision
    /// block; returns the input's gradient (replicated).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block_bwd<C: Communicator>(
        &self,
        comm: &C,
        p: &BlockParams,
        c: &LayerCache,
        rows: usize,
        ctx: &BwdCtx<'_>,
        dy: &[f32],
        extra_dkv: Option<(&[f32], &[f32])>,
        dprefix: Option<(&mut [f32], &mut [f32])>,
        grads: &mut [f32],
    ) -> Result<Vec<f32>, TpError> {
        let w: &Weights = &self.weights;
        let (seqs, cos, sin) = (ctx.seqs, ctx.cos, ctx.sin);
        let h = p.o.out;
        let f = p.gate.out;
        let dims = ctx.dims;
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let lb = |l: &Linear,
                  dx: &mut [f32],
                  dy: &[f32],
                  x: &[f32],
                  g: &mut [f32],
                  acc: bool|
         -> Result<(), TpError> {
            linear_backward(w, l, Some(dx), dy, x, rows, Some(g), acc).map_err(train_err)
        };
        // MLP: down is row-parallel (dy replicated: local columns, no communication)
        let mut dact = vec![0f32; rows * f];
        lb(&p.down, &mut dact, dy, &c.act, grads, false)?;
        let (mut dgate, mut dup) = (vec![0f32; rows * f], vec![0f32; rows * f]);
        swiglu_bwd(&mut dgate, &mut dup, &dact, &c.gate, &c.up)?;
        drop(dact);
        // gate/up column-parallel: partial input gradients, all-reduced
        let mut dxn2 = vec![0f32; rows * h];
        lb(&p.up, &mut dxn2, &dup, &c.xn2, grads, false)?;
        lb(&p.gate, &mut dxn2, &dgate, &c.xn2, grads, true)?;
        drop((dgate, dup));
        comm.all_reduce_sum(&mut dxn2)?;
        let mut dmid = dy.to_vec();
        rmsnorm_bwd(
            &mut dmid,
            Some(grad_of(w, grads, p.norm2)),
            &dxn2,
            &c.x_mid,
            w.get(p.norm2),
            &c.rstd2,
            rows,
            h,
            true,
        )?;
        drop(dxn2);
        // attention: o row-parallel, heads local
        let mut dattn = vec![0f32; rows * qw];
        lb(&p.o, &mut dattn, &dmid, &c.attn, grads, false)?;
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; rows * qw],
            vec![0f32; rows * kvw],
            vec![0f32; rows * kvw],
        );
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let (mut none_k, mut none_v) = ([0f32; 0], [0f32; 0]);
        let (dpk, dpv) = match dprefix {
            Some((a, b)) => (a, b),
            None => {
                if seqs.iter().any(|s| s.prefix_len > 0) {
                    return Err(input(
                        "block_bwd: a block that reads a shared prefix needs buffers for the \
                         prefix k/v gradient"
                            .into(),
                    ));
                }
                (&mut none_k[..], &mut none_v[..])
            }
        };
        attention_bwd(
            &mut dq,
            &mut dk,
            &mut dv,
            dpk,
            dpv,
            &dattn,
            &c.q,
            &c.k,
            &c.v,
            ctx.prefix_k,
            ctx.prefix_v,
            &c.attn,
            &c.lse,
            seqs,
            dims,
            ctx.mask,
            scale,
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
        rope_bwd(&mut dq, cos, sin, rows, dims.num_heads, dims.head_dim)?;
        rope_bwd(&mut dk, cos, sin, rows, dims.num_kv_heads, dims.head_dim)?;
        let mut dxn1 = vec![0f32; rows * h];
        lb(&p.v, &mut dxn1, &dv, &c.xn1, grads, false)?;
        lb(&p.k, &mut dxn1, &dk, &c.xn1, grads, true)?;
        lb(&p.q, &mut dxn1, &dq, &c.xn1, grads, true)?;
        drop((dq, dk, dv));
        comm.all_reduce_sum(&mut dxn1)?;
        rmsnorm_bwd(
            &mut dmid,
            Some(grad_of(w, grads, p.norm1)),
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

    /// With replicated kv heads: takes the k/v gradients already in `grads` out (zeroing them),
    /// so that [`TpModel::kv_sum_replicas`] sums only this pass's replicas.
    pub(crate) fn kv_set_aside(&self, grads: &mut [f32]) -> Vec<(ParamId, Vec<f32>)> {
        if !self.plan.kv_replicated {
            return Vec::new();
        }
        let w = &self.weights;
        w.layout
            .text_layers
            .iter()
            .flat_map(|lp| [lp.k.w, lp.v.w].into_iter().chain(lp.k.b).chain(lp.v.b))
            .map(|id| {
                let g = grad_of(w, grads, id);
                let p = g.to_vec();
                g.fill(0.0);
                (id, p)
            })
            .collect()
    }

    /// Sums this pass's k/v gradients over the ranks holding the same kv head, then adds back
    /// what [`TpModel::kv_set_aside`] took out.
    pub(crate) fn kv_sum_replicas<C: Communicator>(
        &self,
        comm: &C,
        prior: Vec<(ParamId, Vec<f32>)>,
        grads: &mut [f32],
    ) -> Result<(), TpError> {
        for (id, p) in prior {
            self.sum_kv_replicas(comm, id, grads)?;
            for (g, p) in grad_of(&self.weights, grads, id).iter_mut().zip(p) {
                *g += p;
            }
        }
        Ok(())
    }

    /// Adds the gradients of a replicated kv-head parameter (k/v weight or bias, one kv head
    /// per rank) over the ranks that hold the same head: an all-reduce of a buffer with one slot
    /// per kv head, each rank filling its head's slot (zeros elsewhere; adding zeros is exact).
    fn sum_kv_replicas<C: Communicator>(
        &self,
        comm: &C,
        id: ParamId,
        grads: &mut [f32],
    ) -> Result<(), TpError> {
        let t = self.plan.config.text();
        let (nq, nkv) = (t.num_heads as usize, t.num_kv_heads as usize);
        let head = self.rank * (nq / self.plan.degree) / (nq / nkv);
        let g = grad_of(&self.weights, grads, id);
        let n = g.len();
        let mut all = vec![0f32; n * nkv];
        all[head * n..(head + 1) * n].copy_from_slice(g);
        comm.all_reduce_sum(&mut all)?;
        g.copy_from_slice(&all[head * n..(head + 1) * n]);
        Ok(())
    }
}

/// How a block's attention ran: its sequences, mask, the rank's heads and the RoPE tables.
pub(crate) struct BwdCtx<'a> {
    pub seqs: &'a [AttnSeq],
    pub mask: AttnMask,
    pub dims: AttnDims,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// This layer's shared prefix k/v (the rank's kv heads; empty for none).
    pub prefix_k: &'a [f32],
    pub prefix_v: &'a [f32],
}

pub(crate) fn train_err(e: crate::train::TrainError) -> TpError {
    match e {
        crate::train::TrainError::Kernel(k) => TpError::Kernel(k),
        crate::train::TrainError::Model(m) => TpError::Model(m),
        other => TpError::Config(other.to_string()),
    }
}
