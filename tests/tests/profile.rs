//! `rollplex-run --profile`: measured task times become a cost-model profile that
//! `rollplexc --profile` reads, and recompiling with it moves the plan's predicted iteration
//! time toward the measured one (issue 6, item 7).
//!
//! The first two tests feed the recorder synthetic times (deterministic); the last one runs
//! examples/tiny.rpx on the CPU backend and compares with the clock.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use rollplex_cost::Profile;
use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::cli::{self, BackendChoice, RunArgs};
use rollplex_runtime::exec::profile::{median, Execution, ProfileRecorder};

/// examples/tiny.rpx compiled in `mode`, with `profile` when given.
fn tiny(mode: Mode, profile: Option<&Profile>) -> Plan {
    let opts = rollplex_compiler::Options {
        mode: Some(mode),
        profile: profile.cloned(),
        ..Default::default()
    };
    common::compile_spec(
        &common::spec("tiny.rpx", &common::repo_file("examples/tiny.rpx")),
        &opts,
    )
}

/// Feeds `rec` one warm-up iteration at 100x the plan's predicted times, then iterations at
/// `scales` x the predicted times (every task at its predicted start and end, scaled).
fn feed(rec: &mut ProfileRecorder, plan: &Plan, scales: &[f64]) {
    for (it, &k) in std::iter::once(&100.0).chain(scales).enumerate() {
        rec.begin_iteration(Instant::now());
        for t in &plan.tasks {
            rec.record(t, t.start_s * k, t.end_s * k);
        }
        rec.end_iteration(
            it as u32,
            Duration::from_secs_f64(plan.predicted.iteration_s * k),
        );
    }
}

#[test]
fn points_are_medians_of_runs_alone_after_the_warmup() {
    let plan = tiny(Mode::Overlap, None);
    let mut rec = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1).unwrap();
    feed(&mut rec, &plan, &[2.0, 5.0, 3.0]);

    // The warm-up (100x) is not measured: medians are 3x the predicted times.
    let expect_iter = 3.0 * plan.predicted.iteration_s;
    assert!((rec.iteration_median_s().unwrap() / expect_iter - 1.0).abs() < 1e-9);
    assert_eq!(rec.iterations_s().len(), 3);

    // Alone: no other task's predicted interval overlaps it (side tasks in a decode window
    // co-run with decode and are left out).
    let overlaps = |a: &rollplex_plan::plan::Task| {
        plan.tasks
            .iter()
            .any(|b| b.id != a.id && a.start_s < b.end_s && b.start_s < a.end_s)
    };
    let points = rec.points();
    let alone: Vec<_> = plan
        .tasks
        .iter()
        .filter(|t| !overlaps(t) && t.end_s > t.start_s)
        .collect();
    assert!(
        plan.tasks.iter().any(overlaps),
        "the overlap plan co-runs tasks"
    );
    assert!(!alone.is_empty());
    assert_eq!(points.len(), alone.len());
    for (p, t) in points.iter().zip(&alone) {
        assert_eq!(
            (p.kind, p.sms, &p.work),
            (t.kind, t.sms, &t.work),
            "{}",
            t.name
        );
        let want = 3.0 * (t.end_s - t.start_s);
        // points are rounded to nanoseconds
        assert!(
            (p.seconds - want).abs() <= 0.5e-9,
            "{}: {} vs {want}",
            t.name,
            p.seconds
        );
    }
    for s in rec
        .tasks()
        .filter(|s| overlaps(&plan.tasks[s.task.index()]))
    {
        assert!(s.alone_s.is_empty() && s.co_ran == 3, "{}", s.name);
    }
    assert_eq!(median(&[2.0, 5.0, 3.0]), Some(3.0));
}

#[test]
fn recompiling_with_a_profile_of_slower_tasks_predicts_a_slower_iteration() {
    let before = tiny(Mode::Serial, None);
    let mut rec = ProfileRecorder::new(&before, "test", Execution::OneAtATime, 1).unwrap();
    // One task at a time on the whole device: every task is a point on all SMs.
    feed(&mut rec, &before, &[4.0, 4.0, 4.0]);
    let measured = rec.profile().unwrap();
    let p = &measured.profile;
    assert!(p.points.iter().all(|q| q.sms == before.target.sms));
    assert_eq!(
        p.points.len(),
        before.tasks.iter().filter(|t| t.end_s > t.start_s).count()
    );
    assert!(p.corun_points.is_empty());

    // The file round-trips through the cost crate, header and all.
    let text = measured.to_yaml();
    assert!(text.starts_with("# Measured by rollplex-run --profile"));
    let back = Profile::from_yaml(&text).unwrap();
    assert_eq!(&back, p);

    let after = tiny(Mode::Serial, Some(&back));
    let (b, a) = (before.predicted.iteration_s, after.predicted.iteration_s);
    let ratio = a / (4.0 * b);
    assert!(
        (0.97..1.03).contains(&ratio),
        "tasks measured 4x slower than predicted: iteration predicted {b} s before, {a} s after \
         (want ~{} s)",
        4.0 * b
    );
}

/// Median of the `time_s` of metrics.jsonl's iterations after the first (the warm-up).
fn measured_median(metrics: &Path) -> f64 {
    let text = std::fs::read_to_string(metrics).unwrap();
    let times: Vec<f64> = text
        .lines()
        .skip(1)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["time_s"].as_f64().unwrap()
        })
        .collect();
    median(&times).unwrap()
}

#[test]
fn cpu_run_profile_moves_the_prediction_toward_the_measurement() {
    let dir = common::Scratch::new("profile");
    let before = tiny(Mode::Serial, None);
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, rollplex_plan::encode(&before, "tests").unwrap()).unwrap();
    let prof_path = dir.path().join("prof.yaml");
    let args = RunArgs {
        plan: plan_path,
        backend: BackendChoice::Cpu,
        iterations: 4,
        out: dir.path().join("out"),
        trace: None,
        svg: None,
        cost_profile: None,
        profile: Some(prof_path.clone()),
        save_every: 0,
        keep_checkpoints: 2,
        resume: None,
        eval: 0,
        quiet: true,
    };
    cli::run(&args).expect("run");
    let profile = Profile::from_yaml(&std::fs::read_to_string(&prof_path).unwrap()).unwrap();
    assert_eq!(profile.gpu, before.spec.cluster.gpu);
    assert!(!profile.points.is_empty());

    let measured = measured_median(&dir.path().join("out/metrics.jsonl"));
    let after = tiny(Mode::Serial, Some(&profile));
    let err = |pred: f64| (pred / measured).ln().abs();
    let (b, a) = (before.predicted.iteration_s, after.predicted.iteration_s);
    assert!(
        err(a) < err(b),
        "measured {measured} s; predicted {b} s before calibration, {a} s after"
    );

    // Too few iterations for a warm-up plus one measured: refused before anything runs.
    let e = cli::run(&RunArgs {
        iterations: 1,
        ..args
    })
    .unwrap_err();
    assert!(e.to_string().contains("at least 2 iterations"), "{e}");
}
