//! One seed from start to end: the schedule's faults, the events they cause, the checks
//! after each.

use super::agent::{Did, Life};
use super::faults::{Fault, Mix, schedule};
use super::world::{Ev, World};
use super::{Options, Report};
use crate::etcd::session::{Command, Input, Machine};

/// Events one seed may take before the checker calls it a loop of its own.
const EVENT_LIMIT: u64 = 3_000_000;

/// Runs `seed` with its own schedule.
pub fn run(seed: u64, opts: &Options) -> Report {
    let plan = schedule(seed, &mix(seed, opts));
    run_schedule(seed, opts, &plan)
}

pub fn mix(seed: u64, opts: &Options) -> Mix {
    Mix {
        agents: opts.agents,
        initial: opts.initial.min(opts.agents),
        faults: opts.faults,
        ttl_ms: opts.ttl.as_millis() as u64,
        three_members: opts.three_members,
        // One seed in ten may end with a halt; the others keep running to the end.
        halts: seed % 10 == 0,
        overload: opts.overload,
    }
}

/// Runs `plan` (from `seed`'s schedule, or a shrunk one).
pub fn run_schedule(seed: u64, opts: &Options, plan: &[(u64, Fault)]) -> Report {
    let mut w = World::new(opts.clone(), seed);
    let mut last = plan.last().map_or(0, |(t, _)| *t);
    if let Some(ms) = opts.crowd_ms {
        // One seed in three on a slower etcd than the spread is made for (its rate is
        // fixed, etcd's room is not): there joins wait at the gate.
        // (Apart from the seed's placement shape, `Options::for_seed`'s `seed % 3`.)
        let apply_ms = if (seed / 3) % 3 == 2 { 250 } else { 100 };
        w.push(0, Ev::Fault(Fault::Overload { apply_ms }));
        w.push(ms, Ev::Fault(Fault::Drained));
        last = last.max(ms);
    }
    for (t, f) in plan {
        w.push(*t, Ev::Fault(*f));
    }
    let heal = last + 1;
    w.push(heal, Ev::HealAll);
    let settle = heal + opts.liveness_bound().as_millis() as u64;
    w.push(settle, Ev::Settled);
    // A node outside every round claims the coordinator key a TTL after it went (members
    // first, duty.rs), and with blocks a run can be left with no live member: its claim
    // and first writes may come that late, and the quiet starts after them.
    let quiet_from = settle + opts.ttl.as_millis() as u64;
    w.push(quiet_from, Ev::Quiet);
    w.push(quiet_from + 10_000, Ev::End);
    w.push(100, Ev::Expire);
    let mut writes_at_settle = Vec::new();
    while let Some(q) = w.pop() {
        if w.events > EVENT_LIMIT {
            w.violate(format!(
                "more than {EVENT_LIMIT} events: the run never settles"
            ));
            break;
        }
        match q.ev {
            Ev::End => break,
            Ev::Settled => {
                w.check_settled();
                w.check_departures();
            }
            Ev::Quiet => {
                writes_at_settle = w
                    .writes
                    .iter()
                    .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
                    .collect();
            }
            ev => handle(&mut w, ev),
        }
        w.check_fencing();
        if w.violation.is_some() {
            break;
        }
    }
    if w.violation.is_none() && !writes_at_settle.is_empty() {
        quiet(&mut w, &writes_at_settle);
    }
    Report {
        seed,
        events: w.events,
        faults: w.faults_applied,
        formation_writes: w.formation_writes,
        violation: w.violation.take(),
        trace: w.trace.take().unwrap_or_default(),
    }
}

/// Once nothing changes, nobody writes: at most one write per agent in the last 10 s.
fn quiet(w: &mut World, before: &[u64]) {
    for (a, c) in w.writes.iter().enumerate() {
        let n = c.load(std::sync::atomic::Ordering::Relaxed) - before[a];
        if n > 1 && w.agents[a].life == Life::Up {
            let what = format!("n{a} made {n} etcd writes in 10 s after the run settled");
            w.violate(what);
            return;
        }
    }
}

fn handle(w: &mut World, ev: Ev) {
    match ev {
        Ev::Fault(f) => fault(w, f),
        Ev::Arrive { a, process, op } => w.arrive(a, process, op),
        Ev::Apply {
            a,
            process,
            op,
            restarts,
            answer,
        } => w.applied(a, process, &op, restarts, answer),
        Ev::KeepAlive { a, streams, lease } => w.keep_alive(a, streams, lease),
        Ev::Deliver { a, process, input } => {
            if w.agents[a].process == process {
                w.feed(a, input);
            }
        }
        Ev::Stream { a, streams, input } => w.deliver_stream(a, streams, input),
        Ev::Timer { a, process } => {
            if w.agents[a].process == process && w.agents[a].life == Life::Up {
                w.timer_fired(a);
                w.feed(a, Input::Timer);
            }
        }
        Ev::Evict {
            a,
            process,
            command,
        } => {
            let ag = &mut w.agents[a];
            if ag.process == process && ag.life == Life::Up {
                let id = ag.tell();
                w.note(|| format!("n{a}'s ring watcher: {command:?}"));
                w.feed(a, Input::Command(id, command));
            }
        }
        Ev::Probe { a, process } => probe(w, a, process),
        Ev::Expire => {
            w.expire();
            w.after(100, Ev::Expire);
        }
        Ev::EtcdBack => {
            let now = w.now();
            if w.etcd.down_until.is_some_and(|t| now >= t) {
                w.etcd.new_leader(now);
                w.note(|| "etcd is back".into());
            }
        }
        Ev::HealAll => heal_all(w),
        Ev::Settled | Ev::Quiet | Ev::End => {}
    }
}

/// The prober looks: a stopped etcd (refused) proves no leader; a cut network proves
/// nothing.
fn probe(w: &mut World, a: usize, process: u64) {
    let ag = &w.agents[a];
    if ag.process != process || !ag.probing || ag.life == Life::Down {
        return;
    }
    let now = w.now();
    // A frozen process's prober is frozen too: it proves nothing while it sleeps.
    if ag.life == Life::Up && !ag.cut && !w.etcd.has_leader(now, w.opts.three_members) {
        w.feed(
            a,
            Input::NoLeader {
                sent: now,
                silent: false,
            },
        );
    }
    let every = w.opts.ttl.as_millis() as u64 / 4;
    w.after(every, Ev::Probe { a, process });
}

fn fault(w: &mut World, f: Fault) {
    w.faults_applied += 1;
    w.changed(1);
    w.note(|| format!("fault: {f:?}"));
    match f {
        Fault::Start(a) => w.start(a),
        Fault::Kill(a) => kill(w, a),
        Fault::Term(a) => {
            if w.agents[a].life == Life::Up {
                let did = w.agents[a].terminated();
                w.apply(a, did);
            }
        }
        Fault::Freeze(a) => {
            if w.agents[a].life == Life::Up {
                w.agents[a].life = Life::Frozen;
            }
        }
        Fault::Thaw(a) => thaw(w, a),
        Fault::Cut(a) => cut_network(w, a),
        Fault::Heal(a) => w.agents[a].cut = false,
        Fault::Slow(a) => w.agents[a].slow = true,
        Fault::Fast(a) => w.agents[a].slow = false,
        Fault::CancelWatch(a) => cancel_watch(w, a),
        Fault::WorkerFails(a) => {
            if w.agents[a].life == Life::Up {
                let did = w.agents[a].worker_failed();
                w.apply(a, did);
            }
        }
        Fault::WorkerHalts(a) => {
            if w.agents[a].life == Life::Up {
                let did = w.agents[a].worker_halts();
                w.apply(a, did);
            }
        }
        Fault::EtcdRestart { empty, down_ms } => etcd_restart(w, empty, down_ms),
        Fault::MemberLost(m) => member_lost(w, m),
        Fault::MemberBack(m) => member_back(w, m),
        Fault::Overload { apply_ms } => w.etcd.apply_ms = apply_ms,
        Fault::Drained => w.etcd.apply_ms = 0,
    }
}

/// The agent's network to etcd goes: its streams fail a while later.
fn cut_network(w: &mut World, a: usize) {
    if !w.agents[a].cut {
        w.agents[a].cut = true;
        let delay = w.rng.range(500, 3_000);
        w.fail_streams(a, delay);
    }
}

/// etcd cancels the agent's watch (what a compaction does).
fn cancel_watch(w: &mut World, a: usize) {
    let streams = w.agents[a].streams;
    if w.agents[a].watching.is_some() {
        w.after(
            1,
            Ev::Stream {
                a,
                streams,
                input: Input::WatchEnded,
            },
        );
    }
}

/// etcd stops for `down_ms`, then comes back with its data or empty; every stream fails
/// meanwhile.
fn etcd_restart(w: &mut World, empty: bool, down_ms: u64) {
    let now = w.now();
    let unix_ms = 1_800_000_000_000 + w.now_ms;
    w.etcd.restart(
        now,
        std::time::Duration::from_millis(down_ms),
        empty,
        unix_ms,
    );
    for a in 0..w.agents.len() {
        let delay = w.rng.range(1, 20);
        w.fail_streams(a, delay);
    }
    w.after(down_ms, Ev::EtcdBack);
}

/// A member of the three-member etcd is lost: the streams of the agents pinned to it fail.
fn member_lost(w: &mut World, m: usize) {
    let now = w.now();
    let had = w.etcd.has_leader(now, w.opts.three_members);
    w.etcd.members_up[m] = false;
    for a in 0..w.agents.len() {
        if w.agents[a].pinned == m {
            let delay = w.rng.range(1, 20);
            w.fail_streams(a, delay);
        }
    }
    if had && !w.etcd.has_leader(now, w.opts.three_members) {
        w.note(|| "etcd lost its quorum".into());
    }
}

/// A lost member comes back; with it back, a quorum elects a new leader.
fn member_back(w: &mut World, m: usize) {
    let now = w.now();
    let had = w.etcd.has_leader(now, w.opts.three_members);
    w.etcd.members_up[m] = true;
    if !had && w.etcd.has_leader(now, w.opts.three_members) {
        w.etcd.new_leader(now);
    }
}

/// SIGKILL: the process and its workers go; the ring neighbour of a running member finds
/// its port closed and evicts the lease it last announced (its heartbeats carry it: the
/// machine's lease at its death, which a frozen agent could not have changed).
fn kill(w: &mut World, a: usize) {
    if !matches!(w.agents[a].life, Life::Up | Life::Frozen) {
        return;
    }
    let running = w.agents[a].running().cloned();
    // The old watcher (a switch) revoked the round's id.
    let announced = (!w.opts.switches.old_store)
        .then(|| w.agents[a].machine.as_ref().map(Machine::lease))
        .flatten();
    let ag = &mut w.agents[a];
    ag.life = Life::Down;
    ag.machine = None;
    ag.watching = None;
    ag.kept = None;
    ag.asked = None;
    ag.exit_after = None;
    ag.process += 1;
    ag.held_until = None;
    ag.streams += 1;
    ag.lp = super::agent::Loop::Starting;
    let Some(r) = running else { return };
    let node = w.agents[a].node.clone();
    let Some(pos) = r.members.iter().position(|m| m.node_id == node) else {
        return;
    };
    let n = r.members.len();
    if n < 2 {
        return;
    }
    let watcher_node = &r.members[(pos + n - 1) % n].node_id;
    let Some(watcher) = w.agents.iter().position(|g| &g.node == watcher_node) else {
        return;
    };
    if w.agents[watcher]
        .running()
        .is_some_and(|h| h.number == r.number)
    {
        let command = Command::Evict {
            node,
            lease: announced.unwrap_or(r.members[pos].lease),
            round: r.number,
            detect_ms: 200,
        };
        let process = w.agents[watcher].process;
        let delay = w.rng.range(100, 800);
        w.after(
            delay,
            Ev::Evict {
                a: watcher,
                process,
                command,
            },
        );
    }
}

fn thaw(w: &mut World, a: usize) {
    if w.agents[a].life != Life::Frozen {
        return;
    }
    w.agents[a].life = Life::Up;
    let inbox = std::mem::take(&mut w.agents[a].frozen_inbox);
    for (streams, input) in inbox {
        // Events of a stream the machine closed meanwhile are gone with it.
        if streams.is_none_or(|s| s == w.agents[a].streams) {
            w.feed(a, input);
        }
    }
    // Its timers are late: it looks at once.
    w.feed(a, Input::Timer);
}

fn heal_all(w: &mut World) {
    w.note(|| "faults are over: everything heals".into());
    let now = w.now();
    for a in 0..w.agents.len() {
        thaw(w, a);
        w.agents[a].cut = false;
        w.agents[a].slow = false;
    }
    let had = w.etcd.has_leader(now, w.opts.three_members);
    w.etcd.members_up = [true; 3];
    w.etcd.apply_ms = 0;
    if w.etcd.down_until.is_some() || !had {
        w.etcd.new_leader(now);
    }
}

impl World {
    pub fn apply(&mut self, a: usize, did: Vec<Did>) {
        for d in did {
            self.did(a, d);
        }
        self.after_step(a);
    }

    /// A timer fired: the loop's own recheck, if due, is done by the look that follows.
    pub fn timer_fired(&mut self, a: usize) {
        self.clear_timer(a);
        let now = self.now();
        let ag = &mut self.agents[a];
        if ag.recheck.is_some_and(|at| at <= now) {
            ag.recheck = None;
        }
    }
}
