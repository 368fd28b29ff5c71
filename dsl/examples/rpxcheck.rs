//! `cargo run -p rollplex-dsl --example rpxcheck -- FILE.rpx`: checks a file and prints its
//! diagnostics (or the spec, as Debug), for working on the language without the compiler.
use std::process::ExitCode;

struct Fs;
impl rollplex_dsl::Env for Fs {
    fn read_file(&self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(path).map_err(|e| e.to_string())
    }
}

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: rpxcheck FILE.rpx");
        return ExitCode::from(2);
    };
    let src = match std::fs::read_to_string(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot read {path}: {e}");
            return ExitCode::from(2);
        }
    };
    match rollplex_dsl::compile_source(&path, &src, &Fs) {
        Ok(c) => {
            eprint!("{}", c.warnings.render(&path, &src, false));
            println!("{:#?}", c.spec);
            ExitCode::SUCCESS
        }
        Err(d) => {
            eprint!("{}", d.render(&path, &src, false));
            eprintln!("{}", d.summary(&path));
            ExitCode::from(1)
        }
    }
}
