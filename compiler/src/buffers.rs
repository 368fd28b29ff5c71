//! Buffers: every tensor an iteration keeps beyond one task, with its size per rank, and which
//! tasks read and write it; plus each task's transient working set (`scratch`).
//!
//! Table (per rank; `n` prompts of a replica, `g` group size, `P` prompt tokens, `R` max new
//! tokens, `c` copies of each prefix (1 with dedup, `g` without)):
//!
//! | buffer | bytes | written by | read by |
//! |---|---|---|---|
//! | `actor_weights` | params x dtype / train TP | optimizer | everything of the actor |
//! | `rollout_weights` | the part of the rollout shard not in the training shard | weight sync | encode, prefill, decode |
//! | `ref_weights` | as `actor_weights` | (frozen) | reference prefix/suffix |
//! | `master_weights`, `adam_moments` | trainable x 4, x 8 / training ranks | optimizer | optimizer |
//! | `grads.sS` | trainable x 4 / train TP | micro-batches of step S | optimizer step S |
//! | `vision_emb` | c n x media tokens x out hidden x dtype | encode | prefill, prefixes (tower and merger frozen) |
//! | `kv.prompt` | c n P x KV/token / rollout TP | prefill | decode |
//! | `kv.response` | n g R x KV/token / rollout TP | prefill, decode | decode |
//! | `samples` | n g R x 4 (token ids, lengths, slot table) | prefill, decode | tail tasks |
//! | `ref_prefix_kv`, `old_prefix_kv` | c n P x KV/token / train TP | prefixes | suffixes |
//! | `train_prefix.sS` | c n P x (kept bytes/token + KV/token) (+ n x the vision inputs kept when the tower or merger trains) | actor prefix of step S (step 0: the prefill, where it keeps the training forward) | its micro-batches |
//! | `ref_logprobs`, `old_logprobs` | n g R x 4 | suffixes | micro-batches |
//! | `scalars` | n g x 8 (rewards, advantages) | reward, advantages | micro-batches |
//!
//! `old_prefix_kv` and `old_logprobs` exist only with an old-log-prob pass
//! (`OldLogProbSource::Pass`); without one the micro-batches' own log-probs are the old ones.
//!
//! Every buffer has its [`BufferRole`] (the display names above are for people; the runtime
//! and the later passes go by role). Every size allows the runtime's alignment of each tensor
//! it places in the buffer ([`placed_bytes`]: it puts each buffer's tensors at the plan's
//! offset, each aligned).
//!
//! Kept bytes per token follow the kept activation layers ([`crate::shapes::kept_act_bytes_per_token`]:
//! a micro-batch's suffix keeps every activation of the first [`PhaseGraph::kept`]`.suffix`
//! layers and the input of the others; a kept prompt forward keeps every activation of the
//! first `kept.prompt` layers and the input of the others, and every layer's K/V);
//! activations kept for backward are split across the TP group (sequence parallelism).
//! Sizes that depend on response length use the maximum (`max_new_tokens`): the arena is
//! static, so every size is an upper bound.
//!
//! Invariant: every buffer a node names exists and lives on the node's GPU program.

use crate::ir::{LBufId, LogicalBuffer, Offload, PhaseGraph};
use crate::shapes::{
    kept_act_bytes_per_token, kept_act_bytes_per_token_layer, transient_bytes_per_token,
    KEPT_ACT_TENSORS,
};
use rollplex_plan::spec::{MediaSpec, Mode};
use rollplex_plan::{
    placed_bytes, BufferRole, GpuId, OldLogProbSource, Op, Purpose, TrainPrefixSource,
};

/// Parameter tensors of the actor at most: twelve per vision block and text layer (two norms,
/// the attention's and the MLP's weights and biases) and the embeddings, patch embedding,
/// merger and head.
fn param_tensors(spec: &rollplex_plan::spec::JobSpec) -> u64 {
    let blocks = spec.actor.vision.depth as u64 + spec.actor.text.num_layers as u64;
    12 * blocks + 16
}

struct Table {
    bufs: Vec<LogicalBuffer>,
}

impl Table {
    /// The id the next buffer added gets.
    fn next(&self) -> LBufId {
        LBufId::from_index(self.bufs.len())
    }

    #[allow(clippy::too_many_arguments)] // one argument per column of the buffer table
    fn add(
        &mut self,
        name: &str,
        role: BufferRole,
        gpu: GpuId,
        bytes: u64,
        shape: String,
        persistent: bool,
        offload: Offload,
    ) -> LBufId {
        let id = self.next();
        self.bufs.push(LogicalBuffer {
            name: name.into(),
            role,
            class: role
                .class()
                .expect("the roles of the buffer table fix their class"),
            gpu,
            bytes,
            shape,
            persistent,
            offload,
        });
        id
    }
}

/// Defines the buffer table of `pg` and fills every node's reads, writes and scratch.
pub fn assign(pg: &mut PhaseGraph) {
    let spec = &pg.spec;
    let sh = &pg.shapes;
    let par = &pg.topo.parallel;
    let (rg, tg) = (pg.topo.rollout_gpu, pg.topo.train_gpu);
    let (rtp, ttp) = (par.rollout_tp as u64, par.train_tp as u64);
    let (g, n_r, n_t) = (
        par.group_size as u64,
        par.prompts_per_rollout_replica as u64,
        par.prompts_per_train_replica as u64,
    );
    let c = pg.copies as u64;
    let p = sh.prompt_tokens;
    let r = sh.max_new_tokens as u64;
    let kv = sh.kv_bytes_per_token;
    let db = sh.dtype_bytes;
    let dt = format!("{:?}", spec.actor.dtype).to_lowercase();
    let colocated = pg.topo.mode != Mode::Disaggregated;
    let params = sh.params.total();
    let trainable = sh.trainable_params;
    let batch = pg.topo.batch;
    let prefill_trains = batch.train_prefix == TrainPrefixSource::Rollout;
    // kept prompt forwards keep each layer's K/V, and every activation of the first
    // `kept.prompt` layers and the input of the others (those recomputed in backward)
    let kept_tok = kept_act_bytes_per_token(&spec.actor, 1, pg.kept.prompt) / ttp + kv / ttp;
    let mut t = Table { bufs: Vec::new() };

    let train_w = crate::sharing::train_bytes(spec);
    let actor_w = t.add(
        "actor_weights",
        BufferRole::ActorWeights,
        tg,
        train_w,
        format!("(params {params} / tp {ttp}, norms replicated) {dt}"),
        true,
        Offload::No,
    );
    let mut rollout_w = Vec::new();
    let mut frozen_w = None;
    if let Some(sharing) = &pg.sharing {
        // Identical and view tensors alias `actor_weights`; incompatible ones keep their
        // local training shard in place and add the gathered rest (`crate::sharing`).
        rollout_w.push(actor_w);
        let frozen = sharing.extra_bytes - sharing.resharded_bytes;
        if sharing.resharded_bytes > 0 {
            rollout_w.push(t.add(
                "rollout_weights",
                BufferRole::RolloutWeights,
                rg,
                sharing.resharded_bytes,
                format!("(trainable incompatible tensors at tp {rtp} - own train shard) {dt}"),
                false,
                Offload::No,
            ));
        }
        if frozen > 0 {
            frozen_w = Some(t.next());
            rollout_w.push(t.add(
                "rollout_weights.frozen",
                BufferRole::FrozenRolloutWeights,
                rg,
                frozen,
                format!("(frozen incompatible tensors at tp {rtp} - own train shard) {dt}"),
                true,
                Offload::No,
            ));
        }
    } else {
        rollout_w.push(t.add(
            "rollout_weights",
            BufferRole::RolloutWeights,
            rg,
            crate::sharing::layout_bytes(spec, par.rollout_tp),
            format!("(params {params} / tp {rtp}, norms replicated) {dt}"),
            true,
            Offload::No,
        ));
    }
    let ref_w = spec.reference.enabled.then(|| {
        t.add(
            "ref_weights",
            BufferRole::RefWeights,
            tg,
            train_w,
            format!("(params {params} / tp {ttp}, norms replicated) {dt}"),
            true,
            Offload::Frozen,
        )
    });
    // Distributed optimizer: fp32 master weights and moments are sharded over every training
    // rank (the TP shard, split again across the data-parallel replicas).
    let opt_shard = ttp * par.train_replicas as u64;
    let master = t.add(
        "master_weights",
        BufferRole::MasterWeights,
        tg,
        trainable * 4 / opt_shard,
        format!("(trainable {trainable} / ranks {opt_shard}) f32"),
        true,
        Offload::Mutable,
    );
    let moments = t.add(
        "adam_moments",
        BufferRole::AdamMoments,
        tg,
        trainable * 8 / opt_shard,
        format!("(2, trainable {trainable} / ranks {opt_shard}) f32"),
        true,
        Offload::Mutable,
    );
    let grads: Vec<LBufId> = (0..batch.steps)
        .map(|s| {
            t.add(
                &format!("grads.s{s}"),
                BufferRole::Grads { step: s },
                tg,
                trainable * 4 / ttp,
                format!("(trainable {trainable} / tp {ttp}) f32"),
                false,
                Offload::No,
            )
        })
        .collect();
    let media_tok = sh.media_tokens_per_prompt();
    let out_h = spec.actor.vision.out_hidden_size as u64;
    let emb = (media_tok > 0).then(|| {
        t.add(
            "vision_emb",
            BufferRole::MediaEmbeddings,
            rg,
            c * n_r * media_tok * out_h * db,
            format!("(copies {c} x prompts {n_r}, tokens {media_tok}, hidden {out_h}) {dt}"),
            false,
            Offload::No,
        )
    });
    let emb_train = pg
        .graph
        .node_weights()
        .any(|n| matches!(n.op, Op::Reshard { .. }))
        .then(|| {
            t.add(
                "vision_emb.train",
                BufferRole::TrainMediaEmbeddings,
                tg,
                n_t * media_tok * out_h * db,
                format!("(prompts {n_t}, tokens {media_tok}, hidden {out_h}) {dt}"),
                false,
                Offload::No,
            )
        });
    let kv_prompt = t.add(
        "kv.prompt",
        BufferRole::KvPrompt,
        rg,
        c * n_r * p * kv / rtp,
        format!("(copies {c} x prompts {n_r}, tokens {p}, kv bytes {kv} / tp {rtp})"),
        false,
        Offload::No,
    );
    let kv_resp = t.add(
        "kv.response",
        BufferRole::KvResponse,
        rg,
        n_r * g * r * kv / rtp,
        format!(
            "(samples {}, tokens {r}, kv bytes {kv} / tp {rtp})",
            n_r * g
        ),
        false,
        Offload::No,
    );
    let samples_n = n_r.max(n_t) * g;
    let samples = t.add(
        "samples",
        BufferRole::Samples,
        rg,
        samples_n * (r + 2) * 4,
        format!("(samples {samples_n}, tokens {r} + 2) i32"),
        false,
        Offload::No,
    );
    let samples_t = if colocated {
        samples
    } else {
        t.add(
            "samples.train",
            BufferRole::TrainSamples,
            tg,
            n_t * g * (r + 2) * 4,
            format!("(samples {}, tokens {r} + 2) i32", n_t * g),
            true,
            Offload::No,
        )
    };
    let ref_kv = spec.reference.enabled.then(|| {
        t.add(
            "ref_prefix_kv",
            BufferRole::RefPrefixKv,
            tg,
            c * n_t * p * kv / ttp,
            format!("(copies {c} x prompts {n_t}, tokens {p}, kv bytes {kv} / tp {ttp})"),
            false,
            Offload::No,
        )
    });
    let multi = batch.steps > 1;
    let old_pass = batch.old_logprobs == OldLogProbSource::Pass;
    let old_kv = old_pass.then(|| {
        t.add(
            "old_prefix_kv",
            BufferRole::OldPrefixKv,
            tg,
            c * n_t * p * kv / ttp,
            format!("(copies {c} x prompts {n_t}, tokens {p}, kv bytes {kv} / tp {ttp})"),
            false,
            Offload::No,
        )
    });
    let step_groups = if multi { batch.mini as u64 / g } else { n_t };
    // With the tower or merger trained, a training prefix encodes its group's media once and
    // keeps what their backward needs (runtime `gpu/vision_train.rs`, `VisionTrainState`): the
    // merger's input, and when the tower trains the pixel rows and every block's input too;
    // per patch (patch dim + (depth + 1) x vision hidden) x dtype, or the vision hidden alone,
    // whatever the copies; split across the TP group as the text's kept activations are.
    let vis = &spec.actor.vision;
    let keeps_vision = !pg.reuses_encoding
        && sh.media_items > 0
        && !(spec.train.freeze_vision && spec.train.freeze_merger);
    let kept_vis = if keeps_vision {
        let vh = vis.hidden_size as u64;
        let per_patch = if spec.train.freeze_vision {
            vh
        } else {
            vis.patch_dim() + (vis.depth as u64 + 1) * vh
        };
        sh.media_items as u64 * sh.patches_per_item * per_patch * db / ttp
    } else {
        0
    };
    let train_prefix: Vec<LBufId> = (0..batch.steps)
        .map(|s| {
            t.add(
                &format!("train_prefix.s{s}"),
                BufferRole::TrainPrefix { step: s },
                tg,
                step_groups * (c * p * kept_tok + kept_vis),
                format!(
                    "(copies {c} x groups {step_groups}, tokens {p}, kept bytes {kept_tok}, layer inputs{})",
                    if keeps_vision {
                        format!("; groups {step_groups} x vision kept bytes {kept_vis}")
                    } else {
                        String::new()
                    }
                ),
                false,
                Offload::Mutable,
            )
        })
        .collect();
    let ref_lp = spec.reference.enabled.then(|| {
        t.add(
            "ref_logprobs",
            BufferRole::RefLogProbs,
            tg,
            n_t * g * r * 4,
            format!("(samples {}, tokens {r}) f32", n_t * g),
            false,
            Offload::No,
        )
    });
    let old_lp = old_pass.then(|| {
        t.add(
            "old_logprobs",
            BufferRole::OldLogProbs,
            tg,
            n_t * g * r * 4,
            format!("(samples {}, tokens {r}) f32", n_t * g),
            false,
            Offload::No,
        )
    });
    let scalars = t.add(
        "scalars",
        BufferRole::Scalars,
        tg,
        n_t * g * 8,
        format!("(samples {}, reward + advantage) f32", n_t * g),
        false,
        Offload::No,
    );

    // The runtime places each buffer's tensors at aligned addresses in its range.
    let kept_vis_tensors = match (keeps_vision, spec.train.freeze_vision) {
        (false, _) => 0,
        (true, true) => 1,
        (true, false) => vis.depth as u64 + 2,
    };
    let items_per_prompt = sh.media_items as u64;
    for b in &mut t.bufs {
        let pieces = match b.role {
            // (rollout weights apart from the actor's exist only at TP > 1 or on another GPU,
            // where the executor places nothing)
            BufferRole::RolloutWeights | BufferRole::FrozenRolloutWeights => 0,
            BufferRole::ActorWeights
            | BufferRole::RefWeights
            | BufferRole::MasterWeights
            | BufferRole::Grads { .. } => param_tensors(spec),
            BufferRole::AdamMoments => 2 * param_tensors(spec),
            BufferRole::MediaEmbeddings => c * n_r * items_per_prompt,
            BufferRole::TrainMediaEmbeddings => n_t * items_per_prompt,
            // the decode KV arena's keys and values span `kv.prompt` and `kv.response`
            BufferRole::KvPrompt => 2,
            // keys and values per group
            BufferRole::RefPrefixKv | BufferRole::OldPrefixKv => 2 * n_t,
            // kept layer inputs, keys, values; per group each kept layer's activations and its
            // media's kept vision state (pixel rows, every block's input, the merger's input;
            // the merger's input alone when only the merger trains)
            BufferRole::TrainPrefix { .. } => {
                3 + step_groups
                    * (pg.kept.prompt as u64 * KEPT_ACT_TENSORS
                        + items_per_prompt * kept_vis_tensors)
            }
            _ => 1,
        };
        b.bytes = placed_bytes(b.bytes, pieces);
    }

    // Transient sizes.
    let vocab = spec.actor.text.vocab_size as u64;
    let trans_r = transient_bytes_per_token(&spec.actor, par.rollout_tp);
    let trans_t = transient_bytes_per_token(&spec.actor, par.train_tp);
    let logits_chunk = |tokens: u64, tp: u64| tokens.min(4096) * vocab * 4 / tp;
    let v = &spec.actor.vision;
    let vis_trans = |items: u64, tp: u64| {
        items
            * sh.patches_per_item
            * (3 * v.hidden_size as u64 + 3 * v.intermediate_size as u64 / tp)
            * db
    };
    let items = match spec.rollout.media {
        MediaSpec::None => 0,
        MediaSpec::Image { count, .. } => count as u64,
        MediaSpec::Video { .. } => 1,
    };
    let own_vision = !pg.reuses_encoding && items > 0;
    let frozen_tower = spec.train.freeze_vision && spec.train.freeze_merger;
    let kept_full = kept_act_bytes_per_token_layer(&spec.actor, 1, false) / ttp;

    let ids: Vec<_> = pg.graph.node_indices().collect();
    for id in ids {
        let node = &pg.graph[id];
        let mut reads: Vec<LBufId> = Vec::new();
        let mut writes: Vec<LBufId> = Vec::new();
        let mut scratch = 0u64;
        let emb_t = emb_train.or(if pg.reuses_encoding { emb } else { None });
        match &node.op {
            Op::WeightSync { .. } => {
                if colocated {
                    reads.push(actor_w);
                }
                // The frozen extra is built at load (the assembler adds it when the planner
                // rebuilds it every iteration instead).
                writes.extend(
                    rollout_w
                        .iter()
                        .filter(|&&b| b != actor_w && Some(b) != frozen_w),
                );
            }
            Op::EncodeMedia { groups, copies } => {
                // A frozen tower and merger are never resharded per iteration: encoding reads
                // the training weights and the frozen extra only (so it may run beside the sync).
                if frozen_tower && colocated {
                    reads.push(actor_w);
                    reads.extend(frozen_w);
                } else {
                    reads.extend(&rollout_w);
                }
                writes.extend(emb);
                scratch = vis_trans(groups.len() as u64 * *copies as u64 * items, rtp);
            }
            Op::Reshard { .. } => {
                reads.extend(emb);
                writes.extend(emb_train);
            }
            Op::Prefill { groups, copies } => {
                reads.extend(&rollout_w);
                reads.extend(emb);
                writes.extend([kv_prompt, kv_resp, samples]);
                let tok = groups.len() as u64 * *copies as u64 * p;
                scratch = tok * trans_r + groups.len() as u64 * g * vocab * 4 / rtp;
                if prefill_trains {
                    // the training forward of the prompt, kept for step 0 (one layer's full
                    // activations at a time)
                    reads.push(actor_w);
                    writes.push(train_prefix[0]);
                    scratch = scratch.max(tok * (trans_t + kept_full));
                }
            }
            Op::DecodeWindow { .. } => {
                reads.extend(&rollout_w);
                reads.push(kv_prompt);
                writes.extend([kv_resp, samples]);
                scratch = n_r * g * (vocab * 4 / rtp + trans_r);
            }
            Op::RefPrefix { groups, copies } => {
                reads.extend(ref_w);
                reads.extend(emb_t);
                writes.extend(ref_kv);
                let seqs = groups.len() as u64 * *copies as u64;
                scratch = seqs * p * trans_t
                    + if own_vision {
                        vis_trans(seqs * items, ttp)
                    } else {
                        0
                    };
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => {
                reads.push(actor_w);
                reads.extend(emb_t);
                match purpose {
                    Purpose::OldLogProb => writes.extend(old_kv),
                    Purpose::Train { step } => writes.push(train_prefix[*step as usize]),
                }
                let seqs = groups.span().len() as u64 * *copies as u64;
                scratch = seqs * p * trans_t
                    + if own_vision {
                        vis_trans(seqs * items, ttp)
                    } else {
                        0
                    };
            }
            Op::RefSuffix { .. } => {
                reads.extend(ref_w);
                reads.extend(ref_kv);
                reads.push(samples_t);
                writes.extend(ref_lp);
                scratch = g * r * trans_t + logits_chunk(g * r, ttp);
            }
            Op::ActorSuffix { .. } => {
                reads.push(actor_w);
                reads.extend(old_kv);
                reads.push(samples_t);
                writes.extend(old_lp);
                scratch = g * r * trans_t + logits_chunk(g * r, ttp);
            }
            Op::Reward { .. } => {
                reads.push(samples_t);
                writes.push(scalars);
            }
            Op::Advantages { .. } => {
                reads.push(scalars);
                writes.push(scalars);
            }
            Op::TrainMicroBatch {
                step,
                samples: s,
                prefix_bwd_slots,
                ..
            } => {
                reads.extend([actor_w, train_prefix[*step as usize], samples_t, scalars]);
                reads.extend(ref_lp);
                reads.extend(old_lp);
                writes.push(grads[*step as usize]);
                let tok = s.len() as u64 * r;
                let kept = kept_act_bytes_per_token(&spec.actor, 1, pg.kept.suffix) / ttp;
                let prefix_tok = prefix_bwd_slots.len() as u64 * c * p;
                // with every layer kept, the head keeps its logits (bf16) for the backward too
                let kept_logits = match pg.kept.suffix >= spec.actor.text.num_layers {
                    true => tok * vocab * db / ttp,
                    false => 0,
                };
                // Suffix activations kept over all layers, one layer's full activations during
                // backward (recompute), the logits chunk, the prefix's one-layer recompute
                // (none with every prompt layer kept).
                let prefix_recompute = match pg.kept.prompt >= spec.actor.text.num_layers {
                    true => prefix_tok * trans_t,
                    false => prefix_tok * (kept_full + trans_t),
                };
                scratch = tok * (kept + trans_t)
                    + logits_chunk(tok, ttp)
                    + kept_logits
                    + tok * kept_full
                    + prefix_recompute;
            }
            Op::OptimizerStep { step } => {
                reads.push(grads[*step as usize]);
                writes.extend([actor_w, master, moments]);
            }
            Op::Offload { .. } | Op::Reload { .. } => {}
        }
        let node = &mut pg.graph[id];
        reads.sort_unstable();
        reads.dedup();
        writes.sort_unstable();
        writes.dedup();
        node.reads = reads;
        node.writes = writes;
        node.scratch = scratch;
    }
    pg.buffers = t.bufs;
    debug_assert!(t_find_unique(&pg.buffers));
}

/// Names and roles are unique in the table.
fn t_find_unique(bufs: &[LogicalBuffer]) -> bool {
    let mut names: Vec<&str> = bufs.iter().map(|b| b.name.as_str()).collect();
    names.sort_unstable();
    let n = names.len();
    names.dedup();
    let mut roles: Vec<BufferRole> = bufs.iter().map(|b| b.role).collect();
    roles.sort_unstable();
    roles.dedup();
    n == names.len() && n == roles.len()
}
