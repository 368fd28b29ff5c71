//! `--backend cpu`: a plan on its ranks, resumed from a checkpoint or fresh. One rank (TP 1)
//! and a tensor-parallel group run the same code: the ranks as threads of this process, or,
//! for a group whose ranks are processes (`RANK` set: `--tp-processes`, torchrun, slurm), this
//! process as one rank (`tp`).

use rollplex_plan::Plan;

use super::output::{eval_greedy, nothing_to_run, open_run, table_header, LoopRun, RunRoofline};
use super::validate::{self, Validation};
use super::RunArgs;
use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::cpu::{self, CpuModels, TrainState};
use crate::exec::{self, ExecError};
use crate::metrics::LoopProgress;
use crate::model::Qwen25VL;
use crate::tp::launch;
use crate::trace::PlanTrace;

pub(super) fn run_cpu(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    let degree = exec::cpu_plan_degree(plan)?;
    if degree > 1 && args.profile.is_some() {
        return Err(ExecError::Unsupported(format!(
            "--profile: a tensor-parallel CPU run's {degree} ranks share this machine's cores, \
             so their task times would calibrate nothing; profile a plan for one rank \
             (`gpu {{ count = 1 }}` without `tp`)"
        )));
    }
    let env = if degree > 1 {
        launch::RankEnv::from_env().map_err(|e| ExecError::Machine(e.to_string()))?
    } else {
        None
    };
    let actor = exec::host_actor(&plan.spec)?;
    let rank0 = env.as_ref().is_none_or(|e| e.rank == 0);
    let start = Start::new(plan, args, &actor, rank0)?;
    if start.first >= args.iterations {
        if rank0 {
            nothing_to_run(start.first, args.iterations);
        }
        return Ok(());
    }
    match env {
        None => run_threads(plan, args, degree, actor, start),
        Some(env) => super::tp::run_cpu_process(plan, args, degree, env, actor, start),
    }
}

/// Where a run starts: its checkpoint identity (when saving, resuming or evaluating), the
/// iterations a resumed checkpoint has done and its state (every rank takes its part of it),
/// and how often the ranks gather their state to save and to evaluate.
pub(super) struct Start {
    pub(super) identity: Option<RunIdentity>,
    pub(super) first: u32,
    resumed: Option<TrainState>,
    save_every: u32,
    eval_every: u32,
}

impl Start {
    /// Loads and checks `--resume`'s checkpoint (each rank process reads it itself: the path
    /// must reach it from every rank) before anything of the run is written; `rank0`: this
    /// process speaks for the run.
    fn new(plan: &Plan, args: &RunArgs, actor: &Qwen25VL, rank0: bool) -> Result<Self, ExecError> {
        let spec = &plan.spec;
        // Hashing the plan and the reference costs a pass over the weights: only when needed.
        let identity = (args.save_every > 0 || args.resume.is_some() || args.eval_every > 0)
            .then(|| RunIdentity::with_reference(plan, spec.reference.enabled.then_some(actor)))
            .transpose()?;
        let (first, resumed) = match (&args.resume, &identity) {
            (Some(p), Some(identity)) => {
                let dir = checkpoint::resolve(p)?;
                let cfg = cpu::train_config(spec)?;
                let (completed, state) =
                    checkpoint::load(&dir, identity, actor.config.clone(), |n| cfg.trainable(n))?;
                if !args.quiet && rank0 {
                    println!(
                        "resuming from {} after {completed} iterations",
                        dir.display()
                    );
                }
                (completed, Some(state))
            }
            _ => (0, None),
        };
        Ok(Start {
            identity,
            first,
            resumed,
            save_every: args.save_every,
            eval_every: args.eval_every,
        })
    }

    /// A rank's models as this run starts them: the checkpoint's part restored, saves set.
    pub(super) fn prepare(&self, models: &mut CpuModels) -> Result<(), ExecError> {
        if let Some(state) = &self.resumed {
            cpu::restore_rank(models, state)?;
        }
        models.set_save_every(self.save_every);
        models.set_eval_every(self.eval_every);
        Ok(())
    }
}

/// Rank 0's observer of a run whose ranks are `how` ("thread" or "process") and its inputs.
pub(super) fn observer<'a>(
    plan: &Plan,
    args: &'a RunArgs,
    degree: usize,
    how: &str,
    start: &Start,
) -> Result<(LoopRun<'a>, super::output::RunSources), ExecError> {
    let (backend, track) = if degree == 1 {
        ("cpu".to_string(), "cpu".to_string())
    } else {
        (
            format!("cpu (TP {degree}, a {how} per rank)"),
            format!("cpu, rank 0 of TP {degree}"),
        )
    };
    let held_out = validate::held_out(&plan.spec, args)?;
    let validation = Validation::new(&plan.spec, args, start.first, held_out.clone())?;
    let (source, reward, metrics) = open_run(plan, args, start.first, &backend)?;
    let profile = args
        .profile
        .as_ref()
        .map(|_| {
            use exec::profile::{Execution, ProfileRecorder};
            ProfileRecorder::for_run(
                plan,
                "cpu",
                Execution::OneAtATime,
                args.iterations - start.first,
            )
        })
        .transpose()?;
    let run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(start.first, args.iterations, args.quiet),
        trace: args.trace.as_ref().map(|_| PlanTrace::new(plan, &track)),
        identity: start.identity.clone(),
        phase_s: [0.0; 4],
        roof: RunRoofline::of(plan),
        profile,
        host: None,
        validation,
        held_out,
    };
    Ok((run, (source, reward)))
}

/// The held-out evaluation of `model` (the initial actor before, the trained one after) on
/// `held` (the run's [`LoopRun::held_out`]).
pub(super) fn eval(
    plan: &Plan,
    args: &RunArgs,
    held: Option<&exec::data::HeldOut>,
    model: &Qwen25VL,
    when: &str,
) -> Result<(), ExecError> {
    eval_greedy(
        &plan.spec,
        args,
        held,
        &mut exec::data::cpu_generate(model),
        when,
    )
}

/// Every rank in this process: one on this thread, or one thread per rank. The held-out
/// evaluations run once, before on the initial actor and after on the ranks' weights gathered
/// into Hugging Face layout.
fn run_threads(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    actor: Qwen25VL,
    start: Start,
) -> Result<(), ExecError> {
    let mut models = cpu::build_ranks(&plan.spec, &actor, degree)?;
    for m in &mut models {
        start.prepare(m)?;
    }
    let (mut run, (mut source, mut reward)) = observer(plan, args, degree, "thread", &start)?;
    // A resumed run's "before" is the original run's.
    if start.first == 0 {
        eval(plan, args, run.held_out.as_deref(), &actor, "before")?;
    }
    drop(actor);
    if !args.quiet {
        println!("{}", table_header());
    }
    let result = exec::run_cpu_loop(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        start.first..args.iterations,
        &mut run,
    );
    run.finish()?;
    result?;
    run.write_profile(plan)?;
    if let Some(held) = run.held_out.as_deref() {
        eval(
            plan,
            args,
            Some(held),
            &cpu::unshard_actor(&models)?,
            "after",
        )?;
    }
    Ok(())
}
