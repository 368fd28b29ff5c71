//! The Rollplex runtime.
pub mod train;
