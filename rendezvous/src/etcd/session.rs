//! The background half of an etcd rendezvous: one task per agent that keeps the lease
//! alive, keeps the [`View`] current through watches, takes part in the coordinator
//! election and, while coordinator, seals rounds.
//!
//! Every failure of etcd (a closed stream, a restart, lost data) ends in the same place: a
//! fresh ranged read, a rebuilt view, and new watches from the read's revision. The
//! etcd-client lease keeper does not reconnect by itself, so the keep-alive is ours too.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchFilterType,
    WatchOptions,
};
use fsdp_proto::{SCHEMA_VERSION, v1};
use prost::Message;
use tokio::sync::watch;
use tokio::time::Instant;

use super::keys::Keys;
use super::view::View;
use crate::seal::{self, Candidate, Current, SealConfig, SealDecision, SealState};

/// State shared between the agent-facing handle and the session task. The locks are std
/// mutexes held for a copy, never across an await.
#[derive(Debug)]
pub struct Shared {
    pub node_id: String,
    pub lease: AtomicI64,
    /// The registration to (re)write whenever the lease is new.
    pub member: Mutex<Option<v1::Member>>,
    /// The round this agent is running, republished if etcd comes back without it.
    pub my_round: Mutex<Option<v1::Round>>,
    /// Writes this agent made to etcd (puts, transactions, lease grants and revokes).
    pub writes: AtomicU64,
    /// etcd errors the session recovered from (lost connections, failed keep-alives).
    pub errors: Arc<AtomicU64>,
    /// Held while the lease is being replaced, so that the session and the agent-facing
    /// handle, finding the lease gone at the same moment, grant one new lease, not two.
    pub renewing: tokio::sync::Mutex<()>,
}

impl Shared {
    /// A copy of the round this agent runs.
    pub fn my_round(&self) -> Option<v1::Round> {
        self.my_round.lock().map(|r| r.clone()).unwrap_or(None)
    }

    /// A copy of this agent's registration.
    pub fn member(&self) -> Option<v1::Member> {
        self.member.lock().map(|m| m.clone()).unwrap_or(None)
    }

    pub fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Replaces the lease `stale`, which etcd no longer has (it expired while this agent
    /// was frozen, or etcd lost it), unless another task already did. Returns the live id.
    pub async fn renew_lease(
        &self,
        client: &mut Client,
        stale: i64,
        ttl: Duration,
    ) -> EtcdResult<i64> {
        let _one_at_a_time = self.renewing.lock().await;
        let current = self.lease.load(Ordering::SeqCst);
        if current != stale {
            return Ok(current);
        }
        let grant = client
            .lease_grant(ttl.as_secs().max(1) as i64, None)
            .await?;
        self.wrote();
        self.lease.store(grant.id(), Ordering::SeqCst);
        tracing::info!(
            old = stale,
            new = grant.id(),
            "the lease was gone; granted a new one"
        );
        Ok(grant.id())
    }
}

/// Whether etcd refused a request because the lease it names does not exist (any more).
pub fn lease_not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

pub struct Session {
    pub client: Client,
    pub keys: Keys,
    pub shared: Arc<Shared>,
    pub view: watch::Sender<View>,
    pub ttl: Duration,
    pub seal: SealConfig,
    synced_once: bool,
    /// The next resync is ours (not an outage): no grace for missing members.
    voluntary_resync: bool,
    absent_check: Option<Instant>,
    quiet_since: Instant,
    member_ids: BTreeSet<String>,
    reform: Option<(u64, Instant)>,
    recheck: Option<Instant>,
    last_reason: String,
}

type EtcdResult<T> = Result<T, etcd_client::Error>;

impl Session {
    pub fn new(
        client: Client,
        keys: Keys,
        shared: Arc<Shared>,
        view: watch::Sender<View>,
        ttl: Duration,
        seal: SealConfig,
    ) -> Self {
        Self {
            client,
            keys,
            shared,
            view,
            ttl,
            seal,
            synced_once: false,
            voluntary_resync: false,
            absent_check: None,
            quiet_since: Instant::now(),
            member_ids: BTreeSet::new(),
            reform: None,
            recheck: None,
            last_reason: String::new(),
        }
    }

    /// Runs until aborted.
    pub async fn run(mut self) {
        let (first, cap) = (Duration::from_millis(100), Duration::from_secs(2));
        let mut delays = crate::backoff::delays(first, cap);
        loop {
            match self.sync_and_watch().await {
                Ok(()) => delays = crate::backoff::delays(first, cap),
                Err(e) => {
                    let delay = delays.next().unwrap_or(cap);
                    self.view.send_modify(|v| v.connected = false);
                    self.shared.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, retry_in = ?delay, "etcd connection lost; reconnecting");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    fn me(&self) -> &str {
        &self.shared.node_id
    }

    fn is_coordinator(&self) -> bool {
        self.view.borrow().coordinator.as_deref() == Some(self.me())
    }

    async fn sync_and_watch(&mut self) -> EtcdResult<()> {
        let resp = self
            .client
            .get(self.keys.root(), Some(GetOptions::new().with_prefix()))
            .await?;
        let rev = resp.header().map_or(0, |h| h.revision());
        let mut fresh = View::default();
        for kv in resp.kvs() {
            fresh.put(
                &self.keys,
                kv.key_str().unwrap_or(""),
                kv.value(),
                kv.create_revision(),
                kv.mod_revision(),
                kv.lease(),
            );
        }
        fresh.connected = true;
        let resync = self.synced_once;
        let voluntary = std::mem::take(&mut self.voluntary_resync);
        let now = Instant::now().into_std();
        let mine: Vec<String> = self
            .shared
            .my_round()
            .iter()
            .flat_map(|r| r.members.iter().map(|m| m.node_id.clone()))
            .collect();
        self.view.send_modify(|v| {
            fresh.departed = std::mem::take(&mut v.departed);
            if voluntary {
                // Nothing was lost in between: a member we knew of that the snapshot lacks
                // left while we were switching watches.
                let known = v.members.keys().cloned().chain(mine);
                for id in known.filter(|id| !fresh.members.contains_key(id)) {
                    fresh.departed.entry(id).or_insert(now);
                }
            }
            *v = fresh;
        });
        self.synced_once = true;
        self.ensure_registered(resync).await?;
        if resync && !voluntary {
            // After an outage, give members a lease TTL to re-register before anyone is
            // declared lost (etcd may have come back empty).
            self.absent_check = Some(Instant::now() + self.ttl + Duration::from_secs(1));
        }
        if resync {
            // On the first sync the agent's registration claims the role if it is free.
            self.campaign().await?;
        }
        let full = self.is_coordinator();
        let mut ctl = self
            .client
            .watch(
                self.keys.ctl(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(rev + 1),
                ),
            )
            .await?;
        let mut member_opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(rev + 1)
            .with_prev_key();
        if !full {
            // Only the coordinator needs registrations; the others learn of new rounds
            // through the round key and of departures through deletes.
            member_opts = member_opts.with_filters([WatchFilterType::NoPut]);
        }
        let mut members = self
            .client
            .watch(self.keys.members(), Some(member_opts))
            .await?;
        let lease = self.shared.lease.load(Ordering::SeqCst);
        let (mut keeper, mut kept) = self.client.lease_keep_alive(lease).await?;
        let mut tick = tokio::time::interval(self.ttl / 3);
        self.coordinate().await?;
        loop {
            let recheck = [self.recheck, self.absent_check]
                .into_iter()
                .flatten()
                .min();
            let sleep = async {
                match recheck {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                msg = ctl.message() => {
                    let Some(resp) = msg? else { return Ok(()) };
                    if resp.canceled() { return Ok(()); }
                    let was = self.is_coordinator();
                    let coordinator_gone = resp.events().iter().any(|e| {
                        e.event_type() == EventType::Delete
                            && e.kv().is_some_and(|kv| kv.key() == self.keys.coordinator().as_bytes())
                    });
                    self.apply(resp.events());
                    if coordinator_gone {
                        self.campaign().await?;
                    }
                    if self.is_coordinator() != was {
                        // Coordinator now: resync to watch registrations too.
                        self.voluntary_resync = true;
                        return Ok(());
                    }
                    self.coordinate().await?;
                }
                msg = members.message() => {
                    let Some(resp) = msg? else { return Ok(()) };
                    if resp.canceled() { return Ok(()); }
                    self.apply(resp.events());
                    self.coordinate().await?;
                }
                _ = tick.tick() => {
                    if self.shared.lease.load(Ordering::SeqCst) != lease {
                        // The agent-facing handle replaced the lease: keep the new one alive.
                        return Ok(());
                    }
                    keeper.keep_alive().await?
                }
                msg = kept.message() => {
                    match msg? {
                        Some(r) if r.ttl() > 0 => {}
                        _ => {
                            tracing::warn!(lease, "lease expired or revoked; registering again");
                            self.new_lease().await?;
                            return Ok(());
                        }
                    }
                }
                () = sleep => {
                    let now = Instant::now();
                    if self.absent_check.is_some_and(|at| at <= now) {
                        self.absent_check = None;
                        self.check_absent().await?;
                    }
                    if self.recheck.is_some_and(|at| at <= now) {
                        self.recheck = None;
                        self.coordinate().await?;
                    }
                }
            }
        }
    }

    fn apply(&mut self, events: &[etcd_client::Event]) {
        let now = Instant::now().into_std();
        let keys = self.keys.clone();
        self.view.send_modify(|v| {
            for ev in events {
                let Some(kv) = ev.kv() else { continue };
                let key = kv.key_str().unwrap_or("");
                match ev.event_type() {
                    EventType::Put => v.put(
                        &keys,
                        key,
                        kv.value(),
                        kv.create_revision(),
                        kv.mod_revision(),
                        kv.lease(),
                    ),
                    EventType::Delete => v.delete(&keys, key, now),
                }
            }
        });
    }

    async fn new_lease(&mut self) -> EtcdResult<()> {
        let stale = self.shared.lease.load(Ordering::SeqCst);
        self.shared
            .renew_lease(&mut self.client, stale, self.ttl)
            .await?;
        self.register().await
    }

    /// Writes this agent's registration with the current lease, if it has one to write.
    async fn register(&mut self) -> EtcdResult<()> {
        let member = self.shared.member();
        if let Some(m) = member {
            let lease = self.shared.lease.load(Ordering::SeqCst);
            self.client
                .put(
                    self.keys.member(&m.node_id),
                    m.encode_to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await?;
            self.shared.wrote();
        }
        Ok(())
    }

    /// After a (re)sync: make sure our lease lives and our registration is there; put back
    /// our round if etcd lost it.
    async fn ensure_registered(&mut self, resync: bool) -> EtcdResult<()> {
        let lease = self.shared.lease.load(Ordering::SeqCst);
        let alive = self
            .client
            .lease_time_to_live(lease, None)
            .await
            .map(|r| r.ttl() > 0)
            .unwrap_or(false);
        let (present, round_missing, evicted) = {
            let v = self.view.borrow();
            let present = v.members.contains_key(self.me());
            let mine = self.shared.my_round();
            let round_missing = mine.is_some() && v.round.is_none();
            // Our key is gone while our round is still there: the others saw us leave.
            let evicted = !present
                && mine.is_some_and(|r| {
                    v.round
                        .as_ref()
                        .is_some_and(|cur| cur.record.number >= r.number)
                });
            (present, round_missing, evicted)
        };
        if evicted {
            let now = Instant::now().into_std();
            let me = self.me().to_owned();
            self.view.send_modify(|v| {
                v.departed.insert(me, now);
            });
        }
        if !alive {
            return self
                .new_lease()
                .await
                .and(self.republish(round_missing).await);
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
        if !round_missing {
            return Ok(());
        }
        let mine = self.shared.my_round();
        if let Some(r) = mine {
            let key = self.keys.round();
            let txn = Txn::new()
                .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, r.encode_to_vec(), None)]);
            let ok = self.client.txn(txn).await?.succeeded();
            self.shared.wrote();
            if ok {
                tracing::info!(
                    round = r.number,
                    "etcd lost the round record; republished the running round"
                );
            }
        }
        Ok(())
    }

    /// Members of our round that did not come back within the grace after an outage are
    /// gone: record them as departed so the agent re-forms.
    async fn check_absent(&mut self) -> EtcdResult<()> {
        let Some(mine) = self.shared.my_round() else {
            return Ok(());
        };
        let resp = self
            .client
            .get(
                self.keys.members(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await?;
        let present: BTreeSet<String> = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                kv.key_str()
                    .ok()
                    .and_then(|k| k.strip_prefix(&self.keys.members()))
                    .map(str::to_owned)
            })
            .collect();
        let now = Instant::now().into_std();
        self.view.send_modify(|v| {
            for m in &mine.members {
                if !present.contains(&m.node_id) {
                    v.departed.insert(m.node_id.clone(), now);
                }
            }
        });
        Ok(())
    }

    /// Tries to become coordinator if nobody is.
    async fn campaign(&mut self) -> EtcdResult<()> {
        if self.view.borrow().coordinator.is_some() || self.shared.member().is_none() {
            return Ok(());
        }
        let key = self.keys.coordinator();
        let claim = v1::Coordinator {
            schema: SCHEMA_VERSION,
            node_id: self.me().to_owned(),
        };
        let lease = self.shared.lease.load(Ordering::SeqCst);
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                claim.encode_to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if self.client.txn(txn).await?.succeeded() {
            tracing::info!(node = self.me(), "elected rendezvous coordinator");
            let me = self.me().to_owned();
            self.view.send_modify(|v| v.coordinator = Some(me));
        }
        self.shared.wrote();
        Ok(())
    }

    /// As coordinator: decide whether to seal a round, and commit it if so.
    async fn coordinate(&mut self) -> EtcdResult<()> {
        if !self.is_coordinator() {
            self.recheck = None;
            return Ok(());
        }
        let now = Instant::now();
        let (decision, reason, fence, records) = {
            let v = self.view.borrow();
            let ids: BTreeSet<String> = v.members.keys().cloned().collect();
            if ids != self.member_ids {
                self.member_ids = ids;
                self.quiet_since = now;
            }
            let current = v.round.as_ref().map(|r| Current {
                number: r.record.number,
                members: r.record.members.iter().map(|m| m.node_id.clone()).collect(),
                restart_count: r.record.restart_count,
                failed: v.failures.contains(&r.record.number),
            });
            let candidates: Vec<Candidate> = v
                .members
                .values()
                .map(|m| Candidate {
                    node_id: m.record.node_id.clone(),
                    joined_rev: m.create_rev,
                    ready: current
                        .as_ref()
                        .is_none_or(|c| m.record.wants_round > c.number),
                })
                .collect();
            if let Some(c) = &current {
                if self.reform.is_none_or(|(n, _)| n != c.number) {
                    self.reform = None;
                }
            }
            let state = SealState {
                current: current.as_ref(),
                candidates: &candidates,
                quiet_since: self.quiet_since.into_std(),
                reform_since: self.reform.map(|(_, t)| t.into_std()),
            };
            let (d, reason) = seal::decide(now.into_std(), &state, &self.seal);
            if matches!(d, SealDecision::Reforming { .. } | SealDecision::Seal(_))
                && self.reform.is_none()
            {
                if let Some(c) = &current {
                    self.reform = Some((c.number, now));
                }
            }
            let fence = v.round.as_ref().map(|r| r.mod_rev);
            (d, reason, fence, v.members.clone())
        };
        if reason != self.last_reason {
            tracing::info!(%reason, "coordinator");
            self.last_reason = reason.clone();
        }
        match decision {
            SealDecision::Wait { recheck_at } | SealDecision::Reforming { recheck_at } => {
                self.recheck = recheck_at.map(Instant::from_std);
            }
            SealDecision::Seal(p) => {
                let record = v1::Round {
                    schema: SCHEMA_VERSION,
                    number: p.number,
                    members: p
                        .members
                        .iter()
                        .filter_map(|id| records.get(id).map(|m| m.record.clone()))
                        .collect(),
                    restart_count: p.restart_count,
                    reason: reason.clone(),
                };
                if commit_round(&mut self.client, &self.keys, fence, &record).await? {
                    tracing::info!(round = p.number, members = p.members.len(), restart_count = p.restart_count, %reason, "round sealed");
                }
                self.shared.wrote();
            }
        }
        Ok(())
    }
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
