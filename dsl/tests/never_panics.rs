//! The parser and checker never panic, on any input: random bytes, token soup, and valid
//! files with random edits. Every diagnostic they return lies inside the source and renders.

use proptest::prelude::*;
use rollplex_dsl::{compile_source, MemFiles, Span};

const TINY: &str = include_str!("../../examples/tiny.rpx");

/// Every shipped example pipeline.
const EXAMPLES: [&str; 5] = [
    TINY,
    include_str!("../../examples/tiny-h200.rpx"),
    include_str!("../../examples/h200-3b-video.rpx"),
    include_str!("../../examples/paper-7b-32xh800.rpx"),
    include_str!("../../examples/paper-32b-32xh800.rpx"),
];

/// A file that touches every section and most literal kinds.
const FULL: &str = r#"
const G = 8
const BATCH = 4 * G
/* block comment */
pipeline full {
    seed = 3
    gpu { preset = H800, count = 32, gpus_per_node = 8, nvlink = 200GB/s, ib = 50GB/s }
    model actor {
        checkpoint = "ckpt"
        dtype = bf16
        vision { depth = 32 }
        text { rope_theta = 1e6 }
        tokens { eos = [151645, 151643] }
    }
    reference = on
    rollout {
        tp = 4
        prompts = BATCH
        group = G
        media = image(size = 448x448, count = 2)
        text_tokens = 128
        max_new_tokens = 1024
        response_length = lognormal(median = 256, sigma = 0.6)
        sampling { temperature = 0.9, top_p = 0.95, top_k = 50, stop = [151645], forced_lengths = off }
        dataset = file("data/train.jsonl")
    }
    reward = command(["python3", "reward.py"], timeout = 30s)
    train {
        tp = 4
        algorithm = ppo_clip(clip_low = 0.2, clip_high = 0.28, kl_coef = 0.0, kl = k1, loss_agg = seq_mean_token_mean)
        optimizer = adamw {
            lr = 1e-6
            betas = (0.9, 0.95)
            schedule = cosine(warmup = 10, total = 1000, min_lr_ratio = 0.1)
        }
        micro_batch = 8
        mini_batch = 64
        epochs = 2
        freeze = [vision, merger]
        recompute = full
    }
    schedule { mode = disaggregated, prefix_dedup = off, decode_window = 32, memory = 70GiB, host_memory = 256GiB }
}
"#;

const CONFIG: &str = r#"{"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
  "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
  "rope_scaling": {"mrope_section": [16, 24, 24]}, "tie_word_embeddings": false,
  "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
  "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 3584}}"#;

fn env() -> MemFiles {
    let mut m = MemFiles::default();
    m.0.insert("ckpt/config.json".into(), CONFIG.into());
    m
}

/// Checks and renders; asserts every span is inside the source.
fn run(src: &str) {
    let env = env();
    let diags = match compile_source("fuzz.rpx", src, &env) {
        Ok(c) => {
            for (_, s) in c.spans.iter() {
                assert_span(src, s);
            }
            c.warnings
        }
        Err(d) => {
            assert!(d.has_errors(), "Err without an error");
            d
        }
    };
    for d in diags.iter() {
        assert_span(src, d.span);
    }
    let _ = diags.render("fuzz.rpx", src, false);
    let _ = diags.render("fuzz.rpx", src, true);
}

fn assert_span(src: &str, s: Span) {
    assert!(
        s.start <= s.end && s.end <= src.len(),
        "span {s:?} outside a source of {} bytes",
        src.len()
    );
}

#[test]
fn the_full_file_compiles() {
    if let Err(d) = compile_source("full.rpx", FULL, &env()) {
        panic!("{}", d.render("full.rpx", FULL, false));
    }
}

const TOKENS: &[&str] = &[
    "pipeline", "const", "gpu", "model", "actor", "rollout", "train", "schedule", "reward", "=",
    "{", "}", "(", ")", "[", "]", ",", "\n", " ", "\"", "//", "/*", "*/", "1", "-", "*", "/", "+",
    "0.5", "1e-6", "80GiB", "4.8TB/s", "30s", "448x448", "on", "off", "grpo", "video", "tp", "x",
    "G", "\\", "é", "\t",
];

fn mutate(base: &str, edits: &[(u8, usize, usize, usize)]) -> String {
    let mut s = base.to_string();
    for &(kind, a, b, t) in edits {
        if s.is_empty() {
            s.push_str(TOKENS[t % TOKENS.len()]);
            continue;
        }
        let mut i = a % (s.len() + 1);
        while !s.is_char_boundary(i) {
            i -= 1;
        }
        let mut j = (i + b % 40).min(s.len());
        while !s.is_char_boundary(j) {
            j -= 1;
        }
        match kind % 4 {
            0 => s.replace_range(i..j, ""),
            1 => s.insert_str(i, TOKENS[t % TOKENS.len()]),
            2 => s.replace_range(i..j, TOKENS[t % TOKENS.len()]),
            _ => {
                let piece = s[i..j].to_string();
                s.insert_str(j, &piece);
            }
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        run(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn token_soup_never_panics(toks in proptest::collection::vec(0..TOKENS.len(), 0..120)) {
        let s: String = toks.iter().map(|&t| TOKENS[t]).collect::<Vec<_>>().join(" ");
        run(&s);
    }

    #[test]
    fn mutated_tiny_never_panics(edits in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>(), any::<usize>()), 1..6)) {
        run(&mutate(TINY, &edits));
    }

    #[test]
    fn mutated_examples_never_panic(which in 0..EXAMPLES.len(), edits in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>(), any::<usize>()), 1..6)) {
        run(&mutate(EXAMPLES[which], &edits));
    }

    #[test]
    fn mutated_full_never_panics(edits in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>(), any::<usize>()), 1..6)) {
        run(&mutate(FULL, &edits));
    }
}

#[test]
fn pathological_nesting_is_refused_not_overflowed() {
    let deep_parens = format!(
        "pipeline p {{ x = {}1{} }}",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    run(&deep_parens);
    let deep_blocks = format!("pipeline p {{ {} }}", "a { ".repeat(10_000));
    run(&deep_blocks);
    let long_chain = format!("const A = 1{}\npipeline p {{ }}", " + 1".repeat(100_000));
    run(&long_chain);
    let negs = format!("const A = {}1\npipeline p {{ }}", "-".repeat(100_000));
    run(&negs);
    let unbalanced = format!("pipeline p {{ x = {} }}", "[(".repeat(50_000));
    run(&unbalanced);
}

#[test]
fn extreme_values_are_errors_not_panics() {
    let max = u32::MAX;
    let cases = [
        format!("pipeline p {{ gpu {{ preset = H200 }} model actor {{ preset = tiny }} rollout {{ prompts = {max}, group = {max}, max_new_tokens = {max} }} reward = builtin(\"exact_match\"), train {{ micro_batch = {max}, tp = {max} }} }}"),
        format!("pipeline p {{ gpu {{ preset = H200, count = {max} }} model actor {{ vision {{ depth = {max}, hidden = {max}, heads = {max}, ffn = {max}, full_attention = [{max}], patch = {max}, merge = {max}, temporal_patch = {max}, window = {max}, in_channels = {max} }} text {{ layers = {max}, hidden = {max}, heads = {max}, kv_heads = {max}, ffn = {max}, vocab = {max}, mrope = [{max}, {max}, {max}] }} }} rollout {{ tp = {max}, prompts = 1, group = 2, max_new_tokens = 1, media = video(frames = {max}, size = {max}x{max}) }} reward = builtin(\"exact_match\"), train {{ micro_batch = 1 }} schedule {{ mode = disaggregated, memory = 1e300GiB }} }}"),
        "pipeline p { gpu { preset = cpu } model actor { preset = tiny, text { heads = 3, kv_heads = 2 } } rollout { prompts = 1, group = 2, max_new_tokens = 1 } reward = builtin(\"exact_match\"), train { micro_batch = 1 } }".to_string(),
    ];
    for src in &cases {
        run(src);
        assert!(compile_source("x.rpx", src, &env()).is_err(), "{src}");
    }
    // a config.json with zero dimensions is an error at the checkpoint, not a division by zero
    let mut e = env();
    e.0.insert(
        "zero/config.json".into(),
        CONFIG
            .replace("\"num_key_value_heads\": 4", "\"num_key_value_heads\": 0")
            .replace("\"depth\": 32", "\"depth\": 0"),
    );
    let src = "pipeline p { gpu { preset = H200 } model actor { checkpoint = \"zero\" } rollout { prompts = 1, group = 2, max_new_tokens = 1 } reward = builtin(\"exact_match\"), train { micro_batch = 1, tp = 2 } }";
    let d = compile_source("z.rpx", src, &e).expect_err("zero dims");
    let text = d.render("z.rpx", src, false);
    assert!(text.contains("`text.kv_heads` = 0"), "{text}");
    assert!(text.contains("`vision.depth` = 0"), "{text}");
}
