//! The `math` built-in reward: is the response's final answer equivalent to the reference?
//!
//! **The final answer** ([`math_answer`], applied to the response and to the reference alike):
//! reasoning up to the last `</think>` is dropped; then the content of the last `\boxed{...}`
//! (or `\fbox{...}`; braces balanced) is the answer; else the content of the last
//! `<answer>...</answer>`, else the text, cut to its last non-empty line. A line loses a lead
//! such as `The answer is`, `Answer:` or GSM8K's `####`, markdown bold, surrounding `$...$`,
//! `\(...\)` or `\[...\]`, and a trailing period.
//!
//! **Equivalence** ([`equivalent`]), in order:
//! - *Multiple choice*: a reference that is one capital letter (`B`, `(B)`, `B.`,
//!   `\text{B}`) matches a response whose answer starts with that letter in the same forms
//!   (`(B) 12` reads as B).
//! - *Numbers*: both sides evaluated by a small exact-rational evaluator over `+ - * / ^`,
//!   parentheses, implicit products (`2\pi`), integers, decimals, thousands separators
//!   (`1,234`, `1{,}234`), fractions (`3/4`, `\frac`, `\dfrac`, `\tfrac`, `\frac12`), mixed
//!   numbers (`2\frac{1}{2}`), `\sqrt{}` and `\sqrt[n]{}`, `\pi`, `\times`, `\cdot`, `\div`.
//!   Units (`\text{cm}`, trailing words), degrees (`^\circ`, `°`) and a leading `x =` are
//!   stripped. Two exact values must be equal; a value with an irrational part (`\pi`, a
//!   root that is not exact) is compared in floating point within a relative `tolerance`.
//! - *Percentages*: one rule: `p%` equals both `p` and `p/100`, so `50%`, `50` and `0.5` all
//!   match `50\%`, while `50` and `0.5` (no `%` on either side) differ.
//! - *Anything else* (an expression with variables, an interval, a word): the two answers
//!   compared as text, ignoring case, spaces and the LaTeX spacing commands.
//!
//! Invariant: the score is a pure function of (response, reference, tolerance); the evaluator
//! works on bounded input (exponents up to 256 are exact, larger ones are floating point) and
//! never loops on any text. A reference with no answer at all is an error, never a zero.

/// The final answer of `text` (see the module doc), cleaned of its lead and wrapping.
pub fn math_answer(text: &str) -> String {
    let s = after_think(text);
    if let Some(b) = last_braced(s, &["\\boxed", "\\fbox"]) {
        return clean_line(b);
    }
    let s = last_tag(s, "answer").unwrap_or(s);
    let line = s.lines().rev().map(str::trim).find(|l| !l.is_empty());
    clean_line(line.unwrap_or(""))
}

/// Everything after the last `</think>` (all of `text` when there is none).
pub fn after_think(text: &str) -> &str {
    match find_last_ci(text, "</think>") {
        Some(i) => &text[i + "</think>".len()..],
        None => text,
    }
}

/// The content of the last `<tag>...</tag>` of `s` (tag names ignore case).
pub fn last_tag<'s>(s: &'s str, tag: &str) -> Option<&'s str> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let end = find_last_ci(s, &close)?;
    let start = find_last_ci(&s[..end], &open)? + open.len();
    Some(&s[start..end])
}

/// The content of the last `\cmd{...}` of `s` for any `cmd` of `cmds`, braces balanced;
/// `None` when there is none or its braces do not close.
pub fn last_braced<'s>(s: &'s str, cmds: &[&str]) -> Option<&'s str> {
    let mut best: Option<(usize, &'s str)> = None;
    for cmd in cmds {
        let mut from = 0;
        while let Some(i) = s[from..].find(cmd) {
            let at = from + i;
            from = at + cmd.len();
            let rest = s[from..].trim_start();
            if rest.starts_with('{') {
                let open = s.len() - rest.len();
                if let Some(inner) = balanced(s, open) {
                    if best.is_none_or(|(b, _)| at > b) {
                        best = Some((at, inner));
                    }
                }
            }
        }
    }
    best.map(|(_, inner)| inner)
}

/// The text between the `{` at byte `open` of `s` and its matching `}`.
fn balanced(s: &str, open: usize) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Byte index of the last case-insensitive (ASCII) occurrence of `pat` in `s`.
fn find_last_ci(s: &str, pat: &str) -> Option<usize> {
    let (h, p) = (s.as_bytes(), pat.as_bytes());
    if p.len() > h.len() {
        return None;
    }
    (0..=h.len() - p.len())
        .rev()
        .find(|&i| h[i..i + p.len()].eq_ignore_ascii_case(p) && s.is_char_boundary(i))
}

/// One answer line without its lead (`The answer is`, `Answer:`, `####`), markdown bold, math
/// delimiters or trailing period.
fn clean_line(line: &str) -> String {
    let mut s = line.trim().replace("**", "");
    if let Some(i) = s.rfind("####") {
        s = s[i + 4..].to_string();
    }
    for lead in ["answer is:", "answer is", "answer:"] {
        if let Some(i) = find_last_ci(&s, lead) {
            s = s[i + lead.len()..].to_string();
            break;
        }
    }
    let mut t = s.trim().trim_start_matches(':').trim();
    loop {
        let before = t;
        t = t.trim().trim_end_matches(['.', '!']).trim();
        for (open, close) in [("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")] {
            if t.len() >= open.len() + close.len() && t.starts_with(open) && t.ends_with(close) {
                t = &t[open.len()..t.len() - close.len()];
            }
        }
        if t == before {
            break;
        }
    }
    t.to_string()
}

/// 1 when the final answer of `response` is equivalent to that of `reference` (see the module
/// doc); `tolerance` is the relative tolerance for values with an irrational part.
pub fn math(response: &str, reference: &str, tolerance: f64) -> Result<f64, String> {
    if !(tolerance >= 0.0 && tolerance.is_finite()) {
        return Err(format!(
            "math tolerance must be finite and >= 0, got {tolerance}"
        ));
    }
    let want = math_answer(reference);
    if want.is_empty() {
        return Err(format!(
            "reference answer {reference:?} has no final answer"
        ));
    }
    let got = math_answer(response);
    Ok(equivalent(&got, &want, tolerance) as u8 as f64)
}

/// Whether the answer `got` is equivalent to the reference answer `want` (both already cut by
/// [`math_answer`]; see the module doc).
pub fn equivalent(got: &str, want: &str, tolerance: f64) -> bool {
    let (g, w) = (normalise(got), normalise(want));
    if let Some(letter) = choice_letter(&w, true) {
        return choice_letter(&g, false) == Some(letter);
    }
    let (g, w) = (after_equals(&g), after_equals(&w));
    match (number(g), number(w)) {
        (Some(a), Some(b)) => match (a.percent, b.percent) {
            (false, false) | (true, true) => a.value.same(&b.value, tolerance),
            _ => {
                a.value.same(&b.value, tolerance)
                    || a.value
                        .per_cent(a.percent)
                        .same(&b.value.per_cent(b.percent), tolerance)
            }
        },
        _ => text_key(g) == text_key(w),
    }
}

/// LaTeX reduced to what the evaluator reads: spacing and sizing commands, `$`, degree marks
/// and text wrappers dropped; `\dfrac`/`\tfrac` as `\frac`; `\times`, `\cdot`, `\div` and
/// their Unicode forms as `*` and `/`.
fn normalise(s: &str) -> String {
    let mut s = s.to_string();
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\displaystyle", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("~", " "),
        ("\\$", ""),
        ("$", ""),
        ("{,}", ""),
        ("\\%", "%"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\circ", ""),
        ("\\degree", ""),
        ("°", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\times", "*"),
        ("\\cdot", "*"),
        ("\\div", "/"),
        ("×", "*"),
        ("÷", "/"),
        ("−", "-"),
        ("π", "\\pi "),
        ("√", "\\sqrt"),
    ] {
        s = s.replace(from, to);
    }
    for wrapper in [
        "\\text", "\\textbf", "\\textit", "\\mathrm", "\\mathbf", "\\mbox",
    ] {
        s = unwrap_all(&s, wrapper);
    }
    s.trim().to_string()
}

/// `s` with every `\cmd{x}` replaced by `x`.
fn unwrap_all(s: &str, cmd: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(cmd) {
        let after = &rest[i + cmd.len()..];
        // `\text` must not match the start of `\textbf`
        if after.starts_with(|c: char| c.is_ascii_alphabetic()) {
            out.push_str(&rest[..i + cmd.len()]);
            rest = after;
            continue;
        }
        let open = i + cmd.len() + (after.len() - after.trim_start().len());
        match rest[open..]
            .starts_with('{')
            .then(|| balanced(rest, open))
            .flatten()
        {
            Some(inner) => {
                out.push_str(&rest[..i]);
                out.push_str(inner);
                rest = &rest[open + inner.len() + 2..];
            }
            None => {
                out.push_str(&rest[..i + cmd.len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The letter of a multiple-choice answer: `B`, `(B)`, `B.`, `B)`, `B:`, `Option B`; when not
/// `exact`, also such a letter followed by text (`(B) 12`, `B. 12`).
fn choice_letter(s: &str, exact: bool) -> Option<char> {
    let mut s = s.trim();
    for lead in ["option", "choice"] {
        if s.get(..lead.len())
            .is_some_and(|h| h.eq_ignore_ascii_case(lead))
        {
            s = s[lead.len()..].trim_start();
        }
    }
    let (paren, body) = match s.strip_prefix('(') {
        Some(b) => (true, b),
        None => (false, s),
    };
    let mut chars = body.chars();
    let letter = chars.next().filter(char::is_ascii_uppercase)?;
    let rest = chars.as_str();
    let rest = if paren { rest.strip_prefix(')')? } else { rest };
    let rest = rest
        .strip_prefix(['.', ':', ')'])
        .filter(|_| !paren)
        .unwrap_or(rest);
    let ok = if exact {
        rest.trim().is_empty()
    } else {
        rest.is_empty() || rest.starts_with(char::is_whitespace) || paren
    };
    // `A` alone is a letter; `Ax` or `A+1` is not
    ok.then_some(letter)
}

/// The part after the last `=` (`x = 5` is 5); all of `s` when it has none.
fn after_equals(s: &str) -> &str {
    match s.rfind('=') {
        Some(i) => s[i + 1..].trim(),
        None => s,
    }
}

/// Text compared when an answer is not a number: lower case, without spaces, braces of
/// wrappers already gone.
fn text_key(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect()
}

/// A number read from an answer, and whether it was written as a percentage.
struct Read {
    value: Num,
    percent: bool,
}

/// `s` as a number: the whole text must evaluate, after a trailing `%` and then trailing unit
/// words are stripped.
fn number(s: &str) -> Option<Read> {
    let s = s.trim();
    let (s, percent) = match s.strip_suffix('%') {
        Some(rest) => (rest.trim_end(), true),
        None => (s, false),
    };
    if let Some(value) = eval(s) {
        return Some(Read { value, percent });
    }
    let stripped = strip_units(s);
    if stripped.len() < s.len() && !stripped.is_empty() {
        let (stripped, pct) = match stripped.strip_suffix('%') {
            Some(rest) => (rest.trim_end(), true),
            None => (stripped, percent),
        };
        return eval(stripped).map(|value| Read {
            value,
            percent: pct,
        });
    }
    None
}

/// `s` without trailing unit words (`12 cm`, `5 square units`, `3\text{ m}^2` once unwrapped):
/// letters, spaces and `^2`/`^3` at the end that follow a digit, `}` or `)`, never a command's
/// name (`2\pi` keeps its `\pi`).
fn strip_units(s: &str) -> &str {
    let b = s.as_bytes();
    let mut end = b.len();
    // an exponent on the unit (`cm^2`, `m^{3}`)
    let t = s.trim_end();
    for pow in ["^2", "^3", "^{2}", "^{3}"] {
        if let Some(rest) = t.strip_suffix(pow) {
            if rest.ends_with(|c: char| c.is_ascii_alphabetic()) {
                end = rest.len();
            }
        }
    }
    let mut i = end;
    while i > 0 && (b[i - 1].is_ascii_alphabetic() || b[i - 1] == b' ' || b[i - 1] == b'.') {
        i -= 1;
    }
    let word_start = s[i..end]
        .find(|c: char| c.is_ascii_alphabetic())
        .map(|k| i + k);
    match word_start {
        Some(_) if i > 0 && b[i - 1] != b'\\' => {
            let head = s[..i].trim_end();
            if head.ends_with(|c: char| c.is_ascii_digit() || c == '}' || c == ')' || c == '%') {
                head
            } else {
                s
            }
        }
        _ => s,
    }
}

/// An exact rational `n / d` (d > 0, lowest terms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ratio {
    n: i128,
    d: i128,
}

/// The greatest common divisor of `|a|` and `|b|`.
fn gcd(a: i128, b: i128) -> u128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Ratio {
    fn new(n: i128, d: i128) -> Option<Ratio> {
        if d == 0 {
            return None;
        }
        let g = i128::try_from(gcd(n, d)).ok()?.max(1);
        let (n, d) = (n / g, d / g);
        if d < 0 {
            Some(Ratio {
                n: n.checked_neg()?,
                d: d.checked_neg()?,
            })
        } else {
            Some(Ratio { n, d })
        }
    }
    fn int(n: i128) -> Ratio {
        Ratio { n, d: 1 }
    }
    fn add(self, o: Ratio) -> Option<Ratio> {
        let n = self
            .n
            .checked_mul(o.d)?
            .checked_add(o.n.checked_mul(self.d)?)?;
        Ratio::new(n, self.d.checked_mul(o.d)?)
    }
    fn mul(self, o: Ratio) -> Option<Ratio> {
        Ratio::new(self.n.checked_mul(o.n)?, self.d.checked_mul(o.d)?)
    }
    fn recip(self) -> Option<Ratio> {
        Ratio::new(self.d, self.n)
    }
    fn neg(self) -> Option<Ratio> {
        Some(Ratio {
            n: self.n.checked_neg()?,
            d: self.d,
        })
    }
    fn pow(self, e: i128) -> Option<Ratio> {
        let base = if e < 0 { self.recip()? } else { self };
        let mut out = Ratio::int(1);
        for _ in 0..e.unsigned_abs() {
            out = out.mul(base)?;
        }
        Some(out)
    }
    fn f64(self) -> f64 {
        self.n as f64 / self.d as f64
    }
    /// The exact `k`-th root, when there is one.
    fn root(self, k: u32) -> Option<Ratio> {
        if self.n < 0 && k.is_multiple_of(2) {
            return None;
        }
        let n = int_root(self.n.abs(), k)?;
        let d = int_root(self.d, k)?;
        Ratio::new(if self.n < 0 { -n } else { n }, d)
    }
}

/// The exact integer `k`-th root of `x >= 0`, when there is one.
fn int_root(x: i128, k: u32) -> Option<i128> {
    if x >= 1 << 100 {
        return None;
    }
    let guess = (x as f64).powf(1.0 / k as f64).round() as i128;
    (guess.saturating_sub(1)..=guess + 1).find(|r| *r >= 0 && r.checked_pow(k) == Some(x))
}

/// A value: its floating-point approximation, and its exact rational form when it has one
/// (no `\pi`, no inexact root, no overflow).
#[derive(Clone, Copy, Debug)]
struct Num {
    approx: f64,
    exact: Option<Ratio>,
}

impl Num {
    fn exact(r: Ratio) -> Num {
        Num {
            approx: r.f64(),
            exact: Some(r),
        }
    }
    fn float(x: f64) -> Num {
        Num {
            approx: x,
            exact: None,
        }
    }
    fn lift(
        self,
        o: Num,
        exact: impl Fn(Ratio, Ratio) -> Option<Ratio>,
        approx: impl Fn(f64, f64) -> f64,
    ) -> Num {
        Num {
            approx: approx(self.approx, o.approx),
            exact: self.exact.zip(o.exact).and_then(|(a, b)| exact(a, b)),
        }
    }
    fn add(self, o: Num) -> Num {
        self.lift(o, Ratio::add, |a, b| a + b)
    }
    fn sub(self, o: Num) -> Num {
        self.add(o.neg())
    }
    fn mul(self, o: Num) -> Num {
        self.lift(o, Ratio::mul, |a, b| a * b)
    }
    fn div(self, o: Num) -> Num {
        self.lift(o, |a, b| a.mul(b.recip()?), |a, b| a / b)
    }
    fn neg(self) -> Num {
        Num {
            approx: -self.approx,
            exact: self.exact.and_then(Ratio::neg),
        }
    }
    fn pow(self, e: Num) -> Num {
        let approx = self.approx.powf(e.approx);
        let exact = match (self.exact, e.exact) {
            (Some(b), Some(e)) if e.d == 1 && e.n.abs() <= 256 => b.pow(e.n),
            (Some(b), Some(e)) if e.n.abs() <= 256 && e.d <= 64 => {
                b.root(e.d as u32).and_then(|r| r.pow(e.n))
            }
            _ => None,
        };
        Num { approx, exact }
    }
    fn root(self, k: Num) -> Num {
        match k.exact {
            Some(k) if k.d == 1 && (1..=64).contains(&k.n) => Num {
                approx: if self.approx < 0.0 && k.n % 2 == 1 {
                    -(-self.approx).powf(1.0 / k.n as f64)
                } else {
                    self.approx.powf(1.0 / k.n as f64)
                },
                exact: self.exact.and_then(|r| r.root(k.n as u32)),
            },
            _ => Num::float(f64::NAN),
        }
    }
    /// `p%` as `p / 100` when `percent`.
    fn per_cent(self, percent: bool) -> Num {
        if percent {
            self.div(Num::exact(Ratio::int(100)))
        } else {
            self
        }
    }
    fn same(&self, o: &Num, tolerance: f64) -> bool {
        if let (Some(a), Some(b)) = (self.exact, o.exact) {
            return a == b;
        }
        let (a, b) = (self.approx, o.approx);
        (a - b).abs() <= tolerance * a.abs().max(b.abs()) || (a - b).abs() <= 1e-12
    }
}

/// Evaluates a whole expression; `None` when any of it is not understood or the value is not
/// finite.
fn eval(s: &str) -> Option<Num> {
    let toks = lex(s)?;
    let mut p = Parser {
        toks,
        at: 0,
        depth: 0,
    };
    let v = p.expr()?;
    (p.at == p.toks.len() && v.approx.is_finite()).then_some(v)
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// A decimal literal: digits, thousands separators removed; (value, digits were integral).
    Num(Ratio, bool),
    Op(char),
    Open(char),
    Close(char),
    Frac,
    Sqrt,
    Pi,
}

/// The tokens of `s`; `None` at a character or command the evaluator does not know.
fn lex(s: &str) -> Option<Vec<Tok>> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b' ' | b'\t' => i += 1,
            b'0'..=b'9' | b'.' => {
                let (tok, len) = lex_number(&s[i..])?;
                out.push(tok);
                i += len;
            }
            b'+' | b'-' | b'*' | b'/' | b'^' => {
                out.push(Tok::Op(c as char));
                i += 1;
            }
            b'(' | b'{' | b'[' => {
                out.push(Tok::Open(c as char));
                i += 1;
            }
            b')' | b'}' | b']' => {
                out.push(Tok::Close(c as char));
                i += 1;
            }
            b'\\' => {
                let name: String = s[i + 1..]
                    .chars()
                    .take_while(char::is_ascii_alphabetic)
                    .collect();
                out.push(match name.as_str() {
                    "frac" => Tok::Frac,
                    "sqrt" => Tok::Sqrt,
                    "pi" => Tok::Pi,
                    _ => return None,
                });
                i += 1 + name.len();
            }
            _ => return None,
        }
    }
    Some(out)
}

/// One decimal literal at the start of `s`: `12`, `1,234,567.5` (groups of three after a
/// comma), `.5`, `3.`; at most 30 digits are exact. Returns the token and its byte length.
fn lex_number(s: &str) -> Option<(Tok, usize)> {
    let b = s.as_bytes();
    let mut digits = String::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            digits.push(b[i] as char);
            i += 1;
        } else if b[i] == b','
            && !digits.is_empty()
            && b.len() >= i + 4
            && b[i + 1..i + 4].iter().all(u8::is_ascii_digit)
            && b.get(i + 4).is_none_or(|c| !c.is_ascii_digit())
        {
            i += 1;
        } else {
            break;
        }
    }
    let mut frac = String::new();
    if b.get(i) == Some(&b'.') {
        i += 1;
        while i < b.len() && b[i].is_ascii_digit() {
            frac.push(b[i] as char);
            i += 1;
        }
    }
    if digits.is_empty() && frac.is_empty() {
        return None;
    }
    if digits.len() + frac.len() > 30 {
        return None;
    }
    let n: i128 = format!("{digits}{frac}").parse().ok()?;
    let d = 10i128.checked_pow(frac.len() as u32)?;
    Some((Tok::Num(Ratio::new(n, d)?, frac.is_empty()), i))
}

/// How deeply groups may nest: deeper input is not a number (and cannot exhaust the stack).
const MAX_DEPTH: usize = 64;

struct Parser {
    toks: Vec<Tok>,
    at: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.at).cloned();
        self.at += 1;
        t
    }
    fn eat(&mut self, t: &Tok) -> bool {
        if self.peek() == Some(t) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    /// `term (('+' | '-') term)*`
    fn expr(&mut self) -> Option<Num> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        let v = self.sum();
        self.depth -= 1;
        v
    }

    fn sum(&mut self) -> Option<Num> {
        let mut v = self.term()?;
        loop {
            if self.eat(&Tok::Op('+')) {
                v = v.add(self.term()?);
            } else if self.eat(&Tok::Op('-')) {
                v = v.sub(self.term()?);
            } else {
                return Some(v);
            }
        }
    }

    /// `unary (('*' | '/' | implicit) unary)*`
    fn term(&mut self) -> Option<Num> {
        let mut v = self.unary()?;
        loop {
            if self.eat(&Tok::Op('*')) {
                v = v.mul(self.unary()?);
            } else if self.eat(&Tok::Op('/')) {
                let d = self.unary()?;
                if d.approx == 0.0 {
                    return None;
                }
                v = v.div(d);
            } else if matches!(
                self.peek(),
                Some(Tok::Num(..) | Tok::Open('(' | '{') | Tok::Frac | Tok::Sqrt | Tok::Pi)
            ) {
                v = v.mul(self.power()?);
            } else {
                return Some(v);
            }
        }
    }

    /// `('-' | '+') unary | power`
    fn unary(&mut self) -> Option<Num> {
        if self.eat(&Tok::Op('-')) {
            return Some(self.unary()?.neg());
        }
        if self.eat(&Tok::Op('+')) {
            return self.unary();
        }
        self.power()
    }

    /// `atom ('^' unary)?`, right-associative.
    fn power(&mut self) -> Option<Num> {
        let base = self.atom()?;
        if self.eat(&Tok::Op('^')) {
            let e = self.unary()?;
            return Some(base.pow(e));
        }
        Some(base)
    }

    fn atom(&mut self) -> Option<Num> {
        match self.next()? {
            Tok::Num(r, integral) => {
                let v = Num::exact(r);
                // a mixed number: `2\frac{1}{2}` is 2 + 1/2
                if integral && self.peek() == Some(&Tok::Frac) {
                    let save = self.at;
                    self.at += 1;
                    if let Some(f) = self.frac_args() {
                        if let Some(q) = f.exact.filter(|q| q.n > 0 && q.n < q.d) {
                            let q = Num::exact(q);
                            return Some(if r.n < 0 { v.sub(q) } else { v.add(q) });
                        }
                    }
                    self.at = save;
                }
                Some(v)
            }
            Tok::Open(c) => {
                let v = self.expr()?;
                let close = match c {
                    '(' => ')',
                    '{' => '}',
                    _ => ']',
                };
                self.eat(&Tok::Close(close)).then_some(v)
            }
            Tok::Pi => Some(Num::float(std::f64::consts::PI)),
            Tok::Frac => self.frac_args(),
            Tok::Sqrt => {
                let k = if self.eat(&Tok::Open('[')) {
                    let k = self.expr()?;
                    self.eat(&Tok::Close(']')).then_some(k)?
                } else {
                    Num::exact(Ratio::int(2))
                };
                let x = self.arg()?;
                let r = x.root(k);
                r.approx.is_finite().then_some(r)
            }
            _ => None,
        }
    }

    /// The two arguments of `\frac` (after the command).
    fn frac_args(&mut self) -> Option<Num> {
        let n = self.arg()?;
        let d = self.arg()?;
        (d.approx != 0.0).then(|| n.div(d))
    }

    /// A command's argument: `{expr}`, or one token (`\frac12`: the digits one at a time).
    fn arg(&mut self) -> Option<Num> {
        if self.eat(&Tok::Open('{')) {
            let v = self.expr()?;
            return self.eat(&Tok::Close('}')).then_some(v);
        }
        match self.peek()? {
            Tok::Num(..) => {
                // `\frac12`: a single digit per argument
                let Some(Tok::Num(r, true)) = self.next() else {
                    return None;
                };
                let digits = r.n.to_string();
                if digits.len() == 1 || r.d != 1 {
                    return Some(Num::exact(r));
                }
                let first = digits[..1].parse::<i128>().ok()?;
                let rest: i128 = digits[1..].parse().ok()?;
                // put the remaining digits back as their own literal
                self.at -= 1;
                self.toks[self.at] = Tok::Num(Ratio::int(rest), true);
                Some(Num::exact(Ratio::int(first)))
            }
            Tok::Pi => {
                self.at += 1;
                Some(Num::float(std::f64::consts::PI))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_answers_are_cut_from_responses() {
        let cases = [
            ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
            ("\\boxed{1} then \\boxed{ {2} }", "{2}"),
            ("<think>\\boxed{9}</think> The answer is 7.", "7"),
            ("Work...\n\nThe answer is $42$.\n", "42"),
            ("Answer: 3/4", "3/4"),
            ("**Final Answer:** \\(12\\)", "12"),
            ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
            ("<answer> (B) </answer>", "(B)"),
            ("unclosed \\boxed{12", "unclosed \\boxed{12"),
            ("", ""),
        ];
        for (text, want) in cases {
            assert_eq!(math_answer(text), want, "{text:?}");
        }
    }

    /// (response, reference, equal?)
    const PAIRS: &[(&str, &str, bool)] = &[
        // integers, signs, spaces
        ("\\boxed{42}", "42", true),
        ("\\boxed{-7}", "-7", true),
        ("\\boxed{41}", "42", false),
        ("\\boxed{7}", "-7", false),
        ("The answer is 0", "0", true),
        // decimals
        ("\\boxed{0.5}", "0.50", true),
        ("\\boxed{.25}", "0.25", true),
        ("\\boxed{3.0}", "3", true),
        ("\\boxed{0.333}", "\\frac{1}{3}", false),
        ("\\boxed{2.5}", "2.50001", false),
        // fractions
        ("\\boxed{3/4}", "0.75", true),
        ("\\boxed{6/8}", "\\frac{3}{4}", true),
        ("\\boxed{\\frac{3}{4}}", "3/4", true),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34", true),
        ("\\boxed{\\tfrac{1}{2}}", "0.5", true),
        ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", true),
        ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", false),
        ("\\boxed{2\\frac{1}{2}}", "\\frac{5}{2}", true),
        ("\\boxed{\\frac{10}{4}}", "2.5", true),
        ("\\boxed{\\frac{1}{3}}", "1/4", false),
        // percentages: p% equals p and p/100
        ("\\boxed{50\\%}", "50\\%", true),
        ("\\boxed{50}", "50\\%", true),
        ("\\boxed{0.5}", "50\\%", true),
        ("\\boxed{50%}", "0.5", true),
        ("\\boxed{0.5}", "50", false),
        ("\\boxed{25\\%}", "50\\%", false),
        // thousands separators
        ("\\boxed{1,234}", "1234", true),
        ("\\boxed{1{,}234{,}567}", "1234567", true),
        ("The answer is $12,000$.", "12000", true),
        ("\\boxed{1,234}", "1243", false),
        // pi and roots
        ("\\boxed{2\\pi}", "2\\pi", true),
        ("\\boxed{\\frac{\\pi}{2}}", "\\frac{1}{2}\\pi", true),
        ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", true),
        ("\\boxed{3.14}", "\\pi", false),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", true),
        ("\\boxed{\\sqrt{16}}", "4", true),
        (
            "\\boxed{\\frac{\\sqrt{3}}{2}}",
            "\\frac{1}{2}\\sqrt{3}",
            true,
        ),
        ("\\boxed{\\sqrt{3}/3}", "\\frac{1}{\\sqrt{3}}", true),
        ("\\boxed{\\sqrt[3]{27}}", "3", true),
        ("\\boxed{\\sqrt{2}}", "1.414", false),
        ("\\boxed{4\\sqrt{3}}", "3\\sqrt{4}", false),
        ("\\boxed{2^{10}}", "1024", true),
        ("\\boxed{(1+2)*3}", "9", true),
        ("\\boxed{3 \\times 10^{3}}", "3000", true),
        ("\\boxed{2^{-1}}", "0.5", true),
        ("\\boxed{4^{1/2}}", "2", true),
        // units and degrees
        ("\\boxed{30^\\circ}", "30", true),
        ("\\boxed{30^{\\circ}}", "30°", true),
        ("\\boxed{12 \\text{ cm}}", "12", true),
        ("\\boxed{12\\text{cm}^2}", "12", true),
        ("\\boxed{5 \\text{ square units}}", "5", true),
        ("\\boxed{45 degrees}", "45^\\circ", true),
        ("\\boxed{30^\\circ}", "60", false),
        ("\\boxed{\\$5.00}", "5", true),
        // x = ...
        ("\\boxed{x = 5}", "5", true),
        ("So $y=-3$.", "-3", true),
        // multiple choice
        ("\\boxed{B}", "B", true),
        ("\\boxed{(B)}", "B", true),
        ("The answer is B.", "(B)", true),
        ("\\boxed{\\text{B}}", "B", true),
        ("\\boxed{(C) 12}", "C", true),
        ("Answer: B. 12", "\\text{B}", true),
        ("\\boxed{C}", "B", false),
        ("\\boxed{12}", "B", false),
        ("<answer>D</answer>", "D", true),
        // text answers
        ("\\boxed{\\text{Monday}}", "monday", true),
        ("\\boxed{x^2 + 1}", "x^2+1", true),
        ("\\boxed{x+1}", "x+2", false),
        ("\\boxed{}", "3", false),
        ("no answer here", "3", false),
    ];

    #[test]
    fn answer_pairs() {
        let mut bad = Vec::new();
        for (i, &(resp, reference, want)) in PAIRS.iter().enumerate() {
            let got = math(resp, reference, 1e-9).unwrap() == 1.0;
            if got != want {
                bad.push(format!(
                    "#{i}: {resp:?} vs {reference:?}: expected {want}, got {got} (answer {:?})",
                    math_answer(resp)
                ));
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
        assert!(PAIRS.len() >= 60);
        assert!(PAIRS.iter().filter(|p| !p.2).count() >= 15);
    }

    #[test]
    fn references_without_an_answer_and_bad_tolerances_are_errors() {
        assert!(math("1", "   ", 1e-9)
            .unwrap_err()
            .contains("no final answer"));
        assert!(math("1", "1", f64::NAN).is_err());
        assert!(math("1", "1", -1.0).is_err());
    }

    #[test]
    fn huge_and_hostile_inputs_end_quickly_and_never_match_by_accident() {
        assert_eq!(math("\\boxed{2^{99999999}}", "1", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{10^{300}*10^{300}}", "1", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{1/0}", "1", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{(-2)^{127}/(-2)^{127}}", "1", 1e-9), Ok(1.0));
        assert_eq!(math("\\boxed{opti\u{20ac}n B}", "B", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{\u{20ac}1,000}", "1000", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{\\sqrt{-4}}", "2", 1e-9), Ok(0.0));
        let nested = |n: usize| format!("\\boxed{{{}1{}}}", "(".repeat(n), ")".repeat(n));
        assert_eq!(math(&nested(40), "1", 1e-9), Ok(1.0));
        // deeper than the evaluator goes: not a number, and no stack overflow
        assert_eq!(math(&nested(100_000), "1", 1e-9), Ok(0.0));
        let long = "9".repeat(100);
        assert_eq!(math(&long, &long, 1e-9), Ok(1.0));
        assert_eq!(math("\\boxed{\\frac{1}{3}}", "0.3333333333", 1e-9), Ok(0.0));
        assert_eq!(math("\\boxed{\\frac{1}{3}}", "0.3333333333", 1e-3), Ok(0.0));
    }
}
