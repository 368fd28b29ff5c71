//! The `.rpx` pipeline language: text in, a checked [`JobSpec`] (or every problem of the
//! file, located) out.
//!
//! ```text
//! source ──parser──▶ ast::File ──resolve──▶ JobSpec ──checks──▶ Checked
//!          (pest,       (consts, tables,      (cross-field:
//!         recovering)    presets, config.json)  TP, batches, memory…)
//! ```
//!
//! [`compile_source`] is the entry point. The language is documented in docs/language.md.
//!
//! Invariants: pure — the only input besides the source text is [`Env::read_file`], which the
//! caller implements (used for a checkpoint's config.json); no GPU, no filesystem. Never
//! panics on any input. Every error of a file is reported, each with a span; a job with an
//! error yields no spec.

pub mod ast;
mod checks;
pub mod diag;
pub mod eval;
pub mod limits;
pub mod memory;
mod model;
pub mod parser;
pub mod presets;
mod resolve;
pub mod span;
pub mod suggest;
mod table;
pub mod units;

pub use diag::{render_one, Diagnostic, Diagnostics, Severity};
pub use span::{Span, SpanMap};

use rollplex_plan::spec::JobSpec;

/// IO at the edge: the binary reads files, the dsl never does.
pub trait Env {
    /// The text of the file at `path` (used for `<checkpoint>/config.json`); the error is a
    /// message for the user ("No such file or directory").
    fn read_file(&self, path: &str) -> Result<String, String>;
}

/// An [`Env`] with no files: any `checkpoint = ...` is an error.
pub struct NoFiles;

impl Env for NoFiles {
    fn read_file(&self, path: &str) -> Result<String, String> {
        Err(format!("no file `{path}` (this tool reads no files)"))
    }
}

/// An [`Env`] over an in-memory map of path -> text (tests, tools).
#[derive(Clone, Debug, Default)]
pub struct MemFiles(pub std::collections::BTreeMap<String, String>);

impl Env for MemFiles {
    fn read_file(&self, path: &str) -> Result<String, String> {
        self.0
            .get(path)
            .cloned()
            .ok_or_else(|| "No such file or directory".to_string())
    }
}

/// A checked job.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub spec: JobSpec,
    /// Where each part of the spec was written (for the compiler's own diagnostics).
    pub spans: SpanMap,
    /// Warnings: the job is valid, but probably not as meant. Render with
    /// `warnings.render(file_name, src, color)`.
    pub warnings: Diagnostics,
}

/// Parses and checks one `.rpx` file. `file_name` is only used in messages' context by the
/// caller (rendering takes it again); errors come back with every warning of the file too,
/// sorted by position.
pub fn compile_source(file_name: &str, src: &str, env: &dyn Env) -> Result<Checked, Diagnostics> {
    let _ = file_name;
    let (file, parse_diags) = parser::parse(src);
    let mut cx = table::Cx::new(src);
    cx.diags = parse_diags;
    let spec = resolve::resolve(&mut cx, &file, env);
    if let Some(spec) = &spec {
        checks::check(&mut cx, spec);
    }
    for (from, to) in resolve::SPEC_ALIASES {
        if let Some(s) = cx.spans.get_exact(from) {
            cx.spans.insert(to, s);
        }
    }
    let mut diags = Diagnostics(cx.diags);
    diags.sort();
    match spec {
        Some(spec) if !diags.has_errors() && !file.broken => Ok(Checked {
            spec,
            spans: cx.spans,
            warnings: diags,
        }),
        _ => {
            if !diags.has_errors() {
                // unreachable in practice (a broken file has reported its syntax error), but
                // never hand out a spec from a file we could not read whole
                diags.push(Diagnostic::error(
                    "syntax",
                    Span::new(0, 0),
                    "this file could not be parsed",
                ));
            }
            Err(diags)
        }
    }
}
