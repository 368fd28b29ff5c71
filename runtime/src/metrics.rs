//! Per-iteration metrics: `metrics.jsonl` (one JSON object per line), the same numbers as
//! TensorBoard scalars (an events file beside it, [`crate::tfevents`]) and a compact fixed-width
//! console table; plus a progress bar for long phases.
//!
//! Invariants:
//! - Each line of `metrics.jsonl` is `{"iteration": k, "<name>": value, ...}` with names in
//!   the order they were recorded; non-finite values are written as `null` (JSON has no NaN).
//! - On resume ([`MetricsLog::resume`]) lines of iterations that will run again are dropped,
//!   so a resumed run's file equals an uninterrupted run's.
//! - One run writes a directory: a [`MetricsLog`] holds an exclusive lock (`flock`) on its
//!   directory's [`LOCK_FILE`] for as long as it lives, so a second run given the same `--out`
//!   stops with an error instead of interleaving or truncating the first one's files. The lock
//!   goes with the process, so a killed run leaves nothing to clean.
//! - Each line is appended with one `write` of the whole line to a file opened for appending, so
//!   a line is never split or interleaved with another writer's.
//! - Every record written to `metrics.jsonl` is written, as it is, to the run's events file too:
//!   each numeric field a scalar at step = iteration. A new run removes an earlier run's events
//!   files as it truncates its metrics; a resumed run starts a new events file.
//! - The console table's columns are fixed by the first record; its header is repeated every
//!   [`HEADER_EVERY`] rows. Progress bars draw only when stdout is a terminal, on stderr;
//!   console lines printed while they show go through [`LoopProgress::println`].

use std::io::{BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};

use crate::tfevents::EventWriter;

/// The lock file a [`MetricsLog`] holds in its directory.
pub const LOCK_FILE: &str = ".rollplex-run.lock";

/// Console rows between repeated headers.
pub const HEADER_EVERY: usize = 20;

/// Whether a `metrics.jsonl` field is a measurement of this run (times: `*_s`, `*_us`; the
/// achieved share of the roofline, `*roofline_frac`, or of the copy rate, `*copy_frac`; peak
/// memory; the decode windows' timings) rather than a result that two runs of the same plan and
/// seed agree on bit for bit.
pub fn is_measurement(key: &str) -> bool {
    key.ends_with("_s")
        || key.ends_with("_us")
        || key.ends_with("roofline_frac")
        || key.ends_with("copy_frac")
        || key == "peak_mem_gib"
        || key == "decode_windows"
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    #[error("{dir} is the output directory of another running rollplex-run (it holds {dir}/{LOCK_FILE}); give this run its own --out, or wait for that one to end")]
    Locked { dir: PathBuf },
    #[error("{path}:{line}: {msg}")]
    Line {
        path: PathBuf,
        line: u64,
        msg: String,
    },
}

pub type Result<T, E = MetricsError> = std::result::Result<T, E>;

/// One iteration's metrics, in recording order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    pub iteration: u64,
    pub values: Vec<(String, f64)>,
}

impl Record {
    pub fn new(iteration: u64) -> Self {
        Self {
            iteration,
            values: Vec::new(),
        }
    }

    /// Sets `name` (replacing an earlier value of the same name).
    pub fn set(&mut self, name: &str, value: f64) -> &mut Self {
        match self.values.iter_mut().find(|(n, _)| n == name) {
            Some(v) => v.1 = value,
            None => self.values.push((name.into(), value)),
        }
        self
    }

    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// The JSON line (without newline), keys in recording order.
    pub fn to_json_line(&self) -> String {
        let mut s = format!("{{\"iteration\":{}", self.iteration);
        for (n, v) in &self.values {
            let name = serde_json::to_string(n).expect("a string serialises");
            let value = serde_json::Number::from_f64(*v)
                .map_or_else(|| "null".to_string(), |x| x.to_string());
            s.push_str(&format!(",{name}:{value}"));
        }
        s.push('}');
        s
    }
}

/// A value in at most `w` characters: integers as such, else 4 significant digits, with an
/// exponent when the magnitude is large or small.
pub fn compact(v: f64, w: usize) -> String {
    let s = if !v.is_finite() {
        format!("{v}")
    } else if v == v.trunc() && v.abs() < 1e7 {
        format!("{v:.0}")
    } else if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-3) {
        format!("{v:.2e}")
    } else {
        let digits = 3 - (v.abs().log10().floor() as i32).clamp(-3, 3);
        format!("{v:.*}", digits.max(0) as usize)
    };
    if s.len() > w {
        format!("{v:.1e}")
    } else {
        s
    }
}

/// Fixed-width console rendering of records.
#[derive(Clone, Debug, Default)]
pub struct Table {
    columns: Vec<(String, usize)>,
    rows: usize,
}

impl Table {
    /// The lines to print for `rec`: a header first (and every [`HEADER_EVERY`] rows), then the row.
    pub fn render(&mut self, rec: &Record) -> Vec<String> {
        if self.columns.is_empty() {
            self.columns = rec
                .values
                .iter()
                .map(|(n, _)| (n.clone(), n.len().clamp(9, 16)))
                .collect();
        }
        let mut out = Vec::new();
        if self.rows.is_multiple_of(HEADER_EVERY) {
            let mut h = format!("{:>6}", "iter");
            for (n, w) in &self.columns {
                let name: String = if n.len() > *w {
                    n.chars().take(*w).collect()
                } else {
                    n.clone()
                };
                h.push_str(&format!(" {name:>w$}"));
            }
            out.push(h);
        }
        let mut row = format!("{:>6}", rec.iteration);
        for (n, w) in &self.columns {
            let cell = rec
                .get(n)
                .map_or_else(|| "-".to_string(), |v| compact(v, *w));
            row.push_str(&format!(" {cell:>w$}"));
        }
        out.push(row);
        self.rows += 1;
        out
    }
}

/// Writes records to `metrics.jsonl` and (optionally) a console.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    table: Table,
    console: Option<Box<dyn Write + Send>>,
    /// The TensorBoard events file of this run.
    events: EventWriter,
    /// The directory's lock ([`lock_dir`]), held while the log lives.
    _lock: std::fs::File,
}

/// The directory of a file path (`.` for a bare name).
fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

impl std::fmt::Debug for MetricsLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsLog")
            .field("path", &self.path)
            .finish()
    }
}

/// Takes the exclusive lock of `dir` (created if missing): the returned file holds it until it
/// is dropped or the process ends.
pub fn lock_dir(dir: &Path) -> Result<std::fs::File> {
    use std::os::unix::io::AsRawFd;
    let lock = dir.join(LOCK_FILE);
    let err = |e: std::io::Error| MetricsError::Io {
        path: lock.clone(),
        msg: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| MetricsError::Io {
        path: dir.to_path_buf(),
        msg: e.to_string(),
    })?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(err)?;
    // SAFETY: flock(2) on a descriptor this function owns; it touches no memory.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.kind() == std::io::ErrorKind::WouldBlock {
            MetricsError::Locked {
                dir: dir.to_path_buf(),
            }
        } else {
            err(e)
        });
    }
    Ok(file)
}

/// Appends `line` (newline included) with one `write`: on a file opened for appending the whole
/// line lands at the end at once, or the call fails.
fn append_line(file: &mut std::fs::File, line: &str) -> std::io::Result<()> {
    let n = file.write(line.as_bytes())?;
    if n != line.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            format!("only {n} of {} bytes of a line were written", line.len()),
        ));
    }
    Ok(())
}

impl MetricsLog {
    /// Starts a new file (truncating an old one) after taking its directory's lock; the table
    /// goes to stdout.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let err = |e: std::io::Error| MetricsError::Io {
            path: path.clone(),
            msg: e.to_string(),
        };
        let dir = dir_of(&path);
        let lock = lock_dir(dir)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(err)?;
        file.set_len(0).map_err(err)?;
        let events = crate::tfevents::remove_old(dir)
            .and_then(|()| EventWriter::create(dir, None))
            .map_err(|e| events_err(dir, e))?;
        Ok(Self {
            path,
            file,
            table: Table::default(),
            console: Some(Box::new(std::io::stdout())),
            events,
            _lock: lock,
        })
    }

    /// Continues a file after `completed` iterations: keeps the lines of iterations below
    /// `completed` and drops the rest (they will be recorded again).
    pub fn resume(path: impl AsRef<Path>, completed: u64) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let lock = lock_dir(dir_of(&path))?;
        let mut kept = String::new();
        if path.exists() {
            for line in read_log(&path)? {
                if line.iteration < completed {
                    kept.push_str(&line.text);
                    kept.push('\n');
                }
            }
        }
        // Atomically: a crash here leaves the old file, never a truncated one.
        let err = |p: &Path, e: std::io::Error| MetricsError::Io {
            path: p.to_path_buf(),
            msg: e.to_string(),
        };
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, kept.as_bytes()).map_err(|e| err(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| err(&path, e))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| err(&path, e))?;
        let dir = dir_of(&path);
        let events = EventWriter::create(dir, Some(completed)).map_err(|e| events_err(dir, e))?;
        Ok(Self {
            path,
            file,
            table: Table::default(),
            console: Some(Box::new(std::io::stdout())),
            events,
            _lock: lock,
        })
    }

    /// Sends the table somewhere else (`None`: no console output).
    pub fn with_console(mut self, console: Option<Box<dyn Write + Send>>) -> Self {
        self.console = console;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one iteration's JSON object (without newline, with an integer `iteration`) to the
    /// file, flushed, and its numeric fields to the events file; no console output.
    pub fn log_line(&mut self, json_line: &str) -> Result<()> {
        let fields = match serde_json::from_str::<serde_json::Value>(json_line) {
            Ok(serde_json::Value::Object(fields)) => fields,
            _ => {
                return Err(MetricsError::Io {
                    path: self.path.clone(),
                    msg: format!("a metrics record is not a JSON object: {json_line}"),
                })
            }
        };
        let Some(step) = fields.get("iteration").and_then(|v| v.as_u64()) else {
            return Err(MetricsError::Io {
                path: self.path.clone(),
                msg: format!("a metrics record has no integer `iteration`: {json_line}"),
            });
        };
        append_line(&mut self.file, &format!("{json_line}\n")).map_err(|e| MetricsError::Io {
            path: self.path.clone(),
            msg: e.to_string(),
        })?;
        let scalars = fields
            .iter()
            .filter(|(k, _)| *k != "iteration")
            .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)));
        self.write_events(step, scalars)
    }

    /// Appends `rec` to the file (flushed) and the events file, and prints its table row.
    pub fn log(&mut self, rec: &Record) -> Result<()> {
        let line = rec.to_json_line() + "\n";
        append_line(&mut self.file, &line).map_err(|e| MetricsError::Io {
            path: self.path.clone(),
            msg: e.to_string(),
        })?;
        self.write_events(
            rec.iteration,
            rec.values.iter().map(|(k, v)| (k.as_str(), *v)),
        )?;
        if let Some(c) = &mut self.console {
            for l in self.table.render(rec) {
                // The console is best effort: a closed stdout must not stop training.
                let _ = writeln!(c, "{l}");
            }
            let _ = c.flush();
        }
        Ok(())
    }
}

impl MetricsLog {
    /// The run's TensorBoard events file.
    pub fn events_path(&self) -> &Path {
        self.events.path()
    }

    fn write_events<'a>(
        &mut self,
        step: u64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<()> {
        self.events
            .write_scalars(step, scalars)
            .map_err(|e| MetricsError::Io {
                path: self.events.path().to_path_buf(),
                msg: e.to_string(),
            })
    }
}

fn events_err(dir: &Path, e: std::io::Error) -> MetricsError {
    MetricsError::Io {
        path: dir.to_path_buf(),
        msg: format!("the TensorBoard events file: {e}"),
    }
}

/// One line of a `metrics.jsonl`: its iteration, its text and its fields.
#[derive(Clone, Debug)]
pub struct LogLine {
    pub iteration: u64,
    pub text: String,
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl LogLine {
    /// A numeric field (`None` when missing, `null` or not a number).
    pub fn get(&self, key: &str) -> Option<f64> {
        self.fields.get(key).and_then(|v| v.as_f64())
    }
}

/// The records of a `metrics.jsonl`, blank lines skipped. Errors name `file:line`: a line that
/// is not a JSON object, or has no integer `iteration`; the file must be a regular file, each
/// line at most [`rollplex_plan::files::LINE_CAP`] bytes.
pub fn read_log(path: &Path) -> Result<Vec<LogLine>> {
    use rollplex_plan::files;
    let (f, _) = files::open_regular(path, files::NO_CAP).map_err(|e| MetricsError::Io {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let mut r = BufReader::new(f);
    let mut lines = Vec::new();
    let mut n = 0u64;
    loop {
        n += 1;
        let bad = |msg: String| MetricsError::Line {
            path: path.to_path_buf(),
            line: n,
            msg,
        };
        let Some(text) =
            files::read_line_capped(&mut r, files::LINE_CAP).map_err(|e| bad(e.to_string()))?
        else {
            break;
        };
        if text.trim().is_empty() {
            continue;
        }
        let fields = match serde_json::from_str(&text) {
            Ok(serde_json::Value::Object(fields)) => fields,
            Ok(_) => return Err(bad("not a JSON object".into())),
            Err(e) => return Err(bad(format!("not JSON: {e}"))),
        };
        let iteration = fields
            .get("iteration")
            .and_then(|i| i.as_u64())
            .ok_or_else(|| bad("field `iteration` is missing or not an integer".into()))?;
        lines.push(LogLine {
            iteration,
            text,
            fields,
        });
    }
    Ok(lines)
}

/// A progress bar for a phase of `len` steps on stderr, or a hidden one when stdout is not a
/// terminal (logs, CI), so piped output stays clean.
pub fn progress(len: u64, label: &str) -> indicatif::ProgressBar {
    if !std::io::stdout().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(len),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let style = indicatif::ProgressStyle::with_template(
        "{prefix:>12} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
    )
    .expect("valid template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(label.to_string());
    bar
}

/// Progress of the RL loop on stderr: one bar for iterations, one for the current iteration's
/// tasks (named as it runs). Drawn only when stdout is a terminal and not `quiet`; console
/// lines go through [`LoopProgress::println`], which lifts the bars off the screen while the
/// line is printed to stdout, so the metrics table is never garbled.
#[derive(Debug)]
pub struct LoopProgress {
    bars: Option<(
        indicatif::MultiProgress,
        indicatif::ProgressBar,
        indicatif::ProgressBar,
    )>,
}

impl LoopProgress {
    /// Bars for iterations `first..total` (hidden when `quiet` or stdout is not a terminal).
    pub fn new(first: u32, total: u32, quiet: bool) -> Self {
        Self::with_target(
            first,
            total,
            (!quiet && std::io::stdout().is_terminal()).then(indicatif::ProgressDrawTarget::stderr),
        )
    }

    /// As [`LoopProgress::new`], drawing to `target` (`None`: no bars).
    pub fn with_target(
        first: u32,
        total: u32,
        target: Option<indicatif::ProgressDrawTarget>,
    ) -> Self {
        let Some(target) = target else {
            return Self { bars: None };
        };
        let mp = indicatif::MultiProgress::with_draw_target(target);
        let style = |t: &str| {
            indicatif::ProgressStyle::with_template(t)
                .expect("valid template")
                .progress_chars("=> ")
        };
        let iters = mp.add(indicatif::ProgressBar::new(total as u64));
        iters.set_style(style(
            "{prefix:>10} [{bar:30}] {pos}/{len} elapsed {elapsed} eta {eta}",
        ));
        iters.set_prefix("iterations");
        iters.set_position(first as u64);
        iters.reset_eta();
        let tasks = mp.add(indicatif::ProgressBar::new(0));
        tasks.set_style(style("{prefix:>10} [{bar:30}] {pos}/{len} {msg}"));
        Self {
            bars: Some((mp, iters, tasks)),
        }
    }

    pub fn is_drawn(&self) -> bool {
        self.bars.is_some()
    }

    /// Iteration `it` starts with `tasks` tasks.
    pub fn start_iteration(&self, it: u32, tasks: usize) {
        if let Some((_, _, t)) = &self.bars {
            t.set_length(tasks as u64);
            t.set_position(0);
            t.set_prefix(format!("iter {it}"));
        }
    }

    /// Task `name` starts.
    pub fn task_started(&self, name: &str) {
        if let Some((_, _, t)) = &self.bars {
            t.set_message(name.to_string());
        }
    }

    pub fn task_done(&self) {
        if let Some((_, _, t)) = &self.bars {
            t.inc(1);
        }
    }

    pub fn iteration_done(&self) {
        if let Some((_, i, _)) = &self.bars {
            i.inc(1);
        }
    }

    /// Prints `line` to stdout above the bars. Best effort: a closed stdout (`| head`) must not
    /// stop training.
    pub fn println(&self, line: &str) {
        let print = || {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}").and_then(|_| out.flush());
        };
        match &self.bars {
            Some((mp, _, _)) => mp.suspend(print),
            None => print(),
        }
    }

    /// Removes the bars from the screen.
    pub fn finish(&self) {
        if let Some((mp, i, t)) = &self.bars {
            t.finish_and_clear();
            i.finish_and_clear();
            let _ = mp.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Timings, shares of a ceiling and the decode windows are this run's measurements; the
    /// results two runs of one plan and seed agree on are not.
    #[test]
    fn measurements_are_told_from_results() {
        for k in [
            "time_s",
            "tokens_per_s",
            "rollout_roofline_frac",
            "decode_copy_frac",
            "decode_max_gap_us",
            "decode_windows",
            "peak_mem_gib",
        ] {
            assert!(is_measurement(k), "{k}");
        }
        for k in [
            "loss",
            "reward_mean",
            "decode_steps",
            "decode_gb",
            "grad_norm",
        ] {
            assert!(!is_measurement(k), "{k}");
        }
    }

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn rec(i: u64, reward: f64) -> Record {
        let mut r = Record::new(i);
        r.set("reward_mean", reward)
            .set("loss", -0.0123456)
            .set("tokens_per_s", 123456.0)
            .set("kl", f64::NAN);
        r
    }

    #[test]
    fn jsonl_lines_and_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/metrics.jsonl");
        let buf = Buf::default();
        let mut log = MetricsLog::create(&path)
            .unwrap()
            .with_console(Some(Box::new(buf.clone())));
        for i in 0..3 {
            log.log(&rec(i, 0.25 * i as f64)).unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1],
            r#"{"iteration":1,"reward_mean":0.25,"loss":-0.0123456,"tokens_per_s":123456.0,"kl":null}"#
        );
        let console = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let rows: Vec<&str> = console.lines().collect();
        assert_eq!(rows.len(), 4, "{console}");
        assert_eq!(
            rows[0],
            "  iter reward_mean      loss tokens_per_s        kl"
        );
        assert_eq!(
            rows[2],
            "     1      0.2500  -0.01235       123456       NaN"
        );
        assert!(
            rows.iter().all(|r| r.len() == rows[0].len()),
            "fixed width:\n{console}"
        );
    }

    #[test]
    fn resume_drops_iterations_that_run_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::create(&path).unwrap().with_console(None);
        for i in 0..5 {
            log.log(&rec(i, 1.0)).unwrap();
        }
        drop(log);
        let mut log = MetricsLog::resume(&path, 3).unwrap().with_console(None);
        log.log(&rec(3, 1.0)).unwrap();
        let its: Vec<u64> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["iteration"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(its, vec![0, 1, 2, 3]);
        drop(log);
        std::fs::write(&path, "{\"iteration\": 0}\nnot json\n").unwrap();
        let e = MetricsLog::resume(&path, 1).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2: not JSON"), "{e}");
    }

    #[test]
    fn one_log_per_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/metrics.jsonl");
        let mut first = MetricsLog::create(&path).unwrap().with_console(None);
        first.log(&rec(0, 1.0)).unwrap();
        for second in [MetricsLog::create(&path), MetricsLog::resume(&path, 0)] {
            let e = second.unwrap_err().to_string();
            assert!(e.contains("another running rollplex-run"), "{e}");
        }
        first.log(&rec(1, 1.0)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 2);
        drop(first);
        MetricsLog::resume(&path, 2).expect("free once the first log is gone");
    }

    #[test]
    fn progress_draws_only_when_asked() {
        assert!(!LoopProgress::new(0, 3, true).is_drawn(), "--quiet");
        assert!(
            !LoopProgress::new(0, 3, false).is_drawn(),
            "tests do not run on a terminal"
        );
        let p = LoopProgress::with_target(1, 3, Some(indicatif::ProgressDrawTarget::hidden()));
        assert!(p.is_drawn());
        let (_, iters, tasks) = p.bars.as_ref().unwrap();
        assert_eq!(
            iters.position(),
            1,
            "a resumed run starts where it left off"
        );
        p.start_iteration(1, 40);
        p.task_started("decode.w0");
        p.task_done();
        assert_eq!((tasks.position(), tasks.length()), (1, Some(40)));
        assert_eq!(tasks.message(), "decode.w0");
        p.iteration_done();
        assert_eq!(iters.position(), 2);
        p.finish();
        assert!(iters.is_finished() && tasks.is_finished());
    }

    #[test]
    fn compact_fits_its_width() {
        for (v, want) in [
            (0.0, "0"),
            (12.0, "12"),
            (0.5, "0.5000"),
            (2.34567, "2.346"),
            (1234.5678, "1235"),
            (1e-5, "1.00e-5"),
            (2.5e9, "2.50e9"),
        ] {
            assert_eq!(compact(v, 9), want, "{v}");
        }
        assert!(compact(-1.234e-300, 9).len() <= 9);
        assert!(
            progress(10, "rollout").is_hidden(),
            "tests do not run on a terminal"
        );
    }
}
