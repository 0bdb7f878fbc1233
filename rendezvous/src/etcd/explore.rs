//! Every interleaving of a small world, checked: three agents, one etcd, and a handful of
//! faults, driven through the real pure parts of the protocol — the coordinator's
//! [`Coordinator::observe`] (with [`crate::seal::decide`] and [`crate::pace`]), the
//! waiting agent's `step` and the running agent's [`detect`](super::detect), over a
//! [`View`] — by an exhaustive depth-first search of our own (no model-checking crate: the
//! state is a few maps, and a search we wrote ourselves can call the real functions as
//! they are).
//!
//! The model is synchronous: every agent sees etcd as it is after each event, and any
//! event may come next — the order of events is the only nondeterminism, and the search
//! tries them all. Time stands still except when the coordinator waits for a deadline
//! (the straggler timeout, a pace hold): then one event moves the clock there. Events:
//!
//! * the coordinator (on node a) observes and seals, naming the master in the seal when a
//!   is the round's rank 0; otherwise rank 0 publishes it;
//! * an agent acts on what it sees: a waiting one joins the round (or comes back for the
//!   next when it broke before it started, or it is a spare), a running one stops its
//!   workers when its round is over; an agent registers for the round it wants;
//! * a running agent's ring watcher finds its neighbour dead and revokes the lease the
//!   neighbour last announced; an agent whose lease was revoked under it renews it;
//! * faults, from a budget: a worker fails (a failure report); an agent's lease expires
//!   while it is frozen (its key goes) and later it thaws (a new lease: the next
//!   incarnation, its registration written again); an agent is killed for good; the store
//!   restarts empty, alone or with the agent that served it (every live agent renews its
//!   lease and registers again, in any order; the running round is put back).
//!
//! Checked after every event: a sealed round lists distinct members, between `min` and
//! `max` of them; a round that keeps a member of the one before never lowers the restart
//! count; no live agent is evicted; and no loop: at most [`SEALS_PER_CHANGE`] rounds are
//! sealed between two faults. A violation panics with the trace of events that led to it.
//!
//! Two switches put back two faults seen outside testing, and the search finds both by
//! itself: departures read without incarnations (an agent frozen past its lease read its
//! own old registration's departure as a loss in every later round, ~600 rounds a
//! second), and the old store (lease ids from 1 again after a restart, evictions
//! unchecked: a live agent evicted, the root of a c10d run whose host died with the store
//! it served).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{Hash, Hasher};
use std::time::Instant;

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::coordinator::{Coordinator, round_record};
use super::view::{MemberEntry, RoundEntry, View};
use crate::seal::{SealConfig, SealDecision};

mod events;
#[cfg(test)]
mod tests;

/// Rounds sealed between two faults before the search calls it a loop: a membership
/// change costs at most three rounds, so more without a new fault is one.
const SEALS_PER_CHANGE: u32 = 3;
const NODES: [&str; 3] = ["a", "b", "c"];

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Phase {
    /// Waiting for round `wants` or later; `registered` once its registration says so.
    Waiting {
        wants: u64,
        registered: bool,
        published: Option<u64>,
    },
    Running(u64),
    /// Frozen: its lease expired; it does nothing until it thaws.
    Frozen(Box<Phase>),
    Dead,
}

#[derive(Debug, Clone)]
struct World {
    now: Instant,
    rev: i64,
    view: View,
    /// Each agent's phase, the round it holds, its incarnation and when it began waiting.
    phases: BTreeMap<&'static str, Phase>,
    held: BTreeMap<&'static str, v1::Round>,
    incarnation: BTreeMap<&'static str, u64>,
    since: BTreeMap<&'static str, Instant>,
    coordinator: Coordinator,
    faults_left: u32,
    sealed_since_fault: u32,
    trace: Vec<String>,
    /// Each agent's lease, and the next id the store grants.
    lease: BTreeMap<&'static str, i64>,
    next_lease: i64,
    /// Lease ids revoked since the store's last start.
    revoked: BTreeSet<i64>,
    /// Agents whose lease someone else revoked: they renew it (the next incarnation).
    lease_lost: BTreeSet<&'static str>,
    /// The store and ring watcher as they were before a live agent was evicted: a store restarted empty grants lease ids
    /// from 1 again, and a ring watcher revokes the id its round names without checking it
    /// still holds the dead node's registration.
    old_store: bool,
    /// A live agent whose key an eviction deleted (a violation).
    evicted_live: Option<&'static str>,
}

fn member(node: &str, wants: u64, incarnation: u64, lease: i64) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: SCHEMA_VERSION,
        node_id: node.into(),
        addr: format!("{node}.local"),
        local_world_size: 1,
        wants_round: wants,
        status_addr: format!("{node}.local:29450"),
        lease,
        incarnation,
        ..Default::default()
    })
}

impl World {
    /// Three agents running round 0 together.
    fn new(cfg: SealConfig, faults: u32, old_store: bool) -> Self {
        let now = Instant::now();
        let mut view = View {
            connected: true,
            ..View::default()
        };
        let mut rev = 0;
        for (i, node) in NODES.iter().enumerate() {
            rev += 1;
            let record = member(node, 0, 1, i as i64 + 1);
            view.members.insert(
                (*node).into(),
                MemberEntry {
                    record,
                    create_rev: rev,
                },
            );
        }
        let mut coordinator = Coordinator::new(cfg, now);
        let obs = coordinator.observe(now, &view);
        let SealDecision::Seal(p) = &obs.decision else {
            panic!("three of max three seal at once: {}", obs.reason)
        };
        let record = round_record(p, &view, &obs.reason, 0, std::time::Duration::ZERO);
        coordinator.sealed(now, 0, &obs.reason);
        rev += 1;
        view.round = Some(RoundEntry {
            record: record.clone().into(),
            mod_rev: rev,
        });
        view.master = Some(master(0));
        Self {
            now,
            rev,
            view,
            phases: NODES.iter().map(|n| (*n, Phase::Running(0))).collect(),
            held: NODES.iter().map(|n| (*n, record.clone())).collect(),
            incarnation: NODES.iter().map(|n| (*n, 1)).collect(),
            since: NODES.iter().map(|n| (*n, now)).collect(),
            coordinator,
            faults_left: faults,
            sealed_since_fault: 0,
            trace: Vec::new(),
            lease: NODES
                .iter()
                .enumerate()
                .map(|(i, n)| (*n, i as i64 + 1))
                .collect(),
            next_lease: NODES.len() as i64 + 1,
            revoked: BTreeSet::new(),
            lease_lost: BTreeSet::new(),
            old_store,
            evicted_live: None,
        }
    }

    /// What the state is, for pruning interleavings that meet again (time and trace
    /// aside: equal states at equal depth explore alike).
    fn key(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}|{:?}|{:?}|{}",
            self.view.members,
            self.view.round.as_ref().map(|r| &r.record),
            self.view.master,
            self.view.failures,
            self.view.departed.keys().collect::<Vec<_>>(),
            self.phases,
            self.incarnation,
            self.faults_left,
            self.sealed_since_fault,
            self.lease,
            self.lease_lost,
            self.next_lease
        )
        .hash(&mut h);
        h.finish()
    }

    fn fault(&mut self) {
        self.faults_left -= 1;
        self.sealed_since_fault = 0;
    }

    fn delete_member(&mut self, node: &str) {
        if let Some(m) = self.view.members.remove(node) {
            self.rev += 1;
            self.view.depart(node, m.record.incarnation, self.now);
        }
    }

    /// A new lease for `node`: the next incarnation.
    fn renew(&mut self, node: &'static str) {
        *self.incarnation.get_mut(node).unwrap() += 1;
        self.lease.insert(node, self.next_lease);
        self.next_lease += 1;
        self.lease_lost.remove(node);
    }

    fn register(&mut self, node: &'static str, wants: u64) {
        let inc = self.incarnation[node];
        let lease = self.lease[node];
        self.rev += 1;
        let create_rev = match self.view.members.get(node) {
            Some(m) if m.record.incarnation == inc => m.create_rev,
            _ => self.rev,
        };
        self.view.members.insert(
            node.into(),
            MemberEntry {
                record: member(node, wants, inc, lease),
                create_rev,
            },
        );
    }

    fn check(&self, cfg: &SealConfig, before: Option<&v1::Round>) {
        let fail = |why: String| panic!("{why}\ntrace:\n  {}", self.trace.join("\n  "));
        if let Some(v) = self.evicted_live {
            fail(format!("a ring watcher evicted {v}, which is alive"));
        }
        if let Some(r) = self.view.round.as_ref().map(|r| &r.record) {
            let ids: BTreeSet<&str> = r.members.iter().map(|m| m.node_id.as_str()).collect();
            if ids.len() != r.members.len() {
                fail(format!("round {} lists a node twice", r.number));
            }
            let n = r.members.len() as u32;
            if n < cfg.min_nodes || n > cfg.max_nodes {
                fail(format!("round {} has {n} members", r.number));
            }
            if let Some(b) = before.filter(|b| b.number < r.number) {
                let kept = b.members.iter().any(|m| ids.contains(m.node_id.as_str()));
                if kept && r.restart_count < b.restart_count {
                    fail(format!(
                        "round {} lowered the restart count from {} to {}",
                        r.number, b.restart_count, r.restart_count
                    ));
                }
            }
        }
        if self.sealed_since_fault > SEALS_PER_CHANGE {
            fail(format!(
                "a loop: {} rounds sealed since the last fault",
                self.sealed_since_fault
            ));
        }
    }
}

/// The round a phase's registration asks for (what the session writes again).
fn wants_of(phase: &Phase) -> u64 {
    match phase {
        Phase::Waiting { wants, .. } => *wants,
        Phase::Running(r) => *r,
        Phase::Frozen(before) => wants_of(before),
        Phase::Dead => 0,
    }
}

fn waiting(wants: u64) -> Phase {
    Phase::Waiting {
        wants,
        registered: false,
        published: None,
    }
}

fn master(round: u64) -> v1::Master {
    v1::Master {
        schema: SCHEMA_VERSION,
        round,
        addr: "a.local".into(),
        port: 29500,
    }
}

/// Explores every interleaving up to `depth` events with `faults` faults; returns the
/// number of states checked.
fn explore(cfg: SealConfig, faults: u32, depth: usize, old_store: bool) -> usize {
    let mut seen = HashSet::new();
    let mut stack = vec![World::new(cfg, faults, old_store)];
    let mut states = 0;
    while let Some(w) = stack.pop() {
        states += 1;
        if w.trace.len() >= depth {
            continue;
        }
        let before = w.view.round.as_ref().map(|r| (*r.record).clone());
        for next in w.next() {
            next.check(&cfg, before.as_ref());
            if seen.insert((next.key(), next.trace.len())) {
                stack.push(next);
            }
        }
    }
    states
}
