//! Diagnostics: what went wrong, where, and what would be valid; rendered the way rustc does
//! (a `file:line:col` header, the source line, an underline, a help line).
//!
//! Rendering is hand-written (no terminal-width or Unicode-width guessing) so that golden files
//! stay byte-stable: tabs print as four spaces, columns count characters, and a span that runs
//! over several lines is underlined to the end of its first line.

use crate::span::{LineIndex, Span};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// The job cannot be compiled; the binary exits with 1.
    Error,
    /// The job compiles, but probably not as meant.
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// One located message.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    pub severity: Severity,
    /// The headline: what is wrong ("unknown key `micro_bach` in `train`").
    pub message: String,
    /// The byte range it is about.
    pub span: Span,
    /// Short text printed under the underline ("not a key of `train`"); may be empty.
    pub label: String,
    /// What would be valid ("did you mean `micro_batch`?", "expected one of: serial, overlap").
    pub help: Option<String>,
    /// A stable kebab-case name of the check ("unknown-key", "tp-divides"), for tests and docs.
    pub code: &'static str,
}

impl Diagnostic {
    pub fn error(code: &'static str, span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            message: message.into(),
            span,
            label: String::new(),
            help: None,
            code,
        }
    }

    pub fn warning(code: &'static str, span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(code, span, message)
        }
    }

    pub fn with_label(mut self, label: impl Into<String>) -> Diagnostic {
        self.label = label.into();
        self
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Diagnostic {
        self.help = Some(help.into());
        self
    }

    pub fn with_help_opt(mut self, help: Option<String>) -> Diagnostic {
        self.help = help;
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// This diagnostic, rendered against its source.
    pub fn render(&self, file_name: &str, src: &str, color: bool) -> String {
        let mut out = String::new();
        let lines = LineIndex::new(src);
        render_head_and_source(&mut out, file_name, src, &lines, self, color, true);
        out
    }
}

/// How many diagnostics [`Diagnostics::render`] prints; the rest are counted.
pub const MAX_RENDERED: usize = 50;

/// Every diagnostic of one file, in source order (errors and warnings together).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn new() -> Diagnostics {
        Diagnostics(Vec::new())
    }

    pub fn push(&mut self, d: Diagnostic) {
        self.0.push(d);
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Diagnostic> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn error_count(&self) -> usize {
        self.0.iter().filter(|d| d.is_error()).count()
    }

    pub fn warning_count(&self) -> usize {
        self.0.len() - self.error_count()
    }

    pub fn has_errors(&self) -> bool {
        self.error_count() > 0
    }

    /// Sorts by position (stable: diagnostics at the same place keep their order) and drops
    /// exact duplicates.
    pub fn sort(&mut self) {
        self.0.sort_by_key(|d| (d.span.start, d.span.end));
        self.0.dedup();
    }

    /// The first [`MAX_RENDERED`] diagnostics, each as a block, separated by blank lines, then
    /// a line counting the rest (`... and 12 more: 10 errors, 2 warnings`). Linear in the
    /// number shown: lines come from one [`LineIndex`] of `src`.
    pub fn render(&self, file_name: &str, src: &str, color: bool) -> String {
        let mut out = String::new();
        let lines = LineIndex::new(src);
        for (i, d) in self.0.iter().take(MAX_RENDERED).enumerate() {
            if i > 0 {
                out.push('\n');
            }
            render_head_and_source(&mut out, file_name, src, &lines, d, color, true);
        }
        if let Some(rest) = self.0.get(MAX_RENDERED..).filter(|r| !r.is_empty()) {
            let errors = rest.iter().filter(|d| d.is_error()).count();
            let plural = |n: usize, w: &str| format!("{n} {w}{}", if n == 1 { "" } else { "s" });
            out.push_str(&format!(
                "\n... and {} more: {}, {}\n",
                rest.len(),
                plural(errors, "error"),
                plural(rest.len() - errors, "warning")
            ));
        }
        out
    }

    /// One closing line: "`f.rpx`: 5 errors, 1 warning".
    pub fn summary(&self, file_name: &str) -> String {
        let plural = |n: usize, w: &str| format!("{n} {w}{}", if n == 1 { "" } else { "s" });
        format!(
            "{file_name}: {}, {}",
            plural(self.error_count(), "error"),
            plural(self.warning_count(), "warning")
        )
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.0 {
            writeln!(f, "{}[{}]: {}", d.severity.as_str(), d.code, d.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

impl IntoIterator for Diagnostics {
    type Item = Diagnostic;
    type IntoIter = std::vec::IntoIter<Diagnostic>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Renders one error in the same style, for a caller (the compiler) that found a problem
/// the language could not: `render_one("job.rpx", src, spans.get("train.tp").unwrap(),
/// "does not fit in HBM by 12.3 GiB", Some("raise train.tp"))`.
pub fn render_one(
    file_name: &str,
    src: &str,
    span: Span,
    message: &str,
    help: Option<&str>,
) -> String {
    let d = Diagnostic::error("compile", span, message).with_help_opt(help.map(str::to_string));
    let mut out = String::new();
    let lines = LineIndex::new(src);
    render_head_and_source(&mut out, file_name, src, &lines, &d, false, false);
    out
}

const RED: &str = "\x1b[1;31m";
const YELLOW: &str = "\x1b[1;33m";
const BLUE: &str = "\x1b[1;34m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

fn render_head_and_source(
    out: &mut String,
    file_name: &str,
    src: &str,
    lines: &LineIndex,
    d: &Diagnostic,
    color: bool,
    with_code: bool,
) {
    let paint = |c: &str, s: &str| {
        if color {
            format!("{c}{s}{RESET}")
        } else {
            s.to_string()
        }
    };
    let sev_color = match d.severity {
        Severity::Error => RED,
        Severity::Warning => YELLOW,
    };
    let head = if with_code {
        format!("{}[{}]", d.severity.as_str(), d.code)
    } else {
        d.severity.as_str().to_string()
    };
    out.push_str(&paint(sev_color, &head));
    out.push_str(&paint(BOLD, &format!(": {}", d.message)));
    out.push('\n');

    let start = d.span.start.min(src.len());
    let (line, col) = lines.line_col(src, start);
    let gutter = line.to_string().len();
    let pad = " ".repeat(gutter);
    out.push_str(&format!(
        "{pad}{} {file_name}:{line}:{col}\n",
        paint(BLUE, "-->")
    ));
    out.push_str(&format!("{pad} {}\n", paint(BLUE, "|")));

    // The source line holding the span start.
    let line_start = src[..floor_boundary(src, start)]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let line_end = src[line_start..]
        .find('\n')
        .map_or(src.len(), |i| line_start + i);
    let text = src[line_start..line_end].trim_end_matches('\r');
    let shown = expand_tabs(text);
    out.push_str(&format!(
        "{} {} {}\n",
        paint(BLUE, &line.to_string()),
        paint(BLUE, "|"),
        shown
    ));

    // Underline: from the start column to the span end (clipped to this line), at least one.
    let s = floor_boundary(src, start).max(line_start) - line_start;
    let e =
        floor_boundary(src, d.span.end.min(line_start + text.len())).max(line_start) - line_start;
    let lead = expand_tabs(&text[..s.min(text.len())]).chars().count();
    let width = if e > s {
        expand_tabs(&text[s..e]).chars().count()
    } else {
        0
    }
    .max(1);
    let marks = "^".repeat(width);
    let mut under = format!("{}{}", " ".repeat(lead), paint(sev_color, &marks));
    if !d.label.is_empty() {
        under.push(' ');
        under.push_str(&paint(sev_color, &d.label));
    }
    out.push_str(&format!("{pad} {} {under}\n", paint(BLUE, "|")));
    if let Some(h) = &d.help {
        for (i, hl) in h.lines().enumerate() {
            if i == 0 {
                out.push_str(&format!(
                    "{pad} {} {}: {hl}\n",
                    paint(BLUE, "="),
                    paint(BOLD, "help")
                ));
            } else {
                out.push_str(&format!("{pad}         {hl}\n"));
            }
        }
    }
}

fn floor_boundary(src: &str, mut i: usize) -> usize {
    i = i.min(src.len());
    while !src.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn expand_tabs(s: &str) -> String {
    s.replace('\t', "    ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_header_line_and_underline() {
        let src = "pipeline p {\n  train {\n    micro_bach = 4\n  }\n}\n";
        let start = src.find("micro_bach").unwrap();
        let d = Diagnostic::error(
            "unknown-key",
            Span::new(start, start + 10),
            "unknown key `micro_bach` in `train`",
        )
        .with_label("not a key of `train`")
        .with_help("did you mean `micro_batch`?");
        let r = d.render("p.rpx", src, false);
        assert_eq!(
            r,
            "error[unknown-key]: unknown key `micro_bach` in `train`\n \
             --> p.rpx:3:5\n  |\n3 |     micro_bach = 4\n  |     ^^^^^^^^^^ not a key of `train`\n  \
             = help: did you mean `micro_batch`?\n"
        );
    }

    #[test]
    fn empty_span_at_end_of_file_gets_one_caret() {
        let src = "pipeline p {";
        let d = Diagnostic::error("syntax", Span::new(12, 12), "missing `}`");
        let r = d.render("p.rpx", src, false);
        assert!(r.contains("1 | pipeline p {\n  |             ^\n"), "{r}");
    }

    #[test]
    fn tabs_keep_the_caret_aligned() {
        let src = "\tx = 1";
        let d = Diagnostic::error("t", Span::new(1, 2), "m");
        let r = d.render("f", src, false);
        assert!(r.contains("1 |     x = 1\n  |     ^\n"), "{r}");
        assert!(r.contains("f:1:2"), "{r}");
    }

    #[test]
    fn render_one_has_no_code_and_color_adds_escapes() {
        let src = "a = 1\n";
        let r = render_one(
            "f.rpx",
            src,
            Span::new(0, 1),
            "does not fit",
            Some("raise tp"),
        );
        assert!(
            r.starts_with("error: does not fit\n --> f.rpx:1:1\n"),
            "{r}"
        );
        assert!(r.ends_with("= help: raise tp\n"), "{r}");
        let d = Diagnostics(vec![Diagnostic::warning("w", Span::new(0, 1), "hm")]);
        assert!(d.render("f", src, true).contains("\x1b["));
        assert!(!d.render("f", src, false).contains("\x1b["));
        assert_eq!(d.summary("f"), "f: 0 errors, 1 warning");
    }
}
