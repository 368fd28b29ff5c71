//! The Rollplex runtime.
pub mod train;
pub mod chat;
pub mod tokenizer;
pub mod sim;
pub mod model;
pub mod exec;
pub mod cli;
pub mod data;
pub mod preprocess;
pub mod reward;
pub mod tasks;
pub mod ckpt_state;
pub mod metrics;
pub mod trace;
