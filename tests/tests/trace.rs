//! `rollplex-run --backend cpu --trace FILE`: a measured Chrome/Perfetto trace of every task of
//! every iteration, on the tracks the simulator's trace of the same plan uses. The file parses,
//! holds one event per executed task and one per group whose reward a host thread scored (on a
//! track of its own), and the events of one stream never overlap.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::cli::{self, BackendChoice, RunArgs};
use rollplex_runtime::trace::read_complete_events;
use serde_json::Value;

fn compile(mode: Mode) -> Plan {
    common::compile("overlap_small.rpx", &common::overlap_small(), mode)
}

/// `(pid, tid) -> name` of the thread (or, with tid None, process) metadata of a trace.
fn track_names(trace: &Value, what: &str) -> BTreeMap<(u64, Option<u64>), String> {
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == what)
        .map(|e| {
            (
                (e["pid"].as_u64().unwrap(), e["tid"].as_u64()),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn cpu_trace_measures_every_task_on_the_simulators_tracks() {
    let dir = common::Scratch::new("trace");
    let plan = compile(Mode::Overlap);
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    let trace_path = dir.path().join("out/trace.json");
    let iterations = 2u32;
    cli::run(&RunArgs {
        plan: plan_path,
        backend: BackendChoice::Cpu,
        iterations,
        out: dir.path().join("out"),
        trace: Some(trace_path.clone()),
        svg: None,
        cost_profile: None,
        profile: None,
        save_every: 0,
        keep_checkpoints: 2,
        resume: None,
        eval: 0,
        eval_every: 0,
        eval_data: None,
        quiet: true,
        task_log: false,
        no_green_contexts: false,
        eager_decode: false,
    })
    .expect("run");

    // One event per executed task: every task of the plan once per iteration, on its stream;
    // and the built-in reward of every group, scored on a host thread, on the host track.
    let (rewards, events): (Vec<_>, Vec<_>) = read_complete_events(&trace_path)
        .expect("the trace parses")
        .into_iter()
        .partition(|e| e.cat == "reward");
    assert_eq!(events.len(), plan.tasks.len() * iterations as usize);
    let host = plan.gpus.len() as u32;
    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    assert_eq!(rewards.len(), groups * iterations as usize);
    for e in &rewards {
        let g = e.args["group"].as_u64().unwrap();
        assert_eq!(e.pid, host, "{e:?}");
        assert_eq!(e.name, format!("reward group {g}"));
        assert!(e.dur >= 0.0 && e.ts >= 0.0);
    }
    let mut seen = BTreeSet::new();
    for e in &events {
        let id = e.args["task"].as_str().unwrap();
        let it = e.args["iteration"].as_u64().unwrap();
        let task = plan
            .tasks
            .iter()
            .find(|t| t.id.to_string() == id)
            .unwrap_or_else(|| panic!("event for unknown task {id}"));
        assert_eq!(e.name, task.name);
        assert_eq!(
            (e.pid, e.tid),
            (task.gpu.index() as u32, task.stream.index() as u32)
        );
        assert!(e.dur >= 0.0 && e.ts >= 0.0);
        assert!(
            seen.insert((it, id.to_string())),
            "{id} twice in iteration {it}"
        );
    }
    assert_eq!(seen.len(), events.len());

    // Events of one stream do not overlap (times are rounded to nanoseconds).
    type Spans<'a> = Vec<(f64, f64, &'a str)>; // (start, end, name)
    let mut by_track: BTreeMap<(u32, u32), Spans<'_>> = BTreeMap::new();
    for e in &events {
        by_track
            .entry((e.pid, e.tid))
            .or_default()
            .push((e.ts, e.ts + e.dur, &e.name));
    }
    assert!(by_track.len() > 1, "the overlap plan uses several streams");
    for (track, mut v) in by_track {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in v.windows(2) {
            assert!(
                w[0].1 <= w[1].0 + 0.002,
                "{track:?}: {} ends at {} after {} starts at {}",
                w[0].2,
                w[0].1,
                w[1].2,
                w[1].0
            );
        }
    }

    // Process and thread names are the simulator's for the same plan.
    let ours: Value = serde_json::from_str(&std::fs::read_to_string(&trace_path).unwrap()).unwrap();
    let cost = rollplex_cost::CostModel::for_cluster(&plan.spec.cluster, None);
    let sim = rollplex_runtime::sim::simulate(&plan, &cost)
        .expect("simulates")
        .chrome_trace();
    for what in ["process_name", "thread_name"] {
        let mut names = track_names(&ours, what);
        // the host reward workers' tracks are the measured run's own
        let workers: Vec<_> = names
            .keys()
            .filter(|k| k.0 == host as u64)
            .cloned()
            .collect();
        for k in &workers {
            let name = names.remove(k).unwrap();
            assert!(
                name == "host rewards" || name.starts_with("reward worker "),
                "{name}"
            );
        }
        assert!(!workers.is_empty(), "{what}: no host reward track");
        assert_eq!(names, track_names(&sim, what), "{what}");
    }
    assert_eq!(ours["otherData"]["timing"], "measured");
    assert_eq!(
        ours["otherData"]["iterations"].as_array().unwrap().len(),
        iterations as usize
    );

    // The metrics carry the measured phase times, which fit in the iteration, and each phase's
    // share of the plan's roofline (`rollplexc --stats`): its floor over its measured time.
    let roof = rollplex_plan::roofline::roofline(&plan);
    let text = std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap();
    for line in text.lines() {
        let m: Value = serde_json::from_str(line).unwrap();
        let phases: f64 = ["rollout_s", "scoring_s", "training_s", "sync_s"]
            .iter()
            .map(|k| m[k].as_f64().unwrap_or_else(|| panic!("{k} in {line}")))
            .sum();
        assert!(m["rollout_s"].as_f64().unwrap() > 0.0);
        assert!(phases <= m["time_s"].as_f64().unwrap() * 1.0001, "{line}");
        let time = m["time_s"].as_f64().unwrap();
        assert_eq!(m["roofline_s"].as_f64(), Some(roof.serial_s), "{line}");
        let frac = m["roofline_frac"].as_f64().unwrap();
        assert!((frac - roof.serial_s / time).abs() <= 1e-9 * frac, "{line}");
        for (p, floor) in &roof.phases {
            let name = rollplex_plan::roofline::phase_name(*p);
            let measured = m[format!("{name}_s")].as_f64().unwrap();
            let got = m[format!("{name}_roofline_frac")].as_f64();
            let want = floor.seconds / measured;
            assert!(
                got.is_some_and(|g| (g - want).abs() <= 1e-9 * want),
                "{name}: {line}"
            );
        }
    }
}
