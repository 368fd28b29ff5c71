//! The held-out evaluations of a run. `--eval N` scores N held-out prompts: the first N records
//! of `--eval-data` (a JSONL or Parquet file in the training dataset's format, all of it when
//! it holds fewer), or of the moving-shapes task's test split ([`held_out`]).
//!
//! `--eval-every K`: validation during training. After every K-th iteration the held-out
//! prompts are scored twice, greedy and sampled (the job's sampling under a fixed key,
//! `exec::data::Decoding`), both logged with that iteration's metrics line
//! (`val_reward_greedy`, `val_reward_sampled`, `val_prompts`) and printed; when the greedy
//! score beats every earlier one, the state is saved as `<out>/checkpoints/best` (atomically,
//! beside the `iter-<k>` checkpoints, never pruned), its scores in its run state. A resumed run
//! takes the best score from there, so it keeps the best checkpoint the uninterrupted run
//! would.

use std::path::PathBuf;
use std::sync::Arc;

use rollplex_plan::spec::{DatasetSpec, JobSpec};

use super::RunArgs;
use crate::ckpt_state;
use crate::exec::checkpoint::{self, RunIdentity, Slot, BEST_DIR, CHECKPOINTS_DIR, VALIDATION_KEY};
use crate::exec::data::{score_held_out, Decoding, Generate, HeldOut};
use crate::exec::{self, ExecError, LoopModels};
use crate::tasks::moving_shapes::Split;

/// The held-out prompts `--eval N` scores: `--eval-data`'s file (loaded as the training data
/// is, and its first N records built once here, so a record that does not fit the plan stops
/// the run before it writes anything), else the moving-shapes task's test split; `None`
/// without `--eval` or when the job has neither. Refuses `--eval-data` for a job whose rollout
/// draws synthetic prompts, and without `--eval N`; says so when the file holds fewer than N.
pub(super) fn held_out(spec: &JobSpec, args: &RunArgs) -> Result<Option<Arc<HeldOut>>, ExecError> {
    let Some(path) = &args.eval_data else {
        if args.eval == 0 {
            return Ok(None);
        }
        return Ok(HeldOut::split(spec, Split::Test)?.map(Arc::new));
    };
    if matches!(spec.rollout.dataset, DatasetSpec::Synthetic) {
        return Err(ExecError::Unsupported(format!(
            "--eval-data {}: the job's rollout draws synthetic prompts (dataset = synthetic: random \
             tokens and pixels, no answers to score), not a dataset's; train on a dataset \
             (dataset = file(\"train.jsonl\")) to validate on a held-out file in its format",
            path.display()
        )));
    }
    if args.eval == 0 {
        return Err(ExecError::Unsupported(format!(
            "--eval-data {} needs --eval N: how many of its prompts to score",
            path.display()
        )));
    }
    // the file's errors say which flag named it
    let flagged = |e| match e {
        ExecError::Data(msg) => ExecError::Data(format!("--eval-data: {msg}")),
        e => e,
    };
    let held = HeldOut::file(spec, path).map_err(flagged)?;
    held.check(args.eval).map_err(flagged)?;
    let n = held.count(args.eval);
    if n < args.eval {
        eprintln!(
            "warning: --eval {} asks for more prompts than {} holds: all {n} of them are scored",
            args.eval,
            path.display()
        );
    }
    Ok(Some(Arc::new(held)))
}

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
    held: Arc<HeldOut>,
    /// How many of `held` are scored ([`HeldOut::count`] of `--eval N`).
    prompts: u32,
    /// `<out>/checkpoints`.
    root: PathBuf,
    /// The best greedy score and the iterations done when it was reached.
    best: Option<(f64, u32)>,
}

impl Validation {
    /// `None` without `--eval-every`; refuses it without `--eval N` or without held-out
    /// prompts (`held`, from [`held_out`]). A resumed run (`first` iterations done) starts from the best checkpoint's score
    /// when that checkpoint is of an iteration it has done (a later one, left by a run that
    /// went further, is replaced at the next evaluation, as the run that stopped at `first`
    /// would have).
    pub(super) fn new(
        spec: &JobSpec,
        args: &RunArgs,
        first: u32,
        held: Option<Arc<HeldOut>>,
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
        let Some(held) = held else {
            let how = match spec.rollout.dataset {
                DatasetSpec::Synthetic => {
                    "its rollout draws synthetic prompts, which have no answers; train on a \
                     dataset file and give a held-out one with --eval-data FILE, or on the \
                     moving-shapes task (dataset = generated(\"moving_shapes\", N)), whose test \
                     split is held out"
                }
                _ => "give one with --eval-data FILE (a JSONL or Parquet file in the training dataset's format)",
            };
            return Err(ExecError::Unsupported(format!(
                "--eval-every: the job's data has no held-out split to score: {how}"
            )));
        };
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
            prompts: held.count(args.eval),
            held,
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
            score_held_out(
                &self.spec,
                &self.held,
                self.prompts,
                decoding,
                &mut *generate,
            )
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
                "data": self.held.describe(),
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
