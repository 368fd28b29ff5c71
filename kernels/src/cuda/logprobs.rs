//! `logprobs_fwd_bf16` (kernel in `cuda/logprobs.cu`): the twin of [`crate::cpu::logprobs_fwd`]
//! on bf16 logits, fp32 accumulation: per row the log-probability of its target under
//! `softmax(logits / temperature)`, and optionally the entropy and the log-sum-exp.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::LOGPROBS;
use super::{shape, Gpu, Result};

/// `logp[r] = z[r, targets[r]] - lse_r` with `z = logits / temperature`; `entropy[r]`,
/// `lse[r]` when given. `logits` rows are `row_stride` apart (`>= vocab`). A target outside the
/// vocabulary gives NaN (the CPU twin returns an error; the device cannot without a sync).
#[allow(clippy::too_many_arguments)]
pub fn logprobs_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    logp: &mut impl DevicePtrMut<f32>,
    entropy: Option<&mut dyn DevicePtrMut<f32>>,
    lse: Option<&mut dyn DevicePtrMut<f32>>,
    logits: &impl DevicePtr<bf16>,
    targets: &impl DevicePtr<u32>,
    rows: usize,
    vocab: usize,
    row_stride: usize,
    temperature: f32,
) -> Result<()> {
    const OP: &str = "logprobs_fwd_bf16";
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(shape(
            OP,
            format!("temperature must be positive and finite, got {temperature}"),
        ));
    }
    if vocab == 0 || row_stride < vocab {
        return Err(shape(
            OP,
            format!("vocab {vocab} must be positive and fit in row_stride {row_stride}"),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    need(OP, "logits", logits, (rows - 1) * row_stride + vocab)?;
    need(OP, "targets", targets, rows)?;
    need(OP, "logp", logp, rows)?;
    let opt = |name: &str, b: Option<&mut dyn DevicePtrMut<f32>>| -> Result<u64> {
        match b {
            Some(b) => {
                need(OP, name, b, rows)?;
                Ok(ptr_mut(b, stream))
            }
            None => Ok(0),
        }
    };
    let ep = opt("entropy", entropy)?;
    let lp = opt("lse", lse)?;
    let (outp, xp, tp) = (
        ptr_mut(logp, stream),
        ptr(logits, stream),
        ptr(targets, stream),
    );
    let (r, v, rs) = (
        u32_of(OP, "rows", rows)?,
        u32_of(OP, "vocab", vocab)?,
        u32_of(OP, "row_stride", row_stride)?,
    );
    let cfg = Grid {
        grid: (r, 1, 1),
        block: (512, 1, 1),
        smem: 0,
    };
    // SAFETY: logits cover rows*row_stride (checked), targets/logp/entropy/lse hold `rows`;
    // the kernel bounds-checks each target; arguments match (logp, entropy, lse, logits,
    // targets, rows, vocab, row_stride, temperature).
    unsafe {
        launch(
            gpu,
            stream,
            &LOGPROBS,
            &[],
            "logprobs_fwd_bf16",
            cfg,
            &[&outp, &ep, &lp, &xp, &tp, &r, &v, &rs, &temperature],
        )
    }?;
    Ok(())
}
