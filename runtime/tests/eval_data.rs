//! `--eval-data`: validation on a held-out file of the user's own dataset. The tiny CPU job
//! trains on a JSONL file of images and scores a held-out JSONL file (all of it, when `--eval`
//! asks for more) before, during (`--eval-every`) and after training, keeping the best
//! checkpoint; a held-out file that is missing or has a bad record stops the run with exit
//! status 1 before it writes anything, naming the file and the line; and `--eval-data` is
//! refused where it cannot apply.

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_rollplex-run");

/// A 56x56 PNG: a coloured square on black, its colour the answer's.
fn png(colour: [u8; 3], at: u32, side: u32) -> Vec<u8> {
    let mut img = image::RgbImage::new(side, side);
    for y in at..at + 20 {
        for x in at..at + 20 {
            img.put_pixel(x, y, image::Rgb(colour));
        }
    }
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

const COLOURS: [([u8; 3], &str); 4] = [
    ([255, 0, 0], "A"),
    ([0, 255, 0], "B"),
    ([0, 0, 255], "C"),
    ([255, 255, 0], "D"),
];

/// A JSONL record: one image (a path beside the file) and its answer letter.
fn record(image: &str, answer: &str) -> String {
    format!(
        r#"{{"prompt": "<image>Which colour? A red B green C blue D yellow", "images": ["{image}"], "answer": "{answer}"}}"#
    )
}

/// A JSONL file of `rows` records in `dir` (`img/<k>.png` beside it, one per colour, and
/// `img/big.png` of 112x112, which the plan's 56x56 images do not fit).
fn write_jsonl(dir: &Path, name: &str, rows: &[String]) -> PathBuf {
    std::fs::create_dir_all(dir.join("img")).unwrap();
    for (k, (colour, _)) in COLOURS.iter().enumerate() {
        std::fs::write(
            dir.join(format!("img/{k}.png")),
            png(*colour, 4 + 8 * k as u32, 56),
        )
        .unwrap();
    }
    std::fs::write(dir.join("img/big.png"), png([255, 0, 0], 4, 112)).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path
}

/// `n` good records, the colours in turn from `first`.
fn records(n: usize, first: usize) -> Vec<String> {
    (first..first + n)
        .map(|r| record(&format!("img/{}.png", r % 4), COLOURS[r % 4].1))
        .collect()
}

/// The tiny example on one 56x56 image a prompt, `dataset` its rollout's data, compiled into
/// `dir`.
fn tiny_plan(dir: &Path, dataset: &str) -> PathBuf {
    let src = include_str!("../../examples/tiny.rpx")
        .replacen("const PROMPTS = 8 ", "const PROMPTS = 2 ", 1)
        .replacen("const G = 16 ", "const G = 4 ", 1)
        .replacen(
            "media = video(frames = 4, size = 56x56)",
            "media = image(size = 56x56, count = 1)",
            1,
        )
        .replacen("text_tokens = 40", "text_tokens = 120", 1)
        .replacen("generated(\"moving_shapes\", 4096)", dataset, 1);
    let checked = rollplex_dsl::compile_source("tiny.rpx", &src, &rollplex_dsl::NoFiles)
        .unwrap_or_else(|d| panic!("{}", d.render("tiny.rpx", &src, false)));
    let plan = rollplex_compiler::compile(&checked.spec, &Default::default())
        .expect("the pipeline compiles")
        .plan;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("tiny.plan");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

/// The tiny plan training on `train` (a file).
fn file_plan(dir: &Path, train: &Path) -> PathBuf {
    tiny_plan(dir, &format!("file({:?})", train.display().to_string()))
}

/// `rollplex-run PLAN --quiet --out OUT ARGS..`: exit status and stderr.
fn rollplex_run(plan: &Path, out: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new(BIN)
        .arg(plan)
        .arg("--quiet")
        .arg("--out")
        .arg(out)
        .args(args)
        .output()
        .expect("rollplex-run runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn validation_scores_a_held_out_jsonl_file_and_keeps_the_best_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let train = write_jsonl(dir.path(), "train.jsonl", &records(8, 0));
    let val = write_jsonl(dir.path(), "val.jsonl", &records(3, 1));
    let plan = file_plan(dir.path(), &train);
    let out = dir.path().join("out");
    let val_arg = val.to_str().unwrap();
    let (code, err) = rollplex_run(
        &plan,
        &out,
        &[
            "--iterations",
            "3",
            "--eval",
            "8",
            "--eval-every",
            "1",
            "--eval-data",
            val_arg,
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("--eval 8 asks for more prompts than") && err.contains("all 3 of them"),
        "says that the file holds fewer than asked: {err}"
    );

    // every iteration scored on the file's 3 records, greedy and sampled
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let scores: Vec<(f64, f64)> = metrics
        .lines()
        .map(|l| {
            let m: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(m["val_prompts"], 3, "{m}");
            let (g, s) = (&m["val_reward_greedy"], &m["val_reward_sampled"]);
            let (g, s) = (
                g.as_f64().expect("a greedy score"),
                s.as_f64().expect("a sampled score"),
            );
            // a mean over 3 answers scored 0 or 1
            for v in [g, s] {
                assert!(
                    (0..=3).any(|k| v == k as f64 / 3.0),
                    "{v} is no mean of 3 rewards: {m}"
                );
            }
            (g, s)
        })
        .collect();
    assert_eq!(scores.len(), 3, "{metrics}");

    // the best checkpoint: the first of the highest greedy scores, its data named
    let best = out.join("checkpoints/best");
    let state = rollplex_runtime::ckpt_state::load_run_state(&best).expect("a best checkpoint");
    let top = (0..scores.len()).fold(0, |b, i| if scores[i].0 > scores[b].0 { i } else { b });
    assert_eq!(state.iteration, top as u64 + 1);
    let v = &state.extra["validation"];
    assert_eq!(v["greedy"].as_f64(), Some(scores[top].0), "{v}");
    assert_eq!(v["sampled"].as_f64(), Some(scores[top].1), "{v}");
    assert_eq!(v["prompts"], 3);
    assert_eq!(v["data"].as_str(), Some(val_arg));
    rollplex_runtime::model::Qwen25VL::load(&best).expect("HF layout loads");

    // --eval before and after, on the same records: after is the last validation's greedy
    for when in ["before", "after"] {
        let e = json(out.join(format!("eval-{when}.json")));
        assert_eq!(e["prompts"], 3, "{e}");
        assert!(
            (0.0..=1.0).contains(&e["reward_mean"].as_f64().unwrap()),
            "{e}"
        );
    }
    assert_eq!(
        json(out.join("eval-after.json"))["reward_mean"].as_f64(),
        Some(scores[2].0)
    );
}

/// A held-out file that is missing or has a bad record: exit 1 before anything is written,
/// the file and the line named.
#[test]
fn a_bad_held_out_file_stops_the_run_before_it_writes_anything() {
    let dir = tempfile::tempdir().unwrap();
    let train = write_jsonl(dir.path(), "train.jsonl", &records(4, 0));
    let plan = file_plan(dir.path(), &train);
    let mut no_answer = records(3, 0);
    no_answer[1] = r#"{"prompt": "<image>Which colour?", "images": ["img/0.png"]}"#.into();
    let mut too_big = records(3, 0);
    too_big[2] = record("img/big.png", "A");
    let mut missing_image = records(3, 0);
    missing_image[0] = record("img/9.png", "A");
    // (file name, its lines or None for a missing file, what the error must name)
    type Case<'a> = (&'a str, Option<Vec<String>>, &'a [&'a str]);
    let cases: [Case<'_>; 5] = [
        ("absent.jsonl", None, &["absent.jsonl"]),
        (
            "not-json.jsonl",
            Some(vec![records(1, 0)[0].clone(), "{\"prompt\": ".into()]),
            &["not-json.jsonl:2: not valid JSON"],
        ),
        (
            "no-answer.jsonl",
            Some(no_answer),
            &["no-answer.jsonl:2", "answer"],
        ),
        (
            "missing-image.jsonl",
            Some(missing_image),
            &["missing-image.jsonl:1", "img/9.png"],
        ),
        // found only when the record is built: its image is decoded and does not fit
        (
            "too-big.jsonl",
            Some(too_big),
            &["too-big.jsonl:3: field `images`", "112x112"],
        ),
    ];
    for (name, rows, needles) in cases {
        let val = match rows {
            Some(rows) => write_jsonl(dir.path(), name, &rows),
            None => dir.path().join(name),
        };
        let out = dir.path().join(format!("out-{name}"));
        let (code, err) = rollplex_run(
            &plan,
            &out,
            &[
                "--iterations",
                "1",
                "--eval",
                "4",
                "--eval-every",
                "1",
                "--eval-data",
                val.to_str().unwrap(),
            ],
        );
        assert_eq!(code, 1, "{name}: {err}");
        for n in needles {
            assert!(err.contains(n), "{name}: {n:?} not in: {err}");
        }
        assert!(err.contains("error: data: --eval-data: "), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(
            !out.join("metrics.jsonl").exists(),
            "{name}: nothing is written"
        );
        assert!(
            !out.join("checkpoints").exists(),
            "{name}: nothing is written"
        );
    }
}

#[test]
fn eval_data_is_refused_where_it_cannot_apply() {
    let dir = tempfile::tempdir().unwrap();
    let train = write_jsonl(dir.path(), "train.jsonl", &records(4, 0));
    let val = write_jsonl(dir.path(), "val.jsonl", &records(2, 0));
    let val = val.to_str().unwrap();
    let out = dir.path().join("out");
    let refused = |plan: &Path, args: &[&str], needles: &[&str]| {
        let (code, err) = rollplex_run(plan, &out, args);
        assert_eq!(code, 1, "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {n:?} not in: {err}");
        }
        assert!(
            !out.join("metrics.jsonl").exists(),
            "{args:?}: nothing is written"
        );
    };

    // a job whose rollout draws synthetic prompts has no dataset for the file to be held out of
    let synthetic = tiny_plan(&dir.path().join("synthetic"), "synthetic");
    refused(
        &synthetic,
        &["--eval", "2", "--eval-every", "1", "--eval-data", val],
        &["--eval-data", "synthetic prompts", "dataset = file("],
    );
    let plan = file_plan(dir.path(), &train);
    refused(
        &plan,
        &["--eval-data", val],
        &["--eval-data", "needs --eval N"],
    );
    refused(
        &plan,
        &["--backend", "sim", "--eval", "2", "--eval-data", val],
        &["--eval-data", "simulator"],
    );
    // a dataset file has no held-out split of its own
    refused(
        &plan,
        &["--eval", "2", "--eval-every", "1"],
        &["no held-out split", "--eval-data FILE"],
    );
}
