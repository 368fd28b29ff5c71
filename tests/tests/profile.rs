//! `rollplex-run --profile`: measured task times become a cost-model profile that
//! `rollplexc --profile` reads, and recompiling with it moves the plan's predicted iteration
//! time toward the measured one.
//!
//! The first tests feed the recorder synthetic times (deterministic), host copies among them
//! (the measured host rates); the CPU runs run examples/tiny.rpx and compare with the clock,
//! and a plan that keeps its optimizer state on the host (whose copies the CPU backend does not
//! make: no rate). The co-run tests lay out
//! an overlap plan's decode windows as the runtime measures them: decode steps slower while the
//! window's side tasks run, at the partition's speed after them.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use rollplex_cost::{CostModel, LatencyFit, Profile};
use rollplex_plan::plan::{Op, Task};
use rollplex_plan::spec::Mode;
use rollplex_plan::work::{HostDir, WorkKind};
use rollplex_plan::Plan;
use rollplex_runtime::cli::{self, BackendChoice, RunArgs};
use rollplex_runtime::exec::profile::{median, Execution, ProfileRecorder};

/// `examples/NAME` compiled in `mode`, with `profile` when given (datasheet numbers else).
fn example(name: &str, mode: Mode, profile: Option<&Profile>) -> Plan {
    let opts = rollplex_compiler::Options {
        mode: Some(mode),
        profile: profile.cloned(),
        ..Default::default()
    };
    common::compile_spec(
        &common::spec(name, &common::repo_file(&format!("examples/{name}"))),
        &opts,
    )
}

/// examples/tiny.rpx compiled in `mode`, with `profile` when given.
fn tiny(mode: Mode, profile: Option<&Profile>) -> Plan {
    example("tiny.rpx", mode, profile)
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

/// examples/h200-3b-video.rpx compiled in `mode` (datasheet numbers unless `profile`): decode
/// windows of 64 steps, side work in some of them.
fn h200_3b(mode: Mode, profile: Option<&Profile>) -> Plan {
    example("h200-3b-video.rpx", mode, profile)
}

/// A run of `plan` as a GPU with `truth`'s times alone would measure it, decode slowed
/// `dec_slow` times while side tasks run and side tasks `side_slow` times beside decode:
/// every task outside a window alone, one after another; each window on its own, its side
/// tasks back to back from its start, its decode steps (the op's planned count, each 1/n of
/// the window's time alone on its partition) slowed while a side task runs. Feeds one warm-up
/// iteration and two measured ones. With `spill`, a copy-stream task (the weight sync) runs
/// over the first half of the first window without a split instead of alone.
fn feed_corun(
    rec: &mut ProfileRecorder,
    plan: &Plan,
    truth: &CostModel,
    dec_slow: f64,
    side_slow: f64,
    spill: bool,
) {
    let whole = plan.windows.iter().position(|w| w.side_sms == 0);
    for it in 0..3u32 {
        rec.begin_iteration(Instant::now());
        let mut t = 1000.0;
        for task in plan.tasks.iter().filter(|t| t.window.is_none()) {
            if spill && task.kind == WorkKind::WeightSync {
                continue;
            }
            let d = truth.time(task.kind, &task.work, task.sms).max(1e-6);
            rec.record(task, t, t + d);
            t += d + 1e-3;
        }
        for (w, win) in plan.windows.iter().enumerate() {
            let base = 10.0 * (w as f64 + 1.0);
            let mut side_end = base;
            for task in plan
                .tasks
                .iter()
                .filter(|t| t.window == Some(win.id) && !matches!(t.op, Op::DecodeWindow { .. }))
            {
                let d = truth.time(task.kind, &task.work, task.sms).max(1e-6) * side_slow;
                rec.record(task, side_end, side_end + d);
                side_end += d;
            }
            let decode = plan
                .tasks
                .iter()
                .find(|t| t.window == Some(win.id) && matches!(t.op, Op::DecodeWindow { .. }))
                .expect("every window has its decode");
            let n = match decode.op {
                Op::DecodeWindow { steps, .. } => steps,
                _ => unreachable!(),
            };
            let step = truth.time(WorkKind::Decode, &decode.work, decode.sms) / n as f64;
            let mut marks = vec![base];
            for _ in 0..n {
                let now = *marks.last().unwrap();
                let slow = if now < side_end { dec_slow } else { 1.0 };
                marks.push(now + step * slow);
            }
            let end = *marks.last().unwrap();
            rec.record(decode, base, end);
            rec.record_steps(decode, &marks);
            if spill && whole == Some(w) {
                let sync = plan.tasks.iter().find(|t| t.kind == WorkKind::WeightSync);
                rec.record(
                    sync.expect("a colocated plan syncs"),
                    base,
                    (base + end) / 2.0,
                );
            }
        }
        rec.end_iteration(it, Duration::from_secs_f64(1.0));
    }
}

/// The recorder cuts the co-run windows by step: decode alone on its partition, decode beside
/// each kind of side work, side tasks beside decode; the fit gives back the slowdowns.
#[test]
fn an_overlap_run_measures_decode_beside_side_work_by_step() {
    let plan = h200_3b(Mode::Overlap, None);
    let truth = CostModel::for_cluster(&plan.spec.cluster, None);
    let split: Vec<_> = plan.windows.iter().filter(|w| w.side_sms > 0).collect();
    assert!(split.len() >= 2, "the plan co-runs side work in windows");
    let mut rec = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1).unwrap();
    feed_corun(&mut rec, &plan, &truth, 1.6, 1.3, false);

    // Steps alone on a partition: decode points on the window's decode SMs at the speed alone.
    let on_partition: Vec<_> = rec
        .points()
        .into_iter()
        .filter(|p| p.kind == WorkKind::Decode && p.sms < plan.target.sms)
        .collect();
    assert!(!on_partition.is_empty());
    for p in &on_partition {
        let r = p.seconds / truth.time(p.kind, &p.work, p.sms);
        assert!((r - 1.0).abs() < 0.01, "{}: {r}", p.note);
    }
    // Steps beside side work, and side tasks beside decode, at their slowdowns.
    let beside = rec.beside_points();
    let dec: Vec<_> = beside
        .iter()
        .filter(|b| b.kind == WorkKind::Decode)
        .collect();
    let side: Vec<_> = beside
        .iter()
        .filter(|b| b.kind != WorkKind::Decode)
        .collect();
    assert!(!dec.is_empty() && !side.is_empty(), "{beside:?}");
    for b in &beside {
        let r = b.seconds / truth.time(b.kind, &b.work, b.sms);
        let want = if b.kind == WorkKind::Decode { 1.6 } else { 1.3 };
        assert!((r / want - 1.0).abs() < 0.01, "{}: {r}", b.note);
        assert!(split
            .iter()
            .any(|w| b.sms == w.decode_sms || b.sms == w.side_sms));
        assert!(b.kind != WorkKind::Decode || b.beside != WorkKind::Decode);
    }

    let measured = rec.profile().unwrap();
    let p = &measured.profile;
    for b in &dec {
        let s = p.corun_of(WorkKind::Decode, b.beside).unwrap();
        assert!(
            (s / 1.6 - 1.0).abs() < 0.03,
            "decode beside {:?}: {s}",
            b.beside
        );
    }
    for b in &side {
        assert!(p.corun_of(b.kind, WorkKind::Decode).unwrap() > 1.1);
    }
    let text = measured.to_yaml();
    assert!(text.contains("beside one kind of side work"), "{text}");
    assert_eq!(&Profile::from_yaml(&text).unwrap(), p);

    // A copy over half of a window without a split: its steps beside the copy give no beside
    // point (no partition), its steps after it a point on the whole GPU.
    let mut spilled = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1).unwrap();
    feed_corun(&mut spilled, &plan, &truth, 1.6, 1.3, true);
    let p2 = spilled
        .profile()
        .expect("a window overlapped without a split still fits");
    assert_eq!(p2.profile.beside_points.len(), beside.len());
    assert!(p2
        .profile
        .beside_points
        .iter()
        .all(|b| b.beside != WorkKind::WeightSync));
    // the sync is no point (it never ran alone); the window is a point of its steps alone
    assert_eq!(p2.profile.points.len(), p.points.len() - 1);
    assert!(p2
        .profile
        .points
        .iter()
        .any(|q| q.sms == plan.target.sms && q.note.contains("alone on its partition")));

    // On plain streams (no partitions) only the steps alone count, on all SMs.
    let mut shared = ProfileRecorder::new(&plan, "test", Execution::Shared, 1).unwrap();
    feed_corun(&mut shared, &plan, &truth, 1.6, 1.3, false);
    assert!(shared.beside_points().is_empty());
    assert!(shared.points().iter().all(|p| p.sms == plan.target.sms));
}

/// A profile whose overlap run measured decode slowed 1.6x beside side work makes the planner
/// predict a slower overlap iteration than the same profile without those measurements (the
/// 1.15x default), and one that measured no slowdown a faster one.
#[test]
fn corun_measurements_move_the_overlap_prediction_the_right_way() {
    let plan = h200_3b(Mode::Overlap, None);
    let truth = CostModel::for_cluster(&plan.spec.cluster, None);
    let fitted = |dec: f64, side: f64| {
        let mut rec = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1).unwrap();
        feed_corun(&mut rec, &plan, &truth, dec, side, false);
        rec.profile().unwrap().profile
    };
    let slow = fitted(1.6, 1.3);
    let free = fitted(1.0, 1.0);
    let mut none = slow.clone();
    none.beside_points.clear();
    let none = Profile::fit_all(
        &none.gpu,
        none.points.clone(),
        vec![],
        vec![],
        LatencyFit::PerKind,
    )
    .unwrap();
    assert_eq!(none.default_corun, 1.15);
    assert!(
        free.corun.iter().all(|e| e.slowdown < 1.01),
        "{:?}",
        free.corun
    );

    let t = |p: &Profile| h200_3b(Mode::Overlap, Some(p)).predicted.iteration_s;
    let (t_slow, t_none, t_free) = (t(&slow), t(&none), t(&free));
    assert!(
        t_free < t_none && t_none < t_slow,
        "predicted overlap iteration: no slowdown {t_free} s, default slowdown {t_none} s, \
         measured 1.6x {t_slow} s"
    );
    // The serial plan has no co-runs: the same prediction with or without them.
    let s = |p: &Profile| h200_3b(Mode::Serial, Some(p)).predicted.iteration_s;
    assert!((s(&slow) / s(&none) - 1.0).abs() < 1e-9);
}

/// The small job with its optimizer state kept on the host (reloaded before the optimizer step
/// and written back after it: reloads and offloads), compiled in `mode` with `profile` if given.
fn reloaded(mode: Mode, profile: Option<&Profile>) -> Plan {
    let opts = rollplex_compiler::Options {
        mode: Some(mode),
        profile: profile.cloned(),
        ..Default::default()
    };
    let src = common::in_train(
        &common::with_host_memory(&common::overlap_small_frozen()),
        "optimizer_state = host",
    );
    common::compile_spec(&common::spec("overlap_small.rpx", &src), &opts)
}

fn is_copy(t: &Task) -> bool {
    matches!(t.op, Op::Offload { .. } | Op::Reload { .. })
}

/// Host copies of a run give the profile's host rates, per direction: a run of the overlap
/// plan whose reloads move 64 GB/s and offloads 32 GB/s (every other task at its predicted
/// time; each copy from its planned start, so some run beside compute and count all the same)
/// measures those rates, from every copy; the copies are no points; the file says so and reads
/// back; recompiled with it, the plan prices reloads and offloads each at its own rate, and so
/// does the simulator. Without copies that move data (`measure_host_copies` not called), no
/// rate.
#[test]
fn host_copies_give_the_measured_rates_per_direction() {
    const TO_DEVICE: f64 = 64e9;
    const TO_HOST: f64 = 32e9;
    let plan = reloaded(Mode::Overlap, None);
    let copies: Vec<&Task> = plan.tasks.iter().filter(|t| is_copy(t)).collect();
    let (to_host, to_device): (Vec<&Task>, Vec<&Task>) = copies
        .iter()
        .partition(|t| matches!(t.op, Op::Offload { .. }));
    assert!(
        !to_host.is_empty() && !to_device.is_empty(),
        "the plan reloads and offloads: {:?}",
        copies.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    assert!(copies.iter().all(|t| t.work.host_bytes > 0.0));
    let rate = |t: &Task| match t.op {
        Op::Offload { .. } => TO_HOST,
        _ => TO_DEVICE,
    };
    let feed = |rec: &mut ProfileRecorder| {
        for it in 0..3u32 {
            // the warm-up 10x slower: not measured
            let k = if it == 0 { 10.0 } else { 1.0 };
            rec.begin_iteration(Instant::now());
            for t in &plan.tasks {
                let d = if is_copy(t) {
                    t.work.host_bytes / rate(t)
                } else {
                    t.end_s - t.start_s
                };
                rec.record(t, t.start_s, t.start_s + k * d);
            }
            rec.end_iteration(it, Duration::from_secs_f64(plan.predicted.iteration_s));
        }
    };
    let mut rec = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1)
        .unwrap()
        .measure_host_copies(copies.iter().map(|t| t.id));
    feed(&mut rec);
    assert!(
        rec.tasks()
            .any(|s| is_copy(&plan.tasks[s.task.index()]) && s.co_ran > 0),
        "some copy ran beside compute"
    );
    let c = rec.host_copies();
    let sum = |ts: &[&Task]| ts.iter().map(|t| t.work.host_bytes).sum::<f64>();
    assert_eq!(c.to_device.transfers as usize, to_device.len());
    assert_eq!(c.to_host.transfers as usize, to_host.len());
    assert_eq!(
        (c.to_device.bytes, c.to_host.bytes),
        (sum(&to_device), sum(&to_host))
    );
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-3;
    assert!(close(c.to_device.rate().unwrap(), TO_DEVICE), "{c:?}");
    assert!(close(c.to_host.rate().unwrap(), TO_HOST), "{c:?}");

    let measured = rec.profile().unwrap();
    let p = &measured.profile;
    assert!(close(p.host_bw.unwrap(), TO_DEVICE) && close(p.host_bw_to_host.unwrap(), TO_HOST));
    assert_eq!(p.host_copies, c);
    let copy_names: Vec<&str> = copies.iter().map(|t| t.name.as_str()).collect();
    assert!(p.points.iter().all(|q| !copy_names
        .iter()
        .any(|n| q.note.starts_with(&format!("{n} ")))));
    let text = measured.to_yaml();
    assert!(
        text.contains(&format!(
            "host -> device {:.2} GB/s from {} reloads",
            TO_DEVICE / 1e9,
            to_device.len()
        )) && text.contains(&format!(
            "device -> host {:.2} GB/s from {} offloads",
            TO_HOST / 1e9,
            to_host.len()
        )),
        "{text}"
    );
    assert_eq!(&Profile::from_yaml(&text).unwrap(), p);

    // recompiled with it: each copy at its direction's rate
    let after = reloaded(Mode::Overlap, Some(p));
    let cost = CostModel::for_cluster(&after.spec.cluster, Some(p));
    let sim = rollplex_runtime::sim::simulate(&after, &cost).unwrap();
    let mut seen = (0, 0);
    for (t, st) in after.tasks.iter().zip(&sim.tasks) {
        if !is_copy(t) {
            continue;
        }
        let dir = t.op.host_dir();
        let want_host_s = t.work.host_bytes / rate(t);
        let parts = cost.time_parts_dir(t.kind, &t.work, t.sms, dir);
        assert!(close(parts.host_s, want_host_s), "{}: {parts:?}", t.name);
        let want = cost.time_dir(t.kind, &t.work, t.sms, dir);
        // plans print times to the microsecond
        let planned = t.end_s - t.start_s;
        assert!(
            (planned - want).abs() <= 1e-6,
            "{}: planned {planned} s",
            t.name
        );
        assert!(close(st.alone_s, want), "{}: simulated", t.name);
        match dir {
            HostDir::ToHost => seen.0 += 1,
            HostDir::ToDevice => seen.1 += 1,
        }
    }
    assert!(
        seen.0 > 0 && seen.1 > 0,
        "the recompiled plan reloads and offloads (offloads, reloads: {seen:?})"
    );

    // a backend whose copies move nothing measures no rate, and copies are still no points
    let mut none = ProfileRecorder::new(&plan, "test", Execution::Partitioned, 1).unwrap();
    feed(&mut none);
    assert!(none.host_copies().is_empty());
    let m = none.profile().unwrap();
    assert_eq!((m.profile.host_bw, m.profile.host_bw_to_host), (None, None));
    assert_eq!(m.profile.points, p.points);
    assert!(
        m.header.contains("0 of which move data on this backend"),
        "{}",
        m.header
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
        profile: Some(prof_path.clone()),
        save_every: 0,
        ..common::run_args(&plan_path, BackendChoice::Cpu, &dir.path().join("out"), 4)
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

/// The CPU backend, one address space, moves nothing on a plan's reloads: a profile of a run
/// of the plan that keeps its optimizer state on the host measures no host rate (the file says so),
/// and recompiled with it the plan prices its reload at the GPU spec's host bandwidth.
#[test]
fn a_cpu_run_of_a_reloading_plan_measures_no_host_rate() {
    let dir = common::Scratch::new("profile-reload");
    let before = reloaded(Mode::Serial, None);
    assert!(before.tasks.iter().any(is_copy));
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, rollplex_plan::encode(&before, "tests").unwrap()).unwrap();
    let prof_path = dir.path().join("prof.yaml");
    let args = RunArgs {
        profile: Some(prof_path.clone()),
        save_every: 0,
        ..common::run_args(&plan_path, BackendChoice::Cpu, &dir.path().join("out"), 2)
    };
    cli::run(&args).expect("run");
    let text = std::fs::read_to_string(&prof_path).unwrap();
    assert!(text.contains("no host rate measured"), "{text}");
    let profile = Profile::from_yaml(&text).unwrap();
    assert_eq!((profile.host_bw, profile.host_bw_to_host), (None, None));
    assert!(profile.host_copies.is_empty());
    assert!(profile
        .points
        .iter()
        .all(|p| !p.note.starts_with("reload.")));

    let after = reloaded(Mode::Serial, Some(&profile));
    let cost = CostModel::for_cluster(&after.spec.cluster, Some(&profile));
    let reload = after.tasks.iter().find(|t| is_copy(t)).expect("a reload");
    let parts = cost.time_parts_dir(reload.kind, &reload.work, reload.sms, HostDir::ToDevice);
    let spec_s = reload.work.host_bytes / after.spec.cluster.gpu.host_bw;
    assert!((parts.host_s / spec_s - 1.0).abs() < 1e-12, "{parts:?}");
}

/// The 7B video job fits one H200 only with its reference weights on host; under the runtime
/// profile measured on the 3B and 7B jobs the residency solve must still find that (with
/// HiGHS's presolve it kept them in HBM, 13.3 GiB over budget, and no plan fitted). The plan
/// reloads them beside decode in overlap mode, and its gradients reuse their range.
#[test]
fn the_7b_job_fits_one_h200_with_its_reference_on_host_under_the_runtime_profile() {
    let text = common::repo_file("cost/profiles/h200-runtime.yaml");
    let profile = Profile::from_yaml(&text).expect("the runtime profile");
    for mode in [Mode::Serial, Mode::Overlap] {
        let plan = example("h200-7b-video.rpx", mode, Some(&profile));
        let peak = plan.memory.gpus.iter().map(|g| g.peak).max().unwrap();
        assert!(peak <= plan.memory.gpus[0].budget, "{mode:?}: peak {peak}");
        let reloads: Vec<&str> = plan
            .tasks
            .iter()
            .filter(|t| matches!(t.op, rollplex_plan::Op::Reload { .. }))
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(reloads, ["reload.ref_weights"], "{mode:?}");
        let by_role = |r: rollplex_plan::BufferRole| {
            plan.buffers
                .iter()
                .find(|b| b.role == r)
                .unwrap_or_else(|| panic!("{mode:?}: no {r:?}"))
        };
        let (refw, grads) = (
            by_role(rollplex_plan::BufferRole::RefWeights),
            by_role(rollplex_plan::BufferRole::Grads { step: 0 }),
        );
        assert!(
            grads.offset < refw.offset + refw.bytes && refw.offset < grads.offset + grads.bytes,
            "{mode:?}: the gradients do not reuse the reference's range"
        );
    }
}

/// The H100 runtime profile, fit on the 3B job at 8 prompts, predicts the same job at 4 prompts
/// (plans it was not fit on) within 5% of the iterations measured on an H100 (2.929 s serial,
/// 2.862 s overlap: docs/perf.md, "Planner prediction error").
#[test]
fn the_h100_profile_predicts_the_4_prompt_job_it_was_not_fit_on() {
    let text = common::repo_file("cost/profiles/h100-3b-runtime.yaml");
    let profile = Profile::from_yaml(&text).expect("the H100 runtime profile");
    assert_eq!(profile.gpu.name, "H100");
    let src = common::repo_file("examples/h200-3b-video.rpx")
        .replace("preset = H200", "preset = H100")
        .replace("const PROMPTS = 16", "const PROMPTS = 4");
    let spec = common::spec("h100-3b-video.rpx", &src);
    for (mode, measured) in [(Mode::Serial, 2.929), (Mode::Overlap, 2.862)] {
        let opts = rollplex_compiler::Options {
            mode: Some(mode),
            profile: Some(profile.clone()),
            ..Default::default()
        };
        let predicted = common::compile_spec(&spec, &opts).predicted.iteration_s;
        let err = predicted / measured - 1.0;
        assert!(
            err.abs() < 0.05,
            "{mode:?}: predicted {predicted:.3} s against {measured} s measured ({:+.1}%)",
            err * 100.0
        );
    }
}
