//! Values: constants resolved, arithmetic done, call blocks turned into named arguments.
//!
//! A bare name is a constant when one of that name is defined (earlier in the file), else a
//! symbol (`overlap`, `k3`, `H200`). Arithmetic: `+ - * /` on numbers; a quantity times or
//! divided by a number; quantities of one kind added, subtracted, or divided (giving a plain
//! number). Integer arithmetic stays integral while exact (`64 / 8` is 8, `7 / 2` is 3.5).
//!
//! Invariant: an expression that fails evaluates to [`Value::Error`] after exactly one
//! diagnostic; an `Error` operand yields `Error` silently, so one mistake is reported once.

use crate::ast::{Arg, BinOp, Body, Expr, ExprKind, Ident, Item};
use crate::diag::Diagnostic;
use crate::span::Span;
use crate::units::{self, Dim};
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    /// In base units (bytes, bytes/s, FLOP/s, seconds).
    Qty(f64, Dim),
    /// Width x height.
    Dims(u64, u64),
    Str(String),
    Bool(bool),
    Sym(String),
    List(Vec<Val>),
    Tuple(Vec<Val>),
    Call(Box<CallVal>),
    Error,
}

/// A value and the span of the expression it came from (the use site, for a constant).
#[derive(Clone, Debug, PartialEq)]
pub struct Val {
    pub value: Value,
    pub span: Span,
}

/// `name(args)` or `name { key = value ... }` (whose items become named arguments).
#[derive(Clone, Debug, PartialEq)]
pub struct CallVal {
    pub name: Ident,
    pub args: Vec<(Option<Ident>, Val)>,
    /// The block form had a syntax error: missing arguments are not reported.
    pub broken: bool,
}

impl Val {
    /// How the value reads in a message: "a whole number (`3`)", "a size (`80GiB`)".
    pub fn noun(&self, src: &str) -> String {
        let text = src.get(self.span.start..self.span.end).unwrap_or("");
        let text: String = text.chars().take(40).collect();
        let kind = match &self.value {
            Value::Int(_) => "a whole number",
            Value::Float(_) => "a number",
            Value::Qty(_, d) => d.noun(),
            Value::Dims(..) => "a `WIDTHxHEIGHT` size",
            Value::Str(_) => "a string",
            Value::Bool(_) => "on/off",
            Value::Sym(_) => "the name",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Call(_) => "the call",
            Value::Error => "an invalid value",
        };
        if text.is_empty() || text.contains('\n') {
            kind.to_string()
        } else {
            format!("{kind} `{text}`")
        }
    }
}

/// The constants of a file, in definition order.
#[derive(Clone, Debug, Default)]
pub struct Consts {
    map: HashMap<String, (Val, Span)>,
}

impl Consts {
    pub fn get(&self, name: &str) -> Option<&Val> {
        self.map.get(name).map(|(v, _)| v)
    }

    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.map.keys().map(String::as_str).collect();
        v.sort();
        v
    }

    /// Defines a constant; a second definition of a name is an error.
    pub fn define(
        &mut self,
        name: &Ident,
        value: Val,
        diags: &mut Vec<Diagnostic>,
        lines: &crate::span::LineIndex,
    ) {
        if let Some((_, first)) = self.map.get(&name.name) {
            let l = lines.line(first.start);
            diags.push(
                Diagnostic::error(
                    "duplicate-const",
                    name.span,
                    format!("constant `{}` is defined twice", name.name),
                )
                .with_label("second definition")
                .with_help(format!(
                    "the first definition is at line {l}; rename one of them"
                )),
            );
            return;
        }
        self.map.insert(name.name.clone(), (value, name.span));
    }
}

/// Evaluates an expression.
pub fn eval(e: &Expr, consts: &Consts, diags: &mut Vec<Diagnostic>) -> Val {
    let span = e.span;
    let value = match &e.kind {
        ExprKind::Int(i) => Value::Int(*i),
        ExprKind::Float(f) => Value::Float(*f),
        ExprKind::Quantity(x, d) => Value::Qty(*x, *d),
        ExprKind::Dims(w, h) => Value::Dims(*w, *h),
        ExprKind::Str(s) => Value::Str(s.clone()),
        ExprKind::Bool(b) => Value::Bool(*b),
        ExprKind::Name(n) => match consts.get(n) {
            Some(v) => v.value.clone(),
            None => Value::Sym(n.clone()),
        },
        ExprKind::List(items) => {
            Value::List(items.iter().map(|x| eval(x, consts, diags)).collect())
        }
        ExprKind::Tuple(items) => {
            Value::Tuple(items.iter().map(|x| eval(x, consts, diags)).collect())
        }
        ExprKind::Call { name, args, body } => Value::Call(Box::new(eval_call(
            name,
            args,
            body.as_ref(),
            consts,
            diags,
        ))),
        ExprKind::Neg(inner) => {
            let v = eval(inner, consts, diags);
            match v.value {
                Value::Int(i) => match i.checked_neg() {
                    Some(n) => Value::Int(n),
                    None => arith_error(diags, span, "the number is too large".into()),
                },
                Value::Float(f) => Value::Float(-f),
                Value::Qty(x, d) => Value::Qty(-x, d),
                Value::Error => Value::Error,
                _ => {
                    let what = describe_operand(&v, consts);
                    arith_error(diags, span, format!("cannot negate {what}"))
                }
            }
        }
        ExprKind::Binary(op, l, r) => {
            let a = eval(l, consts, diags);
            let b = eval(r, consts, diags);
            binary(*op, &a, &b, span, consts, diags)
        }
        ExprKind::Error => Value::Error,
    };
    Val { value, span }
}

fn eval_call(
    name: &Ident,
    args: &[Arg],
    body: Option<&Body>,
    consts: &Consts,
    diags: &mut Vec<Diagnostic>,
) -> CallVal {
    let mut out = Vec::new();
    for a in args {
        out.push((a.name.clone(), eval(&a.value, consts, diags)));
    }
    let mut broken = false;
    if let Some(b) = body {
        broken = b.broken;
        for item in &b.items {
            match item {
                Item::Assign { key, value } => {
                    out.push((Some(key.clone()), eval(value, consts, diags)))
                }
                Item::Section {
                    name: sec, head, ..
                } => {
                    diags.push(
                        Diagnostic::error(
                            "syntax",
                            *head,
                            format!("a section `{}` inside `{} {{ }}`", sec.name, name.name),
                        )
                        .with_help(format!(
                            "inside a call block write `key = value`, e.g. `{} = ...`",
                            sec.name
                        )),
                    );
                    broken = true;
                }
            }
        }
    }
    CallVal {
        name: name.clone(),
        args: out,
        broken,
    }
}

fn arith_error(diags: &mut Vec<Diagnostic>, span: Span, msg: String) -> Value {
    diags.push(Diagnostic::error("arithmetic", span, msg));
    Value::Error
}

fn describe_operand(v: &Val, consts: &Consts) -> String {
    match &v.value {
        Value::Int(_) | Value::Float(_) => "a number".into(),
        Value::Qty(_, d) => d.noun().into(),
        Value::Dims(..) => "a `WIDTHxHEIGHT` size".into(),
        Value::Str(_) => "a string".into(),
        Value::Bool(_) => "on/off".into(),
        Value::Sym(s) => {
            let hint = crate::suggest::closest(s, consts.names());
            match hint {
                Some(c) => format!("`{s}` (not a constant; did you mean `{c}`?)"),
                None => format!("`{s}` (not a defined constant)"),
            }
        }
        Value::List(_) => "a list".into(),
        Value::Tuple(_) => "a tuple".into(),
        Value::Call(c) => format!("`{}(...)`", c.name.name),
        Value::Error => "an invalid value".into(),
    }
}

fn binary(
    op: BinOp,
    a: &Val,
    b: &Val,
    span: Span,
    consts: &Consts,
    diags: &mut Vec<Diagnostic>,
) -> Value {
    use Value::*;
    if matches!(a.value, Error) || matches!(b.value, Error) {
        return Error;
    }
    let num = |v: &Value| match v {
        Int(i) => Some(*i as f64),
        Float(f) => Some(*f),
        _ => None,
    };
    let fin = |x: f64, diags: &mut Vec<Diagnostic>| {
        if x.is_finite() {
            Float(x)
        } else {
            arith_error(diags, span, "the result is not a finite number".into())
        }
    };
    match (&a.value, &b.value) {
        (Int(x), Int(y)) => {
            let r = match op {
                BinOp::Add => x.checked_add(*y),
                BinOp::Sub => x.checked_sub(*y),
                BinOp::Mul => x.checked_mul(*y),
                BinOp::Div => {
                    if *y == 0 {
                        return arith_error(diags, b.span, "division by zero".into());
                    }
                    if x % y != 0 {
                        return fin(*x as f64 / *y as f64, diags);
                    }
                    x.checked_div(*y)
                }
            };
            match r {
                Some(v) => Int(v),
                None => arith_error(diags, span, "the result is too large".into()),
            }
        }
        (x, y) if num(x).is_some() && num(y).is_some() => {
            let (x, y) = (num(x).unwrap_or(0.0), num(y).unwrap_or(0.0));
            if op == BinOp::Div && y == 0.0 {
                return arith_error(diags, b.span, "division by zero".into());
            }
            fin(apply(op, x, y), diags)
        }
        (Qty(x, d), y) if num(y).is_some() && matches!(op, BinOp::Mul | BinOp::Div) => {
            let y = num(y).unwrap_or(0.0);
            if op == BinOp::Div && y == 0.0 {
                return arith_error(diags, b.span, "division by zero".into());
            }
            qty(apply(op, *x, y), *d, span, diags)
        }
        (x, Qty(y, d)) if num(x).is_some() && op == BinOp::Mul => {
            qty(num(x).unwrap_or(0.0) * y, *d, span, diags)
        }
        (Qty(x, d1), Qty(y, d2)) if d1 == d2 => match op {
            BinOp::Add | BinOp::Sub => qty(apply(op, *x, *y), *d1, span, diags),
            BinOp::Div if *y == 0.0 => arith_error(diags, b.span, "division by zero".into()),
            BinOp::Div => fin(x / y, diags),
            BinOp::Mul => arith_error(
                diags,
                span,
                format!("cannot multiply {} by {}", d1.noun(), d2.noun()),
            ),
        },
        _ => {
            let verb = match op {
                BinOp::Add => "add",
                BinOp::Sub => "subtract",
                BinOp::Mul => "multiply",
                BinOp::Div => "divide",
            };
            let (l, r) = (describe_operand(a, consts), describe_operand(b, consts));
            let msg = match op {
                BinOp::Add => format!("cannot {verb} {l} and {r}"),
                BinOp::Sub => format!("cannot {verb} {r} from {l}"),
                BinOp::Mul | BinOp::Div => format!("cannot {verb} {l} by {r}"),
            };
            let is_call = |v: &Val| matches!(v.value, Call(_));
            let help = if is_call(a) || is_call(b) {
                "a call is not a number; to weigh rewards, give each a weight inside `sum`: `reward = sum(builtin(\"math\", weight = 0.9), builtin(\"format\", weight = 0.1))`"
            } else {
                "arithmetic works on numbers, on a quantity times or divided by a number, and on quantities of the same kind"
            };
            let d = Diagnostic::error("arithmetic", span, msg).with_help(help);
            diags.push(d);
            Error
        }
    }
}

fn apply(op: BinOp, x: f64, y: f64) -> f64 {
    match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div => x / y,
    }
}

fn qty(x: f64, d: Dim, span: Span, diags: &mut Vec<Diagnostic>) -> Value {
    if x.is_finite() {
        Value::Qty(x, d)
    } else {
        arith_error(
            diags,
            span,
            format!("the result is not a finite {}", &d.noun()[2..]),
        )
    }
}

/// A quantity in readable units (for messages about values).
pub fn show_qty(x: f64, d: Dim) -> String {
    units::show(x, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parser::parse;

    fn eval_const(src: &str) -> (Value, Vec<Diagnostic>) {
        let (file, mut diags) = parse(src);
        let mut consts = Consts::default();
        let mut last = Value::Error;
        let lines = crate::span::LineIndex::new(src);
        for c in &file.consts {
            let v = eval(&c.value, &consts, &mut diags);
            last = v.value.clone();
            consts.define(&c.name, v, &mut diags, &lines);
        }
        (last, diags)
    }

    #[test]
    fn arithmetic_on_constants() {
        assert_eq!(
            eval_const("const G = 8\nconst P = 4 * G + 2").0,
            Value::Int(34)
        );
        assert_eq!(eval_const("const A = 7 / 2").0, Value::Float(3.5));
        assert_eq!(eval_const("const A = 64 / 8").0, Value::Int(8));
        assert_eq!(eval_const("const A = -(2 - 5)").0, Value::Int(3));
        assert_eq!(
            eval_const("const A = 2 * 40GiB").0,
            Value::Qty(80.0 * 1073741824.0, Dim::Bytes)
        );
        assert_eq!(
            eval_const("const A = 80GiB / 2").0,
            Value::Qty(40.0 * 1073741824.0, Dim::Bytes)
        );
        assert_eq!(
            eval_const("const A = 1GiB + 1024MiB").0,
            Value::Qty(2.0 * 1073741824.0, Dim::Bytes)
        );
        assert_eq!(eval_const("const A = 4GiB / 2GiB").0, Value::Float(2.0));
        assert_eq!(eval_const("const A = 1e-6 * 2").0, Value::Float(2e-6));
    }

    #[test]
    fn arithmetic_errors_are_reported_once() {
        let (v, d) = eval_const("const A = 1GiB * 1GiB");
        assert_eq!(v, Value::Error);
        assert_eq!(d.len(), 1);
        assert!(
            d[0].message.contains("cannot multiply a size by a size"),
            "{}",
            d[0].message
        );
        let (_, d) = eval_const("const A = 1 / 0");
        assert_eq!(d[0].message, "division by zero");
        let (_, d) = eval_const("const G = 8\nconst A = Gx * 2 + 1");
        assert_eq!(d.len(), 1);
        assert!(
            d[0].message.contains("did you mean `G`"),
            "{}",
            d[0].message
        );
        let (_, d) = eval_const("const A = 9223372036854775807 + 1");
        assert!(d[0].message.contains("too large"));
        let (_, d) = eval_const("const A = 1\nconst A = 2");
        assert_eq!(d[0].code, "duplicate-const");
    }
}
