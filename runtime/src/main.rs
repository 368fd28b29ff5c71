//! `rollplex-run`: executes a compiled plan. A main that only dispatches: parse flags, call
//! `cli::main`, which prints the error chain once and maps it to an exit code (0 ok, 1 user
//! error, 2 internal, 3 a tensor-parallel rank that stopped because another rank failed). A bad
//! command line is a user error (1), as in `rollplexc`; `--help` and `--version` exit 0. A
//! reader that closes stdout early ends the run by SIGPIPE, quietly.

use std::process::ExitCode;

use clap::Parser;
use rollplex_runtime::cli;

fn main() -> ExitCode {
    // A closed stdout (`rollplex-run ... | head`) ends the process as it ends other Unix tools,
    // by SIGPIPE, rather than as a panic in the next print: Rust ignores SIGPIPE by default.
    // SAFETY: restores the default disposition of one signal before any thread starts.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match cli::Command::try_parse() {
        Ok(cmd) => cli::main(cmd),
        Err(e) => {
            let _ = e.print();
            if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}
