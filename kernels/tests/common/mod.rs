//! Helpers the CUDA test files share: the device ([`rollplex_kernels::cuda::test_gpu`]'s rule: a
//! "skipped: no CUDA device" message and a pass where none opens, a failure with
//! `ROLLPLEX_REQUIRE_GPU=1`), fresh random inputs (each seed printed), uploads/downloads,
//! NaN-poisoned outputs
//! (an unwritten element fails), and the bf16 tolerance check ‖out − ref‖ / ‖ref‖.
//! Included with `#[macro_use] mod common; use common::*;`: a file's own item of the same name
//! shadows the one here.
#![allow(dead_code, unused_macros)]

use std::sync::{Arc, OnceLock};

use half::bf16;
use rollplex_kernels::cuda::*;

/// The device every test of the binary shares, opened once ([`test_gpu`]).
pub fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    GPU.get_or_init(test_gpu).as_ref()
}

macro_rules! gpu_or_skip {
    () => {
        match gpu() {
            Some(g) => g,
            None => {
                println!("skipped: no CUDA device");
                return;
            }
        }
    };
}

/// Uniform values in [-1, 1) from a SplitMix64 stream (fresh per seed).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A fresh seed per call (tests draw new inputs every run), printed so that a failing test's
/// output names the inputs it drew (`rand_vec(n, seed)` draws them again).
pub fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let seed = t ^ N.fetch_add(0x9E37_79B9, std::sync::atomic::Ordering::Relaxed);
    println!("random inputs: seed {seed:#x}");
    seed
}

/// Random bf16 values scaled by `scale`, and the same values as f32 (what the CPU twin reads).
pub fn rand_bf(n: usize, scale: f32) -> (Vec<bf16>, Vec<f32>) {
    let v: Vec<bf16> = rand_vec(n, fresh_seed())
        .iter()
        .map(|x| bf16::from_f32(x * scale))
        .collect();
    let f = v.iter().map(|x| x.to_f32()).collect();
    (v, f)
}

pub fn up<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).expect("upload")
}
pub fn down<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Vec<T> {
    s.clone_dtoh(d).expect("download")
}
pub fn poison_bf(s: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    up(s, &vec![bf16::from_bits(0x7fc0); n])
}
pub fn poison_f32(s: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    up(s, &vec![f32::NAN; n])
}
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// ‖out − ref‖ / ‖ref‖; NaN anywhere in `out` gives infinity.
pub fn rel_err(out: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        if !(o.is_finite() || (o.is_infinite() && o == r)) {
            return f64::INFINITY;
        }
        if o.is_infinite() {
            continue;
        }
        num += (*o as f64 - *r as f64).powi(2);
        den += (*r as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub fn check(name: &str, out: &[f32], reference: &[f32], tol: f64) {
    let e = rel_err(out, reference);
    println!("{name}: rel err {e:.2e} (tol {tol:.0e})");
    assert!(e <= tol, "{name}: rel err {e:.3e} > {tol:.0e}");
}

/// A random group-shared decode on the device with the CPU twin's answer: `groups` GRPO groups
/// of `gsize` samples, the groups' `prefix_len`-row prefixes first in one KV arena, then every
/// sample's own rows (1..=300 of them, 3-row gaps between samples).
pub struct GroupedDecodeCase {
    /// Samples (`groups * gsize`, or the sizes' sum).
    pub b: usize,
    /// The group table: group `i` is samples `starts[i] .. starts[i + 1]`.
    pub starts: Vec<u32>,
    pub suffix_lens: Vec<usize>,
    pub scale: f32,
    /// [`rollplex_kernels::cpu::attention_decode`]'s outputs and log-sum-exps.
    pub want: Vec<f32>,
    pub want_lse: Vec<f32>,
    /// The device descriptors (also on the host, for tests that alter one).
    pub gseqs: Vec<AttnSeqGpu>,
    pub q: CudaSlice<bf16>,
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
    pub seqs: CudaSlice<AttnSeqGpu>,
}

impl GroupedDecodeCase {
    /// The case's inputs for a decode kernel (contiguous rows), reading keys through `seqs`.
    pub fn inputs<'a>(
        &'a self,
        dims: rollplex_kernels::cpu::AttnDims,
        seqs: &'a CudaSlice<AttnSeqGpu>,
    ) -> DecodeInputs<'a> {
        DecodeInputs {
            q: &self.q,
            k_cache: &self.k,
            v_cache: &self.v,
            seqs,
            dims,
            scale: self.scale,
            strides: attention::RowStrides::contiguous(dims),
        }
    }
}

pub fn grouped_decode_case(
    s: &Arc<CudaStream>,
    dims: rollplex_kernels::cpu::AttnDims,
    groups: usize,
    gsize: usize,
    prefix_len: usize,
) -> GroupedDecodeCase {
    grouped_decode_case_sized(s, dims, &vec![gsize; groups], prefix_len)
}

/// Groups of the given sizes (group-major samples, a group of size 0 holding none), each
/// sharing its own prefix of `prefix_len` keys, and random suffixes.
pub fn grouped_decode_case_sized(
    s: &Arc<CudaStream>,
    dims: rollplex_kernels::cpu::AttnDims,
    sizes: &[usize],
    prefix_len: usize,
) -> GroupedDecodeCase {
    use rollplex_kernels::cpu::{self, DecodeSeq};
    let group_of: Vec<usize> = sizes
        .iter()
        .enumerate()
        .flat_map(|(gi, &n)| std::iter::repeat_n(gi, n))
        .collect();
    let (b, groups) = (group_of.len(), sizes.len());
    let kvw = dims.kv_width();
    let suffix_lens: Vec<usize> = rand_vec(b, fresh_seed())
        .iter()
        .map(|v| 1 + ((v + 1.0) * 150.0) as usize)
        .collect();
    let mut rows = groups * prefix_len;
    let mut seqs = Vec::new();
    for (i, &suffix_len) in suffix_lens.iter().enumerate() {
        seqs.push(DecodeSeq {
            prefix_offset: (group_of[i] * prefix_len) as u32,
            prefix_len: prefix_len as u32,
            suffix_offset: rows as u32,
            suffix_len: suffix_len as u32,
        });
        rows += suffix_len + 3; // gaps between suffixes
    }
    let (kc, kcf) = rand_bf(rows * kvw, 1.0);
    let (vc, vcf) = rand_bf(rows * kvw, 1.0);
    let (q, qf) = rand_bf(b * dims.q_width(), 1.0);
    let scale = 1.0 / (dims.head_dim as f32).sqrt();
    let mut want = vec![0f32; b * dims.q_width()];
    let mut want_lse = vec![0f32; b * dims.num_heads];
    cpu::attention_decode(
        &mut want,
        Some(&mut want_lse),
        &qf,
        &kcf,
        &vcf,
        &seqs,
        dims,
        scale,
    )
    .unwrap();
    let gseqs: Vec<AttnSeqGpu> = seqs
        .iter()
        .enumerate()
        .map(|(i, sq)| AttnSeqGpu::from_decode(i as u32, sq))
        .collect();
    let starts = std::iter::once(0)
        .chain(sizes.iter().scan(0u32, |acc, &n| {
            *acc += n as u32;
            Some(*acc)
        }))
        .collect();
    GroupedDecodeCase {
        b,
        starts,
        suffix_lens,
        scale,
        want,
        want_lse,
        q: up(s, &q),
        k: up(s, &kc),
        v: up(s, &vc),
        seqs: up(s, &gseqs),
        gseqs,
    }
}
