//! The old-log-prob pass left out (`old_logprobs = auto` with one optimizer step per iteration)
//! against the pass forced (`old_logprobs = recompute`), end to end on the CPU backend: the
//! training forward runs with the rollout's weights, so its own log-probs are the pass's, bit
//! for bit, and the two runs give the same samples, losses, metrics and trained weights. Serial
//! and overlap plans of the forced pass stay bitwise identical (the skipped case:
//! `serial_overlap.rs`).

mod common;

use rollplex_plan::spec::Mode;
use rollplex_plan::{OldLogProbSource, Op, Plan, Purpose};
use rollplex_runtime::exec::{self, IterationResult};

fn compile(src: &str, mode: Mode) -> Plan {
    common::compile(&format!("{mode:?}.rpx"), src, mode)
}

/// Runs `iterations` RL iterations: every result and the final weights' bits.
fn run(plan: &Plan, iterations: u32) -> (Vec<IterationResult>, Vec<u32>) {
    common::run_cpu(plan, iterations).expect("run")
}

fn old_tasks(p: &Plan) -> usize {
    p.tasks
        .iter()
        .filter(|t| {
            matches!(
                t.op,
                Op::ActorPrefix {
                    purpose: Purpose::OldLogProb,
                    ..
                } | Op::ActorSuffix {
                    purpose: Purpose::OldLogProb,
                    ..
                }
            )
        })
        .count()
}

/// The ratio is exactly 1 and every trained sample has its old log-probs.
fn assert_on_policy(rs: &[IterationResult], what: &str) {
    for (i, r) in rs.iter().enumerate() {
        let l = &r.metrics.loss;
        assert_eq!(r.metrics.optimizer_steps, 1, "{what}: iteration {i}");
        assert_eq!(
            (l.clip_frac, l.approx_kl),
            (0.0, 0.0),
            "{what}: iteration {i}: ratio 1"
        );
        let a = r.metrics.rollout_agreement.expect("agreement measured");
        assert_eq!(
            a.tokens as usize,
            r.response_tokens(),
            "{what}: iteration {i}"
        );
        let g = r.group_size as usize;
        for &grp in &r.trained_groups {
            for s in grp as usize * g..(grp as usize + 1) * g {
                let old = r.old_logp[s]
                    .as_ref()
                    .expect("old log-probs of a trained sample");
                assert_eq!(old.len(), r.tokens[s].len(), "{what}: sample {s}");
            }
        }
    }
}

fn auto_against_forced(src: &str, iterations: u32, what: &str) {
    let auto = compile(src, Mode::Overlap);
    let pass = compile(&common::with_old_logprob_pass(src), Mode::Overlap);
    assert_eq!(auto.old_logprobs, OldLogProbSource::TrainForward, "{what}");
    assert_eq!(old_tasks(&auto), 0, "{what}: no old-log-prob task");
    assert_eq!(pass.old_logprobs, OldLogProbSource::Pass, "{what}");
    assert!(old_tasks(&pass) > 0, "{what}: the forced pass is planned");
    let a = run(&auto, iterations);
    let b = run(&pass, iterations);
    let initial: Vec<u32> = exec::build_cpu_models(&auto.spec)
        .expect("models")
        .actor()
        .weights
        .data
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert!(a.1 != initial, "{what}: the run moved the weights");
    assert_on_policy(&a.0, what);
    assert_on_policy(&b.0, what);
    common::assert_same_iterations(&a.0, &b.0, what);
    assert!(a.1 == b.1, "{what}: trained weights differ");
}

/// `examples/tiny.rpx`: one-token answers.
#[test]
fn tiny_trains_bitwise_the_same_with_or_without_the_pass() {
    auto_against_forced(&common::repo_file("examples/tiny.rpx"), 8, "tiny");
}

/// Responses of 2 to 16 tokens, the reference on: the pass's suffix forward and the training
/// forward score every token alike.
#[test]
fn longer_responses_train_bitwise_the_same_with_or_without_the_pass() {
    auto_against_forced(&common::overlap_small(), 2, "overlap_small");
}

#[test]
fn serial_and_overlap_agree_with_the_forced_pass() {
    let src = common::with_old_logprob_pass(&common::overlap_small());
    let serial = compile(&src, Mode::Serial);
    let overlap = compile(&src, Mode::Overlap);
    assert_eq!(overlap.old_logprobs, OldLogProbSource::Pass);
    assert!(
        overlap.tasks.iter().any(|t| t.window.is_some()
            && matches!(
                t.op,
                Op::ActorPrefix {
                    purpose: Purpose::OldLogProb,
                    ..
                }
            )),
        "the overlap plan runs old-log-prob prefixes inside decode windows"
    );
    let (a, b) = (run(&serial, 2), run(&overlap, 2));
    common::assert_same_iterations(&a.0, &b.0, "serial vs overlap");
    assert!(a.1 == b.1, "serial vs overlap: trained weights differ");
}
