//! `policy_loss_f32` and `policy_loss_reduce_f64` (kernels in `cuda/policy_loss.cu`), with
//! `policy_loss_seq_ratio_f64` first under the sequence ratio: the GRPO / PPO-clip / GSPO policy
//! loss of `runtime/src/train/loss.rs` on the device, so that a trainer needs no host round trip
//! per micro-batch. Per token: `dlogp = d loss / d logp` (f32); per call: the loss metrics, added
//! into a device accumulator ([`PolicyLossAcc`]) that is read once (a 112-byte download) when the
//! optimizer step wants them.
//!
//! Definitions (the CPU module's doc has them in full): ratio `ρ = exp(clamp(logp - old, ±20))`,
//! or under [`RatioKind::Sequence`] (GSPO) every token of sequence `s` takes
//! `exp(clamp(m_s, ±20))` with `m_s` the mean of `logp - old` over the sequence's counted tokens
//! (its derivative w.r.t. the token's own `logp` taken as the ratio, GSPO-token); surrogate
//! `max(-A ρ, -A clamp(ρ, 1 - clip_low, 1 + clip_high))`, capped at `-A c` for `A < 0`
//! with dual clip `c`; KL k1 / k2 / k3 (k3 clamped to ±10) against the reference; every term
//! weighted per token by the aggregation over the *mini-batch* normaliser (`norm_tokens` masked
//! tokens, `norm_seqs` sequences): token_mean `1 / N`, seq_mean_token_mean `1 / (n_s S)`,
//! seq_mean_token_sum `1 / S`, with `n_s` the masked tokens of the token's sequence.
//!
//! Numerics: each token runs the CPU's f64 operations in the CPU's order with explicitly rounded
//! intrinsics (no fused multiply-add), the clamps' closed intervals and the half-gradient at
//! exact `max`/`min` ties as torch's autograd has them; the sequence mean `m_s` is summed
//! serially in row order by one thread per sequence, the CPU's order (`cpu::seq_log_ratio`), so
//! it is the CPU's bit for bit and no function of the grid; dlogp is the CPU's f32 bit for bit
//! wherever CUDA's double `exp` rounds as the host's libm does (both are within 1 ulp in f64,
//! so the f32 results differ at most by an ulp, rarely). The metrics are f64 sums in an order
//! fixed by the token count (blocks of [`TOKENS_PER_BLOCK`], a fixed tree in each, then one
//! block over the partials): two runs give the same bits; they differ from the CPU's
//! token-order sums by rounding only (~1e-15 relative).
//!
//! Input checks: lengths, the configuration (the CPU's rules) and the normaliser's sequence count
//! are checked on the host and refused with [`super::CudaError::Shape`]; what only the device sees
//! (a sequence index out of range, per-sequence counts that do not add up to the masked tokens,
//! more masked tokens than the normaliser counts, under the sequence ratio a row span that does
//! not hold exactly its sequence's rows) is counted by the kernels and refused when the
//! accumulator is read ([`PolicyLossAcc::read`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::KernelModule;
use super::{shape, Gpu, Result};

/// The kernel source of this module (compiled by NVRTC on first use, cached).
pub const POLICY_LOSS: KernelModule = KernelModule {
    name: "policy_loss",
    source: include_str!("../../cuda/policy_loss.cu"),
};

const OP: &str = "policy_loss_f32";
const SEQ_OP: &str = "policy_loss_seq_ratio_f64";

/// Threads of the kernels' blocks (`PL_THREADS` in the source).
const THREADS: u32 = 256;
/// Consecutive tokens one block of `policy_loss_f32` sums (`PL_TOKENS_PER_BLOCK`): the
/// metrics' summation order is a function of the token count alone.
pub const TOKENS_PER_BLOCK: usize = 1024;
/// f64 partial sums per block (`PL_PARTS`).
const PARTS: usize = 8;

/// Slots of the accumulator (`acc` in the source).
const ACC_LOSS: usize = 0;
const ACC_PG: usize = 1;
const ACC_KL: usize = 2;
const ACC_CLIP: usize = 3;
const ACC_CLIP_LOWER: usize = 4;
const ACC_APPROX_KL: usize = 5;
const ACC_ENTROPY: usize = 6;
const ACC_ENTROPY_CALLS: usize = 7;
const ACC_TOKENS: usize = 8;
const ACC_CALLS: usize = 9;
const ACC_NORM_SHORT: usize = 10;
const ACC_COUNT_MISMATCH: usize = 11;
const ACC_BAD_SEQ: usize = 12;
const ACC_BAD_SPAN: usize = 13;
/// f64 slots of [`PolicyLossAcc`] (`PL_ACC`).
pub const ACC_SLOTS: usize = 14;

/// The KL estimator (veRL's names: k1 `kl`, k2 `mse`, k3 `low_var_kl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlKind {
    K1,
    K2,
    K3,
}

/// Whose importance ratio a token takes (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RatioKind {
    /// Its own (PPO, GRPO, DAPO).
    Token,
    /// Its sequence's (GSPO); needs [`PolicyLossInputs::seq_spans`].
    Sequence,
}

/// How per-token terms aggregate (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossAggKind {
    TokenMean,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
}

/// The loss configuration and the mini-batch normaliser of one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyLossParams {
    /// In `[0, 1)`: the ratio's lower bound is `1 - clip_low`.
    pub clip_low: f64,
    /// Finite, `>= 0`: the upper bound is `1 + clip_high`.
    pub clip_high: f64,
    /// The dual-clip constant `c` (finite, `> 1`), or `None`.
    pub dual_clip: Option<f64>,
    /// Finite, `>= 0`; `> 0` needs reference log-probs.
    pub kl_coef: f64,
    pub kl: KlKind,
    pub agg: LossAggKind,
    pub ratio: RatioKind,
    /// Masked response tokens of the whole mini-batch (one optimizer step).
    pub norm_tokens: usize,
    /// Sequences of the whole mini-batch.
    pub norm_seqs: usize,
}

impl PolicyLossParams {
    /// The CPU loss's rules (`LossConfig::validate`), with the same messages.
    pub fn validate(&self) -> Result<()> {
        if !(self.clip_low >= 0.0 && self.clip_low < 1.0) {
            return Err(shape(
                OP,
                format!(
                    "clip_low = {} must lie in [0, 1) (the ratio's lower bound is 1 - clip_low)",
                    self.clip_low
                ),
            ));
        }
        if !(self.clip_high >= 0.0 && self.clip_high.is_finite()) {
            return Err(shape(
                OP,
                format!("clip_high = {} must be finite and >= 0", self.clip_high),
            ));
        }
        if let Some(c) = self.dual_clip {
            if !(c > 1.0 && c.is_finite()) {
                return Err(shape(
                    OP,
                    format!("dual clip constant {c} must be finite and > 1"),
                ));
            }
        }
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(shape(
                OP,
                format!("kl_coef = {} must be finite and >= 0", self.kl_coef),
            ));
        }
        Ok(())
    }
}

/// The device inputs of one call (a micro-batch, any number of GRPO groups). Token `t` of every
/// per-token buffer belongs to sequence `seq[t]` (`< seqs`); the tokens of a sequence need not
/// be contiguous or ordered. Buffers may be longer than asked for; only the first `tokens`
/// (per token) or `seqs` (per sequence) elements are read.
#[derive(Clone, Copy)]
pub struct PolicyLossInputs<'a> {
    /// Tokens of this call.
    pub tokens: usize,
    /// Log-probs of the current policy (what the gradient is taken with respect to).
    pub logp: &'a dyn DevicePtr<f32>,
    /// Log-probs of the policy that sampled the responses.
    pub old_logp: &'a dyn DevicePtr<f32>,
    /// Log-probs of the reference model; required when `kl_coef > 0`; without it the KL term
    /// and metric are 0.
    pub ref_logp: Option<&'a dyn DevicePtr<f32>>,
    /// Per-token advantages.
    pub advantages: &'a dyn DevicePtr<f32>,
    /// Response mask: nonzero where the token counts.
    pub mask: &'a dyn DevicePtr<u8>,
    /// Per-token entropy of the current policy, only reported.
    pub entropy: Option<&'a dyn DevicePtr<f32>>,
    /// The sequence index of each token.
    pub seq: &'a dyn DevicePtr<u32>,
    /// Sequences of this call.
    pub seqs: usize,
    /// Per sequence: its masked (counted) tokens `n_s`. The kernels check that they add up to
    /// the call's masked tokens.
    pub seq_tokens: &'a dyn DevicePtr<u32>,
    /// Per sequence `s`: the rows it owns, `spans[2 s] .. spans[2 s + 1]`, its tokens in order
    /// (under the sequence ratio they must lie contiguously). Required with
    /// [`RatioKind::Sequence`], not read otherwise; the sequence pass checks that each span holds
    /// only rows of its sequence and `n_s` counted ones.
    pub seq_spans: Option<&'a dyn DevicePtr<u32>>,
}

/// The metrics summed over the calls since the accumulator was made or reset, as the CPU's
/// `LossMetrics` (summed with `LossMetrics::add`) has them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyLossSums {
    /// `pg_loss + kl_coef * kl`, formed per call.
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    pub clip_frac: f64,
    pub clip_frac_lower: f64,
    pub approx_kl: f64,
    /// Present when at least one call carried entropies.
    pub entropy: Option<f64>,
    /// Masked tokens over all calls.
    pub tokens: u64,
    /// Calls summed.
    pub calls: u64,
}

impl PolicyLossSums {
    /// Decodes the accumulator's slots; refuses what the kernels counted as inconsistent.
    pub fn from_slots(a: &[f64]) -> Result<Self> {
        if a.len() != ACC_SLOTS {
            return Err(shape(
                OP,
                format!(
                    "the accumulator holds {} slots, expected {ACC_SLOTS}",
                    a.len()
                ),
            ));
        }
        if a[ACC_BAD_SEQ] > 0.0 {
            return Err(shape(
                OP,
                format!(
                    "{} tokens named a sequence index not below their call's sequence count \
                     (their dlogp is NaN)",
                    a[ACC_BAD_SEQ]
                ),
            ));
        }
        if a[ACC_BAD_SPAN] > 0.0 {
            return Err(shape(
                OP,
                format!(
                    "{} sequences' row spans (seq_spans) did not match their rows: a span must \
                     lie within the call's tokens and hold only its sequence's rows, n_s of them \
                     counted (those sequences' counted tokens have NaN dlogp)",
                    a[ACC_BAD_SPAN]
                ),
            ));
        }
        if a[ACC_COUNT_MISMATCH] > 0.0 {
            return Err(shape(
                OP,
                format!(
                    "in {} calls the per-sequence counts (seq_tokens) did not add up to the \
                     masked tokens: n_s must be each sequence's masked token count",
                    a[ACC_COUNT_MISMATCH]
                ),
            ));
        }
        if a[ACC_NORM_SHORT] > 0.0 {
            return Err(shape(
                OP,
                format!(
                    "in {} calls the mini-batch normaliser counted fewer tokens than the call \
                     masked; it must count the whole mini-batch",
                    a[ACC_NORM_SHORT]
                ),
            ));
        }
        Ok(PolicyLossSums {
            loss: a[ACC_LOSS],
            pg_loss: a[ACC_PG],
            kl: a[ACC_KL],
            clip_frac: a[ACC_CLIP],
            clip_frac_lower: a[ACC_CLIP_LOWER],
            approx_kl: a[ACC_APPROX_KL],
            entropy: (a[ACC_ENTROPY_CALLS] > 0.0).then_some(a[ACC_ENTROPY]),
            tokens: a[ACC_TOKENS] as u64,
            calls: a[ACC_CALLS] as u64,
        })
    }
}

/// The device accumulator of the loss metrics: [`ACC_SLOTS`] f64, zero when made, added into by
/// every [`policy_loss_f32`] call in stream order (one accumulator per optimizer step; calls on
/// several streams must be ordered by the caller's events).
pub struct PolicyLossAcc {
    slots: CudaSlice<f64>,
}

impl PolicyLossAcc {
    /// A zeroed accumulator on `stream`.
    pub fn new(gpu: &Gpu, stream: &Arc<CudaStream>) -> Result<Self> {
        let mut slots = gpu.alloc::<f64>(stream, ACC_SLOTS)?;
        stream.memset_zeros(&mut slots)?;
        Ok(PolicyLossAcc { slots })
    }

    /// Zeroes the accumulator on `stream` (the next optimizer step's metrics start here).
    pub fn reset(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memset_zeros(&mut self.slots)?;
        Ok(())
    }

    /// The raw slots (for a caller that downloads them itself, then
    /// [`PolicyLossSums::from_slots`]).
    pub fn slots(&self) -> &CudaSlice<f64> {
        &self.slots
    }

    /// Downloads the sums (synchronises `stream`); refuses a call the kernels found
    /// inconsistent (see the module doc).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<PolicyLossSums> {
        let v = stream.clone_dtoh(&self.slots)?;
        stream.synchronize()?;
        PolicyLossSums::from_slots(&v)
    }
}

fn inv(d: usize) -> f64 {
    if d == 0 {
        0.0
    } else {
        1.0 / d as f64
    }
}

/// The sequence pass of [`RatioKind::Sequence`] alone (what [`policy_loss_f32`] runs first
/// under it): `lr[s]` = the mean of `logp - old_logp` over sequence `s`'s counted rows
/// (`cpu::seq_log_ratio` of them, bitwise), `bad[s]` = 0; for a span that does not hold exactly
/// its sequence's rows with `n_s` counted (see [`PolicyLossInputs::seq_spans`]) `lr[s]` is NaN
/// and `bad[s]` = 1. Reads `logp`, `old_logp`, `mask`, `seq`, `seq_tokens` and `seq_spans` of
/// `x`. Nothing synchronises.
pub fn policy_loss_seq_ratio_f64(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    lr: &mut impl DevicePtrMut<f64>,
    bad: &mut impl DevicePtrMut<u32>,
    x: &PolicyLossInputs<'_>,
) -> Result<()> {
    let Some(spans) = x.seq_spans else {
        return Err(shape(
            SEQ_OP,
            "the sequence ratio needs each sequence's row span (seq_spans), but none was given",
        ));
    };
    let n = x.tokens;
    need(SEQ_OP, "lr", lr, x.seqs)?;
    need(SEQ_OP, "bad", bad, x.seqs)?;
    need(SEQ_OP, "logp", x.logp, n)?;
    need(SEQ_OP, "old_logp", x.old_logp, n)?;
    need(SEQ_OP, "mask", x.mask, n)?;
    need(SEQ_OP, "seq", x.seq, n)?;
    need(SEQ_OP, "seq_tokens", x.seq_tokens, x.seqs)?;
    let two_seqs = x.seqs.saturating_mul(2);
    need(SEQ_OP, "seq_spans", spans, two_seqs)?;
    let n32 = u32_of(SEQ_OP, "tokens", n)?;
    let s32 = u32_of(SEQ_OP, "seqs", x.seqs)?;
    if x.seqs == 0 {
        return Ok(());
    }
    let blocks = u32_of(SEQ_OP, "blocks", x.seqs.div_ceil(THREADS as usize))?;
    let (lrp, badp) = (ptr_mut(lr, stream), ptr_mut(bad, stream));
    let (lp, op, mp, sp, stp, spp) = (
        ptr(x.logp, stream),
        ptr(x.old_logp, stream),
        ptr(x.mask, stream),
        ptr(x.seq, stream),
        ptr(x.seq_tokens, stream),
        ptr(spans, stream),
    );
    let cfg = Grid::new((blocks, 1, 1), THREADS);
    // SAFETY: thread s < seqs (the kernel bounds-checks s) reads seq_tokens[s], spans[2s] and
    // spans[2s + 1] (held: seqs and 2 * seqs elements, checked) and rows r of logp, old_logp,
    // mask and seq only for r below its span's end, which it first checks is at most n (held:
    // n elements each, checked); it writes lr[s] and bad[s] alone (seqs elements each, checked);
    // arguments match the kernel's signature in order.
    unsafe {
        launch(
            gpu,
            stream,
            &POLICY_LOSS,
            &[],
            SEQ_OP,
            cfg,
            &[&lrp, &badp, &lp, &op, &mp, &sp, &stp, &spp, &n32, &s32],
        )
    }
}

/// The loss of one call: writes `dlogp[t]` for `t < x.tokens` (0 on masked-out tokens) and adds
/// the call's metrics into `acc`. Allocates a scratch of `8 * ceil(tokens / 1024)` f64 on
/// `stream` (stream-ordered, freed after the reduction), and under the sequence ratio `seqs` f64
/// and `seqs` u32 for the sequence pass ([`policy_loss_seq_ratio_f64`]). Nothing synchronises.
pub fn policy_loss_f32(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dlogp: &mut impl DevicePtrMut<f32>,
    acc: &mut PolicyLossAcc,
    x: &PolicyLossInputs<'_>,
    p: &PolicyLossParams,
) -> Result<()> {
    p.validate()?;
    if p.kl_coef > 0.0 && x.ref_logp.is_none() {
        return Err(shape(
            OP,
            format!(
                "kl_coef = {} needs reference log-probs, but none were given (score the \
                 reference, or set kl_coef = 0)",
                p.kl_coef
            ),
        ));
    }
    if x.seqs > p.norm_seqs {
        return Err(shape(
            OP,
            format!(
                "the mini-batch normaliser ({} sequences) is smaller than this call ({} \
                 sequences); it must count the whole mini-batch",
                p.norm_seqs, x.seqs
            ),
        ));
    }
    let n = x.tokens;
    need(OP, "dlogp", dlogp, n)?;
    need(OP, "logp", x.logp, n)?;
    need(OP, "old_logp", x.old_logp, n)?;
    need(OP, "advantages", x.advantages, n)?;
    need(OP, "mask", x.mask, n)?;
    need(OP, "seq", x.seq, n)?;
    need(OP, "seq_tokens", x.seq_tokens, x.seqs)?;
    if let Some(r) = x.ref_logp {
        need(OP, "ref_logp", r, n)?;
    }
    if let Some(e) = x.entropy {
        need(OP, "entropy", e, n)?;
    }
    let n32 = u32_of(OP, "tokens", n)?;
    let s32 = u32_of(OP, "seqs", x.seqs)?;
    let blocks = n.div_ceil(TOKENS_PER_BLOCK);
    let nb32 = u32_of(OP, "blocks", blocks)?;
    // the sequence pass: each sequence's mean log-ratio and its span's flag
    let seq_pass = match p.ratio {
        RatioKind::Token => None,
        RatioKind::Sequence => {
            let mut lr = gpu.alloc::<f64>(stream, x.seqs)?;
            let mut bad = gpu.alloc::<u32>(stream, x.seqs)?;
            policy_loss_seq_ratio_f64(gpu, stream, &mut lr, &mut bad, x)?;
            Some((lr, bad))
        }
    };
    let (lrp, badp) = match &seq_pass {
        Some((lr, bad)) => (ptr(lr, stream), ptr(bad, stream)),
        None => (0, 0),
    };
    let mut partial = gpu.alloc::<f64>(stream, blocks * PARTS)?;
    let pp = ptr_mut(&mut partial, stream);
    let stp = ptr(x.seq_tokens, stream);
    let accp = ptr_mut(&mut acc.slots, stream);
    if n > 0 {
        let (lo, hi) = (1.0 - p.clip_low, 1.0 + p.clip_high);
        let has_dual = p.dual_clip.is_some() as u32;
        let dual_c = p.dual_clip.unwrap_or(0.0);
        let est: u32 = match p.kl {
            KlKind::K1 => 1,
            KlKind::K2 => 2,
            KlKind::K3 => 3,
        };
        let agg: u32 = match p.agg {
            LossAggKind::TokenMean => 0,
            LossAggKind::SeqMeanTokenMean => 1,
            LossAggKind::SeqMeanTokenSum => 2,
        };
        let (inv_tokens, inv_seqs) = (inv(p.norm_tokens), inv(p.norm_seqs));
        let outp = ptr_mut(dlogp, stream);
        let (lp, op, ap, mp, sp) = (
            ptr(x.logp, stream),
            ptr(x.old_logp, stream),
            ptr(x.advantages, stream),
            ptr(x.mask, stream),
            ptr(x.seq, stream),
        );
        let rp = x.ref_logp.map(|r| ptr(r, stream)).unwrap_or(0);
        let ep = x.entropy.map(|e| ptr(e, stream)).unwrap_or(0);
        let cfg = Grid {
            grid: (nb32, 1, 1),
            block: (THREADS, 1, 1),
            smem: 0,
        };
        // SAFETY: thread slots cover tokens t < n only (the kernel bounds-checks t); logp,
        // old_logp, advantages, mask, seq, dlogp and, when given (else null, never read),
        // ref_logp and entropy hold at least n elements (checked above); seq_tokens[s] and (under
        // the sequence ratio, else null, never read) the sequence pass's lr[s] are read only for
        // s < seqs (the kernel checks seq[t] against seqs), which both hold (checked, allocated;
        // lr written by the pass earlier on this stream); block b writes only
        // partial[b * 8 .. b * 8 + 8] and the grid has `blocks` blocks, which is what `partial`
        // holds; dlogp[t] is written by one thread; arguments match the kernel's signature in
        // order.
        unsafe {
            launch(
                gpu,
                stream,
                &POLICY_LOSS,
                &[],
                "policy_loss_f32",
                cfg,
                &[
                    &outp,
                    &pp,
                    &lp,
                    &op,
                    &rp,
                    &ap,
                    &mp,
                    &ep,
                    &sp,
                    &stp,
                    &lrp,
                    &n32,
                    &s32,
                    &lo,
                    &hi,
                    &has_dual,
                    &dual_c,
                    &p.kl_coef,
                    &est,
                    &agg,
                    &inv_tokens,
                    &inv_seqs,
                ],
            )
        }?;
    }
    let has_entropy = x.entropy.is_some() as u32;
    let norm_tokens = p.norm_tokens as f64;
    let cfg = Grid::new((1, 1, 1), THREADS);
    // SAFETY: one block reads partial[b * 8 + k] for b < blocks (written by the launch above
    // on the same stream; never read when blocks == 0, where the 1-element scratch keeps the
    // pointer valid), seq_tokens[s] and (under the sequence ratio, else null, never read) the
    // sequence pass's bad[s] for s < seqs (held: checked, allocated); thread 0 alone adds into
    // the accumulator's ACC_SLOTS slots, which `acc` owns; arguments match the signature.
    unsafe {
        launch(
            gpu,
            stream,
            &POLICY_LOSS,
            &[],
            "policy_loss_reduce_f64",
            cfg,
            &[
                &accp,
                &pp,
                &nb32,
                &stp,
                &badp,
                &s32,
                &p.kl_coef,
                &has_entropy,
                &norm_tokens,
            ],
        )
    }?;
    // freed in stream order, after the kernels that read them
    drop(partial);
    drop(seq_pass);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PolicyLossParams {
        PolicyLossParams {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: Some(3.0),
            kl_coef: 0.05,
            kl: KlKind::K3,
            agg: LossAggKind::TokenMean,
            ratio: RatioKind::Sequence,
            norm_tokens: 10,
            norm_seqs: 2,
        }
    }

    #[test]
    fn invalid_configurations_are_refused_with_the_cpu_messages() {
        assert!(params().validate().is_ok());
        let cases: [(PolicyLossParams, &str); 6] = [
            (
                PolicyLossParams {
                    clip_low: 1.0,
                    ..params()
                },
                "clip_low",
            ),
            (
                PolicyLossParams {
                    clip_low: -0.1,
                    ..params()
                },
                "clip_low",
            ),
            (
                PolicyLossParams {
                    clip_high: f64::INFINITY,
                    ..params()
                },
                "clip_high",
            ),
            (
                PolicyLossParams {
                    dual_clip: Some(1.0),
                    ..params()
                },
                "dual clip",
            ),
            (
                PolicyLossParams {
                    kl_coef: -1e-3,
                    ..params()
                },
                "kl_coef",
            ),
            (
                PolicyLossParams {
                    kl_coef: f64::NAN,
                    ..params()
                },
                "kl_coef",
            ),
        ];
        for (p, word) in cases {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(word), "{p:?}: {e}");
        }
    }

    #[test]
    fn accumulator_slots_decode_and_inconsistencies_are_refused() {
        let mut a = [0.0f64; ACC_SLOTS];
        a[ACC_LOSS] = 1.5;
        a[ACC_PG] = 1.25;
        a[ACC_KL] = 5.0;
        a[ACC_CLIP] = 0.5;
        a[ACC_APPROX_KL] = -0.01;
        a[ACC_TOKENS] = 7.0;
        a[ACC_CALLS] = 2.0;
        let s = PolicyLossSums::from_slots(&a).unwrap();
        assert_eq!(
            (s.loss, s.pg_loss, s.kl, s.clip_frac, s.approx_kl, s.entropy),
            (1.5, 1.25, 5.0, 0.5, -0.01, None)
        );
        assert_eq!((s.tokens, s.calls), (7, 2));
        a[ACC_ENTROPY] = 0.75;
        a[ACC_ENTROPY_CALLS] = 1.0;
        assert_eq!(PolicyLossSums::from_slots(&a).unwrap().entropy, Some(0.75));
        for (slot, word) in [
            (ACC_BAD_SEQ, "sequence index"),
            (ACC_BAD_SPAN, "row spans"),
            (ACC_COUNT_MISMATCH, "add up"),
            (ACC_NORM_SHORT, "normaliser"),
        ] {
            let mut b = a;
            b[slot] = 1.0;
            let e = PolicyLossSums::from_slots(&b).unwrap_err().to_string();
            assert!(e.contains(word), "slot {slot}: {e}");
        }
        assert!(PolicyLossSums::from_slots(&a[..5]).is_err());
    }
}
