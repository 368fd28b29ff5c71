//! Built-in GPU and model presets.
//!
//! GPU numbers are datasheet values (dense bf16 tensor-core rate, HBM bandwidth, NVLink per
//! direction), except the H200's and H100's HBM capacity: what the driver reports as the
//! device's total (`cuMemGetInfo`; 143,771 MiB on an H200, 79.2 GiB on an H100 80GB HBM3,
//! where the datasheet's 80 GiB let the planner place plans of 79.6-79.8 GiB that the runtime
//! then refused). Host bandwidth is what PCIe delivers in practice (Gen5 x16: ~55 GB/s,
//! Gen4 x16: ~25 GB/s); InfiniBand is one 400 Gb/s NIC per GPU (HDR 200 Gb/s on A100 systems).
//! The `cpu` preset is not a measurement: it is a nominal device that lets the planner run for
//! the CPU backend, whose timings nobody plans by; override any field in the `gpu` section.
//!
//! Model presets are the plan crate's table (`rollplex_plan::models`), re-exported here: the
//! runtime and the compiler's fixtures read the same one.

use rollplex_plan::spec::GpuSpec;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A GPU preset: the device, and the interconnect it usually comes with.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuPreset {
    pub gpu: GpuSpec,
    /// NVLink, bytes/s per direction.
    pub nvlink: f64,
    /// InfiniBand per GPU, bytes/s.
    pub ib: f64,
    /// GPUs in one node.
    pub gpus_per_node: u32,
}

pub const GPU_PRESETS: &[&str] = &["H200", "H100", "H800", "A100", "cpu"];

pub fn gpu(name: &str) -> Option<GpuPreset> {
    #[allow(clippy::too_many_arguments)]
    fn p(
        name: &str,
        sms: u32,
        gran: u32,
        hbm: u64,
        bw: f64,
        bf16: f64,
        host: f64,
        nvlink: f64,
        ib: f64,
        node: u32,
    ) -> GpuPreset {
        GpuPreset {
            gpu: GpuSpec {
                name: name.to_string(),
                sms,
                sm_granularity: gran,
                hbm_bytes: hbm,
                hbm_bw: bw,
                bf16_flops: bf16,
                host_bw: host,
            },
            nvlink,
            ib,
            gpus_per_node: node,
        }
    }
    Some(match name {
        "H200" => p(
            "H200",
            132,
            8,
            143771 * MIB,
            4.8e12,
            989e12,
            55e9,
            450e9,
            50e9,
            8,
        ),
        "H100" => p(
            "H100",
            132,
            8,
            81_100 * MIB,
            3.35e12,
            989e12,
            55e9,
            450e9,
            50e9,
            8,
        ),
        "H800" => p(
            "H800",
            132,
            8,
            80 * GIB,
            3.35e12,
            989e12,
            55e9,
            200e9,
            50e9,
            8,
        ),
        "A100" => p(
            "A100",
            108,
            2,
            80 * GIB,
            2.0e12,
            312e12,
            25e9,
            300e9,
            25e9,
            8,
        ),
        "cpu" => p("cpu", 8, 1, 16 * GIB, 20e9, 100e9, 20e9, 20e9, 1e9, 1),
        _ => return None,
    })
}

pub use rollplex_plan::models::{model, qwen_tokens, tiny_tokens, ModelPreset, MODEL_PRESETS};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_presets_are_named_as_listed() {
        for name in GPU_PRESETS {
            assert_eq!(gpu(name).unwrap().gpu.name, *name);
        }
        assert!(gpu("B200").is_none());
    }
}
