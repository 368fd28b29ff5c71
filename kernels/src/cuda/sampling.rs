//! Token sampling (kernel `sample_bf16` in `cuda/sampling.cu`) and its CPU twin [`sample_ref`].
//!
//! Definition (both sides compute exactly this; see the kernel's header for the same text):
//! - `temperature <= 0`: greedy argmax, the lowest index on ties.
//! - `z_i = logit_i / T` (IEEE division). Ranks use the bf16 logit's order key; NaN ranks lowest
//!   and is never drawn.
//! - top-k (`0 < k < vocab`): keep logits `>=` the k-th largest (ties at the threshold all kept).
//! - top-p (`p < 1`): `q_i = trunc(exp(z_i - z_max) * 2^32)` (integers: the sum is exact and
//!   order-free); `Z` = sum of `q` over the kept set; keep logits `>= tau`, `tau` the largest
//!   logit with `sum_{kept, logit >= tau} q >= ceil(p * Z)`.
//! - draw: the argmax over the kept set of `z_i + g_i`, `g_i = -ln(-ln(u_i))` (Gumbel-max, an
//!   exact sample of `softmax(z)` restricted to the kept set), ties to the lowest index;
//!   `u_i = ((x >> 8) + 0.5) * 2^-24`, `x` word `i mod 4` of
//!   `Philox4x32-10(counter = (i / 4, step, sample, iteration), key = (seed_lo, seed_hi))`.
//!
//! So a token depends only on the logits and (seed, iteration, sample, step): not on the batch it
//! ran in, nor on the schedule. CPU and CUDA pick the same token unless two candidates' scores
//! differ by about one ulp of `ln` (the libraries' `ln` may differ in the last bit) or a top-p
//! boundary falls within that rounding.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::SAMPLING;
use super::{shape, Gpu, Result};
pub use crate::cpu::philox::philox4x32_10;

/// Sampling settings shared by a batch of rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// `<= 0`: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1.0: off.
    pub top_p: f32,
    pub seed: u64,
    pub iteration: u32,
}

/// Order key of a bf16 (NaN -> 0, below -inf).
fn bf_key(b: bf16) -> u32 {
    let x = b.to_bits() as u32;
    if x & 0x7fff > 0x7f80 {
        return 0;
    }
    if x & 0x8000 != 0 {
        !x & 0xffff
    } else {
        x | 0x8000
    }
}

fn fixed_weight(l: bf16, t: f32, zmax: f32) -> u64 {
    let w = (l.to_f32() / t - zmax).exp() * 4_294_967_296.0f32;
    w as u64
}

/// The CPU twin of `sample_bf16`: the token drawn from one row of logits for sample `sample` at
/// decode step `step` (see the module doc for the definition).
pub fn sample_ref(logits: &[bf16], p: &SampleParams, sample: u32, step: u32) -> u32 {
    let vocab = logits.len();
    if vocab == 0 {
        return 0;
    }
    let mut argmax = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if bf_key(l) > bf_key(logits[argmax]) {
            argmax = i;
        }
    }
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return argmax as u32;
    }
    let t = p.temperature;
    let zmax = logits[argmax].to_f32() / t;
    let mut kmin = 1u32;
    if p.top_k > 0 && (p.top_k as usize) < vocab {
        let mut keys: Vec<u32> = logits
            .iter()
            .map(|&l| bf_key(l))
            .filter(|&k| k >= kmin)
            .collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        if keys.len() >= p.top_k as usize {
            kmin = kmin.max(keys[p.top_k as usize - 1]);
        }
    }
    if p.top_p < 1.0 {
        let mut by_key: Vec<(u32, u64)> = logits
            .iter()
            .filter(|&&l| bf_key(l) >= kmin)
            .map(|&l| (bf_key(l), fixed_weight(l, t, zmax)))
            .collect();
        let z: u64 = by_key.iter().map(|x| x.1).sum();
        let need = ((p.top_p as f64 * z as f64).ceil() as u64).max(1);
        by_key.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        let mut cum = 0u64;
        let mut i = 0;
        while i < by_key.len() {
            let key = by_key[i].0;
            while i < by_key.len() && by_key[i].0 == key {
                cum += by_key[i].1;
                i += 1;
            }
            if cum >= need {
                kmin = kmin.max(key);
                break;
            }
        }
    }
    let key = [p.seed as u32, (p.seed >> 32) as u32];
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for g in 0..vocab.div_ceil(4) {
        let r = philox4x32_10([g as u32, step, sample, p.iteration], key);
        for (w, word) in r.iter().enumerate() {
            let i = g * 4 + w;
            if i >= vocab || bf_key(logits[i]) < kmin {
                continue;
            }
            let u = ((word >> 8) as f32 + 0.5) * 5.960_464_5e-8f32;
            let sc = logits[i].to_f32() / t - (-(u.ln())).ln();
            if sc > best.0 || (sc == best.0 && (i as u32) < best.1) {
                best = (sc, i as u32);
            }
        }
    }
    if best.1 == u32::MAX {
        argmax as u32
    } else {
        best.1
    }
}

/// The scratch of the split draw: three u64 words per row, zero when made and zero again after
/// every launch that uses them (the row's last block resets them). With it, rows drawn without
/// top-k / top-p (and greedy rows) have their vocabulary split over several blocks, so that a
/// small batch still fills the GPU; the tokens are the same bits as one block per row. Launches
/// that use the same scratch must not run at the same time (one stream).
pub struct SampleScratch(CudaSlice<u64>);

impl SampleScratch {
    /// Scratch for draws of up to `rows` rows.
    pub fn new(stream: &Arc<CudaStream>, rows: usize) -> Result<Self> {
        Ok(SampleScratch(stream.alloc_zeros::<u64>(3 * rows.max(1))?))
    }

    /// The words as they are on the device (synchronises `stream`): all zero between launches.
    pub fn to_host(&self, stream: &Arc<CudaStream>) -> Result<Vec<u64>> {
        Ok(stream.clone_dtoh(&self.0)?)
    }
}

/// Blocks the split draw aims at over all rows (4 per SM of a 132-SM GPU), each of
/// [`SPLIT_THREADS`] threads; a row gets at least one block and at most one per
/// `SPLIT_THREADS` Philox groups of 4 logits.
const SPLIT_TARGET_BLOCKS: usize = 528;
const SPLIT_THREADS: usize = 256;

/// Whether splitting pays for `rows` rows on `sm_count` SMs: one 1024-thread block a row leaves
/// SMs idle below about one row an SM; above, the split draw's 64-bit compares make it the
/// slower (H100, 3B vocabulary, T = 1: 0.012 / 0.055 / 0.101 ms split against 0.080 / 0.077 /
/// 0.083 ms one block a row at 8 / 64 / 128 rows).
pub fn split_pays(rows: usize, sm_count: usize) -> bool {
    4 * rows <= 3 * sm_count
}

/// Blocks per row of the split draw for `rows` rows of `vocab` logits.
pub fn split_blocks(rows: usize, vocab: usize) -> usize {
    SPLIT_TARGET_BLOCKS
        .div_ceil(rows.max(1))
        .clamp(1, vocab.div_ceil(4).div_ceil(SPLIT_THREADS).max(1))
}

/// Draws one token per row of `logits` (`rows` rows of `vocab`, `row_stride` apart) into
/// `tokens`; row `r` is sample `sample_ids[r]` at decode step `steps[r]` (both on the device).
/// With `scratch` ([`SampleScratch`], at least `rows` rows), plain and greedy draws of fewer rows
/// than [`split_pays`] allows split each row over several blocks (the same tokens).
#[allow(clippy::too_many_arguments)]
pub fn sample_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    tokens: &mut impl DevicePtrMut<u32>,
    logits: &impl DevicePtr<bf16>,
    sample_ids: &impl DevicePtr<u32>,
    steps: &impl DevicePtr<u32>,
    rows: usize,
    vocab: usize,
    row_stride: usize,
    params: &SampleParams,
    scratch: Option<&mut SampleScratch>,
) -> Result<()> {
    let p = SampleRows::of(stream, tokens, logits, sample_ids, steps);
    launch_sample(
        gpu, stream, p, rows, vocab, row_stride, params, None, scratch,
    )
}

/// [`sample_bf16`] with the key's seed and iteration read from the device (`key = [seed_lo,
/// seed_hi, iteration]`; `params.seed` and `params.iteration` are not used): a CUDA graph that
/// captured it draws the tokens of whatever iteration `key` holds when it is replayed.
#[allow(clippy::too_many_arguments)]
pub fn sample_bf16_keyed(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    tokens: &mut impl DevicePtrMut<u32>,
    logits: &impl DevicePtr<bf16>,
    key: &impl DevicePtr<u32>,
    sample_ids: &impl DevicePtr<u32>,
    steps: &impl DevicePtr<u32>,
    rows: usize,
    vocab: usize,
    row_stride: usize,
    params: &SampleParams,
    scratch: Option<&mut SampleScratch>,
) -> Result<()> {
    need("sample_bf16_keyed", "key", key, 3)?;
    let p = SampleRows::of(stream, tokens, logits, sample_ids, steps);
    let k = ptr(key, stream);
    launch_sample(
        gpu,
        stream,
        p,
        rows,
        vocab,
        row_stride,
        params,
        Some(k),
        scratch,
    )
}

/// The per-row device addresses of a draw, and the element counts behind them (tokens, logits,
/// sample_ids, steps).
struct SampleRows {
    tokens: u64,
    logits: u64,
    sample_ids: u64,
    steps: u64,
    lens: [usize; 4],
}

impl SampleRows {
    fn of(
        stream: &CudaStream,
        tokens: &mut impl DevicePtrMut<u32>,
        logits: &impl DevicePtr<bf16>,
        sample_ids: &impl DevicePtr<u32>,
        steps: &impl DevicePtr<u32>,
    ) -> Self {
        SampleRows {
            lens: [tokens.len(), logits.len(), sample_ids.len(), steps.len()],
            tokens: ptr_mut(tokens, stream),
            logits: ptr(logits, stream),
            sample_ids: ptr(sample_ids, stream),
            steps: ptr(steps, stream),
        }
    }
}

/// Checks and launches either entry point (`key`: the device key's address, or `None` for the
/// key in `params`).
#[allow(clippy::too_many_arguments)]
fn launch_sample(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    p: SampleRows,
    rows: usize,
    vocab: usize,
    row_stride: usize,
    params: &SampleParams,
    key: Option<u64>,
    scratch: Option<&mut SampleScratch>,
) -> Result<()> {
    const OP: &str = "sample_bf16";
    if vocab == 0 || row_stride < vocab || vocab >= (1usize << 31) {
        return Err(shape(
            OP,
            format!("vocab {vocab} must be positive, < 2^31 and fit in row_stride {row_stride}"),
        ));
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) || params.temperature.is_nan() {
        return Err(shape(
            OP,
            format!(
                "top_p {} must be in (0, 1]; temperature not NaN",
                params.top_p
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let want = [rows, (rows - 1) * row_stride + vocab, rows, rows];
    for ((name, have), want) in ["tokens", "logits", "sample_ids", "steps"]
        .iter()
        .zip(p.lens)
        .zip(want)
    {
        if have < want {
            return Err(shape(
                OP,
                format!("{name} holds {have} elements, needs at least {want}"),
            ));
        }
    }
    let (rs, r, v) = (
        u32_of(OP, "row_stride", row_stride)?,
        u32_of(OP, "rows", rows)?,
        vocab as u32,
    );
    let (s0, s1) = (params.seed as u32, (params.seed >> 32) as u32);
    let plain = !(params.top_k > 0 && (params.top_k as usize) < vocab) && params.top_p >= 1.0;
    let split = plain && split_pays(rows, gpu.sm_count() as usize);
    if let (true, Some(sc)) = (split, scratch) {
        need(OP, "sample scratch", &sc.0, 3 * rows)?;
        let cfg = Grid {
            grid: (split_blocks(rows, vocab) as u32, r, 1),
            block: (SPLIT_THREADS as u32, 1, 1),
            smem: 0,
        };
        let (kp, scp) = (key.unwrap_or(0), ptr_mut(&mut sc.0, stream));
        // SAFETY: logits cover rows*row_stride, the per-row arrays hold `rows`, the scratch
        // 3*rows words (checked), the key 3 words when given (checked by the caller); arguments
        // match (logits, row_stride, rows, vocab, temperature, seed_lo, seed_hi, iteration,
        // key, sample_ids, steps, tokens, scratch).
        unsafe {
            launch(
                gpu,
                stream,
                &SAMPLING,
                &[],
                "sample_split_bf16",
                cfg,
                &[
                    &p.logits,
                    &rs,
                    &r,
                    &v,
                    &params.temperature,
                    &s0,
                    &s1,
                    &params.iteration,
                    &kp,
                    &p.sample_ids,
                    &p.steps,
                    &p.tokens,
                    &scp,
                ],
            )
        }?;
        return Ok(());
    }
    let cfg = Grid {
        grid: (r, 1, 1),
        block: (1024, 1, 1),
        smem: 0,
    };
    let (xp, sp, stp, tp) = (p.logits, p.sample_ids, p.steps, p.tokens);
    match key {
        // SAFETY: logits cover rows*row_stride, the per-row arrays hold `rows` (checked);
        // arguments match (logits, row_stride, rows, vocab, temperature, top_k, top_p,
        // seed_lo, seed_hi, iteration, sample_ids, steps, tokens).
        None => unsafe {
            launch(
                gpu,
                stream,
                &SAMPLING,
                &[],
                "sample_bf16",
                cfg,
                &[
                    &xp,
                    &rs,
                    &r,
                    &v,
                    &params.temperature,
                    &params.top_k,
                    &params.top_p,
                    &s0,
                    &s1,
                    &params.iteration,
                    &sp,
                    &stp,
                    &tp,
                ],
            )
        },
        // SAFETY: as above, with the key's three words at `k` (checked by the caller);
        // arguments match (logits, row_stride, rows, vocab, temperature, top_k, top_p, key,
        // sample_ids, steps, tokens).
        Some(k) => unsafe {
            launch(
                gpu,
                stream,
                &SAMPLING,
                &[],
                "sample_bf16_keyed",
                cfg,
                &[
                    &xp,
                    &rs,
                    &r,
                    &v,
                    &params.temperature,
                    &params.top_k,
                    &params.top_p,
                    &k,
                    &sp,
                    &stp,
                    &tp,
                ],
            )
        },
    }?;
    Ok(())
}

/// Test hook: `out[4i..4i+4] = Philox4x32-10((i, c1, c2, c3), key)` for `i < n_blocks`.
pub fn philox_fill(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<u32>,
    n_blocks: usize,
    c: [u32; 3],
    key: [u32; 2],
) -> Result<()> {
    const OP: &str = "philox_fill";
    need(OP, "out", out, n_blocks * 4)?;
    if n_blocks == 0 {
        return Ok(());
    }
    let op_ = ptr_mut(out, stream);
    let n = u32_of(OP, "n_blocks", n_blocks)?;
    let cfg = Grid {
        grid: (n.div_ceil(256), 1, 1),
        block: (256, 1, 1),
        smem: 0,
    };
    // SAFETY: out holds 4*n_blocks words (checked); arguments match (out, n_blocks, c1, c2, c3,
    // k0, k1).
    unsafe {
        launch(
            gpu,
            stream,
            &SAMPLING,
            &[],
            "philox_fill",
            cfg,
            &[&op_, &n, &c[0], &c[1], &c[2], &key[0], &key[1]],
        )
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(vals: &[f32]) -> Vec<bf16> {
        vals.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    /// The split draw's cut: at least one block a row, at most one per 256 Philox groups of a
    /// row, about 528 blocks in all where rows allow; split only below 3 rows for every 4 SMs.
    #[test]
    fn split_draw_cut_fills_the_gpu_within_the_row() {
        let v = 151_936;
        assert_eq!(split_blocks(1, v), v.div_ceil(4).div_ceil(256));
        assert_eq!(split_blocks(8, v), 66);
        assert_eq!(split_blocks(64, v), 9);
        assert_eq!(split_blocks(1000, v), 1);
        assert_eq!(split_blocks(3, 10), 1);
        for rows in 1..200 {
            let b = split_blocks(rows, v);
            assert!(b >= 1 && b <= v.div_ceil(1024), "{rows}: {b}");
        }
        assert!(split_pays(8, 132) && split_pays(99, 132));
        assert!(!split_pays(100, 132) && !split_pays(128, 132));
    }

    #[test]
    fn greedy_takes_first_maximum_and_skips_nan() {
        let p = SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            iteration: 0,
        };
        assert_eq!(sample_ref(&row(&[1.0, 3.0, f32::NAN, 3.0]), &p, 0, 0), 1);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let x = row(&[0.5, 2.0, -1.0, 1.9, 0.0]);
        for s in 0..50 {
            let p = SampleParams {
                temperature: 1.0,
                top_k: 1,
                top_p: 1.0,
                seed: s,
                iteration: 3,
            };
            assert_eq!(sample_ref(&x, &p, 7, 11), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]: p = 0.7 keeps the first two.
        let x = row(&[3.0, 2.0, 1.0, 0.0]);
        let mut seen = [0usize; 4];
        for s in 0..400 {
            let p = SampleParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.7,
                seed: s,
                iteration: 0,
            };
            seen[sample_ref(&x, &p, 0, 0) as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
    }

    #[test]
    fn draws_follow_the_softmax() {
        // 4 tokens with probabilities proportional to e^z; 20000 draws over steps.
        let z = [0.0f32, 1.0, 2.0, -1.0];
        let x = row(&z);
        let mut count = [0f64; 4];
        let n = 20000;
        for step in 0..n {
            let p = SampleParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                seed: 42,
                iteration: 1,
            };
            count[sample_ref(&x, &p, 5, step) as usize] += 1.0;
        }
        let zs: f64 = z.iter().map(|v| (*v as f64).exp()).sum();
        for i in 0..4 {
            let want = (z[i] as f64).exp() / zs;
            let got = count[i] / n as f64;
            assert!((got - want).abs() < 0.015, "token {i}: {got} vs {want}");
        }
    }

    #[test]
    fn token_depends_on_the_key_only() {
        let x = row(&(0..1000)
            .map(|i| ((i * 37 % 101) as f32) / 25.0)
            .collect::<Vec<_>>());
        let p = SampleParams {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.9,
            seed: 9,
            iteration: 2,
        };
        let a = sample_ref(&x, &p, 3, 4);
        assert_eq!(a, sample_ref(&x, &p, 3, 4));
        let others: Vec<u32> = (0..20).map(|s| sample_ref(&x, &p, 3, 5 + s)).collect();
        assert!(
            others.iter().any(|&t| t != a),
            "different steps should not all agree"
        );
    }
}
