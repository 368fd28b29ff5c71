//! Fits one profile to the measurements of several (`rollplex-run --profile` of runs of other
//! plans of the same job, e.g. with and without prefix dedup: each alone covers only its own
//! task sizes), so that the planner's curves hold across all of them. The GPUs must be the
//! same; the merged file lists every point and prints the fit's residuals to stderr.
//!
//! `cargo run -p rollplex-cost --example merge_profiles -- A.yaml B.yaml... > MERGED.yaml`

use rollplex_cost::Profile;

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: merge_profiles A.yaml B.yaml... > MERGED.yaml");
        std::process::exit(1);
    }
    let mut points = Vec::new();
    let mut corun = Vec::new();
    let mut gpu = None;
    let mut sources = Vec::new();
    for p in &paths {
        let text = match std::fs::read_to_string(p) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {p}: {e}");
                std::process::exit(1);
            }
        };
        let prof = match Profile::from_yaml(&text) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("error: {p}: {e}");
                std::process::exit(1);
            }
        };
        match &gpu {
            None => gpu = Some(prof.gpu.clone()),
            Some(g) if *g != prof.gpu => {
                eprintln!(
                    "error: {p} was measured on {}, not {}",
                    prof.gpu.name, g.name
                );
                std::process::exit(1);
            }
            Some(_) => {}
        }
        sources.push(format!("{p} ({})", prof.source));
        points.extend(prof.points);
        corun.extend(prof.corun_points);
    }
    let gpu = gpu.expect("at least one profile");
    let mut merged = match Profile::fit(&gpu, points, corun) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    merged.source = format!("merged fit of: {}", sources.join("; "));
    print!("{}", merged.to_yaml());
    eprintln!(
        "{:<34} {:>10} {:>10} {:>7}  note",
        "what", "measured", "model", "err"
    );
    for r in merged.residuals() {
        eprintln!(
            "{:<34} {:>8.1}ms {:>8.1}ms {:>+6.1}%  {}",
            r.what,
            r.measured_s * 1e3,
            r.predicted_s * 1e3,
            r.rel_err() * 100.0,
            r.note
        );
    }
}
