//! The `gpu { ... }` block: the machine the job runs on (a preset, or every rate and size
//! written out) as the [`ClusterSpec`], and its stand-in when the block is missing.

use crate::diag::Diagnostic;
use crate::model;
use crate::presets;
use crate::span::Span;
use crate::table::{as_choice, Cx, Table};
use crate::units::Dim;
use rollplex_plan::spec::*;

pub(super) fn gpu(cx: &mut Cx<'_>, head: Span, body: &crate::ast::Body) -> ClusterSpec {
    let mut t = Table::from_body(cx, "gpu", "`gpu`", head, body);
    let preset_given = t.has("preset");
    let preset = t
        .typed(cx, "preset", |v, _| as_choice(v, presets::GPU_PRESETS))
        .and_then(presets::gpu);
    let base = model::Base {
        span: cx.spans.get_exact("gpu.preset"),
        bad: preset_given && preset.is_none(),
    };
    let b = preset.as_ref();
    let name = t.string(cx, "name");
    let name = name
        .or_else(|| b.map(|p| p.gpu.name.clone()))
        .unwrap_or_else(|| "custom".into());

    let sms = t.count(cx, "sms", 1);
    let sms = base.pick(
        cx,
        &mut t,
        "sms",
        sms,
        b.map(|p| p.gpu.sms),
        "streaming multiprocessors",
        "132",
        1,
    );
    let gran = t.count(cx, "sm_granularity", 1);
    let gran = base.pick_default(
        cx,
        &mut t,
        "sm_granularity",
        gran,
        b.map(|p| p.gpu.sm_granularity),
        1,
    );
    let hbm = t.qty(cx, "hbm", Dim::Bytes, false);
    let hbm = base.pick(
        cx,
        &mut t,
        "hbm",
        hbm,
        b.map(|p| p.gpu.hbm_bytes as f64),
        "device memory",
        "80GiB",
        1.0,
    );
    let bw = t.qty(cx, "bandwidth", Dim::Bandwidth, false);
    let bw = base.pick(
        cx,
        &mut t,
        "bandwidth",
        bw,
        b.map(|p| p.gpu.hbm_bw),
        "HBM bandwidth",
        "3.35TB/s",
        1.0,
    );
    let bf16 = t.qty(cx, "bf16", Dim::FlopRate, false);
    let bf16 = base.pick(
        cx,
        &mut t,
        "bf16",
        bf16,
        b.map(|p| p.gpu.bf16_flops),
        "dense bf16 rate",
        "989TFLOPS",
        1.0,
    );
    let host = t.qty(cx, "host_bandwidth", Dim::Bandwidth, false);
    let host = base.pick_default(
        cx,
        &mut t,
        "host_bandwidth",
        host,
        b.map(|p| p.gpu.host_bw),
        25e9,
    );
    let count = t.count_or(cx, "count", 1, 1);
    let per_node_default = b.map_or(8, |p| p.gpus_per_node).min(count);
    let per_node = t.count(cx, "gpus_per_node", 1);
    if let Some(n) = per_node.filter(|&n| n > count) {
        cx.mark_bad("gpu.gpus_per_node");
        cx.error(
            Diagnostic::error(
                "range",
                cx.span("gpu.gpus_per_node"),
                format!("`gpus_per_node` in gpu is {n}, more than the {count} GPUs of `count`"),
            )
            .with_help(format!("a node holds at most all the GPUs: write `gpus_per_node = {count}` or less, or raise `count`")),
        );
    }
    let per_node = base.pick_default(
        cx,
        &mut t,
        "gpus_per_node",
        per_node,
        Some(per_node_default),
        per_node_default,
    );
    let nvlink = t.qty(cx, "nvlink", Dim::Bandwidth, false);
    let nvlink = base.pick_default(cx, &mut t, "nvlink", nvlink, b.map(|p| p.nvlink), 25e9);
    let ib = t.qty(cx, "ib", Dim::Bandwidth, false);
    let ib = base.pick_default(cx, &mut t, "ib", ib, b.map(|p| p.ib), 12.5e9);
    t.finish(cx);
    ClusterSpec {
        gpu: GpuSpec {
            name,
            sms,
            sm_granularity: gran,
            hbm_bytes: hbm.min(u64::MAX as f64) as u64,
            hbm_bw: bw,
            bf16_flops: bf16,
            host_bw: host,
        },
        count,
        gpus_per_node: per_node,
        intra_node_bw: nvlink,
        inter_node_bw: ib,
    }
}

pub(super) fn stand_in_cluster() -> ClusterSpec {
    let p = presets::gpu("cpu").map(|p| p.gpu);
    ClusterSpec {
        gpu: p.unwrap_or(GpuSpec {
            name: "cpu".into(),
            sms: 1,
            sm_granularity: 1,
            hbm_bytes: 1 << 34,
            hbm_bw: 1e10,
            bf16_flops: 1e11,
            host_bw: 1e10,
        }),
        count: 1,
        gpus_per_node: 1,
        intra_node_bw: 1e10,
        inter_node_bw: 1e9,
    }
}
