//! Self-fencing: an agent that cannot renew its lease stops its workers before etcd can
//! expire the lease, so that no evicted worker runs (or writes a checkpoint) beside the
//! group that re-forms without it.
//!
//! Two pure parts, tested without etcd:
//! - [`LeaseClock`] turns what the session saw of etcd into the earliest moment the lease
//!   can expire there (`safe_until`);
//! - [`decide`] turns `safe_until`, the time and the margin into hold or fence.
//!
//! # Clock assumptions
//! etcd starts a lease's TTL when it processes a grant or keep-alive, which is after this
//! agent sent it, so `send time + TTL` is a lower bound of the expiry, measured on this
//! agent's monotonic clock; the two clocks' rates are assumed equal over a TTL (drift of
//! parts per million, not per cent). A lease cannot expire while etcd has no leader:
//! expiry needs a leader, and a newly elected leader gives every lease a full TTL again. So
//! a one-member etcd seen without a leader at `t` (`etcd/probe.rs`: its port refuses
//! connections, or accepts them and serves nothing, or it says so) proves the lease lives
//! until at least `t + TTL`. A firewall that *rejects* connections to a live etcd (instead
//! of dropping them) breaks that proof; Kubernetes rejects only when a Service has no
//! ready endpoint, i.e. etcd is down.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The earliest moment etcd could expire this agent's lease, from what the session saw.
#[derive(Debug, Clone, Default)]
pub struct LeaseClock {
    safe_until: Option<Instant>,
    /// Send times of keep-alives not answered yet, oldest first.
    unanswered: VecDeque<Instant>,
}

impl LeaseClock {
    /// The lease lives at least until then; `None` before the first grant is confirmed.
    pub fn safe_until(&self) -> Option<Instant> {
        self.safe_until
    }

    fn extend(&mut self, until: Instant) {
        self.safe_until = Some(self.safe_until.map_or(until, |s| s.max(until)));
    }

    /// A grant or time-to-live request sent at `sent` answered that the lease has `ttl`
    /// left.
    pub fn confirmed(&mut self, sent: Instant, ttl: Duration) {
        self.extend(sent + ttl);
    }

    /// A new lease replaces the old one: what was known of the old one no longer counts.
    pub fn replaced(&mut self, sent: Instant, ttl: Duration) {
        self.safe_until = Some(sent + ttl);
        self.unanswered.clear();
    }

    /// A keep-alive left at `at`.
    pub fn keep_alive_sent(&mut self, at: Instant) {
        // A stream that stopped answering must not grow the queue without bound.
        if self.unanswered.len() >= 64 {
            self.unanswered.pop_front();
        }
        self.unanswered.push_back(at);
    }

    /// The oldest unanswered keep-alive was answered with `ttl` left.
    pub fn keep_alive_answered(&mut self, ttl: Duration) {
        if let Some(sent) = self.unanswered.pop_front() {
            self.extend(sent + ttl);
        }
    }

    /// The keep-alive stream was closed: its unanswered requests will never be answered.
    pub fn stream_closed(&mut self) {
        self.unanswered.clear();
    }

    /// etcd was seen without a leader at `sent` (down, starting, or saying so): no leader
    /// can expire the lease before `sent + ttl` — if the lease still lived at `sent`. A
    /// look after `safe_until` proves nothing: etcd may have been back meanwhile, with a
    /// leader that expired the lease this agent could not reach it to renew (found by the
    /// simulator: an agent cut off past its lease, healed while etcd restarted, joined a
    /// round on a lease etcd had expired).
    pub fn no_leader_at(&mut self, sent: Instant, ttl: Duration) {
        if self.safe_until.is_some_and(|s| sent < s) {
            self.extend(sent + ttl);
        }
    }

    /// When the oldest keep-alive still unanswered was sent.
    pub fn oldest_unanswered(&self) -> Option<Instant> {
        self.unanswered.front().copied()
    }
}

/// Whether to keep running the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceDecision {
    /// The lease is safe; look again at `recheck_at` if nothing happens before.
    Hold { recheck_at: Instant },
    /// Stop the workers now, within `left`: etcd may expire the lease then.
    Fence { reason: String, left: Duration },
    /// No lease confirmed yet (nothing runs before the first round): nothing to fence.
    Unknown,
}

/// Decides, from the earliest moment the lease can expire (`safe_until`), whether the
/// workers may keep running at `now`: they stop `margin` before it, so that stopping them
/// completes before anyone else can be given their ranks.
pub fn decide(now: Instant, safe_until: Option<Instant>, margin: Duration) -> FenceDecision {
    let Some(safe_until) = safe_until else {
        return FenceDecision::Unknown;
    };
    let fence_at = fence_at(safe_until, margin);
    if now < fence_at {
        return FenceDecision::Hold {
            recheck_at: fence_at,
        };
    }
    let left = safe_until.saturating_duration_since(now);
    FenceDecision::Fence {
        reason: format!(
            "the lease could not be renewed: etcd may expire it in {:.1}s (fencing margin {:.1}s); stopping the workers before the group re-forms without this node",
            left.as_secs_f64(),
            margin.as_secs_f64()
        ),
        left,
    }
}

/// When workers under a lease etcd may expire at `safe_until` must have stopped.
fn fence_at(safe_until: Instant, margin: Duration) -> Instant {
    safe_until.checked_sub(margin).unwrap_or(safe_until)
}

/// Whether [`decide`] fences at `now` (the lease in doubt), without its words: asked on
/// every publish of the clock and every look of a waiting round.
pub fn in_doubt(now: Instant, safe_until: Option<Instant>, margin: Duration) -> bool {
    safe_until.is_some_and(|s| now >= fence_at(s, margin))
}

/// The default margin for a lease of `ttl`: a fifth of it, at least half a second, so one
/// missed keep-alive (sent every TTL/3) never fences but two do.
pub fn default_margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(500)).min(ttl / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `in_doubt` is `decide` fencing, without its words.
    #[test]
    fn in_doubt_is_exactly_when_decide_fences() {
        let t0 = Instant::now();
        let margin = Duration::from_secs(1);
        for safe in [None, Some(t0), Some(t0 + Duration::from_millis(500))] {
            for ms in [0, 400, 500, 999, 1000, 1500, 3000] {
                let now = t0 + Duration::from_millis(ms);
                let safe = safe.map(|s: Instant| s + Duration::from_secs(2));
                let fences = matches!(decide(now, safe, margin), FenceDecision::Fence { .. });
                assert_eq!(in_doubt(now, safe, margin), fences, "{ms} ms");
            }
        }
    }

    const TTL: Duration = Duration::from_secs(5);
    const MARGIN: Duration = Duration::from_secs(1);

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn nothing_to_fence_before_the_first_grant() {
        let c = LeaseClock::default();
        assert_eq!(
            decide(Instant::now(), c.safe_until(), MARGIN),
            FenceDecision::Unknown
        );
    }

    #[test]
    fn answered_keep_alives_hold_and_silence_fences_a_margin_before_expiry() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.replaced(t0, TTL);
        for k in 1..=3 {
            c.keep_alive_sent(at(t0, 1_600 * k));
            c.keep_alive_answered(TTL);
        }
        // Last renewal sent at 4.8 s: expiry no earlier than 9.8 s, fence at 8.8 s.
        assert_eq!(
            decide(at(t0, 8_700), c.safe_until(), MARGIN),
            FenceDecision::Hold {
                recheck_at: at(t0, 8_800)
            }
        );
        assert!(matches!(
            decide(at(t0, 8_800), c.safe_until(), MARGIN),
            FenceDecision::Fence { .. }
        ));
    }

    #[test]
    fn a_keep_alive_counts_from_when_it_was_sent_not_when_it_was_answered() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.replaced(t0, TTL);
        c.keep_alive_sent(at(t0, 1_000));
        c.keep_alive_sent(at(t0, 2_000));
        // The first answer arrives late: it vouches for 1 s + TTL, not for now + TTL.
        c.keep_alive_answered(TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 6_000)));
        c.keep_alive_answered(TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 7_000)));
        // An answer nobody asked for proves nothing.
        c.keep_alive_answered(TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 7_000)));
    }

    #[test]
    fn a_closed_stream_forgets_its_unanswered_keep_alives() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.replaced(t0, TTL);
        c.keep_alive_sent(at(t0, 1_000));
        c.stream_closed();
        c.keep_alive_sent(at(t0, 3_000));
        c.keep_alive_answered(TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 8_000)));
    }

    #[test]
    fn etcd_seen_without_a_leader_extends_the_lease() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.replaced(t0, TTL);
        // etcd is down (refused) at 3 s and 6 s: nobody can expire the lease before 11 s.
        c.no_leader_at(at(t0, 3_000), TTL);
        c.no_leader_at(at(t0, 6_000), TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 11_000)));
        assert!(matches!(
            decide(at(t0, 9_000), c.safe_until(), MARGIN),
            FenceDecision::Hold { .. }
        ));
        // An older proof never shortens a newer one.
        c.no_leader_at(at(t0, 1_000), TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 11_000)));
    }

    #[test]
    fn etcd_seen_without_a_leader_after_the_lease_could_have_expired_proves_nothing() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.replaced(t0, TTL);
        c.no_leader_at(at(t0, 6_000), TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 5_000)));
        assert!(matches!(
            decide(at(t0, 6_000), c.safe_until(), MARGIN),
            FenceDecision::Fence { .. }
        ));
    }

    #[test]
    fn a_new_lease_replaces_what_was_known_of_the_old_one() {
        let t0 = Instant::now();
        let mut c = LeaseClock::default();
        c.no_leader_at(at(t0, 10_000), TTL);
        c.replaced(at(t0, 2_000), TTL);
        assert_eq!(c.safe_until(), Some(at(t0, 7_000)));
    }

    #[test]
    fn the_default_margin_lets_one_keep_alive_miss_but_not_two() {
        for ttl_s in [1, 2, 5, 10, 30] {
            let ttl = Duration::from_secs(ttl_s);
            let m = default_margin(ttl);
            assert!(m <= ttl / 2, "{ttl:?}: {m:?}");
            // One missed keep-alive: the last answered one was sent 2×TTL/3 ago at worst.
            assert!(
                ttl - m > ttl * 2 / 3 - Duration::from_millis(200),
                "{ttl:?}: {m:?}"
            );
        }
        assert_eq!(
            default_margin(Duration::from_secs(5)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn a_fence_says_why_and_how_long_is_left() {
        let t0 = Instant::now();
        let FenceDecision::Fence { reason, left } =
            decide(at(t0, 4_500), Some(at(t0, 5_000)), MARGIN)
        else {
            panic!("expected a fence")
        };
        assert!(
            reason.contains("0.5s") && reason.contains("margin 1.0s"),
            "{reason}"
        );
        assert_eq!(left, Duration::from_millis(500));
    }
}
