//! AST -> [`JobSpec`]: every section read through a [`Table`] (so unknown, duplicate, missing
//! and mistyped keys are all reported), defaults filled in, presets expanded.
//!
//! Defaults (documented in docs/language.md, and only here in code) are the values a key
//! takes when it is not written. A value that is missing or invalid leaves a stand-in in the
//! spec and its path in [`Cx::bad`]; the spec is only handed out when there was no error.
//!
//! This module reads the pipeline itself (its `seed`, `reference` and the checks across
//! sections) and holds the helpers the sections share; each section is read in its own
//! submodule: `gpu`, `rollout` (with `sampling`, media and the dataset), `reward`, `train`
//! (with the algorithm presets), `optimizer` (`train { optimizer = ... }`) and `schedule`. The
//! `model` sections are read in [`crate::model`].

// `%` instead of `is_multiple_of`: the workspace supports Rust 1.85.
#![allow(clippy::manual_is_multiple_of)]

mod gpu;
mod optimizer;
mod reward;
mod rollout;
mod schedule;
mod train;

use crate::ast::{File, Ident, Pipeline};
use crate::diag::Diagnostic;
use crate::eval::{Val, Value};
use crate::model;
use crate::span::Span;
use crate::table::{Cx, Table};
use crate::Env;
use rollplex_plan::spec::*;

use gpu::{gpu, stand_in_cluster};
use reward::reward;
use rollout::{rollout, stand_in_rollout};
use schedule::{default_schedule, schedule};
use train::{stand_in_train, train};

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
