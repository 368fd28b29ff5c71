//! Which ranks do what: tensor-parallel replicas for rollout and training, the GPU programs
//! of a mode, and the batch arithmetic every later pass relies on.
//!
//! Colocated modes (serial, overlap) have one GPU program run by every rank: rollout replicas
//! of `rollout.tp` ranks and training replicas of `train.tp` ranks over the same GPUs (the
//! larger TP group is a union of consecutive smaller ones). Disaggregated mode has two
//! programs: the first `r` ranks roll out, the rest train.
//!
//! Invariants of an `Ok` topology (the rest of the compiler divides by these without checks):
//! every count below is >= 1, replicas divide the prompts, a training replica's samples split
//! into whole mini-batches and those into whole micro-batches.

// `u32::is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

use crate::error::{CompileError, Result};
use rollplex_plan::spec::{JobSpec, Mode, OldLogProbPass};
use rollplex_plan::{Gpu, GpuId, GpuRole, OldLogProbSource, Parallelism, TrainPrefixSource};

#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    pub mode: Mode,
    pub parallel: Parallelism,
    pub gpus: Vec<Gpu>,
    /// The program that rolls out, and the one that trains (equal when colocated).
    pub rollout_gpu: GpuId,
    pub train_gpu: GpuId,
    pub batch: Batch,
}

/// Per-training-replica batch arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Samples one training replica trains on per iteration.
    pub samples: u32,
    /// Samples per optimizer step on one replica.
    pub mini: u32,
    /// Samples per micro-batch.
    pub micro: u32,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: u32,
    /// Optimizer steps per iteration (epochs x steps per epoch).
    pub steps: u32,
    pub micro_per_step: u32,
    /// Whether the old log-probs get a pass of their own ([`old_logprobs`]).
    pub old_logprobs: OldLogProbSource,
    /// Where the kept prompt forwards of training come from ([`train_prefix`]).
    pub train_prefix: TrainPrefixSource,
}

/// Where the loss's old log-probs come from. The pass is redundant, and left out under
/// `old_logprobs = auto`, when the iteration takes one optimizer step over one epoch: every
/// micro-batch's training forward then runs with the rollout's weights, the very ones the
/// pass would use, so its own log-probs are the old ones and the ratio is exactly 1. It stays
/// with several steps (later steps train on moved weights) and with truncated importance
/// sampling, which weighs each token by `pi_old / pi_sampler` before the loss runs.
pub fn old_logprobs(spec: &JobSpec, steps: u32) -> OldLogProbSource {
    let redundant = steps == 1 && spec.train.algorithm.loss().tis_cap.is_none();
    match spec.train.old_logprobs {
        OldLogProbPass::Auto if redundant => OldLogProbSource::TrainForward,
        OldLogProbPass::Auto | OldLogProbPass::Recompute => OldLogProbSource::Pass,
    }
}

/// Where the micro-batches' kept prompt forwards come from. The training layout's pass is
/// redundant, and left out, when it would redo the rollout's prefill (the rule, shared with the
/// plan's validator: [`TrainPrefixSource::why_not_rollout`]). The prefill then runs the training
/// forward of each group's prompt and keeps it; decode reads its keys, values and logits.
pub fn train_prefix(
    spec: &JobSpec,
    mode: Mode,
    par: &Parallelism,
    steps: u32,
) -> TrainPrefixSource {
    let colocated = mode != Mode::Disaggregated;
    if TrainPrefixSource::why_not_rollout(spec, colocated, par, steps).is_empty() {
        TrainPrefixSource::Rollout
    } else {
        TrainPrefixSource::Pass
    }
}

/// Checks the job's basic counts (what the DSL should have rejected, re-checked so that a
/// spec built in code cannot make the compiler divide by zero).
pub fn check_counts(spec: &JobSpec) -> Result<()> {
    let positive = [
        ("cluster.count", spec.cluster.count as u64),
        ("rollout.tp", spec.rollout.tp as u64),
        ("train.tp", spec.train.tp as u64),
        (
            "rollout.prompts_per_iter",
            spec.rollout.prompts_per_iter as u64,
        ),
        ("rollout.group_size", spec.rollout.group_size as u64),
        ("rollout.max_new_tokens", spec.rollout.max_new_tokens as u64),
        ("train.micro_batch", spec.train.micro_batch as u64),
        ("train.mini_batch", spec.train.mini_batch as u64),
        ("train.epochs", spec.train.epochs as u64),
        ("schedule.decode_window", spec.schedule.decode_window as u64),
        ("cluster.gpu.sms", spec.cluster.gpu.sms as u64),
        ("actor.text.num_layers", spec.actor.text.num_layers as u64),
        ("actor.text.num_heads", spec.actor.text.num_heads as u64),
        (
            "actor.text.num_kv_heads",
            spec.actor.text.num_kv_heads as u64,
        ),
    ];
    for (field, v) in positive {
        if v == 0 {
            return Err(CompileError::user(
                field,
                format!("`{field}` is 0"),
                "it must be at least 1",
            ));
        }
    }
    let gran = spec.cluster.gpu.sm_granularity.max(1);
    if spec.cluster.gpu.sms < gran {
        return Err(CompileError::user(
            "cluster.gpu.sms",
            format!(
                "the GPU has {} SMs, fewer than its partition granularity {gran}",
                spec.cluster.gpu.sms
            ),
            "",
        ));
    }
    Ok(())
}

fn divides(field: &str, what: &str, n: u32, by: u32, by_what: &str) -> Result<()> {
    if by == 0 || n % by != 0 {
        return Err(CompileError::user(
            field,
            format!("{what} ({n}) is not divisible by {by_what} ({by})"),
            format!(
                "choose a multiple of {by}: {} or {}",
                (n / by.max(1)).max(1) * by,
                (n / by.max(1) + 1) * by
            ),
        ));
    }
    Ok(())
}

/// The topology of a colocated mode (serial, overlap).
pub fn colocated(spec: &JobSpec, mode: Mode) -> Result<Topology> {
    check_counts(spec)?;
    let n = spec.cluster.count;
    let (rtp, ttp) = (spec.rollout.tp, spec.train.tp);
    divides(
        "cluster.count",
        "the GPU count",
        n,
        rtp,
        "the rollout TP degree",
    )?;
    divides(
        "cluster.count",
        "the GPU count",
        n,
        ttp,
        "the training TP degree",
    )?;
    let (lo, hi) = (rtp.min(ttp), rtp.max(ttp));
    if hi % lo != 0 {
        return Err(CompileError::user(
            "train.tp",
            format!("rollout TP {rtp} and training TP {ttp} do not nest: the larger must be a multiple of the smaller"),
            "use powers of two, e.g. rollout TP 4 with training TP 8",
        ));
    }
    let gpus = vec![Gpu {
        id: GpuId(0),
        role: GpuRole::Colocated,
        first_rank: 0,
        ranks: n,
    }];
    build(spec, mode, gpus, n / rtp, n / ttp, GpuId(0), GpuId(0))
}

/// The topology of disaggregated mode with `rollout_ranks` ranks rolling out.
pub fn disaggregated(spec: &JobSpec, rollout_ranks: u32) -> Result<Topology> {
    check_counts(spec)?;
    let n = spec.cluster.count;
    if n < 2 {
        return Err(CompileError::user(
            "schedule.mode",
            "disaggregated mode needs at least 2 GPUs (one set rolls out, the other trains); this job has 1",
            "use mode serial or overlap on one GPU",
        ));
    }
    let (rtp, ttp) = (spec.rollout.tp, spec.train.tp);
    let r = rollout_ranks;
    if r == 0 || r >= n || r % rtp != 0 || (n - r) % ttp != 0 {
        return Err(CompileError::internal(format!(
            "invalid disaggregated split {r} of {n}"
        )));
    }
    let gpus = vec![
        Gpu {
            id: GpuId(0),
            role: GpuRole::Rollout,
            first_rank: 0,
            ranks: r,
        },
        Gpu {
            id: GpuId(1),
            role: GpuRole::Train,
            first_rank: r,
            ranks: n - r,
        },
    ];
    build(
        spec,
        Mode::Disaggregated,
        gpus,
        r / rtp,
        (n - r) / ttp,
        GpuId(0),
        GpuId(1),
    )
}

/// Rollout rank counts that make a valid disaggregated split, ascending.
pub fn disaggregated_splits(spec: &JobSpec) -> Vec<u32> {
    let n = spec.cluster.count;
    (1..n).filter(|&r| disaggregated(spec, r).is_ok()).collect()
}

fn build(
    spec: &JobSpec,
    mode: Mode,
    gpus: Vec<Gpu>,
    rollout_replicas: u32,
    train_replicas: u32,
    rollout_gpu: GpuId,
    train_gpu: GpuId,
) -> Result<Topology> {
    let prompts = spec.rollout.prompts_per_iter;
    let g = spec.rollout.group_size;
    divides(
        "rollout.prompts_per_iter",
        "prompts per iteration",
        prompts,
        rollout_replicas,
        "the rollout replicas",
    )?;
    divides(
        "rollout.prompts_per_iter",
        "prompts per iteration",
        prompts,
        train_replicas,
        "the training replicas",
    )?;
    let trained = spec.train.trained_groups(&spec.rollout);
    if trained == 0 || trained > prompts {
        return Err(CompileError::user(
            "train.groups",
            format!("{trained} groups trained per iteration of {prompts} rolled out"),
            format!(
                "train between 1 and {prompts} groups (fewer than rolled out: dynamic sampling)"
            ),
        ));
    }
    divides(
        "train.groups",
        "groups trained per iteration",
        trained,
        train_replicas,
        "the training replicas",
    )?;
    // Training is sized by the trained groups; rollout and scoring by the rolled-out ones.
    let samples_total = trained * g;
    let mini_total = spec.train.mini_batch;
    divides(
        "train.mini_batch",
        "the mini-batch",
        mini_total,
        train_replicas,
        "the training replicas",
    )?;
    if samples_total % mini_total != 0 {
        return Err(CompileError::user(
            "train.mini_batch",
            format!("{samples_total} samples per iteration do not split into mini-batches of {mini_total}"),
            format!("use a divisor of {samples_total}, e.g. {samples_total}"),
        ));
    }
    let mini = mini_total / train_replicas;
    let micro = spec.train.micro_batch;
    if mini % micro != 0 {
        return Err(CompileError::user(
            "train.micro_batch",
            format!("a replica's mini-batch of {mini} samples does not split into micro-batches of {micro}"),
            format!("use a divisor of {mini}"),
        ));
    }
    let steps_per_epoch = samples_total / mini_total;
    if steps_per_epoch > 1 && mini % g != 0 {
        return Err(CompileError::user(
            "train.mini_batch",
            format!("with several optimizer steps per iteration a mini-batch must hold whole GRPO groups; a replica's {mini} samples are not a multiple of the group size {g}"),
            format!("use a multiple of {}", g * train_replicas),
        ));
    }
    let steps = steps_per_epoch * spec.train.epochs;
    let parallel = Parallelism {
        rollout_tp: spec.rollout.tp,
        train_tp: spec.train.tp,
        rollout_replicas,
        train_replicas,
        prompts_per_rollout_replica: prompts / rollout_replicas,
        prompts_per_train_replica: prompts / train_replicas,
        trained_groups_per_train_replica: trained / train_replicas,
        group_size: g,
    };
    Ok(Topology {
        mode,
        gpus,
        rollout_gpu,
        train_gpu,
        batch: Batch {
            samples: trained / train_replicas * g,
            mini,
            micro,
            steps_per_epoch,
            steps,
            micro_per_step: mini / micro,
            old_logprobs: old_logprobs(spec, steps),
            train_prefix: train_prefix(spec, mode, &parallel, steps),
        },
        parallel,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{job, paper_job, QwenSize};

    /// The rollout's prefill keeps the training prompt forwards only where it is that forward:
    /// colocated, one layout, one optimizer step, every group trained, nothing of the media's
    /// encoding to keep for backward.
    #[test]
    fn prefill_keeps_the_training_prompt_forwards_only_where_it_is_that_forward() {
        let source = |spec: &JobSpec, mode: Mode| {
            let t = match mode {
                Mode::Disaggregated => disaggregated(spec, 1).unwrap(),
                m => colocated(spec, m).unwrap(),
            };
            t.batch.train_prefix
        };
        let frozen = job(|s| s.train.freeze_merger = true);
        for mode in [Mode::Serial, Mode::Overlap] {
            assert_eq!(
                source(&frozen, mode),
                TrainPrefixSource::Rollout,
                "{mode:?}"
            );
        }
        let two = job(|s| {
            s.train.freeze_merger = true;
            s.cluster.count = 2;
        });
        assert_eq!(source(&two, Mode::Disaggregated), TrainPrefixSource::Pass);
        // the merger trains (the fixture's default): the encoding's backward state
        assert_eq!(source(&job(|_| ()), Mode::Serial), TrainPrefixSource::Pass);
        let text = job(|s| s.rollout.media = rollplex_plan::spec::MediaSpec::None);
        assert_eq!(source(&text, Mode::Serial), TrainPrefixSource::Rollout);
        let steps = job(|s| {
            s.train.freeze_merger = true;
            s.train.mini_batch = 64;
        });
        assert_eq!(source(&steps, Mode::Serial), TrainPrefixSource::Pass);
        let epochs = job(|s| {
            s.train.freeze_merger = true;
            s.train.epochs = 2;
        });
        assert_eq!(source(&epochs, Mode::Serial), TrainPrefixSource::Pass);
        let tp = job(|s| {
            s.train.freeze_merger = true;
            s.cluster.count = 2;
            s.train.tp = 2;
        });
        assert_eq!(source(&tp, Mode::Serial), TrainPrefixSource::Pass);
        let same_tp = job(|s| {
            s.train.freeze_merger = true;
            s.cluster.count = 2;
            s.train.tp = 2;
            s.rollout.tp = 2;
        });
        assert_eq!(source(&same_tp, Mode::Serial), TrainPrefixSource::Rollout);
        let asked = job(|s| {
            s.train.freeze_merger = true;
            s.train.prompt_forward = rollplex_plan::spec::PromptForwardPass::Recompute;
        });
        assert_eq!(source(&asked, Mode::Overlap), TrainPrefixSource::Pass);
    }

    #[test]
    fn paper_32b_layout() {
        let spec = paper_job(QwenSize::B32);
        let t = colocated(&spec, Mode::Overlap).unwrap();
        assert_eq!(t.parallel.rollout_replicas, 8);
        assert_eq!(t.parallel.train_replicas, 4);
        assert_eq!(t.parallel.prompts_per_train_replica, 32);
        assert_eq!(t.batch.steps, 1);
        assert_eq!(t.batch.micro_per_step, 32);
        assert!(!disaggregated_splits(&spec).is_empty());
    }

    #[test]
    fn indivisible_batch_is_a_user_error() {
        let mut spec = paper_job(QwenSize::B7);
        spec.rollout.prompts_per_iter = 100;
        let e = colocated(&spec, Mode::Serial).unwrap_err();
        assert!(e.is_user(), "{e}");
        assert!(e.to_string().contains("not divisible"), "{e}");
    }
}
