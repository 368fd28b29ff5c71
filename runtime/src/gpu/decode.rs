//! The rollout's decode loop on the device: each step draws every row's token, takes its
//! log-prob, applies the stop test and prepares the next forward's inputs without the host
//! (`decode_advance`), then runs the forward ([`GpuModel::decode_forward`]); the whole step is
//! one CUDA graph, captured once per (batch bucket, stream) and replayed.
//!
//! Rows are samples in sample order, so group-major (the layout group-shared attention reads:
//! a table of where each group's rows start, [`group_starts`]). The batch shrinks by buckets of
//! `group` rows (1, 2, 3, 4, 6, 8, 12, 16, ... groups' worth, up to all of them): every [`LAG`]
//! steps, the rows are compacted to the smallest bucket holding the samples that were still
//! decoding [`LAG`] steps earlier, topped up with stopped ones ([`compaction`]). A group's
//! samples leave one by one, so a group whose longest response runs to the cap does not keep
//! its finished samples in the batch. The stop information comes back asynchronously (a copy
//! of `done_step` into pinned memory after every [`LAG`]th step, read [`LAG`] steps later), so
//! the host never waits on the step it just launched, and the compaction points are a function
//! of the samples' stop steps only: serial and overlapped plans, eager launches and graph
//! replays run the same batches and give the same bits. Rows of samples that stopped keep
//! running until a compaction drops them; what they compute is discarded (`decode_advance`
//! records nothing for them and gives them no KV row).
//!
//! Buffers live as long as the run: a graph replays fixed addresses. Whatever a graph bakes in
//! that can change between iterations (the KV arena's address, the RoPE table's size, the key
//! split's length bound) is checked before each iteration, and the graphs are captured again
//! when it changed; the sampling key (seed, iteration) is read from the device.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, PinnedHostSlice};
use half::bf16;
use rollplex_kernels::cuda::{
    decode_advance, decode_gather_rows, embedding_fwd_bf16, logprobs_fwd_bf16, sample_bf16_keyed,
    AttnSeqGpu, CudaEvent, CudaSlice, CudaStream, DecodeAdvance, DecodeRow, Gpu, SampleParams,
    SampleScratch,
};

use crate::model::DecodeSlot;

use super::plan::{decode_kernel_for, flat_rope_tables, DecodeKernel};
use super::text::{DecodeBufs, DecodeIo, GpuKvArena, Grouping};
use super::{alloc, GpuError, GpuModel, Result};

/// Steps between a compaction decision and the stop information it uses (and between the
/// copies of that information to the host).
pub const LAG: u32 = 8;

/// `done_step` of a sample still decoding.
pub const NOT_DONE: u32 = u32::MAX;

/// A decode step's graph replay in the kernel timing table (`Gpu::set_kernel_times`).
const DECODE_GRAPH: &str = "decode step (graph replay)";

/// Key-split bound granularity: the bound (which fixes the attention's split, so the bits) is
/// rounded up to it, so that iterations with slightly different prompt lengths share graphs.
const MAX_KV_ROUND: usize = 512;

/// What one iteration's decode starts from.
pub struct DecodeStart<'a> {
    /// One slot per sample, in sample order (group-major, `group` samples a group), every
    /// suffix `max_new` rows long and empty.
    pub slots: &'a [DecodeSlot],
    /// Per sample: the id its draws are keyed by (the sample's index when `None`).
    pub keys: Option<&'a [u32]>,
    pub group: usize,
    pub max_new: u32,
    /// Token ids that stop a sample (unless lengths are forced).
    pub stop_ids: &'a [u32],
    /// Per sample: the number of tokens after which it stops, whatever it draws.
    pub forced: Option<&'a [u32]>,
    /// Sampling (temperature, top-k, top-p; the key's seed and iteration go to the device).
    pub sampling: SampleParams,
    /// The temperature the drawn tokens' log-probs are taken at.
    pub logprob_temperature: f32,
}

/// What a window's steps left on the device, brought to the host ([`DeviceDecode::collect`]).
pub struct DecodeOutput {
    /// `[samples, max_new]`: the token drawn at each (sample, step) the sample was live at.
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Per sample: the step it stopped at, or [`NOT_DONE`].
    pub done_step: Vec<u32>,
}

/// A copy of `done_step` on its way to the host: the step after which it was taken.
struct DoneCopy {
    step: u32,
    buf: usize,
    ready: CudaEvent,
}

/// The decode loop's device state and graphs (see the module docs). Lives for the run.
pub struct DeviceDecode {
    samples: usize,
    group: usize,
    max_new: usize,
    vocab: usize,
    head_dim: usize,
    max_kv: usize,
    /// The longest group prefix the buffers and graphs are made for.
    max_prefix: usize,
    /// Rows are attended by group (each group's prefix read once) rather than one by one.
    grouped: bool,
    /// Row state, its compaction scratch and the compaction's row map.
    rows: CudaSlice<DecodeRow>,
    rows_tmp: CudaSlice<DecodeRow>,
    map: CudaSlice<u32>,
    /// Where each group's rows start ([`group_starts`]; `samples / group + 1` entries).
    starts: CudaSlice<u32>,
    /// The next draw's key per row, and `[seed_lo, seed_hi, iteration]`.
    sample_ids: CudaSlice<u32>,
    steps: CudaSlice<u32>,
    key: CudaSlice<u32>,
    /// This step's draws (each row split over blocks: [`SampleScratch`]) and the next
    /// forward's inputs.
    tokens: CudaSlice<u32>,
    sample_scratch: SampleScratch,
    logprobs: CudaSlice<f32>,
    feed: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    seqs: CudaSlice<AttnSeqGpu>,
    write_rows: CudaSlice<u32>,
    /// RoPE cos / sin by position row (`[table_rows, head_dim]`, capacity for more).
    cos_table: CudaSlice<f32>,
    sin_table: CudaSlice<f32>,
    stop_ids: CudaSlice<u32>,
    n_stop: usize,
    /// `[samples, max_new]` outputs and per-sample stop steps.
    out_tokens: CudaSlice<u32>,
    out_logprobs: CudaSlice<f32>,
    done_step: CudaSlice<u32>,
    /// Next-token logits per row, and the compaction's scratch.
    logits: CudaSlice<bf16>,
    logits_tmp: CudaSlice<bf16>,
    bufs: DecodeBufs,
    sampling: SampleParams,
    logprob_temperature: f32,
    /// Host mirror: the sample of each row of the batch, in row order (ascending).
    batch: Vec<usize>,
    /// Prefix keys the batch reads a step (each group's once when grouped, else each row's).
    batch_prefix_keys: u64,
    /// Pinned landing buffers of `done_step` copies, and the copies in flight (oldest first).
    pinned: Vec<PinnedHostSlice<u32>>,
    copies: VecDeque<DoneCopy>,
    /// The newest stop information known on the host: (step it is as of, done_step).
    known: Option<(u32, Vec<u32>)>,
    /// Captured steps by (bucket, stream), and what they baked in (arena K and V addresses).
    graphs: HashMap<(usize, usize), CudaGraph>,
    baked: (u64, u64),
    /// Streams on which a capture failed: their steps are launched eagerly.
    no_graph: Vec<usize>,
    /// (bucket, stream) pairs that ran a step eagerly: the next step of the pair is captured.
    warm: HashSet<(usize, usize)>,
    /// Launch every step eagerly (no graphs): the reference the graph replay is checked against.
    eager: bool,
    /// Per sample: its group's prefix length (for [`DeviceDecode::step_bytes`]).
    prefix_len: Vec<u32>,
    /// Per step launched this iteration, by step (they run from 0 in order): (rows, prefix
    /// keys read).
    launched: Vec<(usize, u64)>,
    /// Bytes of the text decoder's weights and lm head, and of one key's K and V over layers.
    weight_bytes: u64,
    kv_bytes_per_key: u64,
}

/// How [`DeviceDecode::step`] launched a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepLaunch {
    /// A replay of the step graph of the batch's bucket on this stream (microseconds of host).
    Replay,
    /// One kernel at a time, as every step of this loop (eager mode, or a stream whose capture
    /// failed).
    Eager,
    /// Milliseconds of host: a bucket's first step on a stream (one kernel at a time), or its
    /// second, captured (`captured`) and replayed.
    Burst { captured: bool },
}

/// The batch sizes, in groups' worth of rows, a loop over `groups` groups runs: 1, 2, 3, 4, 6,
/// 8, 12, ... below `groups`, then `groups`.
pub fn buckets(groups: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut p = 1usize;
    while p < groups {
        out.push(p);
        if p >= 2 && p + p / 2 < groups {
            out.push(p + p / 2);
        }
        p *= 2;
    }
    out.push(groups.max(1));
    out.sort_unstable();
    out.dedup();
    out
}

/// Bytes of `model`'s text decoder weights (norms, linears, final norm) and lm head.
fn decoder_weight_bytes(model: &GpuModel) -> u64 {
    let w = &model.weights;
    let lin = |l: &super::weights::GpuLinear| l.w.len() + l.b.as_ref().map_or(0, |b| b.len());
    let blocks: usize = w
        .text
        .iter()
        .map(|b| {
            b.norm1.len() + b.norm2.len() + lin(&b.qkv) + lin(&b.o) + lin(&b.gate_up) + lin(&b.down)
        })
        .sum();
    2 * (blocks + w.final_norm.len() + w.lm_head().len()) as u64
}

/// The smallest bucket holding `alive` groups.
fn bucket_for(alive: usize, groups: usize) -> usize {
    buckets(groups)
        .into_iter()
        .find(|&b| b >= alive)
        .unwrap_or(groups)
}

/// The rows of the smallest bucket holding `alive` rows, with `samples` samples in groups of
/// `group` (a multiple of `group`, at most `samples`).
fn row_bucket_for(alive: usize, samples: usize, group: usize) -> usize {
    bucket_for(alive.div_ceil(group).max(1), samples / group) * group
}

/// The groups a batch of `rows` rows is cut into for the group-shared attention: as many as
/// there can be (every row its own group, at most every group once), so that the cut is a
/// function of the bucket alone and a captured step serves any mix of groups.
fn table_groups(rows: usize, samples: usize, group: usize) -> usize {
    rows.min(samples / group).max(1)
}

/// The group table of a batch whose rows are the (ascending) `batch` samples in groups of
/// `group`: the row each group present starts at, then `batch.len()` up to `groups + 1`
/// entries (empty groups).
pub(crate) fn group_starts(batch: &[usize], group: usize, groups: usize) -> Vec<u32> {
    let mut out: Vec<u32> = (0..batch.len())
        .filter(|&i| i == 0 || batch[i] / group != batch[i - 1] / group)
        .map(|i| i as u32)
        .collect();
    debug_assert!(
        out.len() <= groups,
        "{} groups present, {groups} cut",
        out.len()
    );
    out.resize(groups + 1, batch.len() as u32);
    out
}

/// A compaction of the batch ([`compaction`]): the new batch's samples (ascending) and, per
/// new row, the old row it comes from.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Compaction {
    pub batch: Vec<usize>,
    pub map: Vec<u32>,
}

/// Compacts `batch` (ascending samples in groups of `group`, `samples` in all) to the smallest
/// bucket holding its samples that are `alive`, or `None` when that bucket is not smaller.
/// The bucket is topped up with stopped samples, first those of groups that still have a live
/// sample (so that no other group's prefix is read), each kind in row order. A function of
/// the batch and of which samples are alive only.
pub(crate) fn compaction(
    batch: &[usize],
    alive: impl Fn(usize) -> bool,
    group: usize,
    samples: usize,
) -> Option<Compaction> {
    let live: Vec<usize> = (0..batch.len()).filter(|&i| alive(batch[i])).collect();
    let rows = row_bucket_for(live.len(), samples, group);
    if rows >= batch.len() {
        return None;
    }
    let live_groups: std::collections::HashSet<usize> =
        live.iter().map(|&i| batch[i] / group).collect();
    let (near, far): (Vec<usize>, Vec<usize>) = (0..batch.len())
        .filter(|&i| !alive(batch[i]))
        .partition(|&i| live_groups.contains(&(batch[i] / group)));
    let fill = rows - live.len();
    let mut keep: Vec<usize> = live
        .into_iter()
        .chain(near.into_iter().chain(far).take(fill))
        .collect();
    keep.sort_unstable();
    Some(Compaction {
        batch: keep.iter().map(|&i| batch[i]).collect(),
        map: keep.into_iter().map(|i| i as u32).collect(),
    })
}

impl DeviceDecode {
    /// Buffers for `samples` samples in groups of `group`, `max_new` tokens each, after group
    /// prefixes of at most `max_prefix` keys, with `model`'s vocabulary; nothing is captured
    /// yet. Groups of more than one sample share their prefix reads when the model's head
    /// size takes the tensor-core attention.
    pub fn new(
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        samples: usize,
        group: usize,
        max_new: usize,
        max_prefix: usize,
    ) -> Result<Self> {
        if group == 0 || samples == 0 || !samples.is_multiple_of(group) || max_new == 0 {
            return Err(GpuError::Input(format!(
                "device decode: {samples} samples in groups of {group}, {max_new} tokens each"
            )));
        }
        let v = model.vocab();
        let hd = model.text_dims().head_dim;
        let max_prefix = max_prefix.max(1).div_ceil(MAX_KV_ROUND) * MAX_KV_ROUND;
        let max_kv = max_prefix + max_new;
        let grouped =
            group > 1 && decode_kernel_for(hd).is_ok_and(|k| k == DecodeKernel::TensorCores);
        let n = samples;
        let table = (max_kv + max_new) * hd;
        Ok(DeviceDecode {
            samples,
            group,
            max_new,
            vocab: v,
            head_dim: hd,
            max_kv,
            max_prefix,
            grouped,
            rows: alloc(gpu, stream, n)?,
            rows_tmp: alloc(gpu, stream, n)?,
            map: alloc(gpu, stream, n)?,
            starts: alloc(gpu, stream, n / group + 1)?,
            sample_ids: alloc(gpu, stream, n)?,
            steps: alloc(gpu, stream, n)?,
            key: alloc(gpu, stream, 3)?,
            tokens: alloc(gpu, stream, n)?,
            sample_scratch: SampleScratch::new(stream, n)?,
            logprobs: alloc(gpu, stream, n)?,
            feed: alloc(gpu, stream, n)?,
            cos: alloc(gpu, stream, n * hd)?,
            sin: alloc(gpu, stream, n * hd)?,
            seqs: alloc(gpu, stream, n)?,
            write_rows: alloc(gpu, stream, n)?,
            cos_table: alloc(gpu, stream, table)?,
            sin_table: alloc(gpu, stream, table)?,
            stop_ids: alloc(gpu, stream, 1)?,
            n_stop: 0,
            out_tokens: alloc(gpu, stream, n * max_new)?,
            out_logprobs: alloc(gpu, stream, n * max_new)?,
            done_step: alloc(gpu, stream, n)?,
            logits: alloc(gpu, stream, n * v)?,
            logits_tmp: alloc(gpu, stream, n * v)?,
            bufs: DecodeBufs::new(
                model,
                gpu,
                stream,
                n,
                max_kv,
                grouped.then_some((group, max_prefix)),
            )?,
            sampling: SampleParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
                iteration: 0,
            },
            logprob_temperature: 1.0,
            batch: Vec::new(),
            batch_prefix_keys: 0,
            pinned: Vec::new(),
            copies: VecDeque::new(),
            known: None,
            graphs: HashMap::new(),
            baked: (0, 0),
            no_graph: Vec::new(),
            warm: HashSet::new(),
            eager: false,
            prefix_len: Vec::new(),
            launched: Vec::new(),
            weight_bytes: decoder_weight_bytes(model),
            kv_bytes_per_key: {
                let t = model.config.text();
                2 * t.num_layers as u64 * (t.num_kv_heads * t.head_dim()) as u64 * 2
            },
        })
    }

    /// Whether these buffers serve a loop of this shape (else a new [`DeviceDecode`] is made).
    pub fn fits(&self, samples: usize, group: usize, max_new: usize, max_prefix: usize) -> bool {
        self.samples == samples
            && self.group == group
            && self.max_new == max_new
            && max_prefix <= self.max_prefix
    }

    /// Launch every step eagerly from now on (graph replay's reference in tests and benches).
    pub fn set_eager(&mut self, eager: bool) {
        self.eager = eager;
    }

    /// Row `sample`'s logits, where the caller puts the first step's (its prefix's last logits).
    pub fn first_logits_mut(&mut self, sample: usize) -> cudarc::driver::CudaViewMut<'_, bf16> {
        let v = self.vocab;
        self.logits.slice_mut(sample * v..(sample + 1) * v)
    }

    /// Starts an iteration's decode over `arena` (on `stream`): uploads the rows, the key, the
    /// RoPE table and the stop rule; the first logits are the caller's
    /// ([`DeviceDecode::first_logits_mut`]). Graphs baked for another arena are dropped.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &GpuKvArena,
        s: &DecodeStart<'_>,
        seed: u64,
        iteration: u32,
    ) -> Result<()> {
        let n = s.slots.len();
        if n != self.samples || s.group != self.group || s.max_new as usize != self.max_new {
            return Err(GpuError::Input(format!(
                "device decode made for {} samples (groups of {}, {} tokens), started with {n} \
                 (groups of {}, {} tokens)",
                self.samples, self.group, self.max_new, s.group, s.max_new
            )));
        }
        for (what, v) in [("forced lengths", s.forced), ("sampling keys", s.keys)] {
            if v.is_some_and(|v| v.len() != n) {
                return Err(GpuError::Input(format!(
                    "device decode: {what} do not match the {n} samples"
                )));
            }
        }
        if s.slots
            .iter()
            .any(|sl| sl.suffix_len != 0 || sl.suffix_capacity != s.max_new)
        {
            return Err(GpuError::Input(
                "device decode: every suffix must start empty with max_new rows".into(),
            ));
        }
        // positions: prefix.len + rope_delta + suffix_len, from the lowest start
        let starts: Vec<i64> = s
            .slots
            .iter()
            .map(|sl| sl.prefix.len as i64 + sl.rope_delta)
            .collect();
        let base = starts.iter().copied().min().unwrap_or(0);
        let top = starts.iter().copied().max().unwrap_or(0) + s.max_new as i64;
        let table_rows = (top - base) as usize;
        let max_prefix = s
            .slots
            .iter()
            .map(|sl| sl.prefix.len as usize)
            .max()
            .unwrap_or(1);
        let hd = self.head_dim;
        if table_rows * hd > self.cos_table.len() || max_prefix > self.max_prefix {
            return Err(GpuError::Input(format!(
                "device decode: {table_rows} RoPE rows and prefixes of {max_prefix} keys exceed \
                 the buffers made for {} and {}",
                self.cos_table.len() / hd,
                self.max_prefix
            )));
        }
        if let Some(f) = s.forced {
            if let Some(bad) = f.iter().find(|&&l| l == 0 || l > s.max_new) {
                return Err(GpuError::Input(format!(
                    "device decode: a forced length of {bad} is outside 1..={}",
                    s.max_new
                )));
            }
        }
        let positions: Vec<i64> = (base..top).collect();
        let (cos, sin) = flat_rope_tables(&model.config, &positions);
        stream.memcpy_htod(&cos, &mut self.cos_table.slice_mut(..cos.len()))?;
        stream.memcpy_htod(&sin, &mut self.sin_table.slice_mut(..sin.len()))?;
        let rows: Vec<DecodeRow> = s
            .slots
            .iter()
            .enumerate()
            .map(|(i, sl)| DecodeRow {
                sample: i as u32,
                key: s.keys.map_or(i as u32, |k| k[i]),
                prefix_offset: sl.prefix.offset,
                prefix_len: sl.prefix.len,
                suffix_offset: sl.suffix_offset,
                suffix_len: 0,
                rope_row: (starts[i] - base) as u32,
                forced: s.forced.is_some() as u32,
                stop_len: s.forced.map_or(0, |f| f[i]),
                done: 0,
                step: 0,
            })
            .collect();
        stream.memcpy_htod(&rows, &mut self.rows)?;
        let ids: Vec<u32> = rows.iter().map(|r| r.key).collect();
        stream.memcpy_htod(&ids, &mut self.sample_ids)?;
        stream.memcpy_htod(&vec![0u32; n], &mut self.steps)?;
        stream.memcpy_htod(&vec![NOT_DONE; n], &mut self.done_step)?;
        let key = [seed as u32, (seed >> 32) as u32, iteration];
        stream.memcpy_htod(&key, &mut self.key)?;
        if s.stop_ids.len() > self.stop_ids.len() {
            self.stop_ids = alloc(gpu, stream, s.stop_ids.len())?;
            self.graphs.clear();
        }
        stream.memcpy_htod(s.stop_ids, &mut self.stop_ids.slice_mut(..s.stop_ids.len()))?;
        let (a, b) = (&s.sampling, &self.sampling);
        if s.stop_ids.len() != self.n_stop
            || (a.temperature, a.top_k, a.top_p) != (b.temperature, b.top_k, b.top_p)
            || s.logprob_temperature != self.logprob_temperature
        {
            // baked into the graphs as launch arguments (the key's seed and iteration are not)
            self.graphs.clear();
        }
        self.n_stop = s.stop_ids.len();
        self.sampling = s.sampling;
        self.logprob_temperature = s.logprob_temperature;
        let baked = arena.addresses(stream);
        if baked != self.baked {
            self.graphs.clear();
            self.baked = baked;
        }
        self.copies.clear();
        self.known = None;
        self.prefix_len = s.slots.iter().map(|sl| sl.prefix.len).collect();
        self.launched.clear();
        self.set_batch(stream, (0..n).collect())
    }

    /// Makes `batch` (ascending samples, already in the rows) the batch: uploads its group
    /// table and counts the prefix keys a step reads.
    fn set_batch(&mut self, stream: &Arc<CudaStream>, batch: Vec<usize>) -> Result<()> {
        let g = self.group;
        if self.grouped {
            let groups = table_groups(batch.len(), self.samples, g);
            let starts = group_starts(&batch, g, groups);
            stream.memcpy_htod(&starts, &mut self.starts.slice_mut(..starts.len()))?;
            self.batch_prefix_keys = starts[..groups]
                .iter()
                .filter(|&&r| (r as usize) < batch.len())
                .map(|&r| self.prefix_len[batch[r as usize]] as u64)
                .sum();
        } else {
            self.batch_prefix_keys = batch.iter().map(|&i| self.prefix_len[i] as u64).sum();
        }
        self.batch = batch;
        Ok(())
    }

    /// Drops the captured graphs (and so their hold on the streams they were captured on):
    /// a run whose streams are going away calls it.
    pub fn forget_graphs(&mut self) {
        self.graphs.clear();
        self.no_graph.clear();
        self.warm.clear();
    }

    /// The least bytes step `step` moved, given how many samples were live in it (the caller's
    /// count; the device knows only its rows): every text weight and the lm head, each group's
    /// prefix KV once (per row without group-shared attention), each live sample's suffix KV
    /// and appended row, and the logits written and read twice (draw, log-prob).
    pub fn step_bytes(&self, step: u32, live: usize) -> f64 {
        let Some(&(rows, prefix_keys)) = self.launched.get(step as usize) else {
            return 0.0;
        };
        let kv = self.kv_bytes_per_key as f64;
        self.weight_bytes as f64
            + prefix_keys as f64 * kv
            + live as f64 * (step as f64 + 2.0) * kv
            + rows as f64 * self.vocab as f64 * 2.0 * 3.0
    }

    /// Rows step `step` ran (0 for a step not launched).
    pub fn step_rows(&self, step: u32) -> usize {
        self.launched
            .get(step as usize)
            .map_or(0, |&(rows, _)| rows)
    }

    /// Rows in the running batch.
    pub fn batch_rows(&self) -> usize {
        self.batch.len()
    }

    /// Runs decode step `step` on `stream`: first the deterministic compaction (see the module
    /// docs), then the step as a graph replay (a bucket's first step on a stream is launched
    /// eagerly, which also compiles and plans what a capture needs; its second is captured and
    /// replayed: a capture burst after an eager one would outlast the steps the device has
    /// queued), and every [`LAG`]th step a copy of the stop steps for the host. Returns how the
    /// step was launched, or `None` (nothing launched) once the host knows every sample has
    /// stopped.
    pub fn step(
        &mut self,
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
        step: u32,
    ) -> Result<Option<StepLaunch>> {
        self.poll()?;
        if let Some((_, done)) = &self.known {
            if done.iter().all(|&d| d != NOT_DONE) {
                return Ok(None);
            }
        }
        if step >= LAG && step.is_multiple_of(LAG) {
            self.compact_as_of(gpu, stream, step - LAG)?;
        }
        let sk = stream.cu_stream() as usize;
        let key = (self.batch.len(), sk);
        let steady = self.eager || self.no_graph.contains(&sk);
        let how = if let Some(g) = self.graphs.get(&key).filter(|_| !steady) {
            gpu.timed(stream, DECODE_GRAPH, 0.0, || Ok(g.launch()?))?;
            StepLaunch::Replay
        } else if steady {
            self.launch_step(model, gpu, stream, arena)?;
            StepLaunch::Eager
        } else if self.warm.insert(key) {
            // the bucket's first step on this stream: launched one kernel at a time, which also
            // compiles and plans what a capture needs (kernels, GEMM plans, the stream's GEMM
            // workspace)
            self.launch_step(model, gpu, stream, arena)?;
            StepLaunch::Burst { captured: false }
        } else {
            // its second step: captured, then replayed (the host's burst split over two steps,
            // each shorter than the two steps the device has queued)
            match self.capture(model, gpu, stream, arena) {
                Ok(g) => {
                    gpu.timed(stream, DECODE_GRAPH, 0.0, || Ok(g.launch()?))?;
                    self.graphs.insert(key, g);
                    StepLaunch::Burst { captured: true }
                }
                Err(e) => {
                    eprintln!(
                        "warning: decode steps on this stream are launched one kernel at a \
                         time: capturing a CUDA graph failed ({e})"
                    );
                    self.no_graph.push(sk);
                    self.launch_step(model, gpu, stream, arena)?;
                    StepLaunch::Burst { captured: false }
                }
            }
        };
        if step.is_multiple_of(LAG) {
            self.copy_done(gpu, stream, step)?;
        }
        let (rows, prefix_keys) = (self.batch_rows(), self.batch_prefix_keys);
        debug_assert_eq!(
            self.launched.len(),
            step as usize,
            "steps run in order from 0"
        );
        self.launched.push((rows, prefix_keys));
        Ok(Some(how))
    }

    /// The step's launches: draw, log-prob, advance, forward.
    fn launch_step(
        &mut self,
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
    ) -> Result<()> {
        let (b, v) = (self.batch_rows(), self.vocab);
        sample_bf16_keyed(
            gpu,
            stream,
            &mut self.tokens,
            &self.logits,
            &self.key,
            &self.sample_ids,
            &self.steps,
            b,
            v,
            v,
            &self.sampling,
            Some(&mut self.sample_scratch),
        )?;
        logprobs_fwd_bf16(
            gpu,
            stream,
            &mut self.logprobs,
            None::<&mut dyn cudarc::driver::DevicePtrMut<f32>>,
            None,
            &self.logits,
            &self.tokens,
            b,
            v,
            v,
            self.logprob_temperature,
        )?;
        decode_advance(
            gpu,
            stream,
            DecodeAdvance {
                rows: &mut self.rows,
                n_rows: b,
                tokens: &self.tokens,
                logprobs: &self.logprobs,
                stop_ids: &self.stop_ids,
                n_stop: self.n_stop,
                max_new: self.max_new,
                keep_prefix: self.grouped,
                out_tokens: &mut self.out_tokens,
                out_logprobs: &mut self.out_logprobs,
                done_step: &mut self.done_step,
                samples: self.samples,
                cos_table: &self.cos_table,
                sin_table: &self.sin_table,
                head_dim: self.head_dim,
                feed: &mut self.feed,
                cos: &mut self.cos,
                sin: &mut self.sin,
                seqs: &mut self.seqs,
                write_rows: &mut self.write_rows,
                sample_ids: &mut self.sample_ids,
                steps: &mut self.steps,
            },
        )?;
        let io = DecodeIo {
            tokens: &self.feed,
            cos: &self.cos,
            sin: &self.sin,
            seqs: &self.seqs,
            write_rows: &self.write_rows,
            batch: b,
            max_kv: self.max_kv,
            grouped: self.grouped.then_some(Grouping {
                group: self.group,
                max_prefix: self.max_prefix,
                table: Some((&self.starts, table_groups(b, self.samples, self.group))),
            }),
        };
        model.decode_forward(gpu, stream, arena, &io, &mut self.bufs, &mut self.logits)
    }

    /// Captures the step's launches as a graph (not run).
    fn capture(
        &mut self,
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
    ) -> Result<CudaGraph> {
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let launched = self.launch_step(model, gpu, stream, arena);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        graph?.ok_or_else(|| GpuError::Input("stream capture of a decode step was empty".into()))
    }

    /// Enqueues a copy of the stop steps as of `step` (just launched) into pinned memory.
    fn copy_done(&mut self, gpu: &Gpu, stream: &Arc<CudaStream>, step: u32) -> Result<()> {
        let used: Vec<usize> = self.copies.iter().map(|c| c.buf).collect();
        let buf = match (0..self.pinned.len()).find(|i| !used.contains(i)) {
            Some(i) => i,
            None => {
                // SAFETY: a page-locked host buffer of `samples` u32, written only by the copies
                // below and read after their events.
                let p = unsafe { gpu.ctx().alloc_pinned_with_flags::<u32>(self.samples, 0) }?;
                self.pinned.push(p);
                self.pinned.len() - 1
            }
        };
        stream.memcpy_dtoh(&self.done_step, &mut self.pinned[buf])?;
        let ready = gpu.event()?;
        ready.record(stream)?;
        self.copies.push_back(DoneCopy { step, buf, ready });
        Ok(())
    }

    /// Takes in every copy that has landed, without waiting.
    fn poll(&mut self) -> Result<()> {
        while self.copies.front().is_some_and(|c| c.ready.is_complete()) {
            self.take_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest copy in flight and makes it the newest known.
    fn take_oldest(&mut self) -> Result<()> {
        let Some(c) = self.copies.pop_front() else {
            return Ok(());
        };
        c.ready.synchronize()?;
        let done = self.pinned[c.buf].as_slice()?.to_vec();
        self.known = Some((c.step, done));
        Ok(())
    }

    /// Compacts the rows to the bucket of the samples still decoding after step `asof`
    /// ([`compaction`]; waiting for that copy if it has not landed: it was launched [`LAG`]
    /// steps ago).
    fn compact_as_of(&mut self, gpu: &Gpu, stream: &Arc<CudaStream>, asof: u32) -> Result<()> {
        while self.known.as_ref().is_none_or(|(s, _)| *s < asof) {
            if self.copies.is_empty() {
                return Err(GpuError::Input(format!(
                    "device decode: no copy of the stop steps as of step {asof}"
                )));
            }
            self.take_oldest()?;
        }
        let (_, done) = self.known.as_ref().expect("taken above");
        let alive = |m: usize| done[m] == NOT_DONE || done[m] > asof;
        let Some(Compaction { batch, map }) =
            compaction(&self.batch, alive, self.group, self.samples)
        else {
            return Ok(());
        };
        let n = map.len();
        stream.memcpy_htod(&map, &mut self.map.slice_mut(..n))?;
        decode_gather_rows(
            gpu,
            stream,
            &mut self.rows_tmp,
            &self.rows,
            &self.map,
            n,
            &mut self.sample_ids,
            &mut self.steps,
        )?;
        stream.memcpy_dtod(&self.rows_tmp.slice(..n), &mut self.rows.slice_mut(..n))?;
        let v = self.vocab;
        embedding_fwd_bf16(
            gpu,
            stream,
            &mut self.logits_tmp,
            &self.logits,
            &self.map,
            n,
            v,
            v,
        )?;
        stream.memcpy_dtod(
            &self.logits_tmp.slice(..n * v),
            &mut self.logits.slice_mut(..n * v),
        )?;
        self.set_batch(stream, batch)
    }

    /// Brings the outputs to the host (synchronises `stream`).
    pub fn collect(&mut self, stream: &Arc<CudaStream>) -> Result<DecodeOutput> {
        let out = DecodeOutput {
            tokens: stream.clone_dtoh(&self.out_tokens)?,
            logprobs: stream.clone_dtoh(&self.out_logprobs)?,
            done_step: stream.clone_dtoh(&self.done_step)?,
        };
        stream.synchronize()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
