//! Run state for resume: iteration, RNG and data cursor, optimizer tensors; atomic directories.
//!
//! A checkpoint is a directory. The model weights in it are written by the model's own
//! checkpoint code in Hugging Face layout (config.json + safetensors); this module writes
//! the rest:
//!
//! ```text
//! <dir>/run_state.json          manifest: format, version, iteration, seed, RNG words, data
//!                               cursor, optimizer step, extra values, the optimizer file's
//!                               size and CRC32, the size and CRC32 of every other file of the
//!                               directory (the model's), and `manifest_crc32`, its own CRC32
//! <dir>/optimizer.safetensors   optimizer tensors (AdamW m, v, fp32 master weights), f32
//! ```
//!
//! Writes are atomic ([`AtomicDir`]): everything goes into a sibling `<dir>.tmp-<unique>`,
//! files are fsynced, and the directory is renamed into place only when complete. A crash
//! leaves either the old checkpoint or the new one, plus at most a stray `.tmp-` directory
//! that [`latest_checkpoint`] ignores and the next [`AtomicDir::begin`] beside it removes.
//!
//! Invariants:
//! - `load_run_state(save_run_state(s)) == s` bit for bit (f32 tensors are stored as raw
//!   little-endian words, integers as JSON integers, f64 extras in shortest round-trip form),
//!   so a resumed run continues exactly like an uninterrupted one.
//! - A checkpoint is resumed as written or not at all: the manifest's CRC32 covers its
//!   canonical content (compact JSON of every field but the checksum, so formatting does not
//!   matter and any edited value does), and every file it lists is checked for size and CRC32.
//!   A mismatch is an error naming the file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::data::BatchCursor;

pub const MANIFEST_FILE: &str = "run_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const FORMAT: &str = "rollplex-run-state";
/// 2: the manifest carries its own checksum and every file's.
pub const RUN_STATE_VERSION: u32 = 2;

/// Errors of this module; each names the path involved.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    #[error("{path}: not a valid run state: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{path}: {msg}")]
    Damaged { path: PathBuf, msg: String },
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
    /// Size and CRC32 of every other file of the directory, by name.
    files: BTreeMap<String, FileCheck>,
    extra: BTreeMap<String, serde_json::Value>,
    /// CRC32 of the manifest's canonical form: [`Manifest::canonical_crc`]. Absent only while
    /// it is being computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    manifest_crc32: Option<u32>,
}

impl Manifest {
    /// CRC32 of the compact JSON of every field but `manifest_crc32` (in declaration order;
    /// maps are sorted): independent of how the file is formatted, sensitive to every value.
    fn canonical_crc(&mut self) -> u32 {
        let saved = self.manifest_crc32.take();
        let text = serde_json::to_string(self).expect("manifest serialises");
        self.manifest_crc32 = saved;
        crc32fast::hash(text.as_bytes())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
struct FileCheck {
    bytes: u64,
    crc32: u32,
}

/// Size and CRC32 of the regular file `path`, read in pieces (model files are large).
fn file_check(path: &Path) -> Result<FileCheck> {
    use std::io::Read;
    let (mut f, _) =
        rollplex_plan::files::open_regular(path, rollplex_plan::files::NO_CAP).map_err(io(path))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileCheck {
        bytes,
        crc32: hasher.finalize(),
    })
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

/// Removes the `.tmp-` and `.old-` directories (see [`sibling`]) in `parent` left by processes
/// that are gone (killed mid-save); a live process's, this one's included, are left alone.
/// Best effort: what cannot be removed stays, and [`latest_checkpoint`] ignores it.
fn remove_stale_siblings(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = [".tmp-", ".old-"].iter().find_map(|tag| {
            let (_, rest) = name.rsplit_once(tag)?;
            rest.split('-').next()?.parse::<u32>().ok()
        }) else {
            continue;
        };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !alive && entry.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
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
            remove_stale_siblings(parent);
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

/// Removes the checkpoint directory `dir` so that a kill midway leaves nothing that looks like
/// a checkpoint: it is first renamed to a `.old-` sibling (the name [`AtomicDir::commit`] gives
/// the checkpoint it replaces), which no listing of checkpoints reads and the next
/// [`AtomicDir::begin`] beside it removes once this process is gone; then that is removed.
pub fn remove_checkpoint(dir: &Path) -> Result<()> {
    let retired = retire(dir)?;
    std::fs::remove_dir_all(&retired).map_err(io(&retired))
}

/// The first step of [`remove_checkpoint`]: renames `dir` out of the checkpoints (durably) and
/// returns its new path.
fn retire(dir: &Path) -> Result<PathBuf> {
    let retired = sibling(dir, "old");
    std::fs::rename(dir, &retired).map_err(io(dir))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fsync_dir(parent)?;
    }
    Ok(retired)
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
    // Every other file already written (the model's weights and config): size and CRC32.
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == MANIFEST_FILE || name == OPTIMIZER_FILE || !entry.path().is_file() {
            continue;
        }
        files.insert(name, file_check(&entry.path())?);
    }
    let mut manifest = Manifest {
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
        files,
        extra: state.extra.clone(),
        manifest_crc32: None,
    };
    manifest.manifest_crc32 = Some(manifest.canonical_crc());
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
    let text = rollplex_plan::files::read_to_string(&path, rollplex_plan::files::TEXT_CAP)
        .map_err(io(&path))?;
    let bad = |msg: String| CkptError::Format {
        path: path.clone(),
        msg,
    };
    // Format and version first, so an older or foreign file gets that message.
    let head: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let format = head.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != FORMAT {
        return Err(bad(format!("format is {format:?}, expected {FORMAT:?}")));
    }
    let version = head.get("version").and_then(|v| v.as_u64());
    if version != Some(RUN_STATE_VERSION as u64) {
        return Err(bad(format!(
            "version {} is not supported (this build reads {RUN_STATE_VERSION})",
            version.map_or("missing".to_string(), |v| v.to_string())
        )));
    }
    let mut m: Manifest = serde_json::from_value(head).map_err(|e| bad(e.to_string()))?;
    let crc = m.canonical_crc();
    match m.manifest_crc32 {
        Some(saved) if saved == crc => {}
        Some(saved) => {
            return Err(bad(format!(
                "the file was changed after it was written: its content has CRC32 {crc:08x},                  its `manifest_crc32` says {saved:08x}; resume from an intact checkpoint"
            )))
        }
        None => return Err(bad("`manifest_crc32` is missing".into())),
    }
    for (name, want) in &m.files {
        if name.contains('/') || name == ".." {
            return Err(bad(format!(
                "file name {name:?} is not a name in the directory"
            )));
        }
        let p = dir.join(name);
        let got = file_check(&p)?;
        if got != *want {
            return Err(CkptError::Damaged {
                path: p,
                msg: format!(
                    "file is corrupt: {} bytes with CRC32 {:08x}, {MANIFEST_FILE} says {} bytes with {:08x}",
                    got.bytes, got.crc32, want.bytes, want.crc32
                ),
            });
        }
    }
    let opt_path = dir.join(&m.optimizer_file.name);
    if m.optimizer_file.name.contains('/') {
        return Err(bad(format!(
            "optimizer file name {:?} is not a name in the directory",
            m.optimizer_file.name
        )));
    }
    let blob = rollplex_plan::files::read(&opt_path, rollplex_plan::files::NO_CAP)
        .map_err(io(&opt_path))?;
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

    /// `run_state.json` of `p` with `from` replaced by `to` once.
    fn edit_manifest(p: &Path, from: &str, to: &str) {
        let path = p.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{from:?} not in {text}");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    }

    #[test]
    fn an_edited_manifest_or_any_changed_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let save = |name: &str| {
            let d = AtomicDir::begin(dir.path().join(name)).unwrap();
            std::fs::write(d.path().join("config.json"), b"{\"hidden_size\": 64}").unwrap();
            std::fs::write(d.path().join("model.safetensors"), vec![7u8; 5000]).unwrap();
            write_run_state(d.path(), &state()).unwrap();
            d.commit().unwrap()
        };
        // Formatting is not content: a re-indented manifest still loads.
        let p = save("fmt");
        let path = p.join(MANIFEST_FILE);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(load_run_state(&p).unwrap(), state());
        // One digit of a value, or two values changed together so that they still agree.
        for (from, to) in [
            ("\"optimizer_step\": 24", "\"optimizer_step\": 25"),
            ("\"iteration\": 12", "\"iteration\": 13"),
        ] {
            let p = save("digit");
            edit_manifest(&p, from, to);
            if from.contains("iteration") {
                edit_manifest(&p, "\"next_batch\": 12", "\"next_batch\": 13");
            }
            let e = load_run_state(&p).unwrap_err().to_string();
            assert!(
                e.contains("run_state.json") && e.contains("changed after it was written"),
                "{e}"
            );
        }
        // A checksum removed is refused too.
        let p = save("nocrc");
        let path = p.join(MANIFEST_FILE);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("manifest_crc32");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = load_run_state(&p).unwrap_err().to_string();
        assert!(e.contains("`manifest_crc32` is missing"), "{e}");
        // Every file the manifest lists: the model's config and weights.
        for (file, bytes) in [
            ("config.json", b"{\"hidden_size\": 65}".to_vec()),
            ("model.safetensors", vec![7u8; 4999]),
        ] {
            let p = save("files");
            std::fs::write(p.join(file), bytes).unwrap();
            let e = load_run_state(&p).unwrap_err().to_string();
            assert!(e.contains(file) && e.contains("corrupt"), "{e}");
        }
    }

    #[test]
    fn a_killed_save_leaves_nothing_after_the_next() {
        let dir = tempfile::tempdir().unwrap();
        // A process id that is not running: past the kernel's largest.
        let dead = dir.path().join("iter-00000003.tmp-4194305-1f-0");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("model.safetensors"), b"partial").unwrap();
        let mine = dir
            .path()
            .join(format!("iter-00000004.tmp-{}-2f-0", std::process::id()));
        std::fs::create_dir(&mine).unwrap();
        save_run_state(checkpoint_dir(dir.path(), 5), &state()).unwrap();
        assert!(!dead.exists(), "a dead process's temporary is removed");
        assert!(mine.exists(), "a live process's temporary is not");
    }

    #[test]
    fn a_killed_removal_leaves_no_checkpoint_and_is_cleaned_by_the_next_save() {
        let dir = tempfile::tempdir().unwrap();
        let one = save_run_state(checkpoint_dir(dir.path(), 1), &state()).unwrap();
        let two = save_run_state(checkpoint_dir(dir.path(), 2), &state()).unwrap();
        remove_checkpoint(&one).unwrap();
        assert!(!one.exists());
        // a removal killed after the rename: what stays is not a checkpoint ...
        let retired = retire(&two).unwrap();
        assert!(retired.join(MANIFEST_FILE).is_file());
        assert_eq!(latest_checkpoint(dir.path()).unwrap(), None);
        // ... and once the process that left it is gone, the next save removes it
        let name = retired.file_name().unwrap().to_str().unwrap();
        let dead = retired.with_file_name(
            name.replace(&format!(".old-{}-", std::process::id()), ".old-4194305-"),
        );
        assert_ne!(dead, retired);
        std::fs::rename(&retired, &dead).unwrap();
        save_run_state(checkpoint_dir(dir.path(), 3), &state()).unwrap();
        assert!(!dead.exists(), "the retired directory is removed");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["iter-00000003"]);
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
