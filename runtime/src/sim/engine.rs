//! The event-driven core of the simulator, on its own small input types (the plan is mapped
//! into them by `super::simulate`).
//!
//! Model: every stream runs its tasks one after another, in order; a task starts when it is at
//! the head of its stream and all its dependencies are done. A running task progresses at
//! rate `1 / (time(kind, work, sms) * slowdown)`, where `sms` is its partition (scaled down in
//! proportion when the tasks running on one GPU ask for more SMs than it has, as plain streams
//! share SMs) and `slowdown` is the largest co-run slowdown against the other GPU tasks
//! running on the same GPU at that moment. Rates are recomputed at every start and finish
//! (processor sharing with piecewise-constant rates), so the result is exact for this model.
//! Host tasks (`uses_sms == false`: reward on the CPU, copies on the copy engines) take no
//! SMs; only reward is also free of contention (the cost model's slowdown says so).
//!
//! Invariants: a task never starts before its dependencies end or before its stream
//! predecessor ends; every finished task has `start <= end`; the run ends with every task
//! finished or with an error that names the tasks that could not start.

use rollplex_cost::CostModel;
use rollplex_plan::work::{HostDir, Work, WorkKind};

/// One GPU (program) of the simulation.
#[derive(Clone, Debug)]
pub struct DeviceIn {
    pub sms: u32,
}

/// One task: `stream` and `device` index the input's tables, `deps` index `tasks`.
#[derive(Clone, Debug)]
pub struct TaskIn {
    pub stream: usize,
    pub device: usize,
    pub deps: Vec<usize>,
    pub kind: WorkKind,
    pub work: Work,
    /// Which way its host bytes go (the plan op's `host_dir`).
    pub host_dir: HostDir,
    /// Requested SMs (its partition).
    pub sms: u32,
    /// Whether the task occupies SMs (false for host work and copy-engine transfers).
    pub uses_sms: bool,
}

#[derive(Clone, Debug)]
pub struct Input {
    pub devices: Vec<DeviceIn>,
    /// Device of each stream.
    pub streams: Vec<usize>,
    /// In issue order: each stream runs its tasks in this order.
    pub tasks: Vec<TaskIn>,
}

/// What happened to one task.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TaskOut {
    pub start_s: f64,
    pub end_s: f64,
    /// Time alone on its requested partition (no contention), seconds.
    pub alone_s: f64,
    /// Time-averaged SMs it ran on.
    pub avg_sms: f64,
    /// Time-averaged co-run slowdown it saw.
    pub avg_slowdown: f64,
}

/// A sample of one device's state, valid from `t_s` until the next sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSample {
    pub t_s: f64,
    /// SMs allocated to running tasks (sum of their partitions, at most the device's SMs; a
    /// memory-bound task holds its SMs without keeping their tensor cores busy).
    pub sms: f64,
    /// HBM traffic of the running tasks, bytes/s (each task's bytes spread over its run).
    pub hbm_bw: f64,
    /// Arithmetic rate of the running tasks, FLOP/s (each task's flops spread over its run).
    pub flops: f64,
    /// Tasks running.
    pub running: u32,
}

#[derive(Clone, Debug)]
pub struct Output {
    pub tasks: Vec<TaskOut>,
    pub samples: Vec<Vec<DeviceSample>>,
    pub makespan_s: f64,
}

/// Why a run could not finish.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineError {
    /// Index out of range in the input.
    BadInput(String),
    /// No task can start and none is running: a dependency cycle, or a dependency on a task
    /// that is behind the dependent one on the same stream. Lists the blocked tasks.
    Stuck(Vec<usize>),
    /// A task would take forever (e.g. zero SMs for GPU work).
    Infinite(usize),
}

struct Running {
    task: usize,
    /// Remaining fraction of the work, 1 -> 0.
    left: f64,
    rate: f64,
    sms: f64,
    slowdown: f64,
    /// Integrals for the averages.
    sms_time: f64,
    slow_time: f64,
}

/// Runs the model described in the module doc.
pub fn run(input: &Input, cost: &CostModel) -> Result<Output, EngineError> {
    let n = input.tasks.len();
    for (i, t) in input.tasks.iter().enumerate() {
        if t.device >= input.devices.len() || t.stream >= input.streams.len() {
            return Err(EngineError::BadInput(format!(
                "task {i}: device or stream out of range"
            )));
        }
        if let Some(d) = t.deps.iter().find(|&&d| d >= n) {
            return Err(EngineError::BadInput(format!(
                "task {i}: dependency {d} out of range"
            )));
        }
    }
    // per stream: its tasks in order
    let mut queues: Vec<Vec<usize>> = vec![Vec::new(); input.streams.len()];
    for (i, t) in input.tasks.iter().enumerate() {
        queues[t.stream].push(i);
    }
    let mut head = vec![0usize; queues.len()];
    let mut stream_busy = vec![false; queues.len()];
    let mut done = vec![false; n];
    let mut out = vec![TaskOut::default(); n];
    let mut running: Vec<Running> = Vec::new();
    let mut samples: Vec<Vec<DeviceSample>> = vec![Vec::new(); input.devices.len()];
    let mut now = 0.0f64;
    let mut finished = 0usize;

    loop {
        // start every task that can start now
        for s in 0..queues.len() {
            if stream_busy[s] || head[s] >= queues[s].len() {
                continue;
            }
            let i = queues[s][head[s]];
            if input.tasks[i].deps.iter().all(|&d| done[d]) {
                let t = &input.tasks[i];
                let alone = cost.time_dir(t.kind, &t.work, t.sms, t.host_dir);
                if !alone.is_finite() {
                    return Err(EngineError::Infinite(i));
                }
                out[i].start_s = now;
                out[i].alone_s = alone;
                stream_busy[s] = true;
                running.push(Running {
                    task: i,
                    left: 1.0,
                    rate: 0.0,
                    sms: 0.0,
                    slowdown: 1.0,
                    sms_time: 0.0,
                    slow_time: 0.0,
                });
            }
        }
        update_rates(input, cost, &mut running);
        record(input, &running, now, &mut samples);
        if running.is_empty() {
            if finished == n {
                break;
            }
            let blocked: Vec<usize> = (0..queues.len())
                .filter(|&s| head[s] < queues[s].len())
                .map(|s| queues[s][head[s]])
                .collect();
            return Err(EngineError::Stuck(blocked));
        }
        // advance to the next finish
        let dt = running
            .iter()
            .map(|r| {
                if r.rate > 0.0 {
                    r.left / r.rate
                } else {
                    f64::INFINITY
                }
            })
            .fold(f64::INFINITY, f64::min);
        if !dt.is_finite() {
            return Err(EngineError::Infinite(running[0].task));
        }
        now += dt;
        for r in running.iter_mut() {
            r.left -= r.rate * dt;
            r.sms_time += r.sms * dt;
            r.slow_time += r.slowdown * dt;
        }
        // finish everything within rounding of done (instant tasks included)
        let mut k = 0;
        while k < running.len() {
            let r = &running[k];
            let eps = 1e-12 * r.rate.max(1.0);
            if r.left <= eps || r.rate.is_infinite() {
                let r = running.swap_remove(k);
                let i = r.task;
                let dur = now - out[i].start_s;
                out[i].end_s = now;
                out[i].avg_sms = if dur > 0.0 { r.sms_time / dur } else { r.sms };
                out[i].avg_slowdown = if dur > 0.0 {
                    r.slow_time / dur
                } else {
                    r.slowdown
                };
                done[i] = true;
                finished += 1;
                let s = input.tasks[i].stream;
                stream_busy[s] = false;
                head[s] += 1;
            } else {
                k += 1;
            }
        }
    }
    let makespan_s = out.iter().map(|o| o.end_s).fold(0.0, f64::max);
    Ok(Output {
        tasks: out,
        samples,
        makespan_s,
    })
}

/// Sets each running task's SMs, slowdown and rate for the current set of running tasks.
fn update_rates(input: &Input, cost: &CostModel, running: &mut [Running]) {
    for d in 0..input.devices.len() {
        let total = input.devices[d].sms.max(1) as f64;
        let on: Vec<usize> = (0..running.len())
            .filter(|&k| input.tasks[running[k].task].device == d)
            .collect();
        let asked: f64 = on
            .iter()
            .map(|&k| &input.tasks[running[k].task])
            .filter(|t| t.uses_sms)
            .map(|t| t.sms.min(total as u32) as f64)
            .sum();
        let scale = if asked > total { total / asked } else { 1.0 };
        for &k in &on {
            let t = &input.tasks[running[k].task];
            let sms = if t.uses_sms {
                (t.sms.min(total as u32) as f64 * scale).max(1.0)
            } else {
                0.0
            };
            let slowdown = on
                .iter()
                .filter(|&&j| j != k)
                .map(|&j| cost.corun_slowdown(t.kind, input.tasks[running[j].task].kind))
                .fold(1.0, f64::max);
            // A fractional share (oversubscribed plain streams) is timed at the SM count below
            // it and scaled, keeping the time monotone in the share.
            let whole = sms.floor().max(1.0) as u32;
            let time = if t.uses_sms {
                cost.time_dir(t.kind, &t.work, whole, t.host_dir) * whole as f64
                    / sms.max(whole as f64)
            } else {
                cost.time_dir(t.kind, &t.work, t.sms, t.host_dir)
            };
            let r = &mut running[k];
            r.sms = sms;
            r.slowdown = slowdown;
            r.rate = if time > 0.0 {
                1.0 / (time * slowdown)
            } else {
                f64::INFINITY
            };
        }
    }
}

fn record(input: &Input, running: &[Running], now: f64, samples: &mut [Vec<DeviceSample>]) {
    for (d, series) in samples.iter_mut().enumerate() {
        let mut s = DeviceSample {
            t_s: now,
            sms: 0.0,
            hbm_bw: 0.0,
            flops: 0.0,
            running: 0,
        };
        for r in running.iter().filter(|r| input.tasks[r.task].device == d) {
            let t = &input.tasks[r.task];
            s.sms += r.sms;
            if r.rate.is_finite() {
                s.hbm_bw += t.work.total_bytes() * r.rate;
                s.flops += t.work.total_flops() * r.rate;
            }
            s.running += 1;
        }
        s.sms = s.sms.min(input.devices[d].sms as f64);
        match series.last_mut() {
            Some(last) if last.t_s == now => *last = s,
            Some(last)
                if last.sms == s.sms
                    && last.hbm_bw == s.hbm_bw
                    && last.flops == s.flops
                    && last.running == s.running => {}
            _ => series.push(s),
        }
    }
}
