//! The one backoff of the agent: delays from a first one doubling up to a cap, built on
//! `backon`. Reconnecting to etcd, retrying the first connection and pausing before a
//! restart all start from [`exponential`].

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Delays starting at `first`, doubling, capped at `cap`, without end. Add `with_jitter`,
/// `with_max_times` or `with_total_delay` where a caller needs them.
pub fn exponential(first: Duration, cap: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(first)
        .with_max_delay(cap)
        .with_factor(2.0)
        .without_max_times()
}

/// The delays of [`exponential`], one per retry.
pub fn delays(first: Duration, cap: Duration) -> impl Iterator<Item = Duration> {
    exponential(first, cap).build()
}

/// The `n`-th (0-based) delay of [`exponential`].
pub fn nth(first: Duration, cap: Duration, n: u32) -> Duration {
    // From the 32nd on every delay is the cap (or beyond any real cap): no need to walk there.
    delays(first, cap).nth(n.min(32) as usize).unwrap_or(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_the_first_up_to_the_cap() {
        let (first, cap) = (Duration::from_millis(100), Duration::from_secs(2));
        let ms: Vec<u128> = delays(first, cap).take(7).map(|d| d.as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(nth(first, cap, 3).as_millis(), 800);
        assert_eq!(nth(first, cap, u32::MAX), cap);
    }
}
