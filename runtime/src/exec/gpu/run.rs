//! The iteration loop on the GPU: the walker over the plan's tasks, the memory checks, the
//! observer's times; and greedy evaluation.

use std::time::{Duration, Instant};

use rollplex_plan::plan::{Op, Plan, Purpose, Task};
use rollplex_plan::TaskId;

use super::super::cpu::RewardFn;
use super::super::walker::{self, TaskRunner};
use super::super::{ExecError, IterationResult, LoopModels, LoopObserver, PromptData};
use super::models::{check_gpu_plan, GpuModels, GIB, WORKSPACE_ALLOWANCE};
use super::pacing::StreamRef;
use super::streams::{blocks_host, PlanStreams};
use super::{GpuExecOptions, GpuIteration};
use crate::model::GenerateConfig;

impl TaskRunner for GpuIteration<'_, '_> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.book.slots_bound()
    }

    /// Non-blocking tasks first: they are launched and run on the device while the host waits
    /// inside a blocking one.
    fn rank(&self, task: &Task) -> u8 {
        u8::from(blocks_host(&task.op))
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        self.residency.step(task)?;
        let s = self.streams.for_task(self.plan, task)?;
        // Wait for every task this one depends on, and for the previous task of its plan
        // stream, that ran on another CUDA stream (a plan stream's tasks may run on different
        // partitions: inside and outside decode windows). Deferred ones are launched first.
        let prev = self.last_on_stream[task.stream.index()];
        let waits: Vec<TaskId> = task.deps.iter().copied().chain(prev).collect();
        // A deferred task it waits for is launched first, unless this task is deferred too
        // behind it on the same CUDA stream (deferred pieces launch in order, so the stream
        // orders them).
        let deferring = self.defers(task);
        if task.window.is_none() {
            // out of the decode windows nothing waits to be paced
            self.flush_deferred()?;
        }
        let first = self
            .deferred
            .launch_first(&waits, &StreamRef(s.clone()), deferring);
        self.flush_deferred_for(&first)?;
        for d in waits.iter().filter(|&&id| !self.deferred.contains(id)) {
            let (_, end, on) = self
                .events
                .get(d.index())
                .and_then(Option::as_ref)
                .ok_or_else(|| {
                    ExecError::Plan(format!("{} runs before its dependency {d}", task.id))
                })?;
            if on.cu_stream() != s.cu_stream() {
                s.wait(end)?;
            }
        }
        if matches!(
            task.op,
            Op::ActorPrefix {
                purpose: Purpose::Train { .. },
                ..
            }
        ) {
            self.book.metrics.train_prefix_tasks += 1;
        }
        if deferring {
            let pieces = self.pieces_of(&task.op)?;
            self.deferred.push(task.id, StreamRef(s), pieces);
            self.last_on_stream[task.stream.index()] = Some(task.id);
            self.book.metrics.tasks += 1;
            return self.retire_ready();
        }
        let start = self.models.gpu.timing_event()?;
        start.record(&s)?;
        self.run_op(&s, &task.op)?;
        let end = self.models.gpu.timing_event()?;
        end.record(&s)?;
        self.events[task.id.index()] = Some((start, end, s));
        if matches!(task.op, Op::DecodeWindow { .. }) {
            self.decode_marks[task.id.index()] = Some(std::mem::take(&mut self.step_marks));
        }
        self.last_on_stream[task.stream.index()] = Some(task.id);
        self.book.metrics.tasks += 1;
        self.retire_ready()
    }
}

/// [`run_gpu_loop_with`] with the default options.
pub fn run_gpu_loop(
    plan: &Plan,
    models: &mut GpuModels,
    source: &mut dyn super::super::prompts::PromptSource,
    reward: &mut RewardFn<'_>,
    iterations: std::ops::Range<u32>,
    observer: &mut dyn LoopObserver,
) -> Result<(), ExecError> {
    let options = GpuExecOptions::default();
    run_gpu_loop_with(plan, models, source, reward, iterations, observer, options)
}

/// Runs iterations `iterations` of `plan` on the GPU, telling `observer` about every task (with
/// its device start and end, mapped onto the host clock from the iteration's start) and every
/// iteration.
pub fn run_gpu_loop_with(
    plan: &Plan,
    models: &mut GpuModels,
    source: &mut dyn super::super::prompts::PromptSource,
    reward: &mut RewardFn<'_>,
    iterations: std::ops::Range<u32>,
    observer: &mut dyn LoopObserver,
    options: GpuExecOptions,
) -> Result<(), ExecError> {
    check_gpu_plan(plan, &models.gpu)?;
    models.trainer.follow_plan(plan);
    let streams = PlanStreams::with_options(plan, &models.gpu, options.streams)?;
    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    let program = plan.gpus[0].id;
    let tasks = plan.tasks.iter().filter(|t| t.gpu == program).count();
    let origin_stream = streams.get(
        plan.streams
            .iter()
            .find(|s| s.gpu == program)
            .ok_or_else(|| ExecError::Plan("GPU program 0 has no stream".into()))?
            .id,
    )?;
    // The next iteration's prompts are drawn on a host thread while this one runs.
    // Memory. Models built for this plan (`build_gpu_models_for`) sit in its device arena,
    // allocated once, and each iteration's kept buffers go at their plan offsets in it
    // (`exec::placement`); the working sets inside tasks come from the memory pool. Models
    // built without a plan (benchmarks that run several plans on one set of models): the
    // plan's arena is reserved in the pool once instead, and every buffer comes from the pool.
    // Either way state whose plan buffers end early is let go then (`Held`), and an iteration
    // that holds more than the plan counts (plus an allowance for fixed workspaces) is
    // reported.
    let arena: u64 = plan
        .memory
        .arenas
        .iter()
        .filter(|a| a.gpu == program && a.kind == rollplex_plan::plan::ArenaKind::Device)
        .map(|a| a.bytes)
        .sum();
    let placed = match &models.arena {
        Some(a) if !a.fits(plan) => {
            return Err(ExecError::Plan(
                "the models were placed in another plan's device arena: build them for this \
                 plan (build_gpu_models_for)"
                    .into(),
            ))
        }
        Some(a) => a.mapped(),
        None => {
            let (used, _) = models.gpu.pool_usage()?;
            models
                .gpu
                .reserve_pool(&models.stream, arena.saturating_sub(used))?;
            0
        }
    };
    // with the arena placed, the pool holds the tasks' working sets the arena also leaves room
    // for (its `scratch.*` ranges): the bound is then the job's budget
    let budget = plan
        .memory
        .gpus
        .iter()
        .find(|m| m.gpu == program)
        .map_or(0, |m| m.budget);
    let limit = if placed > 0 {
        budget.max(arena + WORKSPACE_ALLOWANCE)
    } else {
        arena + WORKSPACE_ALLOWANCE
    };
    let mut over_arena = false;
    let ran = super::super::prompts::for_each_prefetched(
        source,
        iterations,
        groups,
        |it, prompts, t0| {
            models.gpu.ctx().synchronize()?;
            models.gpu.reset_pool_peak()?;
            if let Some(a) = &models.arena {
                // the device is idle: the last iteration's buffers are dead
                a.reset_iteration();
            }
            let origin = models.gpu.timing_event()?;
            origin.record(origin_stream)?;
            // the host instant of `origin` (device times map onto the host clock from here)
            let t_origin = Instant::now();
            observer.iteration_started(it, tasks);
            let (result, times) = {
                let mut iter =
                    GpuIteration::new(plan, models, &streams, reward, it, &prompts, &options)?;
                let mut started = Started {
                    inner: &mut iter,
                    observer: &mut *observer,
                    iteration: it,
                    log: options.task_log.then_some(t0),
                };
                walker::walk(plan, program, &mut started, |_, _| {})?;
                iter.flush_deferred()?;
                iter.models.gpu.ctx().synchronize()?;
                let times = iter.task_times(&origin)?;
                let steps = iter.step_times(&origin)?;
                let mut result = iter.finish()?;
                let peak = placed + models.gpu.pool_usage()?.1;
                result.metrics.peak_mem_bytes = Some(peak);
                if peak > limit && !over_arena {
                    // once per run: the plan's memory numbers are what a user sizes GPUs by
                    over_arena = true;
                    eprintln!(
                    "warning: iteration {it} held {:.2} GiB of device memory at its peak, more \
                     than {} ({:.2} GiB): the runtime kept memory the plan does not count",
                    peak as f64 / GIB,
                    if placed > 0 {
                        "the job's memory budget"
                    } else {
                        "1 GiB above the plan's device arena"
                    },
                    limit as f64 / GIB
                );
                }
                (result, (times, steps))
            };
            let (times, steps) = times;
            let wall = t0.elapsed();
            let at = |ms: f64| t_origin + Duration::from_secs_f64(ms.max(0.0) / 1e3);
            for (i, a, b) in times {
                observer.task_done(it, &plan.tasks[i], at(a), at(b));
            }
            for (i, marks) in steps {
                let marks: Vec<Instant> = marks.into_iter().map(at).collect();
                observer.decode_steps(it, &plan.tasks[i], &marks);
            }
            for span in reward.take_spans() {
                observer.reward_span(&span);
            }
            observer.iteration_done(it, &result, LoopModels::Gpu(models), t0, wall)
        },
    );
    // the loop's streams go with it: so do the GEMM workspaces and handles made for them, and
    // the decode graphs captured on them (which hold the streams and bake in the workspaces)
    if let Some(d) = models.decode.as_mut() {
        d.forget_graphs();
    }
    let forgot = models.gpu.forget_streams(streams.all());
    ran?;
    Ok(forgot?)
}

/// Tells the observer when each task is launched (its device times come after the iteration).
struct Started<'a, 'b, 'r> {
    inner: &'a mut GpuIteration<'b, 'r>,
    observer: &'a mut dyn LoopObserver,
    iteration: u32,
    /// With [`GpuExecOptions::task_log`]: the iteration's start, to log each task to stderr as it
    /// runs.
    log: Option<Instant>,
}

impl TaskRunner for Started<'_, '_, '_> {
    type Error = ExecError;
    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        self.observer.task_started(self.iteration, task);
        let t0 = Instant::now();
        // kernel timing's scope: the task's kind (side pieces set their own)
        (self.inner.models.gpu)
            .set_kernel_scope(Some(rollplex_cost::defaults::kind_name(task.kind)));
        let ran = self.inner.run(task);
        // cleared whether or not the task ran: launches after a failed task are not its own
        self.inner.models.gpu.set_kernel_scope(None);
        ran?;
        if let Some(start) = self.log {
            // host times: when the launches of `task` began and how long the host spent in them;
            // the memory pool's bytes in use once they are queued (stream-ordered allocations
            // count when queued) and its high-water mark of the iteration so far
            let (used, high) = self.inner.models.gpu.pool_usage().unwrap_or((0, 0));
            eprintln!(
                "[iteration {} +{:.3} s] {} ({}): host {:.1} ms, pool {:.2} GiB, high {:.2} GiB",
                self.iteration,
                t0.duration_since(start).as_secs_f64(),
                task.name,
                task.id,
                t0.elapsed().as_secs_f64() * 1e3,
                used as f64 / GIB,
                high as f64 / GIB
            );
        }
        Ok(())
    }
    fn slots_bound(&self) -> u32 {
        self.inner.slots_bound()
    }
    fn rank(&self, task: &Task) -> u8 {
        self.inner.rank(task)
    }
}

/// Runs iterations `first .. first + count` of `plan` on the GPU. `on_iteration` sees each
/// iteration's result and wall time as soon as it is done.
pub fn run_gpu_iterations(
    plan: &Plan,
    models: &mut GpuModels,
    source: &mut dyn super::super::prompts::PromptSource,
    reward: &mut RewardFn<'_>,
    first: u32,
    count: u32,
    on_iteration: impl FnMut(u32, &IterationResult, Duration) -> Result<(), ExecError>,
) -> Result<(), ExecError> {
    run_gpu_loop(
        plan,
        models,
        source,
        reward,
        first..first + count,
        &mut super::super::EachIteration(on_iteration),
    )
}

/// The answer tokens of one prompt with the GPU model (evaluation): encode, prefill, generate
/// under `cfg` (greedy or sampled, as its sampling says).
pub fn generate_tokens(
    models: &GpuModels,
    prompt: &PromptData,
    sample: u32,
    cfg: &GenerateConfig,
) -> Result<Vec<u32>, ExecError> {
    let (gpu, s) = (&models.gpu, &models.stream);
    let model = models.trainer.model();
    let media = GpuIteration::encode(gpu, s, model, std::slice::from_ref(prompt), &[0], 1, None)?;
    let state = GpuIteration::prefill(
        gpu,
        s,
        model,
        std::slice::from_ref(prompt),
        &[0],
        &media,
        1,
        None,
    )?
    .pop()
    .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))?;
    let mut out = model.generate_group(gpu, s, &state, &[sample], cfg)?;
    Ok(out.pop().map(|r| r.tokens).unwrap_or_default())
}
