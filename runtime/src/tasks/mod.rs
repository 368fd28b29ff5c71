//! Built-in task generators: synthetic datasets shipped with the repo, with known answers.
//!
//! Each generator is deterministic from a seed and writes a dataset directory that
//! [`crate::data::Dataset::load`] reads.

pub mod moving_shapes;
