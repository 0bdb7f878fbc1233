//! What a node waiting for a round tells the person who started it: what it waits for,
//! where, for how long, and what would end the wait. Logged every [`EVERY`] while it
//! waits, and, at the join timeout, the error's text. A pure function of what the node
//! knows, so the words are tested without an etcd.

use std::time::Duration;

use super::session::{CROWD, place_in_crowd};

/// How often a node that waits for a round says so.
pub const EVERY: Duration = Duration::from_secs(30);

/// In a run of more than [`CROWD`] nodes, about this many count the registrations.
pub const COUNTERS: u32 = 100;

/// Whether node `node_id` of a run of at most `max_nodes` counts the registrations for
/// its waiting line: every node of a run of up to [`CROWD`], about [`COUNTERS`] of a
/// larger one. etcd counts a range key by key, so each count is O(N): at 10,000 nodes
/// waiting a count from each every [`EVERY`] was 333 such reads a second on an etcd
/// already behind (86,707 of them "took too long" in one formation that never ended).
/// And the counters are the crowd's first places, which start waiting together: at
/// 10,000 nodes on etcd 3.5 a thousand of them counting in the same second, 30 s into a
/// formation, took etcd 8 ms of CPU each (28% of its CPU in the seconds after), and the
/// formations that reached that moment collapsed.
pub fn counts_registrations(node_id: &str, max_nodes: u32) -> bool {
    max_nodes <= CROWD || place_in_crowd(node_id) < f64::from(COUNTERS) / f64::from(max_nodes)
}

/// What a waiting node knows.
#[derive(Debug, Clone)]
pub struct Waiting<'a> {
    pub run_id: &'a str,
    /// `etcd`, or `the c10d store`.
    pub store: &'a str,
    pub endpoints: String,
    pub min_nodes: u32,
    pub max_nodes: u32,
    /// Registrations in the store, this node's included; `None` when they could not be
    /// counted (the store did not answer) or were not ([`counts_registrations`]).
    pub registered: Option<u64>,
    /// Whether this node counts them.
    pub counting: bool,
    /// The run's current round, which this node is not in: its number and size.
    pub round: Option<(u64, usize)>,
    /// Whether the node's session is connected to the store.
    pub connected: bool,
}

impl Waiting<'_> {
    /// The line logged while waiting, `waited` after the wait began.
    pub fn progress(&self, waited: Duration) -> String {
        let (what, fix) = self.parts();
        format!("{what} ({}) for {}; {fix}", self.place(), words(waited))
    }

    /// The error's text when the wait ends at the join timeout.
    pub fn gave_up(&self, join_timeout: Duration) -> String {
        let (what, fix) = self.parts();
        format!(
            "no round formed within join_timeout ({}): {what} ({}); {fix}",
            words(join_timeout),
            self.place()
        )
    }

    fn place(&self) -> String {
        format!(
            "run '{}' on {} at {}",
            self.run_id, self.store, self.endpoints
        )
    }

    /// What the node waits for, and what would end the wait.
    fn parts(&self) -> (String, String) {
        let (min, max) = (self.min_nodes, self.max_nodes);
        let start_others = match self.store {
            "etcd" => "start the others with the same --rdzv-id",
            _ => "start the others with the same --rdzv-endpoint and --rdzv-id",
        };
        if !self.connected {
            return (
                "not connected to the rendezvous".into(),
                format!(
                    "the agent reconnects on its own: check that {} is up and reachable",
                    self.store
                ),
            );
        }
        match (self.registered, self.round) {
            (Some(n), _) if n < u64::from(min) => (
                format!("waiting for nodes: {n} of min {min} present"),
                format!("{start_others}, or lower --nnodes"),
            ),
            (_, Some((number, size))) if size >= max as usize => (
                format!("waiting as a spare: round {number} is full ({size} of max {max} nodes)"),
                "this node joins when a member leaves, or raise --nnodes MAX".into(),
            ),
            (_, Some((number, size))) => (
                format!("waiting to join: round {number} runs {size} of max {max} nodes"),
                "the coordinator admits this node at the next re-form".into(),
            ),
            (Some(n), None) => (
                format!("waiting for the first round: {n} nodes present (min {min}, max {max})"),
                "the coordinator seals it when --nnodes MAX are there or the last call ends (fsdp-agent status shows who registered)".into(),
            ),
            (None, None) if !self.counting => (
                format!(
                    "waiting for the first round (min {min}, max {max} nodes); in a run this \
                     large about {COUNTERS} of the nodes count the registrations, this one does not"
                ),
                format!("fsdp-agent status shows who registered: if fewer than MIN are, {start_others}, or lower --nnodes"),
            ),
            (None, None) => (
                format!("waiting for nodes (min {min}); the registrations could not be counted"),
                format!("{start_others}, or lower --nnodes"),
            ),
        }
    }
}

/// A duration as a person says it: `8 s`, `10 min`, `1 min 30 s`, `2 h 5 min`.
pub fn words(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        return format!("{} ms", d.as_millis());
    }
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    match (h, m, s) {
        (0, 0, s) => format!("{s} s"),
        (0, m, 0) => format!("{m} min"),
        (0, m, s) => format!("{m} min {s} s"),
        (h, 0, _) => format!("{h} h"),
        (h, m, _) => format!("{h} h {m} min"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alone() -> Waiting<'static> {
        Waiting {
            run_id: "job42",
            store: "etcd",
            endpoints: "host:2379".into(),
            min_nodes: 2,
            max_nodes: 2,
            registered: Some(1),
            counting: true,
            round: None,
            connected: true,
        }
    }

    #[test]
    fn one_node_of_two_says_the_count_the_place_and_the_fix() {
        assert_eq!(
            alone().progress(Duration::from_secs(30)),
            "waiting for nodes: 1 of min 2 present (run 'job42' on etcd at host:2379) for 30 s; \
             start the others with the same --rdzv-id, or lower --nnodes"
        );
        assert_eq!(
            alone().gave_up(Duration::from_secs(8)),
            "no round formed within join_timeout (8 s): waiting for nodes: 1 of min 2 present \
             (run 'job42' on etcd at host:2379); start the others with the same --rdzv-id, or lower --nnodes"
        );
    }

    #[test]
    fn c10d_names_its_endpoint_too() {
        let w = Waiting {
            store: "the c10d store",
            endpoints: "host0:29400".into(),
            ..alone()
        };
        let line = w.progress(Duration::from_secs(60));
        assert!(
            line.contains("on the c10d store at host0:29400) for 1 min;"),
            "{line}"
        );
        assert!(
            line.contains("same --rdzv-endpoint and --rdzv-id"),
            "{line}"
        );
    }

    #[test]
    fn a_spare_a_joiner_and_a_crowd_waiting_for_the_seal_each_say_what_they_wait_for() {
        let spare = Waiting {
            registered: Some(3),
            round: Some((4, 2)),
            ..alone()
        };
        assert!(
            spare
                .progress(EVERY)
                .starts_with("waiting as a spare: round 4 is full (2 of max 2 nodes)")
        );
        let joiner = Waiting {
            max_nodes: 4,
            ..spare.clone()
        };
        assert!(
            joiner
                .progress(EVERY)
                .starts_with("waiting to join: round 4 runs 2 of max 4 nodes")
        );
        let below_min = Waiting {
            registered: Some(1),
            ..joiner.clone()
        };
        assert!(
            below_min
                .progress(EVERY)
                .starts_with("waiting for nodes: 1 of min 2 present")
        );
        let sealing = Waiting {
            registered: Some(3),
            round: None,
            max_nodes: 4,
            ..alone()
        };
        assert!(
            sealing
                .progress(EVERY)
                .starts_with("waiting for the first round: 3 nodes present (min 2, max 4)")
        );
        let cut = Waiting {
            connected: false,
            ..alone()
        };
        assert!(
            cut.progress(EVERY)
                .starts_with("not connected to the rendezvous (run 'job42'")
        );
    }

    /// In a run of more than a crowd, about a hundred nodes count, each the same in every
    /// run; the others say so, and where to look instead.
    #[test]
    fn in_a_large_run_about_a_hundred_nodes_count_the_registrations() {
        let counting = |max: u32| {
            (0..max)
                .filter(|i| counts_registrations(&format!("node-{i:05}"), max))
                .count()
        };
        assert_eq!(counting(CROWD), CROWD as usize);
        for max in [2_000, 10_000, 20_000] {
            let n = counting(max);
            assert!((70..=130).contains(&n), "{max}: {n}");
        }
        // The larger the run, the fewer count, from the same draw: a node that counts
        // in a run of 20,000 counts in one of 10,000.
        for i in 0..20_000 {
            let id = format!("node-{i:05}");
            if counts_registrations(&id, 20_000) {
                assert!(counts_registrations(&id, 10_000), "{id}");
            }
        }
        let spared = Waiting {
            registered: None,
            counting: false,
            max_nodes: 10_000,
            ..alone()
        };
        let line = spared.progress(EVERY);
        assert!(
            line.starts_with(
                "waiting for the first round (min 2, max 10000 nodes); in a run this large about \
                 100 of the nodes count the registrations, this one does not"
            ),
            "{line}"
        );
        assert!(
            line.contains(
                "fsdp-agent status shows who registered: if fewer than MIN are, start the \
                 others with the same --rdzv-id, or lower --nnodes"
            ),
            "{line}"
        );
    }

    #[test]
    fn no_line_holds_rust_debug_text() {
        for w in [
            alone(),
            Waiting {
                registered: None,
                counting: false,
                ..alone()
            },
            Waiting {
                registered: None,
                ..alone()
            },
            Waiting {
                round: Some((1, 2)),
                registered: None,
                ..alone()
            },
        ] {
            for line in [w.progress(EVERY), w.gave_up(Duration::from_secs(600))] {
                for debug in ["Some(", "None", "Err(", "Ok("] {
                    assert!(!line.contains(debug), "{line}");
                }
            }
        }
    }

    #[test]
    fn durations_read_as_words() {
        let w = |s| words(Duration::from_secs(s));
        assert_eq!(w(8), "8 s");
        assert_eq!(w(600), "10 min");
        assert_eq!(w(90), "1 min 30 s");
        assert_eq!(w(3600), "1 h");
        assert_eq!(w(7500), "2 h 5 min");
        assert_eq!(words(Duration::from_millis(250)), "250 ms");
    }
}
