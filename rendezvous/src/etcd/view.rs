//! What an agent knows of its run: the keys under the run's prefix, decoded and checked.
//! Built from a snapshot (a ranged read) and kept current by watch events.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use fsdp_proto::v1;

use super::keys::Keys;
use super::record::{self, Allowed, At};

/// A registered member and the revision that created its key (its join order).
#[derive(Debug, Clone)]
pub struct MemberEntry {
    pub record: v1::Member,
    pub create_rev: i64,
}

/// The sealed round and the revision that wrote it (the fence for the next commit).
#[derive(Debug, Clone)]
pub struct RoundEntry {
    /// Shared: the view is copied to the handle at every change, and a round of a
    /// thousand members copied each time was most of a re-form's time at that size.
    pub record: std::sync::Arc<v1::Round>,
    pub mod_rev: i64,
}

/// A member key seen deleted: which incarnation of the node went ([`v1::Member`]'s
/// `incarnation`; `u64::MAX` when unknown, so that it counts for any), and when it was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Departed {
    pub at: Instant,
    pub incarnation: u64,
}

/// Why a node left, and the revision that wrote it (the order of departures: etcd's, not
/// the writers' clocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftEntry {
    pub record: v1::Left,
    pub mod_rev: i64,
}

/// A worker fault report as the view keeps it: when its agent saw the exit, and the
/// revision at which the report reached etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultSeen {
    pub exited_ms: u64,
    pub rev: i64,
}

/// Rounds [`View::broken`] keeps.
pub const BROKEN_KEPT: usize = 16;

#[derive(Debug, Clone, Default)]
pub struct View {
    /// The view was read from etcd (the first sync's read, or a later one; the watches
    /// that keep it current open right after).
    pub connected: bool,
    /// Registered members. Complete for the coordinator; for other agents, the last
    /// snapshot minus departures (they do not receive registrations). The machine's
    /// only: the view published to the handle has none ([`View::for_handle`]).
    pub members: BTreeMap<String, MemberEntry>,
    /// Members whose key was deleted (lease expired or revoked): the registration that
    /// went, and when it was seen. A later registration of the same node is not departed.
    pub departed: BTreeMap<String, Departed>,
    pub round: Option<RoundEntry>,
    /// The round `round` replaced, if it held a lower number: a halt may come from its
    /// members ([`super::record`]).
    pub previous_round: Option<std::sync::Arc<v1::Round>>,
    /// A round sealed as a delta of a round this view does not hold, or placed: the
    /// roster, or the placement, must be read.
    pub round_wanted: Option<u64>,
    /// The header of a placed round ([`super::placement`]) whose placement is read next,
    /// and its revision; the machine's only.
    pub placing: Option<RoundEntry>,
    pub master: Option<v1::Master>,
    pub failures: BTreeSet<u64>,
    /// Per round, the members whose workers all succeeded.
    pub done: BTreeMap<u64, BTreeSet<String>>,
    pub coordinator: Option<String>,
    /// The lease the coordinator key lives on (0: none): the coordinator's seal is fenced
    /// on it (`session::records::commit_round`).
    pub coordinator_lease: i64,
    /// Keys holding values that do not decode (garbage, another schema), with the
    /// reason: the rendezvous stops with a clear error naming the key.
    pub corrupt: BTreeMap<String, String>,
    /// Keys holding records that decode but that this node refuses ([`Allowed`]; a
    /// registration that is not its own key's, a round no agent of this run could seal),
    /// with the reason: ignored, logged once.
    pub refused: BTreeMap<String, String>,
    /// What this node accepts from the records others write.
    pub allowed: Allowed,
    /// The revision of a round record this node refused, newer than the round it holds:
    /// the next seal is fenced on it, so that it replaces the forgery.
    pub refused_round_rev: Option<i64>,
    /// How each lost member's loss was noticed, by node (the latest round's record).
    pub noticed: BTreeMap<String, v1::Noticed>,
    /// Per round, the nodes that saw their own worker fail, with when and the revision of
    /// their report ([`View::first_fault`] finds the origin); the latest rounds only.
    pub faults: BTreeMap<u64, BTreeMap<String, FaultSeen>>,
    /// Machines kept out of the run, by machine.
    pub quarantine: BTreeMap<String, v1::Quarantine>,
    /// Nodes whose health check fails, by node.
    pub unhealthy: BTreeMap<String, v1::Unhealthy>,
    /// A node ended the run for everyone.
    pub halt: Option<v1::Halt>,
    /// Why nodes left, by key tail ([`super::record::left_tail`]); the machine's and
    /// status's only: the handle decides nothing from them ([`View::for_handle`]).
    pub left: BTreeMap<String, LeftEntry>,
    /// For each recent round (the last [`BROKEN_KEPT`]), the first member said to have
    /// left it (not a finish): how the others went is said by nobody
    /// ([`crate::etcd::left::news`]), and the handle reports them so.
    pub broken: BTreeMap<u64, String>,
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

impl View {
    /// The view the agent loop's handle reads: all of it but the registrations, which
    /// only the machine reads (the coordinator's seal runs there). The session publishes a
    /// copy at each change; with the registrations in it, a coordinator of a thousand
    /// nodes copied a thousand entries for each registration it received, and every agent
    /// a thousand for each departure.
    pub fn for_handle(&self) -> View {
        // Every field named, so that a new one is a decision here.
        let View {
            connected,
            members: _,
            departed,
            round,
            previous_round,
            round_wanted,
            placing: _,
            master,
            failures,
            done,
            coordinator,
            coordinator_lease,
            corrupt,
            refused,
            allowed,
            refused_round_rev,
            noticed,
            faults,
            quarantine,
            unhealthy,
            halt,
            left: _,
            broken,
            hangs,
            lease_safe_until,
            incarnation,
            gave_up,
        } = self;
        View {
            connected: *connected,
            members: BTreeMap::new(),
            departed: departed.clone(),
            round: round.clone(),
            previous_round: previous_round.clone(),
            round_wanted: *round_wanted,
            placing: None,
            master: master.clone(),
            failures: failures.clone(),
            done: done.clone(),
            coordinator: coordinator.clone(),
            coordinator_lease: *coordinator_lease,
            corrupt: corrupt.clone(),
            refused: refused.clone(),
            allowed: allowed.clone(),
            refused_round_rev: *refused_round_rev,
            noticed: noticed.clone(),
            faults: faults.clone(),
            quarantine: quarantine.clone(),
            unhealthy: unhealthy.clone(),
            halt: halt.clone(),
            left: BTreeMap::new(),
            broken: broken.clone(),
            hangs: hangs.clone(),
            lease_safe_until: *lease_safe_until,
            incarnation: *incarnation,
            gave_up: gave_up.clone(),
        }
    }

    /// The members of `round` whose workers have not all succeeded (none: it finished).
    /// For a member's copy of a placed round, which lists only itself and its neighbour,
    /// the others are counted, not named.
    pub fn unfinished(&self, round: &v1::Round) -> Vec<String> {
        let done = self.done.get(&round.number);
        let mut out: Vec<String> = round
            .members
            .iter()
            .filter(|m| !done.is_some_and(|d| d.contains(&m.node_id)))
            .map(|m| m.node_id.clone())
            .collect();
        if round.placed.is_some() {
            let finished = done.map_or(0, BTreeSet::len);
            let others = (round.group_world_size as usize).saturating_sub(finished + out.len());
            if others > 0 {
                out.push(format!("{others} other member(s)"));
            }
        }
        out
    }

    /// The current round finished: every member's workers succeeded and the members are
    /// leaving, so their departures end the job rather than break the round.
    pub fn round_finished(&self) -> bool {
        self.round
            .as_ref()
            .is_some_and(|r| self.unfinished(&r.record).is_empty())
    }

    /// The node whose worker failed first in `round`: the earliest exit its agent saw,
    /// then the report that reached etcd first. A secondary failure (a collective cut by
    /// the first one's exit) can reach etcd first when the first node's agent is busy;
    /// it cannot have exited first. Reports without a time (older agents) are ordered by
    /// revision alone.
    pub fn first_fault(&self, round: u64) -> Option<String> {
        let reports = self.faults.get(&round)?;
        let timed = reports.values().all(|f| f.exited_ms > 0);
        reports
            .iter()
            .min_by_key(|(node, f)| (if timed { f.exited_ms } else { 0 }, f.rev, *node))
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

    /// Applies a put of `value` at `key`, written under `lease` (0: none): what it does is
    /// the record's declaration ([`super::record`]).
    pub fn put(
        &mut self,
        keys: &Keys,
        key: &str,
        value: &[u8],
        create_rev: i64,
        mod_rev: i64,
        lease: i64,
    ) {
        let at = At {
            create_rev,
            mod_rev,
            lease,
        };
        record::put(self, keys, key, value, at);
    }

    /// Applies a delete of `key`, seen at `now`; `prev` is the deleted value when the
    /// event carried it.
    pub fn delete(&mut self, keys: &Keys, key: &str, now: Instant, prev: Option<&[u8]>) {
        record::delete(self, keys, key, now, prev);
    }

    /// The revision the round key has, as far as this view knows: the fence of the next
    /// commit (a refused round's, if one replaced the round it holds).
    pub fn round_fence(&self) -> Option<i64> {
        let held = self.round.as_ref().map(|r| r.mod_rev);
        held.max(self.refused_round_rev)
    }

    /// Refuses the record at `key` for `why`: it stays out of the view, and the refusal
    /// is logged once (again only if the reason changes).
    pub fn refuse(&mut self, key: &str, why: String) {
        if self.refused.get(key) != Some(&why) {
            // Both from the store: shown, never obeyed by the terminal.
            let (shown_key, shown_why) = (crate::text::shown(key), crate::text::shown(&why));
            tracing::warn!(key = %shown_key, "refused a record: {shown_why}; ignoring it");
            self.refused.insert(key.to_owned(), why);
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
        .map(|r| &*r.record)
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

#[cfg(test)]
mod tests;
