//! The Rollplex plan format. See `spec` for the job description that every plan carries.
pub mod spec;
