//! Run state for resume: iteration, RNG and data cursor, optimizer tensors; atomic directories.
//!
//! A checkpoint is a directory. The model weights in it are written by the model's own
//! checkpoint code in Hugging Face layout (config.json + safetensors); this module writes
//! the rest:
//!
//! ```text
//! <dir>/run_state.json          manifest: format, version, iteration, seed, RNG words, data
//!                               cursor, optimizer step, extra values, and the optimizer file's
//!                               size and CRC32
//! <dir>/optimizer.safetensors   optimizer tensors (AdamW m, v, fp32 master weights), f32
//! ```
//!
//! Writes are atomic ([`AtomicDir`]): everything goes into a sibling `<dir>.tmp-<unique>`,
//! files are fsynced, and the directory is renamed into place only when complete. A crash
//! leaves either the old checkpoint or the new one, plus at most a stray `.tmp-` directory
//! that [`latest_checkpoint`] ignores.
//!
//! Invariant: `load_run_state(save_run_state(s)) == s` bit for bit (f32 tensors are stored as
//! raw little-endian words, integers as JSON integers, f64 extras in shortest round-trip form),
//! so a resumed run continues exactly like an uninterrupted one.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::data::BatchCursor;

pub const MANIFEST_FILE: &str = "run_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const FORMAT: &str = "rollplex-run-state";
pub const RUN_STATE_VERSION: u32 = 1;

/// Errors of this module; each names the path involved.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    #[error("{path}: not a valid run state: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("optimizer tensor {name:?}: shape {shape:?} has {want} elements but {got} values were given")]
    Shape {
        name: String,
        shape: Vec<usize>,
        want: usize,
        got: usize,
    },
}

pub type Result<T, E = CkptError> = std::result::Result<T, E>;

fn io(path: &Path) -> impl Fn(std::io::Error) -> CkptError + '_ {
    move |e| CkptError::Io {
        path: path.into(),
        msg: e.to_string(),
    }
}

/// An f32 tensor: row-major values and their shape.
#[derive(Clone, Debug, Default)]
pub struct Tensor32 {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl PartialEq for Tensor32 {
    /// Bitwise: NaN payloads and the sign of zero count.
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape
            && self.data.len() == other.data.len()
            && self
                .data
                .iter()
                .zip(&other.data)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

/// Everything besides the model weights that a bitwise-identical resume needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunState {
    /// Iterations completed; the resumed run starts with this iteration.
    pub iteration: u64,
    /// The job seed (checked on resume: a different seed would not continue the same run).
    pub seed: u64,
    /// RNG words: the state of any sequential generator the loop keeps. A counter-based
    /// sampler keyed by (seed, iteration, sample, step) needs none.
    pub rng: Vec<u64>,
    /// The next data batch.
    pub data: BatchCursor,
    /// Optimizer steps taken (AdamW's bias-correction step count).
    pub optimizer_step: u64,
    /// Optimizer tensors by name (e.g. `exp_avg.model.layers.0.mlp.up_proj.weight`).
    pub optimizer: BTreeMap<String, Tensor32>,
    /// Other values to carry over (plan checksum, learning-rate schedule state, ...).
    pub extra: BTreeMap<String, serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    iteration: u64,
    seed: u64,
    rng: Vec<u64>,
    data: BatchCursor,
    optimizer_step: u64,
    optimizer_file: FileSum,
    extra: BTreeMap<String, serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
struct FileSum {
    name: String,
    bytes: u64,
    crc32: u32,
    tensors: usize,
}

/// A directory written under a temporary name and renamed into place by [`commit`](Self::commit).
/// Dropped without commit, the temporary directory is removed.
#[derive(Debug)]
pub struct AtomicDir {
    target: PathBuf,
    tmp: PathBuf,
    committed: bool,
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

fn sibling(target: &Path, tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
    let name = target
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!("{name}.{tag}-{}-{nanos:x}-{n}", std::process::id()))
}

fn fsync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

impl AtomicDir {
    /// Starts writing `target` (its parent is created if missing).
    pub fn begin(target: impl AsRef<Path>) -> Result<Self> {
        let target = target.as_ref().to_path_buf();
        if target.file_name().is_none() {
            return Err(CkptError::Io {
                path: target,
                msg: "needs a directory name".into(),
            });
        }
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let tmp = sibling(&target, "tmp");
        std::fs::create_dir(&tmp).map_err(io(&tmp))?;
        Ok(Self {
            target,
            tmp,
            committed: false,
        })
    }

    /// Where to write the files now.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// The final path.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Fsyncs every file, then renames the directory into place, replacing an existing one.
    pub fn commit(mut self) -> Result<PathBuf> {
        for entry in std::fs::read_dir(&self.tmp).map_err(io(&self.tmp))? {
            let p = entry.map_err(io(&self.tmp))?.path();
            if p.is_file() {
                std::fs::File::open(&p)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&p))?;
            }
        }
        fsync_dir(&self.tmp)?;
        let old = if self.target.exists() {
            // A directory cannot be renamed over a non-empty one: move the old one aside first.
            let old = sibling(&self.target, "old");
            std::fs::rename(&self.target, &old).map_err(io(&self.target))?;
            Some(old)
        } else {
            None
        };
        std::fs::rename(&self.tmp, &self.target).map_err(io(&self.target))?;
        self.committed = true;
        if let Some(parent) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            fsync_dir(parent)?;
        }
        if let Some(old) = old {
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        Ok(self.target.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Writes `state` into an existing directory (e.g. an [`AtomicDir::path`] that the model's
/// weights are also written into).
pub fn write_run_state(dir: &Path, state: &RunState) -> Result<()> {
    for (name, t) in &state.optimizer {
        let want: usize = t.shape.iter().product();
        if want != t.data.len() {
            return Err(CkptError::Shape {
                name: name.clone(),
                shape: t.shape.clone(),
                want,
                got: t.data.len(),
            });
        }
    }
    let bytes: Vec<(&String, Vec<u8>)> = state
        .optimizer
        .iter()
        .map(|(n, t)| (n, t.data.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .zip(state.optimizer.values())
        .map(|((n, b), t)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.shape.clone(), b)
                .map(|v| (n.as_str(), v))
                .map_err(|e| CkptError::Format {
                    path: dir.join(OPTIMIZER_FILE),
                    msg: format!("tensor {n:?}: {e}"),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let blob = safetensors::serialize(views, None).map_err(|e| CkptError::Format {
        path: opt_path.clone(),
        msg: e.to_string(),
    })?;
    std::fs::write(&opt_path, &blob).map_err(io(&opt_path))?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: RUN_STATE_VERSION,
        iteration: state.iteration,
        seed: state.seed,
        rng: state.rng.clone(),
        data: state.data,
        optimizer_step: state.optimizer_step,
        optimizer_file: FileSum {
            name: OPTIMIZER_FILE.into(),
            bytes: blob.len() as u64,
            crc32: crc32fast::hash(&blob),
            tensors: state.optimizer.len(),
        },
        extra: state.extra.clone(),
    };
    let path = dir.join(MANIFEST_FILE);
    let mut f = std::fs::File::create(&path).map_err(io(&path))?;
    let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    f.write_all(text.as_bytes())
        .and_then(|_| f.write_all(b"\n"))
        .map_err(io(&path))
}

/// Saves `state` as the directory `dir`, atomically.
pub fn save_run_state(dir: impl AsRef<Path>, state: &RunState) -> Result<PathBuf> {
    let d = AtomicDir::begin(dir)?;
    write_run_state(d.path(), state)?;
    d.commit()
}

/// Loads the run state of checkpoint directory `dir`, checking format, version and the
/// optimizer file's size and checksum.
pub fn load_run_state(dir: impl AsRef<Path>) -> Result<RunState> {
    let dir = dir.as_ref();
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let bad = |msg: String| CkptError::Format {
        path: path.clone(),
        msg,
    };
    let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if m.format != FORMAT {
        return Err(bad(format!(
            "format is {:?}, expected {FORMAT:?}",
            m.format
        )));
    }
    if m.version != RUN_STATE_VERSION {
        return Err(bad(format!(
            "version {} is not supported (this build reads {RUN_STATE_VERSION})",
            m.version
        )));
    }
    let opt_path = dir.join(&m.optimizer_file.name);
    let blob = std::fs::read(&opt_path).map_err(io(&opt_path))?;
    let obad = |msg: String| CkptError::Format {
        path: opt_path.clone(),
        msg,
    };
    if blob.len() as u64 != m.optimizer_file.bytes
        || crc32fast::hash(&blob) != m.optimizer_file.crc32
    {
        return Err(obad(format!(
            "file is corrupt: {} bytes with CRC32 {:08x}, the manifest says {} bytes with {:08x}",
            blob.len(),
            crc32fast::hash(&blob),
            m.optimizer_file.bytes,
            m.optimizer_file.crc32
        )));
    }
    let st = safetensors::SafeTensors::deserialize(&blob).map_err(|e| obad(e.to_string()))?;
    let mut optimizer = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(obad(format!(
                "tensor {name:?} is {:?}, expected F32",
                view.dtype()
            )));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        optimizer.insert(
            name,
            Tensor32 {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    if optimizer.len() != m.optimizer_file.tensors {
        return Err(obad(format!(
            "holds {} tensors, the manifest says {}",
            optimizer.len(),
            m.optimizer_file.tensors
        )));
    }
    Ok(RunState {
        iteration: m.iteration,
        seed: m.seed,
        rng: m.rng,
        data: m.data,
        optimizer_step: m.optimizer_step,
        optimizer,
        extra: m.extra,
    })
}

/// `<root>/iter-<iteration, 8 digits>`: where the loop saves the checkpoint after `iteration`
/// iterations.
pub fn checkpoint_dir(root: impl AsRef<Path>, iteration: u64) -> PathBuf {
    root.as_ref().join(format!("iter-{iteration:08}"))
}

/// The complete checkpoint of `root` with the most iterations (`iter-N` directories holding a
/// manifest; temporary and partial directories are ignored), or `None`.
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Result<Option<(u64, PathBuf)>> {
    let root = root.as_ref();
    if !root.exists() {
        return Ok(None);
    }
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let p = entry.map_err(io(root))?.path();
        let Some(n) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("iter-"))
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if p.join(MANIFEST_FILE).is_file() && best.as_ref().is_none_or(|(b, _)| n > *b) {
            best = Some((n, p));
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> RunState {
        let mut s = RunState {
            iteration: 12,
            seed: u64::MAX - 3,
            rng: vec![1, u64::MAX, 0x1234_5678_9abc_def0],
            data: BatchCursor { next_batch: 12 },
            optimizer_step: 24,
            ..Default::default()
        };
        let odd = vec![
            0.0,
            -0.0,
            f32::MIN_POSITIVE / 3.0,
            f32::from_bits(0x7fc0_1234),
            1.0e-30,
            -7.25,
            f32::INFINITY,
        ];
        s.optimizer.insert(
            "exp_avg.w".into(),
            Tensor32 {
                shape: vec![7],
                data: odd,
            },
        );
        s.optimizer.insert(
            "exp_avg_sq.w".into(),
            Tensor32 {
                shape: vec![2, 3],
                data: (0..6).map(|i| i as f32 / 7.0).collect(),
            },
        );
        s.optimizer.insert(
            "scalar".into(),
            Tensor32 {
                shape: vec![],
                data: vec![0.1],
            },
        );
        s.extra
            .insert("lr".into(), serde_json::json!(3.0e-6_f64 / 7.0));
        s.extra
            .insert("plan_crc".into(), serde_json::json!(0xdead_beef_u32));
        s
    }

    #[test]
    fn round_trip_is_bitwise() {
        let dir = tempfile::tempdir().unwrap();
        let s = state();
        let path = save_run_state(dir.path().join("ck/iter-00000012"), &s).unwrap();
        let back = load_run_state(&path).unwrap();
        assert_eq!(back, s);
        assert_eq!(
            back.extra["lr"].as_f64().unwrap().to_bits(),
            (3.0e-6_f64 / 7.0).to_bits()
        );
        // No temporary directory is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("ck"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("iter-00000012")]);
    }

    #[test]
    fn saving_again_replaces_atomically_and_drop_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("iter-00000001");
        let mut s = state();
        save_run_state(&target, &s).unwrap();
        s.iteration = 13;
        s.optimizer.clear();
        save_run_state(&target, &s).unwrap();
        assert_eq!(load_run_state(&target).unwrap(), s);
        {
            let d = AtomicDir::begin(dir.path().join("iter-00000002")).unwrap();
            std::fs::write(d.path().join("model.safetensors"), b"partial").unwrap();
            // dropped without commit: as if the process died before renaming
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(latest_checkpoint(dir.path()).unwrap().unwrap().0, 1);
    }

    #[test]
    fn latest_ignores_partial_and_temporary_directories() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(latest_checkpoint(dir.path().join("none")).unwrap(), None);
        for i in [2, 10, 9] {
            save_run_state(
                checkpoint_dir(dir.path(), i),
                &RunState {
                    iteration: i,
                    ..Default::default()
                },
            )
            .unwrap();
        }
        std::fs::create_dir(dir.path().join("iter-00000011")).unwrap(); // no manifest
        std::fs::create_dir(dir.path().join("iter-00000012.tmp-1-2-3")).unwrap();
        let (n, p) = latest_checkpoint(dir.path()).unwrap().unwrap();
        assert_eq!((n, p), (10, checkpoint_dir(dir.path(), 10)));
    }

    #[test]
    fn corruption_and_bad_input_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = save_run_state(dir.path().join("c"), &state()).unwrap();
        let opt = p.join(OPTIMIZER_FILE);
        let mut b = std::fs::read(&opt).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&opt, &b).unwrap();
        let e = load_run_state(&p).unwrap_err().to_string();
        assert!(
            e.contains("optimizer.safetensors") && e.contains("corrupt"),
            "{e}"
        );
        let e = load_run_state(dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing/run_state.json"), "{e}");
        std::fs::write(p.join(MANIFEST_FILE), r#"{"format": "other"}"#).unwrap();
        let e = load_run_state(&p).unwrap_err().to_string();
        assert!(
            e.contains("run_state.json") && e.contains("not a valid run state"),
            "{e}"
        );
        let mut s = state();
        s.optimizer.insert(
            "bad".into(),
            Tensor32 {
                shape: vec![2, 2],
                data: vec![1.0],
            },
        );
        let e = save_run_state(dir.path().join("d"), &s)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"bad\"") && e.contains("4 elements but 1"),
            "{e}"
        );
        assert!(!dir.path().join("d").exists());
    }
}
