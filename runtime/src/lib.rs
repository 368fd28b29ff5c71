//! The Rollplex runtime.
pub mod chat;
pub mod ckpt_state;
pub mod cli;
pub mod data;
pub mod exec;
pub mod gpu;
pub mod metrics;
pub mod model;
pub mod preprocess;
pub mod reward;
pub mod sim;
pub mod tasks;
pub mod tfevents;
pub mod tokenizer;
pub mod tp;
pub mod trace;
pub mod train;
