//! `adamw_step_f32` (kernel in `cuda/adamw.cu`): AdamW on fp32 master weights and moments, op for
//! op as `runtime/src/train/adamw.rs` computes it on the CPU, with a bf16 copy out. No operation
//! is fused, so GPU and CPU agree bitwise; the per-step scalars are computed on the host in f64
//! by [`AdamWScalars::new`] exactly as the CPU optimizer does.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{grid_for, launch, need, ptr, ptr_mut, Grid};
use super::nvrtc::ADAMW;
use super::{shape, Gpu, Result};

/// The f32 scalars of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    pub decay_mul: f32,
    pub w1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

impl AdamWScalars {
    /// Scalars of step `t` (1-based) with learning rate `lr`, as the CPU optimizer rounds them.
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = t as f64;
        AdamWScalars {
            decay_mul: (1.0 - lr * weight_decay) as f32,
            w1: (1.0 - beta1) as f32,
            b2: beta2 as f32,
            one_minus_b2: (1.0 - beta2) as f32,
            neg_step_size: (-(lr / (1.0 - beta1.powf(t)))) as f32,
            bc2_sqrt: ((1.0 - beta2.powf(t)).sqrt()) as f32,
            eps: eps as f32,
        }
    }
}

/// One AdamW step over `n` elements of `p` (master), `m`, `v` with gradients `g` (all f32);
/// `decay` applies the decoupled weight decay; `out` (optional) receives `bf16(p)`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    p: &mut impl DevicePtrMut<f32>,
    m: &mut impl DevicePtrMut<f32>,
    v: &mut impl DevicePtrMut<f32>,
    out: Option<&mut dyn DevicePtrMut<bf16>>,
    g: &impl DevicePtr<f32>,
    n: usize,
    decay: bool,
    s: AdamWScalars,
) -> Result<()> {
    const OP: &str = "adamw_step_f32";
    need(OP, "p", p, n)?;
    need(OP, "m", m, n)?;
    need(OP, "v", v, n)?;
    need(OP, "g", g, n)?;
    if !s.bc2_sqrt.is_finite() || s.bc2_sqrt <= 0.0 {
        return Err(shape(
            OP,
            format!(
                "bias correction {} is not positive (step must be >= 1)",
                s.bc2_sqrt
            ),
        ));
    }
    let op_ = match out {
        Some(o) => {
            need(OP, "out", o, n)?;
            ptr_mut(o, stream)
        }
        None => 0,
    };
    if n == 0 {
        return Ok(());
    }
    let (pp, mp, vp, gp) = (
        ptr_mut(p, stream),
        ptr_mut(m, stream),
        ptr_mut(v, stream),
        ptr(g, stream),
    );
    let (n64, d) = (n as u64, decay as u32);
    let cfg = Grid {
        grid: (grid_for(n, 256, 8192), 1, 1),
        block: (256, 1, 1),
        smem: 0,
    };
    // SAFETY: p, m, v, g (and out when given) hold n elements (checked); element i is touched
    // only by one thread; arguments match (p, m, v, g, out, n, decay, decay_mul, w1, b2,
    // one_minus_b2, neg_step_size, bc2_sqrt, eps).
    unsafe {
        launch(
            gpu,
            stream,
            &ADAMW,
            &[],
            "adamw_step_f32",
            cfg,
            &[
                &pp,
                &mp,
                &vp,
                &gp,
                &op_,
                &n64,
                &d,
                &s.decay_mul,
                &s.w1,
                &s.b2,
                &s.one_minus_b2,
                &s.neg_step_size,
                &s.bc2_sqrt,
                &s.eps,
            ],
        )
    }?;
    Ok(())
}
