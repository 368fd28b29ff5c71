//! The [`Work`] of every op, per rank, from the job's shapes: FLOPs (2 per multiply-add), HBM
//! bytes, sequential layer passes, host and network bytes.
//!
//! Counting rules (one place, so that every op is counted alike):
//! - a text-model forward over `T` tokens does `2 T W` FLOPs for the `W` parameters of its
//!   layers' matmuls, `4 d` per (query, key) pair per layer for attention (`d` = heads x head
//!   dim: QK^T and AV), and `2 h V` per token whose logits it needs (log-probs, sampling);
//! - bytes: the weights once per pass, each layer's activations in and out (`(10 h + 4 f)`
//!   elements per token and layer), KV written or read, fp32 logits written and read;
//! - backward is twice the forward's FLOPs, plus the forward again of the layers that kept
//!   only their input (the plan's kept activation layers; prompt rows always);
//! - tensor parallelism divides FLOPs and sharded bytes by the TP degree and adds two
//!   all-reduces of the hidden state per layer and pass (`2 (tp-1)/tp` of it crosses the link);
//! - the vision tower: patch embedding, blocks with window attention over
//!   `(window_size / patch_size)^2` patches (capped at a frame) and full attention over a frame
//!   in the full-attention blocks, then the merger over `patches / merge^2` tokens.
//!
//! Response-dependent work uses the expected length and squared length of the response
//! distribution (see [`crate::lengths`]).

use crate::lengths::Lengths;
use crate::shapes::Shapes;
use rollplex_plan::spec::JobSpec;
use rollplex_plan::work::Work;

/// `w` with every amount rounded to a whole number (plans print integers; the error is far
/// below the model's).
pub fn rounded(w: &Work) -> Work {
    w.scaled(1.0)
}

/// Work formulas of one job.
pub struct Workload<'a> {
    pub spec: &'a JobSpec,
    pub shapes: &'a Shapes,
    pub lengths: &'a Lengths,
}

fn allreduce(bytes: f64, tp: u32) -> f64 {
    if tp <= 1 {
        0.0
    } else {
        2.0 * (tp as f64 - 1.0) / tp as f64 * bytes
    }
}

impl Workload<'_> {
    fn t(&self) -> &rollplex_plan::spec::TextDims {
        &self.spec.actor.text
    }

    /// Matmul parameters of the text layers (all layers).
    pub fn text_layer_params(&self) -> f64 {
        let t = self.t();
        let (h, f) = (t.hidden_size as f64, t.intermediate_size as f64);
        let hd = t.head_dim() as f64;
        let (nq, nkv) = (t.num_heads as f64, t.num_kv_heads as f64);
        t.num_layers as f64 * (h * nq * hd + 2.0 * h * nkv * hd + nq * hd * h + 3.0 * h * f)
    }

    fn attn_width(&self) -> f64 {
        let t = self.t();
        (t.num_heads * t.head_dim()) as f64
    }

    fn layers(&self) -> f64 {
        self.t().num_layers as f64
    }

    fn text_weight_bytes(&self) -> f64 {
        self.shapes.params.text as f64 * self.shapes.dtype_bytes as f64
    }

    fn act_io_per_token(&self) -> f64 {
        let t = self.t();
        (10.0 * t.hidden_size as f64 + 4.0 * t.intermediate_size as f64)
            * self.shapes.dtype_bytes as f64
            * self.layers()
    }

    fn logits_flops(&self, tokens: f64) -> f64 {
        let t = self.t();
        2.0 * t.hidden_size as f64 * t.vocab_size as f64 * tokens
    }

    fn logits_bytes(&self, tokens: f64) -> f64 {
        // fp32 logits written and read back (log-softmax, gather).
        2.0 * 4.0 * self.t().vocab_size as f64 * tokens
    }

    fn hidden_bytes(&self, tokens: f64) -> f64 {
        self.t().hidden_size as f64 * self.shapes.dtype_bytes as f64 * tokens
    }

    /// Vision tower and merger over `items` media items (with grad: x3 FLOPs when `backward`).
    pub fn vision(&self, items: f64, tp: u32) -> Work {
        let v = &self.spec.actor.vision;
        let sh = self.shapes;
        let n = sh.patches_per_item as f64 * items;
        if n == 0.0 {
            return Work::default();
        }
        let (vh, vi) = (v.hidden_size as f64, v.intermediate_size as f64);
        let patch_in = v.patch_dim() as f64;
        let frame = (sh.grid.1 as f64 * sh.grid.2 as f64).max(1.0);
        let win = ((v.window_size / v.patch_size.max(1)) as f64)
            .powi(2)
            .min(frame);
        let full_blocks = v
            .fullatt_block_indexes
            .iter()
            .filter(|&&b| b < v.depth)
            .count() as f64;
        let win_blocks = v.depth as f64 - full_blocks;
        let lin = 2.0 * n * (patch_in * vh + v.depth as f64 * (4.0 * vh * vh + 3.0 * vh * vi));
        let attn = 4.0 * vh * n * (win_blocks * win + full_blocks * frame);
        let m2 = (v.spatial_merge_size as f64).powi(2);
        let mh = vh * m2;
        let merged = n / m2;
        let merger = 2.0 * merged * (mh * mh + mh * v.out_hidden_size as f64);
        let tpf = tp.max(1) as f64;
        let b = sh.dtype_bytes as f64;
        let weights = (sh.params.vision + sh.params.merger) as f64 * b;
        let acts = n * v.depth as f64 * (10.0 * vh + 4.0 * vi) * b;
        Work {
            flops: (lin + attn + merger) / tpf,
            bytes: (weights + acts) / tpf + merged * v.out_hidden_size as f64 * b,
            steps: v.depth,
            host_bytes: n * patch_in * b,
            net_bytes: allreduce(2.0 * v.depth as f64 * n * vh * b, tp),
            parts: Vec::new(),
        }
    }

    /// The vision tower's and merger's backward over `items` media items as the trainers run
    /// it: each block's forward again from its kept input, then the backward (twice the
    /// forward's FLOPs), so three forwards' FLOPs and bytes, and two passes over the blocks.
    pub fn vision_backward(&self, items: f64, tp: u32) -> Work {
        let f = self.vision(items, tp);
        Work {
            flops: 3.0 * f.flops,
            bytes: 3.0 * f.bytes,
            steps: 2 * f.steps,
            host_bytes: 0.0,
            net_bytes: 3.0 * f.net_bytes,
            parts: Vec::new(),
        }
    }

    /// Text forward over the prompts of `seqs` sequences of `p` tokens each (causal), writing
    /// their KV; `logit_tokens` positions get logits.
    pub fn prefix(&self, seqs: f64, tp: u32, logit_tokens: f64) -> Work {
        let p = self.shapes.prompt_tokens as f64;
        let tokens = seqs * p;
        let tpf = tp.max(1) as f64;
        let flops = 2.0 * tokens * self.text_layer_params()
            + 4.0 * self.attn_width() * self.layers() * seqs * p * (p + 1.0) / 2.0
            + self.logits_flops(logit_tokens);
        let kv = tokens * self.shapes.kv_bytes_per_token as f64;
        Work {
            flops: flops / tpf,
            bytes: (self.text_weight_bytes()
                + tokens * self.act_io_per_token()
                + kv
                + self.logits_bytes(logit_tokens))
                / tpf,
            steps: self.t().num_layers,
            host_bytes: 0.0,
            net_bytes: allreduce(2.0 * self.layers() * self.hidden_bytes(tokens), tp),
            parts: Vec::new(),
        }
    }

    /// The prompt rows of a training micro-batch's `groups` groups (`copies` prompt forwards a
    /// group), as its backward recomputes them: [`Workload::prefix`]'s work, one layer pass per
    /// group, since the trainers run each group's prompt rows as a call of their own (a group's
    /// bits never depend on how many share its micro-batch).
    pub fn micro_batch_prompts(&self, groups: u32, copies: u32, tp: u32) -> Work {
        let mut w = self.prefix(groups as f64 * copies as f64, tp, 0.0);
        w.steps *= groups;
        w
    }

    /// Text forward over the responses of `samples` samples attending to a kept prefix of
    /// `prefix_tokens` (per sample), with logits for every response token.
    pub fn suffix(&self, samples: f64, tp: u32) -> Work {
        let p = self.shapes.prompt_tokens as f64;
        let (el, el2) = (self.lengths.mean(), self.lengths.mean_sq());
        let tokens = samples * el;
        let tpf = tp.max(1) as f64;
        let flops = 2.0 * tokens * self.text_layer_params()
            + 4.0 * self.attn_width() * self.layers() * samples * (el * p + (el2 + el) / 2.0)
            + self.logits_flops(tokens);
        let kv_read = samples * p * self.shapes.kv_bytes_per_token as f64;
        Work {
            flops: flops / tpf,
            bytes: (self.text_weight_bytes()
                + tokens * self.act_io_per_token()
                + kv_read
                + self.logits_bytes(tokens))
                / tpf,
            steps: self.t().num_layers,
            host_bytes: 0.0,
            net_bytes: allreduce(2.0 * self.layers() * self.hidden_bytes(tokens), tp),
            parts: Vec::new(),
        }
    }

    /// Backward of a forward `fwd` (x2 FLOPs), plus the `recomputed` share of the forward run
    /// again (its layers that kept only their input).
    pub fn backward_of(&self, fwd: &Work, recomputed: f64) -> Work {
        let k = 2.0 + recomputed.clamp(0.0, 1.0);
        Work {
            flops: fwd.flops * k,
            bytes: fwd.bytes * k,
            steps: fwd.steps * 2,
            host_bytes: 0.0,
            net_bytes: fwd.net_bytes * k,
            parts: Vec::new(),
        }
    }

    /// Decode steps `first .. first + steps` of a rollout replica with `groups` groups of `g`
    /// samples; each group's prompt KV is read once per step, with or without prefix dedup
    /// (without it the copies are computed, but they are bitwise equal and the runtime keeps
    /// the first for decode, as a prefix cache would: measured on the H200, the same window
    /// takes the same time either way).
    pub fn decode(&self, groups: f64, g: u32, first: u32, steps: u32, tp: u32) -> Work {
        let l = self.lengths;
        let p = self.shapes.prompt_tokens as f64;
        let kvt = self.shapes.kv_bytes_per_token as f64;
        let samples = groups * g as f64;
        let tpf = tp.max(1) as f64;
        let (mut flops, mut bytes, mut tokens) = (0.0, 0.0, 0.0);
        for s in first..first + steps {
            let active = samples * l.active(s);
            let resp_kv = samples * l.active_kv(s);
            let prefix_reads = groups * (1.0 - l.group_done(g, s.saturating_sub(1)));
            flops += 2.0 * active * self.text_layer_params()
                + 4.0 * self.attn_width() * self.layers() * (active * p + resp_kv)
                + self.logits_flops(active);
            bytes += self.text_weight_bytes()
                + (prefix_reads * p + resp_kv + active) * kvt
                + active * self.act_io_per_token()
                + self.logits_bytes(active);
            tokens += active;
        }
        Work {
            flops: flops / tpf,
            bytes: bytes / tpf,
            steps: steps * self.t().num_layers,
            host_bytes: tokens * 4.0,
            net_bytes: allreduce(2.0 * self.layers() * self.hidden_bytes(tokens), tp),
            parts: Vec::new(),
        }
    }

    /// One optimizer step of the distributed optimizer: the fp32 gradients of a TP shard are
    /// reduce-scattered over the `replicas` data-parallel ranks, each updates its slice (fp32
    /// master and two moments read and written, grads read), and the bf16 weights are
    /// all-gathered back.
    ///
    /// Network bytes are counted at the intra-node link's speed (the cost model's one link):
    /// when the replicas span nodes, the bytes are scaled by intra / inter-node bandwidth.
    pub fn optimizer(&self, tp: u32, replicas: u32) -> Work {
        let shard = self.shapes.trainable_params as f64 / tp.max(1) as f64;
        let r = replicas.max(1) as f64;
        let slice = shard / r;
        let c = &self.spec.cluster;
        let spans_nodes = replicas as u64 * tp as u64 > c.gpus_per_node.max(1) as u64;
        let slow = if spans_nodes && c.inter_node_bw > 0.0 {
            (c.intra_node_bw / c.inter_node_bw).max(1.0)
        } else {
            1.0
        };
        let net = if replicas <= 1 {
            0.0
        } else {
            (r - 1.0) / r * shard * (4.0 + 2.0) * slow
        };
        Work {
            flops: 12.0 * slice,
            bytes: slice * (8.0 + 16.0 + 4.0) + shard * 2.0,
            steps: 1,
            host_bytes: 0.0,
            net_bytes: net,
            parts: Vec::new(),
        }
    }

    /// Per-group reward of `g` samples: tokens to the host, one host step.
    pub fn reward(&self, g: u32) -> Work {
        Work {
            flops: 0.0,
            bytes: 0.0,
            steps: 1,
            host_bytes: g as f64 * self.lengths.mean() * 4.0,
            net_bytes: 0.0,
            parts: Vec::new(),
        }
    }

    /// Group-normalised advantages of `g` samples.
    pub fn advantages(&self, g: u32) -> Work {
        Work {
            flops: 10.0 * g as f64,
            bytes: 16.0 * g as f64,
            steps: 1,
            host_bytes: 0.0,
            net_bytes: 0.0,
            parts: Vec::new(),
        }
    }

    /// A copy of `bytes` over the network (reshard) or the host link (offload, reload).
    pub fn transfer(&self, net_bytes: f64, host_bytes: f64) -> Work {
        Work {
            flops: 0.0,
            bytes: net_bytes + host_bytes,
            steps: 1,
            host_bytes,
            net_bytes,
            parts: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::job;

    #[test]
    fn prefill_flops_near_2_n_params_per_token() {
        let spec = job(|_| {});
        let sh = Shapes::new(&spec);
        let l = Lengths::new(&spec.rollout.response_len, spec.rollout.max_new_tokens);
        let w = Workload {
            spec: &spec,
            shapes: &sh,
            lengths: &l,
        };
        let f = w.prefix(1.0, 1, 0.0).flops;
        let per_token = f / sh.prompt_tokens as f64;
        // 3B: ~2.8 B non-embedding text params -> ~5.6 GFLOP/token plus attention over ~1.2k tokens.
        let base = 2.0 * w.text_layer_params();
        assert!(
            per_token > base && per_token < 1.3 * base,
            "{per_token} vs {base}"
        );
        // TP halves the FLOPs and adds all-reduce traffic.
        let w2 = w.prefix(1.0, 2, 0.0);
        assert!((w2.flops * 2.0 - f).abs() / f < 1e-9);
        assert!(w2.net_bytes > 0.0);
    }

    #[test]
    fn decode_reads_weights_once_per_step() {
        let spec = job(|_| {});
        let sh = Shapes::new(&spec);
        let l = Lengths::new(&spec.rollout.response_len, spec.rollout.max_new_tokens);
        let w = Workload {
            spec: &spec,
            shapes: &sh,
            lengths: &l,
        };
        let one = w.decode(16.0, 8, 0, 1, 1);
        assert!(one.bytes > w.text_weight_bytes());
        let ten = w.decode(16.0, 8, 0, 10, 1);
        assert!(ten.bytes > 9.9 * one.bytes && ten.bytes < 10.5 * one.bytes);
        // One prompt KV per group: 8 samples of a group cost less than 8 groups of one.
        let per_group = w.decode(16.0, 8, 0, 1, 1).bytes - w.text_weight_bytes();
        let per_sample = w.decode(128.0, 1, 0, 1, 1).bytes - w.text_weight_bytes();
        assert!(per_group < 0.5 * per_sample, "{per_group} vs {per_sample}");
    }
}
