//! Checkpoints of the RL loop (`--save-every`) and resuming from them (`--resume`).
//!
//! A checkpoint after `k` completed iterations is the directory `<out>/checkpoints/iter-<k>`
//! (8 digits), written atomically by [`ckpt_state::AtomicDir`] (temporary sibling, fsync,
//! rename):
//!
//! ```text
//! config.json, model.safetensors   the actor in Hugging Face layout, f32 (bitwise; loadable
//!                                  by our loader and by transformers)
//! optimizer.safetensors            AdamW per trainable tensor: master.<name>, exp_avg.<name>,
//!                                  exp_avg_sq.<name>
//! run_state.json                   iterations done, seed, data cursor, optimizer step, the
//!                                  optimizer file's CRC32, and under `extra`: the plan's hash,
//!                                  the reference model's identity, model.safetensors' CRC32
//! ```
//!
//! What a bitwise resume needs and why nothing else is saved: sampling keys its Philox RNG by
//! (seed, iteration, sample, step) and prompts are a function of (dataset, seed, iteration)
//! (see `prompts`), so the RNG words are empty and the data cursor is the iteration; the
//! reference is the initial actor, rebuilt from the job spec and checked against the saved
//! hash; the learning rate is a function of the optimizer step.
//!
//! Both backends write the same format through one code path (host weights, the optimizer map
//! and the step): the CUDA trainer's state comes down with `GpuTrainer::export_state`, its fused
//! q|k|v and gate|up tensors split into the CPU model's tensors and named as the CPU backend
//! names them, the model file's trained tensors being its fp32 masters. A checkpoint is
//! therefore backend-neutral for the same plan: a `--backend cuda` checkpoint resumes on
//! `--backend cpu` and the reverse (the tensors and identity checks are the same; the numbers
//! then follow the engine that resumes, bf16 on the GPU, f32 on the CPU, so only a resume on the
//! engine that saved is bitwise the uninterrupted run). A CUDA resume restores masters and
//! moments and re-derives the bf16 compute copy from the masters (round to nearest even, as
//! `adamw_step_f32` writes it: the same bits); the frozen vision tower and merger keep the job's
//! initial weights, as in the run that saved.
//!
//! The CPU backend saves and loads one state, the whole model's [`TrainState`]: its ranks
//! gather their shards of the weights and the AdamW state on rank 0
//! ([`super::cpu::gather_train_state`]; a copy on one rank), which saves it ([`save`]); a
//! resume [`load`]s it and each rank takes its part ([`super::cpu::restore_rank`]).
//!
//! `--eval-every` also keeps `<out>/checkpoints/best` ([`BEST_DIR`], [`Slot::Best`]): the same
//! format, written the same atomic way over the one before, its validation scores in its run
//! state. It is not an `iter-<k>` name, so [`prune`] and [`resolve`] (the newest checkpoint of
//! an output directory) never take it; `--resume <out>/checkpoints/best` resumes from it.
//!
//! Invariants: a checkpoint is only ever seen complete or not at all; a resume refuses a
//! checkpoint of another plan, another seed, another reference, or with a corrupt file, with a
//! message naming the file, before anything of the run is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rollplex_plan::spec::{DType, JobSpec, WeightsSource};
use rollplex_plan::Plan;

use super::cpu::TrainState;
use super::gpu::GpuModels;
use super::ExecError;
use crate::ckpt_state::{self, AtomicDir, RunState, Tensor32};
use crate::data::BatchCursor;
use crate::gpu::train::{GpuTrainState, ParamState};
use crate::model::Qwen25VL;
use crate::train::OptTable;

/// Where `--save-every` writes, under the run's output directory.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The checkpoint with the best validation score (`--eval-every`), beside the `iter-<k>` ones
/// under [`CHECKPOINTS_DIR`]; not an `iter-<k>` name, so pruning and "the newest checkpoint"
/// never see it.
pub const BEST_DIR: &str = "best";
/// Where a best checkpoint's `run_state.json` keeps its scores (under `extra`).
pub const VALIDATION_KEY: &str = "validation";

/// Which checkpoint a save writes.
#[derive(Clone, Debug)]
pub enum Slot {
    /// `iter-<k>`, then all but the newest `keep` of them removed (`0`: all kept).
    Newest { keep: usize },
    /// [`BEST_DIR`], replacing the one there; `scores` go into its run state under
    /// [`VALIDATION_KEY`], for a resumed run to continue from.
    Best { scores: serde_json::Value },
}
const MODEL_FILE: &str = "model.safetensors";

fn ck(msg: String) -> ExecError {
    ExecError::Checkpoint(msg)
}

/// FNV-1a over 32-bit words: a stable 64-bit fingerprint (identity checks, not security).
fn fnv64(words: impl Iterator<Item = u32>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        h ^= w as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn hex(h: u64) -> String {
    format!("{h:016x}")
}

/// The plan's fingerprint: of its binary encoding (producer name left out), so the same plan
/// read from `plan.bin` or recompiled identically hashes the same.
pub fn plan_hash(plan: &Plan) -> Result<String, ExecError> {
    let bytes = rollplex_plan::encode(plan, "")
        .map_err(|e| ExecError::Plan(format!("cannot encode the plan to hash it: {e}")))?;
    Ok(hex(fnv64(bytes.chunks(4).map(|c| {
        c.iter().rev().fold(0u32, |a, &b| (a << 8) | b as u32)
    }))))
}

/// The fingerprint of a model's weights (their f32 bits).
pub fn weights_hash(model: &Qwen25VL) -> String {
    hex(fnv64(model.weights.data.iter().map(|x| x.to_bits())))
}

fn source_of(spec: &JobSpec) -> String {
    match &spec.actor.weights {
        WeightsSource::Random { seed } => format!("random(seed = {seed})"),
        WeightsSource::Checkpoint { path } => format!("checkpoint({path})"),
    }
}

/// What a checkpoint must match to continue a run: the plan, and the reference model (its
/// source and its weights' hash; `None` when the job has no reference).
#[derive(Clone, Debug, PartialEq)]
pub struct RunIdentity {
    pub plan_hash: String,
    pub seed: u64,
    pub reference: Option<(String, String)>,
}

impl RunIdentity {
    /// The identity of a run whose reference is `reference` (on the host; the initial actor),
    /// whatever backend runs it: the same for `cpu` and `cuda`.
    pub fn with_reference(plan: &Plan, reference: Option<&Qwen25VL>) -> Result<Self, ExecError> {
        Ok(RunIdentity {
            plan_hash: plan_hash(plan)?,
            seed: plan.spec.seed,
            reference: reference.map(|r| (source_of(&plan.spec), weights_hash(r))),
        })
    }

    fn reference_json(&self) -> serde_json::Value {
        match &self.reference {
            Some((source, hash)) => serde_json::json!({"source": source, "weights_fnv64": hash}),
            None => serde_json::Value::Null,
        }
    }
}

/// The optimizer file's three prefixes: fp32 master, AdamW's first and second moments.
const OPT_PREFIXES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// Adds one trained tensor's `(master, m, v)` to the optimizer map under [`OPT_PREFIXES`].
fn insert_param(
    out: &mut BTreeMap<String, Tensor32>,
    name: &str,
    shape: &[usize],
    bufs: [&[f32]; 3],
) {
    for (prefix, buf) in OPT_PREFIXES.into_iter().zip(bufs) {
        out.insert(
            format!("{prefix}.{name}"),
            Tensor32 {
                shape: shape.to_vec(),
                data: buf.to_vec(),
            },
        );
    }
}

/// The optimizer map of dense AdamW buffers in `table`'s carving.
fn opt_state_of(
    table: &OptTable,
    (master, m, v): (&[f32], &[f32], &[f32]),
) -> BTreeMap<String, Tensor32> {
    let mut out = BTreeMap::new();
    for p in table.params() {
        let r = p.state_offset..p.state_offset + p.numel;
        insert_param(
            &mut out,
            &p.name,
            &p.shape,
            [&master[r.clone()], &m[r.clone()], &v[r]],
        );
    }
    out
}

/// The CUDA trainer's state as the optimizer map (the CPU backend's names).
fn gpu_opt_state(state: &GpuTrainState) -> BTreeMap<String, Tensor32> {
    let mut out = BTreeMap::new();
    for p in &state.params {
        insert_param(&mut out, &p.name, &p.shape, [&p.master, &p.m, &p.v]);
    }
    out
}

/// The inverse of [`gpu_opt_state`]: every `master.<name>` with its two moments; a tensor
/// without all three, or any other entry, is an error naming the optimizer file.
fn gpu_state_of(
    dir: &Path,
    mut map: BTreeMap<String, Tensor32>,
    steps: u64,
) -> Result<GpuTrainState, ExecError> {
    let opath = dir.join(ckpt_state::OPTIMIZER_FILE);
    let names: Vec<String> = map
        .keys()
        .filter_map(|k| k.strip_prefix("master.").map(str::to_string))
        .collect();
    let mut params = Vec::with_capacity(names.len());
    for name in names {
        let mut take = |prefix: &str| {
            map.remove(&format!("{prefix}.{name}")).ok_or_else(|| {
                ck(format!(
                    "{}: tensor {name:?} has a master but no {prefix}",
                    opath.display()
                ))
            })
        };
        let (master, m, v) = (take("master")?, take("exp_avg")?, take("exp_avg_sq")?);
        if m.shape != master.shape || v.shape != master.shape {
            return Err(ck(format!(
                "{}: the master and moments of {name:?} differ in shape",
                opath.display()
            )));
        }
        params.push(ParamState {
            name,
            shape: master.shape,
            master: master.data,
            m: m.data,
            v: v.data,
        });
    }
    if let Some(k) = map.keys().next() {
        return Err(ck(format!(
            "{}: unexpected tensor {k:?} (not master/exp_avg/exp_avg_sq of a trained tensor)",
            opath.display()
        )));
    }
    Ok(GpuTrainState { params, steps })
}

/// Saves the CPU backend's state after `completed` iterations atomically into `slot`
/// (`<root>/iter-<completed>` then pruned, or `<root>/best`). `state` is the whole model's,
/// gathered from the ranks on rank 0 (its weights load in Hugging Face layout; a resume
/// continues its plan at any rank count it runs with).
pub fn save(
    root: &Path,
    completed: u32,
    state: &TrainState,
    identity: &RunIdentity,
    slot: &Slot,
) -> Result<PathBuf, ExecError> {
    let trained = TrainedState {
        model: &state.actor,
        optimizer: opt_state_of(&state.table, (&state.master, &state.m, &state.v)),
        steps: state.steps,
    };
    save_state(root, completed, trained, identity, slot)
}

/// [`save`] for the CUDA backend: the trainer's state comes down into `host` (the host copy of
/// the actor the run started from, or resumed into: its trained tensors are overwritten with
/// the fp32 masters, its frozen ones are the run's) and is saved in the same format.
pub fn save_gpu(
    root: &Path,
    completed: u32,
    models: &GpuModels,
    host: &mut Qwen25VL,
    identity: &RunIdentity,
    slot: &Slot,
) -> Result<PathBuf, ExecError> {
    let st = models.trainer.export_state(&models.stream, host)?;
    let state = TrainedState {
        model: host,
        optimizer: gpu_opt_state(&st),
        steps: st.steps,
    };
    save_state(root, completed, state, identity, slot)
}

/// What a checkpoint holds of the trained actor, whatever backend trained it.
struct TrainedState<'a> {
    /// Host weights, f32, the trained tensors equal to their masters.
    model: &'a Qwen25VL,
    /// `master.<name>`, `exp_avg.<name>`, `exp_avg_sq.<name>` per trained tensor.
    optimizer: BTreeMap<String, Tensor32>,
    /// Optimizer steps taken.
    steps: u64,
}

/// The one save path of both backends.
fn save_state(
    root: &Path,
    completed: u32,
    trained: TrainedState<'_>,
    identity: &RunIdentity,
    slot: &Slot,
) -> Result<PathBuf, ExecError> {
    let target = match slot {
        Slot::Newest { .. } => ckpt_state::checkpoint_dir(root, completed as u64),
        Slot::Best { .. } => root.join(BEST_DIR),
    };
    let dir = AtomicDir::begin(target).map_err(|e| ck(e.to_string()))?;
    let model = trained.model;
    crate::model::checkpoint::save_checkpoint(model, dir.path(), DType::F32)?;
    let mpath = dir.path().join(MODEL_FILE);
    let blob = std::fs::read(&mpath).map_err(|e| ck(format!("{}: {e}", mpath.display())))?;
    let mut extra = BTreeMap::new();
    extra.insert("plan_fnv64".into(), identity.plan_hash.clone().into());
    extra.insert("reference".into(), identity.reference_json());
    extra.insert(
        "model_file".into(),
        serde_json::json!({"name": MODEL_FILE, "bytes": blob.len(), "crc32": crc32fast::hash(&blob)}),
    );
    if let Slot::Best { scores } = slot {
        extra.insert(VALIDATION_KEY.into(), scores.clone());
    }
    let state = RunState {
        iteration: completed as u64,
        seed: identity.seed,
        rng: Vec::new(),
        data: BatchCursor {
            next_batch: completed as u64,
        },
        optimizer_step: trained.steps,
        optimizer: trained.optimizer,
        extra,
    };
    ckpt_state::write_run_state(dir.path(), &state).map_err(|e| ck(e.to_string()))?;
    let path = dir.commit().map_err(|e| ck(e.to_string()))?;
    if let Slot::Newest { keep } = slot {
        prune(root, *keep)?;
    }
    Ok(path)
}

/// Removes all but the newest `keep` complete `iter-<k>` checkpoints of `root` (`keep == 0`:
/// none; [`BEST_DIR`] is never one of them), each
/// renamed out of the checkpoints before it is deleted ([`ckpt_state::remove_checkpoint`]), so
/// a kill midway never leaves a partial `iter-N` that looks like a checkpoint.
pub fn prune(root: &Path, keep: usize) -> Result<(), ExecError> {
    if keep == 0 {
        return Ok(());
    }
    let mut all = complete_checkpoints(root)?;
    all.sort();
    let n = all.len().saturating_sub(keep);
    for (_, p) in all.into_iter().take(n) {
        ckpt_state::remove_checkpoint(&p).map_err(|e| ck(e.to_string()))?;
    }
    Ok(())
}

/// The complete checkpoints (`iter-N` with a manifest) directly under `root`.
fn complete_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, ExecError> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(root).map_err(|e| ck(format!("{}: {e}", root.display())))?;
    for e in entries {
        let p = e
            .map_err(|e| ck(format!("{}: {e}", root.display())))?
            .path();
        let n = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("iter-"))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(n) = n {
            if p.join(ckpt_state::MANIFEST_FILE).is_file() {
                out.push((n, p));
            }
        }
    }
    Ok(out)
}

/// The checkpoint `--resume path` names: `path` itself when it holds `run_state.json`, else the
/// newest complete checkpoint under `path/checkpoints` (an output directory) or `path`.
pub fn resolve(path: &Path) -> Result<PathBuf, ExecError> {
    if !path.exists() {
        return Err(ck(format!(
            "{}: no such directory (give a checkpoint directory or a run's output directory)",
            path.display()
        )));
    }
    if path.join(ckpt_state::MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join(CHECKPOINTS_DIR), path.to_path_buf()] {
        if let Some((_, p)) = ckpt_state::latest_checkpoint(&root).map_err(|e| ck(e.to_string()))? {
            return Ok(p);
        }
    }
    Err(ck(format!(
        "{}: no complete checkpoint here (looked for {}, {CHECKPOINTS_DIR}/iter-*/ and iter-*/ with a {})",
        path.display(),
        ckpt_state::MANIFEST_FILE,
        ckpt_state::MANIFEST_FILE
    )))
}

/// The checkpoint's weights (`loaded`) as the job's model (`config`).
fn job_actor(
    dir: &Path,
    config: crate::model::ModelConfig,
    loaded: Qwen25VL,
) -> Result<Qwen25VL, ExecError> {
    Qwen25VL::new(config, loaded.weights).map_err(|e| {
        ck(format!(
            "{}: {e}: the checkpoint's weights do not fit this job's model",
            dir.display()
        ))
    })
}

/// AdamW's dense buffers: fp32 masters, first moments, second moments.
type AdamWBuffers = (Vec<f32>, Vec<f32>, Vec<f32>);

/// A checkpoint's optimizer map as AdamW's dense (master, first moment, second moment) buffers
/// in `table`'s carving; refuses a map of other tensors or shapes.
fn optimizer_buffers(
    dir: &Path,
    state: &RunState,
    table: &OptTable,
) -> Result<AdamWBuffers, ExecError> {
    let n = table.state_len();
    let (mut master, mut m, mut v) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let opath = dir.join(ckpt_state::OPTIMIZER_FILE);
    let mut used = 0usize;
    for p in table.params() {
        let r = p.state_offset..p.state_offset + p.numel;
        for (prefix, buf) in [
            ("master", &mut master),
            ("exp_avg", &mut m),
            ("exp_avg_sq", &mut v),
        ] {
            let name = format!("{prefix}.{}", p.name);
            let t = state.optimizer.get(&name).ok_or_else(|| {
                ck(format!(
                    "{}: no tensor {name:?} (the checkpoint trains other tensors than this job)",
                    opath.display()
                ))
            })?;
            if t.shape != p.shape {
                return Err(ck(format!(
                    "{}: tensor {name:?} has shape {:?}, this job's is {:?}",
                    opath.display(),
                    t.shape,
                    p.shape
                )));
            }
            buf[r.clone()].copy_from_slice(&t.data);
            used += 1;
        }
    }
    if used != state.optimizer.len() {
        return Err(ck(format!(
            "{}: holds {} tensors, this job trains {} (x3)",
            opath.display(),
            state.optimizer.len(),
            used / 3
        )));
    }
    Ok((master, m, v))
}

/// Loads checkpoint `dir` for the CPU backend: checks it belongs to this run (plan, seed,
/// reference; `identity`, [`RunIdentity::with_reference`]) and is intact, then returns the
/// iterations done and the whole model's state, for every rank to take its part of
/// ([`super::cpu::restore_rank`]); `config` is the job's model, `trainable` its trained tensors.
pub fn load(
    dir: &Path,
    identity: &RunIdentity,
    config: crate::model::ModelConfig,
    trainable: impl Fn(&str) -> bool,
) -> Result<(u32, TrainState), ExecError> {
    let (completed, state, loaded) = load_checked(dir, identity)?;
    let actor = job_actor(dir, config, loaded)?;
    let table = OptTable::from_model(&actor.weights.table, trainable)?;
    let (master, m, v) = optimizer_buffers(dir, &state, &table)?;
    let tp = TrainState {
        actor,
        table,
        master,
        m,
        v,
        steps: state.optimizer_step,
    };
    Ok((completed, tp))
}

/// A loaded checkpoint of the CUDA backend: iterations done, the models to continue with, and
/// the host copy of the actor (the checkpoint's weights) that the next saves write through.
pub struct ResumedGpu {
    pub dir: PathBuf,
    pub completed: u32,
    pub models: GpuModels,
    pub host: Qwen25VL,
}

/// [`load`] for the CUDA backend: the same checks, then the trainer's masters, moments and
/// step restored with `GpuTrainer::import_state` (the bf16 compute copy re-derived from the
/// masters). `fresh` are the models a new run would start from: its reference and frozen
/// tensors are kept. A CPU-backend checkpoint of the same plan loads too.
pub fn load_gpu(
    dir: &Path,
    identity: &RunIdentity,
    mut fresh: GpuModels,
) -> Result<ResumedGpu, ExecError> {
    let (completed, state, loaded) = load_checked(dir, identity)?;
    let st = gpu_state_of(dir, state.optimizer, state.optimizer_step)?;
    fresh
        .trainer
        .import_state(&fresh.stream, &st)
        .map_err(|e| {
            ck(format!(
                "{}: {e}",
                dir.join(ckpt_state::OPTIMIZER_FILE).display()
            ))
        })?;
    if let Some(a) = &fresh.arena {
        // the host images of optimizer state the plan offloads: the restored values
        a.capture(&fresh.stream)?;
    }
    let config = fresh.trainer.model().config.clone();
    let host = job_actor(dir, config, loaded)?;
    Ok(ResumedGpu {
        dir: dir.to_path_buf(),
        completed,
        models: fresh,
        host,
    })
}

/// The part of loading both backends share: the checkpoint belongs to this run (plan, seed,
/// reference), its run state fits, its model file is intact; returns the iterations done, the
/// run state and the checkpoint's weights (with its own config.json).
fn load_checked(
    dir: &Path,
    identity: &RunIdentity,
) -> Result<(u32, RunState, Qwen25VL), ExecError> {
    let at = |msg: String| ck(format!("{}: {msg}", dir.display()));
    let state = ckpt_state::load_run_state(dir).map_err(|e| ck(e.to_string()))?;
    let saved_plan = state.extra.get("plan_fnv64").and_then(|v| v.as_str());
    if saved_plan != Some(identity.plan_hash.as_str()) {
        return Err(at(format!(
            "was written by a run of another plan (plan hash {}, this plan's is {}): resume with the \
             plan it was saved with, or start a fresh run without --resume",
            saved_plan.unwrap_or("missing"),
            identity.plan_hash
        )));
    }
    if state.seed != identity.seed {
        return Err(at(format!(
            "was written with seed {}, this job's seed is {}",
            state.seed, identity.seed
        )));
    }
    let saved_ref = state
        .extra
        .get("reference")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    if saved_ref != identity.reference_json() {
        return Err(at(format!(
            "the reference model differs from the one this checkpoint was trained against \
             (saved {saved_ref}, now {}): its initial weights changed",
            identity.reference_json()
        )));
    }
    if state.data.next_batch != state.iteration || !state.rng.is_empty() {
        return Err(at(format!(
            "{}: data cursor {} and {} RNG words do not fit a checkpoint after {} iterations",
            ckpt_state::MANIFEST_FILE,
            state.data.next_batch,
            state.rng.len(),
            state.iteration
        )));
    }
    let completed = u32::try_from(state.iteration)
        .map_err(|_| at(format!("iteration {} out of range", state.iteration)))?;
    // The weights: intact (size and CRC32 as saved), then loaded with the plan's config.
    let mpath = dir.join(MODEL_FILE);
    let blob = std::fs::read(&mpath).map_err(|e| ck(format!("{}: {e}", mpath.display())))?;
    let want = state.extra.get("model_file");
    let (bytes, crc) = (
        want.and_then(|w| w.get("bytes")).and_then(|b| b.as_u64()),
        want.and_then(|w| w.get("crc32")).and_then(|c| c.as_u64()),
    );
    if bytes != Some(blob.len() as u64) || crc != Some(crc32fast::hash(&blob) as u64) {
        let said = match (bytes, crc) {
            (Some(b), Some(c)) => format!("{b} bytes with CRC32 {c:08x}"),
            _ => "nothing (no model_file entry)".into(),
        };
        return Err(ck(format!(
            "{}: file is corrupt: {} bytes with CRC32 {:08x}, {} says {said}",
            mpath.display(),
            blob.len(),
            crc32fast::hash(&blob),
            ckpt_state::MANIFEST_FILE,
        )));
    }
    drop(blob);
    let loaded = Qwen25VL::load(dir).map_err(|e| at(e.to_string()))?;
    Ok((completed, state, loaded))
}
