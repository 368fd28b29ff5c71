//! Sampling on the device and the rollout of one GRPO group, mirroring the CPU engine's
//! `model::generate`: G samples decoded from one shared prefix state in a [`GpuKvArena`] laid
//! out as `[prefix | suffix 0 | suffix 1 | ...]`.
//!
//! Each token is drawn by `sample_bf16` keyed by the same address as the CPU sampler's
//! [`SampleKey`](crate::model::SampleKey): (seed, iteration, sample, step). The draw itself is
//! the kernel's (Gumbel-max over Philox4x32-10 words, docs/cuda.md), not the CPU engine's
//! inverse CDF, so the two backends agree on greedy tokens (up to bf16 near-ties) but not on
//! sampled ones; on the same logits the device agrees with `sample_ref`, its CPU twin.
//! Stops are decided on the device ([`DeviceDecode`]); the tokens come back once.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{sample_bf16, CudaSlice, CudaStream, Gpu, SampleParams};

use crate::model::{DecodeSlot, GenerateConfig, Rollout, SamplingParams, StopReason};

use super::decode::{DecodeStart, DeviceDecode};
use super::text::{GpuKvArena, GpuPrefixState};
use super::{alloc, upload, GpuError, GpuModel, Result};

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
        sample_bf16(
            gpu, stream, &mut out, logits, &ids, &st, rows, v, v, &p, None,
        )?;
        Ok(out)
    }

    /// Generates one response per entry of `sample_ids` from one prefix state (as the CPU
    /// engine's `generate_group`), with the rollout's device decode loop
    /// ([`DeviceDecode`], its steps launched eagerly: a one-off group is not worth capturing);
    /// the tokens come back once, at the end.
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
        if g == 0 || maxn == 0 {
            let empty = || Rollout {
                tokens: Vec::new(),
                logp: Vec::new(),
                stop: StopReason::MaxLength,
            };
            return Ok((0..g).map(|_| empty()).collect());
        }
        let cap = prefix.len as u64 + g as u64 * maxn as u64;
        let cap = u32::try_from(cap)
            .map_err(|_| GpuError::Input("generate_group: KV arena over 2^32 rows".into()))?;
        let mut arena = GpuKvArena::for_model(self, gpu, stream, cap)?;
        let pspan = arena.store_prefix(stream, 0, prefix)?;
        let slots: Vec<DecodeSlot> = (0..g)
            .map(|i| DecodeSlot::new(pspan, prefix.rope_delta, prefix.len + i as u32 * maxn, maxn))
            .collect();
        let lp_temp = if cfg.sampling.temperature > 0.0 {
            cfg.sampling.temperature
        } else {
            1.0
        };
        let mut dd =
            DeviceDecode::new(self, gpu, stream, g, g, maxn as usize, prefix.len as usize)?;
        dd.set_eager(true);
        for i in 0..g {
            // step 0: every sample draws from the prefix's last logits
            stream.memcpy_dtod(&*prefix.last_logits, &mut dd.first_logits_mut(i))?;
        }
        let start = DecodeStart {
            slots: &slots,
            keys: Some(sample_ids),
            group: g,
            max_new: maxn,
            stop_ids: &cfg.stop_ids,
            forced: None,
            sampling: sample_params(&cfg.sampling, cfg.seed, cfg.iteration),
            logprob_temperature: lp_temp,
        };
        dd.start(self, gpu, stream, &arena, &start, cfg.seed, cfg.iteration)?;
        for step in 0..maxn {
            if dd.step(self, gpu, stream, &mut arena, step)?.is_none() {
                break;
            }
        }
        let out = dd.collect(stream)?;
        let m = maxn as usize;
        Ok((0..g)
            .map(|i| {
                let n = out.done_step[i].min(maxn - 1) as usize + 1;
                let tokens = out.tokens[i * m..i * m + n].to_vec();
                let stop = if tokens.last().is_some_and(|t| cfg.stop_ids.contains(t)) {
                    StopReason::StopToken
                } else {
                    StopReason::MaxLength
                };
                Rollout {
                    tokens,
                    logp: out.logprobs[i * m..i * m + n].to_vec(),
                    stop,
                }
            })
            .collect())
    }
}
