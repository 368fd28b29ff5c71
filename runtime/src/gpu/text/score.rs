//! Scoring: log-probs and entropies of given responses from a kept prefix, left on the device
//! ([`DeviceScores`]) until the host needs them.

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use half::bf16;
use rollplex_kernels::cpu::AttnSeq;
use rollplex_kernels::cuda::{logprobs_fwd_bf16, AttnSeqGpu, CudaSlice, CudaStream, Gpu};

use crate::model::TokenScores;

use super::super::block::run_blocks;
use super::super::plan::{check_ids, flat_rope_tables};
use super::super::staging::staged_bytes;
use super::super::{alloc, download, GpuModel, Result};
use super::attn::PackedAttn;
use super::{GpuPrefixState, LM_CHUNK};

impl GpuModel {
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
