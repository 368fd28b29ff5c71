//! What every launcher uses: [`launch`] (the one way a kernel of this crate is started), its
//! [`Grid`], raw device pointers, length and alignment checks.

use std::ffi::c_void;

use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs,
    LaunchConfig, PushKernelArg,
};

use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};

/// Where a kernel runs: its grid, its block, and the bytes of dynamic shared memory it gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grid {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
}

impl Grid {
    /// `grid` blocks of `threads` threads along x, no dynamic shared memory.
    pub fn new(grid: (u32, u32, u32), threads: u32) -> Grid {
        Grid {
            grid,
            block: (threads, 1, 1),
            smem: 0,
        }
    }
}

/// One kernel argument, passed by reference: a device address (`u64`), a size, a scalar or a
/// `repr(C)` struct that mirrors the kernel's.
pub(crate) trait KernelArg {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>);
    /// The argument's address, as the driver's kernel-parameter array holds it.
    fn param(&self) -> *mut c_void;
}

impl<T: DeviceRepr> KernelArg for T {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(self);
    }
    fn param(&self) -> *mut c_void {
        self as *const T as *mut c_void
    }
}

/// The kernels that call `pdl_wait()` (common.cuh) before their first memory access: with
/// [`Gpu::pdl`] on they are launched with programmatic stream serialization, so each may be
/// scheduled while the kernel ahead of it drains (the decode step's short kernels). A kernel
/// named here without that call would race its predecessor: add both or neither.
pub(crate) const PDL_KERNELS: &[&str] = &[
    "rmsnorm_fwd_bf16",
    "add_rmsnorm_fwd_bf16",
    "rope_kv_append_bf16",
    "swiglu_fwd_bf16",
    "add_fwd_bf16",
    "embedding_fwd_bf16",
    "attention_decode_simt_bf16",
    "attention_decode_bf16",
    "attention_decode_grouped_bf16",
    "attention_decode_grouped_wide_bf16",
    "attention_decode_reduce_bf16",
    "gemv_bf16",
    "gemv_tma_bf16",
    "sample_bf16",
    "sample_bf16_keyed",
    "sample_split_bf16",
    "logprobs_fwd_bf16",
    "decode_advance",
    "decode_gather_rows",
];

/// Launches kernel `func` of `module` (compiled with `defines` on first use) on `stream` over
/// `g`, with `args` in order. When `g.smem > 0` the kernel's dynamic shared-memory limit is
/// first raised to exactly that (the launch then passes it).
///
/// # Safety
/// `args` match the kernel's signature (count, order and types), and the buffers behind the
/// addresses among them hold every element the kernel reads or writes for this grid.
pub(crate) unsafe fn launch(
    gpu: &Gpu,
    stream: &CudaStream,
    module: &KernelModule,
    defines: &[(&'static str, u32)],
    func: &'static str,
    g: Grid,
    args: &[&dyn KernelArg],
) -> Result<()> {
    let f = gpu.function(module, defines, func)?;
    if g.smem > 0 {
        // SAFETY: a valid function handle of this context; the limit is what this launch
        // passes (every launcher keeps it under the 227 KiB an sm_90 block may use).
        unsafe {
            cudarc::driver::sys::cuFuncSetAttribute(
                f.cu_function(),
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                g.smem as i32,
            )
        }
        .result()?;
    }
    let timed = gpu.time_start(stream)?;
    if gpu.pdl() && PDL_KERNELS.contains(&func) {
        // SAFETY: the caller's (see above).
        unsafe { launch_programmatic(stream, &f, g, args) }?;
        return gpu.time_end(stream, timed, func, 0.0);
    }
    let mut b = stream.launch_builder(&f);
    for a in args {
        a.push(&mut b);
    }
    let cfg = LaunchConfig {
        grid_dim: g.grid,
        block_dim: g.block,
        shared_mem_bytes: g.smem,
    };
    // SAFETY: the caller's (see above).
    unsafe { b.launch(cfg) }?;
    gpu.time_end(stream, timed, func, 0.0)
}

/// `cuLaunchKernelEx` with programmatic stream serialization allowed (see [`PDL_KERNELS`]).
///
/// # Safety
/// As [`launch`]'s.
unsafe fn launch_programmatic(
    stream: &CudaStream,
    f: &CudaFunction,
    g: Grid,
    args: &[&dyn KernelArg],
) -> Result<()> {
    use cudarc::driver::sys;
    stream.context().bind_to_thread()?;
    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
    // SAFETY: a C union of integers and byte arrays: all zeros is a valid value.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let cfg = sys::CUlaunchConfig {
        gridDimX: g.grid.0,
        gridDimY: g.grid.1,
        gridDimZ: g.grid.2,
        blockDimX: g.block.0,
        blockDimY: g.block.1,
        blockDimZ: g.block.2,
        sharedMemBytes: g.smem,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: cfg, attr and params outlive the call (the driver copies the argument values at
    // launch); the arguments match the kernel (the caller's contract).
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()?;
    Ok(())
}

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
    if !p.is_multiple_of(16) {
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

/// A tensor-memory-accelerator descriptor (the driver's `CUtensorMap`, 128 bytes) as a kernel
/// argument: passed by value, read by the kernel as a `__grid_constant__` parameter.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap([u64; 16]);

// SAFETY: plain bytes that mirror the kernel's `TmaMap` parameter (128 bytes, 64-aligned).
unsafe impl DeviceRepr for TmaMap {}

/// The TMA descriptor of a row-major bf16 matrix of `rows` rows of `cols` elements, `ld`
/// elements apart, at device address `addr`, read in boxes of `box_cols` x `box_rows` into
/// shared memory in the 128-byte swizzle (`box_cols * 2` must be at most 128), elements outside
/// the matrix read as zeros. Needs a 16-byte aligned `addr` and `ld % 8 == 0`.
pub(crate) fn tma_map_bf16(
    op: &'static str,
    addr: u64,
    rows: usize,
    cols: usize,
    ld: usize,
    box_cols: u32,
    box_rows: u32,
) -> Result<TmaMap> {
    use cudarc::driver::sys;
    aligned16(op, "tensor", addr)?;
    if !ld.is_multiple_of(8) || ld < cols || rows == 0 || cols == 0 {
        return Err(shape(
            op,
            format!("a {rows} x {cols} tensor with row stride {ld} (a positive multiple of 8, at least the columns) has no TMA descriptor"),
        ));
    }
    if box_cols * 2 > 128 || !(1..=256).contains(&box_rows) {
        return Err(shape(
            op,
            format!("TMA box {box_cols} x {box_rows}: at most 64 bf16 columns and 256 rows"),
        ));
    }
    let dims = [cols as u64, rows as u64];
    let strides = [(ld * 2) as u64];
    let boxes = [box_cols, box_rows];
    let elem = [1u32, 1];
    // SAFETY: all-zero bytes are a valid CUtensorMap (an opaque array the driver fills).
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    // SAFETY: every pointer is to a live array of the rank the call names (2 dims, 1 stride);
    // the driver only writes `map`.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            addr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()?;
    Ok(TmaMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes a TMA descriptor cannot describe are refused before the driver is asked (no GPU
    /// needed): an unaligned address, a row stride that is not a multiple of 8 or is shorter
    /// than a row, an empty tensor, a box wider than the 128-byte swizzle or taller than 256.
    #[test]
    fn tma_maps_refuse_what_they_cannot_describe() {
        let op = "test";
        for (addr, rows, cols, ld, bc, br) in [
            (0x1008u64, 8, 64, 64, 64, 8),
            (0x1000, 8, 64, 60, 64, 8),
            (0x1000, 8, 64, 32, 64, 8),
            (0x1000, 0, 64, 64, 64, 8),
            (0x1000, 8, 0, 64, 64, 8),
            (0x1000, 8, 128, 128, 128, 8),
            (0x1000, 8, 64, 64, 64, 257),
            (0x1000, 8, 64, 64, 64, 0),
        ] {
            let r = tma_map_bf16(op, addr, rows, cols, ld, bc, br);
            assert!(
                matches!(r, Err(super::super::CudaError::Shape { .. })),
                "{addr:#x} {rows}x{cols} ld {ld} box {bc}x{br}"
            );
        }
    }

    /// The kernels whose body calls `pdl_wait()`, read from every CUDA source of the crate:
    /// exactly those of [`PDL_KERNELS`] (one named there without the call would race the kernel
    /// ahead of it; one calling it but not named would lose its early scheduling).
    #[test]
    fn pdl_kernels_are_those_that_wait() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut waiting = Vec::new();
        let mut kernels = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_none_or(|x| x != "cu") {
                continue;
            }
            let src = std::fs::read_to_string(&path).unwrap();
            for (name, body) in kernel_bodies(&src) {
                kernels += 1;
                if body.contains("pdl_wait()") {
                    waiting.push(name.to_string());
                }
            }
        }
        assert!(
            kernels > 40,
            "found only {kernels} kernels: the parser lost its way"
        );
        waiting.sort_unstable();
        let mut named: Vec<String> = PDL_KERNELS.iter().map(|k| k.to_string()).collect();
        named.sort_unstable();
        assert_eq!(waiting, named);
    }

    /// (name, body) of every `extern "C" __global__` function in a CUDA source: the name is the
    /// identifier before the parameter list (past `__launch_bounds__(..)`), the body the text
    /// between its braces.
    fn kernel_bodies(src: &str) -> Vec<(&str, &str)> {
        let b = src.as_bytes();
        // the index just past the bracket matching the opening one at `open`
        let matching = |open: usize, (l, r): (u8, u8)| {
            let mut depth = 0;
            for (i, &c) in b.iter().enumerate().skip(open) {
                if c == l {
                    depth += 1;
                } else if c == r {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
            }
            panic!("unbalanced {} at byte {open}", l as char);
        };
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(k) = src[at..].find("extern \"C\" __global__") {
            let mut i = at + k;
            let name = loop {
                let open = i + src[i..].find('(').expect("a parameter list");
                let ident = src[..open].trim_end();
                let start = ident
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |p| p + 1);
                i = matching(open, (b'(', b')'));
                if &ident[start..] != "__launch_bounds__" {
                    break &ident[start..];
                }
            };
            let open = i + src[i..].find('{').expect("a body");
            let close = matching(open, (b'{', b'}'));
            out.push((name, &src[open + 1..close - 1]));
            at = close;
        }
        out
    }
}
