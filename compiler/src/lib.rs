//! The Rollplex compiler: a checked job spec in, a plan out.
//!
//! The pipeline is listed in [`driver`]; each pass is one module, and the types they hand each
//! other are in [`ir`] (which also gives the order of the modules: none uses one above it).
//! The compiler is pure: it
//! reads no files and touches no device (the `rollplexc` binary does the IO).
//!
//! Invariants: the compiler never links cudarc; only `rollplex_plan` types leave it; every plan
//! it returns passes `rollplex_plan::validate`.
pub mod assemble;
pub mod buffers;
pub mod diff;
pub mod driver;
pub mod emit;
pub mod error;
pub mod fixtures;
pub mod ilp;
pub mod ir;
pub mod lengths;
pub mod lower;
pub mod memory;
pub mod residency;
pub mod sched;
pub mod schedule_overlap;
pub mod schedule_serial;
pub mod shapes;
pub mod sharing;
pub mod topology;
pub mod workload;

pub use driver::{compile, Compiled, Options, Stats};
pub use error::CompileError;
