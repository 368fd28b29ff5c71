//! Golden diagnostics: every `tests/in/diag/*.rpx` is checked and its rendered diagnostics
//! (no colour) compared with `tests/out/diag/*.txt`. `BLESS=1` rewrites the expected files.
//!
//! A file named `ok_*.rpx` must compile (its warnings are the golden output); every other file
//! must fail. `five_mistakes.rpx` must get exactly five errors, on five different lines.
//! A checkpoint named in a file is read relative to `tests/in/diag/`.

mod common;

use rollplex_dsl::{compile_source, Env, Severity};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Reads files relative to `tests/in/diag/` (the binary's job in real use).
struct DirEnv(PathBuf);

impl Env for DirEnv {
    fn read_file(&self, path: &str) -> Result<String, String> {
        fs::read_to_string(self.0.join(path)).map_err(|e| e.to_string())
    }
}

/// The golden text of one input: rendered diagnostics and a closing line.
fn render(name: &str, src: &str) -> (String, bool) {
    let env = DirEnv(root().join("in/diag"));
    match compile_source(name, src, &env) {
        Ok(c) => {
            let mut out = c.warnings.render(name, src, false);
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&format!("ok: {}\n", c.warnings.summary(name)));
            (out, true)
        }
        Err(d) => (
            format!("{}\n{}\n", d.render(name, src, false), d.summary(name)),
            false,
        ),
    }
}

fn inputs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(root().join("in/diag"))
        .expect("tests/in/diag exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rpx"))
        .collect();
    v.sort();
    v
}

/// A line diff (longest common subsequence): `-` expected, `+` actual, with two lines of
/// context around each change and `...` between hunks.
fn diff(expected: &str, actual: &str) -> String {
    let a: Vec<&str> = expected.lines().collect();
    let b: Vec<&str> = actual.lines().collect();
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    // (tag, line): ' ' same, '-' expected only, '+' actual only
    let (mut i, mut j, mut ops) = (0, 0, Vec::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            ops.push((' ', a[i]));
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push(('-', a[i]));
            i += 1;
        } else {
            ops.push(('+', b[j]));
            j += 1;
        }
    }
    let near_change = |k: usize| {
        let lo = k.saturating_sub(2);
        let hi = (k + 2).min(ops.len() - 1);
        (lo..=hi).any(|x| ops[x].0 != ' ')
    };
    let mut out = String::new();
    let mut skipped = false;
    for (k, (tag, line)) in ops.iter().enumerate() {
        if near_change(k) {
            if skipped {
                out.push_str("...\n");
                skipped = false;
            }
            out.push_str(&format!("{tag} {line}\n"));
        } else {
            skipped = true;
        }
    }
    out
}

#[test]
fn golden_diagnostics() {
    let bless = common::bless();
    let out_dir = root().join("out/diag");
    let mut failures = Vec::new();
    let inputs = inputs();
    assert!(
        inputs.len() >= 5,
        "expected the diagnostic inputs in tests/in/diag"
    );
    for path in &inputs {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name");
        let name = format!("tests/in/diag/{stem}.rpx");
        let src = fs::read_to_string(path).expect("readable input");
        let (actual, ok) = render(&name, &src);
        let must_pass = stem.starts_with("ok_");
        assert_eq!(
            ok,
            must_pass,
            "{name}: expected it to {}:\n{actual}",
            if must_pass { "compile" } else { "fail" }
        );
        let want_path = out_dir.join(format!("{stem}.txt"));
        if bless {
            fs::create_dir_all(&out_dir).expect("create tests/out/diag");
            fs::write(&want_path, &actual).expect("write golden file");
            continue;
        }
        match fs::read_to_string(&want_path) {
            Ok(want) if want == actual => {}
            Ok(want) => failures.push(format!(
                "{name} differs from {}:\n{}",
                want_path.display(),
                diff(&want, &actual)
            )),
            Err(_) => failures.push(format!(
                "{name}: no expected output {}",
                want_path.display()
            )),
        }
    }
    // No stale golden files.
    if !bless {
        for e in fs::read_dir(&out_dir).expect("tests/out/diag exists") {
            let p = e.expect("dir entry").path();
            let stem = p
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            if !root().join(format!("in/diag/{stem}.rpx")).exists() {
                failures.push(format!(
                    "{} has no input tests/in/diag/{stem}.rpx",
                    p.display()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n\nIf the new output is right, run:\n    BLESS=1 cargo test -p rollplex-tests --test diagnostics\n",
        failures.join("\n\n")
    );
}

#[test]
fn five_mistakes_give_five_located_errors() {
    let path = root().join("in/diag/five_mistakes.rpx");
    let src = fs::read_to_string(&path).expect("five_mistakes.rpx");
    let diags =
        compile_source("five_mistakes.rpx", &src, &DirEnv(root())).expect_err("five mistakes");
    let errors: Vec<_> = diags
        .iter()
        .filter(|d| d.severity == Severity::Error)
        .collect();
    let lines: std::collections::BTreeSet<usize> = errors
        .iter()
        .map(|d| rollplex_dsl::span::line_col(&src, d.span.start).0)
        .collect();
    assert_eq!(
        errors.len(),
        5,
        "{}",
        diags.render("five_mistakes.rpx", &src, false)
    );
    assert_eq!(lines.len(), 5, "five different lines: {lines:?}");
    // each marked line is one the file says holds a mistake
    for l in lines {
        let text = src.lines().nth(l - 1).unwrap_or_default();
        assert!(
            text.contains("// "),
            "line {l} is not a marked mistake: {text}"
        );
    }
}

#[test]
fn every_example_pipeline_checks() {
    // examples/*.rpx are written by several people; each must at least pass the language.
    let dir = root().join("../examples");
    let mut n = 0;
    for e in fs::read_dir(&dir).expect("examples/") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "rpx") {
            let src = fs::read_to_string(&p).expect("readable example");
            let name = p.display().to_string();
            let env = DirEnv(dir.clone());
            if let Err(d) = compile_source(&name, &src, &env) {
                panic!("{}", d.render(&name, &src, false));
            }
            n += 1;
        }
    }
    assert!(n >= 1, "no example pipelines found");
}
