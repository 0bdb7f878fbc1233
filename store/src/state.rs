//! The embedded store's state: keys under etcd's revision rules, leases that delete their
//! keys when they lapse, and the history that watches replay. Pure: the time is an
//! argument, nothing here does I/O or waits, so every rule is tested on its own.
//!
//! The rules are etcd's, as far as the rendezvous can tell: one revision per write request
//! (a transaction's writes share one), a delete of nothing writes nothing, a key's
//! `version` counts its puts since it was created, a comparison on a missing key sees
//! zeros (and never equals a value), and revoking a lease deletes its keys in one
//! revision.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use fsdp_proto::etcdserverpb as pb;
use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;
use pb::response_op::Response;

/// Revisions whose events are kept for watches that start in the past; older ones are
/// compacted, as etcd compacts. The rendezvous replays at most the few revisions between a
/// read and its watch, so this bounds memory without ever being reached in practice.
const HISTORY_REVISIONS: usize = 100_000;

/// A request the store refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// etcd's own words, which etcd clients (ours too) recognise.
    #[error("etcdserver: requested lease not found")]
    LeaseNotFound,
    #[error("etcdserver: lease already exists")]
    LeaseExists,
    #[error("etcdserver: key not found")]
    KeyNotFound,
    #[error("etcdserver: mvcc: required revision has been compacted")]
    Compacted,
    #[error("etcdserver: mvcc: required revision is a future revision")]
    FutureRevision,
    /// etcd's words for a TTL above its own bound ([`MAX_TTL`]).
    #[error("etcdserver: too large lease TTL")]
    TtlTooLarge,
    /// A lease id below 0: no client asks for one.
    #[error("etcdserver: lease ID must be positive")]
    BadLeaseId,
    /// [`MAX_LEASES`] are held: a job has one lease per agent.
    #[error("etcdserver: too many requests")]
    TooManyLeases,
}

/// The longest lease TTL granted, in seconds: etcd's own bound (about 285 years; an
/// `i64::MAX` TTL made the deadline's arithmetic panic).
pub const MAX_TTL: i64 = 9_000_000_000;

/// The most leases the store holds at once: one per agent of a job, with room to spare.
/// Without a bound, 500,000 granted leases cost 61 MB and a 100 ms expiry scan of all of
/// them under the state's lock.
pub const MAX_LEASES: usize = 100_000;

/// Where a watch stands: its next events, or the revision its start was compacted to.
#[derive(Debug, PartialEq)]
pub enum Replay {
    Events(Vec<pb::Event>),
    Compacted(i64),
}

/// What a watch asks for.
#[derive(Debug, Clone, Default)]
pub struct WatchSpec {
    pub key: Vec<u8>,
    pub range_end: Vec<u8>,
    pub no_put: bool,
    pub no_delete: bool,
    pub prev_kv: bool,
}

struct Lease {
    ttl: i64,
    deadline: Instant,
    keys: BTreeSet<Vec<u8>>,
}

/// The keys, leases and history.
pub struct State {
    revision: i64,
    kvs: BTreeMap<Vec<u8>, pb::KeyValue>,
    leases: HashMap<i64, Lease>,
    /// The events of each revision still kept, oldest first.
    history: VecDeque<(i64, Vec<pb::Event>)>,
    /// The newest revision whose events are gone.
    compacted: i64,
    /// The id the next lease granted without one gets; only grows. Unused when ids are
    /// random ([`State::serving`]).
    next_lease: i64,
    /// Lease ids drawn at random: ids an outsider cannot derive from the store's start
    /// time (they were found in 7 to 12 probes, and a dead agent's lease kept alive).
    random_ids: Option<ring::rand::SystemRandom>,
}

impl Default for State {
    fn default() -> Self {
        Self::new()
    }
}

/// The first lease id of a store started at `unix_ms` (Unix milliseconds): the time
/// shifted left 20 bits, so that a store restarted a millisecond later starts a million ids
/// above this one's first, and an id stays positive until the year 6429. etcd's own ids
/// are just as unique across restarts (its member id and the time).
pub fn first_lease_id(unix_ms: u64) -> i64 {
    i64::try_from(unix_ms.min((1 << 42) - 1) << 20).unwrap_or(i64::MAX)
}

/// Whether `key` lies in `[from, end)` as etcd reads a range: no end is the key alone, an
/// end of `\0` is every key from `from` on.
fn in_range(key: &[u8], from: &[u8], end: &[u8]) -> bool {
    match end {
        [] => key == from,
        [0] => key >= from,
        _ => key >= from && key < end,
    }
}

/// One write request being applied: every write in it gets `revision`.
struct Batch {
    revision: i64,
    events: Vec<pb::Event>,
}

impl State {
    /// A store whose lease ids start at 1 (tests and the simulation, where ids must repeat
    /// from run to run).
    pub fn new() -> Self {
        Self::with_first_lease(1)
    }

    /// A store whose first lease id is `first`. A store that serves agents starts at
    /// [`first_lease_id`] of the clock, so that one restarted in place never hands out
    /// the ids of the leases it had before: an agent holding an old id (a ring watcher
    /// about to revoke a dead peer's lease) would otherwise name a live one.
    pub fn with_first_lease(first: i64) -> Self {
        Self {
            revision: 1,
            kvs: BTreeMap::new(),
            leases: HashMap::new(),
            history: VecDeque::new(),
            compacted: 0,
            next_lease: first.max(1),
            random_ids: None,
        }
    }

    /// The store an agent serves: lease ids drawn at random from the 63-bit positive
    /// range (never reused across a restart in place but with odds of one in 2^63 per
    /// lease, and never derivable by an outsider).
    pub fn serving() -> Self {
        Self {
            random_ids: Some(ring::rand::SystemRandom::new()),
            ..Self::new()
        }
    }

    /// A fresh lease id: the next in order, or a random one that is not held.
    fn fresh_id(&mut self) -> i64 {
        if let Some(random) = &self.random_ids {
            use ring::rand::SecureRandom;
            loop {
                let mut bytes = [0u8; 8];
                if random.fill(&mut bytes).is_err() {
                    break;
                }
                let id = i64::from_le_bytes(bytes) & i64::MAX;
                if id != 0 && !self.leases.contains_key(&id) {
                    return id;
                }
            }
        }
        // Past the largest id the count starts again at 1; at most [`MAX_LEASES`] are
        // held, so a free one is found.
        while self.leases.contains_key(&self.next_lease) {
            self.next_lease = self.next_lease.checked_add(1).unwrap_or(1);
        }
        self.next_lease
    }

    /// The current revision (every response's header carries it).
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Leases still held: a store host waits for them to go before it stops serving.
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// The keys of a request's range, in order.
    fn keys_in<'a>(
        &'a self,
        from: &'a [u8],
        end: &'a [u8],
    ) -> impl Iterator<Item = &'a pb::KeyValue> {
        use std::ops::Bound;
        self.kvs
            .range::<[u8], _>((Bound::Included(from), Bound::Unbounded))
            .take_while(move |(k, _)| in_range(k, from, end))
            .map(|(_, kv)| kv)
    }

    fn begin(&self) -> Batch {
        Batch {
            revision: self.revision + 1,
            events: Vec::new(),
        }
    }

    /// Ends a write request: the revision advances only if something was written.
    fn commit(&mut self, batch: Batch) {
        if batch.events.is_empty() {
            return;
        }
        self.revision = batch.revision;
        self.history.push_back((batch.revision, batch.events));
        while self.history.len() > HISTORY_REVISIONS {
            if let Some((rev, _)) = self.history.pop_front() {
                self.compacted = rev;
            }
        }
    }

    pub fn range(&self, r: &pb::RangeRequest) -> Result<pb::RangeResponse, StoreError> {
        if r.revision > self.revision {
            return Err(StoreError::FutureRevision);
        }
        if r.revision > 0 && r.revision < self.revision {
            // Reads of the past are not kept (the rendezvous never asks for one).
            return Err(StoreError::Compacted);
        }
        let matching: Vec<&pb::KeyValue> = self.keys_in(&r.key, &r.range_end).collect();
        let count = matching.len() as i64;
        let limit = usize::try_from(r.limit).ok().filter(|l| *l > 0);
        let kept = limit.map_or(matching.len(), |l| l.min(matching.len()));
        let kvs = if r.count_only {
            Vec::new()
        } else {
            matching[..kept]
                .iter()
                .map(|kv| {
                    let mut kv = (*kv).clone();
                    if r.keys_only {
                        kv.value.clear();
                    }
                    kv
                })
                .collect()
        };
        Ok(pb::RangeResponse {
            header: None,
            kvs,
            more: kept < matching.len(),
            count,
        })
    }

    pub fn put(&mut self, r: pb::PutRequest) -> Result<pb::PutResponse, StoreError> {
        let mut batch = self.begin();
        let resp = self.put_in(&mut batch, r)?;
        self.commit(batch);
        Ok(resp)
    }

    pub fn delete_range(&mut self, r: &pb::DeleteRangeRequest) -> pb::DeleteRangeResponse {
        let mut batch = self.begin();
        let resp = self.delete_in(&mut batch, r);
        self.commit(batch);
        resp
    }

    pub fn txn(&mut self, r: pb::TxnRequest) -> Result<pb::TxnResponse, StoreError> {
        // Checked before anything is written: a refused transaction writes nothing.
        self.check_txn(&r)?;
        let mut batch = self.begin();
        let resp = self.txn_in(&mut batch, r)?;
        self.commit(batch);
        Ok(resp)
    }

    /// The leases the chosen branch of `r` (and of the transactions it nests) would attach
    /// keys to must exist.
    fn check_txn(&self, r: &pb::TxnRequest) -> Result<(), StoreError> {
        let ops = if self.compares(&r.compare) {
            &r.success
        } else {
            &r.failure
        };
        for op in ops {
            match &op.request {
                Some(Request::RequestPut(p))
                    if p.lease != 0 && !p.ignore_lease && !self.leases.contains_key(&p.lease) =>
                {
                    return Err(StoreError::LeaseNotFound);
                }
                Some(Request::RequestTxn(t)) => self.check_txn(t)?,
                _ => {}
            }
        }
        Ok(())
    }

    fn compares(&self, compares: &[pb::Compare]) -> bool {
        compares.iter().all(|c| self.compare(c))
    }

    fn compare(&self, c: &pb::Compare) -> bool {
        let found: Vec<&pb::KeyValue> = self.keys_in(&c.key, &c.range_end).collect();
        if found.is_empty() {
            let target = CompareTarget::try_from(c.target).unwrap_or(CompareTarget::Version);
            return target != CompareTarget::Value && compare_kv(c, &pb::KeyValue::default());
        }
        found.into_iter().all(|kv| compare_kv(c, kv))
    }

    fn txn_in(
        &mut self,
        batch: &mut Batch,
        r: pb::TxnRequest,
    ) -> Result<pb::TxnResponse, StoreError> {
        let succeeded = self.compares(&r.compare);
        let ops = if succeeded { r.success } else { r.failure };
        let mut responses = Vec::with_capacity(ops.len());
        for op in ops {
            let response = match op.request {
                Some(Request::RequestRange(q)) => Response::ResponseRange(self.range(&q)?),
                Some(Request::RequestPut(p)) => Response::ResponsePut(self.put_in(batch, p)?),
                Some(Request::RequestDeleteRange(d)) => {
                    Response::ResponseDeleteRange(self.delete_in(batch, &d))
                }
                Some(Request::RequestTxn(t)) => Response::ResponseTxn(self.txn_in(batch, t)?),
                None => continue,
            };
            responses.push(pb::ResponseOp {
                response: Some(response),
            });
        }
        Ok(pb::TxnResponse {
            header: None,
            succeeded,
            responses,
        })
    }

    fn put_in(
        &mut self,
        batch: &mut Batch,
        r: pb::PutRequest,
    ) -> Result<pb::PutResponse, StoreError> {
        let prev = self.kvs.get(&r.key).cloned();
        if (r.ignore_value || r.ignore_lease) && prev.is_none() {
            return Err(StoreError::KeyNotFound);
        }
        let lease = match &prev {
            Some(p) if r.ignore_lease => p.lease,
            _ => r.lease,
        };
        if lease != 0 && !self.leases.contains_key(&lease) {
            return Err(StoreError::LeaseNotFound);
        }
        let value = match &prev {
            Some(p) if r.ignore_value => p.value.clone(),
            _ => r.value,
        };
        if let Some(old) = prev.as_ref().filter(|p| p.lease != lease) {
            self.detach(old);
        }
        if let Some(l) = self.leases.get_mut(&lease) {
            l.keys.insert(r.key.clone());
        }
        let kv = pb::KeyValue {
            key: r.key.clone(),
            create_revision: prev.as_ref().map_or(batch.revision, |p| p.create_revision),
            mod_revision: batch.revision,
            version: prev.as_ref().map_or(1, |p| p.version + 1),
            value,
            lease,
        };
        self.kvs.insert(r.key, kv.clone());
        batch.events.push(pb::Event {
            r#type: pb::event::EventType::Put as i32,
            kv: Some(kv),
            prev_kv: prev.clone(),
        });
        Ok(pb::PutResponse {
            header: None,
            prev_kv: prev.filter(|_| r.prev_kv),
        })
    }

    fn delete_in(
        &mut self,
        batch: &mut Batch,
        r: &pb::DeleteRangeRequest,
    ) -> pb::DeleteRangeResponse {
        let doomed: Vec<Vec<u8>> = self
            .keys_in(&r.key, &r.range_end)
            .map(|kv| kv.key.clone())
            .collect();
        let mut prev_kvs = Vec::new();
        for key in &doomed {
            if let Some(old) = self.remove(batch, key) {
                if r.prev_kv {
                    prev_kvs.push(old);
                }
            }
        }
        pb::DeleteRangeResponse {
            header: None,
            deleted: doomed.len() as i64,
            prev_kvs,
        }
    }

    fn remove(&mut self, batch: &mut Batch, key: &[u8]) -> Option<pb::KeyValue> {
        let old = self.kvs.remove(key)?;
        self.detach(&old);
        batch.events.push(pb::Event {
            r#type: pb::event::EventType::Delete as i32,
            kv: Some(pb::KeyValue {
                key: key.to_vec(),
                mod_revision: batch.revision,
                ..Default::default()
            }),
            prev_kv: Some(old.clone()),
        });
        Some(old)
    }

    fn detach(&mut self, kv: &pb::KeyValue) {
        if let Some(l) = self.leases.get_mut(&kv.lease) {
            l.keys.remove(&kv.key);
        }
    }

    /// A new lease of `ttl` seconds (at least one), under `id` or a fresh id when `id` is 0.
    /// Every number a request brings is bounded first: no arithmetic here can overflow.
    pub fn grant(&mut self, ttl: i64, id: i64, now: Instant) -> Result<(i64, i64), StoreError> {
        if ttl > MAX_TTL {
            return Err(StoreError::TtlTooLarge);
        }
        if id < 0 {
            return Err(StoreError::BadLeaseId);
        }
        if self.leases.len() >= MAX_LEASES {
            return Err(StoreError::TooManyLeases);
        }
        let ttl = ttl.max(1);
        let id = if id == 0 {
            self.fresh_id()
        } else if self.leases.contains_key(&id) {
            return Err(StoreError::LeaseExists);
        } else {
            id
        };
        self.next_lease = self.next_lease.max(id).saturating_add(1);
        self.leases.insert(
            id,
            Lease {
                ttl,
                deadline: deadline(now, ttl),
                keys: BTreeSet::new(),
            },
        );
        Ok((id, ttl))
    }

    /// Ends lease `id` and deletes its keys, all in one revision.
    pub fn revoke(&mut self, id: i64) -> Result<(), StoreError> {
        let lease = self.leases.remove(&id).ok_or(StoreError::LeaseNotFound)?;
        let mut batch = self.begin();
        for key in &lease.keys {
            self.remove(&mut batch, key);
        }
        self.commit(batch);
        Ok(())
    }

    /// Renews lease `id` for its whole TTL; its TTL, or `None` when it no longer exists.
    pub fn keep_alive(&mut self, id: i64, now: Instant) -> Option<i64> {
        let lease = self.leases.get_mut(&id)?;
        lease.deadline = deadline(now, lease.ttl);
        Some(lease.ttl)
    }

    /// Seconds left (rounded down), the granted TTL and the keys of lease `id`.
    pub fn time_to_live(&self, id: i64, now: Instant) -> Option<(i64, i64, Vec<Vec<u8>>)> {
        let lease = self.leases.get(&id)?;
        let left = lease.deadline.saturating_duration_since(now).as_secs() as i64;
        Some((left, lease.ttl, lease.keys.iter().cloned().collect()))
    }

    /// Every lease a full TTL again from `now`, as etcd's new leader gives them.
    pub fn renew_all(&mut self, now: Instant) {
        for lease in self.leases.values_mut() {
            lease.deadline = deadline(now, lease.ttl);
        }
    }

    /// Revokes every lease whose deadline has passed; the ids revoked.
    pub fn expire(&mut self, now: Instant) -> Vec<i64> {
        let mut lapsed: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        lapsed.sort_unstable();
        for id in &lapsed {
            let _ = self.revoke(*id);
        }
        lapsed
    }

    /// The events after revision `from - 1` that `w` asks for.
    pub fn replay(&self, from: i64, w: &WatchSpec) -> Replay {
        if from <= self.compacted {
            return Replay::Compacted(self.compacted + 1);
        }
        let first = self.history.partition_point(|(rev, _)| *rev < from);
        let events = self
            .history
            .range(first..)
            .flat_map(|(_, events)| events)
            .filter(|e| {
                let key = e.kv.as_ref().map_or(&[][..], |kv| &kv.key[..]);
                let put = e.r#type == pb::event::EventType::Put as i32;
                in_range(key, &w.key, &w.range_end) && if put { !w.no_put } else { !w.no_delete }
            })
            .map(|e| {
                let mut e = e.clone();
                if !w.prev_kv {
                    e.prev_kv = None;
                }
                e
            })
            .collect();
        Replay::Events(events)
    }
}

fn secs(s: i64) -> Duration {
    Duration::from_secs(s.unsigned_abs())
}

/// `ttl` seconds after `now`, or as far as the clock goes.
fn deadline(now: Instant, ttl: i64) -> Instant {
    now.checked_add(secs(ttl))
        .unwrap_or_else(|| now + Duration::from_secs(u64::from(u32::MAX)))
}

fn compare_kv(c: &pb::Compare, kv: &pb::KeyValue) -> bool {
    use std::cmp::Ordering;
    let ord: Ordering = match &c.target_union {
        Some(TargetUnion::Version(v)) => kv.version.cmp(v),
        Some(TargetUnion::CreateRevision(v)) => kv.create_revision.cmp(v),
        Some(TargetUnion::ModRevision(v)) => kv.mod_revision.cmp(v),
        Some(TargetUnion::Lease(v)) => kv.lease.cmp(v),
        Some(TargetUnion::Value(v)) => kv.value.as_slice().cmp(v.as_slice()),
        // proto3 leaves a zero target out of the oneof: the field the target names, at 0.
        None => match CompareTarget::try_from(c.target).unwrap_or(CompareTarget::Version) {
            CompareTarget::Version => kv.version.cmp(&0),
            CompareTarget::Create => kv.create_revision.cmp(&0),
            CompareTarget::Mod => kv.mod_revision.cmp(&0),
            CompareTarget::Lease => kv.lease.cmp(&0),
            CompareTarget::Value => kv.value.as_slice().cmp(&[][..]),
        },
    };
    match CompareResult::try_from(c.result).unwrap_or(CompareResult::Equal) {
        CompareResult::Equal => ord == Ordering::Equal,
        CompareResult::Greater => ord == Ordering::Greater,
        CompareResult::Less => ord == Ordering::Less,
        CompareResult::NotEqual => ord != Ordering::Equal,
    }
}

#[cfg(test)]
mod tests;
