//! A learning curve of a CPU GRPO job: trains a compiled plan on the CPU backend and, every K
//! iterations, measures held-out accuracy (greedy answers to the first N test-split prompts of
//! the moving-shapes task) next to the mean train reward of the last K iterations.
//!
//! Prints one row per evaluation (iteration, train reward, held-out accuracy, train-split greedy
//! accuracy on as many prompts, elapsed seconds of training and of evaluation), and with `--tsv`
//! writes the same rows to a file.
//!
//! Usage: cargo run --release -p rollplex-runtime --example learn_curve -- PLAN.bin \
//!     [--iterations 300] [--every 50] [--eval 64] [--tsv curve.tsv] [--examples 4]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rollplex_runtime::cli::load_plan;
use rollplex_runtime::exec::{self, data};
use rollplex_runtime::tasks::moving_shapes::Split;

struct Args {
    plan: PathBuf,
    iterations: u32,
    every: u32,
    eval: u32,
    tsv: Option<PathBuf>,
    examples: u32,
}

fn parse() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        plan: PathBuf::new(),
        iterations: 300,
        every: 50,
        eval: 64,
        tsv: None,
        examples: 0,
    };
    let mut plan = None;
    while let Some(x) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match x.as_str() {
            "--iterations" => a.iterations = val("--iterations")?.parse()?,
            "--every" => a.every = val("--every")?.parse()?,
            "--eval" => a.eval = val("--eval")?.parse()?,
            "--tsv" => a.tsv = Some(val("--tsv")?.into()),
            "--examples" => a.examples = val("--examples")?.parse()?,
            s if s.starts_with("--") => bail!("unknown flag {s}"),
            s => plan = Some(PathBuf::from(s)),
        }
    }
    a.plan = plan.context("usage: learn_curve PLAN.bin [--iterations N] [--every K] [--eval N] [--tsv FILE] [--examples N]")?;
    if a.every == 0 {
        bail!("--every must be at least 1");
    }
    Ok(a)
}

fn main() -> Result<()> {
    let args = parse()?;
    let plan = load_plan(&args.plan)?;
    let spec = &plan.spec;
    let mut models = [exec::build_cpu_models(spec)?];
    let mut source = data::data_source(spec, &spec.rollout.dataset)?;
    let mut reward = exec::reward_fn(spec)?;
    let mut rows =
        vec!["iteration\ttrain_reward\theldout_acc\ttrain_greedy_acc\ttrain_s\teval_s".to_string()];
    println!(
        "{:>6} {:>12} {:>11} {:>11} {:>8} {:>7}",
        "iter", "train_reward", "heldout_acc", "train_acc", "train_s", "eval_s"
    );
    let (mut train_s, mut eval_s) = (0.0f64, 0.0f64);
    let mut window = Vec::new();
    let mut report = |it: u32,
                      window: &mut Vec<f64>,
                      models: &[exec::cpu::CpuModels],
                      train_s: f64,
                      eval_s: &mut f64|
     -> Result<()> {
        let t0 = Instant::now();
        let model = &exec::cpu::unshard_actor(models)?;
        let held = data::evaluate_split(spec, model, Split::Test, args.eval)?
            .context("the job's dataset has no held-out split (use dataset = generated(\"moving_shapes\", N))")?;
        let train = data::evaluate_split(spec, model, Split::Train, args.eval)?.unwrap_or(f64::NAN);
        *eval_s += t0.elapsed().as_secs_f64();
        let r = if window.is_empty() {
            f64::NAN
        } else {
            window.iter().sum::<f64>() / window.len() as f64
        };
        window.clear();
        println!(
            "{it:>6} {r:>12.3} {held:>11.3} {train:>11.3} {train_s:>8.1} {:>7.1}",
            *eval_s
        );
        rows.push(format!(
            "{it}\t{r:.4}\t{held:.4}\t{train:.4}\t{train_s:.2}\t{:.2}",
            *eval_s
        ));
        Ok(())
    };
    report(0, &mut window, &models, 0.0, &mut eval_s)?;
    let mut done = 0;
    while done < args.iterations {
        let n = args.every.min(args.iterations - done);
        let t0 = Instant::now();
        exec::run_cpu_iterations(
            &plan,
            &mut models,
            source.as_mut(),
            reward.as_mut(),
            done,
            n,
            |_, r, _| {
                window.push(r.reward_mean());
                Ok(())
            },
        )?;
        train_s += t0.elapsed().as_secs_f64();
        done += n;
        report(done, &mut window, &models, train_s, &mut eval_s)?;
    }
    if args.examples > 0 {
        for (split, i, text) in data::greedy_answers(
            spec,
            &exec::cpu::unshard_actor(&models)?,
            Split::Test,
            args.examples,
        )? {
            println!("{} {i}: {text:?}", split.name());
        }
    }
    if let Some(p) = &args.tsv {
        std::fs::write(p, rows.join("\n") + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
