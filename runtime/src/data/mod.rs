//! Datasets of prompts with media and reference answers, their order, and their batches.
//!
//! What this module knows: the sample record ([`Sample`]), the file format that holds samples
//! ([`jsonl`]: one JSON object per line), and the order in which an RL loop draws them
//! ([`sampler`]: deterministic by seed and epoch, batches of `prompts_per_iter`). It does not
//! decode media (see [`crate::preprocess`]) nor know token ids.
//!
//! The file's extension picks its format: `.jsonl` (or `.ndjson`) is [`jsonl`], `.parquet` is
//! [`parquet`] (veRL's and EasyR1's layout, read directly; the `parquet` cargo feature, on by
//! default).
//!
//! Invariants: every sample has a non-empty unique `id`; media paths are absolute or resolved
//! against the directory of the file that names them, and exist when the dataset is loaded;
//! an error about a record names `file:line` (JSONL) or `file:row N` (Parquet) and the field.

pub mod jsonl;
#[cfg(feature = "parquet")]
pub mod parquet;
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
    #[error("{}: {msg}", unit.locate(path, *line))]
    Record {
        path: PathBuf,
        unit: RecordUnit,
        line: u64,
        msg: String,
    },
    #[error("{path}: id {id:?} is used by {unit} {first} and {unit} {second}")]
    DuplicateId {
        path: PathBuf,
        unit: RecordUnit,
        id: String,
        first: u64,
        second: u64,
    },
    #[error("{path}: dataset has no samples")]
    Empty { path: PathBuf },
    #[error("{path}: unknown dataset format (expected a .jsonl or .parquet file)")]
    Format { path: PathBuf },
    #[error("{path}: this rollplex-run was built without Parquet support (the `parquet` cargo feature); rebuild with it, or give a .jsonl dataset")]
    Parquet { path: PathBuf },
    #[error("batch of {batch} prompts needs at least {batch} samples, the dataset has {samples}")]
    TooSmall { batch: u64, samples: u64 },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// How a dataset file's records are numbered in messages: JSONL by line (from 1, as editors
/// count), Parquet by row (from 0, as pandas and pyarrow count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordUnit {
    Line,
    Row,
}

impl RecordUnit {
    /// Where record `n` of `path` is: `file:7` (a line) or `file:row 6` (a row).
    pub fn locate(self, path: &Path, n: u64) -> String {
        match self {
            RecordUnit::Line => format!("{}:{n}", path.display()),
            RecordUnit::Row => format!("{}:row {n}", path.display()),
        }
    }
}

impl std::fmt::Display for RecordUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RecordUnit::Line => "line",
            RecordUnit::Row => "row",
        })
    }
}

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
    /// The line (JSONL) or row (Parquet) of each sample in `path`, for messages.
    pub lines: Vec<u64>,
    /// Whether `lines` are lines or rows.
    pub unit: RecordUnit,
}

impl Dataset {
    /// Loads a dataset file, its format picked by its extension: `.jsonl` / `.ndjson` or
    /// `.parquet`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        let ((samples, lines), unit) = match ext.as_str() {
            "jsonl" | "ndjson" => (jsonl::load_with_lines(path)?, RecordUnit::Line),
            #[cfg(feature = "parquet")]
            "parquet" => (parquet::load_with_rows(path)?, RecordUnit::Row),
            #[cfg(not(feature = "parquet"))]
            "parquet" => return Err(DataError::Parquet { path: path.into() }),
            _ => return Err(DataError::Format { path: path.into() }),
        };
        Ok(Self {
            path: path.into(),
            samples,
            lines,
            unit,
        })
    }

    /// Where sample `i` is in the file, for messages: `file:line` or `file:row N`.
    pub fn at(&self, i: usize) -> String {
        self.unit
            .locate(&self.path, self.lines.get(i).copied().unwrap_or(0))
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Fills in `line<N>` / `row<N>` for samples without an id.
pub(crate) fn default_ids(samples: &mut [Sample], lines: &[u64], unit: RecordUnit) {
    for (s, &n) in samples.iter_mut().zip(lines) {
        if s.id.is_empty() {
            s.id = format!("{unit}{n}");
        }
    }
}

/// Checks ids are unique; `lines[i]` is the line (row) of sample `i` for the message.
pub(crate) fn check_unique_ids(
    path: &Path,
    samples: &[Sample],
    lines: &[u64],
    unit: RecordUnit,
) -> Result<()> {
    let mut seen: HashMap<&str, u64> = HashMap::with_capacity(samples.len());
    for (s, &line) in samples.iter().zip(lines) {
        if let Some(first) = seen.insert(&s.id, line) {
            return Err(DataError::DuplicateId {
                path: path.into(),
                unit,
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

/// [`resolve_media`], which must name an existing file (the error says which it looked for).
pub(crate) fn media_path(file: &Path, p: &str) -> std::result::Result<PathBuf, String> {
    let full = resolve_media(file, p);
    if full.is_file() {
        Ok(full)
    } else {
        Err(format!("no such file {}", full.display()))
    }
}
