//! `--save-every` / `--resume` on the CPU backend, through `rollplex-run`'s library entry
//! (`cli::run`): a run of 6 iterations and a run of 3 resumed to 6 give the same metrics
//! (timings aside) and bitwise the same weights and optimizer state; checkpoints are complete,
//! the newest K are kept, and a missing, corrupt or foreign checkpoint is refused with a
//! message naming it before anything is written.

mod common;

use std::path::{Path, PathBuf};

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::cli::{self, BackendChoice, RunArgs};

/// tests/in/e2e/overlap_small.rpx compiled in `mode`.
fn compile(mode: Mode) -> Plan {
    common::compile("overlap_small.rpx", &common::overlap_small(), mode)
}

fn write_plan(plan: &Plan, path: &Path) {
    std::fs::write(path, rollplex_plan::encode(plan, "tests").unwrap()).unwrap();
}

fn args(plan: &Path, out: &Path, iterations: u32) -> RunArgs {
    common::run_args(plan, BackendChoice::Cpu, out, iterations)
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn ckpt(out: &Path, k: u32) -> PathBuf {
    out.join(format!("checkpoints/iter-{k:08}"))
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Writes `plan` into `dir`, runs it for `total` iterations into `dir/a`, and for `first` into
/// `dir/b`, resumed from there (its newest complete checkpoint) to `total`. Returns the plan's
/// path and the two output directories.
fn run_and_resume(
    dir: &common::Scratch,
    plan: &Plan,
    first: u32,
    total: u32,
) -> (PathBuf, PathBuf, PathBuf) {
    let plan_path = dir.path().join("plan.bin");
    write_plan(plan, &plan_path);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cli::run(&args(&plan_path, &a, total)).expect("uninterrupted run");
    cli::run(&args(&plan_path, &b, first)).expect("first part");
    let mut resume = args(&plan_path, &b, total);
    resume.resume = Some(b.clone());
    cli::run(&resume).expect("resumed run");
    (plan_path, a, b)
}

#[test]
fn three_plus_resume_to_six_equals_six_bitwise() {
    let dir = common::Scratch::new("resume-bitwise");
    let plan = compile(Mode::Overlap);
    let (plan_path, a, b) = run_and_resume(&dir, &plan, 3, 6);

    let (ma, mb) = (
        common::metrics_without_times(&a),
        common::metrics_without_times(&b),
    );
    let its: Vec<u64> = mb
        .iter()
        .map(|m| m["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(
        its,
        vec![0, 1, 2, 3, 4, 5],
        "metrics.jsonl continues the iteration numbers"
    );
    assert_eq!(ma, mb, "metrics of 6 vs 3 + resume to 6 (timings aside)");
    assert!(
        ma.iter().all(|m| m["optimizer_steps"].as_u64() > Some(0)),
        "every iteration trained"
    );
    assert_ne!(
        ma[0]["loss"], ma[5]["loss"],
        "the iterations differ from one another"
    );

    // Keep the newest 2, and the final state is bitwise the same.
    let want = vec!["iter-00000005".to_string(), "iter-00000006".to_string()];
    assert_eq!(checkpoints(&a), want);
    assert_eq!(checkpoints(&b), want);
    for f in ["model.safetensors", "optimizer.safetensors", "config.json"] {
        assert!(
            read(ckpt(&a, 6).join(f)) == read(ckpt(&b, 6).join(f)),
            "{f} of iteration 6 differs between the runs"
        );
    }
    // The weights load with the model's own loader (HF layout) and are the trained ones.
    let model = rollplex_runtime::model::Qwen25VL::load(&ckpt(&a, 6)).expect("HF layout loads");
    let init = rollplex_runtime::exec::build_cpu_models(&plan.spec).unwrap();
    assert_eq!(model.weights.data.len(), init.actor().weights.data.len());
    assert!(
        model.weights.data != init.actor().weights.data,
        "training changed the weights"
    );

    // Resuming a finished run does nothing and changes nothing.
    let before = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    let mut again = args(&plan_path, &b, 6);
    again.resume = Some(ckpt(&b, 6));
    cli::run(&again).expect("nothing to do is not an error");
    assert_eq!(
        std::fs::read_to_string(b.join("metrics.jsonl")).unwrap(),
        before
    );
}

/// A plan that streams its optimizer state through the device in chunks (`optimizer_state =
/// stream`): 2 iterations resumed to 4 end with bitwise the checkpoint of 4 in one run, and
/// that checkpoint's weights and optimizer state are bitwise those of the in-HBM plan's.
#[test]
fn a_streamed_optimizer_state_resumes_bitwise() {
    let src = common::with_host_memory(&common::overlap_small());
    let plan_of = |choice: &str| {
        let src = common::in_train(&src, &format!("optimizer_state = {choice}"));
        common::compile("overlap_small.rpx", &src, Mode::Overlap)
    };
    let streamed = plan_of("stream");
    assert!(streamed.optimizer_stream.is_some(), "streamed");
    let dir = common::Scratch::new("resume-streamed");
    let (_, a, b) = run_and_resume(&dir, &streamed, 2, 4);
    let in_hbm = plan_of("hbm");
    assert!(in_hbm.optimizer_stream.is_none());
    let hbm_path = dir.path().join("hbm.bin");
    write_plan(&in_hbm, &hbm_path);
    let c = dir.path().join("c");
    cli::run(&args(&hbm_path, &c, 4)).expect("in-HBM run");
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let want = read(ckpt(&a, 4).join(f));
        assert!(
            read(ckpt(&b, 4).join(f)) == want,
            "{f} of iteration 4 differs between the streamed runs"
        );
        assert!(
            read(ckpt(&c, 4).join(f)) == want,
            "{f} of iteration 4 differs between the streamed and the in-HBM plan"
        );
    }
}

/// Runs `args` and returns its error, which must be a user error (exit 1).
fn refused(a: &RunArgs) -> String {
    let e = cli::run(a).expect_err("must be refused");
    assert!(e.is_user_error(), "exit 1, not an internal error: {e}");
    e.to_string()
}

#[test]
fn bad_checkpoints_are_refused_with_a_clear_message() {
    let dir = common::Scratch::new("resume-refused");
    let plan = compile(Mode::Overlap);
    let plan_path = dir.path().join("plan.bin");
    write_plan(&plan, &plan_path);
    let src = dir.path().join("src");
    cli::run(&args(&plan_path, &src, 1)).expect("one iteration");
    let good = ckpt(&src, 1);
    assert!(good.join("run_state.json").is_file());
    // No temporary directories are left next to a checkpoint.
    assert_eq!(checkpoints(&src), vec!["iter-00000001".to_string()]);

    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("metrics.jsonl"), "{\"iteration\":0}\n").unwrap();
    let resume_from = |p: &Path| {
        let mut a = args(&plan_path, &out, 3);
        a.resume = Some(p.to_path_buf());
        a
    };
    let untouched = || {
        assert_eq!(
            std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(),
            "{\"iteration\":0}\n",
            "a refused resume writes nothing"
        );
        assert!(!out.join("checkpoints").exists());
    };

    let e = refused(&resume_from(&dir.path().join("nowhere")));
    assert!(
        e.contains("nowhere") && e.contains("no such directory"),
        "{e}"
    );
    let e = refused(&resume_from(&out));
    assert!(e.contains("no complete checkpoint"), "{e}");
    untouched();

    // A flipped byte in the weights.
    let bad = dir.path().join("bad");
    copy_dir(&good, &bad);
    let mut w = read(bad.join("model.safetensors"));
    let n = w.len() - 5;
    w[n] ^= 0x40;
    std::fs::write(bad.join("model.safetensors"), &w).unwrap();
    let e = refused(&resume_from(&bad));
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt"),
        "{e}"
    );
    untouched();

    // A truncated optimizer file.
    copy_dir(&good, &bad);
    let o = read(bad.join("optimizer.safetensors"));
    std::fs::write(bad.join("optimizer.safetensors"), &o[..o.len() / 2]).unwrap();
    let e = refused(&resume_from(&bad));
    assert!(
        e.contains("optimizer.safetensors") && e.contains("corrupt"),
        "{e}"
    );

    // A missing manifest: not a checkpoint.
    copy_dir(&good, &bad);
    std::fs::remove_file(bad.join("run_state.json")).unwrap();
    let e = refused(&resume_from(&bad));
    assert!(e.contains("no complete checkpoint"), "{e}");

    // Another plan (the serial plan of the same pipeline) is refused by its hash.
    let serial_path = dir.path().join("serial.bin");
    write_plan(&compile(Mode::Serial), &serial_path);
    let mut a = resume_from(&good);
    a.plan = serial_path;
    let e = refused(&a);
    assert!(e.contains("another plan"), "{e}");
    untouched();
}

fn copy_dir(from: &Path, to: &Path) {
    if to.exists() {
        std::fs::remove_dir_all(to).unwrap();
    }
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// A disaggregated run (its rollout on its own copy of the actor) resumes bitwise too: the copy
/// is rebuilt from the checkpoint's weights.
#[test]
fn a_disaggregated_run_resumes_bitwise() {
    let dir = common::Scratch::new("resume-disaggregated");
    let src = common::overlap_small();
    assert!(src.contains("count = 1"), "the test edits the GPU count");
    let src = src.replacen("count = 1", "count = 2", 1);
    let plan = common::compile("overlap_small.rpx", &src, Mode::Disaggregated);
    assert_eq!(plan.gpus.len(), 2, "a rollout and a training GPU program");
    let (_, a, b) = run_and_resume(&dir, &plan, 2, 3);
    let (ma, mb) = (
        common::metrics_without_times(&a),
        common::metrics_without_times(&b),
    );
    assert_eq!(ma.len(), 3);
    assert_eq!(ma, mb, "metrics of 3 vs 2 + resume to 3 (timings aside)");
    assert!(
        read(ckpt(&a, 3).join("model.safetensors")) == read(ckpt(&b, 3).join("model.safetensors")),
        "the final weights differ between the runs"
    );
}
