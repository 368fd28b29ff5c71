//! The group check `rollplex-run --tp-check` runs on every rank of a launched TP group: the
//! plan's actor sharded over the group, a greedy continuation of a fixed text prompt through the
//! TP forward (vocab-parallel greedy argmax, gathered logits), repeated for a number of rounds;
//! then every rank compares what it computed with every other rank, and rank 0 compares it with
//! the same computation at TP = 1.
//!
//! What it knows: the model, a [`Communicator`], the job's spec (the prompt's length and seed).
//! What it checks: the rendezvous handed every rank the same unique id; the ranks agree bitwise
//! (greedy tokens and the hash of the full gathered logits); every round repeats round 0
//! bitwise; and how far the TP logits are from TP = 1 (reported, not judged: `docs/tp.md` has
//! the tolerances). Loading the plan, building the actor, joining the group and the exit status
//! are the binary's (`cli::tp_check`).

use std::sync::Arc;
use std::time::Instant;

use rollplex_plan::spec::JobSpec;

use super::{Communicator, ThreadComm, TpError, TpModel, TpPlan};
use crate::model::philox::philox4x32_10;
use crate::model::{Prompt, Qwen25VL};

/// Tokens of the check's prompt (at most; fewer when the plan's prompts are shorter).
const PROMPT_TOKENS: u32 = 24;
/// Greedy tokens generated per round.
const NEW_TOKENS: usize = 6;

/// What one rank found.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    pub rank: usize,
    pub world: usize,
    pub rounds: u32,
    /// The greedy continuation (equal on every rank, checked).
    pub tokens: Vec<u32>,
    /// FNV-1a of the bits of the full gathered logits of the final sequence (equal on every
    /// rank, checked).
    pub logits_hash: u64,
    /// Rank 0: max |logit(TP) - logit(TP = 1)| over every position of the final sequence.
    pub max_err_vs_tp1: Option<f32>,
    /// Rank 0: whether TP = 1 generates the same continuation.
    pub tokens_equal_tp1: Option<bool>,
    /// Wall time of the rounds.
    pub seconds: f64,
    /// Collectives issued per round (all ranks issue the same).
    pub collectives_per_round: u64,
}

fn fnv(words: impl Iterator<Item = u32>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        h ^= w as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The check's prompt: ordinary text ids (no media or special token) drawn from the job's seed.
fn prompt_ids(spec: &JobSpec, model: &Qwen25VL) -> Vec<u32> {
    let t = &model.config.spec.tokens;
    let special = [
        t.image_token_id,
        t.video_token_id,
        t.vision_start_token_id,
        t.vision_end_token_id,
    ];
    let vocab = model.config.spec.text.vocab_size;
    let n = spec.rollout.prompt_text_tokens.clamp(1, PROMPT_TOKENS);
    let mut ids = Vec::with_capacity(n as usize);
    let mut i = 0u32;
    while ids.len() < n as usize {
        let r = philox4x32_10(
            [i, 0, 0, 0x5450_434B],
            [spec.seed as u32, (spec.seed >> 32) as u32],
        );
        i += 1;
        let id = r[0] % vocab;
        if !special.contains(&id) && !t.eos_token_ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Greedy continuation of `ids` on one rank: returns the tokens and the full gathered logits of
/// the final sequence.
fn continue_greedy<C: Communicator>(
    comm: &C,
    m: &TpModel,
    ids: &[u32],
) -> Result<(Vec<u32>, Vec<f32>), TpError> {
    let m = m.as_rank();
    let mut seq = ids.to_vec();
    let vl = m.vocab_counts()[m.rank];
    for _ in 0..NEW_TOKENS {
        let l = m.forward_logits(
            comm,
            Prompt {
                ids: &seq,
                media: &[],
            },
        )?;
        let last = &l[l.len() - vl..];
        seq.push(m.greedy(comm, last)?[0]);
    }
    let l = m.forward_logits(
        comm,
        Prompt {
            ids: &seq,
            media: &[],
        },
    )?;
    let full = m.gather_logits(comm, &l)?;
    Ok((seq[ids.len()..].to_vec(), full))
}

/// Counts the collectives a communicator issues (to report the check's traffic).
struct Counting<'a, C> {
    inner: &'a C,
    n: std::sync::atomic::AtomicU64,
}

impl<C: Communicator> Communicator for Counting<'_, C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce<T: super::Elem>(
        &self,
        buf: &mut [T],
        op: super::ReduceOp,
    ) -> Result<(), super::CommError> {
        self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.all_reduce(buf, op)
    }
    fn all_gather<T: super::Elem>(
        &self,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), super::CommError> {
        self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.all_gather(send, recv)
    }
    fn broadcast<T: super::Elem>(
        &self,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), super::CommError> {
        self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<(), super::CommError> {
        self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.barrier()
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// Every rank's `words`, gathered (u32 words travel exactly as f64).
fn gather_words<C: Communicator>(comm: &C, words: &[u32]) -> Result<Vec<Vec<u32>>, TpError> {
    let send: Vec<f64> = words.iter().map(|&w| w as f64).collect();
    let mut all = vec![0f64; send.len() * comm.world()];
    comm.all_gather(&send, &mut all)?;
    Ok(all
        .chunks(send.len().max(1))
        .take(comm.world())
        .map(|c| c.iter().map(|&x| x as u32).collect())
        .collect())
}

/// Runs the check on this rank (every rank of the group calls it with the same arguments but
/// its `unique_id`, which must be the same everywhere): `full` is the job's actor, unsharded,
/// as every rank builds it; `spec` gives the prompt's length and seed. An error names the rank
/// that differs.
pub fn run_check<C: Communicator>(
    comm: &C,
    spec: &JobSpec,
    full: &Qwen25VL,
    unique_id: &[u8],
    rounds: u32,
) -> Result<CheckReport, TpError> {
    let (rank, world) = (comm.rank(), comm.world());
    let plan = Arc::new(TpPlan::new(&full.config, world)?);
    let model = TpModel::shard(Arc::clone(&plan), &full.weights, rank)?;
    let ids = prompt_ids(spec, full);
    let counting = Counting {
        inner: comm,
        n: Default::default(),
    };

    // the rendezvous's blob and the model the ranks built must be the same everywhere
    let id_crc = crc32fast::hash(unique_id);
    let w_hash = fnv(full.weights.data.iter().map(|x| x.to_bits()));
    let mine = [id_crc, w_hash as u32, (w_hash >> 32) as u32];
    for (r, theirs) in gather_words(comm, &mine)?.into_iter().enumerate() {
        if theirs[0] != mine[0] {
            return Err(TpError::Config(format!(
                "rank {r} received another rendezvous id than rank {rank} (crc {:08x} vs {:08x})",
                theirs[0], mine[0]
            )));
        }
        if theirs[1..] != mine[1..] {
            return Err(TpError::Config(format!(
                "rank {r} built other actor weights than rank {rank} (different checkpoint or seed)"
            )));
        }
    }

    let t0 = Instant::now();
    let mut first: Option<(Vec<u32>, Vec<f32>)> = None;
    for round in 0..rounds.max(1) {
        let (tokens, logits) = continue_greedy(&counting, &model, &ids)?;
        match &first {
            None => first = Some((tokens, logits)),
            Some((t, l)) => {
                let same = *t == tokens
                    && l.iter()
                        .zip(&logits)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(TpError::Config(format!(
                        "rank {rank}: round {round} differs from round 0 (the TP forward is not deterministic)"
                    )));
                }
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let per_round = counting.n.load(std::sync::atomic::Ordering::Relaxed) / rounds.max(1) as u64;
    let (tokens, logits) = first.expect("at least one round");
    let hash = fnv(logits.iter().map(|x| x.to_bits()));

    let mut mine = vec![(hash as u32), (hash >> 32) as u32];
    mine.extend(&tokens);
    for (r, theirs) in gather_words(comm, &mine)?.into_iter().enumerate() {
        if theirs != mine {
            return Err(TpError::Config(format!(
                "rank {r} disagrees with rank {rank}: tokens {:?} vs {:?}, logits hash {:08x}{:08x} vs {hash:016x}",
                &theirs[2..],
                tokens,
                theirs[1],
                theirs[0]
            )));
        }
    }

    let (mut max_err, mut tokens_equal) = (None, None);
    if rank == 0 {
        let one = TpModel::shard(Arc::new(TpPlan::new(&full.config, 1)?), &full.weights, 0)?;
        let c1 = ThreadComm::group(1)?.pop().expect("one rank");
        let (t1, l1) = continue_greedy(&c1, &one, &ids)?;
        tokens_equal = Some(t1 == tokens);
        // compare on the TP sequence: forward it at TP = 1
        let mut seq = ids.clone();
        seq.extend(&tokens);
        let l1 = if t1 == tokens {
            l1
        } else {
            one.as_rank().forward_logits(
                &c1,
                Prompt {
                    ids: &seq,
                    media: &[],
                },
            )?
        };
        max_err = Some(
            l1.iter()
                .zip(&logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max),
        );
    }
    comm.barrier()?;
    Ok(CheckReport {
        rank,
        world,
        rounds: rounds.max(1),
        tokens,
        logits_hash: hash,
        max_err_vs_tp1: max_err,
        tokens_equal_tp1: tokens_equal,
        seconds,
        collectives_per_round: per_round,
    })
}
