//! The parts of a pre-norm block's backward that the text decoder's trainer (`train/`) and the
//! vision tower's (`vision_train/`) share: a linear's weight and bias gradients, the MLP and
//! its norm, the output projection, and the fused q|k|v projection with the first norm. Only
//! the attention between them (causal over a kept prefix, or windows / frames with 2D RoPE)
//! differs, and stays with each caller.
//!
//! Invariant: over one row set (the vision tower's blocks) every launch and its order are what
//! each caller ran before these were shared; gradients are added into the caller's fp32 sums
//! ([`BlockGrads`]) in a fixed order. The text trainer runs the MLP half over several row sets
//! stacked (`BlockBwd::mlp_stacked`), one GEMM per weight over all of them.

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

/// One row set of [`BlockBwd::mlp_stacked`]: its saved activations, the gradient of its block
/// output (`dx`, at least `rows` rows; it ends holding the gradient of `x_mid`) and its rows.
pub(crate) struct MlpSet<'a, 'b> {
    pub saved: MlpSaved<'a>,
    pub dx: &'b mut CudaSlice<bf16>,
    pub rows: usize,
}

/// An [`MlpSaved`] of an activations struct with fields of those names (the text layer's and
/// the vision block's).
macro_rules! mlp_saved {
    ($a:expr) => {
        $crate::gpu::block_bwd::MlpSaved {
            x_mid: &$a.x_mid,
            xn2: &$a.xn2,
            rstd2: &$a.rstd2,
            gu: &$a.gu,
            act: &$a.act,
            att: &$a.att,
        }
    };
}
pub(crate) use mlp_saved;

/// The activations of the MLP half and of the attention output that the backward reads.
#[derive(Clone, Copy)]
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
        let set = MlpSet {
            saved: *a,
            dx: &mut *dx,
            rows: self.rows,
        };
        self.mlp_stacked(grads, &mut [set])?;
        self.o(grads, a, dx)
    }

    /// The MLP and norm2 backward of [`BlockBwd::mlp_and_o`] over row sets stacked in order
    /// (`self.rows` is the sum of their rows; each set's saved activations and `dx` its own):
    /// the four GEMMs run once over all rows, each weight gradient one GEMM, where a call per
    /// set ran each GEMM on fewer rows and summed each weight gradient into its fp32 sum once
    /// per set. SwiGLU's and norm2's backward run per set. The output projection is left to
    /// [`BlockBwd::o`], per set.
    pub fn mlp_stacked(
        &self,
        grads: &mut impl BlockGrads,
        sets: &mut [MlpSet<'_, '_>],
    ) -> Result<()> {
        let (gpu, s, rows, h, b) = (self.gpu, self.s, self.rows, self.hidden, self.b);
        let ffn = b.ffn;
        if rows == 0 {
            return Ok(());
        }
        if sets.iter().map(|x| x.rows).sum::<usize>() != rows {
            return Err(super::GpuError::Input(format!(
                "stacked MLP backward: row sets of {:?} rows, {rows} in all",
                sets.iter().map(|x| x.rows).collect::<Vec<_>>()
            )));
        }
        // each set's rows of the stacked rows, and of a [rows, width] buffer
        let mut at = 0;
        let spans: Vec<std::ops::Range<usize>> = sets
            .iter()
            .map(|x| {
                at += x.rows;
                at - x.rows..at
            })
            .collect();
        let span = |i: usize, width: usize| spans[i].start * width..spans[i].end * width;
        // one [rows, width] buffer of the sets' `parts` in order (none for one set: its own
        // buffer serves)
        let stack =
            |parts: Vec<&CudaSlice<bf16>>, width: usize| -> Result<Option<CudaSlice<bf16>>> {
                if parts.len() == 1 {
                    return Ok(None);
                }
                let mut out = alloc::<bf16>(gpu, s, rows * width)?;
                for (i, x) in parts.into_iter().enumerate() {
                    let n = span(i, width).len();
                    s.memcpy_dtod(&x.slice(..n), &mut out.slice_mut(span(i, width)))?;
                }
                Ok(Some(out))
            };
        let dx_stack = stack(sets.iter().map(|x| &*x.dx).collect(), h)?;
        let dx_all = dx_stack.as_ref().unwrap_or(&*sets[0].dx);
        let mut dact = alloc::<bf16>(gpu, s, rows * ffn)?;
        matmul_bf16(gpu, s, &mut dact, dx_all, &b.down.w, Gemm::nn(rows, h, ffn))?;
        let act = stack(sets.iter().map(|x| x.saved.act).collect(), ffn)?;
        let act_all = act.as_ref().unwrap_or(sets[0].saved.act);
        self.linear_grads(grads, Lin::Down, &b.down, dx_all, act_all)?;
        drop((act, dx_stack));
        let mut dgu = alloc::<bf16>(gpu, s, rows * 2 * ffn)?;
        for (i, x) in sets.iter().enumerate() {
            let mut d = dgu.slice_mut(span(i, 2 * ffn));
            swiglu_bwd_fused_bf16(
                gpu,
                s,
                &mut d,
                &dact.slice(span(i, ffn)),
                x.saved.gu,
                x.rows,
                ffn,
            )?;
        }
        drop(dact);
        let mut dxn = alloc::<bf16>(gpu, s, rows * h)?;
        let gemm = Gemm::nn(rows, 2 * ffn, h);
        matmul_bf16(gpu, s, &mut dxn, &dgu, &b.gate_up.w, gemm)?;
        let xn2 = stack(sets.iter().map(|x| x.saved.xn2).collect(), h)?;
        let xn2_all = xn2.as_ref().unwrap_or(sets[0].saved.xn2);
        self.linear_grads(grads, Lin::GateUp, &b.gate_up, &dgu, xn2_all)?;
        drop((dgu, xn2));
        for (i, x) in sets.iter_mut().enumerate() {
            let dy = dxn.slice(span(i, h));
            self.norm2_bwd(grads, &x.saved, &dy, x.dx, x.rows)?;
        }
        Ok(())
    }

    /// norm2's backward over `rows` rows: adds the gradient of `x_mid` into `dx` from `dxn`, the
    /// gradient of the normed rows.
    fn norm2_bwd(
        &self,
        grads: &mut impl BlockGrads,
        a: &MlpSaved<'_>,
        dxn: &impl DevicePtr<bf16>,
        dx: &mut CudaSlice<bf16>,
        rows: usize,
    ) -> Result<()> {
        let (gpu, s, h, b) = (self.gpu, self.s, self.hidden, self.b);
        rmsnorm_bwd_bf16(
            gpu,
            s,
            dx,
            Some(grads.grad(BlockTensor::Norm2(self.layer))? as &mut dyn DevicePtrMut<f32>),
            dxn,
            a.x_mid,
            &b.norm2,
            a.rstd2,
            rows,
            h,
            true,
        )?;
        Ok(())
    }

    /// The output projection's backward from `dx`, the gradient of its output (`[rows, hidden]`):
    /// its weight gradient, and the gradient of the attention output `[rows, q_width]`.
    pub fn o(
        &self,
        grads: &mut impl BlockGrads,
        a: &MlpSaved<'_>,
        dx: &CudaSlice<bf16>,
    ) -> Result<CudaSlice<bf16>> {
        let (gpu, s, rows, h, b) = (self.gpu, self.s, self.rows, self.hidden, self.b);
        let qw = b.o.inp;
        let mut datt = alloc::<bf16>(gpu, s, rows * qw)?;
        matmul_bf16(gpu, s, &mut datt, dx, &b.o.w, Gemm::nn(rows, h, qw))?;
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
