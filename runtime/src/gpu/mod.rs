//! The Qwen2.5-VL model engine on the CUDA backend: the same operations as [`crate::model`]
//! (encode media, prefill a group's prompt once, decode over a shared-prefix KV arena, score
//! responses from a kept prefix, sample) with bf16 weights and activations on the device, built
//! from the kernels of `rollplex_kernels::cuda` (cuBLASLt GEMMs with fp32 accumulation, our
//! NVRTC kernels for the rest).
//!
//! Module map: `weights` (upload of a [`Qwen25VL`]: bf16, fused q|k|v and gate|up rows),
//! `plan` (host-side index work: window permutation, M-RoPE tables, packed sequences, decode
//! slot checks; pure, tested without a GPU), `vision` (`encode_media`), `text` (`prefill`,
//! `forward_logits`, `decode_step`, `score`, the device KV arena), `generate` (a group's rollout
//! with sampling on the device), `staging` (page-locked uploads of each call's host tables),
//! `train` (the text decoder's training step), `vision_train` (the vision tower's and merger's
//! training forward and backward), `streams` (the decode windows' SM partitions: the
//! `StreamSet` of `rollplex_kernels::cuda::green`).
//!
//! Names mirror the CPU engine so the executor can switch backends: `GpuModel::encode_media` /
//! `prefill` / `decode_step` / `score` / `generate_group`, [`GpuKvArena::store_prefix`], the same
//! [`DecodeSlot`](crate::model::DecodeSlot), [`Prompt`]-like inputs and result types.
//!
//! Invariants:
//! - Every launch and copy runs on the `&Arc<CudaStream>` the caller passes; nothing here
//!   synchronises except where a result comes back to the host (token ids for stop checks,
//!   scores), which the function's doc says. `prefill` and `encode_media` upload every host
//!   table through page-locked staging before their first launch, so the host never waits for
//!   the device inside them (it waits only for the previous call's uploads to have run).
//! - Numerics follow Hugging Face's bf16 forward: bf16 storage, fp32 accumulation, roundings
//!   where PyTorch's bf16 code rounds (the kernels document each); positions and window orders
//!   are computed on the host by the CPU engine's own functions (`model::positions`), so both
//!   backends place every token identically.
//! - A sample's results do not depend on which other samples share its batch: every op is
//!   row-wise or attends only its own sequence's keys, and GEMM algorithms are fixed per shape.

use std::sync::Arc;

use rollplex_kernels::cuda::{CudaError, CudaSlice, CudaStream, Gpu};

use crate::model::{ModelConfig, ModelError, Qwen25VL};

pub mod arena;
mod block;
mod block_bwd;
pub mod decode;
pub mod generate;
pub mod loss;
pub mod plan;
mod readback;
mod staging;
pub mod streams;
pub mod text;
pub mod train;
pub mod train_pack;
pub mod vision;
pub mod vision_train;
pub mod weights;

/// Orders frees after `done`: every stream of `streams` other than `on` (where `done` was
/// recorded) waits for it. A device buffer's drop queues its free on the stream it was made on,
/// so state used on other streams is dropped after this, not before.
pub(crate) fn wait_before_free<'a>(
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    on: &Arc<CudaStream>,
    done: &cudarc::driver::CudaEvent,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let mut waited = vec![on.cu_stream()];
    for x in streams {
        if !waited.contains(&x.cu_stream()) {
            x.wait(done)?;
            waited.push(x.cu_stream());
        }
    }
    Ok(())
}

pub use generate::sample_params;
pub use text::{GpuKvArena, GpuPrefixState, GpuPrompt};
pub use vision::GpuEncodedMedia;
pub use weights::GpuWeights;

/// What can go wrong in the GPU model.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("GPU model input: {0}")]
    Input(String),
    /// The model's dims do not fit a kernel (e.g. a head dim the attention kernels lack).
    #[error("GPU model: {0}")]
    Unsupported(String),
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// A Qwen2.5-VL model whose weights live on one GPU.
pub struct GpuModel {
    pub config: ModelConfig,
    pub weights: GpuWeights,
    /// `0..max_rows` as u32 on the device (identity row indices for copies).
    iota: CudaSlice<u32>,
    /// Page-locked staging for each call's host tables (`staging.rs`).
    staging: std::sync::Mutex<staging::Staging>,
}

impl GpuModel {
    /// Uploads `model` in bf16 on `stream` (returns once the copies are queued).
    ///
    /// Also sets the device's default memory pool to keep freed memory (release threshold
    /// `u64::MAX`): activations are allocated per call in stream order, and without this every
    /// synchronisation would hand the pool's memory back to the driver, so the next call
    /// would map it again.
    pub fn upload(gpu: &Gpu, stream: &Arc<CudaStream>, model: &Qwen25VL) -> Result<Self> {
        Self::upload_in(gpu, stream, model, None)
    }

    /// [`GpuModel::upload`] with the weights in `region` of the plan's arena.
    pub fn upload_in(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        model: &Qwen25VL,
        region: Option<&arena::Region>,
    ) -> Result<Self> {
        keep_pool_memory(gpu)?;
        let weights = GpuWeights::upload(gpu, stream, model, region)?;
        let iota = stream.clone_htod(&(0..IOTA_ROWS as u32).collect::<Vec<u32>>())?;
        Ok(GpuModel {
            config: model.config.clone(),
            weights,
            iota,
            staging: staging::Staging::new(),
        })
    }

    /// Takes the upload staging buffer for a batch of at most `bytes` (the sum of
    /// `staging::staged_bytes` of the tables); waits only for the previous batch's copies.
    pub(crate) fn stage<'a>(
        &'a self,
        stream: &'a Arc<CudaStream>,
        bytes: usize,
    ) -> Result<staging::StagedBatch<'a>> {
        staging::stage(&self.staging, stream, bytes)
    }

    /// Identity row indices `0..n` on the device.
    pub(crate) fn iota(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<std::borrow::Cow<'_, CudaSlice<u32>>> {
        if n <= IOTA_ROWS {
            Ok(std::borrow::Cow::Borrowed(&self.iota))
        } else {
            let v: Vec<u32> = (0..n as u32).collect();
            Ok(std::borrow::Cow::Owned(stream.clone_htod(&v)?))
        }
    }
}

fn keep_pool_memory(gpu: &Gpu) -> Result<()> {
    use cudarc::driver::sys;
    let ctx = gpu.ctx();
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: valid out-pointer and device of the bound context; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()?;
    }
    Ok(())
}

/// Rows of the kept identity index buffer (larger batches upload their own).
const IOTA_ROWS: usize = 1 << 16;

/// Uploads host data to a new device buffer.
pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        // a 1-element buffer keeps pointers valid for launchers that take empty inputs
        // SAFETY: never read (every user passes a length of 0 with it)
        return Ok(unsafe { stream.alloc::<T>(1) }?);
    }
    Ok(stream.clone_htod(data)?)
}

/// A new device buffer of `n` elements (uninitialised; every user writes before reading).
pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    Ok(gpu.alloc::<T>(stream, n)?)
}

/// Downloads a device buffer (synchronises `stream`).
pub(crate) fn download<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    src: &impl cudarc::driver::DevicePtr<T>,
) -> Result<Vec<T>> {
    let v = stream.clone_dtoh(src)?;
    stream.synchronize()?;
    Ok(v)
}

#[cfg(test)]
mod tests;
