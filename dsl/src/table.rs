//! Typed access to the keys of one section or call, with the bookkeeping that makes the
//! checks complete: unknown keys (with "did you mean"), duplicate keys, missing required keys,
//! values of the wrong type or unit, and the span of every value in the [`SpanMap`].
//!
//! A [`Table`] learns its valid keys from the getters called on it; [`Table::finish`] then
//! reports every key nobody asked for. Every getter records the key's path in the span map;
//! a key that is missing or invalid goes into [`Cx::bad`], and cross-field checks skip
//! anything that depends on a bad path (so one mistake is not reported twice).

// `%` instead of `is_multiple_of`: the workspace supports Rust 1.85.
#![allow(clippy::manual_is_multiple_of)]

use crate::ast::{Body, Ident, Item};
use crate::diag::Diagnostic;
use crate::eval::{eval, CallVal, Consts, Val, Value};
use crate::span::{LineIndex, Span, SpanMap};
use crate::suggest;
use crate::units::Dim;
use std::collections::HashSet;

/// Everything the checker accumulates.
pub struct Cx<'a> {
    pub src: &'a str,
    pub consts: Consts,
    pub diags: Vec<Diagnostic>,
    pub spans: SpanMap,
    /// Paths whose value is missing or invalid; the spec holds a stand-in there.
    pub bad: HashSet<String>,
    /// Lines of `src`, for the line numbers in messages.
    pub lines: LineIndex,
}

impl<'a> Cx<'a> {
    pub fn new(src: &'a str) -> Cx<'a> {
        Cx {
            src,
            consts: Consts::default(),
            diags: Vec::new(),
            spans: SpanMap::new(),
            bad: HashSet::new(),
            lines: LineIndex::new(src),
        }
    }

    /// True when none of `paths` (nor a parent of one) is bad.
    pub fn ok(&self, paths: &[&str]) -> bool {
        paths.iter().all(|p| {
            let mut q: &str = p;
            loop {
                if self.bad.contains(q) {
                    return false;
                }
                match q.rfind('.') {
                    Some(i) => q = &q[..i],
                    None => return true,
                }
            }
        })
    }

    pub fn mark_bad(&mut self, path: &str) {
        self.bad.insert(path.to_string());
    }

    /// The span of `path` (or its nearest parent).
    pub fn span(&self, path: &str) -> Span {
        self.spans.get(path).unwrap_or_default()
    }

    pub fn error(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    pub fn eval(&mut self, e: &crate::ast::Expr) -> Val {
        eval(e, &self.consts, &mut self.diags)
    }
}

/// What a key holds.
pub enum Slot<'b> {
    Value(Val),
    Section {
        label: Option<&'b Ident>,
        head: Span,
        body: &'b Body,
    },
}

pub struct Entry<'b> {
    pub key: String,
    pub key_span: Span,
    pub slot: Slot<'b>,
}

/// The keys of one section (`train { ... }`) or one call (`grpo(clip = 0.2)`).
pub struct Table<'b> {
    /// Dotted path of this table ("train", "train.algorithm").
    pub path: String,
    /// How messages name it ("`train`", "`grpo(...)`").
    pub title: String,
    /// Header span: missing keys are reported here.
    pub span: Span,
    /// A syntax error inside: missing keys are not reported.
    pub broken: bool,
    /// Other spellings of keys (Hugging Face names, spec field names) -> the key to write.
    pub hints: &'static [(&'static str, &'static str)],
    entries: Vec<Entry<'b>>,
    asked: Vec<&'static str>,
    /// Call tables: whether the call's arguments are keys given by name only.
    is_call: bool,
}

impl<'b> Table<'b> {
    /// A section's body: evaluates every assignment; reports duplicate keys.
    pub fn from_body(
        cx: &mut Cx<'_>,
        path: &str,
        title: &str,
        span: Span,
        body: &'b Body,
    ) -> Table<'b> {
        let mut entries = Vec::new();
        for item in &body.items {
            let slot = match item {
                Item::Assign { value, .. } => Slot::Value(cx.eval(value)),
                Item::Section {
                    label, head, body, ..
                } => Slot::Section {
                    label: label.as_ref(),
                    head: *head,
                    body,
                },
            };
            let k = item.key();
            entries.push(Entry {
                key: k.name.clone(),
                key_span: k.span,
                slot,
            });
        }
        let mut t = Table {
            path: path.to_string(),
            title: title.to_string(),
            span,
            broken: body.broken,
            hints: &[],
            entries,
            asked: Vec::new(),
            is_call: false,
        };
        t.report_duplicates(cx);
        cx.spans.insert(path, span);
        t
    }

    /// A call's arguments; positional ones take the names in `positional`, in order.
    pub fn from_call(
        cx: &mut Cx<'_>,
        path: &str,
        call: &CallVal,
        positional: &[&'static str],
    ) -> Table<'b> {
        let title = format!("`{}(...)`", call.name.name);
        let mut entries = Vec::new();
        let mut pos = 0;
        let mut seen_named = false;
        for (name, v) in &call.args {
            match name {
                Some(n) => {
                    seen_named = true;
                    entries.push(Entry {
                        key: n.name.clone(),
                        key_span: n.span,
                        slot: Slot::Value(v.clone()),
                    });
                }
                None => {
                    if seen_named {
                        cx.error(
                            Diagnostic::error(
                                "argument",
                                v.span,
                                format!("a positional argument after a named one in {title}"),
                            )
                            .with_help("put positional arguments first, or name this one"),
                        );
                        continue;
                    }
                    match positional.get(pos) {
                        Some(k) => entries.push(Entry {
                            key: k.to_string(),
                            key_span: v.span,
                            slot: Slot::Value(v.clone()),
                        }),
                        None => {
                            let help = if positional.is_empty() {
                                format!("{title} takes only named arguments (`key = value`)")
                            } else {
                                format!(
                                    "{title} takes at most {} positional argument(s): {}",
                                    positional.len(),
                                    positional.join(", ")
                                )
                            };
                            cx.error(
                                Diagnostic::error(
                                    "argument",
                                    v.span,
                                    format!("too many arguments to {title}"),
                                )
                                .with_help(help),
                            );
                        }
                    }
                    pos += 1;
                }
            }
        }
        let span = call.name.span;
        let mut t = Table {
            path: path.to_string(),
            title,
            span,
            broken: call.broken,
            hints: &[],
            entries,
            asked: Vec::new(),
            is_call: true,
        };
        t.report_duplicates(cx);
        t
    }

    /// Reports every key given a second time and keeps the first: linear in the entries
    /// (a hash of first spans, lines from the file's index, one pass to drop the rest).
    fn report_duplicates(&mut self, cx: &mut Cx<'_>) {
        let mut firsts: std::collections::HashMap<&str, Span> = std::collections::HashMap::new();
        let mut keep = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            if let Some(first) = firsts.get(e.key.as_str()) {
                let l = cx.lines.line(first.start);
                cx.error(
                    Diagnostic::error(
                        "duplicate-key",
                        e.key_span,
                        format!("`{}` is given twice in {}", e.key, self.title),
                    )
                    .with_label("second value")
                    .with_help(format!("the first is at line {l}; keep one")),
                );
                keep.push(false);
            } else {
                firsts.insert(e.key.as_str(), e.key_span);
                keep.push(true);
            }
        }
        let mut keep = keep.into_iter();
        self.entries.retain(|_| keep.next().unwrap_or(true));
    }

    fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Whether `key` was written (registers it as valid).
    pub fn has(&mut self, key: &'static str) -> bool {
        self.note(key);
        self.entries.iter().any(|e| e.key == key)
    }

    fn note(&mut self, key: &'static str) {
        if !self.asked.contains(&key) {
            self.asked.push(key);
        }
    }

    fn entry(&mut self, key: &'static str) -> Option<&Entry<'b>> {
        self.note(key);
        self.entries.iter().find(|e| e.key == key)
    }

    /// Reports `key` as missing (unless this table had a syntax error) and marks it bad.
    pub fn missing(&mut self, cx: &mut Cx<'_>, key: &'static str, what: &str, example: &str) {
        let path = self.key_path(key);
        cx.mark_bad(&path);
        if self.broken || self.misspelt(key) {
            return;
        }
        let msg = format!("{} needs `{key}` ({what})", self.title);
        let help = if self.is_call {
            format!("add `{key} = {example}` to the arguments")
        } else {
            format!("add `{key} = {example}`")
        };
        cx.error(
            Diagnostic::error("missing-key", self.span, msg)
                .with_label(format!("`{key}` missing here"))
                .with_help(help),
        );
    }

    /// Whether a written key looks like a misspelling of `key`: then the unknown-key report
    /// (with its "did you mean `key`?") says all there is to say.
    fn misspelt(&self, key: &str) -> bool {
        let known = |k: &str| self.asked.contains(&k) && k != key;
        self.entries
            .iter()
            .any(|e| !known(&e.key) && e.key != key && suggest::closest(&e.key, [key]).is_some())
    }

    /// Reports section `key` as missing (unless this table had a syntax error).
    pub fn missing_section(&mut self, cx: &mut Cx<'_>, key: &'static str, example: &str) {
        let path = self.key_path(key);
        cx.mark_bad(&path);
        if self.broken {
            return;
        }
        cx.error(
            Diagnostic::error(
                "missing-key",
                self.span,
                format!("{} needs a `{key}` section", self.title),
            )
            .with_label(format!("`{key} {{ ... }}` missing here"))
            .with_help(format!("add `{example}`")),
        );
    }

    /// The raw value of `key`; a section there is an error.
    pub fn value(&mut self, cx: &mut Cx<'_>, key: &'static str) -> Option<Val> {
        let path = self.key_path(key);
        let title = self.title.clone();
        let e = self.entry(key)?;
        match &e.slot {
            Slot::Value(v) => {
                cx.spans.insert(&path, v.span);
                if matches!(v.value, Value::Error) {
                    cx.mark_bad(&path);
                    return None;
                }
                Some(v.clone())
            }
            Slot::Section { head, .. } => {
                let head = *head;
                cx.mark_bad(&path);
                cx.error(
                    Diagnostic::error(
                        "type",
                        head,
                        format!("`{key}` in {title} is a value, not a section"),
                    )
                    .with_help(format!("write `{key} = ...`")),
                );
                None
            }
        }
    }

    /// The body of section `key`; a value there is an error. Returns (label, head, body).
    #[allow(clippy::type_complexity)]
    pub fn section(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
    ) -> Option<(Option<&'b Ident>, Span, &'b Body)> {
        let path = self.key_path(key);
        let title = self.title.clone();
        let e = self.entry(key)?;
        match &e.slot {
            Slot::Section { label, head, body } => {
                let r = (*label, *head, *body);
                cx.spans.insert(&path, *head);
                Some(r)
            }
            Slot::Value(v) => {
                let sp = e.key_span.to(v.span);
                cx.mark_bad(&path);
                cx.error(
                    Diagnostic::error(
                        "type",
                        sp,
                        format!("`{key}` in {title} is a section, not a value"),
                    )
                    .with_help(format!("write `{key} {{ ... }}`")),
                );
                None
            }
        }
    }

    /// Applies `conv` to the value of `key`; a conversion error is reported at the value.
    pub fn typed<T>(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        conv: impl FnOnce(&Val, &str) -> Result<T, (String, Option<String>)>,
    ) -> Option<T> {
        let v = self.value(cx, key)?;
        match conv(&v, cx.src) {
            Ok(t) => Some(t),
            Err((msg, help)) => {
                let path = self.key_path(key);
                cx.mark_bad(&path);
                cx.error(
                    Diagnostic::error("type", v.span, format!("`{key}` in {}: {msg}", self.title))
                        .with_label(format!("found {}", v.noun(cx.src)))
                        .with_help_opt(help),
                );
                None
            }
        }
    }

    /// A whole number >= `min` (and < 2^32), and at most its limit if it has one
    /// ([`crate::limits`]): above it, an error at the value naming the limit.
    pub fn count(&mut self, cx: &mut Cx<'_>, key: &'static str, min: u32) -> Option<u32> {
        let n = self.typed(cx, key, |v, _| as_count(v, key, min))?;
        let path = self.key_path(key);
        match crate::limits::max_of(&path) {
            Some(max) if n > max => {
                let span = cx.span(&path);
                cx.mark_bad(&path);
                cx.error(
                    Diagnostic::error(
                        "limit",
                        span,
                        format!("`{key}` in {} is {n}, above the limit of {max}", self.title),
                    )
                    .with_help(crate::limits::HELP),
                );
                None
            }
            _ => Some(n),
        }
    }

    pub fn count_or(&mut self, cx: &mut Cx<'_>, key: &'static str, min: u32, default: u32) -> u32 {
        self.count(cx, key, min).unwrap_or(default)
    }

    /// A required whole number; `1` stands in when missing or invalid (and the path is bad).
    pub fn req_count(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        min: u32,
        example: &str,
    ) -> u32 {
        if !self.has(key) {
            self.missing(cx, key, "a whole number", example);
            return min.max(1);
        }
        self.count(cx, key, min).unwrap_or(min.max(1))
    }

    /// A 64-bit whole number >= 0 (seeds).
    pub fn u64(&mut self, cx: &mut Cx<'_>, key: &'static str) -> Option<u64> {
        self.typed(cx, key, |v, _| match v.value {
            Value::Int(i) if i >= 0 => Ok(i as u64),
            Value::Int(_) => Err(("expected a whole number >= 0".into(), None)),
            _ => Err(("expected a whole number".into(), unit_help(v))),
        })
    }

    /// A number (integer or float) in `[lo, hi]`.
    pub fn float(&mut self, cx: &mut Cx<'_>, key: &'static str, lo: f64, hi: f64) -> Option<f64> {
        self.typed(cx, key, |v, _| {
            let x = match v.value {
                Value::Int(i) => i as f64,
                Value::Float(f) => f,
                _ => return Err(("expected a number".into(), unit_help(v))),
            };
            in_range(x, lo, hi)
        })
    }

    pub fn float_or(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        lo: f64,
        hi: f64,
        default: f64,
    ) -> f64 {
        self.float(cx, key, lo, hi).unwrap_or(default)
    }

    pub fn req_float(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        lo: f64,
        hi: f64,
        example: &str,
    ) -> f64 {
        if !self.has(key) {
            self.missing(cx, key, "a number", example);
            return lo.max(0.0);
        }
        self.float(cx, key, lo, hi).unwrap_or(lo.max(0.0))
    }

    /// A quantity of dimension `dim` (> 0 unless `allow_zero`), in base units.
    pub fn qty(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        dim: Dim,
        allow_zero: bool,
    ) -> Option<f64> {
        self.typed(cx, key, |v, _| match v.value {
            Value::Qty(x, d) if d == dim => {
                if x < 0.0 || (x == 0.0 && !allow_zero) {
                    Err((
                        format!(
                            "expected {} {} 0",
                            dim.noun(),
                            if allow_zero { ">=" } else { ">" }
                        ),
                        None,
                    ))
                } else {
                    Ok(x)
                }
            }
            Value::Qty(_, _) => Err((
                format!("expected {}", dim.noun()),
                Some(format!("e.g. `{key} = {}`", dim.example())),
            )),
            Value::Int(_) | Value::Float(_) => Err((
                format!("expected {}, which needs a unit", dim.noun()),
                Some(format!("e.g. `{key} = {}`", dim.example())),
            )),
            _ => Err((
                format!("expected {}", dim.noun()),
                Some(format!("e.g. `{key} = {}`", dim.example())),
            )),
        })
    }

    pub fn bool(&mut self, cx: &mut Cx<'_>, key: &'static str) -> Option<bool> {
        self.typed(cx, key, |v, _| match v.value {
            Value::Bool(b) => Ok(b),
            Value::Int(0) => Ok(false),
            Value::Int(1) => Ok(true),
            _ => Err((
                "expected on/off".into(),
                Some(format!("write `{key} = on` or `{key} = off`")),
            )),
        })
    }

    pub fn string(&mut self, cx: &mut Cx<'_>, key: &'static str) -> Option<String> {
        self.typed(cx, key, |v, _| match &v.value {
            Value::Str(s) => Ok(s.clone()),
            _ => Err((
                "expected a string".into(),
                Some(format!("quote it: `{key} = \"...\"`")),
            )),
        })
    }

    /// One of `choices`, written as a bare name (a string is accepted too).
    pub fn choice(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        choices: &[&'static str],
    ) -> Option<&'static str> {
        self.typed(cx, key, |v, _| as_choice(v, choices))
    }

    /// A call value, or a bare name (a call with no arguments).
    pub fn call(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        forms: &[&'static str],
    ) -> Option<CallVal> {
        self.typed(cx, key, |v, _| as_call(v, forms))
    }

    /// Reports every key that no getter asked for.
    pub fn finish(self, cx: &mut Cx<'_>) {
        for e in &self.entries {
            if self.asked.contains(&e.key.as_str()) {
                continue;
            }
            let path = self.key_path(&e.key);
            let hint = self
                .hints
                .iter()
                .find(|(other, _)| *other == e.key)
                .map(|(_, k)| *k);
            let help = match hint.or_else(|| suggest::closest(&e.key, self.asked.iter().copied())) {
                Some(c) if hint.is_some() && c.contains(' ') => {
                    format!("`{}` goes in `{c}`", e.key)
                }
                Some(c) if hint.is_some() => format!("`{}` is written `{c}` here", e.key),
                Some(c) => format!("did you mean `{c}`?"),
                None => {
                    let mut keys = self.asked.clone();
                    keys.sort();
                    format!("{} takes: {}", self.title, keys.join(", "))
                }
            };
            let (what, label) = match e.slot {
                Slot::Section { .. } => ("section", format!("not a section of {}", self.title)),
                Slot::Value(_) => ("key", format!("not a key of {}", self.title)),
            };
            let span = match e.slot {
                Slot::Section { head, .. } => head,
                Slot::Value(_) => e.key_span,
            };
            cx.mark_bad(&path);
            cx.error(
                Diagnostic::error(
                    "unknown-key",
                    span,
                    format!("unknown {what} `{}` in {}", e.key, self.title),
                )
                .with_label(label)
                .with_help(help),
            );
        }
    }
}

fn in_range(x: f64, lo: f64, hi: f64) -> Result<f64, (String, Option<String>)> {
    if x < lo || x > hi || x.is_nan() {
        let r = match (lo.is_finite(), hi.is_finite()) {
            (true, true) => format!("between {lo} and {hi}"),
            (true, false) => format!(">= {lo}"),
            (false, true) => format!("<= {hi}"),
            (false, false) => "a finite number".into(),
        };
        Err((format!("must be {r}, is {x}"), None))
    } else {
        Ok(x)
    }
}

/// Help for a value that has a unit where a plain number goes.
fn unit_help(v: &Val) -> Option<String> {
    match v.value {
        Value::Qty(_, d) => Some(format!(
            "{} was given; this key takes a plain number without a unit",
            d.noun()
        )),
        _ => None,
    }
}

pub fn as_count(v: &Val, key: &str, min: u32) -> Result<u32, (String, Option<String>)> {
    match v.value {
        Value::Int(i) if i >= min as i64 && i <= u32::MAX as i64 => Ok(i as u32),
        Value::Int(i) if i < min as i64 => Err((format!("must be at least {min}, is {i}"), None)),
        Value::Int(_) => Err(("is too large (at most 4294967295)".into(), None)),
        Value::Float(f) => Err((
            "expected a whole number".into(),
            Some(if f.fract() == 0.0 && (0.0..4294967296.0).contains(&f) {
                format!("write `{key} = {}`", f as u64)
            } else {
                format!("`{key}` counts things; use a whole number")
            }),
        )),
        Value::Qty(_, d) => Err((
            "expected a whole number".into(),
            Some(format!(
                "{} was given; `{key}` is a count without a unit",
                d.noun()
            )),
        )),
        _ => Err(("expected a whole number".into(), None)),
    }
}

pub fn as_choice(
    v: &Val,
    choices: &[&'static str],
) -> Result<&'static str, (String, Option<String>)> {
    let word = match &v.value {
        Value::Sym(s) | Value::Str(s) => s.as_str(),
        Value::Bool(true) => "on",
        Value::Bool(false) => "off",
        _ => return Err((format!("expected one of: {}", choices.join(", ")), None)),
    };
    match choices.iter().find(|c| **c == word) {
        Some(c) => Ok(c),
        None => Err((
            format!("`{word}` is not one of: {}", choices.join(", ")),
            Some(suggest::help_for(word, choices)),
        )),
    }
}

pub fn as_call(v: &Val, forms: &[&'static str]) -> Result<CallVal, (String, Option<String>)> {
    let call = match &v.value {
        Value::Call(c) => (**c).clone(),
        Value::Sym(s) => CallVal {
            name: Ident {
                name: s.clone(),
                span: v.span,
            },
            args: Vec::new(),
            broken: false,
        },
        _ => return Err((format!("expected one of: {}", forms_list(forms)), None)),
    };
    if forms.contains(&call.name.name.as_str()) {
        Ok(call)
    } else {
        Err((
            format!("`{}` is not one of: {}", call.name.name, forms_list(forms)),
            Some(suggest::help_for(&call.name.name, forms)),
        ))
    }
}

fn forms_list(forms: &[&str]) -> String {
    forms.join(", ")
}
