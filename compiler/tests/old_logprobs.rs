//! The old-log-prob pass: left out when one optimizer step over one epoch makes it redundant
//! (`old_logprobs = auto`), kept with several steps, truncated importance sampling or
//! `old_logprobs = recompute`, and the plan says which.
use rollplex_compiler::fixtures::job;
use rollplex_compiler::{compile, Options};
use rollplex_plan::spec::{JobSpec, Mode, OldLogProbPass};
use rollplex_plan::{validate, BufferRole, Groups, OldLogProbSource, Op, Phase, Plan, Purpose};

fn plan(spec: &JobSpec, mode: Mode) -> Plan {
    compile(
        spec,
        &Options {
            mode: Some(mode),
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .plan
}

fn is_old(op: &Op) -> bool {
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
}

fn old_tasks(p: &Plan) -> usize {
    p.tasks.iter().filter(|t| is_old(&t.op)).count()
}

fn old_buffers(p: &Plan) -> usize {
    p.buffers
        .iter()
        .filter(|b| matches!(b.role, BufferRole::OldLogProbs | BufferRole::OldPrefixKv))
        .count()
}

/// FLOPs of the plan's scoring-phase tasks (wherever the schedule put them).
fn scoring_flops(p: &Plan) -> f64 {
    p.tasks
        .iter()
        .filter(|t| t.op.phase(false) == Some(Phase::Scoring))
        .map(|t| t.work.flops + t.work.parts.iter().map(|x| x.work.flops).sum::<f64>())
        .sum()
}

fn forced() -> JobSpec {
    job(|s| s.train.old_logprobs = OldLogProbPass::Recompute)
}

#[test]
fn one_step_over_one_epoch_leaves_the_pass_out() {
    let spec = job(|_| {});
    assert_eq!(spec.train.mini_batch, 128, "the fixture trains in one step");
    for mode in [Mode::Serial, Mode::Overlap] {
        let p = plan(&spec, mode);
        assert_eq!(p.old_logprobs, OldLogProbSource::TrainForward, "{mode:?}");
        assert_eq!(old_tasks(&p), 0, "{mode:?}: no old-log-prob task");
        assert_eq!(old_buffers(&p), 0, "{mode:?}: no old-log-prob buffer");
    }
    let mut two = spec.clone();
    two.cluster.count = 2;
    let p = plan(&two, Mode::Disaggregated);
    assert_eq!(p.old_logprobs, OldLogProbSource::TrainForward);
    assert_eq!(old_tasks(&p), 0);
}

#[test]
fn recompute_keeps_the_pass_beside_the_first_steps_prefixes() {
    let auto = plan(&job(|_| {}), Mode::Overlap);
    for mode in [Mode::Serial, Mode::Overlap] {
        let p = plan(&forced(), mode);
        assert_eq!(p.old_logprobs, OldLogProbSource::Pass, "{mode:?}");
        assert_eq!(validate(&p), Ok(()), "{mode:?}");
        let slots = p.parallel.prompts_per_train_replica as usize;
        let suffixes = p
            .tasks
            .iter()
            .filter(|t| {
                matches!(
                    t.op,
                    Op::ActorSuffix {
                        purpose: Purpose::OldLogProb,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(
            suffixes, slots,
            "{mode:?}: one old-log-prob suffix per slot"
        );
        assert_eq!(
            old_buffers(&p),
            2,
            "{mode:?}: old prefix KV and old log-probs"
        );
        // one step: the training prefixes still run by prompt, with the rollout's weights
        assert!(p.tasks.iter().any(|t| matches!(
            t.op,
            Op::ActorPrefix {
                groups: Groups::Prompts(_),
                purpose: Purpose::Train { step: 0 },
                ..
            }
        )));
        // the same micro-batches and steps as without the pass
        let training = |p: &Plan| {
            p.tasks
                .iter()
                .filter(|t| matches!(t.op, Op::TrainMicroBatch { .. } | Op::OptimizerStep { .. }))
                .map(|t| t.op.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(training(&p), training(&auto), "{mode:?}");
    }
    let p = plan(&forced(), Mode::Overlap);
    assert!(
        scoring_flops(&p) > scoring_flops(&auto) * 1.5,
        "the pass is scoring work: {} against {} FLOPs",
        scoring_flops(&p),
        scoring_flops(&auto)
    );
    assert!(p.predicted.iteration_s > auto.predicted.iteration_s);
}

#[test]
fn several_steps_or_importance_sampling_keep_the_pass() {
    for (what, spec) in [
        ("two epochs", job(|s| s.train.epochs = 2)),
        ("two mini-batches", job(|s| s.train.mini_batch = 64)),
        (
            "truncated importance sampling",
            job(|s| {
                if let rollplex_plan::spec::Algorithm::Grpo(l) = &mut s.train.algorithm {
                    l.tis_cap = Some(2.0);
                }
            }),
        ),
    ] {
        let p = plan(&spec, Mode::Overlap);
        assert_eq!(p.old_logprobs, OldLogProbSource::Pass, "{what}");
        assert!(old_tasks(&p) > 0, "{what}");
        assert_eq!(validate(&p), Ok(()), "{what}");
    }
}
