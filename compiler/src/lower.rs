//! Lowering: the job spec becomes the phase graph of one iteration (petgraph), with the real
//! tensor shapes and the [`Work`] of every task.
//!
//! The decomposition (which tasks exist, which samples each covers, in which order gradients
//! accumulate) depends only on the job, never on the mode: serial, overlap and disaggregated
//! plans compute the same batches in the same order, so they give bitwise-identical results;
//! modes differ in placement, SM shares and timing only.
//!
//! Per rollout replica (on the rollout program): weight sync (colocated: the actor's current
//! weights into the rollout layout), media encoding and prompt prefill in chunks of prompts,
//! then decode as windows of `decode_window` steps. Per training replica (on the training
//! program): reference prefix chunks (by prompt); actor prefix chunks by prompt: old log-probs
//! when the plan has an old-log-prob pass (`topology::old_logprobs`: several optimizer steps,
//! truncated importance sampling, or asked for), and the first step's forward with grad when the
//! iteration takes one step and the rollout's prefill does not keep it (`topology::train_prefix`:
//! where it is the same forward, the prefill tasks keep it and the micro-batches depend on
//! them); per completion slot the reference suffix, the old-log-prob suffix
//! (with the pass), reward and advantages; per
//! optimizer step its micro-batches (samples in training-slot order, accumulated in index
//! order) and the step itself; prefixes of later steps are recomputed after the previous step (the
//! weight-version rule: only version-0 work may overlap decode).
//!
//! Dynamic sampling (`train { groups }` below `rollout { prompts }`): rollout, scoring, rewards
//! and advantages cover every rolled-out group; optimizer steps and micro-batches are sized by
//! the trained groups, and every training op depends on every slot's scoring (the runtime picks
//! the trained groups once all rewards are in).
//!
//! Prefix dedup on: one encoding per media item (shared by rollout, reference and actor when
//! the tower and merger are frozen and the layouts are colocated) and one prefix per GRPO group.
//! Off: every phase prefills every sample (`copies = group_size`), and the rollout encodes
//! every sample's media; the reference and actor prefixes count no encoding of their own when
//! the tower and merger are frozen and the layouts colocated (both backends reuse the
//! rollout's encoding then: same weights, bitwise the same embeddings; their tasks depend on
//! the encode task they read), and decode reads one prompt KV per group either way (the
//! runtime keeps the first copy; `Workload::decode`).
//!
//! Invariants: edges point from producer to consumer and the graph is acyclic; every node's
//! `role` says where scheduling may put it; `ready_step` is the planned number of decode steps
//! after which the groups a node waits for have finished.

use crate::error::{CompileError, Result};
use crate::ir::{KeptLayers, Node, NodeId, PhaseGraph, Role, SideClass, WindowPlan};
use crate::lengths::Lengths;
use crate::shapes::Shapes;
use crate::topology::Topology;
use crate::workload::Workload;
use petgraph::graph::DiGraph;
use rollplex_plan::spec::{AdvantageEstimator, JobSpec, Mode};
use rollplex_plan::work::{Work, WorkKind, WorkPart};
use rollplex_plan::{
    GpuId, Groups, OldLogProbSource, Op, Phase, Purpose, ReshardWhat, Span, TrainPrefixSource,
};

/// Prefix work is batched into tasks of about this many prompt tokens (large enough for
/// efficient GEMMs, small enough to pack into decode windows).
pub const PREFIX_CHUNK_TOKENS: u64 = 4096;

/// Splits `0..n` into consecutive spans of `per` (the last may be shorter).
pub fn chunks(n: u32, per: u32) -> Vec<Span> {
    let per = per.max(1);
    (0..n.div_ceil(per))
        .map(|i| Span::new(i * per, ((i + 1) * per).min(n)))
        .collect()
}

struct Builder<'a> {
    g: DiGraph<Node, (), u32>,
    wl: Workload<'a>,
}

impl Builder<'_> {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        name: String,
        kind: WorkKind,
        op: Op,
        gpu: GpuId,
        role: Role,
        work: Work,
        ready_step: u32,
        deps: &[NodeId],
    ) -> NodeId {
        // (a phase graph holds no transfers: those come with residency)
        let phase = op.phase(false).unwrap_or(Phase::Training);
        let id = self.g.add_node(Node {
            name,
            kind,
            op,
            gpu,
            phase,
            role,
            work,
            ready_step,
            reads: vec![],
            writes: vec![],
            scratch: 0,
        });
        for &d in deps {
            self.g.add_edge(d, id, ());
        }
        id
    }
}

fn add_work(a: &Work, b: &Work) -> Work {
    Work {
        flops: a.flops + b.flops,
        bytes: a.bytes + b.bytes,
        steps: a.steps + b.steps,
        host_bytes: a.host_bytes + b.host_bytes,
        net_bytes: a.net_bytes + b.net_bytes,
        parts: a.parts.iter().chain(&b.parts).cloned().collect(),
    }
}

/// `w` with `part` of `kind` inside it (nothing for an empty part).
fn with_part(w: Work, kind: WorkKind, part: Work) -> Work {
    if part == Work::default() {
        return w;
    }
    let mut w = w;
    w.parts.push(WorkPart { kind, work: part });
    w
}

/// The kept activation layers the job fixes: every text layer (`recompute = none`), none
/// (`full`), and under `auto` none until the planner decides ([`lower`] again with its answer).
pub fn fixed_kept_layers(spec: &JobSpec) -> KeptLayers {
    let n = spec
        .train
        .recompute
        .kept_layers(spec.actor.text.num_layers)
        .unwrap_or(0);
    KeptLayers {
        suffix: n,
        prompt: n,
    }
}

/// Builds the phase graph of one iteration of `spec` on `topo`, with the first `kept` text
/// layers keeping their training activations (the others recomputed in backward).
pub fn lower(spec: &JobSpec, topo: Topology, kept: KeptLayers) -> Result<PhaseGraph> {
    let shapes = Shapes::new(spec);
    let lengths = Lengths::new(&spec.rollout.response_len, spec.rollout.max_new_tokens);
    if shapes.prompt_tokens == 0 {
        return Err(CompileError::user(
            "rollout.prompt_text_tokens",
            "prompts are empty: no text tokens and no media",
            "give each prompt some text tokens or media",
        ));
    }
    let par = topo.parallel.clone();
    let batch = topo.batch;
    let (g, n_r, n_t) = (
        par.group_size,
        par.prompts_per_rollout_replica,
        par.prompts_per_train_replica,
    );
    let (rtp, ttp) = (par.rollout_tp, par.train_tp);
    let dedup = spec.schedule.prefix_dedup;
    let copies = if dedup { 1 } else { g };
    let colocated = topo.mode != Mode::Disaggregated;
    let media = shapes.media_items > 0;
    // A frozen tower and merger give bitwise the same embeddings in every phase: colocated,
    // the reference and actor prefixes read the rollout's encoding (with or without dedup)
    // and so depend on the encode task of their prompts.
    let reuses_encoding =
        colocated && media && spec.train.freeze_vision && spec.train.freeze_merger;
    let ref_on = spec.reference.enabled;
    let multi_step = batch.steps > 1;
    let text_layers = spec.actor.text.num_layers.max(1);
    let kept = KeptLayers {
        suffix: kept.suffix.min(text_layers),
        prompt: kept.prompt.min(text_layers),
    };
    // the share of the suffix's and the prompt rows' layers whose forward backward runs again
    let recomputed = |k: u32| (text_layers - k) as f64 / text_layers as f64;
    let old_pass = batch.old_logprobs == OldLogProbSource::Pass;
    // the rollout's prefill keeps the training prompt forwards (`topology::train_prefix`)
    let prefill_trains = batch.train_prefix == TrainPrefixSource::Rollout;
    let items = shapes.media_items as f64;
    let (rg, tg) = (topo.rollout_gpu, topo.train_gpu);

    // Decode windows: planned steps = when the rollout replica's last group is expected done.
    let decode_steps = lengths
        .slot_finish_steps(n_r, g)
        .last()
        .copied()
        .unwrap_or(0)
        .max(1);
    let d = spec.schedule.decode_window.max(1);
    let windows: Vec<WindowPlan> = (0..decode_steps.div_ceil(d))
        .map(|w| WindowPlan {
            first: w * d,
            steps: d.min(decode_steps - w * d),
        })
        .collect();
    let slot_finish = lengths.slot_finish_steps(n_t, g);

    let per_chunk = PREFIX_CHUNK_TOKENS
        .div_ceil(shapes.prompt_tokens * copies as u64)
        .max(1) as u32;
    let wl = Workload {
        spec,
        shapes: &shapes,
        lengths: &lengths,
    };
    let mut b = Builder {
        g: DiGraph::default(),
        wl,
    };

    // ---- rollout program ----
    let mut pre: Vec<NodeId> = Vec::new();
    let sharing = colocated.then(|| crate::sharing::analyse(spec));
    if let Some(sh) = &sharing {
        // The sync rebuilds exactly the incompatible trainable tensors (frozen ones are built
        // once, at load).
        let moved = sh.resharded_bytes;
        let sync = b.add(
            "weight_sync".into(),
            WorkKind::WeightSync,
            Op::WeightSync {
                from_tp: ttp,
                to_tp: rtp,
            },
            rg,
            Role::PreDecode,
            b.wl.transfer(moved as f64, 0.0),
            0,
            &[],
        );
        pre.push(sync);
    }
    let r_chunks = chunks(n_r, per_chunk);
    let mut encodes = Vec::new();
    // A frozen tower and merger do not change: encoding need not wait for the weight sync
    // (the planner may run the sync beside it, see `crate::residency`).
    let encode_deps: Vec<NodeId> = if spec.train.freeze_vision && spec.train.freeze_merger {
        vec![]
    } else {
        pre.clone()
    };
    if media {
        for s in &r_chunks {
            let w = b.wl.vision(s.len() as f64 * copies as f64 * items, rtp);
            let e = b.add(
                format!("encode[{s}]"),
                WorkKind::VisionEncode,
                Op::EncodeMedia { groups: *s, copies },
                rg,
                Role::PreDecode,
                w,
                0,
                &encode_deps,
            );
            encodes.push(e);
        }
    }
    let mut embed_reshard = None;
    if reuses_encoding && rtp < ttp {
        let bytes = embed_gather_bytes(spec, &shapes, &topo.parallel) as f64;
        embed_reshard = Some(b.add(
            "embed_reshard".into(),
            WorkKind::Transfer,
            Op::Reshard {
                what: ReshardWhat::Embeddings,
                from_tp: rtp,
                to_tp: ttp,
            },
            rg,
            Role::PreDecode,
            b.wl.transfer(bytes, 0.0),
            0,
            &encodes,
        ));
    }
    let mut prefills = Vec::new();
    for (i, s) in r_chunks.iter().enumerate() {
        let mut deps = pre.clone();
        if let Some(&e) = encodes.get(i) {
            deps.push(e);
        }
        let w = b.wl.prefix(
            s.len() as f64 * copies as f64,
            rtp,
            s.len() as f64 * g as f64,
        );
        prefills.push(b.add(
            format!("prefill[{s}]"),
            WorkKind::Prefill,
            Op::Prefill { groups: *s, copies },
            rg,
            Role::PreDecode,
            w,
            0,
            &deps,
        ));
    }
    let mut decodes: Vec<NodeId> = Vec::new();
    for (wi, w) in windows.iter().enumerate() {
        let last = wi + 1 == windows.len();
        let deps = if wi == 0 {
            prefills.clone()
        } else {
            vec![decodes[wi - 1]]
        };
        let work = b.wl.decode(n_r as f64, g, w.first, w.steps, rtp);
        decodes.push(b.add(
            format!("decode.w{wi}"),
            WorkKind::Decode,
            Op::DecodeWindow {
                first_step: w.first,
                steps: w.steps,
                until_done: last,
            },
            rg,
            Role::Decode { window: wi as u32 },
            work,
            0,
            &deps,
        ));
    }
    let last_decode = *decodes
        .last()
        .ok_or_else(|| CompileError::internal("no decode window"))?;

    // ---- training program ----
    // What a training-layout prefix chunk waits for: the shared encoding (same layout: the same
    // chunk; other layouts: all of it or its reshard), nothing when it encodes for itself.
    let t_chunks = chunks(n_t, per_chunk);
    let enc_deps = |i: usize| -> Vec<NodeId> {
        if !reuses_encoding {
            return vec![];
        }
        if let Some(r) = embed_reshard {
            return vec![r];
        }
        if rtp == ttp {
            return encodes.get(i).map(|&e| vec![e]).unwrap_or_default();
        }
        encodes.clone()
    };
    // Disaggregated training starts when rollout is complete (the usual two-engine design).
    let tail_gate: Vec<NodeId> = if colocated { vec![] } else { vec![last_decode] };
    // What a prefix task encodes itself, `per_group` encodings of each group's media (the
    // rollout's encoding is reused when it can be: see the module doc): the vision tower's
    // forward, a part of kind `vision_encode` inside the prefix task, priced at the tower's
    // rate (measured on the H200 well below the decoder's: docs/cost-model.md).
    let own_vision = |s: &Span, per_group: u32, tp: u32, wl: &Workload| -> Work {
        if reuses_encoding || !media {
            Work::default()
        } else {
            wl.vision(s.len() as f64 * per_group as f64 * items, tp)
        }
    };

    let mut ref_prefix = Vec::new();
    let mut old_prefix = Vec::new();
    let mut train_prefix0 = Vec::new();
    for (i, s) in t_chunks.iter().enumerate() {
        let mut deps = enc_deps(i);
        deps.extend(&tail_gate);
        let fwd = b.wl.prefix(s.len() as f64 * copies as f64, ttp, 0.0);
        // the reference encodes every copy (runtime `ref_media`), as does the old-log-prob
        // prefix's count; the training prefix encodes a group's media once and runs its copies'
        // prompts over it (runtime `gpu/train/prefixes.rs`, `prefix_forward`)
        let vis = own_vision(s, copies, ttp, &b.wl);
        let train_vis = own_vision(s, 1, ttp, &b.wl);
        if ref_on {
            let item = ref_prefix.len() as u32;
            ref_prefix.push(b.add(
                format!("ref_prefix[{s}]"),
                WorkKind::RefPrefix,
                Op::RefPrefix { groups: *s, copies },
                tg,
                Role::Side {
                    class: SideClass::RefPrefix,
                    item,
                },
                with_part(fwd.clone(), WorkKind::VisionEncode, vis.clone()),
                0,
                &deps,
            ));
        }
        if old_pass {
            let item = old_prefix.len() as u32;
            old_prefix.push(b.add(
                format!("old_prefix[{s}]"),
                WorkKind::ActorPrefixFwd,
                Op::ActorPrefix {
                    groups: Groups::Prompts(*s),
                    copies,
                    purpose: Purpose::OldLogProb,
                },
                tg,
                Role::Side {
                    class: SideClass::OldPrefix,
                    item,
                },
                with_part(fwd.clone(), WorkKind::VisionEncode, vis.clone()),
                0,
                &deps,
            ));
        }
        if !multi_step && !prefill_trains {
            let item = train_prefix0.len() as u32;
            train_prefix0.push(b.add(
                format!("train_prefix[{s}]"),
                WorkKind::ActorPrefixFwd,
                Op::ActorPrefix {
                    groups: Groups::Prompts(*s),
                    copies,
                    purpose: Purpose::Train { step: 0 },
                },
                tg,
                Role::Side {
                    class: SideClass::TrainPrefix,
                    item,
                },
                with_part(fwd, WorkKind::VisionEncode, train_vis),
                0,
                &deps,
            ));
        }
    }

    let mut ref_suffix = Vec::new();
    let mut old_suffix = Vec::new();
    let mut adv = Vec::new();
    let mut rewards = Vec::new();
    for k in 0..n_t {
        let ready = slot_finish[k as usize];
        let suf = b.wl.suffix(g as f64, ttp);
        if ref_on {
            let mut deps = ref_prefix.clone();
            deps.extend(&tail_gate);
            ref_suffix.push(b.add(
                format!("ref_suffix.slot{k}"),
                WorkKind::RefSuffix,
                Op::RefSuffix { slot: k },
                tg,
                Role::Side {
                    class: SideClass::RefSuffix,
                    item: k,
                },
                suf.clone(),
                ready,
                &deps,
            ));
        }
        if old_pass {
            let mut deps = old_prefix.clone();
            deps.extend(&tail_gate);
            old_suffix.push(b.add(
                format!("old_suffix.slot{k}"),
                WorkKind::ActorSuffixFwd,
                Op::ActorSuffix {
                    slot: k,
                    purpose: Purpose::OldLogProb,
                },
                tg,
                Role::Side {
                    class: SideClass::OldSuffix,
                    item: k,
                },
                suf.clone(),
                ready,
                &deps,
            ));
        }
        let r = b.add(
            format!("reward.slot{k}"),
            WorkKind::Reward,
            Op::Reward { slot: k },
            tg,
            Role::Side {
                class: SideClass::Reward,
                item: k,
            },
            b.wl.reward(g),
            ready,
            &tail_gate,
        );
        rewards.push(r);
        adv.push(b.add(
            format!("advantages.slot{k}"),
            WorkKind::Advantage,
            Op::Advantages { slot: k },
            tg,
            Role::Side {
                class: SideClass::Advantages,
                item: k,
            },
            b.wl.advantages(g),
            ready,
            &[r],
        ));
    }

    // Advantages that look past their own group (the batch whitening of REINFORCE++, the pick
    // of dynamic sampling) wait for every reward.
    let dynamic = par.trained_groups_per_train_replica < n_t;
    if dynamic || spec.train.algorithm.loss().advantage == AdvantageEstimator::ReinforceBaseline {
        let last = slot_finish[n_t as usize - 1];
        for &a in &adv {
            for &r in &rewards {
                if !b.g.contains_edge(r, a) {
                    b.g.add_edge(r, a, ());
                }
            }
            b.g[a].ready_step = last;
        }
    }
    // Dynamic sampling: training slots name the groups picked after every reward is known, so
    // every training op waits for all of the scoring of every slot, and is ready when the last
    // group is; otherwise training slot k is completion slot k.
    let train_ready = |k: u32| -> u32 {
        let k = if dynamic { n_t - 1 } else { k };
        slot_finish[k as usize]
    };
    let slot_deps = |covered: Span| -> Vec<NodeId> {
        let slots = if dynamic { Span::new(0, n_t) } else { covered };
        let mut deps = Vec::new();
        for q in slots.iter() {
            deps.push(adv[q as usize]);
            if let Some(&r) = ref_suffix.get(q as usize) {
                deps.push(r);
            }
            if let Some(&o) = old_suffix.get(q as usize) {
                deps.push(o);
            }
        }
        deps
    };
    let mut prev_step: Option<NodeId> = None;
    let mut step_nodes = Vec::new();
    for s in 0..batch.steps {
        let m = s % batch.steps_per_epoch;
        let first_sample = m * batch.mini;
        let first_slot = first_sample / g;
        let mini_slots = batch.mini.div_ceil(g);
        // Actor ops that use weight version `s` (the step must wait for all of them).
        let mut version_ops: Vec<NodeId> = Vec::new();
        // The prefix of this step's groups: by prompt (single step, may overlap decode) or by
        // slot (several steps: mini-batches are slot ranges, recomputed after each step).
        let mut step_prefix: Vec<(Span, NodeId)> = Vec::new();
        if multi_step {
            for (i, sp) in chunks(mini_slots, per_chunk).into_iter().enumerate() {
                let slots = Span::new(first_slot + sp.start, first_slot + sp.end);
                let fwd = b.wl.prefix(slots.len() as f64 * copies as f64, ttp, 0.0);
                let vis = own_vision(&slots, 1, ttp, &b.wl);
                let mut deps: Vec<NodeId> = prev_step.into_iter().collect();
                if reuses_encoding {
                    match embed_reshard {
                        Some(r) => deps.push(r),
                        None => deps.extend(&encodes),
                    }
                }
                deps.extend(&tail_gate);
                if dynamic {
                    deps.extend(slot_deps(slots));
                }
                let role = if s == 0 {
                    Role::Side {
                        class: SideClass::TrainPrefix,
                        item: i as u32,
                    }
                } else {
                    Role::Post
                };
                let ready = train_ready(slots.end - 1);
                let id = b.add(
                    format!("train_prefix.s{s}[{slots}]"),
                    WorkKind::ActorPrefixFwd,
                    Op::ActorPrefix {
                        groups: Groups::Slots(slots),
                        copies,
                        purpose: Purpose::Train { step: s },
                    },
                    tg,
                    role,
                    with_part(fwd, WorkKind::VisionEncode, vis),
                    ready,
                    &deps,
                );
                step_prefix.push((slots, id));
                version_ops.push(id);
            }
        } else {
            version_ops.extend(&train_prefix0);
        }
        if s == 0 {
            version_ops.extend(&old_prefix);
            version_ops.extend(&old_suffix);
        }
        let mut prev_mb = prev_step;
        for j in 0..batch.micro_per_step {
            let samples = Span::new(
                first_sample + j * batch.micro,
                first_sample + (j + 1) * batch.micro,
            );
            let covered = Span::new(samples.start / g, (samples.end - 1) / g + 1);
            let bwd_slots: Vec<u32> = covered
                .iter()
                .filter(|q| samples.contains(q * g + g - 1))
                .collect();
            let prefix_bwd = match (bwd_slots.first(), bwd_slots.last()) {
                (Some(&a), Some(&z)) => Span::new(a, z + 1),
                _ => Span::new(covered.start, covered.start),
            };
            let mut deps: Vec<NodeId> = prev_mb.into_iter().collect();
            deps.extend(slot_deps(covered));
            if multi_step {
                deps.extend(
                    step_prefix
                        .iter()
                        .filter(|(sp, _)| sp.start < covered.end && covered.start < sp.end)
                        .map(|(_, id)| *id),
                );
            } else if prefill_trains {
                deps.extend(&prefills);
            } else {
                deps.extend(&train_prefix0);
            }
            let fwd = b.wl.suffix(batch.micro as f64, ttp);
            let mut work = add_work(&fwd, &b.wl.backward_of(&fwd, recomputed(kept.suffix)));
            if !prefix_bwd.is_empty() {
                let pf = b.wl.micro_batch_prompts(prefix_bwd.len(), copies, ttp);
                // the prompt rows' layers past the kept ones keep their inputs only (the
                // runtimes recompute them)
                work = add_work(&work, &b.wl.backward_of(&pf, recomputed(kept.prompt)));
                if !spec.train.freeze_vision && media {
                    // once per group, whatever the copies: the copies' encodings are the same
                    // bits, so the trainers run the tower's backward once per group (CUDA:
                    // on the copies' summed embedding gradients, runtime `gpu/train/`);
                    // a part of kind `vision_encode`: the tower's kernels, at their own rate
                    let v = b.wl.vision_backward(prefix_bwd.len() as f64 * items, ttp);
                    work = with_part(work, WorkKind::VisionEncode, v);
                }
            }
            let role = if s == 0 {
                Role::Side {
                    class: SideClass::MicroBatch,
                    item: j,
                }
            } else {
                Role::Post
            };
            let ready = train_ready(covered.end - 1);
            let id = b.add(
                format!("mb.s{s}.m{j}"),
                WorkKind::ActorBwd,
                Op::TrainMicroBatch {
                    step: s,
                    micro_batch: j,
                    samples,
                    prefix_bwd_slots: prefix_bwd,
                },
                tg,
                role,
                work,
                ready,
                &deps,
            );
            version_ops.push(id);
            prev_mb = Some(id);
        }
        let mut deps = version_ops.clone();
        if colocated {
            deps.push(last_decode);
        }
        let st = b.add(
            format!("optim.s{s}"),
            WorkKind::Optimizer,
            Op::OptimizerStep { step: s },
            tg,
            Role::Post,
            b.wl.optimizer(ttp, par.train_replicas),
            0,
            &deps,
        );
        step_nodes.push(st);
        prev_step = Some(st);
    }
    if !colocated {
        let last = *step_nodes
            .last()
            .ok_or_else(|| CompileError::internal("no optimizer step"))?;
        // Training and rollout sets live on different nodes when the job spans nodes: the
        // cost model's one link is the intra-node one, so scale the bytes to the slower link.
        let c = &spec.cluster;
        let slow = if c.count > c.gpus_per_node && c.inter_node_bw > 0.0 {
            (c.intra_node_bw / c.inter_node_bw).max(1.0)
        } else {
            1.0
        };
        let bytes = disaggregated_sync_bytes(&shapes, rtp) as f64;
        let work = Work {
            net_bytes: bytes * slow,
            ..b.wl.transfer(bytes, 0.0)
        };
        b.add(
            "weight_sync".into(),
            WorkKind::WeightSync,
            Op::WeightSync {
                from_tp: ttp,
                to_tp: rtp,
            },
            rg,
            Role::Post,
            work,
            0,
            &[last, last_decode],
        );
    }

    let graph = b.g;
    if petgraph::algo::is_cyclic_directed(&graph) {
        return Err(CompileError::internal(
            "lowering built a cyclic phase graph",
        ));
    }
    Ok(PhaseGraph {
        spec: spec.clone(),
        topo,
        shapes,
        lengths,
        graph,
        buffers: Vec::new(),
        windows,
        slot_finish,
        reuses_encoding,
        sharing,
        copies,
        kept,
    })
}

/// Bytes each training rank gathers of the other rollout replicas' vision embeddings when
/// the training replica spans several rollout replicas.
pub fn embed_gather_bytes(
    spec: &JobSpec,
    shapes: &Shapes,
    par: &rollplex_plan::Parallelism,
) -> u64 {
    let (rtp, ttp) = (par.rollout_tp.max(1) as u64, par.train_tp.max(1) as u64);
    if rtp >= ttp {
        return 0;
    }
    let ratio = ttp / rtp;
    let all = par.prompts_per_train_replica as u64
        * shapes.media_tokens_per_prompt()
        * spec.actor.vision.out_hidden_size as u64
        * shapes.dtype_bytes;
    all / ratio * (ratio - 1)
}

/// Bytes each rollout rank receives when the trained weights reach a disaggregated rollout
/// set (frozen parts never change and are not sent).
pub fn disaggregated_sync_bytes(shapes: &Shapes, rtp: u32) -> u64 {
    shapes.trainable_params * shapes.dtype_bytes / rtp.max(1) as u64
}

#[cfg(test)]
mod tests {
    use rollplex_plan::spec::Mode;
    use rollplex_plan::work::WorkKind;

    use crate::fixtures::job;

    /// A micro-batch's layer passes: the response rows' forward and backward once, and each of
    /// its groups' prompt rows as a call of their own (as the trainers run them), so a
    /// micro-batch of four groups counts three more groups' prompt passes than one of one group.
    #[test]
    fn micro_batch_passes_count_each_groups_prompt_rows() {
        let passes = |groups: u32| {
            let spec = job(|s| s.train.micro_batch = groups * s.rollout.group_size);
            let topo = crate::topology::colocated(&spec, Mode::Serial).unwrap();
            let pg = super::lower(&spec, topo, Default::default()).unwrap();
            let layers = pg.spec.actor.text.num_layers;
            let steps: Vec<u32> = pg
                .graph
                .node_weights()
                .filter(|n| n.kind == WorkKind::ActorBwd)
                .map(|n| n.work.steps)
                .collect();
            (steps, layers)
        };
        let (one, layers) = passes(1);
        let (four, _) = passes(4);
        assert_eq!(one.len(), 4 * four.len());
        // forward + backward of the response rows: 3 passes a layer; each group's prompt rows
        // (recomputed and backward): 2
        assert!(one.iter().all(|&s| s == layers * (3 + 2)), "{one:?}");
        assert!(four.iter().all(|&s| s == layers * (3 + 4 * 2)), "{four:?}");
    }
}
