//! Multi-process tensor parallelism through the real `rollplex-run` binary (`--tp-check`): the
//! binary as its own launcher (one process per GPU of a 2-GPU CPU plan) and as ranks started
//! torchrun-style with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; the ranks agree bitwise; a rank
//! killed with SIGKILL ends the job within seconds with a message naming it, never a hang.
//! Every process these tests start is killed by a guard if the test fails.

#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rollplex-run");

/// The tiny model on 2 CPU pseudo-GPUs with rollout and training TP 2.
const PIPELINE: &str = r#"
pipeline tp2 {
    seed = 3
    gpu { preset = cpu, count = 2 }
    model actor { preset = tiny, weights = random(seed = 7) }
    rollout {
        tp = 2
        prompts = 2
        group = 2
        media = image(size = 56x56)
        text_tokens = 16
        max_new_tokens = 2
        response_length = fixed(tokens = 2)
    }
    reward = builtin("choice_letter")
    train {
        tp = 2
        algorithm = grpo { clip = 0.2 }
        optimizer = adamw(lr = 1e-3)
        micro_batch = 2
    }
    schedule { mode = serial }
}
"#;

struct NoFiles;
impl rollplex_dsl::Env for NoFiles {
    fn read_file(&self, path: &str) -> Result<String, String> {
        Err(format!("no files here ({path})"))
    }
}

/// [`PIPELINE`] made to train from the first iteration although its synthetic prompts earn no
/// reward: weight decay moves the weights at every step, then the KL term against the
/// reference gives a gradient; 3 tokens per response, so decode steps run over the KV arena.
fn training_pipeline() -> String {
    let s = PIPELINE.replace(
        "algorithm = grpo { clip = 0.2 }",
        "algorithm = grpo { clip = 0.2, kl_coef = 0.05 }",
    );
    let s = s.replace(
        "optimizer = adamw(lr = 1e-3)",
        "optimizer = adamw(lr = 1e-3, weight_decay = 0.1)",
    );
    let s = s.replace("max_new_tokens = 2", "max_new_tokens = 3");
    s.replace(
        "response_length = fixed(tokens = 2)",
        "response_length = fixed(tokens = 3)",
    )
}

/// The TP=2 plan, compiled once per test into its own temp dir.
fn plan_file(dir: &Path) -> PathBuf {
    plan_file_of(dir, PIPELINE)
}

fn plan_file_of(dir: &Path, src: &str) -> PathBuf {
    let checked = rollplex_dsl::compile_source("tp2.rpx", src, &NoFiles)
        .unwrap_or_else(|d| panic!("{}", d.render("tp2.rpx", src, false)));
    let plan = rollplex_compiler::compile(&checked.spec, &Default::default())
        .expect("the TP=2 CPU pipeline compiles")
        .plan;
    assert_eq!((plan.target.count, plan.parallel.rollout_tp), (2, 2));
    let path = dir.join("tp2.plan");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

/// `rollplex-run` with the launcher variables of the test's own environment removed.
fn command(plan: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg(plan);
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "ROLLPLEX_TP_LAUNCHED",
    ] {
        c.env_remove(v);
    }
    c
}

/// Kills a started process when the test ends early.
struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_with_timeout(mut c: Command, limit: Duration) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let id = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| {
            kill9(id);
            panic!("rollplex-run {id} did not finish within {limit:?}")
        })
        .unwrap()
}

extern "C" {
    /// POSIX kill(2), from the C library every Rust program on unix links.
    fn kill(pid: i32, sig: i32) -> i32;
}

/// SIGKILL to a process this test started (directly or through the launcher).
fn kill9(pid: u32) {
    // SAFETY: kill(2) takes plain integers; the pid is one of this test's processes
    let rc = unsafe { kill(pid as i32, 9) };
    assert_eq!(rc, 0, "kill -9 {pid}");
}

/// Reads `child`'s stderr on a thread; lines arrive on the returned channel.
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits for a line containing `what`, collecting every line into `seen`.
fn wait_for(rx: &mpsc::Receiver<String>, what: &str, seen: &mut Vec<String>) -> String {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            seen.push(l.clone());
            if l.contains(what) {
                return l;
            }
        }
    }
    panic!(
        "no line with {what:?} within 60 s; saw:\n{}",
        seen.join("\n")
    );
}

fn pid_in(line: &str) -> u32 {
    line.rsplit("pid ").next().unwrap().trim().parse().unwrap()
}

#[test]
fn the_launcher_starts_one_rank_per_gpu_and_they_agree() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path());
    let mut c = command(&plan);
    c.arg("--tp-check=2");
    let out = run_with_timeout(c, Duration::from_secs(120));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(
        se.contains("rank 0 of 2 started") && se.contains("rank 1 of 2 started"),
        "{se}"
    );
    assert!(
        se.contains("[rank 0] rollplex-tp: rank 0 listening on 127.0.0.1:"),
        "{se}"
    );
    assert!(
        se.contains("[rank 1] rollplex-tp: rank 1 joined the group of 2"),
        "{se}"
    );
    assert!(so.contains("[rank 1] tp-check: rank 1 agrees"), "{so}");
    let line = so
        .lines()
        .find(|l| l.starts_with("[rank 0] tp-check: 2 ranks over TCP"))
        .unwrap_or_else(|| panic!("{so}"));
    assert!(
        line.contains("ranks agree bitwise") && line.contains("2 rounds"),
        "{line}"
    );
    assert!(line.contains("greedy tokens equal TP=1"), "{line}");
    // the TP logits are within the TP tests' tolerance of TP=1 (docs/tp.md: 2e-5)
    let err: f64 = line
        .split("max |logit - TP=1| ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(err < 2e-5, "{line}");
    assert!(so.contains("tp-check passed on 2 ranks"), "{so}");
}

#[test]
fn a_killed_rank_ends_the_launched_job_within_seconds_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path());
    let mut c = command(&plan);
    // enough rounds to run for minutes: only the kill can end it in time
    c.arg("--tp-check=10000000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut g = Guard(c.spawn().unwrap());
    let rx = stderr_lines(&mut g.0);
    let mut seen = Vec::new();
    let started = wait_for(&rx, "rank 1 of 2 started", &mut seen);
    wait_for(&rx, "[rank 1] rollplex-tp: rank 1 joined", &mut seen);
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    kill9(pid_in(&started));
    let status = loop {
        if let Some(s) = g.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the launcher still runs 10 s after rank 1 was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    while let Ok(l) = rx.recv_timeout(Duration::from_millis(500)) {
        seen.push(l);
    }
    let all = seen.join("\n");
    assert!(!status.success(), "{all}");
    assert!(took < Duration::from_secs(5), "took {took:?}\n{all}");
    assert!(
        all.contains(
            "error: rank 1 was killed by signal 9 (SIGKILL); the other ranks were stopped"
        ),
        "{all}"
    );
    // rank 0 saw its peer's connection close and named it
    assert!(
        all.contains("[rank 0] error: rank 0: tensor-parallel rank 1 failed"),
        "{all}"
    );
}

#[test]
fn torchrun_style_ranks_join_and_a_dead_rank_0_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path());
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let rank = |r: usize, port: u16, rounds: &str| {
        let mut c = command(&plan);
        c.arg(format!("--tp-check={rounds}"))
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", r.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    // rank 1 first: it retries until rank 0 listens
    let port = free_port();
    let r1 = std::thread::spawn({
        let c = rank(1, port, "2");
        move || run_with_timeout(c, Duration::from_secs(120))
    });
    std::thread::sleep(Duration::from_millis(300));
    let o0 = run_with_timeout(rank(0, port, "2"), Duration::from_secs(120));
    let o1 = r1.join().unwrap();
    let s0 = String::from_utf8_lossy(&o0.stdout);
    let s1 = String::from_utf8_lossy(&o1.stdout);
    assert!(
        o0.status.success() && o1.status.success(),
        "{s0}\n{s1}\n{}",
        String::from_utf8_lossy(&o1.stderr)
    );
    assert!(s0.contains("ranks agree bitwise"), "{s0}");
    assert!(s1.contains("rank 1 agrees"), "{s1}");

    // rank 0 killed mid-run: rank 1 ends within seconds with the peer-failure status, naming it
    let port = free_port();
    let mut g0 = Guard(
        rank(0, port, "10000000")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut g1 = Guard(
        rank(1, port, "10000000")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let rx1 = stderr_lines(&mut g1.0);
    let mut seen = Vec::new();
    wait_for(&rx1, "rank 1 joined the group of 2", &mut seen);
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    kill9(g0.0.id());
    let _ = g0.0.wait();
    let status = loop {
        if let Some(s) = g1.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rank 1 still runs 10 s after rank 0 died"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    while let Ok(l) = rx1.recv_timeout(Duration::from_millis(500)) {
        seen.push(l);
    }
    let all = seen.join("\n");
    assert_eq!(status.code(), Some(3), "{all}");
    assert!(took < Duration::from_secs(5), "took {took:?}\n{all}");
    assert!(
        all.contains("error: rank 1: tensor-parallel rank 0 failed"),
        "{all}"
    );
}

#[test]
fn bad_launch_variables_are_refused_with_the_variable_named() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path());
    let mut c = command(&plan);
    c.arg("--tp-check").env("RANK", "1");
    let out = run_with_timeout(c, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(se.contains("RANK is set but WORLD_SIZE is not"), "{se}");
    let mut c = command(&plan);
    c.arg("--tp-check")
        .env("RANK", "0")
        .env("WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1");
    let out = run_with_timeout(c, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        se.contains("WORLD_SIZE=4 but the plan runs on 2 GPUs"),
        "{se}"
    );
}

/// The metrics lines of a run without the wall-clock and memory fields.
fn metrics_without_times(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            m.retain(|k, _| !rollplex_runtime::metrics::is_measurement(k));
            v
        })
        .collect()
}

#[test]
fn training_over_launched_processes_is_bitwise_the_threaded_run() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file_of(dir.path(), &training_pipeline());
    let run = |out: &str, processes: bool| {
        let mut c = command(&plan);
        c.args(["--iterations", "3", "-q", "--out"])
            .arg(dir.path().join(out));
        if processes {
            c.arg("--tp-processes");
        }
        let o = run_with_timeout(c, Duration::from_secs(120));
        let (so, se) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "stdout:\n{so}\nstderr:\n{se}");
        (so.to_string(), se.to_string())
    };
    let (_, se) = run("processes", true);
    assert!(se.contains("rank 1 of 2 started"), "{se}");
    run("threads", false);
    let (p, t) = (
        metrics_without_times(&dir.path().join("processes")),
        metrics_without_times(&dir.path().join("threads")),
    );
    assert_eq!(p.len(), 3, "rank 0 alone writes one line per iteration");
    // the run trains: a KL and a gradient from the second iteration on
    assert!(p[2]["kl"].as_f64().unwrap() > 0.0, "{:?}", p[2]);
    assert!(p[2]["grad_norm"].as_f64().unwrap() > 0.0, "{:?}", p[2]);
    // every number (losses, KL, entropy of the sampled tokens, grad norms) is bitwise equal:
    // TcpComm reduces in rank order as ThreadComm does
    assert_eq!(p, t);
}

#[test]
fn a_training_rank_that_fails_ends_the_launched_job_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file_of(dir.path(), &training_pipeline());
    // rank 0 alone writes the output directory: a file in its place fails rank 0 only, after
    // the group formed; rank 1 stops because of it (status 3) and the launcher names rank 0
    let out = dir.path().join("not-a-dir");
    std::fs::write(&out, "x").unwrap();
    let mut c = command(&plan);
    c.args(["--iterations", "2", "-q", "--tp-processes", "--out"])
        .arg(&out);
    let o = run_with_timeout(c, Duration::from_secs(120));
    let se = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{se}");
    assert!(se.contains("error: rank 0 exited with status 1"), "{se}");
    assert!(
        se.contains("[rank 1] error: tensor-parallel rank 1: tensor-parallel rank 0 failed")
            && se.contains("not-a-dir"),
        "{se}"
    );
}

#[test]
fn launched_processes_checkpoint_and_resume_as_the_threaded_run() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file_of(dir.path(), &training_pipeline());
    let run = |out: &str, iterations: &str, processes: bool, resume: bool| {
        let mut c = command(&plan);
        c.args([
            "--iterations",
            iterations,
            "-q",
            "--save-every",
            "1",
            "--keep-checkpoints",
            "0",
            "--out",
        ])
        .arg(dir.path().join(out));
        if processes {
            c.arg("--tp-processes");
        }
        if resume {
            c.arg("--resume").arg(dir.path().join(out));
        }
        let o = run_with_timeout(c, Duration::from_secs(120));
        assert!(
            o.status.success(),
            "stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    // threads, 3 iterations; processes, 2 then each rank resumes from the checkpoint to 3
    run("threads", "3", false, false);
    run("processes", "2", true, false);
    run("processes", "3", true, true);
    let (p, t) = (
        metrics_without_times(&dir.path().join("processes")),
        metrics_without_times(&dir.path().join("threads")),
    );
    assert_eq!(p.len(), 3, "the resumed run appends to metrics.jsonl");
    assert_eq!(p, t);
    for k in 1..=3 {
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let at = |out: &str| {
                std::fs::read(
                    dir.path()
                        .join(out)
                        .join(format!("checkpoints/iter-{k:08}/{f}")),
                )
                .unwrap()
            };
            assert!(at("processes") == at("threads"), "{f} after iteration {k}");
        }
    }
}
