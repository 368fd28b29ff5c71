//! Watching a run: the README's main job (`examples/tiny.rpx` on the CPU backend) writes
//! TensorBoard events beside `metrics.jsonl`, and `rollplex-run plot` draws its metrics.
//!
//! The events are read back here by a reader of the test's own (TFRecord framing with both
//! CRC32Cs, the `Event`, `Summary` and `SessionLog` protobufs field by field), and must hold
//! every numeric field of every metrics line at step = iteration, also across a resume (a new
//! file starting with `SessionLog START`, after which iterations that run again replace the
//! earlier file's). The plot must parse as XML and hold one path per series, a point per
//! iteration.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rollplex_runtime::cli::{self, BackendChoice, RunArgs};
use rollplex_runtime::{metrics, plot, tfevents};

fn args(plan: &Path, out: &Path, iterations: u32) -> RunArgs {
    RunArgs {
        save_every: 2,
        keep_checkpoints: 1,
        ..common::run_args(plan, BackendChoice::Cpu, out, iterations)
    }
}

/// examples/tiny.rpx compiled into `dir`.
fn tiny_plan(dir: &Path) -> PathBuf {
    let spec = common::spec("tiny.rpx", &common::repo_file("examples/tiny.rpx"));
    let plan = common::compile_spec(&spec, &Default::default());
    let path = dir.join("tiny.plan.bin");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

/// CRC32C, bit by bit (the writer uses a table).
fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = (c >> 1) ^ (0x82F6_3B78 & (c & 1).wrapping_neg());
        }
    }
    !c
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One `Event` as read back (field numbers: TensorFlow's `event.proto` and `summary.proto`).
#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    scalars: Vec<(String, f32)>,
    session_start: bool,
}

/// A protobuf message's fields: (field number, wire value).
enum Wire<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes");
}

fn fields(b: &[u8]) -> Vec<(u64, Wire<'_>)> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < b.len() {
        let key = varint(b, &mut at);
        let w = match key & 7 {
            0 => Wire::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Wire::Fixed64(b[at - 8..at].try_into().unwrap())
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                Wire::Bytes(&b[at - n..at])
            }
            5 => {
                at += 4;
                Wire::Fixed32(b[at - 4..at].try_into().unwrap())
            }
            t => panic!("wire type {t}"),
        };
        out.push((key >> 3, w));
    }
    assert_eq!(at, b.len(), "a field runs past its message");
    out
}

fn event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (f, w) in fields(data) {
        match (f, w) {
            (1, Wire::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Wire::Varint(v)) => e.step = v as i64,
            (3, Wire::Bytes(b)) => e.file_version = Some(String::from_utf8(b.to_vec()).unwrap()),
            (5, Wire::Bytes(summary)) => {
                for (f, w) in fields(summary) {
                    let (1, Wire::Bytes(value)) = (f, w) else {
                        panic!("Summary field {f}")
                    };
                    let (mut tag, mut v) = (None, None);
                    for (f, w) in fields(value) {
                        match (f, w) {
                            (1, Wire::Bytes(t)) => {
                                tag = Some(String::from_utf8(t.to_vec()).unwrap())
                            }
                            (2, Wire::Fixed32(x)) => v = Some(f32::from_le_bytes(x)),
                            (f, _) => panic!("Summary.Value field {f}"),
                        }
                    }
                    e.scalars
                        .push((tag.expect("tag"), v.expect("simple_value")));
                }
            }
            (7, Wire::Bytes(log)) => {
                for (f, w) in fields(log) {
                    match (f, w) {
                        (1, Wire::Varint(1)) => e.session_start = true,
                        (f, _) => panic!("SessionLog field {f}"),
                    }
                }
            }
            (f, _) => panic!("Event field {f}"),
        }
    }
    e
}

/// The events of one file: every record's framing and both CRCs checked.
fn read_events(path: &Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(
            crc,
            masked(len_bytes),
            "{}: length CRC at {at}",
            path.display()
        );
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked(data), "{}: data CRC at {at}", path.display());
        out.push(event(data));
        at += 16 + len;
    }
    out
}

/// The scalars TensorBoard shows for `out`: its files in name order, a `SessionLog START` at
/// step s dropping what earlier files recorded from s on. Checks each file's first record.
fn scalars_by_step(out: &Path) -> (usize, BTreeMap<i64, Vec<(String, f32)>>) {
    let mut names: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    names.sort();
    let mut steps: BTreeMap<i64, Vec<(String, f32)>> = BTreeMap::new();
    for (k, path) in names.iter().enumerate() {
        let events = read_events(path);
        assert_eq!(
            events[0].file_version.as_deref(),
            Some("brain.Event:2"),
            "{}",
            path.display()
        );
        assert!(events[0].wall_time > 1.6e9, "wall time in seconds");
        assert_eq!(
            events[1].session_start,
            k > 0,
            "{}: a resumed run's file starts with SessionLog START",
            path.display()
        );
        for e in &events[1..] {
            if e.session_start {
                steps.retain(|s, _| *s < e.step);
            } else {
                assert!(
                    steps.insert(e.step, e.scalars.clone()).is_none(),
                    "step {} twice",
                    e.step
                );
            }
        }
    }
    (names.len(), steps)
}

/// Runs the tiny job for 5 iterations (checkpoints after 2 and 4) and resumes it to 7, so
/// iteration 4 runs twice, in scratch directory `name`; returns it and the run's directory.
fn run_and_resume(name: &str) -> (common::Scratch, PathBuf) {
    let dir = common::Scratch::new(name);
    let plan = tiny_plan(dir.path());
    let out = dir.path().join("out");
    cli::run(&args(&plan, &out, 5)).expect("first part");
    let mut resume = args(&plan, &out, 7);
    resume.resume = Some(out.clone());
    cli::run(&resume).expect("resumed run");
    (dir, out)
}

#[test]
fn events_hold_every_metric_of_every_iteration_across_a_resume() {
    let (_dir, out) = run_and_resume("watch-events");
    let lines = metrics::read_log(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines.iter().map(|l| l.iteration).collect::<Vec<_>>(),
        (0..7).collect::<Vec<_>>()
    );
    let (files, steps) = scalars_by_step(&out);
    assert_eq!(files, 2, "a resumed run writes a new file");
    assert_eq!(
        steps.keys().copied().collect::<Vec<_>>(),
        (0..7).collect::<Vec<_>>()
    );
    for l in &lines {
        let want: Vec<(String, f32)> = l
            .fields
            .iter()
            .filter(|(k, _)| *k != "iteration")
            .filter_map(|(k, v)| Some((tfevents::tag(k), v.as_f64()? as f32)))
            .collect();
        assert_eq!(
            steps[&(l.iteration as i64)],
            want,
            "iteration {}",
            l.iteration
        );
    }
    let tags: Vec<&str> = steps[&0].iter().map(|(t, _)| t.as_str()).collect();
    for t in [
        "reward/mean",
        "reward/std",
        "response/len_mean",
        "loss/total",
        "loss/kl",
        "loss/clip_frac",
        "train/grad_norm",
        "time/iteration_s",
        "time/rollout_s",
        "time/training_s",
        "roofline/iteration_frac",
    ] {
        assert!(tags.contains(&t), "{t} missing from {tags:?}");
    }

    // A new run in the same directory replaces the old events as it replaces the metrics.
    let plan = out.parent().unwrap().join("tiny.plan.bin");
    cli::run(&args(&plan, &out, 1)).expect("a new run");
    let (files, steps) = scalars_by_step(&out);
    assert_eq!((files, steps.len()), (1, 1));
}

/// The `d` of each `<path data-series=...>` of an SVG, which must be well-formed XML.
fn series(svg: &str) -> BTreeMap<String, String> {
    let doc = roxmltree::Document::parse(svg).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter_map(|n| {
            Some((
                n.attribute("data-series")?.to_string(),
                n.attribute("d")?.to_string(),
            ))
        })
        .collect()
}

#[test]
fn plot_draws_a_real_run() {
    let (dir, out) = run_and_resume("watch-plot");
    let (path, n) = plot::plot_run(&out, None).expect("plot");
    assert_eq!((path.clone(), n), (out.join("metrics.svg"), 7));
    let s = series(&std::fs::read_to_string(&path).unwrap());
    for key in [
        "reward_mean",
        "response_len_mean",
        "loss",
        "pg_loss",
        "kl",
        "time_s",
        "rollout_s",
        "training_s",
    ] {
        let d = s
            .get(key)
            .unwrap_or_else(|| panic!("{key} not drawn: {s:?}"));
        if !key.ends_with("_s") || key == "time_s" {
            let vertices = d.matches(['M', 'L']).count();
            assert_eq!(vertices, 7, "{key}: a point per iteration: {d}");
        }
    }
    assert!(s.contains_key("reward_std"), "the reward band");

    // What a user gets wrong is said, not drawn.
    let other = dir.path().join("not-a-run");
    std::fs::create_dir(&other).unwrap();
    let e = plot::plot_run(&other, None).unwrap_err().to_string();
    assert!(
        e.contains("metrics.jsonl") && e.contains("--out directory"),
        "{e}"
    );
    let e = plot::plot_run(&out, Some(&dir.path().join("p.png")))
        .unwrap_err()
        .to_string();
    assert!(e.contains(".svg"), "{e}");
    let bad = other.join("metrics.jsonl");
    std::fs::write(&bad, "{\"iteration\":0}\n{\"iteration\":1,\n").unwrap();
    let e = plot::plot_run(&bad, None).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl:2: not JSON"), "{e}");
    std::fs::write(&bad, "").unwrap();
    let e = plot::plot_run(&other, None).unwrap_err().to_string();
    assert!(e.contains("no iteration recorded yet"), "{e}");
}
