//! What a sync does with what it read: the view rebuilt from a ranged read (keeping the
//! departures already seen), this node's lease and registration made sure of, the round
//! put back if etcd lost it, the members of the round not back after an outage's grace,
//! a round read whole from the roster; and the commands that waited for etcd.

use std::collections::BTreeSet;
use std::time::Duration;

use super::io::{Kv, Role};
use super::machine::{Machine, Phase, Resync};
use super::sync::Todo;
use crate::etcd::view::{RoundEntry, View, left_between};
use fsdp_proto::v1;

impl Machine {
    /// Replaces the view with `fresh`, keeping the departures already seen. When
    /// `voluntary` (nothing was lost in between), a member we knew of that the snapshot
    /// lacks left while we were switching watches.
    pub(super) fn install(&mut self, mut fresh: View, voluntary: bool) {
        let now = self.now;
        if let Some(r) = &self.view.round {
            self.me.saw(&r.record);
        }
        let left = if voluntary {
            left_between(&self.view, self.me.running().map(|r| &**r), &fresh)
        } else {
            Vec::new()
        };
        let v = self.view.edit();
        fresh.departed = std::mem::take(&mut v.departed);
        fresh.lease_safe_until = v.lease_safe_until;
        fresh.incarnation = v.incarnation;
        fresh.connected = true;
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
        *self.view.edit() = fresh;
    }

    /// etcd answered the time-to-live sent last with `ttl` (> 0) seconds left: the lease
    /// clock moves from the request's send time by that much, never past the TTL granted
    /// (a leader not yet keeping leases after an election answers the largest TTL there is).
    pub(super) fn lease_left(&mut self, ttl: i64) {
        let left = Duration::from_secs(ttl.unsigned_abs()).min(self.cfg.ttl);
        self.lease.confirmed(self.flight.sent(), left);
        self.publish_lease();
    }

    /// After a read: make sure our lease lives and our registration is there; put back
    /// our round if etcd lost it.
    pub(super) fn ensure_registered(&mut self, ttl: i64) {
        let alive = ttl > 0;
        if alive {
            self.lease_left(ttl);
        }
        let v = &self.view;
        let present = v.members.contains_key(&self.cfg.node_id);
        let mine = self.me.running();
        let round_missing = self.me.round_to_put_back().is_some() && v.round.is_none();
        // Our key is gone while our lease lives and our round is still there: someone
        // deleted it, and the others saw us leave. (A lost lease is judged by the clock,
        // in `lease_gone`.)
        let evicted = alive
            && !present
            && mine.is_some_and(|r| {
                v.round
                    .as_ref()
                    .is_some_and(|cur| cur.record.number >= r.number)
            });
        if evicted {
            // The incarnation the round names went; this node registers again below, as
            // the next one, whose registration that departure does not concern.
            if let Some(went) = self.my_incarnation() {
                let (me, now) = (self.cfg.node_id.clone(), self.now);
                self.view.edit().depart(&me, went, now);
            }
            self.next_incarnation();
        }
        let mut next = Vec::new();
        if !alive {
            self.lease_gone();
            next.extend([Todo::Grant, Todo::Register]);
        } else if !present {
            next.push(Todo::Register);
        }
        if round_missing {
            next.push(Todo::Republish);
        }
        for t in next.into_iter().rev() {
            self.flight.first(t);
        }
    }

    /// By node, not by incarnation: after etcd came back empty every member registers
    /// again as a new incarnation, and the round goes on.
    pub(super) fn check_absent(&mut self, present: &[Kv]) {
        let Some(mine) = self.me.running().cloned() else {
            return;
        };
        let prefix = self.cfg.keys.members();
        let present: BTreeSet<&str> = present
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&prefix))
            .collect();
        let now = self.now;
        let v = self.view.edit();
        for m in mine
            .members
            .iter()
            .filter(|m| !present.contains(m.node_id.as_str()))
        {
            v.depart(&m.node_id, m.incarnation, now);
        }
    }

    /// The whole round, for a view that could not apply a delta. A roster older than the
    /// round wanted (a newer seal came between the event and the read, so the next event
    /// brings its delta) leaves the view waiting; none at all means the run's keys are not
    /// as any agent writes them: read everything again.
    pub(super) fn read_roster(&mut self, kvs: &[Kv], served_at: Option<i64>) {
        let wanted = self.view.round_wanted;
        let placing = self.view.placing.as_ref();
        if let Some(header) = placing.filter(|h| Some(h.record.number) == wanted).cloned() {
            return self.read_placement(header, kvs, served_at);
        }
        let keys = self.cfg.keys.clone();
        let v = self.view.edit();
        for kv in kvs {
            put_kv(v, &keys, kv);
        }
        if kvs.is_empty() && self.view.round_wanted.is_some() {
            tracing::warn!(
                "a round came as a delta and no roster holds it whole; reading the run again"
            );
            self.resync_after_watching(Resync::Outage);
        }
    }

    /// The shards of the placed round `header` (this node's, or every one for a view
    /// that coordinates), read under the name its header gives them. A member's shard
    /// missing means a newer seal deleted it (two seals came between the header and the
    /// read, or a whole round replaced it) or keys no agent wrote: the round key tells
    /// which ([`Machine::read_seal`]), unless the read was served (`served_at`, a
    /// serializable read's revision) from a member that had not applied the header yet:
    /// then it is read again from the leader's state. Anything else wrong: read
    /// everything again.
    pub(super) fn read_placement(
        &mut self,
        header: RoundEntry,
        kvs: &[Kv],
        served_at: Option<i64>,
    ) {
        use crate::etcd::placement;
        let h = &header.record;
        let mut shards = Vec::with_capacity(kvs.len());
        for kv in kvs {
            match fsdp_proto::decode::<v1::Placement>(&kv.key, &kv.value) {
                Ok(s) => shards.push(s),
                // As garbage anywhere in the run: the rendezvous stops, naming the key.
                Err(e) => {
                    self.view
                        .edit()
                        .corrupt
                        .insert(kv.key.clone(), e.to_string());
                    return;
                }
            }
        }
        if self.watches.control_only() && kvs.is_empty() {
            if served_at.is_some_and(|rev| rev < header.mod_rev) {
                self.flight.first(Todo::ReadShardAgain);
                return;
            }
            // At 10,000 members a resync for each would be a crowd's whole reads again.
            self.flight.first(Todo::ReadSeal);
            return;
        }
        let made = if self.watches.control_only() {
            let me = &self.cfg.node_id;
            match shards
                .iter()
                .find(|s| s.shard == placement::shard_of(me, h.shards))
            {
                Some(s) if s.round == h.number => {
                    Ok(placement::window(h, s, me).unwrap_or_else(|| v1::Round::clone(h)))
                }
                _ => Err(format!("shard of round {} missing", h.number)),
            }
        } else {
            placement::whole(h, &shards)
        };
        let judged =
            made.and_then(|r| crate::etcd::record::set_placed(self.view.edit(), r, header.mod_rev));
        if let Err(why) = judged {
            tracing::warn!(round = h.number, %why, "a placed round's placement does not make the round; reading the run again");
            self.resync_after_watching(Resync::Outage);
        }
    }

    /// The round key, read because this node's shard of the placed round it waits on
    /// was gone: a newer seal is taken as a watch would bring it (its header, read next);
    /// the same seal (or none) means keys no agent wrote: read everything again.
    pub(super) fn read_seal(&mut self, kvs: &[Kv]) {
        let waited = self.view.placing.as_ref().map(|p| p.mod_rev);
        match kvs.first() {
            Some(kv) if waited.is_some_and(|rev| kv.mod_rev > rev) => {
                let keys = self.cfg.keys.clone();
                put_kv(self.view.edit(), &keys, kv);
                if self.view.round_wanted.is_some() {
                    self.flight.first(Todo::ReadRoster);
                }
            }
            _ => {
                let round = self.view.placing.as_ref().map(|p| p.record.number);
                tracing::warn!(
                    ?round,
                    "a placed round's shard is missing; reading the run again"
                );
                self.resync_after_watching(Resync::Outage);
            }
        }
    }

    pub(super) fn drain(&mut self) {
        if let Some((id, command)) = self.flight.next_waiting() {
            self.flight.first(Todo::Drain);
            self.serve(id, command);
        }
    }

    pub(super) fn role_check(&mut self) {
        if let Phase::Watching { role, .. } = self.phase {
            if role != self.role() {
                let grace_until = self.watches.grace_until();
                self.resync_after_watching(Resync::RoleChanged { grace_until });
            }
        }
    }

    /// The read of this sync takes the control keys alone: a member's, at join or after
    /// an outage. A change of role reads the whole run: a new coordinator seals from
    /// every registration, and a former one compares what it knew with the snapshot.
    pub(super) fn control_read(&self) -> bool {
        matches!(self.phase, Phase::Syncing(Resync::First | Resync::Outage))
            && !self.watches.whole_read()
            && self.role() == Role::Member
    }
}

/// The view a ranged read of the run gives.
pub(super) fn fresh_view(m: &Machine, kvs: &[Kv]) -> View {
    // The refusals already said stay said: each re-read of the run (every re-sync) logged
    // every refused record once more.
    let mut fresh = View {
        allowed: m.view.allowed.clone(),
        refused: m.view.refused.clone(),
        ..View::default()
    };
    for kv in kvs {
        put_kv(&mut fresh, &m.cfg.keys, kv);
    }
    let present: std::collections::HashSet<&str> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    fresh.refused.retain(|k, _| present.contains(k.as_str()));
    fresh
}

/// Applies a stored key and value to `v`.
pub(super) fn put_kv(v: &mut View, keys: &crate::etcd::keys::Keys, kv: &Kv) {
    v.put(
        keys,
        &kv.key,
        &kv.value,
        kv.create_rev,
        kv.mod_rev,
        kv.lease,
    );
}
