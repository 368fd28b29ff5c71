//! `--backend cuda`: one GPU, the plan's streams as CUDA streams (`exec::gpu`).

use rollplex_plan::Plan;

use super::output::{eval_greedy, nothing_to_run, open_run, table_header, LoopRun, RunRoofline};
use super::RunArgs;
use crate::exec::checkpoint::{self, RunIdentity};
use crate::exec::{self, ExecError};
use crate::metrics::LoopProgress;
use crate::trace::PlanTrace;

/// The CUDA run: one GPU, the plan's streams as CUDA streams (`exec::gpu`).
pub(super) fn run_cuda(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    // Checked before the models are built (a large random model takes a while on the host).
    let gpu = exec::gpu::open_gpu()?;
    exec::gpu::check_gpu_plan(plan, &gpu)?;
    exec::gpu::check_host_memory(plan)?;
    // Decode windows run on SM partitions when green contexts work (exec::gpu::PlanStreams),
    // else on plain streams sharing the SMs (exec::profile::Execution).
    let options = exec::gpu::GpuExecOptions {
        task_log: args.task_log,
        streams: crate::gpu::streams::StreamOptions {
            green_contexts: !args.no_green_contexts,
        },
        eager_decode: args.eager_decode,
    };
    let partitioned = exec::gpu::PlanStreams::with_options(plan, &gpu, options.streams)?.green();
    drop(gpu);
    let spec = &plan.spec;
    // The held-out prompts, checked before the models are built.
    let held_out = super::validate::held_out(spec, args)?;
    let setup = std::time::Instant::now();
    // Checkpoints (the CPU path's format and checks, `checkpoint::save_gpu` / `load_gpu`): the
    // initial actor stays on the host, hashed for the run's identity and kept as the copy the
    // saves write through; a checkpoint is loaded and checked before anything is written.
    let saves = args.save_every > 0 || args.resume.is_some() || args.eval_every > 0;
    let (mut models, identity, host, first) = if saves {
        let actor = exec::host_actor(spec)?;
        let identity = RunIdentity::with_reference(plan, spec.reference.enabled.then_some(&actor))?;
        let fresh = exec::gpu::build_gpu_models_for(plan, &actor)?;
        match &args.resume {
            Some(p) => {
                let dir = checkpoint::resolve(p)?;
                let r = checkpoint::load_gpu(&dir, &identity, fresh)?;
                if !args.quiet {
                    println!(
                        "resuming from {} after {} iterations",
                        r.dir.display(),
                        r.completed
                    );
                }
                (r.models, Some(identity), Some(r.host), r.completed)
            }
            None => (fresh, Some(identity), Some(actor), 0),
        }
    } else {
        let actor = exec::host_actor(spec)?;
        (
            exec::gpu::build_gpu_models_for(plan, &actor)?,
            None,
            None,
            0,
        )
    };
    if !args.quiet || args.task_log {
        eprintln!(
            "models built and uploaded in {:.1} s",
            setup.elapsed().as_secs_f64()
        );
    }
    if first >= args.iterations {
        nothing_to_run(first, args.iterations);
        return Ok(());
    }
    let profile = args
        .profile
        .as_ref()
        .map(|_| {
            use exec::profile::{Execution, ProfileRecorder};
            let execution = if partitioned {
                Execution::Partitioned
            } else {
                Execution::Shared
            };
            // the host link's rates from the copies of state the plan keeps on the host
            let copies = models.arena.as_ref().map(|a| a.copying_tasks(plan));
            ProfileRecorder::for_run(plan, "cuda", execution, args.iterations - first)
                .map(|r| r.measure_host_copies(copies.into_iter().flatten()))
        })
        .transpose()?;
    let validation = super::validate::Validation::new(spec, args, first, held_out.clone())?;
    let (mut source, mut reward, metrics) = open_run(plan, args, first, "cuda")?;
    let eval = |models: &exec::gpu::GpuModels, when: &str| -> Result<(), ExecError> {
        eval_greedy(
            spec,
            args,
            held_out.as_deref(),
            &mut |p, i, cfg| exec::gpu::generate_tokens(models, p, i, cfg),
            when,
        )
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
        trace: args.trace.as_ref().map(|_| PlanTrace::new(plan, "cuda")),
        identity,
        phase_s: [0.0; 4],
        roof: RunRoofline::of(plan),
        profile,
        host,
        validation,
        held_out: held_out.clone(),
    };
    if models.gpu.kernel_times() {
        // the table counts the iterations only
        models
            .gpu
            .take_kernel_times()
            .map_err(|e| ExecError::Gpu(e.into()))?;
    }
    let result = exec::gpu::run_gpu_loop_with(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        first..args.iterations,
        &mut run,
        options,
    );
    run.finish()?;
    result?;
    if let Some(a) = &models.arena {
        let spilled = a.usage().iter().any(|u| u.spills > 0);
        if spilled {
            eprintln!(
                "warning: some buffers did not fit their plan ranges and came from the memory \
                 pool (the plan sized them otherwise than this run's data)"
            );
        }
        if !args.quiet || spilled {
            eprint!("{}", a.report());
        }
    }
    run.write_profile(plan)?;
    if models.gpu.kernel_times() {
        // ROLLPLEX_KERNEL_TIMES=1: where the device time went, every iteration of the run
        let times = models
            .gpu
            .take_kernel_times()
            .map_err(|e| ExecError::Gpu(e.into()))?;
        eprintln!(
            "kernel times (ROLLPLEX_KERNEL_TIMES=1; {} iterations, per task kind; eager launches and decode graph replays):",
            args.iterations - first
        );
        eprint!(
            "{}",
            rollplex_kernels::cuda::kernel_times_table(&times, args.iterations - first, 0.005)
        );
    }
    eval(&models, "after")
}
