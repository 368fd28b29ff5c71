//! The job's reward as the executors call it, per GRPO group: started on host threads as soon
//! as a group has finished decoding, joined at the plan's reward task.
//!
//! [`Book::push_token`](super::book::Book::push_token) calls [`GroupReward::start`] the moment
//! a group's last sample stops (on cpu and cuda alike: both executors record tokens through
//! the book), and the `Reward` op calls [`GroupReward::score`]. [`JobReward`], the reward of a
//! pipeline ([`reward_fn`]), sends a group made only of built-in rewards to a small
//! [`RewardPool`] there: decoding the responses to text and scoring them then overlaps the
//! decode steps of the groups still running, and the reward task only waits for the result.
//! External commands keep running at the reward task (one process, one request stream).
//!
//! Invariant: a group's rewards are the same bits whether they were computed on a worker or
//! at the reward task: the reward of a sample is a pure function of its text and answer, and
//! both paths run the same function ([`score_host`]). A group started with responses other
//! than those it is scored with is an error, never a silent mix.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use rollplex_plan::spec::{DatasetSpec, JobSpec};

use super::data::PromptBuilder;
use super::{ExecError, PromptData};
use crate::reward::{HostReward, Reward, RewardPool, RewardRequest, Ticket, Work};

/// A group of one iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    pub iteration: u32,
    pub group: u32,
}

/// When a host thread scored a group (the trace's reward track).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RewardSpan {
    pub key: GroupKey,
    /// The worker thread, from 0.
    pub worker: usize,
    pub start: Instant,
    pub end: Instant,
}

/// Scores the responses of one group (one reward per response, in order).
///
/// A plain closure `FnMut(&PromptData, &[&[u32]]) -> Result<Vec<f32>, ExecError>` is one: it
/// scores at the reward task.
pub trait GroupReward {
    /// Group `key`'s responses are final: a reward that runs on host threads may start
    /// scoring them now. Never blocks and never fails (a failure shows at [`Self::score`]).
    fn start(&mut self, _key: GroupKey, _prompt: &PromptData, _responses: &[&[u32]]) {}

    /// The group's rewards, in member order: the started work joined, or computed now.
    fn score(
        &mut self,
        key: GroupKey,
        prompt: &PromptData,
        responses: &[&[u32]],
    ) -> Result<Vec<f32>, ExecError>;

    /// The groups scored on host threads since the last call, for the trace.
    fn take_spans(&mut self) -> Vec<RewardSpan> {
        Vec::new()
    }
}

impl<F> GroupReward for F
where
    F: FnMut(&PromptData, &[&[u32]]) -> Result<Vec<f32>, ExecError>,
{
    fn score(
        &mut self,
        _: GroupKey,
        prompt: &PromptData,
        responses: &[&[u32]],
    ) -> Result<Vec<f32>, ExecError> {
        self(prompt, responses)
    }
}

/// What a group's scoring returns.
type Scored = Result<Vec<f32>, ExecError>;

/// How many groups wait in the pool's queue at most (each holds its response tokens); more
/// wait here, and a group still here at its reward task is scored by the task itself.
const QUEUE: usize = 64;

/// A group handed to the pool (or waiting for room in its queue), with the responses it was
/// started with.
struct Pending {
    responses: Vec<Vec<u32>>,
    state: State,
}

enum State {
    /// The queue was full: still here, run by the next call that finds room, or by the
    /// reward task itself.
    Queued(Work<Scored>),
    Running(Ticket<Scored>),
}

/// The reward of a pipeline ([`reward_fn`]): built-in rewards on host threads from the moment
/// a group finishes decoding, external commands at the reward task (see the module doc).
pub struct JobReward {
    reward: Reward,
    /// `None` for synthetic prompts, which have no answers: every reward is 0 (benchmarks
    /// time the loop, not the reward).
    builder: Option<Arc<PromptBuilder>>,
    /// The reward when it is made only of built-ins (then it runs on the pool).
    host: Option<Arc<HostReward>>,
    /// Made on the first group started.
    pool: Option<RewardPool<Scored>>,
    pending: BTreeMap<GroupKey, Pending>,
    spans: Vec<RewardSpan>,
}

/// The job's reward as the loop calls it: decode each response, score the group; built-in
/// rewards start on host threads when their group has finished decoding.
pub fn reward_fn(spec: &JobSpec) -> Result<Box<JobReward>, ExecError> {
    let reward = Reward::from_spec(&spec.reward).map_err(|e| ExecError::Reward(e.to_string()))?;
    let builder = match spec.rollout.dataset {
        DatasetSpec::Synthetic => None,
        _ => Some(Arc::new(PromptBuilder::for_spec(spec)?)),
    };
    let host = reward.host().map(Arc::new);
    Ok(Box::new(JobReward {
        reward,
        builder,
        host,
        pool: None,
        pending: BTreeMap::new(),
        spans: Vec::new(),
    }))
}

/// What a reward reads of a prompt (not its media, which a worker has no use for).
#[derive(Clone, Copy)]
struct PromptText<'p> {
    id: &'p str,
    text: &'p str,
    answer: &'p str,
}

impl<'p> PromptText<'p> {
    fn of(p: &'p PromptData) -> Self {
        PromptText {
            id: &p.id,
            text: &p.text,
            answer: &p.answer,
        }
    }
}

/// The reward requests of a group: each response decoded, named `<prompt id>/<member>`.
fn requests(
    builder: &PromptBuilder,
    prompt: PromptText<'_>,
    responses: &[&[u32]],
) -> Result<Vec<RewardRequest>, ExecError> {
    responses
        .iter()
        .enumerate()
        .map(|(k, r)| {
            Ok(RewardRequest {
                id: format!("{}/{k}", prompt.id),
                prompt: prompt.text.to_string(),
                response: builder.decode(r)?,
                answer: prompt.answer.to_string(),
            })
        })
        .collect()
}

/// A group's rewards under a built-in-only reward: the one function both the workers and the
/// reward task run.
fn score_host(
    builder: &PromptBuilder,
    host: &HostReward,
    prompt: PromptText<'_>,
    responses: &[&[u32]],
) -> Scored {
    let reqs = requests(builder, prompt, responses)?;
    host.score_f32(&reqs)
        .map_err(|e| ExecError::Reward(e.to_string()))
}

impl JobReward {
    /// Whether groups are scored on host threads (every term a built-in, prompts with answers).
    pub fn on_host_threads(&self) -> bool {
        self.host.is_some() && self.builder.is_some()
    }

    /// Submits queued groups while the pool's queue has room, oldest first.
    fn pump(&mut self) {
        let Some(pool) = &self.pool else { return };
        let queued: Vec<GroupKey> = self
            .pending
            .iter()
            .filter(|(_, p)| matches!(p.state, State::Queued(_)))
            .map(|(k, _)| *k)
            .collect();
        for k in queued {
            let Some(mut p) = self.pending.remove(&k) else {
                continue;
            };
            let mut full = false;
            p.state = match p.state {
                State::Queued(work) => match pool.try_submit(work) {
                    Ok(ticket) => State::Running(ticket),
                    Err(work) => {
                        full = true;
                        State::Queued(work)
                    }
                },
                running => running,
            };
            self.pending.insert(k, p);
            if full {
                return;
            }
        }
    }
}

impl GroupReward for JobReward {
    fn start(&mut self, key: GroupKey, prompt: &PromptData, responses: &[&[u32]]) {
        let (Some(builder), Some(host)) = (&self.builder, &self.host) else {
            return;
        };
        // what an iteration that failed left behind is never joined
        self.pending.retain(|k, _| k.iteration == key.iteration);
        if self.pool.is_none() {
            let workers = RewardPool::<Scored>::default_workers();
            // no thread to be had: every group is scored at its reward task
            self.pool = RewardPool::new(workers, QUEUE).ok();
        }
        let owned: Vec<Vec<u32>> = responses.iter().map(|r| r.to_vec()).collect();
        let (builder, host) = (Arc::clone(builder), Arc::clone(host));
        let (id, text, answer) = (
            prompt.id.clone(),
            prompt.text.clone(),
            prompt.answer.clone(),
        );
        let mine = owned.clone();
        let work: Work<Scored> = Box::new(move || {
            let refs: Vec<&[u32]> = mine.iter().map(Vec::as_slice).collect();
            let prompt = PromptText {
                id: &id,
                text: &text,
                answer: &answer,
            };
            score_host(&builder, &host, prompt, &refs)
        });
        self.pending.insert(
            key,
            Pending {
                responses: owned,
                state: State::Queued(work),
            },
        );
        self.pump();
    }

    fn score(
        &mut self,
        key: GroupKey,
        prompt: &PromptData,
        responses: &[&[u32]],
    ) -> Result<Vec<f32>, ExecError> {
        let Some(builder) = &self.builder else {
            return Ok(vec![0.0; responses.len()]);
        };
        let Some(p) = self.pending.remove(&key) else {
            // never started: scored here, built-ins by the very function the workers run
            let prompt = PromptText::of(prompt);
            if let Some(host) = &self.host {
                return score_host(builder, host, prompt, responses);
            }
            let reqs = requests(builder, prompt, responses)?;
            return self
                .reward
                .score_f32(&reqs)
                .map_err(|e| ExecError::Reward(e.to_string()));
        };
        self.pump();
        if p.responses.len() != responses.len()
            || p.responses.iter().zip(responses).any(|(a, b)| a != b)
        {
            return Err(ExecError::Plan(format!(
                "group {} of iteration {} was scored with responses other than those it \
                 finished decoding with",
                key.group, key.iteration
            )));
        }
        match p.state {
            // no room on the workers yet: the reward task does it
            State::Queued(work) => work(),
            State::Running(ticket) => {
                let done = ticket.wait().map_err(ExecError::Reward)?;
                self.spans.push(RewardSpan {
                    key,
                    worker: done.worker,
                    start: done.start,
                    end: done.end,
                });
                done.value
            }
        }
    }

    fn take_spans(&mut self) -> Vec<RewardSpan> {
        std::mem::take(&mut self.spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(answer: &str) -> PromptData {
        PromptData {
            id: "p".into(),
            text: String::new(),
            ids: Vec::new(),
            media: Vec::new(),
            answer: answer.into(),
        }
    }

    #[test]
    fn a_closure_is_a_group_reward_scored_at_the_reward_task() {
        let mut calls = 0;
        let mut f = |_: &PromptData, r: &[&[u32]]| -> Result<Vec<f32>, ExecError> {
            calls += 1;
            Ok(vec![1.0; r.len()])
        };
        let key = GroupKey {
            iteration: 0,
            group: 0,
        };
        let g: &mut dyn GroupReward = &mut f;
        g.start(key, &prompt("A"), &[&[1]]);
        assert_eq!(
            g.score(key, &prompt("A"), &[&[1], &[2]]).unwrap(),
            vec![1.0, 1.0]
        );
        assert!(g.take_spans().is_empty());
        assert_eq!(calls, 1);
    }
}
