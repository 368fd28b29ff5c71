//! Golden plans. Each `tests/in/plans/NAME.rpx` compiles to `tests/out/plans/NAME.yaml`, and
//! each `examples/NAME.rpx` to its checked-in `examples/NAME.plan.yaml`. A mismatch prints the
//! first differing lines and the command that refreshes the file; `BLESS=1` rewrites them all.
mod common;

use rollplex_compiler::{compile, Options};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is inside the workspace")
        .to_path_buf()
}

struct Dir(PathBuf);

impl rollplex_dsl::Env for Dir {
    fn read_file(&self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(self.0.join(path)).map_err(|e| e.to_string())
    }
}

/// What `rollplexc FILE --emit-yaml OUT` writes (the ILP stops on a node limit, not the clock,
/// so the answer does not depend on the machine or its load: `ilp::MAX_NODES`).
fn compile_yaml(file: &Path) -> String {
    let src = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let name = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let env = Dir(file.parent().map(Path::to_path_buf).unwrap_or_default());
    let checked = rollplex_dsl::compile_source(&name, &src, &env)
        .unwrap_or_else(|d| panic!("{}", d.render(&name, &src, false)));
    let c = compile(&checked.spec, &Options::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    rollplex_plan::to_yaml(&c.plan).expect("plans serialise")
}

/// The first `n` lines where `a` and `b` differ, numbered.
fn first_differences(a: &str, b: &str, n: usize) -> String {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let mut out = String::new();
    let mut shown = 0;
    for i in 0..la.len().max(lb.len()) {
        let (x, y) = (la.get(i).copied(), lb.get(i).copied());
        if x != y {
            out.push_str(&format!(
                "  line {}:\n    - {}\n    + {}\n",
                i + 1,
                x.unwrap_or("<end>"),
                y.unwrap_or("<end>")
            ));
            shown += 1;
            if shown == n {
                break;
            }
        }
    }
    out
}

/// Compares (or with BLESS=1 rewrites) every `(input, expected)` pair; fails listing all stale files.
fn check(pairs: &[(PathBuf, PathBuf)], refresh: impl Fn(&Path, &Path) -> String) {
    let bless = common::bless();
    let mut stale = Vec::new();
    for (input, expected) in pairs {
        let got = compile_yaml(input);
        if bless {
            std::fs::write(expected, &got)
                .unwrap_or_else(|e| panic!("{}: {e}", expected.display()));
            continue;
        }
        let want = std::fs::read_to_string(expected).unwrap_or_default();
        if want != got {
            stale.push(format!(
                "{} is stale (or missing) for {}:\n{}  refresh: {}\n",
                expected.strip_prefix(root()).unwrap_or(expected).display(),
                input.strip_prefix(root()).unwrap_or(input).display(),
                first_differences(&want, &got, 8),
                refresh(input, expected)
            ));
        }
    }
    assert!(stale.is_empty(), "{} golden plan(s) differ:\n{}\nor rewrite them all: BLESS=1 cargo test -p rollplex-tests --test plans", stale.len(), stale.join("\n"));
}

fn rpx_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "rpx"))
        .collect();
    v.sort();
    v
}

#[test]
fn golden_plans() {
    let out = root().join("tests/out/plans");
    let pairs: Vec<(PathBuf, PathBuf)> = rpx_files(&root().join("tests/in/plans"))
        .into_iter()
        .map(|p| {
            let stem = p
                .file_stem()
                .expect("a file name")
                .to_string_lossy()
                .to_string();
            (p, out.join(format!("{stem}.yaml")))
        })
        .collect();
    assert!(
        pairs.len() >= 5,
        "expected the golden inputs under tests/in/plans"
    );
    check(&pairs, |_, _| {
        "BLESS=1 cargo test -p rollplex-tests --test plans".to_string()
    });
}

#[test]
fn example_plans_are_fresh() {
    let pairs: Vec<(PathBuf, PathBuf)> = rpx_files(&root().join("examples"))
        .into_iter()
        .map(|p| {
            let stem = p
                .file_stem()
                .expect("a file name")
                .to_string_lossy()
                .to_string();
            let out = p.with_file_name(format!("{stem}.plan.yaml"));
            (p, out)
        })
        .collect();
    assert!(pairs.len() >= 4, "expected the example pipelines");
    check(&pairs, |i, o| {
        let rel = |p: &Path| p.strip_prefix(root()).unwrap_or(p).display().to_string();
        format!(
            "cargo run -p rollplex-compiler --bin rollplexc -- {} --emit-yaml {}",
            rel(i),
            rel(o)
        )
    });
}

#[test]
fn compiling_twice_gives_the_same_plan() {
    let f = root().join("examples/paper-32b-32xh800.rpx");
    assert_eq!(compile_yaml(&f), compile_yaml(&f));
}

/// A search long enough to need a limit stops where the node limit says, whatever the clock:
/// the 32B example with 4,096-token responses takes ~68 s to solve to optimality (2-core
/// workspace machine), so with the clock deciding (the old 2 s default, or these two limits with
/// the old 20,000-node cap) the two compiles below would stop at different incumbents.
#[test]
fn a_long_search_stops_at_the_same_plan_under_any_time_limit() {
    let f = root().join("examples/paper-32b-32xh800.rpx");
    let src = std::fs::read_to_string(&f).unwrap();
    assert!(
        src.contains("max_new_tokens = 1024"),
        "{}: the test edits that line",
        f.display()
    );
    let src = src.replace("max_new_tokens = 1024", "max_new_tokens = 4096");
    let env = Dir(f.parent().unwrap().to_path_buf());
    let checked = rollplex_dsl::compile_source("long.rpx", &src, &env)
        .unwrap_or_else(|d| panic!("{}", d.render("long.rpx", &src, false)));
    let plan_with = |limit: f64| {
        let opts = Options {
            time_limit_s: limit,
            ..Options::default()
        };
        let c = compile(&checked.spec, &opts).unwrap();
        assert_eq!(
            c.plan.solver.status,
            rollplex_plan::SolveStatus::TimeLimit,
            "this search is meant to reach the node limit"
        );
        rollplex_plan::to_yaml(&c.plan).unwrap()
    };
    let a = plan_with(120.0);
    let b = plan_with(240.0);
    assert!(a == b, "{}", first_differences(&a, &b, 5));
}
