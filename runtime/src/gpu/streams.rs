//! Streams confined to a share of the GPU's SMs (the decode and side partitions of each decode
//! window): the green contexts of `rollplex_kernels::cuda::green`, where the device code lives,
//! under the names the executor and the benchmarks use.

pub use rollplex_kernels::cuda::green::{Placement, Priority, SmLayout, StreamOptions, StreamSet};

#[cfg(test)]
#[path = "streams_tests.rs"]
mod tests;
