//! The text decoder on the device and the operations the RL loop runs on it, mirroring the CPU
//! engine's `model::text`: `prefill` (prompts -> prefix states, several prompts packed in one
//! batch), `forward_logits` (every position's logits, as HF's `model(...)`), `decode_step` (one
//! token per sample over a [`GpuKvArena`] laid out as [shared group prefix | per-sample
//! suffix]), and `score` (log-probs of given responses from a kept prefix plus the suffix).
//!
//! Positions: prompt tokens get `get_rope_index` positions (computed on the host by
//! `model::positions`); every later token at sequence index `n` gets `n + rope_delta` in all
//! three sections, as the CPU engine and HF's `generate` do.
//!
//! A prefill keeps every layer's k/v of its packed batch in one device buffer
//! `[layers, rows, kv_width]` shared (`Arc`) by the batch's prefix states; each state names its
//! rows. `score` attends a state's rows there directly; [`GpuKvArena::store_prefix`] copies
//! them into an arena for decode.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut};

use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::{
    attention_decode_bf16, attention_fwd_bf16, decode_plan, embedding_fwd_bf16, kv_append_bf16,
    logprobs_fwd_bf16, rmsnorm_fwd_bf16, rope_fwd_bf16, rope_kv_append_bf16, AttnSeqGpu, CudaSlice,
    CudaStream, Gpu,
};

use crate::model::{DecodeSlot, KvSpan, TokenScores};

use super::arena::{alloc_in, DevBuf, Region};
use super::block::{run_blocks, AttnStep};
use super::plan::{
    check_decode_slots, check_ids, decode_kernel_for, flat_rope_tables, media_slot, DecodeKernel,
    PackedPrompts, PromptSpec,
};
use super::staging::staged_bytes;
use super::vision::GpuEncodedMedia;
use super::{alloc, download, upload, GpuError, GpuModel, Result};

/// A prompt: token ids (media placeholders included) and the device-encoded media filling its
/// placeholder runs, in order.
#[derive(Clone, Copy)]
pub struct GpuPrompt<'a> {
    pub ids: &'a [u32],
    pub media: &'a [&'a GpuEncodedMedia],
}

/// Every layer's k/v (after RoPE) of one packed prefill batch: `[layers, rows, kv_width]`.
pub struct PrefillKv {
    pub k: DevBuf<bf16>,
    pub v: DevBuf<bf16>,
    pub rows: usize,
    pub kv_width: usize,
}

/// What a prompt leaves for its samples (the GPU twin of `model::PrefixState`).
#[derive(Clone)]
pub struct GpuPrefixState {
    pub len: u32,
    pub rope_delta: i64,
    /// The packed batch's KV and this prompt's first row in it.
    pub kv: Arc<PrefillKv>,
    pub row0: u32,
    /// Logits of the last prompt token `[vocab]`.
    pub last_logits: Arc<CudaSlice<bf16>>,
}

/// KV cache of every layer in one buffer pair on the device: `k`, `v` `[layers, capacity,
/// kv_width]`. Rows are handed out by the caller (the plan), as in the CPU engine's `KvArena`.
pub struct GpuKvArena {
    layers: usize,
    kv_width: usize,
    capacity: u32,
    k: DevBuf<bf16>,
    v: DevBuf<bf16>,
}

impl GpuKvArena {
    /// An arena for `model` with `capacity` rows (contents undefined until written).
    pub fn for_model(
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        capacity: u32,
    ) -> Result<Self> {
        Self::for_model_in(model, gpu, stream, capacity, None)
    }

    /// [`GpuKvArena::for_model`] in `region` of the plan's arena (`kv.prompt` + `kv.response`).
    pub fn for_model_in(
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        capacity: u32,
        region: Option<&Region>,
    ) -> Result<Self> {
        let t = model.config.text();
        let layers = t.num_layers as usize;
        let kv_width = (t.num_kv_heads * t.head_dim()) as usize;
        let n = layers * capacity as usize * kv_width;
        Ok(GpuKvArena {
            layers,
            kv_width,
            capacity,
            k: alloc_in(gpu, stream, n, region)?,
            v: alloc_in(gpu, stream, n, region)?,
        })
    }
    pub fn capacity(&self) -> u32 {
        self.capacity
    }
    /// Bytes of the arena (K and V).
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.capacity as usize * self.kv_width * 2
    }
    fn layer_len(&self) -> usize {
        self.capacity as usize * self.kv_width
    }
    /// Copies a prefix's KV into rows `offset..offset + prefix.len` (on `stream`).
    pub fn store_prefix(
        &mut self,
        stream: &Arc<CudaStream>,
        offset: u32,
        prefix: &GpuPrefixState,
    ) -> Result<KvSpan> {
        let kv = &prefix.kv;
        if kv.kv_width != self.kv_width || kv.k.len() != self.layers * kv.rows * kv.kv_width {
            return Err(GpuError::Input(format!(
                "prefix of KV width {} does not fit an arena of {} layers x {}",
                kv.kv_width, self.layers, self.kv_width
            )));
        }
        let end = offset as u64 + prefix.len as u64;
        if end > self.capacity as u64 {
            return Err(GpuError::Input(format!(
                "prefix rows {offset}..{end} exceed the arena's {} rows",
                self.capacity
            )));
        }
        let (w, n) = (self.kv_width, prefix.len as usize * self.kv_width);
        let ll = self.layer_len();
        for l in 0..self.layers {
            let src = l * kv.rows * w + prefix.row0 as usize * w;
            let dst = l * ll + offset as usize * w;
            stream.memcpy_dtod(
                &kv.k.slice(src..src + n),
                &mut self.k.slice_mut(dst..dst + n),
            )?;
            stream.memcpy_dtod(
                &kv.v.slice(src..src + n),
                &mut self.v.slice_mut(dst..dst + n),
            )?;
        }
        Ok(KvSpan {
            offset,
            len: prefix.len,
        })
    }
}

/// Text attention over a packed batch: rotate q and k (HF's bf16 text rounding), attend each
/// sequence causally (after an optional prefix KV of this layer), keep k/v when asked.
struct PackedAttn<'a> {
    cos: &'a CudaSlice<f32>,
    sin: &'a CudaSlice<f32>,
    seqs: &'a CudaSlice<AttnSeqGpu>,
    n_seqs: usize,
    max_q: usize,
    dims: AttnDims,
    rows: usize,
    /// A prefix KV (`[layers, prefix_rows, kvw]`) the sequences' prefix spans index.
    prefix: Option<&'a PrefillKv>,
    /// Where to keep this batch's k/v (`[layers, rows, kvw]`) and the identity slots.
    keep: Option<(&'a mut PrefillKv, &'a CudaSlice<u32>)>,
}

impl AttnStep for PackedAttn<'_> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let d = self.dims;
        let (qw, kvw) = (d.q_width(), d.kv_width());
        let row = qw + 2 * kvw;
        rope_fwd_bf16(
            gpu,
            stream,
            qkv,
            self.cos,
            self.sin,
            self.rows,
            row,
            d.num_heads + d.num_kv_heads,
            d.head_dim,
            true,
        )?;
        if let Some((kv, iota)) = self.keep.as_mut() {
            let n = kv.rows * kvw;
            let (a, b) = (layer * n, (layer + 1) * n);
            let ks = qkv.slice(qw..);
            let vs = qkv.slice(qw + kvw..);
            kv_append_bf16(
                gpu,
                stream,
                &mut kv.k.slice_mut(a..b),
                &ks,
                *iota,
                self.rows,
                kvw,
                row,
                kvw,
            )?;
            kv_append_bf16(
                gpu,
                stream,
                &mut kv.v.slice_mut(a..b),
                &vs,
                *iota,
                self.rows,
                kvw,
                row,
                kvw,
            )?;
        }
        let k = qkv.slice(qw..qkv.len() - kvw);
        let v = qkv.slice(qw + kvw..);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        match self.prefix {
            Some(p) => {
                let n = p.rows * kvw;
                let pk = p.k.slice(layer * n..(layer + 1) * n);
                let pv = p.v.slice(layer * n..(layer + 1) * n);
                let strides = RowStrides {
                    q: row,
                    kv: row,
                    prefix: kvw,
                    out: qw,
                };
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    qkv,
                    &k,
                    &v,
                    &pk,
                    &pv,
                    self.seqs,
                    self.n_seqs,
                    self.max_q,
                    d,
                    AttnMask::Causal,
                    scale,
                    strides,
                )?;
            }
            None => {
                let strides = RowStrides {
                    q: row,
                    kv: row,
                    prefix: row,
                    out: qw,
                };
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    qkv,
                    &k,
                    &v,
                    &k,
                    &v,
                    self.seqs,
                    self.n_seqs,
                    self.max_q,
                    d,
                    AttnMask::Causal,
                    scale,
                    strides,
                )?;
            }
        }
        Ok(())
    }
}

/// Decode attention: rotate q and k, append k/v at each sample's next suffix row, attend
/// `[prefix | suffix]` of each sample in the arena.
struct DecodeAttn<'a> {
    cos: &'a CudaSlice<f32>,
    sin: &'a CudaSlice<f32>,
    slots: &'a CudaSlice<u32>,
    seqs: &'a CudaSlice<AttnSeqGpu>,
    dims: AttnDims,
    batch: usize,
    max_kv: usize,
    kernel: DecodeKernel,
    workspace: Option<CudaSlice<f32>>,
    arena: &'a mut GpuKvArena,
}

impl AttnStep for DecodeAttn<'_> {
    fn attend(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        layer: usize,
        qkv: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let d = self.dims;
        let (qw, kvw) = (d.q_width(), d.kv_width());
        let row = qw + 2 * kvw;
        let ll = self.arena.layer_len();
        let (a, b) = (layer * ll, (layer + 1) * ll);
        {
            let mut kc = self.arena.k.slice_mut(a..b);
            let mut vc = self.arena.v.slice_mut(a..b);
            rope_kv_append_bf16(
                gpu,
                stream,
                qkv,
                &mut kc,
                &mut vc,
                self.cos,
                self.sin,
                self.slots,
                self.batch,
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                true,
            )?;
        }
        let kc = self.arena.k.slice(a..b);
        let vc = self.arena.v.slice(a..b);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let strides = RowStrides {
            q: row,
            kv: kvw,
            prefix: kvw,
            out: qw,
        };
        match self.kernel {
            DecodeKernel::TensorCores => {
                let plan = decode_plan(self.batch, d, self.max_kv);
                let ws = match &mut self.workspace {
                    Some(w) => w,
                    None => self
                        .workspace
                        .insert(alloc::<f32>(gpu, stream, plan.workspace_len())?),
                };
                attention_decode_bf16(
                    gpu, stream, out, None, ws, qkv, &kc, &vc, self.seqs, d, scale, strides, plan,
                )?;
            }
            DecodeKernel::Varlen => {
                attention_fwd_bf16(
                    gpu,
                    stream,
                    out,
                    None,
                    qkv,
                    &kc,
                    &vc,
                    &kc,
                    &vc,
                    self.seqs,
                    self.batch,
                    1,
                    d,
                    AttnMask::Causal,
                    scale,
                    strides,
                )?;
            }
        }
        Ok(())
    }
}

/// Rows of hidden states per lm-head chunk in `score` / `forward_logits` (bounds the logits
/// buffer to `CHUNK x vocab`).
const LM_CHUNK: usize = 1024;

impl GpuModel {
    fn text_dims(&self) -> AttnDims {
        let t = self.config.text();
        AttnDims {
            num_heads: t.num_heads as usize,
            num_kv_heads: t.num_kv_heads as usize,
            head_dim: t.head_dim() as usize,
        }
    }
    fn hidden(&self) -> usize {
        self.config.text().hidden_size as usize
    }
    /// Vocabulary size (logits row width).
    pub fn vocab(&self) -> usize {
        self.config.text().vocab_size as usize
    }
    fn eps(&self) -> f32 {
        self.config.text().rms_norm_eps as f32
    }
    fn check_text_dims(&self) -> Result<()> {
        let hd = self.text_dims().head_dim;
        if !hd.is_multiple_of(16) {
            return Err(GpuError::Unsupported(format!(
                "text head_dim {hd}: the CUDA attention kernels need a multiple of 16"
            )));
        }
        Ok(())
    }

    /// Token embeddings `[ids, H]`.
    fn embed(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        ids: &CudaSlice<u32>,
        n: usize,
    ) -> Result<CudaSlice<bf16>> {
        let h = self.hidden();
        let mut x = alloc::<bf16>(gpu, stream, n * h)?;
        embedding_fwd_bf16(gpu, stream, &mut x, &self.weights.embed, ids, n, h, h)?;
        Ok(x)
    }

    /// Final norm of rows `rows` of `x` (gathered) then the lm head: logits `[rows, V]`.
    fn head_rows(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        total_rows: usize,
        rows: &impl DevicePtr<u32>,
        n: usize,
    ) -> Result<CudaSlice<bf16>> {
        let (h, v) = (self.hidden(), self.vocab());
        let mut g = alloc::<bf16>(gpu, stream, n * h)?;
        // a row gather: x is the "table" of `total_rows` rows
        embedding_fwd_bf16(
            gpu,
            stream,
            &mut g,
            &x.slice(..total_rows * h),
            rows,
            n,
            h,
            h,
        )?;
        let mut xn = alloc::<bf16>(gpu, stream, n * h)?;
        rmsnorm_fwd_bf16(
            gpu,
            stream,
            &mut xn,
            None,
            &g,
            &self.weights.final_norm,
            n,
            h,
            self.eps(),
        )?;
        let mut logits = alloc::<bf16>(gpu, stream, n * v)?;
        rollplex_kernels::cuda::linear_fwd_bf16(
            gpu,
            stream,
            &mut logits,
            &xn,
            self.weights.lm_head(),
            None,
            n,
            h,
            v,
        )?;
        Ok(logits)
    }

    /// Prefill: runs the prompts once (packed, causal) and returns their prefix states. Nothing
    /// synchronises.
    pub fn prefill(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prompts: &[GpuPrompt<'_>],
    ) -> Result<Vec<GpuPrefixState>> {
        self.prefill_in(gpu, stream, prompts, None)
    }

    /// [`GpuModel::prefill`] with the prefix keys and values in `region` of the plan's arena
    /// (the reference's or the old policy's kept prefixes).
    pub fn prefill_in(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prompts: &[GpuPrompt<'_>],
        region: Option<&Region>,
    ) -> Result<Vec<GpuPrefixState>> {
        Ok(self.prefill_impl(gpu, stream, prompts, false, region)?.0)
    }

    /// Full-sequence forward of one prompt as HF's `model(input_ids, ...)`: logits of every
    /// position `[len, V]` on the device.
    pub fn forward_logits(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prompt: GpuPrompt<'_>,
    ) -> Result<CudaSlice<bf16>> {
        let (_, all) = self.prefill_impl(gpu, stream, &[prompt], true, None)?;
        all.ok_or_else(|| GpuError::Input("forward_logits: no logits".into()))
    }

    fn prefill_impl(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prompts: &[GpuPrompt<'_>],
        all_logits: bool,
        region: Option<&Region>,
    ) -> Result<(Vec<GpuPrefixState>, Option<CudaSlice<bf16>>)> {
        self.check_text_dims()?;
        if prompts.is_empty() {
            return Ok((Vec::new(), None));
        }
        let specs: Vec<PromptSpec<'_>> = prompts
            .iter()
            .map(|p| PromptSpec {
                ids: p.ids,
                media: p.media.iter().map(|m| media_slot(m.kind, m.grid)).collect(),
            })
            .collect();
        let packed = PackedPrompts::new(&self.config, &specs)?;
        check_ids("prefill", &packed.ids, self.vocab())?;
        let rows = packed.ids.len();
        let h = self.hidden();
        let media_tokens: usize = prompts
            .iter()
            .flat_map(|p| p.media.iter())
            .map(|m| m.tokens)
            .sum();
        if media_tokens != packed.media_rows.len() {
            return Err(GpuError::Input(format!(
                "{} media placeholder tokens but the media carry {media_tokens} embeddings",
                packed.media_rows.len()
            )));
        }
        for m in prompts.iter().flat_map(|p| p.media.iter()) {
            if m.embeds.len() < m.tokens * h {
                return Err(GpuError::Input(format!(
                    "a media item holds {} embedding values, expected {} x {h}",
                    m.embeds.len(),
                    m.tokens
                )));
            }
        }
        // every host table goes up before the first launch, through page-locked staging
        let gseqs: Vec<AttnSeqGpu> = packed.seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let last: Vec<u32> = packed.seqs.iter().map(|s| s.start + s.len - 1).collect();
        let bytes = staged_bytes(&packed.ids)
            + staged_bytes(&packed.media_rows)
            + staged_bytes(&packed.cos)
            + staged_bytes(&packed.sin)
            + staged_bytes(&gseqs)
            + staged_bytes(&last);
        let (ids, slots, cos, sin, seqs, last_dev) = {
            let mut up = self.stage(stream, bytes)?;
            (
                up.put(gpu, &packed.ids)?,
                up.put(gpu, &packed.media_rows)?,
                up.put(gpu, &packed.cos)?,
                up.put(gpu, &packed.sin)?,
                up.put(gpu, &gseqs)?,
                up.put(gpu, &last)?,
            )
        };
        let mut x = self.embed(gpu, stream, &ids, rows)?;
        // media embeddings into their placeholder rows (one scatter for the batch)
        if media_tokens > 0 {
            let mut cat = alloc::<bf16>(gpu, stream, media_tokens * h)?;
            let mut off = 0;
            for m in prompts.iter().flat_map(|p| p.media.iter()) {
                let n = m.tokens * h;
                stream.memcpy_dtod(&m.embeds.slice(..n), &mut cat.slice_mut(off..off + n))?;
                off += n;
            }
            kv_append_bf16(gpu, stream, &mut x, &cat, &slots, media_tokens, h, h, h)?;
        }
        let max_q = packed
            .seqs
            .iter()
            .map(|s| s.len as usize)
            .max()
            .unwrap_or(0);
        let dims = self.text_dims();
        let layers = self.weights.text.len();
        let kvw = dims.kv_width();
        let mut kv = PrefillKv {
            k: alloc_in(gpu, stream, layers * rows * kvw, region)?,
            v: alloc_in(gpu, stream, layers * rows * kvw, region)?,
            rows,
            kv_width: kvw,
        };
        let iota = self.iota(stream, rows)?;
        {
            let mut step = PackedAttn {
                cos: &cos,
                sin: &sin,
                seqs: &seqs,
                n_seqs: gseqs.len(),
                max_q,
                dims,
                rows,
                prefix: None,
                keep: Some((&mut kv, &iota)),
            };
            run_blocks(
                gpu,
                stream,
                &self.weights.text,
                &mut x,
                rows,
                h,
                dims,
                self.eps(),
                &mut step,
            )?;
        }
        let logits = self.head_rows(gpu, stream, &x, rows, &last_dev, last.len())?;
        let full = if all_logits {
            let v = self.vocab();
            let mut full = alloc::<bf16>(gpu, stream, rows * v)?;
            for c0 in (0..rows).step_by(LM_CHUNK) {
                let n = LM_CHUNK.min(rows - c0);
                let idx = iota.slice(c0..c0 + n);
                let l = self.head_rows(gpu, stream, &x, rows, &idx, n)?;
                stream.memcpy_dtod(&l, &mut full.slice_mut(c0 * v..(c0 + n) * v))?;
            }
            Some(full)
        } else {
            None
        };
        let kv = Arc::new(kv);
        let v = self.vocab();
        let mut states = Vec::with_capacity(prompts.len());
        for (i, s) in packed.seqs.iter().enumerate() {
            let mut ll = alloc::<bf16>(gpu, stream, v)?;
            stream.memcpy_dtod(&logits.slice(i * v..(i + 1) * v), &mut ll)?;
            states.push(GpuPrefixState {
                len: s.len,
                rope_delta: packed.deltas[i],
                kv: kv.clone(),
                row0: s.start,
                last_logits: Arc::new(ll),
            });
        }
        Ok((states, full))
    }

    /// One decode step: `tokens[b]` is appended to sample `b`'s suffix (its K/V written to the
    /// arena at `suffix_offset + suffix_len`), attends `[prefix | suffix]`, and its next-token
    /// logits land in the returned `[B, vocab]` buffer. Advances each slot's `suffix_len`.
    /// Nothing synchronises.
    pub fn decode_step(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<CudaSlice<bf16>> {
        self.check_text_dims()?;
        let b = slots.len();
        if tokens.len() != b {
            return Err(GpuError::Input(format!(
                "decode_step: {b} slots but {} tokens",
                tokens.len()
            )));
        }
        let t = self.config.text();
        if arena.layers != t.num_layers as usize
            || arena.kv_width != (t.num_kv_heads * t.head_dim()) as usize
        {
            return Err(GpuError::Input(
                "decode_step: the KV arena was made for another model".into(),
            ));
        }
        check_decode_slots(arena.capacity, slots)?;
        check_ids("decode_step", tokens, self.vocab())?;
        if b == 0 {
            return alloc::<bf16>(gpu, stream, 0);
        }
        let dims = self.text_dims();
        let kernel = decode_kernel_for(dims.head_dim)?;
        let positions: Vec<i64> = slots.iter().map(DecodeSlot::next_position).collect();
        let (cos, sin) = flat_rope_tables(&self.config, &positions);
        let gseqs: Vec<AttnSeqGpu> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| AttnSeqGpu::from_decode(i as u32, &s.decode_seq()))
            .collect();
        let max_kv = slots
            .iter()
            .map(|s| (s.prefix.len + s.suffix_len + 1) as usize)
            .max()
            .unwrap_or(1);
        let write: Vec<u32> = slots.iter().map(DecodeSlot::write_row).collect();
        let ids = upload(stream, tokens)?;
        let cos = upload(stream, &cos)?;
        let sin = upload(stream, &sin)?;
        let seqs = upload(stream, &gseqs)?;
        let wslots = upload(stream, &write)?;
        let h = self.hidden();
        let mut x = self.embed(gpu, stream, &ids, b)?;
        {
            let mut step = DecodeAttn {
                cos: &cos,
                sin: &sin,
                slots: &wslots,
                seqs: &seqs,
                dims,
                batch: b,
                max_kv,
                kernel,
                workspace: None,
                arena,
            };
            run_blocks(
                gpu,
                stream,
                &self.weights.text,
                &mut x,
                b,
                h,
                dims,
                self.eps(),
                &mut step,
            )?;
        }
        let iota = self.iota(stream, b)?;
        let logits = self.head_rows(gpu, stream, &x, b, &iota.slice(..b), b)?;
        for s in slots.iter_mut() {
            s.suffix_len += 1;
        }
        Ok(logits)
    }

    /// Log-probs (and entropies) of `responses` given a kept prefix state, at `temperature`.
    /// Token 0 is scored from `prefix.last_logits`; tokens `1..` from one packed forward of
    /// every response's suffix over the prefix's KV. Synchronises (the scores come back):
    /// [`GpuModel::score_on_device`] then [`DeviceScores::to_host`].
    pub fn score(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prefix: &GpuPrefixState,
        responses: &[&[u32]],
        temperature: f32,
    ) -> Result<Vec<TokenScores>> {
        self.score_on_device(gpu, stream, prefix, responses, temperature)?
            .to_host()
    }

    /// [`GpuModel::score`] without the download: the scores stay on the device (on `stream`)
    /// until [`DeviceScores::to_host`]. Nothing synchronises.
    pub fn score_on_device(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prefix: &GpuPrefixState,
        responses: &[&[u32]],
        temperature: f32,
    ) -> Result<DeviceScores> {
        self.check_text_dims()?;
        let v = self.vocab();
        let mut ids = Vec::new();
        let mut targets = Vec::new();
        let mut seqs = Vec::new();
        let mut positions = Vec::new();
        for r in responses {
            let n = r.len().saturating_sub(1);
            seqs.push(AttnSeq {
                start: ids.len() as u32,
                len: n as u32,
                prefix_start: prefix.row0,
                prefix_len: prefix.len,
            });
            for j in 0..n {
                ids.push(r[j]);
                targets.push(r[j + 1]);
                positions.push(prefix.len as i64 + j as i64 + prefix.rope_delta);
            }
        }
        for r in responses {
            check_ids("score", r, v)?;
        }
        let rows = ids.len();
        let mut rest = None;
        if rows > 0 {
            let h = self.hidden();
            let dims = self.text_dims();
            let (cos, sin) = flat_rope_tables(&self.config, &positions);
            let gseqs: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
            // through page-locked staging: scoring runs as a side task in decode windows, and a
            // pageable upload would hold the host until the side stream's earlier work is done
            let bytes = staged_bytes(&ids)
                + staged_bytes(&targets)
                + staged_bytes(&cos)
                + staged_bytes(&sin)
                + staged_bytes(&gseqs);
            let (ids_d, tgt_d, cos, sin, seqs_d) = {
                let mut up = self.stage(stream, bytes)?;
                (
                    up.put(gpu, &ids)?,
                    up.put(gpu, &targets)?,
                    up.put(gpu, &cos)?,
                    up.put(gpu, &sin)?,
                    up.put(gpu, &gseqs)?,
                )
            };
            let max_q = seqs.iter().map(|s| s.len as usize).max().unwrap_or(0);
            let mut x = self.embed(gpu, stream, &ids_d, rows)?;
            {
                let mut step = PackedAttn {
                    cos: &cos,
                    sin: &sin,
                    seqs: &seqs_d,
                    n_seqs: gseqs.len(),
                    max_q,
                    dims,
                    rows,
                    prefix: Some(&prefix.kv),
                    keep: None,
                };
                run_blocks(
                    gpu,
                    stream,
                    &self.weights.text,
                    &mut x,
                    rows,
                    h,
                    dims,
                    self.eps(),
                    &mut step,
                )?;
            }
            let iota = self.iota(stream, rows)?;
            let mut lp_d = alloc::<f32>(gpu, stream, rows)?;
            let mut ent_d = alloc::<f32>(gpu, stream, rows)?;
            for c0 in (0..rows).step_by(LM_CHUNK) {
                let n = LM_CHUNK.min(rows - c0);
                let logits = self.head_rows(gpu, stream, &x, rows, &iota.slice(c0..c0 + n), n)?;
                let mut e = ent_d.slice_mut(c0..c0 + n);
                logprobs_fwd_bf16(
                    gpu,
                    stream,
                    &mut lp_d.slice_mut(c0..c0 + n),
                    Some(&mut e as &mut dyn DevicePtrMut<f32>),
                    None,
                    &logits,
                    &tgt_d.slice(c0..c0 + n),
                    n,
                    v,
                    v,
                    temperature,
                )?;
            }
            rest = Some((lp_d, ent_d));
        }
        // token 0 of every response from the prefix's last logits
        let firsts: Vec<u32> = responses
            .iter()
            .filter_map(|r| r.first().copied())
            .collect();
        let mut first = None;
        if !firsts.is_empty() {
            let n = firsts.len();
            let mut rep = alloc::<bf16>(gpu, stream, n * v)?;
            for i in 0..n {
                stream.memcpy_dtod(&*prefix.last_logits, &mut rep.slice_mut(i * v..(i + 1) * v))?;
            }
            let f = {
                let mut up = self.stage(stream, staged_bytes(&firsts))?;
                up.put(gpu, &firsts)?
            };
            let mut l = alloc::<f32>(gpu, stream, n)?;
            let mut e = alloc::<f32>(gpu, stream, n)?;
            logprobs_fwd_bf16(
                gpu,
                stream,
                &mut l,
                Some(&mut e as &mut dyn DevicePtrMut<f32>),
                None,
                &rep,
                &f,
                n,
                v,
                v,
                temperature,
            )?;
            first = Some((l, e));
        }
        Ok(DeviceScores {
            stream: stream.clone(),
            lens: responses.iter().map(|r| r.len()).collect(),
            seqs,
            rest,
            first,
        })
    }
}

/// Scores of [`GpuModel::score_on_device`], still on the device.
pub struct DeviceScores {
    stream: Arc<CudaStream>,
    lens: Vec<usize>,
    seqs: Vec<AttnSeq>,
    /// Log-probs and entropies of tokens `1..` of every response, packed.
    rest: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Of token 0 of every non-empty response.
    first: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl DeviceScores {
    /// The scores on the host, one per response (synchronises the stream they were made on).
    pub fn to_host(&self) -> Result<Vec<TokenScores>> {
        let stream = &self.stream;
        let (lp, ent) = match &self.rest {
            Some((l, e)) => (download(stream, l)?, download(stream, e)?),
            None => (Vec::new(), Vec::new()),
        };
        let (l0, e0) = match &self.first {
            Some((l, e)) => (download(stream, l)?, download(stream, e)?),
            None => (Vec::new(), Vec::new()),
        };
        let mut out = Vec::with_capacity(self.lens.len());
        let mut fi = 0;
        for (&len, s) in self.lens.iter().zip(&self.seqs) {
            if len == 0 {
                out.push(TokenScores {
                    logp: Vec::new(),
                    entropy: Vec::new(),
                });
                continue;
            }
            let (a, n) = (s.start as usize, s.len as usize);
            let mut logp = vec![l0[fi]];
            logp.extend_from_slice(&lp[a..a + n]);
            let mut entropy = vec![e0[fi]];
            entropy.extend_from_slice(&ent[a..a + n]);
            fi += 1;
            out.push(TokenScores { logp, entropy });
        }
        Ok(out)
    }
}
