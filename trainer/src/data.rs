//! Training samples, addressed by a global sample index: the same index gives the same
//! sequence whatever the world size, so a re-formed group resumes at the same sample.

use tch::{Device, Kind, Tensor};

use crate::dataset::TokenCorpus;

/// Where sequences come from.
pub enum Corpus {
    /// A deterministic corpus with structure to learn: each token is followed by a fixed
    /// successor (a permutation of the vocabulary) 9 times in 10, else by a random token.
    Synthetic { vocab: i64, successor: Vec<i64> },
    /// A local dataset, tokenized ([`crate::dataset`]).
    Tokens(TokenCorpus),
}

/// Validation samples are numbered from here: training would need 2^62 samples to reach
/// them.
const VALIDATION: u64 = 1 << 62;

/// splitmix64: a small, well-mixed hash, so sample `i` is the same on every machine.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Corpus {
    pub fn synthetic(vocab: i64) -> Self {
        // A fixed permutation (Fisher-Yates with the hash), independent of --seed so runs
        // with different seeds see the same data.
        let mut successor: Vec<i64> = (0..vocab).collect();
        for i in (1..successor.len()).rev() {
            let j = (mix(0xc0ffee ^ i as u64) % (i as u64 + 1)) as usize;
            successor.swap(i, j);
        }
        Self::Synthetic { vocab, successor }
    }

    /// `len` tokens of sample `index`.
    pub fn sample(&self, index: u64, len: usize) -> Vec<i64> {
        match self {
            Self::Synthetic { vocab, successor } => {
                let v = *vocab as u64;
                let mut state = mix(index);
                let mut cur = (state % v) as i64;
                let mut out = Vec::with_capacity(len);
                out.push(cur);
                while out.len() < len {
                    state = mix(state);
                    cur = if state % 10 == 0 {
                        ((state >> 8) % v) as i64
                    } else {
                        successor[cur as usize]
                    };
                    out.push(cur);
                }
                out
            }
            Self::Tokens(t) => t.train_sample(index, len),
        }
    }

    /// Training samples in one pass over the data (`None`: it has no end).
    pub fn samples_per_epoch(&self, context: i64) -> Option<u64> {
        match self {
            Self::Synthetic { .. } => None,
            Self::Tokens(t) => Some(t.windows_per_epoch(context as usize + 1)),
        }
    }

    /// The pass over the data (from 0) that sample `index` belongs to (`None`: no end).
    pub fn epoch_of(&self, index: u64, context: i64) -> Option<u64> {
        match self {
            Self::Synthetic { .. } => None,
            Self::Tokens(t) => Some(t.epoch_of(index, context as usize + 1)),
        }
    }

    /// Inputs and targets `[batch, context]` for samples `first .. first + batch`.
    pub fn batch(&self, first: u64, batch: i64, context: i64, device: Device) -> (Tensor, Tensor) {
        let len = context as usize + 1;
        let flat: Vec<i64> = (0..batch as u64)
            .flat_map(|i| self.sample(first + i, len))
            .collect();
        to_pair(&flat, batch, context, device)
    }

    /// Like [`Self::batch`], from samples training never sees: the dataset's held-out
    /// windows, or synthetic samples numbered past any training run.
    pub fn validation_batch(
        &self,
        first: u64,
        batch: i64,
        context: i64,
        device: Device,
    ) -> (Tensor, Tensor) {
        let len = context as usize + 1;
        let flat: Vec<i64> = (first..first + batch as u64)
            .flat_map(|i| match self {
                Self::Tokens(t) => t.validation_sample(i, len),
                Self::Synthetic { .. } => self.sample(VALIDATION + i, len),
            })
            .collect();
        to_pair(&flat, batch, context, device)
    }
}

/// Inputs and targets `[batch, context]` from `batch` rows of `context + 1` tokens.
fn to_pair(flat: &[i64], batch: i64, context: i64, device: Device) -> (Tensor, Tensor) {
    let all = Tensor::from_slice(flat)
        .view([batch, context + 1])
        .to_kind(Kind::Int64)
        .to_device(device);
    (all.narrow(1, 0, context), all.narrow(1, 1, context))
}

/// The first global sample index of `rank`'s share of a step that starts at
/// `samples_seen`: ranks take consecutive blocks of `per_rank`.
pub fn first_sample(samples_seen: u64, rank: usize, per_rank: i64) -> u64 {
    samples_seen + rank as u64 * per_rank as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_depend_only_on_their_index() {
        let c = Corpus::synthetic(256);
        assert_eq!(c.sample(7, 16), c.sample(7, 16));
        assert_ne!(c.sample(7, 16), c.sample(8, 16));
        // Two ranks of 4 cover what one rank of 8 covers.
        let one: Vec<u64> = (0..8).map(|i| first_sample(100, 0, 8) + i).collect();
        let two: Vec<u64> = (0..2)
            .flat_map(|r| (0..4).map(move |i| first_sample(100, r, 4) + i))
            .collect();
        assert_eq!(one, two);
    }

    #[test]
    fn the_synthetic_corpus_mostly_follows_its_successor_table() {
        let c = Corpus::synthetic(64);
        let Corpus::Synthetic { successor, .. } = &c else {
            unreachable!()
        };
        let s = c.sample(3, 1000);
        let follows = s
            .windows(2)
            .filter(|w| successor[w[0] as usize] == w[1])
            .count();
        assert!(follows > 850 && follows < 950, "{follows}");
    }
}
