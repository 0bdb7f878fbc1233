//! The session machine: its state, [`Machine::step`], and what every phase does with an
//! input. The steps of a sync and of a command live in `sync.rs` and `serve.rs`.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::departures::Saying;
use super::io::{Answer, Command, CommandId, Effect, Input, Op, Role};
use super::serve::Serving;
use super::sync::Todo;
use crate::Counters;
use crate::etcd::connect::{overloaded, too_large};
use crate::etcd::coordinator::Coordinator;
use crate::etcd::keys::Keys;
use crate::etcd::left;
use crate::etcd::view::View;
use crate::fence::LeaseClock;
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
    /// This agent serves the store it uses, started empty: a round that others put back
    /// gets their re-registration a grace before anyone is declared lost.
    pub fresh_store: bool,
    /// The driver can look for proof that etcd has no leader ([`Effect::Probe`]).
    pub can_probe: bool,
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
    /// A port free on `addr` now, for the master of a round this node seals as its rank 0
    /// (the driver's is [`crate::port::free_port`]; a simulation's a fixed one).
    pub pick_port: fn(&str) -> Option<u16>,
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
    Watching { role: Role, lease: i64 },
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
    Commit {
        number: u64,
        members: usize,
        restart_count: u32,
        reason: String,
    },
}

/// The etcd session of one agent, without I/O: [`Machine::step`] takes what happened and
/// returns what to do.
pub struct Machine {
    pub(super) cfg: Config,
    pub(super) now: Instant,
    pub(super) view: View,
    pub(super) view_changed: bool,
    /// Only the lease clock moved, and later: nobody needs waking for it.
    pub(super) lease_moved: bool,
    pub(super) clock: LeaseClock,
    /// The lease this node's keys live on; only the session replaces it.
    pub(super) lease: i64,
    /// The registration to write again whenever the lease is new.
    pub(super) member: Option<v1::Member>,
    /// The lease and incarnation of the registration last written (etcd took it): while
    /// they are the current ones and its key was not seen to go, it is still in etcd.
    pub(super) written: Option<(i64, u64)>,
    /// This agent's registrations so far ([`v1::Member`]'s `incarnation`): a new lease, or
    /// a registration written again after its key was deleted, is the next one.
    pub(super) incarnation: u64,
    /// The round this agent runs.
    pub(super) running: Option<std::sync::Arc<v1::Round>>,
    /// The newest round this agent has seen: put back when etcd comes back without any
    /// (its data lost), so that round numbers and the restart count go on.
    pub(super) known_round: Option<v1::Round>,
    /// The round the view holds and when this agent first saw it: how long ago a round
    /// was sealed, by this agent's own clock ([`v1::Round::charged_ago_ms`]).
    /// (Whether it was seen while watching, that is sealed, not read at a sync.)
    pub(super) round_seen: Option<(u64, Instant, bool)>,
    /// The churn episode ([`crate::pace::HoldRule::Churn`]) already said at info.
    pub(super) churn_said: Option<u64>,
    /// The highest round number this agent has seen: a new round is numbered past it.
    pub(super) highest_round: Option<u64>,
    pub(super) coordinator: Coordinator,
    pub(super) counters: Counters,
    pub(super) writes: Arc<AtomicU64>,
    /// Failures since the last good watch: the next sync waits
    /// `backoff::nth(FIRST_RETRY, LAST_RETRY, n)`.
    pub(super) failures: u32,
    /// Commands waiting for etcd, oldest first: served after the next sync, never
    /// answered with a transient error.
    pub(super) pending: VecDeque<(CommandId, Command)>,
    /// Since when etcd has not answered (the first failure of an outage).
    pub(super) outage_since: Option<Instant>,
    /// etcd has one member (from its member list at the last sync): only then can the
    /// prober prove that it has no leader.
    pub(super) single_member: bool,
    pub(super) probing: bool,
    /// Several endpoints: the connection's member failed, pin another at the next sync.
    pub(super) reselect: bool,
    /// Revoke the lease and take a new one at the next sync (this node fenced itself).
    pub(super) abandon: bool,
    /// Why this node fenced itself, to write before its lease is revoked.
    pub(super) fenced_word: Option<v1::Left>,
    /// As coordinator: the departures of round members it recorded or found explained.
    pub(super) dealt: BTreeSet<left::Departure>,
    /// As coordinator: the departure record write in flight.
    pub(super) saying: Option<Saying>,
    pub(super) phase: Phase,
    /// What is left to do before the next input is looked at.
    pub(super) todo: VecDeque<Todo>,
    pub(super) awaiting: Option<Then>,
    /// Inputs that came while an op was in flight or work was left.
    pub(super) inbox: super::inbox::Inbox,
    pub(super) effects: Vec<Effect>,
    /// When the op in flight was sent.
    pub(super) sent: Instant,
    /// Outage grace: members of our round not back by then are gone.
    pub(super) grace_until: Option<Instant>,
    /// When the coordinator asked to look again.
    pub(super) recheck: Option<Instant>,
    /// The coordinator key went and this node is not the first to claim it: when to claim
    /// it if nobody has by then.
    pub(super) campaign_at: Option<Instant>,
    pub(super) keep_alive_at: Option<Instant>,
    /// The revision of the last ranged read (the watches start after it).
    pub(super) read_rev: i64,
    /// The view was read from the control keys alone (a joining member's first sync):
    /// it holds no registrations, so it cannot seal or judge who vanished until a whole
    /// read (the role change that makes this node coordinator brings one).
    pub(super) control_only: bool,
    /// This sync must read the whole run even if it is the first.
    pub(super) whole_read: bool,
    /// The op in flight, kept to be sent again if etcd answers that it is overloaded.
    pub(super) in_flight: Option<Op>,
    /// An op etcd was too busy for, and when to send it again. Until then the machine
    /// waits as if it were still in flight.
    pub(super) retry: Option<(Instant, Then, Op)>,
    /// Overloaded answers in a row, and since when: the next retry waits longer, and a
    /// busy spell longer than the outage bound ends the session as an outage would.
    pub(super) slowed: u32,
    pub(super) slowed_since: Option<Instant>,
    /// etcd ended the keep-alive stream for load: the next keep-alive needs a new one.
    pub(super) keep_alive_ended: bool,
    /// When etcd last said anything to this session (see [`Machine::said_by_etcd`]).
    heard_at: Option<Instant>,
    /// The role and lease the watches being opened are for.
    pub(super) watch_role: Role,
    pub(super) watch_lease: i64,
}

impl Machine {
    pub fn new(cfg: Config, counters: Counters, writes: Arc<AtomicU64>) -> Self {
        let mut clock = LeaseClock::default();
        clock.replaced(cfg.granted_at, cfg.ttl);
        counters.lease.send_replace(cfg.lease);
        let now = cfg.granted_at;
        let view = View {
            lease_safe_until: clock.safe_until(),
            incarnation: cfg.first_incarnation,
            allowed: cfg.allowed.clone(),
            ..View::default()
        };
        Self {
            incarnation: cfg.first_incarnation,
            lease: cfg.lease,
            coordinator: Coordinator::new(cfg.seal, now),
            cfg,
            now,
            view,
            view_changed: true,
            lease_moved: false,
            clock,
            member: None,
            written: None,
            running: None,
            known_round: None,
            round_seen: None,
            churn_said: None,
            highest_round: None,
            counters,
            writes,
            failures: 0,
            pending: VecDeque::new(),
            outage_since: None,
            single_member: false,
            probing: false,
            reselect: false,
            abandon: false,
            fenced_word: None,
            dealt: BTreeSet::new(),
            saying: None,
            phase: Phase::Syncing(Resync::First),
            todo: VecDeque::new(),
            awaiting: None,
            inbox: super::inbox::Inbox::default(),
            effects: Vec::new(),
            sent: now,
            grace_until: None,
            recheck: None,
            campaign_at: None,
            keep_alive_at: None,
            read_rev: 0,
            control_only: false,
            whole_read: false,
            watch_role: Role::Member,
            watch_lease: 0,
            in_flight: None,
            retry: None,
            slowed: 0,
            slowed_since: None,
            keep_alive_ended: false,
            heard_at: None,
        }
    }

    /// The first sync.
    pub fn start(&mut self, now: Instant) -> Vec<Effect> {
        self.now = now;
        self.begin_sync(Resync::First);
        self.advance();
        std::mem::take(&mut self.effects)
    }

    /// Takes one input at `now` and returns what to do. An [`Input::Answer`] answers the
    /// op in flight; anything else waits until no op is in flight and no work is left.
    pub fn step(&mut self, now: Instant, input: Input) -> Vec<Effect> {
        self.now = now;
        if self.said_by_etcd(&input) {
            self.heard_at = Some(now);
        }
        match input {
            Input::Answer(answer) => match (self.awaiting.take(), answer) {
                (Some(then), Err(e)) if overloaded(&e) && self.may_retry(&then) => {
                    self.slowed_down(then, e)
                }
                (Some(then), answer) => {
                    self.in_flight = None;
                    // A keep-alive is answered by the local send, not by etcd: it says
                    // nothing of whether etcd keeps up.
                    let from_etcd = !matches!(then, Then::Todo(Todo::KeepAlive));
                    if answer.is_ok() && from_etcd {
                        (self.slowed, self.slowed_since) = (0, None);
                    }
                    self.on_answer(then, answer)
                }
                (None, _) => tracing::debug!("an answer nobody waited for"),
            },
            // A proof counts at once, even while an op waits on the etcd it is about.
            Input::NoLeader { sent, silent } => {
                if silent && self.heard_at.is_some_and(|h| h + self.cfg.ttl / 8 > sent) {
                    // A connection nobody answered, while this session heard etcd lately:
                    // loaded, not stopped (at 4,000 to 10,000 nodes, etcd took longer than
                    // the probe's eighth of a TTL to answer new connections, with a leader
                    // that went on expiring leases). A stopped etcd says nothing on any
                    // stream. Lately: an eighth of a TTL, as long as the look itself
                    // waits. With a fence margin up to a third of a TTL the first look
                    // comes later than that after the last word a frozen etcd can have
                    // said (the keep-alive after it is sent a third of a TTL after the
                    // last answered one, the look a quarter TTL before the fence), so a
                    // freeze is still proved in time; a longer window cost such fences.
                    tracing::debug!(?sent, "a silent etcd heard from lately proves nothing");
                } else {
                    self.clock.no_leader_at(sent, self.cfg.ttl);
                    self.publish_lease();
                }
            }
            // The lease's keep-alives go on while an op waits, and their answers count at
            // once (see `keep_alive_beside`).
            Input::Timer if self.busy() => self.send_keep_alive_beside(),
            Input::LeaseAnswer(Some(ttl)) if ttl > 0 && self.counts_beside() => {
                self.on_input(input);
            }
            other => self.inbox.push_back(other),
        }
        self.advance();
        if let Some(r) = &self.view.round {
            let n = r.record.number;
            if self.round_seen.is_none_or(|(seen, ..)| seen != n) {
                let live = matches!(self.phase, Phase::Watching { .. });
                self.round_seen = Some((n, now, live));
            }
            self.highest_round = self.highest_round.max(Some(n));
        }
        std::mem::take(&mut self.effects)
    }

    /// The view, when it changed since the last call.
    pub fn changed_view(&mut self) -> Option<&View> {
        self.lease_moved &= !self.view_changed;
        std::mem::take(&mut self.view_changed).then_some(&self.view)
    }

    /// When nothing but the lease clock moved since the last look, and moved later: its
    /// new moment, to hand on without waking anyone. Every keep-alive answer moves it; a
    /// copy of the view and a look at the held round for each was most of what an idle
    /// agent cost at 1,000 (issue 30). A clock that moved earlier is a change like any
    /// other ([`Machine::changed_view`]): a wait timed by the old moment would fence late.
    pub fn lease_moved(&mut self) -> Option<Option<Instant>> {
        std::mem::take(&mut self.lease_moved).then_some(self.view.lease_safe_until)
    }

    pub fn view(&self) -> &View {
        &self.view
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    pub fn keys(&self) -> &Keys {
        &self.cfg.keys
    }

    pub fn ttl(&self) -> Duration {
        self.cfg.ttl
    }

    /// The lease this node's keys live on now.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// About how many bytes of watch events wait in the inbox.
    pub fn queued_bytes(&self) -> usize {
        self.inbox.bytes()
    }

    /// Whether an op is in flight (its answer is the next input that counts).
    pub fn busy(&self) -> bool {
        self.awaiting.is_some()
    }

    /// When [`Input::Timer`] is due, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        if self.busy() {
            return self.keep_alive_beside();
        }
        if let Some((at, ..)) = &self.retry {
            // Only for the lease the stream was opened for: a command that took a new
            // lease meanwhile resyncs once it is answered (found by the simulator: a
            // keep-alive due at once, never sent, woke the machine without end).
            let keep_alive = match self.phase {
                Phase::Watching { lease, .. } if lease == self.lease => self.keep_alive_at,
                _ => None,
            };
            return Some(keep_alive.map_or(*at, |k| k.min(*at)));
        }
        if !self.todo.is_empty() {
            return None;
        }
        match self.phase {
            Phase::Watching { .. } => [
                self.keep_alive_at,
                self.campaign_at,
                self.recheck,
                self.grace_until,
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
        while self.awaiting.is_none() && self.phase != Phase::Ended {
            if let Some((at, ..)) = &self.retry {
                if self.now < *at {
                    self.keep_alive_while_waiting();
                    break;
                }
                let (_, then, op) = self.retry.take().expect("a retry");
                self.issue(then, op);
            } else if let Some(todo) = self.todo.pop_front() {
                self.run(todo);
            } else if let Some(input) = self.inbox.pop_front() {
                self.on_input(input);
            } else {
                break;
            }
        }
        if self.phase == Phase::Ended {
            self.end_requests();
        }
    }

    fn on_answer(&mut self, then: Then, answer: Result<Answer, etcd_client::Error>) {
        match then {
            Then::Todo(todo) => self.on_todo_answer(todo, answer),
            Then::Command(serving) => self.on_command_answer(serving, answer),
            Then::Commit {
                number,
                members,
                restart_count,
                reason,
            } => match answer {
                Ok(Answer::Txn { succeeded }) => {
                    self.wrote();
                    if succeeded {
                        tracing::info!(round = number, members, restart_count, %reason, "round sealed");
                        self.counters.rounds_sealed.fetch_add(1, Ordering::Relaxed);
                        self.coordinator.sealed(self.now, number, &reason);
                    }
                }
                Ok(other) => self.unexpected(&other),
                Err(e) => {
                    if too_large(&e) {
                        // Read again and sealed again, it fails the same way: only the
                        // operator can end this, and the line must say how.
                        tracing::error!(
                            round = number,
                            members,
                            error = %e,
                            "the round is larger than etcd takes in one request (its --max-request-bytes, \
                             1.5 MiB by default, holds a round of about 40,000 nodes, stored packed); no \
                             round can form until etcd is started with a larger --max-request-bytes"
                        );
                    }
                    self.lost(e)
                }
            },
        }
    }

    pub(super) fn unexpected(&mut self, answer: &Answer) {
        let e = std::io::Error::other(format!("an answer of the wrong kind: {answer:?}"));
        self.lost(etcd_client::Error::IoError(e));
    }

    /// Sends `op`; its answer goes to `then`.
    pub(super) fn issue(&mut self, then: Then, op: Op) {
        debug_assert!(self.awaiting.is_none(), "one op at a time");
        self.sent = self.now;
        self.awaiting = Some(then);
        self.in_flight = Some(op.clone());
        self.effects.push(Effect::Etcd(op));
    }

    /// Whether `input` is something etcd said (not the driver's own doing: a local send,
    /// a deadline, a broken connection).
    fn said_by_etcd(&self, input: &Input) -> bool {
        let said = |e: &etcd_client::Error| matches!(e, etcd_client::Error::GRpcStatus(_));
        match input {
            Input::Watched(_) | Input::WatchCreated { .. } | Input::LeaseAnswer(_) => true,
            Input::StreamFailed(e) | Input::KeepAliveFailed(e) => said(e),
            // A keep-alive is answered by the local send.
            Input::Answer(Ok(_)) => !matches!(self.awaiting, Some(Then::Todo(Todo::KeepAlive))),
            Input::Answer(Err(e)) => said(e),
            _ => false,
        }
    }

    /// When the next keep-alive is due while an op is in flight, if it may go beside it.
    /// An op can wait in etcd far longer than a keep-alive period: under load a write
    /// waited seconds for "request timed out", and a lease renewed only between ops
    /// expired meanwhile (issue 30: at 10,000 nodes, thousands of keep-alive streams
    /// ended in "lease not found", each a registration again and a resync). etcd's leader
    /// renews a lease without a consensus round, so keep-alives still get through when
    /// writes are slow. Only for the lease the open stream keeps, on a stream that has
    /// not ended, and not beside the keep-alive or reopen that is itself in flight.
    pub(super) fn keep_alive_beside(&self) -> Option<Instant> {
        let own = matches!(
            self.awaiting,
            Some(Then::Todo(Todo::KeepAlive | Todo::ReopenKeepAlive))
        );
        if own || self.keep_alive_ended || !self.counts_beside() {
            return None;
        }
        self.keep_alive_at
    }

    /// Whether a keep-alive answer counts at once, while an op is in flight: only on
    /// the stream of the lease held, and only if no answer waits before it (the lease
    /// clock pairs answers with keep-alives in the order they were sent).
    fn counts_beside(&self) -> bool {
        let held = matches!(self.phase, Phase::Watching { lease, .. } if lease == self.lease);
        self.busy() && held && !self.inbox.holds_lease_answer()
    }

    /// A timer while an op is in flight: the keep-alive, if due. Every other timer waits
    /// for the answer (the inbox keeps no timer: the deadline asks again).
    fn send_keep_alive_beside(&mut self) {
        if self.keep_alive_beside().is_some_and(|at| at <= self.now) {
            self.clock.keep_alive_sent(self.now);
            self.keep_alive_at = Some(self.now + self.cfg.ttl / 3);
            self.effects.push(Effect::KeepAlive);
        }
    }

    /// While an op waits to be sent again, the lease still needs its keep-alives (a
    /// busy spell can outlast a TTL in retries) and their answers still move the lease
    /// clock; everything else waits its turn.
    fn keep_alive_while_waiting(&mut self) {
        let mut rest = super::inbox::Inbox::default();
        for input in self.inbox.take() {
            match input {
                Input::LeaseAnswer(_) => self.on_input(input),
                Input::KeepAliveFailed(e) if overloaded(&e) => {
                    // A keep-alive on a new stream at once.
                    self.keep_alive_ended = true;
                    self.keep_alive_at = Some(self.now);
                }
                // The deadline asks again; the retry's own time is what it waited for.
                Input::Timer => {}
                other => rest.push_back(other),
            }
        }
        self.inbox = rest;
        let Phase::Watching { lease, .. } = self.phase else {
            return;
        };
        if lease != self.lease || self.keep_alive_at.is_none_or(|at| at > self.now) {
            return;
        }
        // Once per keep-alive period, whatever the outcome: a reopen etcd is too busy for
        // is not sent again at once.
        self.keep_alive_at = Some(self.now + self.cfg.ttl / 3);
        if self.keep_alive_ended {
            let op = Op::ReopenKeepAlive { lease };
            return self.issue(Then::Todo(Todo::ReopenKeepAlive), op);
        }
        self.clock.keep_alive_sent(self.now);
        self.issue(Then::Todo(Todo::KeepAlive), Op::KeepAlive);
    }

    /// The `n`-th (0-based) wait before a request etcd was too busy for goes again: from
    /// 100 ms, doubling, at most a quarter TTL (and 2 s).
    pub(super) fn retry_delay(&self, n: u32) -> Duration {
        crate::backoff::nth(FIRST_RETRY, LAST_RETRY.min(self.cfg.ttl / 4), n)
    }

    /// Whether an overloaded answer is retried in place. Not during an outage or after the
    /// end (nothing is in flight then). With several etcd members, only for a quarter
    /// TTL: a member cut from its quorum answers "request timed out" too, and then
    /// another member is the way on (the outage path picks one).
    fn may_retry(&self, then: &Then) -> bool {
        let watching = matches!(self.phase, Phase::Watching { .. } | Phase::Syncing(_));
        let since = self.slowed_since.unwrap_or(self.now);
        let safe = match then {
            Then::Command(s) => s.retry_safe(),
            _ => true,
        };
        safe && watching && !(self.cfg.several_endpoints && self.now - since >= self.cfg.ttl / 4)
    }

    /// etcd answered the op in flight that it is overloaded: the same op goes again after
    /// a backoff, the watches stay open and the view stays; nothing else is done meanwhile
    /// (the op is as good as still in flight). A write that timed out may still have been
    /// applied: every op here is safe to send twice (a fenced or guarded transaction
    /// fails its compare the second time, and the watch brings what the first one did;
    /// a second grant only leaves a lease to expire).
    fn slowed_down(&mut self, then: Then, e: etcd_client::Error) {
        let Some(op) = self.in_flight.take() else {
            return self.on_answer(then, Err(e));
        };
        if self.retry.is_some() {
            // A keep-alive stream's reopen sent while another op waits for its turn
            // failed the same way: it is tried again when the next keep-alive falls due
            // (`keep_alive_ended` stays), never in the waiting op's place.
            debug_assert!(matches!(then, Then::Todo(Todo::ReopenKeepAlive)));
            return;
        }
        let now = self.now;
        let busy_for = now - *self.slowed_since.get_or_insert(now);
        if busy_for > self.cfg.outage_limit {
            // The command being served hears why with the ones waiting.
            if let Then::Command(s) = then {
                self.pending.push_front(s.into_waiting());
            }
            return self.give_up(busy_for, &e);
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let delay = self.retry_delay(self.slowed);
        if self.slowed == 0 {
            tracing::warn!(error = %e, retry_in = ?delay, "etcd is overloaded; sending the request again later (the watches stay open)");
        } else {
            tracing::debug!(error = %e, retry_in = ?delay, "etcd is still overloaded");
        }
        self.slowed = self.slowed.saturating_add(1);
        self.retry = Some((now + delay, then, op));
    }
}
