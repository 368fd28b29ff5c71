//! Test helpers: a deterministic input generator and the relative error against an f64 reference.

/// `n` values uniform in [-1, 1) from a SplitMix64 stream seeded by `seed`.
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0x2545_F491_4F6C_DD1D);
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

/// ‖out − ref‖₂ / ‖ref‖₂ (‖out − ref‖₂ when the reference is zero).
pub fn rel_err(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        num += (*o as f64 - r) * (*o as f64 - r);
        den += r * r;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
