//! Whole-actor verification on a tiny random Qwen2.5-VL (vision tower, merger, GQA text decoder
//! with M-RoPE), one GRPO group with an image and a video in its prompt:
//!
//! - gradients of every parameter tensor against central finite differences of the loss;
//! - recomputing every layer, or all but the first, gives bitwise the gradients of keeping
//!   every activation;
//! - a group split over two micro-batches accumulates to `g_a + g_b`, deterministically, and
//!   matches the one-micro-batch gradient up to rounding;
//! - the loss on a fixed batch falls over 20 optimizer steps; frozen parts do not move.

use rollplex_plan::spec::{AdamWSpec, KlEstimator, LossAgg, LrSchedule};

use super::backward::{forward_backward, GroupBatch, ResponseBatch, TrainConfig};
use super::loss::{policy_loss, LossBatch, LossConfig, Normaliser};
use super::step::Trainer;
use crate::model::tests::tiny_spec;
use crate::model::{EncodedMedia, MediaInput, MediaKind, Prompt, Qwen25VL};
use crate::tp::SoloComm;

const IMG: u32 = 290;
const VID: u32 = 291;
const VS: u32 = 288;
const VE: u32 = 289;

/// splitmix64 in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() + 1.0) * 0.5) * n as f32) as usize % n
    }
}

/// Random weights at a scale where every path carries signal: matrices ~ N(0, 0.02) scaled up
/// 4x, norms and biases moved off 1 and 0.
fn tiny_model(tie: bool) -> Qwen25VL {
    let mut m = Qwen25VL::random(tiny_spec(tie), 7).unwrap();
    let mut rng = Rng(99);
    for x in m.weights.data.iter_mut() {
        if *x == 1.0 {
            *x = 1.0 + 0.2 * rng.next();
        } else if *x == 0.0 {
            *x = 0.05 * rng.next();
        } else {
            *x *= 4.0;
        }
    }
    m
}

/// Owned inputs of one group: prompt with an image (grid 1x4x6, 6 tokens) and a video (grid
/// 2x4x4, 8 tokens), and responses with their training data.
struct Group {
    prompt: Vec<u32>,
    img: Vec<f32>,
    vid: Vec<f32>,
    tokens: Vec<Vec<u32>>,
    old: Vec<Vec<f32>>,
    refl: Vec<Vec<f32>>,
    adv: Vec<Vec<f32>>,
    mask: Vec<Vec<bool>>,
}

impl Group {
    /// `lens`: response lengths. old/ref log-probs are the model's own plus noise of `spread`.
    fn new(m: &Qwen25VL, lens: &[usize], spread: f32, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let pd = m.config.patch_dim();
        let img: Vec<f32> = (0..24 * pd).map(|_| rng.next()).collect();
        let vid: Vec<f32> = (0..32 * pd).map(|_| rng.next()).collect();
        let mut prompt = vec![5, 6, VS];
        prompt.extend([IMG; 6]);
        prompt.extend([VE, 7, VS]);
        prompt.extend([VID; 8]);
        prompt.extend([VE, 8, 9, 10]);
        let tokens: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| rng.below(280) as u32).collect())
            .collect();
        let mut g = Group {
            prompt,
            img,
            vid,
            tokens,
            old: vec![],
            refl: vec![],
            adv: vec![],
            mask: vec![],
        };
        let logp = g.current_logp(m);
        let rewards: Vec<f32> = (0..lens.len()).map(|_| rng.next()).collect();
        let per_seq = super::loss::grpo_advantages(&rewards, lens.len(), true).unwrap();
        for (r, lp) in logp.iter().enumerate() {
            g.old
                .push(lp.iter().map(|&l| l + spread * rng.next()).collect());
            g.refl
                .push(lp.iter().map(|&l| l + 0.5 * rng.next()).collect());
            g.adv.push(vec![per_seq[r]; lp.len()]);
            g.mask
                .push((0..lp.len()).map(|j| (j + r) % 5 != 3).collect());
        }
        g
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

    fn responses(&self, which: std::ops::Range<usize>) -> Vec<ResponseBatch<'_>> {
        which
            .map(|r| ResponseBatch {
                tokens: &self.tokens[r],
                old_logp: Some(&self.old[r]),
                ref_logp: Some(&self.refl[r]),
                advantages: &self.adv[r],
                mask: &self.mask[r],
            })
            .collect()
    }

    fn current_logp(&self, m: &Qwen25VL) -> Vec<Vec<f32>> {
        let enc = m.encode_media(&self.media(), None).unwrap();
        let refs: Vec<&EncodedMedia> = enc.iter().collect();
        let st = m
            .prefill(
                &[Prompt {
                    ids: &self.prompt,
                    media: &refs,
                }],
                None,
            )
            .unwrap()
            .remove(0);
        let toks: Vec<&[u32]> = self.tokens.iter().map(|t| &t[..]).collect();
        m.score(&st, &toks, 1.0, None)
            .unwrap()
            .into_iter()
            .map(|s| s.logp)
            .collect()
    }

    fn norm(&self) -> Normaliser {
        let mut n = Normaliser::default();
        for mk in &self.mask {
            n = n.merge(Normaliser::of(&[0, mk.len()], mk).unwrap());
        }
        n
    }
}

/// Every text layer's activations kept.
const ALL: usize = usize::MAX;

fn cfg(kept_layers: usize, agg: LossAgg) -> TrainConfig {
    TrainConfig {
        loss: LossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: Some(3.0),
            kl_coef: 0.1,
            kl_estimator: KlEstimator::K3,
            agg,
            ratio: rollplex_plan::spec::RatioLevel::Token,
            horizon: 0,
        },
        kept_layers,
        kept_prompt_layers: kept_layers,
        freeze_vision: false,
        freeze_merger: false,
        temperature: 1.0,
    }
}

/// The loss by the model's plain forward (no caches), for finite differences.
fn loss_only(m: &Qwen25VL, c: &TrainConfig, g: &Group) -> f64 {
    let logp = g.current_logp(m);
    let mut offsets = vec![0];
    let flat = |v: &[Vec<f32>]| v.concat();
    for lp in &logp {
        offsets.push(offsets.last().unwrap() + lp.len());
    }
    let (lp, old, refl, adv) = (flat(&logp), flat(&g.old), flat(&g.refl), flat(&g.adv));
    let mask = g.mask.concat();
    let b = LossBatch {
        offsets: &offsets,
        logp: &lp,
        old_logp: &old,
        ref_logp: Some(&refl),
        advantages: &adv,
        mask: &mask,
        entropy: None,
    };
    policy_loss(&c.loss, &b, g.norm()).unwrap().loss
}

fn grads_of(
    m: &Qwen25VL,
    c: &TrainConfig,
    groups: &[GroupBatch<'_>],
    norm: Normaliser,
) -> (Vec<f32>, f64) {
    let mut g = vec![0f32; m.weights.table.total()];
    let out = forward_backward(m, c, groups, norm, &mut g).unwrap();
    (g, out.metrics.loss)
}

fn fd_step() -> f32 {
    std::env::var("FD_STEP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1e-1)
}

/// Per tensor, the norm-wise relative error of the analytic gradient against central
/// differences on 4 entries (the 2 largest analytic gradients and 2 random ones).
fn finite_difference_check(tie: bool, agg: LossAgg) {
    let m = tiny_model(tie);
    let c = cfg(ALL, agg);
    // spread 0.1 keeps every ratio inside the clip range: the loss is smooth there.
    let g = Group::new(&m, &[6, 1, 4, 9], 0.1, 11);
    let media = g.media();
    let resp = g.responses(0..4);
    let batch = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &resp,
    }];
    let (grads, loss) = grads_of(&m, &c, &batch, g.norm());
    let plain = loss_only(&m, &c, &g);
    assert!(
        (loss - plain).abs() < 1e-9,
        "training forward loss {loss} != plain forward loss {plain}"
    );

    let mut rng = Rng(5);
    let mut worst = (0.0f64, String::new());
    let mut lines = Vec::new();
    let mut mm = m.clone();
    for e in m.weights.table.entries() {
        let gt = &grads[e.offset..e.offset + e.len];
        let mut idx: Vec<usize> = (0..e.len).collect();
        idx.sort_by(|&a, &b| gt[b].abs().total_cmp(&gt[a].abs()));
        let mut pick = vec![idx[0], idx[1.min(e.len - 1)]];
        for _ in 0..2 {
            pick.push(rng.below(e.len));
        }
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for &i in &pick {
            let x = m.weights.data[e.offset + i];
            // Central differences at steps h and 2h, combined by Richardson extrapolation
            // (cancels the O(h^2) term), so h can be large enough to rise well above the f32
            // rounding of the loss. Steps are taken as represented in f32.
            let mut central = |h: f32| {
                mm.weights.data[e.offset + i] = x + h;
                let lp = loss_only(&mm, &c, &g);
                mm.weights.data[e.offset + i] = x - h;
                let lm = loss_only(&mm, &c, &g);
                mm.weights.data[e.offset + i] = x;
                (lp - lm) / ((x + h) as f64 - (x - h) as f64)
            };
            let h = fd_step() * x.abs().max(0.1);
            let fd = (4.0 * central(h) - central(2.0 * h)) / 3.0;
            num += (gt[i] as f64 - fd).powi(2);
            den += fd * fd;
        }
        let rel = if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        };
        lines.push(format!(
            "{:<60} {:>10.2e} |g| {:.2e}",
            e.name,
            rel,
            den.sqrt()
        ));
        if rel > worst.0 {
            worst = (rel, e.name.clone());
        }
        assert!(
            den > 0.0,
            "{}: the sampled finite differences are all zero (no gradient path?)",
            e.name
        );
    }
    println!(
        "finite differences (tie = {tie}, {agg:?}):\n{}",
        lines.join("\n")
    );
    println!("worst: {} {:.2e}", worst.1, worst.0);
    assert!(
        worst.0 < 1e-2,
        "worst relative error {:.2e} in {}",
        worst.0,
        worst.1
    );
}

#[test]
fn gradients_match_finite_differences_untied() {
    finite_difference_check(false, LossAgg::TokenMean);
}

#[test]
fn gradients_match_finite_differences_tied_seq_mean() {
    finite_difference_check(true, LossAgg::SeqMeanTokenSum);
}

#[test]
fn recompute_gives_bitwise_the_kept_gradients() {
    let m = tiny_model(false);
    let g = Group::new(&m, &[5, 3, 7], 0.4, 21);
    let media = g.media();
    let resp = g.responses(0..3);
    let batch = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &resp,
    }];
    let (keep, lk) = grads_of(&m, &cfg(ALL, LossAgg::TokenMean), &batch, g.norm());
    // every layer recomputed, and the first kept with the others recomputed
    assert!(m.config.text().num_layers > 1, "a split needs two layers");
    for kept in [0, 1] {
        let (rec, lr) = grads_of(&m, &cfg(kept, LossAgg::TokenMean), &batch, g.norm());
        assert_eq!(lk.to_bits(), lr.to_bits(), "{kept} layers kept");
        assert!(
            keep.iter()
                .zip(&rec)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{kept} layers kept changed a gradient bit"
        );
    }
    assert!(
        keep.iter().filter(|x| **x != 0.0).count() > keep.len() / 2,
        "most gradients are non-zero"
    );
    // and a second run is bitwise the same (no hidden state, fixed reduction order)
    let (again, _) = grads_of(&m, &cfg(ALL, LossAgg::TokenMean), &batch, g.norm());
    assert!(keep
        .iter()
        .zip(&again)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Without old log-probs (`old_logp: None`, a plan without the old-log-prob pass) the forward's
/// own, detached, are the old ones: the ratio is exactly 1, nothing is clipped, and the
/// gradient is bit for bit the one of giving the model's scored log-probs as the old ones (the
/// training forward scores the tokens as the plain forward does).
#[test]
fn own_logprobs_are_the_old_ones_without_a_pass() {
    let m = tiny_model(false);
    let c = cfg(ALL, LossAgg::TokenMean);
    let g = Group::new(&m, &[5, 3, 7], 0.4, 21);
    let media = g.media();
    let scored = g.current_logp(&m);
    let run = |given: bool| {
        let resp: Vec<ResponseBatch<'_>> = g
            .responses(0..3)
            .into_iter()
            .zip(&scored)
            .map(|(r, lp)| ResponseBatch {
                old_logp: given.then_some(&lp[..]),
                ..r
            })
            .collect();
        let batch = [GroupBatch {
            prompt_ids: &g.prompt,
            media: &media,
            responses: &resp,
        }];
        let mut grads = vec![0f32; m.weights.table.total()];
        let out = forward_backward(&m, &c, &batch, g.norm(), &mut grads).unwrap();
        (out, grads)
    };
    let (own, g_own) = run(false);
    let (given, g_given) = run(true);
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(
        bits(&own.logp),
        bits(&scored),
        "the training forward's log-probs are the scored ones"
    );
    for out in [&own, &given] {
        assert_eq!(out.metrics.clip_frac, 0.0);
        assert_eq!(out.metrics.approx_kl, 0.0);
        assert!(out.metrics.kl > 0.0, "the KL to the reference still counts");
    }
    assert_eq!(own.metrics, given.metrics);
    assert!(g_own.iter().any(|&x| x != 0.0), "a gradient at all");
    assert!(
        g_own
            .iter()
            .zip(&g_given)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the gradients differ"
    );
}

/// Four responses of one group as one micro-batch, or as two micro-batches of two (each
/// recomputing the prefix): the accumulated gradient is exactly `g_a + g_b`, the same on every
/// run, and equal to the one-micro-batch gradient up to rounding.
#[test]
fn split_group_accumulates_in_plan_order() {
    let m = tiny_model(false);
    let g = Group::new(&m, &[4, 6, 2, 5], 0.4, 31);
    let media = g.media();
    let norm = g.norm();
    let c = cfg(0, LossAgg::SeqMeanTokenMean);
    let (all, a, b) = (g.responses(0..4), g.responses(0..2), g.responses(2..4));
    let whole = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &all,
    }];
    let first = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &a,
    }];
    let second = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &b,
    }];
    let spec = AdamWSpec {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        grad_clip: 0.0,
        lr_schedule: LrSchedule::Constant,
    };
    let mut t1 = Trainer::new(m.clone(), c.clone(), spec.clone()).unwrap();
    t1.micro_batch(&SoloComm, 0, &whole, norm).unwrap();
    let one = t1.grads().to_vec();
    let run = || {
        let mut t = Trainer::new(m.clone(), c.clone(), spec.clone()).unwrap();
        assert!(
            t.micro_batch(&SoloComm, 1, &second, norm).is_err(),
            "out of plan order"
        );
        let o0 = t.micro_batch(&SoloComm, 0, &first, norm).unwrap();
        let o1 = t.micro_batch(&SoloComm, 1, &second, norm).unwrap();
        (t.grads().to_vec(), o0.metrics.loss + o1.metrics.loss)
    };
    let (split, split_loss) = run();
    let (split2, _) = run();
    assert!(
        split
            .iter()
            .zip(&split2)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "deterministic"
    );
    let (ga, _) = grads_of(&m, &c, &first, norm);
    let (gb, _) = grads_of(&m, &c, &second, norm);
    let sum: Vec<f32> = ga.iter().zip(&gb).map(|(x, y)| 0.0 + x + y).collect();
    assert!(
        split
            .iter()
            .zip(&sum)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "accumulated = (0 + g_a) + g_b exactly"
    );
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in split.iter().zip(&one) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    let rel = (num / den).sqrt();
    println!("split vs one micro-batch: relative difference {rel:.2e}");
    assert!(rel < 1e-5, "split and whole differ by {rel}");
    let whole_loss = t1.optimizer_step(&SoloComm).unwrap().metrics.loss;
    assert!(
        (split_loss - whole_loss).abs() < 1e-6,
        "losses add up: {split_loss} vs {whole_loss}"
    );
}

#[test]
fn loss_falls_on_a_fixed_batch() {
    let m = tiny_model(false);
    let g = Group::new(&m, &[6, 4, 8, 5], 0.0, 41);
    let media = g.media();
    let resp = g.responses(0..4);
    let batch = [GroupBatch {
        prompt_ids: &g.prompt,
        media: &media,
        responses: &resp,
    }];
    let spec = AdamWSpec {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: 1.0,
        lr_schedule: LrSchedule::Constant,
    };
    let mut c = cfg(0, LossAgg::TokenMean);
    c.freeze_vision = true;
    let mut t = Trainer::new(m.clone(), c, spec).unwrap();
    let mut losses = Vec::new();
    for _ in 0..20 {
        t.micro_batch(&SoloComm, 0, &batch, g.norm()).unwrap();
        let r = t.optimizer_step(&SoloComm).unwrap();
        assert!(r.step.grad_norm.is_finite() && r.step.grad_norm > 0.0);
        losses.push(r.metrics.loss);
    }
    println!("losses: {losses:?}");
    // It falls, then levels off where the clipped ratios stop the gradient (ratio 1.28 on
    // positive, 0.8 on negative advantages), moving only by the KL term and Adam's noise.
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(
        losses[19] < losses[0] - 0.1,
        "loss did not fall: {} -> {}",
        losses[0],
        losses[19]
    );
    assert!(
        losses[1] < losses[0] && losses[2] < losses[1],
        "the first steps descend: {losses:?}"
    );
    assert!(
        mean(&losses[10..]) < mean(&losses[..10]),
        "later steps are lower on average"
    );
    // the frozen vision tower did not move; the merger and the text decoder did
    let moved = |name: &str| {
        let id = m.weights.table.find(name).unwrap();
        m.weights.get(id) != t.weights().get(id)
    };
    assert!(
        !moved("model.visual.blocks.0.attn.qkv.weight")
            && !moved("model.visual.patch_embed.proj.weight")
    );
    assert!(
        moved("model.visual.merger.mlp.0.weight")
            && moved("model.language_model.layers.1.mlp.down_proj.weight")
    );
}

/// The one training path (a rank's shard over a communicator, `TpAdamW`'s global clip, the
/// plan-ordered `GradAccumulator`) at degree 1 over `SoloComm` is bitwise plain AdamW with
/// torch's clip over the whole model's gradient sum: several steps of two micro-batches each,
/// weight decay on and the clip active, compared weights, moments, grad norms and losses.
#[test]
fn one_rank_training_is_bitwise_plain_adamw() {
    use crate::tp::{TpAdamW, TpModel, TpPlan};
    use crate::train::{AdamW, GradAccumulator, OptTable};
    use std::sync::Arc;

    let m = tiny_model(false);
    let g = Group::new(&m, &[6, 4, 8, 5], 0.3, 43);
    let media = g.media();
    let (a, b) = (g.responses(0..2), g.responses(2..4));
    let mbs = [
        [GroupBatch {
            prompt_ids: &g.prompt,
            media: &media,
            responses: &a,
        }],
        [GroupBatch {
            prompt_ids: &g.prompt,
            media: &media,
            responses: &b,
        }],
    ];
    let spec = AdamWSpec {
        lr: 2e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: 0.05,
        lr_schedule: LrSchedule::Constant,
    };
    let mut c = cfg(ALL, LossAgg::TokenMean);
    c.freeze_vision = true;
    let norm = g.norm();

    // plain: the whole model, AdamW with its own clip
    let mut plain = m.clone();
    let table = OptTable::from_model(&m.weights.table, |n| c.trainable(n)).unwrap();
    let mut opt = AdamW::new(spec.clone(), table, &plain.weights.data).unwrap();
    let mut acc = GradAccumulator::new(plain.weights.table.total());
    // the rank path at degree 1
    let plan = Arc::new(TpPlan::new(&m.config, 1).unwrap());
    let mut shard = TpModel::shard(plan, &m.weights, 0).unwrap();
    let mut tp_opt = TpAdamW::new(&shard, spec.clone(), |n| c.trainable(n)).unwrap();
    let mut tp_acc = GradAccumulator::new(shard.weights.table.total());
    let mut trainer = Trainer::new(m.clone(), c.clone(), spec.clone()).unwrap();

    for step in 0..4 {
        for (i, mb) in mbs.iter().enumerate() {
            let mut gp = vec![0f32; plain.weights.table.total()];
            let out = forward_backward(&plain, &c, mb, norm, &mut gp).unwrap();
            acc.add(i as u32, &gp).unwrap();
            let mut gt = vec![0f32; shard.weights.table.total()];
            let tout = shard
                .as_rank()
                .forward_backward(&SoloComm, &c, mb, norm, &mut gt)
                .unwrap();
            tp_acc.add(i as u32, &gt).unwrap();
            assert_eq!(tout, out, "step {step}, micro-batch {i}: outputs");
            assert_eq!(
                trainer.micro_batch(&SoloComm, i as u32, mb, norm).unwrap(),
                out,
                "step {step}, micro-batch {i}: the trainer's outputs"
            );
        }
        let rep = opt
            .step_f32(acc.grads_mut(), &mut plain.weights.data)
            .unwrap();
        acc.reset();
        let tp_rep = tp_opt
            .step(&SoloComm, &mut shard, tp_acc.grads_mut())
            .unwrap();
        tp_acc.reset();
        let tr = trainer.optimizer_step(&SoloComm).unwrap();
        assert!(rep.grad_norm > spec.grad_clip, "the clip must be active");
        assert_eq!(tp_rep, rep, "step {step}: reports");
        assert_eq!(tr.step, rep, "step {step}: the trainer's report");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&shard.weights.data), bits(&plain.weights.data));
        assert_eq!(bits(&trainer.weights().data), bits(&plain.weights.data));
        let (p, q) = (opt.state(), tp_opt.state());
        assert!(bits(p.0) == bits(q.0) && bits(p.1) == bits(q.1) && bits(p.2) == bits(q.2));
    }
}
