//! The etcd session: one task per agent that owns the agent's lease and makes every etcd
//! write of the agent. It keeps the lease alive, keeps the [`View`] current through
//! watches, takes part in the coordinator election, seals rounds while coordinator, and
//! serves the agent-facing handle's [`Command`]s between watch events.
//!
//! The session is a state machine ([`State`]; drawn in docs/architecture.md, "The etcd
//! session"). Every failure of etcd (a closed stream, a restart, lost data) ends in the same
//! place: a fresh ranged read, a rebuilt view, and new watches from the read's revision.
//! The etcd-client lease keeper does not reconnect by itself, so the keep-alive is ours too.
//! With one owner of the lease, a lease found gone is replaced exactly once.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, WatchFilterType, WatchOptions, WatchResponse, WatchStream,
};
use fsdp_proto::{SCHEMA_VERSION, v1};
use prost::Message;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, Interval};

use super::connect::{self, EtcdOptions, transient};
use super::coordinator::{Coordinator, round_record};
use super::keys::Keys;
use super::probe::{self, Prober, SharedClock};
use super::view::{View, left_between};
use crate::fence::LeaseClock;
use crate::seal::{SealConfig, SealDecision};
use crate::{Departure, RendezvousError, port};

type EtcdResult<T> = Result<T, etcd_client::Error>;

/// What the agent-facing handle asks of the session.
#[derive(Debug)]
pub enum Command {
    /// Write this node's registration, ready for `wants_round`; claim the coordinator role
    /// in the same transaction when nobody holds it (one write per node).
    Register { wants_round: u64 },
    /// As the round's group rank 0: publish a free port on this node's address.
    PublishMaster { round: u64 },
    /// This node runs `round`: put it back if etcd loses it, and after an outage wait
    /// for its members, not for strangers. Answered at once.
    Running { round: v1::Round },
    /// Charge a failure in `round` to the job (the first report per round wins).
    ReportFailure { round: u64 },
    /// This node's workers all succeeded in `round`.
    ReportDone { round: u64 },
    /// Where this node's ranks were when its round hung.
    ReportHang { report: v1::HangReport },
    /// End the run for every node (the first halt stands).
    Halt { halt: v1::Halt },
    /// A worker of this node failed in its round (written before anything is stopped).
    ReportFault { record: v1::Fault },
    /// Keep this machine out of the run until the record's time.
    Quarantine { record: v1::Quarantine },
    /// This node's health check failed: withdraw its registration (and the coordinator
    /// role) and say why; it registers again when the check passes.
    Withdraw { record: v1::Unhealthy },
    /// Revoke the lease (the others learn at once) and end the session.
    Depart { how: Departure },
    /// This node fenced itself: at the next contact with etcd, revoke the lease (the
    /// others see it leave instead of waiting out the TTL) and join again on a new one.
    Abandon,
    /// `node`'s agent is proven gone (its status port refused a connection): revoke its
    /// lease, so every agent sees it leave now rather than after its TTL.
    Evict {
        node: String,
        lease: i64,
        round: u64,
        detect_ms: u32,
    },
}

/// A command and where its outcome goes.
#[derive(Debug)]
pub struct Request {
    pub command: Command,
    pub reply: Option<oneshot::Sender<Result<(), RendezvousError>>>,
}

/// Whether etcd refused a request because the lease it names does not exist (any more).
pub fn lease_not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

/// What the session is given at start.
pub struct Setup {
    pub client: Client,
    pub keys: Keys,
    pub node_id: String,
    /// The address this node advertises (registration, master).
    pub addr: String,
    /// Where its status port answers (`host:port`), empty when it serves none.
    pub status_addr: String,
    pub local_world_size: u32,
    /// The lease the handle granted at join, and when it asked for it.
    pub lease: i64,
    pub granted_at: std::time::Instant,
    pub ttl: Duration,
    /// How to reach etcd, for the prober; `None` when the client was given ready-made
    /// (simulated nodes sharing one connection): no proofs, the lease clock alone decides.
    pub options: Option<EtcdOptions>,
    /// How long etcd may stay unreachable before the session gives up.
    pub outage_limit: Duration,
    /// How long before the lease could expire the agent fences (the prober must have
    /// found its proof by then).
    pub fence_margin: Duration,
    pub seal: SealConfig,
    /// etcd writes made (puts, transactions, lease grants and revokes).
    pub writes: Arc<AtomicU64>,
    /// etcd errors the session recovered from (lost connections, failed keep-alives),
    /// rounds it sealed, seals it held back.
    pub counters: crate::Counters,
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

/// Which watches the session holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Watches control keys and member departures.
    Member,
    /// Also watches registrations, and seals rounds.
    Coordinator,
}

/// The session's states.
pub enum State {
    /// Read the run, rebuild the view, make sure the lease and registration live, open
    /// the watches.
    Syncing(Resync),
    /// Watches open, lease kept alive; commands served between events.
    Watching(Box<Watching>),
    /// etcd failed; commands are still served (and fail or succeed on their own) until
    /// `until`, then the session syncs again.
    Disconnected { until: Instant },
    /// The lease was revoked on request, or the handle is gone: the task ends.
    Ended,
}

/// The live part of [`State::Watching`].
pub struct Watching {
    role: Role,
    /// Control keys; for the coordinator, every key of the run.
    ctl: WatchStream,
    /// Member departures (members only: the coordinator's one watch has them in order).
    members: Option<WatchStream>,
    keeper: LeaseKeeper,
    kept: LeaseKeepAliveStream,
    /// The lease the keeper keeps alive.
    lease: i64,
    tick: Interval,
    /// Outage grace: members of our round not back by then are gone.
    grace_until: Option<Instant>,
    /// When the coordinator asked to look again.
    recheck: Option<Instant>,
}

/// One thing that happened while watching.
enum Event {
    Ctl(Option<WatchResponse>),
    Members(Option<WatchResponse>),
    Tick,
    LeaseAnswer(Option<i64>),
    Timer,
    Command(Option<Request>),
}

const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(2);

pub struct Session {
    client: Client,
    keys: Keys,
    node_id: String,
    addr: String,
    status_addr: String,
    local_world_size: u32,
    ttl: Duration,
    view: Arc<watch::Sender<View>>,
    commands: mpsc::UnboundedReceiver<Request>,
    writes: Arc<AtomicU64>,
    counters: crate::Counters,
    /// The lease this node's keys live on; only the session replaces it.
    lease: i64,
    /// The registration to write again whenever the lease is new.
    member: Option<v1::Member>,
    /// This agent's registrations so far ([`v1::Member`]'s `incarnation`): a new lease, or
    /// a registration written again after its key was deleted, is the next one.
    incarnation: u64,
    /// The round this agent runs.
    running: Option<v1::Round>,
    coordinator: Coordinator,
    /// Failures since the last good watch: the next sync waits
    /// `backoff::nth(FIRST_RETRY, LAST_RETRY, n)`.
    failures: u32,
    /// Requests whose etcd write failed on a transient error, oldest first: served again
    /// after the next sync, never answered with the error.
    pending: VecDeque<Request>,
    /// Since when etcd has not answered (the first failure of an outage).
    outage_since: Option<Instant>,
    outage_limit: Duration,
    fence_margin: Duration,
    /// The earliest moment etcd could expire the lease (published in the view).
    clock: SharedClock,
    options: Option<EtcdOptions>,
    /// etcd has one member (from its member list at the last sync): only then can the
    /// prober prove that it has no leader.
    single_member: bool,
    /// Looks for that proof while etcd does not answer.
    prober: Option<Prober>,
    /// Several endpoints: the client's member failed, pin another at the next sync.
    reselect: bool,
    /// Revoke the lease and take a new one at the next sync (this node fenced itself).
    abandon: bool,
}

/// How serving a request went.
enum Served {
    Answered,
    /// The session ends (the lease was revoked on request).
    Ended,
    /// etcd failed on the way; the request waits in `pending` for the next sync.
    Retry(etcd_client::Error),
}

impl Session {
    pub fn new(
        s: Setup,
        view: watch::Sender<View>,
        commands: mpsc::UnboundedReceiver<Request>,
    ) -> Self {
        let mut clock = LeaseClock::default();
        clock.replaced(s.granted_at, s.ttl);
        let clock = Arc::new(Mutex::new(clock));
        let view = Arc::new(view);
        probe::publish(&clock, &view);
        Self {
            client: s.client,
            keys: s.keys,
            node_id: s.node_id,
            addr: s.addr,
            status_addr: s.status_addr,
            local_world_size: s.local_world_size,
            ttl: s.ttl,
            view,
            commands,
            writes: s.writes,
            counters: s.counters,
            lease: s.lease,
            member: None,
            incarnation: 1,
            running: None,
            coordinator: Coordinator::new(s.seal, Instant::now().into_std()),
            failures: 0,
            pending: VecDeque::new(),
            outage_since: None,
            outage_limit: s.outage_limit,
            fence_margin: s.fence_margin,
            clock,
            options: s.options,
            single_member: false,
            prober: None,
            reselect: false,
            abandon: false,
        }
    }

    /// Runs the state machine until the session ends (or the task is aborted).
    pub async fn run(mut self) {
        let mut state = State::Syncing(Resync::First);
        loop {
            state = match state {
                State::Syncing(why) => match self.sync(why).await {
                    Ok(w) => match self.drain().await {
                        Ok(false) => {
                            self.outage_since = None;
                            self.prober = None;
                            State::Watching(Box::new(w))
                        }
                        Ok(true) => State::Ended,
                        Err(e) => self.lost(e),
                    },
                    Err(e) => self.lost(e),
                },
                State::Watching(mut w) => match self.watch(&mut w).await {
                    Ok(next) => {
                        self.failures = 0;
                        next
                    }
                    Err(e) => self.lost(e),
                },
                State::Disconnected { until } => self.disconnected(until).await,
                State::Ended => return,
            }
        }
    }

    fn lost(&mut self, e: etcd_client::Error) -> State {
        self.view.send_modify(|v| v.connected = false);
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let lasted = now - *self.outage_since.get_or_insert(now);
        if lasted > self.outage_limit {
            return self.give_up(lasted, &e);
        }
        self.trouble();
        self.reselect = self.several_endpoints();
        // Retry well within the fencing margin: a refused probe keeps the lease safe only
        // for a TTL from when it was sent.
        let last = LAST_RETRY.min(self.ttl / 4);
        let delay = crate::backoff::nth(FIRST_RETRY, last, self.failures);
        tracing::warn!(error = %e, retry_in = ?delay, "etcd connection lost; reconnecting");
        self.failures = self.failures.saturating_add(1);
        State::Disconnected {
            until: Instant::now() + delay,
        }
    }

    /// etcd has not answered for longer than the outage bound: every waiting request
    /// gets the reason, the view says it, and the session ends.
    fn give_up(&mut self, lasted: Duration, last: &etcd_client::Error) -> State {
        let embedded = self.options.as_ref().is_some_and(|o| o.embedded_store);
        let store = if embedded { "the c10d store" } else { "etcd" };
        let mut reason = format!(
            "{store} has not answered for {:.0}s, longer than outage_timeout ({:.0}s); last error: {last}",
            lasted.as_secs_f64(),
            self.outage_limit.as_secs_f64()
        );
        if embedded {
            reason.push_str(
                "; the agent serving the store at --rdzv-endpoint is gone, and a c10d job cannot outlive it \
                 (--rdzv-backend etcd can)",
            );
        }
        tracing::error!(%reason, "giving up on etcd");
        self.view.send_modify(|v| v.gave_up = Some(reason.clone()));
        for req in self.pending.drain(..) {
            if let Some(reply) = req.reply {
                let _ = reply.send(Err(RendezvousError::Outage(reason.clone())));
            }
        }
        State::Ended
    }

    /// Until `until`, does what needs no etcd and keeps the rest for the next sync.
    async fn disconnected(&mut self, until: Instant) -> State {
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return State::Syncing(Resync::Outage),
                req = self.commands.recv() => {
                    let Some(req) = req else { return State::Ended };
                    let local = matches!(
                        req.command,
                        Command::Running { .. } | Command::Abandon | Command::Depart { .. }
                    );
                    if !local {
                        self.pending.push_back(req);
                    } else if let Served::Ended = self.serve(req).await {
                        return State::Ended;
                    }
                }
            }
        }
    }

    /// Serves the requests that waited for etcd, oldest first; returns whether the
    /// session ends.
    async fn drain(&mut self) -> EtcdResult<bool> {
        while let Some(req) = self.pending.pop_front() {
            match self.serve(req).await {
                Served::Answered => {}
                Served::Ended => return Ok(true),
                Served::Retry(e) => return Err(e),
            }
        }
        Ok(false)
    }

    fn publish_lease(&self) {
        probe::publish(&self.clock, &self.view);
    }

    /// Changes the lease clock (only the session and the prober do).
    fn lease_clock<T>(&self, f: impl FnOnce(&mut LeaseClock) -> T) -> T {
        let mut clock = self.clock.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut clock)
    }

    fn several_endpoints(&self) -> bool {
        self.options.as_ref().is_some_and(|o| o.endpoints.len() > 1)
    }

    /// Pins the client to a member that answers (and knows a leader, if one does).
    async fn pick_endpoint(&mut self) {
        let Some(opts) = &self.options else { return };
        let patience = (self.ttl / 4).min(opts.connect_timeout);
        if let Some(client) = connect::pick(opts, patience).await {
            self.client = client;
            self.reselect = false;
        }
    }

    /// With several endpoints: when the oldest unanswered keep-alive is late enough to
    /// try another member. With a one-member etcd: when the fence draws near (a quarter
    /// TTL before it) without an answer, so the prober should look for its proof — not
    /// before, so that a slow but working etcd (1,000 agents on two cores) is not probed.
    fn answer_due(&self) -> Option<Instant> {
        let (sent, safe_until) = self.lease_clock(|c| (c.oldest_unanswered(), c.safe_until()));
        if self.several_endpoints() {
            return Some(Instant::from_std(sent? + self.ttl / 4));
        }
        if self.prober.as_ref().is_some_and(|p| !p.finished()) || !self.single_member {
            return None;
        }
        sent?;
        let near = safe_until?.checked_sub(self.fence_margin + self.ttl / 4)?;
        Some(Instant::from_std(near))
    }

    /// etcd does not answer: start looking for proof that it has no leader (so the lease
    /// cannot expire and the workers need not be fenced).
    fn trouble(&mut self) {
        if !self.single_member || self.prober.as_ref().is_some_and(|p| !p.finished()) {
            return;
        }
        let Some(opts) = &self.options else { return };
        let Some(endpoint) = opts.endpoints.first() else {
            return;
        };
        self.prober = Some(Prober::start(
            endpoint.clone(),
            opts.clone(),
            self.ttl,
            self.clock.clone(),
            self.view.clone(),
        ));
    }

    fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    fn role(&self) -> Role {
        if self.view.borrow().coordinator.as_deref() == Some(self.node_id.as_str()) {
            Role::Coordinator
        } else {
            Role::Member
        }
    }

    /// [`State::Syncing`]: everything from a ranged read to open watches.
    async fn sync(&mut self, why: Resync) -> EtcdResult<Watching> {
        if self.reselect {
            self.pick_endpoint().await;
        }
        if self.abandon {
            // Before the read, so that the watches start after the revoke and this node
            // does not see its own departure.
            self.abandon_lease().await?;
        }
        let resp = self
            .client
            .get(self.keys.root(), Some(GetOptions::new().with_prefix()))
            .await?;
        // The cluster's size rarely changes: asked at join and after an outage, not at
        // every coordinator change.
        if !matches!(why, Resync::RoleChanged { .. }) {
            self.single_member = self.client.member_list().await?.members().len() == 1;
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        let mut fresh = View::default();
        for kv in resp.kvs() {
            let key = kv.key_str().unwrap_or("");
            let (value, create, modified) = (kv.value(), kv.create_revision(), kv.mod_revision());
            fresh.put(&self.keys, key, value, create, modified, kv.lease());
        }
        fresh.connected = true;
        self.install(fresh, matches!(why, Resync::RoleChanged { .. }));
        self.ensure_registered(why != Resync::First).await?;
        let grace_until = match why {
            Resync::First => None,
            Resync::RoleChanged { grace_until } => grace_until,
            // After an outage, give members a lease TTL to re-register before anyone is
            // declared lost (etcd may have come back empty).
            Resync::Outage => Some(Instant::now() + self.ttl + Duration::from_secs(1)),
        };
        if why != Resync::First {
            // On the first sync the agent's registration claims the role if it is free.
            self.campaign().await?;
        }
        let mut w = self.open_watches(rev + 1, grace_until).await?;
        self.coordinate(&mut w.recheck).await?;
        Ok(w)
    }

    /// Replaces the view with `fresh`, keeping the departures already seen. When
    /// `voluntary` (nothing was lost in between), a member we knew of that the snapshot
    /// lacks left while we were switching watches.
    fn install(&mut self, mut fresh: View, voluntary: bool) {
        let now = Instant::now().into_std();
        let running = self.running.as_ref();
        self.view.send_modify(|v| {
            let left = if voluntary {
                left_between(v, running, &fresh)
            } else {
                Vec::new()
            };
            fresh.departed = std::mem::take(&mut v.departed);
            fresh.lease_safe_until = v.lease_safe_until;
            for (id, incarnation) in left {
                // An earlier sighting of this incarnation's departure keeps its time.
                if fresh
                    .departed
                    .get(&id)
                    .is_none_or(|d| d.incarnation < incarnation)
                {
                    fresh.depart(&id, incarnation, now);
                }
            }
            *v = fresh;
        });
    }

    /// Opens the watches for this node's role from revision `from`, and the keep-alive.
    async fn open_watches(
        &mut self,
        from: i64,
        grace_until: Option<Instant>,
    ) -> EtcdResult<Watching> {
        let role = self.role();
        let ctl_opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let (ctl, members) = if role == Role::Coordinator {
            // One watch over the whole run, so that the view the coordinator seals from is
            // always etcd's history up to one revision. Two streams (control keys and
            // registrations) were read in whatever order they became ready: a node's
            // failure report and its registration for the next round, written in that
            // order, were seen the other way round, and the round was sealed without
            // charging the failure. (It knows every registration, so a delete needs no
            // previous value to say which incarnation went.)
            let all = self.client.watch(self.keys.root(), Some(ctl_opts)).await?;
            (all, None)
        } else {
            let ctl = self.client.watch(self.keys.ctl(), Some(ctl_opts)).await?;
            // Only the coordinator needs registrations; the others learn of new rounds
            // through the round key and of departures through deletes.
            let member_opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(from)
                .with_prev_key()
                .with_filters([WatchFilterType::NoPut]);
            let members = self
                .client
                .watch(self.keys.members(), Some(member_opts))
                .await?;
            (ctl, Some(members))
        };
        let (keeper, kept) = self.client.lease_keep_alive(self.lease).await?;
        self.lease_clock(LeaseClock::stream_closed);
        Ok(Watching {
            role,
            ctl,
            members,
            keeper,
            kept,
            lease: self.lease,
            tick: tokio::time::interval(self.ttl / 3),
            grace_until,
            recheck: None,
        })
    }

    /// [`State::Watching`]: handles events until one calls for another state.
    async fn watch(&mut self, w: &mut Watching) -> EtcdResult<State> {
        loop {
            let event = self.next_event(w).await?;
            if let Some(next) = self.on_event(w, event).await? {
                return Ok(next);
            }
        }
    }

    async fn next_event(&mut self, w: &mut Watching) -> EtcdResult<Event> {
        let timer = [w.recheck, w.grace_until, self.answer_due()]
            .into_iter()
            .flatten()
            .min();
        let sleep = async {
            match timer {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let departures = async {
            match w.members.as_mut() {
                Some(m) => m.message().await,
                None => std::future::pending().await,
            }
        };
        Ok(tokio::select! {
            msg = w.ctl.message() => Event::Ctl(msg?.filter(|r| !r.canceled())),
            msg = departures => Event::Members(msg?.filter(|r| !r.canceled())),
            _ = w.tick.tick() => Event::Tick,
            msg = w.kept.message() => Event::LeaseAnswer(msg?.map(|r| r.ttl())),
            () = sleep => Event::Timer,
            req = self.commands.recv() => Event::Command(req),
        })
    }

    /// Applies one event; returns the next state when it leaves [`State::Watching`].
    async fn on_event(&mut self, w: &mut Watching, event: Event) -> EtcdResult<Option<State>> {
        let outage = || Some(State::Syncing(Resync::Outage));
        match event {
            Event::Ctl(None) | Event::Members(None) => return Ok(outage()),
            Event::Ctl(Some(resp)) => self.on_ctl(&resp).await?,
            Event::Members(Some(resp)) => self.apply(resp.events()),
            // A command replaced the lease: keep the new one alive.
            Event::Tick if self.lease != w.lease => return Ok(outage()),
            Event::Tick => {
                let now = std::time::Instant::now();
                self.lease_clock(|c| c.keep_alive_sent(now));
                w.keeper.keep_alive().await?;
                return Ok(None);
            }
            Event::LeaseAnswer(Some(ttl)) if ttl > 0 => {
                self.lease_clock(|c| {
                    c.keep_alive_answered(Duration::from_secs(ttl.unsigned_abs()))
                });
                self.publish_lease();
                self.prober = None;
                return Ok(None);
            }
            Event::LeaseAnswer(_) => {
                tracing::warn!(
                    lease = w.lease,
                    "lease expired or revoked; registering again"
                );
                self.lease_gone();
                self.new_lease().await?;
                return Ok(outage());
            }
            Event::Timer => {
                if !self.on_timer(w).await? {
                    return Ok(None);
                }
            }
            Event::Command(None) => return Ok(Some(State::Ended)),
            Event::Command(Some(req)) => match self.serve(req).await {
                Served::Ended => return Ok(Some(State::Ended)),
                Served::Retry(e) => return Err(e),
                Served::Answered if self.lease != w.lease || self.abandon => {
                    return Ok(outage());
                }
                // A registration may have won the coordinator key.
                Served::Answered => return Ok(self.role_changed(w)),
            },
        }
        if let Some(next) = self.role_changed(w) {
            return Ok(Some(next));
        }
        self.coordinate(&mut w.recheck).await?;
        Ok(None)
    }

    /// A control event: applied, and a campaign if the coordinator key went away.
    async fn on_ctl(&mut self, resp: &WatchResponse) -> EtcdResult<()> {
        let coordinator = self.keys.coordinator();
        let coordinator_gone = resp.events().iter().any(|e| {
            e.event_type() == EventType::Delete
                && e.kv().is_some_and(|kv| kv.key() == coordinator.as_bytes())
        });
        self.apply(resp.events());
        if coordinator_gone {
            self.campaign().await?;
        }
        Ok(())
    }

    /// The watches were opened for another role: open them again for this one.
    fn role_changed(&self, w: &Watching) -> Option<State> {
        (self.role() != w.role).then_some(State::Syncing(Resync::RoleChanged {
            grace_until: w.grace_until,
        }))
    }

    /// Handles the timers that are due; returns whether the coordinator asked to look again.
    async fn on_timer(&mut self, w: &mut Watching) -> EtcdResult<bool> {
        let now = Instant::now();
        if self.answer_due().is_some_and(|at| at <= now) {
            // etcd answers a keep-alive in milliseconds: a late one is the first sign of
            // an outage that leaves the connection open (a frozen or stalled etcd, a cut
            // network, a member cut from its leader), long before the connection's own
            // keep-alive gives up on it.
            if self.several_endpoints() {
                let late = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "a lease keep-alive went unanswered; trying another etcd member",
                );
                return Err(etcd_client::Error::IoError(late));
            }
            self.trouble();
        }
        if w.grace_until.is_some_and(|at| at <= now) {
            w.grace_until = None;
            self.check_absent().await?;
        }
        let recheck = w.recheck.is_some_and(|at| at <= now);
        if recheck {
            w.recheck = None;
        }
        Ok(recheck)
    }

    fn apply(&mut self, events: &[etcd_client::Event]) {
        let now = Instant::now().into_std();
        let keys = &self.keys;
        self.view.send_modify(|v| {
            for ev in events {
                let Some(kv) = ev.kv() else { continue };
                let key = kv.key_str().unwrap_or("");
                match ev.event_type() {
                    EventType::Put => v.put(
                        keys,
                        key,
                        kv.value(),
                        kv.create_revision(),
                        kv.mod_revision(),
                        kv.lease(),
                    ),
                    EventType::Delete => {
                        let prev = ev.prev_kv().map(|p| p.value());
                        v.delete(keys, key, now, prev);
                    }
                }
            }
        });
    }

    /// Replaces the lease, which etcd no longer has (it expired while this agent was
    /// frozen, or etcd lost it).
    async fn renew_lease(&mut self) -> EtcdResult<()> {
        let ttl = self.ttl.as_secs().max(1) as i64;
        let sent = std::time::Instant::now();
        let grant = self.client.lease_grant(ttl, None).await?;
        self.wrote();
        self.lease_clock(|c| c.replaced(sent, self.ttl));
        self.publish_lease();
        tracing::info!(
            old = self.lease,
            new = grant.id(),
            "the lease was gone; granted a new one"
        );
        self.lease = grant.id();
        self.incarnation += 1;
        Ok(())
    }

    async fn new_lease(&mut self) -> EtcdResult<()> {
        self.renew_lease().await?;
        self.register().await
    }

    /// The lease is gone. Before `safe_until` etcd cannot have expired it, so it lost its
    /// data (an empty restart) and nobody saw this node leave: the round goes on. From
    /// then on it may have expired and the others re-form without this node: if it runs
    /// a round, that round is over for it too.
    fn lease_gone(&mut self) {
        let now = std::time::Instant::now();
        let expired = self
            .lease_clock(|c| c.safe_until())
            .is_none_or(|s| now >= s);
        if let Some(went) = self.my_incarnation().filter(|_| expired) {
            tracing::warn!("the lease expired while this node ran a round: it was evicted");
            let me = self.node_id.clone();
            self.view.send_modify(|v| v.depart(&me, went, now));
        }
    }

    /// This node's incarnation in the round it runs, if it runs one.
    fn my_incarnation(&self) -> Option<u64> {
        let r = self.running.as_ref()?;
        let me = r.members.iter().find(|m| m.node_id == self.node_id)?;
        Some(me.incarnation)
    }

    /// After fencing: revoke the lease (the others see this node leave at once; one that
    /// expired meanwhile is gone either way) and take a new one.
    async fn abandon_lease(&mut self) -> EtcdResult<()> {
        self.revoke(self.lease).await?;
        tracing::info!(lease = self.lease, "revoked the fenced lease");
        self.abandon = false;
        self.renew_lease().await
    }

    /// Writes this agent's registration with the current lease, if it has one to write.
    async fn register(&mut self) -> EtcdResult<()> {
        if self.member.is_some() {
            let txn = registration(
                &self.keys,
                &self.node_id,
                self.member.as_ref(),
                (self.lease, self.incarnation),
                false,
            );
            self.client.txn(txn).await?;
            self.wrote();
        }
        Ok(())
    }

    /// Tries to become coordinator if nobody is (and this node takes part in the run).
    async fn campaign(&mut self) -> EtcdResult<()> {
        if self.view.borrow().coordinator.is_some() || self.member.is_none() {
            return Ok(());
        }
        let txn = registration(&self.keys, &self.node_id, None, (self.lease, 0), true);
        let won = self.client.txn(txn).await?.succeeded();
        self.wrote();
        if won {
            self.elected();
        }
        Ok(())
    }

    /// This node's claim on the coordinator key won (the one place that says so).
    fn elected(&self) {
        tracing::info!(node = %self.node_id, "elected rendezvous coordinator");
        let me = self.node_id.clone();
        self.view.send_modify(|v| v.coordinator = Some(me));
    }

    /// After a (re)sync: make sure our lease lives and our registration is there; put back
    /// our round if etcd lost it.
    async fn ensure_registered(&mut self, resync: bool) -> EtcdResult<()> {
        let sent = std::time::Instant::now();
        let ttl = self
            .client
            .lease_time_to_live(self.lease, None)
            .await?
            .ttl();
        let alive = ttl > 0;
        if alive {
            self.lease_clock(|c| c.confirmed(sent, Duration::from_secs(ttl.unsigned_abs())));
            self.publish_lease();
        }
        let (present, round_missing, evicted) = {
            let v = self.view.borrow();
            let present = v.members.contains_key(&self.node_id);
            let mine = self.running.as_ref();
            let round_missing = mine.is_some() && v.round.is_none();
            // Our key is gone while our lease lives and our round is still there: someone
            // deleted it, and the others saw us leave. (A lost lease is judged by the
            // clock, in `lease_gone`.)
            let evicted = alive
                && !present
                && mine.is_some_and(|r| {
                    v.round
                        .as_ref()
                        .is_some_and(|cur| cur.record.number >= r.number)
                });
            (present, round_missing, evicted)
        };
        if evicted {
            // The incarnation the round names went; this node registers again below, as
            // the next one, whose registration that departure does not concern.
            if let Some(went) = self.my_incarnation() {
                let (me, now) = (self.node_id.clone(), Instant::now().into_std());
                self.view.send_modify(|v| v.depart(&me, went, now));
            }
            self.incarnation += 1;
        }
        if !alive {
            self.lease_gone();
            self.new_lease().await?;
            return self.republish(round_missing).await;
        }
        // On the first sync the agent writes its own registration when it joins a round.
        if !present && resync {
            self.register().await?;
        }
        self.republish(round_missing).await
    }

    /// etcd came back without our round: put the same round back, so no healthy worker
    /// restarts. Every member tries; the create-if-absent makes exactly one write win.
    async fn republish(&mut self, round_missing: bool) -> EtcdResult<()> {
        let Some(r) = self.running.clone().filter(|_| round_missing) else {
            return Ok(());
        };
        let key = self.keys.round();
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, r.encode_to_vec(), None)]);
        let ok = self.client.txn(txn).await?.succeeded();
        self.wrote();
        if ok {
            tracing::info!(
                round = r.number,
                "etcd lost the round record; republished the running round"
            );
        }
        Ok(())
    }

    /// Members of our round that did not come back within the grace after an outage are
    /// gone: record them as departed so the agent re-forms.
    async fn check_absent(&mut self) -> EtcdResult<()> {
        let Some(mine) = self.running.clone() else {
            return Ok(());
        };
        let prefix = self.keys.members();
        let resp = self
            .client
            .get(
                prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await?;
        let present: BTreeSet<&str> = resp
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(&prefix))
            .collect();
        let now = Instant::now().into_std();
        // By node, not by incarnation: after etcd came back empty every member registers
        // again as a new incarnation, and the round goes on.
        self.view.send_modify(|v| {
            for m in mine
                .members
                .iter()
                .filter(|m| !present.contains(m.node_id.as_str()))
            {
                v.depart(&m.node_id, m.incarnation, now);
            }
        });
        Ok(())
    }

    /// As coordinator: observe the view, and commit a round if the rule says so.
    /// `recheck` is when the coordinator wants to look again.
    async fn coordinate(&mut self, recheck: &mut Option<Instant>) -> EtcdResult<()> {
        if self.role() != Role::Coordinator {
            *recheck = None;
            return Ok(());
        }
        let now = Instant::now().into_std();
        let (obs, record, finished) = {
            let v = self.view.borrow();
            let obs = self.coordinator.observe(now, &v);
            let record = match &obs.decision {
                SealDecision::Seal(p) => Some(round_record(p, &v, &obs.reason, crate::unix_ms())),
                _ => None,
            };
            (obs, record, v.round_finished())
        };
        // Once every member finished, the members leaving is the job ending: "re-forming
        // (lost ...)" would read as a failure in the last lines of a successful run. The
        // decision itself stands (a node joining a finished job still gets a round).
        match (obs.new_reason, finished) {
            (true, true) => {
                tracing::debug!(reason = %obs.reason, "coordinator (the round finished)")
            }
            (true, false) => tracing::info!(reason = %obs.reason, "coordinator"),
            (false, _) => {}
        }
        if let Some(why) = &obs.held {
            self.counters.seals_held.fetch_add(1, Ordering::Relaxed);
            tracing::error!(reason = %obs.reason, held = %why, "rounds are being sealed too fast; is a node re-forming in a loop?");
        }
        match (obs.decision, record) {
            (SealDecision::Wait { recheck_at } | SealDecision::Reforming { recheck_at }, _) => {
                *recheck = recheck_at.map(Instant::from_std);
            }
            (SealDecision::Seal(p), Some(record)) => {
                if commit_round(&mut self.client, &self.keys, obs.fence, &record).await? {
                    let reason = &obs.reason;
                    tracing::info!(round = p.number, members = p.members.len(), restart_count = p.restart_count, %reason, "round sealed");
                    self.counters.rounds_sealed.fetch_add(1, Ordering::Relaxed);
                    self.coordinator
                        .sealed(Instant::now().into_std(), p.number, reason);
                }
                self.wrote();
            }
            (SealDecision::Seal(_), None) => {}
        }
        Ok(())
    }
}

/// Commands: every write the handle asks for.
impl Session {
    /// Serves one command and answers it, unless etcd failed on the way: then the
    /// request waits in `pending` for the next sync and the session reconnects.
    async fn serve(&mut self, req: Request) -> Served {
        let ends = matches!(req.command, Command::Depart { .. });
        let result = match &req.command {
            Command::Register { wants_round } => {
                // Joining a round means the last one is over for this node.
                self.running = None;
                self.register_for(*wants_round).await
            }
            Command::PublishMaster { round } => self.publish_master(*round).await,
            Command::Running { round } => {
                self.running = Some(round.clone());
                Ok(())
            }
            Command::ReportFailure { round } => self.report_failure(*round).await,
            Command::ReportDone { round } => self.report_done(*round).await,
            Command::ReportHang { report } => self.report_hang(report).await,
            Command::Halt { halt } => self.halt(halt).await,
            Command::Withdraw { record } => self.withdraw(record).await,
            Command::ReportFault { record } => {
                let key = self.keys.fault(record.round, &record.node_id);
                self.put(key, record.encode_to_vec(), "reporting a worker fault")
                    .await
            }
            Command::Quarantine { record } => {
                let key = self.keys.quarantine(&record.machine);
                self.put(key, record.encode_to_vec(), "quarantining this machine")
                    .await
            }
            Command::Depart { how } => {
                self.depart(*how).await;
                Ok(())
            }
            Command::Abandon => {
                self.running = None;
                self.abandon = true;
                Ok(())
            }
            Command::Evict {
                node,
                lease,
                round,
                detect_ms,
            } => {
                let gone = gone(*round, node, v1::Detection::Refused, *detect_ms);
                self.evict(gone, *lease).await
            }
        };
        let result = match result {
            Err(RendezvousError::Etcd { what, source }) if transient(&source) => {
                tracing::warn!(error = %source, "{what} failed; retrying after reconnecting");
                self.pending.push_front(req);
                return Served::Retry(source);
            }
            other => other,
        };
        if let Some(reply) = req.reply {
            // The handle may have stopped waiting (its future was dropped): nothing to do.
            let _ = reply.send(result);
        }
        if ends {
            Served::Ended
        } else {
            Served::Answered
        }
    }

    async fn register_for(&mut self, wants_round: u64) -> Result<(), RendezvousError> {
        let member = v1::Member {
            schema: SCHEMA_VERSION,
            node_id: self.node_id.clone(),
            addr: self.addr.clone(),
            local_world_size: self.local_world_size,
            wants_round,
            status_addr: self.status_addr.clone(),
            // Set to the lease and incarnation it is written with (`registration`).
            lease: 0,
            incarnation: 0,
        };
        self.member = Some(member.clone());
        let claiming = self.view.borrow().coordinator.is_none();
        let (keys, me) = (self.keys.clone(), self.node_id.clone());
        let won = self
            .with_live_lease("registering this node", |mut client, held| {
                let txn = registration(&keys, &me, Some(&member), held, claiming);
                async move { client.txn(txn).await.map(|r| r.succeeded()) }
            })
            .await?;
        self.wrote();
        if claiming && won {
            self.elected();
        }
        Ok(())
    }

    async fn publish_master(&mut self, round: u64) -> Result<(), RendezvousError> {
        let port = port::free_port(&self.addr)?;
        let master = v1::Master {
            schema: SCHEMA_VERSION,
            round,
            addr: self.addr.clone(),
            port: u32::from(port),
        };
        let key = self.keys.master();
        self.with_live_lease("publishing the master address", |mut client, (lease, _)| {
            let (key, value) = (key.clone(), master.encode_to_vec());
            let opts = PutOptions::new().with_lease(lease);
            async move { client.put(key, value, Some(opts)).await.map(drop) }
        })
        .await?;
        self.wrote();
        Ok(())
    }

    async fn report_failure(&mut self, round: u64) -> Result<(), RendezvousError> {
        let key = self.keys.failure(round);
        let failure = v1::Failure {
            schema: SCHEMA_VERSION,
            round,
            node_id: self.node_id.clone(),
        };
        // Not once the run is halted: a peer's workers that fail because the halting
        // node's did must not spend the budget the halt leaves untouched.
        let txn = Txn::new()
            .when([
                Compare::version(key.clone(), CompareOp::Equal, 0),
                Compare::version(self.keys.halt(), CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(key, failure.encode_to_vec(), None)]);
        self.client
            .txn(txn)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "reporting a worker failure",
                source,
            })?;
        self.wrote();
        Ok(())
    }

    /// One plain put, as a request's outcome.
    async fn put(
        &mut self,
        key: String,
        value: Vec<u8>,
        what: &'static str,
    ) -> Result<(), RendezvousError> {
        self.client
            .put(key, value, None)
            .await
            .map_err(|source| RendezvousError::Etcd { what, source })?;
        self.wrote();
        Ok(())
    }

    async fn withdraw(&mut self, record: &v1::Unhealthy) -> Result<(), RendezvousError> {
        // Out of every round until it registers again: nothing of ours to put back, and
        // the next registration is a new incarnation.
        self.member = None;
        self.running = None;
        self.incarnation += 1;
        let coordinating = self.view.borrow().coordinator.as_deref() == Some(&self.node_id);
        let mut ops = vec![
            TxnOp::delete(self.keys.member(&self.node_id), None),
            TxnOp::put(
                self.keys.unhealthy(&self.node_id),
                record.encode_to_vec(),
                Some(PutOptions::new().with_lease(self.lease)),
            ),
        ];
        if coordinating {
            // A node out of the rounds does not seal them: a healthy one takes over.
            ops.push(TxnOp::delete(self.keys.coordinator(), None));
        }
        self.client
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "withdrawing an unhealthy node",
                source,
            })?;
        self.wrote();
        Ok(())
    }

    async fn halt(&mut self, halt: &v1::Halt) -> Result<(), RendezvousError> {
        let key = self.keys.halt();
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, halt.encode_to_vec(), None)]);
        self.client
            .txn(txn)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "ending the run for every node",
                source,
            })?;
        self.wrote();
        Ok(())
    }

    async fn report_hang(&mut self, report: &v1::HangReport) -> Result<(), RendezvousError> {
        let key = self.keys.hang(report.round, &self.node_id);
        self.client
            .put(key, report.encode_to_vec(), None)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "reporting where this node's ranks were in a hang",
                source,
            })?;
        self.wrote();
        Ok(())
    }

    async fn report_done(&mut self, round: u64) -> Result<(), RendezvousError> {
        let done = v1::Done {
            schema: SCHEMA_VERSION,
            round,
            node_id: self.node_id.clone(),
        };
        let key = self.keys.done(round, &done.node_id);
        self.client
            .put(key, done.encode_to_vec(), None)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "reporting this node finished",
                source,
            })?;
        self.wrote();
        Ok(())
    }

    /// Records how a member's loss was noticed, before its lease goes (so that every agent
    /// has the record when it re-forms).
    async fn say_gone(&mut self, gone: &v1::Gone) -> EtcdResult<()> {
        let key = self.keys.gone(gone.round, &gone.node_id);
        // The first word stands: a leaver's own "left" is not overwritten by the
        // neighbour that then finds its port closed.
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, gone.encode_to_vec(), None)]);
        self.client.txn(txn).await?;
        self.wrote();
        Ok(())
    }

    /// Revokes a dead agent's lease: its registration (and the coordinator key, if it
    /// held it) goes, and every agent sees the delete at once. Already gone: nothing to do.
    async fn evict(&mut self, gone: v1::Gone, lease: i64) -> Result<(), RendezvousError> {
        let node = gone.node_id.clone();
        if self.view.borrow().departed.contains_key(&node) {
            // It left (or its lease went) before the proof came: nothing to add.
            return Ok(());
        }
        // Only while `lease` is still the one its registration lives on: the proof is about
        // the process that held it. A node that registered again (a new incarnation), or a
        // store restarted empty that handed the id to someone else, is not what was found
        // dead, and revoking the id would evict a live agent.
        let held = lease_holds(&mut self.client, &self.keys, &node, lease)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "checking a dead agent's lease",
                source,
            })?;
        if !held {
            tracing::info!(%node, lease, "the dead agent's lease no longer holds its registration; nothing to revoke");
            return Ok(());
        }
        self.say_gone(&gone)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "recording how a dead agent was found",
                source,
            })?;
        self.revoke(lease)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "revoking a dead agent's lease",
                source,
            })?;
        tracing::info!(%node, lease, "revoked the lease of a dead agent");
        Ok(())
    }

    /// Revokes `lease`; one etcd no longer has is gone already.
    async fn revoke(&mut self, lease: i64) -> EtcdResult<()> {
        match self.client.lease_revoke(lease).await {
            Ok(_) => {
                self.wrote();
                Ok(())
            }
            Err(e) if lease_not_found(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Revoking deletes our registration (and the coordinator key if we held it), so the
    /// others learn within milliseconds instead of a lease TTL.
    async fn depart(&mut self, how: Departure) {
        // The others learn how (a leave, not a death) from a record sent beside the
        // revoke, not before it: under load one more round trip first would delay what
        // every survivor waits for.
        let record = match (how, &self.running) {
            (Departure::Left, Some(r)) => {
                Some(gone(r.number, &self.node_id, v1::Detection::Left, 0))
            }
            _ => None,
        };
        let (mut client, lease) = (self.client.clone(), self.lease);
        let (said, revoked) = tokio::join!(
            async {
                match &record {
                    Some(g) => self.say_gone(g).await,
                    None => Ok(()),
                }
            },
            client.lease_revoke(lease)
        );
        if let Err(e) = said {
            tracing::debug!(error = %e, "could not record the leave");
        }
        match revoked {
            Ok(_) => self.wrote(),
            Err(e) => {
                tracing::warn!(error = %e, ?how, "could not revoke the lease; peers will notice after its TTL")
            }
        }
    }

    /// Runs `request` with the current lease and this agent's incarnation on it; when etcd
    /// no longer has that lease (this agent was frozen past its TTL, or etcd lost it) a new
    /// one is granted and the request runs again with it, so the agent rejoins as a new
    /// incarnation instead of exiting.
    async fn with_live_lease<T, F, Fut>(
        &mut self,
        what: &'static str,
        mut request: F,
    ) -> Result<T, RendezvousError>
    where
        F: FnMut(Client, (i64, u64)) -> Fut,
        Fut: std::future::Future<Output = EtcdResult<T>>,
    {
        // A second refusal right after a fresh grant is not a stale lease: report it.
        for attempt in 0..2 {
            match request(self.client.clone(), (self.lease, self.incarnation)).await {
                Err(e) if attempt == 0 && lease_not_found(&e) => {
                    self.lease_gone();
                    self.renew_lease()
                        .await
                        .map_err(|source| RendezvousError::Etcd {
                            what: "granting a new membership lease",
                            source,
                        })?;
                }
                r => return r.map_err(|source| RendezvousError::Etcd { what, source }),
            }
        }
        unreachable!("the second attempt always returns")
    }
}

/// How `node`'s loss from `round` was noticed.
fn gone(round: u64, node: &str, how: v1::Detection, detect_ms: u32) -> v1::Gone {
    v1::Gone {
        schema: SCHEMA_VERSION,
        round,
        node_id: node.to_owned(),
        how: how.into(),
        detect_ms,
    }
}

/// This node's registration transaction under `lease`: its member record when given,
/// and, when `claim`, the coordinator key if nobody holds it (the record is written
/// either way).
fn registration(
    keys: &Keys,
    node_id: &str,
    member: Option<&v1::Member>,
    (lease, incarnation): (i64, u64),
    claim: bool,
) -> Txn {
    // A registration says the node is healthy again: its unhealthy record goes with it.
    let put_member: Vec<TxnOp> = member
        .map(|m| {
            let opts = PutOptions::new().with_lease(lease);
            let record = v1::Member {
                lease,
                incarnation,
                ..m.clone()
            };
            [
                TxnOp::put(keys.member(&m.node_id), record.encode_to_vec(), Some(opts)),
                TxnOp::delete(keys.unhealthy(&m.node_id), None),
            ]
        })
        .into_iter()
        .flatten()
        .collect();
    if !claim {
        return Txn::new().and_then(put_member);
    }
    let key = keys.coordinator();
    let record = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: node_id.to_owned(),
    };
    let opts = PutOptions::new().with_lease(lease);
    let claim = TxnOp::put(key.clone(), record.encode_to_vec(), Some(opts));
    Txn::new()
        .when([Compare::version(key, CompareOp::Equal, 0)])
        .and_then(
            put_member
                .iter()
                .cloned()
                .chain([claim])
                .collect::<Vec<_>>(),
        )
        .or_else(put_member)
}

/// Whether `node`'s registration lives on `lease` now (one comparison, no read).
pub async fn lease_holds(
    client: &mut Client,
    keys: &Keys,
    node: &str,
    lease: i64,
) -> EtcdResult<bool> {
    let key = keys.member(node);
    let txn = Txn::new().when([Compare::lease(key, CompareOp::Equal, lease)]);
    Ok(client.txn(txn).await?.succeeded())
}

/// Commits `record` as the next round, fenced on the round it replaces: the transaction
/// succeeds only if the round key still has revision `fence` (or does not exist when
/// `fence` is `None`). Two coordinators racing for the same round cannot both win.
pub async fn commit_round(
    client: &mut Client,
    keys: &Keys,
    fence: Option<i64>,
    record: &v1::Round,
) -> EtcdResult<bool> {
    let key = keys.round();
    let compare = match fence {
        Some(rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
        None => Compare::version(key.clone(), CompareOp::Equal, 0),
    };
    let txn = Txn::new()
        .when([compare])
        .and_then([TxnOp::put(key, record.encode_to_vec(), None)]);
    Ok(client.txn(txn).await?.succeeded())
}
