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
//! Per round each agent writes its registration once; the coordinator and rank 0 write one
//! key each: O(N) writes, no key that every node compare-and-swaps in a loop.
//!
//! # How a round ends
//!
//! A member's key disappears (its lease expired, or it left and revoked it), a failure is
//! reported under `ctl/failures/`, or the coordinator seals a newer round (to admit a
//! waiting node). Each agent sees this in its watch ([`detect`]) and stops its workers.

mod connect;
pub mod inspect;
mod keys;
mod session;
mod view;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use fsdp_proto::{SCHEMA_VERSION, v1};
use prost::Message;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use connect::{EtcdOptions, TlsFiles, connect, transient as is_transient};
pub use keys::Keys;
pub use session::commit_round;
pub use view::View;

use crate::seal::SealConfig;
use crate::{
    Change, Departure, Finish, Rendezvous, RendezvousError, Round, RoundMember, port, ranks,
};
use session::{Session, Shared};

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
        }
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

/// An agent's handle on the etcd rendezvous.
pub struct EtcdRendezvous {
    cfg: EtcdConfig,
    client: Client,
    keys: Keys,
    shared: Arc<Shared>,
    view: watch::Receiver<View>,
    session: JoinHandle<()>,
    held: Option<Held>,
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
        let grant =
            client
                .lease_grant(ttl_s, None)
                .await
                .map_err(|source| RendezvousError::Etcd {
                    what: "granting the membership lease",
                    source,
                })?;
        let shared = Arc::new(Shared {
            node_id: cfg.node_id.clone(),
            lease: AtomicI64::new(grant.id()),
            member: Mutex::new(None),
            my_round: Mutex::new(None),
            writes: AtomicU64::new(1),
            errors: Arc::new(AtomicU64::new(0)),
            renewing: tokio::sync::Mutex::new(()),
        });
        let (tx, mut view) = watch::channel(View::default());
        let seal = SealConfig {
            min_nodes: cfg.min_nodes,
            max_nodes: cfg.max_nodes,
            last_call: cfg.last_call,
            straggler_timeout: cfg.straggler_timeout,
        };
        let session = Session::new(
            client.clone(),
            keys.clone(),
            shared.clone(),
            tx,
            Duration::from_secs(ttl_s as u64),
            seal,
        );
        let session = tokio::spawn(session.run());
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
            client,
            keys,
            shared,
            view,
            session,
            held: None,
        })
    }

    /// This agent's node id.
    pub fn node_id(&self) -> &str {
        &self.shared.node_id
    }

    /// etcd writes this agent made so far.
    pub fn writes(&self) -> u64 {
        self.shared.writes.load(Ordering::Relaxed)
    }

    /// The key layout of the run.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The agent's current view of the run (a copy).
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    async fn put_member(&mut self, wants_round: u64) -> Result<(), RendezvousError> {
        let member = v1::Member {
            schema: SCHEMA_VERSION,
            node_id: self.shared.node_id.clone(),
            addr: self.cfg.addr.clone(),
            local_world_size: self.cfg.local_world_size,
            wants_round,
        };
        if let Ok(mut m) = self.shared.member.lock() {
            *m = Some(member.clone());
        }
        // Registering and claiming the coordinator role when nobody holds it is one
        // transaction: one write per node, however many nodes start at once.
        let claiming = self.view.borrow().coordinator.is_none();
        let won = self
            .with_live_lease("registering this node", |mut client, lease| {
                let txn = registration(&self.keys, &member, lease, claiming);
                async move { client.txn(txn).await.map(|r| r.succeeded()) }
            })
            .await?;
        self.shared.wrote();
        // Whether the claim won is known only here: by now the watch may already have shown
        // this node its own claim, so the view cannot tell.
        if claiming && won {
            tracing::info!(node = %member.node_id, "elected rendezvous coordinator");
        }
        Ok(())
    }

    /// Runs `request` with the current lease; when etcd no longer has that lease (this
    /// agent was frozen past its TTL, or etcd lost it) a new one is granted and the request
    /// runs again with it, so the agent rejoins as a new node instead of exiting.
    async fn with_live_lease<T, F, Fut>(
        &self,
        what: &'static str,
        mut request: F,
    ) -> Result<T, RendezvousError>
    where
        F: FnMut(Client, i64) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut lease = self.shared.lease.load(Ordering::SeqCst);
        // A second refusal right after a fresh grant is not a stale lease: report it.
        for attempt in 0..2 {
            match request(self.client.clone(), lease).await {
                Err(e) if attempt == 0 && session::lease_not_found(&e) => {
                    let ttl = Duration::from_secs(self.cfg.keep_alive_ttl.as_secs().max(1));
                    lease = self
                        .shared
                        .renew_lease(&mut self.client.clone(), lease, ttl)
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

    async fn publish_master(&mut self, round: u64) -> Result<(), RendezvousError> {
        let port = port::free_port(&self.cfg.addr)?;
        let master = v1::Master {
            schema: SCHEMA_VERSION,
            round,
            addr: self.cfg.addr.clone(),
            port: u32::from(port),
        };
        let key = self.keys.master();
        self.with_live_lease("publishing the master address", |mut client, lease| {
            let (key, value) = (key.clone(), master.encode_to_vec());
            async move {
                client
                    .put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
                    .map(drop)
            }
        })
        .await?;
        self.shared.wrote();
        Ok(())
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

/// The registration transaction: this node's member record under `lease`, and, when
/// `claiming`, the coordinator key if nobody holds it.
fn registration(keys: &Keys, member: &v1::Member, lease: i64, claiming: bool) -> Txn {
    let put_member = TxnOp::put(
        keys.member(&member.node_id),
        member.encode_to_vec(),
        Some(PutOptions::new().with_lease(lease)),
    );
    if !claiming {
        return Txn::new().and_then([put_member]);
    }
    let key = keys.coordinator();
    let claim = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: member.node_id.clone(),
    };
    Txn::new()
        .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
        .and_then([
            put_member.clone(),
            TxnOp::put(
                key,
                claim.encode_to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            ),
        ])
        .or_else([put_member])
}

/// What `next_round` should do after looking at the view.
enum Step {
    Wait,
    Spare { next: u64 },
    Broken { next: u64, change: Change },
    PublishMaster { round: u64 },
    Done(Box<(v1::Round, Round)>),
}

fn step(
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
    let Some(r) = v.round.as_ref().filter(|r| r.record.number >= wants) else {
        return Ok(Step::Wait);
    };
    let rec = &r.record;
    let Some(pos) = rec.members.iter().position(|m| m.node_id == me) else {
        return Ok(Step::Spare {
            next: rec.number + 1,
        });
    };
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
    // A round that gives this node another worker count than it runs would hand its
    // workers a wrong WORLD_SIZE and overlapping ranks: the record is not ours.
    let given = rec.members[pos].local_world_size;
    if given != my_workers {
        return Err(RendezvousError::Corrupt(format!(
            "round {} gives this node local_world_size {given}, but it runs {my_workers} workers",
            rec.number
        )));
    }
    let sizes: Vec<u32> = rec.members.iter().map(|m| m.local_world_size).collect();
    let (all, world_size) = ranks::assign(&sizes)
        .map_err(|e| RendezvousError::Corrupt(format!("round {}: {e}", rec.number)))?;
    let round = Round {
        number: rec.number,
        group_rank: all[pos].group_rank,
        group_world_size: rec.members.len() as u32,
        base_rank: all[pos].base_rank,
        world_size,
        master_addr: master.addr.clone(),
        // The view admits only ports 1-65535.
        master_port: u16::try_from(master.port).unwrap_or_default(),
        restart_count: rec.restart_count,
        members: rec
            .members
            .iter()
            .zip(&all)
            .map(|(m, r)| RoundMember {
                node_id: m.node_id.clone(),
                addr: m.addr.clone(),
                group_rank: r.group_rank,
                base_rank: r.base_rank,
                local_world_size: m.local_world_size,
            })
            .collect(),
        reason: rec.reason.clone(),
    };
    Ok(Step::Done(Box::new((rec.clone(), round))))
}

/// Whether the round an agent holds is still the group's round: a pure function of the
/// view, so tests can drive it without etcd.
pub fn detect(v: &View, held: &v1::Round, me: &str, since: Instant) -> Option<Change> {
    // A failure is looked at first: a node that gives up reports its failure and then
    // revokes its lease, and the others must see the failure, not just a departure.
    if v.failures.contains(&held.number) {
        return Some(Change::PeerFailed {
            restart_count: held.restart_count + 1,
        });
    }
    let done = v.done.get(&held.number);
    // A member that finished and left is not lost: it is waiting to exit or has exited 0.
    let departed = |id: &str| {
        v.departed.get(id).is_some_and(|t| *t >= since) && !done.is_some_and(|d| d.contains(id))
    };
    if departed(me) {
        return Some(Change::MemberLost {
            node: me.to_owned(),
        });
    }
    if let Some(m) = held.members.iter().find(|m| departed(&m.node_id)) {
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

impl Rendezvous for EtcdRendezvous {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    fn node_id(&self) -> Option<&str> {
        Some(&self.shared.node_id)
    }

    fn coordinator(&self) -> Option<String> {
        self.view.borrow().coordinator.clone()
    }

    fn error_counter(&self) -> Option<Arc<AtomicU64>> {
        Some(self.shared.errors.clone())
    }

    fn run_id(&self) -> &str {
        &self.cfg.run_id
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
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
        self.put_member(wants).await?;
        let mut published = None;
        loop {
            let next = step(
                &self.view.borrow_and_update(),
                &self.shared.node_id,
                self.cfg.local_world_size,
                wants,
                published,
                since,
            )?;
            match next {
                Step::Done(done) => {
                    let (record, round) = *done;
                    if let Ok(mut m) = self.shared.my_round.lock() {
                        *m = Some(record.clone());
                    }
                    self.held = Some(Held {
                        record,
                        round: round.clone(),
                        since,
                    });
                    return Ok(round);
                }
                Step::PublishMaster { round } => {
                    self.publish_master(round).await?;
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
                    self.put_member(wants).await?;
                    continue;
                }
                Step::Spare { next } => {
                    tracing::info!(round = next - 1, "the group is full; waiting as a spare");
                    wants = next;
                    self.put_member(wants).await?;
                    continue;
                }
                Step::Wait => {}
            }
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| RendezvousError::SessionEnded("its task stopped"))?,
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
        let Some(held) = self.held.clone() else {
            return std::future::pending().await;
        };
        loop {
            {
                let v = self.view.borrow_and_update();
                if let Some(c) = v.corruption() {
                    return Err(RendezvousError::Corrupt(c));
                }
                if let Some(change) = detect(&v, &held.record, &self.shared.node_id, held.since) {
                    return Ok(change);
                }
            }
            self.view
                .changed()
                .await
                .map_err(|_| RendezvousError::SessionEnded("its task stopped"))?;
        }
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        let Some(held) = &self.held else {
            return Ok(0);
        };
        let key = self.keys.failure(held.record.number);
        let failure = v1::Failure {
            schema: SCHEMA_VERSION,
            round: held.record.number,
            node_id: self.shared.node_id.clone(),
        };
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, failure.encode_to_vec(), None)]);
        self.client
            .txn(txn)
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "reporting a worker failure",
                source,
            })?;
        self.shared.wrote();
        Ok(held.round.restart_count + 1)
    }

    async fn finish(&mut self, timeout: Duration) -> Result<Finish, RendezvousError> {
        let Some(held) = self.held.clone() else {
            return Ok(Finish::AllDone);
        };
        let done = v1::Done {
            schema: SCHEMA_VERSION,
            round: held.record.number,
            node_id: self.shared.node_id.clone(),
        };
        self.client
            .put(
                self.keys.done(held.record.number, &done.node_id),
                done.encode_to_vec(),
                None,
            )
            .await
            .map_err(|source| RendezvousError::Etcd {
                what: "reporting this node finished",
                source,
            })?;
        self.shared.wrote();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let unfinished: Vec<String> = {
                let v = self.view.borrow_and_update();
                if let Some(c) = v.corruption() {
                    return Err(RendezvousError::Corrupt(c));
                }
                let finished = v.done.get(&held.record.number);
                let unfinished: Vec<String> = held
                    .record
                    .members
                    .iter()
                    .filter(|m| !finished.is_some_and(|d| d.contains(&m.node_id)))
                    .map(|m| m.node_id.clone())
                    .collect();
                if unfinished.is_empty() {
                    return Ok(Finish::AllDone);
                }
                if let Some(change) = detect(&v, &held.record, &self.shared.node_id, held.since) {
                    return Ok(Finish::Changed(change));
                }
                unfinished
            };
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| RendezvousError::SessionEnded("its task stopped"))?,
                () = tokio::time::sleep_until(deadline) => return Ok(Finish::TimedOut { unfinished }),
            }
        }
    }

    async fn depart(&mut self, how: Departure) -> Result<(), RendezvousError> {
        self.session.abort();
        let lease = self.shared.lease.load(Ordering::SeqCst);
        // Revoking deletes our registration (and the coordinator key if we held it), so
        // the others learn within milliseconds instead of a lease TTL.
        match self.client.lease_revoke(lease).await {
            Ok(_) => self.shared.wrote(),
            Err(e) => {
                tracing::warn!(error = %e, ?how, "could not revoke the lease; peers will notice after its TTL")
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use view::RoundEntry;

    fn member(id: &str) -> v1::Member {
        v1::Member {
            schema: SCHEMA_VERSION,
            node_id: id.into(),
            addr: "a".into(),
            local_world_size: 2,
            wants_round: 3,
        }
    }

    fn view_with_round(members: &[&str]) -> View {
        let record = v1::Round {
            schema: SCHEMA_VERSION,
            number: 3,
            members: members.iter().map(|m| member(m)).collect(),
            restart_count: 0,
            reason: String::new(),
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
        v.departed.insert("ghost".into(), Instant::now());
        match step(&v, "me", 2, 3, None, since) {
            Ok(Step::Broken {
                next: 4,
                change: Change::MemberLost { node },
            }) => assert_eq!(node, "ghost"),
            other => panic!("expected a broken round, got {:?}", other.map(|_| ())),
        }
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
        v.departed.insert("b".into(), Instant::now());
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
