//! The ceiling of RL on the moving-shapes task for a given model and optimizer: the same policy
//! loss, but every iteration each prompt's group is the four answer letters (`A`..`D`, then
//! `<|im_end|>`) with the advantage +1 on the correct one and 0 on the others: maximum
//! likelihood of the right answer, i.e. what GRPO would do with perfect exploration. If
//! held-out accuracy does not rise here, no RL setting of the same model, data and learning
//! rate can make it rise; if it does, the gap to RL is exploration. The reference KL is off.
//!
//! Prints every K iterations: held-out (test split) and train-split greedy accuracy, the mean
//! probability of the right letter among the four over the last K batches, and the spread of
//! p(A | A-D) over the last batch's prompts (near 0 means the answer ignores the video). With
//! `PROBE_GRADS=1` also the gradient and weight norms per part of the model. `--init-scale S`
//! multiplies the random normal init by S (norms and biases unchanged).
//!
//! Usage: cargo run --release -p rollplex-runtime --example probe_supervised -- PLAN.bin \
//!     [--iterations 300] [--every 50] [--eval 64] [--init-scale 1]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rollplex_runtime::cli::load_plan;
use rollplex_runtime::exec::{self, data, PromptData};
use rollplex_runtime::model::weights::Init;
use rollplex_runtime::model::{MediaInput, Qwen25VL};
use rollplex_runtime::tasks::moving_shapes::Split;
use rollplex_runtime::tp::SoloComm;
use rollplex_runtime::train::loss::Normaliser;
use rollplex_runtime::train::step::Trainer;
use rollplex_runtime::train::{GroupBatch, ResponseBatch, TrainConfig};

fn main() -> Result<()> {
    let mut it = std::env::args().skip(1);
    let (mut plan_path, mut iterations, mut every, mut eval) = (None, 300u32, 50u32, 64u32);
    let mut init_scale = 1f32;
    while let Some(x) = it.next() {
        let mut val = |n: &str| it.next().with_context(|| format!("{n} needs a value"));
        match x.as_str() {
            "--iterations" => iterations = val("--iterations")?.parse()?,
            "--every" => every = val("--every")?.parse()?,
            "--eval" => eval = val("--eval")?.parse()?,
            "--init-scale" => init_scale = val("--init-scale")?.parse()?,
            s if s.starts_with("--") => bail!("unknown flag {s}"),
            s => plan_path = Some(PathBuf::from(s)),
        }
    }
    let plan = load_plan(
        &plan_path
            .context("usage: probe_supervised PLAN.bin [--iterations N] [--every K] [--eval N]")?,
    )?;
    let mut spec = plan.spec.clone();
    // No reference: the ceiling is measured without the KL term.
    match &mut spec.train.algorithm {
        rollplex_plan::spec::Algorithm::Grpo(l) | rollplex_plan::spec::Algorithm::PpoClip(l) => {
            l.kl_coef = 0.0
        }
    }
    let cfg = TrainConfig::from_spec(&spec.train, 1.0, None, spec.rollout.max_new_tokens as usize)?;
    let mut model = exec::host_actor(&spec)?;
    // Optionally scale the random normal init (weights only; norms stay 1, biases 0).
    let entries = model.weights.table.entries().to_vec();
    for e in entries
        .iter()
        .filter(|e| e.init == Init::Normal && init_scale != 1.0)
    {
        for x in &mut model.weights.data[e.offset..e.offset + e.len] {
            *x *= init_scale;
        }
    }
    let config = model.config.clone();
    let mut trainer = Trainer::new(model, cfg.clone(), spec.train.optimizer.clone())?;
    let mut source = data::data_source(&spec, &spec.rollout.dataset)?;
    let eos = spec.actor.tokens.eos_token_ids[0];
    let answers: Vec<[u32; 2]> = (b'A'..=b'D').map(|c| [c as u32, eos]).collect();
    let groups = spec.rollout.prompts_per_iter as usize;
    let t0 = Instant::now();
    println!(
        "{:>6} {:>11} {:>11} {:>14} {:>8}",
        "iter", "heldout_acc", "train_acc", "p(right|A-D)", "s"
    );
    // Mean over the last K iterations of the probability of the right letter among the four.
    let (mut p_sum, mut p_n) = (0f64, 0usize);
    // Spread of p(A | A-D) over the prompts of the last iteration: 0 when the answer ignores the video.
    let mut spread = (1f64, 0f64);
    for i in 0..=iterations {
        if i % every == 0 {
            let m = &Qwen25VL::new(config.clone(), trainer.weights().clone())?;
            let h = data::evaluate_split(&spec, m, Split::Test, eval)?.unwrap_or(f64::NAN);
            let t = data::evaluate_split(&spec, m, Split::Train, eval)?.unwrap_or(f64::NAN);
            let p = p_sum / p_n.max(1) as f64;
            (p_sum, p_n) = (0.0, 0);
            println!(
                "{i:>6} {h:>11.3} {t:>11.3} {p:>14.3} {:>8.1}   p(A) over the last batch: {:.4}..{:.4} (max-min {:.2e})",
                t0.elapsed().as_secs_f64(),
                spread.0,
                spread.1,
                spread.1 - spread.0
            );
        }
        if i == iterations {
            break;
        }
        let prompts: Vec<PromptData> = source.prompts(i, groups)?;
        spread = (1.0, 0.0);
        let correct: Vec<usize> = prompts
            .iter()
            .map(|p| (p.answer.as_bytes()[0] - b'A') as usize)
            .collect();
        let media: Vec<Vec<MediaInput<'_>>> = prompts
            .iter()
            .map(|p| {
                p.media
                    .iter()
                    .map(|m| MediaInput {
                        kind: m.kind,
                        pixels: &m.pixels,
                        grid: m.grid,
                    })
                    .collect()
            })
            .collect();
        let mask = [true, true];
        let zeros = [0f32; 2];
        let advs: Vec<Vec<[f32; 2]>> = correct
            .iter()
            .map(|&c| {
                (0..4)
                    .map(|k| [if k == c { 1.0 } else { 0.0 }; 2])
                    .collect()
            })
            .collect();
        let norm = Normaliser {
            tokens: groups * 4 * 2,
            seqs: groups * 4,
        };
        // The old policy is the current one: one forward for its log-probs (ratio 1).
        let mut old: Vec<Vec<Vec<f32>>> = Vec::new();
        for (g, p) in prompts.iter().enumerate() {
            let rs: Vec<ResponseBatch<'_>> = answers
                .iter()
                .map(|a| ResponseBatch {
                    tokens: a,
                    old_logp: Some(&zeros),
                    ref_logp: None,
                    advantages: &zeros,
                    mask: &mask,
                })
                .collect();
            let batch = [GroupBatch {
                prompt_ids: &p.ids,
                media: &media[g],
                responses: &rs,
            }];
            let mut scratch = vec![0f32; trainer.weights().table.total()];
            let out = trainer.actor().as_rank().forward_backward(
                &SoloComm,
                &cfg,
                &batch,
                norm,
                &mut scratch,
            )?;
            let first: Vec<f64> = out.logp.iter().map(|l| (l[0] as f64).exp()).collect();
            p_sum += first[correct[g]] / first.iter().sum::<f64>();
            let pa = first[0] / first.iter().sum::<f64>();
            spread = (spread.0.min(pa), spread.1.max(pa));
            p_n += 1;
            old.push(out.logp);
        }
        for (g, p) in prompts.iter().enumerate() {
            let rs: Vec<ResponseBatch<'_>> = answers
                .iter()
                .enumerate()
                .map(|(k, a)| ResponseBatch {
                    tokens: a,
                    old_logp: Some(&old[g][k]),
                    ref_logp: None,
                    advantages: &advs[g][k],
                    mask: &mask,
                })
                .collect();
            trainer.micro_batch(
                &SoloComm,
                g as u32,
                &[GroupBatch {
                    prompt_ids: &p.ids,
                    media: &media[g],
                    responses: &rs,
                }],
                norm,
            )?;
        }
        if std::env::var_os("PROBE_GRADS").is_some() && i % every == 0 {
            let g = trainer.grads();
            let mut by: std::collections::BTreeMap<String, (f64, f64)> = Default::default();
            for e in trainer.weights().table.entries() {
                let key: String = e.name.split('.').take(3).collect::<Vec<_>>().join(".");
                let n2: f64 = g[e.offset..e.offset + e.len]
                    .iter()
                    .map(|&x| (x as f64).powi(2))
                    .sum();
                let w2: f64 = trainer.weights().data[e.offset..e.offset + e.len]
                    .iter()
                    .map(|&x| (x as f64).powi(2))
                    .sum();
                let v = by.entry(key).or_default();
                v.0 += n2;
                v.1 += w2;
            }
            for (k, (g2, w2)) in by {
                println!(
                    "    grad {k:<40} |g| {:.3e} |w| {:.3e}",
                    g2.sqrt(),
                    w2.sqrt()
                );
            }
        }
        trainer.optimizer_step(&SoloComm)?;
    }
    Ok(())
}
