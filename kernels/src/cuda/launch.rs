//! Small helpers every launcher uses: raw device pointers, length and alignment checks.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};

use super::{shape, Result};

/// The raw device address of a buffer to read (no event bookkeeping: tracking is off).
pub(crate) fn ptr<T>(x: &(impl DevicePtr<T> + ?Sized), s: &CudaStream) -> u64 {
    let (p, _sync) = x.device_ptr(s);
    p
}

/// The raw device address of a buffer to write.
pub(crate) fn ptr_mut<T>(x: &mut (impl DevicePtrMut<T> + ?Sized), s: &CudaStream) -> u64 {
    let (p, _sync) = x.device_ptr_mut(s);
    p
}

/// `name` must hold at least `want` elements.
pub(crate) fn need<T>(
    op: &'static str,
    name: &str,
    x: &(impl DeviceSlice<T> + ?Sized),
    want: usize,
) -> Result<()> {
    if x.len() < want {
        return Err(shape(
            op,
            format!("{name} holds {} elements, needs at least {want}", x.len()),
        ));
    }
    Ok(())
}

/// The address must be 16-byte aligned (kernels that read whole rows with 16-byte loads).
pub(crate) fn aligned16(op: &'static str, name: &str, p: u64) -> Result<()> {
    if p % 16 != 0 {
        return Err(shape(
            op,
            format!("{name} must start on a 16-byte boundary (address {p:#x})"),
        ));
    }
    Ok(())
}

/// A size that a kernel takes as u32.
pub(crate) fn u32_of(op: &'static str, name: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{name} = {v} does not fit in 32 bits")))
}

/// Blocks for a grid-stride loop over `n` items of `per_block` each, capped.
pub(crate) fn grid_for(n: usize, per_block: usize, cap: usize) -> u32 {
    n.div_ceil(per_block.max(1)).clamp(1, cap) as u32
}
