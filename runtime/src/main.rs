//! `rollplex-run`: executes a compiled plan. A main that only dispatches: parse flags, call
//! `cli::main`, which prints the error chain once and maps it to an exit code (0 ok, 1 user
//! error, 2 internal, 3 a tensor-parallel rank that stopped because another rank failed).

use std::process::ExitCode;

use clap::Parser;
use rollplex_runtime::cli;

fn main() -> ExitCode {
    cli::main(cli::Command::parse())
}
