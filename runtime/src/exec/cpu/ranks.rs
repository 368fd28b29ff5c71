//! The CPU backend's loop: a plan's iterations on its ranks. A plan whose rollout TP =
//! training TP = GPU count = `N` runs as `N` ranks, each walking the plan's GPU program with
//! [`CpuIteration`] over its [`RankEngine`]; a plan of one rank (TP 1, or a disaggregated plan
//! of one rollout and one training GPU, whose two programs it walks in turn) is the same loop
//! over `SoloComm`, on the caller's thread. [`run_cpu_loop`] runs every rank of this process
//! (more than one: threads over `ThreadComm`); [`run_rank`] is one rank's loop over any
//! [`Communicator`] (a process of a group over `TcpComm`: `rollplex-run --tp-processes`, or ranks
//! started by torchrun/slurm).
//!
//! Only rank 0 holds the prompt source, the reward and the observer (metrics, traces): each
//! iteration's prompts are broadcast from rank 0, and each group's rewards too (the reward runs
//! once, an external command included). Every other host decision is made by
//! [`Book`](super::super::book::Book) on every rank from bitwise-equal inputs. At the end of
//! each iteration the ranks compare a fingerprint of their sampled tokens and rewards and stop
//! with an error if they differ. With `--save-every` the ranks gather their training state on
//! rank 0 after a saved iteration ([`gather_train_state`]) and the observer writes it.
//!
//! Invariants: (1) every rank issues the same collectives in the same order: the walker's
//! choice depends on the plan and the book only, and the book's state is replicated; (2) every
//! number is a function of (spec, seed, iteration, data, TP degree), never of thread timing (the
//! collectives reduce in rank order), so a run is bitwise reproducible at its degree.

use std::ops::Range;
use std::sync::Mutex;

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;

use super::super::prompts::{self, PromptSource};
use super::super::{
    walker, EachIteration, ExecError, IterationResult, LoopModels, LoopObserver, MediaData,
    PromptData, Timed,
};
use super::engine::{gather_train_state, CpuModels, RankEngine};
use super::iteration::{CpuIteration, RewardFn};
use crate::exec::rewards::{GroupKey, GroupReward};
use crate::model::MediaKind;
use crate::tp::{run_ranks, Communicator, SoloComm, ThreadComm};

/// A reward the loop can hand to rank 0's thread.
pub type SendRewardFn<'a> = dyn GroupReward + Send + 'a;

/// What only rank 0 holds: where prompts come from, the reward, and who is told about tasks
/// and iterations.
pub struct RootSide<'a, 'r> {
    pub source: &'a mut dyn PromptSource,
    pub reward: &'a mut RewardFn<'r>,
    pub observer: &'a mut dyn LoopObserver,
}

/// Runs iterations `iterations` of `plan` on one rank of its group. Rank 0 passes `root`,
/// every other rank `None`; every rank passes its own models and communicator.
pub fn run_rank<C: Communicator>(
    plan: &Plan,
    comm: &C,
    models: &mut CpuModels,
    root: Option<RootSide<'_, '_>>,
    iterations: Range<u32>,
) -> Result<(), ExecError> {
    let degree = super::super::cpu_plan_degree(plan)?;
    if comm.world() != degree || models.degree() != degree || models.rank() != comm.rank() {
        return Err(ExecError::Plan(format!(
            "rank {} of a TP-{} model on communicator rank {} of {}, for a plan of TP {degree}",
            models.rank(),
            models.degree(),
            comm.rank(),
            comm.world()
        )));
    }
    if root.is_some() != (comm.rank() == 0) {
        return Err(ExecError::Plan(format!(
            "rank {} {} the prompt source, reward and observer: rank 0 alone holds them",
            comm.rank(),
            if root.is_some() { "was given" } else { "lacks" }
        )));
    }
    models.trainer.follow_plan(plan);
    let groups = plan.parallel.prompts_per_rollout_replica as usize;
    let gpu = plan.gpus[0].id;
    // a disaggregated plan's two programs (rollout, training) run in turn on one rank
    let all = plan.mode == Mode::Disaggregated;
    let tasks = plan.tasks.iter().filter(|t| all || t.gpu == gpu).count();
    match root {
        Some(RootSide {
            source,
            reward,
            observer,
        }) => prompts::for_each_prefetched(source, iterations, groups, |it, prompts, t0| {
            let prompts = share_prompts(comm, Some(prompts))?;
            observer.iteration_started(it, tasks);
            super::super::reset_rss_peak();
            let mut result = rank_iteration(
                plan,
                comm,
                models,
                Some(&mut *reward),
                Some(&mut *observer),
                it,
                &prompts,
            )?;
            // the process's high-water mark: every rank's thread counts
            result.metrics.peak_mem_bytes = super::super::rss_peak();
            for span in reward.take_spans() {
                observer.reward_span(&span);
            }
            let wall = t0.elapsed();
            // a stop (a signal on rank 0) is every rank's: they gather the state to save
            // together, then end
            let stop = share_stop(comm, observer.stop_requested())?;
            let state =
                if models.gather_due(it + 1) || stop {
                    Some(gather_train_state(comm, models)?.ok_or_else(|| {
                        ExecError::Plan("rank 0 gathered no training state".into())
                    })?)
                } else {
                    None
                };
            observer.iteration_done(it, &result, LoopModels::Cpu(state.as_ref()), t0, wall)
        }),
        None => {
            for it in iterations {
                let prompts = share_prompts(comm, None)?;
                rank_iteration(plan, comm, models, None, None, it, &prompts)?;
                let stop = share_stop(comm, false)?;
                if models.gather_due(it + 1) || stop {
                    gather_train_state(comm, models)?;
                }
                if stop {
                    break;
                }
            }
            Ok(())
        }
    }
}

/// Rank 0's answer to whether the run stops after this iteration, on every rank (one
/// broadcast; the other ranks' `mine` is ignored).
fn share_stop<C: Communicator>(comm: &C, mine: bool) -> Result<bool, ExecError> {
    let mut flag = [if mine { 1f32 } else { 0f32 }];
    comm.broadcast(&mut flag, 0)?;
    Ok(flag[0] != 0.0)
}

/// The reward as every rank sees it: rank 0 (`root`) scores, and starts groups as they finish
/// decoding; the group's rewards are then broadcast to every rank.
struct SharedReward<'a, 'r, C> {
    root: Option<&'a mut RewardFn<'r>>,
    comm: &'a C,
}

impl<C: Communicator> GroupReward for SharedReward<'_, '_, C> {
    fn start(&mut self, key: GroupKey, prompt: &PromptData, responses: &[&[u32]]) {
        if let Some(root) = self.root.as_mut() {
            root.start(key, prompt, responses);
        }
    }

    fn score(
        &mut self,
        key: GroupKey,
        p: &PromptData,
        responses: &[&[u32]],
    ) -> Result<Vec<f32>, ExecError> {
        let mut r = match self.root.as_mut() {
            Some(f) => {
                let r = f.score(key, p, responses)?;
                if r.len() != responses.len() {
                    return Err(ExecError::Reward(format!(
                        "expected {} rewards for the group of prompt {:?}, got {}",
                        responses.len(),
                        p.id,
                        r.len()
                    )));
                }
                r
            }
            None => vec![0f32; responses.len()],
        };
        self.comm.broadcast(&mut r, 0)?;
        Ok(r)
    }
}

/// One iteration on one rank: the plan's walk over a [`RankEngine`], rewards from rank 0, and
/// the ranks' agreement check.
fn rank_iteration<C: Communicator>(
    plan: &Plan,
    comm: &C,
    models: &mut CpuModels,
    reward: Option<&mut RewardFn<'_>>,
    observer: Option<&mut dyn LoopObserver>,
    it: u32,
    prompts: &[PromptData],
) -> Result<IterationResult, ExecError> {
    let mut shared = SharedReward { root: reward, comm };
    let gpu = plan.gpus[0].id;
    let all = plan.mode == Mode::Disaggregated;
    let mut engine = RankEngine { models, comm };
    let result = {
        let mut iter = CpuIteration::new(plan, &mut engine, &mut shared, it, prompts)?;
        match observer {
            Some(observer) => {
                let mut timed = Timed {
                    inner: &mut iter,
                    observer,
                    iteration: it,
                };
                if all {
                    walker::walk_all(plan, &mut timed, |_, _| {})?;
                } else {
                    walker::walk(plan, gpu, &mut timed, |_, _| {})?;
                }
            }
            None if all => walker::walk_all(plan, &mut iter, |_, _| {})?,
            None => walker::walk(plan, gpu, &mut iter, |_, _| {})?,
        }
        iter.finish()
    };
    check_ranks_agree(comm, it, &result)?;
    Ok(result)
}

/// Runs iterations `iterations` of `plan` on its ranks, `models` in rank order: one rank on
/// this thread over `SoloComm`, more as one thread per rank over [`ThreadComm`]. Rank 0 draws
/// the prompts from `source`, scores with `reward` and tells `observer`. An error of a group
/// names the rank it happened on (the first rank that failed: the others then stop with "rank
/// K failed").
pub fn run_cpu_loop(
    plan: &Plan,
    models: &mut [CpuModels],
    source: &mut dyn PromptSource,
    reward: &mut SendRewardFn<'_>,
    iterations: Range<u32>,
    observer: &mut (dyn LoopObserver + Send),
) -> Result<(), ExecError> {
    let degree = super::super::cpu_plan_degree(plan)?;
    if models.len() != degree {
        return Err(ExecError::Plan(format!(
            "{} rank models given for a plan of TP {degree}",
            models.len()
        )));
    }
    if let [solo] = models {
        let root = RootSide {
            source,
            reward,
            observer,
        };
        return run_rank(plan, &SoloComm, solo, Some(root), iterations);
    }
    let slots: Vec<Mutex<Option<&mut CpuModels>>> =
        models.iter_mut().map(|m| Mutex::new(Some(m))).collect();
    let root = Mutex::new(Some((source, reward, observer)));
    let lock_err = |what: &str| ExecError::Plan(format!("rank {what} taken twice"));
    run_ranks(degree, |comm: &ThreadComm| -> Result<(), ExecError> {
        let rank = comm.rank();
        let m = slots[rank]
            .lock()
            .map_err(|_| lock_err("models"))?
            .take()
            .ok_or_else(|| lock_err("models"))?;
        let side = if rank == 0 {
            root.lock().map_err(|_| lock_err("0's inputs"))?.take()
        } else {
            None
        };
        let side = side.map(|(source, reward, observer)| RootSide {
            source,
            reward,
            observer,
        });
        run_rank(plan, comm, m, side, iterations.clone())
    })
    .map(|_| ())
    .map_err(|e| ExecError::Rank {
        rank: e.rank,
        source: Box::new(e.error),
    })
}

/// Runs iterations `first .. first + count` of `plan` on its ranks ([`run_cpu_loop`]);
/// `on_iteration` sees each iteration's result (rank 0's; every rank's agree, checked) and wall
/// time as soon as it is done.
pub fn run_cpu_iterations(
    plan: &Plan,
    models: &mut [CpuModels],
    source: &mut dyn PromptSource,
    reward: &mut SendRewardFn<'_>,
    first: u32,
    count: u32,
    on_iteration: impl FnMut(u32, &IterationResult, std::time::Duration) -> Result<(), ExecError> + Send,
) -> Result<(), ExecError> {
    run_cpu_loop(
        plan,
        models,
        source,
        reward,
        first..first + count,
        &mut EachIteration(on_iteration),
    )
}

/// FNV-1a over 32-bit words.
fn fnv(h: &mut u64, words: impl IntoIterator<Item = u32>) {
    for w in words {
        *h ^= w as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// Fingerprint of what the host decided from the ranks' replicated data: sampled tokens,
/// rewards, advantages, the grad norm.
fn fingerprint(r: &IterationResult) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in &r.tokens {
        fnv(&mut h, [t.len() as u32]);
        fnv(&mut h, t.iter().copied());
    }
    fnv(&mut h, r.rewards.iter().map(|x| x.to_bits()));
    fnv(&mut h, r.advantages.iter().map(|x| x.to_bits()));
    let g = r.metrics.grad_norm.to_bits();
    fnv(&mut h, [g as u32, (g >> 32) as u32]);
    h
}

/// Every rank's fingerprint of the iteration, compared with rank 0's.
fn check_ranks_agree<C: Communicator>(
    comm: &C,
    it: u32,
    r: &IterationResult,
) -> Result<(), ExecError> {
    let h = fingerprint(r);
    let mine = [(h & 0xffff_ffff) as f64, (h >> 32) as f64];
    let mut all = vec![0f64; 2 * comm.world()];
    comm.all_gather(&mine, &mut all)?;
    if let Some(k) = (1..comm.world()).find(|&k| all[2 * k..2 * k + 2] != all[..2]) {
        return Err(ExecError::Plan(format!(
            "tensor-parallel ranks diverged in iteration {it}: rank {k}'s sampled tokens, rewards \
             or grad norm differ from rank 0's (a bug: replicated values must be bitwise equal \
             on every rank)"
        )));
    }
    Ok(())
}

/// Rank 0's prompts on every rank: rank 0 passes `Some`, the others `None`. Three broadcasts:
/// the two lengths, the header (f64: counts, token ids, media kinds and grids; exact below
/// 2^53), the pixels (f32). Other ranks get empty `id`, `text` and `answer` (only rank 0
/// scores rewards).
pub fn share_prompts<C: Communicator>(
    comm: &C,
    mine: Option<Vec<PromptData>>,
) -> Result<Vec<PromptData>, ExecError> {
    if comm.world() == 1 {
        // a group of one: rank 0's own prompts, nothing to send
        return mine.ok_or_else(|| ExecError::Plan("rank 0 has no prompts to share".into()));
    }
    let (mut header, mut pixels) = match &mine {
        Some(p) => encode_prompts(p),
        None => (Vec::new(), Vec::new()),
    };
    let mut lens = [header.len() as f64, pixels.len() as f64];
    comm.broadcast(&mut lens, 0)?;
    if mine.is_none() {
        header = vec![0f64; lens[0] as usize];
        pixels = vec![0f32; lens[1] as usize];
    }
    comm.broadcast(&mut header, 0)?;
    comm.broadcast(&mut pixels, 0)?;
    match mine {
        Some(p) => Ok(p),
        None => decode_prompts(&header, &pixels),
    }
}

/// The header and pixels [`share_prompts`] sends: `[prompts, per prompt: ids, id..., media, per
/// item: kind (0 image, 1 video), seconds per temporal patch (NaN: none), t, h, w, pixels]`.
fn encode_prompts(prompts: &[PromptData]) -> (Vec<f64>, Vec<f32>) {
    let mut h = vec![prompts.len() as f64];
    let mut px = Vec::new();
    for p in prompts {
        h.push(p.ids.len() as f64);
        h.extend(p.ids.iter().map(|&i| i as f64));
        h.push(p.media.len() as f64);
        for m in &p.media {
            let (kind, spg) = match m.kind {
                MediaKind::Image => (0.0, f64::NAN),
                MediaKind::Video { second_per_grid_t } => {
                    (1.0, second_per_grid_t.unwrap_or(f64::NAN))
                }
            };
            h.extend([kind, spg]);
            h.extend(m.grid.iter().map(|&g| g as f64));
            h.push(m.pixels.len() as f64);
            px.extend_from_slice(&m.pixels);
        }
    }
    (h, px)
}

fn decode_prompts(h: &[f64], px: &[f32]) -> Result<Vec<PromptData>, ExecError> {
    let bad = || ExecError::Plan("the prompts rank 0 broadcast do not decode".into());
    let mut i = 0usize;
    let mut next = || -> Result<f64, ExecError> {
        let v = *h.get(i).ok_or_else(bad)?;
        i += 1;
        Ok(v)
    };
    let mut off = 0usize;
    let n = next()? as usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = next()? as usize;
        let ids = (0..len)
            .map(|_| next().map(|v| v as u32))
            .collect::<Result<Vec<_>, _>>()?;
        let items = next()? as usize;
        let mut media = Vec::with_capacity(items);
        for _ in 0..items {
            let (kind, spg) = (next()?, next()?);
            let kind = if kind == 0.0 {
                MediaKind::Image
            } else {
                MediaKind::Video {
                    second_per_grid_t: (!spg.is_nan()).then_some(spg),
                }
            };
            let grid = [next()? as u32, next()? as u32, next()? as u32];
            let np = next()? as usize;
            let pixels = px.get(off..off + np).ok_or_else(bad)?.to_vec();
            off += np;
            media.push(MediaData { kind, pixels, grid });
        }
        out.push(PromptData {
            id: String::new(),
            text: String::new(),
            ids,
            media,
            answer: String::new(),
        });
    }
    if i != h.len() || off != px.len() {
        return Err(bad());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts() -> Vec<PromptData> {
        let media = |kind, n: usize, grid| MediaData {
            kind,
            pixels: (0..n).map(|i| i as f32 * 0.25 - 3.0).collect(),
            grid,
        };
        vec![
            PromptData {
                id: "a".into(),
                text: "what moves?".into(),
                ids: vec![1, 2, 3, 70_000],
                media: vec![
                    media(MediaKind::Image, 12, [1, 2, 2]),
                    media(
                        MediaKind::Video {
                            second_per_grid_t: Some(0.5),
                        },
                        24,
                        [2, 2, 2],
                    ),
                ],
                answer: "B".into(),
            },
            PromptData {
                id: "b".into(),
                text: String::new(),
                ids: vec![9],
                media: vec![media(
                    MediaKind::Video {
                        second_per_grid_t: None,
                    },
                    6,
                    [1, 1, 2],
                )],
                answer: "C".into(),
            },
        ]
    }

    #[test]
    fn prompts_reach_every_rank_with_their_ids_and_media() {
        let sent = prompts();
        let got = run_ranks(3, |c: &ThreadComm| {
            share_prompts(c, (c.rank() == 0).then(|| sent.clone()))
        })
        .unwrap();
        assert_eq!(got[0], sent, "rank 0 keeps its own prompts");
        for g in &got[1..] {
            assert_eq!(g.len(), sent.len());
            for (a, b) in g.iter().zip(&sent) {
                assert_eq!((&a.ids, &a.media), (&b.ids, &b.media));
                assert!(a.id.is_empty() && a.text.is_empty() && a.answer.is_empty());
            }
        }
        // a truncated header or stray pixels do not decode
        let (h, px) = encode_prompts(&sent);
        assert!(decode_prompts(&h[..h.len() - 1], &px).is_err());
        assert!(decode_prompts(&h, &px[1..]).is_err());
        assert_eq!(decode_prompts(&h, &px).unwrap().len(), 2);
    }

    #[test]
    fn ranks_that_sampled_differently_are_stopped_naming_the_rank() {
        let result = |tok: u32| IterationResult {
            tokens: vec![vec![1, tok]],
            rollout_logp: vec![vec![0.0, 0.0]],
            ref_logp: vec![None],
            old_logp: vec![None],
            rewards: vec![1.0],
            advantages: vec![0.0],
            slot_groups: vec![0],
            trained_groups: vec![0],
            group_size: 1,
            metrics: Default::default(),
        };
        run_ranks(2, |c: &ThreadComm| check_ranks_agree(c, 4, &result(7))).unwrap();
        let e = run_ranks(3, |c: &ThreadComm| {
            check_ranks_agree(c, 4, &result(if c.rank() == 2 { 8 } else { 7 }))
        })
        .unwrap_err();
        let msg = e.error.to_string();
        assert!(
            msg.contains("iteration 4") && msg.contains("rank 2"),
            "{msg}"
        );
    }
}
