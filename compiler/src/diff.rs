//! `rollplexc diff a.plan.yaml b.plan.yaml`: what changed between two plans, in a few lines a
//! reviewer reads first, then the raw unified diff of their YAML forms.
//!
//! The summary compares, in this order: mode and target; where the old log-probs come from;
//! predicted iteration time and phase spans; peak device memory per GPU program; decode
//! windows and their SM partitions;
//! placements (tasks matched by name: stream, window, SMs; tasks added or removed); buffer
//! residency per phase and sizes (buffers matched by name); reshard points; solver size and
//! status. Lists are capped at [`MAX_ITEMS`] entries with a count of the rest.
//!
//! Invariant: pure (plans in, text out); the same two plans always give the same text.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use rollplex_plan::{Buffer, OldLogProbSource, Plan, Residency, Task, TrainPrefixSource};
use similar::TextDiff;

/// Entries listed per category before "... and N more".
pub const MAX_ITEMS: usize = 6;

const GIB: f64 = (1u64 << 30) as f64;

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

fn pct(a: f64, b: f64) -> String {
    if a > 0.0 {
        format!("{:+.1}%", (b / a - 1.0) * 100.0)
    } else {
        "new".into()
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB)
}

/// Appends `items` as one line `label: a; b; c ... and N more` (nothing when empty).
fn list(out: &mut String, label: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    let shown: Vec<&str> = items.iter().take(MAX_ITEMS).map(|s| s.as_str()).collect();
    let more = items.len().saturating_sub(MAX_ITEMS);
    let _ = write!(out, "{label}: {}", shown.join("; "));
    if more > 0 {
        let _ = write!(out, "; ... and {more} more");
    }
    out.push('\n');
}

/// Where a task runs, as one word: `stream1@win2 (84 SMs)`.
fn placement(p: &Plan, t: &Task) -> String {
    let stream = p
        .stream(t.stream)
        .map(|s| format!("{}:{}", t.stream, s.name))
        .unwrap_or_else(|| t.stream.to_string());
    match t.window {
        Some(w) => format!("{stream}@{w} ({} SMs)", t.sms),
        None => format!("{stream} ({} SMs)", t.sms),
    }
}

fn residency(b: &Buffer) -> String {
    b.residency
        .iter()
        .map(|r| {
            let where_ = match r.residency {
                Residency::Hbm => "hbm",
                Residency::Host => "host",
                Residency::Recompute => "recompute",
                Residency::Absent => "-",
            };
            format!("{:?}={where_}", r.phase).to_lowercase()
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The summary lines of [`diff_plans`] (without the raw diff).
pub fn summarize(a: &Plan, b: &Plan) -> String {
    let mut out = String::new();
    if a.mode != b.mode {
        let _ = writeln!(out, "mode: {:?} -> {:?}", a.mode, b.mode);
    }
    if a.target != b.target {
        let _ = writeln!(
            out,
            "target: {} x {} ({} SMs) -> {} x {} ({} SMs)",
            a.target.count, a.target.gpu, a.target.sms, b.target.count, b.target.gpu, b.target.sms
        );
    }
    if a.old_logprobs != b.old_logprobs {
        let source = |s: OldLogProbSource| match s {
            OldLogProbSource::Pass => "their own pass",
            OldLogProbSource::TrainForward => "the training forward",
        };
        let _ = writeln!(
            out,
            "old log-probs: {} -> {}",
            source(a.old_logprobs),
            source(b.old_logprobs)
        );
    }
    if a.train_prefix != b.train_prefix {
        let source = |s: TrainPrefixSource| match s {
            TrainPrefixSource::Pass => "their own pass",
            TrainPrefixSource::Rollout => "the rollout's prefill",
        };
        let _ = writeln!(
            out,
            "training prompt forwards: {} -> {}",
            source(a.train_prefix),
            source(b.train_prefix)
        );
    }
    let layers = b.spec.actor.text.num_layers;
    for (what, x, y) in [
        ("", a.kept_act_layers, b.kept_act_layers),
        (
            " of the prompt rows",
            a.kept_prompt_layers,
            b.kept_prompt_layers,
        ),
    ] {
        if x != y {
            let _ = writeln!(out, "kept activation layers{what}: {x} -> {y} of {layers}");
        }
    }
    let (ta, tb) = (a.predicted.iteration_s, b.predicted.iteration_s);
    if ta != tb {
        let _ = writeln!(
            out,
            "predicted iteration: {} -> {} ({})",
            secs(ta),
            secs(tb),
            pct(ta, tb)
        );
    }
    let mut phases = Vec::new();
    for pa in &a.predicted.phases {
        match b.predicted.phases.iter().find(|pb| pb.phase == pa.phase) {
            Some(pb) if (pa.start_s, pa.end_s) != (pb.start_s, pb.end_s) => phases.push(format!(
                "{:?} {}..{} -> {}..{}",
                pa.phase,
                secs(pa.start_s),
                secs(pa.end_s),
                secs(pb.start_s),
                secs(pb.end_s)
            )),
            Some(_) => {}
            None => phases.push(format!("{:?} removed", pa.phase)),
        }
    }
    for pb in b
        .predicted
        .phases
        .iter()
        .filter(|pb| !a.predicted.phases.iter().any(|pa| pa.phase == pb.phase))
    {
        phases.push(format!("{:?} added", pb.phase));
    }
    list(&mut out, "phases", &phases);
    if a.predicted.hidden_s != b.predicted.hidden_s {
        let _ = writeln!(
            out,
            "side work hidden in decode windows: {} -> {}",
            secs(a.predicted.hidden_s),
            secs(b.predicted.hidden_s)
        );
    }

    // memory
    let mut mem = Vec::new();
    for ma in &a.memory.gpus {
        match b.memory.gpus.iter().find(|mb| mb.gpu == ma.gpu) {
            Some(mb) if ma.peak != mb.peak || ma.host != mb.host => {
                let mut s = format!(
                    "{} peak {} -> {} ({:+.2} GiB)",
                    ma.gpu,
                    gib(ma.peak),
                    gib(mb.peak),
                    (mb.peak as f64 - ma.peak as f64) / GIB
                );
                if ma.host != mb.host {
                    let _ = write!(s, ", host {} -> {}", gib(ma.host), gib(mb.host));
                }
                mem.push(s);
            }
            Some(_) => {}
            None => mem.push(format!("{} removed (peak {})", ma.gpu, gib(ma.peak))),
        }
    }
    for mb in b
        .memory
        .gpus
        .iter()
        .filter(|mb| !a.memory.gpus.iter().any(|ma| ma.gpu == mb.gpu))
    {
        mem.push(format!("{} added (peak {})", mb.gpu, gib(mb.peak)));
    }
    list(&mut out, "memory", &mem);

    // windows / partitions
    let splits = |p: &Plan| {
        p.windows
            .iter()
            .map(|w| (w.gpu, w.first_step, w.decode_sms, w.side_sms))
            .collect::<Vec<_>>()
    };
    if splits(a) != splits(b) {
        let mut changed = Vec::new();
        for (wa, wb) in a.windows.iter().zip(&b.windows) {
            if (wa.first_step, wa.decode_sms, wa.side_sms)
                != (wb.first_step, wb.decode_sms, wb.side_sms)
            {
                changed.push(format!(
                    "{} step {} {}/{} -> step {} {}/{}",
                    wa.id,
                    wa.first_step,
                    wa.decode_sms,
                    wa.side_sms,
                    wb.first_step,
                    wb.decode_sms,
                    wb.side_sms
                ));
            }
        }
        let _ = writeln!(
            out,
            "decode windows: {} -> {} (decode/side SMs)",
            a.windows.len(),
            b.windows.len()
        );
        list(&mut out, "partitions", &changed);
    }

    // placements
    fn by_name(p: &Plan) -> BTreeMap<String, &Task> {
        p.tasks.iter().map(|t| (t.name.clone(), t)).collect()
    }
    let (na, nb) = (by_name(a), by_name(b));
    let mut moved = Vec::new();
    for (name, ta) in &na {
        if let Some(tb) = nb.get(name) {
            let (pa, pb) = (placement(a, ta), placement(b, tb));
            if pa != pb {
                moved.push(format!("{name} {pa} -> {pb}"));
            }
        }
    }
    let added: Vec<String> = nb
        .keys()
        .filter(|k| !na.contains_key(*k))
        .cloned()
        .collect();
    let removed: Vec<String> = na
        .keys()
        .filter(|k| !nb.contains_key(*k))
        .cloned()
        .collect();
    if !moved.is_empty() || !added.is_empty() || !removed.is_empty() {
        let _ = writeln!(
            out,
            "tasks: {} -> {} ({} moved, {} added, {} removed)",
            a.tasks.len(),
            b.tasks.len(),
            moved.len(),
            added.len(),
            removed.len()
        );
    }
    list(&mut out, "moved", &moved);
    list(&mut out, "added tasks", &added);
    list(&mut out, "removed tasks", &removed);

    // buffers / residency
    fn bufs(p: &Plan) -> BTreeMap<String, &Buffer> {
        p.buffers.iter().map(|x| (x.name.clone(), x)).collect()
    }
    let (ba, bb) = (bufs(a), bufs(b));
    let mut res = Vec::new();
    let mut sizes = Vec::new();
    for (name, xa) in &ba {
        if let Some(xb) = bb.get(name) {
            let (ra, rb) = (residency(xa), residency(xb));
            if ra != rb {
                res.push(format!("{name} {ra} -> {rb}"));
            }
            if xa.bytes != xb.bytes {
                sizes.push(format!("{name} {} -> {}", gib(xa.bytes), gib(xb.bytes)));
            }
        }
    }
    let badd: Vec<String> = bb
        .iter()
        .filter(|(k, _)| !ba.contains_key(*k))
        .map(|(k, x)| format!("{k} ({})", gib(x.bytes)))
        .collect();
    let brem: Vec<String> = ba
        .iter()
        .filter(|(k, _)| !bb.contains_key(*k))
        .map(|(k, x)| format!("{k} ({})", gib(x.bytes)))
        .collect();
    list(&mut out, "residency", &res);
    list(&mut out, "buffer sizes", &sizes);
    list(&mut out, "added buffers", &badd);
    list(&mut out, "removed buffers", &brem);

    // reshards
    let rs = |p: &Plan| -> (usize, u64, u64) {
        (
            p.reshards.len(),
            p.reshards.iter().map(|r| r.bytes_moved).sum(),
            p.reshards.iter().map(|r| r.bytes_aliased).sum(),
        )
    };
    let (ra, rb) = (rs(a), rs(b));
    if ra != rb {
        let _ = writeln!(
            out,
            "reshards: {} -> {}; moved {} -> {}; aliased {} -> {}",
            ra.0,
            rb.0,
            gib(ra.1),
            gib(rb.1),
            gib(ra.2),
            gib(rb.2)
        );
    }

    // weight sharing: the planner's choices and the memory it costs
    let ws = |p: &Plan| -> Option<(u64, u64, bool, rollplex_plan::ReshardPoint)> {
        p.weight_sharing.as_ref().map(|w| {
            (
                w.extra_bytes,
                w.aliased_bytes,
                w.frozen_rebuilt,
                w.reshard_point,
            )
        })
    };
    let (wa, wb) = (ws(a), ws(b));
    if wa != wb {
        let show = |w: Option<(u64, u64, bool, rollplex_plan::ReshardPoint)>| match w {
            None => "separate rollout copy".to_string(),
            Some((extra, aliased, rebuilt, point)) => format!(
                "{} extra, {} aliased, frozen extra {}, reshard {point:?}",
                gib(extra),
                gib(aliased),
                if rebuilt { "rebuilt" } else { "kept" }
            ),
        };
        let _ = writeln!(out, "weight sharing: {} -> {}", show(wa), show(wb));
    }

    // solver
    let (sa, sb) = (&a.solver, &b.solver);
    if (
        sa.variables,
        sa.integer_variables,
        sa.constraints,
        sa.status,
    ) != (
        sb.variables,
        sb.integer_variables,
        sb.constraints,
        sb.status,
    ) {
        let _ = writeln!(
            out,
            "solver: {} vars ({} integer), {} constraints, {:?} -> {} vars ({} integer), {} constraints, {:?}",
            sa.variables, sa.integer_variables, sa.constraints, sa.status, sb.variables, sb.integer_variables, sb.constraints, sb.status
        );
    }
    if a.spec != b.spec {
        let _ = writeln!(out, "job spec changed (see the raw diff)");
    }
    if out.is_empty() {
        out.push_str("no differences in the summary fields\n");
    }
    out
}

/// Unified diff of two texts with `a`/`b` headers and 3 lines of context ("" when equal).
pub fn unified(a_text: &str, b_text: &str, a_name: &str, b_name: &str) -> String {
    if a_text == b_text {
        return String::new();
    }
    TextDiff::from_lines(a_text, b_text)
        .unified_diff()
        .context_radius(3)
        .header(a_name, b_name)
        .to_string()
}

/// The summary followed by the raw unified diff of the two plans' YAML forms.
pub fn diff_plans(a: &Plan, b: &Plan) -> String {
    diff_plans_named(a, b, "a", "b")
}

/// [`diff_plans`] with the file names to show in the diff header.
pub fn diff_plans_named(a: &Plan, b: &Plan, a_name: &str, b_name: &str) -> String {
    let mut out = summarize(a, b);
    let ya = rollplex_plan::to_yaml(a).unwrap_or_else(|e| format!("# cannot print plan a: {e}\n"));
    let yb = rollplex_plan::to_yaml(b).unwrap_or_else(|e| format!("# cannot print plan b: {e}\n"));
    let raw = unified(&ya, &yb, a_name, b_name);
    if raw.is_empty() {
        out.push_str("plans are identical\n");
    } else {
        out.push('\n');
        out.push_str(&raw);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollplex_plan::spec::*;
    use rollplex_plan::work::{Work, WorkKind};
    use rollplex_plan::*;

    /// Prefill, a decode window with the reference prefix on the side stream, a suffix.
    fn plan() -> Plan {
        let g = GpuId(0);
        let task = |i: u32,
                    name: &str,
                    kind,
                    op,
                    stream: u32,
                    window: Option<u32>,
                    deps: Vec<u32>,
                    sms| Task {
            id: TaskId(i),
            name: name.into(),
            kind,
            op,
            gpu: g,
            stream: StreamId(stream),
            window: window.map(WindowId),
            deps: deps.into_iter().map(TaskId).collect(),
            reads: vec![],
            writes: vec![],
            work: Work {
                flops: 1e12,
                bytes: 1e9,
                steps: 1,
                ..Work::default()
            },
            sms,
            start_s: 0.0,
            end_s: 0.0,
        };
        let kv = Buffer {
            id: BufferId(0),
            name: "kv.prefix".into(),
            role: BufferRole::KvPrompt,
            class: BufferClass::KvPrefix,
            gpu: g,
            bytes: 8 << 30,
            shape: String::new(),
            lifetime: Lifetime::Tasks {
                first: TaskId(2),
                last: TaskId(3),
            },
            residency: vec![
                PhaseResidency {
                    phase: Phase::Rollout,
                    residency: Residency::Hbm,
                },
                PhaseResidency {
                    phase: Phase::Scoring,
                    residency: Residency::Hbm,
                },
            ],
            arena: ArenaId(0),
            offset: 0,
        };
        Plan {
            target: Target {
                gpu: "H200".into(),
                count: 1,
                hbm_bytes: 141_000_000_000,
                sms: 132,
                sm_granularity: 8,
            },
            mode: Mode::Overlap,
            parallel: Parallelism {
                rollout_tp: 1,
                train_tp: 1,
                rollout_replicas: 1,
                train_replicas: 1,
                prompts_per_rollout_replica: 2,
                prompts_per_train_replica: 2,
                trained_groups_per_train_replica: 2,
                group_size: 2,
            },
            old_logprobs: OldLogProbSource::TrainForward,
            train_prefix: TrainPrefixSource::Rollout,
            kept_act_layers: 0,
            kept_prompt_layers: 0,
            predicted: Predicted {
                iteration_s: 1.5,
                phases: vec![PhaseTime {
                    phase: Phase::Rollout,
                    start_s: 0.0,
                    end_s: 1.0,
                }],
                hidden_s: 0.3,
            },
            solver: SolverStats {
                solver: "highs".into(),
                status: SolveStatus::Optimal,
                variables: 10,
                integer_variables: 4,
                constraints: 12,
                objective: 1.5,
            },
            gpus: vec![Gpu {
                id: g,
                role: GpuRole::Colocated,
                first_rank: 0,
                ranks: 1,
            }],
            streams: vec![
                Stream {
                    id: StreamId(0),
                    gpu: g,
                    name: "main".into(),
                    priority: Priority::High,
                    sms: 132,
                },
                Stream {
                    id: StreamId(1),
                    gpu: g,
                    name: "side".into(),
                    priority: Priority::Normal,
                    sms: 132,
                },
            ],
            windows: vec![Window {
                id: WindowId(0),
                gpu: g,
                first_step: 0,
                steps: 8,
                decode_stream: StreamId(0),
                side_stream: StreamId(1),
                decode_sms: 48,
                side_sms: 84,
                expected_active: 4.0,
                expected_groups_done: 0,
                start_s: 0.1,
                end_s: 1.0,
            }],
            tasks: vec![
                task(
                    0,
                    "prefill",
                    WorkKind::Prefill,
                    Op::Prefill {
                        groups: Span::new(0, 2),
                        copies: 1,
                    },
                    0,
                    None,
                    vec![],
                    132,
                ),
                task(
                    1,
                    "decode.w0",
                    WorkKind::Decode,
                    Op::DecodeWindow {
                        first_step: 0,
                        steps: 8,
                        until_done: true,
                    },
                    0,
                    Some(0),
                    vec![0],
                    48,
                ),
                task(
                    2,
                    "ref_prefix",
                    WorkKind::RefPrefix,
                    Op::RefPrefix {
                        groups: Span::new(0, 2),
                        copies: 1,
                    },
                    1,
                    Some(0),
                    vec![0],
                    84,
                ),
                task(
                    3,
                    "ref_suffix.s0",
                    WorkKind::RefSuffix,
                    Op::RefSuffix { slot: 0 },
                    0,
                    None,
                    vec![1, 2],
                    132,
                ),
            ],
            buffers: vec![kv],
            reshards: vec![],
            weight_sharing: None,
            optimizer_stream: None,
            memory: Memory {
                arenas: vec![Arena {
                    id: ArenaId(0),
                    gpu: g,
                    kind: ArenaKind::Device,
                    bytes: 8 << 30,
                }],
                gpus: vec![GpuMemory {
                    gpu: g,
                    budget: 141_000_000_000,
                    peak: 8 << 30,
                    live_peak: 8 << 30,
                    live_peak_at: TaskId(2),
                    host: 0,
                }],
            },
            spec: crate::fixtures::job(|_| {}),
        }
    }

    #[test]
    fn identical_plans_say_so() {
        let p = plan();
        let d = diff_plans(&p, &p);
        assert_eq!(
            d,
            "no differences in the summary fields\nplans are identical\n"
        );
    }

    #[test]
    fn summary_names_the_weight_sharing_choice() {
        let a = plan();
        let mut b = plan();
        let mut w = crate::sharing::analyse(&crate::fixtures::job(|_| {}));
        w.reshard_point = rollplex_plan::ReshardPoint::BesideEncode;
        b.weight_sharing = Some(w);
        let d = diff_plans_named(&a, &b, "a.plan.yaml", "b.plan.yaml");
        assert!(
            d.contains("weight sharing: separate rollout copy -> 0.00 GiB extra"),
            "{d}"
        );
        assert!(d.contains("frozen extra kept, reshard BesideEncode"), "{d}");
    }

    #[test]
    fn summary_names_where_old_logprobs_come_from() {
        let a = plan();
        let mut b = plan();
        b.old_logprobs = OldLogProbSource::Pass;
        let s = summarize(&a, &b);
        assert!(
            s.contains("old log-probs: the training forward -> their own pass"),
            "{s}"
        );
        assert!(!summarize(&a, &a).contains("old log-probs"));
    }

    #[test]
    fn summary_names_where_the_training_prompt_forwards_come_from() {
        let a = plan();
        let mut b = plan();
        b.train_prefix = TrainPrefixSource::Pass;
        let s = summarize(&a, &b);
        assert!(
            s.contains("training prompt forwards: the rollout's prefill -> their own pass"),
            "{s}"
        );
        assert!(!summarize(&a, &a).contains("training prompt forwards"));
    }

    #[test]
    fn summary_names_the_kept_activation_layers() {
        let a = plan();
        let mut b = plan();
        b.kept_act_layers = 3;
        b.kept_prompt_layers = 2;
        let s = summarize(&a, &b);
        let layers = b.spec.actor.text.num_layers;
        assert!(
            s.contains(&format!("kept activation layers: 0 -> 3 of {layers}")),
            "{s}"
        );
        assert!(
            s.contains(&format!(
                "kept activation layers of the prompt rows: 0 -> 2 of {layers}"
            )),
            "{s}"
        );
        assert!(!summarize(&a, &a).contains("kept activation"));
    }

    #[test]
    fn summary_names_what_changed_before_the_raw_diff() {
        let a = plan();
        let mut b = plan();
        b.predicted.iteration_s = 1.2;
        b.windows[0].decode_sms = 40;
        b.windows[0].side_sms = 92;
        b.tasks[2].stream = StreamId(0);
        b.tasks[2].window = None;
        b.tasks[2].sms = 132;
        b.buffers[0].residency[1].residency = Residency::Host;
        b.memory.gpus[0].peak = 6 << 30;
        let d = diff_plans_named(&a, &b, "a.plan.yaml", "b.plan.yaml");
        let (summary, raw) = d
            .split_once("\n--- a.plan.yaml")
            .expect("raw diff follows the summary");
        assert!(
            summary.contains("predicted iteration: 1.500 s -> 1.200 s (-20.0%)"),
            "{summary}"
        );
        assert!(
            summary.contains("win0 step 0 48/84 -> step 0 40/92"),
            "{summary}"
        );
        assert!(
            summary.contains("ref_prefix stream1:side@win0 (84 SMs) -> stream0:main (132 SMs)"),
            "{summary}"
        );
        assert!(
            summary.contains("kv.prefix rollout=hbm,scoring=hbm -> rollout=hbm,scoring=host"),
            "{summary}"
        );
        assert!(
            summary.contains("gpu0 peak 8.00 GiB -> 6.00 GiB (-2.00 GiB)"),
            "{summary}"
        );
        assert!(summary.lines().count() <= 10, "{summary}");
        let line = |sign: char, text: &str| {
            raw.lines()
                .any(|l| l.starts_with(sign) && l[1..].trim() == text)
        };
        assert!(
            raw.contains("+++ b.plan.yaml")
                && line('-', "decode_sms: 48")
                && line('+', "decode_sms: 40"),
            "{raw}"
        );
    }

    #[test]
    fn added_and_removed_tasks_are_listed_and_capped() {
        let a = plan();
        let mut b = plan();
        b.tasks.pop();
        for i in 0..10 {
            let mut t = b.tasks[0].clone();
            t.id = TaskId(b.tasks.len() as u32);
            t.name = format!("extra.{i}");
            b.tasks.push(t);
        }
        let s = summarize(&a, &b);
        assert!(
            s.contains("tasks: 4 -> 13 (0 moved, 10 added, 1 removed)"),
            "{s}"
        );
        assert!(s.contains("... and 4 more"), "{s}");
        assert!(s.contains("removed tasks: ref_suffix.s0"), "{s}");
    }
}
