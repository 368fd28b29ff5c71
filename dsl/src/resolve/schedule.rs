//! The `schedule { ... }` block: execution mode, prefix dedup, the decode window and the memory
//! budgets, as the [`ScheduleSpec`], with defaults taken from the cluster.

use crate::span::Span;
use crate::table::{Cx, Table};
use crate::units::Dim;
use rollplex_plan::spec::*;

pub(super) fn default_schedule(cluster: &ClusterSpec) -> ScheduleSpec {
    ScheduleSpec {
        mode: Mode::Overlap,
        prefix_dedup: true,
        decode_window: 64,
        memory_budget: cluster.gpu.hbm_bytes,
        host_memory: 0,
    }
}

pub(super) fn schedule(
    cx: &mut Cx<'_>,
    head: Span,
    body: &crate::ast::Body,
    cluster: &ClusterSpec,
) -> ScheduleSpec {
    let mut t = Table::from_body(cx, "schedule", "`schedule`", head, body);
    t.hints = &[
        ("memory_budget", "memory"),
        ("window", "decode_window"),
        ("dedup", "prefix_dedup"),
    ];
    let d = default_schedule(cluster);
    let mode = match t.choice(cx, "mode", &["serial", "overlap", "disaggregated"]) {
        Some("serial") => Mode::Serial,
        Some("disaggregated") => Mode::Disaggregated,
        _ => d.mode,
    };
    let prefix_dedup = t.bool(cx, "prefix_dedup").unwrap_or(d.prefix_dedup);
    let decode_window = t.count_or(cx, "decode_window", 1, d.decode_window);
    let memory = t
        .qty(cx, "memory", Dim::Bytes, false)
        .map_or(d.memory_budget, |x| x as u64);
    let host = t
        .qty(cx, "host_memory", Dim::Bytes, true)
        .map_or(d.host_memory, |x| x as u64);
    t.finish(cx);
    ScheduleSpec {
        mode,
        prefix_dedup,
        decode_window,
        memory_budget: memory,
        host_memory: host,
    }
}
