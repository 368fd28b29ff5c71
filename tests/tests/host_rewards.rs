//! Built-in rewards start on host threads as soon as their group has finished decoding
//! (`exec::rewards`): on the CPU backend, with the tiny pipeline and response lengths that
//! differ between groups, a group's reward is complete while later decode windows still run,
//! and every number of the run is bitwise the one of a run that scores each group at its
//! reward task.

mod common;

use std::time::Instant;

use rollplex_plan::plan::{Op, Task};
use rollplex_plan::Plan;
use rollplex_runtime::exec::{
    self, GroupKey, GroupReward, IterationResult, LoopModels, LoopObserver, PromptData, RewardSpan,
};

/// examples/tiny.rpx with groups of 4 whose samples stop at lengths drawn from 1..48, so some
/// groups finish decoding windows before others.
fn plan() -> Plan {
    let mut src = common::repo_file("examples/tiny.rpx");
    for (from, to) in [
        ("const G = 16", "const G = 4"),
        ("max_new_tokens = 1 ", "max_new_tokens = 48 "),
        (
            "response_length = fixed(tokens = 1)",
            "response_length = uniform(min = 1, max = 48)",
        ),
        (
            "temperature = 1.0",
            "temperature = 1.0\n            forced_lengths = on",
        ),
    ] {
        assert!(
            src.contains(from),
            "examples/tiny.rpx changed: {from:?} is gone"
        );
        src = src.replace(from, to);
    }
    common::compile("tiny.rpx", &src, rollplex_plan::spec::Mode::Overlap)
}

/// What the test looks at: each iteration's result, its decode windows' starts, the reward
/// spans.
#[derive(Default)]
struct Seen {
    results: Vec<IterationResult>,
    /// Per iteration: the start of every decode window task.
    windows: Vec<Vec<Instant>>,
    spans: Vec<RewardSpan>,
}

impl LoopObserver for Seen {
    fn iteration_started(&mut self, _: u32, _: usize) {
        self.windows.push(Vec::new());
    }
    fn task_done(&mut self, _: u32, task: &Task, start: Instant, _: Instant) {
        if matches!(task.op, Op::DecodeWindow { .. }) {
            if let Some(w) = self.windows.last_mut() {
                w.push(start);
            }
        }
    }
    fn reward_span(&mut self, span: &RewardSpan) {
        self.spans.push(*span);
    }
    fn iteration_done(
        &mut self,
        _: u32,
        r: &IterationResult,
        _: LoopModels<'_>,
        _: Instant,
        _: std::time::Duration,
    ) -> Result<(), exec::ExecError> {
        self.results.push(r.clone());
        Ok(())
    }
}

fn run(plan: &Plan, reward: &mut exec::cpu::SendRewardFn<'_>, iterations: u32) -> Seen {
    let spec = &plan.spec;
    let mut models = [exec::build_cpu_models(spec).expect("models")];
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut seen = Seen::default();
    exec::run_cpu_loop(
        plan,
        &mut models,
        source.as_mut(),
        reward,
        0..iterations,
        &mut seen,
    )
    .expect("run");
    seen
}

#[test]
fn rewards_finish_during_decode_and_equal_those_of_the_reward_task() {
    let plan = plan();
    let iterations = 3;
    let mut early = exec::reward_fn(&plan.spec).expect("reward");
    assert!(early.on_host_threads());
    let pooled = run(&plan, early.as_mut(), iterations);

    // the same reward, asked only at the reward task (a group never started is scored there)
    let mut job = exec::reward_fn(&plan.spec).expect("reward");
    let mut at_task = |p: &PromptData, r: &[&[u32]]| {
        let never = GroupKey {
            iteration: u32::MAX,
            group: u32::MAX,
        };
        job.score(never, p, r)
    };
    let inline = run(&plan, &mut at_task, iterations);

    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    assert_eq!(pooled.results.len(), iterations as usize);
    assert_eq!(
        pooled.spans.len(),
        groups * iterations as usize,
        "every group is scored on a host thread"
    );
    assert!(inline.spans.is_empty());
    let bits = |r: &IterationResult| {
        (
            r.rewards.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            r.advantages.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    for (a, b) in pooled.results.iter().zip(&inline.results) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(
            bits(a),
            bits(b),
            "rewards differ between host threads and the reward task"
        );
        assert_eq!(a.metrics.grad_norm.to_bits(), b.metrics.grad_norm.to_bits());
    }

    // some group's reward was done before the last decode window of its iteration started
    let mut early_done = 0;
    for s in &pooled.spans {
        let windows = &pooled.windows[s.key.iteration as usize];
        assert!(windows.len() > 1, "decode runs over several windows");
        let last = windows.iter().max().expect("a decode window");
        early_done += (s.end < *last) as u32;
    }
    assert!(
        early_done > 0,
        "no group's reward finished before its iteration's last decode window: {:?}",
        pooled.spans
    );
}
