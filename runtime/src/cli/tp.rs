//! A tensor-parallel CPU plan whose ranks are processes: this process as one rank over TCP
//! (`--tp-processes` starts them; torchrun or slurm may too). The run itself is `cpu`'s: the
//! same start, observer and evaluations, with a `TcpComm` for the group.

use std::path::Path;

use rollplex_plan::Plan;

use super::cpu::{eval, observer, Start};
use super::load_plan;
use super::output::table_header;
use super::RunArgs;
use crate::exec::checkpoint;
use crate::exec::cpu;
use crate::exec::{self, ExecError};
use crate::tp::launch;

/// This process as rank `env.rank` of the plan's TP group, over TCP.
pub(super) fn run_cpu_process(
    plan: &Plan,
    args: &RunArgs,
    degree: usize,
    env: launch::RankEnv,
    actor: crate::model::Qwen25VL,
    start: Start,
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
        let mut models = cpu::build_rank(&plan.spec, &actor, degree, rank)?;
        start.prepare(&mut models)?;
        let iterations = start.first..args.iterations;
        // rank 0's held-out prompts; the other ranks only take part in gathering the actor
        let mut held = None;
        if rank == 0 {
            let (mut run, (mut source, mut reward)) =
                observer(plan, args, degree, "process", &start)?;
            held = run.held_out.clone();
            if start.first == 0 {
                eval(plan, args, held.as_deref(), &actor, "before")?;
            }
            if !args.quiet {
                println!("{}", table_header());
            }
            let root = cpu::RootSide {
                source: source.as_mut(),
                reward: reward.as_mut(),
                observer: &mut run,
            };
            let r = cpu::run_rank(plan, &comm, &mut models, Some(root), iterations);
            run.finish()?;
            r?;
        } else {
            cpu::run_rank(plan, &comm, &mut models, None, iterations)?;
        }
        if args.eval > 0 {
            if let Some(full) = cpu::gather_actor(&comm, &models)? {
                eval(plan, args, held.as_deref(), &full, "after")?;
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
