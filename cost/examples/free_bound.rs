//! The free bound of overlap (`rollplex_cost::bound`) from serial runs' profiles: per profile
//! the measured seconds per kind, the movable work, the decode time, and the speedup overlap
//! could reach if the movable work ran free inside decode.
//!
//! `cargo run --release -p rollplex-cost --example free_bound -- SERIAL.profile.yaml...`
//! (the profiles `iteration_bench --profile-dir` or `rollplex-run --profile` write for serial
//! plans; docs/perf.md quotes its output).

use rollplex_cost::{bound, Profile};

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: free_bound SERIAL.profile.yaml...");
        std::process::exit(1);
    }
    println!(
        "{:<40} {:>9} {:>9} {:>9} {:>11}",
        "profile", "total_s", "movable", "decode", "free bound"
    );
    let mut failed = false;
    for p in &paths {
        let b = std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| Profile::from_yaml(&t).map_err(|e| e.to_string()))
            .and_then(|prof| bound::free_bound(&prof).map_err(|e| e.to_string()));
        match b {
            Ok(b) => {
                let name = std::path::Path::new(p)
                    .file_name()
                    .map_or(p.clone(), |n| n.to_string_lossy().into_owned());
                println!(
                    "{name:<40} {:>9.3} {:>9.3} {:>9.3} {:>10.3}x",
                    b.total,
                    b.movable,
                    b.decode,
                    b.speedup()
                );
                let kinds: Vec<String> = b
                    .by_kind
                    .iter()
                    .map(|(k, s)| format!("{k} {s:.3}"))
                    .collect();
                println!("    {}", kinds.join(", "));
            }
            Err(e) => {
                eprintln!("error: {p}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
