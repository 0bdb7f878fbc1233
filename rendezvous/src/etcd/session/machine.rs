//! The session machine: its state, [`Machine::step`], and what every phase does with an
//! input. The steps of a sync and of a command live in `sync.rs` and `serve.rs`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::io::{Answer, Command, CommandId, Effect, Input, Op, Role, WatchEvent};
use super::serve::Serving;
use super::sync::Todo;
use crate::etcd::coordinator::Coordinator;
use crate::etcd::keys::Keys;
use crate::etcd::view::View;
use crate::fence::LeaseClock;
use crate::seal::SealConfig;
use crate::{Counters, RendezvousError};

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
    view_changed: bool,
    pub(super) clock: LeaseClock,
    /// The lease this node's keys live on; only the session replaces it.
    pub(super) lease: i64,
    /// The registration to write again whenever the lease is new.
    pub(super) member: Option<v1::Member>,
    /// This agent's registrations so far ([`v1::Member`]'s `incarnation`): a new lease, or
    /// a registration written again after its key was deleted, is the next one.
    pub(super) incarnation: u64,
    /// The round this agent runs.
    pub(super) running: Option<v1::Round>,
    /// The newest round this agent has seen: put back when etcd comes back without any
    /// (its data lost), so that round numbers and the restart count go on.
    pub(super) known_round: Option<v1::Round>,
    pub(super) coordinator: Coordinator,
    pub(super) counters: Counters,
    writes: Arc<AtomicU64>,
    /// Failures since the last good watch: the next sync waits
    /// `backoff::nth(FIRST_RETRY, LAST_RETRY, n)`.
    failures: u32,
    /// Commands waiting for etcd, oldest first: served after the next sync, never
    /// answered with a transient error.
    pub(super) pending: VecDeque<(CommandId, Command)>,
    /// Since when etcd has not answered (the first failure of an outage).
    outage_since: Option<Instant>,
    /// etcd has one member (from its member list at the last sync): only then can the
    /// prober prove that it has no leader.
    pub(super) single_member: bool,
    pub(super) probing: bool,
    /// Several endpoints: the connection's member failed, pin another at the next sync.
    pub(super) reselect: bool,
    /// Revoke the lease and take a new one at the next sync (this node fenced itself).
    pub(super) abandon: bool,
    pub(super) phase: Phase,
    /// What is left to do before the next input is looked at.
    pub(super) todo: VecDeque<Todo>,
    pub(super) awaiting: Option<Then>,
    /// Inputs that came while an op was in flight or work was left.
    inbox: VecDeque<Input>,
    effects: Vec<Effect>,
    /// When the op in flight was sent.
    pub(super) sent: Instant,
    /// Outage grace: members of our round not back by then are gone.
    pub(super) grace_until: Option<Instant>,
    /// When the coordinator asked to look again.
    pub(super) recheck: Option<Instant>,
    pub(super) keep_alive_at: Option<Instant>,
    /// The revision of the last ranged read (the watches start after it).
    pub(super) read_rev: i64,
    /// The role and lease the watches being opened are for.
    pub(super) watch_role: Role,
    pub(super) watch_lease: i64,
}

impl Machine {
    pub fn new(cfg: Config, counters: Counters, writes: Arc<AtomicU64>) -> Self {
        let mut clock = LeaseClock::default();
        clock.replaced(cfg.granted_at, cfg.ttl);
        let now = cfg.granted_at;
        let view = View {
            lease_safe_until: clock.safe_until(),
            incarnation: cfg.first_incarnation,
            ..View::default()
        };
        Self {
            incarnation: cfg.first_incarnation,
            lease: cfg.lease,
            coordinator: Coordinator::new(cfg.seal.clone(), now),
            cfg,
            now,
            view,
            view_changed: true,
            clock,
            member: None,
            running: None,
            known_round: None,
            counters,
            writes,
            failures: 0,
            pending: VecDeque::new(),
            outage_since: None,
            single_member: false,
            probing: false,
            reselect: false,
            abandon: false,
            phase: Phase::Syncing(Resync::First),
            todo: VecDeque::new(),
            awaiting: None,
            inbox: VecDeque::new(),
            effects: Vec::new(),
            sent: now,
            grace_until: None,
            recheck: None,
            keep_alive_at: None,
            read_rev: 0,
            watch_role: Role::Member,
            watch_lease: 0,
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
        match input {
            Input::Answer(answer) => match self.awaiting.take() {
                Some(then) => self.on_answer(then, answer),
                None => tracing::debug!("an answer nobody waited for"),
            },
            // A proof counts at once, even while an op waits on the etcd it is about.
            Input::NoLeader { sent } => {
                self.clock.no_leader_at(sent, self.cfg.ttl);
                self.publish_lease();
            }
            other => self.inbox.push_back(other),
        }
        self.advance();
        std::mem::take(&mut self.effects)
    }

    /// The view, when it changed since the last call.
    pub fn changed_view(&mut self) -> Option<&View> {
        std::mem::take(&mut self.view_changed).then_some(&self.view)
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

    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    pub fn lease(&self) -> i64 {
        self.lease
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Whether an op is in flight (its answer is the next input that counts).
    pub fn busy(&self) -> bool {
        self.awaiting.is_some()
    }

    /// When [`Input::Timer`] is due, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        if self.busy() || !self.todo.is_empty() {
            return None;
        }
        match self.phase {
            Phase::Watching { .. } => [
                self.keep_alive_at,
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
            if let Some(todo) = self.todo.pop_front() {
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
                Err(e) => self.lost(e),
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
        self.effects.push(Effect::Etcd(op));
    }

    fn on_input(&mut self, input: Input) {
        match (self.phase, input) {
            (Phase::Ended, _) => {}
            (_, Input::CommandsClosed) => self.phase = Phase::Ended,
            (Phase::Watching { .. }, input) => self.on_watching(input),
            (Phase::Disconnected { until }, Input::Timer) => {
                if self.now >= until {
                    self.begin_sync(Resync::Outage);
                }
            }
            (Phase::Disconnected { .. }, Input::Command(id, command)) => {
                let local = matches!(
                    command,
                    Command::Running { .. } | Command::Abandon | Command::Depart { .. }
                );
                if local {
                    self.serve(id, command);
                } else {
                    self.pending.push_back((id, command));
                }
            }
            (Phase::Syncing(_), Input::Command(id, command)) => {
                self.pending.push_back((id, command));
            }
            // Streams that closed, and timers of a phase that is over.
            (_, _) => {}
        }
    }

    fn on_watching(&mut self, input: Input) {
        match input {
            Input::Watched(events) => {
                if self.apply(events) {
                    self.todo.push_back(Todo::Campaign);
                }
                self.todo.extend([Todo::RoleCheck, Todo::Coordinate]);
            }
            Input::WatchEnded => self.resync_after_watching(Resync::Outage),
            Input::StreamFailed(e) => self.lost(e),
            Input::LeaseAnswer(Some(ttl)) if ttl > 0 => {
                self.clock
                    .keep_alive_answered(Duration::from_secs(ttl.unsigned_abs()));
                self.publish_lease();
                self.probe(false);
            }
            Input::LeaseAnswer(_) => {
                tracing::warn!(
                    lease = self.lease,
                    "lease expired or revoked; registering again"
                );
                self.lease_gone();
                self.todo
                    .extend([Todo::Grant, Todo::Register, Todo::Resync(Resync::Outage)]);
            }
            Input::Timer => self.on_timer(),
            Input::Command(id, command) => self.serve(id, command),
            Input::Answer(_) | Input::CommandsClosed | Input::NoLeader { .. } => {}
        }
    }

    /// The timers that are due.
    fn on_timer(&mut self) {
        let Phase::Watching { lease, .. } = self.phase else {
            return;
        };
        let now = self.now;
        if self.keep_alive_at.is_some_and(|at| at <= now) {
            // A command replaced the lease: keep the new one alive.
            if self.lease != lease {
                return self.resync_after_watching(Resync::Outage);
            }
            self.clock.keep_alive_sent(now);
            self.keep_alive_at = Some(now + self.cfg.ttl / 3);
            self.todo.push_back(Todo::KeepAlive);
        }
        if self.answer_due().is_some_and(|at| at <= now) {
            // etcd answers a keep-alive in milliseconds: a late one is the first sign of
            // an outage that leaves the connection open (a frozen or stalled etcd, a cut
            // network, a member cut from its leader), long before the connection's own
            // keep-alive gives up on it.
            if self.cfg.several_endpoints {
                let late = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "a lease keep-alive went unanswered; trying another etcd member",
                );
                return self.lost(etcd_client::Error::IoError(late));
            }
            self.trouble();
        }
        if self.grace_until.is_some_and(|at| at <= now) {
            self.grace_until = None;
            self.todo.push_back(Todo::CheckAbsent);
        }
        if self.recheck.is_some_and(|at| at <= now) {
            self.recheck = None;
            self.todo.extend([Todo::RoleCheck, Todo::Coordinate]);
        }
    }

    /// With several endpoints: when the oldest unanswered keep-alive is late enough to
    /// try another member. With a one-member etcd: when the fence draws near (a quarter
    /// TTL before it) without an answer, so the prober should look for its proof — not
    /// before, so that a slow but working etcd (1,000 agents on two cores) is not probed.
    pub(super) fn answer_due(&self) -> Option<Instant> {
        let (sent, safe_until) = (self.clock.oldest_unanswered(), self.clock.safe_until());
        let ttl = self.cfg.ttl;
        if self.cfg.several_endpoints {
            return Some(sent? + ttl / 4);
        }
        if self.probing || !self.single_member || !self.cfg.can_probe {
            return None;
        }
        sent?;
        safe_until?.checked_sub(self.cfg.fence_margin + ttl / 4)
    }

    /// etcd does not answer: start looking for proof that it has no leader (so the lease
    /// cannot expire and the workers need not be fenced).
    pub(super) fn trouble(&mut self) {
        if self.single_member && self.cfg.can_probe {
            self.probe(true);
        }
    }

    pub(super) fn probe(&mut self, on: bool) {
        if self.probing != on {
            self.probing = on;
            self.effects.push(Effect::Probe(on));
        }
    }

    /// Leaves [`Phase::Watching`] without an error (the backoff starts over).
    pub(super) fn resync_after_watching(&mut self, why: Resync) {
        self.failures = 0;
        self.begin_sync(why);
    }

    /// Starts a sync: whatever was left to do is dropped, and so is every stream event
    /// not handled yet (the new watches start from the read).
    pub(super) fn begin_sync(&mut self, why: Resync) {
        self.close_watches();
        self.phase = Phase::Syncing(why);
        self.grace_until = match why {
            Resync::First => None,
            Resync::RoleChanged { grace_until } => grace_until,
            // After an outage, give members a lease TTL to re-register before anyone is
            // declared lost (etcd may have come back empty).
            Resync::Outage => Some(self.now + self.cfg.ttl + Duration::from_secs(1)),
        };
        self.recheck = None;
        self.todo = Todo::sync(why, self.reselect, self.abandon).into();
    }

    /// Stream events queued before this moment belong to streams now closed.
    fn close_watches(&mut self) {
        // Also when a sync failed after opening them: their events would otherwise queue
        // up behind the next sync and be read as the new watches' (found by the
        // simulator: a coordinator's old stream, without previous values, made every later
        // incarnation of two nodes look departed, and rounds were sealed in a loop).
        if !matches!(self.phase, Phase::Disconnected { .. } | Phase::Ended) {
            self.effects.push(Effect::CloseWatches);
        }
        self.keep_alive_at = None;
        self.inbox.retain(|i| {
            matches!(
                i,
                Input::Command(..) | Input::CommandsClosed | Input::NoLeader { .. }
            )
        });
    }

    /// etcd failed: back off, or give up once the outage lasted too long.
    pub(super) fn lost(&mut self, e: etcd_client::Error) {
        self.close_watches();
        self.todo.clear();
        self.view_mut().connected = false;
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let now = self.now;
        let lasted = now - *self.outage_since.get_or_insert(now);
        if lasted > self.cfg.outage_limit {
            return self.give_up(lasted, &e);
        }
        self.trouble();
        self.reselect = self.cfg.several_endpoints;
        // Retry well within the fencing margin: a refused probe keeps the lease safe only
        // for a TTL from when it was sent.
        let last = LAST_RETRY.min(self.cfg.ttl / 4);
        let delay = crate::backoff::nth(FIRST_RETRY, last, self.failures);
        tracing::warn!(error = %e, retry_in = ?delay, "etcd connection lost; reconnecting");
        self.failures = self.failures.saturating_add(1);
        self.phase = Phase::Disconnected { until: now + delay };
    }

    /// etcd has not answered for longer than the outage bound: every waiting request
    /// gets the reason, the view says it, and the session ends.
    fn give_up(&mut self, lasted: Duration, last: &etcd_client::Error) {
        let store = if self.cfg.embedded_store {
            "the c10d store"
        } else {
            "etcd"
        };
        let mut reason = format!(
            "{store} has not answered for {:.0}s, longer than outage_timeout ({:.0}s); last error: {last}",
            lasted.as_secs_f64(),
            self.cfg.outage_limit.as_secs_f64()
        );
        if self.cfg.embedded_store {
            reason.push_str(
                "; the agent serving the store at --rdzv-endpoint is gone, and a c10d job cannot outlive it \
                 (--rdzv-backend etcd can)",
            );
        }
        tracing::error!(%reason, "giving up on etcd");
        self.view_mut().gave_up = Some(reason);
        self.phase = Phase::Ended;
    }

    /// The session ended: whoever still waits hears why.
    fn end_requests(&mut self) {
        self.todo.clear();
        let reason = self.view.gave_up.clone();
        let waiting: Vec<CommandId> = self
            .pending
            .drain(..)
            .map(|(id, _)| id)
            .chain(self.inbox.drain(..).filter_map(|i| match i {
                Input::Command(id, _) => Some(id),
                _ => None,
            }))
            .collect();
        for id in waiting {
            let e = match &reason {
                Some(r) => RendezvousError::Outage(r.clone()),
                None => RendezvousError::SessionEnded("the session ended"),
            };
            self.reply(id, Err(e));
        }
    }

    pub(super) fn reset_outage(&mut self) {
        self.outage_since = None;
    }

    pub(super) fn reply(&mut self, id: CommandId, result: Result<(), RendezvousError>) {
        self.effects.push(Effect::Reply(id, result));
    }

    pub(super) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn view_mut(&mut self) -> &mut View {
        self.view_changed = true;
        &mut self.view
    }

    pub(super) fn publish_lease(&mut self) {
        let safe_until = self.clock.safe_until();
        if self.view.lease_safe_until != safe_until {
            self.view_mut().lease_safe_until = safe_until;
        }
    }

    pub(super) fn role(&self) -> Role {
        if self.view.coordinator.as_deref() == Some(self.cfg.node_id.as_str()) {
            Role::Coordinator
        } else {
            Role::Member
        }
    }

    /// Now in Unix milliseconds, counted on the monotonic clock from the grant.
    pub(super) fn unix_ms(&self) -> u64 {
        let since = self.now.saturating_duration_since(self.cfg.granted_at);
        self.cfg.unix_ms_at_grant + since.as_millis() as u64
    }

    /// Applies a watch batch; returns whether the coordinator key went.
    fn apply(&mut self, events: Vec<WatchEvent>) -> bool {
        let coordinator = self.cfg.keys.coordinator();
        let now = self.now;
        let mut coordinator_gone = false;
        let keys = self.cfg.keys.clone();
        let v = self.view_mut();
        for ev in events {
            match ev {
                WatchEvent::Put(kv) => v.put(
                    &keys,
                    &kv.key,
                    &kv.value,
                    kv.create_rev,
                    kv.mod_rev,
                    kv.lease,
                ),
                WatchEvent::Delete { key, prev } => {
                    coordinator_gone |= key == coordinator;
                    v.delete(&keys, &key, now, prev.as_deref());
                }
            }
        }
        coordinator_gone
    }

    /// This node's claim on the coordinator key won (the one place that says so).
    pub(super) fn elected(&mut self) {
        tracing::info!(node = %self.cfg.node_id, "elected rendezvous coordinator");
        let me = self.cfg.node_id.clone();
        self.view_mut().coordinator = Some(me);
    }

    /// The lease is gone. Before `safe_until` etcd cannot have expired it, so it lost its
    /// data (an empty restart) and nobody saw this node leave: the round goes on. From
    /// then on it may have expired and the others re-form without this node: if it runs
    /// a round, that round is over for it too.
    pub(super) fn lease_gone(&mut self) {
        let now = self.now;
        let expired = self.clock.safe_until().is_none_or(|s| now >= s);
        if let Some(went) = self.my_incarnation().filter(|_| expired) {
            tracing::warn!("the lease expired while this node ran a round: it was evicted");
            let me = self.cfg.node_id.clone();
            self.view_mut().depart(&me, went, now);
        }
    }

    /// This node's incarnation in the round it runs, if it runs one.
    pub(super) fn my_incarnation(&self) -> Option<u64> {
        let r = self.running.as_ref()?;
        let me = r.members.iter().find(|m| m.node_id == self.cfg.node_id)?;
        Some(me.incarnation)
    }

    /// A new lease replaced the old one: the next incarnation.
    pub(super) fn lease_renewed(&mut self, id: i64) {
        self.wrote();
        self.clock.replaced(self.sent, self.cfg.ttl);
        self.publish_lease();
        tracing::info!(
            old = self.lease,
            new = id,
            "the lease was gone; granted a new one"
        );
        self.lease = id;
        self.next_incarnation();
    }

    /// This agent's next registration is a new incarnation.
    pub(super) fn next_incarnation(&mut self) {
        self.incarnation += 1;
        let n = self.incarnation;
        self.view_mut().incarnation = n;
    }
}
