//! JSONL datasets: one JSON object per line.
//!
//! ```text
//! {"id": "train-17", "prompt": "Which way did the red square move? ...", "video": ["f0.png", "f1.png"], "answer": "B"}
//! {"id": 3, "prompt": "<image> What colour is the shape?", "images": ["img/3.png"], "answer": "red"}
//! ```
//!
//! Fields: `prompt` (string, required), `answer` (string or number, required), `id` (string or
//! integer; defaults to `line<N>`), `images` (list of paths) or `video` (list of frame paths,
//! at least one; not both), `system` (string, optional). Other fields are ignored. Blank lines
//! are skipped. Paths are relative to the JSONL file's directory unless absolute; every media
//! file must exist.

use std::io::BufReader;
use std::path::Path;

use serde_json::Value;

use super::{
    check_unique_ids, default_ids, media_path, DataError, Media, MediaSource, RecordUnit, Result,
    Sample,
};

/// Reads every sample of `path`: a regular file, read a line at a time, each line at most
/// [`rollplex_plan::files::LINE_CAP`] bytes.
pub fn load(path: &Path) -> Result<Vec<Sample>> {
    load_with_lines(path).map(|(samples, _)| samples)
}

/// [`load`], with the line of each sample (for messages about a record found later).
pub fn load_with_lines(path: &Path) -> Result<(Vec<Sample>, Vec<u64>)> {
    use rollplex_plan::files;
    let (file, _) = files::open_regular(path, files::NO_CAP).map_err(|e| DataError::Read {
        path: path.into(),
        msg: e.to_string(),
    })?;
    let mut samples = Vec::new();
    let mut lines = Vec::new();
    let mut reader = BufReader::new(file);
    for n in 1u64.. {
        let line =
            files::read_line_capped(&mut reader, files::LINE_CAP).map_err(|e| DataError::Read {
                path: path.into(),
                msg: format!("line {n}: {e}"),
            })?;
        let Some(line) = line else { break };
        if line.trim().is_empty() {
            continue;
        }
        let rec = |msg: String| DataError::Record {
            path: path.into(),
            unit: RecordUnit::Line,
            line: n,
            msg,
        };
        let v: Value =
            serde_json::from_str(&line).map_err(|e| rec(format!("not valid JSON: {e}")))?;
        samples.push(parse_record(path, &v).map_err(rec)?);
        lines.push(n);
    }
    default_ids(&mut samples, &lines, RecordUnit::Line);
    check_unique_ids(path, &samples, &lines, RecordUnit::Line)?;
    Ok((samples, lines))
}

/// One record; the error is a message naming the field.
pub(crate) fn parse_record(path: &Path, v: &Value) -> std::result::Result<Sample, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("expected a JSON object, got {}", kind(v)))?;
    let string = |key: &str| -> std::result::Result<Option<String>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!(
                "field `{key}` must be a string, got {}",
                kind(other)
            )),
        }
    };
    let prompt = string("prompt")?.ok_or("field `prompt` is missing")?;
    let answer = match obj.get("answer") {
        None | Some(Value::Null) => return Err("field `answer` is missing".into()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "field `answer` must be a string or a number, got {}",
                kind(other)
            ))
        }
    };
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(n.to_string()),
        Some(other) => {
            return Err(format!(
                "field `id` must be a non-empty string or an integer, got {other}"
            ))
        }
    };
    let system = string("system")?;
    let paths = |key: &str| -> std::result::Result<Option<Vec<MediaSource>>, String> {
        let Some(v) = obj.get(key).filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let list = v
            .as_array()
            .ok_or_else(|| format!("field `{key}` must be a list of paths, got {}", kind(v)))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, p) in list.iter().enumerate() {
            let p = p.as_str().ok_or_else(|| {
                format!("field `{key}`[{i}] must be a path string, got {}", kind(p))
            })?;
            let full = media_path(path, p).map_err(|e| format!("field `{key}`[{i}]: {e}"))?;
            out.push(MediaSource::Path(full));
        }
        Ok(Some(out))
    };
    let media = match (paths("images")?, paths("video")?) {
        (Some(i), Some(v)) if !i.is_empty() && !v.is_empty() => {
            return Err(
                "fields `images` and `video` are both set; a sample has images or one video".into(),
            )
        }
        (_, Some(v)) if !v.is_empty() => Media::Video(v),
        (_, Some(_)) => {
            return Err("field `video` is an empty list; a video needs at least one frame".into())
        }
        (Some(i), _) if !i.is_empty() => Media::Images(i),
        _ => Media::None,
    };
    Ok(Sample {
        id: id.unwrap_or_default(),
        system,
        prompt,
        media,
        answer,
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Writes samples as JSONL (media paths as given, made relative to `path`'s directory when
/// they are inside it). Embedded media bytes cannot be written.
pub fn write(path: &Path, samples: &[Sample]) -> Result<()> {
    use std::io::Write;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut out = String::new();
    for s in samples {
        let rel = |list: &[MediaSource]| -> Result<Vec<String>> {
            list.iter()
                .map(|m| match m {
                    MediaSource::Path(p) => Ok(p
                        .strip_prefix(base)
                        .unwrap_or(p)
                        .to_string_lossy()
                        .into_owned()),
                    MediaSource::Bytes(_) => Err(DataError::Other(format!(
                        "sample {}: embedded media cannot be written to JSONL",
                        s.id
                    ))),
                })
                .collect()
        };
        let mut v = serde_json::json!({"id": s.id, "prompt": s.prompt, "answer": s.answer});
        if let Some(sys) = &s.system {
            v["system"] = sys.clone().into();
        }
        match &s.media {
            Media::None => {}
            Media::Images(i) => v["images"] = rel(i)?.into(),
            Media::Video(f) => v["video"] = rel(f)?.into(),
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    let mut f = std::fs::File::create(path).map_err(|e| DataError::Read {
        path: path.into(),
        msg: e.to_string(),
    })?;
    f.write_all(out.as_bytes()).map_err(|e| DataError::Read {
        path: path.into(),
        msg: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(lines: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("f")).unwrap();
        for n in ["f/0.png", "f/1.png", "a.png"] {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let p = dir.path().join("d.jsonl");
        std::fs::write(&p, lines).unwrap();
        (dir, p)
    }

    #[test]
    fn loads_video_image_and_text_samples() {
        let (dir, p) = setup(
            "{\"id\": \"v1\", \"prompt\": \"Which way?\", \"video\": [\"f/0.png\", \"f/1.png\"], \"answer\": \"B\"}\n\
             \n\
             {\"prompt\": \"<image> colour?\", \"images\": [\"a.png\"], \"answer\": 3, \"extra\": 1}\n\
             {\"id\": 7, \"prompt\": \"2+2\", \"answer\": \"4\", \"system\": \"Be brief.\"}\n",
        );
        let s = load(&p).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(
            s[0].media,
            Media::Video(vec![
                MediaSource::Path(dir.path().join("f/0.png")),
                MediaSource::Path(dir.path().join("f/1.png"))
            ])
        );
        assert_eq!((s[1].id.as_str(), s[1].answer.as_str()), ("line3", "3"));
        assert_eq!(s[2].id, "7");
        assert_eq!(s[2].system.as_deref(), Some("Be brief."));
        // Round trip through the writer.
        let q = dir.path().join("copy.jsonl");
        write(&q, &s).unwrap();
        assert_eq!(load(&q).unwrap(), s);
    }

    #[track_caller]
    fn err_of(lines: &str) -> String {
        let (_d, p) = setup(lines);
        load(&p).unwrap_err().to_string()
    }

    #[test]
    fn only_a_regular_file_is_a_dataset() {
        let e = load(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let e =
            err_of("{\"prompt\": \"a\", \"answer\": \"b\"}\n{\"prompt\": 5, \"answer\": \"b\"}\n");
        assert!(
            e.contains("d.jsonl:2:") && e.contains("`prompt` must be a string"),
            "{e}"
        );
        let e = err_of("{\"prompt\": \"a\"}\n");
        assert!(
            e.contains("d.jsonl:1:") && e.contains("`answer` is missing"),
            "{e}"
        );
        let e = err_of("{\"prompt\": \"a\", \"answer\": \"b\", \"video\": [\"f/9.png\"]}\n");
        assert!(
            e.contains("`video`[0]: no such file") && e.contains("f/9.png"),
            "{e}"
        );
        let e = err_of("{\"prompt\": \"a\", \"answer\": \"b\", \"images\": \"a.png\"}\n");
        assert!(e.contains("`images` must be a list"), "{e}");
        let e = err_of("{\"prompt\": \"a\", \"answer\": \"b\" \n");
        assert!(e.contains("d.jsonl:1: not valid JSON"), "{e}");
        let e = err_of("[1]\n");
        assert!(e.contains("expected a JSON object, got a list"), "{e}");
        let e = err_of("{\"id\": \"x\", \"prompt\": \"a\", \"answer\": \"b\"}\n{\"id\": \"x\", \"prompt\": \"a\", \"answer\": \"b\"}\n");
        assert!(e.contains("id \"x\" is used by line 1 and line 2"), "{e}");
        let e = err_of("{\"prompt\": \"a\", \"answer\": \"b\", \"images\": [\"a.png\"], \"video\": [\"f/0.png\"]}\n");
        assert!(e.contains("both set"), "{e}");
        let e = err_of("\n\n");
        assert!(e.contains("no samples"), "{e}");
        let e = load(Path::new("/nonexistent/x.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/x.jsonl"), "{e}");
    }
}
