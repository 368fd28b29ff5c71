//! Page-locked staging for the host tables a call uploads (token ids, RoPE tables, sequence
//! descriptors, row indices, pixel rows). A copy from pageable memory makes the driver wait for
//! the stream's earlier work first, so an upload queued behind a layer stack stalls the host
//! until the stack is done, and an upload at the start of a call waits for the previous call;
//! a copy from page-locked memory is queued like a kernel and the host goes on.
//!
//! Invariants: a [`StagedBatch`] holds one slot of the model's staging ring (under its mutex)
//! while it writes; a slot is rewritten only after the event recorded behind its previous
//! batch's copies has completed. The ring has [`SLOTS`] slots used in turn, so the host waits
//! only when it runs that many calls ahead of the copies (several side tasks of a decode window
//! queued on one stream, each a few group calls, must not hold the host, which then starts the
//! window late); a table that does not fit the reserved bytes is uploaded from pageable memory
//! instead (correct, only slower).

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};
use rollplex_kernels::cuda::Gpu;

use super::{alloc, upload, GpuError, Result};

/// Staging buffers in the ring.
pub(crate) const SLOTS: usize = 8;

/// Bytes a table of `data` takes in the staging buffer (16-byte aligned slots).
pub(crate) fn staged_bytes<T>(data: &[T]) -> usize {
    std::mem::size_of_val(data).div_ceil(16) * 16
}

/// One page-locked buffer and the event behind the last batch's copies from it.
struct Slot {
    ptr: *mut u8,
    cap: usize,
    done: Option<CudaEvent>,
}

/// The ring of staging buffers and the slot the next batch takes.
pub(crate) struct Staging {
    slots: Vec<Slot>,
    next: usize,
}

// SAFETY: every `ptr` is page-locked host memory owned by this value and only touched through
// the mutex that holds it (StagedBatch writes while holding the guard).
unsafe impl Send for Staging {}

impl Staging {
    pub(crate) fn new() -> Mutex<Self> {
        Mutex::new(Staging {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    ptr: std::ptr::null_mut(),
                    cap: 0,
                    done: None,
                })
                .collect(),
            next: 0,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for s in &mut self.slots {
            if let Some(e) = s.done.take() {
                // the copies must be done before the memory goes back
                let _ = e.synchronize();
            }
            if !s.ptr.is_null() {
                // SAFETY: allocated by malloc_host below and not freed yet; no copy reads it.
                let _ = unsafe { cudarc::driver::result::free_host(s.ptr as *mut _) };
            }
        }
    }
}

/// One call's uploads through a staging slot (see the module doc). Dropping it records the
/// event the slot's next batch waits for.
pub(crate) struct StagedBatch<'a> {
    st: MutexGuard<'a, Staging>,
    slot: usize,
    stream: &'a Arc<CudaStream>,
    used: usize,
}

/// Takes the next staging slot for a batch of at most `bytes` (sum of [`staged_bytes`]): waits
/// for that slot's previous batch's copies, grows its buffer if needed.
pub(crate) fn stage<'a>(
    staging: &'a Mutex<Staging>,
    stream: &'a Arc<CudaStream>,
    bytes: usize,
) -> Result<StagedBatch<'a>> {
    let mut st = staging
        .lock()
        .map_err(|_| GpuError::Input("the upload staging buffer's lock is poisoned".into()))?;
    let k = st.next;
    st.next = (k + 1) % SLOTS;
    let slot = &mut st.slots[k];
    if let Some(e) = slot.done.take() {
        e.synchronize()?;
    }
    if slot.cap < bytes {
        stream.context().bind_to_thread()?;
        if !slot.ptr.is_null() {
            // SAFETY: the slot's previous copies are done (event above); nothing else reads it.
            unsafe { cudarc::driver::result::free_host(slot.ptr as *mut _) }?;
            slot.ptr = std::ptr::null_mut();
            slot.cap = 0;
        }
        let cap = bytes.next_power_of_two().max(1 << 16);
        // SAFETY: a plain page-locked allocation of `cap` bytes in the bound context.
        slot.ptr = unsafe { cudarc::driver::result::malloc_host(cap, 0) }? as *mut u8;
        slot.cap = cap;
    }
    Ok(StagedBatch {
        st,
        slot: k,
        stream,
        used: 0,
    })
}

impl StagedBatch<'_> {
    /// A new device buffer holding `data`, copied through the staging buffer on the batch's
    /// stream (from pageable memory when the reserved bytes are used up).
    pub(crate) fn put<T: DeviceRepr>(&mut self, gpu: &Gpu, data: &[T]) -> Result<CudaSlice<T>> {
        let n = std::mem::size_of_val(data);
        let len = staged_bytes(data);
        let (ptr, cap) = {
            let s = &self.st.slots[self.slot];
            (s.ptr, s.cap)
        };
        if n == 0 || self.used + len > cap {
            return upload(self.stream, data);
        }
        // SAFETY: [used, used + n) lies inside the slot's buffer (checked), which no pending copy
        // reads (its previous batch's event completed in `stage`; this batch's tables do not
        // overlap); T: DeviceRepr is plain data.
        let host = unsafe {
            let dst = ptr.add(self.used);
            std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, dst, n);
            dst
        };
        let mut d = alloc::<T>(gpu, self.stream, data.len())?;
        {
            let (dp, _record) = d.device_ptr_mut(self.stream);
            // SAFETY: `d` holds data.len() elements (n bytes); `host` is page-locked and stays
            // untouched until the event recorded when this batch drops has completed.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dp,
                    host as *const std::ffi::c_void,
                    n,
                    self.stream.cu_stream(),
                )
            }
            .result()?;
        }
        self.used += len;
        Ok(d)
    }
}

impl Drop for StagedBatch<'_> {
    fn drop(&mut self) {
        if self.used == 0 {
            return;
        }
        match self.stream.record_event(None) {
            Ok(e) => {
                let k = self.slot;
                self.st.slots[k].done = Some(e)
            }
            // without an event, wait here so that the buffer is never rewritten under a copy
            Err(_) => {
                let _ = self.stream.synchronize();
            }
        }
    }
}
