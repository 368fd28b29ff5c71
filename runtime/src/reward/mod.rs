//! Rewards of responses: built-in scorers, external reward programs, and weighted sums of them.
//!
//! What this module knows: how to turn (prompt, response, reference answer) into a float,
//! either in process ([`builtin`]: `exact_match`, `choice_letter`, `numeric`; [`math`]: the
//! math/geometry answer verifier; [`format`]: the layout check) or through an external program
//! speaking JSON lines ([`command`]), and `sum_i w_i * r_i` of several. In-process rewards are
//! pure functions of each request ([`HostReward`]), so they may run on the host threads of
//! [`pool`] as soon as a group's responses are final. It does not know tokens or advantages.
//!
//! Invariant: [`Reward::score`] returns one finite reward per request, in request order, or
//! an error; a reward that cannot be computed is never reported as 0. A [`HostReward`] scores
//! a request the same, bit for bit, on any thread and in any batch.

pub mod builtin;
pub mod command;
pub mod format;
pub mod math;
pub mod pool;

use rollplex_plan::spec::{FORMAT_ANSWER_TAG, FORMAT_THINK_TAG};
use serde::Serialize;

pub use command::{CommandError, CommandReward};
pub use pool::{Done, RewardPool, Ticket, Work};

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
    #[error("unknown built-in reward {:?} (known: {})", .0, rollplex_plan::spec::BUILTIN_REWARDS.join(", "))]
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
    #[error("reward sum: {0}")]
    Sum(String),
}

/// A built-in reward.
#[derive(Clone, Debug, PartialEq)]
pub enum Builtin {
    ExactMatch,
    ChoiceLetter,
    /// Absolute tolerance.
    Numeric {
        tolerance: f64,
    },
    /// Relative tolerance for values with an irrational part ([`math`]).
    Math {
        tolerance: f64,
    },
    /// Tag names ([`format`]).
    Format {
        think: String,
        answer: String,
    },
}

impl Builtin {
    /// A built-in by name; `format` takes the default tags ([`FORMAT_THINK_TAG`],
    /// [`FORMAT_ANSWER_TAG`]).
    pub fn from_name(name: &str, tolerance: f64) -> Result<Self, RewardError> {
        Ok(match name {
            "exact_match" => Builtin::ExactMatch,
            "choice_letter" => Builtin::ChoiceLetter,
            "numeric" => Builtin::Numeric { tolerance },
            "math" => Builtin::Math { tolerance },
            "format" => Builtin::Format {
                think: FORMAT_THINK_TAG.into(),
                answer: FORMAT_ANSWER_TAG.into(),
            },
            _ => return Err(RewardError::Unknown(name.into())),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Builtin::ExactMatch => "exact_match",
            Builtin::ChoiceLetter => "choice_letter",
            Builtin::Numeric { .. } => "numeric",
            Builtin::Math { .. } => "math",
            Builtin::Format { .. } => "format",
        }
    }

    pub fn score_one(&self, r: &RewardRequest) -> Result<f64, RewardError> {
        let err = |msg: String| RewardError::Builtin {
            reward: self.name(),
            id: r.id.clone(),
            msg,
        };
        match self {
            Builtin::ExactMatch => Ok(builtin::exact_match(&r.response, &r.answer)),
            Builtin::ChoiceLetter => {
                builtin::choice_letter(&r.response, &r.answer, &r.prompt).map_err(err)
            }
            Builtin::Numeric { tolerance } => {
                builtin::numeric(&r.response, &r.answer, *tolerance).map_err(err)
            }
            Builtin::Math { tolerance } => {
                math::math(&r.response, &r.answer, *tolerance).map_err(err)
            }
            Builtin::Format { think, answer } => Ok(format::format(&r.response, think, answer)),
        }
    }
}

/// One scorer of a [`Reward`]'s sum.
#[derive(Debug)]
enum Scorer {
    Builtin(Builtin),
    Command(CommandReward),
}

/// The job's reward function: `sum_i w_i * r_i` over its terms (one term of weight 1 for a
/// single reward: `1 * r` is `r`, bit for bit).
#[derive(Debug)]
pub struct Reward {
    terms: Vec<(f64, Scorer)>,
}

/// A reward made only of built-ins: a pure function of each request, cheap to clone and safe
/// to share between threads ([`Reward::host`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HostReward {
    terms: Vec<(f64, Builtin)>,
}

/// `sum_i w_i * r_i` per request, terms added in order, checked to have one score per request.
fn weighted_sum(
    n: usize,
    terms: impl Iterator<Item = Result<(f64, Vec<f64>), RewardError>>,
) -> Result<Vec<f64>, RewardError> {
    let mut out: Option<Vec<f64>> = None;
    for term in terms {
        let (w, scores) = term?;
        if scores.len() != n {
            return Err(RewardError::Sum(format!(
                "a term gave {} scores for {n} requests",
                scores.len()
            )));
        }
        match &mut out {
            None => out = Some(scores.iter().map(|s| w * s).collect()),
            Some(acc) => acc.iter_mut().zip(&scores).for_each(|(a, s)| *a += w * s),
        }
    }
    out.ok_or_else(|| RewardError::Sum("a sum of no rewards".into()))
}

/// `name` or `sum(name * w, ...)` for logs and errors.
fn sum_name(terms: impl Iterator<Item = (f64, String)>) -> String {
    let terms: Vec<(f64, String)> = terms.collect();
    match terms.as_slice() {
        [(w, n)] if *w == 1.0 => n.clone(),
        _ => {
            let parts: Vec<String> = terms.iter().map(|(w, n)| format!("{n} * {w}")).collect();
            format!("sum({})", parts.join(", "))
        }
    }
}

impl HostReward {
    /// One reward per request, in request order.
    pub fn score(&self, reqs: &[RewardRequest]) -> Result<Vec<f64>, RewardError> {
        weighted_sum(
            reqs.len(),
            self.terms.iter().map(|(w, b)| {
                let scores = reqs
                    .iter()
                    .map(|r| b.score_one(r))
                    .collect::<Result<_, _>>()?;
                Ok((*w, scores))
            }),
        )
    }

    /// [`HostReward::score`] as the trainer's f32 ([`Reward::score_f32`]).
    pub fn score_f32(&self, reqs: &[RewardRequest]) -> Result<Vec<f32>, RewardError> {
        to_f32(&self.name(), &self.score(reqs)?, reqs)
    }

    pub fn name(&self) -> String {
        sum_name(self.terms.iter().map(|(w, b)| (*w, b.name().to_string())))
    }
}

/// Scores as f32: a finite reward beyond f32's range (1e308 is a valid JSON number) would
/// become infinite, so it is refused as out of range, naming the request, rather than passed
/// on as a non-finite value.
fn to_f32(name: &str, scores: &[f64], reqs: &[RewardRequest]) -> Result<Vec<f32>, RewardError> {
    scores
        .iter()
        .zip(reqs)
        .map(|(&value, r)| {
            let x = value as f32;
            if x.is_finite() {
                Ok(x)
            } else {
                Err(RewardError::OutOfRange {
                    reward: name.into(),
                    id: r.id.clone(),
                    value,
                })
            }
        })
        .collect()
}

impl Reward {
    /// From the job spec's `reward` section (a sum inside a sum is flattened, its weights
    /// multiplied).
    pub fn from_spec(spec: &rollplex_plan::spec::RewardSpec) -> Result<Self, RewardError> {
        let mut terms = Vec::new();
        add_terms(spec, 1.0, &mut terms)?;
        if terms.is_empty() {
            return Err(RewardError::Sum("a sum of no rewards".into()));
        }
        Ok(Reward { terms })
    }

    /// The reward as a [`HostReward`] when every term is a built-in (then it may run on host
    /// threads); `None` when a term is an external command.
    pub fn host(&self) -> Option<HostReward> {
        let terms = self
            .terms
            .iter()
            .map(|(w, s)| match s {
                Scorer::Builtin(b) => Some((*w, b.clone())),
                Scorer::Command(_) => None,
            })
            .collect::<Option<_>>()?;
        Some(HostReward { terms })
    }

    /// A short name for logs and metrics.
    pub fn name(&self) -> String {
        sum_name(self.terms.iter().map(|(w, s)| {
            let n = match s {
                Scorer::Builtin(b) => b.name().to_string(),
                Scorer::Command(c) => c.command_line(),
            };
            (*w, n)
        }))
    }

    /// One reward per request, in request order.
    pub fn score(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f64>, RewardError> {
        weighted_sum(
            reqs.len(),
            self.terms.iter_mut().map(|(w, s)| {
                let scores = match s {
                    Scorer::Builtin(b) => reqs
                        .iter()
                        .map(|r| b.score_one(r))
                        .collect::<Result<_, _>>()?,
                    Scorer::Command(c) => c.score(reqs)?,
                };
                Ok((*w, scores))
            }),
        )
    }

    /// [`Reward::score`] as the trainer's f32: a finite reward beyond f32's range (1e308 is a
    /// valid JSON number) would become infinite, so it is refused as out of range, naming the
    /// request, rather than passed on as a non-finite value.
    pub fn score_f32(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f32>, RewardError> {
        let scores = self.score(reqs)?;
        to_f32(&self.name(), &scores, reqs)
    }
}

fn add_terms(
    spec: &rollplex_plan::spec::RewardSpec,
    weight: f64,
    out: &mut Vec<(f64, Scorer)>,
) -> Result<(), RewardError> {
    use rollplex_plan::spec::RewardSpec;
    if !weight.is_finite() {
        return Err(RewardError::Sum(format!(
            "weight {weight} is not a finite number"
        )));
    }
    match spec {
        RewardSpec::Builtin { name, tolerance } => out.push((
            weight,
            Scorer::Builtin(Builtin::from_name(name, *tolerance)?),
        )),
        RewardSpec::Format { think, answer } => out.push((
            weight,
            Scorer::Builtin(Builtin::Format {
                think: think.clone(),
                answer: answer.clone(),
            }),
        )),
        RewardSpec::Command { argv, timeout_s } => out.push((
            weight,
            Scorer::Command(CommandReward::new(argv.clone(), *timeout_s)?),
        )),
        RewardSpec::Sum { terms } => {
            for t in terms {
                add_terms(&t.reward, weight * t.weight, out)?;
            }
        }
    }
    Ok(())
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
    fn sums_weigh_their_terms_in_order_and_host_rewards_score_the_same() {
        use rollplex_plan::spec::WeightedReward;
        let math = RewardSpec::Builtin {
            name: "math".into(),
            tolerance: 1e-9,
        };
        let format = RewardSpec::Format {
            think: "think".into(),
            answer: "answer".into(),
        };
        let term = |weight, reward: &RewardSpec| WeightedReward {
            weight,
            reward: reward.clone(),
        };
        let spec = RewardSpec::Sum {
            terms: vec![term(0.9, &math), term(0.1, &format)],
        };
        let mut r = Reward::from_spec(&spec).unwrap();
        assert_eq!(r.name(), "sum(math * 0.9, format * 0.1)");
        let req = |response: &str| RewardRequest {
            id: "0/0".into(),
            prompt: String::new(),
            response: response.into(),
            answer: "\\frac{3}{4}".into(),
        };
        let reqs = [
            req("<think>3 of 4</think><answer>0.75</answer>"),
            req("\\boxed{3/4}"),
            req("<think>3 of 4</think><answer>1</answer>"),
            req("nothing"),
        ];
        let want = [
            0.9 * 1.0 + 0.1 * 1.0,
            0.9 * 1.0 + 0.1 * 0.0,
            0.9 * 0.0 + 0.1 * 1.0,
            0.0,
        ];
        let got = r.score(&reqs).unwrap();
        assert_eq!(got, want);
        let host = r.host().expect("built-ins only");
        assert_eq!(host.name(), r.name());
        assert_eq!(host.score(&reqs).unwrap(), got);
        assert_eq!(host.score_f32(&reqs).unwrap(), r.score_f32(&reqs).unwrap());
        // a single reward is itself, bit for bit; a sum inside a sum is flattened
        let one = Reward::from_spec(&math).unwrap();
        assert_eq!(one.name(), "math");
        let nested = RewardSpec::Sum {
            terms: vec![WeightedReward {
                weight: 0.5,
                reward: spec.clone(),
            }],
        };
        assert_eq!(
            Reward::from_spec(&nested).unwrap().name(),
            "sum(math * 0.45, format * 0.05)"
        );
        // with a command in it, the reward runs at the reward task
        let mixed = RewardSpec::Sum {
            terms: vec![
                term(1.0, &math),
                term(
                    1.0,
                    &RewardSpec::Command {
                        argv: vec!["my-rm".into()],
                        timeout_s: 1.0,
                    },
                ),
            ],
        };
        assert!(Reward::from_spec(&mixed).unwrap().host().is_none());
        let empty = RewardSpec::Sum { terms: Vec::new() };
        assert!(Reward::from_spec(&empty)
            .unwrap_err()
            .to_string()
            .contains("no rewards"));
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
