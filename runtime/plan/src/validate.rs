//! The plan verifier. The compiler runs it on every plan it emits (and between passes in
//! tests); the runtime runs it on every plan it loads. It never panics, whatever the plan.
//!
//! *Happens-before* below is the transitive closure of two edge sets: each task's `deps`, and
//! the order of tasks on the same stream (a stream runs its tasks in `plan.tasks` order).
//!
//! Invariants checked (each violation is reported with its rule name; all are reported):
//! - `ids`: every table's `id` field equals its index; every id a plan stores (task gpu,
//!   stream, window, deps, reads, writes; buffer gpu and arena; window streams; op buffers;
//!   reshard tasks; memory gpus) is in range; task and buffer names are unique.
//! - `streams`: a task's stream and window belong to the task's GPU; a task in a window runs
//!   on that window's decode or side stream; each window has exactly one `DecodeWindow` task,
//!   on its decode stream, and every `DecodeWindow` task names its window.
//! - `deps`: every dependency points strictly backwards in `plan.tasks` (so the graph is
//!   acyclic and a runtime issuing tasks in list order has recorded every event before anyone
//!   waits on it).
//! - `sms`: window SM splits are in the GPU's granularity: `decode_sms` is a positive multiple
//!   of `sm_granularity` (or the whole GPU when `side_sms` is 0); `side_sms` is 0, a multiple of
//!   the granularity, or the rest of the GPU; the two sum to at most the GPU's SMs. Stream and
//!   task SM counts are at most the GPU's SMs.
//! - `weights`: the weight-version rule. An actor op using the weights after `v > 0`
//!   optimizer steps happens after `OptimizerStep{v-1}`; `OptimizerStep{s}` happens after
//!   every actor op that uses weight version `<= s` and, on colocated GPUs (rollout reads the
//!   actor's weights), after every decode window; optimizer steps are in step order; actor ops
//!   inside a decode window use version 0 only (old log-probs, first step's forward).
//! - `deadlock`: no decode window happens after a task that waits for finished groups (slot
//!   ops, micro-batches): those waits are released only by decode progress.
//! - `ranges`: groups, slots and samples of every op are inside the replica's counts (training
//!   slots inside its trained groups, which are at least 1 and at most its scored groups).
//! - `memory`: a buffer's arena belongs to its GPU and holds `offset..offset+bytes`; a
//!   buffer's lifetime tasks are on its GPU and every task reading or writing it lies between
//!   them in happens-before order; two buffers of one arena whose byte ranges overlap have
//!   lifetimes ordered by happens-before (one's last task before the other's first); a
//!   persistent buffer overlaps nothing; each GPU's device arena fits its budget and `peak`
//!   equals the device arena size.
//! - `roles`: a buffer's class is the one its role fixes; a GPU program has at most one buffer
//!   of each role but kept-state chunks, host copies and scratch (one actor-weights buffer,
//!   one `grads` per step, ...), and one each of actor weights, master weights and Adam moments
//!   where it runs optimizer steps; `grads` and `train_prefix` of step S only where
//!   `OptimizerStep{S}` runs; host copies, and only they, are in host arenas, and an offload
//!   writes (a reload reads) a host copy and nothing else; the decode KV arena's `kv_prompt`
//!   starts at the aligned end of its `kv_response` (the runtime sees them as one range).
//! - `optimizer_stream`: a streamed optimizer step ([`crate::OptimizerStream`]) names a GPU
//!   program that runs optimizer steps, 2 or 3 staging slots and a chunk of at least one
//!   parameter, and as many chunks as cover its state; that program has host copies of the
//!   master weights and of the moments (the moments' twice the masters' bytes), its
//!   `master_weights` and `adam_moments` device buffers are exactly the staging slots, no
//!   reload or offload moves them, and every optimizer step of it reads and writes both host
//!   copies.
//! - `old_logprobs`: the plan's `old_logprobs` says where the loss's old log-probs come from.
//!   `train_forward`: no old-log-prob task (`Purpose::OldLogProb`) or buffer, one optimizer
//!   step per iteration (every micro-batch and step is step 0), no truncated importance
//!   sampling and no `recompute` asked in the spec. `pass`: every micro-batch happens after
//!   the old-log-prob suffix of each completion slot it trains (of every slot under dynamic
//!   sampling), on its GPU program.
//! - `activations`: the plan's `kept_act_layers` is at most the actor's text layers, and is
//!   every layer under `recompute = none`, none under `full`.
//! - `work`: every task's work amounts (its own and its parts') are finite and >= 0, and
//!   parts hold no parts of their own.
//! - `timing`: predicted times are finite, `start_s <= end_s`, a task starts no earlier than
//!   its dependencies end, and tasks of a stream do not overlap in time.

use crate::ids::{BufferId, GpuId, Groups, TaskId};
use crate::plan::{
    align_up, ArenaKind, BufferClass, BufferRole, GpuRole, Lifetime, OldLogProbSource, Op, Plan,
    Purpose,
};
use crate::spec::OldLogProbPass;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub rule: &'static str,
    pub message: String,
}

/// Every broken invariant of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violations(pub Vec<Violation>);

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "plan is invalid ({} problems):", self.0.len())?;
        for v in &self.0 {
            writeln!(f, "  [{}] {}", v.rule, v.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Violations {}

/// Plans larger than this are refused (the happens-before closure is quadratic).
pub const MAX_TASKS: usize = 60_000;
const TIME_EPS: f64 = 1e-6;

/// Checks every invariant in the module docs.
pub fn validate(plan: &Plan) -> Result<(), Violations> {
    let mut v = Checker {
        plan,
        out: Vec::new(),
    };
    if plan.tasks.len() > MAX_TASKS {
        v.err(
            "ids",
            format!(
                "{} tasks, more than the {MAX_TASKS} the verifier accepts",
                plan.tasks.len()
            ),
        );
        return Err(Violations(v.out));
    }
    // Structural checks first: later rules index tables with stored ids.
    v.ids();
    if !v.out.is_empty() {
        return Err(Violations(v.out));
    }
    v.streams();
    v.deps();
    if !v.out.is_empty() {
        return Err(Violations(v.out));
    }
    let hb = HappensBefore::new(plan);
    v.sms();
    v.weights(&hb);
    v.deadlock(&hb);
    v.ranges();
    v.memory(&hb);
    v.roles();
    v.optimizer_stream();
    v.old_logprobs(&hb);
    v.activations();
    v.work();
    v.timing();
    if v.out.is_empty() {
        Ok(())
    } else {
        Err(Violations(v.out))
    }
}

/// Reflexive-transitive closure of deps and stream order, as one bitset of ancestors per task.
pub struct HappensBefore {
    words: usize,
    anc: Vec<u64>,
}

impl HappensBefore {
    /// Requires that every dep points backwards (checked by the `deps` rule).
    pub fn new(plan: &Plan) -> Self {
        let n = plan.tasks.len();
        let words = n.div_ceil(64).max(1);
        let mut anc = vec![0u64; n * words];
        let mut last_on_stream: Vec<Option<usize>> = vec![None; plan.streams.len()];
        for (i, t) in plan.tasks.iter().enumerate() {
            let mut preds: Vec<usize> = t
                .deps
                .iter()
                .map(|d| d.index())
                .filter(|&d| d < i)
                .collect();
            if let Some(slot) = last_on_stream.get_mut(t.stream.index()) {
                if let Some(p) = *slot {
                    preds.push(p);
                }
                *slot = Some(i);
            }
            for p in preds {
                let (lo, hi) = anc.split_at_mut(i * words);
                let src = &lo[p * words..(p + 1) * words];
                let dst = &mut hi[..words];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d |= *s;
                }
                dst[p / 64] |= 1 << (p % 64);
            }
        }
        HappensBefore { words, anc }
    }

    /// Whether `a` happens before `b` (or `a == b`).
    pub fn before_or_same(&self, a: TaskId, b: TaskId) -> bool {
        a == b || self.strictly_before(a, b)
    }

    /// Whether `a` finishes before `b` starts.
    pub fn strictly_before(&self, a: TaskId, b: TaskId) -> bool {
        let (a, b) = (a.index(), b.index());
        match self.anc.get(b * self.words + a / 64) {
            Some(w) => w & (1 << (a % 64)) != 0,
            None => false,
        }
    }
}

struct Checker<'a> {
    plan: &'a Plan,
    out: Vec<Violation>,
}

impl Checker<'_> {
    fn err(&mut self, rule: &'static str, message: String) {
        self.out.push(Violation { rule, message });
    }

    fn ids(&mut self) {
        let p = self.plan;
        let (ng, ns, nw, nt, nb, na) = (
            p.gpus.len(),
            p.streams.len(),
            p.windows.len(),
            p.tasks.len(),
            p.buffers.len(),
            p.memory.arenas.len(),
        );
        macro_rules! check_table {
            ($table:expr, $what:literal) => {
                for (i, x) in $table.iter().enumerate() {
                    if x.id.index() != i {
                        self.err(
                            "ids",
                            format!(concat!($what, " at index {} has id {}"), i, x.id),
                        );
                    }
                }
            };
        }
        check_table!(p.gpus, "gpu");
        check_table!(p.streams, "stream");
        check_table!(p.windows, "window");
        check_table!(p.tasks, "task");
        check_table!(p.buffers, "buffer");
        check_table!(p.memory.arenas, "arena");
        for s in &p.streams {
            if s.gpu.index() >= ng {
                self.err(
                    "ids",
                    format!("{} is on {}, which does not exist", s.id, s.gpu),
                );
            }
        }
        for w in &p.windows {
            if w.gpu.index() >= ng || w.decode_stream.index() >= ns || w.side_stream.index() >= ns {
                self.err("ids", format!("{} refers to a missing gpu or stream", w.id));
            }
        }
        for t in &p.tasks {
            if t.gpu.index() >= ng || t.stream.index() >= ns {
                self.err(
                    "ids",
                    format!("{} `{}` refers to a missing gpu or stream", t.id, t.name),
                );
            }
            if let Some(w) = t.window {
                if w.index() >= nw {
                    self.err(
                        "ids",
                        format!("{} `{}` is in {w}, which does not exist", t.id, t.name),
                    );
                }
            }
            for d in &t.deps {
                if d.index() >= nt {
                    self.err(
                        "ids",
                        format!("{} `{}` depends on {d}, which does not exist", t.id, t.name),
                    );
                }
            }
            for b in t
                .reads
                .iter()
                .chain(&t.writes)
                .chain(op_buffers(&t.op).iter())
            {
                if b.index() >= nb {
                    self.err(
                        "ids",
                        format!("{} `{}` uses {b}, which does not exist", t.id, t.name),
                    );
                }
            }
        }
        for b in &p.buffers {
            if b.gpu.index() >= ng || b.arena.index() >= na {
                self.err(
                    "ids",
                    format!("{} `{}` refers to a missing gpu or arena", b.id, b.name),
                );
            }
            if let Lifetime::Tasks { first, last } = b.lifetime {
                if first.index() >= nt || last.index() >= nt {
                    self.err(
                        "ids",
                        format!("{} `{}` has a lifetime naming a missing task", b.id, b.name),
                    );
                }
            }
        }
        for a in &p.memory.arenas {
            if a.gpu.index() >= ng {
                self.err(
                    "ids",
                    format!("{} is on {}, which does not exist", a.id, a.gpu),
                );
            }
        }
        for m in &p.memory.gpus {
            if m.gpu.index() >= ng || m.live_peak_at.index() >= nt.max(1) {
                self.err(
                    "ids",
                    format!("memory entry of {} refers to a missing gpu or task", m.gpu),
                );
            }
        }
        for r in &p.reshards {
            if r.task.index() >= nt {
                self.err(
                    "ids",
                    format!("a reshard names {}, which does not exist", r.task),
                );
            }
        }
        let mut names = std::collections::HashSet::new();
        for t in &p.tasks {
            if !names.insert(t.name.as_str()) {
                self.err("ids", format!("task name `{}` is used twice", t.name));
            }
        }
        let mut names = std::collections::HashSet::new();
        for b in &p.buffers {
            if !names.insert(b.name.as_str()) {
                self.err("ids", format!("buffer name `{}` is used twice", b.name));
            }
        }
    }

    fn streams(&mut self) {
        let p = self.plan;
        let mut decode_tasks = vec![0u32; p.windows.len()];
        for t in &p.tasks {
            let s = &p.streams[t.stream.index()];
            if s.gpu != t.gpu {
                self.err(
                    "streams",
                    format!(
                        "{} `{}` is on {} but its stream {} is on {}",
                        t.id, t.name, t.gpu, s.id, s.gpu
                    ),
                );
            }
            let is_decode = matches!(t.op, Op::DecodeWindow { .. });
            match t.window {
                Some(wid) => {
                    let w = &p.windows[wid.index()];
                    if w.gpu != t.gpu {
                        self.err(
                            "streams",
                            format!(
                                "{} `{}` is on {} but its window {wid} is on {}",
                                t.id, t.name, t.gpu, w.gpu
                            ),
                        );
                    }
                    if t.stream != w.decode_stream && t.stream != w.side_stream {
                        self.err(
                            "streams",
                            format!(
                                "{} `{}` is in {wid} but on {}, neither of its streams",
                                t.id, t.name, t.stream
                            ),
                        );
                    }
                    if is_decode {
                        decode_tasks[wid.index()] += 1;
                        if t.stream != w.decode_stream {
                            self.err(
                                "streams",
                                format!(
                                    "decode task {} is not on the decode stream of {wid}",
                                    t.id
                                ),
                            );
                        }
                    }
                }
                None if is_decode => {
                    self.err(
                        "streams",
                        format!("decode task {} `{}` has no window", t.id, t.name),
                    );
                }
                None => {}
            }
        }
        for (i, n) in decode_tasks.iter().enumerate() {
            if *n != 1 {
                self.err(
                    "streams",
                    format!("win{i} has {n} decode tasks, expected exactly 1"),
                );
            }
        }
    }

    fn deps(&mut self) {
        for (i, t) in self.plan.tasks.iter().enumerate() {
            for d in &t.deps {
                if d.index() >= i {
                    self.err(
                        "deps",
                        format!(
                            "{} `{}` depends on {d}, which is not earlier in the task list",
                            t.id, t.name
                        ),
                    );
                }
            }
        }
    }

    fn sms(&mut self) {
        let p = self.plan;
        let (total, gran) = (p.target.sms, p.target.sm_granularity.max(1));
        for s in &p.streams {
            if s.sms == 0 || s.sms > total {
                self.err(
                    "sms",
                    format!("{} has {} SMs; the GPU has {total}", s.id, s.sms),
                );
            }
        }
        for w in &p.windows {
            let ok_decode = w.decode_sms > 0
                && w.decode_sms <= total
                && (w.decode_sms % gran == 0 || (w.side_sms == 0 && w.decode_sms == total));
            if !ok_decode {
                self.err(
                    "sms",
                    format!(
                        "{} gives decode {} SMs: not a positive multiple of {gran} within {total}",
                        w.id, w.decode_sms
                    ),
                );
            }
            let rest = total.saturating_sub(w.decode_sms);
            if w.decode_sms.saturating_add(w.side_sms) > total {
                self.err(
                    "sms",
                    format!(
                        "{} splits {} + {} SMs, more than the GPU's {total}",
                        w.id, w.decode_sms, w.side_sms
                    ),
                );
            } else if w.side_sms != 0 && w.side_sms % gran != 0 && w.side_sms != rest {
                self.err("sms", format!("{} gives side work {} SMs: not a multiple of {gran} nor the remaining {rest}", w.id, w.side_sms));
            }
        }
        for t in &p.tasks {
            if t.sms > total {
                self.err(
                    "sms",
                    format!(
                        "{} `{}` assumes {} SMs; the GPU has {total}",
                        t.id, t.name, t.sms
                    ),
                );
            }
            if let Some(wid) = t.window {
                let w = &p.windows[wid.index()];
                let cap = if t.stream == w.decode_stream {
                    w.decode_sms
                } else {
                    w.side_sms
                };
                if t.sms > cap {
                    self.err(
                        "sms",
                        format!(
                            "{} `{}` assumes {} SMs in {wid}, whose share is {cap}",
                            t.id, t.name, t.sms
                        ),
                    );
                }
            }
        }
    }

    fn weights(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        for g in 0..p.gpus.len() {
            let gpu = GpuId::from_index(g);
            let colocated = p.gpus[g].role == GpuRole::Colocated;
            let on_gpu: Vec<&crate::plan::Task> = p.tasks.iter().filter(|t| t.gpu == gpu).collect();
            let steps: Vec<(u32, TaskId)> = on_gpu
                .iter()
                .filter_map(|t| match t.op {
                    Op::OptimizerStep { step } => Some((step, t.id)),
                    _ => None,
                })
                .collect();
            for w in steps.windows(2) {
                if w[1].0 != w[0].0 + 1 || !hb.strictly_before(w[0].1, w[1].1) {
                    self.err(
                        "weights",
                        format!(
                            "optimizer steps {} ({}) and {} ({}) are out of order",
                            w[0].0, w[0].1, w[1].0, w[1].1
                        ),
                    );
                }
            }
            let step_task = |s: u32| steps.iter().find(|(k, _)| *k == s).map(|(_, t)| *t);
            for t in &on_gpu {
                if let Some(v) = t.op.actor_weight_version() {
                    if t.window.is_some() && v != 0 {
                        self.err("weights", format!("{} `{}` uses actor weights v{v} inside a decode window; only v0 work (old log-probs, the first step) may run there", t.id, t.name));
                    }
                    if v > 0 {
                        match step_task(v - 1) {
                            Some(s) if hb.strictly_before(s, t.id) => {}
                            Some(s) => self.err("weights", format!("{} `{}` uses weights v{v} but does not wait for optimizer step {} ({s})", t.id, t.name, v - 1)),
                            None => self.err("weights", format!("{} `{}` uses weights v{v} but optimizer step {} does not exist", t.id, t.name, v - 1)),
                        }
                    }
                    for &(s, st) in &steps {
                        if s >= v && !hb.strictly_before(t.id, st) {
                            self.err("weights", format!("optimizer step {s} ({st}) may overwrite the weights v{v} that {} `{}` reads", t.id, t.name));
                        }
                    }
                }
                if colocated && matches!(t.op, Op::DecodeWindow { .. }) {
                    for &(s, st) in &steps {
                        if !hb.strictly_before(t.id, st) {
                            self.err("weights", format!("optimizer step {s} ({st}) may run while decode {} `{}` still reads the weights", t.id, t.name));
                        }
                    }
                }
            }
        }
    }

    fn deadlock(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let waiting: Vec<TaskId> = p
            .tasks
            .iter()
            .filter(|t| waits_for_groups(&t.op))
            .map(|t| t.id)
            .collect();
        for d in p
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::DecodeWindow { .. }))
        {
            for &w in &waiting {
                if p.tasks[w.index()].gpu == d.gpu && hb.strictly_before(w, d.id) {
                    self.err("deadlock", format!("decode {} `{}` waits for {w} `{}`, which waits for decode to finish groups", d.id, d.name, p.tasks[w.index()].name));
                }
            }
        }
    }

    fn ranges(&mut self) {
        let p = self.plan;
        let par = &p.parallel;
        let g = par.group_size;
        if par.trained_groups_per_train_replica == 0
            || par.trained_groups_per_train_replica > par.prompts_per_train_replica
        {
            self.err(
                "ranges",
                format!(
                    "a training replica trains {} of its {} groups (at least 1, at most all)",
                    par.trained_groups_per_train_replica, par.prompts_per_train_replica
                ),
            );
        }
        for t in &p.tasks {
            let role = p.gpus[t.gpu.index()].role;
            let rollout_side = matches!(t.op, Op::EncodeMedia { .. } | Op::Prefill { .. });
            let groups = if rollout_side || role == GpuRole::Rollout {
                par.prompts_per_rollout_replica
            } else {
                par.prompts_per_train_replica
            };
            let trained = par.trained_groups_per_train_replica;
            let bad = match &t.op {
                Op::EncodeMedia { groups: s, copies }
                | Op::Prefill { groups: s, copies }
                | Op::RefPrefix { groups: s, copies } => {
                    s.is_empty() || s.end > groups || (*copies != 1 && *copies != g)
                }
                Op::ActorPrefix {
                    groups: gs, copies, ..
                } => {
                    let s = gs.span();
                    // training slots count only the trained groups
                    let n = match gs {
                        Groups::Slots(_) if !rollout_side && role != GpuRole::Rollout => trained,
                        _ => groups,
                    };
                    s.is_empty() || s.end > n || (*copies != 1 && *copies != g)
                }
                Op::RefSuffix { slot }
                | Op::ActorSuffix { slot, .. }
                | Op::Reward { slot }
                | Op::Advantages { slot } => *slot >= groups,
                Op::TrainMicroBatch {
                    samples,
                    prefix_bwd_slots,
                    ..
                } => {
                    samples.is_empty()
                        || samples.end as u64 > trained as u64 * g as u64
                        || prefix_bwd_slots.end > trained
                }
                _ => false,
            };
            if bad {
                self.err(
                    "ranges",
                    format!(
                        "{} `{}`: {:?} is outside the replica's {groups} groups of {g}",
                        t.id, t.name, t.op
                    ),
                );
            }
        }
    }

    fn activations(&mut self) {
        let p = self.plan;
        let layers = p.spec.actor.text.num_layers;
        let kept = p.kept_act_layers;
        if kept > layers {
            self.err(
                "activations",
                format!("kept_act_layers {kept} is more than the actor's {layers} text layers"),
            );
        }
        let recompute = p.spec.train.recompute;
        if let Some(fixed) = recompute.kept_layers(layers) {
            if kept != fixed {
                let name = if fixed == 0 { "full" } else { "none" };
                self.err(
                    "activations",
                    format!("kept_act_layers {kept}, but `recompute = {name}` keeps {fixed} of {layers} layers"),
                );
            }
        }
    }

    fn old_logprobs(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let is_old = |op: &Op| {
            matches!(
                op,
                Op::ActorPrefix {
                    purpose: Purpose::OldLogProb,
                    ..
                } | Op::ActorSuffix {
                    purpose: Purpose::OldLogProb,
                    ..
                }
            )
        };
        match p.old_logprobs {
            OldLogProbSource::TrainForward => {
                let reason = "the plan takes the old log-probs from the training forward";
                for t in p.tasks.iter().filter(|t| is_old(&t.op)) {
                    self.err(
                        "old_logprobs",
                        format!(
                            "{} `{}` is an old-log-prob pass, but {reason}",
                            t.id, t.name
                        ),
                    );
                }
                for b in &p.buffers {
                    if matches!(b.role, BufferRole::OldLogProbs | BufferRole::OldPrefixKv) {
                        self.err(
                            "old_logprobs",
                            format!(
                                "{} `{}` holds old-log-prob state, but {reason}",
                                b.id, b.name
                            ),
                        );
                    }
                }
                for t in &p.tasks {
                    if let Op::TrainMicroBatch { step, .. } | Op::OptimizerStep { step } = t.op {
                        if step != 0 {
                            self.err(
                                "old_logprobs",
                                format!(
                                    "{} `{}` trains at optimizer step {step}: after the first step the weights are no longer the rollout's, yet {reason}",
                                    t.id, t.name
                                ),
                            );
                        }
                    }
                }
                let train = &p.spec.train;
                if train.algorithm.loss().tis_cap.is_some() {
                    self.err(
                        "old_logprobs",
                        format!("truncated importance sampling (`tis_cap`) weighs tokens by the old log-probs before the loss, yet {reason}"),
                    );
                }
                if train.old_logprobs == OldLogProbPass::Recompute {
                    self.err(
                        "old_logprobs",
                        format!("the job asks for the old-log-prob pass (`old_logprobs = recompute`), yet {reason}"),
                    );
                }
            }
            OldLogProbSource::Pass => {
                let par = &p.parallel;
                let (g, scored) = (par.group_size.max(1), par.prompts_per_train_replica);
                let dynamic = par.trained_groups_per_train_replica < scored;
                let mut suffixes: BTreeMap<(GpuId, u32), Vec<TaskId>> = BTreeMap::new();
                for o in &p.tasks {
                    if let Op::ActorSuffix {
                        slot,
                        purpose: Purpose::OldLogProb,
                    } = o.op
                    {
                        suffixes.entry((o.gpu, slot)).or_default().push(o.id);
                    }
                }
                for t in &p.tasks {
                    let Op::TrainMicroBatch { samples, .. } = t.op else {
                        continue;
                    };
                    // the completion slots whose old log-probs the micro-batch reads (under
                    // dynamic sampling its training slots may be any of them)
                    let (first, end) = if dynamic {
                        (0, scored)
                    } else {
                        (samples.start / g, samples.end.div_ceil(g).min(scored))
                    };
                    // a slot is scored when one of its suffixes on this program happens before;
                    // counted over the suffixes that exist, so a broken plan's huge ranges
                    // cost nothing
                    let done: Vec<u32> = suffixes
                        .range((t.gpu, first)..(t.gpu, end.max(first)))
                        .filter(|(_, os)| os.iter().any(|&o| hb.strictly_before(o, t.id)))
                        .map(|(&(_, k), _)| k)
                        .collect();
                    let wanted = end.saturating_sub(first);
                    if done.len() as u64 != u64::from(wanted) {
                        let missing = (first..end)
                            .find(|k| done.binary_search(k).is_err())
                            .unwrap_or(first);
                        self.err(
                            "old_logprobs",
                            format!(
                                "{} `{}` trains on the old log-probs of slots {first}..{end}, but {} of them (slot {missing} first) have no old-log-prob suffix before it",
                                t.id,
                                t.name,
                                wanted as usize - done.len()
                            ),
                        );
                    }
                }
            }
        }
    }

    fn memory(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let mut users: Vec<Vec<TaskId>> = vec![Vec::new(); p.buffers.len()];
        for t in &p.tasks {
            for b in t
                .reads
                .iter()
                .chain(&t.writes)
                .chain(op_buffers(&t.op).iter())
            {
                users[b.index()].push(t.id);
            }
        }
        for b in &p.buffers {
            let a = &p.memory.arenas[b.arena.index()];
            if a.gpu != b.gpu {
                self.err(
                    "memory",
                    format!(
                        "{} `{}` is on {} but in {} of {}",
                        b.id, b.name, b.gpu, a.id, a.gpu
                    ),
                );
            }
            if b.offset
                .checked_add(b.bytes)
                .is_none_or(|end| end > a.bytes)
            {
                self.err(
                    "memory",
                    format!(
                        "{} `{}` at {}+{} overruns {} ({} bytes)",
                        b.id, b.name, b.offset, b.bytes, a.id, a.bytes
                    ),
                );
            }
            if let Lifetime::Tasks { first, last } = b.lifetime {
                for x in [first, last] {
                    if p.tasks[x.index()].gpu != b.gpu {
                        self.err(
                            "memory",
                            format!("{} `{}` has lifetime task {x} on another GPU", b.id, b.name),
                        );
                    }
                }
                if !hb.before_or_same(first, last) {
                    self.err(
                        "memory",
                        format!(
                            "{} `{}`: lifetime start {first} does not happen before its end {last}",
                            b.id, b.name
                        ),
                    );
                }
                for &u in &users[b.id.index()] {
                    if !(hb.before_or_same(first, u) && hb.before_or_same(u, last)) {
                        self.err(
                            "memory",
                            format!(
                                "{} `{}` is used by {u} outside its lifetime {first}..{last}",
                                b.id, b.name
                            ),
                        );
                    }
                }
            }
        }
        // Overlap check per arena: sort by offset, compare each buffer with those it overlaps.
        for a in &p.memory.arenas {
            let mut bufs: Vec<&crate::plan::Buffer> = p
                .buffers
                .iter()
                .filter(|b| b.arena == a.id && b.bytes > 0)
                .collect();
            bufs.sort_by_key(|b| (b.offset, b.id));
            for i in 0..bufs.len() {
                let x = bufs[i];
                let x_end = x.offset.saturating_add(x.bytes);
                for y in bufs.iter().skip(i + 1) {
                    if y.offset >= x_end {
                        break;
                    }
                    if !ordered(hb, x.lifetime, y.lifetime) {
                        self.err(
                            "memory",
                            format!(
                                "{} `{}` and {} `{}` overlap in {} while both may be alive",
                                x.id, x.name, y.id, y.name, a.id
                            ),
                        );
                    }
                }
            }
        }
        for m in &p.memory.gpus {
            let dev: u64 = p
                .memory
                .arenas
                .iter()
                .filter(|a| a.gpu == m.gpu && a.kind == ArenaKind::Device)
                .map(|a| a.bytes)
                .sum();
            if m.peak != dev {
                self.err(
                    "memory",
                    format!(
                        "{} reports peak {} but its device arenas hold {dev} bytes",
                        m.gpu, m.peak
                    ),
                );
            }
            if dev > m.budget {
                self.err(
                    "memory",
                    format!(
                        "{} needs {dev} device bytes, over its budget of {}",
                        m.gpu, m.budget
                    ),
                );
            }
            if m.live_peak > m.peak {
                self.err(
                    "memory",
                    format!(
                        "{} reports live peak {} above its arena peak {}",
                        m.gpu, m.live_peak, m.peak
                    ),
                );
            }
        }
    }

    fn optimizer_stream(&mut self) {
        let p = self.plan;
        let Some(st) = &p.optimizer_stream else {
            return;
        };
        let bad = |m: String| ("optimizer_stream", m);
        let mut errs = Vec::new();
        if st.gpu.index() >= p.gpus.len() {
            self.err(
                "optimizer_stream",
                format!("streams on {}, not a GPU", st.gpu),
            );
            return;
        }
        if !(2..=3).contains(&st.slots) {
            errs.push(bad(format!("{} staging slots (2 or 3)", st.slots)));
        }
        if st.chunk_elems == 0 {
            errs.push(bad("chunks of 0 parameters".into()));
        }
        let on = |role: BufferRole, class: BufferClass| {
            p.buffers
                .iter()
                .find(|b| b.gpu == st.gpu && b.role == role && b.class == class)
        };
        let host = (
            on(BufferRole::HostCopy, BufferClass::MasterWeights),
            on(BufferRole::HostCopy, BufferClass::OptimizerMoments),
        );
        let dev = (
            on(BufferRole::MasterWeights, BufferClass::MasterWeights),
            on(BufferRole::AdamMoments, BufferClass::OptimizerMoments),
        );
        let steps: Vec<&crate::plan::Task> = p
            .tasks
            .iter()
            .filter(|t| t.gpu == st.gpu && matches!(t.op, Op::OptimizerStep { .. }))
            .collect();
        if steps.is_empty() {
            errs.push(bad(format!("{} runs no optimizer step", st.gpu)));
        }
        match host {
            (Some(hm), Some(hv)) => {
                let total = hm.bytes / 4;
                if hv.bytes != 2 * hm.bytes {
                    errs.push(bad(format!(
                        "host copies of {} B of masters and {} B of moments (twice as many)",
                        hm.bytes, hv.bytes
                    )));
                }
                if st.chunk_elems > 0 && total.div_ceil(st.chunk_elems) != st.chunks as u64 {
                    errs.push(bad(format!(
                        "{} chunks of {} parameters for a state of {total}",
                        st.chunks, st.chunk_elems
                    )));
                }
                for t in &steps {
                    for b in [hm.id, hv.id] {
                        if !t.reads.contains(&b) || !t.writes.contains(&b) {
                            errs.push(bad(format!(
                                "{} `{}` does not read and write the host copy {b}",
                                t.id, t.name
                            )));
                        }
                    }
                }
            }
            _ => errs.push(bad(format!(
                "{} has no host copy of the master weights and the moments",
                st.gpu
            ))),
        }
        match dev {
            (Some(m), Some(v)) => {
                if m.bytes != st.master_bytes() || v.bytes != st.moment_bytes() {
                    errs.push(bad(format!(
                        "staging of {} B of masters and {} B of moments, not {} slots of {} \
                         parameters ({} B and {} B)",
                        m.bytes,
                        v.bytes,
                        st.slots,
                        st.chunk_elems,
                        st.master_bytes(),
                        st.moment_bytes()
                    )));
                }
                for t in p.tasks.iter().filter(|t| t.gpu == st.gpu) {
                    if let Op::Reload { to: b, .. } | Op::Offload { from: b, .. } = t.op {
                        if b == m.id || b == v.id {
                            errs.push(bad(format!(
                                "{} `{}` moves the streamed staging {b} whole",
                                t.id, t.name
                            )));
                        }
                    }
                }
            }
            _ => errs.push(bad(format!(
                "{} has no master weights and moments staging",
                st.gpu
            ))),
        }
        for (rule, m) in errs {
            self.err(rule, m);
        }
    }

    fn roles(&mut self) {
        let p = self.plan;
        let mut seen: BTreeMap<(GpuId, BufferRole), BufferId> = BTreeMap::new();
        for b in &p.buffers {
            if let Some(c) = b.role.class().filter(|&c| c != b.class) {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` has role {:?} but class {:?} (the role's is {c:?})",
                        b.id, b.name, b.role, b.class
                    ),
                );
            }
            if b.role.unique() {
                if let Some(other) = seen.insert((b.gpu, b.role), b.id) {
                    self.err(
                        "roles",
                        format!(
                            "{} `{}` and {other} are both {:?} of {}",
                            b.id, b.name, b.role, b.gpu
                        ),
                    );
                }
            }
            let host_arena = p.memory.arenas[b.arena.index()].kind == ArenaKind::Host;
            if host_arena != (b.role == BufferRole::HostCopy) {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` is {:?} in a {} arena",
                        b.id,
                        b.name,
                        b.role,
                        if host_arena { "host" } else { "device" }
                    ),
                );
            }
        }
        let mut steps: BTreeSet<(GpuId, u32)> = BTreeSet::new();
        for t in &p.tasks {
            let (host, dev) = match t.op {
                Op::Offload { from, to } => (to, from),
                Op::Reload { from, to } => (from, to),
                Op::OptimizerStep { step } => {
                    steps.insert((t.gpu, step));
                    continue;
                }
                _ => continue,
            };
            let role = |b: BufferId| p.buffers[b.index()].role;
            if role(host) != BufferRole::HostCopy || role(dev) == BufferRole::HostCopy {
                self.err(
                    "roles",
                    format!(
                        "{} `{}` moves {host} ({:?}) and {dev} ({:?}): one host copy and one \
                         device buffer",
                        t.id,
                        t.name,
                        role(host),
                        role(dev)
                    ),
                );
            }
        }
        for &(gpu, step) in &steps {
            for role in [
                BufferRole::ActorWeights,
                BufferRole::MasterWeights,
                BufferRole::AdamMoments,
            ] {
                if !seen.contains_key(&(gpu, role)) {
                    self.err(
                        "roles",
                        format!("{gpu} runs optimizer step {step} but has no {role:?} buffer"),
                    );
                }
            }
        }
        for (&(gpu, role), &id) in &seen {
            if let BufferRole::Grads { step } | BufferRole::TrainPrefix { step } = role {
                if !steps.contains(&(gpu, step)) {
                    self.err(
                        "roles",
                        format!("{id} is {role:?} of {gpu}, which runs no optimizer step {step}"),
                    );
                }
            }
            if role != BufferRole::KvResponse {
                continue;
            }
            let resp = &p.buffers[id.index()];
            match seen.get(&(gpu, BufferRole::KvPrompt)) {
                Some(&q) => {
                    let prompt = &p.buffers[q.index()];
                    let end = align_up(resp.offset.saturating_add(resp.bytes));
                    if prompt.arena != resp.arena || prompt.offset != end {
                        self.err(
                            "roles",
                            format!(
                                "{q} `{}` is at {} of {} but {id} `{}` ends at {end} of {}",
                                prompt.name, prompt.offset, prompt.arena, resp.name, resp.arena
                            ),
                        );
                    }
                }
                None => self.err(
                    "roles",
                    format!("{gpu} has {id} `{}` without a KvPrompt buffer", resp.name),
                ),
            }
        }
    }

    fn work(&mut self) {
        for t in &self.plan.tasks {
            if t.work.amounts().any(|a| !(a >= 0.0 && a.is_finite())) {
                self.err(
                    "work",
                    format!(
                        "{} `{}` has a work amount that is negative or not finite",
                        t.id, t.name
                    ),
                );
            }
            if t.work.parts.iter().any(|p| !p.work.parts.is_empty()) {
                self.err(
                    "work",
                    format!(
                        "{} `{}` has a work part with parts of its own",
                        t.id, t.name
                    ),
                );
            }
        }
    }

    fn timing(&mut self) {
        let p = self.plan;
        let mut last_end: Vec<Option<(f64, TaskId)>> = vec![None; p.streams.len()];
        for t in &p.tasks {
            if !(t.start_s.is_finite() && t.end_s.is_finite())
                || t.start_s > t.end_s
                || t.start_s < 0.0
            {
                self.err(
                    "timing",
                    format!(
                        "{} `{}` has predicted times {}..{}",
                        t.id, t.name, t.start_s, t.end_s
                    ),
                );
                continue;
            }
            for d in &t.deps {
                let dt = &p.tasks[d.index()];
                if dt.end_s > t.start_s + TIME_EPS {
                    self.err(
                        "timing",
                        format!(
                            "{} `{}` starts at {} before its dependency {d} ends at {}",
                            t.id, t.name, t.start_s, dt.end_s
                        ),
                    );
                }
            }
            if let Some((end, prev)) = last_end[t.stream.index()] {
                if end > t.start_s + TIME_EPS {
                    self.err(
                        "timing",
                        format!(
                            "{} `{}` starts at {} before {prev} on the same stream ends at {end}",
                            t.id, t.name, t.start_s
                        ),
                    );
                }
            }
            last_end[t.stream.index()] = Some((t.end_s, t.id));
        }
    }
}

/// Buffers an op names directly (offload/reload endpoints).
fn op_buffers(op: &Op) -> Vec<BufferId> {
    match op {
        Op::Offload { from, to } | Op::Reload { from, to } => vec![*from, *to],
        _ => Vec::new(),
    }
}

/// Ops that wait until decode has finished particular groups (they name slots).
pub fn waits_for_groups(op: &Op) -> bool {
    matches!(
        op,
        Op::RefSuffix { .. }
            | Op::ActorSuffix { .. }
            | Op::Reward { .. }
            | Op::Advantages { .. }
            | Op::TrainMicroBatch { .. }
            | Op::ActorPrefix {
                groups: crate::ids::Groups::Slots(_),
                ..
            }
    )
}

fn ordered(hb: &HappensBefore, a: Lifetime, b: Lifetime) -> bool {
    match (a, b) {
        (
            Lifetime::Tasks {
                first: fa,
                last: la,
            },
            Lifetime::Tasks {
                first: fb,
                last: lb,
            },
        ) => hb.strictly_before(la, fb) || hb.strictly_before(lb, fa),
        _ => false,
    }
}
