//! The search over three agents: every interleaving holds the invariants, and with either
//! switch that puts back a fault seen outside testing, the search finds it.

use std::time::Duration;

use super::explore;
use crate::seal::SealConfig;

/// Events per interleaving.
const DEPTH: usize = 16;

fn cfg() -> SealConfig {
    SealConfig {
        min_nodes: 1,
        max_nodes: 3,
        last_call: Duration::from_secs(30),
        straggler_timeout: Duration::from_secs(10),
        segment_size: 1,
    }
}

#[test]
fn every_interleaving_of_three_agents_and_two_faults_holds_the_invariants() {
    let states = explore(cfg(), 2, DEPTH, false);
    eprintln!("explored {states} states");
    assert!(states > 1000, "the search explored only {states} states");
}

/// With departures read as they once were (any departure of the node, whatever its
/// incarnation), the search finds the frozen agent's loop by itself.
#[test]
fn without_incarnations_the_search_finds_the_frozen_agents_loop() {
    crate::switches::OLD_DEPARTURES.with(|old| old.set(true));
    let found = std::panic::catch_unwind(|| explore(cfg(), 2, DEPTH, false));
    crate::switches::OLD_DEPARTURES.with(|old| old.set(false));
    let err = found.expect_err("the search must find the loop");
    let text = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("a loop"), "{text}");
    assert!(text.contains("broke before it started"), "{text}");
}

/// With the store and ring watcher as they once were (a store restarted empty grants lease
/// ids from 1 again; an eviction revokes the id without checking it), the search finds the
/// c10d reproduction's root: the host dies with its store, the store comes back empty on
/// the restarted host, a survivor's ring watcher revokes the dead host's old lease id, and
/// that id is now a live agent's.
#[test]
fn with_the_old_store_the_search_finds_a_live_agent_evicted() {
    let found = std::panic::catch_unwind(|| explore(cfg(), 1, 6, true));
    let err = found.expect_err("the search must find the eviction");
    let text = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("evicted"), "{text}");
    assert!(text.contains("dies with the store"), "{text}");
}
