//! Sampling on the device and the rollout of one GRPO group, mirroring the CPU engine's
//! `model::generate`: G samples decoded from one shared prefix state in a [`GpuKvArena`] laid
//! out as `[prefix | suffix 0 | suffix 1 | ...]`.
//!
//! Each token is drawn by `sample_bf16` keyed by the same address as the CPU sampler's
//! [`SampleKey`](crate::model::SampleKey): (seed, iteration, sample, step). The draw itself is
//! the kernel's (Gumbel-max over Philox4x32-10 words, docs/cuda.md), not the CPU engine's
//! inverse CDF, so the two backends agree on greedy tokens (up to bf16 near-ties) but not on
//! sampled ones; on the same logits the device agrees with `sample_ref`, its CPU twin.
//! Tokens come back to the host once per step (stop tokens decide who stays in the batch).

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use half::bf16;
use rollplex_kernels::cuda::{
    logprobs_fwd_bf16, sample_bf16, CudaSlice, CudaStream, Gpu, SampleParams,
};

use crate::model::{DecodeSlot, GenerateConfig, Rollout, SamplingParams, StopReason};

use super::text::{GpuKvArena, GpuPrefixState};
use super::{alloc, download, upload, GpuError, GpuModel, Result};

/// The kernel's parameters for the CPU engine's sampling settings and key fields.
pub fn sample_params(p: &SamplingParams, seed: u64, iteration: u32) -> SampleParams {
    SampleParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        seed,
        iteration,
    }
}

impl GpuModel {
    /// Draws one token per row of `logits [rows, vocab]`: row `r` with key (seed, iteration,
    /// `sample_ids[r]`, `steps[r]`). The tokens stay on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_tokens(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<bf16>,
        sampling: &SamplingParams,
        seed: u64,
        iteration: u32,
        sample_ids: &[u32],
        steps: &[u32],
    ) -> Result<CudaSlice<u32>> {
        let rows = sample_ids.len();
        if steps.len() != rows {
            return Err(GpuError::Input(format!(
                "sample_tokens: {rows} sample ids but {} steps",
                steps.len()
            )));
        }
        let v = self.vocab();
        if logits.len() < rows * v {
            return Err(GpuError::Input(format!(
                "sample_tokens: {} logits for {rows} rows of {v}",
                logits.len()
            )));
        }
        let mut out = alloc::<u32>(gpu, stream, rows)?;
        if rows == 0 {
            return Ok(out);
        }
        let ids = upload(stream, sample_ids)?;
        let st = upload(stream, steps)?;
        let p = sample_params(sampling, seed, iteration);
        sample_bf16(gpu, stream, &mut out, logits, &ids, &st, rows, v, v, &p)?;
        Ok(out)
    }

    /// Generates one response per entry of `sample_ids` from one prefix state (as the CPU
    /// engine's `generate_group`). Synchronises once per step (the tokens come back).
    pub fn generate_group(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        prefix: &GpuPrefixState,
        sample_ids: &[u32],
        cfg: &GenerateConfig,
    ) -> Result<Vec<Rollout>> {
        let g = sample_ids.len();
        let maxn = cfg.max_new_tokens;
        let mut out: Vec<Rollout> = (0..g)
            .map(|_| Rollout {
                tokens: Vec::new(),
                logp: Vec::new(),
                stop: StopReason::MaxLength,
            })
            .collect();
        if g == 0 || maxn == 0 {
            return Ok(out);
        }
        let v = self.vocab();
        let cap = prefix.len as u64 + g as u64 * maxn as u64;
        let cap = u32::try_from(cap)
            .map_err(|_| GpuError::Input("generate_group: KV arena over 2^32 rows".into()))?;
        let mut arena = GpuKvArena::for_model(self, gpu, stream, cap)?;
        let pspan = arena.store_prefix(stream, 0, prefix)?;
        let mut slots: Vec<DecodeSlot> = (0..g)
            .map(|i| DecodeSlot::new(pspan, prefix.rope_delta, prefix.len + i as u32 * maxn, maxn))
            .collect();
        let lp_temp = if cfg.sampling.temperature > 0.0 {
            cfg.sampling.temperature
        } else {
            1.0
        };
        // step 0: every sample draws from the prefix's last logits
        let mut logits = alloc::<bf16>(gpu, stream, g * v)?;
        for i in 0..g {
            stream.memcpy_dtod(
                &*prefix.last_logits,
                &mut logits.slice_mut(i * v..(i + 1) * v),
            )?;
        }
        let mut active: Vec<usize> = (0..g).collect();
        for step in 0..maxn {
            let ids: Vec<u32> = active.iter().map(|&i| sample_ids[i]).collect();
            let steps = vec![step; active.len()];
            let toks_d = self.sample_tokens(
                gpu,
                stream,
                &logits,
                &cfg.sampling,
                cfg.seed,
                cfg.iteration,
                &ids,
                &steps,
            )?;
            let n = active.len();
            let mut lp_d = alloc::<f32>(gpu, stream, n)?;
            logprobs_fwd_bf16(
                gpu,
                stream,
                &mut lp_d,
                None::<&mut dyn DevicePtrMut<f32>>,
                None,
                &logits,
                &toks_d,
                n,
                v,
                v,
                lp_temp,
            )?;
            let toks = download(stream, &toks_d)?;
            let lps = download(stream, &lp_d)?;
            let mut next_active = Vec::with_capacity(n);
            let mut feed = Vec::with_capacity(n);
            for (ai, &i) in active.iter().enumerate() {
                let tok = toks[ai];
                out[i].tokens.push(tok);
                out[i].logp.push(lps[ai]);
                if cfg.stop_ids.contains(&tok) {
                    out[i].stop = StopReason::StopToken;
                } else if step + 1 < maxn {
                    next_active.push(i);
                    feed.push(tok);
                }
            }
            active = next_active;
            if active.is_empty() {
                break;
            }
            let mut batch: Vec<DecodeSlot> = active.iter().map(|&i| slots[i]).collect();
            logits = self.decode_step(gpu, stream, &mut arena, &mut batch, &feed)?;
            for (s, &i) in batch.iter().zip(&active) {
                slots[i] = *s;
            }
        }
        Ok(out)
    }
}
