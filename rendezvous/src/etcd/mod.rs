//! The etcd v3 backend: lease-bound membership, a coordinator elected through etcd,
//! rounds committed by fenced transactions, and watch-driven change detection.
//!
//! # How a round forms
//!
//! 1. Each agent grants a lease (TTL `keep_alive_ttl`) and writes its [`v1::Member`]
//!    record under `members/` with that lease, saying which round it is ready for.
//! 2. One agent holds `ctl/coordinator` (a lease-bound create-if-absent). It watches the
//!    registrations and asks [`crate::seal::decide`] whether to seal; when yes it writes
//!    `ctl/round` in a transaction fenced on the revision of the round it replaces.
//! 3. The round's group rank 0 picks a free port and writes `ctl/master`; every member
//!    that sees the round and its master returns from [`EtcdRendezvous::next_round`].
//!
//! Every etcd write of an agent after its lease grant is made by one task, the session
//! (`session.rs`), which owns the lease; [`EtcdRendezvous`] asks it for writes through
//! commands and reads the [`View`] it publishes.
//!
//! Per round each agent writes its registration once; the coordinator and rank 0 write one
//! key each: O(N) writes, no key that every node compare-and-swaps in a loop.
//!
//! # How a round ends
//!
//! A member's key disappears (its lease expired, or it left and revoked it), a failure is
//! reported under `ctl/failures/`, or the coordinator seals a newer round (to admit a
//! waiting node). Each agent sees this in its watch ([`detect`]) and stops its workers.

mod connect;
mod coordinator;
#[cfg(test)]
mod explore;
pub mod inspect;
mod keys;
pub mod liveness;
mod probe;
pub(crate) mod session;
mod view;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use fsdp_proto::v1;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

pub use connect::{EtcdOptions, TlsFiles, connect, transient as is_transient};
pub use keys::Keys;
pub use session::{commit_round, lease_holds};
pub use view::View;

use crate::fence::{self, FenceDecision};
use crate::seal::SealConfig;
use crate::{
    Change, Counters, Departure, Finish, Rendezvous, RendezvousError, Round, RoundMember, port,
};
use session::{Command, Config as SessionConfig, Driver, Machine, Request};

/// Configuration of one agent's etcd rendezvous.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub options: EtcdOptions,
    /// Key prefix; the run's keys live under `<prefix>/<run_id>/`.
    pub prefix: String,
    pub run_id: String,
    /// Unique id of this agent; generated from host name, pid and a random suffix if empty.
    pub node_id: String,
    /// Address this node advertises (becomes `MASTER_ADDR` when it is group rank 0).
    pub addr: String,
    pub local_world_size: u32,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub last_call: Duration,
    /// How long `next_round` waits for a round before giving up.
    pub join_timeout: Duration,
    /// Lease TTL: a dead agent is noticed within this time.
    pub keep_alive_ttl: Duration,
    /// How long a re-form waits for a surviving member that does not come back.
    pub straggler_timeout: Duration,
    /// How long before its lease can expire an agent that cannot renew it stops its
    /// workers ([`crate::fence`]); `None`: [`crate::fence::default_margin`] of the TTL.
    pub fence_margin: Option<Duration>,
    /// How long etcd may stay unreachable mid-run before the agent gives up.
    pub outage_timeout: Duration,
    /// Where this agent's status port answers (`host:port`), if it serves one: its ring
    /// neighbour watches it ([`liveness`]).
    pub status_addr: Option<String>,
}

impl EtcdConfig {
    /// Defaults for everything but the endpoints, run id and group size.
    pub fn new(endpoints: Vec<String>, run_id: &str, min_nodes: u32, max_nodes: u32) -> Self {
        Self {
            options: EtcdOptions::new(endpoints),
            prefix: "/fsdp".into(),
            run_id: run_id.into(),
            node_id: String::new(),
            addr: "127.0.0.1".into(),
            local_world_size: 1,
            min_nodes,
            max_nodes,
            last_call: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            keep_alive_ttl: Duration::from_secs(5),
            straggler_timeout: Duration::from_secs(30),
            fence_margin: None,
            outage_timeout: Duration::from_secs(900),
            status_addr: None,
        }
    }
}

impl EtcdConfig {
    /// The fencing margin in effect.
    pub fn margin(&self) -> Duration {
        self.fence_margin
            .unwrap_or_else(|| crate::fence::default_margin(self.keep_alive_ttl))
    }
}

/// A unique node id: host name, pid and a random suffix, so agents that share a host name
/// and a pid (PID 1 in containers) are still told apart.
pub fn new_node_id() -> String {
    let host = crate::hostname().replace('/', "_");
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("{host}-{}-{suffix}", std::process::id())
}

/// The round this agent holds, with what detection needs.
#[derive(Debug, Clone)]
struct Held {
    record: v1::Round,
    round: Round,
    /// When this agent started waiting for the round: departures after it concern us.
    since: Instant,
}

/// An agent's handle on the etcd rendezvous. It reads the session's [`View`] and asks the
/// session (which makes every etcd write) for writes through [`Command`]s.
pub struct EtcdRendezvous {
    cfg: EtcdConfig,
    keys: Keys,
    view: watch::Receiver<View>,
    commands: mpsc::UnboundedSender<Request>,
    session: JoinHandle<()>,
    writes: Arc<AtomicU64>,
    counters: Counters,
    held: Option<Held>,
    /// Watches the held round's ring neighbour ([`liveness`]).
    watcher: Option<liveness::Watcher>,
}

impl Drop for EtcdRendezvous {
    fn drop(&mut self) {
        self.session.abort();
    }
}

impl EtcdRendezvous {
    /// Connects (bounded retry) and joins the run.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, RendezvousError> {
        let client = connect::connect(&cfg.options).await?;
        Self::join(client, cfg).await
    }

    /// Joins the run over an existing connection (several simulated nodes can share one).
    pub async fn join(mut client: Client, mut cfg: EtcdConfig) -> Result<Self, RendezvousError> {
        if cfg.min_nodes == 0 || cfg.min_nodes > cfg.max_nodes {
            return Err(RendezvousError::InvalidConfig(format!(
                "nnodes {}:{} is not 0 < MIN <= MAX",
                cfg.min_nodes, cfg.max_nodes
            )));
        }
        if cfg.node_id.is_empty() {
            cfg.node_id = new_node_id();
        }
        let keys = Keys::new(&cfg.prefix, &cfg.run_id).map_err(RendezvousError::InvalidConfig)?;
        refuse_nesting(&mut client, &keys, &cfg.prefix).await?;
        let ttl_s = cfg.keep_alive_ttl.as_secs().max(1) as i64;
        let granted_at = std::time::Instant::now();
        let unix_ms_at_grant = crate::unix_ms();
        let grant =
            client
                .lease_grant(ttl_s, None)
                .await
                .map_err(|source| RendezvousError::Etcd {
                    what: "granting the membership lease",
                    source,
                })?;
        let writes = Arc::new(AtomicU64::new(1));
        let counters = Counters::default();
        let (tx, mut view) = watch::channel(View::default());
        let (commands, inbox) = mpsc::unbounded_channel();
        let machine = Machine::new(
            SessionConfig {
                keys: keys.clone(),
                node_id: cfg.node_id.clone(),
                addr: cfg.addr.clone(),
                status_addr: cfg.status_addr.clone().unwrap_or_default(),
                local_world_size: cfg.local_world_size,
                ttl: Duration::from_secs(ttl_s as u64),
                outage_limit: cfg.outage_timeout,
                fence_margin: cfg.margin(),
                seal: SealConfig {
                    min_nodes: cfg.min_nodes,
                    max_nodes: cfg.max_nodes,
                    last_call: cfg.last_call,
                    straggler_timeout: cfg.straggler_timeout,
                },
                several_endpoints: cfg.options.endpoints.len() > 1,
                can_probe: true,
                embedded_store: cfg.options.embedded_store,
                lease: grant.id(),
                granted_at,
                unix_ms_at_grant,
                first_incarnation: session::first_incarnation(unix_ms_at_grant),
            },
            counters.clone(),
            writes.clone(),
        );
        let driver = Driver::new(client, Some(cfg.options.clone()), machine, tx, inbox);
        let session = tokio::spawn(driver.run());
        let synced = view.wait_for(|v| v.connected);
        if tokio::time::timeout(cfg.options.retry_window, synced)
            .await
            .is_err()
        {
            session.abort();
            return Err(RendezvousError::SessionEnded(
                "etcd did not answer the first read of the run",
            ));
        }
        Ok(Self {
            cfg,
            keys,
            view,
            commands,
            session,
            writes,
            counters,
            held: None,
            watcher: None,
        })
    }

    /// This agent's node id.
    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// etcd writes this agent made so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The key layout of the run.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The agent's current view of the run (a copy).
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    /// Resolves when the held round is no longer the group's round (or this node must
    /// fence itself).
    async fn next_change(&mut self) -> Result<Change, RendezvousError> {
        let Some(held) = self.held.clone() else {
            return std::future::pending().await;
        };
        let margin = self.cfg.margin();
        loop {
            let recheck_at = {
                let v = self.view.borrow_and_update();
                if let Some(c) = v.corruption() {
                    return Err(RendezvousError::Corrupt(c));
                }
                if let Some(change) = detect(&v, &held.record, &self.cfg.node_id, held.since) {
                    return Ok(change);
                }
                match fence::decide(Instant::now(), v.lease_safe_until, margin) {
                    FenceDecision::Fence { reason, left } => {
                        drop(v);
                        self.tell(Command::Abandon);
                        // Cut off, this node proves nothing about anyone.
                        self.watcher = None;
                        return Ok(Change::Fenced {
                            reason,
                            stop_within: left,
                        });
                    }
                    FenceDecision::Hold { recheck_at } => Some(recheck_at),
                    FenceDecision::Unknown => None,
                }
            };
            let fence_timer = async {
                match recheck_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = fence_timer => {}
            }
        }
    }

    /// Starts watching `round`'s ring neighbour: proven gone, it is evicted at once.
    fn watch_neighbour(&mut self, round: &v1::Round) {
        let me = self.cfg.node_id.clone();
        let number = round.number;
        self.watcher = liveness::neighbour(round, &me).map(|target| {
            let commands = self.commands.clone();
            let view = self.view.clone();
            liveness::Watcher::start(me, target.clone(), move |node, lease, proof| {
                let liveness::Proof { reason, detect } = proof;
                // A neighbour whose workers all succeeded exits when the job is done: its
                // port closing is the end of the run, not a death.
                if view
                    .borrow()
                    .done
                    .get(&number)
                    .is_some_and(|d| d.contains(&node))
                {
                    tracing::debug!(%node, "finished neighbour exited");
                    return;
                }
                let detect_ms = u32::try_from(detect.as_millis()).unwrap_or(u32::MAX);
                tracing::warn!(%node, %reason, detect_ms, "ring neighbour gone; revoking its lease");
                let command = Command::Evict {
                    node,
                    lease,
                    round: number,
                    detect_ms,
                };
                let _ = commands.send(Request {
                    command,
                    reply: None,
                });
            })
        });
    }

    /// Tells the session `command` without waiting: nothing the handle does next depends on
    /// it, and a session that ended will say so at the next request.
    fn tell(&self, command: Command) {
        let _ = self.commands.send(Request {
            command,
            reply: None,
        });
    }

    /// Why the session is gone: it gave up on etcd, or its task stopped.
    fn ended(&self) -> RendezvousError {
        match &self.view.borrow().gave_up {
            Some(reason) => RendezvousError::Outage(reason.clone()),
            None => RendezvousError::SessionEnded("its task stopped"),
        }
    }

    /// Asks the session for `command` and waits for its outcome.
    async fn ask(&self, command: Command) -> Result<(), RendezvousError> {
        let (reply, outcome) = oneshot::channel();
        let ended = || self.ended();
        self.commands
            .send(Request {
                command,
                reply: Some(reply),
            })
            .map_err(|_| ended())?;
        outcome.await.map_err(|_| ended())?
    }
}

/// Refuses to start a run whose keys would lie inside another run's (its prefix is
/// below another run's root) or around one (another run's prefix is below this run's
/// root): the outer run would read the inner one's keys as its own. Costs one read per
/// level of the prefix, once, at start.
async fn refuse_nesting(
    client: &mut Client,
    keys: &Keys,
    prefix: &str,
) -> Result<(), RendezvousError> {
    let read = |what| move |source| RendezvousError::Etcd { what, source };
    let fix = "choose an etcd_prefix outside other runs' keys (e.g. the default /fsdp)";
    for outer in keys.enclosing_roots() {
        for sub in ["members/", "ctl/"] {
            let found = client
                .get(
                    format!("{outer}{sub}"),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
                .map_err(read("checking that the run's keys nest in no other run"))?
                .count();
            if found > 0 {
                return Err(RendezvousError::InvalidConfig(format!(
                    "etcd_prefix '{prefix}' puts this run's keys ({}) inside those of the run at {outer}; {fix}",
                    keys.root()
                )));
            }
        }
    }
    let inner = client
        .get(
            keys.root(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .map_err(read("checking that no other run nests in this run's keys"))?;
    if let Some(k) = inner
        .kvs()
        .iter()
        .filter_map(|kv| kv.key_str().ok())
        .find(|k| keys.nested_run_key(k))
    {
        return Err(RendezvousError::InvalidConfig(format!(
            "another run's keys ({k}) lie inside this run's ({}); give that run or this one a different etcd_prefix or --rdzv-id",
            keys.root()
        )));
    }
    Ok(())
}

/// What `next_round` should do after looking at the view.
pub(crate) enum Step {
    Wait,
    Spare { next: u64 },
    Broken { next: u64, change: Change },
    PublishMaster { round: u64 },
    Done(Box<(v1::Round, Round)>),
}

pub(crate) fn step(
    v: &View,
    me: &str,
    my_workers: u32,
    wants: u64,
    published: Option<u64>,
    since: Instant,
) -> Result<Step, RendezvousError> {
    if let Some(c) = v.corruption() {
        return Err(RendezvousError::Corrupt(c));
    }
    if let Some(h) = v.halted() {
        return Err(RendezvousError::Halted(h));
    }
    let Some(r) = v.round.as_ref().filter(|r| r.record.number >= wants) else {
        return Ok(Step::Wait);
    };
    let rec = &r.record;
    let Some(pos) = rec.members.iter().position(|m| m.node_id == me) else {
        return Ok(Step::Spare {
            next: rec.number + 1,
        });
    };
    if rec.members[pos].incarnation < v.incarnation {
        // Sealed from a registration of this node that is gone (an earlier process, or a
        // lease it gave up): the coordinator seals the next round with the current one.
        return Ok(Step::Broken {
            next: rec.number + 1,
            change: Change::MemberLost {
                node: me.to_owned(),
            },
        });
    }
    let master = v.master.as_ref().filter(|m| m.round == rec.number);
    let Some(master) = master else {
        // The round broke before it started (e.g. rank 0 died before publishing the
        // master): come back for the next one, or everyone would wait for a master that
        // never comes while the coordinator waits for them to come back.
        if let Some(change) = detect(v, rec, me, since) {
            return Ok(Step::Broken {
                next: rec.number + 1,
                change,
            });
        }
        return Ok(if pos == 0 && published != Some(rec.number) {
            Step::PublishMaster { round: rec.number }
        } else {
            Step::Wait
        });
    };
    // Broken already (a member left, a failure was reported): workers started now would
    // only be stopped again.
    if let Some(change) = detect(v, rec, me, since) {
        return Ok(Step::Broken {
            next: rec.number + 1,
            change,
        });
    }
    // A round that gives this node another worker count than it runs would hand its
    // workers a wrong WORLD_SIZE and overlapping ranks: the record is not ours.
    let given = rec.members[pos].local_world_size;
    if given != my_workers {
        return Err(RendezvousError::Corrupt(format!(
            "round {} gives this node local_world_size {given}, but it runs {my_workers} workers",
            rec.number
        )));
    }
    let mut round = Round::new(
        rec.number,
        rec.members.iter().map(RoundMember::from).collect(),
        pos,
        // The view admits only ports 1-65535.
        (
            master.addr.clone(),
            u16::try_from(master.port).unwrap_or_default(),
        ),
        rec.restart_count,
        rec.reason.clone(),
    )
    .map_err(|e| RendezvousError::Corrupt(format!("round {}: {e}", rec.number)))?;
    round.charged_at_ms = rec.charged_at_ms.clone();
    // A record from before the field existed: the charges of the whole run count.
    if rec.sealed_at_ms > 0 {
        round.sealed_at_ms = rec.sealed_at_ms;
    }
    Ok(Step::Done(Box::new((rec.clone(), round))))
}

/// Whether the round an agent holds is still the group's round: a pure function of the
/// view, so tests can drive it without etcd.
pub fn detect(v: &View, held: &v1::Round, me: &str, since: Instant) -> Option<Change> {
    if let Some(h) = v.halted() {
        return Some(Change::Halted(h));
    }
    // A failure is looked at first: a node that gives up reports its failure and then
    // revokes its lease, and the others must see the failure, not just a departure.
    if v.failures.contains(&held.number) {
        return Some(Change::PeerFailed {
            restart_count: held.restart_count + 1,
        });
    }
    let done = v.done.get(&held.number);
    // Only the registration the round was sealed from counts: a node that lost its lease
    // and registered again is a new registration, and its old one's departure says nothing
    // about a round sealed with the new one (read as a loss, that departure broke every
    // later round before it started: a livelock).
    // A member that finished and left is not lost: it is waiting to exit or has exited 0.
    let departed = |m: &v1::Member| {
        v.departed_since(m, since) && !done.is_some_and(|d| d.contains(&m.node_id))
    };
    let mine = held.members.iter().find(|m| m.node_id == me);
    let others = held.members.iter().filter(|m| m.node_id != me);
    if let Some(m) = mine.into_iter().chain(others).find(|m| departed(m)) {
        return Some(Change::MemberLost {
            node: m.node_id.clone(),
        });
    }
    match v.round.as_ref().map(|r| &r.record) {
        Some(r) if r.number > held.number => {
            if r.members.iter().any(|m| m.node_id == me) {
                Some(Change::NewRound { number: r.number })
            } else {
                Some(Change::MemberLost {
                    node: me.to_owned(),
                })
            }
        }
        _ => None,
    }
}

/// A stored hang report as the agent reads it.
pub fn hang_report(h: &v1::HangReport) -> crate::HangReport {
    crate::HangReport {
        node_id: h.node_id.clone(),
        declared: h.declared,
        reason: h.reason.clone(),
        ranks: h
            .ranks
            .iter()
            .map(|r| crate::RankStep {
                rank: r.rank,
                last_step: r.last_step,
                phase: Some(r.phase.clone()).filter(|p| !p.is_empty()),
            })
            .collect(),
    }
}

impl Rendezvous for EtcdRendezvous {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    fn node_id(&self) -> Option<&str> {
        Some(&self.cfg.node_id)
    }

    fn coordinator(&self) -> Option<String> {
        self.view.borrow().coordinator.clone()
    }

    fn counters(&self) -> Option<Counters> {
        Some(self.counters.clone())
    }

    fn detection(&self, node: &str, round: u64) -> Option<crate::Detection> {
        let v = self.view.borrow();
        let found = v.gone.get(node).filter(|g| g.round == round);
        Some(match found.map(|g| (g.how(), g.detect_ms)) {
            Some((v1::Detection::Left, _)) => crate::Detection::Left,
            Some((v1::Detection::Refused, ms)) => crate::Detection::Refused {
                detect: Duration::from_millis(u64::from(ms)),
            },
            _ => crate::Detection::LeaseExpiry,
        })
    }

    fn run_id(&self) -> &str {
        &self.cfg.run_id
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        // The last round's neighbour stays watched until a new round replaces it: a dead
        // peer often reaches the workers (a failure) before anything else, and the
        // survivors then wait for the next round, where only its eviction makes the dead
        // node's absence known before its lease runs out.
        let since = Instant::now();
        let deadline = tokio::time::Instant::now() + self.cfg.join_timeout;
        let mut wants = match &self.held {
            Some(h) => h.record.number + 1,
            None => self
                .view
                .borrow()
                .round
                .as_ref()
                .map_or(0, |r| r.record.number + 1),
        };
        self.ask(Command::Register { wants_round: wants }).await?;
        let mut published = None;
        loop {
            let next = step(
                &self.view.borrow_and_update(),
                &self.cfg.node_id,
                self.cfg.local_world_size,
                wants,
                published,
                since,
            )?;
            match next {
                Step::Done(done) => {
                    let (record, round) = *done;
                    let safe_until = self.view.borrow().lease_safe_until;
                    if let FenceDecision::Fence { reason, .. } =
                        fence::decide(Instant::now(), safe_until, self.cfg.margin())
                    {
                        // Workers started now would run under a lease etcd may have
                        // expired, beside a group that re-forms without this node.
                        tracing::warn!(round = record.number, %reason, "not starting the round: the lease may be gone; joining the next");
                        self.tell(Command::Abandon);
                        wants = record.number + 1;
                        self.ask(Command::Register { wants_round: wants }).await?;
                        continue;
                    }
                    self.tell(Command::Running {
                        round: record.clone(),
                    });
                    self.watch_neighbour(&record);
                    self.held = Some(Held {
                        record,
                        round: round.clone(),
                        since,
                    });
                    return Ok(round);
                }
                Step::PublishMaster { round } => {
                    let port = port::free_port(&self.cfg.addr)?;
                    self.ask(Command::PublishMaster { round, port }).await?;
                    published = Some(round);
                    continue;
                }
                Step::Broken { next, change } => {
                    tracing::info!(
                        round = next - 1,
                        ?change,
                        "the round broke before it started; waiting for the next"
                    );
                    wants = next;
                    self.ask(Command::Register { wants_round: wants }).await?;
                    continue;
                }
                Step::Spare { next } => {
                    let members = self
                        .view
                        .borrow()
                        .round
                        .as_ref()
                        .map_or(0, |r| r.record.members.len());
                    if members >= self.cfg.max_nodes as usize {
                        tracing::info!(round = next - 1, "the group is full; waiting as a spare");
                    } else {
                        // Sealed before this node registered: the coordinator grows the
                        // group with it next.
                        tracing::info!(
                            round = next - 1,
                            members,
                            max = self.cfg.max_nodes,
                            "the round was sealed without this node; joining the next"
                        );
                    }
                    wants = next;
                    self.ask(Command::Register { wants_round: wants }).await?;
                    continue;
                }
                Step::Wait => {}
            }
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = tokio::time::sleep_until(deadline) => {
                    let v = self.view.borrow();
                    let state = format!(
                        "round {:?}, coordinator {:?}, connected {}",
                        v.round.as_ref().map(|r| r.record.number),
                        v.coordinator,
                        v.connected
                    );
                    return Err(RendezvousError::Timeout { timeout: self.cfg.join_timeout, state });
                }
            }
        }
    }

    async fn changed(&mut self) -> Result<Change, RendezvousError> {
        // Watching the neighbour goes on into the re-form (see `next_round`).
        self.next_change().await
    }

    async fn report_fault(&mut self, exit: String) -> Result<(), RendezvousError> {
        let Some(held) = &self.held else {
            return Ok(());
        };
        let record = v1::Fault {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: held.record.number,
            node_id: self.cfg.node_id.clone(),
            exit,
        };
        self.ask(Command::ReportFault { record }).await
    }

    fn first_fault(&self, round: u64) -> Option<String> {
        self.view.borrow().first_fault(round)
    }

    async fn quarantine(
        &mut self,
        machine: String,
        reason: String,
        until_ms: u64,
    ) -> Result<(), RendezvousError> {
        let record = v1::Quarantine {
            schema: fsdp_proto::SCHEMA_VERSION,
            machine,
            node_id: self.cfg.node_id.clone(),
            reason,
            until_ms,
        };
        self.ask(Command::Quarantine { record }).await
    }

    fn quarantined(&self, machine: &str) -> Option<(String, u64)> {
        let v = self.view.borrow();
        let q = v.quarantine.get(machine)?;
        (q.until_ms > crate::unix_ms()).then(|| (q.reason.clone(), q.until_ms))
    }

    async fn unhealthy(&mut self, reason: String, failures: u32) -> Result<(), RendezvousError> {
        let record = v1::Unhealthy {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            reason,
            failures,
            at_ms: crate::unix_ms(),
        };
        self.ask(Command::Withdraw { record }).await
    }

    async fn halt(&mut self, exit_code: u8, reason: String) -> Result<(), RendezvousError> {
        let halt = v1::Halt {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            exit_code: u32::from(exit_code),
            reason,
            round: self.held.as_ref().map_or(0, |h| h.record.number),
        };
        self.ask(Command::Halt { halt }).await
    }

    async fn report_hang(
        &mut self,
        round: u64,
        report: crate::HangReport,
    ) -> Result<(), RendezvousError> {
        let record = v1::HangReport {
            schema: fsdp_proto::SCHEMA_VERSION,
            round,
            node_id: self.cfg.node_id.clone(),
            declared: report.declared,
            reason: report.reason,
            ranks: report
                .ranks
                .into_iter()
                .map(|r| v1::RankStep {
                    rank: r.rank,
                    last_step: r.last_step,
                    phase: r.phase.unwrap_or_default(),
                })
                .collect(),
        };
        self.ask(Command::ReportHang { report: record }).await
    }

    async fn hang_reports(
        &mut self,
        round: u64,
        want: &[String],
        patience: Duration,
    ) -> Vec<crate::HangReport> {
        let all_in = |v: &View| {
            let have = v.hangs.get(&round);
            want.iter().all(|n| have.is_some_and(|h| h.contains_key(n)))
        };
        let _ = tokio::time::timeout(patience, self.view.wait_for(all_in)).await;
        let v = self.view.borrow();
        v.hangs
            .get(&round)
            .map(|h| h.values().map(hang_report).collect())
            .unwrap_or_default()
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        let Some(held) = &self.held else {
            return Ok(0);
        };
        let round = held.record.number;
        let restarts = held.round.restart_count;
        self.ask(Command::ReportFailure { round }).await?;
        Ok(restarts + 1)
    }

    async fn finish(&mut self, timeout: Duration) -> Result<Finish, RendezvousError> {
        let Some(held) = self.held.clone() else {
            return Ok(Finish::AllDone);
        };
        let round = held.record.number;
        self.ask(Command::ReportDone { round }).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let unfinished: Vec<String> = {
                let v = self.view.borrow_and_update();
                if let Some(c) = v.corruption() {
                    return Err(RendezvousError::Corrupt(c));
                }
                let unfinished = v.unfinished(&held.record);
                if unfinished.is_empty() {
                    return Ok(Finish::AllDone);
                }
                if let Some(change) = detect(&v, &held.record, &self.cfg.node_id, held.since) {
                    return Ok(Finish::Changed(change));
                }
                unfinished
            };
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = tokio::time::sleep_until(deadline) => return Ok(Finish::TimedOut { unfinished }),
            }
        }
    }

    async fn depart(&mut self, how: Departure) -> Result<(), RendezvousError> {
        self.watcher = None;
        // The session revokes the lease and ends; leaving never fails the agent.
        if let Err(e) = self.ask(Command::Depart { how }).await {
            tracing::warn!(error = %e, ?how, "could not revoke the lease; peers will notice after its TTL");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_proto::SCHEMA_VERSION;
    use view::RoundEntry;

    fn member(id: &str) -> v1::Member {
        v1::Member {
            schema: SCHEMA_VERSION,
            node_id: id.into(),
            addr: "a".into(),
            local_world_size: 2,
            wants_round: 3,
            ..Default::default()
        }
    }

    fn view_with_round(members: &[&str]) -> View {
        let record = v1::Round {
            schema: SCHEMA_VERSION,
            number: 3,
            members: members.iter().map(|m| member(m)).collect(),
            restart_count: 0,
            reason: String::new(),
            ..Default::default()
        };
        View {
            round: Some(RoundEntry { record, mod_rev: 7 }),
            ..View::default()
        }
    }

    #[test]
    fn a_round_whose_rank_0_died_before_publishing_the_master_is_skipped() {
        let since = Instant::now();
        let mut v = view_with_round(&["ghost", "me"]);
        assert!(matches!(step(&v, "me", 2, 3, None, since), Ok(Step::Wait)));
        v.depart("ghost", 0, Instant::now());
        match step(&v, "me", 2, 3, None, since) {
            Ok(Step::Broken {
                next: 4,
                change: Change::MemberLost { node },
            }) => assert_eq!(node, "ghost"),
            other => panic!("expected a broken round, got {:?}", other.map(|_| ())),
        }
    }

    /// The livelock outside testing found (issue 26): an agent frozen past its lease saw its
    /// own old registration deleted while it waited for the next round, and read that
    /// departure as a loss in every round sealed after it, with its new registration:
    /// "the round broke before it started" ~600 times a second.
    #[test]
    fn a_departure_of_an_earlier_incarnation_breaks_no_later_round() {
        let since = Instant::now();
        let mut v = view_with_round(&["me", "peer"]);
        for m in &mut v.round.as_mut().unwrap().record.members {
            m.incarnation = 2;
        }
        // Both nodes' first registrations went after this agent started waiting (its own
        // expired lease, a peer's restart), and both registered again.
        v.depart("me", 1, Instant::now());
        v.depart("peer", 1, Instant::now());
        assert!(matches!(
            step(&v, "me", 2, 3, None, since),
            Ok(Step::PublishMaster { round: 3 })
        ));
        let held = v.round.clone().unwrap().record;
        assert_eq!(detect(&v, &held, "me", since), None);
        // The incarnation the round names going (or a later one) is a loss, as before.
        v.depart("peer", 2, Instant::now());
        assert_eq!(
            detect(&v, &held, "me", since),
            Some(Change::MemberLost {
                node: "peer".into()
            })
        );
        v.depart("me", 3, Instant::now());
        assert_eq!(
            detect(&v, &held, "me", since),
            Some(Change::MemberLost { node: "me".into() })
        );
        // A departure whose incarnation nobody knew (a record of an older agent) counts.
        let mut v = view_with_round(&["me", "peer"]);
        v.depart("peer", u64::MAX, Instant::now());
        assert!(matches!(
            step(&v, "me", 2, 3, None, since),
            Ok(Step::Broken { next: 4, .. })
        ));
    }

    #[test]
    fn rank_0_publishes_the_master_and_ranks_follow_worker_counts() {
        let since = Instant::now();
        let mut v = view_with_round(&["me", "other"]);
        assert!(matches!(
            step(&v, "me", 2, 3, None, since),
            Ok(Step::PublishMaster { round: 3 })
        ));
        assert!(matches!(
            step(&v, "me", 2, 3, Some(3), since),
            Ok(Step::Wait)
        ));
        v.master = Some(v1::Master {
            schema: SCHEMA_VERSION,
            round: 3,
            addr: "10.0.0.1".into(),
            port: 29400,
        });
        let Ok(Step::Done(done)) = step(&v, "other", 2, 3, None, since) else {
            panic!("a sealed round with a master")
        };
        let (_, round) = *done;
        assert_eq!(
            (round.group_rank, round.base_rank, round.world_size),
            (1, 2, 4)
        );
        assert_eq!(
            (round.master_addr.as_str(), round.master_port),
            ("10.0.0.1", 29400)
        );
    }

    #[test]
    fn a_finished_member_that_leaves_is_not_a_loss_but_an_unfinished_one_is() {
        let since = Instant::now();
        let mut v = view_with_round(&["a", "b"]);
        let held = v.round.clone().unwrap().record;
        v.depart("b", 0, Instant::now());
        v.done.entry(3).or_default().insert("b".into());
        assert_eq!(detect(&v, &held, "a", since), None);
        v.done.clear();
        assert_eq!(
            detect(&v, &held, "a", since),
            Some(Change::MemberLost { node: "b".into() })
        );
        v.failures.insert(3);
        assert_eq!(
            detect(&v, &held, "a", since),
            Some(Change::PeerFailed { restart_count: 1 })
        );
    }
}
