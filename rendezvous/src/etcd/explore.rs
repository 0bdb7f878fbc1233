//! Every interleaving of a small world, checked: three agents, one etcd, and a handful of
//! faults, driven through the real pure parts of the protocol — the coordinator's
//! [`Coordinator::observe`] (with [`crate::seal::decide`] and [`crate::pace`]), the
//! waiting agent's `step` and the running agent's [`detect`], over a [`View`] — by an
//! exhaustive depth-first search of our own (no model-checking crate: the state is a few
//! maps, and a search we wrote ourselves can call the real functions as they are).
//!
//! The model is synchronous: every agent sees etcd as it is after each event, and any
//! event may come next — the order of events is the only nondeterminism, and the search
//! tries them all. Time stands still except when the coordinator waits for a deadline
//! (the straggler timeout, a pace hold): then one event moves the clock there. Events:
//!
//! * the coordinator observes and seals; rank 0 publishes the master;
//! * an agent acts on what it sees: a waiting one joins the round (or comes back for the
//!   next when it broke before it started, or it is a spare), a running one stops its
//!   workers when its round is over; an agent registers for the round it wants;
//! * a running agent's ring watcher finds its neighbour dead and revokes the lease the
//!   round names for it; an agent whose lease was revoked under it renews it;
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
//! Two switches put back what issue 26 fixed, and the search finds both reproductions by
//! itself: departures read without incarnations (the frozen agent's loop), and the old
//! store (lease ids from 1 again after a restart, evictions unchecked: a live agent
//! evicted, the c10d reproduction's root).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::coordinator::{Coordinator, round_record};
use super::view::{MemberEntry, RoundEntry, View};
use super::{Step, detect, step};
use crate::Change;
use crate::seal::{SealConfig, SealDecision};

/// Rounds sealed between two faults before the search calls it a loop (the issue 27
/// invariant: a membership change costs at most three rounds).
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
    /// The store and ring watcher before issue 26: a store restarted empty grants lease ids
    /// from 1 again, and a ring watcher revokes the id its round names without checking it
    /// still holds the dead node's registration.
    old_store: bool,
    /// A live agent whose key an eviction deleted (a violation).
    evicted_live: Option<&'static str>,
}

fn member(node: &str, wants: u64, incarnation: u64, lease: i64) -> v1::Member {
    v1::Member {
        schema: SCHEMA_VERSION,
        node_id: node.into(),
        addr: format!("{node}.local"),
        local_world_size: 1,
        wants_round: wants,
        status_addr: format!("{node}.local:29450"),
        lease,
        incarnation,
    }
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
        let record = round_record(p, &view, &obs.reason, 0);
        coordinator.sealed(now, 0, &obs.reason);
        rev += 1;
        view.round = Some(RoundEntry {
            record: record.clone(),
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

    /// The events possible now, each with the world after it.
    fn next(&self) -> Vec<World> {
        let mut out = Vec::new();
        let mut push = |mut w: World, what: String| {
            w.trace.push(what);
            out.push(w);
        };
        // The coordinator looks (only when it would do something, or the search would
        // spin on a no-op).
        let mut c = self.coordinator.clone();
        let obs = c.observe(self.now, &self.view);
        match &obs.decision {
            SealDecision::Seal(p) => {
                let mut w = self.clone();
                w.coordinator = c.clone();
                let record = round_record(p, &w.view, &obs.reason, 0);
                w.rev += 1;
                w.view.round = Some(RoundEntry {
                    record,
                    mod_rev: w.rev,
                });
                w.view.master = None;
                w.coordinator.sealed(w.now, p.number, &obs.reason);
                w.sealed_since_fault += 1;
                push(
                    w,
                    format!("seal round {} {:?}: {}", p.number, p.members, obs.reason),
                );
            }
            SealDecision::Wait {
                recheck_at: Some(at),
            }
            | SealDecision::Reforming {
                recheck_at: Some(at),
            } if *at > self.now => {
                let mut w = self.clone();
                w.now = *at;
                push(
                    w,
                    format!("time passes to the coordinator's recheck ({})", obs.reason),
                );
            }
            _ => {}
        }
        for node in NODES {
            let phase = &self.phases[node];
            match phase {
                Phase::Waiting {
                    wants,
                    registered: false,
                    ..
                } => {
                    let mut w = self.clone();
                    w.register(node, *wants);
                    let Some(Phase::Waiting { registered, .. }) = w.phases.get_mut(node) else {
                        unreachable!()
                    };
                    *registered = true;
                    push(w, format!("{node} registers for round {wants}"));
                }
                Phase::Waiting {
                    wants,
                    registered: true,
                    published,
                } => {
                    let s = step(&self.view, node, 1, *wants, *published, self.since[node]);
                    let mut w = self.clone();
                    match s {
                        Ok(Step::Done(done)) => {
                            let (record, _) = *done;
                            w.phases.insert(node, Phase::Running(record.number));
                            w.held.insert(node, record.clone());
                            push(w, format!("{node} starts round {}", record.number));
                        }
                        Ok(Step::PublishMaster { round }) => {
                            w.view.master = Some(master(round));
                            w.rev += 1;
                            w.phases.insert(
                                node,
                                Phase::Waiting {
                                    wants: *wants,
                                    registered: true,
                                    published: Some(round),
                                },
                            );
                            push(w, format!("{node} publishes the master of round {round}"));
                        }
                        Ok(Step::Broken { next, change }) => {
                            w.phases.insert(node, waiting(next));
                            push(
                                w,
                                format!(
                                    "{node}: round {} broke before it started ({change:?})",
                                    next - 1
                                ),
                            );
                        }
                        Ok(Step::Spare { next }) => {
                            w.phases.insert(node, waiting(next));
                            push(w, format!("{node} waits as a spare for round {next}"));
                        }
                        Ok(Step::Wait) => {}
                        Err(e) => panic!("{node}: {e}\n{}", self.trace.join("\n")),
                    }
                }
                Phase::Running(_) => {
                    let held = &self.held[node];
                    if let Some(change) = detect(&self.view, held, node, self.since[node]) {
                        let mut w = self.clone();
                        if change == (Change::MemberLost { node: node.into() }) {
                            // It lost its place by its own fault: charged (as the agent does).
                            w.view.failures.insert(held.number);
                        }
                        w.phases.insert(node, waiting(held.number + 1));
                        w.since.insert(node, w.now);
                        push(w, format!("{node} stops its workers: {change:?}"));
                    }
                    if self.faults_left > 0 {
                        let mut w = self.clone();
                        w.fault();
                        w.view.failures.insert(held.number);
                        w.rev += 1;
                        w.phases.insert(node, waiting(held.number + 1));
                        w.since.insert(node, w.now);
                        push(
                            w,
                            format!("FAULT {node}'s worker fails in round {}", held.number),
                        );
                    }
                }
                Phase::Frozen(before) => {
                    // Thaws: a new lease, the next incarnation, its last registration
                    // written again (as the session does).
                    // The other half of the freeze: a change, but no new fault.
                    let mut w = self.clone();
                    w.sealed_since_fault = 0;
                    w.renew(node);
                    w.register(node, wants_of(before));
                    w.phases.insert(node, (**before).clone());
                    push(w, format!("FAULT {node} thaws on a new lease"));
                }
                Phase::Dead => {}
            }
            if self.lease_lost.contains(node) && !matches!(phase, Phase::Frozen(_) | Phase::Dead) {
                // Its lease was revoked under it: the session grants a new one and writes
                // its registration again.
                let mut w = self.clone();
                w.sealed_since_fault = 0;
                w.renew(node);
                w.register(node, wants_of(phase));
                push(
                    w,
                    format!("{node} finds its lease revoked and registers on a new one"),
                );
            }
            if let Some(w) = self.evict_neighbour(node) {
                let what = w.trace.last().cloned().unwrap_or_default();
                let mut w = w;
                w.trace.pop();
                push(w, what);
            }
            if self.faults_left > 0 && !matches!(phase, Phase::Frozen(_) | Phase::Dead) {
                let mut w = self.clone();
                w.fault();
                w.delete_member(node);
                w.phases
                    .insert(node, Phase::Frozen(Box::new(phase.clone())));
                push(
                    w,
                    format!("FAULT {node} frozen past its lease (its key goes)"),
                );
                let mut w = self.clone();
                w.fault();
                w.delete_member(node);
                w.phases.insert(node, Phase::Dead);
                push(w, format!("FAULT {node} killed"));
            }
        }
        if self.faults_left > 0 {
            for first in 0..NODES.len() {
                out.push(self.store_restart(None, first));
                for victim in NODES {
                    if matches!(self.phases[victim], Phase::Running(_)) {
                        out.push(self.store_restart(Some(victim), first));
                    }
                }
            }
        }
        out
    }

    /// `node`'s ring watcher proves its neighbour in the round it runs dead (a refused
    /// connection) and revokes the lease the round names for it, as `Command::Evict` does.
    fn evict_neighbour(&self, node: &'static str) -> Option<World> {
        let Phase::Running(_) = self.phases[node] else {
            return None;
        };
        let round = &self.held[node];
        let target = super::liveness::neighbour(round, node)?;
        let dead = matches!(self.phases.get(target.node_id.as_str()), Some(Phase::Dead));
        // It left (or its lease went) before the proof came: nothing to add.
        if !dead || self.view.departed.contains_key(&target.node_id) {
            return None;
        }
        let lease = target.lease;
        if self.revoked.contains(&lease) {
            return None;
        }
        let holds = self
            .view
            .members
            .get(&target.node_id)
            .is_some_and(|m| m.record.lease == lease);
        if !self.old_store && !holds {
            return None;
        }
        let mut w = self.clone();
        w.revoked.insert(lease);
        let victim = w
            .view
            .members
            .iter()
            .find(|(_, m)| m.record.lease == lease)
            .map(|(id, _)| id.clone());
        let mut what = format!("{node} evicts {} (lease {lease})", target.node_id);
        if let Some(v) = victim {
            w.delete_member(&v);
            let v = NODES.into_iter().find(|n| *n == v).unwrap();
            if !matches!(w.phases[v], Phase::Dead) {
                w.lease_lost.insert(v);
                w.evicted_live = Some(v);
            }
            what += &format!(": deletes {v}'s key");
        }
        w.trace.push(what);
        Some(w)
    }

    /// The store restarts empty (`victim`, when given, was serving it and died with it):
    /// every agent's lease and key are gone, no delete was seen; each live agent grants a
    /// new lease and registers again, in the order `first` comes first, and the members of
    /// the running round put it back.
    fn store_restart(&self, victim: Option<&'static str>, first: usize) -> World {
        let mut w = self.clone();
        w.fault();
        if let Some(v) = victim {
            w.phases.insert(v, Phase::Dead);
        }
        w.view.members.clear();
        w.view.master = None;
        w.view.failures.clear();
        w.revoked.clear();
        w.rev += 1;
        if w.old_store {
            w.next_lease = 1;
        }
        let running = NODES
            .iter()
            .filter(|n| matches!(w.phases[**n], Phase::Running(_)))
            .map(|n| w.held[*n].clone())
            .max_by_key(|r| r.number);
        w.view.round = running.map(|record| RoundEntry {
            record,
            mod_rev: w.rev,
        });
        for k in 0..NODES.len() {
            let node = NODES[(first + k) % NODES.len()];
            let phase = w.phases[node].clone();
            if matches!(phase, Phase::Dead | Phase::Frozen(_)) {
                continue;
            }
            w.renew(node);
            w.register(node, wants_of(&phase));
        }
        w.trace.push(match victim {
            Some(v) => format!("FAULT {v} dies with the store it serves; the store restarts empty ({} reconnects first)", NODES[first]),
            None => format!("FAULT the store restarts empty ({} reconnects first)", NODES[first]),
        });
        w
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
        let before = w.view.round.as_ref().map(|r| r.record.clone());
        for next in w.next() {
            next.check(&cfg, before.as_ref());
            if seen.insert((next.key(), next.trace.len())) {
                stack.push(next);
            }
        }
    }
    states
}

/// Events per interleaving.
const DEPTH: usize = 16;

fn cfg() -> SealConfig {
    SealConfig {
        min_nodes: 1,
        max_nodes: 3,
        last_call: Duration::from_secs(30),
        straggler_timeout: Duration::from_secs(10),
    }
}

#[test]
fn every_interleaving_of_three_agents_and_two_faults_holds_the_invariants() {
    let states = explore(cfg(), 2, DEPTH, false);
    eprintln!("explored {states} states");
    assert!(states > 1000, "the search explored only {states} states");
}

/// With departures read as before issue 26 (any departure of the node, whatever its
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

/// With the store and ring watcher as before issue 26 (a store restarted empty grants lease
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
