//! `--eval-every K`: validation during training. After every K-th iteration the held-out split
//! (`--eval N` prompts) is scored twice, greedy and sampled (the job's sampling under a fixed
//! key, `exec::data::Decoding`), both logged with that iteration's metrics line
//! (`val_reward_greedy`, `val_reward_sampled`, `val_prompts`) and printed; when the greedy
//! score beats every earlier one, the state is saved as `<out>/checkpoints/best` (atomically,
//! beside the `iter-<k>` checkpoints, never pruned), its scores in its run state. A resumed run
//! takes the best score from there, so it keeps the best checkpoint the uninterrupted run
//! would.

use std::path::PathBuf;

use rollplex_plan::spec::JobSpec;

use super::RunArgs;
use crate::ckpt_state;
use crate::exec::checkpoint::{self, RunIdentity, Slot, BEST_DIR, CHECKPOINTS_DIR, VALIDATION_KEY};
use crate::exec::data::{score_split_with, Decoding, Generate};
use crate::exec::{self, ExecError, LoopModels};
use crate::tasks::moving_shapes::Split;

/// One evaluation's mean rewards.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Scores {
    pub(super) greedy: f64,
    pub(super) sampled: f64,
}

/// The validation of a run: when, on how many prompts, and the best greedy score so far.
pub(super) struct Validation {
    spec: JobSpec,
    every: u32,
    prompts: u32,
    /// `<out>/checkpoints`.
    root: PathBuf,
    /// The best greedy score and the iterations done when it was reached.
    best: Option<(f64, u32)>,
}

impl Validation {
    /// `None` without `--eval-every`; refuses it without `--eval N` or without a held-out
    /// split. A resumed run (`first` iterations done) starts from the best checkpoint's score
    /// when that checkpoint is of an iteration it has done (a later one, left by a run that
    /// went further, is replaced at the next evaluation, as the run that stopped at `first`
    /// would have).
    pub(super) fn new(
        spec: &JobSpec,
        args: &RunArgs,
        first: u32,
    ) -> Result<Option<Self>, ExecError> {
        if args.eval_every == 0 {
            return Ok(None);
        }
        if args.eval == 0 {
            return Err(ExecError::Unsupported(format!(
                "--eval-every {} needs --eval N: the number of held-out prompts to score",
                args.eval_every
            )));
        }
        if !exec::data::has_held_out(spec) {
            return Err(ExecError::Unsupported(
                "--eval-every: the job's data has no held-out split to score (the moving-shapes task has one: \
                 dataset = generated(\"moving_shapes\", N))"
                    .into(),
            ));
        }
        let root = args.out.join(CHECKPOINTS_DIR);
        let best_dir = root.join(BEST_DIR);
        let mut best = None;
        if args.resume.is_some() && best_dir.exists() {
            let state = ckpt_state::load_run_state(&best_dir).map_err(|e| {
                ExecError::Checkpoint(format!(
                    "{e} (the best checkpoint of --eval-every; remove {} to start the best over)",
                    best_dir.display()
                ))
            })?;
            let greedy = state
                .extra
                .get(VALIDATION_KEY)
                .and_then(|v| v.get("greedy"))
                .and_then(|g| g.as_f64())
                .ok_or_else(|| {
                    ExecError::Checkpoint(format!(
                        "{}: its run state has no `extra.{VALIDATION_KEY}.greedy` score",
                        best_dir.display()
                    ))
                })?;
            let at = u32::try_from(state.iteration).unwrap_or(u32::MAX);
            if at <= first {
                best = Some((greedy, at));
            }
        }
        Ok(Some(Validation {
            spec: spec.clone(),
            every: args.eval_every,
            prompts: args.eval,
            root,
            best,
        }))
    }

    /// Whether the state after `done` iterations is evaluated.
    pub(super) fn due(&self, done: u32) -> bool {
        done.is_multiple_of(self.every)
    }

    pub(super) fn prompts(&self) -> u32 {
        self.prompts
    }

    /// Scores `models` (the state after `done` iterations) greedy and sampled.
    pub(super) fn score(&self, models: LoopModels<'_>, done: u32) -> Result<Scores, ExecError> {
        match models {
            LoopModels::Cpu(Some(state)) => {
                self.score_with(&mut exec::data::cpu_generate(&state.actor))
            }
            LoopModels::Cpu(None) => Err(ExecError::Plan(format!(
                "iteration {done} is to be evaluated but the ranks did not gather their state \
                 (CpuModels::set_eval_every not called)"
            ))),
            LoopModels::Gpu(m) => self.score_with(
                &mut |p: &exec::PromptData, i: u32, cfg: &crate::model::GenerateConfig| {
                    exec::gpu::generate_tokens(m, p, i, cfg)
                },
            ),
        }
    }

    /// Both scores with one backend's generation.
    fn score_with(&self, generate: &mut Generate<'_>) -> Result<Scores, ExecError> {
        let mut one = |decoding| {
            score_split_with(
                &self.spec,
                Split::Test,
                self.prompts,
                decoding,
                &mut *generate,
            )?
            .ok_or_else(|| ExecError::Plan("the held-out split gave no score".into()))
        };
        Ok(Scores {
            greedy: one(Decoding::Greedy)?,
            sampled: one(Decoding::Sampled)?,
        })
    }

    /// Whether `scores` beat the best so far (the greedy score, strictly: a tie keeps the
    /// earlier checkpoint).
    pub(super) fn is_best(&self, scores: &Scores) -> bool {
        self.best.is_none_or(|(b, _)| scores.greedy > b)
    }

    /// Saves the state after `done` iterations as the best checkpoint and remembers its score.
    pub(super) fn save_best(
        &mut self,
        models: LoopModels<'_>,
        host: Option<&mut crate::model::Qwen25VL>,
        identity: &RunIdentity,
        done: u32,
        scores: Scores,
    ) -> Result<PathBuf, ExecError> {
        let slot = Slot::Best {
            scores: serde_json::json!({
                "greedy": scores.greedy,
                "sampled": scores.sampled,
                "prompts": self.prompts,
            }),
        };
        let path = match models {
            LoopModels::Cpu(Some(state)) => checkpoint::save(&self.root, done, state, identity, &slot)?,
            LoopModels::Cpu(None) => {
                return Err(ExecError::Plan(format!(
                    "iteration {done} is to be saved as the best but the ranks did not gather their state"
                )))
            }
            LoopModels::Gpu(m) => {
                let host = host.ok_or_else(|| {
                    ExecError::Checkpoint("no host copy of the actor to save through".into())
                })?;
                checkpoint::save_gpu(&self.root, done, m, host, identity, &slot)?
            }
        };
        self.best = Some((scores.greedy, done));
        Ok(path)
    }

    /// The console line of an evaluation.
    pub(super) fn line(&self, done: u32, s: &Scores, saved: bool) -> String {
        let (b, at) = self.best.unwrap_or((s.greedy, done));
        format!(
            "validation after {done} iterations ({} held-out prompts): greedy {:.3}, sampled {:.3}; best greedy {b:.3} after {at}{}",
            self.prompts,
            s.greedy,
            s.sampled,
            if saved { " (saved as checkpoints/best)" } else { "" }
        )
    }
}
