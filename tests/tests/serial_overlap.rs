//! The invariant Rollplex stands on: a `serial` plan and an `overlap` plan of the same pipeline
//! and seed produce bitwise-identical samples, log-probs, rewards, losses and final weights.
//! Prefix deduplication must not change a number either. Runs the tiny example on the CPU
//! backend end to end (compile -> plan -> RL iterations).

mod common;

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::exec::IterationResult;

fn compile(src: &str, mode: Mode, dedup: bool) -> Plan {
    let mut spec = common::spec("tiny.rpx", src);
    spec.schedule.prefix_dedup = dedup;
    let opts = rollplex_compiler::Options {
        mode: Some(mode),
        ..Default::default()
    };
    common::compile_spec(&spec, &opts)
}

/// Runs `iterations` RL iterations and returns every result plus the final weights' bits.
fn run(plan: &Plan, iterations: u32) -> (Vec<IterationResult>, Vec<u32>) {
    common::run_cpu(plan, iterations).expect("run")
}

/// The tiny model with prompts large enough that the overlap plan puts side work in decode
/// windows (tests/in/e2e/overlap_small.rpx).
fn tiny_src() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/in/e2e/overlap_small.rpx");
    std::fs::read_to_string(path).expect("tests/in/e2e/overlap_small.rpx")
}
/// Both runs' iterations bit for bit, and their final weights.
fn assert_same(
    a: &(Vec<IterationResult>, Vec<u32>),
    b: &(Vec<IterationResult>, Vec<u32>),
    what: &str,
) {
    common::assert_same_iterations(&a.0, &b.0, what);
    assert!(a.1 == b.1, "{what}: final weights differ");
}

#[test]
fn serial_and_overlap_plans_give_bitwise_identical_training() {
    let src = tiny_src();
    let serial = compile(&src, Mode::Serial, true);
    let overlap = compile(&src, Mode::Overlap, true);
    // one optimizer step: the training forward's log-probs are the old ones, no pass of their
    // own (`old_logprobs.rs` runs the forced pass)
    for p in [&serial, &overlap] {
        assert_eq!(
            p.old_logprobs,
            rollplex_plan::OldLogProbSource::TrainForward
        );
    }
    // the two plans must really schedule differently, or this test proves nothing
    let side_work = |p: &Plan| {
        p.tasks
            .iter()
            .filter(|t| {
                t.window.is_some() && !matches!(t.op, rollplex_plan::Op::DecodeWindow { .. })
            })
            .count()
    };
    assert_eq!(
        side_work(&serial),
        0,
        "a serial plan puts no side work in decode windows"
    );
    assert!(
        side_work(&overlap) > 0,
        "the overlap plan should move prefix work into decode windows"
    );
    let a = run(&serial, 2);
    let b = run(&overlap, 2);
    assert!(
        a.0.iter().all(|r| r.metrics.optimizer_steps > 0),
        "the run trained"
    );
    assert_same(&a, &b, "serial vs overlap");
}

#[test]
fn prefix_dedup_changes_no_number() {
    let src = tiny_src();
    let dedup = compile(&src, Mode::Overlap, true);
    let per_sample = compile(&src, Mode::Overlap, false);
    assert_ne!(dedup.tasks.len(), 0);
    let a = run(&dedup, 1);
    let b = run(&per_sample, 1);
    assert_same(&a, &b, "dedup vs per-sample prefixes");
}

/// Disaggregated (rollout on one GPU program, scoring and training on another, the trainer's
/// weights sent to the rollout's own copy after each step) computes what colocated serial does:
/// the same samples, log-probs, losses and final weights, bit for bit.
#[test]
fn disaggregated_plans_train_as_serial_ones_do() {
    let src = tiny_src();
    let serial = compile(&src, Mode::Serial, true);
    let mut spec = common::spec("tiny.rpx", &src);
    spec.cluster.count = 2;
    let disagg = common::compile_spec(
        &spec,
        &rollplex_compiler::Options {
            mode: Some(Mode::Disaggregated),
            ..Default::default()
        },
    );
    // the plan must really split the work, or this test proves nothing
    let gpu_of = |name: &str| {
        disagg
            .tasks
            .iter()
            .find(|t| t.name.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} task"))
            .gpu
    };
    assert_ne!(
        gpu_of("decode"),
        gpu_of("mb."),
        "rollout and training on separate GPU programs"
    );
    let a = run(&serial, 3);
    let b = run(&disagg, 3);
    assert!(
        a.0.iter().all(|r| r.metrics.optimizer_steps > 0) && a.0[2].metrics.loss.loss != 0.0,
        "the run trained"
    );
    assert_same(&a, &b, "serial vs disaggregated");
}

/// Every loss variant keeps the invariant: DAPO with dynamic sampling (8 groups rolled out, 4
/// trained over two optimizer steps, so an old-log-prob pass runs and truncated importance
/// sampling weighs by it), overlong shaping, GSPO's sequence ratio, REINFORCE++'s batch
/// whitening and Dr. GRPO's constant denominator.
#[test]
fn loss_variants_keep_serial_and_overlap_bitwise_identical() {
    let variants = [
        (
            "dapo(overlong_buffer = 8, tis_cap = 2.0, kl_coef = 0.01)",
            "mini_batch = 2 * G\n        groups = 4",
        ),
        ("gspo(kl_coef = 0.01)", "mini_batch = PROMPTS * G"),
        (
            "reinforce_pp(loss_agg = seq_mean_token_sum_norm, kl_coef = 0.01)",
            "mini_batch = PROMPTS * G",
        ),
    ];
    for (algorithm, batches) in variants {
        let src = common::with_algorithm(&tiny_src(), algorithm, batches, 8);
        let serial = compile(&src, Mode::Serial, true);
        let overlap = compile(&src, Mode::Overlap, true);
        assert!(
            overlap
                .tasks
                .iter()
                .any(|t| t.window.is_some()
                    && !matches!(t.op, rollplex_plan::Op::DecodeWindow { .. })),
            "{algorithm}: the overlap plan moves side work into decode windows"
        );
        let a = run(&serial, 2);
        let b = run(&overlap, 2);
        assert!(
            a.0.iter()
                .all(|r| r.metrics.optimizer_steps > 0 && r.metrics.loss.loss != 0.0),
            "{algorithm}: the run trained"
        );
        for (x, y) in a.0.iter().zip(&b.0) {
            assert_eq!(x.trained_groups, y.trained_groups, "{algorithm}");
            assert_eq!(x.metrics.rollout_agreement, y.metrics.rollout_agreement);
        }
        assert_same(&a, &b, algorithm);
    }
}
