//! Checkpoints and bitwise resume on the CUDA backend (`checkpoint::save_gpu` / `load_gpu`,
//! `rollplex-run --backend cuda --save-every/--resume`), on the tiny overlap plan of
//! `gpu_loop.rs` (tests/in/e2e/overlap_small.rpx with vision and merger frozen):
//! - 4 iterations uninterrupted vs 2, checkpoint, fresh models, resume, 2 more: the same
//!   tokens, log-probs, rewards, losses and grad norms in iterations 2-3 and bitwise the same
//!   final bf16 text weights; the bf16 compute copy right after the resume is bitwise the one
//!   the saving run had (re-derived from the fp32 masters);
//! - the CUDA checkpoint loads on the CPU backend (same format, names and identity);
//! - through `cli::run`: metrics.jsonl of 4 vs 2 + resume to 4 (timings aside) and the
//!   iteration-4 checkpoint files are byte-identical.
//!
//! Refusing a corrupt checkpoint or one of another plan, seed or reference is the code path
//! both backends share (`checkpoint::load_checked`), tested on the CPU in `resume.rs`.
//!
//! Each test prints `skipped: ...` and passes where no CUDA GPU is present (CI); with
//! `ROLLPLEX_REQUIRE_GPU=1` that is a failure.

mod common;

use std::path::{Path, PathBuf};

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::cli::{self, BackendChoice, RunArgs};
use rollplex_runtime::exec::checkpoint::{self, RunIdentity};
use rollplex_runtime::exec::{self, gpu, IterationResult};

/// tests/in/e2e/overlap_small.rpx with the vision tower frozen (the GPU trainer's requirement),
/// compiled as an overlap plan.
fn plan() -> Plan {
    common::compile_gpu(
        "overlap_small.rpx",
        &common::overlap_small_frozen(),
        Mode::Overlap,
    )
}

/// [`plan`] with the vision tower and merger trained.
fn plan_tower() -> Plan {
    common::compile_gpu("overlap_small.rpx", &common::overlap_small(), Mode::Overlap)
}

/// Runs iterations `first .. first + count` on `models`.
fn run(plan: &Plan, models: &mut gpu::GpuModels, first: u32, count: u32) -> Vec<IterationResult> {
    let spec = &plan.spec;
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut results = Vec::new();
    gpu::run_gpu_iterations(
        plan,
        models,
        source.as_mut(),
        reward.as_mut(),
        first,
        count,
        |it, r, wall| {
            println!(
                "iteration {it}: {:.1} ms, reward {:.3}, loss {:.5}, grad norm {:.4}",
                wall.as_secs_f64() * 1e3,
                r.reward_mean(),
                r.metrics.loss.loss,
                r.metrics.grad_norm
            );
            results.push(r.clone());
            Ok(())
        },
    )
    .expect("GPU run");
    results
}

fn fb(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn assert_same_iteration(i: u32, x: &IterationResult, y: &IterationResult) {
    assert!(x.metrics.optimizer_steps > 0, "iteration {i} trained");
    assert_eq!(x.tokens, y.tokens, "iteration {i}: sampled tokens differ");
    let all = |v: &[Vec<f32>]| v.iter().map(|r| fb(r)).collect::<Vec<_>>();
    assert_eq!(
        all(&x.rollout_logp),
        all(&y.rollout_logp),
        "iteration {i}: rollout log-probs differ"
    );
    let opt = |v: &[Option<Vec<f32>>]| v.iter().map(|r| r.as_deref().map(fb)).collect::<Vec<_>>();
    assert_eq!(
        opt(&x.ref_logp),
        opt(&y.ref_logp),
        "iteration {i}: reference log-probs differ"
    );
    assert_eq!(
        opt(&x.old_logp),
        opt(&y.old_logp),
        "iteration {i}: old log-probs differ"
    );
    assert_eq!(fb(&x.rewards), fb(&y.rewards), "iteration {i}: rewards");
    assert_eq!(
        x.metrics.loss.loss.to_bits(),
        y.metrics.loss.loss.to_bits(),
        "iteration {i}: loss differs ({} vs {})",
        x.metrics.loss.loss,
        y.metrics.loss.loss
    );
    assert_eq!(
        x.metrics.grad_norm.to_bits(),
        y.metrics.grad_norm.to_bits(),
        "iteration {i}: grad norm differs"
    );
}

#[test]
fn cuda_two_plus_resume_to_four_equals_four_bitwise() {
    two_plus_resume(plan(), false);
}

/// With the tower and merger trained: their masters and moments go through the checkpoint too.
#[test]
fn cuda_two_plus_resume_to_four_trains_the_tower_bitwise() {
    two_plus_resume(plan_tower(), false);
}

/// With the reference weights on the host between uses (the models at the plan's offsets, the
/// reference reloaded from its pinned copy each iteration): the resumed run reloads the same
/// bits.
#[test]
fn cuda_two_plus_resume_to_four_with_the_reference_reloaded() {
    let plan = common::compile_gpu(
        "overlap_small.rpx",
        &common::reloaded_reference_small(),
        Mode::Overlap,
    );
    assert!(
        plan.tasks
            .iter()
            .any(|t| matches!(t.op, rollplex_plan::Op::Reload { .. })),
        "the plan reloads the reference"
    );
    two_plus_resume(plan, true);
}

/// Four iterations against two, a checkpoint, and two more resumed from it; `placed`: the
/// models built for the plan (its arena, as `rollplex-run` does), else from the memory pool.
fn two_plus_resume(plan: Plan, placed: bool) {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let spec = &plan.spec;
    let dir = common::Scratch::new("gpu-resume-lib");
    let root = dir.path().join(checkpoint::CHECKPOINTS_DIR);

    let actor = exec::host_actor(spec).expect("initial actor");
    let build = || {
        if placed {
            gpu::build_gpu_models_for(&plan, &actor)
        } else {
            gpu::build_gpu_models_from(spec, &actor)
        }
        .expect("GPU models")
    };
    // Uninterrupted.
    let (a, a_bits) = {
        let mut models = build();
        let r = run(&plan, &mut models, 0, 4);
        (r, models.weight_bits().expect("weights"))
    };

    // Two iterations, a checkpoint, and the models dropped.
    let identity = RunIdentity::with_reference(&plan, spec.reference.enabled.then_some(&actor))
        .expect("identity");
    let (b_first, saved_bits) = {
        let mut models = build();
        let r = run(&plan, &mut models, 0, 2);
        let mut host = actor.clone();
        let path = checkpoint::save_gpu(
            &root,
            2,
            &models,
            &mut host,
            &identity,
            &checkpoint::Slot::Newest { keep: 0 },
        )
        .expect("save the checkpoint");
        println!("checkpoint: {}", path.display());
        (r, models.weight_bits().expect("weights"))
    };
    for i in 0..2 {
        assert_same_iteration(i as u32, &a[i], &b_first[i]);
    }

    // Fresh models from the initial actor, resumed from the checkpoint.
    let fresh = build();
    let initial_bits = fresh.weight_bits().expect("weights");
    let ckpt = checkpoint::resolve(dir.path()).expect("the checkpoint");
    let mut r = checkpoint::load_gpu(&ckpt, &identity, fresh).expect("resume");
    assert_eq!(r.completed, 2);
    assert_eq!(r.models.trainer.steps(), 2, "optimizer steps restored");
    let resumed_bits = r.models.weight_bits().expect("weights");
    assert!(
        initial_bits != saved_bits,
        "two iterations changed the weights, or the comparisons prove little"
    );
    for (what, r, s) in [
        ("vision", &resumed_bits.vision, &saved_bits.vision),
        ("text", &resumed_bits.text, &saved_bits.text),
    ] {
        let differ = r.iter().zip(s).filter(|(x, y)| x != y).count();
        assert!(
            differ == 0 && r.len() == s.len(),
            "the {what} bf16 compute copy after the resume differs from the saving run's in \
             {differ} of {} values",
            s.len()
        );
    }
    let b = run(&plan, &mut r.models, 2, 2);
    for (k, (x, y)) in a[2..].iter().zip(&b).enumerate() {
        assert_same_iteration(2 + k as u32, x, y);
    }
    assert_ne!(
        a[2].metrics.loss.loss.to_bits(),
        a[3].metrics.loss.loss.to_bits(),
        "the iterations differ from one another"
    );
    let b_bits = r.models.weight_bits().expect("weights");
    assert!(a_bits == b_bits, "final weights differ");

    // The same checkpoint loads on the CPU backend (numbers then follow the CPU engine).
    let cpu_identity = RunIdentity::with_reference(&plan, spec.reference.enabled.then_some(&actor))
        .expect("identity");
    assert_eq!(
        cpu_identity, identity,
        "the run identity is backend-neutral"
    );
    let cfg = exec::cpu::train_config(spec).expect("train config");
    let (completed, state) = checkpoint::load(&ckpt, &cpu_identity, actor.config.clone(), |n| {
        cfg.trainable(n)
    })
    .expect("a cuda checkpoint on cpu");
    assert_eq!(completed, 2);
    assert_eq!(state.steps, 2);
    let mut cpu_models = exec::build_cpu_models(spec).expect("CPU models");
    exec::cpu::restore_rank(&mut cpu_models, &state).expect("restored on cpu");
    assert_eq!(cpu_models.trainer.optimizer().steps(), 2);
}

fn args(plan: &Path, out: &Path, iterations: u32) -> RunArgs {
    common::run_args(plan, BackendChoice::Cuda, out, iterations)
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn cuda_cli_resume_continues_bitwise() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let dir = common::Scratch::new("gpu-resume-cli");
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, rollplex_plan::encode(&plan(), "tests").unwrap()).unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));

    cli::run(&args(&plan_path, &a, 4)).expect("uninterrupted run");
    cli::run(&args(&plan_path, &b, 2)).expect("first half");
    let mut resume = args(&plan_path, &b, 4);
    resume.resume = Some(b.clone());
    cli::run(&resume).expect("resumed run");

    let (ma, mb) = (
        common::metrics_without_times(&a),
        common::metrics_without_times(&b),
    );
    assert_eq!(ma.len(), 4);
    assert_eq!(ma, mb, "metrics of 4 vs 2 + resume to 4 (timings aside)");
    let ckpt = |out: &Path, k: u32| out.join(format!("checkpoints/iter-{k:08}"));
    for f in ["model.safetensors", "optimizer.safetensors", "config.json"] {
        assert!(
            read(ckpt(&a, 4).join(f)) == read(ckpt(&b, 4).join(f)),
            "{f} of iteration 4 differs between the runs"
        );
    }
    assert!(
        !ckpt(&a, 2).exists() && ckpt(&a, 3).exists(),
        "--keep-checkpoints 2 keeps the newest two"
    );
}
