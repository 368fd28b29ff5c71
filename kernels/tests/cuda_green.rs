//! SM partitions on a CUDA device ([`StreamSet`]; the rounding rules are tested without one in
//! `cuda::green`): where kernels land (`%smid`) on a decode and a side partition used at once
//! from one thread. Prints "skipped: no CUDA device" and passes where no GPU is present.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use rollplex_kernels::cuda::green::{Priority, StreamSet};
use rollplex_kernels::cuda::nvrtc::KernelModule;
use rollplex_kernels::cuda::{CudaStream, Gpu};

#[macro_use]
mod common;
use common::*;

/// Each block's SM id and its start / end times (globaltimer, ns) after spinning `spin` clocks.
const SM_PROBE: KernelModule = KernelModule {
    name: "sm_probe",
    source: include_str!("../cuda/sm_probe.cu"),
};

struct Probe {
    smid: cudarc::driver::CudaSlice<u32>,
    t: cudarc::driver::CudaSlice<u64>,
}

fn launch_probe(gpu: &Gpu, s: &Arc<CudaStream>, blocks: u32, spin: i64) -> Probe {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let f = gpu.function(&SM_PROBE, &[], "sm_probe").unwrap();
    let mut p = Probe {
        smid: s.alloc_zeros::<u32>(blocks as usize).unwrap(),
        t: s.alloc_zeros::<u64>(2 * blocks as usize).unwrap(),
    };
    let mut lb = s.launch_builder(&f);
    lb.arg(&mut p.smid).arg(&mut p.t).arg(&spin);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel writes blocks entries of smid and 2 * blocks of t, both allocated so.
    unsafe { lb.launch(cfg) }.unwrap();
    p
}

/// (distinct SMs, first start, last end) of a finished probe.
fn probe_result(s: &Arc<CudaStream>, p: &Probe) -> (std::collections::BTreeSet<u32>, u64, u64) {
    let ids = s.clone_dtoh(&p.smid).unwrap();
    let t = s.clone_dtoh(&p.t).unwrap();
    s.synchronize().unwrap();
    let start = t.iter().step_by(2).copied().min().unwrap();
    let end = t.iter().skip(1).step_by(2).copied().max().unwrap();
    (ids.into_iter().collect(), start, end)
}

#[test]
fn kernels_land_on_their_partitions_sms_when_two_run_at_once() {
    let gpu = gpu_or_skip!();
    let set = StreamSet::new(gpu).unwrap();
    if !set.green() {
        eprintln!(
            "skipped: green contexts unavailable ({})",
            set.warning().unwrap_or("")
        );
        return;
    }
    eprintln!(
        "layout {:?} (driver split of {} SMs)",
        set.layout(),
        gpu.sm_count()
    );
    assert_eq!(set.total_sms(), gpu.sm_count());
    // the whole GPU: the probe spreads over (nearly) every SM, so the checks below can fail
    let whole = set.partition(gpu.sm_count(), Priority::High).unwrap();
    let p = launch_probe(gpu, &whole, 2048, 20_000);
    let (all, _, _) = probe_result(&whole, &p);
    eprintln!("whole GPU: {} distinct SMs", all.len());
    assert!(all.len() as u32 > set.total_sms() / 2);
    let total = set.total_sms();
    for d in [40, 48, 64, 80] {
        let side = total - d;
        let (a, b) = (
            set.partition(d, Priority::High).unwrap(),
            set.partition(side, Priority::Normal).unwrap(),
        );
        let (ga, gb) = (
            set.granted(d, Priority::High).unwrap(),
            set.granted(side, Priority::Normal).unwrap(),
        );
        // launched back to back from this thread; each block spins ~1 ms
        let pa = launch_probe(gpu, &a, 1024, 2_000_000);
        let pb = launch_probe(gpu, &b, 1024, 2_000_000);
        let (sa, a0, a1) = probe_result(&a, &pa);
        let (sb, b0, b1) = probe_result(&b, &pb);
        eprintln!(
            "decode {d} (granted {ga}): {} SMs; side {side} (granted {gb}): {} SMs; overlap \
             {:.3} ms of {:.3} / {:.3} ms",
            sa.len(),
            sb.len(),
            (a1.min(b1) as f64 - a0.max(b0) as f64) / 1e6,
            (a1 - a0) as f64 / 1e6,
            (b1 - b0) as f64 / 1e6
        );
        assert!(
            sa.len() as u32 <= ga,
            "decode partition on {} SMs",
            sa.len()
        );
        assert!(sb.len() as u32 <= gb, "side partition on {} SMs", sb.len());
        assert!(sa.is_disjoint(&sb), "partitions share SMs");
        assert!(
            a0 < b1 && b0 < a1,
            "the two partitions did not run at the same time"
        );
    }
}
