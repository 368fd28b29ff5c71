//! `reward = ...`: built-ins with their parameters, weighted sums, and the mistakes around them.

use rollplex_dsl::{compile_source, MemFiles};
use rollplex_plan::spec::{RewardSpec, WeightedReward};

fn with_reward(reward: &str) -> String {
    format!(
        "pipeline p {{ gpu {{ preset = cpu }} model actor {{ preset = tiny }} \
         rollout {{ prompts = 2, group = 2, max_new_tokens = 4 }} reward = {reward}, \
         train {{ micro_batch = 2 }} }}"
    )
}

fn reward_of(reward: &str) -> Result<RewardSpec, String> {
    let src = with_reward(reward);
    compile_source("p.rpx", &src, &MemFiles::default())
        .map(|c| c.spec.reward)
        .map_err(|d| d.render("p.rpx", &src, false))
}

#[test]
fn math_format_and_weighted_sums_resolve() {
    assert_eq!(
        reward_of("builtin(\"math\")").unwrap(),
        RewardSpec::Builtin {
            name: "math".into(),
            tolerance: 1e-9
        }
    );
    assert_eq!(
        reward_of("builtin(\"format\")").unwrap(),
        RewardSpec::Format {
            think: "think".into(),
            answer: "answer".into()
        }
    );
    assert_eq!(
        reward_of(
            "sum(builtin(\"math\", weight = 0.9), builtin(\"format\", think = \"\", answer = \"final\", weight = 0.1), command([\"rm.py\"]))"
        )
        .unwrap(),
        RewardSpec::Sum {
            terms: vec![
                WeightedReward {
                    weight: 0.9,
                    reward: RewardSpec::Builtin {
                        name: "math".into(),
                        tolerance: 1e-9
                    }
                },
                WeightedReward {
                    weight: 0.1,
                    reward: RewardSpec::Format {
                        think: String::new(),
                        answer: "final".into()
                    }
                },
                WeightedReward {
                    weight: 1.0,
                    reward: RewardSpec::Command {
                        argv: vec!["rm.py".into()],
                        timeout_s: 60.0
                    }
                },
            ]
        }
    );
}

#[test]
fn reward_mistakes_say_what_would_be_valid() {
    let cases: &[(&str, &[&str])] = &[
        (
            "builtin(\"math\", weight = 0.5)",
            &["`weight` applies to a reward inside `sum(...)`", "p.rpx:1:"],
        ),
        (
            "builtin(\"math\") * 0.9",
            &["cannot multiply `builtin(...)` by a number", "weight = 0.9"],
        ),
        (
            "sum()",
            &[
                "`sum(...)` of no rewards",
                "sum(builtin(\"math\", weight = 0.9)",
            ],
        ),
        (
            "sum(builtin(\"math\"), weight = 2)",
            &["takes rewards, not `weight = ...`"],
        ),
        ("sum(sum(builtin(\"math\")))", &["a `sum` inside `sum`"]),
        (
            "sum(\"math\")",
            &["a term of `sum(...)`", "builtin, command"],
        ),
        (
            "builtin(\"maths\")",
            &["`maths` is not one of", "did you mean `math`?"],
        ),
        (
            "builtin(\"format\", answer = \"\")",
            &["the tag name is empty"],
        ),
        (
            "builtin(\"format\", think = \"<think>\")",
            &["is not a tag name", "without `<>`"],
        ),
        (
            "builtin(\"format\", tolerance = 0.1)",
            &["unknown key `tolerance`"],
        ),
    ];
    for (reward, wants) in cases {
        let e = reward_of(reward).expect_err(reward);
        for w in *wants {
            assert!(e.contains(w), "{reward}: expected {w:?} in\n{e}");
        }
    }
}
