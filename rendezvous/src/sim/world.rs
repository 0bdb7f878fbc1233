//! The world of one seed: a simulated clock and network, the simulated etcd, the agents,
//! and the queue of what happens next. Everything is drawn from the seed, so the same seed
//! gives the same run, event for event.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::Options;
use super::agent::{Did, Life, SimAgent};
use super::etcd::SimEtcd;
use super::faults::Fault;
use super::rng::Rng;
use crate::Counters;
use crate::etcd::Keys;
use crate::etcd::session::{
    Answer, Command, Config, Effect, FirstRead, Input, Machine, Op, WatchEvent,
};
use crate::seal::SealConfig;

/// How often a node waiting its turn looks at its watch of the admission keys.
const WATCH_LOOKS: Duration = Duration::from_millis(20);

/// What happens at a moment.
#[derive(Debug)]
pub enum Ev {
    Fault(Fault),
    /// An op reaches etcd.
    Arrive {
        a: usize,
        process: u64,
        op: Op,
    },
    /// etcd's apply loop reaches an op queued while it was overloaded (lost if etcd
    /// restarted since: `restarts`); `answer`: the agent still waits for its answer.
    Apply {
        a: usize,
        process: u64,
        op: Op,
        restarts: u64,
        answer: bool,
    },
    /// A keep-alive reaches etcd.
    KeepAlive {
        a: usize,
        streams: u64,
        lease: i64,
    },
    /// An input reaches agent `a`'s process (op answers, timers).
    Deliver {
        a: usize,
        process: u64,
        input: Input,
    },
    /// An input from agent `a`'s open streams.
    Stream {
        a: usize,
        streams: u64,
        input: Input,
    },
    /// Agent `a`'s timer.
    Timer {
        a: usize,
        process: u64,
    },
    /// Agent `a`'s ring watcher found `node` dead.
    Evict {
        a: usize,
        process: u64,
        command: Command,
    },
    /// Agent `a`'s prober looks at etcd.
    Probe {
        a: usize,
        process: u64,
    },
    /// etcd expires leases.
    Expire,
    /// etcd is back from a restart.
    EtcdBack,
    /// Faults are over: everything heals.
    HealAll,
    /// The liveness bound after the last fault.
    Settled,
    /// From here on nobody writes more than once (`run.rs`'s quiet check).
    Quiet,
    End,
}

pub struct Queued {
    pub at: u64,
    pub seq: u64,
    pub ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// A round committed to etcd, as the checker keeps it.
#[derive(Debug, Clone)]
pub struct Sealed {
    pub epoch: u32,
    pub members: Vec<String>,
    pub restart_count: u32,
}

pub struct World {
    pub opts: Options,
    pub base: Instant,
    pub now_ms: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Queued>>,
    pub rng: Rng,
    pub etcd: SimEtcd,
    pub agents: Vec<SimAgent>,
    pub keys: Keys,
    pub writes: Vec<Arc<AtomicU64>>,
    /// Rounds committed, by number (a republished round is not a new one).
    pub sealed: BTreeMap<u64, Sealed>,
    /// Rounds the faults and membership changes so far may still cost (`check.rs`).
    pub seal_budget: u32,
    /// The revision up to which membership changes were looked for.
    pub(super) membership_rev: i64,
    pub trace: Option<Vec<String>>,
    pub events: u64,
    pub faults_applied: u64,
    pub violation: Option<String>,
    /// Last delivery time of each agent's streams (deliveries of one stream keep order).
    pub(super) stream_clock: Vec<[u64; 2]>,
    timer_at: Vec<Option<u64>>,
    /// Which agent's process each lease was granted to (`check.rs`: no process
    /// registers on a new lease while its registration on an older one stands).
    pub granted_to: BTreeMap<i64, (usize, u64)>,
    /// Each agent's writes when its process started, and the process that first ran a
    /// round (its formation is over).
    writes_at_start: Vec<u64>,
    formed: Vec<u64>,
    /// The most writes a node made from its start until it first ran a round.
    pub formation_writes: u64,
}

const UNIX_MS_AT_START: u64 = 1_800_000_000_000;

impl World {
    pub fn new(opts: Options, seed: u64) -> Self {
        let keys = Keys::new("/fsdp-sim", "run").expect("a valid prefix");
        let margin = crate::fence::default_margin(opts.ttl);
        let agents = (0..opts.agents)
            .map(|i| {
                SimAgent::new(
                    format!("n{i}"),
                    keys.clone(),
                    margin,
                    opts.max_nodes,
                    opts.max_restarts,
                )
            })
            .collect();
        let members = if opts.three_members { 3 } else { 1 };
        Self {
            etcd: SimEtcd::new(opts.switches.old_store, UNIX_MS_AT_START, members),
            base: Instant::now(),
            now_ms: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            rng: Rng::new(seed.wrapping_mul(31).wrapping_add(7)),
            agents,
            keys,
            writes: (0..opts.agents)
                .map(|_| Arc::new(AtomicU64::new(0)))
                .collect(),
            sealed: BTreeMap::new(),
            seal_budget: 0,
            membership_rev: 0,
            trace: opts.trace.then(Vec::new),
            events: 0,
            faults_applied: 0,
            violation: None,
            stream_clock: vec![[0; 2]; opts.agents],
            timer_at: vec![None; opts.agents],
            granted_to: BTreeMap::new(),
            writes_at_start: vec![0; opts.agents],
            formed: vec![0; opts.agents],
            formation_writes: 0,
            opts,
        }
    }

    pub fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.now_ms)
    }

    pub fn ms(&self, at: Instant) -> u64 {
        let ns = at.saturating_duration_since(self.base).as_nanos();
        ns.div_ceil(1_000_000) as u64
    }

    pub fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at: at.max(self.now_ms),
            seq: self.seq,
            ev,
        }));
    }

    pub fn after(&mut self, delay: u64, ev: Ev) {
        self.push(self.now_ms + delay, ev);
    }

    pub fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(t) = self.trace.as_mut() {
            let ms = self.now_ms;
            t.push(format!("{:>4}.{:03}s {}", ms / 1000, ms % 1000, what()));
        }
    }

    pub fn pop(&mut self) -> Option<Queued> {
        let q = self.queue.pop()?.0;
        self.now_ms = q.at;
        self.events += 1;
        Some(q)
    }

    pub fn latency(&mut self, a: usize) -> u64 {
        if self.agents[a].slow {
            self.rng.range(200, 1_000)
        } else {
            self.rng.range(1, 20)
        }
    }

    fn seal_config(&self) -> SealConfig {
        SealConfig {
            min_nodes: self.opts.min_nodes,
            max_nodes: self.opts.max_nodes,
            last_call: self.opts.last_call,
            straggler_timeout: self.opts.ttl,
            segment_size: self.opts.segment_size,
        }
    }

    /// Whether agent `a`'s process waits before its grant, as the handle's does: its
    /// turn, once per process (its first look, then until the coordinator's admission
    /// key lets it in, or its latest moment), then the gate unless the key let it in; its
    /// start comes again when it may go on.
    /// (Unlike the handle's, the gate has no deadline here, and a start the schedule
    /// plans meanwhile looks again at once: the gate is on in crowd runs only, which plan
    /// no other faults.)
    fn waits_before_join(&mut self, a: usize, now: Instant) -> bool {
        let (crowd, per_second) = self.opts.join_spread;
        let node = self.agents[a].node.clone();
        let next = self.agents[a].process + 1;
        if self.agents[a].turn_for != next {
            self.agents[a].turn_for = next;
            let turn = crate::etcd::session::Turn::scaled(
                &node,
                self.opts.max_nodes,
                now,
                crowd,
                per_second,
            );
            if let Some(first) = turn.as_ref().map(crate::etcd::session::Turn::first_look) {
                let wait = first.saturating_duration_since(now);
                self.note(|| format!("n{a} looks first in {wait:?}, then waits its turn"));
                self.after(wait.as_millis() as u64, Ev::Fault(Fault::Start(a)));
            }
            self.agents[a].turn = turn;
            if self.agents[a].turn.is_some() {
                return true;
            }
        }
        // The handle's turn ([`crate::etcd::session::Turn`]): an admission key from its
        // own on, read (serializable: answered at once) and watched; the watch is looked
        // at every few milliseconds here (its event comes once the key is applied, as a
        // read's answer does). At its latest moment it goes to the gate.
        let mut pushed = false;
        if let Some(turn) = self.agents[a].turn.take() {
            pushed = self.admitted(turn.key(), now);
            if !pushed && now < turn.latest() {
                let wait = turn
                    .latest()
                    .saturating_duration_since(now)
                    .min(WATCH_LOOKS);
                self.after(wait.as_millis() as u64 + 1, Ev::Fault(Fault::Start(a)));
                self.agents[a].turn = Some(turn);
                return true;
            }
            let how = if pushed { "pushed" } else { "at its latest" };
            self.note(|| format!("n{a}'s turn came ({how})"));
        }
        // Held at the gate (below), it watches the admission keys from its own as a turn
        // does, and goes on at the coordinator's push.
        if let Some(until) = self.agents[a].held_until.take() {
            let own = crate::etcd::session::admission_key(&node, self.opts.max_nodes);
            if self.admitted(own, now) {
                self.note(|| format!("n{a} goes on from the gate (pushed)"));
                return false;
            }
            if now < until {
                let wait = until.saturating_duration_since(now).min(WATCH_LOOKS);
                self.agents[a].held_until = Some(until);
                self.after(wait.as_millis() as u64 + 1, Ev::Fault(Fault::Start(a)));
                return true;
            }
        }
        // The handle's gate ([`crate::etcd::session::Gate`]): its nesting read, linearizable
        // in a crowd, is answered once the apply loop caught up; a late answer holds the
        // node a drawn pause before it looks again.
        if !pushed && crate::etcd::session::a_crowd(self.opts.max_nodes, crowd) {
            let lag = self.etcd.lag(now);
            let gate = self.agents[a]
                .gate
                .get_or_insert_with(|| crate::etcd::session::Gate::new(&node, self.opts.ttl));
            if let Some(at) = gate.looked(now, now + lag) {
                let held = at.saturating_duration_since(now);
                self.note(|| {
                    format!("n{a} is held at the gate for {held:?} (etcd {lag:?} behind)")
                });
                self.agents[a].held_until = Some(at);
                self.after(
                    held.min(WATCH_LOOKS).as_millis() as u64 + 1,
                    Ev::Fault(Fault::Start(a)),
                );
                return true;
            }
        }
        false
    }

    /// Whether an admission key from `own` on is there (read serializably, as the
    /// handle's look does; its watch sees the same once the put is applied).
    fn admitted(&mut self, own: u32, now: Instant) -> bool {
        let admissions = Op::Range {
            key: self.keys.admissions(),
            prefix: true,
            keys_only: true,
            serializable: true,
        };
        let prefix = self.keys.admissions();
        match self.etcd.execute(&admissions, now) {
            Ok(Answer::Range { kvs, .. }) => kvs.iter().any(|kv| {
                let n: Option<u32> = kv.key.strip_prefix(&prefix).and_then(|n| n.parse().ok());
                n.is_some_and(|n| n >= own)
            }),
            _ => false,
        }
    }

    /// The handle's nesting check, which reads the run's control keys for the first sync
    /// in the same transaction ([`crate::etcd::session::FirstRead`]), then its grant: the
    /// read and the lease, or none (a refused grant starts agent `a` again later, as the
    /// handle asks again; the store refuses neither otherwise).
    fn read_and_grant(&mut self, a: usize, now: Instant) -> Option<(FirstRead, i64)> {
        let control = Op::Range {
            key: self.keys.ctl(),
            prefix: true,
            keys_only: false,
            serializable: true,
        };
        let Ok(Answer::Range { revision, kvs }) = self.etcd.execute(&control, now) else {
            return None;
        };
        // The grant is a proposal: behind a long queue it is refused, and the handle asks
        // again. (Taken at once otherwise: the lease lives from the request on, which is
        // what the machine's clock counts from anyway.)
        if self.etcd.queueing(now) && self.etcd.propose(now) == super::etcd::Proposal::Refused {
            self.after(500, Ev::Fault(Fault::Start(a)));
            return None;
        }
        let ttl_s = self.opts.ttl.as_secs() as i64;
        let (lease, _) = self.etcd.state.grant(ttl_s, 0, now).ok()?;
        Some((FirstRead { revision, kvs }, lease))
    }

    /// Starts agent `a`'s process: a lease granted at etcd, then the machine's first sync.
    pub fn start(&mut self, a: usize) {
        if self.agents[a].life != Life::Down {
            return;
        }
        let now = self.now();
        let pinned = self.agents[a].pinned;
        if !self.etcd.serves(now, pinned, self.opts.three_members) {
            // The handle's join retries until etcd answers.
            self.after(500, Ev::Fault(Fault::Start(a)));
            return;
        }
        if self.waits_before_join(a, now) {
            return;
        }
        let Some((read, lease)) = self.read_and_grant(a, now) else {
            return;
        };
        let skew = self.rng.range(0, 2_000);
        let cfg = Config {
            keys: self.keys.clone(),
            node_id: self.agents[a].node.clone(),
            addr: format!("10.0.0.{a}"),
            status_addr: format!("10.0.0.{a}:29450"),
            local_world_size: 1,
            ttl: self.opts.ttl,
            outage_limit: Duration::from_secs(60),
            fence_margin: crate::fence::default_margin(self.opts.ttl),
            seal: self.seal_config(),
            several_endpoints: self.opts.three_members,
            budget: Default::default(),
            job: String::new(),
            segment: self.opts.segment(a),
            fresh_store: false,
            placement_above: self.opts.placement_above,
            placement_shape: self.opts.placement_shape,
            can_probe: true,
            crowd: crate::etcd::session::a_crowd(self.opts.max_nodes, self.opts.join_spread.0),
            crowd_window: self.opts.join_spread.0,
            embedded_store: false,
            lease,
            allowed: Default::default(),
            granted_at: now,
            unix_ms_at_grant: UNIX_MS_AT_START + self.now_ms + skew,
            first_incarnation: crate::etcd::session::first_incarnation(
                UNIX_MS_AT_START + self.now_ms,
            ),
        };
        let mut machine =
            Machine::new(cfg, Counters::default(), self.writes[a].clone()).with_first_read(read);
        let effects = machine.start(now);
        let ag = &mut self.agents[a];
        ag.process += 1;
        ag.gate = None;
        ag.held_until = None;
        ag.streams += 1;
        ag.machine = Some(machine);
        ag.life = Life::Up;
        ag.restarted(self.opts.max_nodes);
        ag.asked = None;
        ag.watching = None;
        ag.kept = None;
        ag.probing = false;
        ag.frozen_inbox.clear();
        // A timer the last process set fires for that process only (and is dropped): a new
        // deadline at the same moment must be set again for this one.
        let process = ag.process;
        self.clear_timer(a);
        self.granted_to.insert(lease, (a, process));
        self.writes_at_start[a] = self.writes[a].load(std::sync::atomic::Ordering::Relaxed);
        self.note(|| format!("n{a} starts (lease {lease})"));
        self.carry_out(a, effects);
        self.after_step(a);
    }

    /// Gives agent `a` an input (kept for later while it is frozen).
    pub fn feed(&mut self, a: usize, input: Input) {
        let now = self.now();
        let ag = &mut self.agents[a];
        match ag.life {
            Life::Frozen => return ag.frozen_inbox.push((None, input)),
            Life::Up => {}
            Life::Down | Life::Exited(_) => return,
        }
        let Some(m) = ag.machine.as_mut() else { return };
        let before = self
            .trace
            .is_some()
            .then(|| (m.phase(), m.view().departed.clone(), m.incarnation()));
        let what = self.trace.is_some().then(|| match &input {
            Input::NoLeader { .. } => "NoLeader".to_owned(),
            other => format!("{other:?}").chars().take(120).collect::<String>(),
        });
        let effects = m.step(now, input);
        if let (Some((phase, departed, inc)), Some(what)) = (before, what) {
            let (p2, d2, i2) = (m.phase(), m.view().departed.clone(), m.incarnation());
            if phase != p2 || departed != d2 || inc != i2 {
                let (phase, p2) = (self.phase(phase), self.phase(p2));
                let line = format!(
                    "n{a} machine: {phase} -> {p2}, incarnation ..{} departed {:?} (after {what})",
                    i2 % 1_000_000,
                    d2.iter()
                        .map(|(k, d)| format!("{k}#..{}", d.incarnation % 1_000_000))
                        .collect::<Vec<_>>()
                );
                self.note(|| line);
            }
        }
        self.carry_out(a, effects);
        self.after_step(a);
    }

    /// The loop looks again, and the next timer is set.
    pub fn after_step(&mut self, a: usize) {
        loop {
            let now = self.now();
            let did = self.agents[a].act(now);
            if did.is_empty() {
                break;
            }
            for d in did {
                self.did(a, d);
            }
        }
        let ag = &self.agents[a];
        let Some(m) = ag.machine.as_ref() else { return };
        let due = [m.deadline(), ag.recheck].into_iter().flatten().min();
        if let Some(due) = due {
            let at = self.ms(due).max(self.now_ms);
            if self.timer_at[a] != Some(at) {
                self.timer_at[a] = Some(at);
                let process = ag.process;
                self.push(at, Ev::Timer { a, process });
            }
        }
    }

    pub fn did(&mut self, a: usize, d: Did) {
        match d {
            Did::Ask(id, command) | Did::Tell(id, command) => {
                self.note(|| format!("n{a} asks {}", short(&command)));
                if let Command::Register { wants_round } = &command {
                    self.check_register(a, *wants_round);
                }
                self.feed(a, Input::Command(id, command));
            }
            Did::Started(round) => {
                self.note(|| format!("n{a} runs round {} {:?}", round.number, names(&round)));
                self.check_start(a, &round);
                self.formed(a);
            }
            Did::Stopped(why) => self.note(|| format!("n{a} stops its workers: {why}")),
            Did::Exited(why) => self.note(|| format!("n{a} exits: {why}")),
            Did::GaveUp { round, count } => {
                self.note(|| {
                    format!("n{a} gives up: the restart budget is spent in round {round} (restart count {count})")
                });
            }
            Did::Note(what) => self.note(|| format!("n{a}: {what}")),
        }
    }

    /// Agent `a` runs a round: if its process's first, how many writes it took.
    fn formed(&mut self, a: usize) {
        let process = self.agents[a].process;
        if self.formed[a] == process {
            return;
        }
        self.formed[a] = process;
        let made = self.writes[a].load(std::sync::atomic::Ordering::Relaxed);
        let n = made - self.writes_at_start[a];
        self.formation_writes = self.formation_writes.max(n);
        if let Some(most) = self.opts.formation_writes.filter(|m| n > *m) {
            self.violate(format!(
                "formation: n{a} made {n} etcd writes before it first ran a round (at most {most})"
            ));
        }
    }

    fn carry_out(&mut self, a: usize, effects: Vec<Effect>) {
        for effect in effects {
            let process = self.agents[a].process;
            match effect {
                Effect::Etcd(Op::KeepAlive) => {
                    // Sent on the open stream: done at once; the answer comes on the stream.
                    self.push(
                        self.now_ms,
                        Ev::Deliver {
                            a,
                            process,
                            input: Input::Answer(Ok(Answer::Done)),
                        },
                    );
                    self.send_keep_alive(a);
                }
                Effect::KeepAlive => self.send_keep_alive(a),
                Effect::Etcd(op) => {
                    let lat = self.latency(a);
                    self.after(lat, Ev::Arrive { a, process, op });
                }
                Effect::Reply(id, result) => {
                    if let Some(d) = self.agents[a].answered(id, &result) {
                        self.did(a, d);
                    }
                }
                Effect::CloseWatches => {
                    self.note(|| format!("n{a} closes its watches"));
                    let ag = &mut self.agents[a];
                    ag.watching = None;
                    ag.kept = None;
                    ag.streams += 1;
                }
                // A port is free at once here, with no event of its own: the schedules
                // stay as they were.
                Effect::PickPort => {
                    let now = self.now();
                    if let Some(m) = self.agents[a].machine.as_mut() {
                        let more = m.step(now, Input::Port(Some(29_500)));
                        self.carry_out(a, more);
                    }
                }
                Effect::Probe(on) => {
                    self.agents[a].probing = on;
                    if on {
                        self.after(0, Ev::Probe { a, process });
                    }
                }
            }
        }
    }

    /// One keep-alive on agent `a`'s open stream, if it has one.
    fn send_keep_alive(&mut self, a: usize) {
        let Some(lease) = self.agents[a].kept else {
            return;
        };
        let lat = self.latency(a);
        let streams = self.agents[a].streams;
        self.after(lat, Ev::KeepAlive { a, streams, lease });
    }

    /// A phase as the trace shows it: times from the start of the run.
    fn phase(&self, p: crate::etcd::session::Phase) -> String {
        use crate::etcd::session::{Phase, Resync};
        match p {
            Phase::Disconnected { until } => format!("Disconnected until {}ms", self.ms(until)),
            Phase::Syncing(Resync::RoleChanged { .. }) => "Syncing(RoleChanged)".into(),
            Phase::Watching { role, .. } => format!("Watching({role:?})"),
            other => format!("{other:?}"),
        }
    }

    pub fn clear_timer(&mut self, a: usize) {
        self.timer_at[a] = None;
    }

    pub fn deliver_stream(&mut self, a: usize, streams: u64, input: Input) {
        if self.agents[a].streams != streams {
            return;
        }
        if self.agents[a].life == Life::Frozen {
            // Read at the thaw, if the stream is still open then.
            return self.agents[a].frozen_inbox.push((Some(streams), input));
        }
        if let Input::Watched(batch) = &input {
            let gone: Vec<&str> = batch
                .iter()
                .filter_map(|e| match e {
                    WatchEvent::Delete { key, .. } => Some(key.as_str()),
                    WatchEvent::Put(_) => None,
                })
                .collect();
            if !gone.is_empty() && self.trace.is_some() {
                let gone = gone.join(",");
                self.note(|| format!("n{a} sees deleted {gone}"));
            }
        }
        self.feed(a, input);
    }
}

pub fn names(r: &v1::Round) -> Vec<String> {
    r.members
        .iter()
        .map(|m| format!("{}#..{}", m.node_id, m.incarnation % 1_000_000))
        .collect()
}

fn short(c: &Command) -> String {
    match c {
        Command::Register { wants_round } => format!("register for round {wants_round}"),
        Command::Running { round } => format!("running round {}", round.number),
        Command::Write(o) => format!("{} ({})", o.writing, o.key),
        Command::Depart { how, .. } => format!("depart ({how:?})"),
        Command::Abandon { .. } => "abandon the fenced lease".into(),
        Command::Evict { node, lease, .. } => format!("evict {node} (lease {lease})"),
        other => format!("{other:?}"),
    }
}
