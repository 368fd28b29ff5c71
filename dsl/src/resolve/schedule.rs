//! The `schedule { ... }` block: execution mode, prefix dedup, the decode window and the memory
//! budgets, as the [`ScheduleSpec`], with defaults taken from the cluster.

use crate::span::Span;
use crate::table::{Cx, Table};
use crate::units::Dim;
use rollplex_plan::spec::*;

/// Device memory a run holds outside the plan: the CUDA context, the compiled kernels and the
/// GEMM library's workspaces (about 0.6 GiB on an H100 or H200). The default budget leaves it
/// (an eighth of the GPU at most, for small made-up GPUs).
const RUNTIME_RESERVE: u64 = 1 << 30;

pub(super) fn default_schedule(cluster: &ClusterSpec) -> ScheduleSpec {
    let hbm = cluster.gpu.hbm_bytes;
    ScheduleSpec {
        mode: Mode::Overlap,
        prefix_dedup: true,
        decode_window: 64,
        memory_budget: hbm - RUNTIME_RESERVE.min(hbm / 8),
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

#[cfg(test)]
mod tests {
    use crate::{compile_source, MemFiles};

    fn budget(gpu: &str, schedule: &str) -> u64 {
        let src = format!(
            "pipeline p {{ gpu {{ {gpu} }} model actor {{ preset = tiny }} \
             rollout {{ prompts = 2, group = 2, max_new_tokens = 4 }} reward = builtin(\"math\"), \
             train {{ micro_batch = 2 }} {schedule} }}"
        );
        let c = compile_source("p.rpx", &src, &MemFiles::default())
            .unwrap_or_else(|d| panic!("{}", d.render("p.rpx", &src, false)));
        c.spec.schedule.memory_budget
    }

    #[test]
    fn the_default_budget_leaves_the_runtime_its_reserve() {
        // an H200: its 143,771 MiB less 1 GiB
        assert_eq!(budget("preset = H200", ""), (143_771 << 20) - (1 << 30));
        // a small made-up GPU keeps seven eighths
        assert_eq!(budget("preset = cpu, hbm = 4GiB", ""), 7 << 29);
        // a budget written is taken as written
        assert_eq!(
            budget("preset = H200", "schedule { memory = 140GiB }"),
            140 << 30
        );
    }
}
