//! The fault schedule of one seed: what happens to whom and when, drawn before the run so
//! that a failing schedule can be shrunk (faults taken out) and replayed as it is.

use super::rng::Rng;

/// One fault. Agents are named by index; a fault that does not apply when its time comes
/// (a thaw of an agent that is not frozen) does nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL: the agent and its workers die; its lease lives out its TTL unless its ring
    /// neighbour proves it dead.
    Kill(usize),
    /// The agent (killed or never started) starts: a new process, a new lease.
    Start(usize),
    /// SIGTERM: the agent stops its workers, says it left and revokes its lease.
    Term(usize),
    /// The whole node stops (agent and workers, as a paused VM), and goes on.
    Freeze(usize),
    Thaw(usize),
    /// The agent's network to etcd is cut (requests time out, streams fail), and healed.
    Cut(usize),
    Heal(usize),
    /// Requests and keep-alives of the agent take seconds.
    Slow(usize),
    Fast(usize),
    /// The agent's watch is cancelled (a compaction, an etcd restart of the stream).
    CancelWatch(usize),
    /// A worker of the agent fails (the failure is charged, the group re-forms).
    WorkerFails(usize),
    /// A worker exits with a `--no-retry-exit-codes` code: the run halts.
    WorkerHalts(usize),
    /// etcd restarts: with its data or empty, down for `down_ms`.
    EtcdRestart {
        empty: bool,
        down_ms: u64,
    },
    /// A member of a three-member etcd is lost, and comes back.
    MemberLost(usize),
    MemberBack(usize),
    /// etcd's apply loop takes `apply_ms` for each proposal (a write, a grant, a revoke),
    /// one after another: proposals queue behind each other, linearizable reads and lease
    /// renewals wait for the queue (refused past a second, "waiting for the applied index
    /// took too long"), writes are answered "request timed out" past 2 s (and applied
    /// later), and "too many requests" past 3 s of queue. Leases whose renewals were
    /// refused for a TTL expire.
    Overload {
        apply_ms: u64,
    },
    /// The overload ends: etcd drains what queued.
    Drained,
}

impl Fault {
    /// Whether the fault changes who is in the run (a seal may follow).
    pub fn agent(self) -> Option<usize> {
        match self {
            Fault::Kill(a)
            | Fault::Start(a)
            | Fault::Term(a)
            | Fault::Freeze(a)
            | Fault::Thaw(a)
            | Fault::Cut(a)
            | Fault::Heal(a)
            | Fault::Slow(a)
            | Fault::Fast(a)
            | Fault::CancelWatch(a)
            | Fault::WorkerFails(a)
            | Fault::WorkerHalts(a) => Some(a),
            _ => None,
        }
    }
}

/// What the schedule may contain.
#[derive(Debug, Clone)]
pub struct Mix {
    pub agents: usize,
    /// Agents started at the beginning (the rest join later).
    pub initial: usize,
    pub faults: usize,
    pub ttl_ms: u64,
    pub three_members: bool,
    /// Whether a worker may halt the run (it ends the seed's interesting part).
    pub halts: bool,
    /// Whether etcd is overloaded at times (spells drawn apart from the other faults, so
    /// that a seed's other faults are the same with and without them).
    pub overload: bool,
}

/// The schedule of `seed`: `(ms, fault)` in time order.
pub fn schedule(seed: u64, mix: &Mix) -> Vec<(u64, Fault)> {
    let mut rng = Rng::new(seed);
    let mut out: Vec<(u64, Fault)> = (0..mix.initial).map(|a| (0, Fault::Start(a))).collect();
    let mut t = 2_000;
    let ttl = mix.ttl_ms;
    for _ in 0..mix.faults {
        // Mostly close together (faults that overlap), sometimes long enough apart for the
        // run to settle.
        t += if rng.chance(70) {
            rng.range(20, 1_500)
        } else {
            rng.range(1_500, 3 * ttl)
        };
        let a = rng.pick(mix.agents);
        let later = t + rng.range(200, 2 * ttl);
        let roll = rng.range(0, 99);
        let (now, then) = match roll {
            0..=9 => (Fault::Kill(a), rng.chance(80).then_some(Fault::Start(a))),
            10..=14 => (Fault::Term(a), rng.chance(80).then_some(Fault::Start(a))),
            15..=17 => (Fault::Start(a), None),
            18..=31 => (Fault::Freeze(a), Some(Fault::Thaw(a))),
            32..=45 => (Fault::Cut(a), Some(Fault::Heal(a))),
            46..=52 => (Fault::Slow(a), Some(Fault::Fast(a))),
            53..=59 => (Fault::CancelWatch(a), None),
            60..=77 => (Fault::WorkerFails(a), None),
            78..=79 if mix.halts => (Fault::WorkerHalts(a), None),
            78..=89 => {
                let empty = rng.chance(40);
                let down_ms = rng.range(50, ttl);
                (Fault::EtcdRestart { empty, down_ms }, None)
            }
            _ if mix.three_members => {
                let m = rng.pick(3);
                (Fault::MemberLost(m), Some(Fault::MemberBack(m)))
            }
            _ => (Fault::WorkerFails(a), None),
        };
        out.push((t, now));
        if let Some(f) = then {
            out.push((later, f));
        }
    }
    if mix.overload {
        out.extend(overload_spells(seed, t, ttl));
    }
    out.sort_by_key(|(t, _)| *t);
    out
}

/// One to three spells of an overloaded etcd within `0..until` ms, one of them from the
/// start half the time (formation under overload): each a proposal cost of 50–600 ms,
/// lasting up to three TTLs.
fn overload_spells(seed: u64, until: u64, ttl: u64) -> Vec<(u64, Fault)> {
    let mut rng = Rng::new(seed ^ 0x6f76_6572_6c6f_6164);
    let mut out = Vec::new();
    for i in 0..rng.range(1, 3) {
        let at = if i == 0 && rng.chance(50) {
            0
        } else {
            rng.range(0, until.max(1))
        };
        let apply_ms = rng.range(50, 600);
        out.push((at, Fault::Overload { apply_ms }));
        out.push((at + rng.range(500, 3 * ttl), Fault::Drained));
    }
    out
}
