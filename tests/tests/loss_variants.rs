//! The loss variants on the tiny job (`examples/tiny.rpx`, CPU backend): DAPO with dynamic
//! sampling and GSPO learn the moving-shapes task from random weights, and dynamic sampling
//! trains the groups its rule picks. Serial and overlap plans of each variant stay bitwise
//! identical: `serial_overlap.rs`.
//!
//! The learning checks train 250 iterations each (about a minute in a release build): they
//! run in release builds and are ignored in debug ones (pass `--ignored` to force them).

mod common;

use rollplex_plan::Plan;
use rollplex_runtime::exec::IterationResult;

/// `examples/tiny.rpx` with `algorithm`, `batches` (the `mini_batch` line and, for dynamic
/// sampling, `groups`) and `prompts` rolled out per iteration.
fn tiny_variant(algorithm: &str, batches: &str, prompts: u32) -> Plan {
    let src = common::with_algorithm(
        &common::repo_file("examples/tiny.rpx"),
        algorithm,
        batches,
        prompts,
    );
    common::compile_spec(&common::spec("tiny.rpx", &src), &Default::default())
}

/// DAPO (clip-higher, token-mean, no KL term) rolling out 12 groups and training 8.
fn dapo() -> Plan {
    tiny_variant("dapo()", "mini_batch = 8 * G\n        groups = 8", 12)
}

fn run(plan: &Plan, iterations: u32) -> Vec<IterationResult> {
    common::run_cpu(plan, iterations).expect("run").0
}

fn mean_reward(rs: &[IterationResult]) -> f64 {
    rs.iter().map(IterationResult::reward_mean).sum::<f64>() / rs.len() as f64
}

/// Reward rises: the last 50 iterations' mean is at least 0.1 above the first 50's (measured:
/// from about 0.01 to 0.3 in 250 iterations for both variants, chance being 0.25 once the
/// model answers with a letter at all).
fn assert_learns(rs: &[IterationResult], what: &str) {
    let (first, last) = (mean_reward(&rs[..50]), mean_reward(&rs[rs.len() - 50..]));
    assert!(
        last >= first + 0.1,
        "{what}: mean reward {first:.3} over the first 50 iterations, {last:.3} over the last 50"
    );
}

#[test]
fn dynamic_sampling_trains_the_groups_with_reward_variance_first() {
    let plan = dapo();
    assert_eq!(plan.parallel.prompts_per_train_replica, 12);
    assert_eq!(plan.parallel.trained_groups_per_train_replica, 8);
    let g = plan.spec.rollout.group_size as usize;
    for r in run(&plan, 3) {
        let varied: Vec<u32> = (0..12)
            .filter(|&k| {
                let x = &r.rewards[k as usize * g..(k as usize + 1) * g];
                x.iter().any(|&v| v != x[0])
            })
            .collect();
        assert_eq!(r.metrics.groups_with_variance, Some(varied.len() as u32));
        assert_eq!(r.metrics.groups_trained, 8);
        assert_eq!(r.trained_groups.len(), 8);
        // every group with variance trains (there are at most 8 here), the rest are the
        // lowest-numbered others, and the list is in prompt order
        let mut want: Vec<u32> = varied.iter().copied().take(8).collect();
        want.extend((0..12).filter(|k| !varied.contains(k)).take(8 - want.len()));
        want.sort_unstable();
        assert_eq!(r.trained_groups, want);
        assert_eq!(r.metrics.micro_batches, 8, "one group per micro-batch");
        let a = r.metrics.rollout_agreement.expect("agreement measured");
        assert_eq!(a.tokens, 8 * g as u64, "the trained samples' tokens");
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "250 iterations: runs in release builds (or pass --ignored)"
)]
fn dapo_with_dynamic_sampling_learns() {
    let rs = run(&dapo(), 250);
    assert_learns(&rs, "DAPO with dynamic sampling");
    assert!(rs.iter().all(|r| r.trained_groups.len() == 8));
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "250 iterations: runs in release builds (or pass --ignored)"
)]
fn gspo_learns() {
    let plan = tiny_variant("gspo(kl_coef = 0.01)", "mini_batch = PROMPTS * G", 8);
    assert_eq!(
        plan.spec.train.algorithm.loss().ratio,
        rollplex_plan::spec::RatioLevel::Sequence
    );
    assert_learns(&run(&plan, 250), "GSPO");
}
