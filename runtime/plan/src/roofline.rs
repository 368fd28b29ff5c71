//! The plan's roofline: the least time its work could take on its GPUs, from the same work
//! counts the cost model prices ([`Work`]: FLOPs, device bytes, host and network bytes).
//!
//! A task's floor is the slowest of its terms at the machine's ceilings,
//! `max(flops / gemm_rate, bytes / copy_rate, host_bytes / host_bw, net_bytes / net_bw)`; a phase's
//! floor sums its tasks' floors (phases as [`crate::plan::Op::phase`] assigns them; side work placed in a
//! decode window is the rollout's, as `rollplex-run` measures phases), and the iteration's floor on a GPU program is the sum of its phases'.
//! The overlapped floor lets compute-bound work, memory-bound work and transfers share the time
//! perfectly: the same `max` over the program's sums. Both take the
//! slowest GPU program. What the counts leave out (per-step latency, attention's quadratic
//! reads beyond the minimum, a kernel's own inefficiency) is what an engine loses to its roofline.
//!
//! Ceilings are rates measured on the GPU, not datasheet peaks, where we have them
//! ([`Ceilings::of`]).

use crate::plan::{Phase, Plan};
use crate::spec::GpuSpec;
use crate::work::Work;

/// The rates the roofline holds work against.
#[derive(Clone, Debug, PartialEq)]
pub struct Ceilings {
    /// Dense bf16 GEMM rate, FLOP/s.
    pub flops: f64,
    /// Device-memory copy rate, bytes/s (read + write counted).
    pub bytes: f64,
    /// Host <-> device, bytes/s.
    pub host: f64,
    /// GPU <-> GPU per GPU, bytes/s (the cluster spec's link bandwidth).
    pub net: f64,
    /// Where the rates come from, for the printout.
    pub source: &'static str,
}

impl Ceilings {
    /// The ceilings of `gpu` with links at `net_bw`: on an H200 the rates measured there (bf16
    /// 8192^3 cuBLASLt GEMM 785 TFLOP/s; a 2 GiB device-to-device copy 4.23 TB/s; docs/perf.md),
    /// elsewhere the cluster spec's peaks (datasheet numbers for a GPU).
    pub fn of(gpu: &GpuSpec, net_bw: f64) -> Self {
        if gpu.name.eq_ignore_ascii_case("H200") {
            Ceilings {
                flops: 785e12,
                bytes: 4.23e12,
                host: gpu.host_bw,
                net: net_bw,
                source: "measured H200 ceilings",
            }
        } else {
            Ceilings {
                flops: gpu.bf16_flops,
                bytes: gpu.hbm_bw,
                host: gpu.host_bw,
                net: net_bw,
                source: "the cluster spec's peaks",
            }
        }
    }

    /// One task's floor, seconds.
    pub fn floor(&self, w: &Work) -> f64 {
        let div = |a: f64, b: f64| if a > 0.0 { a / b } else { 0.0 };
        div(w.total_flops(), self.flops)
            .max(div(w.total_bytes(), self.bytes))
            .max(div(w.host_bytes, self.host))
            .max(div(w.net_bytes, self.net))
    }
}

/// One phase's work and floor on the slowest GPU program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PhaseRoof {
    pub flops: f64,
    pub bytes: f64,
    /// Sum of the phase's task floors, seconds.
    pub seconds: f64,
}

/// The plan's roofline (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    /// Every phase with work, in [`Phase::ALL`] order.
    pub phases: Vec<(Phase, PhaseRoof)>,
    /// Phases one after another.
    pub serial_s: f64,
    /// Compute, memory traffic and transfers overlapped perfectly.
    pub overlapped_s: f64,
    pub ceilings: Ceilings,
}

/// The roofline of `plan` at the ceilings of its cluster.
pub fn roofline(plan: &Plan) -> Roofline {
    let cluster = &plan.spec.cluster;
    roofline_at(plan, Ceilings::of(&cluster.gpu, cluster.intra_node_bw))
}

/// The roofline of `plan` at `ceilings`.
pub fn roofline_at(plan: &Plan, ceilings: Ceilings) -> Roofline {
    let mut phases = vec![PhaseRoof::default(); Phase::ALL.len()];
    let (mut serial_s, mut overlapped_s) = (0f64, 0f64);
    for g in &plan.gpus {
        let mut mine = vec![PhaseRoof::default(); Phase::ALL.len()];
        let mut sums = Work::default();
        for t in plan.tasks.iter().filter(|t| t.gpu == g.id) {
            let Some(p) = t.op.phase(t.window.is_some()) else {
                continue;
            };
            let r = &mut mine[p.index()];
            let (f, b) = (t.work.total_flops(), t.work.total_bytes());
            r.flops += f;
            r.bytes += b;
            r.seconds += ceilings.floor(&t.work);
            sums.flops += f;
            sums.bytes += b;
            sums.host_bytes += t.work.host_bytes;
            sums.net_bytes += t.work.net_bytes;
        }
        let total: f64 = mine.iter().map(|r| r.seconds).sum();
        if total > serial_s {
            serial_s = total;
            phases = mine;
        }
        overlapped_s = overlapped_s.max(ceilings.floor(&sums));
    }
    Roofline {
        phases: Phase::ALL
            .into_iter()
            .zip(phases)
            .filter(|(_, r)| r.seconds > 0.0)
            .collect(),
        serial_s,
        overlapped_s,
        ceilings,
    }
}

impl Roofline {
    /// The lines `rollplexc --stats` prints.
    pub fn text(&self) -> String {
        let c = &self.ceilings;
        let mut s = format!(
            "roofline ({}: {:.0} TFLOP/s, {:.2} TB/s): {:.3} s/iteration with phases in turn, \
             {:.3} s with compute and memory work overlapped\n",
            c.source,
            c.flops / 1e12,
            c.bytes / 1e12,
            self.serial_s,
            self.overlapped_s
        );
        for (p, r) in &self.phases {
            s.push_str(&format!(
                "  {:<8} {:>8.3} s  ({:.1} TFLOP, {:.1} GB)\n",
                phase_name(*p),
                r.seconds,
                r.flops / 1e12,
                r.bytes / 1e9
            ));
        }
        s
    }
}

/// A phase's name as the tools print it.
pub fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Rollout => "rollout",
        Phase::Scoring => "scoring",
        Phase::Training => "training",
        Phase::Sync => "sync",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_index_their_place_in_all() {
        for (i, p) in Phase::ALL.into_iter().enumerate() {
            assert_eq!(p.index(), i);
        }
    }

    #[test]
    fn a_floor_is_the_slowest_term_at_the_ceilings() {
        let c = Ceilings {
            flops: 1e12,
            bytes: 1e9,
            host: 1e8,
            net: 1e7,
            source: "test",
        };
        let w = |flops, bytes, host_bytes, net_bytes| Work {
            flops,
            bytes,
            host_bytes,
            net_bytes,
            ..Work::default()
        };
        assert_eq!(c.floor(&w(2e12, 1e9, 0.0, 0.0)), 2.0);
        assert_eq!(c.floor(&w(1e12, 3e9, 0.0, 0.0)), 3.0);
        assert_eq!(c.floor(&w(0.0, 0.0, 4e8, 1e7)), 4.0);
        assert_eq!(c.floor(&w(0.0, 0.0, 0.0, 5e7)), 5.0);
        assert_eq!(c.floor(&Work::default()), 0.0);
    }

    #[test]
    fn h200_ceilings_are_the_measured_rates_and_others_the_datasheet() {
        let mut gpu = GpuSpec {
            name: "H200".into(),
            sms: 132,
            sm_granularity: 8,
            hbm_bytes: 141_000_000_000,
            hbm_bw: 4.8e12,
            bf16_flops: 989e12,
            host_bw: 64e9,
        };
        assert!(Ceilings::of(&gpu, 1.0).flops < gpu.bf16_flops);
        gpu.name = "H800".into();
        assert_eq!(Ceilings::of(&gpu, 1.0).flops, gpu.bf16_flops);
    }
}
