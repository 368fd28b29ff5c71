//! Parquet datasets as veRL and EasyR1 write them, read row by row (the `parquet` crate's record
//! API: no arrow).
//!
//! Columns (others are ignored):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `prompt` | list of `{role, content}` structs (veRL), or a string | the user turn: the last `user` message; the first `system` message becomes the system turn |
//! | `problem` | string (EasyR1) | the user turn, when there is no `prompt` column |
//! | `answer` | string or number | the reference answer |
//! | `reward_model` | struct with `ground_truth` (string or number; veRL) | the reference answer, when there is no `answer` column |
//! | `images` | list of `{bytes, path}` structs (as Hugging Face `datasets` stores images), or of path strings | one media item each: the embedded bytes (PNG/JPEG), else the path |
//! | `videos` | list of one video: its frame paths (a list of strings, or a `{video: [...]}` struct) | one video's already-sampled frames |
//! | `id` | string or integer | the sample id; else veRL's `extra_info.index`; else `row<N>` |
//!
//! Rows are numbered from 0, as pandas and pyarrow number them, and an error about a row names
//! `file:row N`, the column and what was expected. Paths are relative to the Parquet file's
//! directory unless absolute, and must exist when the dataset is loaded; embedded image bytes
//! must be a PNG or JPEG whose header decodes (the pixels are decoded when the sample is drawn).
//! The file is read through the bounded reader (`rollplex_plan::files`: a regular file, never a
//! FIFO), and one value (a string, an image) holds at most [`rollplex_plan::files::LINE_CAP`]
//! bytes, as a JSONL line does.

use std::path::Path;
use std::sync::Arc;

use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::{Field, Row};

use super::{
    check_unique_ids, default_ids, media_path, DataError, Media, MediaSource, RecordUnit, Result,
    Sample,
};

/// Reads every sample of `path`, with the row (from 0) of each.
pub fn load_with_rows(path: &Path) -> Result<(Vec<Sample>, Vec<u64>)> {
    use rollplex_plan::files;
    let read_err = |msg: String| DataError::Read {
        path: path.into(),
        msg,
    };
    let (file, _) =
        files::open_regular(path, files::NO_CAP).map_err(|e| read_err(e.to_string()))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| read_err(format!("not a readable Parquet file: {e}")))?;
    let columns = Columns::of(path, &reader)?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| read_err(format!("cannot read its rows: {e}")))?;
    let mut samples = Vec::new();
    let mut numbers = Vec::new();
    for (n, row) in rows.enumerate() {
        let n = n as u64;
        let row =
            row.map_err(|e| read_err(format!("row {n}: cannot read: {e}{}", codec_hint(&e))))?;
        let sample = parse_row(path, &columns, row).map_err(|msg| DataError::Record {
            path: path.into(),
            unit: RecordUnit::Row,
            line: n,
            msg,
        })?;
        samples.push(sample);
        numbers.push(n);
    }
    default_ids(&mut samples, &numbers, RecordUnit::Row);
    check_unique_ids(path, &samples, &numbers, RecordUnit::Row)?;
    Ok((samples, numbers))
}

/// What to do about a column compressed with a codec this build does not read.
fn codec_hint(e: &::parquet::errors::ParquetError) -> &'static str {
    if e.to_string().contains("Disabled feature") {
        " (this build reads snappy, gzip and uncompressed columns: rewrite the file with one of \
         them, e.g. pyarrow's `pq.write_table(table, path, compression=\"snappy\")`)"
    } else {
        ""
    }
}

/// Which columns hold the prompt and the answer (checked on the schema before any row is read).
struct Columns {
    /// `prompt` (veRL) or `problem` (EasyR1).
    prompt: &'static str,
    /// `answer`, or veRL's `reward_model` (its `ground_truth` field).
    answer: &'static str,
}

impl Columns {
    fn of(path: &Path, reader: &SerializedFileReader<std::fs::File>) -> Result<Self> {
        let schema = reader.metadata().file_metadata().schema_descr();
        let names: Vec<&str> = schema
            .root_schema()
            .get_fields()
            .iter()
            .map(|f| f.name())
            .collect();
        let has = |n: &str| names.contains(&n);
        let missing = |what: &str| DataError::Read {
            path: path.into(),
            msg: format!(
                "{what}; the file's columns are: {}",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ),
        };
        let prompt = match (has("prompt"), has("problem")) {
            (true, _) => "prompt",
            (false, true) => "problem",
            _ => {
                return Err(missing(
                    "column `prompt` is missing (expected veRL's `prompt`: a list of {role, content} messages, or EasyR1's `problem`: a string)",
                ))
            }
        };
        let answer = match (has("answer"), has("reward_model")) {
            (true, _) => "answer",
            (false, true) => "reward_model",
            _ => {
                return Err(missing(
                    "column `answer` is missing (expected `answer`: a string or a number, or veRL's `reward_model` struct with `ground_truth`)",
                ))
            }
        };
        Ok(Columns { prompt, answer })
    }
}

/// What a value is, for messages.
fn kind(f: &Field) -> &'static str {
    match f {
        Field::Null => "null",
        Field::Bool(_) => "a boolean",
        Field::Byte(_)
        | Field::Short(_)
        | Field::Int(_)
        | Field::Long(_)
        | Field::UByte(_)
        | Field::UShort(_)
        | Field::UInt(_)
        | Field::ULong(_) => "an integer",
        Field::Float(_) | Field::Double(_) | Field::Float16(_) | Field::Decimal(_) => "a number",
        Field::Str(_) => "a string",
        Field::Bytes(_) => "binary data",
        Field::Group(_) => "a struct",
        Field::ListInternal(_) => "a list",
        Field::MapInternal(_) => "a map",
        _ => "a date or time",
    }
}

/// A string value of at most `LINE_CAP` bytes (binary data that is UTF-8 is taken too: some
/// writers leave strings unannotated).
fn string(col: &str, f: &Field) -> std::result::Result<String, String> {
    let s = match f {
        Field::Str(s) => s.clone(),
        Field::Bytes(b) => std::str::from_utf8(b.data())
            .map_err(|_| {
                format!("column `{col}`: expected a string, got binary data that is not UTF-8")
            })?
            .to_string(),
        other => {
            return Err(format!(
                "column `{col}`: expected a string, got {}",
                kind(other)
            ))
        }
    };
    capped(col, s.len())?;
    Ok(s)
}

fn capped(col: &str, len: usize) -> std::result::Result<(), String> {
    let cap = rollplex_plan::files::LINE_CAP;
    if len > cap {
        return Err(format!(
            "column `{col}`: a value of {} is over the cap of {} for one value",
            rollplex_plan::files::human_bytes(len as u64),
            rollplex_plan::files::human_bytes(cap as u64)
        ));
    }
    Ok(())
}

/// A struct's field `name` (`None` when absent or null).
fn member<'a>(row: &'a Row, name: &str) -> Option<&'a Field> {
    row.get_column_iter()
        .find(|(n, _)| n.as_str() == name)
        .map(|(_, f)| f)
        .filter(|f| !matches!(f, Field::Null))
}

/// A list's elements (`None` for null).
fn list<'a>(col: &str, f: &'a Field) -> std::result::Result<Option<&'a [Field]>, String> {
    match f {
        Field::Null => Ok(None),
        Field::ListInternal(l) => Ok(Some(l.elements())),
        other => Err(format!(
            "column `{col}`: expected a list, got {}",
            kind(other)
        )),
    }
}

/// An answer: a string, or a number written as text.
fn answer_text(col: &str, f: &Field) -> std::result::Result<String, String> {
    Ok(match f {
        Field::Str(_) | Field::Bytes(_) => string(col, f)?,
        Field::Byte(_)
        | Field::Short(_)
        | Field::Int(_)
        | Field::Long(_)
        | Field::UByte(_)
        | Field::UShort(_)
        | Field::UInt(_)
        | Field::ULong(_)
        | Field::Float(_)
        | Field::Double(_)
        | Field::Decimal(_) => f.to_string(),
        Field::Null => {
            return Err(format!(
                "column `{col}` is null (expected the reference answer)"
            ))
        }
        other => {
            return Err(format!(
                "column `{col}`: expected a string or a number, got {}",
                kind(other)
            ))
        }
    })
}

/// The user turn and the system turn of a `prompt` value: a string, or veRL's message list.
fn prompt_of(col: &str, f: &Field) -> std::result::Result<(String, Option<String>), String> {
    let Some(messages) = list(col, f).or_else(|e| match f {
        Field::Str(_) | Field::Bytes(_) => Ok(None),
        _ => Err(e),
    })?
    else {
        return match f {
            Field::Null => Err(format!("column `{col}` is null (expected the prompt)")),
            _ => Ok((string(col, f)?, None)),
        };
    };
    let (mut user, mut system) = (None, None);
    for (i, m) in messages.iter().enumerate() {
        let at = format!("{col}[{i}]");
        let Field::Group(m) = m else {
            return Err(format!(
                "column `{at}`: expected a {{role, content}} message, got {}",
                kind(m)
            ));
        };
        let field = |name: &str| -> std::result::Result<String, String> {
            let v = member(m, name).ok_or_else(|| format!("column `{at}.{name}` is missing"))?;
            string(&format!("{at}.{name}"), v)
        };
        match field("role")?.as_str() {
            "user" => user = Some(field("content")?),
            "system" if system.is_none() => system = Some(field("content")?),
            _ => {}
        }
    }
    let user = user.ok_or_else(|| format!("column `{col}`: no message has role `user`"))?;
    Ok((user, system))
}

/// An image: embedded bytes (whose header must decode) or a path that exists.
fn image_of(path: &Path, col: &str, f: &Field) -> std::result::Result<MediaSource, String> {
    let (bytes, file) = match f {
        Field::Group(r) => (member(r, "bytes"), member(r, "path")),
        Field::Str(_) => (None, Some(f)),
        other => {
            return Err(format!(
                "column `{col}`: expected a {{bytes, path}} struct or a path string, got {}",
                kind(other)
            ))
        }
    };
    match (bytes, file) {
        (Some(Field::Bytes(b)), _) if !b.data().is_empty() => {
            capped(col, b.data().len())?;
            check_image_header(b.data())
                .map_err(|e| format!("column `{col}.bytes`: not a decodable image: {e}"))?;
            Ok(MediaSource::Bytes(Arc::new(b.data().to_vec())))
        }
        (Some(other @ Field::Str(_)), _) | (Some(other @ Field::Group(_)), _) => Err(format!(
            "column `{col}.bytes`: expected binary data, got {}",
            kind(other)
        )),
        (_, Some(p)) => {
            let p = string(&format!("{col}.path"), p)?;
            media_path(path, &p)
                .map(MediaSource::Path)
                .map_err(|e| format!("column `{col}`: {e}"))
        }
        _ => Err(format!("column `{col}`: neither `bytes` nor `path` is set")),
    }
}

/// Whether `bytes` are a PNG or JPEG whose header (format and size) decodes.
fn check_image_header(bytes: &[u8]) -> std::result::Result<(), String> {
    image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())?
        .into_dimensions()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The frames of the one video of a `videos` value.
fn video_of(
    path: &Path,
    col: &str,
    videos: &[Field],
) -> std::result::Result<Vec<MediaSource>, String> {
    if videos.len() != 1 {
        return Err(format!(
            "column `{col}`: {} videos, a sample holds one",
            videos.len()
        ));
    }
    let at = format!("{col}[0]");
    let frames = match &videos[0] {
        Field::Group(r) => {
            member(r, "video").ok_or_else(|| format!("column `{at}.video` is missing"))?
        }
        f => f,
    };
    let frames = match frames {
        Field::ListInternal(l) => l.elements(),
        Field::Str(p) => {
            return Err(format!(
            "column `{at}` is a video file ({p}); give its sampled frames as a list of image paths"
        ))
        }
        other => {
            return Err(format!(
                "column `{at}`: expected a list of frame paths, got {}",
                kind(other)
            ))
        }
    };
    if frames.is_empty() {
        return Err(format!(
            "column `{at}` is an empty list; a video needs at least one frame"
        ));
    }
    frames
        .iter()
        .enumerate()
        .map(|(k, f)| {
            let col = format!("{at}[{k}]");
            let p = string(&col, f)?;
            media_path(path, &p)
                .map(MediaSource::Path)
                .map_err(|e| format!("column `{col}`: {e}"))
        })
        .collect()
}

/// One row; the error is a message naming the column and what was expected.
fn parse_row(path: &Path, cols: &Columns, row: Row) -> std::result::Result<Sample, String> {
    let get = |name: &str| member(&row, name);
    let (prompt, system) = match get(cols.prompt) {
        Some(f) => prompt_of(cols.prompt, f)?,
        None => {
            return Err(format!(
                "column `{}` is null (expected the prompt)",
                cols.prompt
            ))
        }
    };
    let answer = match (cols.answer, get(cols.answer)) {
        ("reward_model", Some(Field::Group(rm))) => {
            let gt = member(rm, "ground_truth")
                .ok_or("column `reward_model.ground_truth` is missing or null")?;
            answer_text("reward_model.ground_truth", gt)?
        }
        ("reward_model", Some(other)) => {
            return Err(format!(
                "column `reward_model`: expected a struct with `ground_truth`, got {}",
                kind(other)
            ))
        }
        (col, Some(f)) => answer_text(col, f)?,
        (col, None) => {
            return Err(format!(
                "column `{col}` is null (expected the reference answer)"
            ))
        }
    };
    let id = match get("id") {
        Some(f @ (Field::Str(_) | Field::Bytes(_))) => string("id", f)?,
        Some(Field::Long(n)) => n.to_string(),
        Some(Field::Int(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "column `id`: expected a string or an integer, got {}",
                kind(other)
            ))
        }
        None => match get("extra_info") {
            Some(Field::Group(e)) => match member(e, "index") {
                Some(Field::Long(n)) => n.to_string(),
                Some(Field::Int(n)) => n.to_string(),
                Some(f @ (Field::Str(_) | Field::Bytes(_))) => string("extra_info.index", f)?,
                _ => String::new(),
            },
            _ => String::new(),
        },
    };
    let images = match get("images") {
        Some(f) => list("images", f)?
            .unwrap_or(&[])
            .iter()
            .enumerate()
            .map(|(k, im)| image_of(path, &format!("images[{k}]"), im))
            .collect::<std::result::Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    let video = match get("videos")
        .map(|f| list("videos", f))
        .transpose()?
        .flatten()
    {
        Some(v) if !v.is_empty() => Some(video_of(path, "videos", v)?),
        _ => None,
    };
    let media = match (images.is_empty(), video) {
        (false, Some(_)) => {
            return Err(
                "columns `images` and `videos` are both set; a sample has images or one video"
                    .into(),
            )
        }
        (_, Some(v)) => Media::Video(v),
        (false, None) => Media::Images(images),
        (true, None) => Media::None,
    };
    Ok(Sample {
        id,
        system,
        prompt,
        media,
        answer,
    })
}
