//! The Rollplex runtime.
