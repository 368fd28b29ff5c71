//! The algorithm presets resolve to the loss options docs/language.md lists, options override a
//! preset's defaults, and `train { groups }` sizes training by the trained groups.

use rollplex_dsl::{compile_source, MemFiles};
use rollplex_plan::spec::{
    AdvantageEstimator, Algorithm, JobSpec, LossAgg, Overlong, PolicyLoss, RatioLevel,
};

/// A CPU pipeline whose `train` section sets `algorithm` and, on its line 9, `train_extra`.
fn source(algorithm: &str, train_extra: &str) -> String {
    format!(
        r#"pipeline p {{
    gpu {{ preset = cpu }}
    model actor {{ preset = tiny }}
    rollout {{ prompts = 8, group = 4, text_tokens = 16, max_new_tokens = 16 }}
    reward = builtin("exact_match")
    train {{
        algorithm = {algorithm}
        micro_batch = 4
        {train_extra}
    }}
}}"#
    )
}

fn job(algorithm: &str, train_extra: &str) -> JobSpec {
    let src = source(algorithm, train_extra);
    compile_source("p.rpx", &src, &MemFiles::default())
        .unwrap_or_else(|d| panic!("{}", d.render("p.rpx", &src, false)))
        .spec
}

fn loss(algorithm: &str) -> PolicyLoss {
    job(algorithm, "").train.algorithm.loss().clone()
}

#[test]
fn presets_set_their_papers_defaults() {
    let grpo = loss("grpo()");
    assert_eq!(
        (
            grpo.advantage,
            grpo.ratio,
            grpo.loss_agg,
            grpo.norm_adv_by_std
        ),
        (
            AdvantageEstimator::Group,
            RatioLevel::Token,
            LossAgg::TokenMean,
            true
        )
    );
    assert_eq!((grpo.tis_cap, grpo.overlong), (None, None));
    let dr = loss("dr_grpo()");
    assert!(!dr.norm_adv_by_std);
    assert_eq!(dr.loss_agg, LossAgg::SeqMeanTokenSumNorm);
    let dapo = loss("dapo()");
    assert_eq!(
        (dapo.clip_low, dapo.clip_high, dapo.kl_coef),
        (0.2, 0.28, 0.0)
    );
    let gspo = loss("gspo()");
    assert_eq!(gspo.ratio, RatioLevel::Sequence);
    assert_eq!((gspo.clip_low, gspo.clip_high), (3e-4, 4e-4));
    assert_eq!(gspo.loss_agg, LossAgg::SeqMeanTokenMean);
    let rpp = loss("reinforce_pp()");
    assert_eq!(rpp.advantage, AdvantageEstimator::ReinforceBaseline);
    assert!(matches!(
        job("ppo_clip()", "").train.algorithm,
        Algorithm::PpoClip(_)
    ));
}

#[test]
fn options_override_a_presets_defaults() {
    let l = loss(
        "gspo(clip_low = 0.001, clip_high = 0.002, loss_agg = token_mean, tis_cap = 2, \
         overlong_buffer = 4, overlong_penalty = 0.5, advantage = reinforce_baseline)",
    );
    assert_eq!((l.clip_low, l.clip_high), (0.001, 0.002));
    assert_eq!(l.loss_agg, LossAgg::TokenMean);
    assert_eq!(l.ratio, RatioLevel::Sequence);
    assert_eq!(l.tis_cap, Some(2.0));
    assert_eq!(
        l.overlong,
        Some(Overlong {
            buffer: 4,
            penalty: 0.5
        })
    );
    assert_eq!(l.advantage, AdvantageEstimator::ReinforceBaseline);
    // the penalty defaults to 1 when only the buffer is given
    assert_eq!(
        loss("dapo(overlong_buffer = 2)").overlong.unwrap().penalty,
        1.0
    );
}

#[test]
fn trained_groups_size_the_default_mini_batch() {
    let j = job("dapo()", "groups = 2");
    assert_eq!(j.train.groups, Some(2));
    assert_eq!(j.train.trained_groups(&j.rollout), 2);
    assert_eq!(j.train.mini_batch, 8, "2 trained groups of 4");
    let all = job("grpo()", "");
    assert_eq!(all.train.groups, None);
    assert_eq!(all.train.trained_groups(&all.rollout), 8);
    assert_eq!(all.train.mini_batch, 32);
}

/// `train { KEY = WORD }` with a word that is not `auto` or `recompute`: an error at the value
/// (`p.rpx:9:COL`) that lists the valid words.
fn refuses_a_third_word(key: &str, word: &str, col: usize) {
    let src = source("grpo()", &format!("{key} = {word}"));
    let Err(d) = compile_source("p.rpx", &src, &MemFiles::default()) else {
        panic!("`{key} = {word}` checked");
    };
    let text = d.render("p.rpx", &src, false);
    assert!(
        text.contains(&format!("`{word}` is not one of: auto, recompute")),
        "{text}"
    );
    assert!(text.contains(&format!("p.rpx:9:{col}")), "{text}");
}

/// `train { prompt_forward }`: `auto` unless asked, `recompute` asks for the training prompt
/// forwards' own pass; any other word is an error at the value that lists the valid ones.
#[test]
fn prompt_forward_is_auto_or_recompute() {
    use rollplex_plan::spec::PromptForwardPass;
    assert_eq!(
        job("grpo()", "").train.prompt_forward,
        PromptForwardPass::Auto
    );
    assert_eq!(
        job("grpo()", "prompt_forward = recompute")
            .train
            .prompt_forward,
        PromptForwardPass::Recompute
    );
    refuses_a_third_word("prompt_forward", "twice", 26);
}

/// `train { old_logprobs }`: `auto` unless asked, `recompute` forces the pass; any other word
/// is an error at the value that lists the valid ones.
#[test]
fn old_logprobs_is_auto_or_recompute() {
    use rollplex_plan::spec::OldLogProbPass;
    assert_eq!(job("grpo()", "").train.old_logprobs, OldLogProbPass::Auto);
    assert_eq!(
        job("grpo()", "old_logprobs = auto").train.old_logprobs,
        OldLogProbPass::Auto
    );
    assert_eq!(
        job("grpo()", "old_logprobs = recompute").train.old_logprobs,
        OldLogProbPass::Recompute
    );
    refuses_a_third_word("old_logprobs", "always", 24);
}
