//! `rollplexc`: parse flags, run, print the error once, map it to an exit code
//! (0 ok, 1 user error, 2 internal error).

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match cli::parse() {
        Ok(a) => a,
        Err(code) => return code,
    };
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", e.text);
            if !e.text.ends_with('\n') {
                eprintln!();
            }
            ExitCode::from(e.code)
        }
    }
}
