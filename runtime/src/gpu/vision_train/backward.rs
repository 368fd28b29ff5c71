//! The vision backward: the merger's, then each block's top-down (recomputed from its kept
//! input), then the patch embedding's, into fp32 gradient sums.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::attention_bwd_tc::{bwd_kernel_for, BwdKernel, TC_BWD_HEAD_DIMS};
use rollplex_kernels::cuda::{
    add_rmsnorm_fwd_bf16, attention_bwd_bf16_with, embedding_fwd_bf16, gelu_bwd_bf16,
    gelu_fwd_bf16, kv_append_bf16, matmul_bf16, matmul_bf16_f32, rmsnorm_bwd_bf16,
    rmsnorm_fwd_bf16, rope_bwd_bf16, swiglu_gate_up_fwd_bf16, BwdGrads, BwdInputs, CudaSlice,
    CudaStream, Gpu,
};

use crate::model::config::VISION_RMS_EPS;

use super::super::block::linear;
use super::super::block_bwd::{linear_grads, mlp_saved, BlockBwd, GradSink};
use super::super::vision::VisionAttn;
use super::super::weights::GpuBlock;
use super::super::{alloc, upload, GpuError, GpuModel, Result};
use super::params::{VisionSink, VisionSlot};
use super::VisionTrainState;

/// One block's activations, recomputed from its input.
struct BlockActs {
    xn1: CudaSlice<bf16>,
    rstd1: CudaSlice<f32>,
    /// `[rows, (h + 2 kvh) hd]` after RoPE (q and k rotated).
    qkv: CudaSlice<bf16>,
    att: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    x_mid: CudaSlice<bf16>,
    delta: CudaSlice<bf16>,
    xn2: CudaSlice<bf16>,
    rstd2: CudaSlice<f32>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
}

impl BlockActs {
    fn new(gpu: &Gpu, s: &Arc<CudaStream>, b: &GpuBlock, c: &Ctx<'_>) -> Result<Self> {
        let (rows, h) = (c.rows, c.hidden);
        Ok(BlockActs {
            xn1: alloc(gpu, s, rows * h)?,
            rstd1: alloc(gpu, s, rows)?,
            qkv: alloc(gpu, s, rows * b.qkv.out)?,
            att: alloc(gpu, s, rows * c.dims.q_width())?,
            lse: alloc(gpu, s, rows * c.dims.num_heads)?,
            x_mid: alloc(gpu, s, rows * h)?,
            delta: alloc(gpu, s, rows * h)?,
            xn2: alloc(gpu, s, rows * h)?,
            rstd2: alloc(gpu, s, rows)?,
            gu: alloc(gpu, s, rows * 2 * b.ffn)?,
            act: alloc(gpu, s, rows * b.ffn)?,
        })
    }
}

/// What every block's backward shares.
struct Ctx<'a> {
    rows: usize,
    hidden: usize,
    dims: AttnDims,
    attn: VisionAttn<'a>,
    iota: &'a CudaSlice<u32>,
    /// `0..rows * num_heads`, for padding the attention heads ([`repad_heads`]).
    head_iota: &'a CudaSlice<u32>,
    ones: &'a CudaSlice<bf16>,
}

/// The dims the attention backward of `d` runs at on the tensor cores when `d`'s head_dim is
/// one they do not take (the vision tower's 80): the smallest supported head_dim above it,
/// heads zero-padded to it. Zero columns add exact zeros to every fp32 sum of q.k and
/// dout.out and give zero gradient columns, so the real columns are what a tensor-core kernel
/// at `d` would compute. None: `d` runs as it is (the tensor cores take it, or neither takes
/// the padded case: grid limits), on the kernel `Auto` picks.
pub(super) fn tc_padded_dims(d: AttnDims, n_seqs: usize) -> Option<AttnDims> {
    if bwd_kernel_for(&d, RowStrides::contiguous(d), n_seqs) == BwdKernel::TensorCores {
        return None;
    }
    TC_BWD_HEAD_DIMS
        .iter()
        .filter(|&&hd| hd > d.head_dim)
        .map(|&head_dim| AttnDims { head_dim, ..d })
        .find(|p| bwd_kernel_for(p, RowStrides::contiguous(*p), n_seqs) == BwdKernel::TensorCores)
}

/// `x` (`heads` heads of `from` values, one after the other) with each head cut or zero-padded
/// to `to` values.
fn repad_heads(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &CudaSlice<bf16>,
    heads: usize,
    from: usize,
    to: usize,
    iota: &CudaSlice<u32>,
) -> Result<CudaSlice<bf16>> {
    let mut out = if to > from {
        s.alloc_zeros::<bf16>(heads * to)?
    } else {
        alloc::<bf16>(gpu, s, heads * to)?
    };
    kv_append_bf16(gpu, s, &mut out, x, iota, heads, from.min(to), from, to)?;
    Ok(out)
}

/// One vision block's attention backward over contiguous rows (no sequence has a prefix).
struct AttnBwd<'a, S> {
    gpu: &'a Gpu,
    s: &'a Arc<CudaStream>,
    rows: usize,
    seqs: &'a S,
    n_seqs: usize,
    scale: f32,
}

impl<S: DevicePtr<rollplex_kernels::cuda::attention::AttnSeqGpu>> AttnBwd<'_, S> {
    /// `(dq, dk, dv)` at `dims` from `[q, k, v, out, dout]` and the forward's `lse`, on `kernel`.
    fn run(
        &self,
        kernel: BwdKernel,
        dims: AttnDims,
        [q, k, v, out, dout]: [&CudaSlice<bf16>; 5],
        lse: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<bf16>)> {
        let (gpu, s, rows) = (self.gpu, self.s, self.rows);
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let (mut dq, mut dk, mut dv) = (
            alloc::<bf16>(gpu, s, rows * qw)?,
            alloc::<bf16>(gpu, s, rows * kvw)?,
            alloc::<bf16>(gpu, s, rows * kvw)?,
        );
        // no sequence has a prefix: one-row fp32 stand-ins
        let mut dpk = alloc::<f32>(gpu, s, kvw)?;
        let mut dpv = alloc::<f32>(gpu, s, kvw)?;
        attention_bwd_bf16_with(
            kernel,
            gpu,
            s,
            BwdGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                dprefix_k: &mut dpk,
                dprefix_v: &mut dpv,
            },
            BwdInputs {
                dout,
                q,
                k,
                v,
                prefix_k: k,
                prefix_v: v,
                out,
                lse,
                seqs: self.seqs,
                n_seqs: self.n_seqs,
                dims,
                mask: AttnMask::Full,
                scale: self.scale,
                strides: RowStrides::contiguous(dims),
            },
        )?;
        Ok((dq, dk, dv))
    }
}

/// Block `layer`'s forward from `x_in`, as `block::run_blocks` runs it (the same launches: the
/// norm of the input, whose bits equal the fused add+norm's, qkv, `VisionAttn`'s RoPE and
/// attention, proj, the residual add fused into norm2, gate|up, SwiGLU), keeping every
/// activation the backward reads.
fn block_recompute(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &Ctx<'_>,
    x_in: &CudaSlice<bf16>,
    a: &mut BlockActs,
) -> Result<()> {
    let (rows, h, ffn) = (c.rows, c.hidden, b.ffn);
    rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn1,
        Some(&mut a.rstd1 as &mut dyn DevicePtrMut<f32>),
        x_in,
        &b.norm1,
        rows,
        h,
        VISION_RMS_EPS,
    )?;
    linear(gpu, s, &mut a.qkv, &a.xn1, &b.qkv, rows)?;
    c.attn
        .attend_lse(gpu, s, layer, &mut a.qkv, &mut a.att, Some(&mut a.lse))?;
    linear(gpu, s, &mut a.delta, &a.att, &b.o, rows)?;
    s.memcpy_dtod(&x_in.slice(..rows * h), &mut a.x_mid)?;
    add_rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn2,
        Some(&mut a.rstd2 as &mut dyn DevicePtrMut<f32>),
        &mut a.x_mid,
        &a.delta,
        &b.norm2,
        rows,
        h,
        VISION_RMS_EPS,
    )?;
    linear(gpu, s, &mut a.gu, &a.xn2, &b.gate_up, rows)?;
    swiglu_gate_up_fwd_bf16(gpu, s, &mut a.act, &a.gu, rows, ffn)?;
    Ok(())
}

/// Backward of block `layer`: `dx` holds the gradient of the block's output and ends holding
/// that of its input; the block's parameter gradients are added into `grads`.
#[allow(clippy::too_many_arguments)]
fn block_backward(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &Ctx<'_>,
    x_in: &CudaSlice<bf16>,
    a: &BlockActs,
    dx: &mut CudaSlice<bf16>,
    grads: &mut impl VisionSink,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let bb = BlockBwd {
        gpu,
        s,
        layer,
        b,
        rows,
        hidden: h,
        ones: c.ones,
    };
    let saved = mlp_saved!(a);
    // MLP: delta = down(swiglu(gate_up(norm2(x_mid)))); attention: delta = proj(attn(...))
    let datt = bb.mlp_and_o(grads, &saved, dx)?;
    // q, k, v (rotated) into contiguous buffers: the attention backward writes each gradient at
    // its input's row stride, and three views of one fused buffer cannot be borrowed at once
    let (mut q, mut k, mut v) = (
        alloc::<bf16>(gpu, s, rows * qw)?,
        alloc::<bf16>(gpu, s, rows * kvw)?,
        alloc::<bf16>(gpu, s, rows * kvw)?,
    );
    kv_append_bf16(gpu, s, &mut q, &a.qkv, c.iota, rows, qw, row, qw)?;
    kv_append_bf16(
        gpu,
        s,
        &mut k,
        &a.qkv.slice(qw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut v,
        &a.qkv.slice(qw + kvw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    let (seqs, n_seqs, _) = c.attn.seqs(layer);
    let bwd = AttnBwd {
        gpu,
        s,
        rows,
        seqs,
        n_seqs,
        scale: 1.0 / (d.head_dim as f32).sqrt(),
    };
    let (dq, dk, dv) = match tc_padded_dims(d, n_seqs) {
        Some(pd) => {
            // the tensor-core backward on heads zero-padded to `pd.head_dim` (see
            // `tc_padded_dims`), then the gradients' real columns back to `d`'s layout
            // (q, out and dout hold `num_heads` heads a row, k and v `num_kv_heads`)
            let (nh, nkv) = (d.num_heads, d.num_kv_heads);
            let repad = |x: &CudaSlice<bf16>, heads: usize, from: usize, to: usize| {
                repad_heads(gpu, s, x, rows * heads, from, to, c.head_iota)
            };
            let pad = |x: &CudaSlice<bf16>, heads| repad(x, heads, d.head_dim, pd.head_dim);
            let (qp, kp, vp) = (pad(&q, nh)?, pad(&k, nkv)?, pad(&v, nkv)?);
            drop((q, k, v));
            let (op, dop) = (pad(&a.att, nh)?, pad(&datt, nh)?);
            drop(datt);
            let g = bwd.run(
                BwdKernel::TensorCores,
                pd,
                [&qp, &kp, &vp, &op, &dop],
                &a.lse,
            )?;
            drop((qp, kp, vp, op, dop));
            let unpad = |x: &CudaSlice<bf16>, heads| repad(x, heads, pd.head_dim, d.head_dim);
            (unpad(&g.0, nh)?, unpad(&g.1, nkv)?, unpad(&g.2, nkv)?)
        }
        None => {
            let g = bwd.run(BwdKernel::Auto, d, [&q, &k, &v, &a.att, &datt], &a.lse)?;
            drop((q, k, v, datt));
            g
        }
    };
    let mut dqkv = alloc::<bf16>(gpu, s, rows * row)?;
    kv_append_bf16(gpu, s, &mut dqkv, &dq, c.iota, rows, qw, qw, row)?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw..),
        &dk,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw + kvw..),
        &dv,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    drop((dq, dk, dv));
    // 2D RoPE's transposed rotation on the q and k heads of each row (v untouched)
    let (cos, sin) = c.attn.tables();
    rope_bwd_bf16(
        gpu,
        s,
        &mut dqkv,
        cos,
        sin,
        rows,
        row,
        d.num_heads + d.num_kv_heads,
        d.head_dim,
    )?;
    bb.qkv_and_norm1(grads, &dqkv, &a.xn1, &a.rstd1, x_in, dx)?;
    Ok(())
}

/// Backward of the merger and (with `train_tower`) the vision tower of one training forward.
///
/// `d_embeds` is the gradient of the items' embeddings concatenated in item order, `[tokens,
/// out_hidden]` bf16 (at least `state.tokens() * out_hidden` values), as the decoder reads the
/// embeddings. Gradients are added into `grads`: the merger's when it holds them (a frozen
/// merger: build `grads` without, its input gradient still flows), the tower's when
/// `train_tower` (then `grads` must hold them; without `train_tower` the tower's sums are left
/// as they are even when held). `model` must hold the weights the forward ran with. Nothing
/// synchronises.
pub(crate) fn vision_backward(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    model: &GpuModel,
    state: &VisionTrainState,
    d_embeds: &impl DevicePtr<bf16>,
    train_tower: bool,
    grads: &mut impl VisionSink,
) -> Result<()> {
    let s = stream;
    let cfg = &model.config;
    let v = cfg.vision();
    let w = &model.weights;
    let (vh, pd) = (v.hidden_size as usize, cfg.patch_dim());
    let (mh, ow) = (w.merger_fc1.out, w.merger_fc2.out);
    let tokens = state.tokens();
    if d_embeds.len() < tokens * ow {
        return Err(GpuError::Input(format!(
            "vision_backward: d_embeds holds {} values, the forward's {tokens} media tokens x \
             {ow} need {}",
            d_embeds.len(),
            tokens * ow
        )));
    }
    if train_tower && !grads.holds_tower() {
        return Err(GpuError::Input(
            "vision_backward: train_tower is set but the gradient buffers hold no tower tensor \
             (build VisionGrads with tower = true)"
                .into(),
        ));
    }
    let train_merger = grads.holds_merger();
    let Some(k) = state.kept.as_ref() else {
        return Ok(());
    };
    if !train_merger && !train_tower {
        return Ok(());
    }
    let plan = &k.inp.plan;
    let n = plan.patches;
    let groups = n / plan.unit;
    if groups * mh != n * vh || (train_tower && k.block_inputs.len() != w.vision.len()) {
        return Err(GpuError::Input(format!(
            "vision_backward: a state of {n} patches and {} kept block inputs does not fit this \
             model ({} blocks, merger width {mh}){}",
            k.block_inputs.len(),
            w.vision.len(),
            if train_tower && k.block_inputs.is_empty() {
                ": the state was encoded for the merger alone (tower = false)"
            } else {
                ""
            }
        )));
    }
    let window_index = k.inp.window_index.as_ref().ok_or_else(|| {
        GpuError::Input("vision_backward: the state has no window order on the device".into())
    })?;
    let ones = upload(s, &vec![bf16::ONE; n])?;
    let fc2_slots = (
        VisionSlot::MergerFc2,
        w.merger_fc2.b.as_ref().map(|_| VisionSlot::MergerFc2Bias),
    );
    let fc1_slots = (
        VisionSlot::MergerFc1,
        w.merger_fc1.b.as_ref().map(|_| VisionSlot::MergerFc1Bias),
    );

    // ---- merger: recompute from its input (the forward's launches) ----
    let mut rstd = alloc::<f32>(gpu, s, n)?;
    let xn = model.vision_merger_norm(gpu, s, &k.merger_in, n, Some(&mut rstd))?;
    let mut h1 = alloc::<bf16>(gpu, s, groups * mh)?;
    linear(gpu, s, &mut h1, &xn, &w.merger_fc1, groups)?;
    let mut gel = alloc::<bf16>(gpu, s, groups * mh)?;
    gelu_fwd_bf16(gpu, s, &mut gel, &h1, groups * mh, false)?;
    // the un-permute's adjoint: merged row i is embedding row window_index[i]
    let mut dm = alloc::<bf16>(gpu, s, groups * ow)?;
    embedding_fwd_bf16(gpu, s, &mut dm, d_embeds, window_index, groups, ow, ow)?;
    // fc2, GELU, fc1, ln_q
    let mut dg = alloc::<bf16>(gpu, s, groups * mh)?;
    matmul_bf16(
        gpu,
        s,
        &mut dg,
        &dm,
        &w.merger_fc2.w,
        Gemm::nn(groups, ow, mh),
    )?;
    if train_merger {
        linear_grads(
            gpu,
            s,
            grads,
            &ones,
            fc2_slots,
            &w.merger_fc2,
            &dm,
            &gel,
            groups,
        )?;
    }
    drop((dm, gel));
    let mut dh1 = alloc::<bf16>(gpu, s, groups * mh)?;
    gelu_bwd_bf16(gpu, s, &mut dh1, &dg, &h1, groups * mh, false)?;
    drop((dg, h1));
    let mut dxn = alloc::<bf16>(gpu, s, groups * mh)?;
    matmul_bf16(
        gpu,
        s,
        &mut dxn,
        &dh1,
        &w.merger_fc1.w,
        Gemm::nn(groups, mh, mh),
    )?;
    if train_merger {
        linear_grads(
            gpu,
            s,
            grads,
            &ones,
            fc1_slots,
            &w.merger_fc1,
            &dh1,
            &xn,
            groups,
        )?;
    }
    drop((dh1, xn));
    let mut dx = alloc::<bf16>(gpu, s, n * vh)?;
    let dln = if train_merger {
        Some(GradSink::<VisionSlot>::grad(grads, VisionSlot::MergerLn)?
            as &mut dyn DevicePtrMut<f32>)
    } else {
        None
    };
    rmsnorm_bwd_bf16(
        gpu,
        s,
        &mut dx,
        dln,
        &dxn,
        &k.merger_in,
        &w.merger_ln,
        &rstd,
        n,
        vh,
        false,
    )?;
    drop((dxn, rstd));
    if !train_tower {
        return Ok(());
    }

    // ---- blocks, top-down, each recomputed from its kept input ----
    let iota = model.iota(s, n)?;
    let head_iota = model.iota(s, n * k.inp.dims.num_heads)?;
    let c = Ctx {
        rows: n,
        hidden: vh,
        dims: k.inp.dims,
        attn: k.inp.attn(&v.fullatt_block_indexes),
        iota: &iota,
        head_iota: &head_iota,
        ones: &ones,
    };
    if let Some(b0) = w.vision.first() {
        let mut acts = BlockActs::new(gpu, s, b0, &c)?;
        for (l, b) in w.vision.iter().enumerate().rev() {
            let x_in = &k.block_inputs[l];
            block_recompute(gpu, s, l, b, &c, x_in, &mut acts)?;
            block_backward(gpu, s, l, b, &c, x_in, &acts, &mut dx, grads)?;
        }
    }
    // ---- patch embedding: dW [vh, pd] += dx^T pix (rows in the same permuted order) ----
    let pix = k
        .pix
        .as_ref()
        .ok_or_else(|| GpuError::Input("vision_backward: the state kept no pixel rows".into()))?;
    matmul_bf16_f32(
        gpu,
        s,
        GradSink::<VisionSlot>::grad(grads, VisionSlot::PatchEmbed)?,
        &dx,
        pix,
        Gemm::tn(vh, n, pd).accumulate(),
    )?;
    Ok(())
}
