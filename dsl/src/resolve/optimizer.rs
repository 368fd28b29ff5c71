//! `train { optimizer = adamw(...) }`: AdamW's hyperparameters and its learning-rate
//! schedule, as the [`AdamWSpec`].

use crate::diag::Diagnostic;
use crate::eval::{CallVal, Value};
use crate::table::{Cx, Table};
use rollplex_plan::spec::*;

pub(super) fn default_adamw() -> AdamWSpec {
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

pub(super) fn adamw(cx: &mut Cx<'_>, c: &CallVal) -> AdamWSpec {
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
