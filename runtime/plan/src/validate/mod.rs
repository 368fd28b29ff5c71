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
//! - `train_prefix`: under `rollout` (the rollout's prefill keeps the training prompt
//!   forwards) no `ActorPrefix` task of `Purpose::Train` exists, every micro-batch and
//!   optimizer step is step 0, every micro-batch happens after every prefill of its GPU
//!   program, and the job allows it: colocated, the same TP degree and replicas for rollout
//!   and training, every scored group trained, and a frozen tower and merger where there is
//!   media.
//! - `activations`: the plan's `kept_act_layers` and `kept_prompt_layers` are each at most the
//!   actor's text layers, and every layer under `recompute = none`, none under `full`.
//! - `work`: every task's work amounts (its own and its parts') are finite and >= 0, and
//!   parts hold no parts of their own.
//! - `timing`: predicted times are finite, `start_s <= end_s`, a task starts no earlier than
//!   its dependencies end, and tasks of a stream do not overlap in time.
//!
//! The rules are grouped by concern, one submodule each: `structure` (`ids`, `streams`,
//! `sms`), `order` (`deps`, `weights`, `deadlock`, and the happens-before closure),
//! `residency` (`memory`, `roles`), `optimizer_stream`, `iteration` (`ranges`,
//! `old_logprobs`, `train_prefix`, `activations`) and `predictions` (`work`, `timing`).

mod iteration;
mod optimizer_stream;
mod order;
mod predictions;
mod residency;
mod structure;

use crate::ids::BufferId;
use crate::plan::{Op, Plan};
use std::fmt;

pub use order::{waits_for_groups, HappensBefore};

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
    v.train_prefix(&hb);
    v.activations();
    v.work();
    v.timing();
    if v.out.is_empty() {
        Ok(())
    } else {
        Err(Violations(v.out))
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
}

/// Buffers an op names directly (offload/reload endpoints).
fn op_buffers(op: &Op) -> Vec<BufferId> {
    match op {
        Op::Offload { from, to } | Op::Reload { from, to } => vec![*from, *to],
        _ => Vec::new(),
    }
}
