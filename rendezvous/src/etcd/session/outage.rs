//! What the session knows of etcd's trouble: failures in a row and since when, whether
//! etcd was too busy for a request and since when, whether the prober looks, and what
//! the next sync must do about the connection. Each is changed only here; the phases
//! (`phases.rs`) decide what the trouble means.

use std::time::{Duration, Instant};

use super::admission::place_in_crowd;
use super::machine::{FIRST_RETRY, LAST_RETRY};

/// A crowd's questions for the member count are spread over this much per node of the
/// run (500 a second): spread over half a TTL, 20,000 nodes asked 10,500 of them in the
/// four seconds after the seal, with the seal's 20,000 shard reads and 12,000 renewals a
/// second, and that run collapsed there (lease questions, lapsed leases, registrations
/// again; docs/bench/agents-scale.md, twenty-seventh section).
const COUNT_PER_NODE: Duration = Duration::from_millis(2);

/// How long after it runs its first round a crowd's node `node_id`, of a run of at most
/// `max_nodes`, asks etcd's member count: half a TTL, then a moment drawn from its id
/// within [`COUNT_PER_NODE`] a node (at least half a TTL: 40 s at 20,000), so that a
/// crowd's questions come neither with the seal's reads nor faster than etcd answers
/// them beside its renewals. What waiting costs: a node that loses etcd before it knows
/// fences on its lease clock, as a node of an etcd of several members always does.
pub(super) fn count_delay(node_id: &str, max_nodes: u32, ttl: Duration) -> Duration {
    let spread = (COUNT_PER_NODE * max_nodes).max(ttl / 2);
    ttl / 2 + spread.mul_f64(place_in_crowd(node_id))
}

#[derive(Debug, Default)]
pub(super) struct Outage {
    /// Failures since the last good watch: the next sync waits
    /// `backoff::nth(FIRST_RETRY, LAST_RETRY, n)`.
    failures: u32,
    /// Since when etcd has not answered (the first failure of an outage).
    since: Option<Instant>,
    /// etcd's member count (from its member list at the last sync that asked): only a
    /// one-member etcd's lack of a leader can the prober prove. Unknown until asked: a
    /// crowd's node asks only with a late keep-alive's question or once it runs a round
    /// ([`Outage::count_members_at`]).
    members: Option<usize>,
    /// When a crowd's node that runs its first round asks etcd's member count.
    count_at: Option<Instant>,
    probing: bool,
    /// The look is held until then: etcd was asked about the lease, and a slow etcd
    /// that answers needs no look (`Outage::hold_look`).
    look_held_until: Option<Instant>,
    /// etcd said the lease stands since the look began: it has a leader, and the look
    /// for proof that it has none is moot until the trouble is over.
    spoke_for_lease: bool,
    /// The connection's member failed (or its requests went unanswered): pin another,
    /// or a fresh connection, at the next sync.
    reselect: bool,
    /// When etcd last said anything to this session.
    heard_at: Option<Instant>,
    /// Overloaded answers in a row, and since when: the next retry waits longer, and a
    /// busy spell longer than the outage bound ends the session as an outage would.
    slowed: u32,
    slowed_since: Option<Instant>,
}

impl Outage {
    /// etcd failed at `now`: how long the outage has lasted, counted from its first
    /// failure.
    pub(super) fn failed(&mut self, now: Instant) -> Duration {
        now - *self.since.get_or_insert(now)
    }

    /// The wait before the next sync after a failure (from 100 ms, doubling, at most a
    /// quarter TTL and 2 s: well within the fencing margin, since a refused probe keeps
    /// the lease safe only for a TTL from when it was sent); counts the failure.
    pub(super) fn next_backoff(&mut self, ttl: Duration) -> Duration {
        let delay = crate::backoff::nth(FIRST_RETRY, LAST_RETRY.min(ttl / 4), self.failures);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// The watches were left without an error: the backoff starts over.
    pub(super) fn left_cleanly(&mut self) {
        self.failures = 0;
    }

    /// etcd answers again (the watches are open).
    pub(super) fn over(&mut self) {
        self.since = None;
    }

    /// etcd told its member count.
    pub(super) fn members(&mut self, n: usize) {
        self.members = Some(n);
        self.count_at = None;
    }

    /// etcd is known to have one member.
    pub(super) fn single_member(&self) -> bool {
        self.members == Some(1)
    }

    /// etcd may have one member: known to, or not asked yet. A forming node (no workers
    /// to fence) asks about its lease on that alone, and learns the count with the
    /// question ([`Outage::members_known`]).
    pub(super) fn may_be_single(&self) -> bool {
        self.members.is_none_or(|n| n == 1)
    }

    pub(super) fn members_known(&self) -> bool {
        self.members.is_some()
    }

    /// Ask the member count at `at`, unless it is known by then.
    pub(super) fn count_members_at(&mut self, at: Instant) {
        if self.members.is_none() {
            self.count_at = Some(at);
        }
    }

    /// When the member count is to be asked, if it is.
    pub(super) fn count_due(&self) -> Option<Instant> {
        self.count_at
    }

    /// The count's question is on its way.
    pub(super) fn counting(&mut self) {
        self.count_at = None;
    }

    pub(super) fn probing(&self) -> bool {
        self.probing
    }

    /// Whether the prober is to look; returns whether the prober's state changed. New
    /// trouble (a lost connection) after etcd spoke for the lease looks again: etcd may
    /// have gone down since.
    pub(super) fn probe(&mut self, on: bool) -> bool {
        let was = self.looks();
        self.probing = on;
        self.spoke_for_lease = false;
        self.look_held_until = None;
        was != self.looks()
    }

    /// In trouble, but the look waits until `until` for etcd's answer about the lease
    /// (each look is two fresh connections and a status call; an etcd that answers has
    /// a leader, and the look is moot).
    pub(super) fn hold_look(&mut self, until: Instant) {
        self.probing = true;
        self.spoke_for_lease = false;
        self.look_held_until = Some(until);
    }

    /// When a held look is to start, if one is held.
    pub(super) fn look_held_until(&self) -> Option<Instant> {
        self.look_held_until
    }

    /// Whether a held look starts at `now` (its time came and etcd has not spoken).
    pub(super) fn held_look_starts(&mut self, now: Instant) -> bool {
        if self.look_held_until.is_none_or(|at| at > now) {
            return false;
        }
        self.look_held_until = None;
        self.looks()
    }

    /// etcd said the lease stands while this session was in trouble: whether a running
    /// prober is to stop (a held look is dropped; it never started).
    pub(super) fn lease_spoken_for(&mut self) -> bool {
        let ran = self.looks();
        if self.probing {
            self.spoke_for_lease = true;
            self.look_held_until = None;
        }
        ran
    }

    /// Whether the prober should run: looking, no longer held, and etcd has not spoken
    /// for the lease.
    pub(super) fn looks(&self) -> bool {
        self.probing && !self.spoke_for_lease && self.look_held_until.is_none()
    }

    /// Whether the next sync pins another member (or a fresh connection) first.
    pub(super) fn reselect(&self) -> bool {
        self.reselect
    }

    pub(super) fn set_reselect(&mut self, reselect: bool) {
        self.reselect = reselect;
    }

    /// etcd said something at `now`.
    pub(super) fn heard(&mut self, now: Instant) {
        self.heard_at = Some(now);
    }

    pub(super) fn heard_at(&self) -> Option<Instant> {
        self.heard_at
    }

    /// etcd answered a request: any busy spell is over.
    pub(super) fn keeps_up(&mut self) {
        (self.slowed, self.slowed_since) = (0, None);
    }

    /// Since when etcd has been too busy, or `now` if it is not.
    pub(super) fn slowed_since(&self, now: Instant) -> Instant {
        self.slowed_since.unwrap_or(now)
    }

    /// etcd was too busy for a request at `now`: how many times in a row before this one,
    /// and how long the spell has lasted.
    pub(super) fn slowed(&mut self, now: Instant) -> (u32, Duration) {
        let busy_for = now - *self.slowed_since.get_or_insert(now);
        let before = self.slowed;
        self.slowed = self.slowed.saturating_add(1);
        (before, busy_for)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run's nodes ask within half a TTL of half a TTL after their first round
    /// (as before); a crowd of 20,000 over 40 s from then, at most about 500 a second.
    #[test]
    fn a_crowds_member_count_questions_come_at_about_500_a_second_from_half_a_ttl() {
        let ttl = Duration::from_secs(5);
        let delays = |max_nodes: u32| -> Vec<Duration> {
            (0..max_nodes)
                .map(|i| count_delay(&format!("sim-{i:05}"), max_nodes, ttl))
                .collect()
        };
        for d in delays(8) {
            assert!(d >= ttl / 2 && d < ttl, "{d:?}");
        }
        let crowd = delays(20_000);
        assert!(
            crowd
                .iter()
                .all(|d| *d >= ttl / 2 && *d < ttl / 2 + Duration::from_secs(40))
        );
        assert!(crowd.iter().any(|d| *d > ttl / 2 + Duration::from_secs(35)));
        let mut per_second = [0u32; 43];
        for d in &crowd {
            per_second[d.as_secs() as usize] += 1;
        }
        let busiest = per_second.iter().max().copied().unwrap_or(0);
        assert!(busiest <= 650, "{busiest} in one second: {per_second:?}");
    }
}
