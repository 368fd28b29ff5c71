//! Page-locked staging for the host tables a call uploads (token ids, RoPE tables, sequence
//! descriptors, row indices, pixel rows). A copy from pageable memory makes the driver wait for
//! the stream's earlier work first, so an upload queued behind a layer stack stalls the host
//! until the stack is done, and an upload at the start of a call waits for the previous call;
//! a copy from page-locked memory is queued like a kernel and the host goes on.
//!
//! Invariants: a [`StagedBatch`] holds the model's staging buffer (under its mutex) while it
//! writes; the buffer is rewritten only after the event recorded behind the previous batch's
//! copies has completed (those copies sit at the start of that call's work, so the wait is
//! short unless the host runs a whole call ahead); a table that does not fit the reserved
//! bytes is uploaded from pageable memory instead (correct, only slower).

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};
use rollplex_kernels::cuda::Gpu;

use super::{alloc, upload, GpuError, Result};

/// Bytes a table of `data` takes in the staging buffer (16-byte aligned slots).
pub(crate) fn staged_bytes<T>(data: &[T]) -> usize {
    std::mem::size_of_val(data).div_ceil(16) * 16
}

/// The page-locked buffer and the event behind the last batch's copies.
pub(crate) struct Staging {
    ptr: *mut u8,
    cap: usize,
    done: Option<CudaEvent>,
}

// SAFETY: `ptr` is page-locked host memory owned by this value and only touched through the
// mutex that holds it (StagedBatch writes while holding the guard).
unsafe impl Send for Staging {}

impl Staging {
    pub(crate) fn new() -> Mutex<Self> {
        Mutex::new(Staging {
            ptr: std::ptr::null_mut(),
            cap: 0,
            done: None,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(e) = self.done.take() {
            // the copies must be done before the memory goes back
            let _ = e.synchronize();
        }
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host below and not freed yet; no copy reads it now.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut _) };
        }
    }
}

/// One call's uploads through the staging buffer (see the module doc). Dropping it records the
/// event the next batch waits for.
pub(crate) struct StagedBatch<'a> {
    st: MutexGuard<'a, Staging>,
    stream: &'a Arc<CudaStream>,
    used: usize,
}

/// Takes the staging buffer for a batch of at most `bytes` (sum of [`staged_bytes`]): waits
/// for the previous batch's copies, grows the buffer if needed.
pub(crate) fn stage<'a>(
    staging: &'a Mutex<Staging>,
    stream: &'a Arc<CudaStream>,
    bytes: usize,
) -> Result<StagedBatch<'a>> {
    let mut st = staging
        .lock()
        .map_err(|_| GpuError::Input("the upload staging buffer's lock is poisoned".into()))?;
    if let Some(e) = st.done.take() {
        e.synchronize()?;
    }
    if st.cap < bytes {
        stream.context().bind_to_thread()?;
        if !st.ptr.is_null() {
            // SAFETY: the previous batch's copies are done (event above); nothing else reads it.
            unsafe { cudarc::driver::result::free_host(st.ptr as *mut _) }?;
            st.ptr = std::ptr::null_mut();
            st.cap = 0;
        }
        let cap = bytes.next_power_of_two().max(1 << 16);
        // SAFETY: a plain page-locked allocation of `cap` bytes in the bound context.
        st.ptr = unsafe { cudarc::driver::result::malloc_host(cap, 0) }? as *mut u8;
        st.cap = cap;
    }
    Ok(StagedBatch {
        st,
        stream,
        used: 0,
    })
}

impl StagedBatch<'_> {
    /// A new device buffer holding `data`, copied through the staging buffer on the batch's
    /// stream (from pageable memory when the reserved bytes are used up).
    pub(crate) fn put<T: DeviceRepr>(&mut self, gpu: &Gpu, data: &[T]) -> Result<CudaSlice<T>> {
        let n = std::mem::size_of_val(data);
        let slot = staged_bytes(data);
        if n == 0 || self.used + slot > self.st.cap {
            return upload(self.stream, data);
        }
        // SAFETY: [used, used + n) lies inside the buffer (checked), which no pending copy reads
        // (the previous batch's event completed in `stage`; this batch's slots do not overlap);
        // T: DeviceRepr is plain data.
        let host = unsafe {
            let dst = self.st.ptr.add(self.used);
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
        self.used += slot;
        Ok(d)
    }
}

impl Drop for StagedBatch<'_> {
    fn drop(&mut self) {
        if self.used == 0 {
            return;
        }
        match self.stream.record_event(None) {
            Ok(e) => self.st.done = Some(e),
            // without an event, wait here so that the buffer is never rewritten under a copy
            Err(_) => {
                let _ = self.stream.synchronize();
            }
        }
    }
}
