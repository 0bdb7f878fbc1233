//! What an agent knows of its run: the keys under the run's prefix, decoded and checked.
//! Built from a snapshot (a ranged read) and kept current by watch events.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use fsdp_proto::{Versioned, decode, v1};

use super::keys::Keys;
use crate::ranks;

/// A registered member and the revision that created its key (its join order).
#[derive(Debug, Clone)]
pub struct MemberEntry {
    pub record: v1::Member,
    pub create_rev: i64,
}

/// The sealed round and the revision that wrote it (the fence for the next commit).
#[derive(Debug, Clone)]
pub struct RoundEntry {
    pub record: v1::Round,
    pub mod_rev: i64,
}

/// A member key seen deleted: which incarnation of the node went ([`v1::Member`]'s
/// `incarnation`; `u64::MAX` when unknown, so that it counts for any), and when it was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Departed {
    pub at: Instant,
    pub incarnation: u64,
}

/// Rounds whose hang reports a view keeps.
const HANG_ROUNDS_KEPT: usize = 4;
/// Rounds whose faults a view keeps (quarantine looks at the last few failed rounds).
const FAULT_ROUNDS_KEPT: usize = 32;

#[derive(Debug, Clone, Default)]
pub struct View {
    /// A watch is established and the view is current.
    pub connected: bool,
    /// Registered members. Complete for the coordinator; for other agents, the last
    /// snapshot minus departures (they do not receive registrations).
    pub members: std::sync::Arc<BTreeMap<String, MemberEntry>>,
    /// Members whose key was deleted (lease expired or revoked): the registration that
    /// went, and when it was seen. A later registration of the same node is not departed.
    pub departed: BTreeMap<String, Departed>,
    pub round: Option<RoundEntry>,
    pub master: Option<v1::Master>,
    pub failures: BTreeSet<u64>,
    /// Per round, the members whose workers all succeeded.
    pub done: BTreeMap<u64, BTreeSet<String>>,
    pub coordinator: Option<String>,
    /// Keys holding values we cannot trust, with the reason.
    pub corrupt: BTreeMap<String, String>,
    /// How each lost member's loss was noticed, by node (the latest round's record).
    pub gone: BTreeMap<String, v1::Gone>,
    /// Per round, the nodes that saw their own worker fail, with the revision of their
    /// report (the first is the origin); the latest rounds only.
    pub faults: BTreeMap<u64, BTreeMap<String, i64>>,
    /// Machines kept out of the run, by machine.
    pub quarantine: BTreeMap<String, v1::Quarantine>,
    /// Nodes whose health check fails, by node.
    pub unhealthy: BTreeMap<String, v1::Unhealthy>,
    /// A node ended the run for everyone.
    pub halt: Option<v1::Halt>,
    /// Hang reports of the latest rounds that hung, by round and node.
    pub hangs: BTreeMap<u64, BTreeMap<String, v1::HangReport>>,
    /// The earliest moment etcd could expire this agent's lease ([`crate::fence`]); not
    /// from the keys but from the session's lease traffic.
    pub lease_safe_until: Option<Instant>,
    /// This agent's registration now ([`v1::Member`]'s `incarnation`): a round that names
    /// an older one of this node was sealed from a registration that is gone.
    pub incarnation: u64,
    /// Why the session gave up on etcd (an outage longer than its bound); nothing more
    /// will come.
    pub gave_up: Option<String>,
}

fn decoded<T: Versioned>(
    corrupt: &mut BTreeMap<String, String>,
    key: &str,
    value: &[u8],
) -> Option<T> {
    match decode::<T>(key, value) {
        Ok(r) => {
            corrupt.remove(key);
            Some(r)
        }
        Err(e) => {
            corrupt.insert(key.to_owned(), e.to_string());
            None
        }
    }
}

impl View {
    /// The registrations, to change. Shared with the views published before (a view is
    /// cloned to every reader of the session at each change; with a thousand members, a
    /// copy per change of every agent was most of a re-form's time): copied on the first
    /// change after a publish, not at each.
    pub fn members_mut(&mut self) -> &mut BTreeMap<String, MemberEntry> {
        std::sync::Arc::make_mut(&mut self.members)
    }

    /// The members of `round` whose workers have not all succeeded (none: it finished).
    pub fn unfinished(&self, round: &v1::Round) -> Vec<String> {
        let done = self.done.get(&round.number);
        round
            .members
            .iter()
            .filter(|m| !done.is_some_and(|d| d.contains(&m.node_id)))
            .map(|m| m.node_id.clone())
            .collect()
    }

    /// The current round finished: every member's workers succeeded and the members are
    /// leaving, so their departures end the job rather than break the round.
    pub fn round_finished(&self) -> bool {
        self.round
            .as_ref()
            .is_some_and(|r| self.unfinished(&r.record).is_empty())
    }

    /// The node whose fault report for `round` reached etcd first.
    pub fn first_fault(&self, round: u64) -> Option<String> {
        self.faults
            .get(&round)?
            .iter()
            .min_by_key(|(node, rev)| (**rev, (*node).clone()))
            .map(|(node, _)| node.clone())
    }

    /// Whether `m` (a member as a round names it) was seen to go at or after `since`: its
    /// own incarnation or a later one. An earlier incarnation's departure is not: the
    /// node registered again since, and the round was sealed with the new registration.
    pub fn departed_since(&self, m: &v1::Member, since: Instant) -> bool {
        if crate::switches::OLD_DEPARTURES.with(std::cell::Cell::get) {
            return self.departed.get(&m.node_id).is_some_and(|d| d.at >= since);
        }
        self.departed
            .get(&m.node_id)
            .is_some_and(|d| d.at >= since && d.incarnation >= m.incarnation)
    }

    /// Records that incarnation `incarnation` of `node` went, seen at `now`.
    pub fn depart(&mut self, node: &str, incarnation: u64, now: Instant) {
        self.departed.insert(
            node.to_owned(),
            Departed {
                at: now,
                incarnation,
            },
        );
    }

    /// The halt of the run, if a node ended it.
    pub fn halted(&self) -> Option<crate::Halt> {
        self.halt.as_ref().map(|h| crate::Halt {
            node_id: h.node_id.clone(),
            exit_code: u8::try_from(h.exit_code).unwrap_or(u8::MAX),
            reason: h.reason.clone(),
        })
    }

    /// Applies a put of `value` at `key`, written under `lease` (0: none).
    pub fn put(
        &mut self,
        keys: &Keys,
        key: &str,
        value: &[u8],
        create_rev: i64,
        mod_rev: i64,
        lease: i64,
    ) {
        if let Some(id) = key.strip_prefix(&keys.members()) {
            if let Some(record) = decoded::<v1::Member>(&mut self.corrupt, key, value) {
                if let Err(why) = check_member(id, &record, lease) {
                    self.corrupt
                        .insert(key.to_owned(), format!("member record at {key} {why}"));
                    return;
                }
                self.members_mut()
                    .insert(id.to_owned(), MemberEntry { record, create_rev });
            }
        } else if key == keys.round() {
            if let Some(record) = decoded::<v1::Round>(&mut self.corrupt, key, value) {
                if let Err(why) = check_round(&record) {
                    self.corrupt
                        .insert(key.to_owned(), format!("round record at {key} {why}"));
                    return;
                }
                self.round = Some(RoundEntry { record, mod_rev });
            }
        } else if key == keys.master() {
            match decoded::<v1::Master>(&mut self.corrupt, key, value) {
                Some(m) if !(1..=u32::from(u16::MAX)).contains(&m.port) || m.addr.is_empty() => {
                    self.corrupt.insert(
                        key.to_owned(),
                        format!(
                            "master record at {key} has address '{}' and port {}, not a host and a port 1-65535",
                            m.addr, m.port
                        ),
                    );
                }
                Some(m) => self.master = Some(m),
                None => {}
            }
        } else if key == keys.coordinator() {
            if let Some(c) = decoded::<v1::Coordinator>(&mut self.corrupt, key, value) {
                self.coordinator = Some(c.node_id);
            }
        } else if key.starts_with(&keys.gone_prefix()) {
            if let Some(g) = decoded::<v1::Gone>(&mut self.corrupt, key, value) {
                let newer = self
                    .gone
                    .get(&g.node_id)
                    .is_none_or(|old| old.round <= g.round);
                if newer {
                    self.gone.insert(g.node_id.clone(), g);
                }
            }
        } else if key.starts_with(&keys.faults_prefix()) {
            if let Some(f) = decoded::<v1::Fault>(&mut self.corrupt, key, value) {
                let round = self.faults.entry(f.round).or_default();
                round.entry(f.node_id).or_insert(mod_rev);
                while self.faults.len() > FAULT_ROUNDS_KEPT {
                    self.faults.pop_first();
                }
            }
        } else if let Some(machine) = key.strip_prefix(&keys.quarantine_prefix()) {
            if let Some(q) = decoded::<v1::Quarantine>(&mut self.corrupt, key, value) {
                self.quarantine.insert(machine.to_owned(), q);
            }
        } else if let Some(id) = key.strip_prefix(&keys.unhealthy_prefix()) {
            if let Some(u) = decoded::<v1::Unhealthy>(&mut self.corrupt, key, value) {
                self.unhealthy.insert(id.to_owned(), u);
            }
        } else if key == keys.halt() {
            if let Some(h) = decoded::<v1::Halt>(&mut self.corrupt, key, value) {
                self.halt = Some(h);
            }
        } else if key.starts_with(&keys.hang_prefix()) {
            if let Some(h) = decoded::<v1::HangReport>(&mut self.corrupt, key, value) {
                self.hangs
                    .entry(h.round)
                    .or_default()
                    .insert(h.node_id.clone(), h);
                // Only the latest hangs matter (the declaring node names the culprit at
                // the next round; status shows the last one).
                while self.hangs.len() > HANG_ROUNDS_KEPT {
                    self.hangs.pop_first();
                }
            }
        } else if key.starts_with(&keys.done_prefix()) {
            if let Some(d) = decoded::<v1::Done>(&mut self.corrupt, key, value) {
                self.done.entry(d.round).or_default().insert(d.node_id);
            }
        } else if key.starts_with(&keys.failures()) {
            if let Some(f) = decoded::<v1::Failure>(&mut self.corrupt, key, value) {
                self.failures.insert(f.round);
            }
        } else if keys.nested_run_key(key) {
            // Another run whose prefix lies under ours: its keys are not ours to judge
            // (agents refuse to start such a run; this keeps a race harmless).
        } else {
            self.corrupt.insert(
                key.to_owned(),
                format!("unexpected key {key} under the run's prefix"),
            );
        }
    }

    /// Applies a delete of `key`, seen at `now`; `prev` is the deleted value when the
    /// event carried it.
    pub fn delete(&mut self, keys: &Keys, key: &str, now: Instant, prev: Option<&[u8]>) {
        self.corrupt.remove(key);
        if let Some(id) = key.strip_prefix(&keys.members()) {
            let known = self.members_mut().remove(id).map(|m| m.record.incarnation);
            let went = prev
                .and_then(|value| decode::<v1::Member>(key, value).ok())
                .map(|m| m.incarnation)
                .or(known)
                .unwrap_or(u64::MAX);
            self.depart(id, went, now);
        } else if key == keys.round() {
            self.round = None;
        } else if key == keys.master() {
            self.master = None;
        } else if key == keys.coordinator() {
            self.coordinator = None;
        } else if key == keys.halt() {
            self.halt = None;
        } else if let Some(id) = key.strip_prefix(&keys.unhealthy_prefix()) {
            self.unhealthy.remove(id);
        } else if let Some(machine) = key.strip_prefix(&keys.quarantine_prefix()) {
            self.quarantine.remove(machine);
        }
    }

    /// The first untrusted value, as an error message naming its key.
    pub fn corruption(&self) -> Option<String> {
        self.corrupt.values().next().cloned()
    }
}

/// The members `old` knew of — registrations, its round's members, and those of the round
/// this agent runs — and the members of the snapshot `fresh`'s round, that `fresh` has no
/// registration for, each with the latest incarnation known: they left while the watches
/// were being switched, and no delete event will say so. (A node that only the round
/// names matters most: a member's view holds registrations from its last snapshot only,
/// and a rank 0 that left between the snapshot and the switch took the master with it,
/// leaving the others waiting for a master that never comes.)
pub fn left_between(old: &View, running: Option<&v1::Round>, fresh: &View) -> Vec<(String, u64)> {
    let mut known: BTreeMap<&str, u64> = BTreeMap::new();
    let rounds = [old.round.as_ref(), fresh.round.as_ref()]
        .into_iter()
        .flatten()
        .map(|r| &r.record)
        .chain(running);
    let named = old
        .members
        .values()
        .map(|m| &m.record)
        .chain(rounds.flat_map(|r| r.members.iter()));
    for m in named.filter(|m| !fresh.members.contains_key(&m.node_id)) {
        let i = known.entry(m.node_id.as_str()).or_default();
        *i = (*i).max(m.incarnation);
    }
    known
        .into_iter()
        .map(|(id, i)| (id.to_owned(), i))
        .collect()
}

/// A registration is trusted only if it names its own key, is bound to a lease (a live
/// agent's always is: without one it would never go away) and asks for a sane number of
/// workers.
fn check_member(id: &str, m: &v1::Member, lease: i64) -> Result<(), String> {
    if m.node_id != id {
        return Err(format!("names another node ({})", m.node_id));
    }
    if lease == 0 {
        return Err("is not bound to a lease (agents always register under theirs)".into());
    }
    if m.local_world_size == 0 || m.local_world_size > ranks::MAX_LOCAL_WORLD_SIZE {
        return Err(format!(
            "has local_world_size {}, outside 1..={}",
            m.local_world_size,
            ranks::MAX_LOCAL_WORLD_SIZE
        ));
    }
    Ok(())
}

/// A round is trusted only if its members are distinct and their worker counts form a
/// group without overflowing the rank arithmetic.
fn check_round(r: &v1::Round) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    if let Some(dup) = r.members.iter().find(|m| !seen.insert(m.node_id.as_str())) {
        return Err(format!("lists node {} twice", dup.node_id));
    }
    let sizes: Vec<u32> = r.members.iter().map(|m| m.local_world_size).collect();
    ranks::assign(&sizes).map(drop)
}

#[cfg(test)]
mod tests;
