//! AST -> [`JobSpec`]: every section read through a [`Table`] (so unknown, duplicate, missing
//! and mistyped keys are all reported), defaults filled in, presets expanded.
//!
//! Defaults (documented in docs/language.md, and only here in code) are the values a key
//! takes when it is not written. A value that is missing or invalid leaves a stand-in in the
//! spec and its path in [`Cx::bad`]; the spec is only handed out when there was no error.

// `%` instead of `is_multiple_of`: the workspace supports Rust 1.85.
#![allow(clippy::manual_is_multiple_of)]

use crate::ast::{File, Ident, Pipeline};
use crate::diag::Diagnostic;
use crate::eval::{CallVal, Val, Value};
use crate::model;
use crate::presets;
use crate::span::Span;
use crate::table::{as_call, as_choice, Cx, Table};
use crate::units::Dim;
use crate::Env;
use rollplex_plan::spec::*;

/// Resolves a parsed file; `None` only when there is no pipeline at all.
pub fn resolve(cx: &mut Cx<'_>, file: &File, env: &dyn Env) -> Option<JobSpec> {
    for c in &file.consts {
        let v = cx.eval(&c.value);
        cx.consts.define(&c.name, v, &mut cx.diags, &cx.lines);
    }
    let Some(p) = &file.pipeline else {
        if !file.broken {
            let end = cx.src.len();
            cx.error(
                Diagnostic::error("missing-pipeline", Span::new(end, end), "this file has no `pipeline`")
                    .with_help("add `pipeline NAME { gpu { ... } model actor { ... } rollout { ... } reward = ... train { ... } }`"),
            );
        }
        return None;
    };
    Some(pipeline(cx, p, env))
}

fn no_label(cx: &mut Cx<'_>, key: &str, label: Option<&Ident>) {
    if let Some(l) = label {
        cx.error(
            Diagnostic::error("syntax", l.span, format!("`{key}` takes no name"))
                .with_label("unexpected name")
                .with_help(format!("write `{key} {{ ... }}`")),
        );
    }
}

fn pipeline(cx: &mut Cx<'_>, p: &Pipeline, env: &dyn Env) -> JobSpec {
    let title = format!("pipeline `{}`", p.name.name);
    let mut t = Table::from_body(cx, "", &title, p.name.span, &p.body);
    let seed = t.u64(cx, "seed").unwrap_or(0);

    let cluster = match t.section(cx, "gpu") {
        Some((label, head, body)) => {
            no_label(cx, "gpu", label);
            gpu(cx, head, body)
        }
        None => {
            if !t.has("gpu") {
                t.missing_section(cx, "gpu", "gpu { preset = H200, count = 1 }");
            }
            stand_in_cluster()
        }
    };
    let actor = match t.section(cx, "model") {
        Some((label, head, body)) => model::model(cx, label, head, body, seed, env),
        None => {
            if !t.has("model") {
                t.missing_section(cx, "model", "model actor { preset = \"qwen2.5-vl-3b\" }");
            }
            model::stand_in()
        }
    };
    let rollout = match t.section(cx, "rollout") {
        Some((label, head, body)) => {
            no_label(cx, "rollout", label);
            rollout(cx, head, body)
        }
        None => {
            if !t.has("rollout") {
                t.missing_section(
                    cx,
                    "rollout",
                    "rollout { prompts = 8, group = 4, max_new_tokens = 256 }",
                );
            }
            stand_in_rollout()
        }
    };
    let samples = match rollout.prompts_per_iter.checked_mul(rollout.group_size) {
        Some(n) if n <= crate::limits::MAX_SAMPLES => n,
        Some(n) => {
            let sp = cx.span("rollout.prompts");
            cx.mark_bad("rollout.samples");
            cx.error(
                Diagnostic::error(
                    "limit",
                    sp,
                    format!(
                        "prompts x group is {n} samples per iteration, above the limit of {}",
                        crate::limits::MAX_SAMPLES
                    ),
                )
                .with_help(crate::limits::HELP),
            );
            1
        }
        None => {
            let sp = cx.span("rollout.prompts");
            cx.mark_bad("rollout.samples");
            cx.error(
                Diagnostic::error(
                    "range",
                    sp,
                    "prompts x group is more samples than can be counted",
                )
                .with_help("an iteration holds at most 4294967295 samples"),
            );
            1
        }
    };
    let train = match t.section(cx, "train") {
        Some((label, head, body)) => {
            no_label(cx, "train", label);
            train(cx, head, body, samples, rollout.prompts_per_iter)
        }
        None => {
            if !t.has("train") {
                t.missing_section(cx, "train", "train { micro_batch = 4 }");
            }
            stand_in_train(samples)
        }
    };
    let steps =
        u64::from(samples).div_ceil(u64::from(train.micro_batch.max(1))) * u64::from(train.epochs);
    if steps > u64::from(crate::limits::MAX_MICRO_STEPS)
        && cx.ok(&["rollout.samples", "train.micro_batch", "train.epochs"])
    {
        cx.mark_bad("train.epochs");
        cx.error(
            Diagnostic::error(
                "limit",
                cx.span("train.micro_batch"),
                format!(
                    "{samples} samples in micro-batches of {} over {} epochs are {steps} micro-batch steps per iteration, above the limit of {}",
                    train.micro_batch,
                    train.epochs,
                    crate::limits::MAX_MICRO_STEPS
                ),
            )
            .with_help(format!("raise micro_batch or lower epochs; {}", crate::limits::HELP)),
        );
    }
    let reward = match t.call(cx, "reward", &["builtin", "command", "sum"]) {
        Some(c) => reward(cx, &c),
        None => {
            if !t.has("reward") {
                t.missing(cx, "reward", "a reward", "builtin(\"choice_letter\")");
            }
            RewardSpec::Builtin {
                name: "exact_match".into(),
                tolerance: 0.0,
            }
        }
    };
    let kl = train.algorithm.loss().kl_coef;
    let reference = ReferenceSpec {
        enabled: t.bool(cx, "reference").unwrap_or(kl > 0.0),
    };
    let schedule = match t.section(cx, "schedule") {
        Some((label, head, body)) => {
            no_label(cx, "schedule", label);
            schedule(cx, head, body, &cluster)
        }
        None => default_schedule(&cluster),
    };
    t.finish(cx);
    JobSpec {
        name: p.name.name.clone(),
        seed,
        cluster,
        actor,
        reference,
        rollout,
        reward,
        train,
        schedule,
    }
}

// ---------------------------------------------------------------- gpu

fn gpu(cx: &mut Cx<'_>, head: Span, body: &crate::ast::Body) -> ClusterSpec {
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

fn stand_in_cluster() -> ClusterSpec {
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

// ---------------------------------------------------------------- rollout

fn rollout(cx: &mut Cx<'_>, head: Span, body: &crate::ast::Body) -> RolloutSpec {
    let mut t = Table::from_body(cx, "rollout", "`rollout`", head, body);
    t.hints = &[
        ("prompts_per_iter", "prompts"),
        ("group_size", "group"),
        ("n", "group"),
        ("prompt_text_tokens", "text_tokens"),
        ("response_len", "response_length"),
        ("temperature", "sampling { temperature = ... }"),
        ("top_p", "sampling { top_p = ... }"),
        ("top_k", "sampling { top_k = ... }"),
    ];
    let tp = t.count_or(cx, "tp", 1, 1);
    let prompts = t.req_count(cx, "prompts", 1, "8");
    let group = t.req_count(cx, "group", 1, "4");
    let media = match t.call(cx, "media", &["video", "image", "none"]) {
        Some(c) => media(cx, &c),
        None => MediaSpec::None,
    };
    let text_tokens = t.count_or(cx, "text_tokens", 0, 64);
    let max_new = t.req_count(cx, "max_new_tokens", 1, "256");
    let response_len = match t.call(cx, "response_length", &["fixed", "uniform", "lognormal"]) {
        Some(c) => length_dist(cx, &c),
        None => LengthDist::Fixed { tokens: max_new },
    };
    let sampling = match t.section(cx, "sampling") {
        Some((label, head, body)) => {
            no_label(cx, "sampling", label);
            sampling(cx, head, body)
        }
        None => SamplingSpec {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop_token_ids: vec![],
            forced_lengths: false,
        },
    };
    let dataset = match t.call(cx, "dataset", &["file", "generated", "synthetic"]) {
        Some(c) => dataset(cx, &c),
        None => DatasetSpec::Synthetic,
    };
    t.finish(cx);
    RolloutSpec {
        tp,
        prompts_per_iter: prompts,
        group_size: group,
        media,
        prompt_text_tokens: text_tokens,
        max_new_tokens: max_new,
        response_len,
        sampling,
        dataset,
    }
}

fn stand_in_rollout() -> RolloutSpec {
    RolloutSpec {
        tp: 1,
        prompts_per_iter: 1,
        group_size: 2,
        media: MediaSpec::None,
        prompt_text_tokens: 64,
        max_new_tokens: 1,
        response_len: LengthDist::Fixed { tokens: 1 },
        sampling: SamplingSpec {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop_token_ids: vec![],
            forced_lengths: false,
        },
        dataset: DatasetSpec::Synthetic,
    }
}

/// `WxH`, or one number for a square.
fn size_arg(t: &mut Table<'_>, cx: &mut Cx<'_>, key: &'static str) -> Option<(u32, u32)> {
    t.typed(cx, key, |v, _| match v.value {
        Value::Dims(w, h) if w >= 1 && h >= 1 && w <= u32::MAX as u64 && h <= u32::MAX as u64 => {
            Ok((w as u32, h as u32))
        }
        Value::Int(s) if s >= 1 && s <= u32::MAX as i64 => Ok((s as u32, s as u32)),
        Value::Dims(..) | Value::Int(_) => {
            Err(("width and height must be at least 1 pixel".into(), None))
        }
        _ => Err((
            "expected `WIDTHxHEIGHT` in pixels".into(),
            Some(format!("e.g. `{key} = 448x448`")),
        )),
    })
}

fn media(cx: &mut Cx<'_>, c: &CallVal) -> MediaSpec {
    match c.name.name.as_str() {
        "video" => {
            let mut t = Table::from_call(cx, "rollout.media", c, &["frames", "size"]);
            let frames = t.req_count(cx, "frames", 1, "8");
            let size = size_arg(&mut t, cx, "size");
            if size.is_none() && !t.has("size") {
                t.missing(cx, "size", "`WIDTHxHEIGHT` in pixels", "448x448");
            }
            t.finish(cx);
            let (w, h) = size.unwrap_or((1, 1));
            MediaSpec::Video {
                frames,
                height: h,
                width: w,
            }
        }
        "image" => {
            let mut t = Table::from_call(cx, "rollout.media", c, &["size", "count"]);
            let size = size_arg(&mut t, cx, "size");
            if size.is_none() && !t.has("size") {
                t.missing(cx, "size", "`WIDTHxHEIGHT` in pixels", "448x448");
            }
            let count = t.count_or(cx, "count", 1, 1);
            t.finish(cx);
            let (w, h) = size.unwrap_or((1, 1));
            MediaSpec::Image {
                count,
                height: h,
                width: w,
            }
        }
        _ => {
            let t = Table::from_call(cx, "rollout.media", c, &[]);
            t.finish(cx);
            MediaSpec::None
        }
    }
}

fn length_dist(cx: &mut Cx<'_>, c: &CallVal) -> LengthDist {
    match c.name.name.as_str() {
        "fixed" => {
            let mut t = Table::from_call(cx, "rollout.response_length", c, &["tokens"]);
            let tokens = t.req_count(cx, "tokens", 1, "256");
            t.finish(cx);
            LengthDist::Fixed { tokens }
        }
        "uniform" => {
            let mut t = Table::from_call(cx, "rollout.response_length", c, &["min", "max"]);
            let min = t.req_count(cx, "min", 1, "16");
            let max = t.req_count(cx, "max", 1, "256");
            if min > max && cx.ok(&["rollout.response_length.min", "rollout.response_length.max"]) {
                let sp = cx.span("rollout.response_length.min");
                cx.error(
                    Diagnostic::error(
                        "range",
                        sp,
                        format!("`uniform` has min = {min} > max = {max}"),
                    )
                    .with_help("swap them"),
                );
            }
            t.finish(cx);
            LengthDist::Uniform { min, max }
        }
        _ => {
            let mut t = Table::from_call(cx, "rollout.response_length", c, &["median", "sigma"]);
            let median = t.req_float(cx, "median", 1.0, f64::INFINITY, "256");
            let sigma = t.req_float(cx, "sigma", 0.0, 10.0, "0.6");
            t.finish(cx);
            LengthDist::LogNormal { median, sigma }
        }
    }
}

fn sampling(cx: &mut Cx<'_>, head: Span, body: &crate::ast::Body) -> SamplingSpec {
    let mut t = Table::from_body(cx, "rollout.sampling", "`sampling`", head, body);
    t.hints = &[("stop_token_ids", "stop"), ("temp", "temperature")];
    let temperature = t.float_or(cx, "temperature", 0.0, 100.0, 1.0);
    let top_p = t.float_or(cx, "top_p", 0.0, 1.0, 1.0);
    if top_p == 0.0 && cx.ok(&["rollout.sampling.top_p"]) {
        let sp = cx.span("rollout.sampling.top_p");
        cx.error(
            Diagnostic::error("range", sp, "`top_p = 0` keeps no token")
                .with_help("top_p is in (0, 1]; 1 disables nucleus sampling"),
        );
    }
    let top_k = t.count_or(cx, "top_k", 0, 0);
    let stop = t
        .typed(cx, "stop", |v, _| count_list(v, "stop"))
        .unwrap_or_default();
    let forced = t.bool(cx, "forced_lengths").unwrap_or(false);
    t.finish(cx);
    SamplingSpec {
        temperature,
        top_p,
        top_k,
        stop_token_ids: stop,
        forced_lengths: forced,
    }
}

/// A list of whole numbers (a single one is accepted as a list of one).
pub fn count_list(v: &Val, key: &str) -> Result<Vec<u32>, (String, Option<String>)> {
    let items: Vec<Val> = match &v.value {
        Value::List(xs) => xs.clone(),
        Value::Int(_) => vec![v.clone()],
        _ => {
            return Err((
                "expected a list of whole numbers".into(),
                Some(format!("e.g. `{key} = [1, 2]`")),
            ))
        }
    };
    let mut out = Vec::new();
    for x in &items {
        match x.value {
            Value::Int(i) if (0..=u32::MAX as i64).contains(&i) => out.push(i as u32),
            Value::Error => return Err(("contains an invalid value".into(), None)),
            _ => {
                return Err((
                    "expected a list of whole numbers".into(),
                    Some(format!("e.g. `{key} = [1, 2]`")),
                ))
            }
        }
    }
    Ok(out)
}

/// Whether a dataset path names a format the runtime reads: `.jsonl` / `.ndjson` or `.parquet`
/// (any case), as `rollplex_runtime::data::Dataset::load` picks it.
fn dataset_format_known(path: &str) -> bool {
    std::path::Path::new(path)
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| ["jsonl", "ndjson", "parquet"].contains(&e.to_ascii_lowercase().as_str()))
}

fn dataset(cx: &mut Cx<'_>, c: &CallVal) -> DatasetSpec {
    match c.name.name.as_str() {
        "file" => {
            let mut t = Table::from_call(cx, "rollout.dataset", c, &["path"]);
            // The runtime picks the file's format by its extension: refuse others here.
            let path = t.typed(cx, "path", |v, _| match &v.value {
                Value::Str(s) if dataset_format_known(s) => Ok(s.clone()),
                Value::Str(_) => Err((
                    "expected a .jsonl or .parquet dataset (the extension picks the format)".into(),
                    Some("e.g. `file(\"data/train.parquet\")`".into()),
                )),
                _ => Err((
                    "expected a string".into(),
                    Some("quote it: `path = \"...\"`".into()),
                )),
            });
            if path.is_none() && !t.has("path") {
                t.missing(cx, "path", "a file path", "\"data/train.jsonl\"");
            }
            t.finish(cx);
            DatasetSpec::File {
                path: path.unwrap_or_default(),
            }
        }
        "generated" => {
            let mut t = Table::from_call(cx, "rollout.dataset", c, &["name", "size"]);
            let name = t.typed(cx, "name", |v, _| match &v.value {
                Value::Str(s) | Value::Sym(s) => Ok(s.clone()),
                _ => Err((
                    "expected a generator name".into(),
                    Some("e.g. `generated(\"moving_shapes\", 512)`".into()),
                )),
            });
            if name.is_none() && !t.has("name") {
                t.missing(cx, "name", "a generator name", "\"moving_shapes\"");
            }
            let size = t.req_count(cx, "size", 1, "512");
            t.finish(cx);
            DatasetSpec::Generated {
                name: name.unwrap_or_default(),
                size,
            }
        }
        _ => {
            Table::from_call(cx, "rollout.dataset", c, &[]).finish(cx);
            DatasetSpec::Synthetic
        }
    }
}

// ---------------------------------------------------------------- reward

/// `reward = builtin(...) | command(...) | sum(...)`.
fn reward(cx: &mut Cx<'_>, c: &CallVal) -> RewardSpec {
    if c.name.name == "sum" {
        return reward_sum(cx, c);
    }
    reward_term(cx, c, false).0
}

/// How a weighted sum is written, for help texts.
const SUM_EXAMPLE: &str = "sum(builtin(\"math\", weight = 0.9), builtin(\"format\", weight = 0.1))";

/// `sum(reward, reward, ...)`: each a `builtin` or `command` call with an optional `weight`.
fn reward_sum(cx: &mut Cx<'_>, c: &CallVal) -> RewardSpec {
    let mut terms = Vec::new();
    let mut bad = false;
    for (name, v) in &c.args {
        if let Some(n) = name {
            bad = true;
            cx.error(
                Diagnostic::error(
                    "argument",
                    n.span,
                    format!("`sum(...)` takes rewards, not `{} = ...`", n.name),
                )
                .with_help(format!(
                    "list the rewards, each with its weight: `{SUM_EXAMPLE}`"
                )),
            );
            continue;
        }
        if matches!(v.value, Value::Error) {
            bad = true; // already reported
            continue;
        }
        match as_call(v, &["builtin", "command"]) {
            Ok(call) => {
                let (reward, weight) = reward_term(cx, &call, true);
                terms.push(WeightedReward { weight, reward });
            }
            Err((msg, help)) => {
                bad = true;
                let help = match &v.value {
                    Value::Call(inner) if inner.name.name == "sum" => {
                        "a `sum` inside `sum`: list its rewards in the outer one".to_string()
                    }
                    _ => help.unwrap_or_else(|| format!("e.g. `{SUM_EXAMPLE}`")),
                };
                cx.error(
                    Diagnostic::error("type", v.span, format!("a term of `sum(...)`: {msg}"))
                        .with_label(format!("found {}", v.noun(cx.src)))
                        .with_help(help),
                );
            }
        }
    }
    if terms.is_empty() && !bad && !c.broken {
        cx.error(
            Diagnostic::error("missing-key", c.name.span, "`sum(...)` of no rewards")
                .with_help(format!("e.g. `{SUM_EXAMPLE}`")),
        );
    }
    if bad || terms.is_empty() {
        cx.mark_bad("reward");
    }
    RewardSpec::Sum { terms }
}

/// A tag name of the `format` reward: letters, digits, `_` or `-`, written without `<>`.
fn tag_name(v: &Val, empty_ok: bool) -> Result<String, (String, Option<String>)> {
    let Value::Str(s) = &v.value else {
        return Err((
            "expected a tag name as a string".into(),
            Some("e.g. `think = \"think\"` for `<think>...</think>`".into()),
        ));
    };
    if s.is_empty() && !empty_ok {
        return Err((
            "the tag name is empty".into(),
            Some("name the tag the answer goes in, e.g. `answer = \"answer\"`".into()),
        ));
    }
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err((
            format!("{s:?} is not a tag name (letters, digits, `_`, `-`)"),
            Some(
                "write the name without `<>`: `think = \"think\"` for `<think>...</think>`".into(),
            ),
        ));
    }
    Ok(s.clone())
}

/// `builtin(name, ...)` or `command(argv, ...)`, and its `weight` (only inside `sum`; 1
/// elsewhere).
fn reward_term(cx: &mut Cx<'_>, c: &CallVal, in_sum: bool) -> (RewardSpec, f64) {
    let positional: &[&'static str] = if c.name.name == "builtin" {
        &["name", "tolerance"]
    } else {
        &["argv", "timeout"]
    };
    let mut t = Table::from_call(cx, "reward", c, positional);
    let weight = if in_sum {
        t.float_or(cx, "weight", f64::NEG_INFINITY, f64::INFINITY, 1.0)
    } else {
        if let Some(v) = t.value(cx, "weight") {
            cx.mark_bad("reward");
            cx.error(
                Diagnostic::error(
                    "unknown-key",
                    v.span,
                    "`weight` applies to a reward inside `sum(...)`",
                )
                .with_label("not a key of a single reward")
                .with_help(format!(
                    "drop it, or weigh several rewards: `reward = {SUM_EXAMPLE}`"
                )),
            );
        }
        1.0
    };
    let spec = if c.name.name == "builtin" {
        let name = t.typed(cx, "name", |v, _| as_choice(v, BUILTIN_REWARDS));
        if name.is_none() && !t.has("name") {
            t.missing(cx, "name", "a built-in reward", "\"math\"");
        }
        match name.unwrap_or("exact_match") {
            "format" => {
                let think = t
                    .typed(cx, "think", |v, _| tag_name(v, true))
                    .unwrap_or_else(|| FORMAT_THINK_TAG.into());
                let answer = t
                    .typed(cx, "answer", |v, _| tag_name(v, false))
                    .unwrap_or_else(|| FORMAT_ANSWER_TAG.into());
                RewardSpec::Format { think, answer }
            }
            name => {
                let default_tol = match name {
                    "numeric" => 1e-6,
                    "math" => 1e-9,
                    _ => 0.0,
                };
                let tolerance = t.float_or(cx, "tolerance", 0.0, f64::INFINITY, default_tol);
                RewardSpec::Builtin {
                    name: name.into(),
                    tolerance,
                }
            }
        }
    } else {
        let argv = t.typed(cx, "argv", |v, _| {
            let bad = || {
                (
                    "expected the command as a list of strings".to_string(),
                    Some("e.g. `command([\"python3\", \"reward.py\"])`".to_string()),
                )
            };
            match &v.value {
                Value::List(xs) if !xs.is_empty() => xs
                    .iter()
                    .map(|x| match &x.value {
                        Value::Str(s) => Ok(s.clone()),
                        _ => Err(bad()),
                    })
                    .collect(),
                Value::List(_) => Err((
                    "the command is empty".into(),
                    Some("name the program to run".into()),
                )),
                _ => Err(bad()),
            }
        });
        if argv.is_none() && !t.has("argv") {
            t.missing(
                cx,
                "argv",
                "the command as a list of strings",
                "[\"python3\", \"reward.py\"]",
            );
        }
        let timeout = t.qty(cx, "timeout", Dim::Duration, false).unwrap_or(60.0);
        RewardSpec::Command {
            argv: argv.unwrap_or_default(),
            timeout_s: timeout,
        }
    };
    t.finish(cx);
    (spec, weight)
}

// ---------------------------------------------------------------- train

fn train(
    cx: &mut Cx<'_>,
    head: Span,
    body: &crate::ast::Body,
    samples: u32,
    prompts: u32,
) -> TrainSpec {
    let mut t = Table::from_body(cx, "train", "`train`", head, body);
    t.hints = &[
        ("lr", "optimizer = adamw(lr = ...)"),
        ("clip", "algorithm = grpo(clip = ...)"),
        ("kl_coef", "algorithm = grpo(kl_coef = ...)"),
        ("micro_batch_size", "micro_batch"),
        ("mini_batch_size", "mini_batch"),
        ("ppo_epochs", "epochs"),
    ];
    let tp = t.count_or(cx, "tp", 1, 1);
    let algorithm = match t.call(cx, "algorithm", ALGORITHMS) {
        Some(c) => algorithm(cx, &c),
        None => Algorithm::Grpo(default_loss("grpo")),
    };
    let optimizer = match t.call(cx, "optimizer", &["adamw"]) {
        Some(c) => adamw(cx, &c),
        None => default_adamw(),
    };
    let groups = t.count(cx, "groups", 1);
    if let Some(n) = groups.filter(|&n| n > prompts) {
        let sp = cx.span("train.groups");
        cx.error(
            Diagnostic::error(
                "range",
                sp,
                format!("{n} groups trained per iteration, but only {prompts} are rolled out"),
            )
            .with_help(format!(
                "train at most `rollout {{ prompts }}` = {prompts} groups; fewer than rolled out \
                 turns on dynamic sampling (the groups with reward variance train)"
            )),
        );
    }
    let trained_samples = match groups {
        Some(n) if n <= prompts => samples / prompts.max(1) * n,
        _ => samples,
    };
    let micro = t.req_count(cx, "micro_batch", 1, "4");
    let mini = t.count_or(cx, "mini_batch", 1, trained_samples.max(1));
    let epochs = t.count_or(cx, "epochs", 1, 1);
    let freeze = t
        .typed(cx, "freeze", |v, _| {
            let items: Vec<Val> = match &v.value {
                Value::List(xs) => xs.clone(),
                Value::Sym(_) => vec![v.clone()],
                _ => {
                    return Err((
                        "expected a list of parts".into(),
                        Some("e.g. `freeze = [vision, merger]`, or `[]`".into()),
                    ))
                }
            };
            let mut parts = Vec::new();
            for x in &items {
                parts.push(as_choice(x, &["vision", "merger"])?);
            }
            Ok(parts)
        })
        .unwrap_or_default();
    let recompute = match t.choice(cx, "recompute", &["auto", "none", "full"]) {
        Some("full") => Recompute::Full,
        Some("none") => Recompute::None,
        _ => Recompute::Auto,
    };
    let optimizer_state = match t.choice(cx, "optimizer_state", &["auto", "hbm", "host", "stream"])
    {
        Some("hbm") => OptimizerState::Hbm,
        Some("host") => OptimizerState::Host,
        Some("stream") => OptimizerState::Stream,
        _ => OptimizerState::Auto,
    };
    let old_logprobs = match t.choice(cx, "old_logprobs", &["auto", "recompute"]) {
        Some("recompute") => OldLogProbPass::Recompute,
        _ => OldLogProbPass::Auto,
    };
    t.finish(cx);
    TrainSpec {
        tp,
        algorithm,
        optimizer,
        micro_batch: micro,
        mini_batch: mini,
        epochs,
        freeze_vision: freeze.contains(&"vision"),
        freeze_merger: freeze.contains(&"merger"),
        recompute,
        optimizer_state,
        groups,
        old_logprobs,
    }
}

fn stand_in_train(samples: u32) -> TrainSpec {
    TrainSpec {
        tp: 1,
        algorithm: Algorithm::Grpo(default_loss("grpo")),
        optimizer: default_adamw(),
        micro_batch: 1,
        mini_batch: samples.max(1),
        epochs: 1,
        freeze_vision: false,
        freeze_merger: false,
        recompute: Recompute::None,
        optimizer_state: OptimizerState::Auto,
        groups: None,
        old_logprobs: OldLogProbPass::Auto,
    }
}

/// The algorithm presets of `train { algorithm = ... }`: every one is the same loss with other
/// defaults, and every option can be set in any of them.
const ALGORITHMS: &[&str] = &[
    "grpo",
    "ppo_clip",
    "dr_grpo",
    "dapo",
    "gspo",
    "reinforce_pp",
];

/// The defaults of an algorithm preset (a name of [`ALGORITHMS`]).
fn default_loss(name: &str) -> PolicyLoss {
    let base = PolicyLoss {
        clip_low: 0.2,
        clip_high: 0.2,
        kl_coef: 0.001,
        kl_estimator: KlEstimator::K3,
        loss_agg: LossAgg::TokenMean,
        norm_adv_by_std: name != "ppo_clip",
        advantage: AdvantageEstimator::Group,
        ratio: RatioLevel::Token,
        tis_cap: None,
        overlong: None,
    };
    match name {
        // Dr. GRPO: no std normalisation, a constant loss denominator.
        "dr_grpo" => PolicyLoss {
            norm_adv_by_std: false,
            loss_agg: LossAgg::SeqMeanTokenSumNorm,
            ..base
        },
        // DAPO: clip-higher, token-mean loss, no KL term.
        "dapo" => PolicyLoss {
            clip_high: 0.28,
            kl_coef: 0.0,
            ..base
        },
        // GSPO: the sequence-level ratio with the paper's small clip range.
        "gspo" => PolicyLoss {
            clip_low: 3e-4,
            clip_high: 4e-4,
            loss_agg: LossAgg::SeqMeanTokenMean,
            ratio: RatioLevel::Sequence,
            ..base
        },
        "reinforce_pp" => PolicyLoss {
            advantage: AdvantageEstimator::ReinforceBaseline,
            norm_adv_by_std: false,
            ..base
        },
        _ => base,
    }
}

fn algorithm(cx: &mut Cx<'_>, c: &CallVal) -> Algorithm {
    let name = c.name.name.as_str();
    let mut t = Table::from_call(cx, "train.algorithm", c, &[]);
    t.hints = &[
        ("kl_estimator", "kl"),
        ("kl_loss_coef", "kl_coef"),
        ("clip_ratio", "clip"),
        ("tis_imp_ratio_cap", "tis_cap"),
        ("overlong_buffer_len", "overlong_buffer"),
        ("overlong_penalty_factor", "overlong_penalty"),
        ("adv_estimator", "advantage"),
    ];
    let d = default_loss(name);
    let clip = t.float(cx, "clip", 0.0, 1.0);
    let clip_low = t.float(cx, "clip_low", 0.0, 1.0);
    let clip_high = t.float(cx, "clip_high", 0.0, f64::INFINITY);
    if clip.is_some() && (t.has("clip_low") || t.has("clip_high")) {
        let sp = cx.span("train.algorithm.clip");
        cx.error(
            Diagnostic::error(
                "conflict",
                sp,
                "both `clip` and `clip_low`/`clip_high` are given",
            )
            .with_help("`clip = x` sets both bounds; give either it or `clip_low`/`clip_high`"),
        );
    }
    let kl_coef = t.float_or(cx, "kl_coef", 0.0, f64::INFINITY, d.kl_coef);
    let kl = match t.choice(cx, "kl", &["k1", "k2", "k3"]) {
        Some("k1") => KlEstimator::K1,
        Some("k2") => KlEstimator::K2,
        Some(_) => KlEstimator::K3,
        None => d.kl_estimator,
    };
    let agg = match t.choice(
        cx,
        "loss_agg",
        &[
            "token_mean",
            "seq_mean_token_mean",
            "seq_mean_token_sum",
            "seq_mean_token_sum_norm",
        ],
    ) {
        Some("token_mean") => LossAgg::TokenMean,
        Some("seq_mean_token_mean") => LossAgg::SeqMeanTokenMean,
        Some("seq_mean_token_sum") => LossAgg::SeqMeanTokenSum,
        Some(_) => LossAgg::SeqMeanTokenSumNorm,
        None => d.loss_agg,
    };
    let norm = t.bool(cx, "norm_adv_by_std").unwrap_or(d.norm_adv_by_std);
    let advantage = match t.choice(cx, "advantage", &["group", "reinforce_baseline"]) {
        Some("group") => AdvantageEstimator::Group,
        Some(_) => AdvantageEstimator::ReinforceBaseline,
        None => d.advantage,
    };
    let ratio = match t.choice(cx, "ratio", &["token", "sequence"]) {
        Some("token") => RatioLevel::Token,
        Some(_) => RatioLevel::Sequence,
        None => d.ratio,
    };
    let tis_cap = t.float(cx, "tis_cap", 1.0, f64::INFINITY);
    let overlong_buffer = t.count(cx, "overlong_buffer", 1);
    let overlong_penalty = t.float(cx, "overlong_penalty", 0.0, f64::INFINITY);
    if overlong_penalty.is_some() && !t.has("overlong_buffer") {
        t.missing(
            cx,
            "overlong_buffer",
            "the tokens before max_new_tokens over which the overlong penalty grows",
            "4",
        );
    }
    t.finish(cx);
    let loss = PolicyLoss {
        clip_low: clip_low.or(clip).unwrap_or(d.clip_low),
        clip_high: clip_high.or(clip).unwrap_or(d.clip_high),
        kl_coef,
        kl_estimator: kl,
        loss_agg: agg,
        norm_adv_by_std: norm,
        advantage,
        ratio,
        tis_cap,
        overlong: overlong_buffer.map(|buffer| Overlong {
            buffer,
            penalty: overlong_penalty.unwrap_or(1.0),
        }),
    };
    if name == "ppo_clip" {
        Algorithm::PpoClip(loss)
    } else {
        Algorithm::Grpo(loss)
    }
}

fn default_adamw() -> AdamWSpec {
    AdamWSpec {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: 1.0,
        lr_schedule: LrSchedule::Constant,
    }
}

fn adamw(cx: &mut Cx<'_>, c: &CallVal) -> AdamWSpec {
    let mut t = Table::from_call(cx, "train.optimizer", c, &[]);
    t.hints = &[
        ("learning_rate", "lr"),
        ("beta1", "betas"),
        ("beta2", "betas"),
        ("clip_grad", "grad_clip"),
        ("lr_schedule", "schedule"),
    ];
    let d = default_adamw();
    let lr = t.float(cx, "lr", 0.0, 1.0).unwrap_or(d.lr);
    if lr == 0.0 && cx.ok(&["train.optimizer.lr"]) {
        let sp = cx.span("train.optimizer.lr");
        cx.error(Diagnostic::warning(
            "range",
            sp,
            "`lr = 0`: the weights never change",
        ));
    }
    let betas = t
        .typed(cx, "betas", |v, _| {
            let help = Some("e.g. `betas = (0.9, 0.999)`".to_string());
            match &v.value {
                Value::Tuple(xs) if xs.len() == 2 => {
                    let mut b = [0.0; 2];
                    for (i, x) in xs.iter().enumerate() {
                        b[i] = match x.value {
                            Value::Float(f) => f,
                            Value::Int(n) => n as f64,
                            _ => return Err(("expected two numbers".into(), help)),
                        };
                        if !(0.0..1.0).contains(&b[i]) {
                            return Err((
                                format!("each beta must be in [0, 1), got {}", b[i]),
                                None,
                            ));
                        }
                    }
                    Ok((b[0], b[1]))
                }
                _ => Err(("expected a pair `(beta1, beta2)`".into(), help)),
            }
        })
        .unwrap_or((d.beta1, d.beta2));
    let eps = t.float(cx, "eps", f64::MIN_POSITIVE, 1.0).unwrap_or(d.eps);
    let wd = t.float_or(cx, "weight_decay", 0.0, f64::INFINITY, d.weight_decay);
    let gc = t.float_or(cx, "grad_clip", 0.0, f64::INFINITY, d.grad_clip);
    let sched = match t.call(cx, "schedule", &["constant", "warmup", "cosine"]) {
        Some(s) => lr_schedule(cx, &s),
        None => LrSchedule::Constant,
    };
    t.finish(cx);
    AdamWSpec {
        lr,
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay: wd,
        grad_clip: gc,
        lr_schedule: sched,
    }
}

fn lr_schedule(cx: &mut Cx<'_>, c: &CallVal) -> LrSchedule {
    let path = "train.optimizer.schedule";
    match c.name.name.as_str() {
        "warmup" => {
            let mut t = Table::from_call(cx, path, c, &["steps"]);
            let steps = t.req_count(cx, "steps", 0, "10");
            t.finish(cx);
            LrSchedule::LinearWarmup {
                warmup_steps: steps,
            }
        }
        "cosine" => {
            let mut t = Table::from_call(cx, path, c, &["warmup", "total", "min_lr_ratio"]);
            let warmup = t.count_or(cx, "warmup", 0, 0);
            let total = t.req_count(cx, "total", 1, "1000");
            let ratio = t.float_or(cx, "min_lr_ratio", 0.0, 1.0, 0.0);
            if warmup >= total
                && cx.ok(&[
                    "train.optimizer.schedule.warmup",
                    "train.optimizer.schedule.total",
                ])
            {
                let sp = cx.span("train.optimizer.schedule.warmup");
                cx.error(
                    Diagnostic::error("range", sp, format!("cosine warmup ({warmup} steps) is not shorter than its total ({total} steps)"))
                        .with_help("`total` counts every optimizer step, warmup included"),
                );
            }
            t.finish(cx);
            LrSchedule::Cosine {
                warmup_steps: warmup,
                total_steps: total,
                min_lr_ratio: ratio,
            }
        }
        _ => {
            Table::from_call(cx, path, c, &[]).finish(cx);
            LrSchedule::Constant
        }
    }
}

// ---------------------------------------------------------------- schedule

fn default_schedule(cluster: &ClusterSpec) -> ScheduleSpec {
    ScheduleSpec {
        mode: Mode::Overlap,
        prefix_dedup: true,
        decode_window: 64,
        memory_budget: cluster.gpu.hbm_bytes,
        host_memory: 0,
    }
}

fn schedule(
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

/// DSL key paths -> JobSpec field paths, registered in the span map as well.
pub const SPEC_ALIASES: &[(&str, &str)] = &[
    ("gpu", "cluster"),
    ("gpu", "cluster.gpu"),
    ("gpu.name", "cluster.gpu.name"),
    ("gpu.sms", "cluster.gpu.sms"),
    ("gpu.sm_granularity", "cluster.gpu.sm_granularity"),
    ("gpu.hbm", "cluster.gpu.hbm_bytes"),
    ("gpu.bandwidth", "cluster.gpu.hbm_bw"),
    ("gpu.bf16", "cluster.gpu.bf16_flops"),
    ("gpu.host_bandwidth", "cluster.gpu.host_bw"),
    ("gpu.count", "cluster.count"),
    ("gpu.gpus_per_node", "cluster.gpus_per_node"),
    ("gpu.nvlink", "cluster.intra_node_bw"),
    ("gpu.ib", "cluster.inter_node_bw"),
    ("reference", "reference.enabled"),
    ("rollout.prompts", "rollout.prompts_per_iter"),
    ("rollout.group", "rollout.group_size"),
    ("rollout.text_tokens", "rollout.prompt_text_tokens"),
    ("rollout.response_length", "rollout.response_len"),
    ("rollout.sampling.stop", "rollout.sampling.stop_token_ids"),
    ("train.algorithm.kl", "train.algorithm.kl_estimator"),
    ("train.optimizer.betas", "train.optimizer.beta1"),
    ("train.optimizer.betas", "train.optimizer.beta2"),
    ("train.optimizer.schedule", "train.optimizer.lr_schedule"),
    ("train.freeze", "train.freeze_vision"),
    ("train.freeze", "train.freeze_merger"),
    ("schedule.memory", "schedule.memory_budget"),
];
