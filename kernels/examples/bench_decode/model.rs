//! The decode step's model: random weights, KV caches and activations, and one step's launches
//! in each variant.

use super::*;

pub(crate) struct Layer {
    pub(crate) wqkv: CudaSlice<bf16>,
    pub(crate) bqkv: CudaSlice<bf16>,
    pub(crate) wo: CudaSlice<bf16>,
    pub(crate) wgu: CudaSlice<bf16>,
    pub(crate) wd: CudaSlice<bf16>,
    pub(crate) n1: CudaSlice<bf16>,
    pub(crate) n2: CudaSlice<bf16>,
    pub(crate) kc: CudaSlice<bf16>,
    pub(crate) vc: CudaSlice<bf16>,
}

pub(crate) struct Model {
    pub(crate) d: Dims,
    pub(crate) batch: usize,
    pub(crate) layers: Vec<Layer>,
    pub(crate) embed: CudaSlice<bf16>,
    pub(crate) lm_head: Option<CudaSlice<bf16>>,
    pub(crate) norm: CudaSlice<bf16>,
    // activations
    pub(crate) h: CudaSlice<bf16>,
    pub(crate) x: CudaSlice<bf16>,
    pub(crate) qkv: CudaSlice<bf16>,
    pub(crate) attn: CudaSlice<bf16>,
    pub(crate) tmp: CudaSlice<bf16>,
    pub(crate) gu: CudaSlice<bf16>,
    pub(crate) act: CudaSlice<bf16>,
    pub(crate) logits: CudaSlice<bf16>,
    pub(crate) tokens: CudaSlice<u32>,
    pub(crate) cos: CudaSlice<f32>,
    pub(crate) sin: CudaSlice<f32>,
    pub(crate) slots: CudaSlice<u32>,
    pub(crate) seqs: CudaSlice<AttnSeqGpu>,
    pub(crate) ws: CudaSlice<f32>,
    /// The split draw's scratch (see [`Model::sample`]).
    pub(crate) sample_scratch: Option<SampleScratch>,
    pub(crate) sample_ids: CudaSlice<u32>,
    pub(crate) steps: CudaSlice<u32>,
    pub(crate) plan: DecodePlan,
    pub(crate) kv_len: usize,
    /// Fused kernels (add+rmsnorm, rope+KV append) or the separate ones.
    pub(crate) fused: bool,
    /// (group size, shared prefix length) of the GRPO groups; (1, 0) when nothing is shared.
    pub(crate) prefix: (usize, usize),
    /// The dispatching GEMM entry points (`linear_fwd_bf16`, `gate_up_swiglu_bf16`: our skinny
    /// kernel at m <= 8, gate|up fused with SwiGLU) instead of always cuBLASLt + `swiglu_fwd_bf16`.
    pub(crate) dispatch: bool,
    /// `attention_decode_grouped_bf16` with `gplan` instead of `attention_decode_bf16` with `plan`.
    pub(crate) grouped: bool,
    /// With the dispatching GEMMs and the fused kernels: q|k|v, rope and the KV append through
    /// `qkv_rope_append_bf16` (one launch where the skinny kernel fuses them, as the runtime
    /// runs them) instead of the q|k|v GEMM and `rope_kv_append_bf16`.
    pub(crate) qkv_rope: bool,
    pub(crate) gplan: GroupedDecodePlan,
}

/// How [`Model::qkv_rope_by`] makes a layer's rotated q|k|v and appends k / v: cuBLASLt's, the
/// skinny kernel's or the dispatching GEMM (`linear_fwd_bf16`) then `rope_kv_append_bf16`, the
/// fused skinny launch, or what `qkv_rope_append_bf16` picks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum QkvBy {
    Lt,
    Skinny,
    Linear,
    Fused,
    Dispatch,
}

pub(crate) fn rand_bf(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
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
pub(crate) fn filled(
    g: &Gpu,
    s: &Arc<CudaStream>,
    src: &CudaSlice<bf16>,
    n: usize,
) -> Res<CudaSlice<bf16>> {
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
pub(crate) fn build(
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
        sample_scratch: Some(SampleScratch::new(s, batch)?),
        sample_ids: s.clone_htod(&(0..batch as u32).collect::<Vec<_>>())?,
        steps: s.clone_htod(&vec![5u32; batch])?,
        plan,
        kv_len,
        fused: true,
        prefix: (gsize, plen),
        dispatch: false,
        grouped: false,
        qkv_rope: true,
        gplan,
        layers,
    })
}

/// `y = x w^T (+ bias)` through the dispatching entry point or always cuBLASLt.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lin(
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
    pub(crate) fn dims(&self) -> AttnDims {
        AttnDims {
            num_heads: self.d.nh,
            num_kv_heads: self.d.nkv,
            head_dim: self.d.hd,
        }
    }

    /// Every layer's attention in one graph: its median replay time (ms).
    pub(crate) fn attention_ms(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<f64> {
        let layers = self.d.layers;
        let gr = capture(s, || {
            for l in 0..layers {
                self.attention(g, s, l)?;
            }
            Ok(())
        })?;
        time_graph(g, s, &gr, 20)
    }

    pub(crate) fn attention(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
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
                None,
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

    /// Layer `l`'s q|k|v projection (bias fused): `qkv = x wqkv^T + b`.
    fn qkv_gemm(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
        let d = self.d;
        let ly = &self.layers[l];
        let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let (b, sk) = (self.batch, self.dispatch);
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
        )
    }

    /// Layer `l`'s output projection: `tmp = attn wo^T`.
    fn o_gemm(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
        let d = self.d;
        let (b, sk) = (self.batch, self.dispatch);
        let w = &self.layers[l].wo;
        lin(
            g,
            s,
            sk,
            &mut self.tmp,
            &self.attn,
            w,
            None,
            b,
            d.nh * d.hd,
            d.h,
        )
    }

    /// Layer `l`'s gate|up GEMM: with the skinny dispatch SwiGLU is fused (`act` written);
    /// else `gu` only, and `act` when `swiglu`.
    fn gate_up_gemm(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize, swiglu: bool) -> Res<()> {
        let d = self.d;
        let b = self.batch;
        let w = &self.layers[l].wgu;
        if self.dispatch {
            let (act, gu) = (&mut self.act, &mut self.gu);
            gate_up_swiglu_bf16(g, s, act, gu, &self.x, w, b, d.h, d.f)?;
            return Ok(());
        }
        linear_fwd_bf16_cublaslt(g, s, &mut self.gu, &self.x, w, None, b, d.h, 2 * d.f)?;
        if swiglu {
            let up = self.gu.slice(d.f..);
            let (gu, f) = (&self.gu, d.f);
            swiglu_fwd_bf16(g, s, &mut self.act, gu, &up, b, f, f, 2 * f, 2 * f)?;
        }
        Ok(())
    }

    /// Layer `l`'s down projection: `tmp = act wd^T`.
    fn down_gemm(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
        let d = self.d;
        let (b, sk) = (self.batch, self.dispatch);
        let w = &self.layers[l].wd;
        lin(g, s, sk, &mut self.tmp, &self.act, w, None, b, d.f, d.h)
    }

    /// The lm head (tied to the embedding unless the model has its own): `logits = x head^T`.
    fn head_gemm(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        let d = self.d;
        let (b, sk) = (self.batch, self.dispatch);
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
        )
    }

    pub(crate) fn step(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
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
            if self.fused {
                // the q|k|v GEMM (as the variant dispatches it) and rope + append, fused into
                // one launch where `qkv_rope_append_bf16` takes them
                let how = match (self.dispatch, self.qkv_rope) {
                    (true, true) => QkvBy::Dispatch,
                    (true, false) => QkvBy::Linear,
                    (false, _) => QkvBy::Lt,
                };
                self.qkv_rope_by(g, s, l, how)?;
            } else {
                self.qkv_gemm(g, s, l)?;
                let (cos, sin, slots) = (&self.cos, &self.sin, &self.slots);
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
            self.o_gemm(g, s, l)?;
            let ly = &self.layers[l];
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
            self.gate_up_gemm(g, s, l, true)?;
            self.down_gemm(g, s, l)?;
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
        self.head_gemm(g, s)?;
        self.sample(g, s)
    }

    /// The step's draw (T = 1) from the logits: each row split over several blocks with the
    /// scratch (as the runtime draws), one block a row without it.
    pub(crate) fn sample(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
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
            self.batch,
            self.d.vocab,
            self.d.vocab,
            &p,
            self.sample_scratch.as_mut(),
        )?;
        Ok(())
    }

    /// Only the step's GEMMs (same shapes, same buffers), to split the step time.
    pub(crate) fn gemms(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        for l in 0..self.d.layers {
            self.qkv_gemm(g, s, l)?;
            self.o_gemm(g, s, l)?;
            self.gate_up_gemm(g, s, l, false)?;
            self.down_gemm(g, s, l)?;
        }
        self.head_gemm(g, s)
    }

    /// (weight bytes, KV bytes a per-sample reader moves, KV bytes this variant moves, logits
    /// bytes) of one step. KV: every key and value row read once per layer (+ the appended row).
    pub(crate) fn bytes(&self) -> (f64, f64, f64, f64) {
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
    pub(crate) fn gemm_kind(
        &mut self,
        g: &Gpu,
        s: &Arc<CudaStream>,
        kind: usize,
        how: GemmBy,
    ) -> Res<()> {
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

    /// Layer `l`'s q|k|v projection, rotary embedding and KV append, made as `how` says.
    pub(crate) fn qkv_rope_by(
        &mut self,
        g: &Gpu,
        s: &Arc<CudaStream>,
        l: usize,
        how: QkvBy,
    ) -> Res<()> {
        let d = self.d;
        let b = self.batch;
        let ly = &mut self.layers[l];
        let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
        let (x, w) = (&self.x, &ly.wqkv);
        let rope = QkvRope {
            k_cache: &mut ly.kc,
            v_cache: &mut ly.vc,
            cos: &self.cos,
            sin: &self.sin,
            slots: &self.slots,
            heads: d.nh,
            kv_heads: d.nkv,
            head_dim: d.hd,
        };
        let n = rope.width();
        match how {
            QkvBy::Dispatch => qkv_rope_append_bf16(g, s, &mut self.qkv, x, w, bias, b, d.h, rope)?,
            QkvBy::Fused => {
                skinny_qkv_rope_bf16(g, s, &mut self.qkv, x, w, bias, b, d.h, rope, None)?
            }
            QkvBy::Lt | QkvBy::Skinny | QkvBy::Linear => {
                let q = &mut self.qkv;
                match how {
                    QkvBy::Lt => linear_fwd_bf16_cublaslt(g, s, q, x, w, bias, b, d.h, n)?,
                    QkvBy::Linear => linear_fwd_bf16(g, s, q, x, w, bias, b, d.h, n)?,
                    _ => {
                        let p = skinny_plan(b, d.h, n);
                        skinny_linear_fwd_bf16_with(g, s, q, x, w, bias, b, d.h, n, d.h, n, p)?
                    }
                }
                let (kc, vc) = (rope.k_cache, rope.v_cache);
                let (cos, sin, slots) = (rope.cos, rope.sin, rope.slots);
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
            }
        }
        Ok(())
    }

    /// (k, n) of GEMM kind `kind` and its weight bytes over all its repetitions.
    pub(crate) fn gemm_shape(&self, kind: usize) -> (usize, usize, f64) {
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
