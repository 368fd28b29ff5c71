//! The Rollplex paper's setting by simulation: predicted iteration time of `serial`, `overlap`
//! and `disaggregated` plans for the 7B and 32B paper pipelines (`examples/paper-*.rpx`, 32
//! H800s) and the one-H200 example (`examples/h200-3b-video.rpx`), their ratios and peak
//! memory per GPU, next to the paper's numbers; then how the ratios move when each cost input
//! is changed by -20% / +20%.
//!
//! ```text
//! cargo run -p rollplex-compiler --example paper_scale [-- --out DIR] [-- --quick]
//! ```
//!
//! The cost model is the shipped H200 profile (`cost/profiles/h200.yaml`, fitted to
//! `cost/profiles/reference`), moved over to the H800's datasheet peaks for the paper jobs:
//! efficiencies are fractions of the peaks, the per-SM bandwidth is the SM's own. Nothing here
//! is tuned to the paper. "No prefix dedup" is the usual runtimes' job (veRL): every sample
//! recomputes its prompt prefix in the reference and actor passes. `--out DIR` keeps each plan
//! (`DIR/paper-7b.overlap.plan.bin`, `DIR/paper-7b.serial-nodedup.plan.bin`, ...) for
//! `rollplex-run PLAN --backend sim`; `--quick` skips the sensitivity tables.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rollplex_compiler::{compile, Compiled, Options};
use rollplex_cost::Profile;
use rollplex_plan::spec::{JobSpec, LengthDist, Mode};
use rollplex_plan::work::WorkKind;

const GIB: f64 = (1u64 << 30) as f64;
const PROFILE: &str = include_str!("../../cost/profiles/h200.yaml");
/// (label, file, compared with the paper).
const JOBS: [(&str, &str, bool); 3] = [
    ("7B, 32 x H800", "paper-7b-32xh800.rpx", true),
    ("32B, 32 x H800", "paper-32b-32xh800.rpx", true),
    ("3B, 1 x H200", "h200-3b-video.rpx", false),
];
/// A device memory budget no job reaches: "what if memory were unlimited".
const UNLIMITED: u64 = 1 << 50;

/// The plans compared: (name, mode, prefix dedup).
const VARIANTS: [(&str, Mode, bool); 5] = [
    ("serial", Mode::Serial, true),
    ("overlap", Mode::Overlap, true),
    ("disaggregated", Mode::Disaggregated, true),
    ("serial-nodedup", Mode::Serial, false),
    ("disaggregated-nodedup", Mode::Disaggregated, false),
];

struct Env(PathBuf);
impl rollplex_dsl::Env for Env {
    fn read_file(&self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(self.0.join(path)).map_err(|e| format!("{path}: {e}"))
    }
}

fn load(file: &str) -> Result<JobSpec, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let src = std::fs::read_to_string(dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
    rollplex_dsl::compile_source(file, &src, &Env(dir))
        .map(|c| c.spec)
        .map_err(|d| d.render(file, &src, false))
}

/// One variant's outcome.
struct Outcome {
    time_s: f64,
    /// Peak device bytes per GPU (largest GPU program).
    peak: u64,
    /// Peak of the candidate that keeps everything in HBM, fitting or not.
    all_hbm_peak: Option<u64>,
    /// Set when the job does not fit the GPU's memory and was timed with unlimited memory.
    unfit: Option<String>,
    split: String,
    hidden_s: f64,
}

/// The variants of one job; a variant that cannot be planned at all maps to its error.
type Row = BTreeMap<&'static str, Result<Outcome, String>>;

fn compile_mode(spec: &JobSpec, profile: Option<&Profile>, mode: Mode) -> Result<Compiled, String> {
    let opts = Options {
        mode: Some(mode),
        profile: profile.cloned(),
        ..Options::default()
    };
    compile(spec, &opts).map_err(|e| e.to_string())
}

fn outcome(c: &Compiled, unfit: Option<String>) -> Outcome {
    let plan = &c.plan;
    Outcome {
        time_s: plan.predicted.iteration_s,
        peak: plan.memory.gpus.iter().map(|g| g.peak).max().unwrap_or(0),
        all_hbm_peak: c
            .stats
            .candidates
            .iter()
            .find(|c| c.label.contains("all in HBM"))
            .map(|c| c.peak),
        unfit,
        split: plan
            .gpus
            .iter()
            .map(|g| format!("{} {}", g.ranks, format!("{:?}", g.role).to_lowercase()))
            .collect::<Vec<_>>()
            .join(" + "),
        hidden_s: plan.predicted.hidden_s,
    }
}

/// Compiles every variant; with `out`, writes each plan to `DIR/TAG.VARIANT.plan.bin`.
fn run(spec: &JobSpec, profile: Option<&Profile>, out: Option<(&Path, &str)>) -> Row {
    let mut row = Row::new();
    for (name, mode, dedup) in VARIANTS {
        let mut s = spec.clone();
        s.schedule.prefix_dedup = dedup;
        let got = match compile_mode(&s, profile, mode) {
            Ok(c) => Ok((c, None)),
            // A job that does not fit is timed as if memory were unlimited, and marked.
            Err(e) if e.contains("does not fit") => {
                s.schedule.memory_budget = UNLIMITED;
                compile_mode(&s, profile, mode).map(|c| (c, Some(e)))
            }
            Err(e) => Err(e),
        };
        if let (Ok((c, _)), Some((dir, tag))) = (&got, out) {
            let path = dir.join(format!("{tag}.{name}.plan.bin"));
            let written = rollplex_plan::encode(&c.plan, "paper_scale example")
                .map_err(|e| e.to_string())
                .and_then(|b| std::fs::write(&path, b).map_err(|e| e.to_string()));
            if let Err(e) = written {
                eprintln!("cannot write {}: {e}", path.display());
            }
        }
        row.insert(name, got.map(|(c, unfit)| outcome(&c, unfit)));
    }
    row
}

fn time(row: &Row, name: &str) -> Option<f64> {
    row.get(name)
        .and_then(|r| r.as_ref().ok())
        .map(|o| o.time_s)
}

/// Speedup of overlap over `name`.
fn speedup(row: &Row, name: &str) -> Option<f64> {
    Some(time(row, name)? / time(row, "overlap")?)
}

fn fmt_opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

type Edit = Box<dyn Fn(&mut JobSpec, &mut Profile, f64)>;

/// Applies `f` to the curves of `kinds`.
fn each_curve(p: &mut Profile, kinds: &[WorkKind], f: impl Fn(&mut rollplex_cost::KindCurve)) {
    for k in kinds {
        if let Some(c) = p.kinds.get_mut(k) {
            f(c);
        }
    }
}

const FWD_BWD: [WorkKind; 7] = [
    WorkKind::VisionEncode,
    WorkKind::Prefill,
    WorkKind::RefPrefix,
    WorkKind::RefSuffix,
    WorkKind::ActorPrefixFwd,
    WorkKind::ActorSuffixFwd,
    WorkKind::ActorBwd,
];

/// The inputs of the sensitivity table and how to scale each by `f`.
fn inputs() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "HBM bandwidth (GPU peak, all kinds)",
            Box::new(|s, _, f| s.cluster.gpu.hbm_bw *= f),
        ),
        (
            "bf16 rate (GPU peak, all kinds)",
            Box::new(|s, _, f| s.cluster.gpu.bf16_flops *= f),
        ),
        (
            "decode memory efficiency",
            Box::new(|_, p, f| {
                each_curve(p, &[WorkKind::Decode], |c| {
                    c.eff_memory = (c.eff_memory * f).min(1.0)
                })
            }),
        ),
        (
            "forward/backward compute efficiency",
            Box::new(|_, p, f| {
                each_curve(p, &FWD_BWD, |c| {
                    c.eff_compute = (c.eff_compute * f).min(1.0)
                })
            }),
        ),
        (
            "per-SM bandwidth (where decode saturates)",
            Box::new(|_, p, f| each_curve(p, &[WorkKind::Decode], |c| c.sm_bw *= f)),
        ),
        (
            "prefix slowdown with fewer SMs (compute exponent)",
            Box::new(|_, p, f| {
                each_curve(p, &FWD_BWD, |c| {
                    c.compute_exponent = (c.compute_exponent * f).min(1.5)
                })
            }),
        ),
        (
            "per-layer latency",
            Box::new(|_, p, f| {
                for c in p.kinds.values_mut() {
                    c.step_overhead_s *= f;
                }
            }),
        ),
        (
            "co-run slowdown (its excess over 1)",
            Box::new(|_, p, f| {
                p.default_corun = 1.0 + (p.default_corun - 1.0) * f;
                for e in p.corun.iter_mut() {
                    e.slowdown = 1.0 + (e.slowdown - 1.0) * f;
                }
            }),
        ),
        (
            "NVLink bandwidth",
            Box::new(|s, _, f| s.cluster.intra_node_bw *= f),
        ),
        (
            "inter-node bandwidth",
            Box::new(|s, _, f| s.cluster.inter_node_bw *= f),
        ),
        (
            "PCIe (host) bandwidth",
            Box::new(|s, _, f| s.cluster.gpu.host_bw *= f),
        ),
        (
            "median response length (workload, not cost)",
            Box::new(|s, _, f| {
                if let LengthDist::LogNormal { median, .. } = &mut s.rollout.response_len {
                    *median *= f;
                }
            }),
        ),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    if let Err(e) = real_main(quick, out.as_deref()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn real_main(quick: bool, out: Option<&Path>) -> Result<(), String> {
    let profile = Profile::from_yaml(PROFILE).map_err(|e| e.to_string())?;
    if let Some(dir) = out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut base = Vec::new();
    for (label, file, paper) in JOBS {
        let spec = load(file)?;
        let t = std::time::Instant::now();
        let tag = file.trim_end_matches(".rpx").to_string();
        let row = run(&spec, Some(&profile), out.map(|d| (d, tag.as_str())));
        let plain = run(&spec, None, None);
        eprintln!(
            "{label}: compiled {} plans in {:.1} s",
            2 * VARIANTS.len(),
            t.elapsed().as_secs_f64()
        );
        base.push((label, paper, spec, row, plain));
    }

    println!("Predicted iteration time, seconds (H200 profile):\n");
    println!("| job | serial | serial, no prefix dedup | overlap | disaggregated | disaggregated, no prefix dedup |");
    println!("|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    for (label, _, _, row, _) in &base {
        let mut cells = Vec::new();
        for (name, ..) in VARIANTS {
            cells.push(match &row[name] {
                Ok(o) => {
                    let mut c = format!("{:.2}", o.time_s);
                    if name == "disaggregated" {
                        c.push_str(&format!(" ({})", o.split));
                    }
                    if let Some(e) = &o.unfit {
                        c.push_str(" (*)");
                        notes.push(format!("(*) {label}, {name}: does not fit in device memory; timed with unlimited memory. {e}"));
                    }
                    c
                }
                Err(e) => {
                    notes.push(format!("{label}, {name}: {e}"));
                    "-".into()
                }
            });
        }
        println!(
            "| {label} | {} | {} | {} | {} | {} |",
            cells[0], cells[3], cells[1], cells[2], cells[4]
        );
    }
    for n in &notes {
        println!("\n{n}");
    }

    println!("\nSpeedup of overlap (Rollplex); last column: the same with datasheet defaults instead of the profile:\n");
    println!("| job | vs serial | vs serial, no dedup | paper | vs disaggregated | vs disaggregated, no dedup | paper | vs serial, no profile |");
    println!("|---|---|---|---|---|---|---|---|");
    for (label, paper, _, row, plain) in &base {
        let x = |v: Option<f64>| fmt_opt(v, |v| format!("{v:.2}x"));
        let (ps, pd) = if *paper {
            ("1.23-1.30x", "1.57-2.24x")
        } else {
            ("-", "-")
        };
        println!(
            "| {label} | {} | {} | {ps} | {} | {} | {pd} | {} |",
            x(speedup(row, "serial")),
            x(speedup(row, "serial-nodedup")),
            x(speedup(row, "disaggregated")),
            x(speedup(row, "disaggregated-nodedup")),
            x(speedup(plain, "serial"))
        );
    }

    println!("\nPeak device memory per GPU (GiB; \"all in HBM\" is the candidate without offload, fitting or not):\n");
    println!("| job | serial, no dedup, all in HBM | serial, all in HBM | serial (chosen) | overlap | disaggregated | paper |");
    println!("|---|---|---|---|---|---|---|");
    for (label, paper, _, row, _) in &base {
        let g = |v: Option<u64>| fmt_opt(v.map(|b| b as f64 / GIB), |v| format!("{v:.1}"));
        let o = |name: &str| row.get(name).and_then(|r| r.as_ref().ok());
        println!(
            "| {label} | {} | {} | {} | {} | {} | {} |",
            g(o("serial-nodedup").and_then(|o| o.all_hbm_peak)),
            g(o("serial").and_then(|o| o.all_hbm_peak)),
            g(o("serial").map(|o| o.peak)),
            g(o("overlap").map(|o| o.peak)),
            g(o("disaggregated").map(|o| o.peak)),
            if *paper && label.starts_with("32B") {
                "~165 -> < 80"
            } else {
                "-"
            }
        );
    }
    println!(
        "\nSide work hidden in decode windows (whole-GPU seconds): {}",
        base.iter()
            .map(|(label, _, _, row, _)| {
                let h = row
                    .get("overlap")
                    .and_then(|r| r.as_ref().ok())
                    .map(|o| o.hidden_s);
                format!("{label}: {}", fmt_opt(h, |v| format!("{v:.2} s")))
            })
            .collect::<Vec<_>>()
            .join("; ")
    );
    if quick {
        return Ok(());
    }

    for (label, paper, spec, row, _) in &base {
        if !paper {
            continue;
        }
        println!("\nSensitivity, {label}: each input at -20% / +20%; speedup of overlap vs serial, vs serial without dedup, vs disaggregated.\n");
        println!("| input | vs serial -20% | +20% | vs serial, no dedup -20% | +20% | vs disaggregated -20% | +20% |");
        println!("|---|---|---|---|---|---|---|");
        let r3 = |row: &Row| {
            [
                speedup(row, "serial"),
                speedup(row, "serial-nodedup"),
                speedup(row, "disaggregated"),
            ]
        };
        let b = r3(row);
        let c = |v: Option<f64>| fmt_opt(v, |v| format!("{v:.3}"));
        println!(
            "| (base) | {} | {} | {} | {} | {} | {} |",
            c(b[0]),
            c(b[0]),
            c(b[1]),
            c(b[1]),
            c(b[2]),
            c(b[2])
        );
        for (input, edit) in inputs() {
            let mut got = Vec::new();
            for f in [0.8, 1.2] {
                let (mut s, mut p) = (spec.clone(), profile.clone());
                edit(&mut s, &mut p, f);
                got.push(r3(&run(&s, Some(&p), None)));
            }
            println!(
                "| {input} | {} | {} | {} | {} | {} | {} |",
                c(got[0][0]),
                c(got[1][0]),
                c(got[0][1]),
                c(got[1][1]),
                c(got[0][2]),
                c(got[1][2])
            );
        }
    }
    Ok(())
}
