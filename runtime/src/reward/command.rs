//! An external reward program speaking JSON lines over stdin/stdout.
//!
//! Protocol: the runtime starts `argv` once and keeps it running across batches. For each
//! request it writes one line `{"id": "...", "prompt": "...", "response": "...", "answer":
//! "..."}` to the program's stdin; the program answers each with one line `{"id": "...",
//! "reward": <finite number>}` on stdout, in any order (extra fields are ignored, blank lines
//! skipped). Its stderr is kept (the last 4 KiB) and shown in errors.
//!
//! Invariants:
//! - Never a hang: if no valid answer arrives for `timeout` (counted from sending the batch and
//!   again from each answer), the program is killed and the call fails; a program that closes
//!   its stdout is waited for at most that long too. Requests are written from a helper
//!   thread, so a program that stops reading cannot block the runtime either.
//! - Nothing outlives the run: the program runs in a process group of its own, and the whole
//!   group (the program and whatever it started) is killed on a failure and when the reward is
//!   dropped.
//! - Bounded memory: an answer line may hold at most [`MAX_LINE`] bytes; a longer one is an
//!   error naming the cap. At most [`QUEUED_LINES`] lines wait unread.
//! - Never a silent zero: a program that exits, closes stdout, writes a line that is not a JSON
//!   object, answers an unknown or already answered id, leaves out `reward`, or gives a
//!   non-number or non-finite reward makes the call fail with an error that names the command
//!   and what went wrong. After a failure the program is killed; the next call starts it anew.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::RewardRequest;

const STDERR_KEEP: usize = 4096;

/// The longest answer line read, in bytes (1 MiB): an answer is one short JSON object, and a
/// program that writes without newlines must not take the runtime's memory with it.
pub const MAX_LINE: usize = 1 << 20;

/// How many answer lines may wait unread before the reader stops reading the program's stdout
/// (the program then blocks on its writes): bounds memory to `QUEUED_LINES * MAX_LINE`.
pub const QUEUED_LINES: usize = 64;

/// How long a program that closed its stdout is given to exit before it is killed (never more
/// than the timeout): it can answer nothing more, so only its exit status is waited for.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Errors of an external reward command. Each names the command line.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("reward command `{cmd}` could not be started: {msg}")]
    Spawn { cmd: String, msg: String },
    #[error("reward command `{cmd}` gave no answer for {timeout_s} s ({got} of {want} answers received); it was killed{stderr}")]
    Timeout {
        cmd: String,
        timeout_s: f64,
        got: usize,
        want: usize,
        stderr: String,
    },
    #[error("reward command `{cmd}` exited ({status}) after {got} of {want} answers{stderr}")]
    Died {
        cmd: String,
        status: String,
        got: usize,
        want: usize,
        stderr: String,
    },
    #[error("reward command `{cmd}` wrote a bad answer line {line:?}: {msg}")]
    BadAnswer {
        cmd: String,
        line: String,
        msg: String,
    },
    #[error("reward command `{cmd}`: {msg}")]
    Io { cmd: String, msg: String },
    #[error("reward command: {0}")]
    Invalid(String),
}

struct Running {
    child: Child,
    stdin: Arc<Mutex<ChildStdin>>,
    lines: Receiver<std::io::Result<String>>,
    stderr: Arc<Mutex<VecDeque<u8>>>,
}

/// A reward computed by an external program (see the module doc).
pub struct CommandReward {
    argv: Vec<String>,
    timeout: Duration,
    running: Option<Running>,
}

impl std::fmt::Debug for CommandReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandReward")
            .field("argv", &self.argv)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl CommandReward {
    /// `argv[0]` is the program (looked up in `PATH`), the rest its arguments. The program is
    /// started on the first call.
    pub fn new(argv: Vec<String>, timeout_s: f64) -> Result<Self, CommandError> {
        if argv.is_empty() || argv[0].is_empty() {
            return Err(CommandError::Invalid("the command line is empty".into()));
        }
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(CommandError::Invalid(format!(
                "timeout must be a positive number of seconds, got {timeout_s}"
            )));
        }
        Ok(Self {
            argv,
            timeout: Duration::from_secs_f64(timeout_s),
            running: None,
        })
    }

    /// The command line as a user would type it.
    pub fn command_line(&self) -> String {
        self.argv
            .iter()
            .map(|a| {
                if !a.is_empty()
                    && a.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
                {
                    a.clone()
                } else {
                    format!("'{}'", a.replace('\'', r"'\''"))
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn start(&mut self) -> Result<&mut Running, CommandError> {
        if self.running.is_none() {
            let cmd = self.command_line();
            let mut child = Command::new(&self.argv[0])
                .args(&self.argv[1..])
                // A group of its own, so that what the program starts is killed with it.
                .process_group(0)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| CommandError::Spawn {
                    cmd: cmd.clone(),
                    msg: e.to_string(),
                })?;
            let stdin = child.stdin.take().expect("piped stdin");
            let stdout = child.stdout.take().expect("piped stdout");
            let mut stderr_pipe = child.stderr.take().expect("piped stderr");
            let (tx, rx) = mpsc::sync_channel(QUEUED_LINES);
            std::thread::Builder::new()
                .name("reward-stdout".into())
                .spawn(move || {
                    let mut out = BufReader::new(stdout);
                    loop {
                        let line = rollplex_plan::files::read_line_capped(&mut out, MAX_LINE);
                        let last = !matches!(line, Ok(Some(_)));
                        let Some(line) = line.transpose() else { break };
                        if tx.send(line).is_err() || last {
                            break;
                        }
                    }
                })
                .map_err(|e| CommandError::Io {
                    cmd: cmd.clone(),
                    msg: format!("cannot start reader thread: {e}"),
                })?;
            let stderr = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_KEEP)));
            let keep = stderr.clone();
            std::thread::Builder::new()
                .name("reward-stderr".into())
                .spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = stderr_pipe.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let mut k = keep.lock().unwrap_or_else(|e| e.into_inner());
                        k.extend(&buf[..n]);
                        while k.len() > STDERR_KEEP {
                            k.pop_front();
                        }
                    }
                })
                .map_err(|e| CommandError::Io {
                    cmd: cmd.clone(),
                    msg: format!("cannot start reader thread: {e}"),
                })?;
            self.running = Some(Running {
                child,
                stdin: Arc::new(Mutex::new(stdin)),
                lines: rx,
                stderr,
            });
        }
        Ok(self.running.as_mut().expect("just started"))
    }

    /// Kills the program's process group and reaps the program (if running).
    fn stop(&mut self) {
        if let Some(mut r) = self.running.take() {
            kill_group(&mut r.child);
        }
    }

    fn stderr_tail(&self) -> String {
        let Some(r) = &self.running else {
            return String::new();
        };
        // Give the stderr reader a moment to drain what a dying program wrote last.
        std::thread::sleep(Duration::from_millis(20));
        let k = r.stderr.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = k.as_slices();
        let text = String::from_utf8_lossy(&[a, b].concat()).trim().to_string();
        if text.is_empty() {
            String::new()
        } else {
            format!("; its stderr ends with:\n{text}")
        }
    }

    /// Rewards of `reqs`, in the order of `reqs`. Ids must be unique within the call.
    pub fn score(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f64>, CommandError> {
        let result = self.score_inner(reqs);
        if result.is_err() {
            self.stop();
        }
        result
    }

    fn score_inner(&mut self, reqs: &[RewardRequest]) -> Result<Vec<f64>, CommandError> {
        let cmd = self.command_line();
        let mut pending: HashMap<&str, usize> = HashMap::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            if pending.insert(r.id.as_str(), i).is_some() {
                return Err(CommandError::Invalid(format!(
                    "request id {:?} appears twice in one batch",
                    r.id
                )));
            }
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut payload = String::new();
        for r in reqs {
            payload.push_str(
                &serde_json::to_string(r).map_err(|e| CommandError::Invalid(e.to_string()))?,
            );
            payload.push('\n');
        }
        let timeout = self.timeout;
        let running = self.start()?;
        let stdin = running.stdin.clone();
        let (wtx, wrx) = mpsc::channel();
        std::thread::Builder::new()
            .name("reward-stdin".into())
            .spawn(move || {
                let mut s = stdin.lock().unwrap_or_else(|e| e.into_inner());
                let r = s.write_all(payload.as_bytes()).and_then(|_| s.flush());
                let _ = wtx.send(r);
            })
            .map_err(|e| CommandError::Io {
                cmd: cmd.clone(),
                msg: format!("cannot start writer thread: {e}"),
            })?;
        let mut rewards = vec![f64::NAN; reqs.len()];
        let mut got = 0;
        let mut deadline = Instant::now() + timeout;
        let mut write_error = None;
        while got < reqs.len() {
            if let Ok(Err(e)) = wrx.try_recv() {
                // Usually a broken pipe: the program is gone; its exit is reported below.
                write_error = Some(e);
            }
            let running = self.running.as_mut().expect("started above");
            let wait = deadline.saturating_duration_since(Instant::now());
            let line = match running.lines.recv_timeout(wait) {
                Ok(Ok(line)) => line,
                Ok(Err(e)) => {
                    return Err(CommandError::Io {
                        cmd,
                        msg: format!("reading its stdout: {e}"),
                    })
                }
                Err(RecvTimeoutError::Timeout) => {
                    let stderr = self.stderr_tail();
                    return Err(CommandError::Timeout {
                        cmd,
                        timeout_s: timeout.as_secs_f64(),
                        got,
                        want: reqs.len(),
                        stderr,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Stdout is closed: nothing more can come. Wait for the exit status a
                    // little, never past the deadline; `score` kills what is left.
                    let until = deadline.min(Instant::now() + EXIT_GRACE);
                    let status = match wait_until(&mut running.child, until) {
                        Ok(Some(s)) => s.to_string(),
                        Ok(None) => "closed its stdout and is still running".to_string(),
                        Err(e) => format!("status unknown: {e}"),
                    };
                    let mut stderr = self.stderr_tail();
                    if let Some(e) = &write_error {
                        stderr = format!("; writing requests failed: {e}{stderr}");
                    }
                    return Err(CommandError::Died {
                        cmd,
                        status,
                        got,
                        want: reqs.len(),
                        stderr,
                    });
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let bad = |msg: String| CommandError::BadAnswer {
                cmd: cmd.clone(),
                line: clip(&line),
                msg,
            };
            let v: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let obj = v
                .as_object()
                .ok_or_else(|| bad("expected a JSON object".into()))?;
            let id = match obj.get("id") {
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(other) => {
                    return Err(bad(format!(
                        "`id` must be the request's id string, got {other}"
                    )))
                }
                None => return Err(bad("`id` is missing".into())),
            };
            let Some(index) = pending.remove(id) else {
                let msg = if reqs.iter().any(|r| r.id == id) {
                    format!("id {id:?} was already answered")
                } else {
                    format!("id {id:?} is not one of this batch's requests")
                };
                return Err(bad(msg));
            };
            let reward = match obj.get("reward") {
                Some(serde_json::Value::Number(n)) => n
                    .as_f64()
                    .ok_or_else(|| bad(format!("reward {n} is not a float")))?,
                Some(other) => return Err(bad(format!("`reward` must be a number, got {other}"))),
                None => return Err(bad("`reward` is missing".into())),
            };
            if !reward.is_finite() {
                return Err(bad(format!("reward {reward} is not finite")));
            }
            rewards[index] = reward;
            got += 1;
            deadline = Instant::now() + timeout;
        }
        Ok(rewards)
    }
}

fn clip(s: &str) -> String {
    if s.len() <= 200 {
        s.to_string()
    } else {
        let mut end = 200;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    }
}

/// Polls `child` until it exits or `until` passes: `Ok(None)` if it is still running.
fn wait_until(
    child: &mut Child,
    until: Instant,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if Instant::now() >= until {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills the process group `child` leads (see `start`: the program, and whatever it started
/// that stayed in its group), then reaps `child`.
fn kill_group(child: &mut Child) {
    if let Ok(pgid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) with a negative pid signals a process group; it touches no memory.
        // The group is the child's own (`process_group(0)`), so nothing else is signalled.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        if let Some(Running {
            mut child, stdin, ..
        }) = self.running.take()
        {
            // Closing stdin lets a well-behaved program exit on EOF; then make sure it and its
            // group are gone (a child it left behind would otherwise outlive the run).
            drop(stdin);
            let _ = wait_until(&mut child, Instant::now() + Duration::from_millis(200));
            kill_group(&mut child);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str, response: &str, answer: &str) -> RewardRequest {
        RewardRequest {
            id: id.into(),
            prompt: "p".into(),
            response: response.into(),
            answer: answer.into(),
        }
    }

    fn py(src: &str, timeout_s: f64) -> CommandReward {
        CommandReward::new(
            vec!["python3".into(), "-u".into(), "-c".into(), src.into()],
            timeout_s,
        )
        .unwrap()
    }

    /// Answers each batch of `n` lines after reading all of them, in reverse order.
    const GOOD: &str = r#"
import sys, json
calls = 0
batch = []
for line in sys.stdin:
    r = json.loads(line)
    calls += 1
    batch.append({"id": r["id"], "reward": 1.0 if r["response"] == r["answer"] else 0.0, "calls": calls})
    if len(batch) == 3:
        for b in reversed(batch):
            print(json.dumps(b))
        batch = []
"#;

    #[test]
    fn answers_in_any_order_and_the_process_is_reused() {
        let mut c = py(GOOD, 10.0);
        let r = c
            .score(&[req("a", "x", "x"), req("b", "x", "y"), req("c", "z", "z")])
            .unwrap();
        assert_eq!(r, vec![1.0, 0.0, 1.0]);
        let pid = c.running.as_ref().unwrap().child.id();
        let r = c
            .score(&[req("a", "1", "2"), req("b", "2", "2"), req("c", "", "")])
            .unwrap();
        assert_eq!(r, vec![0.0, 1.0, 1.0]);
        assert_eq!(
            c.running.as_ref().unwrap().child.id(),
            pid,
            "one process for both batches"
        );
    }

    #[track_caller]
    fn fails(src: &str, timeout_s: f64, reqs: &[RewardRequest], needles: &[&str]) {
        let mut c = py(src, timeout_s);
        let t = Instant::now();
        let e = c.score(reqs).unwrap_err().to_string();
        assert!(
            t.elapsed() < Duration::from_secs_f64(timeout_s + 5.0),
            "took {:?}",
            t.elapsed()
        );
        assert!(e.contains("python3 -u -c"), "names the command: {e}");
        for n in needles {
            assert!(e.contains(n), "{n:?} not in: {e}");
        }
        assert!(c.running.is_none(), "killed after a failure");
    }

    #[test]
    fn a_dead_process_is_an_error_with_status_and_stderr() {
        fails(
            "import sys; sys.stderr.write('reward model missing\\n'); sys.exit(3)",
            10.0,
            &[req("a", "", "")],
            &["exit status: 3", "0 of 1 answers", "reward model missing"],
        );
        // Dies after answering one of two.
        fails(
            "import sys, json\nr = json.loads(sys.stdin.readline())\nprint(json.dumps({'id': r['id'], 'reward': 1}))",
            10.0,
            &[req("a", "", ""), req("b", "", "")],
            &["1 of 2 answers"],
        );
    }

    #[test]
    fn a_hanging_process_times_out() {
        fails(
            "import time; time.sleep(60)",
            0.5,
            &[req("a", "", "")],
            &["no answer for 0.5 s", "0 of 1"],
        );
        // A program that never reads its stdin, with more than a pipe buffer of requests.
        let big = "x".repeat(200_000);
        fails(
            "import time; time.sleep(60)",
            0.5,
            &[req("a", &big, ""), req("b", &big, "")],
            &["no answer for 0.5 s"],
        );
    }

    #[test]
    fn misbehaving_answers_are_errors() {
        let one = [req("a", "", "")];
        let echo = |out: &str| {
            format!("import sys\nsys.stdin.readline()\nprint({out:?})\nsys.stdout.flush()\nimport time; time.sleep(5)")
        };
        fails(
            &echo("hello"),
            10.0,
            &one,
            &["bad answer line \"hello\"", "not JSON"],
        );
        fails(
            &echo(r#"{"id": "zz", "reward": 1}"#),
            10.0,
            &one,
            &["\"zz\" is not one of this batch"],
        );
        fails(
            &echo(r#"{"id": "a"}"#),
            10.0,
            &one,
            &["`reward` is missing"],
        );
        fails(
            &echo(r#"{"id": "a", "reward": "1"}"#),
            10.0,
            &one,
            &["`reward` must be a number"],
        );
        fails(
            &echo(r#"{"id": "a", "reward": NaN}"#),
            10.0,
            &one,
            &["not JSON"],
        );
        fails(
            &echo(r#"{"id": "a", "reward": 1e999}"#),
            10.0,
            &one,
            &["bad answer line"],
        );
        fails(&echo(r#"{"reward": 1}"#), 10.0, &one, &["`id` is missing"]);
        fails(&echo("[1]"), 10.0, &one, &["expected a JSON object"]);
        let twice = "import sys\nsys.stdin.readline()\nprint('{\"id\": \"a\", \"reward\": 1}')\nprint('{\"id\": \"a\", \"reward\": 1}')\nsys.stdout.flush()\nimport time; time.sleep(5)";
        fails(
            twice,
            10.0,
            &[req("a", "", ""), req("b", "", "")],
            &["\"a\" was already answered"],
        );
    }

    fn sh(src: &str, timeout_s: f64) -> CommandReward {
        CommandReward::new(vec!["sh".into(), "-c".into(), src.into()], timeout_s).unwrap()
    }

    /// Whether process `pid` is gone (or a zombie nobody has reaped yet).
    fn gone(pid: &str) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    #[track_caller]
    fn assert_gone_soon(pid: &str) {
        let until = Instant::now() + Duration::from_secs(3);
        while !gone(pid) {
            assert!(Instant::now() < until, "process {pid} outlived its reward");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_program_that_closes_stdout_is_bounded_by_the_timeout() {
        let mut c = sh("exec 1>&-; sleep 30", 10.0);
        let t = Instant::now();
        let e = c.score(&[req("a", "", "")]).unwrap_err().to_string();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert!(e.contains("closed its stdout"), "{e}");
        let mut c = sh("exec 1>&-; sleep 30", 0.5);
        let t = Instant::now();
        c.score(&[req("a", "", "")]).unwrap_err();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "took {:?}",
            t.elapsed()
        );
    }

    #[test]
    fn what_the_program_starts_dies_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        // On a timeout.
        let src = format!("sleep 60 & echo $! > {}; sleep 60", pidfile.display());
        let mut c = sh(&src, 0.5);
        c.score(&[req("a", "", "")]).unwrap_err();
        assert_gone_soon(std::fs::read_to_string(&pidfile).unwrap().trim());
        // At drop, after a well-behaved exchange.
        let src = format!(
            "sleep 60 & echo $! > {}; read l; echo '{{\"id\": \"a\", \"reward\": 1}}'; sleep 60",
            pidfile.display()
        );
        let mut c = sh(&src, 10.0);
        assert_eq!(c.score(&[req("a", "", "")]).unwrap(), vec![1.0]);
        let pid = std::fs::read_to_string(&pidfile).unwrap();
        assert!(!gone(pid.trim()));
        drop(c);
        assert_gone_soon(pid.trim());
    }

    #[test]
    fn an_endless_line_is_refused_at_the_cap() {
        let mut c = py(
            "import sys, time\nsys.stdin.readline()\nsys.stdout.write('x' * (3 << 20))\nsys.stdout.flush()\ntime.sleep(30)",
            10.0,
        );
        let t = Instant::now();
        let e = c.score(&[req("a", "", "")]).unwrap_err().to_string();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert!(e.contains("1048576 bytes (1 MiB)"), "{e}");
    }

    #[test]
    fn bad_setup_is_refused() {
        let e = CommandReward::new(vec!["/nonexistent/reward-prog".into()], 1.0)
            .unwrap()
            .score(&[req("a", "", "")]);
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/reward-prog") && e.contains("could not be started"),
            "{e}"
        );
        assert!(CommandReward::new(vec![], 1.0).is_err());
        assert!(CommandReward::new(vec!["x".into()], 0.0).is_err());
        let mut c = py(GOOD, 1.0);
        assert!(c
            .score(&[req("a", "", ""), req("a", "", "")])
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }
}
