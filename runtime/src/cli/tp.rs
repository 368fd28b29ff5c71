//! A tensor-parallel CPU plan: its ranks as threads of this process, or this process as one
//! rank over TCP (`--tp-processes` starts them; torchrun or slurm may too).

use std::path::Path;

use rollplex_plan::Plan;

use super::output::{nothing_to_run, open_run, report_eval, table_header, LoopRun};
use super::{load_plan, RunArgs};
use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::{self, ExecError};
use crate::metrics::LoopProgress;
use crate::tp::launch;
use crate::trace::PlanTrace;

/// A CPU plan with rollout TP = training TP = GPU count = `degree` > 1: one thread per rank
/// (`exec::cpu_tp`), or, when `RANK` is set (children of `--tp-processes`, torchrun, slurm),
/// this process as that rank over TCP. Rank 0 alone writes metrics and the trace. The held-out
/// evaluations run on one rank (rank 0), before on the initial actor and after on the ranks'
/// weights gathered into Hugging Face layout.
pub(super) fn run_cpu_tp(plan: &Plan, args: &RunArgs, degree: usize) -> Result<(), ExecError> {
    if args.profile.is_some() {
        return Err(ExecError::Unsupported(format!(
            "--profile: a tensor-parallel CPU run's {degree} ranks share this machine's cores, \
             so their task times would calibrate nothing; profile a plan for one rank \
             (`gpu {{ count = 1 }}` without `tp`)"
        )));
    }
    let env = launch::RankEnv::from_env().map_err(|e| ExecError::Machine(e.to_string()))?;
    let actor = exec::host_actor(&plan.spec)?;
    let rank0 = env.as_ref().is_none_or(|e| e.rank == 0);
    let start = TpStart::new(plan, args, &actor, rank0)?;
    if start.first >= args.iterations {
        if rank0 {
            nothing_to_run(start.first, args.iterations);
        }
        return Ok(());
    }
    match env {
        None => run_cpu_tp_threads(plan, args, degree, actor, start),
        Some(env) => run_cpu_tp_process(plan, args, degree, env, actor, start),
    }
}

/// Where a TP run starts: its checkpoint identity (when saving or resuming), the iterations a
/// resumed checkpoint has done and its state (every rank takes its part of it), and when the
/// ranks gather their state to save.
struct TpStart {
    identity: Option<RunIdentity>,
    first: u32,
    resumed: Option<exec::cpu_tp::TpTrainState>,
    checkpoints: Option<exec::cpu_tp::TpCheckpoints>,
}

impl TpStart {
    /// Loads and checks `--resume`'s checkpoint (each rank process reads it itself: the path
    /// must reach it from every rank) before anything of the run is written; `rank0`: this
    /// process speaks for the run.
    fn new(
        plan: &Plan,
        args: &RunArgs,
        actor: &crate::model::Qwen25VL,
        rank0: bool,
    ) -> Result<Self, ExecError> {
        let spec = &plan.spec;
        let identity = (args.save_every > 0 || args.resume.is_some())
            .then(|| RunIdentity::with_reference(plan, spec.reference.enabled.then_some(actor)))
            .transpose()?;
        let (first, resumed) = match (&args.resume, &identity) {
            (Some(p), Some(identity)) => {
                let dir = checkpoint::resolve(p)?;
                let cfg = exec::cpu::train_config(spec)?;
                let (completed, state) =
                    checkpoint::load_tp(&dir, identity, actor.config.clone(), |n| {
                        cfg.trainable(n)
                    })?;
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
        let checkpoints = (args.save_every > 0).then(|| exec::cpu_tp::TpCheckpoints {
            every: args.save_every,
            initial: std::sync::Arc::new(actor.clone()),
        });
        Ok(TpStart {
            identity,
            first,
            resumed,
            checkpoints,
        })
    }

    /// A rank's models as this run starts them: the checkpoint's part restored, saves set.
    fn prepare(&self, models: &mut exec::cpu_tp::TpRankModels) -> Result<(), ExecError> {
        if let Some(state) = &self.resumed {
            exec::cpu_tp::restore_rank(models, state)?;
        }
        models.set_checkpoints(self.checkpoints.clone());
        Ok(())
    }
}

/// Rank 0's observer of a TP run.
fn tp_observer<'a>(
    plan: &Plan,
    args: &'a RunArgs,
    degree: usize,
    how: &str,
    start: &TpStart,
) -> Result<(LoopRun<'a>, RunInputsNoMetrics), ExecError> {
    let (source, reward, metrics) = open_run(
        plan,
        args,
        start.first,
        &format!("cpu (TP {degree}, a {how} per rank)"),
    )?;
    let run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(start.first, args.iterations, args.quiet),
        trace: args
            .trace
            .as_ref()
            .map(|_| PlanTrace::new(plan, &format!("cpu, rank 0 of TP {degree}"))),
        identity: start.identity.clone(),
        phase_s: [0.0; 4],
        profile: None,
        host: None,
    };
    Ok((run, (source, reward)))
}

type RunInputsNoMetrics = (
    Box<dyn exec::prompts::PromptSource>,
    Box<exec::cpu_tp::SendRewardFn<'static>>,
);

fn tp_eval(
    plan: &Plan,
    args: &RunArgs,
    model: &crate::model::Qwen25VL,
    when: &str,
) -> Result<(), ExecError> {
    let acc = exec::evaluate(&plan.spec, model, args.eval)?;
    report_eval(args, acc, when)
}

fn run_cpu_tp_threads(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    actor: crate::model::Qwen25VL,
    start: TpStart,
) -> Result<(), ExecError> {
    let mut models = exec::cpu_tp::build_tp_models_from(&plan.spec, &actor, degree)?;
    for m in &mut models {
        start.prepare(m)?;
    }
    let (mut run, (mut source, mut reward)) = tp_observer(plan, args, degree, "thread", &start)?;
    // A resumed run's "before" is the original run's.
    if start.first == 0 {
        tp_eval(plan, args, &actor, "before")?;
    }
    drop(actor);
    if !args.quiet {
        println!("{}", table_header());
    }
    let result = exec::cpu_tp::run_cpu_tp_loop(
        plan,
        models,
        source.as_mut(),
        reward.as_mut(),
        start.first..args.iterations,
        &mut run,
    );
    run.finish()?;
    let ranks = result?;
    if args.eval > 0 {
        tp_eval(plan, args, &exec::cpu_tp::unshard_actor(&ranks)?, "after")?;
    }
    Ok(())
}

/// This process as rank `env.rank` of the plan's TP group, over TCP.
fn run_cpu_tp_process(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    env: launch::RankEnv,
    actor: crate::model::Qwen25VL,
    start: TpStart,
) -> Result<(), ExecError> {
    use crate::tp::Communicator;
    launch::watch_launcher(env.rank);
    let rank = env.rank;
    if env.world != degree {
        return Err(ExecError::Machine(format!(
            "WORLD_SIZE={} but the plan runs TP {degree}: start one rank per GPU of the plan",
            env.world
        )));
    }
    let job = format!("plan-{}", checkpoint::plan_hash(plan)?);
    let comm = launch::join(&env, &job, Vec::new(), crate::tp::TcpOptions::default())
        .map_err(|e| ExecError::Machine(format!("rank {rank}: {e}")))?;
    let result = (|| -> Result<(), ExecError> {
        let mut models = exec::cpu_tp::build_tp_rank(&plan.spec, &actor, degree, rank)?;
        start.prepare(&mut models)?;
        let iterations = start.first..args.iterations;
        if rank == 0 {
            let (mut run, (mut source, mut reward)) =
                tp_observer(plan, args, degree, "process", &start)?;
            if start.first == 0 {
                tp_eval(plan, args, &actor, "before")?;
            }
            if !args.quiet {
                println!("{}", table_header());
            }
            let root = exec::cpu_tp::RootSide {
                source: source.as_mut(),
                reward: reward.as_mut(),
                observer: &mut run,
            };
            let r = exec::cpu_tp::run_tp_rank(plan, &comm, &mut models, Some(root), iterations);
            run.finish()?;
            r?;
        } else {
            exec::cpu_tp::run_tp_rank(plan, &comm, &mut models, None, iterations)?;
        }
        if args.eval > 0 {
            if let Some(full) = exec::cpu_tp::gather_actor(&comm, &models, &actor)? {
                tp_eval(plan, args, &full, "after")?;
            }
        }
        Ok(())
    })();
    if let Err(e) = &result {
        comm.abort(&e.to_string());
    }
    result.map_err(|e| ExecError::Rank {
        rank,
        source: Box::new(e),
    })
}

/// `rollplex-run PLAN --tp-processes` without `RANK`: starts one process per rank of the
/// plan's TP group (this executable, these arguments) and waits for them (`tp::launch`).
pub(super) fn launch_tp_ranks(plan_path: &Path) -> std::process::ExitCode {
    use std::process::ExitCode;
    let degree = match load_plan(plan_path).and_then(|p| exec::cpu_plan_degree(&p)) {
        Ok(d) if d > 1 => d,
        Ok(_) => {
            eprintln!(
                "error: --tp-processes runs a tensor-parallel plan's ranks as processes; this plan runs TP 1 (drop the flag)"
            );
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(e.exit_code());
        }
    };
    match launch::Launch::this_process(degree).and_then(|l| launch::launch(&l)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
