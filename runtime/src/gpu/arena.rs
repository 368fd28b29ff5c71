//! The plan's device arena on the GPU: its address range reserved once, before the models are
//! uploaded, device memory mapped under the ranges of the buffers placed in it, and those
//! buffers at the plan's offsets.
//!
//! A [`Region`] is the arena's part that one or more plan buffers cover (`kv.prompt` and
//! `kv.response` together hold the decode KV arena; contiguous ranges merge). What the runtime
//! makes for those buffers is placed in the region's ranges in allocation order ([`Bump`]), and
//! comes back as a [`DevBuf`]: a `CudaSlice` that is never freed, since the plan decides when
//! that memory is reused: a buffer placed over another's range is written only by tasks that
//! the plan orders after the other's last reader (`memory.rs` lays buffers out by happens-before
//! lifetimes, and the executor turns every plan dependency into stream order or an event). A
//! region is reset where the plan's buffer starts a new lifetime (each iteration, each
//! mini-batch's gradient sums). What does not fit (a runtime layout the plan sized otherwise)
//! comes from the memory pool and is counted ([`RegionUsage::spilled`]): never silently wrong,
//! only reported. Working sets inside a task (the plan's `scratch.*`) come from the pool, whose
//! high-water mark the loop reports beside the plan's.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys, CudaContext, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};
use rollplex_kernels::cuda::{CudaSlice, CudaStream, Gpu};
use rollplex_plan::ALIGN;

use super::Result;

/// The plan's device arena: its address range reserved once, and device memory mapped
/// (`cuMemCreate` + `cuMemMap`, at the device's allocation granularity) under the ranges the
/// runtime places buffers in. Ranges the plan holds only for the tasks' working sets stay
/// unmapped: those sets come from the memory pool, so mapping them too would count them
/// twice. Unmapped and freed when the last [`Region`] and [`DevBuf`] holding it are gone.
pub struct DeviceArena {
    ptr: sys::CUdeviceptr,
    bytes: u64,
    reserved: usize,
    /// `(offset, bytes, handle)` of each mapped chunk.
    maps: Vec<(u64, usize, sys::CUmemGenericAllocationHandle)>,
    ctx: Arc<CudaContext>,
}

impl DeviceArena {
    /// Reserves `bytes` of device address space on `gpu` and backs `used` (`(offset, bytes)`
    /// ranges, rounded out to the allocation granularity) with device memory.
    pub fn new(gpu: &Gpu, bytes: u64, used: &[(u64, u64)]) -> Result<Arc<Self>> {
        let ctx = gpu.ctx().clone();
        ctx.bind_to_thread()?;
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ctx.cu_device(),
        };
        // SAFETY: a plain-old-data C struct; every field that matters is set below
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = location;
        let mut gran = 0usize;
        // SAFETY: valid out-pointer and property struct
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        }
        .result()?;
        let gran = gran.max(1) as u64;
        let reserved = bytes.max(1).next_multiple_of(gran) as usize;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; freed in Drop
        unsafe { sys::cuMemAddressReserve(&mut ptr, reserved, gran as usize, 0, 0) }.result()?;
        let mut arena = DeviceArena {
            ptr,
            bytes,
            reserved,
            maps: Vec::new(),
            ctx,
        };
        let access = sys::CUmemAccessDesc {
            location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // each chunk is rounded out to the granularity and merged with its neighbours
        let chunks = Bump::new(
            used.iter()
                .map(|&(o, b)| {
                    let lo = o / gran * gran;
                    (lo, (o + b).next_multiple_of(gran).min(reserved as u64) - lo)
                })
                .collect(),
        );
        for &(off, size) in chunks.ranges() {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out-pointer and property; released in Drop (pushed before the map
            // so that a failure below still releases it)
            unsafe { sys::cuMemCreate(&mut h, size as usize, &prop, 0) }.result()?;
            arena.maps.push((off, 0, h));
            // SAFETY: [off, off + size) lies in the reserved range; unmapped in Drop
            unsafe { sys::cuMemMap(ptr + off, size as usize, 0, h, 0) }.result()?;
            arena.maps.last_mut().expect("pushed above").1 = size as usize;
            // SAFETY: the range was just mapped
            unsafe { sys::cuMemSetAccess(ptr + off, size as usize, &access, 1) }.result()?;
        }
        Ok(Arc::new(arena))
    }

    /// The plan's arena size (address space).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Device memory mapped under it.
    pub fn mapped(&self) -> u64 {
        self.maps.iter().map(|m| m.1 as u64).sum()
    }
}

impl DeviceArena {
    /// The device address of `[offset, offset + bytes)`, checked to lie in the arena.
    fn range(&self, offset: u64, bytes: u64) -> Result<sys::CUdeviceptr> {
        if offset + bytes > self.bytes {
            return Err(super::GpuError::Input(format!(
                "arena range at {offset} ({bytes} bytes) lies past the arena's end ({} bytes)",
                self.bytes
            )));
        }
        Ok(self.ptr + offset)
    }

    /// Queues on `stream` the copy of the arena's `[offset, offset + image.bytes())` into
    /// `image` (its contents are the device's once `stream` reaches this point).
    pub fn copy_to_host(&self, stream: &CudaStream, offset: u64, image: &HostImage) -> Result<()> {
        let src = self.range(offset, image.bytes as u64)?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the source lies in the arena (checked), the destination is `image`'s pinned
        // allocation of that size, which outlives the copy (its drop synchronises the context)
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(image.ptr.cast(), src, image.bytes, stream.cu_stream())
        }
        .result()?;
        Ok(())
    }

    /// Queues on `stream` the copy of `image` into the arena's `[offset, offset +
    /// image.bytes())`.
    pub fn copy_from_host(
        &self,
        stream: &CudaStream,
        offset: u64,
        image: &HostImage,
    ) -> Result<()> {
        let dst = self.range(offset, image.bytes as u64)?;
        self.ctx.bind_to_thread()?;
        // SAFETY: as in `copy_to_host`, the other way
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, image.ptr.cast(), image.bytes, stream.cu_stream())
        }
        .result()?;
        Ok(())
    }
}

/// Page-locked host memory that holds a plan buffer while it lives on the host (its
/// `<name>.host` copy): copies between it and the device arena run asynchronously on a stream
/// ([`DeviceArena::copy_to_host`], [`DeviceArena::copy_from_host`]).
pub struct HostImage {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the pointer is a pinned allocation owned by this value alone; the device reads and
// writes it only through copies ordered on streams, which its drop waits for.
unsafe impl Send for HostImage {}
unsafe impl Sync for HostImage {}

impl HostImage {
    /// `bytes` of pinned host memory (contents undefined until a copy fills them).
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<Self> {
        let ctx = gpu.ctx().clone();
        ctx.bind_to_thread()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; freed in Drop
        unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1), 0) }.result()?;
        Ok(HostImage {
            ptr: p.cast(),
            bytes,
            ctx,
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The image's first byte (for copies a caller queues itself).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The image's bytes, to fill from the host; only while no copy into or out of it is
    /// queued.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes allocated in `new`, alive while `self` is, borrowed uniquely
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// The image's bytes; only meaningful once the copies queued into it have finished.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `bytes` bytes allocated in `new`, alive while `self` is
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
}

impl Drop for HostImage {
    fn drop(&mut self) {
        // a copy into or out of it may still be queued
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: allocated in `new`, freed once
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        // every DevBuf in it is gone (each holds this arena); the device may still run work
        // queued on them
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        for &(off, size, h) in &self.maps {
            // SAFETY: mapped (size > 0) and created in `new`, each once
            unsafe {
                if size > 0 {
                    let _ = sys::cuMemUnmap(self.ptr + off, size);
                }
                let _ = sys::cuMemRelease(h);
            }
        }
        // SAFETY: reserved in `new`, freed once
        let _ = unsafe { sys::cuMemAddressFree(self.ptr, self.reserved) };
    }
}

/// First-fit bump allocation over a region's byte ranges (pure: offsets only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bump {
    /// `(offset, bytes)`, ascending, contiguous ranges merged.
    ranges: Vec<(u64, u64)>,
    /// Per range: bytes handed out from its start.
    used: Vec<u64>,
}

impl Bump {
    pub fn new(mut ranges: Vec<(u64, u64)>) -> Self {
        ranges.retain(|&(_, b)| b > 0);
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (o, b) in ranges {
            match merged.last_mut() {
                // overlapping or touching: one range (buffers of one region may share bytes
                // when their lifetimes do not overlap)
                Some((mo, mb)) if o <= *mo + *mb => *mb = (*mb).max(o + b - *mo),
                _ => merged.push((o, b)),
            }
        }
        let used = vec![0; merged.len()];
        Bump {
            ranges: merged,
            used,
        }
    }

    /// The offset of `bytes` (aligned to `align`) in the first range with room, or `None`.
    pub fn take(&mut self, bytes: u64, align: u64) -> Option<u64> {
        for (i, &(o, b)) in self.ranges.iter().enumerate() {
            let start = (o + self.used[i]).next_multiple_of(align);
            if start + bytes <= o + b {
                self.used[i] = start + bytes - o;
                return Some(start);
            }
        }
        None
    }

    /// Everything free again.
    pub fn reset(&mut self) {
        self.used.iter_mut().for_each(|u| *u = 0);
    }

    /// Bytes of the ranges.
    pub fn capacity(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// Bytes handed out since the last reset (alignment gaps included).
    pub fn used(&self) -> u64 {
        self.used.iter().sum()
    }

    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }
}

/// What a region held: its capacity, the most placed at once (alignment gaps included), and
/// what did not fit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionUsage {
    pub name: String,
    pub capacity: u64,
    pub peak: u64,
    pub spilled: u64,
    pub spills: u64,
}

/// The arena's part for one or more plan buffers (see the module docs).
pub struct Region {
    arena: Arc<DeviceArena>,
    state: Mutex<(Bump, RegionUsage)>,
}

impl Region {
    /// `ranges` are `(offset, bytes)` in `arena`; an error names a range past its end.
    pub fn new(
        arena: Arc<DeviceArena>,
        name: impl Into<String>,
        ranges: Vec<(u64, u64)>,
    ) -> std::result::Result<Self, String> {
        let name = name.into();
        if let Some(&(o, b)) = ranges.iter().find(|&&(o, b)| o + b > arena.bytes) {
            return Err(format!(
                "plan buffer {name} at offset {o} ({b} bytes) lies past the end of its arena \
                 ({} bytes)",
                arena.bytes
            ));
        }
        let bump = Bump::new(ranges);
        let usage = RegionUsage {
            name,
            capacity: bump.capacity(),
            ..RegionUsage::default()
        };
        Ok(Region {
            arena,
            state: Mutex::new((bump, usage)),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (Bump, RegionUsage)> {
        // a panic while holding it leaves only counters behind: keep going
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` elements in the region (uninitialised), or `None`, counted as spilled, when they
    /// do not fit.
    fn place<T: DeviceRepr>(&self, stream: &Arc<CudaStream>, n: usize) -> Option<DevBuf<T>> {
        let bytes = (n * std::mem::size_of::<T>()) as u64;
        let mut st = self.state();
        let (bump, usage) = &mut *st;
        let Some(off) = bump.take(bytes, ALIGN) else {
            usage.spilled += bytes;
            usage.spills += 1;
            return None;
        };
        usage.peak = usage.peak.max(bump.used());
        // SAFETY: [off, off + bytes) lies in the arena (Bump keeps to its ranges, which `new`
        // checked), which the DevBuf keeps alive and never frees.
        let s = unsafe { stream.upgrade_device_ptr::<T>(self.arena.ptr + off, n) };
        Some(DevBuf {
            slice: ManuallyDrop::new(s),
            arena: Some(self.arena.clone()),
        })
    }

    /// A new lifetime of the region's buffers: their earlier contents are dead (the plan orders
    /// every writer of the new lifetime after every reader of the old).
    pub fn reset(&self) {
        self.state().0.reset();
    }

    pub fn usage(&self) -> RegionUsage {
        self.state().1.clone()
    }
}

/// `n` elements (at least one; uninitialised) in `region`, or from the pool without one or
/// when they do not fit it.
pub fn alloc_in<T: DeviceRepr>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    n: usize,
    region: Option<&Region>,
) -> Result<DevBuf<T>> {
    let n = n.max(1);
    match region.and_then(|r| r.place(stream, n)) {
        Some(b) => Ok(b),
        None => Ok(DevBuf::from(gpu.alloc::<T>(stream, n)?)),
    }
}

/// `data` uploaded into `region` (or the pool).
pub fn upload_in<T: DeviceRepr>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    data: &[T],
    region: Option<&Region>,
) -> Result<DevBuf<T>> {
    let mut b = alloc_in::<T>(gpu, stream, data.len(), region)?;
    if !data.is_empty() {
        stream.memcpy_htod(data, &mut *b)?;
    }
    Ok(b)
}

/// `n` zeroed elements in `region` (or the pool).
pub fn zeros_in<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    n: usize,
    region: Option<&Region>,
) -> Result<DevBuf<T>> {
    let mut b = alloc_in::<T>(gpu, stream, n, region)?;
    stream.memset_zeros(&mut *b)?;
    Ok(b)
}

/// `src` kept in `region` (copied there on `stream`, `src` then freed in stream order), or
/// `src` itself without one.
pub fn keep_in<T: DeviceRepr>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    src: CudaSlice<T>,
    region: Option<&Region>,
) -> Result<DevBuf<T>> {
    if region.is_none() {
        return Ok(DevBuf::from(src));
    }
    let mut b = alloc_in::<T>(gpu, stream, src.len(), region)?;
    stream.memcpy_dtod(&src, &mut *b)?;
    Ok(b)
}

/// A device buffer in a [`Region`] of the plan's arena (never freed: the plan reuses its
/// memory) or from the memory pool (freed, stream-ordered, when dropped). Derefs to the
/// `CudaSlice` every launcher takes.
pub struct DevBuf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// The arena the memory is part of, when placed.
    arena: Option<Arc<DeviceArena>>,
}

impl<T> From<CudaSlice<T>> for DevBuf<T> {
    fn from(s: CudaSlice<T>) -> Self {
        DevBuf {
            slice: ManuallyDrop::new(s),
            arena: None,
        }
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let s = unsafe { ManuallyDrop::take(&mut self.slice) };
        if self.arena.is_some() {
            // the arena's memory: only the slice's handle goes (the arena frees the memory)
            let _ = s.leak();
        } else {
            drop(s);
        }
    }
}

impl<T> Deref for DevBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DevBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> DeviceSlice<T> for DevBuf<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T> DevicePtr<T> for DevBuf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for DevBuf<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bump_merges_touching_ranges_and_fits_first() {
        // two buffers back to back (kv.response then kv.prompt) and one apart
        let mut b = Bump::new(vec![(1000, 24), (512, 488), (4096, 100)]);
        assert_eq!(b.ranges(), &[(512, 512), (4096, 100)]);
        assert_eq!(b.capacity(), 612);
        assert_eq!(b.take(300, 256), Some(512));
        // 812 rounds up to 1024, the merged range's end: no room, next range
        assert_eq!(b.take(10, 256), Some(4096));
        assert_eq!(b.take(100, 256), None);
        assert_eq!(b.used(), 300 + 10);
        b.reset();
        assert_eq!(b.used(), 0);
        assert_eq!(b.take(512, 256), Some(512));
    }

    #[test]
    fn bump_merges_overlapping_ranges() {
        let b = Bump::new(vec![(0, 100), (50, 100), (150, 0)]);
        assert_eq!(b.ranges(), &[(0, 150)]);
    }

    /// A range offloaded to a host image and overwritten comes back bit for bit on reload, at
    /// an unaligned offset and a size that is not a multiple of anything in particular.
    #[test]
    fn offload_and_reload_round_trip_through_a_host_image() {
        let Some(gpu) = rollplex_kernels::cuda::test_gpu() else {
            return;
        };
        let s = gpu.stream(0).unwrap();
        let (off, n) = (4096u64 + 256, 100_003usize);
        let arena = DeviceArena::new(&gpu, 1 << 21, &[(off, n as u64)]).unwrap();
        let region = Region::new(arena.clone(), "moved", vec![(off, n as u64)]).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
        let buf = upload_in(&gpu, &s, &data, Some(&region)).unwrap();
        assert!(buf.arena.is_some(), "placed in the region");
        let image = HostImage::new(&gpu, n).unwrap();
        arena.copy_to_host(&s, off, &image).unwrap();
        s.synchronize().unwrap();
        assert_eq!(image.as_slice(), &data[..], "offloaded");
        // another buffer's data over the range while it lives on the host
        let mut over = buf;
        s.memset_zeros(&mut *over).unwrap();
        assert!(s.clone_dtoh(&*over).unwrap().iter().all(|&b| b == 0));
        arena.copy_from_host(&s, off, &image).unwrap();
        assert_eq!(s.clone_dtoh(&*over).unwrap(), data, "reloaded");
        assert!(
            arena.copy_from_host(&s, 1 << 21, &image).is_err(),
            "past the end"
        );
    }

    #[test]
    fn bump_aligns_each_placement() {
        let mut b = Bump::new(vec![(0, 1024)]);
        assert_eq!(b.take(1, 256), Some(0));
        assert_eq!(b.take(1, 256), Some(256));
        assert_eq!(b.take(512, 256), Some(512));
        assert_eq!(b.take(1, 256), None);
    }
}
