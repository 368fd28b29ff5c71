//! `--backend cpu` on one rank: the single-rank models, resumed from a checkpoint or fresh.

use rollplex_plan::Plan;

use super::output::{nothing_to_run, open_run, report_eval, table_header, LoopRun};
use super::RunArgs;
use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::{self, ExecError};
use crate::metrics::LoopProgress;
use crate::trace::PlanTrace;

pub(super) fn run_cpu(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    let degree = exec::cpu_plan_degree(plan)?;
    if degree > 1 {
        return super::tp::run_cpu_tp(plan, args, degree);
    }
    let spec = &plan.spec;
    // A checkpoint is loaded and checked before anything of the run is written.
    let fresh = exec::build_cpu_models(spec)?;
    // Hashing the plan and the reference costs a pass over the weights: only when needed.
    let identity = (args.save_every > 0 || args.resume.is_some())
        .then(|| RunIdentity::of(plan, &fresh))
        .transpose()?;
    let (mut models, first) = match (&args.resume, &identity) {
        (Some(p), Some(identity)) => {
            let dir = checkpoint::resolve(p)?;
            let r = checkpoint::load(&dir, identity, fresh)?;
            if !args.quiet {
                println!(
                    "resuming from {} after {} iterations",
                    r.dir.display(),
                    r.completed
                );
            }
            (r.models, r.completed)
        }
        _ => (fresh, 0),
    };
    if first >= args.iterations {
        nothing_to_run(first, args.iterations);
        return Ok(());
    }
    let profile = args
        .profile
        .as_ref()
        .map(|_| {
            use exec::profile::{Execution, ProfileRecorder};
            ProfileRecorder::for_run(plan, "cpu", Execution::OneAtATime, args.iterations - first)
        })
        .transpose()?;
    let (mut source, mut reward, metrics) = open_run(plan, args, first, "cpu")?;
    let eval = |models: &exec::cpu::CpuModels, when: &str| -> Result<(), ExecError> {
        let acc = exec::evaluate(spec, models.trainer.model(), args.eval)?;
        report_eval(args, acc, when)
    };
    // A resumed run's "before" is the original run's.
    if first == 0 {
        eval(&models, "before")?;
    }
    if !args.quiet {
        println!("{}", table_header());
    }
    let mut run = LoopRun {
        args,
        metrics,
        progress: LoopProgress::new(first, args.iterations, args.quiet),
        trace: args.trace.as_ref().map(|_| PlanTrace::new(plan, "cpu")),
        identity,
        phase_s: [0.0; 4],
        profile,
        host: None,
    };
    let result = exec::run_cpu_loop(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        first..args.iterations,
        &mut run,
    );
    run.finish()?;
    result?;
    run.write_profile(plan)?;
    eval(&models, "after")
}
