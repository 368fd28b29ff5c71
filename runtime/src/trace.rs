//! Chrome / Perfetto trace writer for measured timelines (the JSON object format:
//! `{"traceEvents": [...]}`; opens in ui.perfetto.dev and chrome://tracing).
//!
//! Conventions, shared with the simulator's trace (`sim/trace.rs`) so that a measured and a
//! predicted timeline of the same plan line up: one process per GPU (`pid` = GPU index, named
//! e.g. `gpu0`), one thread per stream (`tid` = stream index, named `stream<i> <name>`), one
//! complete event (`ph: "X"`) per task with `ts`/`dur` in microseconds rounded to nanoseconds,
//! the task kind as `cat`, counters as `ph: "C"`, run facts under `otherData`.
//!
//! Invariant: the output is deterministic for the same events: metadata first (by pid, tid),
//! then events sorted by (ts, pid, tid, name), whatever order they were recorded in (events of
//! several streams are usually recorded out of order).
//!
//! Bounded memory: sorting needs every event at hand, so they are kept in memory, about 1 KiB
//! each (the record, its name and kind, and the args map of a plan task) and as much again
//! while the file is written. A writer keeps at most [`MAX_EVENTS`] events and counter samples
//! (some 250 MiB): later ones are dropped and
//! counted, and the file says so under `otherData.truncated` (`trace truncated after N
//! events, M dropped`). A long run traced in full is better traced for fewer iterations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
}

/// One complete event (a task on a stream).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompleteEvent {
    pub name: String,
    #[serde(default)]
    pub cat: String,
    pub pid: u32,
    pub tid: u32,
    /// Start, microseconds.
    pub ts: f64,
    /// Duration, microseconds.
    pub dur: f64,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub args: Value,
}

#[derive(Clone, Debug, PartialEq)]
struct Counter {
    name: String,
    pid: u32,
    ts: f64,
    values: Vec<(String, f64)>,
}

/// The most events and counter samples one trace keeps (see the module doc).
pub const MAX_EVENTS: usize = 250_000;

fn us(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Collects events (at most [`MAX_EVENTS`], see the module doc), writes them as one JSON file.
#[derive(Clone, Debug)]
pub struct TraceWriter {
    processes: BTreeMap<u32, String>,
    threads: BTreeMap<(u32, u32), String>,
    events: Vec<CompleteEvent>,
    counters: Vec<Counter>,
    other: serde_json::Map<String, Value>,
    /// How many events and counter samples are kept.
    cap: usize,
    /// Events and counter samples dropped once `cap` was reached.
    dropped: u64,
}

impl Default for TraceWriter {
    fn default() -> Self {
        Self::with_cap(MAX_EVENTS)
    }
}

impl TraceWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer that keeps at most `cap` events and counter samples.
    pub fn with_cap(cap: usize) -> Self {
        Self {
            processes: BTreeMap::new(),
            threads: BTreeMap::new(),
            events: Vec::new(),
            counters: Vec::new(),
            other: serde_json::Map::new(),
            cap,
            dropped: 0,
        }
    }

    /// Whether one more event fits; counts it as dropped when not.
    fn keep_one(&mut self) -> bool {
        let full = self.events.len() + self.counters.len() >= self.cap;
        self.dropped += full as u64;
        !full
    }

    /// `trace truncated after N events, M dropped` when the cap was reached, else `None`.
    pub fn truncated(&self) -> Option<String> {
        (self.dropped > 0).then(|| {
            format!(
                "trace truncated after {} events, {} dropped (at most {} are kept)",
                self.events.len() + self.counters.len(),
                self.dropped,
                self.cap
            )
        })
    }

    /// Names process `pid` (a GPU: `gpu0`).
    pub fn process(&mut self, pid: u32, name: &str) {
        self.processes.insert(pid, name.into());
    }

    /// Names thread `tid` of `pid` (a stream: `stream1 decode`).
    pub fn thread(&mut self, pid: u32, tid: u32, name: &str) {
        self.threads.insert((pid, tid), name.into());
    }

    /// A task that ran on GPU `pid`, stream `tid`, from `ts_us` for `dur_us` microseconds.
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        pid: u32,
        tid: u32,
        name: &str,
        cat: &str,
        ts_us: f64,
        dur_us: f64,
        args: Value,
    ) {
        if !self.keep_one() {
            return;
        }
        self.events.push(CompleteEvent {
            name: name.into(),
            cat: cat.into(),
            pid,
            tid,
            ts: us(ts_us),
            dur: us(dur_us.max(0.0)),
            args,
        });
    }

    /// A counter sample (e.g. `HBM live (GiB)`) on process `pid`.
    pub fn counter(&mut self, pid: u32, name: &str, ts_us: f64, values: &[(&str, f64)]) {
        if !self.keep_one() {
            return;
        }
        self.counters.push(Counter {
            name: name.into(),
            pid,
            ts: us(ts_us),
            values: values.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        });
    }

    /// A run fact under `otherData` (job name, mode, iteration time, ...).
    pub fn other(&mut self, key: &str, value: Value) {
        self.other.insert(key.into(), value);
    }

    pub fn events(&self) -> &[CompleteEvent] {
        &self.events
    }

    /// The trace as JSON (see the module doc for the order).
    pub fn to_json(&self) -> Value {
        let mut out =
            Vec::with_capacity(self.events.len() + self.counters.len() + 2 * self.threads.len());
        for (pid, name) in &self.processes {
            out.push(
                json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}),
            );
            out.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        }
        for ((pid, tid), name) in &self.threads {
            out.push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}));
            out.push(json!({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}));
        }
        let mut events: Vec<&CompleteEvent> = self.events.iter().collect();
        events.sort_by(|a, b| {
            a.ts.total_cmp(&b.ts)
                .then(a.pid.cmp(&b.pid))
                .then(a.tid.cmp(&b.tid))
                .then(a.name.cmp(&b.name))
        });
        for e in events {
            let mut v = json!({"name": e.name, "cat": e.cat, "ph": "X", "ts": e.ts, "dur": e.dur, "pid": e.pid, "tid": e.tid});
            if !e.args.is_null() {
                v["args"] = e.args.clone();
            }
            out.push(v);
        }
        let mut counters: Vec<&Counter> = self.counters.iter().collect();
        counters.sort_by(|a, b| {
            a.ts.total_cmp(&b.ts)
                .then(a.pid.cmp(&b.pid))
                .then(a.name.cmp(&b.name))
        });
        for c in counters {
            let args: serde_json::Map<String, Value> = c
                .values
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            out.push(json!({"name": c.name, "ph": "C", "pid": c.pid, "ts": c.ts, "args": args}));
        }
        let mut other = self.other.clone();
        if let Some(t) = self.truncated() {
            other.insert("truncated".into(), json!(t));
        }
        json!({"traceEvents": out, "displayTimeUnit": "ms", "otherData": other})
    }

    /// Writes the trace to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), TraceError> {
        let path = path.as_ref();
        let err = |e: &dyn std::fmt::Display| TraceError::Io {
            path: path.into(),
            msg: e.to_string(),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| err(&e))?;
        }
        let text = serde_json::to_string(&self.to_json()).map_err(|e| err(&e))?;
        std::fs::write(path, text + "\n").map_err(|e| err(&e))
    }
}

/// The complete events of a trace file (ours or the simulator's), in file order.
pub fn read_complete_events(path: impl AsRef<Path>) -> Result<Vec<CompleteEvent>, TraceError> {
    let path = path.as_ref();
    let err = |msg: String| TraceError::Io {
        path: path.into(),
        msg,
    };
    let text = rollplex_plan::files::read_to_string(path, rollplex_plan::files::PLAN_CAP)
        .map_err(|e| err(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("not JSON: {e}")))?;
    let list = v
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .ok_or_else(|| err("no `traceEvents` list".into()))?;
    list.iter()
        .enumerate()
        .filter(|(_, e)| e.get("ph").and_then(|p| p.as_str()) == Some("X"))
        .map(|(i, e)| {
            serde_json::from_value(e.clone()).map_err(|x| err(format!("traceEvents[{i}]: {x}")))
        })
        .collect()
}

/// The measured timeline of a plan's tasks over a run, laid out as the simulator lays out its
/// prediction (`sim/trace.rs`): one process per GPU program (`pid` = its index, named
/// `gpu0 (colocated, 1 ranks)`), one thread per stream (`tid` = the stream's index in
/// `plan.streams`, named `stream<i> <name>`), one complete event per executed task named by the
/// task, with its work kind as `cat` and `{"iteration", "task", "phase", "window"}` as args.
/// Rewards scored on host threads while decode runs are a process of their own after the GPU
/// programs (`host rewards`), one thread per worker (`reward worker <i>`), one event per group
/// (`reward group <g>`, `cat` `reward`, `{"iteration", "group"}` as args).
/// Iterations follow one another on the same tracks; `otherData.iterations` lists each one's
/// measured span.
///
/// Invariant: times are measured on the host around each task (`Instant`), relative to the
/// trace's origin; on a backend that runs one task at a time no two events overlap.
#[derive(Clone, Debug)]
pub struct PlanTrace {
    writer: TraceWriter,
    origin: Instant,
    /// `(pid, tid)` per stream index.
    tracks: Vec<(u32, u32)>,
    /// The process of the host reward workers' tracks (after the GPU programs').
    reward_pid: u32,
    /// Reward worker tracks named so far.
    reward_workers: usize,
    iterations: Vec<Value>,
}

impl PlanTrace {
    /// Names the tracks of `plan` (all GPU programs and streams) and starts the clock.
    pub fn new(plan: &rollplex_plan::Plan, backend: &str) -> Self {
        let mut writer = TraceWriter::new();
        for (pid, g) in plan.gpus.iter().enumerate() {
            let role = format!("{:?}", g.role).to_lowercase();
            writer.process(pid as u32, &format!("{} ({role}, {} ranks)", g.id, g.ranks));
        }
        let mut tracks = Vec::with_capacity(plan.streams.len());
        for (tid, s) in plan.streams.iter().enumerate() {
            let pid = s.gpu.index() as u32;
            writer.thread(pid, tid as u32, &format!("stream{tid} {}", s.name));
            tracks.push((pid, tid as u32));
        }
        writer.other("job", json!(plan.spec.name));
        writer.other("mode", json!(format!("{:?}", plan.mode).to_lowercase()));
        writer.other(
            "gpu",
            json!(format!("{} x {}", plan.target.count, plan.target.gpu)),
        );
        writer.other("backend", json!(backend));
        writer.other("timing", json!("measured"));
        writer.other("planned_iteration_s", json!(plan.predicted.iteration_s));
        Self {
            writer,
            origin: Instant::now(),
            tracks,
            reward_pid: plan.gpus.len() as u32,
            reward_workers: 0,
            iterations: Vec::new(),
        }
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// Records task `task` of `iteration`, which ran from `start` to `end`.
    pub fn task(
        &mut self,
        iteration: u32,
        task: &rollplex_plan::plan::Task,
        start: Instant,
        end: Instant,
    ) {
        let (pid, tid) = self
            .tracks
            .get(task.stream.index())
            .copied()
            .unwrap_or((task.gpu.index() as u32, task.stream.index() as u32));
        let phase = task
            .op
            .phase(task.window.is_some())
            .map(|p| format!("{p:?}").to_lowercase());
        let (ts, te) = (self.us(start), self.us(end));
        self.writer.complete(
            pid,
            tid,
            &task.name,
            &format!("{:?}", task.kind),
            ts,
            te - ts,
            json!({
                "iteration": iteration,
                "task": task.id.to_string(),
                "phase": phase,
                "window": task.window.map(|w| w.to_string()),
            }),
        );
    }

    /// Records a group's reward computed on a host thread ([`crate::exec::RewardSpan`]).
    pub fn reward(&mut self, span: &crate::exec::RewardSpan) {
        if self.reward_workers == 0 {
            self.writer.process(self.reward_pid, "host rewards");
        }
        while self.reward_workers <= span.worker {
            let w = self.reward_workers;
            self.writer
                .thread(self.reward_pid, w as u32, &format!("reward worker {w}"));
            self.reward_workers += 1;
        }
        let (ts, te) = (self.us(span.start), self.us(span.end));
        self.writer.complete(
            self.reward_pid,
            span.worker as u32,
            &format!("reward group {}", span.key.group),
            "reward",
            ts,
            te - ts,
            json!({
                "iteration": span.key.iteration,
                "group": span.key.group,
            }),
        );
    }

    /// Records that `iteration` ran from `start` to `end` (listed under `otherData`).
    pub fn iteration(&mut self, iteration: u32, start: Instant, end: Instant) {
        let (ts, te) = (self.us(start), self.us(end));
        self.iterations.push(json!({
            "iteration": iteration,
            "start_us": us(ts),
            "dur_us": us(te - ts),
        }));
    }

    /// The events recorded so far.
    pub fn events(&self) -> &[CompleteEvent] {
        self.writer.events()
    }

    /// Whether the trace reached [`MAX_EVENTS`] (the message to show the user), else `None`.
    pub fn truncated(&self) -> Option<String> {
        self.writer.truncated()
    }

    /// The trace as JSON.
    pub fn to_json(&self) -> Value {
        let mut w = self.writer.clone();
        w.other("iterations", Value::Array(self.iterations.clone()));
        w.to_json()
    }

    /// Writes the trace to `path` (to a temporary file beside it, then renamed).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), TraceError> {
        let path = path.as_ref();
        let mut w = self.writer.clone();
        w.other("iterations", Value::Array(self.iterations.clone()));
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        w.write(&tmp)?;
        std::fs::rename(&tmp, path).map_err(|e| TraceError::Io {
            path: path.into(),
            msg: e.to_string(),
        })
    }
}

/// Wall-clock time since a fixed origin, in microseconds: host-side timing of CPU-backend
/// tasks (GPU timings come from CUDA events).
#[derive(Clone, Copy, Debug)]
pub struct TraceClock {
    origin: Instant,
}

impl Default for TraceClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl TraceClock {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn now_us(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * 1e6
    }

    /// Runs `f` and records it as a complete event on (`pid`, `tid`).
    pub fn time<T>(
        &self,
        trace: &mut TraceWriter,
        pid: u32,
        tid: u32,
        name: &str,
        cat: &str,
        f: impl FnOnce() -> T,
    ) -> T {
        let start = self.now_us();
        let out = f();
        let end = self.now_us();
        trace.complete(pid, tid, name, cat, start, end - start, Value::Null);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_cap_events_are_dropped_and_the_file_says_so() {
        let mut w = TraceWriter::with_cap(3);
        assert_eq!(w.truncated(), None);
        for i in 0..4 {
            w.complete(0, 0, &format!("t{i}"), "k", i as f64, 1.0, Value::Null);
        }
        w.counter(0, "HBM live (GiB)", 5.0, &[("live", 1.0)]);
        assert_eq!(w.events().len(), 3);
        let why = w.truncated().unwrap();
        assert!(
            why.contains("trace truncated after 3 events, 2 dropped"),
            "{why}"
        );
        assert_eq!(w.to_json()["otherData"]["truncated"], json!(why));
        // the cap is the one `rollplex-run --help` documents
        use clap::CommandFactory;
        let help = crate::cli::Command::command()
            .render_long_help()
            .to_string();
        assert!(
            help.contains(&format!("at most {MAX_EVENTS} events")),
            "{help}"
        );
    }

    #[test]
    fn output_is_sorted_and_deterministic() {
        let mut a = TraceWriter::new();
        a.process(0, "gpu0");
        a.thread(0, 1, "stream1 side");
        a.thread(0, 0, "stream0 decode");
        a.complete(
            0,
            1,
            "ref_prefix",
            "RefPrefix",
            5.0,
            20.0,
            json!({"sms": 48}),
        );
        a.complete(0, 0, "decode[0..64]", "Decode", 0.0, 100.0004, Value::Null);
        a.counter(0, "SMs busy", 0.0, &[("sms", 132.0)]);
        a.other("mode", json!("overlap"));
        let v = a.to_json();
        let ev = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = ev.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            vec![
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
                "thread_name",
                "thread_sort_index",
                "decode[0..64]",
                "ref_prefix",
                "SMs busy"
            ]
        );
        assert_eq!(ev[6]["dur"], json!(100.0));
        assert_eq!(ev[7]["args"]["sms"], json!(48));
        assert_eq!(v["otherData"]["mode"], "overlap");
        // Recording order does not change the file.
        let mut b = TraceWriter::new();
        b.complete(0, 0, "decode[0..64]", "Decode", 0.0, 100.0004, Value::Null);
        b.complete(
            0,
            1,
            "ref_prefix",
            "RefPrefix",
            5.0,
            20.0,
            json!({"sms": 48}),
        );
        b.thread(0, 0, "stream0 decode");
        b.thread(0, 1, "stream1 side");
        b.process(0, "gpu0");
        b.counter(0, "SMs busy", 0.0, &[("sms", 132.0)]);
        b.other("mode", json!("overlap"));
        assert_eq!(
            serde_json::to_string(&a.to_json()).unwrap(),
            serde_json::to_string(&b.to_json()).unwrap()
        );
    }

    #[test]
    fn write_read_and_clock() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TraceWriter::new();
        let clock = TraceClock::new();
        let x = clock.time(&mut t, 0, 2, "reward", "Reward", || 41 + 1);
        assert_eq!(x, 42);
        let path = dir.path().join("traces/iter0.json");
        t.write(&path).unwrap();
        let ev = read_complete_events(&path).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].name.as_str(), ev[0].tid), ("reward", 2));
        assert!(ev[0].dur >= 0.0);
        std::fs::write(&path, "{}").unwrap();
        assert!(read_complete_events(&path)
            .unwrap_err()
            .to_string()
            .contains("traceEvents"));
    }
}
