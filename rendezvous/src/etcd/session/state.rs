//! Small steps on the machine's state: the view and its publication, the lease and the
//! incarnation, the coordinator role.

use std::sync::atomic::Ordering;

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::io::{CommandId, Effect, Kv, Role, WatchEvent};
use super::machine::Machine;
use crate::RendezvousError;
use crate::etcd::keys::Keys;
use crate::etcd::view::View;

impl Machine {
    pub(super) fn reply(&mut self, id: CommandId, result: Result<(), RendezvousError>) {
        self.flight.emit(Effect::Reply(id, result));
    }

    pub(super) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// The lease clock's moment, into the view.
    pub(super) fn publish_lease(&mut self) {
        let (now, margin) = (self.now, self.cfg.fence_margin);
        self.view
            .lease_safe_until(self.lease.clock().safe_until(), now, margin);
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
    pub(super) fn apply(&mut self, events: Vec<WatchEvent>) -> bool {
        let coordinator = self.cfg.keys.key::<fsdp_proto::v1::Coordinator>("");
        let now = self.now;
        let mut coordinator_gone = false;
        let keys = self.cfg.keys.clone();
        let member = self.watches.role() == Role::Member;
        let v = self.view.edit();
        for ev in events {
            match ev {
                WatchEvent::Put(kv) => {
                    super::rebuild::put_kv(v, &keys, &kv);
                    if member {
                        said_departed(v, &keys, &kv, now);
                    }
                }
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
        let (me, lease) = (self.cfg.node_id.clone(), self.lease.id());
        let v = self.view.edit();
        v.coordinator = Some(me);
        v.coordinator_lease = lease;
    }

    /// The lease is gone. Before `safe_until` etcd cannot have expired it, so it lost its
    /// data (an empty restart) and nobody saw this node leave: the round goes on. From
    /// then on it may have expired and the others re-form without this node: if it runs
    /// a round, that round is over for it too.
    pub(super) fn lease_gone(&mut self) {
        self.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
        let now = self.now;
        let expired = self.lease.clock().safe_until().is_none_or(|s| now >= s);
        if let Some(went) = self.my_incarnation().filter(|_| expired) {
            tracing::warn!("the lease expired while this node ran a round: it was evicted");
            let me = self.cfg.node_id.clone();
            self.view.edit().depart(&me, went, now);
        }
    }

    /// etcd took this node's registration on the current lease and incarnation.
    pub(super) fn registered(&mut self) {
        if self.me.written(self.lease.id(), self.lease.incarnation()) {
            self.counters.reregistered.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// This node's incarnation in the round it runs, if it runs one.
    pub(super) fn my_incarnation(&self) -> Option<u64> {
        let r = self.me.running()?;
        let me = r.members.iter().find(|m| m.node_id == self.cfg.node_id)?;
        Some(me.incarnation)
    }

    /// A new lease replaced the old one: the next incarnation.
    pub(super) fn lease_renewed(&mut self, id: i64) {
        self.wrote();
        let old = self.lease.id();
        self.lease.replaced(id, self.flight.sent(), self.cfg.ttl);
        self.publish_lease();
        tracing::info!(old, new = id, "the lease was gone; granted a new one");
        self.counters.lease.send_replace(id);
        self.next_incarnation();
    }

    /// This node's registration, ready for `wants_round`.
    pub(super) fn member_record(&self, wants_round: u64) -> v1::Member {
        v1::MemberFields {
            schema: SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            addr: self.cfg.addr.clone(),
            local_world_size: self.cfg.local_world_size,
            wants_round,
            status_addr: self.cfg.status_addr.clone(),
            // Set to the lease and incarnation it is written with (`registration`).
            lease: 0,
            incarnation: 0,
            min_nodes: self.cfg.seal.min_nodes,
            max_nodes: self.cfg.seal.max_nodes,
            max_restarts: self.cfg.budget.max_restarts,
            restart_window_s: self.cfg.budget.window_s,
            job: self.cfg.job.clone(),
            segment: self.cfg.segment.clone(),
        }
        .into()
    }

    /// This agent's next registration is a new incarnation.
    pub(super) fn next_incarnation(&mut self) {
        let n = self.lease.next_incarnation();
        self.view.edit().incarnation = n;
    }
}

/// A member watches no registrations (N members each watching every registration made
/// etcd match every put against N watchers: formation was O(N²) inside etcd, and 4,000
/// nodes never formed). It learns that a round member went from the records
/// that say so, all under the control keys: the node's own word before it revokes its
/// lease (a leave, a fence), the coordinator's "lost" for a lease that expired, and the
/// ring watcher's record of a dead node it evicts.
fn said_departed(v: &mut View, keys: &Keys, kv: &Kv, now: std::time::Instant) {
    let went = if kv.key.starts_with(&keys.key::<v1::Left>("")) {
        let tail = &kv.key[keys.key::<v1::Left>("").len()..];
        v.left
            .get(tail)
            .map(|e| (e.record.node_id.clone(), e.record.incarnation))
    } else if kv.key.starts_with(&keys.key::<v1::Noticed>("")) {
        let Ok(g) = fsdp_proto::decode::<v1::Noticed>(&kv.key, &kv.value) else {
            return;
        };
        v.round
            .as_ref()
            .filter(|r| r.record.number == g.round)
            .and_then(|r| r.record.members.iter().find(|m| m.node_id == g.node_id))
            .map(|m| (m.node_id.clone(), m.incarnation))
    } else if kv.key.starts_with(&keys.key::<v1::Unhealthy>("")) {
        // A withdrawal for a failing health check: the registration went in the same
        // transaction, and nobody else says so (the coordinator counts it explained).
        let Ok(u) = fsdp_proto::decode::<v1::Unhealthy>(&kv.key, &kv.value) else {
            return;
        };
        v.round
            .as_ref()
            .and_then(|r| r.record.members.iter().find(|m| m.node_id == u.node_id))
            .map(|m| (m.node_id.clone(), m.incarnation))
    } else {
        None
    };
    if let Some((node, incarnation)) = went {
        // An earlier sighting of this incarnation's departure keeps its time.
        if v.departed
            .get(&node)
            .is_none_or(|d| d.incarnation < incarnation)
        {
            v.depart(&node, incarnation, now);
        }
    }
}
