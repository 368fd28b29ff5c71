//! Fits the H200 profile to the bench measurements and prints it (the shipped
//! `cost/profiles/h200.yaml`); the fit's residuals go to stderr.
//!
//! `cargo run -p rollplex-cost --example calibrate_h200 > cost/profiles/h200.yaml`

fn main() {
    let profile = match rollplex_cost::h200::profile() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", rollplex_cost::h200::profile_yaml(&profile));
    eprintln!(
        "{:<34} {:>10} {:>10} {:>7}  note",
        "what", "measured", "model", "err"
    );
    for r in profile.residuals() {
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
