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

mod attn;
mod decode;
mod score;

use std::sync::Arc;

use cudarc::driver::DevicePtr;

use half::bf16;
use rollplex_kernels::cpu::AttnDims;
use rollplex_kernels::cuda::{
    embedding_fwd_bf16, kv_append_bf16, rmsnorm_fwd_bf16, AttnSeqGpu, CudaSlice, CudaStream, Gpu,
};

use crate::model::KvSpan;

use super::arena::{alloc_in, DevBuf, Region};
use super::block::run_blocks;
use super::plan::{check_ids, media_slot, PackedPrompts, PromptSpec};
use super::staging::staged_bytes;
use super::vision::GpuEncodedMedia;
use super::{alloc, GpuError, GpuModel, Result};
use attn::PackedAttn;

pub use decode::{DecodeBufs, DecodeIo, Grouping};
pub use score::DeviceScores;

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
    /// The device addresses of K and V (what a captured decode step bakes in).
    pub fn addresses(&self, stream: &CudaStream) -> (u64, u64) {
        (self.k.device_ptr(stream).0, self.v.device_ptr(stream).0)
    }
    /// Bytes of the arena (K and V).
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.capacity as usize * self.kv_width * 2
    }
    fn layer_len(&self) -> usize {
        self.capacity as usize * self.kv_width
    }
    /// Layer `layer`'s elements of `k` (and of `v`).
    pub(super) fn layer_range(&self, layer: usize) -> std::ops::Range<usize> {
        let ll = self.layer_len();
        layer * ll..(layer + 1) * ll
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

/// Rows of hidden states per lm-head chunk in `score` / `forward_logits` (bounds the logits
/// buffer to `CHUNK x vocab`).
const LM_CHUNK: usize = 1024;

impl GpuModel {
    pub(crate) fn text_dims(&self) -> AttnDims {
        let t = self.config.text();
        AttnDims {
            num_heads: t.num_heads as usize,
            num_kv_heads: t.num_kv_heads as usize,
            head_dim: t.head_dim() as usize,
        }
    }
    pub(crate) fn hidden(&self) -> usize {
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
        let mut logits = alloc::<bf16>(gpu, stream, n * v)?;
        self.head_into(gpu, stream, &g, n, &mut xn, &mut logits)?;
        Ok(logits)
    }

    /// Final norm of the first `n` rows of `x` (into `xn`), then the lm head into `logits`
    /// `[n, V]`.
    pub(crate) fn head_into(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        n: usize,
        xn: &mut CudaSlice<bf16>,
        logits: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (h, v) = (self.hidden(), self.vocab());
        rmsnorm_fwd_bf16(
            gpu,
            stream,
            xn,
            None,
            x,
            &self.weights.final_norm,
            n,
            h,
            self.eps(),
        )?;
        rollplex_kernels::cuda::linear_fwd_bf16(
            gpu,
            stream,
            logits,
            &*xn,
            self.weights.lm_head(),
            None,
            n,
            h,
            v,
        )?;
        Ok(())
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
}
