//! The serial schedule (the usual colocated baseline): one stream per GPU program, every task
//! in dependency order, decode windows with the whole GPU and no side work. Disaggregated
//! plans use the same placement on each of their two GPU programs.
//!
//! Invariant: no task is in a window's side partition; every window gives decode all SMs.

use crate::ir::{PhaseGraph, Placement, ResidencyChoice};
use std::collections::BTreeMap;

pub fn place(pg: &PhaseGraph, residency: ResidencyChoice) -> Placement {
    let total = pg.spec.cluster.gpu.sms;
    Placement {
        single_stream: true,
        splits: vec![(total, 0); pg.windows.len()],
        in_window: BTreeMap::new(),
        residency,
    }
}
