//! Chrome / Perfetto trace of a [`SimReport`] (the JSON object format: `traceEvents`).
//!
//! One process per GPU program (`pid` = its index, named `gpu0 (colocated, 32 ranks)`), one
//! thread per stream (`tid` = the stream's index, named by the stream), one complete event
//! (`ph: "X"`) per task with its kind as category and its numbers as args, and counter tracks
//! (`ph: "C"`) for SMs allocated, bf16 rate, HBM traffic and HBM live bytes. Times are microseconds. Opens in
//! ui.perfetto.dev and chrome://tracing.

use std::io::{self, Write};

use serde_json::{json, Value};

use super::SimReport;

impl SimReport {
    /// The trace as a JSON value (see the module doc).
    pub fn chrome_trace(&self) -> Value {
        let us = |s: f64| (s * 1e6 * 1000.0).round() / 1000.0;
        let mut events: Vec<Value> = Vec::new();
        for (pid, d) in self.devices.iter().enumerate() {
            events.push(json!({
                "name": "process_name", "ph": "M", "pid": pid,
                "args": {"name": format!("{} ({}, {} ranks)", d.name, d.role, d.ranks)}
            }));
            events.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        }
        for (tid, s) in self.streams.iter().enumerate() {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": s.device, "tid": tid,
                "args": {"name": format!("stream{tid} {}", s.name)}
            }));
            events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": s.device, "tid": tid, "args": {"sort_index": tid}}));
        }
        for t in &self.tasks {
            events.push(json!({
                "name": t.name,
                "cat": format!("{:?}", t.kind),
                "ph": "X",
                "ts": us(t.start_s),
                "dur": us(t.duration_s()),
                "pid": t.device,
                "tid": t.stream,
                "args": {
                    "phase": format!("{:?}", t.phase).to_lowercase(),
                    "window": t.window,
                    "sms": (t.avg_sms * 10.0).round() / 10.0,
                    "slowdown": (t.avg_slowdown * 1000.0).round() / 1000.0,
                    "alone_ms": t.alone_s * 1e3,
                    "planned_start_ms": t.planned_start_s * 1e3,
                    "planned_end_ms": t.planned_end_s * 1e3,
                    "hbm_bytes": t.bytes,
                }
            }));
        }
        for (pid, d) in self.devices.iter().enumerate() {
            for s in &d.samples {
                events.push(json!({
                    "name": "SMs allocated", "ph": "C", "pid": pid, "ts": us(s.t_s),
                    "args": {"sms": (s.sms * 10.0).round() / 10.0}
                }));
                events.push(json!({
                    "name": "HBM traffic (GB/s)", "ph": "C", "pid": pid, "ts": us(s.t_s),
                    "args": {"GB/s": (s.hbm_bw / 1e9).round()}
                }));
                events.push(json!({
                    "name": "bf16 rate (TFLOP/s)", "ph": "C", "pid": pid, "ts": us(s.t_s),
                    "args": {"TFLOP/s": (s.flops / 1e12 * 10.0).round() / 10.0}
                }));
            }
            for &(t, b) in &d.hbm_live {
                events.push(json!({
                    "name": "HBM live (GiB)", "ph": "C", "pid": pid, "ts": us(t),
                    "args": {"GiB": ((b as f64 / (1u64 << 30) as f64) * 100.0).round() / 100.0}
                }));
            }
        }
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "job": self.name,
                "mode": self.mode,
                "gpu": format!("{} x {}", self.gpu_count, self.gpu),
                "cost_model": self.cost_source,
                "iteration_s": self.iteration_s,
                "planned_iteration_s": self.planned_iteration_s,
            }
        })
    }

    /// Writes [`SimReport::chrome_trace`] as JSON.
    pub fn write_chrome_trace(&self, w: &mut impl Write) -> io::Result<()> {
        serde_json::to_writer(&mut *w, &self.chrome_trace()).map_err(io::Error::other)?;
        writeln!(w)
    }
}
