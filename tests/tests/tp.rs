//! Tensor parallelism on the CPU backend (ranks as threads): TP=2 and TP=4 give the single-rank
//! model's results within a stated tolerance (the row-parallel all-reduce adds partial dot
//! products in another order than one matmul), greedy tokens are identical, TP=1 is bitwise the
//! single-rank model, two runs at one degree are bitwise equal, shard -> unshard is bitwise, and
//! a rollout's log-probs (from decode logits) are bitwise those of the scoring pass.
//!
//! The tiny config has 4 query heads and 2 kv heads (TP=4 replicates each kv head on two ranks;
//! a variant with 4 kv heads splits them), 4 vision heads, and a vocabulary (302) and text MLP
//! (66) that TP=4 splits unevenly. Run with `--nocapture` to see the measured errors.

use std::sync::Arc;

use rollplex_plan::models::TestModel;
use rollplex_plan::spec::ModelSpec;
use rollplex_runtime::model::{
    DecodeSlot, EncodedMedia, KvArena, MediaInput, MediaKind, Prompt, Qwen25VL, TokenScores,
};
use rollplex_runtime::tp::{run_ranks, shard_all, ThreadComm, TpError, TpModel, TpPlan};

const IMG: u32 = 290;
const VID: u32 = 291;
const VS: u32 = 288;
const VE: u32 = 289;
const VOCAB: usize = 302;

/// Absolute tolerance of TP results against the single-rank model (logits, log-probs,
/// entropies, media embeddings); docs/tp.md lists the measured errors.
const TOL: f32 = 2e-5;

fn spec(kv_heads: u32, tie: bool) -> ModelSpec {
    TestModel {
        name: "tiny-tp",
        vision_heads: 4,
        kv_heads,
        ffn: 66,
        vocab: VOCAB as u32,
        tie,
        ..TestModel::default()
    }
    .spec()
}

/// Random weights; zero biases and unit norms perturbed so every path (bias after the
/// all-reduce, replicated norms) counts.
fn model(kv_heads: u32, tie: bool) -> Qwen25VL {
    let mut m = Qwen25VL::random(spec(kv_heads, tie), 5).unwrap();
    for (i, x) in m.weights.data.iter_mut().enumerate() {
        if *x == 0.0 || *x == 1.0 {
            *x += 0.05 * (((i * 2654435761) % 1000) as f32 / 500.0 - 1.0);
        }
    }
    m
}

fn pixels(n: usize, pd: usize, seed: u64) -> Vec<f32> {
    (0..n * pd)
        .map(|i| (((i as u64 + seed * 7919) * 2654435761 % 2000) as f32 / 1000.0) - 1.0)
        .collect()
}

/// One image (grid 1x4x6 -> 6 tokens) and one video (grid 2x4x4 -> 8 tokens).
struct Inputs {
    img: Vec<f32>,
    vid: Vec<f32>,
    ids: Vec<u32>,
    text_ids: Vec<u32>,
}

impl Inputs {
    fn new(pd: usize) -> Self {
        let mut ids = vec![5, 6, VS];
        ids.extend([IMG; 6]);
        ids.extend([VE, 7, VS]);
        ids.extend([VID; 8]);
        ids.extend([VE, 8, 9, 10]);
        Inputs {
            img: pixels(24, pd, 1),
            vid: pixels(32, pd, 2),
            ids,
            text_ids: vec![1, 2, 3, 4, 5, 6, 301, 0],
        }
    }
    fn media(&self) -> [MediaInput<'_>; 2] {
        [
            MediaInput {
                kind: MediaKind::Image,
                pixels: &self.img,
                grid: [1, 4, 6],
            },
            MediaInput {
                kind: MediaKind::Video {
                    second_per_grid_t: Some(1.0),
                },
                pixels: &self.vid,
                grid: [2, 4, 4],
            },
        ]
    }
}

/// Everything a run produces, in full (gathered) form.
#[derive(Clone, Debug, PartialEq)]
struct Outputs {
    embeds: Vec<f32>,
    /// Logits of every position of the media prompt.
    forward: Vec<f32>,
    /// Last-token logits of both prompts (prefilled together).
    last: Vec<f32>,
    /// Decode logits of every step, 2 samples per step.
    decode: Vec<f32>,
    /// Greedy tokens of both samples.
    tokens: Vec<Vec<u32>>,
    /// Scores of both greedy responses at temperature 1 and 0.7.
    scores: Vec<TokenScores>,
}

const STEPS: usize = 6;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (j, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = j;
        }
    }
    best as u32
}

/// The single-rank model's outputs.
fn reference(m: &Qwen25VL, inp: &Inputs) -> Outputs {
    let enc = m.encode_media(&inp.media(), None).unwrap();
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let mp = Prompt {
        ids: &inp.ids,
        media: &refs,
    };
    let tp = Prompt {
        ids: &inp.text_ids,
        media: &[],
    };
    let forward = m.forward_logits(mp).unwrap();
    let states = m.prefill(&[mp, tp], None).unwrap();
    let last: Vec<f32> = states.iter().flat_map(|s| s.last_logits.clone()).collect();
    let st = &states[0];
    let mut arena = KvArena::for_model(m, 64);
    let span = arena.store_prefix(0, st).unwrap();
    let mut slots = [
        DecodeSlot::new(span, st.rope_delta, 30, 10),
        DecodeSlot::new(span, st.rope_delta, 45, 10),
    ];
    let mut tok = vec![argmax(&st.last_logits), 7];
    let mut tokens = vec![vec![tok[0]], vec![tok[1]]];
    let mut decode = Vec::new();
    let mut logits = vec![0f32; 2 * VOCAB];
    for _ in 0..STEPS {
        m.decode_step(&mut arena, &mut slots, &tok, &mut logits)
            .unwrap();
        decode.extend_from_slice(&logits);
        tok = logits.chunks(VOCAB).map(argmax).collect();
        tokens[0].push(tok[0]);
        tokens[1].push(tok[1]);
    }
    let resp: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
    let mut scores = m.score(st, &resp, 1.0, None).unwrap();
    scores.extend(m.score(st, &resp, 0.7, None).unwrap());
    Outputs {
        embeds: enc.iter().flat_map(|e| e.embeds.clone()).collect(),
        forward,
        last,
        decode,
        tokens,
        scores,
    }
}

/// The same operations on one rank of a TP group (logits gathered, tokens from the
/// vocab-parallel argmax).
fn rank_outputs(r: &TpModel, c: &ThreadComm, inp: &Inputs) -> Result<Outputs, TpError> {
    let r = r.as_rank();
    let enc = r.encode_media(c, &inp.media(), None)?;
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let mp = Prompt {
        ids: &inp.ids,
        media: &refs,
    };
    let tp = Prompt {
        ids: &inp.text_ids,
        media: &[],
    };
    let forward = r.gather_logits(c, &r.forward_logits(c, mp)?)?;
    let states = r.prefill(c, &[mp, tp], None)?;
    let local_last: Vec<f32> = states.iter().flat_map(|s| s.last_logits.clone()).collect();
    let last = r.gather_logits(c, &local_last)?;
    let st = &states[0];
    let mut arena = r.kv_arena(64);
    let span = arena.store_prefix(0, st)?;
    let mut slots = [
        DecodeSlot::new(span, st.rope_delta, 30, 10),
        DecodeSlot::new(span, st.rope_delta, 45, 10),
    ];
    let mut tok = vec![r.greedy(c, &st.last_logits)?[0], 7];
    let mut tokens = vec![vec![tok[0]], vec![tok[1]]];
    let mut decode = Vec::new();
    let mut rollout_logp = [Vec::new(), Vec::new()];
    for _ in 0..STEPS {
        let local = r.decode_step(c, &mut arena, &mut slots, &tok)?;
        decode.extend(r.gather_logits(c, &local)?);
        tok = r.greedy(c, &local)?;
        let (lp, _) = r.vocab_logprobs(c, &local, &tok, 1.0)?;
        for s in 0..2 {
            tokens[s].push(tok[s]);
            rollout_logp[s].push(lp[s]);
        }
    }
    let resp: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
    let mut scores = r.score(c, st, &resp, 1.0, None)?;
    // the rollout's log-probs (from decode logits) are bitwise the scoring pass's, under TP too
    for s in 0..2 {
        if scores[s].logp[1..] != rollout_logp[s][..] {
            return Err(TpError::Config(format!(
                "rank {}: sample {s}: decode log-probs {:?} != score log-probs {:?}",
                c_rank(c),
                rollout_logp[s],
                &scores[s].logp[1..]
            )));
        }
    }
    scores.extend(r.score(c, st, &resp, 0.7, None)?);
    Ok(Outputs {
        embeds: enc.iter().flat_map(|e| e.embeds.clone()).collect(),
        forward,
        last,
        decode,
        tokens,
        scores,
    })
}

/// Runs a TP group of `degree` threads; every rank must return the same outputs.
fn run_tp(m: &Qwen25VL, degree: usize, inp: &Inputs) -> Outputs {
    let ranks = shard_all(m, degree).unwrap();
    let outs = run_ranks(degree, |c: &ThreadComm| {
        rank_outputs(&ranks[c_rank(c)], c, inp)
    })
    .unwrap_or_else(|e| panic!("TP={degree}: {e}"));
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert!(
            o == &outs[0],
            "TP={degree}: rank {r}'s outputs differ from rank 0's"
        );
    }
    outs.into_iter().next().unwrap()
}

fn c_rank(c: &ThreadComm) -> usize {
    use rollplex_runtime::tp::Communicator;
    c.rank()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Max abs errors of a TP run against the reference, by output.
fn errors(got: &Outputs, want: &Outputs) -> Vec<(&'static str, f32)> {
    let logp = |o: &Outputs| -> Vec<f32> { o.scores.iter().flat_map(|x| x.logp.clone()).collect() };
    let ent =
        |o: &Outputs| -> Vec<f32> { o.scores.iter().flat_map(|x| x.entropy.clone()).collect() };
    vec![
        ("media embeddings", max_abs(&got.embeds, &want.embeds)),
        ("forward logits", max_abs(&got.forward, &want.forward)),
        ("prefill last logits", max_abs(&got.last, &want.last)),
        ("decode logits", max_abs(&got.decode, &want.decode)),
        ("log-probs", max_abs(&logp(got), &logp(want))),
        ("entropies", max_abs(&ent(got), &ent(want))),
    ]
}

fn check_against_reference(kv_heads: u32, tie: bool, degrees: &[usize]) {
    let m = model(kv_heads, tie);
    let inp = Inputs::new(m.config.patch_dim());
    let want = reference(&m, &inp);
    let scale = want.forward.iter().fold(0f32, |a, x| a.max(x.abs()));
    println!("kv_heads {kv_heads}, tied {tie}: max |logit| {scale:.4}");
    for &t in degrees {
        let got = run_tp(&m, t, &inp);
        assert_eq!(got.tokens, want.tokens, "TP={t}: greedy tokens differ");
        if t == 1 {
            assert!(got == want, "TP=1 must be bitwise the single-rank model");
        }
        for (what, e) in errors(&got, &want) {
            println!("  TP={t} {what}: max abs error {e:.3e}");
            assert!(e <= TOL, "TP={t} {what}: max abs error {e:e} > {TOL:e}");
        }
    }
}

#[test]
fn tp_matches_single_rank_kv_heads_split_at_2_replicated_at_4() {
    check_against_reference(2, false, &[1, 2, 4]);
}

#[test]
fn tp_matches_single_rank_kv_heads_split_at_4_tied_embeddings() {
    check_against_reference(4, true, &[2, 4]);
}

#[test]
fn two_tp2_runs_are_bitwise_equal() {
    let m = model(2, false);
    let inp = Inputs::new(m.config.patch_dim());
    let a = run_tp(&m, 2, &inp);
    let b = run_tp(&m, 2, &inp);
    assert!(a == b, "two TP=2 runs differ");
}

#[test]
fn shard_unshard_round_trip_is_bitwise() {
    for (kv, tie) in [(2, false), (4, true)] {
        let m = model(kv, tie);
        for t in [1, 2, 4] {
            let plan = Arc::new(TpPlan::new(&m.config, t).unwrap());
            let shards: Vec<_> = (0..t).map(|r| plan.shard(&m.weights, r).unwrap()).collect();
            // every rank holds a part: together at most the full model plus replicas
            let held: usize = shards.iter().map(|s| s.data.len()).sum();
            assert!(held >= m.weights.data.len());
            if t > 1 {
                assert!(shards[0].data.len() < m.weights.data.len());
            }
            let back = plan.unshard(&shards).unwrap();
            assert!(
                back == m.weights,
                "kv {kv}, tied {tie}, TP={t}: round trip differs"
            );
            // the free functions agree with the plan's methods
            let free: Vec<_> = (0..t)
                .map(|r| rollplex_runtime::tp::shard(&m.config, &m.weights, t, r).unwrap())
                .collect();
            assert!(free == shards);
            assert!(rollplex_runtime::tp::unshard(&m.config, &free).unwrap() == m.weights);
        }
    }
}

#[test]
fn unshard_rejects_diverged_replicas() {
    let m = model(2, false);
    let plan = TpPlan::new(&m.config, 4).unwrap();
    let mut shards: Vec<_> = (0..4).map(|r| plan.shard(&m.weights, r).unwrap()).collect();
    // ranks 0 and 1 share kv head 0 at TP=4: change rank 1's copy
    let k = shards[1].layout.text_layers[0].k.w;
    shards[1].get_mut(k)[3] += 1.0;
    let e = plan.unshard(&shards).unwrap_err().to_string();
    assert!(
        e.contains("k_proj.weight") && e.contains("rank 0 and rank 1"),
        "{e}"
    );
    // a replicated norm too
    let mut shards: Vec<_> = (0..2)
        .map(|r| {
            TpPlan::new(&m.config, 2)
                .unwrap()
                .shard(&m.weights, r)
                .unwrap()
        })
        .collect();
    let n = shards[1].layout.final_norm;
    shards[1].get_mut(n)[0] = 9.0;
    let plan2 = TpPlan::new(&m.config, 2).unwrap();
    let e = plan2.unshard(&shards).unwrap_err().to_string();
    assert!(e.contains("model.language_model.norm.weight"), "{e}");
}

#[test]
fn degrees_that_do_not_split_are_rejected_with_the_dimension() {
    let m = model(2, false);
    let e = TpPlan::new(&m.config, 3).unwrap_err().to_string();
    assert!(
        e.contains("text num_heads 4 is not divisible by the TP degree 3"),
        "{e}"
    );
    assert!(e.contains("vision num_heads 4"), "{e}");
    let e = TpPlan::new(&m.config, 8).unwrap_err().to_string();
    assert!(e.contains("text num_heads 4"), "{e}");
    assert!(TpPlan::new(&m.config, 0).is_err());
    // kv heads that neither divide nor are divided by the degree: 4 q heads, 4 kv heads is fine
    // at 2; with 6 q / 3 kv heads at TP=2 the kv heads cannot split or replicate evenly
    let mut s = spec(2, false);
    s.text.num_heads = 6;
    s.text.num_kv_heads = 3;
    s.text.hidden_size = 48;
    s.text.mrope_section = [1, 1, 2];
    s.vision.out_hidden_size = 48;
    let cfg = rollplex_runtime::model::ModelConfig::from_spec(s).unwrap();
    let e = TpPlan::new(&cfg, 2).unwrap_err().to_string();
    assert!(e.contains("num_kv_heads 3"), "{e}");
}
