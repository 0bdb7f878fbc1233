//! The simulated etcd: the embedded store's pure state ([`fsdp_store::state`], the same
//! rules the c10d store serves) behind the session's [`Op`]s, with the faults etcd has: a
//! restart with its data (every lease a full TTL again, as a new leader gives them) or
//! empty, a member of three lost, and the old store (lease ids from 1 again after an empty
//! restart, before they were made unique across restarts).

use std::time::{Duration, Instant};

use fsdp_proto::etcdserverpb as pb;
use fsdp_store::state::{Replay, State, StoreError, WatchSpec, first_lease_id};
use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;

use crate::etcd::session::{Answer, Compare, Kv, Op, TxnSpec, WatchEvent, Write};

/// The etcd of one simulated run.
pub struct SimEtcd {
    pub state: State,
    /// Starts so far: a restart empty is a new epoch (its leases and rounds are new).
    pub epoch: u32,
    /// Members up (three-member clusters; a one-member etcd uses the first).
    pub members_up: [bool; 3],
    /// Down for a restart until then.
    pub down_until: Option<Instant>,
    /// Lease ids repeat from 1 after an empty restart (the store before
    /// [`first_lease_id`] made them unique across restarts).
    old_store: bool,
    members: usize,
    /// Leases that ended (expired or revoked) in this epoch.
    pub ended: std::collections::BTreeSet<i64>,
    /// While overloaded: how long the apply loop takes for each proposal (0: at once).
    pub apply_ms: u64,
    /// When the apply loop will have applied every proposal queued so far.
    backlog_until: Option<Instant>,
    /// Restarts so far: a proposal queued before one is lost with it.
    pub restarts: u64,
}

/// How long etcd 3.4 lets a linearizable read or a lease renewal wait for its apply
/// loop before it answers "waiting for the applied index took too long".
pub const APPLY_WAIT: Duration = Duration::from_secs(1);
/// How long a proposal waits before etcd answers "request timed out" (it may still be
/// applied later).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The queue past which etcd refuses new proposals ("too many requests").
pub const TOO_MANY: Duration = Duration::from_secs(3);

/// What the apply loop does with a proposal made now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposal {
    /// Refused at once: too many requests.
    Refused,
    /// Applied then.
    At(Instant),
}

/// The session's error for a request that never got through.
pub fn cut() -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "simulated: etcd unreachable",
    ))
}

fn store_error(e: StoreError) -> etcd_client::Error {
    let status = match e {
        StoreError::LeaseNotFound | StoreError::KeyNotFound => {
            tonic::Status::not_found(e.to_string())
        }
        _ => tonic::Status::failed_precondition(e.to_string()),
    };
    etcd_client::Error::GRpcStatus(status)
}

/// The end of the range of every key under `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl SimEtcd {
    pub fn new(old_store: bool, unix_ms: u64, members: usize) -> Self {
        Self {
            members,
            state: Self::fresh(old_store, unix_ms),
            epoch: 0,
            members_up: [true; 3],
            down_until: None,
            old_store,
            ended: Default::default(),
            apply_ms: 0,
            backlog_until: None,
            restarts: 0,
        }
    }

    /// How far the apply loop is behind at `now`.
    pub fn lag(&self, now: Instant) -> Duration {
        self.backlog_until
            .map_or(Duration::ZERO, |b| b.saturating_duration_since(now))
    }

    /// Whether ops go through the apply loop's queue: while overloaded, or while what
    /// queued then drains.
    pub fn queueing(&self, now: Instant) -> bool {
        self.apply_ms > 0 || !self.lag(now).is_zero()
    }

    /// A proposal made at `now`: when it is applied, or refused.
    pub fn propose(&mut self, now: Instant) -> Proposal {
        let lag = self.lag(now);
        if lag > TOO_MANY {
            return Proposal::Refused;
        }
        let at = now + lag + Duration::from_millis(self.apply_ms);
        self.backlog_until = Some(at);
        Proposal::At(at)
    }

    fn fresh(old_store: bool, unix_ms: u64) -> State {
        if old_store {
            State::new()
        } else {
            State::with_first_lease(first_lease_id(unix_ms))
        }
    }

    /// Whether a request through `member` is served now.
    pub fn serves(&self, now: Instant, member: usize, three: bool) -> bool {
        self.has_leader(now, three) && self.members_up[member % 3]
    }

    /// A restart that keeps the data: down for `down`, then every lease a full TTL again.
    pub fn restart(&mut self, now: Instant, down: Duration, empty: bool, unix_ms: u64) {
        self.down_until = Some(now + down);
        // What was queued and not applied is lost with the process.
        self.backlog_until = None;
        self.restarts += 1;
        if empty {
            self.state = Self::fresh(self.old_store, unix_ms);
            self.epoch += 1;
            self.ended.clear();
        }
    }

    /// Whether a leader serves: not restarting, and a quorum of members up.
    pub fn has_leader(&self, now: Instant, three: bool) -> bool {
        let up = self.members_up.iter().filter(|u| **u).count();
        self.down_until.is_none_or(|t| now >= t) && if three { up >= 2 } else { self.members_up[0] }
    }

    /// A leader again: every lease a full TTL (a new leader's grace).
    pub fn new_leader(&mut self, now: Instant) {
        self.down_until = None;
        self.state.renew_all(now);
    }

    /// Leases past their deadline end (only a leader expires them).
    pub fn expire(&mut self, now: Instant) -> Vec<i64> {
        let gone = self.state.expire(now);
        self.ended.extend(&gone);
        gone
    }

    /// Carries `op` out now (the caller knows the member serves). Watches and keep-alive
    /// are the world's business.
    pub fn execute(&mut self, op: &Op, now: Instant) -> Result<Answer, etcd_client::Error> {
        Ok(match op {
            Op::Range {
                key,
                prefix,
                keys_only,
                ..
            } => {
                let req = pb::RangeRequest {
                    key: key.as_bytes().to_vec(),
                    range_end: if *prefix {
                        prefix_end(key.as_bytes())
                    } else {
                        Vec::new()
                    },
                    keys_only: *keys_only,
                    ..Default::default()
                };
                let resp = self.state.range(&req).map_err(store_error)?;
                Answer::Range {
                    revision: self.state.revision(),
                    kvs: resp.kvs.iter().map(kv).collect(),
                }
            }
            Op::MemberCount => Answer::MemberCount(self.members),
            Op::Txn(spec) => {
                let resp = self.state.txn(txn(spec)).map_err(store_error)?;
                Answer::Txn {
                    succeeded: resp.succeeded,
                }
            }
            Op::Put(w) => {
                let spec = TxnSpec {
                    then: vec![w.clone()],
                    ..TxnSpec::default()
                };
                self.state.txn(txn(&spec)).map_err(store_error)?;
                Answer::Done
            }
            Op::Grant { ttl } => {
                let (id, _) = self.state.grant(*ttl, 0, now).map_err(store_error)?;
                Answer::Granted { id }
            }
            Op::Revoke { lease } => {
                self.state.revoke(*lease).map_err(store_error)?;
                self.ended.insert(*lease);
                Answer::Done
            }
            Op::TimeToLive { lease } => Answer::TimeToLive {
                ttl: self
                    .state
                    .time_to_live(*lease, now)
                    .map_or(-1, |(left, ..)| left.max(1)),
            },
            Op::Depart { record, lease } => {
                let said = record
                    .as_ref()
                    .and_then(|spec| self.state.txn(txn(spec)).err().map(store_error));
                let revoked = self.state.revoke(*lease).err().map(store_error);
                if revoked.is_none() {
                    self.ended.insert(*lease);
                }
                Answer::Departed {
                    said: said.map(Into::into),
                    revoked: revoked.map(Into::into),
                }
            }
            // Opening a keep-alive stream waits for its first renewal (etcd-client's
            // `lease_keep_alive`): a lease gone is an error.
            Op::ReopenKeepAlive { lease } => {
                if self.keep_alive(*lease, now) == 0 {
                    return Err(store_error(StoreError::LeaseNotFound));
                }
                Answer::Done
            }
            Op::Watch { .. } | Op::KeepAlive | Op::PickEndpoint => Answer::Done,
        })
    }

    /// Renews `lease`; its TTL, 0 when it is gone.
    pub fn keep_alive(&mut self, lease: i64, now: Instant) -> i64 {
        self.state.keep_alive(lease, now).unwrap_or(0)
    }

    /// The events from revision `from` that a watch of `spec` gets, by revision; `None`
    /// when `from` was compacted.
    pub fn replay(&self, from: i64, spec: &WatchSpec) -> Option<Vec<(i64, Vec<WatchEvent>)>> {
        let Replay::Events(events) = self.state.replay(from, spec) else {
            return None;
        };
        let mut batches: Vec<(i64, Vec<WatchEvent>)> = Vec::new();
        for e in events {
            let Some(kv_) = e.kv.as_ref() else { continue };
            let rev = kv_.mod_revision;
            let event = if e.r#type == pb::event::EventType::Put as i32 {
                WatchEvent::Put(kv(kv_))
            } else {
                WatchEvent::Delete {
                    key: String::from_utf8_lossy(&kv_.key).into_owned(),
                    prev: e.prev_kv.as_ref().map(|p| p.value.clone()),
                }
            };
            match batches.last_mut() {
                Some((r, b)) if *r == rev => b.push(event),
                _ => batches.push((rev, vec![event])),
            }
        }
        Some(batches)
    }
}

fn kv(kv: &pb::KeyValue) -> Kv {
    Kv {
        key: String::from_utf8_lossy(&kv.key).into_owned(),
        value: kv.value.clone(),
        create_rev: kv.create_revision,
        mod_rev: kv.mod_revision,
        lease: kv.lease,
    }
}

fn write(w: &Write) -> pb::RequestOp {
    let request = match w {
        Write::Put { key, value, lease } => Request::RequestPut(pb::PutRequest {
            key: key.as_bytes().to_vec(),
            value: value.clone(),
            lease: *lease,
            ..Default::default()
        }),
        Write::Delete(key) => Request::RequestDeleteRange(pb::DeleteRangeRequest {
            key: key.as_bytes().to_vec(),
            ..Default::default()
        }),
        Write::DeleteRange { from, to } => Request::RequestDeleteRange(pb::DeleteRangeRequest {
            key: from.as_bytes().to_vec(),
            range_end: to.as_bytes().to_vec(),
            ..Default::default()
        }),
    };
    pb::RequestOp {
        request: Some(request),
    }
}

fn compare(c: &Compare) -> pb::Compare {
    let equal = |k: &String, target: CompareTarget, union| pb::Compare {
        result: CompareResult::Equal as i32,
        target: target as i32,
        key: k.as_bytes().to_vec(),
        range_end: Vec::new(),
        target_union: Some(union),
    };
    match c {
        Compare::Absent(k) => equal(k, CompareTarget::Version, TargetUnion::Version(0)),
        Compare::ModRevision(k, rev) => {
            equal(k, CompareTarget::Mod, TargetUnion::ModRevision(*rev))
        }
        Compare::Lease(k, id) => equal(k, CompareTarget::Lease, TargetUnion::Lease(*id)),
        Compare::NoneWrittenAfter { from, to, rev } => pb::Compare {
            result: CompareResult::Less as i32,
            target: CompareTarget::Mod as i32,
            key: from.as_bytes().to_vec(),
            range_end: to.as_bytes().to_vec(),
            target_union: Some(TargetUnion::ModRevision(rev.saturating_add(1))),
        },
    }
}

/// A [`TxnSpec`] as the store's request.
pub fn txn(spec: &TxnSpec) -> pb::TxnRequest {
    pb::TxnRequest {
        compare: spec.when.iter().map(compare).collect(),
        success: spec.then.iter().map(write).collect(),
        failure: spec.otherwise.iter().map(write).collect(),
    }
}
