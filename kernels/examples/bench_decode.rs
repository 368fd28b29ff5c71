//! Workbench: one decode step of a Qwen2.5-VL text decoder (3B and 7B dims) built from this
//! crate's kernels, captured in a CUDA graph and replayed; reports the step time, the bytes it
//! moves (weights + KV cache + logits) and the achieved bandwidth against the device-to-device
//! copy ceiling measured in the same run. Each case runs these variants side by side:
//! - `base`: cuBLASLt GEMMs + `swiglu_fwd_bf16`, the warp-split decode attention aiming at 264
//!   blocks (the step as of 3ab030b);
//! - `gemm`: the dispatching GEMM entry points (`linear_fwd_bf16`, `gate_up_swiglu_bf16`: our
//!   split-k tensor-core kernel `gemv_bf16` at m <= 8, gate|up fused with SwiGLU; cuBLASLt
//!   above), the same attention;
//! - `new`: those GEMMs and `attention_decode_bf16` with `decode_plan` (the block-pipelined
//!   kernel), every sample reading its own KV;
//! - `shared` (GRPO cases): `attention_decode_grouped_bf16` with `grouped_decode_plan`, which
//!   reads a group's shared prefix once per group when there are enough groups; `forced`: the
//!   group pass forced on (where the default plan leaves it off).
//!
//! Bytes are counted two ways: what a per-sample reader moves (every sample reads its whole KV,
//! as PyTorch's SDPA decode does) and what the variant moves (a GRPO group's shared prefix once
//! per group when the group pass runs). Also times the GEMMs alone, each GEMM kind alone
//! (cuBLASLt vs the skinny kernel) and the attention alone.
//!
//! `--gemm-sweep`: instead of the cases, each GEMM kind of the 3B and 7B steps alone over all
//! layers at m = 128, 64, 32 and 16 rows (`--gemm-rows` picks others): cuBLASLt, the skinny kernel's default plan and
//! the other cuts of its `wgmma` (and, at m <= 64, `mma.sync`) form side by side, with the
//! weight-streaming rate against the copy ceiling.
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_decode` (needs a GPU).
//! Each layer has its own weights (random bf16, never zeros) and its own KV cache, so every byte
//! is real HBM traffic. Per step: embedding gather, 36/28 x (rmsnorm, qkv GEMM + bias, rope, KV
//! append, decode attention, o GEMM, residual add, rmsnorm, gate|up GEMM, SwiGLU, down GEMM,
//! residual add), final rmsnorm, lm_head GEMM, sampling (T = 1).

use std::sync::Arc;

use cudarc::driver::sys;
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, DecodeSeq};
use rollplex_kernels::cuda::attention::{
    attention_decode_grouped_bf16, grouped_decode_plan, grouped_decode_plan_for_blocks,
    DecodeInputs, GroupedDecodePlan, RowStrides,
};
use rollplex_kernels::cuda::gemm::{
    gate_up_swiglu_bf16, linear_fwd_bf16_cublaslt, linear_fwd_bf16_cublaslt_ranked,
    skinny_gate_up_swiglu_bf16, skinny_linear_fwd_bf16_with, skinny_pays, skinny_plan,
    skinny_plan_with, SkinnyPlan, LT_RANKS,
};
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
use rollplex_kernels::cuda::*;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy)]
struct Dims {
    name: &'static str,
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    f: usize,
    layers: usize,
    vocab: usize,
    tied: bool,
}

const D3B: Dims = Dims {
    name: "3B",
    h: 2048,
    nh: 16,
    nkv: 2,
    hd: 128,
    f: 11008,
    layers: 36,
    vocab: 151_936,
    tied: true,
};
const D7B: Dims = Dims {
    name: "7B",
    h: 3584,
    nh: 28,
    nkv: 4,
    hd: 128,
    f: 18944,
    layers: 28,
    vocab: 152_064,
    tied: false,
};

struct Layer {
    wqkv: CudaSlice<bf16>,
    bqkv: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    wgu: CudaSlice<bf16>,
    wd: CudaSlice<bf16>,
    n1: CudaSlice<bf16>,
    n2: CudaSlice<bf16>,
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
}

struct Model {
    d: Dims,
    batch: usize,
    layers: Vec<Layer>,
    embed: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    // activations
    h: CudaSlice<bf16>,
    x: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    tmp: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    logits: CudaSlice<bf16>,
    tokens: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    slots: CudaSlice<u32>,
    seqs: CudaSlice<AttnSeqGpu>,
    ws: CudaSlice<f32>,
    sample_ids: CudaSlice<u32>,
    steps: CudaSlice<u32>,
    plan: DecodePlan,
    kv_len: usize,
    /// Fused kernels (add+rmsnorm, rope+KV append) or the separate ones.
    fused: bool,
    /// (group size, shared prefix length) of the GRPO groups; (1, 0) when nothing is shared.
    prefix: (usize, usize),
    /// The dispatching GEMM entry points (`linear_fwd_bf16`, `gate_up_swiglu_bf16`: our skinny
    /// kernel at m <= 8, gate|up fused with SwiGLU) instead of always cuBLASLt + `swiglu_fwd_bf16`.
    dispatch: bool,
    /// `attention_decode_grouped_bf16` with `gplan` instead of `attention_decode_bf16` with `plan`.
    grouped: bool,
    gplan: GroupedDecodePlan,
}

fn rand_bf(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect()
}

/// A device buffer of `n` elements filled by repeating a random source (fast for GBs).
fn filled(g: &Gpu, s: &Arc<CudaStream>, src: &CudaSlice<bf16>, n: usize) -> Res<CudaSlice<bf16>> {
    let mut d = g.alloc::<bf16>(s, n)?;
    let c = src.len();
    let mut off = 0;
    let mut k = 0usize;
    while off < n {
        let len = c.min(n - off);
        // rotate the source window so consecutive chunks differ
        let start = (k * 7919) % (c - len + 1).max(1);
        s.memcpy_dtod(
            &src.slice(start..start + len),
            &mut d.slice_mut(off..off + len),
        )?;
        off += len;
        k += 1;
    }
    Ok(d)
}

/// `prefix`: (group size, shared prefix length); the rest of `kv_len` is each sample's own.
fn build(
    g: &Gpu,
    s: &Arc<CudaStream>,
    d: Dims,
    batch: usize,
    kv_len: usize,
    prefix: Option<(usize, usize)>,
) -> Res<Model> {
    let src = s.clone_htod(&rand_bf(1 << 25, 7, 0.03))?;
    let big = s.clone_htod(&rand_bf(1 << 22, 9, 1.0))?;
    let qkvw = (d.nh + 2 * d.nkv) * d.hd;
    let kvw = d.nkv * d.hd;
    let (gsize, plen) = prefix.unwrap_or((1, 0));
    let groups = batch.div_ceil(gsize);
    let own = kv_len - plen;
    let rows = groups * plen + batch * own;
    let mut layers = Vec::new();
    for _ in 0..d.layers {
        layers.push(Layer {
            wqkv: filled(g, s, &src, qkvw * d.h)?,
            bqkv: filled(g, s, &src, qkvw)?,
            wo: filled(g, s, &src, d.h * d.nh * d.hd)?,
            wgu: filled(g, s, &src, 2 * d.f * d.h)?,
            wd: filled(g, s, &src, d.h * d.f)?,
            n1: filled(g, s, &big, d.h)?,
            n2: filled(g, s, &big, d.h)?,
            kc: filled(g, s, &big, rows * kvw)?,
            vc: filled(g, s, &big, rows * kvw)?,
        });
    }
    let mut seqs = Vec::new();
    let mut slots = Vec::new();
    for b in 0..batch {
        let own_off = groups * plen + b * own;
        let ds = DecodeSeq {
            prefix_offset: ((b / gsize) * plen) as u32,
            prefix_len: plen as u32,
            suffix_offset: own_off as u32,
            suffix_len: own as u32,
        };
        seqs.push(AttnSeqGpu::from_decode(b as u32, &ds));
        slots.push((own_off + own - 1) as u32); // the current token's row
    }
    let dims = AttnDims {
        num_heads: d.nh,
        num_kv_heads: d.nkv,
        head_dim: d.hd,
    };
    // the step as of 3ab030b: the warp-split kernel aiming at 264 blocks
    let plan = decode_plan_for_blocks(batch, dims, kv_len, 264);
    let gplan = grouped_decode_plan(batch, gsize, dims, plen, own);
    let ws_len = [
        plan.workspace_len(),
        gplan.workspace_len(),
        decode_plan(batch, dims, kv_len).workspace_len(),
        grouped_decode_plan_for_blocks(batch, gsize, dims, plen, own, 264).workspace_len(),
    ]
    .into_iter()
    .max()
    .unwrap_or(1);
    let ang: Vec<f32> = (0..batch * d.hd)
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    Ok(Model {
        d,
        batch,
        embed: filled(g, s, &src, d.vocab * d.h)?,
        lm_head: if d.tied {
            None
        } else {
            Some(filled(g, s, &src, d.vocab * d.h)?)
        },
        norm: filled(g, s, &big, d.h)?,
        h: filled(g, s, &big, batch * d.h)?,
        x: g.alloc(s, batch * d.h)?,
        qkv: g.alloc(s, batch * qkvw)?,
        attn: g.alloc(s, batch * d.nh * d.hd)?,
        tmp: g.alloc(s, batch * d.h)?,
        gu: g.alloc(s, batch * 2 * d.f)?,
        act: g.alloc(s, batch * d.f)?,
        logits: g.alloc(s, batch * d.vocab)?,
        tokens: s.clone_htod(&(0..batch as u32).map(|i| i * 101).collect::<Vec<_>>())?,
        cos: s.clone_htod(&ang.iter().map(|a| a.cos()).collect::<Vec<_>>())?,
        sin: s.clone_htod(&ang.iter().map(|a| a.sin()).collect::<Vec<_>>())?,
        slots: s.clone_htod(&slots)?,
        seqs: s.clone_htod(&seqs)?,
        ws: g.alloc(s, ws_len)?,
        sample_ids: s.clone_htod(&(0..batch as u32).collect::<Vec<_>>())?,
        steps: s.clone_htod(&vec![5u32; batch])?,
        plan,
        kv_len,
        fused: true,
        prefix: (gsize, plen),
        dispatch: false,
        grouped: false,
        gplan,
        layers,
    })
}

/// `y = x w^T (+ bias)` through the dispatching entry point or always cuBLASLt.
#[allow(clippy::too_many_arguments)]
fn lin(
    g: &Gpu,
    s: &Arc<CudaStream>,
    dispatch: bool,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    bias: Option<&dyn cudarc::driver::DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
) -> Res<()> {
    if dispatch {
        linear_fwd_bf16(g, s, y, x, w, bias, m, k, n)?;
    } else {
        linear_fwd_bf16_cublaslt(g, s, y, x, w, bias, m, k, n)?;
    }
    Ok(())
}

impl Model {
    fn dims(&self) -> AttnDims {
        AttnDims {
            num_heads: self.d.nh,
            num_kv_heads: self.d.nkv,
            head_dim: self.d.hd,
        }
    }

    fn attention(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
        let d = self.d;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let strides = RowStrides {
            q: qkvw,
            kv: d.nkv * d.hd,
            prefix: d.nkv * d.hd,
            out: d.nh * d.hd,
        };
        let dims = self.dims();
        let ly = &self.layers[l];
        if self.grouped {
            attention_decode_grouped_bf16(
                g,
                s,
                &mut self.attn,
                None,
                &mut self.ws,
                DecodeInputs {
                    q: &self.qkv,
                    k_cache: &ly.kc,
                    v_cache: &ly.vc,
                    seqs: &self.seqs,
                    dims,
                    scale: 1.0 / (d.hd as f32).sqrt(),
                    strides,
                },
                self.gplan,
            )?;
            return Ok(());
        }
        attention_decode_bf16(
            g,
            s,
            &mut self.attn,
            None,
            &mut self.ws,
            DecodeInputs {
                q: &self.qkv,
                k_cache: &ly.kc,
                v_cache: &ly.vc,
                seqs: &self.seqs,
                dims,
                scale: 1.0 / (d.hd as f32).sqrt(),
                strides,
            },
            self.plan,
        )?;
        Ok(())
    }

    fn step(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        let sk = self.dispatch;
        let d = self.d;
        let b = self.batch;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let kvw = d.nkv * d.hd;
        let eps = 1e-6;
        embedding_fwd_bf16(g, s, &mut self.h, &self.embed, &self.tokens, b, d.h, d.h)?;
        // Fused path: the residual add runs inside the next norm, rope inside the KV append.
        let n1 = &self.layers[0].n1;
        rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, n1, b, d.h, eps)?;
        for l in 0..d.layers {
            let ly = &self.layers[l];
            let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
            lin(
                g,
                s,
                sk,
                &mut self.qkv,
                &self.x,
                &ly.wqkv,
                bias,
                b,
                d.h,
                qkvw,
            )?;
            let (cos, sin, slots) = (&self.cos, &self.sin, &self.slots);
            if self.fused {
                let ly = &mut self.layers[l];
                let (kc, vc) = (&mut ly.kc, &mut ly.vc);
                rope_kv_append_bf16(
                    g,
                    s,
                    &mut self.qkv,
                    kc,
                    vc,
                    cos,
                    sin,
                    slots,
                    b,
                    d.nh,
                    d.nkv,
                    d.hd,
                    true,
                )?;
            } else {
                rope_fwd_bf16(
                    g,
                    s,
                    &mut self.qkv,
                    cos,
                    sin,
                    b,
                    qkvw,
                    d.nh + d.nkv,
                    d.hd,
                    true,
                )?;
                let ly = &mut self.layers[l];
                let (ks, vs) = (
                    self.qkv.slice(d.nh * d.hd..),
                    self.qkv.slice((d.nh + d.nkv) * d.hd..),
                );
                kv_append_bf16(g, s, &mut ly.kc, &ks, slots, b, kvw, qkvw, kvw)?;
                kv_append_bf16(g, s, &mut ly.vc, &vs, slots, b, kvw, qkvw, kvw)?;
            }
            self.attention(g, s, l)?;
            let ly = &self.layers[l];
            lin(
                g,
                s,
                sk,
                &mut self.tmp,
                &self.attn,
                &ly.wo,
                None,
                b,
                d.nh * d.hd,
                d.h,
            )?;
            if self.fused {
                add_rmsnorm_fwd_bf16(
                    g,
                    s,
                    &mut self.x,
                    None,
                    &mut self.h,
                    &self.tmp,
                    &ly.n2,
                    b,
                    d.h,
                    eps,
                )?;
            } else {
                add_fwd_bf16_inplace(g, s, &mut self.h, &self.tmp, b * d.h)?;
                rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, &ly.n2, b, d.h, eps)?;
            }
            if sk {
                let (act, gu) = (&mut self.act, &mut self.gu);
                gate_up_swiglu_bf16(g, s, act, gu, &self.x, &ly.wgu, b, d.h, d.f)?;
            } else {
                let (x, w) = (&self.x, &ly.wgu);
                linear_fwd_bf16_cublaslt(g, s, &mut self.gu, x, w, None, b, d.h, 2 * d.f)?;
                let up = self.gu.slice(d.f..);
                swiglu_fwd_bf16(
                    g,
                    s,
                    &mut self.act,
                    &self.gu,
                    &up,
                    b,
                    d.f,
                    d.f,
                    2 * d.f,
                    2 * d.f,
                )?;
            }
            lin(
                g,
                s,
                sk,
                &mut self.tmp,
                &self.act,
                &ly.wd,
                None,
                b,
                d.f,
                d.h,
            )?;
            let next_norm = if l + 1 < d.layers {
                &self.layers[l + 1].n1
            } else {
                &self.norm
            };
            if self.fused {
                add_rmsnorm_fwd_bf16(
                    g,
                    s,
                    &mut self.x,
                    None,
                    &mut self.h,
                    &self.tmp,
                    next_norm,
                    b,
                    d.h,
                    eps,
                )?;
            } else {
                add_fwd_bf16_inplace(g, s, &mut self.h, &self.tmp, b * d.h)?;
                rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, next_norm, b, d.h, eps)?;
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        lin(
            g,
            s,
            sk,
            &mut self.logits,
            &self.x,
            head,
            None,
            b,
            d.h,
            d.vocab,
        )?;
        let p = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            iteration: 0,
        };
        let (ids, steps) = (&self.sample_ids, &self.steps);
        sample_bf16(
            g,
            s,
            &mut self.tokens,
            &self.logits,
            ids,
            steps,
            b,
            d.vocab,
            d.vocab,
            &p,
        )?;
        Ok(())
    }

    /// Only the step's GEMMs (same shapes, same buffers), to split the step time.
    fn gemms(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        let sk = self.dispatch;
        let d = self.d;
        let b = self.batch;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        for ly in &self.layers {
            let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
            lin(
                g,
                s,
                sk,
                &mut self.qkv,
                &self.x,
                &ly.wqkv,
                bias,
                b,
                d.h,
                qkvw,
            )?;
            lin(
                g,
                s,
                sk,
                &mut self.tmp,
                &self.attn,
                &ly.wo,
                None,
                b,
                d.nh * d.hd,
                d.h,
            )?;
            if sk {
                let (act, gu) = (&mut self.act, &mut self.gu);
                gate_up_swiglu_bf16(g, s, act, gu, &self.x, &ly.wgu, b, d.h, d.f)?;
            } else {
                let (x, w) = (&self.x, &ly.wgu);
                linear_fwd_bf16_cublaslt(g, s, &mut self.gu, x, w, None, b, d.h, 2 * d.f)?;
            }
            lin(
                g,
                s,
                sk,
                &mut self.tmp,
                &self.act,
                &ly.wd,
                None,
                b,
                d.f,
                d.h,
            )?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        lin(
            g,
            s,
            sk,
            &mut self.logits,
            &self.x,
            head,
            None,
            b,
            d.h,
            d.vocab,
        )?;
        Ok(())
    }

    /// (weight bytes, KV bytes a per-sample reader moves, KV bytes this variant moves, logits
    /// bytes) of one step. KV: every key and value row read once per layer (+ the appended row).
    fn bytes(&self) -> (f64, f64, f64, f64) {
        let d = self.d;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let per_layer = qkvw * d.h + qkvw + d.h * d.nh * d.hd + 3 * d.f * d.h + 2 * d.h;
        let w = (d.layers * per_layer + d.h + d.vocab * d.h + self.batch * d.h) as f64 * 2.0;
        let row = (d.layers * 2 * d.nkv * d.hd) as f64 * 2.0;
        let per_sample = (self.batch * self.kv_len + self.batch) as f64 * row;
        let (gsize, plen) = self.prefix;
        let moved = if self.grouped && self.gplan.p_splits > 0 {
            let groups = self.batch.div_ceil(gsize);
            (groups * plen + self.batch * (self.kv_len - plen) + self.batch) as f64 * row
        } else {
            per_sample
        };
        let logits = (2 * self.batch * d.vocab) as f64 * 2.0;
        (w, per_sample, moved, logits)
    }

    /// One kind of the step's GEMMs over every layer (as a graph body): 0 qkv, 1 o, 2 gate|up
    /// (+ SwiGLU when `plan` is skinny), 3 down, 4 lm_head. `plan`: None = cuBLASLt.
    fn gemm_kind(&mut self, g: &Gpu, s: &Arc<CudaStream>, kind: usize, how: GemmBy) -> Res<()> {
        let d = self.d;
        let b = self.batch;
        let (k, n, _) = self.gemm_shape(kind);
        let reps = if kind == 4 { 1 } else { d.layers };
        for l in 0..reps {
            let ly = &self.layers[l];
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            let (w, x, y): (&CudaSlice<bf16>, &CudaSlice<bf16>, &mut CudaSlice<bf16>) = match kind {
                0 => (&ly.wqkv, &self.x, &mut self.qkv),
                1 => (&ly.wo, &self.attn, &mut self.tmp),
                2 => (&ly.wgu, &self.x, &mut self.gu),
                3 => (&ly.wd, &self.act, &mut self.tmp),
                _ => (head, &self.x, &mut self.logits),
            };
            let bias = (kind == 0).then_some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
            match how {
                GemmBy::Lt(0) => linear_fwd_bf16_cublaslt(g, s, y, x, w, bias, b, k, n)?,
                GemmBy::Lt(r) => linear_fwd_bf16_cublaslt_ranked(g, s, y, x, w, bias, b, k, n, r)?,
                GemmBy::Skinny(p) if kind == 2 => {
                    let (x, w) = (&self.x, &ly.wgu);
                    skinny_gate_up_swiglu_bf16(g, s, &mut self.act, x, w, b, k, n / 2, Some(p))?
                }
                GemmBy::Skinny(p) => {
                    skinny_linear_fwd_bf16_with(g, s, y, x, w, bias, b, k, n, k, n, p)?
                }
            }
        }
        Ok(())
    }

    /// (k, n) of GEMM kind `kind` and its weight bytes over all its repetitions.
    fn gemm_shape(&self, kind: usize) -> (usize, usize, f64) {
        let d = self.d;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let (k, n) = [
            (d.h, qkvw),
            (d.nh * d.hd, d.h),
            (d.h, 2 * d.f),
            (d.f, d.h),
            (d.h, d.vocab),
        ][kind];
        let reps = if kind == 4 { 1 } else { d.layers };
        (k, n, (reps * k * n * 2) as f64)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median ms of `reps` replays of `graph` (events around each), after 3 warm-up replays.
fn time_graph(
    g: &Gpu,
    s: &Arc<CudaStream>,
    graph: &cudarc::driver::CudaGraph,
    reps: usize,
) -> Res<f64> {
    for _ in 0..3 {
        graph.launch()?;
    }
    s.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let (a, b) = (g.timing_event()?, g.timing_event()?);
        a.record(s)?;
        graph.launch()?;
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(ts))
}

fn capture(s: &Arc<CudaStream>, f: impl FnOnce() -> Res<()>) -> Res<cudarc::driver::CudaGraph> {
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let r = f();
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0))?;
    r?;
    graph.ok_or_else(|| "stream capture produced no graph".into())
}

fn copy_ceiling(g: &Gpu, s: &Arc<CudaStream>) -> Res<f64> {
    let n = 1usize << 30;
    let src = s.clone_htod(&rand_bf(1 << 24, 1, 1.0))?;
    let a = filled(g, s, &src, n)?;
    let mut b = g.alloc::<bf16>(s, n)?;
    for _ in 0..3 {
        s.memcpy_dtod(&a, &mut b)?;
    }
    let mut ts = Vec::new();
    for _ in 0..10 {
        let (e0, e1) = (g.timing_event()?, g.timing_event()?);
        e0.record(s)?;
        s.memcpy_dtod(&a, &mut b)?;
        e1.record(s)?;
        e1.synchronize()?;
        ts.push(e0.elapsed_ms(&e1)? as f64);
    }
    Ok(2.0 * (n * 2) as f64 / (median(ts) * 1e-3) / 1e12)
}

struct Timed {
    step: f64,
    /// The same graph captured without programmatic dependent launch.
    step_no_pdl: f64,
    eager: f64,
    gemms: f64,
    attn: f64,
    bytes: (f64, f64, f64, f64),
    tokens: Vec<u32>,
}

/// Builds the step graph of the model's current variant and times it (also the GEMMs alone and
/// the attention alone, each as its own graph).
fn time_variant(g: &Gpu, s: &Arc<CudaStream>, m: &mut Model) -> Res<Timed> {
    let layers = m.d.layers;
    // eager once (also checks every launch), then the graph
    m.step(g, s)?;
    s.synchronize()?;
    // eager: the same launches, one step at a time from an idle device (as the runtime's
    // decode loop issues a step after the previous step's tokens came back); median of 10
    let eager = {
        let mut ts = Vec::new();
        for _ in 0..10 {
            let (a, b) = (g.timing_event()?, g.timing_event()?);
            s.synchronize()?;
            a.record(s)?;
            m.step(g, s)?;
            b.record(s)?;
            b.synchronize()?;
            ts.push(a.elapsed_ms(&b)? as f64);
        }
        median(ts)
    };
    let graph = capture(s, || m.step(g, s))?;
    let step = time_graph(g, s, &graph, 20)?;
    drop(graph);
    let pdl = g.pdl();
    g.set_pdl(false);
    let graph = capture(s, || m.step(g, s));
    g.set_pdl(pdl);
    let graph = graph?;
    let step_no_pdl = time_graph(g, s, &graph, 20)?;
    drop(graph);
    let tokens = s.clone_dtoh(&m.tokens)?;
    let att_graph = capture(s, || {
        for l in 0..layers {
            m.attention(g, s, l)?;
        }
        Ok(())
    })?;
    let attn = time_graph(g, s, &att_graph, 20)?;
    drop(att_graph);
    let gemm_graph = capture(s, || m.gemms(g, s))?;
    let gemms = time_graph(g, s, &gemm_graph, 20)?;
    drop(gemm_graph);
    Ok(Timed {
        step,
        step_no_pdl,
        eager,
        gemms,
        attn,
        bytes: m.bytes(),
        tokens: tokens[..4.min(tokens.len())].to_vec(),
    })
}

fn main() -> Res<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // --cases 4,8,9: only those rows of the case table below (0-based)
    let mut cases: Option<Vec<usize>> = None;
    if let Some(i) = args.iter().position(|a| a == "--cases") {
        let list = args
            .get(i + 1)
            .ok_or("--cases needs a list such as 4,8,9")?;
        cases = Some(
            list.split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| format!("--cases {list}: {e}"))?,
        );
        args.drain(i..i + 2);
    }
    // --variants shared,new: only those variants of each case
    let mut only: Option<Vec<String>> = None;
    if let Some(i) = args.iter().position(|a| a == "--variants") {
        let list = args
            .get(i + 1)
            .ok_or("--variants needs a list such as shared,new")?;
        only = Some(list.split(',').map(|v| v.trim().to_string()).collect());
        args.drain(i..i + 2);
    }
    // --gemm-rows 16,32: the rows the GEMM sweep takes (default 128,64,32,16)
    let mut sweep_rows = vec![128, 64, 32, 16];
    if let Some(i) = args.iter().position(|a| a == "--gemm-rows") {
        let list = args
            .get(i + 1)
            .ok_or("--gemm-rows needs a list such as 16,32")?;
        sweep_rows = list
            .split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("--gemm-rows {list}: {e}"))?;
        args.drain(i..i + 2);
    }
    for a in &args {
        if !["--unfused", "--simt", "--no-sweep", "--gemm-sweep"].contains(&a.as_str()) {
            return Err(format!("unknown flag {a}; flags: --unfused (separate add/norm and rope/append kernels), --simt (the SIMT decode attention instead of the warp-split one in the base and gemm variants), --no-sweep (skip the GEMM comparison), --gemm-sweep (only the GEMM kinds at m = 128..16, every skinny cut), --gemm-rows M,N (the sweep's rows), --variants V,W (base, gemm, new, shared, forced), --cases I,J (rows of the case table: 0-3 3B/7B at B 64/8 unshared, 4-7 the same with G8 prefixes of 1792, 8-9 3B B 32/128 with G8 prefixes)").into());
        }
    }
    let unfused = args.iter().any(|a| a == "--unfused");
    let tensor_cores = !args.iter().any(|a| a == "--simt");
    let sweep = !args.iter().any(|a| a == "--no-sweep");
    println!(
        "variant flags: {} kernels, base uses the {} decode attention",
        if unfused { "unfused" } else { "fused" },
        if tensor_cores { "tensor-core" } else { "SIMT" }
    );
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    g.prepare_stream(&s)?;
    let ceiling = copy_ceiling(&g, &s)?;
    println!(
        "device: {} ({} SMs); device copy ceiling {ceiling:.2} TB/s (read + write, 2 GiB)",
        g.name(),
        g.sm_count()
    );
    if args.iter().any(|a| a == "--gemm-sweep") {
        return gemm_sweep(&g, &s, ceiling, &sweep_rows);
    }
    let mut rows = Vec::new();
    // (dims, batch, (group size, shared prefix length))
    type Case = (Dims, usize, Option<(usize, usize)>);
    let configs: [Case; 10] = [
        (D3B, 64, None),
        (D3B, 8, None),
        (D7B, 64, None),
        (D7B, 8, None),
        (D3B, 64, Some((8, 1792))),
        (D3B, 8, Some((8, 1792))),
        (D7B, 64, Some((8, 1792))),
        (D7B, 8, Some((8, 1792))),
        (D3B, 32, Some((8, 1792))),
        (D3B, 128, Some((8, 1792))),
    ];
    for (ci, (d, batch, prefix)) in configs.into_iter().enumerate() {
        if cases.as_ref().is_some_and(|c| !c.contains(&ci)) {
            continue;
        }
        let kv_len = 2048;
        let mut m = build(&g, &s, d, batch, kv_len, prefix)?;
        m.fused = !unfused;
        m.plan.tensor_cores = tensor_cores;
        s.synchronize()?;
        let pre = match prefix {
            Some((gs, pl)) => format!("G{gs} prefix {pl}"),
            None => "no sharing".to_string(),
        };
        println!("== {} B={batch} KV={kv_len} ({pre})", d.name);
        // Each GEMM kind alone over all layers: cuBLASLt and the skinny kernel's default plan
        // (no-sharing cases: the GEMMs do not depend on the sharing).
        if sweep && ci < 4 {
            for kind in 0..5 {
                let (k, n, wb) = m.gemm_shape(kind);
                let mut line = Vec::new();
                let p = skinny_plan(batch, k, n);
                for (name, how) in [("cublasLt", GemmBy::Lt(0)), ("skinny", GemmBy::Skinny(p))] {
                    let gr = capture(&s, || m.gemm_kind(&g, &s, kind, how))?;
                    let t = time_graph(&g, &s, &gr, 20)?;
                    drop(gr);
                    line.push(format!(
                        "{name} {:.1} us ({:.2} TB/s)",
                        t * 1e3 / if kind == 4 { 1.0 } else { d.layers as f64 },
                        wb / (t * 1e-3) / 1e12
                    ));
                }
                let kname = ["qkv", "o", "gate_up(+swiglu)", "down", "lm_head"][kind];
                let used = if skinny_pays(&g, batch, k) {
                    "skinny"
                } else {
                    "cublasLt"
                };
                println!(
                    "  gemm {kname} m{batch} k{k} n{n}: {} [skinny plan {}x{}; dispatch takes {used}]",
                    line.join("; "),
                    p.splits,
                    p.kslice
                );
            }
        }
        let (gsize, plen) = m.prefix;
        let old_plan = m.plan;
        let new_plan = decode_plan(batch, m.dims(), kv_len);
        let forced =
            grouped_decode_plan_for_blocks(batch, gsize, m.dims(), plen, kv_len - plen, 264);
        let default_gplan = m.gplan;
        // (name, dispatching GEMMs, per-sample plan, grouped plan)
        let mut variants: Vec<(&str, bool, DecodePlan, Option<GroupedDecodePlan>)> = vec![
            ("base", false, old_plan, None),
            ("gemm", true, old_plan, None),
            ("new", true, new_plan, None),
        ];
        if prefix.is_some() {
            variants.push(("shared", true, new_plan, Some(default_gplan)));
            if forced != default_gplan {
                variants.push(("forced", true, new_plan, Some(forced)));
            }
        }
        if let Some(keep) = &only {
            variants.retain(|v| keep.iter().any(|k| k == v.0));
        }
        let mut res = Vec::new();
        for (vname, dispatch, plan, gplan) in variants {
            m.dispatch = dispatch;
            m.plan = plan;
            m.grouped = gplan.is_some();
            m.gplan = gplan.unwrap_or(default_gplan);
            let t = time_variant(&g, &s, &mut m)?;
            let (w, kv_ps, kv_mv, lg) = t.bytes;
            let moved = w + kv_mv + lg;
            let per_sample = w + kv_ps + lg;
            let attn_plan = match gplan {
                Some(gp) => format!(
                    "grouped: group pass {}x{} (G{}, {} per block), per-sample pass {}x{}",
                    gp.p_splits, gp.p_chunk, gp.group, gp.per_block, gp.s_splits, gp.s_chunk
                ),
                None => format!(
                    "{} {}x{}",
                    if !plan.tensor_cores {
                        "SIMT"
                    } else if plan.pipelined {
                        "pipelined"
                    } else {
                        "warp-split"
                    },
                    plan.splits,
                    plan.chunk
                ),
            };
            println!(
                "  {vname:7} step {:.3} ms (without PDL {:.3}, eager {:.3}); GEMMs alone {:.3} ms ({:.2} TB/s on {:.2} GB), attention alone {:.3} ms ({:.2} TB/s on {:.2} GB moved; {attn_plan}), rest {:.3} ms; bytes per-sample reader {:.2} GB -> {:.2} TB/s ({:.0}% of copy), moved {:.2} GB -> {:.2} TB/s ({:.0}%); tokens {:?}",
                t.step,
                t.step_no_pdl,
                t.eager,
                t.gemms,
                w / (t.gemms * 1e-3) / 1e12,
                w / 1e9,
                t.attn,
                kv_mv / (t.attn * 1e-3) / 1e12,
                kv_mv / 1e9,
                t.step - t.gemms - t.attn,
                per_sample / 1e9,
                per_sample / (t.step * 1e-3) / 1e12,
                100.0 * per_sample / (t.step * 1e-3) / 1e12 / ceiling,
                moved / 1e9,
                moved / (t.step * 1e-3) / 1e12,
                100.0 * moved / (t.step * 1e-3) / 1e12 / ceiling,
                t.tokens
            );
            res.push((vname, t.step, per_sample, moved));
        }
        let Some(&(_, base, _, _)) = res.first() else {
            continue;
        };
        let line = format!(
            "{} B={batch} ({pre}): {}",
            d.name,
            res.iter()
                .map(|(v, t, ps, mv)| format!(
                    "{v} {t:.3} ms ({:.2}x base; per-sample {:.0}%, moved {:.0}% of copy)",
                    base / t,
                    100.0 * ps / (t * 1e-3) / 1e12 / ceiling,
                    100.0 * mv / (t * 1e-3) / 1e12 / ceiling
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
        rows.push(line);
        drop(m);
        s.synchronize()?;
    }
    println!("\nsummary (copy ceiling {ceiling:.2} TB/s):");
    for r in rows {
        println!("  {r}");
    }
    Ok(())
}

/// `--gemm-sweep`: every GEMM kind of the 3B and 7B steps alone (all layers in one graph) at
/// m = 128..8: cuBLASLt against the skinny kernel's default plan and its other cuts.
/// How a GEMM kind runs: cuBLASLt with its heuristic's answer of that rank (0: the first, what
/// the library runs), or the skinny kernel with that cut.
#[derive(Clone, Copy, PartialEq)]
enum GemmBy {
    Lt(usize),
    Skinny(SkinnyPlan),
}

fn gemm_sweep(g: &Gpu, s: &Arc<CudaStream>, ceiling: f64, rows: &[usize]) -> Res<()> {
    for d in [D3B, D7B] {
        for &batch in rows {
            let mut m = build(g, s, d, batch, 16, None)?;
            s.synchronize()?;
            println!("== gemm sweep {} m{batch}", d.name);
            let (mut ours, mut theirs, mut best_total) = (0.0, 0.0, 0.0);
            for kind in 0..5 {
                let (k, n, wb) = m.gemm_shape(kind);
                let def = skinny_plan(batch, k, n);
                let mut cands: Vec<(String, GemmBy)> = vec![
                    ("cublasLt".into(), GemmBy::Lt(0)),
                    ("default".into(), GemmBy::Skinny(def)),
                ];
                // cuBLASLt's other heuristic answers (not every shape has all of them)
                cands.extend((1..LT_RANKS).map(|r| (format!("lt#{r}"), GemmBy::Lt(r))));
                for rt in [1, 2] {
                    for sp in [1, 2, 4, 8] {
                        let p = skinny_plan_with(batch, k, n, rt, sp);
                        let mut forms = vec![p];
                        if batch > 8 && batch <= 64 {
                            forms.push(p.with_form(batch, false));
                        }
                        if p.wgmma {
                            forms.extend([3, 6, 8].iter().filter_map(|&st| p.with_stages(st)));
                        }
                        for p in forms {
                            if p != def && !cands.iter().any(|(_, c)| *c == GemmBy::Skinny(p)) {
                                let form = if p.wgmma { "wg" } else { "sync" };
                                cands.push((
                                    format!(
                                        "{form} rt{} s{} st{}",
                                        p.row_tiles, p.splits, p.stages
                                    ),
                                    GemmBy::Skinny(p),
                                ));
                            }
                        }
                    }
                }
                let kname = ["qkv", "o", "gate_up", "down", "lm_head"][kind];
                let reps = if kind == 4 { 1.0 } else { d.layers as f64 };
                let mut line = Vec::new();
                let mut best = (f64::MAX, String::new());
                let mut timed = Vec::new();
                for (name, how) in &cands {
                    let gr = match capture(s, || m.gemm_kind(g, s, kind, *how)) {
                        Ok(gr) => gr,
                        // a rank the heuristic does not have for this shape
                        Err(_) if matches!(how, GemmBy::Lt(r) if *r > 0) => continue,
                        Err(e) => return Err(e),
                    };
                    let t = time_graph(g, s, &gr, 10)?;
                    drop(gr);
                    let tbs = wb / (t * 1e-3) / 1e12;
                    line.push(format!(
                        "{name} {:.1}us {:.0}%",
                        t * 1e3 / reps,
                        100.0 * tbs / ceiling
                    ));
                    timed.push((t, name.clone()));
                    if name == "cublasLt" {
                        theirs += t;
                    } else if name == "default" {
                        ours += t;
                    }
                    if t < best.0 {
                        best = (t, name.clone());
                    }
                }
                timed.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
                let top: Vec<String> = timed
                    .iter()
                    .take(4)
                    .map(|(t, n)| format!("{n} {:.1}us", t * 1e3 / reps))
                    .collect();
                println!(
                    "  {kname} k{k} n{n}: {} | {} | top: {} [default rt{} s{} st{}]",
                    line[0],
                    line[1],
                    top.join(", "),
                    def.row_tiles,
                    def.splits,
                    def.stages
                );
                best_total += best.0;
            }
            println!(
                "  all kinds: default skinny {ours:.3} ms vs cuBLASLt {theirs:.3} ms ({:.2}x); best of each kind {best_total:.3} ms ({:.2}x)",
                theirs / ours,
                theirs / best_total
            );
        }
    }
    Ok(())
}
