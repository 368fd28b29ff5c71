//! Device-to-host copies that nobody waits for at once. A buffer's copy is queued into
//! page-locked host memory behind the work that writes it, with an event behind the copy; the
//! host reads it later, waiting for that event only. A copy into pageable memory would make the
//! host wait for the stream's earlier work at once, so a caller that queues a micro-batch and
//! goes on to the next could not run ahead of the device.
//!
//! Invariants: a [`Readback`] owns its page-locked buffer until [`Readbacks::take`] hands the
//! buffer back to the pool (after the copy's event completed) or it is dropped (which waits for
//! the event before freeing). Buffers are kept and reused: allocating page-locked memory is slow.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream, DevicePtr, DeviceRepr};
use rollplex_kernels::cuda::Gpu;

use super::Result;

/// One page-locked host buffer.
struct HostBuf {
    ptr: *mut u8,
    cap: usize,
}

impl HostBuf {
    fn free(self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host below, not freed yet; no copy writes it (the
            // callers waited for every copy into it).
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut _) };
        }
    }
}

/// The pool of page-locked buffers the copies land in.
#[derive(Default)]
pub(crate) struct Readbacks {
    free: Vec<HostBuf>,
}

// SAFETY: the buffers are page-locked host memory owned by the pool; a buffer is written only by
// a copy the pool's owner queued and read only after that copy's event (through `take`).
unsafe impl Send for Readbacks {}

/// A queued copy of a device buffer of `len` values `T` (see the module doc).
pub(crate) struct Readback<T> {
    buf: Option<HostBuf>,
    len: usize,
    ready: Option<CudaEvent>,
    _t: PhantomData<T>,
}

// SAFETY: as for `Readbacks`: the buffer is read only after the copy's event completed.
unsafe impl<T> Send for Readback<T> {}

impl Readbacks {
    /// Queues a copy of `src` on `stream` into a pooled page-locked buffer; the host does not
    /// wait.
    pub(crate) fn queue<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        src: &impl DevicePtr<T>,
    ) -> Result<Readback<T>> {
        let len = src.len();
        let bytes = std::mem::size_of::<T>() * len;
        if bytes == 0 {
            return Ok(Readback {
                buf: None,
                len: 0,
                ready: None,
                _t: PhantomData,
            });
        }
        let buf = match self.free.iter().position(|b| b.cap >= bytes) {
            Some(i) => self.free.swap_remove(i),
            None => {
                stream.context().bind_to_thread()?;
                let cap = bytes.next_power_of_two().max(4096);
                // SAFETY: a plain page-locked allocation of `cap` bytes in the bound context.
                let ptr = unsafe { cudarc::driver::result::malloc_host(cap, 0) }? as *mut u8;
                HostBuf { ptr, cap }
            }
        };
        let mut r = Readback {
            buf: Some(buf),
            len,
            ready: None,
            _t: PhantomData,
        };
        {
            let (sp, _record) = src.device_ptr(stream);
            let dst = r.buf.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr);
            // SAFETY: `dst` holds at least `bytes` bytes and nothing reads it before the event
            // recorded below completes; `src` holds `len` values of T.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst as *mut std::ffi::c_void,
                    sp,
                    bytes,
                    stream.cu_stream(),
                )
            }
            .result()?;
        }
        let ready = gpu.event()?;
        ready.record(stream)?;
        r.ready = Some(ready);
        Ok(r)
    }

    /// Waits for `r`'s copy and returns its values; its buffer goes back to the pool.
    pub(crate) fn take<T: DeviceRepr + Clone>(&mut self, mut r: Readback<T>) -> Result<Vec<T>> {
        if let Some(e) = r.ready.take() {
            e.synchronize()?;
        }
        let Some(buf) = r.buf.take() else {
            return Ok(Vec::new());
        };
        // SAFETY: the copy of `len` values of T into `buf` has completed (event above); T is
        // plain data (DeviceRepr).
        let v = unsafe { std::slice::from_raw_parts(buf.ptr as *const T, r.len) }.to_vec();
        self.free.push(buf);
        Ok(v)
    }
}

impl<T> Drop for Readback<T> {
    fn drop(&mut self) {
        if let Some(e) = self.ready.take() {
            // the copy must be done before the memory goes back
            let _ = e.synchronize();
        }
        if let Some(b) = self.buf.take() {
            b.free();
        }
    }
}

impl Drop for Readbacks {
    fn drop(&mut self) {
        for b in self.free.drain(..) {
            b.free();
        }
    }
}
