//! Fits one profile to the measurements of several (`rollplex-run --profile` of runs of other
//! plans of the same job, e.g. serial and overlap, with and without prefix dedup: each alone
//! covers only its own task sizes and partitions), so that the planner's curves and co-run
//! slowdowns hold across all of them ([`Profile::merge`]). The GPUs must be the same; the
//! merged file lists every measurement and the fit's residuals go to stderr.
//!
//! `rollplexc merge-profiles A.yaml B.yaml... -o MERGED.yaml` does the same and prints a
//! summary per kind; this example stays for scripts that have only the cost crate:
//! `cargo run -p rollplex-cost --example merge_profiles -- A.yaml B.yaml... > MERGED.yaml`

use rollplex_cost::Profile;

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: merge_profiles A.yaml B.yaml... > MERGED.yaml");
        std::process::exit(1);
    }
    let mut inputs = Vec::new();
    for p in &paths {
        let prof = std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| Profile::from_yaml(&t).map_err(|e| e.to_string()));
        match prof {
            Ok(x) => inputs.push((p.clone(), x)),
            Err(e) => {
                eprintln!("error: {p}: {e}");
                std::process::exit(1);
            }
        }
    }
    let merged = match Profile::merge(&inputs) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", merged.to_yaml());
    eprintln!(
        "{:<40} {:>10} {:>10} {:>7}  note",
        "what", "measured", "model", "err"
    );
    for r in merged.residuals() {
        eprintln!(
            "{:<40} {:>8.1}ms {:>8.1}ms {:>+6.1}%  {}",
            r.what,
            r.measured_s * 1e3,
            r.predicted_s * 1e3,
            r.rel_err() * 100.0,
            r.note
        );
    }
}
