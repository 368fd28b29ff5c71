//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
//! counter-based generator. The output is a pure function of (counter, key), so a random number
//! is addressed by what it is for (seed, iteration, sample, step) instead of by how many numbers
//! were drawn before it: results do not depend on batch composition or execution order.
//!
//! The one host implementation: the CPU sampler, random weights and the run's data draws use it,
//! and the CUDA sampler's device twin (`philox_fill` in `cuda/sampling.rs`) is tested against it.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// One Philox4x32 block with 10 rounds.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// A double in (0, 1) from 52 bits of two words: `(bits + 0.5) / 2^52`, exact in f64, so never
/// 0 or 1.
#[inline]
pub fn uniform_open01(a: u32, b: u32) -> f64 {
    let bits = ((a as u64) << 20) ^ (b as u64 >> 12); // 52 bits
    (bits as f64 + 0.5) / (1u64 << 52) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123's kat_vectors for philox4x32_10.
    #[test]
    fn random123_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_is_inside_open_interval() {
        assert!(uniform_open01(0, 0) > 0.0);
        assert!(uniform_open01(u32::MAX, u32::MAX) < 1.0);
    }
}
