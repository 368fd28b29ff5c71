//! TensorBoard event files: each iteration's metrics as scalar summaries, so a run can be watched
//! with `tensorboard --logdir <out>` as veRL and OpenRLHF runs are.
//!
//! The format, written by hand (it is small, and the Rust TensorBoard writers pull in a whole
//! protobuf runtime and image codecs for it): a file of TFRecords, each a little-endian `u64`
//! length, the masked CRC32C of those 8 bytes, the data, and the masked CRC32C of the data; each
//! record's data one `tensorflow.Event` protobuf: `wall_time` (double, field 1), `step` (int64,
//! field 2), and one of `file_version` (string, field 3: `brain.Event:2`, the first record),
//! `summary` (field 5: repeated `Summary.Value { tag = 1, simple_value = 2 (float) }`) or
//! `session_log` (field 7: `SessionLog { status = 1 }`, `START` where a resumed run restarts).
//!
//! Invariants:
//! - A file is named `events.out.tfevents.<secs>.<host>.rollplex` and is never reopened: every
//!   run, a resumed one too, starts a new file, named after the newest one in the directory, so
//!   TensorBoard, which reads a directory's event files in name order, reads them in run order.
//! - A resumed run's file begins with a `SessionLog START` at the first iteration it runs, which
//!   tells TensorBoard to drop what earlier files recorded from that step on (iterations that
//!   ran after the last checkpoint and run again), as `MetricsLog::resume` drops their lines.
//! - Each record is appended with one `write`, so a reader sees whole records or none of one.
//! - Tags group the metrics (`reward/mean`, `time/rollout_s`, ...: [`tag`]); a metric the table
//!   does not know keeps its name under `metrics/`, so a new metric shows without a change here.

use std::io::Write;
use std::path::{Path, PathBuf};

/// What every events file's name starts with (TensorBoard looks for it).
pub const PREFIX: &str = "events.out.tfevents.";
/// What the names of the files this writer makes end with.
pub const SUFFIX: &str = ".rollplex";

/// The `file_version` of the first record.
const FILE_VERSION: &str = "brain.Event:2";
/// `SessionLog.SessionStatus.START`.
const SESSION_START: u64 = 1;

/// The TensorBoard tag of a `metrics.jsonl` field (see the module doc).
pub fn tag(key: &str) -> String {
    const TAGS: &[(&str, &str)] = &[
        ("reward_mean", "reward/mean"),
        ("reward_std", "reward/std"),
        ("response_len_mean", "response/len_mean"),
        ("response_tokens", "response/tokens"),
        ("loss", "loss/total"),
        ("pg_loss", "loss/policy"),
        ("kl", "loss/kl"),
        ("approx_kl", "loss/approx_kl"),
        ("clip_frac", "loss/clip_frac"),
        ("entropy", "loss/entropy"),
        ("grad_norm", "train/grad_norm"),
        ("micro_batches", "train/micro_batches"),
        ("optimizer_steps", "train/optimizer_steps"),
        ("decode_steps", "rollout/decode_steps"),
        ("time_s", "time/iteration_s"),
        ("tokens_per_s", "throughput/tokens_per_s"),
        ("peak_mem_gib", "memory/peak_gib"),
        ("roofline_s", "roofline/iteration_s"),
        ("roofline_frac", "roofline/iteration_frac"),
    ];
    if let Some((_, t)) = TAGS.iter().find(|(k, _)| *k == key) {
        return (*t).to_string();
    }
    if let Some(phase) = key.strip_suffix("_roofline_frac") {
        return format!("roofline/{phase}_frac");
    }
    if key.ends_with("_s") && !key.ends_with("_per_s") {
        return format!("time/{key}");
    }
    if key.contains('/') {
        return key.to_string();
    }
    format!("metrics/{key}")
}

/// CRC32C (Castagnoli), bitwise over a 256-entry table.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The CRC TFRecord stores: CRC32C rotated and offset, so a CRC of data holding CRCs stays
/// well distributed.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one TFRecord.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc(data).to_le_bytes());
    r
}

/// Protobuf wire encoding, the few field kinds an `Event` needs.
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, (u64::from(field) << 3) | u64::from(wire));
    }

    pub fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }

    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }

    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }

    pub fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, 2);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }
}

/// What an event carries besides its time and step.
enum Body<'a> {
    FileVersion,
    SessionStart,
    Scalars(&'a [(String, f32)]),
}

/// One `Event` message.
fn event(wall_time: f64, step: u64, body: Body<'_>) -> Vec<u8> {
    let mut e = Vec::new();
    pb::double(&mut e, 1, wall_time);
    // int64 on the wire (an iteration never reaches 2^63); 0 is proto3's default, left out as
    // TensorFlow does.
    if step != 0 {
        pb::uint(&mut e, 2, step);
    }
    match body {
        Body::FileVersion => pb::bytes(&mut e, 3, FILE_VERSION.as_bytes()),
        Body::SessionStart => {
            let mut log = Vec::new();
            pb::uint(&mut log, 1, SESSION_START);
            pb::bytes(&mut e, 7, &log);
        }
        Body::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, v) in values {
                let mut value = Vec::new();
                pb::bytes(&mut value, 1, tag.as_bytes());
                pb::float(&mut value, 2, *v);
                pb::bytes(&mut summary, 1, &value);
            }
            pb::bytes(&mut e, 5, &summary);
        }
    }
    e
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name as it may stand in a file name.
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into a buffer this function owns.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let name = if r == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// The seconds field of an events file name this writer made (`None` for other files).
fn file_secs(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?
        .strip_suffix(SUFFIX)?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The events files this writer made in `dir`, oldest first (by the seconds in their names,
/// which is their name order while those have ten digits, until the year 2286).
pub fn files_in(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(secs) = file_secs(&entry.file_name().to_string_lossy()) {
            files.push((secs, entry.path()));
        }
    }
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// Removes the events files of an earlier run from `dir` (a new run's metrics replace the old
/// ones, and so do its events). Files of other writers stay.
pub fn remove_old(dir: &Path) -> std::io::Result<()> {
    for f in files_in(dir)? {
        std::fs::remove_file(f)?;
    }
    Ok(())
}

/// Writes one run's events file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Starts a new events file in `dir` (see the module doc for its name) with its
    /// `file_version` record; `restart_at`: the run resumes at that iteration (a `SessionLog
    /// START` there).
    pub fn create(dir: &Path, restart_at: Option<u64>) -> std::io::Result<Self> {
        let wall = now();
        let newest = files_in(dir)?
            .iter()
            .filter_map(|p| file_secs(&p.file_name()?.to_string_lossy()))
            .max();
        // Named after every earlier file, so name order is run order.
        let mut secs = (wall as u64).max(newest.map_or(0, |s| s + 1));
        let host = host();
        let (path, file) = loop {
            let path = dir.join(format!("{PREFIX}{secs}.{host}{SUFFIX}"));
            match std::fs::OpenOptions::new()
                .append(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => secs += 1,
                Err(e) => return Err(e),
            }
        };
        let mut w = Self { path, file };
        let mut head = record(&event(wall, 0, Body::FileVersion));
        if let Some(step) = restart_at {
            head.extend(record(&event(wall, step, Body::SessionStart)));
        }
        w.append(&head)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event holding `scalars` (metric names, tagged by [`tag`]) at `step`;
    /// non-finite values are left out, as `metrics.jsonl` writes them as `null`.
    pub fn write_scalars<'a>(
        &mut self,
        step: u64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> std::io::Result<()> {
        let values: Vec<(String, f32)> = scalars
            .into_iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (tag(k), v as f32))
            .collect();
        self.append(&record(&event(now(), step, Body::Scalars(&values))))
    }

    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let n = self.file.write(bytes)?;
        if n != bytes.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("only {n} of {} bytes of an event were written", bytes.len()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_answers() {
        // RFC 3720 B.4 and the usual check value.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn first_record_matches_tensorflow_bytes() {
        // Every TensorFlow events file starts with these 12 bytes: the length of its
        // `file_version` event (24) and that length's masked CRC32C.
        let r = record(&event(0.0, 0, Body::FileVersion));
        assert_eq!(
            &r[..12],
            &[0x18, 0, 0, 0, 0, 0, 0, 0, 0xa3, 0x7f, 0x4b, 0x22]
        );
        let data = [&[0x09][..], &[0; 8], &[0x1a, 0x0d], b"brain.Event:2"].concat();
        assert_eq!(&r[12..12 + data.len()], &data[..]);
        assert_eq!(&r[12 + data.len()..], &masked_crc(&data).to_le_bytes());
    }

    #[test]
    fn session_start_is_field_7() {
        // Event { step = 4, session_log = SessionLog { status = START } } (field 6 is the
        // deprecated log_message, which TensorBoard does not take for a restart).
        assert_eq!(
            event(0.0, 4, Body::SessionStart),
            [&[0x09][..], &[0; 8], &[0x10, 0x04, 0x3a, 0x02, 0x08, 0x01]].concat()
        );
    }

    #[test]
    fn tags_group_metrics() {
        for (key, want) in [
            ("reward_mean", "reward/mean"),
            ("rollout_s", "time/rollout_s"),
            ("time_s", "time/iteration_s"),
            ("tokens_per_s", "throughput/tokens_per_s"),
            ("training_roofline_frac", "roofline/training_frac"),
            ("peak_mem_gib", "memory/peak_gib"),
            ("some_new_metric", "metrics/some_new_metric"),
            ("eval/reward", "eval/reward"),
        ] {
            assert_eq!(tag(key), want, "{key}");
        }
    }

    #[test]
    fn files_are_new_and_named_in_run_order() {
        let dir = tempfile::tempdir().unwrap();
        // An earlier run's file stamped in the future (a clock set back since).
        let later_secs = now() as u64 + 1000;
        let later = dir.path().join(format!("{PREFIX}{later_secs}.h{SUFFIX}"));
        std::fs::write(&later, b"").unwrap();
        std::fs::write(dir.path().join(format!("{PREFIX}1.other")), b"").unwrap();
        let w = EventWriter::create(dir.path(), Some(3)).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(&format!("{PREFIX}{}.", later_secs + 1)),
            "{name}"
        );
        assert_eq!(files_in(dir.path()).unwrap(), vec![later, w.path().into()]);
        remove_old(dir.path()).unwrap();
        assert_eq!(files_in(dir.path()).unwrap(), Vec::<PathBuf>::new());
        assert!(
            dir.path().join(format!("{PREFIX}1.other")).exists(),
            "another writer's file stays"
        );
    }
}
