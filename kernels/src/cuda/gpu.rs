//! [`Gpu`]: one device's context, its compiled kernels, and its GEMM handles.
//!
//! Kernels are compiled on first use for the device's architecture (through the disk cache of
//! [`super::nvrtc`]) and kept per (module, defines). cuBLASLt runs with one handle, one GEMM plan
//! per shape (algorithm chosen once, so every stream runs the same algorithm and gets the same
//! bits), and one 32 MiB workspace per stream (two streams never share a workspace). cuBLAS (the
//! classic API, kept for timing beside cuBLASLt: feature `bench`) gets one handle per stream.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(feature = "bench")]
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
};

use super::gemm::LtState;
use super::kernel_times::{KernelTime, KernelTimer, TimerSlot};
use super::nvrtc::{self, KernelModule};
use super::{cuda_available, CudaError, Result};

type ModuleKey = (&'static str, Vec<(&'static str, u32)>);

/// A CUDA device ready to run this crate's kernels. Cheap to share (`&Gpu` across threads).
pub struct Gpu {
    ctx: Arc<CudaContext>,
    arch: String,
    name: String,
    sm_count: u32,
    modules: Mutex<HashMap<ModuleKey, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(ModuleKey, &'static str), CudaFunction>>,
    compile_logs: Mutex<Vec<(String, String)>>,
    pub(crate) lt: Mutex<LtState>,
    /// Launch the kernels that wait for their predecessor themselves with programmatic stream
    /// serialization ([`Gpu::set_pdl`]).
    pdl: AtomicBool,
    /// Kernel timing ([`Gpu::set_kernel_times`]): the switch read on every launch, and the
    /// timer behind it.
    timing: AtomicBool,
    timer: TimerSlot,
    #[cfg(feature = "bench")]
    blas: Mutex<HashMap<usize, CudaBlas>>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Finish all work before the workspaces and handles go (their frees are stream-ordered).
        let _ = self.ctx.synchronize();
    }
}

impl Gpu {
    /// Opens device `ordinal` (its primary context) and turns off cudarc's per-buffer event
    /// tracking (see the module invariants in [`super`]).
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let n = cuda_available()?;
        if ordinal >= n {
            return Err(CudaError::Unavailable(format!(
                "device {ordinal} asked for, {n} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: from here on buffers of this context carry no events; ordering across streams
        // is the caller's (the crate's invariant), and no buffer was allocated before this call.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        let lt = LtState::new()?;
        let timing = match std::env::var("ROLLPLEX_KERNEL_TIMES").as_deref() {
            Err(_) | Ok("") | Ok("0") => false,
            Ok("1") => true,
            Ok(other) => {
                return Err(super::shape(
                    "ROLLPLEX_KERNEL_TIMES",
                    format!("{other} is not 0 or 1 (1 times every eager launch, per kernel)"),
                ))
            }
        };
        Ok(Gpu {
            // sm_90 devices compile for sm_90a: the same code plus the warpgroup MMAs
            arch: if (major, minor) == (9, 0) {
                "sm_90a".to_string()
            } else {
                format!("sm_{major}{minor}")
            },
            name: ctx.name()?,
            sm_count,
            ctx,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            compile_logs: Mutex::new(Vec::new()),
            lt: Mutex::new(lt),
            pdl: AtomicBool::new(major >= 9 && std::env::var("ROLLPLEX_PDL").as_deref() != Ok("0")),
            timing: AtomicBool::new(timing),
            timer: Mutex::new(timing.then(KernelTimer::default)),
            #[cfg(feature = "bench")]
            blas: Mutex::new(HashMap::new()),
        })
    }

    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// `sm_XY` of the device (what NVRTC compiles for; `sm_90a` on Hopper).
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// Whether the device has Hopper's warpgroup MMAs (`wgmma`), i.e. compiles for `sm_90a`.
    pub fn has_wgmma(&self) -> bool {
        self.arch == "sm_90a"
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Streaming multiprocessors of the whole device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Whether kernels that wait for their predecessor themselves (`pdl_wait()` in common.cuh)
    /// are launched with programmatic stream serialization: each may be scheduled while the
    /// kernel ahead of it drains, which hides most of the gap between two short kernels. On by
    /// default on Hopper and later; `ROLLPLEX_PDL=0` turns it off. Results are the same either
    /// way (each such kernel waits for its predecessor's writes before its first access).
    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch on or off for later launches (and graph captures;
    /// graphs captured earlier keep what they were captured with). Ignored below Hopper.
    pub fn set_pdl(&self, on: bool) {
        let hopper = self.arch.starts_with("sm_9") || self.arch.starts_with("sm_1");
        self.pdl.store(on && hopper, Ordering::Relaxed);
    }

    /// Whether launches are timed ([`super::kernel_times`]).
    pub fn kernel_times(&self) -> bool {
        self.timing.load(Ordering::Relaxed)
    }

    /// Turns kernel timing on or off (`ROLLPLEX_KERNEL_TIMES=1` turns it on when the device
    /// opens). Turning it off drops what was not taken.
    pub fn set_kernel_times(&self, on: bool) {
        let mut t = self.timer.lock().unwrap_or_else(|e| e.into_inner());
        match (on, t.is_some()) {
            (true, false) => *t = Some(KernelTimer::default()),
            (false, true) => *t = None,
            _ => {}
        }
        self.timing.store(on, Ordering::Relaxed);
    }

    /// Names what the launches from here on belong to (a task kind, a phase), `None` for
    /// nothing: the timing table's first column. Returns the scope before (to restore it).
    pub fn set_kernel_scope(&self, scope: Option<&str>) -> Option<String> {
        self.with_timer(|t| t.set_scope(scope)).flatten()
    }

    /// The timed launches since the last take (or since timing was turned on), per (scope,
    /// kernel), longest first; waits for the last of them to finish. Empty while timing is off.
    pub fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        self.with_timer(KernelTimer::take)
            .unwrap_or_else(|| Ok(Vec::new()))
    }

    /// `f` on the timer, `None` while timing is off.
    fn with_timer<R>(&self, f: impl FnOnce(&mut KernelTimer) -> R) -> Option<R> {
        self.timer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .map(f)
    }

    /// Runs `f`, which launches work on `stream` that no launcher of this crate times itself (a
    /// graph replay), timed as one launch of `name` doing `flops` while timing is on.
    pub fn timed<T>(
        &self,
        stream: &CudaStream,
        name: &'static str,
        flops: f64,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = self.time_start(stream)?;
        let out = f()?;
        self.time_end(stream, start, name, flops)?;
        Ok(out)
    }

    /// The start of a timed launch on `stream` (none while timing is off or the stream captures).
    pub(crate) fn time_start(&self, stream: &CudaStream) -> Result<Option<CudaEvent>> {
        if !self.kernel_times() {
            return Ok(None);
        }
        self.with_timer(|t| t.start(stream)).unwrap_or(Ok(None))
    }

    /// The end of the launch [`Gpu::time_start`] opened.
    pub(crate) fn time_end(
        &self,
        stream: &CudaStream,
        start: Option<CudaEvent>,
        name: &'static str,
        flops: f64,
    ) -> Result<()> {
        let Some(start) = start else {
            return Ok(());
        };
        self.with_timer(|t| t.end(stream, start, name, flops))
            .unwrap_or(Ok(()))
    }

    /// A new non-blocking stream. `priority`: lower is more urgent; clamped to the device's range.
    pub fn stream(&self, priority: i32) -> Result<Arc<CudaStream>> {
        let (least, greatest) = self.priority_range()?;
        Ok(self
            .ctx
            .new_stream_with_priority(priority.clamp(greatest, least))?)
    }

    /// The device's stream priority range as (least urgent, most urgent), e.g. (0, -5).
    pub fn priority_range(&self) -> Result<(i32, i32)> {
        self.ctx.bind_to_thread()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: two valid out-pointers; the context is current.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }.result()?;
        Ok((least, greatest))
    }

    /// An event for cross-stream ordering (timing disabled, the cheap kind):
    /// `ev.record(&producer)?; consumer.wait(&ev)?`.
    pub fn event(&self) -> Result<CudaEvent> {
        Ok(self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?)
    }

    /// An event that can time (`start.elapsed_ms(&end)`).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        Ok(self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// The device's default memory pool (where every stream-ordered allocation of this crate
    /// comes from).
    fn pool(&self) -> Result<sys::CUmemoryPool> {
        self.ctx.bind_to_thread()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and the device of the bound context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }.result()?;
        Ok(pool)
    }

    /// Bytes of the default pool in use now and its high-water mark since the last
    /// [`Gpu::reset_pool_peak`] (what this crate's allocations held at most).
    pub fn pool_usage(&self) -> Result<(u64, u64)> {
        let pool = self.pool()?;
        let (mut used, mut high) = (0u64, 0u64);
        // SAFETY: the two attributes take a u64 (cuuint64_t) out-value; the pool is valid.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                &mut used as *mut u64 as *mut std::ffi::c_void,
            )
            .result()?;
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut high as *mut u64 as *mut std::ffi::c_void,
            )
            .result()?;
        }
        Ok((used, high))
    }

    /// Starts a new high-water mark of the default pool at its current use.
    pub fn reset_pool_peak(&self) -> Result<()> {
        let pool = self.pool()?;
        let mut zero = 0u64;
        // SAFETY: setting USED_MEM_HIGH takes a u64 that must be 0 (reset to the current use).
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut std::ffi::c_void,
            )
        }
        .result()?;
        Ok(())
    }

    /// Grows the default pool to hold `bytes` without asking the driver again (one allocation
    /// of that size, freed back into the pool, whose release threshold the caller set to keep
    /// it): the plan's device arena is reserved once, before the first iteration, and every
    /// later buffer is carved from it.
    pub fn reserve_pool(&self, stream: &Arc<CudaStream>, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: never read or written; freed (stream-ordered) when dropped below.
        let block = unsafe { stream.alloc::<u8>(bytes as usize) }?;
        drop(block);
        stream.synchronize()?;
        Ok(())
    }

    /// Allocates `n` elements on `stream` (not initialised: poison or fill before reading).
    pub fn alloc<T: cudarc::driver::DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        // SAFETY: the memory is uninitialised; every kernel here writes its outputs before
        // anything reads them, and callers fill inputs before launching.
        Ok(unsafe { stream.alloc::<T>(n.max(1)) }?)
    }

    /// Frees what GEMMs keep per stream (the 32 MiB cuBLASLt workspace, the cuBLAS handle) for
    /// `streams`, which are done with: the device is synchronised first. Whoever makes streams
    /// for a while (an RL loop's plan streams) calls this before dropping them, so that state of
    /// dead streams does not pile up (a later stream gets its own again on first use).
    pub fn forget_streams<'a>(
        &self,
        streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    ) -> Result<()> {
        self.ctx.synchronize()?;
        let keys: Vec<usize> = streams
            .into_iter()
            .map(|s| s.cu_stream() as usize)
            .collect();
        let mut lt = self.lt()?;
        #[cfg(feature = "bench")]
        let mut blas = self.blas()?;
        for k in keys {
            lt.forget(k);
            #[cfg(feature = "bench")]
            blas.remove(&k);
        }
        Ok(())
    }

    /// Creates what GEMMs on `stream` need (the cuBLASLt workspace) ahead of a graph capture.
    pub fn prepare_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.lt()?.workspace(stream)?;
        Ok(())
    }

    pub(crate) fn lt(&self) -> Result<MutexGuard<'_, LtState>> {
        self.lt
            .lock()
            .map_err(|_| CudaError::Nvrtc("cuBLASLt state poisoned by a panic".into()))
    }

    #[cfg(feature = "bench")]
    fn blas(&self) -> Result<MutexGuard<'_, HashMap<usize, CudaBlas>>> {
        self.blas
            .lock()
            .map_err(|_| CudaError::Nvrtc("cuBLAS state poisoned by a panic".into()))
    }

    /// The classic cuBLAS handle bound to `stream` (created on first use).
    #[cfg(feature = "bench")]
    pub(crate) fn with_blas<R>(
        &self,
        stream: &Arc<CudaStream>,
        f: impl FnOnce(&CudaBlas) -> Result<R>,
    ) -> Result<R> {
        let mut map = self.blas()?;
        let key = stream.cu_stream() as usize;
        if let std::collections::hash_map::Entry::Vacant(e) = map.entry(key) {
            e.insert(CudaBlas::new(stream.clone())?);
        }
        f(&map[&key])
    }

    /// The kernel `func` of `module` compiled with `defines` (compiled and loaded on first use).
    pub fn function(
        &self,
        module: &KernelModule,
        defines: &[(&'static str, u32)],
        func: &'static str,
    ) -> Result<CudaFunction> {
        let mkey: ModuleKey = (module.name, defines.to_vec());
        let fkey = (mkey.clone(), func);
        if let Some(f) = self.functions.lock().expect("kernel table lock").get(&fkey) {
            return Ok(f.clone());
        }
        let m = self.module(module, defines, mkey)?;
        let f = m.load_function(func)?;
        self.functions
            .lock()
            .expect("kernel table lock")
            .insert(fkey, f.clone());
        Ok(f)
    }

    fn module(
        &self,
        module: &KernelModule,
        defines: &[(&'static str, u32)],
        key: ModuleKey,
    ) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().expect("module table lock");
        if let Some(m) = mods.get(&key) {
            return Ok(m.clone());
        }
        let c = nvrtc::compile(module, &self.arch, defines)?;
        if !c.log.is_empty() {
            self.compile_logs
                .lock()
                .expect("log lock")
                .push((format!("{}{defines:?}", module.name), c.log));
        }
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin))?;
        mods.insert(key, m.clone());
        Ok(m)
    }

    /// Compile logs (ptxas register / spill reports) of the modules compiled by this process
    /// (cache hits have none).
    pub fn compile_logs(&self) -> Vec<(String, String)> {
        self.compile_logs.lock().expect("log lock").clone()
    }
}
