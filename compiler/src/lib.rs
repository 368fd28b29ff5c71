//! The Rollplex compiler.
