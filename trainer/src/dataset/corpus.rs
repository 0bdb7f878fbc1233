//! A tokenized dataset cut into windows, addressed by a global sample index.
//!
//! A window of `len` tokens starts every `len - 1` tokens, so consecutive windows share one
//! token and every adjacent pair of the corpus is a (input, target) pair exactly once.
//! Sample `index` is window `order(index % windows)` of epoch `index / windows`, where
//! `order` is a permutation of the windows keyed by the epoch: an epoch visits every window
//! once, each epoch in another order, and no table is stored, so any world size computes
//! the same sample from the index alone.

use crate::data::mix;

/// Tokens and what they were made with.
pub struct TokenCorpus {
    /// Training tokens; when there are no validation files, their tail is held out.
    tokens: Vec<u32>,
    /// Tokens of the dataset's validation files, if it has any.
    validation_files: Option<Vec<u32>>,
    vocab: i64,
    eos: Option<u32>,
    /// The dataset as the user named it, for messages.
    source: String,
}

/// With no validation files, the last 1/`HELD_OUT_DIVISOR` of the tokens (at least one
/// window) is held out.
const HELD_OUT_DIVISOR: usize = 100;

impl TokenCorpus {
    pub(crate) fn new(
        tokens: Vec<u32>,
        validation_files: Option<Vec<u32>>,
        vocab: i64,
        eos: Option<u32>,
        source: String,
    ) -> Self {
        Self {
            tokens,
            validation_files,
            vocab,
            eos,
            source,
        }
    }

    /// Embedding rows the tokens need (the tokenizer's vocabulary with added tokens).
    pub fn vocab(&self) -> i64 {
        self.vocab
    }

    /// The token that ends each document, if the tokenizer has one.
    #[cfg(test)]
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Training tokens for windows of `len`.
    fn train(&self, len: usize) -> &[u32] {
        match &self.validation_files {
            Some(_) => &self.tokens,
            None => &self.tokens[..self.tokens.len() - held_out(self.tokens.len(), len)],
        }
    }

    /// Held-out tokens for windows of `len`.
    fn validation(&self, len: usize) -> &[u32] {
        match &self.validation_files {
            Some(v) => v,
            None => &self.tokens[self.tokens.len() - held_out(self.tokens.len(), len)..],
        }
    }

    /// Whether both splits hold at least one window of `len` tokens
    /// (`--max_context_width + 1`); call it once before sampling.
    pub fn check(&self, len: usize) -> Result<(), String> {
        let train = self.train(len).len();
        let validation = self.validation(len).len();
        let held = if self.validation_files.is_some() {
            "the validation files hold"
        } else {
            "the held-out tail holds"
        };
        if windows(train, len) == 0 {
            Err(format!(
                "--dataset {}: {train} training tokens, fewer than --max_context_width + 1 = \
                 {len} (and {validation} held out for validation); use more text or a shorter \
                 context",
                self.source
            ))
        } else if windows(validation, len) == 0 {
            Err(format!(
                "--dataset {}: {held} {validation} tokens, fewer than --max_context_width + 1 = \
                 {len}; add validation text or use a shorter context",
                self.source
            ))
        } else {
            Ok(())
        }
    }

    /// One line for the trainer's log.
    pub fn describe(&self, len: usize) -> String {
        let held = match self.validation_files {
            Some(_) => "from validation files".to_owned(),
            None => format!("the last 1/{HELD_OUT_DIVISOR}"),
        };
        let eos = self.eos.map_or("none".to_owned(), |e| e.to_string());
        format!(
            "dataset {}: {} training tokens ({} windows of {len}), {} validation tokens ({held}), \
             vocab {}, end-of-document token {eos}",
            self.source,
            self.train(len).len(),
            self.windows_per_epoch(len),
            self.validation(len).len(),
            self.vocab
        )
    }

    /// Training samples in one epoch: the windows of `len` tokens.
    pub fn windows_per_epoch(&self, len: usize) -> u64 {
        windows(self.train(len).len(), len)
    }

    /// Validation windows of `len` tokens.
    pub fn validation_windows(&self, len: usize) -> u64 {
        windows(self.validation(len).len(), len)
    }

    /// The epoch (from 0) that sample `index` belongs to.
    pub fn epoch_of(&self, index: u64, len: usize) -> u64 {
        index / self.nonempty_windows(len)
    }

    /// `len` tokens of training sample `index`.
    pub fn train_sample(&self, index: u64, len: usize) -> Vec<i64> {
        let n = self.nonempty_windows(len);
        let window = shuffled(index % n, n, epoch_key(index / n));
        window_tokens(self.train(len), window, len)
    }

    /// `len` tokens of validation sample `index`: the validation windows in order, from
    /// the first again after the last.
    pub fn validation_sample(&self, index: u64, len: usize) -> Vec<i64> {
        let n = self.validation_windows(len);
        assert!(n > 0, "TokenCorpus::check({len}) was not called or failed");
        window_tokens(self.validation(len), index % n, len)
    }

    fn nonempty_windows(&self, len: usize) -> u64 {
        let n = self.windows_per_epoch(len);
        assert!(n > 0, "TokenCorpus::check({len}) was not called or failed");
        n
    }
}

/// Tokens held out of `total` when there are no validation files.
fn held_out(total: usize, len: usize) -> usize {
    (total / HELD_OUT_DIVISOR).max(len).min(total)
}

/// Distance between window starts: one less than a window, so windows share a token.
fn stride(len: usize) -> usize {
    len.saturating_sub(1).max(1)
}

/// Windows of `len` in `tokens` tokens.
pub(crate) fn windows(tokens: usize, len: usize) -> u64 {
    if len == 0 || tokens < len {
        0
    } else {
        ((tokens - len) / stride(len) + 1) as u64
    }
}

fn window_tokens(tokens: &[u32], window: u64, len: usize) -> Vec<i64> {
    let start = window as usize * stride(len);
    tokens[start..start + len]
        .iter()
        .map(|&t| i64::from(t))
        .collect()
}

/// The permutation key of an epoch; independent of `--seed`, as the synthetic corpus is,
/// so runs with different seeds see the same data order.
fn epoch_key(epoch: u64) -> u64 {
    mix(0x7031_d47a ^ mix(epoch))
}

/// Position `j`'s window in the order keyed by `key`: a permutation of `0..n`.
///
/// A 4-round Feistel network permutes the smallest even-bit-width power of two that holds
/// `n` (a bijection for any round function); values past `n` are walked on through the
/// network until they land inside ("cycle walking"), which keeps it a bijection of `0..n`.
/// The domain is under 4n, so a walk averages under 4 steps.
pub(crate) fn shuffled(j: u64, n: u64, key: u64) -> u64 {
    assert!(j < n, "window {j} of {n}");
    if n == 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = j;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = mix(key ^ (round << 60) ^ right) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(tokens: Vec<u32>, validation: Option<Vec<u32>>) -> TokenCorpus {
        TokenCorpus::new(tokens, validation, 256, None, "test".to_owned())
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        for n in [1, 2, 3, 5, 16, 17, 100, 1000, 4099] {
            for epoch in 0..3 {
                let mut seen: Vec<u64> = (0..n).map(|j| shuffled(j, n, epoch_key(epoch))).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} epoch {epoch}");
            }
        }
    }

    #[test]
    fn epochs_differ_in_order_and_the_order_is_not_the_identity() {
        let order = |epoch| -> Vec<u64> {
            (0..1000)
                .map(|j| shuffled(j, 1000, epoch_key(epoch)))
                .collect()
        };
        assert_ne!(order(0), order(1));
        assert_ne!(order(1), order(2));
        assert_ne!(order(0), (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn windows_share_one_token_so_every_pair_is_a_target_once() {
        let c = corpus((0..1000).collect(), Some(vec![0; 10]));
        // 1000 tokens, windows of 10 every 9: starts 0, 9, .., 990.
        assert_eq!(c.windows_per_epoch(10), 111);
        let mut pairs: Vec<(i64, i64)> = (0..111)
            .flat_map(|i| {
                let s = c.train_sample(i, 10);
                s.windows(2).map(|w| (w[0], w[1])).collect::<Vec<_>>()
            })
            .collect();
        pairs.sort_unstable();
        // Every pair, once.
        assert_eq!(pairs, (0..999).map(|t| (t, t + 1)).collect::<Vec<_>>());
    }

    #[test]
    fn a_sample_depends_only_on_its_index_and_epochs_wrap() {
        let c = corpus((0..5000).map(|t| t * 7 % 256).collect(), Some(vec![0; 10]));
        let n = c.windows_per_epoch(33);
        assert_eq!(c.train_sample(42, 33), c.train_sample(42, 33));
        assert_eq!(c.train_sample(42, 33).len(), 33);
        assert_eq!(c.epoch_of(n - 1, 33), 0);
        assert_eq!(c.epoch_of(n, 33), 1);
        assert_eq!(c.epoch_of(5 * n + 3, 33), 5);
        // Epoch 1 holds the same windows as epoch 0, in another order.
        let mut e0: Vec<Vec<i64>> = (0..n).map(|i| c.train_sample(i, 33)).collect();
        let mut e1: Vec<Vec<i64>> = (n..2 * n).map(|i| c.train_sample(i, 33)).collect();
        assert_ne!(e0, e1);
        e0.sort();
        e1.sort();
        assert_eq!(e0, e1);
    }

    #[test]
    fn without_validation_files_the_last_hundredth_is_held_out() {
        let c = corpus((0..10_000).collect(), None);
        // 100 tokens held out: training windows (every 10 tokens) end before token 9900.
        assert_eq!(c.windows_per_epoch(11), 989);
        let largest = (0..989).flat_map(|i| c.train_sample(i, 11)).max().unwrap();
        assert_eq!(largest, 9890);
        assert_eq!(c.validation_windows(11), 9);
        assert_eq!(c.validation_sample(0, 11), (9900..9911).collect::<Vec<_>>());
        // Validation windows come in order, and wrap.
        assert_eq!(c.validation_sample(1, 11)[0], 9910);
        assert_eq!(c.validation_sample(9, 11), c.validation_sample(0, 11));
        // A window longer than a hundredth: one window is held out.
        assert_eq!(c.validation_windows(500), 1);
        assert_eq!(c.validation_sample(0, 500)[0], 9500);
        assert!(c.check(500).is_ok());
    }

    #[test]
    fn validation_files_are_the_held_out_set_and_training_keeps_every_token() {
        let c = corpus((0..100).collect(), Some((1000..1020).collect()));
        assert_eq!(c.windows_per_epoch(10), 11);
        assert_eq!(c.validation_windows(10), 2);
        assert_eq!(c.validation_sample(1, 10), (1009..1019).collect::<Vec<_>>());
        assert!(c.describe(10).contains("from validation files"));
    }

    #[test]
    fn too_few_tokens_for_a_window_is_an_error_naming_the_split() {
        let e = corpus((0..15).collect(), None).check(10).unwrap_err();
        assert!(e.contains("5 training tokens"), "{e}");
        let e = corpus((0..100).collect(), Some(vec![1; 5]))
            .check(10)
            .unwrap_err();
        assert!(e.contains("the validation files hold 5 tokens"), "{e}");
        assert!(corpus((0..20).collect(), None).check(10).is_ok());
        assert_eq!(windows(0, 10), 0);
        assert_eq!(windows(10, 10), 1);
        assert_eq!(windows(5, 0), 0);
    }
}
