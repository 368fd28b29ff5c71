//! `rollplexc` as a user runs it: exit codes, files written whole or not at all, `explain`
//! byte-identical to `--emit-yaml`, `--help` everywhere.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rollplexc"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace")
        .to_path_buf()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rollplexc-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn run(cmd: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("rollplexc runs");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into(),
        String::from_utf8_lossy(&stderr).into(),
    )
}

#[test]
fn compile_explain_round_trip() {
    let d = tmp("roundtrip");
    let (bin_path, yaml) = (d.join("plan.bin"), d.join("plan.yaml"));
    let (code, _, err) = run(bin()
        .arg(root().join("examples/tiny.rpx"))
        .arg("-o")
        .arg(&bin_path)
        .arg("--emit-yaml")
        .arg(&yaml)
        .arg("--stats"));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("ilp ["), "--stats prints the ILP: {err}");
    let (code, out, err) = run(bin().arg("explain").arg(&bin_path));
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.as_bytes(),
        std::fs::read(&yaml).expect("yaml written").as_slice()
    );
    assert!(
        !std::fs::read_dir(&d).expect("dir").any(|e| e
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .contains(".tmp")),
        "no temporary files left"
    );
}

#[test]
fn user_errors_exit_1_with_located_diagnostics() {
    let d = tmp("user");
    let bad = d.join("bad.rpx");
    std::fs::write(&bad, "pipeline p {\n    gpu { preset = H200 }\n    rollout { prompts = 3, group = 4, max_new_tokens = 8 }\n    train { micro_batch = 5 }\n}\n").expect("write");
    let out = d.join("plan.bin");
    std::fs::write(&out, b"old").expect("write");
    let (code, _, err) = run(bin().arg(&bad).arg("-o").arg(&out));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("bad.rpx:"),
        "diagnostics name the file and line: {err}"
    );
    assert_eq!(
        std::fs::read(&out).expect("still there"),
        b"old",
        "a failed compile leaves the old output alone"
    );
    let (code, _, err) = run(bin().arg("check").arg(&bad));
    assert_eq!(code, 1, "{err}");
}

#[test]
fn corrupted_plan_is_a_clear_error() {
    let d = tmp("corrupt");
    let p = d.join("plan.bin");
    let (code, _, err) = run(bin()
        .arg(root().join("examples/tiny.rpx"))
        .arg("-o")
        .arg(&p));
    assert_eq!(code, 0, "{err}");
    let mut bytes = std::fs::read(&p).expect("plan");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&p, &bytes).expect("write");
    let (code, out, err) = run(bin().arg("explain").arg(&p));
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("checksum"), "{err}");
    let (code, _, err) = run(bin().arg("explain").arg(root().join("examples/tiny.rpx")));
    assert_eq!(code, 1);
    assert!(err.contains("not a Rollplex plan"), "{err}");
}

#[test]
fn unwritable_output_is_a_user_error() {
    let d = tmp("unwritable");
    let (code, _, err) = run(bin()
        .arg(root().join("examples/tiny.rpx"))
        .arg("-o")
        .arg(d.join("missing/dir/plan.bin")));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot write"), "{err}");
}

#[test]
fn help_everywhere_and_usage_errors() {
    for args in [
        vec!["--help"],
        vec!["compile", "--help"],
        vec!["check", "--help"],
        vec!["explain", "--help"],
        vec!["diff", "--help"],
        vec!["--version"],
    ] {
        let (code, out, err) = run(bin().args(&args));
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(!out.is_empty(), "{args:?}");
    }
    let (code, _, _) = run(bin().arg("--no-such-flag"));
    assert_eq!(code, 1);
    let (code, _, err) = run(bin().arg(root().join("examples/tiny.rpx")));
    assert_eq!(code, 1, "nothing to write is an error: {err}");
}

#[test]
fn outputs_never_overwrite_an_input_or_each_other() {
    let d = tmp("clobber");
    let src = d.join("p.rpx");
    let text = std::fs::read(root().join("examples/tiny.rpx")).expect("example");
    std::fs::write(&src, &text).expect("write");
    let hard = d.join("hard.rpx");
    std::fs::hard_link(&src, &hard).expect("hard link");
    let plan = d.join("plan.bin");
    let cases: Vec<(Vec<std::ffi::OsString>, &str)> = vec![
        (
            vec!["-o".into(), src.clone().into()],
            "would overwrite the input",
        ),
        (
            vec!["--emit-yaml".into(), src.clone().into()],
            "would overwrite the input",
        ),
        (
            vec!["-o".into(), hard.clone().into()],
            "would overwrite the input",
        ),
        (
            vec!["-o".into(), d.join(".").join("p.rpx").into()],
            "would overwrite the input",
        ),
        (
            vec![
                "-o".into(),
                plan.clone().into(),
                "--emit-yaml".into(),
                d.join("./plan.bin").into(),
            ],
            "are the same file",
        ),
    ];
    for (args, needle) in cases {
        let (code, _, err) = run(bin().arg(&src).args(&args));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(std::fs::read(&src).expect("source"), text, "{args:?}");
        assert!(!plan.exists(), "nothing written: {args:?}");
    }
    let (code, _, err) = run(bin().arg("merge-profiles").arg(&src).arg("-o").arg(&src));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("would overwrite the input"), "{err}");
    assert_eq!(std::fs::read(&src).expect("source"), text);
}

#[test]
fn only_regular_files_are_read_and_bad_utf8_is_located() {
    let d = tmp("special");
    let (code, _, err) = run(bin().arg("check").arg("/dev/zero"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    let (code, _, err) = run(bin().arg("explain").arg("/dev/zero"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    let fifo = d.join("fifo.rpx");
    if Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        let (code, _, err) = run(bin().arg("check").arg(&fifo));
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("a FIFO"), "{err}");
    }
    let bad = d.join("bad.rpx");
    std::fs::write(
        &bad,
        b"pipeline p {\n    gpu { preset = \"H\xc3\xa9\xff\" }\n}\n",
    )
    .expect("write");
    let (code, _, err) = run(bin().arg("check").arg(&bad));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("bad.rpx:2:23:"),
        "line and column of the bad byte: {err}"
    );
    assert!(err.contains("0xff"), "{err}");
}
