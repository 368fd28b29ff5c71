//! Streams confined to a share of the GPU's SMs: the decode partition and the side partition
//! of each decode window (the plan's `windows:` `decode_sms` / `side_sms`), through CUDA green
//! contexts (`cuDevSmResourceSplitByCount`, `cuGreenCtxCreate`, `cuGreenCtxStreamCreate`), with
//! a fallback to plain prioritised streams.
//!
//! What it knows: the device's SM resource as the driver splits it, and nothing of plans. At
//! [`StreamSet::new`] the SMs are split once (`cuDevSmResourceSplitByCount`) into `units`
//! disjoint groups of [`StreamSet::granularity`] SMs and a remainder (on the H200 with driver
//! 580: 15 groups of 8 and a remainder of 12 SMs, of 132). A partition is a set of these groups, combined into one green
//! context by `cuDevResourceGenerateDesc` (the driver allows any outputs of one split to be
//! combined). [`Priority::High`] partitions (decode) take groups from the front, `0..k`;
//! [`Priority::Normal`] partitions (side work) take them from the back, `units - n..units`,
//! plus the remainder. So a decode partition of `d` SMs and a side partition of `s` SMs share
//! no SM whenever their granted sizes add up to at most the whole GPU ([`SmLayout::disjoint`]):
//! 48/84, 64/68 and 80/52 on the H200 split it exactly.
//!
//! Each (placement, priority) gets one green context and one stream, created on first use and
//! cached ([`StreamSet::partition`]); the stream is a cudarc [`CudaStream`] (a borrowed wrap of
//! the green context's stream), so every launcher of this crate runs on it unchanged:
//! kernels of the primary context's modules launch on a green stream, cuBLASLt takes it as its
//! stream (its workspace per stream is allocated on the primary context's default stream), and
//! events of [`Gpu::event`] order work across partitions. Several partition streams can be fed
//! from one host thread: launches bind the primary context and name the stream.
//!
//! Where green contexts are unavailable (driver older than CUDA 12.5, no SM resource, a failed
//! split, or turned off by [`StreamOptions::green_contexts`]), [`StreamSet::new`] prints one
//! warning line and
//! hands out plain streams with the same priorities and the same cache keys; SM counts are then
//! only advice ([`StreamSet::green`] says which).
//!
//! Invariants:
//! - Results never depend on the partition: our kernels split work by shape, never by the SMs
//!   they get, and cuBLASLt algorithms are fixed per GEMM shape (this crate's invariants), so a
//!   prefill or a decode step gives the same bits on the whole GPU and on any partition (tested
//!   on the H200).
//! - Granted sizes round up: a high partition of `k` SMs gets `ceil(k / unit)` groups, a normal
//!   one the fewest back groups that with the remainder hold `k`; a request that would cover
//!   every SM, or `k >= total`, gets a plain stream on the whole GPU.
//! - A stream is never destroyed under a user: dropping the set destroys a green stream and its
//!   context only when the set holds the last reference (after synchronising it); a stream still
//!   referenced elsewhere (a buffer allocated on it holds one) is left alive, with a warning.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::{shape, CudaError, Gpu, Result};

/// The CUDA driver's version as an integer (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer; the driver is loaded by `Gpu::new` before this is called.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

/// How urgent a partition's work is; also which end of the SMs it is carved from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Priority {
    /// Decode: the device's most urgent stream priority; SM groups from the front.
    High,
    /// Side work (prefixes, scoring, training): the least urgent priority; SM groups from the
    /// back, with the remainder.
    Normal,
}

/// Which SM groups a partition holds (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// A plain stream on the whole GPU.
    Whole,
    /// Groups `0..units`.
    Front { units: u32 },
    /// Groups `total_units - units..total_units` and the remainder.
    Back { units: u32 },
}

/// How the device's SMs were split: `units` groups of `unit` SMs and a usable `remainder`
/// (0 if it cannot join a group). Pure: the rounding rules live here and are tested without a
/// GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmLayout {
    /// SMs of the whole device.
    pub total: u32,
    /// SMs per group (the granularity).
    pub unit: u32,
    /// Number of groups.
    pub units: u32,
    /// SMs beyond the groups that back partitions also get.
    pub remainder: u32,
}

/// The granularity assumed when the driver cannot be asked (Hopper's green-context groups).
const FALLBACK_UNIT: u32 = 8;

impl SmLayout {
    /// `total` SMs in as many groups of `unit` as fit, the rest as the remainder (used where the
    /// driver cannot be asked; the H200's driver keeps one more group back: 15 x 8 + 12).
    pub fn nominal(total: u32, unit: u32) -> SmLayout {
        let unit = unit.max(1);
        SmLayout {
            total,
            unit,
            units: total / unit,
            remainder: total % unit,
        }
    }

    /// Where a partition of `sms` SMs at `priority` goes (see the module invariants).
    pub fn place(&self, sms: u32, priority: Priority) -> Result<Placement> {
        if sms == 0 {
            return Err(shape(
                "SmLayout::place",
                "an SM partition needs at least 1 SM (ask for the whole GPU with its SM count)",
            ));
        }
        if sms >= self.total || self.units == 0 {
            return Ok(Placement::Whole);
        }
        let (p, units) = match priority {
            Priority::High => {
                let u = sms.div_ceil(self.unit);
                (Placement::Front { units: u }, u)
            }
            Priority::Normal => {
                let u = sms
                    .saturating_sub(self.remainder)
                    .div_ceil(self.unit)
                    .max(1);
                (Placement::Back { units: u }, u)
            }
        };
        if units > self.units || self.sms(p) >= self.total {
            return Ok(Placement::Whole);
        }
        Ok(p)
    }

    /// SMs a placement holds.
    pub fn sms(&self, p: Placement) -> u32 {
        match p {
            Placement::Whole => self.total,
            Placement::Front { units } => units * self.unit,
            Placement::Back { units } => units * self.unit + self.remainder,
        }
    }

    /// The groups a placement holds (the remainder aside).
    pub fn groups(&self, p: Placement) -> Range<u32> {
        match p {
            Placement::Whole => 0..self.units,
            Placement::Front { units } => 0..units,
            Placement::Back { units } => self.units - units..self.units,
        }
    }

    /// Whether two placements share no SM (only a front and a back partition can be disjoint).
    pub fn disjoint(&self, a: Placement, b: Placement) -> bool {
        match (a, b) {
            (Placement::Front { units: f }, Placement::Back { units: k })
            | (Placement::Back { units: k }, Placement::Front { units: f }) => f + k <= self.units,
            _ => false,
        }
    }
}

/// The driver objects of a green split: the groups and the remainder, all outputs of one split
/// (so any of them can be combined into one descriptor).
struct Split {
    dev: sys::CUdevice,
    groups: Vec<sys::CUdevResource>,
    remainder: Option<sys::CUdevResource>,
}

struct Entry {
    stream: Arc<CudaStream>,
    /// The green context and its raw stream (None: a plain stream cudarc owns).
    green: Option<(sys::CUgreenCtx, sys::CUstream)>,
}

/// The partition streams of one device (see the module doc).
pub struct StreamSet {
    ctx: Arc<CudaContext>,
    layout: SmLayout,
    split: Option<Split>,
    /// Stream priorities (Normal, High) in the device's range.
    priorities: (i32, i32),
    warning: Option<String>,
    streams: Mutex<HashMap<(Placement, Priority), Entry>>,
}

// SAFETY: the raw handles (green contexts, streams, SM resources) are driver objects usable from
// any thread; the map of streams is behind a mutex; handles are destroyed only in Drop.
unsafe impl Send for StreamSet {}
unsafe impl Sync for StreamSet {}

/// How a [`StreamSet`] makes its partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamOptions {
    /// Green contexts where the driver has them (the default); `false`: prioritised plain
    /// streams, with the warning line saying so (`rollplex-run --no-green-contexts`).
    pub green_contexts: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            green_contexts: true,
        }
    }
}

impl StreamSet {
    /// [`StreamSet::with_options`] with the default options (green contexts where available).
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Self::with_options(gpu, StreamOptions::default())
    }

    /// Detects green-context support (driver >= 12.5 for `cuGreenCtxStreamCreate`, the SM
    /// resource and its split); prints one warning line and falls back to plain prioritised
    /// streams when unavailable or when `options` turn them off.
    pub fn with_options(gpu: &Gpu, options: StreamOptions) -> Result<Self> {
        let why_not = if !options.green_contexts {
            Some("green contexts turned off".to_string())
        } else {
            match driver_version()? {
                v if v < 12050 => Some(format!(
                    "CUDA driver {}.{} predates green-context streams (needs 12.5)",
                    v / 1000,
                    v % 1000 / 10
                )),
                _ => None,
            }
        };
        let why_not = match why_not {
            None => match split_device(gpu) {
                Ok((split, layout)) => return Self::build(gpu, layout, Some(split), None),
                Err(e) => format!("green contexts failed ({e})"),
            },
            Some(r) => r,
        };
        let warning = format!(
            "{why_not}; SM partitions fall back to prioritised plain streams (SM counts not \
             enforced)"
        );
        eprintln!("warning: {warning}");
        Self::build(
            gpu,
            SmLayout::nominal(gpu.sm_count(), FALLBACK_UNIT),
            None,
            Some(warning),
        )
    }

    /// Plain prioritised streams only, as asked (no warning): the baseline green partitions are
    /// measured against. Placements and cache keys are those of a split in groups of 8.
    pub fn plain(gpu: &Gpu) -> Result<Self> {
        Self::build(
            gpu,
            SmLayout::nominal(gpu.sm_count(), FALLBACK_UNIT),
            None,
            None,
        )
    }

    fn build(
        gpu: &Gpu,
        layout: SmLayout,
        split: Option<Split>,
        warning: Option<String>,
    ) -> Result<Self> {
        let (least, greatest) = gpu.priority_range()?;
        Ok(StreamSet {
            ctx: gpu.ctx().clone(),
            layout,
            split,
            priorities: (least, greatest),
            warning,
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// Whether partitions are real (green contexts) rather than plain prioritised streams.
    pub fn green(&self) -> bool {
        self.split.is_some()
    }
    /// SMs of the whole device.
    pub fn total_sms(&self) -> u32 {
        self.layout.total
    }
    /// SMs per group: partition sizes are whole groups (plus the remainder at the back).
    pub fn granularity(&self) -> u32 {
        self.layout.unit
    }
    pub fn layout(&self) -> SmLayout {
        self.layout
    }
    /// Why green contexts are not used, where [`StreamSet::new`] fell back.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }
    /// SMs a partition of `sms` at `priority` is granted.
    pub fn granted(&self, sms: u32, priority: Priority) -> Result<u32> {
        Ok(self.layout.sms(self.layout.place(sms, priority)?))
    }

    /// A stream limited to `sms` SMs (rounded up, see the module invariants; the whole GPU when
    /// `sms >= total`), created once per (placement, priority) and cached.
    pub fn partition(&self, sms: u32, priority: Priority) -> Result<Arc<CudaStream>> {
        let place = self.layout.place(sms, priority)?;
        let mut map = self
            .streams
            .lock()
            .map_err(|_| shape("StreamSet::partition", "the lock is poisoned by a panic"))?;
        if let Some(e) = map.get(&(place, priority)) {
            return Ok(e.stream.clone());
        }
        let entry = self.create(place, priority)?;
        let s = entry.stream.clone();
        map.insert((place, priority), entry);
        Ok(s)
    }

    fn priority(&self, p: Priority) -> i32 {
        match p {
            Priority::High => self.priorities.1,
            Priority::Normal => self.priorities.0,
        }
    }

    fn create(&self, place: Placement, priority: Priority) -> Result<Entry> {
        let prio = self.priority(priority);
        let split = match (&self.split, place) {
            (Some(s), Placement::Front { .. } | Placement::Back { .. }) => s,
            _ => {
                return Ok(Entry {
                    stream: self.ctx.new_stream_with_priority(prio)?,
                    green: None,
                })
            }
        };
        let mut res: Vec<sys::CUdevResource> = self
            .layout
            .groups(place)
            .map(|g| split.groups[g as usize])
            .collect();
        if let (Placement::Back { .. }, Some(r)) = (place, split.remainder) {
            res.push(r);
        }
        // SAFETY: the resources are outputs of one split of this device (allowed to be combined);
        // out-pointers are valid; the green context is destroyed again if its stream fails.
        unsafe {
            let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
            sys::cuDevResourceGenerateDesc(&mut desc, res.as_mut_ptr(), res.len() as u32)
                .result()?;
            let mut gc: sys::CUgreenCtx = std::ptr::null_mut();
            sys::cuGreenCtxCreate(
                &mut gc,
                desc,
                split.dev,
                sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32,
            )
            .result()?;
            let mut st: sys::CUstream = std::ptr::null_mut();
            let r = sys::cuGreenCtxStreamCreate(
                &mut st,
                gc,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                prio,
            )
            .result();
            // launches and copies bind the primary context; leave it current
            if let Err(e) = r.and(self.ctx.bind_to_thread()) {
                if !st.is_null() {
                    let _ = sys::cuStreamDestroy_v2(st);
                }
                let _ = sys::cuGreenCtxDestroy(gc);
                return Err(e.into());
            }
            Ok(Entry {
                stream: self.ctx.wrap_borrowed_stream(st),
                green: Some((gc, st)),
            })
        }
    }
}

/// Splits the device's SMs into equal groups and a remainder; checks the remainder can be
/// combined with a group (else back partitions go without it).
fn split_device(gpu: &Gpu) -> Result<(Split, SmLayout)> {
    let ctx = gpu.ctx();
    ctx.bind_to_thread()?;
    let dev = ctx.cu_device();
    // SAFETY: plain driver calls with valid out-pointers; the driver is >= 12.5 (checked by the
    // caller), so every entry point exists. Descriptors need no release.
    unsafe {
        let mut whole: sys::CUdevResource = std::mem::zeroed();
        sys::cuDeviceGetDevResource(
            dev,
            &mut whole,
            sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
        )
        .result()?;
        let sm = whole.__bindgen_anon_1.sm;
        let min = sm.minSmPartitionSize.max(sm.smCoscheduledAlignment).max(1);
        let mut nb = sm.smCount / min;
        if nb < 2 {
            return Err(CudaError::Unavailable(format!(
                "{} SMs in partitions of at least {min}: nothing to split",
                sm.smCount
            )));
        }
        let mut groups: Vec<sys::CUdevResource> = vec![std::mem::zeroed(); nb as usize];
        let mut rem: sys::CUdevResource = std::mem::zeroed();
        sys::cuDevSmResourceSplitByCount(groups.as_mut_ptr(), &mut nb, &whole, &mut rem, 0, min)
            .result()?;
        groups.truncate(nb as usize);
        let unit = groups.first().map_or(0, |g| g.__bindgen_anon_1.sm.smCount);
        if nb < 2 || groups.iter().any(|g| g.__bindgen_anon_1.sm.smCount != unit) {
            return Err(CudaError::Unavailable(format!(
                "the driver split {} SMs into {nb} unequal or too few groups",
                sm.smCount
            )));
        }
        let rem_sms = if rem.type_ == sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM {
            rem.__bindgen_anon_1.sm.smCount
        } else {
            0
        };
        let remainder = if rem_sms > 0 {
            let mut pair = [groups[nb as usize - 1], rem];
            let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
            match sys::cuDevResourceGenerateDesc(&mut desc, pair.as_mut_ptr(), 2).result() {
                Ok(()) => Some(rem),
                Err(_) => None,
            }
        } else {
            None
        };
        let layout = SmLayout {
            total: sm.smCount,
            unit,
            units: nb,
            remainder: remainder.map_or(0, |_| rem_sms),
        };
        Ok((
            Split {
                dev,
                groups,
                remainder,
            },
            layout,
        ))
    }
}

impl Drop for StreamSet {
    fn drop(&mut self) {
        let Ok(map) = self.streams.get_mut() else {
            return;
        };
        let mut kept = 0;
        for (_, e) in map.drain() {
            let Some((gc, st)) = e.green else { continue };
            if Arc::strong_count(&e.stream) > 1 {
                kept += 1;
                continue;
            }
            drop(e.stream);
            // SAFETY: created in `create`, destroyed once, no other reference to the stream
            // exists; synchronised first so queued work completes.
            unsafe {
                let _ = sys::cuStreamSynchronize(st);
                let _ = sys::cuStreamDestroy_v2(st);
                let _ = sys::cuGreenCtxDestroy(gc);
            }
        }
        if kept > 0 {
            eprintln!(
                "warning: {kept} SM partition stream(s) still in use when their StreamSet was \
                 dropped; left alive"
            );
        }
        let _ = self.ctx.bind_to_thread();
    }
}

#[cfg(test)]
#[path = "green_tests.rs"]
mod tests;
