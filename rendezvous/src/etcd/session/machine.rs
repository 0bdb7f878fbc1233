//! The session machine: its state, [`Machine::step`], and what every phase does with an
//! input. The steps of a sync and of a command live in `sync.rs` and `serve.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::admission::{Admission, paced};
use super::departures::Sayer;
use super::duty::{Commit, Duty};
use super::fault::{Fault, FaultKind};
use super::flight::Flight;
use super::io::{Answer, Command, Effect, Input, Op};
use super::lease::LeaseKeeper;
use super::outage::Outage;
use super::published::Published;
use super::registration::Registration;
use super::serve::Serving;
use super::sync::Todo;
use super::turn::Frontier;
use super::watches::Watches;
use crate::Counters;
use crate::etcd::keys::Keys;
use crate::etcd::view::View;
use crate::seal::SealConfig;

pub(super) const FIRST_RETRY: Duration = Duration::from_millis(100);
pub(super) const LAST_RETRY: Duration = Duration::from_secs(2);

/// What the machine is given at start.
#[derive(Debug, Clone)]
pub struct Config {
    pub keys: Keys,
    pub node_id: String,
    /// The address this node advertises (registration, master).
    pub addr: String,
    /// Where its status port answers (`host:port`), empty when it serves none.
    pub status_addr: String,
    pub local_world_size: u32,
    pub ttl: Duration,
    /// How long etcd may stay unreachable before the session gives up.
    pub outage_limit: Duration,
    /// How long before the lease could expire the agent fences (the prober must have
    /// found its proof by then).
    pub fence_margin: Duration,
    pub seal: SealConfig,
    /// etcd has several endpoints: a late keep-alive answer means trying another member.
    pub several_endpoints: bool,
    /// The agent's restart budget, told in its registration for `fsdp-agent status`.
    pub budget: crate::etcd::Budget,
    /// What makes agents one job ([`crate::job`]), written in the registration and, by a
    /// coordinator, in the rounds it seals.
    pub job: String,
    /// Where this node sits (`Member.segment`, [`crate::topology`]); empty: no location.
    pub segment: String,
    /// This agent serves the store it uses, started empty: a round that others put back
    /// gets their re-registration a grace before anyone is declared lost.
    pub fresh_store: bool,
    /// A round of more members than this is sealed placed ([`crate::etcd::placement`]).
    pub placement_above: usize,
    /// How a placed round is cut ([`crate::etcd::placement::Shape::ETCD`] but in the
    /// simulator).
    pub placement_shape: crate::etcd::placement::Shape,
    /// The driver can look for proof that etcd has no leader ([`Effect::Probe`]).
    pub can_probe: bool,
    /// The run is a crowd whose joins are spread and gated ([`super::gated`]; the
    /// simulator's scaled down): a joining node's keep-alives keep the times set at its
    /// grant when its watches open.
    pub crowd: bool,
    /// How many of a crowd's nodes go at once ([`super::CROWD`]; the simulator's scaled
    /// down): the coordinator of a larger run publishes how far it may go
    /// ([`super::turn::Frontier`]).
    pub crowd_window: u32,
    /// etcd is the c10d store an agent serves (for the give-up message).
    pub embedded_store: bool,
    /// The lease the handle granted at join, when it asked for it, and the Unix time in ms
    /// then (round records carry wall-clock times; the machine counts from this one).
    pub lease: i64,
    pub granted_at: Instant,
    pub unix_ms_at_grant: u64,
    /// The incarnation of this process's first registration: above every incarnation an
    /// earlier process of the same node id used ([`first_incarnation`]).
    pub first_incarnation: u64,
    /// What this node accepts from the records others write.
    pub allowed: crate::etcd::record::Allowed,
}

/// The first incarnation of a process started at `unix_ms`: a node id outlives its
/// processes (a pod restarted in place keeps its name), and the departure of the last
/// process's registration must not read as the departure of the next one's. Counting from
/// the start time in microseconds keeps every process above the one before it (it would
/// have to register again once a microsecond to catch up).
pub fn first_incarnation(unix_ms: u64) -> u64 {
    unix_ms.saturating_mul(1000).max(1)
}

/// Why the session reads the run again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resync {
    /// The first read, at join.
    First,
    /// This node became or stopped being coordinator: the watches change, nothing was
    /// lost in between. A pending outage grace carries over.
    RoleChanged { grace_until: Option<Instant> },
    /// etcd failed, a stream ended, or the lease was replaced: members get a grace to
    /// come back before anyone is declared lost.
    Outage,
}

/// The session's phases (drawn in docs/architecture.md, "The etcd session").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Read the run, rebuild the view, make sure the lease and registration live, open
    /// the watches.
    Syncing(Resync),
    /// Watches of `role` open, `lease` kept alive; commands served between events.
    Watching { role: super::io::Role, lease: i64 },
    /// etcd failed; commands that need no etcd are served, the rest wait until `until`,
    /// when the session syncs again.
    Disconnected { until: Instant },
    /// The lease was revoked on request, the session gave up, or the handle is gone.
    Ended,
}

/// What the op in flight was for.
#[derive(Debug)]
pub(super) enum Then {
    Todo(Todo),
    Command(Serving),
    Commit(Commit),
}

/// The etcd session of one agent, without I/O: [`Machine::step`] takes what happened and
/// returns what to do. Its state is in parts that each own theirs (each part's fields are
/// private to its file): the lease keeper, the trouble with etcd, the work in hand, the
/// coordinator's duty, the departure records, this node's registration, and what the
/// last sync read.
pub struct Machine {
    pub(super) cfg: Config,
    pub(super) now: Instant,
    /// Changed only in `phases.rs`.
    pub(super) phase: Phase,
    pub(super) view: Published,
    pub(super) lease: LeaseKeeper,
    pub(super) admission: Admission,
    /// As coordinator of a crowd: how far it may go (`admit.rs`).
    pub(super) frontier: Option<Frontier>,
    pub(super) outage: Outage,
    pub(super) flight: Flight,
    pub(super) duty: Duty,
    pub(super) sayer: Sayer,
    pub(super) me: Registration,
    pub(super) watches: Watches,
    pub(super) counters: Counters,
    pub(super) writes: Arc<AtomicU64>,
    /// The run's control keys as the handle read them before the grant, for the first
    /// sync ([`Machine::with_first_read`]).
    pub(super) first_read: Option<super::FirstRead>,
    /// When this crowd member reads its shard of the first placed round (`shard_read.rs`).
    pub(super) shard_read_at: Option<Instant>,
}

impl Machine {
    pub fn new(cfg: Config, counters: Counters, writes: Arc<AtomicU64>) -> Self {
        let lease = LeaseKeeper::new(cfg.lease, cfg.first_incarnation, cfg.granted_at, cfg.ttl);
        counters.lease.send_replace(cfg.lease);
        let now = cfg.granted_at;
        let view = View {
            lease_safe_until: lease.clock().safe_until(),
            incarnation: cfg.first_incarnation,
            allowed: cfg.allowed.clone(),
            ..View::default()
        };
        Self {
            lease,
            admission: Admission::new(&cfg.node_id, cfg.ttl),
            frontier: Frontier::scaled(cfg.seal.max_nodes, cfg.ttl, cfg.crowd_window),
            duty: Duty::new(cfg.seal, now),
            cfg,
            now,
            phase: Phase::Syncing(Resync::First),
            view: Published::new(view),
            outage: Outage::default(),
            flight: Flight::new(now),
            sayer: Sayer::default(),
            me: Registration::default(),
            watches: Watches::default(),
            counters,
            writes,
            first_read: None,
            shard_read_at: None,
        }
    }

    /// The first sync takes `read` (the run's control keys, read by the handle in the
    /// nesting check's transaction before the grant) as its read, instead of reading
    /// them again after the grant: one request less for each joining node. The watches
    /// go on from the revision after it, so nothing written since is missed.
    #[must_use]
    pub fn with_first_read(mut self, read: super::FirstRead) -> Self {
        self.first_read = Some(read);
        self
    }

    /// The first sync. No port for a master is asked for here: only a coordinator that is
    /// its round's rank 0 needs one, it asks when it seals (`duty.rs`: the driver answers
    /// at once), and one found at the start was older than a TTL by the seal of any
    /// large run, so asked again (10,000 binds for one port in the bench's process).
    pub fn start(&mut self, now: Instant) -> Vec<Effect> {
        self.now = now;
        self.begin_sync(Resync::First);
        self.advance();
        self.flight.take_effects()
    }

    /// Takes one input at `now` and returns what to do. An [`Input::Answer`] answers the
    /// op in flight; anything else waits until no op is in flight and no work is left,
    /// but for what counts at once (below) and a held look, which starts at its time
    /// whatever is in flight (see `start_held_look`).
    pub fn step(&mut self, now: Instant, input: Input) -> Vec<Effect> {
        self.now = now;
        if self.said_by_etcd(&input) {
            self.outage.heard(now);
        }
        if matches!(input, Input::Timer) {
            self.start_held_look();
        }
        match input {
            Input::Answer(answer) => self.on_answer(answer),
            // A proof counts at once, even while an op waits on the etcd it is about.
            Input::NoLeader { sent, silent } => self.no_leader(sent, silent),
            Input::Port(port) => {
                if self.duty.port(port, now) {
                    self.flight.then(Todo::Coordinate);
                }
            }
            // The lease's keep-alives go on while an op waits, and their answers count at
            // once (see `keep_alive_beside`).
            Input::Timer if self.busy() => self.send_keep_alive_beside(),
            Input::LeaseAnswer(Some(ttl)) if ttl > 0 && self.counts_beside() => {
                self.on_input(input);
            }
            // A joining node's lease gone: a new one before the sync's next step.
            Input::LeaseAnswer(_)
                if self.counts_beside() && self.phase == Phase::Syncing(Resync::First) =>
            {
                self.on_input(input);
            }
            Input::Command(id, departure @ Command::Depart { .. })
                if self.phase != Phase::Ended =>
            {
                self.flight.leave(id, departure);
            }
            other => self.flight.queue(other),
        }
        self.advance();
        if let Some(r) = &self.view.round {
            let live = matches!(self.phase, Phase::Watching { .. });
            self.duty.saw_round(&r.record, now, live);
        }
        self.flight.take_effects()
    }

    /// The answer to the op in flight.
    fn on_answer(&mut self, answer: Result<Answer, Fault>) {
        let Some(then) = self.flight.answered() else {
            return tracing::debug!("an answer nobody waited for");
        };
        let overloaded = answer
            .as_ref()
            .is_err_and(|e| e.kind == FaultKind::Overloaded);
        if !overloaded && self.flight.in_flight().is_some_and(paced) {
            self.admission.answered(self.flight.sent(), self.now);
        }
        match answer {
            Err(e) if e.kind == FaultKind::Overloaded && self.may_retry(&then) => {
                self.slowed_down(then, e)
            }
            answer => self.on_answer_of(then, answer),
        }
    }

    /// The answer to the op in flight, for `then`.
    pub(super) fn on_answer_of(&mut self, then: Then, answer: Result<Answer, Fault>) {
        self.flight.done();
        // A keep-alive is answered by the local send, not by etcd: it says nothing of
        // whether etcd keeps up.
        if answer.is_ok() && !matches!(then, Then::Todo(Todo::KeepAlive)) {
            self.outage.keeps_up();
        }
        match then {
            Then::Todo(todo) => self.on_todo_answer(todo, answer),
            Then::Command(serving) => self.on_command_answer(serving, answer),
            Then::Commit(commit) => self.on_commit_answer(commit, answer),
        }
    }

    /// The prober saw etcd without a leader, looking at `sent`.
    fn no_leader(&mut self, sent: Instant, silent: bool) {
        let heard_lately = self
            .outage
            .heard_at()
            .is_some_and(|h| h + self.cfg.ttl / 8 > sent);
        if silent && heard_lately {
            // A connection nobody answered, while this session heard etcd lately:
            // loaded, not stopped (at 4,000 to 10,000 nodes, etcd took longer than
            // the probe's eighth of a TTL to answer new connections, with a leader
            // that went on expiring leases). A stopped etcd says nothing on any
            // stream. Lately: an eighth of a TTL, as long as the look itself
            // waits. With a fence margin up to a third of a TTL the first look
            // comes later than that after the last word a frozen etcd can have
            // said (the keep-alive after it is sent a third of a TTL after the
            // last answered one, the look a quarter TTL before the fence at the
            // earliest), so a freeze is still proved in time; a longer window cost
            // such fences.
            tracing::debug!(?sent, "a silent etcd heard from lately proves nothing");
        } else {
            self.lease.no_leader_at(sent, self.cfg.ttl);
            self.publish_lease();
        }
    }

    /// The view, when it changed since the last call.
    pub fn changed_view(&mut self) -> Option<&View> {
        self.view.take_changed()
    }

    /// When nothing but the lease clock moved since the last look, and moved later: its
    /// new moment, to hand on without waking anyone. Every keep-alive answer moves it; a
    /// copy of the view and a look at the held round for each was most of what an idle
    /// agent cost at 1,000 nodes. A clock that moved earlier is a change like any other
    /// ([`Machine::changed_view`]): a wait timed by the old moment would fence late.
    pub fn lease_moved(&mut self) -> Option<Option<Instant>> {
        self.view.take_lease_moved()
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn view(&self) -> &View {
        &self.view
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// The address this node advertises (where a port for a master is picked).
    pub fn addr(&self) -> &str {
        &self.cfg.addr
    }

    pub fn keys(&self) -> &Keys {
        &self.cfg.keys
    }

    pub fn ttl(&self) -> Duration {
        self.cfg.ttl
    }

    /// The lease this node's keys live on now.
    #[cfg(any(test, feature = "sim"))]
    pub fn lease(&self) -> i64 {
        self.lease.id()
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn incarnation(&self) -> u64 {
        self.lease.incarnation()
    }

    /// About how many bytes of watch events wait in the inbox.
    pub fn queued_bytes(&self) -> usize {
        self.flight.inbox().bytes()
    }

    /// Whether an op is in flight (its answer is the next input that counts).
    pub fn busy(&self) -> bool {
        self.flight.busy()
    }

    /// When [`Input::Timer`] is due, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        [self.timer(), self.outage.look_held_until()]
            .into_iter()
            .flatten()
            .min()
    }

    /// When a held look for proof that etcd has no leader is to start, if one is held:
    /// the driver hears it also while an op that uses the streams is in flight.
    pub fn look_held_until(&self) -> Option<Instant> {
        self.outage.look_held_until()
    }

    /// A held look's time came at `now` while an op that uses the streams is in flight:
    /// the prober's switch, if it starts (nothing else moves meanwhile).
    pub fn held_look_due(&mut self, now: Instant) -> Vec<Effect> {
        self.now = now;
        self.start_held_look();
        self.flight.take_effects()
    }

    /// When the machine's own work is next due (the held look aside).
    fn timer(&self) -> Option<Instant> {
        if self.busy() {
            return self.keep_alive_beside();
        }
        if let Some(at) = self.flight.retry_due() {
            // Only for the lease the stream was opened for: a command that took a new
            // lease meanwhile resyncs once it is answered (found by the simulator: a
            // keep-alive due at once, never sent, woke the machine without end).
            let keep_alive = if self.keeps_own_lease() {
                self.lease.keep_alive_due()
            } else {
                None
            };
            return Some(keep_alive.map_or(at, |k| k.min(at)));
        }
        if !self.flight.idle() {
            return None;
        }
        match self.phase {
            Phase::Watching { .. } => [
                self.lease.keep_alive_due(),
                self.shard_read_at,
                self.outage.count_due(),
                self.duty.next_timer(),
                self.frontier.as_ref().and_then(Frontier::wake),
                self.watches.grace_until(),
                self.answer_due(),
            ]
            .into_iter()
            .flatten()
            .min(),
            Phase::Disconnected { until } => Some(until),
            Phase::Syncing(_) | Phase::Ended => None,
        }
    }

    /// Works until an op is in flight or nothing is left to do.
    fn advance(&mut self) {
        while !self.busy() && self.phase != Phase::Ended {
            if let Some((id, departure)) = self.flight.take_leaving() {
                self.serve(id, departure);
            } else if let Some(at) = self.flight.retry_due() {
                if self.now < at {
                    self.keep_alive_while_waiting();
                    break;
                }
                if let Some((then, op)) = self.flight.take_retry() {
                    self.issue(then, op);
                }
            } else if let Some(todo) = self.flight.next_todo() {
                self.run(todo);
            } else if let Some(input) = self.flight.next_input() {
                self.on_input(input);
            } else {
                break;
            }
        }
        if self.phase == Phase::Ended {
            self.end_requests();
        }
    }

    pub(super) fn unexpected(&mut self, answer: &Answer) {
        let what = format!("an answer of the wrong kind: {answer:?}");
        self.lost(Fault::local(std::io::ErrorKind::Other, what));
    }

    /// Sends `op`; its answer goes to `then`. A joining node holds a request until its
    /// pace lets it go (`admission.rs`), keeping its lease alive meanwhile, as while a
    /// refused request waits to go again.
    pub(super) fn issue(&mut self, then: Then, op: Op) {
        if self.paces(&op) {
            if let Some(at) = self.admission.wait(self.now) {
                self.held_by_pace(self.now, at);
                return self.flight.retry_at(at, then, op);
            }
        }
        self.flight.issue(self.now, then, op);
    }

    /// A request that could go at `from` waits for this node's pace until `at`
    /// (`Counters::paced_ns`).
    pub(super) fn held_by_pace(&self, from: Instant, at: Instant) {
        let held = u64::try_from(at.saturating_duration_since(from).as_nanos());
        let held = held.unwrap_or(u64::MAX);
        self.counters.paced_ns.fetch_add(held, Ordering::Relaxed);
    }

    /// Whether `op` waits for this node's pace (`admission.rs`): a request etcd serves,
    /// while the node joins and a stream keeps its lease alive (a lease held unkept, an
    /// outage's sync or a lease granted again while joining, must not wait out its TTL)
    /// or it is the grant of a lease (there is none to keep: a crowd's nodes whose leases
    /// expired granted new ones at once, 141,925 grants for 20,000 nodes, each lease one
    /// more proposal to apply and one more to expire), and never a coordinator's: its
    /// seals, reads and evictions are every node's way on (one that ended up a spare
    /// would otherwise stay paced for good). Nor the read of this node's own shard of a
    /// placed round: one key of about 1 KB per member and seal, where a member's
    /// formation ends; held (a keep-alive answered late at the seal paces the next
    /// request), its node was the formation's straggler. A whole roster or run read
    /// stays paced.
    pub(super) fn paces(&self, op: &Op) -> bool {
        let reads_its_shard = matches!(
            op,
            Op::Range { key, prefix: false, .. } if self.cfg.keys.is_placement(key)
        );
        paced(op)
            && !reads_its_shard
            && self.admission.active()
            && (self.keeps_own_lease() || matches!(op, Op::Grant { .. }))
            && self.role() != super::io::Role::Coordinator
    }

    /// Whether a keep-alive stream keeps this node's current lease alive (a lease granted
    /// again, or an outage's sync, has none until its watches open).
    pub(super) fn keeps_own_lease(&self) -> bool {
        self.kept_lease() == Some(self.lease.id())
    }

    /// The lease whose keep-alive stream is open: the watches' in the watching phase, or
    /// the one a joining node keeps alive from its grant during its first sync.
    pub(super) fn kept_lease(&self) -> Option<i64> {
        match self.phase {
            Phase::Watching { lease, .. } => Some(lease),
            Phase::Syncing(Resync::First) => self.lease.kept_from_grant(),
            _ => None,
        }
    }

    /// Whether `input` is something etcd said (not the driver's own doing: a local send,
    /// a deadline, a broken connection).
    fn said_by_etcd(&self, input: &Input) -> bool {
        match input {
            Input::Watched(_) | Input::WatchCreated { .. } | Input::LeaseAnswer(_) => true,
            Input::StreamFailed(e) | Input::KeepAliveFailed(e) => e.said_by_etcd(),
            // A keep-alive is answered by the local send.
            Input::Answer(Ok(_)) => {
                !matches!(self.flight.awaiting(), Some(Then::Todo(Todo::KeepAlive)))
            }
            Input::Answer(Err(e)) => e.said_by_etcd(),
            _ => false,
        }
    }

    /// When the next keep-alive is due while an op is in flight, if it may go beside it.
    /// An op can wait in etcd far longer than a keep-alive period: under load a write
    /// waited seconds for "request timed out", and a lease renewed only between ops
    /// expired meanwhile (at 10,000 nodes, thousands of keep-alive streams ended in
    /// "lease not found", each a registration again and a resync). etcd's leader renews
    /// a lease without a consensus round, so keep-alives still get through when writes
    /// are slow. Only for the lease the open stream keeps, on a stream that has not
    /// ended, and not beside the keep-alive or reopen that is itself in flight.
    pub(super) fn keep_alive_beside(&self) -> Option<Instant> {
        let own = matches!(
            self.flight.awaiting(),
            Some(Then::Todo(
                Todo::KeepAlive | Todo::ReopenKeepAlive | Todo::KeepFromGrant
            ))
        );
        if own || self.lease.stream_ended() || !self.counts_beside() {
            return None;
        }
        self.lease.keep_alive_due()
    }

    /// Whether a keep-alive answer counts at once, while an op is in flight: only on
    /// the stream of the lease held, and only if no answer waits before it (the lease
    /// clock pairs answers with keep-alives in the order they were sent).
    fn counts_beside(&self) -> bool {
        let held = self.keeps_own_lease();
        self.busy() && held && !self.flight.inbox().holds_lease_answer()
    }

    /// A timer while an op is in flight: the keep-alive, if due (and a held look, in
    /// `step`). Every other timer waits for the answer (the inbox keeps no timer: the
    /// deadline asks again).
    fn send_keep_alive_beside(&mut self) {
        if self.keep_alive_beside().is_some_and(|at| at <= self.now) {
            self.lease.sent(self.now, self.cfg.ttl);
            self.flight.emit(Effect::KeepAlive);
        }
    }

    /// While an op waits to be sent again, the lease still needs its keep-alives (a
    /// busy spell can outlast a TTL in retries) and their answers still move the lease
    /// clock; everything else waits its turn.
    fn keep_alive_while_waiting(&mut self) {
        let mut answers = Vec::new();
        let now = self.now;
        let mut ended = false;
        self.flight.sort_inputs(|input| match input {
            Input::LeaseAnswer(_) => {
                answers.push(input);
                None
            }
            Input::KeepAliveFailed(e) if e.kind == FaultKind::Overloaded => {
                ended = true;
                None
            }
            // The deadline asks again; the retry's own time is what it waited for.
            Input::Timer => None,
            other => Some(other),
        });
        for answer in answers {
            self.on_input(answer);
        }
        if ended {
            // A keep-alive on a new stream at once.
            self.lease.ended(Some(now));
        }
        let Some(lease) = self.kept_lease() else {
            return;
        };
        if lease != self.lease.id() || self.lease.keep_alive_due().is_none_or(|at| at > now) {
            return;
        }
        // Once per keep-alive period, whatever the outcome: a reopen etcd is too busy for
        // is not sent again at once.
        if self.lease.stream_ended() {
            self.lease.later(now, self.cfg.ttl);
            let op = Op::ReopenKeepAlive { lease };
            return self.issue(Then::Todo(Todo::ReopenKeepAlive), op);
        }
        self.lease.sent(now, self.cfg.ttl);
        self.issue(Then::Todo(Todo::KeepAlive), Op::KeepAlive);
    }
}
