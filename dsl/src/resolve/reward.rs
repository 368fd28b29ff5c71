//! `reward = ...`: a `builtin(...)` or `command(...)` reward, or a weighted `sum(...)` of them,
//! as the [`RewardSpec`].

use crate::diag::Diagnostic;
use crate::eval::{CallVal, Val, Value};
use crate::table::{as_call, as_choice, Cx, Table};
use crate::units::Dim;
use rollplex_plan::spec::*;

/// `reward = builtin(...) | command(...) | sum(...)`.
pub(super) fn reward(cx: &mut Cx<'_>, c: &CallVal) -> RewardSpec {
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
