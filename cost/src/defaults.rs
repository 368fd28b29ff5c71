//! What the cost model assumes when no measured profile is given: datasheet peaks from the
//! [`GpuSpec`] times generic efficiencies. These are round, documented guesses, not
//! measurements; a profile (`cost/profiles/*.yaml`) replaces them kind by kind.
//!
//! | kinds | eff_compute | eff_memory | exponent | saturates at | step overhead |
//! |---|---|---|---|---|---|
//! | forward/backward (vision, prefill, ref, actor) | 0.60 | 0.70 | 1.0 | S/2 SMs | 10 us |
//! | decode | 0.30 | 0.70 | 1.0 | S/2 SMs | 20 us |
//! | optimizer, advantage, weight sync, transfer | 0.30 | 0.80 | 1.0 | S/2 SMs | 10 us |
//! | reward (host) | 0.30 | 0.80 | 1.0 | S/2 SMs | 0 |
//!
//! "Saturates at S/2" means `sm_bw = 2 * eff_memory * peak_bw / S`: half the SMs can draw
//! what the work can use. Co-running GPU work costs each side [`DEFAULT_CORUN`]; host work
//! (reward) co-runs for free.

use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::WorkKind;

use crate::curve::KindCurve;

/// Slowdown of a GPU task while another GPU task runs beside it, without a profile: the middle
/// of the 10-25% the H200 reference measurements show (`cost/profiles/reference/README.md`).
pub const DEFAULT_CORUN: f64 = 1.15;

/// Every work kind, in declaration order (the index of [`kind_index`]).
pub const ALL_KINDS: [WorkKind; 13] = [
    WorkKind::VisionEncode,
    WorkKind::Prefill,
    WorkKind::Decode,
    WorkKind::RefPrefix,
    WorkKind::RefSuffix,
    WorkKind::ActorPrefixFwd,
    WorkKind::ActorSuffixFwd,
    WorkKind::ActorBwd,
    WorkKind::Optimizer,
    WorkKind::Reward,
    WorkKind::Advantage,
    WorkKind::WeightSync,
    WorkKind::Transfer,
];

/// Position of `kind` in [`ALL_KINDS`] (an exhaustive match: a new kind fails to compile here).
pub fn kind_index(kind: WorkKind) -> usize {
    match kind {
        WorkKind::VisionEncode => 0,
        WorkKind::Prefill => 1,
        WorkKind::Decode => 2,
        WorkKind::RefPrefix => 3,
        WorkKind::RefSuffix => 4,
        WorkKind::ActorPrefixFwd => 5,
        WorkKind::ActorSuffixFwd => 6,
        WorkKind::ActorBwd => 7,
        WorkKind::Optimizer => 8,
        WorkKind::Reward => 9,
        WorkKind::Advantage => 10,
        WorkKind::WeightSync => 11,
        WorkKind::Transfer => 12,
    }
}

/// The snake_case name the YAML uses for `kind`.
pub fn kind_name(kind: WorkKind) -> &'static str {
    match kind {
        WorkKind::VisionEncode => "vision_encode",
        WorkKind::Prefill => "prefill",
        WorkKind::Decode => "decode",
        WorkKind::RefPrefix => "ref_prefix",
        WorkKind::RefSuffix => "ref_suffix",
        WorkKind::ActorPrefixFwd => "actor_prefix_fwd",
        WorkKind::ActorSuffixFwd => "actor_suffix_fwd",
        WorkKind::ActorBwd => "actor_bwd",
        WorkKind::Optimizer => "optimizer",
        WorkKind::Reward => "reward",
        WorkKind::Advantage => "advantage",
        WorkKind::WeightSync => "weight_sync",
        WorkKind::Transfer => "transfer",
    }
}

/// Whether `kind` runs on the host (it neither uses SMs nor contends for HBM).
pub fn is_host(kind: WorkKind) -> bool {
    matches!(kind, WorkKind::Reward)
}

/// The datasheet-only curve of `kind` on `gpu` (see the module table).
pub fn default_curve(gpu: &GpuSpec, kind: WorkKind) -> KindCurve {
    let (eff_compute, eff_memory, step_overhead_s) = match kind {
        WorkKind::VisionEncode
        | WorkKind::Prefill
        | WorkKind::RefPrefix
        | WorkKind::RefSuffix
        | WorkKind::ActorPrefixFwd
        | WorkKind::ActorSuffixFwd
        | WorkKind::ActorBwd => (0.60, 0.70, 10e-6),
        WorkKind::Decode => (0.30, 0.70, 20e-6),
        WorkKind::Optimizer | WorkKind::Advantage | WorkKind::WeightSync | WorkKind::Transfer => {
            (0.30, 0.80, 10e-6)
        }
        WorkKind::Reward => (0.30, 0.80, 0.0),
    };
    let sms = gpu.sms.max(1) as f64;
    KindCurve {
        eff_compute,
        eff_memory,
        compute_exponent: 1.0,
        sm_bw: 2.0 * eff_memory * gpu.hbm_bw / sms,
        sharpness: 2.0,
        step_overhead_s,
    }
}

/// Datasheet numbers of the GPUs the examples use (dense bf16, no sparsity).
///
/// - H200 SXM: 132 SMs, 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s bf16, PCIe Gen5 x16
///   (64 GB/s per direction).
/// - H800 SXM: 132 SMs, 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s bf16, PCIe Gen5 x16.
///
/// Returns `None` for other names.
pub fn datasheet(name: &str) -> Option<GpuSpec> {
    let (hbm_bytes, hbm_bw) = match name.to_ascii_uppercase().as_str() {
        "H200" => (141_000_000_000u64, 4.8e12),
        "H800" => (80_000_000_000u64, 3.35e12),
        _ => return None,
    };
    Some(GpuSpec {
        name: name.to_ascii_uppercase(),
        sms: 132,
        sm_granularity: 8,
        hbm_bytes,
        hbm_bw,
        bf16_flops: 989e12,
        host_bw: 64e9,
    })
}
