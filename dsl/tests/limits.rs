//! The language's limits: counts that would take the compiler's time or memory away are located
//! errors naming the limit and the value, and a file full of mistakes is checked and rendered in
//! time linear in its size, its report capped.

use rollplex_dsl::{compile_source, Diagnostics, NoFiles};
use std::time::{Duration, Instant};

const TINY: &str = include_str!("../../examples/tiny.rpx");

/// The tiny example with `from` replaced by `to` (once).
fn tiny_with(from: &str, to: &str) -> String {
    assert!(TINY.contains(from), "{from:?} not in tiny.rpx");
    TINY.replacen(from, to, 1)
}

/// The errors of `src`, rendered; fails if it compiles.
#[track_caller]
fn errors(src: &str) -> (Diagnostics, String) {
    let d = compile_source("t.rpx", src, &NoFiles).expect_err("must be refused");
    let text = d.render("t.rpx", src, false);
    (d, text)
}

#[track_caller]
fn line_of(src: &str, needle: &str) -> usize {
    src.lines()
        .position(|l| l.contains(needle))
        .expect("needle in source")
        + 1
}

#[test]
fn counts_above_their_limit_are_located_errors() {
    for (from, to, needle) in [
        (
            "const PROMPTS = 8 ",
            "const PROMPTS = 16384 ",
            "is 16384, above the limit of 4096",
        ),
        (
            "preset = cpu ",
            "preset = cpu, count = 5000 ",
            "is 5000, above the limit of 4096",
        ),
        (
            "frames = 4,",
            "frames = 100000,",
            "is 100000, above the limit of 4096",
        ),
        (
            "micro_batch = G ",
            "epochs = 1000000\n        micro_batch = G ",
            "is 1000000, above the limit of 64",
        ),
    ] {
        let src = tiny_with(from, to);
        let t = Instant::now();
        let (d, text) = errors(&src);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{to}: {:?}",
            t.elapsed()
        );
        assert!(d.iter().any(|d| d.code == "limit"), "{to}: {text}");
        assert!(text.contains(needle), "{to}: {text}");
        assert!(text.contains("t.rpx:"), "located: {text}");
    }
    // 1e6 is a number, not a count: refused as such, without allocating for it.
    let (_, text) = errors(&tiny_with("const PROMPTS = 8 ", "const PROMPTS = 1e6 "));
    assert!(text.contains("prompts"), "{text}");
    // Each under its own limit, too many together.
    let src = tiny_with("const PROMPTS = 8 ", "const PROMPTS = 4096 ").replacen(
        "const G = 16 ",
        "const G = 32 ",
        1,
    );
    let (_, text) = errors(&src);
    assert!(
        text.contains("131072 samples per iteration, above the limit of 65536"),
        "{text}"
    );
    let src = tiny_with("micro_batch = G ", "epochs = 64\n        micro_batch = 1 ").replacen(
        "const PROMPTS = 8 ",
        "const PROMPTS = 16 ",
        1,
    );
    let (_, text) = errors(&src);
    assert!(
        text.contains("are 16384 micro-batch steps per iteration, above the limit of 8192"),
        "{text}"
    );
    let at = line_of(&src, "micro_batch = 1 ");
    assert!(
        text.contains(&format!("t.rpx:{at}:")),
        "at micro_batch: {text}"
    );
}

#[test]
fn gpus_per_node_may_not_exceed_count() {
    let src = tiny_with("count = 1", "count = 2, gpus_per_node = 4");
    let (_, text) = errors(&src);
    assert!(
        text.contains("`gpus_per_node` in gpu is 4, more than the 2 GPUs"),
        "{text}"
    );
    let at = line_of(&src, "gpus_per_node = 4");
    assert!(text.contains(&format!("t.rpx:{at}:")), "{text}");
}

#[test]
fn many_diagnostics_cost_linear_time_and_print_capped() {
    // 64,000 duplicate keys in one section, on separate lines and then all on one line.
    for sep in ["\n        ", ", "] {
        let dups = vec!["seed = 1"; 64_000].join(sep);
        let src = tiny_with("seed = 1", &dups);
        let t = Instant::now();
        let (d, text) = errors(&src);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{:?} for 64,000 diagnostics",
            t.elapsed()
        );
        assert_eq!(
            d.iter().filter(|d| d.code == "duplicate-key").count(),
            63_999
        );
        assert!(
            text.contains("... and 63949 more: 63949 errors, 0 warnings"),
            "{}",
            &text[text.len().saturating_sub(300)..]
        );
        assert_eq!(text.matches("error[duplicate-key]").count(), 50);
    }
}
