//! `adamw_step_f32` (kernel in `cuda/adamw.cu`): AdamW on fp32 master weights and moments, op for
//! op as `runtime/src/train/adamw.rs` computes it on the CPU, with a bf16 copy out. No operation
//! is fused, so GPU and CPU agree bitwise; the per-step scalars are computed on the host in f64
//! by [`AdamWScalars::new`] exactly as the CPU optimizer does.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::launch::{grid_for, need, ptr, ptr_mut};
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
    let f = gpu.function(&ADAMW, &[], "adamw_step_f32")?;
    let (pp, mp, vp, gp) = (
        ptr_mut(p, stream),
        ptr_mut(m, stream),
        ptr_mut(v, stream),
        ptr(g, stream),
    );
    let (n64, d) = (n as u64, decay as u32);
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256, 8192), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&pp)
        .arg(&mp)
        .arg(&vp)
        .arg(&gp)
        .arg(&op_)
        .arg(&n64)
        .arg(&d);
    b.arg(&s.decay_mul)
        .arg(&s.w1)
        .arg(&s.b2)
        .arg(&s.one_minus_b2)
        .arg(&s.neg_step_size)
        .arg(&s.bc2_sqrt)
        .arg(&s.eps);
    // SAFETY: p, m, v, g (and out when given) hold n elements (checked); element i is touched
    // only by one thread; arguments match (p, m, v, g, out, n, decay, decay_mul, w1, b2,
    // one_minus_b2, neg_step_size, bc2_sqrt, eps).
    unsafe { b.launch(cfg) }?;
    Ok(())
}
