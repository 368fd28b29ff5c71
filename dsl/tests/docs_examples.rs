//! Every full example in docs/language.md (each ```rpx block holding a `pipeline`) compiles,
//! and examples/tiny.rpx compiles to the job the docs describe.

use rollplex_dsl::{compile_source, MemFiles};
use rollplex_plan::spec::{Algorithm, MediaSpec, Mode};

const DOC: &str = include_str!("../../docs/language.md");
const TINY: &str = include_str!("../../examples/tiny.rpx");

/// The released Qwen2.5-VL-3B-Instruct config.json, abridged to the fields that are read.
const QWEN3B: &str = r#"{"eos_token_id": 151645, "hidden_size": 2048, "intermediate_size": 11008,
  "max_position_embeddings": 128000, "num_attention_heads": 16, "num_hidden_layers": 36,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": true,
  "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
  "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
  "fullatt_block_indexes": [7, 15, 23, 31], "temporal_patch_size": 2},
  "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}"#;

fn rpx_blocks(doc: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in doc.lines() {
        match (&mut cur, line.trim_start()) {
            (None, l) if l.starts_with("```rpx") => cur = Some(String::new()),
            (Some(_), l) if l.starts_with("```") => {
                if let Some(b) = cur.take() {
                    out.push(b);
                }
            }
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

#[test]
fn full_examples_in_the_docs_compile() {
    let mut env = MemFiles::default();
    env.0.insert(
        "models/Qwen2.5-VL-3B-Instruct/config.json".into(),
        QWEN3B.into(),
    );
    // a full example has a pipeline whose body is written out (not `{ ... }`)
    let blocks: Vec<String> = rpx_blocks(DOC)
        .into_iter()
        .filter(|b| b.contains("pipeline ") && !b.contains("{ ... }"))
        .collect();
    assert!(blocks.len() >= 4, "found {} full examples", blocks.len());
    let mut bad = Vec::new();
    for b in &blocks {
        if let Err(d) = compile_source("doc.rpx", b, &env) {
            bad.push(format!("{b}\n{}", d.render("doc.rpx", b, false)));
        }
    }
    assert!(
        bad.is_empty(),
        "docs examples that do not compile:\n{}",
        bad.join("\n\n")
    );
}

#[test]
fn the_tiny_example_is_what_the_docs_say() {
    let c = compile_source("tiny.rpx", TINY, &MemFiles::default()).expect("tiny.rpx compiles");
    assert!(
        c.warnings.is_empty(),
        "{}",
        c.warnings.render("tiny.rpx", TINY, false)
    );
    let s = &c.spec;
    assert_eq!(s.cluster.gpu.name, "cpu");
    assert_eq!(s.actor.name, "tiny");
    assert_eq!(s.rollout.group_size, 16);
    assert_eq!(s.rollout.prompts_per_iter, 8);
    assert_eq!(
        s.rollout.media,
        MediaSpec::Video {
            frames: 4,
            height: 56,
            width: 56
        }
    );
    assert_eq!(s.schedule.mode, Mode::Overlap);
    assert!(matches!(s.train.algorithm, Algorithm::Grpo(_)));
    assert_eq!(s.train.mini_batch, 128);
    // the tiny model is tiny: well under a million parameters
    assert!(s.actor.param_count().total() < 1_000_000);
    // spans point at what set each value
    let at = |p: &str| {
        let sp = c.spans.get(p).expect("span");
        &TINY[sp.start..sp.end]
    };
    assert_eq!(at("rollout.group"), "G");
    assert_eq!(at("rollout.group_size"), "G");
    assert_eq!(at("cluster.gpu.hbm_bytes"), "cpu");
    assert_eq!(at("actor.text.heads"), "tiny");
    assert_eq!(at("train.optimizer.lr"), "1e-3");
    assert_eq!(at("train.tp"), "train");
}
