//! SM partitions: streams that may use only a fixed share of the GPU's multiprocessors, through
//! CUDA green contexts (`cuDevSmResourceSplitByCount`, `cuGreenCtxCreate`,
//! `cuGreenCtxStreamCreate`), so that a memory-bound decode and a compute-bound prefill can run
//! side by side without one starving the other.
//!
//! Where green contexts are unavailable (driver older than CUDA 12.5, or
//! `ROLLPLEX_NO_GREEN_CONTEXTS=1`), [`SmPartition::new`] falls back to plain streams with
//! priorities (partition 0 most urgent) and says so in [`SmPartition::warning`]; the requested
//! SM counts are then only advice.
//!
//! Kernels loaded in the primary context run on green streams as they are (seen on the H200:
//! 1024 blocks of a 40-SM partition landed on exactly 40 SMs), and so does cuBLAS(Lt). Events
//! created by [`super::Gpu::event`] order work across partitions (`ev.record(&a)`, `b.wait(&ev)`).
//!
//! Invariants: the streams handed out are borrowed from this struct: they must not be used after
//! it is dropped (dropping synchronises and destroys them and their green contexts). Split sizes
//! are rounded by the driver to its granularity (8 SMs on the H200); [`SmPartition::sm_counts`]
//! reports what was granted.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use super::{CudaError, Gpu, Result};

/// How a partition's SM limit is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmPartitionKind {
    /// Green contexts: each stream's kernels run only on its SMs.
    Green,
    /// Plain prioritised streams: SM counts are not enforced.
    PriorityStreams,
}

/// A set of streams, each confined to a share of the SMs.
pub struct SmPartition {
    kind: SmPartitionKind,
    streams: Vec<Arc<CudaStream>>,
    sm_counts: Vec<u32>,
    raw: Vec<(sys::CUgreenCtx, sys::CUstream)>,
    warning: Option<String>,
}

// SAFETY: the raw handles are driver objects usable from any thread; they are only destroyed in
// Drop, when no other reference to this struct exists.
unsafe impl Send for SmPartition {}
unsafe impl Sync for SmPartition {}

/// The CUDA driver's version as an integer (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer; the driver is loaded by `Gpu::new` before this is called.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

impl SmPartition {
    /// Splits the GPU into `counts.len() + 1` partitions: partition `i < counts.len()` gets
    /// `counts[i]` SMs (rounded up by the driver), the last gets the remaining SMs. Each
    /// partition has one stream; partition 0 is given the highest priority.
    pub fn new(gpu: &Gpu, counts: &[u32]) -> Result<SmPartition> {
        let total: u32 = counts.iter().sum();
        if counts.is_empty() || counts.contains(&0) || total >= gpu.sm_count() {
            return Err(CudaError::Shape {
                op: "SmPartition::new",
                what: format!(
                    "SM counts {counts:?} must be non-empty, non-zero and leave SMs out of {}",
                    gpu.sm_count()
                ),
            });
        }
        let reason = if std::env::var("ROLLPLEX_NO_GREEN_CONTEXTS").is_ok_and(|v| v == "1") {
            Some("green contexts disabled by ROLLPLEX_NO_GREEN_CONTEXTS=1".to_string())
        } else {
            match driver_version()? {
                v if v < 12050 => Some(format!(
                    "CUDA driver {v} predates green-context streams (needs 12050)"
                )),
                _ => None,
            }
        };
        match reason {
            None => match Self::green(gpu, counts) {
                Ok(p) => Ok(p),
                Err(e) => Self::fallback(gpu, counts, format!("green contexts failed ({e})")),
            },
            Some(r) => Self::fallback(gpu, counts, r),
        }
    }

    fn fallback(gpu: &Gpu, counts: &[u32], why: String) -> Result<SmPartition> {
        let (least, greatest) = gpu.priority_range()?;
        let mut streams = Vec::new();
        let mut sm_counts: Vec<u32> = counts.to_vec();
        sm_counts.push(gpu.sm_count() - counts.iter().sum::<u32>());
        for i in 0..sm_counts.len() {
            streams.push(gpu.stream((greatest + i as i32).min(least))?);
        }
        Ok(SmPartition {
            kind: SmPartitionKind::PriorityStreams,
            streams,
            sm_counts,
            raw: Vec::new(),
            warning: Some(format!(
                "{why}; using prioritised plain streams (SM counts not enforced)"
            )),
        })
    }

    fn green(gpu: &Gpu, counts: &[u32]) -> Result<SmPartition> {
        let ctx = gpu.ctx();
        ctx.bind_to_thread()?;
        let (least, greatest) = gpu.priority_range()?;
        let mut part = SmPartition {
            kind: SmPartitionKind::Green,
            streams: Vec::new(),
            sm_counts: Vec::new(),
            raw: Vec::new(),
            warning: None,
        };
        // SAFETY: plain driver calls with valid out-pointers; every created object is recorded in
        // `part.raw` right away, so Drop releases it on any later error.
        unsafe {
            let dev = ctx.cu_device();
            let mut rest: sys::CUdevResource = std::mem::zeroed();
            sys::cuDeviceGetDevResource(
                dev,
                &mut rest,
                sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
            )
            .result()?;
            let mut groups: Vec<sys::CUdevResource> = Vec::new();
            for &want in counts {
                let mut group: sys::CUdevResource = std::mem::zeroed();
                let mut remaining: sys::CUdevResource = std::mem::zeroed();
                let mut nb: u32 = 1;
                sys::cuDevSmResourceSplitByCount(
                    &mut group,
                    &mut nb,
                    &rest,
                    &mut remaining,
                    0,
                    want,
                )
                .result()?;
                if nb != 1 {
                    return Err(CudaError::Unavailable(format!(
                        "could not carve {want} SMs from the rest"
                    )));
                }
                groups.push(group);
                rest = remaining;
            }
            groups.push(rest);
            for (i, g) in groups.iter_mut().enumerate() {
                let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
                sys::cuDevResourceGenerateDesc(&mut desc, g, 1).result()?;
                let mut gc: sys::CUgreenCtx = std::ptr::null_mut();
                sys::cuGreenCtxCreate(
                    &mut gc,
                    desc,
                    dev,
                    sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32,
                )
                .result()?;
                part.raw.push((gc, std::ptr::null_mut()));
                let mut st: sys::CUstream = std::ptr::null_mut();
                let prio = (greatest + i as i32).min(least);
                sys::cuGreenCtxStreamCreate(
                    &mut st,
                    gc,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    prio,
                )
                .result()?;
                part.raw.last_mut().expect("pushed above").1 = st;
                part.streams.push(ctx.wrap_borrowed_stream(st));
                part.sm_counts.push(g.__bindgen_anon_1.sm.smCount);
            }
            // Leave the primary context current for the caller's other work.
            ctx.bind_to_thread()?;
        }
        Ok(part)
    }

    pub fn kind(&self) -> SmPartitionKind {
        self.kind
    }
    pub fn is_green(&self) -> bool {
        self.kind == SmPartitionKind::Green
    }
    /// Why the partition fell back to plain streams, if it did.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }
    pub fn len(&self) -> usize {
        self.streams.len()
    }
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
    /// Partition `i`'s stream (borrowed: see the module invariants).
    pub fn stream(&self, i: usize) -> &Arc<CudaStream> {
        &self.streams[i]
    }
    /// SMs granted to each partition.
    pub fn sm_counts(&self) -> &[u32] {
        &self.sm_counts
    }
}

impl Drop for SmPartition {
    fn drop(&mut self) {
        self.streams.clear();
        for &(gc, st) in self.raw.iter().rev() {
            // SAFETY: created in `green`, destroyed once; synchronised first so no work is lost.
            unsafe {
                if !st.is_null() {
                    let _ = sys::cuStreamSynchronize(st);
                    let _ = sys::cuStreamDestroy_v2(st);
                }
                let _ = sys::cuGreenCtxDestroy(gc);
            }
        }
    }
}
