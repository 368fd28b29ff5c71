//! Throughput of the CUDA training step (`GpuTrainer`) at 3B-class dims: one GRPO micro-batch's
//! forward + loss + backward, the optimizer step, and the parts that explain them, timed with
//! CUDA events after warm-up (`tests/reference/bench_train.py` times PyTorch eager and
//! `torch.compile` on the same dims and step, and the ceilings, in the same run).
//!
//! Model: Qwen2.5-VL-3B's text widths (hidden 2048, 16 heads / 2 kv heads of 128, FFN 11008,
//! vocab 151936, tied lm head) with `--layers` layers and random weights; the vision tower (one
//! block) is frozen and unused (text-only prompts). Micro-batch: `--seqs` sequences of
//! `--seq-len` rows in groups of `--group`: each group one prompt of `--prompt-len` tokens, each
//! response `seq_len - prompt_len + 1` tokens (its last token is scored, never fed), so every
//! packed sequence is `seq_len` rows and `seq_len - prompt_len + 1` rows go through the lm head.
//! Loss: GRPO clipped surrogate (clip 0.2 / 0.28, dual clip 3, no KL), token mean; old
//! log-probs are the model's own plus noise (ratios near 1: every token carries a gradient).
//!
//! FLOPs (model FLOPs, as `bench_train.py`; recomputation not counted):
//!
//! ```text
//! 6 * (layer weight params) * tokens * layers + 6 * vocab * hidden * head_rows
//!   + 12 * heads * head_dim * causal_pairs * layers      (attention: 4 forward + 8 backward)
//! ```
//!
//! MFU = those FLOPs / time / the GEMM rate measured by `bench_train.py` in the same call. The
//! trainer runs each group's prompt once (not once per response, as PyTorch's step does): the
//! bench also prints the rate over the FLOPs of that decomposition (prompt once per group,
//! suffixes attending to it).
//! With no layer's activations kept (`kept_layers = 0`) the trainer also recomputes each layer's forward in backward and the
//! lm head's logits ("hardware FLOPs" adds `2 * layer params * tokens + 4 * heads * hd * pairs`
//! per layer and `2 * vocab * hidden * head_rows`); the bench then times the same step with
//! every layer's kept (the suffix activations and logits kept, as PyTorch's step keeps them; the
//! prompt rows are still recomputed from their kept inputs) beside it.
//!
//! Parts: one layer's GEMMs and attention and the lm head's GEMMs, timed alone at the shape the
//! step runs them (the trainer's own `train_pack` layout): each group's prompt once, its
//! `--prompt-len` rows one causal sequence (a call per group: one prompt's call timed, counted
//! once per group), then the responses' suffix rows packed in one call, each attending to its
//! group's prompt rows as a prefix (the backward adding the prefix keys' gradients into fp32
//! buffers of the prompt rows); their FLOPs are the decomposition's. "parts, the step" adds
//! them up as the step runs them, "the rest" is what they leave of the measured step.
//!
//! Optimizer: `optimizer_step` (grad norm with its download, clip, AdamW per tensor writing the
//! bf16 copy, gradient zeroing), and `adamw_step_f32` alone over one flat buffer of the same
//! parameter count; bytes counted for AdamW: fp32 master, m, v read + written, fp32 grad read,
//! bf16 copy written = 30 B a parameter.
//!
//! With `--step-only` it runs nothing but the micro-batch with every layer's activations kept
//! (as the 3B plans keep them): once for the old log-probs, once as warm-up, once timed, so
//! that a per-kernel profile of the process starts with three equal micro-batches. Then, as the
//! RL loop trains: the groups' prompt forwards kept once, and `--iters` micro-batches over them
//! run to completion one at a time (`micro_batch_prefixed`) against queued back to back
//! (`queue_micro_batch_prefixed`, results taken at the end), twice each, wall time a micro-batch.
//!
//! Usage: gpu_train_bench [--layers 4] [--seqs 8] [--seq-len 1024] [--prompt-len 512]
//!                        [--group 4] [--iters 10] [--step-only]

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use rollplex_kernels::cpu::{AttnDims, AttnMask, AttnSeq, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::{
    adamw_step_f32, attention_bwd_bf16, attention_fwd_bf16, bf16, kernel_times_table, matmul_bf16,
    AdamWScalars, AttnSeqGpu, BwdGrads, BwdInputs, CudaStream, FwdInputs, Gpu,
};
use rollplex_plan::spec::{AdamWSpec, KlEstimator, LossAgg, LrSchedule};
use rollplex_runtime::gpu::train::{
    GpuGroupBatch, GpuTrainer, PrefixedGroup, PromptMedia, TrainPrefixes,
};
use rollplex_runtime::gpu::train_pack::{layout_prefixes, PackGroup, SuffixPack};
use rollplex_runtime::model::Qwen25VL;
use rollplex_runtime::train::{LossConfig, Normaliser, ResponseBatch, TrainConfig};

#[path = "common/widths.rs"]
mod widths;

fn arg(args: &[String], name: &str, default: usize) -> Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow!("{name} needs a value"))?
            .parse()
            .with_context(|| name.to_string()),
        None => Ok(default),
    }
}

/// Median milliseconds of `iters` timed calls of `f` (after `warmup` calls), each started on an
/// idle device and waited for (CUDA events around the call: host work inside it counts), and
/// the median host milliseconds inside the call.
fn time_calls(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..warmup {
        f()?;
    }
    s.synchronize()?;
    let mut ts = Vec::with_capacity(iters);
    let mut hs = Vec::with_capacity(iters);
    for _ in 0..iters {
        let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
        a.record(s)?;
        let h0 = std::time::Instant::now();
        f()?;
        hs.push(h0.elapsed().as_secs_f64() * 1e3);
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    ts.sort_by(|x, y| x.total_cmp(y));
    hs.sort_by(|x, y| x.total_cmp(y));
    Ok((ts[ts.len() / 2], hs[hs.len() / 2]))
}

fn hash_unit(i: u64, seed: u64) -> f32 {
    ((i + seed * 7919).wrapping_mul(2654435761) % 2000) as f32 / 1000.0 - 1.0
}

/// A device buffer of `n` values of `scale * hash_unit` (never zeros: see METHOD.md).
fn random_bf16(s: &Arc<CudaStream>, n: usize, seed: u64, scale: f32) -> Result<CudaSlice<bf16>> {
    let v: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(scale * hash_unit(i as u64, seed)))
        .collect();
    Ok(s.clone_htod(&v)?)
}

/// A device f32 buffer of `n` values `offset + scale * hash_unit`, filled from a repeated
/// 16M-value host pattern.
fn random_f32(
    s: &Arc<CudaStream>,
    n: usize,
    seed: u64,
    offset: f32,
    scale: f32,
) -> Result<CudaSlice<f32>> {
    const CHUNK: usize = 1 << 24;
    let pat: Vec<f32> = (0..CHUNK.min(n))
        .map(|i| offset + scale * hash_unit(i as u64, seed))
        .collect();
    let mut d = s.alloc_zeros::<f32>(n)?;
    let mut at = 0;
    while at < n {
        let k = CHUNK.min(n - at);
        s.memcpy_htod(&pat[..k], &mut d.slice_mut(at..at + k))?;
        at += k;
    }
    Ok(d)
}

/// Owned inputs of one micro-batch: groups of responses with their loss inputs.
struct Batch {
    prompts: Vec<Vec<u32>>,
    tokens: Vec<Vec<u32>>,
    old: Vec<Vec<f32>>,
    adv: Vec<Vec<f32>>,
    mask: Vec<Vec<bool>>,
    group: usize,
}

impl Batch {
    fn responses(&self, g: usize) -> Vec<ResponseBatch<'_>> {
        (g * self.group..(g + 1) * self.group)
            .map(|r| ResponseBatch {
                tokens: &self.tokens[r],
                old_logp: Some(&self.old[r]),
                ref_logp: None,
                advantages: &self.adv[r],
                mask: &self.mask[r],
            })
            .collect()
    }
    fn norm(&self) -> Result<Normaliser> {
        let mut n = Normaliser::default();
        for m in &self.mask {
            n = n.merge(Normaliser::of(&[0, m.len()], m)?);
        }
        Ok(n)
    }
}

/// Milliseconds of the GEMMs of one linear's forward + backward (`y = x W^T`, `dx = dy W`,
/// `dW = dy^T x`) over `rows` rows: the three products the trainer runs (bias sums aside).
fn linear_gemms_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    rows: usize,
    inp: usize,
    out: usize,
    iters: usize,
) -> Result<f64> {
    let x = random_bf16(s, rows * inp, 1, 1.0)?;
    let w = random_bf16(s, out * inp, 2, 0.02)?;
    let dy = random_bf16(s, rows * out, 3, 1e-3)?;
    let mut y = s.alloc_zeros::<bf16>(rows * out)?;
    let mut dx = s.alloc_zeros::<bf16>(rows * inp)?;
    let mut dw = s.alloc_zeros::<bf16>(out * inp)?;
    Ok(time_calls(gpu, s, 2, iters, || {
        matmul_bf16(gpu, s, &mut y, &x, &w, Gemm::nt(rows, inp, out))?;
        matmul_bf16(gpu, s, &mut dx, &dy, &w, Gemm::nn(rows, out, inp))?;
        matmul_bf16(gpu, s, &mut dw, &dy, &x, Gemm::tn(out, rows, inp))?;
        Ok(())
    })?
    .0)
}

/// Milliseconds of one layer's attention forward (with LSE) and backward over `seqs`, called as
/// the trainer calls them: with `prefix_rows > 0` the sequences' prefix spans index a K/V buffer
/// of that many rows of its own (the kept prompt rows) and the backward adds the prefix keys'
/// gradients into fp32 buffers of as many rows; with 0 no sequence has a prefix (the rows' own
/// K/V stand in for it, one-row fp32 buffers for its gradients).
fn attention_ms(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    seqs: &[AttnSeq],
    prefix_rows: usize,
    d: AttnDims,
    iters: usize,
) -> Result<(f64, f64)> {
    let rows: usize = seqs.iter().map(|q| q.len as usize).sum();
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let q = random_bf16(s, rows * qw, 4, 1.0)?;
    let k = random_bf16(s, rows * kvw, 5, 1.0)?;
    let v = random_bf16(s, rows * kvw, 6, 1.0)?;
    let pre = if prefix_rows > 0 {
        Some((
            random_bf16(s, prefix_rows * kvw, 8, 1.0)?,
            random_bf16(s, prefix_rows * kvw, 9, 1.0)?,
        ))
    } else {
        None
    };
    let (pk, pv) = match &pre {
        Some((pk, pv)) => (pk, pv),
        None => (&k, &v),
    };
    let dout = random_bf16(s, rows * qw, 7, 1e-2)?;
    let mut out = s.alloc_zeros::<bf16>(rows * qw)?;
    let mut lse = s.alloc_zeros::<f32>(rows * d.num_heads)?;
    let mut dq = s.alloc_zeros::<bf16>(rows * qw)?;
    let mut dk = s.alloc_zeros::<bf16>(rows * kvw)?;
    let mut dv = s.alloc_zeros::<bf16>(rows * kvw)?;
    let mut dpk = s.alloc_zeros::<f32>(prefix_rows.max(1) * kvw)?;
    let mut dpv = s.alloc_zeros::<f32>(prefix_rows.max(1) * kvw)?;
    let g: Vec<AttnSeqGpu> = seqs.iter().map(AttnSeqGpu::from_fwd).collect();
    let sd = s.clone_htod(&g)?;
    let maxq = seqs.iter().map(|q| q.len as usize).max().unwrap_or(0);
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let st = RowStrides::contiguous(d);
    let fwd = time_calls(gpu, s, 2, iters, || {
        attention_fwd_bf16(
            gpu,
            s,
            &mut out,
            Some(&mut lse as &mut dyn DevicePtrMut<f32>),
            FwdInputs {
                q: &q,
                k: &k,
                v: &v,
                prefix_k: pk,
                prefix_v: pv,
                seqs: &sd,
                n_seqs: g.len(),
                max_q_len: maxq,
                dims: d,
                mask: AttnMask::Causal,
                scale,
                strides: st,
            },
        )?;
        Ok(())
    })?
    .0;
    let bwd = time_calls(gpu, s, 1, iters.min(5), || {
        attention_bwd_bf16(
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
                dout: &dout,
                q: &q,
                k: &k,
                v: &v,
                prefix_k: pk,
                prefix_v: pv,
                out: &out,
                lse: &lse,
                seqs: &sd,
                n_seqs: g.len(),
                dims: d,
                mask: AttnMask::Causal,
                scale,
                strides: st,
            },
        )?;
        Ok(())
    })?
    .0;
    Ok((fwd, bwd))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let layers = arg(&args, "--layers", 4)?;
    let seqs = arg(&args, "--seqs", 8)?;
    let seq_len = arg(&args, "--seq-len", 1024)?;
    let plen = arg(&args, "--prompt-len", 512)?;
    let group = arg(&args, "--group", 4)?;
    let iters = arg(&args, "--iters", 10)?.max(1);
    let step_only = args.iter().any(|a| a == "--step-only");
    if group == 0 || !seqs.is_multiple_of(group) {
        bail!("--seqs {seqs} must be a multiple of --group {group}");
    }
    if plen == 0 || plen >= seq_len {
        bail!("--prompt-len {plen} must be in 1..{seq_len} (--seq-len)");
    }
    let rlen = seq_len - plen + 1;
    let gpu = Gpu::new(0).context("gpu_train_bench needs a CUDA device")?;
    let s = gpu.stream(0)?;
    let t0 = std::time::Instant::now();
    let model = Qwen25VL::random(widths::qwen3b_widths(layers as u32, 1), 7)?;
    let cfg = TrainConfig {
        loss: LossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: Some(3.0),
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            agg: LossAgg::TokenMean,
            ratio: rollplex_plan::spec::RatioLevel::Token,
            horizon: 0,
        },
        kept_layers: if step_only { usize::MAX } else { 0 },
        kept_prompt_layers: if step_only { usize::MAX } else { 0 },
        freeze_vision: true,
        freeze_merger: true,
        temperature: 1.0,
    };
    let adamw = AdamWSpec {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: 1.0,
        lr_schedule: LrSchedule::Constant,
    };
    let mut tr = GpuTrainer::new(&gpu, &s, &model, cfg.clone(), adamw.clone())?;
    s.synchronize()?;
    // trained parameters: the text decoder (tied head = the embedding)
    let lay = &model.weights.layout;
    let tb = &model.weights.table;
    let len = |id| tb.entry(id).len;
    let mut n_params = len(lay.embed) + len(lay.final_norm);
    if lay.lm_head != lay.embed {
        n_params += len(lay.lm_head);
    }
    for p in &lay.text_layers {
        n_params += len(p.norm1) + len(p.norm2);
        for l in [&p.q, &p.k, &p.v, &p.o, &p.gate, &p.up, &p.down] {
            n_params += len(l.w) + l.b.map(len).unwrap_or(0);
        }
    }
    println!(
        "device {}; {layers} layers, {n_params} trained parameters; model built and trainer set up in {:.1} s",
        gpu.name(),
        t0.elapsed().as_secs_f64()
    );
    let t = model.config.text();
    let (h, ffn, nq, nkv, hd, vocab) = (
        t.hidden_size as usize,
        t.intermediate_size as usize,
        t.num_heads as usize,
        t.num_kv_heads as usize,
        t.head_dim() as usize,
        t.vocab_size as usize,
    );
    // ---- the micro-batch
    let groups = seqs / group;
    let mut b = Batch {
        prompts: (0..groups)
            .map(|g| {
                (0..plen)
                    .map(|i| ((i * 7919 + g * 104729) % 150000) as u32)
                    .collect()
            })
            .collect(),
        tokens: (0..seqs)
            .map(|r| {
                (0..rlen)
                    .map(|j| ((j * 31337 + r * 65537 + 11) % 150000) as u32)
                    .collect()
            })
            .collect(),
        old: vec![vec![0f32; rlen]; seqs],
        adv: (0..seqs)
            .map(|r| vec![hash_unit(r as u64, 3); rlen])
            .collect(),
        mask: (0..seqs)
            .map(|r| (0..rlen).map(|j| (j + r) % 5 != 3).collect())
            .collect(),
        group,
    };
    let norm = b.norm()?;
    // old log-probs = the model's own + noise in [-0.05, 0.05]
    {
        let resp: Vec<Vec<ResponseBatch<'_>>> = (0..groups).map(|g| b.responses(g)).collect();
        let gb: Vec<GpuGroupBatch<'_>> = (0..groups)
            .map(|g| GpuGroupBatch {
                prompt_ids: &b.prompts[g],
                media: PromptMedia::Encoded(&[]),
                responses: &resp[g],
            })
            .collect();
        let out = tr.micro_batch(&gpu, &s, 0, &gb, norm)?;
        tr.discard(&gpu, &s)?;
        let logp = out.logp;
        drop(gb);
        drop(resp);
        for (r, lp) in logp.iter().enumerate() {
            b.old[r] = lp
                .iter()
                .enumerate()
                .map(|(j, &l)| l + 0.05 * hash_unit((r * rlen + j) as u64, 9))
                .collect();
        }
    }
    let resp: Vec<Vec<ResponseBatch<'_>>> = (0..groups).map(|g| b.responses(g)).collect();
    let gb: Vec<GpuGroupBatch<'_>> = (0..groups)
        .map(|g| GpuGroupBatch {
            prompt_ids: &b.prompts[g],
            media: PromptMedia::Encoded(&[]),
            responses: &resp[g],
        })
        .collect();
    // ---- FLOPs
    let tokens = (seqs * seq_len) as f64;
    let head_rows = (seqs * rlen) as f64;
    let layer_w = (h * (nq + 2 * nkv) * hd + nq * hd * h + h * 2 * ffn + ffn * h) as f64;
    let pairs = seqs as f64 * seq_len as f64 * (seq_len as f64 + 1.0) / 2.0;
    let attn_unit = nq as f64 * hd as f64 * pairs; // 1 = one multiply-add pass over the pairs
    let lay_f = layers as f64;
    let model_flops = 6.0 * layer_w * tokens * lay_f
        + 6.0 * (vocab * h) as f64 * head_rows
        + 12.0 * attn_unit * lay_f;
    let hw_flops = model_flops
        + 2.0 * layer_w * tokens * lay_f
        + 4.0 * attn_unit * lay_f
        + 2.0 * (vocab * h) as f64 * head_rows;
    // the work the trainer actually does: each group's prompt once, every response's suffix
    // (its rlen - 1 fed tokens) attending to the prompt and causally to itself
    let (prows, srows) = (groups * plen, seqs * (rlen - 1));
    let (pf, sf) = (plen as f64, (rlen - 1) as f64);
    let shared_tokens = (prows + srows) as f64;
    let shared_pairs =
        groups as f64 * pf * (pf + 1.0) / 2.0 + seqs as f64 * (sf * pf + sf * (sf + 1.0) / 2.0);
    let shared_unit = nq as f64 * hd as f64 * shared_pairs;
    let shared_flops = 6.0 * layer_w * shared_tokens * lay_f
        + 6.0 * (vocab * h) as f64 * head_rows
        + 12.0 * shared_unit * lay_f;
    // the trainer's own layout of the micro-batch (`micro_batch`: one prompt copy per group):
    // the parts run its suffix rows and their attention descriptors
    let lens: Vec<(usize, u32)> = b.prompts.iter().map(|p| (p.len(), 1)).collect();
    let (lays, store_rows, _) = layout_prefixes(&lens)?;
    let packs: Vec<PackGroup<'_>> = lays
        .iter()
        .enumerate()
        .map(|(g, &layout)| PackGroup {
            layout,
            rope_delta: 0,
            responses: b.tokens[g * group..(g + 1) * group]
                .iter()
                .map(Vec::as_slice)
                .collect(),
        })
        .collect();
    let pack = SuffixPack::new(&model.config, &packs)?;
    drop(packs);
    if store_rows != prows || pack.rows() != srows || pack.head_rows.len() != seqs * rlen {
        bail!(
            "the trainer lays the micro-batch out as {store_rows} prompt rows, {} suffix rows and {} lm-head rows; the FLOPs count {prows}, {srows} and {}",
            pack.rows(),
            pack.head_rows.len(),
            seqs * rlen
        );
    }
    println!(
        "micro-batch: {seqs} sequences x {seq_len} rows ({groups} groups of {group}, prompt {plen}, response {rlen} tokens), {head_rows} lm-head rows; {:.3} TFLOP model FLOPs of the full sequences (what PyTorch computes), {:.3} TFLOP with the recomputation; {:.3} TFLOP model FLOPs with one prompt per group (what we compute)",
        model_flops / 1e12,
        hw_flops / 1e12,
        shared_flops / 1e12
    );
    if step_only {
        let mut idx = 0u32;
        let (ms, _) = time_calls(&gpu, &s, 1, 1, || {
            tr.micro_batch(&gpu, &s, idx, &gb, norm)?;
            idx += 1;
            Ok(())
        })?;
        println!(
            "step only, activations kept: {ms:.3} ms, {:.1} TFLOP/s of the FLOPs it computes",
            shared_flops / ms / 1e9
        );
        // the RL loop's path: each group's prompt forward kept once, then micro-batches over
        // them, run to completion one at a time against queued back to back (the host preparing
        // the next while the device runs this one); wall time a micro-batch
        let mut store = TrainPrefixes::new(&gpu, &s, tr.model(), &lens)?;
        for (g, p) in b.prompts.iter().enumerate() {
            tr.prefix_forward(&gpu, &s, &mut store, g, p, PromptMedia::Encoded(&[]))?;
        }
        let kept: Vec<PrefixedGroup<'_>> = (0..groups)
            .map(|g| PrefixedGroup {
                group: g,
                responses: &resp[g],
            })
            .collect();
        let n = iters.max(2);
        let mut per = |queued: bool| -> Result<f64> {
            tr.discard(&gpu, &s)?;
            s.synchronize()?;
            let t0 = std::time::Instant::now();
            for i in 0..n as u32 {
                if queued {
                    tr.queue_micro_batch_prefixed(&gpu, &s, i, &kept, norm, &store)?;
                } else {
                    tr.micro_batch_prefixed(&gpu, &s, i, &kept, norm, &store)?;
                }
            }
            tr.finish_queued()?;
            s.synchronize()?;
            Ok(t0.elapsed().as_secs_f64() * 1e3 / n as f64)
        };
        per(false)?;
        per(true)?;
        // ROLLPLEX_KERNEL_TIMES=1: the warm micro-batches below, kernel by kernel
        gpu.take_kernel_times()?;
        let (w1, q1, w2, q2) = (per(false)?, per(true)?, per(false)?, per(true)?);
        if gpu.kernel_times() {
            println!("kernel times (ROLLPLEX_KERNEL_TIMES=1), per micro-batch over kept prompts:");
            let times = gpu.take_kernel_times()?;
            print!("{}", kernel_times_table(&times, 4 * n as u32, 0.002));
        }
        println!(
            "micro-batches over kept prompts, {n} a run, wall time each: one at a time {w1:.3} / {w2:.3} ms, queued back to back {q1:.3} / {q2:.3} ms ({:.3}x)",
            (w1 + w2) / (q1 + q2)
        );
        return Ok(());
    }
    // ---- forward + loss + backward
    let mut idx = 0u32;
    let mut last_loss = 0.0;
    let (ms, host_ms) = time_calls(&gpu, &s, 2, iters, || {
        let out = tr.micro_batch(&gpu, &s, idx, &gb, norm)?;
        last_loss = out.metrics.loss;
        idx += 1;
        Ok(())
    })?;
    println!(
        "ours fwd+bwd (micro_batch, one prompt per group): {ms:.3} ms, {:.1} TFLOP/s of the full sequences' model FLOPs ({:.1} TFLOP/s with the recomputation), {:.1} TFLOP/s of the FLOPs it computes; host {host_ms:.3} ms inside the call; loss {last_loss:.6}",
        model_flops / ms / 1e9,
        hw_flops / ms / 1e9,
        shared_flops / ms / 1e9
    );
    // ---- the same with every layer's activations kept (no recomputed layer forward,
    // no recomputed logits; bitwise the same gradient), as PyTorch's step keeps them
    {
        let keep_cfg = TrainConfig {
            kept_layers: usize::MAX,
            kept_prompt_layers: usize::MAX,
            ..cfg.clone()
        };
        let mut tk = GpuTrainer::new(&gpu, &s, &model, keep_cfg, adamw.clone())?;
        let mut kidx = 0u32;
        let (kms, khost) = time_calls(&gpu, &s, 2, iters, || {
            tk.micro_batch(&gpu, &s, kidx, &gb, norm)?;
            kidx += 1;
            Ok(())
        })?;
        println!(
            "ours fwd+bwd, activations kept (recompute none): {kms:.3} ms ({:.3}x the recomputing step), {:.1} TFLOP/s of the full sequences' model FLOPs, {:.1} TFLOP/s of the FLOPs it computes; host {khost:.3} ms inside the call",
            ms / kms,
            model_flops / kms / 1e9,
            shared_flops / kms / 1e9
        );
    }
    // ---- optimizer step (a micro-batch before each, untimed)
    let mut opt = Vec::with_capacity(iters);
    for it in 0..iters + 2 {
        tr.discard(&gpu, &s)?;
        tr.micro_batch(&gpu, &s, 0, &gb, norm)?;
        s.synchronize()?;
        let (a, e) = (gpu.timing_event()?, gpu.timing_event()?);
        a.record(&s)?;
        let report = tr.optimizer_step(&gpu, &s)?;
        e.record(&s)?;
        e.synchronize()?;
        if it == 0 {
            // every gradient of the step in one number: two builds whose kernels claim the
            // same bits must print the same bits here
            let g = report.step.grad_norm;
            println!(
                "grad norm of micro-batch 0 (the untrained weights): {g:.17e} (bits {:016x})",
                g.to_bits()
            );
        }
        if it >= 2 {
            opt.push(a.elapsed_ms(&e)? as f64);
        }
    }
    opt.sort_by(|x, y| x.total_cmp(y));
    let opt_ms = opt[opt.len() / 2];
    let adam_bytes = 30.0 * n_params as f64;
    let step_bytes = adam_bytes + 4.0 * n_params as f64 * 2.0; // + norm read, zeroing write
    println!(
        "ours optimizer_step ({} tensors' AdamW + grad norm + clip + zeroing): {opt_ms:.3} ms; {:.1} GB/s counting AdamW's {:.2} GB (30 B/param), {:.1} GB/s counting {:.2} GB with the norm read and the zeroing",
        tr.tensor_names().len(),
        adam_bytes / opt_ms / 1e6,
        adam_bytes / 1e9,
        step_bytes / opt_ms / 1e6,
        step_bytes / 1e9
    );
    drop(gb);
    drop(resp);
    drop(tr);
    // ---- AdamW alone over one flat buffer of the same size
    {
        let n = n_params;
        let mut p = random_f32(&s, n, 1, 0.0, 0.02)?;
        let mut m = random_f32(&s, n, 2, 0.0, 1e-4)?;
        let mut v = random_f32(&s, n, 3, 2e-8, 1e-8)?; // second moments are positive
        let g = random_f32(&s, n, 4, 0.0, 1e-3)?;
        let mut out = s.alloc_zeros::<bf16>(n)?;
        let sc = AdamWScalars::new(1e-6, 0.9, 0.999, 1e-8, 0.01, 10);
        let (ams, _) = time_calls(&gpu, &s, 2, iters, || {
            adamw_step_f32(
                &gpu,
                &s,
                &mut p,
                &mut m,
                &mut v,
                Some(&mut out as &mut dyn DevicePtrMut<bf16>),
                &g,
                n,
                true,
                sc,
            )?;
            Ok(())
        })?;
        println!(
            "ours adamw_step_f32 alone, one flat buffer of {n}: {ams:.3} ms, {:.1} GB/s counting {:.2} GB (30 B/param)",
            adam_bytes / ams / 1e6,
            adam_bytes / 1e9
        );
    }
    // ---- parts: the GEMMs of one layer and of the lm head, attention of one layer, at the
    // step's shape: each group's prompt once (a call per group, one causal sequence), then the
    // packed suffix rows in one call, attending to their group's prompt rows as a prefix
    let lin = [
        ("qkv", h, (nq + 2 * nkv) * hd),
        ("o", nq * hd, h),
        ("gate_up", h, 2 * ffn),
        ("down", ffn, h),
    ];
    let mut layer_gemm = 0.0;
    let gf = groups as f64;
    for (_, inp, out) in lin {
        layer_gemm += gf * linear_gemms_ms(&gpu, &s, plen, inp, out, iters)?
            + linear_gemms_ms(&gpu, &s, srows, inp, out, iters)?;
    }
    let head_gemm = linear_gemms_ms(&gpu, &s, pack.head_rows.len(), h, vocab, iters)?;
    let prompt = [AttnSeq {
        start: 0,
        len: plen as u32,
        prefix_start: 0,
        prefix_len: 0,
    }];
    let dims = AttnDims {
        num_heads: nq,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let (pfwd, pbwd) = attention_ms(&gpu, &s, &prompt, 0, dims, iters)?;
    let (sfwd, sbwd) = attention_ms(&gpu, &s, &pack.seqs, pack.hi - pack.lo, dims, iters)?;
    let (afwd, abwd) = (gf * pfwd + sfwd, gf * pbwd + sbwd);
    let gemm_flops_layer = 6.0 * layer_w * shared_tokens;
    let head_flops = 6.0 * (vocab * h) as f64 * head_rows;
    println!(
        "parts, one layer at the step's shape ({} rows: {groups} prompts of {plen} rows once each, a call each, and {srows} response rows in one call attending to their group's prompt as a prefix): GEMMs fwd+bwd {layer_gemm:.3} ms ({:.1} TFLOP/s); attention fwd {afwd:.3} ms ({:.1} TFLOP/s; prompts {:.3} ms), bwd {abwd:.3} ms ({:.1} TFLOP/s; prompts {:.3} ms); lm head GEMMs fwd+bwd {head_gemm:.3} ms ({:.1} TFLOP/s)",
        prows + srows,
        gemm_flops_layer / layer_gemm / 1e9,
        4.0 * shared_unit / afwd / 1e9,
        gf * pfwd,
        8.0 * shared_unit / abwd / 1e9,
        gf * pbwd,
        head_flops / head_gemm / 1e9
    );
    // what the step runs: per layer the GEMMs, one more forward (the suffix rows' and the
    // prompt rows' recompute: a third of the GEMM time), attention forward twice and backward
    // once; the lm head once more forward
    let fwd_gemm = layer_gemm / 3.0;
    let accounted = lay_f * (layer_gemm + fwd_gemm + 2.0 * afwd + abwd) + head_gemm * 4.0 / 3.0;
    println!(
        "parts, the step: {layers} x (GEMMs + recomputed forward GEMMs + 2 attention fwd + attention bwd) + lm head (fwd twice + bwd) = {accounted:.3} ms of {ms:.3} ms; attention bwd alone {:.3} ms ({:.0}%); the rest (norms, rope, swiglu, log-softmax, copies, host loss, launch gaps) {:.3} ms",
        lay_f * abwd,
        100.0 * lay_f * abwd / ms,
        ms - accounted
    );
    Ok(())
}
