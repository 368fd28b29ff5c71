//! Rewards of responses: built-in scorers and external reward programs.
//!
//! What this module knows: how to turn (prompt, response, reference answer) into a float,
//! either in process ([`builtin`]: `exact_match`, `choice_letter`, `numeric`) or through an
//! external program speaking JSON lines ([`command`]). It does not know tokens or advantages.
//!
//! Invariant: [`Reward::score`] returns one finite reward per request, in request order, or
//! an error; a reward that cannot be computed is never reported as 0.

pub mod builtin;
pub mod command;

use serde::Serialize;

pub use command::{CommandError, CommandReward};

/// One response to score; serialised as-is for external programs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RewardRequest {
    /// Unique within one `score` call (e.g. `<sample id>/<k>` for the k-th sample of a group).
    pub id: String,
    pub prompt: String,
    pub response: String,
    pub answer: String,
}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    #[error("unknown built-in reward {0:?} (known: exact_match, choice_letter, numeric)")]
    Unknown(String),
    #[error("reward {reward} on request {id:?}: {msg}")]
    Builtin {
        reward: &'static str,
        id: String,
        msg: String,
    },
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error("reward {reward} on request {id:?} is {value:e}, out of the range the trainer computes in (f32: magnitude at most {max:e})", max = f32::MAX)]
    OutOfRange {
        reward: String,
        id: String,
        value: f64,
    },
}

/// A built-in reward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Builtin {
    ExactMatch,
    ChoiceLetter,
    /// Absolute tolerance.
    Numeric {
        tolerance: f64,
    },
}

impl Builtin {
    pub fn from_name(name: &str, tolerance: f64) -> Result<Self, RewardError> {
        Ok(match name {
            "exact_match" => Builtin::ExactMatch,
            "choice_letter" => Builtin::ChoiceLetter,
            "numeric" => Builtin::Numeric { tolerance },
            _ => return Err(RewardError::Unknown(name.into())),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Builtin::ExactMatch => "exact_match",
            Builtin::ChoiceLetter => "choice_letter",
            Builtin::Numeric { .. } => "numeric",
        }
    }

    pub fn score_one(&self, r: &RewardRequest) -> Result<f64, RewardError> {
        let err = |msg: String| RewardError::Builtin {
            reward: self.name(),
            id: r.id.clone(),
            msg,
        };
        match *self {
            Builtin::ExactMatch => Ok(builtin::exact_match(&r.response, &r.answer)),
            Builtin::ChoiceLetter => {
                builtin::choice_letter(&r.response, &r.answer, &r.prompt).map_err(err)
            }
            Builtin::Numeric { tolerance } => {
                builtin::numeric(&r.response, &r.answer, tolerance).map_err(err)
            }
        }
    }
}

/// The job's reward function.
#[derive(Debug)]
pub enum Reward {
    Builtin(Builtin),
    Command(CommandReward),
}

impl Reward {
    /// From the job spec's `reward` section.
    pub fn from_spec(spec: &rollplex_plan::spec::RewardSpec) -> Result<Self, RewardError> {
        use rollplex_plan::spec::RewardSpec;
        Ok(match spec {
            RewardSpec::Builtin { name, tolerance } => {
                Reward::Builtin(Builtin::from_name(name, *tolerance)?)
            }
            RewardSpec::Command { argv, timeout_s } => {
                Reward::Command(CommandReward::new(argv.clone(), *timeout_s)?)
            }
        })
    }

    /// A short name for logs and metrics.
    pub fn name(&self) -> String {
        match self {
            Reward::Builtin(b) => b.name().into(),
            Reward::Command(c) => c.command_line(),
        }
    }

    /// One reward per request, in request order.
    pub fn score(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f64>, RewardError> {
        match self {
            Reward::Builtin(b) => reqs.iter().map(|r| b.score_one(r)).collect(),
            Reward::Command(c) => Ok(c.score(reqs)?),
        }
    }

    /// [`Reward::score`] as the trainer's f32: a finite reward beyond f32's range (1e308 is a
    /// valid JSON number) would become infinite, so it is refused as out of range, naming the
    /// request, rather than passed on as a non-finite value.
    pub fn score_f32(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f32>, RewardError> {
        let scores = self.score(reqs)?;
        scores
            .iter()
            .zip(reqs)
            .map(|(&value, r)| {
                let x = value as f32;
                if x.is_finite() {
                    Ok(x)
                } else {
                    Err(RewardError::OutOfRange {
                        reward: self.name(),
                        id: r.id.clone(),
                        value,
                    })
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollplex_plan::spec::RewardSpec;

    #[test]
    fn spec_builds_builtins_and_commands() {
        let mut r = Reward::from_spec(&RewardSpec::Builtin {
            name: "choice_letter".into(),
            tolerance: 0.0,
        })
        .unwrap();
        let q = "Which way did the red square move? A. left B. right C. up D. down";
        let reqs = [
            RewardRequest {
                id: "0/0".into(),
                prompt: q.into(),
                response: "B".into(),
                answer: "B".into(),
            },
            RewardRequest {
                id: "0/1".into(),
                prompt: q.into(),
                response: "It moved left".into(),
                answer: "B".into(),
            },
        ];
        assert_eq!(r.score(&reqs).unwrap(), vec![1.0, 0.0]);
        let e = Reward::from_spec(&RewardSpec::Builtin {
            name: "bleu".into(),
            tolerance: 0.0,
        })
        .unwrap_err();
        assert!(e.to_string().contains("\"bleu\""));
        let mut bad = reqs.clone();
        bad[1].answer = "right".into();
        let e = r.score(&bad).unwrap_err().to_string();
        assert!(
            e.contains("choice_letter") && e.contains("0/1") && e.contains("no choice letter"),
            "{e}"
        );
        let cmd = Reward::from_spec(&RewardSpec::Command {
            argv: vec!["my-rm".into(), "--x y".into()],
            timeout_s: 3.0,
        })
        .unwrap();
        assert_eq!(cmd.name(), "my-rm '--x y'");
    }

    #[test]
    fn a_finite_reward_beyond_f32_is_out_of_range_not_non_finite() {
        let echo = |reward: &str| {
            Reward::from_spec(&RewardSpec::Command {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("read l; echo '{{\"id\": \"0/0\", \"reward\": {reward}}}'; sleep 5"),
                ],
                timeout_s: 10.0,
            })
            .unwrap()
        };
        let reqs = [RewardRequest {
            id: "0/0".into(),
            prompt: String::new(),
            response: String::new(),
            answer: String::new(),
        }];
        let e = echo("1e308").score_f32(&reqs).unwrap_err().to_string();
        assert!(
            e.contains("out of the range") && e.contains("f32") && e.contains("\"0/0\""),
            "{e}"
        );
        assert!(!e.contains("finite"), "{e}");
        assert_eq!(echo("-2.5").score_f32(&reqs).unwrap(), vec![-2.5]);
    }
}
