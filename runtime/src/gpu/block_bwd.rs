//! The parts of a pre-norm block's backward that the text decoder's trainer (`train/`) and the
//! vision tower's (`vision_train/`) share: a linear's weight and bias gradients, the MLP and
//! its norm, the output projection, and the fused q|k|v projection with the first norm. Only
//! the attention between them (causal over a kept prefix, or windows / frames with 2D RoPE)
//! differs, and stays with each caller.
//!
//! Invariant: every launch and its order are what each caller ran before these were shared;
//! gradients are added into the caller's fp32 sums ([`BlockGrads`]) in that fixed order.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cpu::Gemm;
use rollplex_kernels::cuda::{
    matmul_bf16, matmul_bf16_f32, rmsnorm_bwd_bf16, swiglu_bwd_fused_bf16, CudaSlice, CudaStream,
    Gpu,
};

use super::train::Lin;
use super::weights::{GpuBlock, GpuLinear};
use super::{alloc, Result};

/// A block tensor whose gradient a backward adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockTensor {
    Weight(usize, Lin),
    Bias(usize, Lin),
    Norm1(usize),
    Norm2(usize),
}

/// Where gradients go: the fp32 sum of the tensor named `K` (an error when the container does
/// not hold it).
pub(crate) trait GradSink<K> {
    fn grad(&mut self, k: K) -> Result<&mut CudaSlice<f32>>;
}

/// A block backward's parameter gradients.
pub(crate) trait BlockGrads: GradSink<BlockTensor> {}
impl<T: GradSink<BlockTensor>> BlockGrads for T {}

/// `grads[w] += dy^T x` (`[out, inp]`, one GEMM summing its fp32 product into the gradient)
/// and, when the linear has a bias and `bias` names its tensor, `grads[bias] += Σ_rows dy` (a
/// GEMM against `ones`, at least `rows` long).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_grads<K>(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    grads: &mut impl GradSink<K>,
    ones: &CudaSlice<bf16>,
    (w, bias): (K, Option<K>),
    l: &GpuLinear,
    dy: &CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    rows: usize,
) -> Result<()> {
    let gw = Gemm::tn(l.out, rows, l.inp).accumulate();
    matmul_bf16_f32(gpu, s, grads.grad(w)?, dy, x, gw)?;
    if let (Some(b), Some(_)) = (bias, l.b.as_ref()) {
        let gb = Gemm::nn(1, rows, l.out).accumulate();
        matmul_bf16_f32(gpu, s, grads.grad(b)?, ones, dy, gb)?;
    }
    Ok(())
}

/// What a block backward reads besides its weights.
pub(crate) struct BlockBwd<'a> {
    pub gpu: &'a Gpu,
    pub s: &'a Arc<CudaStream>,
    pub layer: usize,
    pub b: &'a GpuBlock,
    pub rows: usize,
    pub hidden: usize,
    /// At least `rows` ones (bias gradients are a GEMM against them).
    pub ones: &'a CudaSlice<bf16>,
}

/// The activations of the MLP half and of the attention output that the backward reads.
pub(crate) struct MlpSaved<'a> {
    pub x_mid: &'a CudaSlice<bf16>,
    pub xn2: &'a CudaSlice<bf16>,
    pub rstd2: &'a CudaSlice<f32>,
    pub gu: &'a CudaSlice<bf16>,
    pub act: &'a CudaSlice<bf16>,
    pub att: &'a CudaSlice<bf16>,
}

impl BlockBwd<'_> {
    fn linear_grads(
        &self,
        grads: &mut impl BlockGrads,
        kind: Lin,
        l: &GpuLinear,
        dy: &CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
    ) -> Result<()> {
        let slots = (
            BlockTensor::Weight(self.layer, kind),
            Some(BlockTensor::Bias(self.layer, kind)),
        );
        let (gpu, s) = (self.gpu, self.s);
        linear_grads(gpu, s, grads, self.ones, slots, l, dy, x, self.rows)
    }

    /// From `dx`, the gradient of the block's output: the MLP (`delta = down(swiglu(gate_up(
    /// norm2(x_mid))))`) and norm2 backward, leaving in `dx` the gradient of `x_mid`, then the
    /// output projection's: returns the gradient of the attention output `[rows, q_width]`.
    pub fn mlp_and_o(
        &self,
        grads: &mut impl BlockGrads,
        a: &MlpSaved<'_>,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<CudaSlice<bf16>> {
        let (gpu, s, rows, h, b) = (self.gpu, self.s, self.rows, self.hidden, self.b);
        let ffn = b.ffn;
        let mut dact = alloc::<bf16>(gpu, s, rows * ffn)?;
        matmul_bf16(gpu, s, &mut dact, &*dx, &b.down.w, Gemm::nn(rows, h, ffn))?;
        self.linear_grads(grads, Lin::Down, &b.down, dx, a.act)?;
        let mut dgu = alloc::<bf16>(gpu, s, rows * 2 * ffn)?;
        swiglu_bwd_fused_bf16(gpu, s, &mut dgu, &dact, a.gu, rows, ffn)?;
        drop(dact);
        let mut dxn = alloc::<bf16>(gpu, s, rows * h)?;
        let gemm = Gemm::nn(rows, 2 * ffn, h);
        matmul_bf16(gpu, s, &mut dxn, &dgu, &b.gate_up.w, gemm)?;
        self.linear_grads(grads, Lin::GateUp, &b.gate_up, &dgu, a.xn2)?;
        drop(dgu);
        rmsnorm_bwd_bf16(
            gpu,
            s,
            dx,
            Some(grads.grad(BlockTensor::Norm2(self.layer))? as &mut dyn DevicePtrMut<f32>),
            &dxn,
            a.x_mid,
            &b.norm2,
            a.rstd2,
            rows,
            h,
            true,
        )?;
        let qw = b.o.inp;
        let mut datt = alloc::<bf16>(gpu, s, rows * qw)?;
        matmul_bf16(gpu, s, &mut datt, &*dx, &b.o.w, Gemm::nn(rows, h, qw))?;
        self.linear_grads(grads, Lin::O, &b.o, dx, a.att)?;
        Ok(datt)
    }

    /// From `dqkv`, the gradient of the fused q|k|v projection's output (before RoPE): its
    /// weight gradients and the norm1 backward, adding the gradient of the block's input
    /// `x_in` into `dx` (the residual's).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_and_norm1(
        &self,
        grads: &mut impl BlockGrads,
        dqkv: &CudaSlice<bf16>,
        xn1: &CudaSlice<bf16>,
        rstd1: &CudaSlice<f32>,
        x_in: &impl DevicePtr<bf16>,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (gpu, s, rows, h, b) = (self.gpu, self.s, self.rows, self.hidden, self.b);
        let mut dxn = alloc::<bf16>(gpu, s, rows * h)?;
        matmul_bf16(
            gpu,
            s,
            &mut dxn,
            dqkv,
            &b.qkv.w,
            Gemm::nn(rows, b.qkv.out, h),
        )?;
        self.linear_grads(grads, Lin::Qkv, &b.qkv, dqkv, xn1)?;
        rmsnorm_bwd_bf16(
            gpu,
            s,
            dx,
            Some(grads.grad(BlockTensor::Norm1(self.layer))? as &mut dyn DevicePtrMut<f32>),
            &dxn,
            x_in,
            &b.norm1,
            rstd1,
            rows,
            h,
            true,
        )?;
        Ok(())
    }
}
