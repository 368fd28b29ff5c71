//! Rollout of one GRPO group: G samples decoded from one shared prefix state in a KV arena laid
//! out as `[prefix | suffix 0 | suffix 1 | ...]`, each token drawn with its own Philox key.
//! Samples that stop leave the batch; since every op is batch-composition independent, a
//! sample's tokens do not depend on which others are still running.

use rollplex_kernels::cpu::logprobs_fwd;

use super::sampling::{sample_token, SampleKey, SamplingParams, StopReason};
use super::text::{DecodeSlot, KvArena, PrefixState};
use super::{ModelError, Qwen25VL};

/// How to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    pub sampling: SamplingParams,
    pub max_new_tokens: u32,
    /// Generation stops after any of these (the model's EOS ids plus the rollout's extras).
    pub stop_ids: Vec<u32>,
    pub seed: u64,
    pub iteration: u32,
}

/// One generated response.
#[derive(Clone, Debug, PartialEq)]
pub struct Rollout {
    pub tokens: Vec<u32>,
    /// Log-prob of each token under the temperature-scaled distribution: bitwise the `logp`
    /// that `score` returns for the same tokens at the same temperature (greedy decoding,
    /// temperature 0, reports them at temperature 1).
    pub logp: Vec<f32>,
    pub stop: StopReason,
}

impl Qwen25VL {
    /// Generates one response per entry of `sample_ids` (the global sample indices that key
    /// their random numbers) from one prefix state.
    pub fn generate_group(
        &self,
        prefix: &PrefixState,
        sample_ids: &[u32],
        cfg: &GenerateConfig,
    ) -> Result<Vec<Rollout>, ModelError> {
        let g = sample_ids.len();
        let maxn = cfg.max_new_tokens;
        if g == 0 || maxn == 0 {
            return Ok(sample_ids
                .iter()
                .map(|_| Rollout {
                    tokens: Vec::new(),
                    logp: Vec::new(),
                    stop: StopReason::MaxLength,
                })
                .collect());
        }
        let v = self.config.text().vocab_size as usize;
        let cap = prefix.len as u64 + g as u64 * maxn as u64;
        let cap = u32::try_from(cap)
            .map_err(|_| ModelError::Input("generate_group: KV arena over 2^32 rows".into()))?;
        let mut arena = KvArena::for_model(self, cap);
        let pspan = arena.store_prefix(0, prefix)?;
        let mut slots: Vec<DecodeSlot> = (0..g)
            .map(|i| DecodeSlot::new(pspan, prefix.rope_delta, prefix.len + i as u32 * maxn, maxn))
            .collect();
        let lp_temp = if cfg.sampling.temperature > 0.0 {
            cfg.sampling.temperature
        } else {
            1.0
        };
        let mut out: Vec<Rollout> = (0..g)
            .map(|_| Rollout {
                tokens: Vec::new(),
                logp: Vec::new(),
                stop: StopReason::MaxLength,
            })
            .collect();
        let mut active: Vec<usize> = (0..g).collect();
        let mut logits: Vec<f32> = Vec::new();
        for step in 0..maxn {
            let mut next_active = Vec::with_capacity(active.len());
            let mut feed = Vec::with_capacity(active.len());
            for (ai, &i) in active.iter().enumerate() {
                let row = if step == 0 {
                    &prefix.last_logits[..]
                } else {
                    &logits[ai * v..(ai + 1) * v]
                };
                let key = SampleKey {
                    seed: cfg.seed,
                    iteration: cfg.iteration,
                    sample: sample_ids[i],
                    step,
                };
                let tok = sample_token(row, &cfg.sampling, key)?;
                let mut lp = [0f32];
                logprobs_fwd(&mut lp, None, None, row, &[tok], 1, v, lp_temp)?;
                out[i].tokens.push(tok);
                out[i].logp.push(lp[0]);
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
            logits = vec![0f32; active.len() * v];
            self.decode_step(&mut arena, &mut batch, &feed, &mut logits)?;
            for (s, &i) in batch.iter().zip(&active) {
                slots[i] = *s;
            }
        }
        Ok(out)
    }
}
