//! The README's main job must show learning, not only a rising reward: `examples/tiny.rpx`
//! trained by GRPO on the CPU backend gets its held-out greedy accuracy (test split of the
//! moving-shapes task, whose videos are never train videos) from 0 to well above chance (0.25).
//!
//! The full check trains 600 iterations (~25 s in a release build, minutes in a debug one): it runs
//! in release builds (CI's `cargo test --workspace --release`) and is ignored in debug builds
//! (`cargo test -p rollplex-tests --test tiny_learns -- --ignored` forces it).
//! The quick test checks the starting point the full one measures from.

mod common;

use rollplex_plan::Plan;
use rollplex_runtime::exec;

fn tiny_plan() -> Plan {
    let spec = common::spec("tiny.rpx", &common::repo_file("examples/tiny.rpx"));
    common::compile_spec(&spec, &Default::default())
}

#[test]
fn the_random_tiny_model_answers_no_held_out_question() {
    let plan = tiny_plan();
    let models = exec::build_cpu_models(&plan.spec).expect("models");
    let acc = exec::evaluate(
        &plan.spec,
        &exec::cpu::unshard_actor(&[models]).expect("actor"),
        16,
    )
    .expect("eval")
    .expect("moving_shapes has a test split");
    assert_eq!(acc, 0.0, "the random model already answers: {acc}");
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "600 GRPO iterations: runs in release builds (or pass --ignored)"
)]
fn tiny_grpo_gets_held_out_accuracy_well_above_chance() {
    let plan = tiny_plan();
    let spec = &plan.spec;
    let mut models = [exec::build_cpu_models(spec).expect("models")];
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut last = Vec::new();
    exec::run_cpu_iterations(
        &plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        0,
        600,
        |it, r, _| {
            if it >= 550 {
                last.push(r.reward_mean());
            }
            Ok(())
        },
    )
    .expect("run");
    let train = last.iter().sum::<f64>() / last.len() as f64;
    let held_out = exec::evaluate(spec, &exec::cpu::unshard_actor(&models).expect("actor"), 64)
        .expect("eval")
        .expect("moving_shapes has a test split");
    // Measured (docs/perf.md, "tiny CPU run"): train reward 0.99 over the last 50 iterations,
    // held-out 0.984.
    assert!(
        train >= 0.8,
        "train reward over the last 50 iterations {train}"
    );
    assert!(held_out >= 0.8, "held-out greedy accuracy {held_out}");
}
