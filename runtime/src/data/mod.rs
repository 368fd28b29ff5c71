//! Datasets of prompts with media and reference answers, their order, and their batches.
//!
//! What this module knows: the sample record ([`Sample`]), the file format that holds samples
//! ([`jsonl`]: one JSON object per line), and the order in which an RL loop draws them
//! ([`sampler`]: deterministic by seed and epoch, batches of `prompts_per_iter`). It does not
//! decode media (see [`crate::preprocess`]) nor know token ids.
//!
//! Parquet (veRL's layout) is read by converting it once with
//! `tests/reference/verl_parquet_to_jsonl.py` (pyarrow), not in Rust. Measured on this 2-core
//! machine: the `parquet` crate 60.1 with every default feature off except `snap` (no arrow,
//! no zstd/brotli/lz4) took 1 min 55 s of CPU and 12 min 40 s of wall time to build while the
//! other crates of the workspace were building, for a format whose veRL datasets carry
//! images as embedded bytes the converter can write out as files once. A `.parquet` path is
//! refused with a message that names the converter.
//!
//! Invariants: every sample has a non-empty unique `id`; media paths are absolute or resolved
//! against the directory of the file that names them, and exist when the dataset is loaded;
//! an error about a record names `file:line` (or `file:row`) and the field.

pub mod jsonl;
pub mod rng;
pub mod sampler;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use sampler::{BatchCursor, Sampler};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read dataset {path}: {msg}")]
    Read { path: PathBuf, msg: String },
    #[error("{path}:{line}: {msg}")]
    Record {
        path: PathBuf,
        line: u64,
        msg: String,
    },
    #[error("{path}: id {id:?} is used by line {first} and line {second}")]
    DuplicateId {
        path: PathBuf,
        id: String,
        first: u64,
        second: u64,
    },
    #[error("{path}: dataset has no samples")]
    Empty { path: PathBuf },
    #[error("{path}: unknown dataset format (expected a .jsonl file)")]
    Format { path: PathBuf },
    #[error("{path}: Parquet is not read directly; convert it once with `python3 tests/reference/verl_parquet_to_jsonl.py {path} OUT_DIR` and use OUT_DIR/<name>.jsonl")]
    Parquet { path: PathBuf },
    #[error("batch of {batch} prompts needs at least {batch} samples, the dataset has {samples}")]
    TooSmall { batch: u64, samples: u64 },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Where a media item's bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MediaSource {
    Path(PathBuf),
    /// Encoded image bytes (PNG/JPEG) held in memory (e.g. from a generator).
    Bytes(Arc<Vec<u8>>),
}

impl MediaSource {
    /// Decodes to RGB (alpha dropped, grey replicated, as PIL's `convert("RGB")`).
    pub fn load(&self) -> Result<crate::preprocess::RgbImage> {
        match self {
            MediaSource::Path(p) => {
                crate::preprocess::load_image(p).map_err(|e| DataError::Other(e.to_string()))
            }
            MediaSource::Bytes(b) => image::load_from_memory(b)
                .map(|i| i.to_rgb8())
                .map_err(|e| {
                    DataError::Other(format!(
                        "cannot decode embedded image ({} bytes): {e}",
                        b.len()
                    ))
                }),
        }
    }
}

/// A sample's media.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Media {
    #[default]
    None,
    /// Images, each its own media item.
    Images(Vec<MediaSource>),
    /// One video as its (already sampled) frames, in order.
    Video(Vec<MediaSource>),
}

impl Media {
    pub fn image_count(&self) -> usize {
        match self {
            Media::Images(v) => v.len(),
            _ => 0,
        }
    }

    pub fn video_count(&self) -> usize {
        matches!(self, Media::Video(_)) as usize
    }
}

/// One prompt of the dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub id: String,
    /// Optional system message (veRL datasets may carry one).
    pub system: Option<String>,
    /// The user turn; may hold `<image>` / `<video>` markers (see [`crate::chat::user_message`]).
    pub prompt: String,
    pub media: Media,
    /// The reference answer the reward compares with.
    pub answer: String,
}

impl Sample {
    /// The chat messages of this sample (system turn first when present).
    pub fn messages(&self) -> Result<Vec<crate::chat::Message>> {
        let mut m = Vec::new();
        if let Some(s) = &self.system {
            m.push(crate::chat::Message::text("system", s));
        }
        m.push(
            crate::chat::user_message(
                &self.prompt,
                self.media.image_count(),
                self.media.video_count(),
            )
            .map_err(|e| DataError::Other(format!("sample {}: {e}", self.id)))?,
        );
        Ok(m)
    }
}

/// A loaded dataset.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub path: PathBuf,
    pub samples: Vec<Sample>,
    /// The line (row) of each sample in `path`, for messages.
    pub lines: Vec<u64>,
}

impl Dataset {
    /// Loads a `.jsonl` file (a `.parquet` path gets an error naming the converter).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        let (samples, lines) = match ext.as_str() {
            "jsonl" | "ndjson" => jsonl::load_with_lines(path)?,
            "parquet" => return Err(DataError::Parquet { path: path.into() }),
            _ => return Err(DataError::Format { path: path.into() }),
        };
        Ok(Self {
            path: path.into(),
            samples,
            lines,
        })
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Checks ids are unique; `lines[i]` is the line (row) of sample `i` for the message.
pub(crate) fn check_unique_ids(path: &Path, samples: &[Sample], lines: &[u64]) -> Result<()> {
    let mut seen: HashMap<&str, u64> = HashMap::with_capacity(samples.len());
    for (s, &line) in samples.iter().zip(lines) {
        if let Some(first) = seen.insert(&s.id, line) {
            return Err(DataError::DuplicateId {
                path: path.into(),
                id: s.id.clone(),
                first,
                second: line,
            });
        }
    }
    if samples.is_empty() {
        return Err(DataError::Empty { path: path.into() });
    }
    Ok(())
}

/// Resolves a media path named in `file` (relative paths are relative to the file's directory).
pub(crate) fn resolve_media(file: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.into()
    } else {
        file.parent().unwrap_or(Path::new(".")).join(p)
    }
}
