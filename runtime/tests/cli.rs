//! `rollplex-run` as a user runs it: a bad command line is a user error (exit 1, as in
//! `rollplexc`), `--help` exits 0, and files that are not regular files are refused, never read.

#![cfg(unix)]

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_rollplex-run");

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("rollplex-run runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn usage_errors_exit_1_and_help_exits_0() {
    for args in [
        &["plan.bin", "--iterations", "-1"][..],
        &["plan.bin", "--iteratons", "3"],
        &["plan.bin", "--backend", "tpu"],
        &[],
    ] {
        let (code, err) = run(args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains("error:"), "{args:?}: {err}");
    }
    assert_eq!(run(&["--help"]).0, 0);
    assert_eq!(run(&["--version"]).0, 0);
}

/// `rollplex-run plot` says what is wrong with the directory it is given (exit 1), and takes
/// none of a run's flags.
#[test]
fn plot_errors_are_user_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run(&["plot", dir.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("metrics.jsonl") && err.contains("--out directory"),
        "{err}"
    );
    let (code, err) = run(&["plot", "run", "--iterations", "3"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(run(&["plot", "--help"]).0, 0);
}

#[test]
fn a_plan_that_is_not_a_regular_file_is_refused() {
    let (code, err) = run(&["/dev/zero", "--backend", "sim"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("/dev/zero") && err.contains("not a regular file"),
        "{err}"
    );
}

/// The tiny example (synthetic prompts, one GPU program), compiled into `dir`.
fn tiny_plan(dir: &std::path::Path) -> std::path::PathBuf {
    let src = include_str!("../../examples/tiny.rpx").replacen(
        "generated(\"moving_shapes\", 4096)",
        "synthetic",
        1,
    );
    let checked = rollplex_dsl::compile_source("tiny.rpx", &src, &rollplex_dsl::NoFiles)
        .unwrap_or_else(|d| panic!("{}", d.render("tiny.rpx", &src, false)));
    let plan = rollplex_compiler::compile(&checked.spec, &Default::default())
        .expect("the tiny pipeline compiles")
        .plan;
    let path = dir.join("tiny.plan");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

/// A reader that closes stdout after the first line (`rollplex-run ... | head -1`) ends the run
/// by SIGPIPE, as it ends other Unix tools: no panic message, no exit code 101.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let mut child = Command::new(BIN)
        .arg(&plan)
        .args(["--backend", "cpu", "--iterations", "100000", "--out"])
        .arg(dir.path().join("out"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("rollplex-run:"), "{first}");
    // the reader is gone: the next line the run prints meets a closed pipe
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Kills a started process when the test ends early.
struct Guard(std::process::Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A second run given the first one's `--out` stops at once with a message (the first keeps
/// its files); SIGTERM stops the first at the next iteration boundary with a checkpoint there.
#[test]
fn one_run_per_output_directory_and_a_signal_saves_a_checkpoint() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let out = dir.path().join("out");
    let run_args = |c: &mut Command| {
        c.arg(&plan)
            .args([
                "--backend",
                "cpu",
                "--iterations",
                "100000",
                "--save-every",
                "100000",
            ])
            .args(["--quiet", "--out"])
            .arg(&out);
    };
    let mut first = Command::new(BIN);
    run_args(&mut first);
    let mut first = Guard(
        first
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starts"),
    );
    let metrics = out.join("metrics.jsonl");
    let until = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 1 {
        assert!(Instant::now() < until, "no iteration finished in 60 s");
        assert!(first.0.try_wait().unwrap().is_none(), "the first run ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut second = Command::new(BIN);
    run_args(&mut second);
    let o = second.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("another running rollplex-run"), "{err}");
    assert!(
        first.0.try_wait().unwrap().is_none(),
        "the first run goes on"
    );

    // SAFETY: kill(2) on the child this test started.
    unsafe {
        libc::kill(first.0.id() as libc::pid_t, libc::SIGTERM);
    }
    let until = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = first.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "SIGTERM did not stop the run");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(first.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(
        err.contains("stopped by a signal after") && err.contains("checkpoint"),
        "{err}"
    );
    let done = std::fs::read_to_string(&metrics).unwrap().lines().count();
    let ckpt = out.join(format!("checkpoints/iter-{done:08}"));
    assert!(ckpt.join("run_state.json").is_file(), "{err}");
}
