//! Text -> [`ast::File`], reporting every syntax error of the file.
//!
//! The pest grammar (`rpx.pest`) parses one statement at a time; this driver walks the
//! statement structure — top level, `{ ... }` bodies, block calls — itself:
//!
//! 1. A statement's extent is found first ([`Driver::statement_end`]): it ends at a newline or
//!    `,` outside brackets, or before the `}` closing the enclosing block. A `(` or `[` left open
//!    at the end of a line ends the statement too when the next line plainly starts a new one
//!    (`key = ...`, `name {`, `}`), so an unclosed call costs one statement, not the file.
//! 2. pest parses exactly that extent (`SOI ~ ... ~ EOI`), so an error is reported where the
//!    statement goes wrong ("expected `,` or `)`, found the end of the line").
//! 3. After an error the driver resumes at the statement's end: one mistake, one diagnostic,
//!    and the rest of the file is still parsed and checked.
//!
//! Invariant: never panics, on any input. Recursion follows brace nesting (bounded by
//! [`MAX_DEPTH`]) and expression nesting (bounded before pest is asked).

mod head;

use head::Head;

use crate::ast::*;
use crate::diag::Diagnostic;
use crate::span::Span;
use crate::suggest;
use crate::units;
use pest::iterators::Pair;
use pest::Parser;
use pest_derive::Parser;

#[derive(Parser)]
#[grammar = "rpx.pest"]
struct RpxParser;

/// Deepest `{ }` nesting accepted (the language needs 4).
const MAX_DEPTH: usize = 32;
/// Deepest bracket nesting inside one statement accepted before pest is asked.
const MAX_EXPR_NESTING: usize = 64;
/// The items of a pipeline body (used only to notice a forgotten `}` of a section).
const PIPELINE_ITEMS: &[&str] = &[
    "gpu",
    "model",
    "rollout",
    "reward",
    "reference",
    "train",
    "schedule",
    "seed",
];
/// Most operators (`+ - * /`, also counting those in comments) in one statement.
const MAX_OPERATORS: usize = 4096;

/// Parses a whole file. The diagnostics are syntax errors (and literal errors: unknown
/// units, bad escapes); the tree holds every statement that did parse.
pub fn parse(src: &str) -> (File, Vec<Diagnostic>) {
    pest::set_error_detail(true);
    let mut p = Driver {
        src,
        lines: crate::span::LineIndex::new(src),
        diags: Vec::new(),
        base: 0,
    };
    let file = p.file();
    (file, p.diags)
}

struct Driver<'s> {
    src: &'s str,
    /// Lines of `src`, for the line numbers in messages.
    lines: crate::span::LineIndex,
    diags: Vec<Diagnostic>,
    /// Offset of the slice the current pest pairs were parsed from.
    base: usize,
}

/// How plainly a line starts a new statement (see [`Driver::starts_statement`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    No,
    Weak,
    Strong,
}

/// One statement's parse failure: where, and what was expected there.
struct Failure {
    pos: usize,
    expected: Vec<String>,
    /// Nothing of the statement parsed: the failure is at its first token.
    at_start: bool,
}

impl<'s> Driver<'s> {
    fn file(&mut self) -> File {
        let mut file = File::default();
        let mut p = 0;
        loop {
            p = self.skip_trivia(p);
            if p >= self.src.len() {
                break;
            }
            let end = self.statement_end(p);
            let f1 = match self.try_rule(Rule::const_def, p, end) {
                Ok(pair) => {
                    let span = Span::new(p, end);
                    let mut it = pair.into_inner();
                    let _kw = it.next();
                    let name = self.ident(it.next());
                    let value = self.expr_opt(it.next(), span);
                    file.consts.push(ConstDef { name, value, span });
                    p = end;
                    continue;
                }
                Err(f) => f,
            };
            let window = self.head_window(p, &[Head::Ident, Head::Ident, Head::Open]);
            let f2 = match self.try_rule(Rule::pipeline_head, p, window) {
                Ok(pair) => {
                    let head = self.span(&pair);
                    let mut it = pair.into_inner();
                    let _kw = it.next();
                    let name = self.ident(it.next());
                    let open = Span::new(head.end - 1, head.end);
                    let (body, after) = self.body(head.end, open, "pipeline", 1);
                    if let Some(first) = &file.pipeline {
                        let l = self.lines.line(first.name.span.start);
                        self.diags.push(
                            Diagnostic::error(
                                "duplicate-pipeline",
                                head,
                                format!("a second pipeline `{}`", name.name),
                            )
                            .with_label("only one pipeline per file")
                            .with_help(format!(
                                "pipeline `{}` is defined at line {l}; put each job in its own file",
                                first.name.name
                            )),
                        );
                    } else {
                        file.pipeline = Some(Pipeline { name, body });
                    }
                    p = after;
                    continue;
                }
                Err(f) => f,
            };
            file.broken = true;
            let f = furthest(f1, f2);
            let word = self.word_at(p);
            if f.at_start && word != "const" && word != "pipeline" {
                let found = self.found(p);
                self.diags.push(
                    Diagnostic::error(
                        "syntax",
                        self.token_span(p),
                        format!("expected `const` or `pipeline`, found {found}"),
                    )
                    .with_label("not allowed at the top of a file")
                    .with_help(
                        "a file holds constants (`const G = 8`) and one `pipeline NAME { ... }`; \
                         settings go inside the pipeline",
                    ),
                );
            } else {
                self.report(&f, "", p);
            }
            p = self.resume(p, end);
        }
        file
    }

    /// Parses items from `p` up to and including the closing `}`; returns the body and the
    /// position after the `}`.
    fn body(&mut self, mut p: usize, open: Span, what: &str, depth: usize) -> (Body, usize) {
        let mut body = Body::default();
        if depth > MAX_DEPTH {
            self.diags.push(
                Diagnostic::error(
                    "syntax",
                    open,
                    format!("blocks nested more than {MAX_DEPTH} deep"),
                )
                .with_help("the language needs at most 4 levels"),
            );
            body.broken = true;
            return (body, self.src.len());
        }
        loop {
            p = self.skip_trivia(p);
            if p >= self.src.len() {
                let l = self.lines.line(open.start);
                self.diags.push(
                    Diagnostic::error(
                        "syntax",
                        open,
                        format!("this `{{` of `{what}` is never closed"),
                    )
                    .with_label("opened here")
                    .with_help(format!("add a `}}` to close the block opened at line {l}")),
                );
                body.broken = true;
                return (body, p);
            }
            let c = self.src.as_bytes()[p];
            if c == b'}' {
                return (body, p + 1);
            }
            if depth > 1 && self.dedented_pipeline_item(p, open.start) {
                // `gpu { preset = H200` followed by `model actor { ... }` at the indentation
                // of `gpu`: the `}` was forgotten. Close here so the rest parses in place.
                let l = self.lines.line(open.start);
                self.diags.push(
                    Diagnostic::error(
                        "syntax",
                        open,
                        format!("this `{{` of `{what}` is never closed"),
                    )
                    .with_label("opened here")
                    .with_help(format!("add a `}}` to close the block opened at line {l}")),
                );
                body.broken = true;
                return (body, p);
            }
            if c == b',' {
                p += 1;
                continue;
            }
            let window = self.head_window(p, &[Head::Ident, Head::Eq, Head::Ident, Head::Open]);
            if let Ok(pair) = self.try_rule(Rule::assign_block_head, p, window) {
                let end = self.span(&pair).end;
                let mut it = pair.into_inner();
                let key = self.ident(it.next());
                let callee = self.ident(it.next());
                let inner_what = callee.name.clone();
                let (inner, after) =
                    self.body(end, Span::new(end - 1, end), &inner_what, depth + 1);
                let span = Span::new(callee.span.start, after);
                let value = Expr {
                    kind: ExprKind::Call {
                        name: callee,
                        args: Vec::new(),
                        body: Some(inner),
                    },
                    span,
                };
                body.items.push(Item::Assign { key, value });
                p = after;
                continue;
            }
            let end = self.statement_end(p);
            let f1 = match self.try_rule(Rule::assign, p, end) {
                Ok(pair) => {
                    let span = Span::new(p, end);
                    let mut it = pair.into_inner();
                    let key = self.ident(it.next());
                    let value = self.expr_opt(it.next(), span);
                    body.items.push(Item::Assign { key, value });
                    p = end;
                    continue;
                }
                Err(f) => f,
            };
            let window = self.head_window(p, &[Head::Ident, Head::OptIdent, Head::Open]);
            let f2 = match self.try_rule(Rule::section_head, p, window) {
                Ok(pair) => {
                    let hs = self.span(&pair);
                    let mut it = pair.into_inner();
                    let name = self.ident(it.next());
                    let label = it.next().map(|x| self.ident(Some(x)));
                    let head = name.span.to(label.as_ref().map_or(name.span, |l| l.span));
                    let sub_what = name.name.clone();
                    let (inner, after) =
                        self.body(hs.end, Span::new(hs.end - 1, hs.end), &sub_what, depth + 1);
                    body.items.push(Item::Section {
                        name,
                        label,
                        head,
                        body: inner,
                    });
                    p = after;
                    continue;
                }
                Err(f) => f,
            };
            body.broken = true;
            let f = furthest(f1, f2);
            match self.word_at(p) {
                "const" => self.diags.push(
                    Diagnostic::error("syntax", self.token_span(p), "a constant inside a block")
                        .with_label("constants go at the top of the file")
                        .with_help("move this `const` above `pipeline`"),
                ),
                "pipeline" => self.diags.push(
                    Diagnostic::error("syntax", self.token_span(p), "a pipeline inside a block")
                        .with_help("a file holds one `pipeline`; is a `}` missing above?"),
                ),
                _ => self.report(&f, what, p),
            }
            p = self.resume(p, end);
        }
    }

    /// Whether the statement at `p` starts its line, no deeper indented than the line that
    /// opened the enclosing block (at `open`), and is a pipeline-level item: then that block's
    /// `}` is missing.
    fn dedented_pipeline_item(&self, p: usize, open: usize) -> bool {
        let indent = |at: usize| -> Option<usize> {
            let line_start = self.src[..at].rfind('\n').map_or(0, |i| i + 1);
            let lead = &self.src[line_start..at];
            lead.chars()
                .all(|c| c == ' ' || c == '\t')
                .then(|| lead.chars().count())
        };
        let open_indent = {
            let line_start = self.src[..open].rfind('\n').map_or(0, |i| i + 1);
            self.src[line_start..open]
                .chars()
                .take_while(|c| *c == ' ' || *c == '\t')
                .count()
        };
        match indent(p) {
            Some(i) => i <= open_indent && PIPELINE_ITEMS.contains(&self.word_at(p)),
            None => false,
        }
    }

    /// Tries `rule` on `src[p..end]`; on success the pair (positions relative to `p`, which
    /// becomes [`Driver::base`]).
    fn try_rule(&mut self, rule: Rule, p: usize, end: usize) -> Result<Pair<'s, Rule>, Failure> {
        let text = &self.src[p..end];
        // pest recurses once per bracket level; refuse absurd nesting up front.
        let limit = self.statement_end(p).max(p);
        if too_complex(&self.src[p..limit.min(end)]) {
            return Err(Failure {
                pos: p,
                expected: vec![format!(
                    "a statement with at most {MAX_EXPR_NESTING} nested brackets and \
                     {MAX_OPERATORS} operators"
                )],
                at_start: true,
            });
        }
        match RpxParser::parse(rule, text) {
            Ok(mut pairs) => match pairs.next() {
                Some(pair) => {
                    self.base = p;
                    Ok(pair)
                }
                None => Err(Failure {
                    pos: p,
                    expected: vec![],
                    at_start: true,
                }),
            },
            Err(e) => {
                let pos = match e.location {
                    pest::error::InputLocation::Pos(x) => x,
                    pest::error::InputLocation::Span((x, _)) => x,
                };
                let mut expected = Vec::new();
                if let pest::error::ErrorVariant::ParsingError { positives, .. } = &e.variant {
                    for r in positives {
                        if let Some(d) = describe(*r) {
                            expected.push(d.to_string());
                        }
                    }
                }
                if let Some(att) = e.parse_attempts() {
                    for t in att.expected_tokens() {
                        let token = t.to_string();
                        // `(` and `[` would only say "a call or a list could start here"
                        if matches!(token.as_str(), "=" | "{" | "}" | ")" | "]" | ",") {
                            expected.push(format!("`{token}`"));
                        }
                    }
                }
                expected.sort();
                expected.dedup();
                Err(Failure {
                    pos: p + pos,
                    expected,
                    at_start: pos == 0,
                })
            }
        }
    }

    fn report(&mut self, f: &Failure, what: &str, stmt_start: usize) {
        let found = self.found(f.pos);
        let mut expected = f.expected.clone();
        if expected.is_empty() {
            expected.push("a statement".into());
        }
        if f.at_start && !what.is_empty() {
            expected = vec![
                "`key = value`".into(),
                "`name { ... }`".into(),
                "`}`".into(),
            ];
        }
        let msg = format!("expected {}, found {found}", join_or(&expected));
        let mut d = Diagnostic::error("syntax", self.token_span(f.pos), msg);
        let rest = &self.src[f.pos.min(self.src.len())..];
        let at_eol = rest.is_empty() || rest.starts_with(['\n', '\r']);
        let unclosed = self.unclosed_bracket(stmt_start, f.pos);
        if let (true, Some(open)) = (at_eol, unclosed) {
            let (l, c) = self.lines.line_col(self.src, open);
            let ch = &self.src[open..open + 1];
            d = d.with_help(format!(
                "the `{ch}` at line {l}, column {c} is never closed"
            ));
        } else if rest.starts_with('"') {
            d = d.with_help("a string ends with `\"` on the same line");
        } else if rest.starts_with(';') {
            d = d.with_help("statements end at the end of the line (or at a `,`): drop the `;`");
        } else if unclosed.is_some() && expected.iter().any(|e| e == "`,`") {
            d = d.with_help("separate items with `,`");
        } else if !f.at_start && expected.iter().any(|e| e == "the end of the statement") {
            d = d.with_help("one statement per line, or separate them with `,`");
        } else if f.at_start && !what.is_empty() {
            d = d.with_help(format!(
                "inside `{what} {{ }}` write `key = value`, one per line"
            ));
        }
        self.diags.push(d);
    }

    /// The innermost `(` or `[` opened in `src[start..end]` and not closed there.
    fn unclosed_bracket(&self, start: usize, end: usize) -> Option<usize> {
        let b = self.src.as_bytes();
        let mut stack = Vec::new();
        let mut i = start;
        while i < end.min(b.len()) {
            match b[i] {
                b'"' => {
                    i += 1;
                    while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                }
                b'(' | b'[' => stack.push(i),
                b')' | b']' => {
                    stack.pop();
                }
                _ => {}
            }
            i += 1;
        }
        stack.pop()
    }

    /// Where to go on after a failed statement at `p` whose extent ends at `end`.
    fn resume(&self, p: usize, end: usize) -> usize {
        if end > p {
            end
        } else {
            self.next_char(p)
        }
    }

    /// The end of the statement starting at `start` (see the module doc): a newline or `,`
    /// outside brackets, a `}` closing an enclosing block (not consumed), the end of a line
    /// that leaves a `(`/`[` open when the next line starts a new statement, or the end.
    fn statement_end(&self, start: usize) -> usize {
        let b = self.src.as_bytes();
        let mut stack: Vec<u8> = Vec::new();
        let mut last = b' '; // last significant byte of the current line
        let mut i = start;
        while i < b.len() {
            let c = b[i];
            match c {
                b'\n' => {
                    match stack.last() {
                        None => return i,
                        Some(b'(' | b'[') => {
                            let continues = matches!(
                                last,
                                b',' | b'(' | b'[' | b'{' | b'=' | b'+' | b'-' | b'*' | b'/'
                            );
                            match self.starts_statement(i + 1) {
                                Start::Strong => return i,
                                Start::Weak if !continues => return i,
                                _ => {}
                            }
                        }
                        _ => {}
                    }
                    last = b' ';
                }
                b',' if stack.is_empty() => return i,
                b'"' => {
                    i += 1;
                    while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                    last = b'"';
                    if i >= b.len() || b[i] == b'\n' {
                        continue;
                    }
                }
                b'/' if b.get(i + 1) == Some(&b'/') => {
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                    continue;
                }
                b'/' if b.get(i + 1) == Some(&b'*') => match self.src[i + 2..].find("*/") {
                    Some(k) => {
                        i = i + 2 + k + 2;
                        continue;
                    }
                    None => return b.len(),
                },
                b'(' | b'[' | b'{' => stack.push(c),
                b')' | b']' | b'}' => {
                    let open = match c {
                        b')' => b'(',
                        b']' => b'[',
                        _ => b'{',
                    };
                    if let Some(k) = stack.iter().rposition(|&o| o == open) {
                        stack.truncate(k);
                    } else if c == b'}' {
                        return i;
                    }
                }
                _ => {}
            }
            if !matches!(c, b' ' | b'\t' | b'\r' | b'\n') {
                last = c;
            }
            i += 1;
        }
        b.len()
    }

    /// How plainly the line from `p` (after indentation) starts a statement: `}`, a section
    /// head (`name {`, `name label {`), `const` or `pipeline` cannot continue an expression
    /// (strong); `key =` could be a named argument on its own line (weak).
    fn starts_statement(&self, p: usize) -> Start {
        let rest = &self.src[p.min(self.src.len())..];
        let rest = rest.trim_start_matches([' ', '\t', '\r']);
        if rest.starts_with('}') {
            return Start::Strong;
        }
        let ident_len = |s: &str| {
            s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(s.len())
        };
        let n1 = ident_len(rest);
        let w1 = &rest[..n1];
        if w1.is_empty() || w1.starts_with(|c: char| c.is_ascii_digit()) {
            return Start::No;
        }
        if w1 == "const" || w1 == "pipeline" {
            return Start::Strong;
        }
        let after = rest[n1..].trim_start_matches([' ', '\t']);
        if after.starts_with('{') {
            return Start::Strong;
        }
        if after.starts_with('=') {
            return Start::Weak;
        }
        let n2 = ident_len(after);
        if n2 > 0 && after[n2..].trim_start_matches([' ', '\t']).starts_with('{') {
            Start::Strong
        } else {
            Start::No
        }
    }

    fn line_end(&self, p: usize) -> usize {
        let p = p.min(self.src.len());
        self.src[p..].find('\n').map_or(self.src.len(), |k| p + k)
    }

    fn next_char(&self, p: usize) -> usize {
        let mut q = p + 1;
        while q < self.src.len() && !self.src.is_char_boundary(q) {
            q += 1;
        }
        q.min(self.src.len())
    }

    fn word_at(&self, p: usize) -> &'s str {
        let rest = &self.src[p.min(self.src.len())..];
        let n = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        &rest[..n]
    }

    /// The span of the token at `p` (a word, or one character; empty at the end).
    fn token_span(&self, p: usize) -> Span {
        if p >= self.src.len() {
            return Span::new(self.src.len(), self.src.len());
        }
        let w = self.word_at(p);
        if !w.is_empty() {
            Span::new(p, p + w.len())
        } else {
            Span::new(p, self.next_char(p))
        }
    }

    fn found(&self, p: usize) -> String {
        if p >= self.src.len() {
            return "the end of the file".into();
        }
        let s = self.token_span(p);
        match &self.src[s.start..s.end] {
            "\n" | "\r" => "the end of the line".into(),
            "," => "`,`".into(),
            t => format!("`{t}`"),
        }
    }

    /// Skips whitespace and comments; an unterminated `/*` is reported and skips to the end.
    fn skip_trivia(&mut self, mut p: usize) -> usize {
        let b = self.src.as_bytes();
        loop {
            while p < b.len() && matches!(b[p], b' ' | b'\t' | b'\r' | b'\n') {
                p += 1;
            }
            if b[p.min(b.len())..].starts_with(b"//") {
                p = self.line_end(p);
                continue;
            }
            if b[p.min(b.len())..].starts_with(b"/*") {
                match self.src[p + 2..].find("*/") {
                    Some(k) => {
                        p = p + 2 + k + 2;
                        continue;
                    }
                    None => {
                        self.diags.push(
                            Diagnostic::error(
                                "syntax",
                                Span::new(p, p + 2),
                                "this comment is never closed",
                            )
                            .with_label("opened here")
                            .with_help("close it with `*/`"),
                        );
                        return b.len();
                    }
                }
            }
            return p;
        }
    }

    // ---- pairs -> AST ----

    fn span(&self, pair: &Pair<'_, Rule>) -> Span {
        let s = pair.as_span();
        Span::new(self.base + s.start(), self.base + s.end())
    }

    fn ident(&self, pair: Option<Pair<'_, Rule>>) -> Ident {
        match pair {
            Some(p) => Ident {
                name: p.as_str().to_string(),
                span: self.span(&p),
            },
            None => Ident {
                name: String::new(),
                span: Span::default(),
            },
        }
    }

    fn expr_opt(&mut self, pair: Option<Pair<'_, Rule>>, fallback: Span) -> Expr {
        match pair {
            Some(p) => self.expr(p),
            None => Expr {
                kind: ExprKind::Error,
                span: fallback,
            },
        }
    }

    fn expr(&mut self, pair: Pair<'_, Rule>) -> Expr {
        let span = self.span(&pair);
        match pair.as_rule() {
            Rule::expr | Rule::term => {
                let mut it = pair.into_inner();
                let mut acc = match it.next() {
                    Some(first) => self.expr(first),
                    None => {
                        return Expr {
                            kind: ExprKind::Error,
                            span,
                        }
                    }
                };
                while let (Some(op), Some(rhs)) = (it.next(), it.next()) {
                    let op = match op.as_str() {
                        "+" => BinOp::Add,
                        "-" => BinOp::Sub,
                        "*" => BinOp::Mul,
                        _ => BinOp::Div,
                    };
                    let rhs = self.expr(rhs);
                    let s = acc.span.to(rhs.span);
                    acc = Expr {
                        kind: ExprKind::Binary(op, Box::new(acc), Box::new(rhs)),
                        span: s,
                    };
                }
                acc
            }
            Rule::factor => {
                let inner: Vec<_> = pair.into_inner().collect();
                let negs = inner.iter().filter(|p| p.as_rule() == Rule::neg).count();
                let mut e = match inner.into_iter().find(|p| p.as_rule() != Rule::neg) {
                    Some(a) => self.expr(a),
                    None => {
                        return Expr {
                            kind: ExprKind::Error,
                            span,
                        }
                    }
                };
                for _ in 0..negs {
                    e = Expr {
                        kind: ExprKind::Neg(Box::new(e)),
                        span,
                    };
                }
                e
            }
            Rule::dims => {
                let t = pair.as_str();
                let (w, h) = t.split_once('x').unwrap_or((t, "0"));
                match (units::parse_number(w), units::parse_number(h)) {
                    (Ok(units::Number::Int(w)), Ok(units::Number::Int(h))) if w >= 0 && h >= 0 => {
                        Expr {
                            kind: ExprKind::Dims(w as u64, h as u64),
                            span,
                        }
                    }
                    _ => self.literal_error(
                        span,
                        format!("`{t}` is not a valid `WIDTHxHEIGHT`"),
                        None,
                    ),
                }
            }
            Rule::quantity => {
                let t = pair.as_str();
                let (num, unit) = units::split_quantity(t);
                match units::parse_number(num) {
                    Err(m) => self.literal_error(span, m, None),
                    Ok(n) => match units::unit(unit) {
                        Some((dim, f)) => Expr {
                            kind: ExprKind::Quantity(n.as_f64() * f, dim),
                            span,
                        },
                        None => {
                            let names = units::unit_names();
                            // `GBps`, `TBs`: a bandwidth missing its slash
                            let per_second = ["ps", "s"].iter().find_map(|suffix| {
                                let stem = unit.strip_suffix(suffix)?;
                                let cand = format!("{stem}/s");
                                units::unit(&cand).map(|_| cand)
                            });
                            let guess = per_second.or_else(|| {
                                suggest::closest(unit, names.iter().copied()).map(str::to_string)
                            });
                            let help = match guess {
                                Some(c) => format!("did you mean `{num}{c}`?"),
                                None => format!("known units: {}", names.join(", ")),
                            };
                            let us = Span::new(span.start + num.len(), span.end);
                            self.literal_error(us, format!("unknown unit `{unit}`"), Some(help))
                        }
                    },
                }
            }
            Rule::number => match units::parse_number(pair.as_str()) {
                Ok(units::Number::Int(i)) => Expr {
                    kind: ExprKind::Int(i),
                    span,
                },
                Ok(units::Number::Float(f)) => Expr {
                    kind: ExprKind::Float(f),
                    span,
                },
                Err(m) => self.literal_error(span, m, None),
            },
            Rule::string => {
                let raw = pair.into_inner().next().map_or("", |p| p.as_str());
                match unescape(raw) {
                    Ok(s) => Expr {
                        kind: ExprKind::Str(s),
                        span,
                    },
                    Err((k, m)) => {
                        let at = span.start + 1 + k;
                        self.literal_error(
                            Span::new(at, at + 2),
                            m,
                            Some("known escapes: \\\" \\\\ \\n \\t".into()),
                        )
                    }
                }
            }
            Rule::boolean => Expr {
                kind: ExprKind::Bool(matches!(pair.as_str(), "true" | "on")),
                span,
            },
            Rule::ident => Expr {
                kind: ExprKind::Name(pair.as_str().to_string()),
                span,
            },
            Rule::list | Rule::tuple => {
                let rule = pair.as_rule();
                let items: Vec<Expr> = pair.into_inner().map(|p| self.expr(p)).collect();
                let kind = if rule == Rule::list {
                    ExprKind::List(items)
                } else {
                    ExprKind::Tuple(items)
                };
                Expr { kind, span }
            }
            Rule::paren => match pair.into_inner().next() {
                Some(inner) => {
                    let mut e = self.expr(inner);
                    e.span = span;
                    e
                }
                None => Expr {
                    kind: ExprKind::Error,
                    span,
                },
            },
            Rule::call => {
                let mut it = pair.into_inner();
                let name = self.ident(it.next());
                let mut args = Vec::new();
                for arg in it {
                    let a = match arg.into_inner().next() {
                        Some(a) => a,
                        None => continue,
                    };
                    if a.as_rule() == Rule::named_arg {
                        let mut ni = a.into_inner();
                        let n = self.ident(ni.next());
                        let v = self.expr_opt(ni.next(), n.span);
                        args.push(Arg {
                            name: Some(n),
                            value: v,
                        });
                    } else {
                        args.push(Arg {
                            name: None,
                            value: self.expr(a),
                        });
                    }
                }
                Expr {
                    kind: ExprKind::Call {
                        name,
                        args,
                        body: None,
                    },
                    span,
                }
            }
            _ => Expr {
                kind: ExprKind::Error,
                span,
            },
        }
    }

    fn literal_error(&mut self, span: Span, msg: String, help: Option<String>) -> Expr {
        self.diags
            .push(Diagnostic::error("literal", span, msg).with_help_opt(help));
        Expr {
            kind: ExprKind::Error,
            span,
        }
    }
}

fn furthest(a: Failure, b: Failure) -> Failure {
    match a.pos.cmp(&b.pos) {
        std::cmp::Ordering::Greater => a,
        std::cmp::Ordering::Less => b,
        std::cmp::Ordering::Equal => {
            let mut expected = a.expected;
            expected.extend(b.expected);
            expected.sort();
            expected.dedup();
            Failure {
                pos: a.pos,
                expected,
                at_start: a.at_start && b.at_start,
            }
        }
    }
}

/// What a rule looks like, in words; `None` for rules never worth naming.
fn describe(r: Rule) -> Option<&'static str> {
    Some(match r {
        Rule::ident => "a name",
        Rule::EOI => "the end of the statement",
        Rule::kw_const => "`const`",
        Rule::kw_pipeline => "`pipeline`",
        Rule::expr | Rule::term | Rule::factor | Rule::neg => "a value",
        Rule::add_op | Rule::mul_op => "an operator",
        Rule::arg | Rule::named_arg => "an argument",
        Rule::number | Rule::quantity | Rule::dims => "a number",
        Rule::string => "a string",
        Rule::boolean => "a value",
        Rule::call | Rule::list | Rule::tuple | Rule::paren => "a value",
        _ => return None,
    })
}

fn join_or(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [a] => a.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// Decodes `\"`, `\\`, `\n`, `\t`; on an unknown escape, its byte offset and a message.
fn unescape(raw: &str) -> Result<String, (usize, String)> {
    let mut out = String::new();
    let mut it = raw.char_indices();
    while let Some((i, c)) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some((_, '"')) => out.push('"'),
            Some((_, '\\')) => out.push('\\'),
            Some((_, 'n')) => out.push('\n'),
            Some((_, 't')) => out.push('\t'),
            Some((_, o)) => return Err((i, format!("unknown escape `\\{o}` in a string"))),
            None => return Err((i, "a string cannot end with `\\`".into())),
        }
    }
    Ok(out)
}

/// Whether a statement nests brackets deeper than [`MAX_EXPR_NESTING`] or chains more than
/// [`MAX_OPERATORS`] operators (strings skipped): bounds on the recursion of parsing and
/// evaluation.
fn too_complex(s: &str) -> bool {
    let (mut depth, mut ops, mut in_str, mut escaped) = (0usize, 0usize, false, false);
    for c in s.chars() {
        if in_str {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '(' | '[' => {
                depth += 1;
                if depth > MAX_EXPR_NESTING {
                    return true;
                }
            }
            ')' | ']' => depth = depth.saturating_sub(1),
            '+' | '-' | '*' | '/' => ops += 1,
            _ => {}
        }
    }
    ops > MAX_OPERATORS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::span::line_col;
    use crate::units::Dim;

    /// The value of `x = <text>` inside a pipeline, and the diagnostics.
    fn value(text: &str) -> (ExprKind, Vec<Diagnostic>) {
        let src = format!("pipeline p {{\n    x = {text}\n}}\n");
        let (file, diags) = parse(&src);
        let item = file.pipeline.and_then(|p| p.body.items.into_iter().next());
        match item {
            Some(Item::Assign { value, .. }) => (value.kind, diags),
            _ => (ExprKind::Error, diags),
        }
    }

    fn ok(text: &str) -> ExprKind {
        let (v, d) = value(text);
        assert!(d.is_empty(), "{text}: {d:?}");
        v
    }

    #[test]
    fn literals() {
        assert_eq!(ok("42"), ExprKind::Int(42));
        assert_eq!(ok("1_000"), ExprKind::Int(1000));
        assert_eq!(ok("0.25"), ExprKind::Float(0.25));
        assert_eq!(ok("1e-6"), ExprKind::Float(1e-6));
        assert_eq!(
            ok("141GiB"),
            ExprKind::Quantity(141.0 * (1u64 << 30) as f64, Dim::Bytes)
        );
        assert_eq!(ok("400GB/s"), ExprKind::Quantity(400e9, Dim::Bandwidth));
        assert_eq!(ok("989TFLOPS"), ExprKind::Quantity(989e12, Dim::FlopRate));
        assert_eq!(ok("500ms"), ExprKind::Quantity(0.5, Dim::Duration));
        assert_eq!(ok("448x336"), ExprKind::Dims(448, 336));
        assert_eq!(ok("\"a \\\"b\\\"\\n\""), ExprKind::Str("a \"b\"\n".into()));
        assert_eq!(ok("on"), ExprKind::Bool(true));
        assert_eq!(ok("false"), ExprKind::Bool(false));
        assert_eq!(ok("online"), ExprKind::Name("online".into()));
        assert_eq!(ok("k3"), ExprKind::Name("k3".into()));
    }

    #[test]
    fn compound_values() {
        match ok("[7, 15, 23, 31,]") {
            ExprKind::List(xs) => assert_eq!(xs.len(), 4),
            v => panic!("{v:?}"),
        }
        match ok("(0.9, 0.999)") {
            ExprKind::Tuple(xs) => assert_eq!(xs.len(), 2),
            v => panic!("{v:?}"),
        }
        assert_eq!(ok("(3)"), ExprKind::Int(3));
        match ok("video(8, size = 448x448)") {
            ExprKind::Call { name, args, body } => {
                assert_eq!(name.name, "video");
                assert!(args[0].name.is_none());
                assert_eq!(args[1].name.as_ref().map(|n| n.name.as_str()), Some("size"));
                assert!(body.is_none());
            }
            v => panic!("{v:?}"),
        }
        match ok("video(\n        frames = 8,\n        size = 448x448,\n    )") {
            ExprKind::Call { args, .. } => assert_eq!(args.len(), 2),
            v => panic!("{v:?}"),
        }
        match ok("grpo { clip = 0.2\n kl = k3 }") {
            ExprKind::Call { body: Some(b), .. } => assert_eq!(b.items.len(), 2),
            v => panic!("{v:?}"),
        }
        match ok("-4 * G + 1") {
            ExprKind::Binary(BinOp::Add, l, _) => {
                assert!(matches!(l.kind, ExprKind::Binary(BinOp::Mul, _, _)))
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn literal_errors_are_located() {
        let (_, d) = value("80Gib");
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].message, "unknown unit `Gib`");
        assert_eq!(d[0].help.as_deref(), Some("did you mean `80GiB`?"));
        let (_, d) = value("\"a\\qb\"");
        assert!(d[0].message.contains("unknown escape `\\q`"), "{:?}", d);
        let (_, d) = value("99999999999999999999");
        assert!(d[0].message.contains("too large"));
    }

    #[test]
    fn one_error_per_broken_statement() {
        let src = "pipeline p {\n  a = 1 2\n  b = (3,\n  c = 4\n  d { e = }\n  f = [1 2]\n}\n";
        let (file, diags) = parse(src);
        let lines: Vec<usize> = diags
            .iter()
            .map(|d| line_col(src, d.span.start).0)
            .collect();
        // `b = (3,` ends with a comma, so `c = 4` may be its next argument: one error there
        assert_eq!(lines, vec![2, 4, 5, 6], "{diags:#?}");
        let p = file.pipeline.expect("pipeline parsed");
        let keys: Vec<&str> = p.body.items.iter().map(|i| i.key().name.as_str()).collect();
        assert_eq!(keys, vec!["d"]);
        assert!(p.body.broken);
    }

    #[test]
    fn statements_separate_by_newline_or_comma() {
        let (file, diags) = parse("pipeline p { a = 1, b = 2\n c { d = 3 } e = 4 }");
        assert!(diags.is_empty(), "{diags:?}");
        assert_eq!(file.pipeline.map(|p| p.body.items.len()), Some(4));
    }
}
