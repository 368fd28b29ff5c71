//! The `train { ... }` block: batches, epochs, groups, frozen parts, recompute, where the
//! optimizer state lives, and the `algorithm = ...` loss presets, as the [`TrainSpec`], and its
//! stand-in when the block is missing. The optimizer call is read in [`super::optimizer`].

use super::optimizer::{adamw, default_adamw};
use crate::diag::Diagnostic;
use crate::eval::{CallVal, Val, Value};
use crate::span::Span;
use crate::table::{as_choice, Cx, Table};
use rollplex_plan::spec::*;

pub(super) fn train(
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
    let prompt_forward = match t.choice(cx, "prompt_forward", &["auto", "recompute"]) {
        Some("recompute") => PromptForwardPass::Recompute,
        _ => PromptForwardPass::Auto,
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
        prompt_forward,
    }
}

pub(super) fn stand_in_train(samples: u32) -> TrainSpec {
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
        prompt_forward: PromptForwardPass::Auto,
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
