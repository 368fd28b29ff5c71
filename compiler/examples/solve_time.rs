//! How the planner's solve time grows with batch size and window count.
//!
//! `cargo run -p rollplex-compiler --example solve_time` prints two markdown tables (the
//! paper's 32-GPU settings, overlap mode): ILP size, solve time and whole-compile time as the
//! prompts per iteration grow, and as the decode window shrinks (more windows).
use rollplex_compiler::fixtures::{paper_job, QwenSize};
use rollplex_compiler::{compile, Options};
use rollplex_plan::spec::{JobSpec, Mode};
use std::time::Instant;

fn row(label: &str, spec: &JobSpec) {
    let opts = Options {
        mode: Some(Mode::Overlap),
        time_limit_s: 30.0,
        ..Options::default()
    };
    let t = Instant::now();
    let c = match compile(spec, &opts) {
        Ok(c) => c,
        Err(e) => {
            println!("| {label} | error: {e} |");
            return;
        }
    };
    let total = t.elapsed().as_secs_f64();
    let ilp = &c.stats.ilp;
    let solve: f64 = ilp.iter().map(|r| r.solve_s).sum();
    let (vars, bins, cons) = ilp
        .first()
        .map(|r| (r.variables, r.integer_variables, r.constraints))
        .unwrap_or((0, 0, 0));
    println!(
        "| {label} | {} | {} | {} | {vars} | {bins} | {cons} | {} | {:.3} | {:.3} | {:.3} |",
        c.plan.parallel.prompts_per_train_replica * c.plan.parallel.group_size,
        c.plan.windows.len(),
        c.plan.tasks.len(),
        ilp.len(),
        solve,
        total,
        c.plan.predicted.iteration_s
    );
}

fn header(first: &str) {
    println!("| {first} | samples/replica | windows | tasks | variables | binaries | constraints | solves | solve s | compile s | predicted s/iter |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
}

fn main() {
    for size in [QwenSize::B7, QwenSize::B32] {
        println!("\n{size:?}, batch size (decode window 64):\n");
        header("prompts/iter");
        for prompts in [32, 64, 128, 256, 512] {
            let mut s = paper_job(size);
            s.rollout.prompts_per_iter = prompts;
            s.train.mini_batch = prompts * s.rollout.group_size;
            row(&prompts.to_string(), &s);
        }
        println!("\n{size:?}, window count (128 prompts, max 1024 new tokens):\n");
        header("decode_window");
        for w in [256, 128, 64, 32, 16, 8] {
            let mut s = paper_job(size);
            s.schedule.decode_window = w;
            row(&w.to_string(), &s);
        }
    }
}
