//! The `rollout { ... }` block: prompts and groups, media, response lengths, the
//! `sampling { ... }` section and the dataset, as the [`RolloutSpec`], and its stand-in when the
//! block is missing.

use super::{count_list, no_label};
use crate::diag::Diagnostic;
use crate::eval::{CallVal, Value};
use crate::span::Span;
use crate::table::{Cx, Table};
use rollplex_plan::spec::*;

pub(super) fn rollout(cx: &mut Cx<'_>, head: Span, body: &crate::ast::Body) -> RolloutSpec {
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

pub(super) fn stand_in_rollout() -> RolloutSpec {
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
