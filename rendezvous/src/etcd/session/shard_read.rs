//! A crowd's reads of its first placed round, spread out. Every member of a placed round
//! reads its own shard when the header comes, and the header comes to all at once: at
//! 10,000 nodes on two cores that was 10,000 reads and as many answers to decode in the
//! same two or three seconds, on top of 6,000 renewals a second. The renewals came late,
//! the members whose renewals were late asked etcd about their leases (thousands of
//! questions more), and in about half the runs leases expired there and the formation
//! collapsed. A member of a crowd's first round reads its shard at a moment drawn from its
//! id within [`shard_spread`] of the header instead (at 10,000 nodes on etcd 3.5, the
//! same hours: 7 runs of 10 formed, against 8 of 19 with the other changes of that
//! session and the reads at once or spread over one second, and 11 of 18 for the build
//! before; too few runs to tell those rates apart, docs/bench/agents-scale.md); a
//! re-form is not spread (its members hold the round before and copy what they need,
//! and a re-form must not wait), nor the read of a node that holds a round.
//!
//! Pure: [`shard_spread`] and [`shard_read_delay`]; the machine's part is
//! [`Machine::read_shard_in_turn`], and the timer's in `phases.rs`.

use std::time::Duration;

use super::admission::place_in_crowd;
use super::machine::Machine;
use super::sync::Todo;

/// The spread grows by this much per node of the run: 10,000 reads a second. A quarter
/// of a millisecond (4,000 a second, 2.5 s at 10,000) was chosen when a seal wrote its
/// shards at once and read them linearizably; with shards of 16 members written a commit
/// apart and read serializably, a tenth of a millisecond formed 10,000 nodes sooner in 7
/// of 9 interleaved cycles (about a second less from the header to the last member's
/// rank), and 15 runs of 15 formed with no lease lost (docs/bench/agents-scale.md,
/// twenty-fifth section).
const PER_NODE: Duration = Duration::from_micros(100);

/// How long the reads of a run of at most `max_nodes` with lease TTL `ttl` are spread
/// over: a tenth of a millisecond a node (1 s at 10,000), at most half the TTL. What it
/// costs is that long at most, once, at the first round; what it spares is the seal's
/// reads all in the moment renewals are due.
pub fn shard_spread(max_nodes: u32, ttl: Duration) -> Duration {
    (PER_NODE * max_nodes).min(ttl / 2)
}

/// How long after the header node `node_id` reads its shard.
pub fn shard_read_delay(node_id: &str, max_nodes: u32, ttl: Duration) -> Duration {
    shard_spread(max_nodes, ttl).mul_f64(place_in_crowd(node_id))
}

impl Machine {
    /// The round wanted is to be read (its shard, its roster): now, or, for a member of a
    /// crowd's first placed round that reads its one shard, at its moment in the spread.
    pub(super) fn read_shard_in_turn(&mut self) {
        // A node that holds a round (a spare of the first, placed into a re-form) reads
        // at once: the re-form waits for it.
        let placed_first = self.cfg.crowd
            && !self.admission.formation_over()
            && self.view.round.is_none()
            && self.watches.control_only()
            && self.view.placing.as_ref().map(|p| p.record.number) == self.view.round_wanted;
        // Drawn only then: this runs at every batch of events while a round is wanted.
        let delay = placed_first
            .then(|| shard_read_delay(&self.cfg.node_id, self.cfg.seal.max_nodes, self.cfg.ttl))
            .filter(|d| !d.is_zero());
        let Some(delay) = delay else {
            // A read due later is this one.
            self.shard_read_at = None;
            return self.flight.then(Todo::ReadRoster);
        };
        let at = self.now + delay;
        self.shard_read_at.get_or_insert(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spread_is_a_tenth_of_a_millisecond_a_node_and_at_most_half_the_ttl() {
        let ttl = Duration::from_secs(5);
        assert_eq!(shard_spread(1_000, ttl), Duration::from_millis(100));
        assert_eq!(shard_spread(20_000, ttl), Duration::from_secs(2));
        assert_eq!(shard_spread(30_000, ttl), ttl / 2);
        assert_eq!(
            shard_spread(20_000, Duration::from_secs(3)),
            Duration::from_millis(1_500)
        );
        let spread = shard_spread(10_000, ttl);
        let delays: Vec<Duration> = (0..10_000)
            .map(|i| shard_read_delay(&format!("node-{i:05}"), 10_000, ttl))
            .collect();
        assert!(delays.iter().all(|d| *d <= spread));
        // Spread evenly: about a tenth of the crowd in each tenth of it.
        for tenth in 0..10u32 {
            let from = spread / 10 * tenth;
            let n = delays
                .iter()
                .filter(|d| **d >= from && **d < from + spread / 10)
                .count();
            assert!((800..=1_200).contains(&n), "{tenth}: {n}");
        }
    }
}
