//! Residency and reshard points as ILP decisions: the inputs of [`crate::ilp::Residency`]
//! from a phase graph, and the answer back as a [`ResidencyChoice`].
//!
//! Items (large buffers that may leave HBM outside the phases that use them):
//! - `ref_weights` -> host: reloaded before the first reference task (no write-back, frozen);
//!   off the decode phase unless reference work runs in a window, off the training phase;
//! - `master_weights` + `adam_moments` -> host: reloaded before the first optimizer step,
//!   written back after the last; off the decode phase, always in the training phase; or a
//!   third choice, host and streamed ([`ilp::StreamOption`]): each optimizer step copies the
//!   state through `STREAM_SLOTS` device chunks ([`stream_chunks`]), the copies of the next
//!   chunk and the write-back of the previous one overlapping the update of the current one,
//!   so the training phase holds only the staging chunks; priced by [`streamed_step_s`] less
//!   the update, per step; offered only where a memory row may move the state off HBM;
//!   `train { optimizer_state }` may force any of the three ([`check_forced`]);
//! - `rollout_weights.frozen` (the frozen incompatible tensors' gathered part, see
//!   [`crate::sharing`]) -> dropped after decode and rebuilt by every weight sync; always in
//!   the decode phase, off the training phase.
//!
//! Kept prefix states (overlap plans: their producers are side classes): `ref_prefix_kv`
//! (reference prefixes -> reference suffixes), `old_prefix_kv` (old-log-prob prefixes -> their
//! suffixes), `train_prefix.s0` (first step's actor prefixes -> its micro-batches). Each is in
//! HBM from its first producer in a window, or on host (every producer in a window writes its
//! own chunk, offloaded on the copy stream right after it; a producer waits for the offload of
//! the chunk two before its own, so two chunks live next to decode; after decode every chunk is
//! reloaded into the whole buffer before its first consumer), or produced after decode
//! (drop-and-recompute: the class stays out of the windows and out of the decode row). The
//! ILP prices host by the transfers' cost-model time (every reload and the last offload,
//! counted as exposed: an upper bound, scoring work after decode may hide part of them), each
//! copy at the host link's rate in its direction (reloads host -> device, offloads and
//! write-backs device -> host).
//!
//! Kept activation layers (`recompute = auto`), two decisions ([`ActLayers`]: the bytes one
//! more layer adds to the training row and, where they are next to decode, to the decode row;
//! the forward it saves):
//! - how many text layers keep every training activation of a micro-batch's suffix (in the
//!   decode row while micro-batches run in windows);
//! - how many keep every activation of the prompt rows in the kept prompt forwards, for every
//!   training group of a step (in the decode row throughout when the rollout's prefill writes
//!   them, or while the prompt forwards run in windows; kept layers keep their store in HBM).
//!
//! The graph is lowered with none kept and lowered again with the answer.
//!
//! A buffer used in one contiguous range of phases is best either in HBM throughout or off HBM
//! outside that range, so one binary per item is its residency per phase.
//!
//! Reshard points (colocated plans): `iteration_start` (the sync on the main stream before
//! encoding: its whole time is exposed) and, in overlap mode when the vision tower and merger
//! are frozen and the job has media, `beside_encode` (on the copy stream while media encoding
//! runs: exposed only by what exceeds encoding; ruled out when the frozen extra is rebuilt,
//! since encoding reads it). Syncing after the last optimizer step instead is not offered: in
//! this schedule nothing runs beside it there, and it would hold the rollout buffer through
//! training, so it is dominated by `iteration_start`.
//!
//! Memory rows: the decode phase (rollout program: weights, KV, embeddings, samples, the
//! kept prompt forwards when the prefill writes them (`train_prefix: rollout`), the largest
//! decode and side scratch, plus the items and side classes the answer keeps) and the
//! training phase (training program: persistent buffers, the largest gradient and kept-prefix
//! buffers, log-probs, scalars, samples, the largest training scratch). These are estimates;
//! the driver lays out memory exactly and, when a plan is over budget, lowers the budget of
//! the row where the peak sits by what the estimate missed ([`Cuts`]) and solves again.

use crate::error::{CompileError, Result};
use crate::ilp::{
    self, ActDecode, ActLayers, IlpRun, KeptState, ResItem, ReshardOption, Residency,
};
use crate::ir::{
    kept_role, KeptLayers, Node, PhaseGraph, ResidencyChoice, Role, RowRoom, SideClass,
    StreamShape, KEPT,
};
use crate::shapes::kept_act_bytes_per_token_layer;
use rollplex_cost::CostModel;
use rollplex_plan::spec::{Mode, OptimizerState, Recompute};
use rollplex_plan::work::{HostDir, WorkKind};
use rollplex_plan::{
    BufferClass, BufferRole, Op, Phase, ReshardPoint, SolverStats, TrainPrefixSource,
};

/// Bytes by which earlier attempts overshot, per memory row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cuts {
    pub decode: u64,
    pub train: u64,
    /// Ignore the job's host budget (the driver's last attempt).
    pub host_unlimited: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item {
    RefWeights,
    OptimizerState,
    FrozenRollout,
}

/// The residency part of the model and what each item is.
pub struct Model {
    pub input: Residency,
    pub items: Vec<Item>,
    /// The producer class of each kept state, in `input.kept` order.
    pub kept: Vec<SideClass>,
    pub reshard: Vec<ReshardPoint>,
    /// The kept activation layers `pg` was lowered with (the answer unless the ILP decides).
    pub kept_layers: KeptLayers,
    /// How a streamed optimizer step would chunk the state (with an optimizer-state item).
    pub stream_shape: Option<StreamShape>,
}

/// Host -> device seconds a streamed optimizer step's chunk copy aims at: long enough that a
/// copy's fixed cost is small, short enough that the fill and drain are.
pub const STREAM_CHUNK_S: f64 = 4e-3;
/// Staging slots of a streamed optimizer step: the chunk being updated, the next one coming
/// in and the previous one going back.
pub const STREAM_SLOTS: u32 = 3;

const GIB: f64 = (1u64 << 30) as f64;

/// Seconds a streamed optimizer step takes whose update alone takes `update_s` (spread evenly
/// over its `chunks` chunks of `chunk_elems` parameters): the copy of the first chunk in (the
/// fill), one stage per chunk of the longer of its update and the copies beside it (the next
/// chunk in and the previous one back, one after the other on the copy stream, each at the host
/// link's rate in its direction), and the write-back of the last (the drain).
pub fn streamed_step_s(cost: &CostModel, update_s: f64, chunk_elems: u64, chunks: u32) -> f64 {
    let chunk = (chunk_elems * 12) as f64;
    let w = rollplex_plan::work::Work {
        bytes: chunk,
        steps: 1,
        host_bytes: chunk,
        ..Default::default()
    };
    let sms = cost.gpu().sms;
    let cin = cost.time_dir(WorkKind::Transfer, &w, sms, HostDir::ToDevice);
    let cout = cost.time_dir(WorkKind::Transfer, &w, sms, HostDir::ToHost);
    let n = chunks.max(1) as f64;
    cin + cout + n * (cin + cout).max(update_s / n)
}

/// The chunking of a streamed optimizer step over `elems` parameters (12 bytes each: master,
/// two moments) at `s_per_byte` host -> device: chunks of [`STREAM_CHUNK_S`] of copy, at most
/// an eighth of the state (so the staging slots are a fraction of it even for small models),
/// a multiple of 64 parameters.
pub fn stream_chunks(elems: u64, s_per_byte: f64) -> StreamShape {
    let by_time = if s_per_byte > 0.0 {
        (STREAM_CHUNK_S / s_per_byte / 12.0) as u64
    } else {
        u64::MAX
    };
    let chunk_elems = by_time.min(elems.div_ceil(8)).max(1).next_multiple_of(64);
    StreamShape {
        chunk_elems,
        chunks: elems.div_ceil(chunk_elems).max(1) as u32,
        slots: STREAM_SLOTS,
    }
}

/// What kept activation layers cost and save (`recompute = auto`; `pg` lowered with none
/// kept): the largest micro-batch's activations of one layer beyond its input, and one
/// layer's forward over every micro-batch of the iteration at the training rate.
fn act_layers(
    pg: &PhaseGraph,
    cost: &CostModel,
    wl: &crate::workload::Workload<'_>,
    decode_class: Option<usize>,
) -> ActLayers {
    let ttp = pg.topo.parallel.train_tp.max(1);
    let r = pg.shapes.max_new_tokens as u64;
    let sms = pg.spec.cluster.gpu.sms;
    let (mut tokens, mut fwd_s) = (0u64, 0.0);
    for i in pg.ids() {
        if let Op::TrainMicroBatch { samples, .. } = pg.node(i).op {
            tokens = tokens.max(samples.len() as u64 * r);
            let fwd = wl.suffix(samples.len() as f64, ttp);
            fwd_s += cost.time(WorkKind::ActorBwd, &fwd, sms);
        }
    }
    let decode = decode_class.map_or(ActDecode::Never, ActDecode::Class);
    layer_decision(pg, tokens, fwd_s, decode, None)
}

/// A kept-layers decision over `tokens` rows (one layer's activations beyond its input each,
/// on a training rank) whose layers' forward takes `fwd_s` in all.
fn layer_decision(
    pg: &PhaseGraph,
    tokens: u64,
    fwd_s: f64,
    decode: ActDecode,
    in_state: Option<usize>,
) -> ActLayers {
    let m = &pg.spec.actor;
    let ttp = pg.topo.parallel.train_tp.max(1) as u64;
    let per_token = (kept_act_bytes_per_token_layer(m, 1, false)
        - kept_act_bytes_per_token_layer(m, 1, true))
        / ttp;
    let layers = m.text.num_layers;
    ActLayers {
        layers,
        bytes_per_layer: (tokens * per_token) as f64,
        recompute_s: fwd_s / layers.max(1) as f64,
        decode,
        in_state,
    }
}

/// What kept prompt-row layers cost and save (`recompute = auto`; `pg` lowered with none
/// kept): every training group's prompt rows of one step's kept prompt forwards (the store a
/// step's micro-batches read), one layer's activations beyond its input, and one layer's
/// forward over the prompt rows of every micro-batch at the training rate (what their
/// backward recomputes).
fn prompt_layers(
    pg: &PhaseGraph,
    cost: &CostModel,
    wl: &crate::workload::Workload<'_>,
    decode: ActDecode,
    in_state: Option<usize>,
) -> ActLayers {
    let ttp = pg.topo.parallel.train_tp.max(1);
    let copies = pg.copies as f64;
    let sms = pg.spec.cluster.gpu.sms;
    let (mut rows, mut fwd_s) = (vec![0u64; pg.topo.batch.steps as usize], 0.0);
    for i in pg.ids() {
        if let Op::TrainMicroBatch {
            step,
            prefix_bwd_slots,
            ..
        } = pg.node(i).op
        {
            let groups = prefix_bwd_slots.len();
            if let Some(r) = rows.get_mut(step as usize) {
                *r += (groups as f64 * copies) as u64 * pg.shapes.prompt_tokens;
            }
            let fwd = wl.micro_batch_prompts(groups, pg.copies, ttp);
            fwd_s += cost.time(WorkKind::ActorBwd, &fwd, sms);
        }
    }
    let tokens = rows.into_iter().max().unwrap_or(0);
    layer_decision(pg, tokens, fwd_s, decode, in_state)
}

fn bytes(pg: &PhaseGraph, role: BufferRole) -> f64 {
    pg.buffer_with(role)
        .map(|i| pg.buffer(i).bytes as f64)
        .unwrap_or(0.0)
}

/// Builds the residency model of `pg`. `class_index` maps a side class to its index in the
/// overlap problem (`None` in serial and disaggregated plans).
pub fn model(
    pg: &PhaseGraph,
    cost: &CostModel,
    cuts: Cuts,
    class_index: &dyn Fn(SideClass) -> Option<usize>,
) -> Model {
    let spec = &pg.spec;
    let total = spec.cluster.gpu.sms;
    let (rg, tg) = (pg.topo.rollout_gpu, pg.topo.train_gpu);
    let overlap = pg.topo.mode == Mode::Overlap;
    let wl = crate::workload::Workload {
        spec,
        shapes: &pg.shapes,
        lengths: &pg.lengths,
    };
    // a copy of `b` bytes over the host link, each direction at its own rate
    let copy_s = |b: f64, dir| cost.time_dir(WorkKind::Transfer, &wl.transfer(0.0, b), total, dir);
    let reload_s = |b: f64| copy_s(b, HostDir::ToDevice);
    let offload_s = |b: f64| copy_s(b, HostDir::ToHost);
    let mut items = Vec::new();
    let mut kinds = Vec::new();
    let item_roles = [
        BufferRole::RefWeights,
        BufferRole::MasterWeights,
        BufferRole::AdamMoments,
        BufferRole::FrozenRolloutWeights,
    ];
    if pg.buffer_with(BufferRole::RefWeights).is_some() {
        let b = bytes(pg, BufferRole::RefWeights);
        items.push(ResItem {
            name: "ref_weights".into(),
            bytes: b,
            host_bytes: b,
            off_s: reload_s(b),
            decode_kept: tg == rg,
            decode_off: false,
            decode_if_class: [SideClass::RefPrefix, SideClass::RefSuffix]
                .into_iter()
                .filter_map(class_index)
                .collect(),
            train_kept: true,
            train_off: false,
            stream: None,
            fixed: None,
        });
        kinds.push(Item::RefWeights);
    }
    let opt = bytes(pg, BufferRole::MasterWeights) + bytes(pg, BufferRole::AdamMoments);
    let mut stream_shape = None;
    let mut stream_item = None; // the optimizer state, streaming left to the ILP
    if opt > 0.0 {
        // Streaming: each optimizer step copies chunk k + 1 in and writes chunk k - 1 back
        // (one after the other on the copy stream) while chunk k is updated, so a step takes
        // the fill, `chunks` stages of max(copies, update) and the drain.
        let elems = bytes(pg, BufferRole::MasterWeights) as u64 / 4;
        let shape = stream_chunks(elems, reload_s(GIB) / GIB);
        let stream_s: f64 = pg
            .ids()
            .map(|i| pg.node(i))
            .filter(|n| n.gpu == tg && matches!(n.op, Op::OptimizerStep { .. }))
            .map(|n| {
                let update = cost.time(n.kind, &n.work, total);
                streamed_step_s(cost, update, shape.chunk_elems, shape.chunks) - update
            })
            .sum();
        let (stream, fixed) = match spec.train.optimizer_state {
            OptimizerState::Auto => (true, None),
            OptimizerState::Hbm => (false, Some(ilp::ItemChoice::Hbm)),
            OptimizerState::Host => (false, Some(ilp::ItemChoice::Off)),
            OptimizerState::Stream => (true, Some(ilp::ItemChoice::Stream)),
        };
        items.push(ResItem {
            name: "optimizer state".into(),
            bytes: opt,
            host_bytes: opt,
            off_s: reload_s(opt) + offload_s(opt),
            decode_kept: tg == rg,
            decode_off: false,
            decode_if_class: vec![],
            train_kept: true,
            train_off: true,
            stream: stream.then(|| ilp::StreamOption {
                train_bytes: (shape.slots as u64 * shape.chunk_elems * 12) as f64,
                stream_s: stream_s.max(0.0),
            }),
            fixed,
        });
        kinds.push(Item::OptimizerState);
        stream_shape = Some(shape);
        stream_item = (fixed.is_none()).then_some(items.len() - 1);
    }
    let sync = pg
        .ids()
        .find(|&i| matches!(pg.node(i).op, Op::WeightSync { .. }))
        .filter(|_| pg.sharing.is_some());
    let sync_s = sync
        .map(|i| cost.time(WorkKind::WeightSync, &pg.node(i).work, total))
        .unwrap_or(0.0);
    let frozen = bytes(pg, BufferRole::FrozenRolloutWeights);
    let mut frozen_idx = None;
    if frozen > 0.0 {
        if let Some(i) = sync {
            let w = &pg.node(i).work;
            let more = rollplex_plan::work::Work {
                net_bytes: w.net_bytes + frozen,
                bytes: w.bytes + frozen,
                ..w.clone()
            };
            frozen_idx = Some(items.len());
            items.push(ResItem {
                name: "rollout_weights.frozen".into(),
                bytes: frozen,
                host_bytes: 0.0,
                off_s: cost.time(WorkKind::WeightSync, &more, total) - sync_s,
                decode_kept: true,
                decode_off: true,
                decode_if_class: vec![],
                train_kept: true,
                train_off: false,
                stream: None,
                fixed: None,
            });
            kinds.push(Item::FrozenRollout);
        }
    }
    // Kept prefix states (only where their producers are classes of the overlap problem).
    let mut kept = Vec::new();
    let mut kept_classes = Vec::new();
    for (class, consumer) in KEPT {
        let (Some(ci), Some(bi)) = (
            class_index(class),
            kept_role(class).and_then(|r| pg.buffer_with(r)),
        ) else {
            continue;
        };
        let n = pg
            .ids()
            .filter(|&i| matches!(pg.node(i).role, Role::Side { class: c, .. } if c == class))
            .count() as u64;
        if n == 0 {
            continue;
        }
        let b = pg.buffer(bi).bytes;
        let chunk = b.div_ceil(n) as f64;
        kept.push(KeptState {
            name: pg.buffer(bi).name.clone(),
            class: ci,
            consumers: class_index(consumer).into_iter().collect(),
            host_resident: (2.0 * chunk).min(b as f64),
            host_bytes: b as f64,
            host_s: n as f64 * reload_s(chunk) + offload_s(chunk),
        });
        kept_classes.push(class);
    }
    // Reshard points.
    let mut reshard = Vec::new();
    let mut points = Vec::new();
    if sync.is_some() {
        reshard.push(ReshardOption {
            name: "iteration_start",
            exposed_s: sync_s,
            excludes: vec![],
        });
        points.push(ReshardPoint::IterationStart);
        if overlap && beside_encode_possible(pg) {
            let encode_s: f64 = pg
                .ids()
                .filter(|&i| matches!(pg.node(i).op, Op::EncodeMedia { .. }))
                .map(|i| cost.time(WorkKind::VisionEncode, &pg.node(i).work, total))
                .sum();
            reshard.push(ReshardOption {
                name: "beside_encode",
                exposed_s: (sync_s - encode_s).max(0.0),
                excludes: frozen_idx.into_iter().collect(),
            });
            points.push(ReshardPoint::BesideEncode);
        }
    }
    // Bases.
    let persistent_on = |g| -> f64 {
        pg.buffers
            .iter()
            .filter(|b| b.persistent && b.gpu == g && !item_roles.contains(&b.role))
            .map(|b| b.bytes as f64)
            .sum()
    };
    let max_scratch = |f: &dyn Fn(&Node) -> bool| -> f64 {
        pg.ids()
            .map(|i| pg.node(i))
            .filter(|n| f(n))
            .map(|n| n.scratch)
            .max()
            .unwrap_or(0) as f64
    };
    let mut decode_base = persistent_on(rg);
    for role in [
        BufferRole::MediaEmbeddings,
        BufferRole::TrainMediaEmbeddings,
        BufferRole::KvPrompt,
        BufferRole::KvResponse,
        BufferRole::Samples,
        BufferRole::RolloutWeights,
    ] {
        if pg
            .buffer_with(role)
            .is_some_and(|i| !pg.buffer(i).persistent && pg.buffer(i).gpu == rg)
        {
            decode_base += bytes(pg, role);
        }
    }
    // kept prompt forwards the rollout's prefill writes for training live through decode
    if pg.topo.batch.train_prefix == TrainPrefixSource::Rollout {
        let role = BufferRole::TrainPrefix { step: 0 };
        if pg.buffer_with(role).is_some_and(|i| pg.buffer(i).gpu == rg) {
            decode_base += bytes(pg, role);
        }
    }
    decode_base += max_scratch(&|n| matches!(n.role, Role::Decode { .. }));
    if overlap {
        decode_base += max_scratch(&|n| matches!(n.role, Role::Side { .. }));
    }
    let largest = |class: BufferClass| -> f64 {
        pg.buffers
            .iter()
            .filter(|b| b.class == class && b.gpu == tg && !b.persistent)
            .map(|b| b.bytes as f64)
            .fold(0.0, f64::max)
    };
    let mut train_base =
        persistent_on(tg) + largest(BufferClass::Grads) + largest(BufferClass::Activations);
    for role in [
        BufferRole::RefLogProbs,
        BufferRole::OldLogProbs,
        BufferRole::Scalars,
        BufferRole::Samples,
        BufferRole::TrainSamples,
    ] {
        if pg
            .buffer_with(role)
            .is_some_and(|i| !pg.buffer(i).persistent && pg.buffer(i).gpu == tg)
        {
            train_base += bytes(pg, role);
        }
    }
    train_base += max_scratch(&|n| n.phase == Phase::Training);
    let auto = spec.train.recompute == Recompute::Auto;
    let act_layers = auto.then(|| act_layers(pg, cost, &wl, class_index(SideClass::MicroBatch)));
    // the prompt rows live in the kept prompt forwards: next to decode where the prefill
    // writes them or while their class runs in windows (then their store stays in HBM)
    let prompt_layers = auto.then(|| {
        let (decode, in_state) = match pg.topo.batch.train_prefix {
            TrainPrefixSource::Rollout => (ActDecode::Always, None),
            TrainPrefixSource::Pass => match class_index(SideClass::TrainPrefix) {
                Some(c) => (
                    ActDecode::Class(c),
                    kept_classes
                        .iter()
                        .position(|&k| k == SideClass::TrainPrefix),
                ),
                None => (ActDecode::Never, None),
            },
        };
        prompt_layers(pg, cost, &wl, decode, in_state)
    });
    let budget = spec.schedule.memory_budget as f64;
    // Streaming is offered only where a memory row may move the state off HBM: the training
    // row does not fit with every item in HBM and every activation layer kept, or the decode
    // row with every item in HBM. Elsewhere the answer keeps it in HBM and the ILP gets no
    // variable for it (a model that differs only by an unused variable may break ties
    // between equal plans differently).
    if let Some(i) = stream_item {
        let train_all = train_base
            + items
                .iter()
                .filter(|it| it.train_kept || it.train_off)
                .map(|it| it.bytes)
                .sum::<f64>()
            + [&act_layers, &prompt_layers]
                .into_iter()
                .flatten()
                .map(|a| a.bytes_per_layer * a.layers as f64)
                .sum::<f64>();
        let decode_all = decode_base
            + items
                .iter()
                .filter(|it| it.decode_kept || it.decode_off)
                .map(|it| it.bytes)
                .sum::<f64>();
        if train_all <= budget - cuts.train as f64 && decode_all <= budget - cuts.decode as f64 {
            items[i].stream = None;
        }
    }
    Model {
        input: Residency {
            items,
            kept,
            decode_base,
            train_base,
            decode_budget: budget - cuts.decode as f64,
            train_budget: budget - cuts.train as f64,
            host_budget: if cuts.host_unlimited {
                f64::MAX / 4.0
            } else {
                spec.schedule.host_memory as f64
            },
            reshard,
            act_layers,
            prompt_layers,
        },
        kept_layers: pg.kept,
        stream_shape,
        items: kinds,
        kept: kept_classes,
        reshard: points,
    }
}

/// A job that forces the optimizer state off HBM (`optimizer_state = host` or `stream`) needs
/// the host memory for it (unless the driver's last attempt ignores the host budget).
pub fn check_forced(pg: &PhaseGraph, cuts: Cuts) -> Result<()> {
    let spec = &pg.spec;
    let opt = bytes(pg, BufferRole::MasterWeights) + bytes(pg, BufferRole::AdamMoments);
    let off = matches!(
        spec.train.optimizer_state,
        OptimizerState::Host | OptimizerState::Stream
    );
    if off && !cuts.host_unlimited && opt > spec.schedule.host_memory as f64 {
        return Err(CompileError::user(
            "train.optimizer_state",
            format!(
                "the optimizer state ({:.2} GiB a GPU) is kept on the host, but `host_memory` \
                 is {:.2} GiB",
                opt / GIB,
                spec.schedule.host_memory as f64 / GIB
            ),
            "raise `schedule { host_memory }`, or write `optimizer_state = auto`",
        ));
    }
    Ok(())
}

/// Whether media encoding can run while the weights are resharded: it reads only frozen
/// vision and merger weights.
pub fn beside_encode_possible(pg: &PhaseGraph) -> bool {
    pg.spec.train.freeze_vision
        && pg.spec.train.freeze_merger
        && pg
            .ids()
            .any(|i| matches!(pg.node(i).op, Op::EncodeMedia { .. }))
}

/// The answer's residency as the assembler takes it.
pub fn choice(m: &Model, ans: &ilp::Answer) -> ResidencyChoice {
    let is_off = |k: Item| m.items.iter().zip(&ans.off).any(|(&it, &o)| it == k && o);
    let host = |c: SideClass| {
        m.kept
            .iter()
            .zip(&ans.kept_host)
            .any(|(&k, &h)| k == c && h)
    };
    ResidencyChoice {
        ref_host: is_off(Item::RefWeights),
        optimizer_host: is_off(Item::OptimizerState),
        optimizer_stream: m
            .items
            .iter()
            .zip(&ans.streamed)
            .any(|(&it, &st)| it == Item::OptimizerState && st)
            .then_some(m.stream_shape)
            .flatten(),
        frozen_rebuilt: is_off(Item::FrozenRollout),
        ref_prefix_host: host(SideClass::RefPrefix),
        old_prefix_host: host(SideClass::OldPrefix),
        train_prefix_host: host(SideClass::TrainPrefix),
        reshard: m.reshard.get(ans.reshard).copied().unwrap_or_default(),
        kept: KeptLayers {
            suffix: ans.act_layers.unwrap_or(m.kept_layers.suffix),
            prompt: ans.prompt_layers.unwrap_or(m.kept_layers.prompt),
        },
        room: RowRoom {
            decode: ans.room[0] as u64,
            train: ans.room[1] as u64,
        },
    }
}

/// The residency decision alone (serial and disaggregated plans: no side work to place).
pub fn solve_alone(
    pg: &PhaseGraph,
    cost: &CostModel,
    cuts: Cuts,
    time_limit_s: f64,
) -> Result<(ResidencyChoice, SolverStats, IlpRun)> {
    check_forced(pg, cuts)?;
    let m = model(pg, cost, cuts, &|_| None);
    let problem = ilp::Problem {
        options: vec![],
        decode_time: vec![],
        classes: vec![],
        precs: vec![],
        headroom: 0.0,
        residency: Some(m.input.clone()),
        time_limit_s,
    };
    let ans = ilp::solve(&problem).map_err(CompileError::internal)?;
    let stats = SolverStats {
        solver: "highs".into(),
        status: ans.status,
        variables: ans.variables,
        integer_variables: ans.integer_variables,
        constraints: ans.constraints,
        objective: (ans.objective * 1e6).round() / 1e6,
    };
    let run = IlpRun {
        label: String::new(),
        variables: ans.variables,
        integer_variables: ans.integer_variables,
        constraints: ans.constraints,
        solve_s: ans.solve_s,
        status: ans.status,
        objective: ans.objective,
    };
    Ok((choice(&m, &ans), stats, run))
}

/// A readable summary of a choice (`--stats` candidate labels).
pub fn label(r: &ResidencyChoice, colocated: bool) -> String {
    let mut off = Vec::new();
    if r.ref_host {
        off.push("reference weights on host");
    }
    if r.optimizer_stream.is_some() {
        off.push("optimizer state on host, streamed");
    } else if r.optimizer_host {
        off.push("optimizer state on host");
    }
    if r.frozen_rebuilt {
        off.push("frozen rollout extra rebuilt");
    }
    for (host, name) in [
        (r.ref_prefix_host, "ref prefix states on host"),
        (r.old_prefix_host, "old prefix states on host"),
        (r.train_prefix_host, "train prefix states on host"),
    ] {
        if host {
            off.push(name);
        }
    }
    let mut s = if off.is_empty() {
        "all in HBM".to_string()
    } else {
        off.join(", ")
    };
    s.push_str(&format!(
        "; {} layers' activations kept ({} of the prompt rows)",
        r.kept.suffix, r.kept.prompt
    ));
    if colocated {
        s.push_str(match r.reshard {
            ReshardPoint::IterationStart => "; reshard at iteration start",
            ReshardPoint::BesideEncode => "; reshard beside encoding",
        });
    }
    s
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{paper_job, QwenSize};
    use crate::Options;
    use rollplex_plan::spec::Mode;
    use rollplex_plan::{Op, ReshardPoint, Residency};

    fn compile(spec: &rollplex_plan::spec::JobSpec, mode: Mode) -> rollplex_plan::Plan {
        let opts = Options {
            mode: Some(mode),
            ..Options::default()
        };
        crate::compile(spec, &opts).unwrap().plan
    }

    /// The 7B paper job: encoding (frozen tower) takes longer than the sync, so the ILP runs
    /// the sync beside it on the copy stream; prefill waits for it, encoding does not.
    #[test]
    fn overlap_reshards_beside_encoding() {
        let mut spec = paper_job(QwenSize::B7);
        spec.train.freeze_vision = true;
        spec.train.freeze_merger = true;
        let plan = compile(&spec, Mode::Overlap);
        let w = plan.weight_sharing.as_ref().unwrap();
        assert_eq!(w.reshard_point, ReshardPoint::BesideEncode);
        let sync = plan
            .tasks
            .iter()
            .find(|t| matches!(t.op, Op::WeightSync { .. }))
            .unwrap();
        assert_eq!(plan.streams[sync.stream.index()].name, "copy");
        let enc = plan
            .tasks
            .iter()
            .find(|t| matches!(t.op, Op::EncodeMedia { .. }))
            .unwrap();
        assert!(!enc.deps.contains(&sync.id));
        assert!(enc.start_s < sync.end_s, "encoding runs beside the sync");
        let prefill = plan
            .tasks
            .iter()
            .find(|t| matches!(t.op, Op::Prefill { .. }))
            .unwrap();
        assert!(prefill.start_s >= sync.end_s);
        // Serial plans keep the sync in order on the one stream.
        let plan = compile(&spec, Mode::Serial);
        assert_eq!(
            plan.weight_sharing.as_ref().unwrap().reshard_point,
            ReshardPoint::IterationStart
        );
    }

    /// The decode row counts the kept prompt forwards where the rollout's prefill writes them
    /// (they live from the prefill to the last micro-batch), and not where the training layout's
    /// own pass runs after decode.
    #[test]
    fn the_decode_row_holds_the_prompt_forwards_the_prefill_keeps() {
        use crate::fixtures::job;
        use rollplex_plan::{BufferRole, TrainPrefixSource};
        let base = |spec: &rollplex_plan::spec::JobSpec| {
            let cost = crate::driver::cost_model(spec, None);
            let topo = crate::topology::colocated(spec, Mode::Serial).unwrap();
            let mut pg = crate::lower::lower(spec, topo, Default::default()).unwrap();
            crate::buffers::assign(&mut pg);
            let kept = pg
                .buffer_with(BufferRole::TrainPrefix { step: 0 })
                .map(|i| pg.buffer(i).bytes as f64)
                .unwrap();
            let m = super::model(&pg, &cost, super::Cuts::default(), &|_| None);
            (pg.topo.batch.train_prefix, m.input.decode_base, kept)
        };
        let (src, kept_base, kept) = base(&job(|s| s.train.freeze_merger = true));
        assert_eq!(src, TrainPrefixSource::Rollout);
        // the merger trains: its own pass after decode, the same buffers otherwise
        let (src, pass_base, _) = base(&job(|_| {}));
        assert_eq!(src, TrainPrefixSource::Pass);
        assert!(kept > 1e9, "{kept}");
        assert!(
            (kept_base - pass_base - kept).abs() < 1.0,
            "decode row {kept_base} with the prefill's forwards, {pass_base} without, kept {kept}"
        );
    }

    /// `recompute = auto` keeps every layer's activations of the response rows when they fit,
    /// at least as fast as `none` (which keeps the prompt rows' too: here the planner gives up
    /// a prompt-row layer to keep the reference weights in HBM), and between the peaks of
    /// `full` and `none` keeps only some layers, the response rows' first: within the budget,
    /// predicted between the two (the optimizer state held in HBM). With the optimizer state left to the planner, it
    /// streams the state instead at that budget and keeps every layer, faster than
    /// recomputing.
    #[test]
    fn auto_keeps_the_activation_layers_memory_allows() {
        use rollplex_plan::spec::{OptimizerState, Recompute};
        let with = |r: Recompute, budget: Option<u64>| {
            let mut spec = paper_job(QwenSize::B7);
            spec.train.optimizer_state = OptimizerState::Hbm;
            spec.train.recompute = r;
            if let Some(b) = budget {
                spec.schedule.memory_budget = b;
            }
            compile(&spec, Mode::Serial)
        };
        let layers = paper_job(QwenSize::B7).actor.text.num_layers;
        let (none, full) = (with(Recompute::None, None), with(Recompute::Full, None));
        assert_eq!((none.kept_act_layers, full.kept_act_layers), (layers, 0));
        assert_eq!(
            (none.kept_prompt_layers, full.kept_prompt_layers),
            (layers, 0)
        );
        let (peak_none, peak_full) = (none.memory.gpus[0].peak, full.memory.gpus[0].peak);
        assert!(peak_full < peak_none, "{peak_full} {peak_none}");
        let roomy = with(Recompute::Auto, None);
        assert_eq!(roomy.kept_act_layers, layers);
        assert!(
            roomy.predicted.iteration_s <= none.predicted.iteration_s,
            "auto {} s, none {} s",
            roomy.predicted.iteration_s,
            none.predicted.iteration_s
        );
        assert!(roomy.memory.gpus[0].peak <= roomy.spec.schedule.memory_budget);
        let budget = (peak_full + peak_none) / 2;
        let part = with(Recompute::Auto, Some(budget));
        // the response rows' layers save more time a byte: they are kept first
        let kept = (part.kept_act_layers, part.kept_prompt_layers);
        assert!(
            0 < kept.0 + kept.1 && kept.0 + kept.1 < 2 * layers && kept.0 >= kept.1,
            "(response, prompt) {kept:?} of {layers} kept under {budget}"
        );
        assert!(part.memory.gpus[0].peak <= budget);
        let t = part.predicted.iteration_s;
        assert!(
            none.predicted.iteration_s < t && t < full.predicted.iteration_s,
            "{t}"
        );
        let mut spec = paper_job(QwenSize::B7);
        spec.train.recompute = Recompute::Auto;
        spec.schedule.memory_budget = budget;
        let streamed = compile(&spec, Mode::Serial);
        let st = streamed.optimizer_stream.clone().unwrap_or_else(|| {
            panic!(
                "not streamed: {} layers, peak {}, {}",
                streamed.kept_act_layers,
                streamed.memory.gpus[0].peak,
                streamed.predicted.iteration_s
            )
        });
        assert!(st.chunks > 1 && st.slots == 3, "{st:?}");
        assert_eq!(streamed.kept_act_layers, layers);
        assert!(streamed.memory.gpus[0].peak <= budget);
        let ts = streamed.predicted.iteration_s;
        assert!(
            none.predicted.iteration_s < ts && ts < t,
            "{ts} against {t}"
        );
    }

    /// Less memory moves buffers off HBM, as the ILP prices them; more memory never does.
    #[test]
    fn tight_memory_moves_buffers_off_hbm() {
        let spec = paper_job(QwenSize::B32);
        let roomy = compile(&spec, Mode::Serial);
        let peak = roomy.memory.gpus[0].peak;
        let on_host = |p: &rollplex_plan::Plan| -> Vec<String> {
            p.buffers
                .iter()
                .filter(|b| b.residency.iter().all(|r| r.residency == Residency::Host))
                .map(|b| b.name.clone())
                .collect()
        };
        assert!(on_host(&roomy).is_empty(), "{:?}", on_host(&roomy));
        let mut tight = spec.clone();
        tight.schedule.memory_budget = peak - (4u64 << 30);
        let plan = compile(&tight, Mode::Serial);
        assert!(plan.memory.gpus[0].peak <= tight.schedule.memory_budget);
        assert!(!on_host(&plan).is_empty());
        // Without the host memory to offload into, the error says how much would do.
        tight.schedule.host_memory = 1 << 30;
        let opts = Options {
            mode: Some(Mode::Serial),
            ..Options::default()
        };
        let e = crate::compile(&tight, &opts).err().expect("does not fit");
        assert!(e.is_user(), "{e}");
        assert!(e.to_string().contains("host_memory"), "{e}");
    }

    /// A decode phase too tight for the first step's prefix states next to the KV cache
    /// (32B paper job with 4096-token responses, 2 GiB under its own peak): the ILP keeps the
    /// prefixes in the windows and sends their states to host chunk by chunk; the plan carries
    /// the offloads and reloads, validates and fits.
    #[test]
    fn tight_decode_moves_train_prefix_states_to_host() {
        let mut spec = paper_job(QwenSize::B32);
        spec.rollout.max_new_tokens = 4096;
        let roomy = compile(&spec, Mode::Overlap);
        let kept = |p: &rollplex_plan::Plan| -> (usize, usize) {
            let n = |f: fn(&Op) -> bool| {
                p.tasks
                    .iter()
                    .filter(|t| f(&t.op) && t.name.contains("train_prefix.s0["))
                    .count()
            };
            (
                n(|o| matches!(o, Op::Offload { .. })),
                n(|o| matches!(o, Op::Reload { .. })),
            )
        };
        assert_eq!(
            kept(&roomy),
            (0, 0),
            "roomy plans keep prefix states in HBM"
        );
        let mut tight = spec.clone();
        tight.schedule.memory_budget = roomy.memory.gpus[0].peak - (2u64 << 30);
        let plan = compile(&tight, Mode::Overlap);
        rollplex_plan::validate(&plan).unwrap();
        assert!(plan.memory.gpus[0].peak <= tight.schedule.memory_budget);
        let in_window = plan
            .tasks
            .iter()
            .filter(|t| t.window.is_some() && t.name.starts_with("train_prefix["))
            .count();
        let (offloads, reloads) = kept(&plan);
        assert!(in_window > 0, "the prefixes still overlap decode");
        assert_eq!(offloads, in_window, "one offload per prefix in a window");
        assert_eq!(reloads, in_window);
        // Reloads follow decode; every micro-batch of step 0 follows every reload.
        let last_decode = plan
            .tasks
            .iter()
            .rposition(|t| matches!(t.op, Op::DecodeWindow { .. }))
            .unwrap();
        let prefix_reloads = plan
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::Reload { .. }) && t.name.contains("train_prefix"));
        for t in prefix_reloads {
            assert!(t.id.index() > last_decode && t.start_s >= plan.tasks[last_decode].end_s);
        }
        let last_reload = plan
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::Reload { .. }) && t.name.contains("train_prefix"))
            .map(|t| t.end_s)
            .fold(0.0, f64::max);
        for t in &plan.tasks {
            if let Op::TrainMicroBatch { step: 0, .. } = t.op {
                assert!(
                    t.window.is_none() && t.start_s >= last_reload,
                    "{} {:?} {} {}",
                    t.name,
                    t.window,
                    t.start_s,
                    last_reload
                );
            }
        }
        // Less host memory than the states need: they stay put and something else gives.
        tight.schedule.host_memory = 4 << 30;
        if let Ok(c) = crate::compile(
            &tight,
            &Options {
                mode: Some(Mode::Overlap),
                ..Options::default()
            },
        ) {
            assert_eq!(kept(&c.plan), (0, 0));
        }
    }
}
