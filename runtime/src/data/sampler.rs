//! The order in which the RL loop draws prompts: a fresh permutation per epoch, keyed by the
//! job seed and the epoch number, cut into batches of `prompts_per_iter`.
//!
//! Invariants:
//! - Batch `k` is a pure function of (dataset size, seed, batch size, k): the sampler keeps no
//!   state, so resuming needs only the next batch number ([`BatchCursor`]).
//! - A batch never spans two epochs; the last `n % batch` prompts of each epoch's permutation
//!   are left out (as veRL's dataloader does with `drop_last`), and a different permutation
//!   each epoch means different prompts are left out.
//! - Within a batch, prompts are distinct.

use serde::{Deserialize, Serialize};

use super::rng::{derive, SplitMix64};
use super::{DataError, Result};

/// Where the loop is in the data: the number of the next batch to draw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchCursor {
    pub next_batch: u64,
}

#[derive(Clone, Debug)]
pub struct Sampler {
    samples: u64,
    batch: u64,
    seed: u64,
    /// Cache of the last epoch's permutation.
    cache: Option<(u64, Vec<u32>)>,
}

impl Sampler {
    /// A sampler of `samples` prompts in batches of `batch`, shuffled with `seed`.
    pub fn new(samples: usize, batch: u32, seed: u64, shuffle: bool) -> Result<Self> {
        let (samples, batch) = (samples as u64, batch as u64);
        if batch == 0 {
            return Err(DataError::Other(
                "prompts_per_iter must be at least 1".into(),
            ));
        }
        if samples < batch {
            return Err(DataError::TooSmall { batch, samples });
        }
        if samples > u32::MAX as u64 {
            return Err(DataError::Other(format!(
                "{samples} samples: at most 2^32-1 are supported"
            )));
        }
        // An unshuffled sampler is the identity permutation every epoch.
        let cache = if shuffle {
            None
        } else {
            Some((u64::MAX, (0..samples as u32).collect()))
        };
        Ok(Self {
            samples,
            batch,
            seed,
            cache,
        })
    }

    pub fn batches_per_epoch(&self) -> u64 {
        self.samples / self.batch
    }

    /// The permutation of epoch `epoch`.
    pub fn permutation(&self, epoch: u64) -> Vec<u32> {
        let mut p: Vec<u32> = (0..self.samples as u32).collect();
        SplitMix64::new(derive(self.seed, epoch)).shuffle(&mut p);
        p
    }

    /// Sample indices of batch `k` (counted from the start of training), with its epoch.
    pub fn batch(&mut self, k: u64) -> (u64, Vec<usize>) {
        let per = self.batches_per_epoch();
        let (epoch, b) = (k / per, k % per);
        let perm = match &self.cache {
            Some((u64::MAX, p)) => p,
            Some((e, p)) if *e == epoch => p,
            _ => {
                let p = self.permutation(epoch);
                &self.cache.insert((epoch, p)).1
            }
        };
        let start = (b * self.batch) as usize;
        (
            epoch,
            perm[start..start + self.batch as usize]
                .iter()
                .map(|&i| i as usize)
                .collect(),
        )
    }

    /// Draws the batch at `cursor` and advances it.
    pub fn next(&mut self, cursor: &mut BatchCursor) -> Vec<usize> {
        let (_, b) = self.batch(cursor.next_batch);
        cursor.next_batch += 1;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_cover_distinct_prompts_and_differ() {
        let mut s = Sampler::new(10, 3, 42, true).unwrap();
        assert_eq!(s.batches_per_epoch(), 3);
        let mut seen = Vec::new();
        for k in 0..3 {
            let (e, b) = s.batch(k);
            assert_eq!(e, 0);
            seen.extend(b);
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 9, "no prompt twice within an epoch");
        let (e, b3) = s.batch(3);
        assert_eq!(e, 1);
        assert_ne!(b3, s.batch(0).1, "epoch 1 is a different permutation");
    }

    #[test]
    fn batches_are_a_pure_function_of_k() {
        let mut a = Sampler::new(100, 8, 7, true).unwrap();
        let mut cursor = BatchCursor::default();
        let drawn: Vec<Vec<usize>> = (0..30).map(|_| a.next(&mut cursor)).collect();
        assert_eq!(cursor.next_batch, 30);
        // A fresh sampler resumed at batch 17 (another epoch cached) gives the same batches.
        let mut b = Sampler::new(100, 8, 7, true).unwrap();
        b.batch(2);
        let mut c = BatchCursor { next_batch: 17 };
        for want in &drawn[17..] {
            assert_eq!(&b.next(&mut c), want);
        }
        let mut other = Sampler::new(100, 8, 8, true).unwrap();
        assert_ne!(other.batch(0).1, drawn[0], "the seed changes the order");
    }

    #[test]
    fn unshuffled_is_in_file_order_and_small_datasets_fail() {
        let mut s = Sampler::new(5, 2, 1, false).unwrap();
        assert_eq!(s.batch(0).1, vec![0, 1]);
        assert_eq!(s.batch(2).1, vec![0, 1]);
        let e = Sampler::new(3, 4, 0, true).unwrap_err().to_string();
        assert!(e.contains("at least 4 samples, the dataset has 3"), "{e}");
        assert!(Sampler::new(3, 0, 0, true).is_err());
    }
}
