//! `--eval-every` on the CPU backend, through `rollplex-run`'s library entry (`cli::run`): the
//! held-out split is scored greedy and sampled every K iterations into metrics.jsonl, the state
//! with the best greedy score is kept in `checkpoints/best` beside the pruned `iter-<k>` ones,
//! and a run resumed midway ends with the same scores and the same best checkpoint, bit for bit.

mod common;

use std::path::{Path, PathBuf};

use rollplex_runtime::cli::{self, BackendChoice, RunArgs};

/// examples/tiny.rpx (the moving-shapes task, which has a held-out split), compiled into `dir`.
fn tiny_plan(dir: &Path) -> PathBuf {
    let src = common::repo_file("examples/tiny.rpx");
    let plan = common::compile_spec(&common::spec("tiny.rpx", &src), &Default::default());
    let path = dir.join("tiny.plan");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

fn args(plan: &Path, out: &Path, iterations: u32) -> RunArgs {
    RunArgs {
        keep_checkpoints: 1,
        eval: 16,
        eval_every: 2,
        ..common::run_args(plan, BackendChoice::Cpu, out, iterations)
    }
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The best checkpoint's iterations done and scores, from its run state.
fn best_of(out: &Path) -> (u64, serde_json::Value) {
    let state = rollplex_runtime::ckpt_state::load_run_state(out.join("checkpoints/best"))
        .expect("an intact best checkpoint");
    (state.iteration, state.extra["validation"].clone())
}

#[test]
fn validation_scores_keep_the_best_checkpoint_and_survive_a_resume() {
    let dir = common::Scratch::new("eval-every");
    let plan = tiny_plan(dir.path());
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cli::run(&args(&plan, &a, 6)).expect("uninterrupted run");

    // Scores after iterations 2, 4 and 6, on the lines of iterations 1, 3 and 5.
    let metrics = common::metrics_without_times(&a);
    assert_eq!(metrics.len(), 6);
    let mut scored = Vec::new();
    for m in &metrics {
        let it = m["iteration"].as_u64().unwrap();
        let (g, s) = (&m["val_reward_greedy"], &m["val_reward_sampled"]);
        if (it + 1) % 2 == 0 {
            let (g, s) = (g.as_f64().unwrap(), s.as_f64().unwrap());
            assert!((0.0..=1.0).contains(&g) && (0.0..=1.0).contains(&s), "{m}");
            assert_eq!(m["val_prompts"], 16);
            scored.push((it + 1, g, s));
        } else {
            assert!(
                g.is_null() && s.is_null(),
                "iteration {it} is not scored: {m}"
            );
        }
    }
    assert_eq!(scored.len(), 3);

    // The best is the first of the highest greedy scores; pruning to 1 keeps it.
    let top = scored
        .iter()
        .fold(scored[0], |b, x| if x.1 > b.1 { *x } else { b });
    let (at, scores) = best_of(&a);
    assert_eq!(at, top.0);
    assert_eq!(scores["greedy"].as_f64(), Some(top.1));
    assert_eq!(scores["sampled"].as_f64(), Some(top.2));
    let mut names: Vec<String> = std::fs::read_dir(a.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["best", "iter-00000006"]);
    // The best checkpoint is a checkpoint: its weights load in Hugging Face layout.
    rollplex_runtime::model::Qwen25VL::load(&a.join("checkpoints/best")).expect("HF layout loads");

    // 3 iterations (scored after 2), then resumed to 6: the same scores and the same best.
    cli::run(&args(&plan, &b, 3)).expect("first part");
    let mut resume = args(&plan, &b, 6);
    resume.resume = Some(b.clone());
    cli::run(&resume).expect("resumed run");
    assert_eq!(metrics, common::metrics_without_times(&b));
    assert_eq!(best_of(&a), best_of(&b));
    assert!(
        read(a.join("checkpoints/best/model.safetensors"))
            == read(b.join("checkpoints/best/model.safetensors")),
        "the best weights differ between the runs"
    );
}

#[test]
fn eval_every_needs_prompts_and_a_held_out_split() {
    let dir = common::Scratch::new("eval-every-refused");
    let plan = tiny_plan(dir.path());
    let mut a = args(&plan, &dir.path().join("a"), 2);
    a.eval = 0;
    let e = cli::run(&a).unwrap_err().to_string();
    assert!(e.contains("--eval-every 2 needs --eval N"), "{e}");

    let synthetic = common::repo_file("examples/tiny.rpx").replacen(
        "generated(\"moving_shapes\", 4096)",
        "synthetic",
        1,
    );
    let spec = common::spec("tiny.rpx", &synthetic);
    let path = dir.path().join("synthetic.plan");
    let plan = common::compile_spec(&spec, &Default::default());
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    let out = dir.path().join("b");
    let e = cli::run(&args(&path, &out, 2)).unwrap_err().to_string();
    assert!(e.contains("no held-out split"), "{e}");
    assert!(
        !out.join("metrics.jsonl").exists(),
        "refused before anything is written"
    );
}
