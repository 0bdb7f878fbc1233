//! Deterministic simulation of the etcd rendezvous: N agents, each the real
//! session [`Machine`](crate::etcd::session::Machine) and the agent loop's rendezvous
//! part (the real `step`, `detect` and `fence::decide`), over the embedded store's pure
//! etcd ([`fsdp_store::state`]), with a simulated clock and network and simulated
//! workers. A seeded schedule of faults — kills, SIGTERMs, freezes past the lease, cuts from etcd,
//! slow links, cancelled watches, failing and halting workers, etcd restarted with its
//! data or empty, a member of three lost, agents joining late and spares — runs to the
//! end, and the invariants (`check.rs`) are checked after every event. The same seed
//! gives the same run byte for byte; a failing one is shrunk to the fewest faults that
//! still fail it ([`shrink`]).
//!
//! * `faults.rs` — the schedule drawn from a seed;
//! * `world.rs` — the clock, the queue of events, the agents' processes;
//! * `net.rs` — the network between agents and etcd: ops, keep-alives, watch deliveries;
//! * `etcd.rs` — the session's ops against the pure store;
//! * `agent.rs` — a simulated agent and its workers;
//! * `check.rs` — the invariants;
//! * `run.rs` — one seed from start to end.
//!
//! `scripts/sim.sh` runs long campaigns; docs/simulation.md says what is modelled and
//! what is left to the real-process tests.

mod agent;
mod check;
// The session's tests apply its transactions to the simulator's store.
#[cfg(test)]
pub(crate) mod etcd;
#[cfg(not(test))]
mod etcd;
pub mod faults;
mod net;
mod rng;
mod run;
#[cfg(test)]
mod tests;
mod world;

use std::time::Duration;

pub use faults::Fault;
pub use run::{mix, run, run_schedule};

/// Fixes switched off, or a fence broken on purpose, to show the checker fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Switches {
    /// Departures read without incarnations, as before they named one: the frozen agent's
    /// loop.
    pub old_departures: bool,
    /// The store and ring watcher before their fix: lease ids from 1 again after an empty
    /// restart, and evictions that do not check the lease still holds the registration (a
    /// live agent evicted under a reused id).
    pub old_store: bool,
    /// Agents never fence themselves.
    pub broken_fence: bool,
    /// A round broken before it started never hands its charged restart to the loop.
    pub no_charge_in_broken: bool,
    /// Joining nodes add load as fast as they can (no spread, no pace, no lease kept
    /// alive before the watches, no question to etcd before a new lease).
    pub no_admission: bool,
}

impl Switches {
    /// Sets the switches on this thread (where the shipped code reads them).
    pub fn set(&self) {
        use crate::switches::*;
        OLD_DEPARTURES.with(|s| s.set(self.old_departures));
        OLD_EVICTIONS.with(|s| s.set(self.old_store));
        NEVER_FENCE.with(|s| s.set(self.broken_fence));
        NO_CHARGE_IN_BROKEN.with(|s| s.set(self.no_charge_in_broken));
        NO_ADMISSION.with(|s| s.set(self.no_admission));
    }
}

/// What a campaign runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub agents: usize,
    /// Agents started at once (the rest join through the schedule).
    pub initial: usize,
    /// Faults per seed.
    pub faults: usize,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub ttl: Duration,
    pub last_call: Duration,
    pub three_members: bool,
    /// Spells of an overloaded etcd ([`Fault::Overload`]).
    pub overload: bool,
    /// A run of more than `.0` nodes spreads its joins at `.1` a second on average (the agent's
    /// [`crate::etcd::session::Turn`] at the simulator's scale: its window and fixed spread).
    pub join_spread: (u32, u32),
    /// Failure restarts each agent allows (`--max-restarts`).
    pub max_restarts: u32,
    /// Agents say where they sit ([`Options::segment`]).
    pub located: bool,
    /// `--segment-size`: rounds of whole blocks of this many nodes of one segment; 1: of
    /// any nodes.
    pub segment_size: u32,
    pub switches: Switches,
    /// Keep the trace (for a replay).
    pub trace: bool,
    /// A crowd run: etcd overloaded (100 ms a proposal, 250 in one seed of three) from
    /// the start for this long.
    pub crowd_ms: Option<u64>,
    /// The most etcd writes a node may make from its start until it first runs a round
    /// (checked in crowd runs, where formation is all that happens).
    pub formation_writes: Option<u64>,
    /// Rounds of more members than this are placed ([`crate::etcd::placement`]).
    pub placement_above: usize,
    /// How they are cut.
    pub placement_shape: crate::etcd::placement::Shape,
}

impl Options {
    /// The default world: `agents` agents, MIN 2, MAX one fewer than the agents (so one
    /// is a spare when all run), a 6 s TTL and a 1 s last call.
    pub fn new(agents: usize) -> Self {
        let agents = agents.max(2);
        Self {
            agents,
            initial: agents,
            faults: 200,
            min_nodes: 2,
            max_nodes: (agents as u32 - 1).max(2),
            ttl: Duration::from_secs(6),
            last_call: Duration::from_secs(1),
            three_members: false,
            overload: false,
            join_spread: (
                crate::etcd::session::CROWD,
                crate::etcd::session::JOINS_PER_SECOND,
            ),
            max_restarts: u32::MAX,
            located: false,
            segment_size: 1,
            switches: Switches::default(),
            trace: false,
            crowd_ms: None,
            formation_writes: None,
            placement_above: crate::etcd::PLACEMENT_ABOVE,
            placement_shape: crate::etcd::placement::Shape::ETCD,
        }
    }

    /// A crowd forming on an etcd that cannot take it at once: `agents` nodes, all
    /// started together, one round of all of them, and an etcd whose apply loop takes
    /// 100 ms a proposal for the first minute (10 a second: two joins' worth of a 10,000
    /// node crowd on this machine's etcd, scaled down with the crowd); the spread scaled
    /// alike (runs above 4 nodes spread at 4 joins a second on average). One seed in three
    /// has a slower etcd (250 ms a proposal) than the spread is made for, where joins wait
    /// at the gate ([`crate::etcd::session::Gate`]). No other faults:
    /// formation is what is checked, and its writes are bounded.
    pub fn crowd(agents: usize) -> Self {
        let mut o = Self::new(agents);
        o.faults = 0;
        o.min_nodes = agents as u32;
        o.max_nodes = agents as u32;
        o.crowd_ms = Some(60_000);
        o.join_spread = (4, 4);
        o.formation_writes = Some(FORMATION_WRITES);
        o
    }

    /// Once faults stop, every live agent runs within this: TTL + last call + 2 s, the
    /// time for a dead member's lease to expire and the last call to run out, and 2 s for
    /// the round to be sealed and reach every agent.
    pub fn liveness_bound(&self) -> Duration {
        self.ttl + self.last_call + Duration::from_secs(2)
    }

    /// Where agent `a` sits: two racks that alternate, so that rank order is not join
    /// order; without blocks the last agent has no location. Empty when not located.
    pub fn segment(&self, a: usize) -> String {
        let unlocated = self.segment_size <= 1 && a + 1 == self.agents;
        if !self.located || unlocated {
            return String::new();
        }
        format!("zone-0/rack-{}", (a + 1) % 2)
    }

    /// The options of `seed`: every fourth seed runs against a three-member etcd, every
    /// fourth (another one) with a small restart budget, spent within its faults; every
    /// third with locations, half of those with rounds of whole blocks of two; every
    /// other one with every round placed (as rounds of thousands are), two in three of
    /// those cut so finely that each seal writes its shards ahead in several
    /// transactions (as rounds of more than 1,600 members do).
    pub fn for_seed(&self, seed: u64) -> Self {
        let mut o = self.clone();
        if seed % 2 == 1 {
            o.placement_above = 0;
            if seed % 3 != 0 {
                o.placement_shape = crate::etcd::placement::Shape::FINEST;
            }
        }
        if o.crowd_ms.is_some() {
            // A crowd is formation alone, on one etcd member.
            return o;
        }
        o.three_members = self.three_members || seed % 4 == 3;
        o.overload = self.overload || seed % 5 == 2;
        if seed % 4 == 1 {
            o.max_restarts = o.max_restarts.min(2 + (seed / 4 % 5) as u32);
        }
        if seed % 3 == 1 {
            o.located = true;
            let blocks = crate::topology::check_size(2, (o.min_nodes, o.max_nodes)).is_ok();
            if seed % 6 == 4 && blocks && o.segment_size == 1 {
                o.segment_size = 2;
            }
        }
        o
    }
}

/// A node's etcd writes from its start until it first runs a round, in a crowd: its
/// registration (which may claim the coordinator key), a seal and the master's key if it
/// coordinates, its word for a member lost, and as many again for one lease lost on the
/// way. A crowd that loses leases over and over (each a new grant and a registration
/// again) goes past it.
pub const FORMATION_WRITES: u64 = 8;

/// How one seed went.
#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    pub events: u64,
    pub faults: u64,
    /// The most etcd writes a node made from its start until it first ran a round.
    pub formation_writes: u64,
    pub violation: Option<String>,
    /// The run, one line per event that matters (when asked for).
    pub trace: Vec<String>,
}

/// Runs `seed` with the switches set on this thread.
pub fn run_seed(seed: u64, opts: &Options) -> Report {
    let opts = opts.for_seed(seed);
    opts.switches.set();
    let report = run(seed, &opts);
    Switches::default().set();
    report
}

/// The fewest faults of `seed`'s schedule that still fail it, and their report: faults are
/// taken out one at a time (halves first) while the run still fails.
pub fn shrink(seed: u64, opts: &Options) -> (Vec<(u64, Fault)>, Report) {
    let opts = opts.for_seed(seed);
    opts.switches.set();
    let mut plan = faults::schedule(seed, &mix(seed, &opts));
    let report = run_schedule(seed, &opts, &plan);
    // The same kind of violation (its first word), not any.
    let kind = |r: &Report| {
        let v = r.violation.as_deref()?;
        Some(v.split([':', ' ']).next().unwrap_or(v).to_owned())
    };
    let wanted = kind(&report);
    let fails = |r: &Report| r.violation.is_some() && kind(r) == wanted;
    if !fails(&report) {
        Switches::default().set();
        return (plan, report);
    }
    let mut chunk = plan.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < plan.len() {
            let mut fewer = plan.clone();
            fewer.drain(i..(i + chunk).min(plan.len()));
            let r = run_schedule(seed, &opts, &fewer);
            if fails(&r) {
                plan = fewer;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    let mut traced = opts.clone();
    traced.trace = true;
    let report = run_schedule(seed, &traced, &plan);
    Switches::default().set();
    (plan, report)
}

/// Runs seeds `start..start + n` on `threads` threads; `progress` is told of each.
pub fn campaign(
    start: u64,
    n: u64,
    opts: &Options,
    threads: usize,
    progress: &(dyn Fn(&Report) + Sync),
) -> Vec<Report> {
    let next = std::sync::atomic::AtomicU64::new(start);
    let failed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= start + n {
                        return;
                    }
                    let r = run_seed(seed, opts);
                    progress(&r);
                    if r.violation.is_some() {
                        failed.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    }
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    failed.sort_by_key(|r| r.seed);
    failed
}
