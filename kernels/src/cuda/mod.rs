//! CUDA twins of the CPU ops (module [`crate::cpu`]), their launchers, cuBLAS(Lt) GEMMs, SM
//! partitions through green contexts, and the run-time compilation cache.
//!
//! What this module knows: device buffers (`cudarc` slices and views), streams, events, and the
//! shapes each op takes. It knows nothing of plans, models or RL; the runtime decides which
//! stream runs what and where buffers live (one arena per lifetime class, carved into views).
//!
//! | op (CUDA symbol = Rust launcher) | CPU twin | file |
//! |---|---|---|
//! | `matmul_bf16`, `matmul_bf16_f32` (fp32 output: weight gradients summed in place), `linear_fwd_bf16` (cuBLASLt, fp32 accumulate; where `skinny_pays` (small m, lopsided shapes up to m = 64) the skinny split-k kernel `gemv_bf16` / `gemv_tma_bf16`), `linear_fwd_bf16_cublaslt`, `gate_up_swiglu_bf16` (gate\|up GEMM with SwiGLU fused at small m) | `matmul`, `linear_fwd` (+ `swiglu_fwd`) | `gemm/` (`lt.rs`: cuBLASLt, `skinny.rs`), `gemv.cu` |
//! | `rmsnorm_fwd_bf16`, `add_rmsnorm_fwd_bf16` (residual add + norm) | `rmsnorm_fwd` (+ `add_fwd`) | `norm.rs`, `norm.cu` |
//! | `rope_fwd_bf16`, `swiglu_fwd_bf16`, `gelu_fwd_bf16`, `add_fwd_bf16`, `embedding_fwd_bf16`, `kv_append_bf16`, `rope_kv_append_bf16` | `rope_fwd`, `swiglu_fwd`, `gelu_fwd`, `add_fwd`, `embedding_fwd` | `pointwise.rs`, `pointwise.cu` |
//! | `attention_fwd_bf16`, `attention_decode_bf16` (block-pipelined tensor-core kernel with a split-K LSE merge; older warp-split and SIMT variants kept for timing), `attention_decode_grouped_bf16` (a GRPO group's shared prefix read once per group) | `attention_fwd`, `attention_decode` | `attention/` (`fwd.rs`, `decode.rs`, `grouped.rs`), `attention.cu` |
//! | `logprobs_fwd_bf16` | `logprobs_fwd` | `logprobs.rs`, `logprobs.cu` |
//! | `sample_bf16` (Philox4x32-10, temperature / top-k / top-p) | [`sampling::sample_ref`] | `sampling.rs`, `sampling.cu` |
//! | `adamw_step_f32` | `runtime::train::adamw` (bitwise) | `adamw.rs`, `adamw.cu` |
//! | `policy_loss_f32` (GRPO / PPO-clip / GSPO loss: per-token `dlogp`, metrics as order-fixed f64 sums; `policy_loss_reduce_f64` adds them into a [`PolicyLossAcc`]; `policy_loss_seq_ratio_f64`, the sequence ratio's per-sequence mean log-ratio) | `runtime::train::loss::policy_loss` (dlogp bitwise up to `exp`'s last bit); `cpu::seq_log_ratio` (bitwise) | `policy_loss.rs`, `policy_loss.cu` |
//! | `rmsnorm_bwd_bf16`, `rope_bwd_bf16`, `swiglu_bwd_bf16`, `swiglu_bwd_fused_bf16`, `gelu_bwd_bf16`, `embedding_bwd_f32`, `logprobs_bwd_bf16` (bf16 activation gradients, fp32 parameter gradients added) | `cpu::backward` (`rmsnorm_bwd`, `rope_bwd`, `swiglu_bwd`, `gelu_bwd` / `gelu_tanh_bwd`, `embedding_bwd`, `logprobs_bwd`) | `backward.rs`, `backward.cu` |
//! | `attention_bwd_bf16` (`attention_bwd_tc_bf16`, FlashAttention-2 on the tensor cores where they take the case, else SIMT; `attention_bwd_bf16_with` takes a [`BwdKernel`]), `attention_bwd_dprefix_bf16` (the shared-prefix keys' part alone on a chosen [`DprefixKernel`]: `attention_bwd_tc_dprefix_f32` or SIMT) | `cpu::attention_bwd` | `attention_bwd.rs`, `attention_bwd.cu`, `attention_bwd_tc.rs`, `attention_bwd_dprefix.rs`, `attention_bwd_tc.cu` |
//! | `sumsq_partial_f32` (the grad-norm's f64 partial sums, fixed order), `scale_f32` (the clip), `gather_sum_rows_bf16` (fixed-order row sums), `add_f32_into_bf16` | `cpu::grad` (`sumsq_partial`, `scale`, `gather_sum_rows`, `add_into`) | `grad.rs`, `grad.cu` |
//!
//! Invariants:
//! - Every launch takes an explicit `&CudaStream`; nothing here synchronises a stream or
//!   allocates on one, except [`Gpu`] creating per-stream GEMM workspaces on first use (call
//!   [`Gpu::prepare_stream`] before capturing a graph on a new stream).
//! - [`Gpu::new`] turns off cudarc's per-buffer event tracking: ordering between streams is the
//!   caller's, through events ([`Gpu::event`], `CudaStream::wait`), as the plan says.
//! - Results depend only on the inputs and launch arguments, never on the stream's SM partition or
//!   on timing: work splits are functions of shapes, reductions run in a fixed order, and cuBLASLt
//!   algorithms are chosen once per GEMM shape and reused on every stream.
//! - Launchers check buffer lengths, strides and alignment and return [`CudaError::Shape`]; a
//!   launch that passes the checks reads and writes only inside the buffers it was given.
//! - Every kernel starts through one helper (`launch::launch`: the function compiled on first
//!   use, its grid, block and dynamic shared memory, the arguments in order, the stream); it
//!   and the cuBLASLt call are where kernel timing ([`kernel_times`]) brackets launches.

pub mod adamw;
pub mod attention;
pub mod attention_bwd;
pub mod attention_bwd_dprefix;
pub mod attention_bwd_tc;
pub mod backward;
pub mod decode_loop;
pub mod gemm;
mod gpu;
pub mod grad;
pub mod green;
pub mod kernel_times;
mod launch;
pub mod logprobs;
pub mod norm;
pub mod nvrtc;
pub mod pointwise;
pub mod policy_loss;
pub mod sampling;

pub use adamw::{adamw_step_f32, AdamWScalars};
#[cfg(feature = "bench")]
pub use attention::decode_plan_for_blocks;
pub use attention::{
    attention_decode_bf16, attention_decode_grouped_bf16, attention_fwd_bf16, decode_plan,
    grouped_decode_plan, grouped_decode_plan_tabled, AttnSeqGpu, DecodeInputs, DecodePlan,
    FwdInputs, GroupedDecodePlan,
};
pub use attention_bwd::{attention_bwd_bf16, attention_bwd_bf16_with, BwdGrads, BwdInputs};
pub use attention_bwd_dprefix::{attention_bwd_dprefix_bf16, DprefixInputs, DprefixKernel};
pub use attention_bwd_tc::{attention_bwd_tc_bf16, BwdKernel};
pub use backward::{
    embedding_bwd_f32, gelu_bwd_bf16, logprobs_bwd_bf16, rmsnorm_bwd_bf16, rope_bwd_bf16,
    swiglu_bwd_bf16, swiglu_bwd_fused_bf16, SwigluBwdStrides,
};
pub use decode_loop::{
    decode_advance, decode_advance_ref, decode_gather_rows, DecodeAdvance, DecodeRow,
};
#[cfg(feature = "bench")]
pub use gemm::matmul_bf16_cublas;
pub use gemm::{
    gate_up_swiglu_bf16, linear_fwd_bf16, matmul_bf16, matmul_bf16_f32, qkv_rope_append_bf16,
    QkvRope,
};
pub use gpu::Gpu;
pub use grad::{
    add_f32_into_bf16, gather_sum_rows_bf16, gather_sum_rows_dev, scale_f32, sumsq_partial_f32,
    RowGather, RowGatherDev, SUMSQ_BLOCKS,
};
pub use green::{StreamOptions, StreamSet};
pub use kernel_times::{kernel_times_table, merge_kernel_times, KernelTime};
pub use logprobs::logprobs_fwd_bf16;
pub use norm::{add_rmsnorm_fwd_bf16, rmsnorm_fwd_bf16};
pub use pointwise::{
    add_fwd_bf16, add_fwd_bf16_inplace, embedding_fwd_bf16, gelu_fwd_bf16, kv_append_bf16,
    rope_fwd_bf16, rope_kv_append_bf16, swiglu_fwd_bf16, swiglu_gate_up_fwd_bf16,
};
pub use policy_loss::{
    policy_loss_f32, policy_loss_seq_ratio_f64, KlKind, LossAggKind, PolicyLossAcc,
    PolicyLossInputs, PolicyLossParams, PolicyLossSums, RatioKind,
};
pub use sampling::{
    philox4x32_10, sample_bf16, sample_bf16_keyed, sample_ref, SampleParams, SampleScratch,
};

pub use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
pub use half::bf16;

/// What can go wrong on the CUDA side. Each variant says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver or device on this machine.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS call failed: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("cuBLASLt call failed: {0}")]
    BlasLt(#[from] cudarc::cublaslt::result::CublasError),
    #[error("NVRTC could not compile {name} with options {options:?}:\n{log}")]
    Compile {
        name: String,
        options: Vec<String>,
        log: String,
    },
    #[error("NVRTC call failed: {0}")]
    Nvrtc(String),
    /// A launcher was handed buffers that do not fit the sizes it was given.
    #[error("{op}: {what}")]
    Shape { op: &'static str, what: String },
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

pub(crate) fn shape(op: &'static str, what: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op,
        what: what.into(),
    }
}

/// Whether a CUDA driver with at least one device can be used here, without panicking: checks
/// that `libcuda` can be loaded (cudarc's loader panics when it cannot), then initialises the
/// driver and counts devices. `Err` says why not, for a "skipped: no CUDA device" message.
pub fn cuda_available() -> Result<usize> {
    // SAFETY: only probes whether the shared library can be opened; calls nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "libcuda (the NVIDIA driver library) was not found".into(),
        ));
    }
    let n = std::panic::catch_unwind(cudarc::driver::CudaContext::device_count)
        .map_err(|_| CudaError::Unavailable("the CUDA driver library failed to load".into()))?
        .map_err(|e| CudaError::Unavailable(format!("cuInit / cuDeviceGetCount failed: {e}")))?;
    if n < 1 {
        return Err(CudaError::Unavailable(
            "the driver reports no CUDA device".into(),
        ));
    }
    Ok(n as usize)
}

/// The environment variable that turns a GPU test's skip into a failure: with
/// `ROLLPLEX_REQUIRE_GPU=1` (on a GPU host) a test that finds no usable device fails.
pub const REQUIRE_GPU_VAR: &str = "ROLLPLEX_REQUIRE_GPU";

/// The GPU-or-skip rule of every GPU test: device 0 when it opens. Without a driver or a
/// device the test skips: `None`, after printing `skipped: no CUDA device (why)`. A device the
/// driver reports that fails to open panics with the reason, and so, with
/// `ROLLPLEX_REQUIRE_GPU=1`, does a missing driver or device: a GPU host never passes a GPU test
/// silently.
pub fn test_gpu() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var(REQUIRE_GPU_VAR).is_ok_and(|v| v == "1") => {
            panic!("{REQUIRE_GPU_VAR}=1 but no CUDA device opens: {e}")
        }
        Err(e) if cuda_available().is_ok() => {
            panic!("the driver reports a CUDA device but device 0 does not open: {e}")
        }
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}
