//! The records of why nodes left (`ctl/left/`), as pure functions of a [`View`]: the word a
//! node writes as it goes, the "lost" the coordinator writes for a member whose
//! registration vanished without one, and which old records go so that the last [`KEPT`]
//! stay.
//!
//! One departure has one key, `<node>/<incarnation>` of the registration that went: the
//! node's own word and the coordinator's "lost" meet there, so a race between them leaves
//! one row (the coordinator writes only while the key is absent; the node's put replaces
//! it, unless etcd holds a departing member's word back as not the round's first:
//! `session::records::say_left`). The records are information for `fsdp-agent status`; nothing an agent decides
//! reads them.

use std::collections::{BTreeMap, BTreeSet};

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::record::left_detail;
use super::view::{LeftEntry, RoundEntry, View};
use crate::{LeftKind, LeftReason};

/// Departures a run keeps.
pub const KEPT: usize = 100;

/// Deletes one transaction carries at most: etcd refuses a transaction of more than 128
/// operations by default (`--max-txn-ops`), and a flood of departures may leave many more
/// than that to trim.
pub const TRIM_PER_TXN: usize = 64;

/// A departure the coordinator has dealt with: node and incarnation.
pub type Departure = (String, u64);

/// The record of `node`'s departure as it writes it.
pub struct Word<'a> {
    pub node_id: &'a str,
    /// The registration that goes.
    pub incarnation: u64,
    pub addr: &'a str,
    pub round: u64,
    pub at_ms: u64,
    /// Who writes it (the node itself, or the coordinator).
    pub by: &'a str,
}

impl Word<'_> {
    pub fn record(&self, why: &LeftReason) -> v1::Left {
        v1::Left {
            schema: SCHEMA_VERSION,
            node_id: self.node_id.to_owned(),
            incarnation: self.incarnation,
            addr: self.addr.to_owned(),
            kind: kind(why.kind).into(),
            detail: left_detail(&why.detail),
            at_ms: self.at_ms,
            round: self.round,
            written_by: self.by.to_owned(),
        }
    }
}

/// The record's kind for `k`.
pub fn kind(k: LeftKind) -> v1::LeftKind {
    match k {
        LeftKind::Finished => v1::LeftKind::Finished,
        LeftKind::Left => v1::LeftKind::Left,
        LeftKind::Unhealthy => v1::LeftKind::Unhealthy,
        LeftKind::Quarantined => v1::LeftKind::Quarantined,
        LeftKind::Halted => v1::LeftKind::Halted,
        LeftKind::Failed => v1::LeftKind::Failed,
        LeftKind::Fenced => v1::LeftKind::Fenced,
        LeftKind::Lost => v1::LeftKind::Lost,
    }
}

/// The kind a stored record names (`None`: none an agent writes; such records are refused
/// before they reach a view).
pub fn kind_of(l: &v1::Left) -> Option<LeftKind> {
    Some(match v1::LeftKind::try_from(l.kind).ok()? {
        v1::LeftKind::Unspecified => return None,
        v1::LeftKind::Finished => LeftKind::Finished,
        v1::LeftKind::Left => LeftKind::Left,
        v1::LeftKind::Unhealthy => LeftKind::Unhealthy,
        v1::LeftKind::Quarantined => LeftKind::Quarantined,
        v1::LeftKind::Halted => LeftKind::Halted,
        v1::LeftKind::Failed => LeftKind::Failed,
        v1::LeftKind::Fenced => LeftKind::Fenced,
        v1::LeftKind::Lost => LeftKind::Lost,
    })
}

/// The tails of the oldest records (by the revision that wrote them) to delete so that,
/// with the record at `writing` written, at most [`KEPT`] stay; at most
/// [`TRIM_PER_TXN`] of them. The record being written is never one of them.
pub fn trim(left: &BTreeMap<String, LeftEntry>, writing: Option<&str>) -> Vec<String> {
    let adding = usize::from(writing.is_some_and(|t| !left.contains_key(t)));
    let over = (left.len() + adding).saturating_sub(KEPT).min(TRIM_PER_TXN);
    let mut by_age: Vec<(i64, &String)> = left
        .iter()
        .filter(|(t, _)| Some(t.as_str()) != writing)
        .map(|(t, e)| (e.mod_rev, t))
        .collect();
    by_age.sort();
    by_age
        .into_iter()
        .take(over)
        .map(|(_, t)| t.clone())
        .collect()
}

/// The members of `round` whose departure its other members were told of, in words that
/// break it: a word written after the round was sealed, of the registration the round
/// names (or a later one), not a finish, from a node not done with the round. Once one is
/// there, another word of a departure from the round is no news to its members (they
/// stopped at the first, and the next round is sealed from the registrations): when a
/// whole run leaves at once, saying each departure to every member still watching is a
/// million events for 1,000 nodes, which kept etcd and the agents busy for seconds.
///
/// Words, not [`View::departed`]: that is what this view saw go (a coordinator sees
/// registrations deleted), and the question is what the members were told.
pub fn breakers<'r>(v: &View, round: &'r RoundEntry) -> Vec<&'r str> {
    let mut words: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for e in v.left.values().filter(|e| e.mod_rev > round.mod_rev) {
        if kind_of(&e.record) != Some(LeftKind::Finished) {
            let i = words.entry(e.record.node_id.as_str()).or_default();
            *i = (*i).max(e.record.incarnation);
        }
    }
    if words.is_empty() {
        return Vec::new();
    }
    let done = v.done.get(&round.record.number);
    round
        .record
        .members
        .iter()
        .filter(|m| {
            words
                .get(m.node_id.as_str())
                .is_some_and(|i| *i >= m.incarnation)
        })
        .filter(|m| !done.is_some_and(|d| d.contains(&m.node_id)))
        .map(|m| m.node_id.as_str())
        .collect()
}

/// Whether a word of `node`'s departure from `round` would be news to its members: none
/// of the others' departures broke it yet ([`breakers`]).
pub fn news(v: &View, round: &RoundEntry, node: &str) -> bool {
    breakers(v, round).iter().all(|b| *b == node)
}

/// A member of the sealed round whose registration is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vanished {
    pub node_id: String,
    pub incarnation: u64,
    pub addr: String,
    pub round: u64,
    /// It said why itself (a record of its own, of this registration or a later one), or
    /// it withdrew for a failing health check (it says why when it leaves): nothing to
    /// write.
    pub explained: bool,
}

/// The members of `v`'s round, `me` aside, whose registration is gone and that are not
/// in `dealt` yet. A coordinator sees every registration, so a member it does not see
/// registered is gone (the caller waits out an outage's grace first: etcd may have come
/// back empty, and the members are still registering again).
pub fn vanished(v: &View, me: &str, dealt: &BTreeSet<Departure>) -> Vec<Vanished> {
    let Some(round) = v.round.as_ref().map(|r| &r.record) else {
        return Vec::new();
    };
    round
        .members
        .iter()
        .filter(|m| m.node_id != me && !v.members.contains_key(&m.node_id))
        .filter(|m| !dealt.contains(&(m.node_id.clone(), m.incarnation)))
        .map(|m| Vanished {
            node_id: m.node_id.clone(),
            incarnation: m.incarnation,
            addr: m.addr.clone(),
            round: round.number,
            explained: said_why(v, &m.node_id, m.incarnation),
        })
        .collect()
}

/// Whether `node` said why its registration `incarnation` went.
fn said_why(v: &View, node: &str, incarnation: u64) -> bool {
    if v.unhealthy.contains_key(node) {
        return true;
    }
    v.left
        .values()
        .any(|e| e.record.node_id == node && e.record.incarnation >= incarnation)
}

/// Why the coordinator thinks `gone` was lost: how its ring neighbour proved it, if one
/// did (a [`v1::Noticed`] of that round), and whether its workers had finished.
pub fn lost_reason(v: &View, gone: &Vanished) -> LeftReason {
    let proof = v
        .noticed
        .get(&gone.node_id)
        .filter(|g| g.round == gone.round)
        .map(|g| (g.how(), g.detect_ms));
    let mut detail = match proof {
        Some((v1::Detection::Refused, ms)) => format!(
            "its status port refused a connection (the agent's process is gone), \
             proven by its ring neighbour {ms} ms after the liveness stream broke"
        ),
        Some((v1::Detection::Left, _)) => {
            "it revoked its own lease (it left) without saying why".to_owned()
        }
        _ => "its registration vanished without a word: its lease expired or was revoked \
              (the agent was killed, frozen or cut off)"
            .to_owned(),
    };
    let finished = v
        .done
        .get(&gone.round)
        .is_some_and(|d| d.contains(&gone.node_id));
    if finished {
        detail.push_str("; its workers had all finished");
    }
    LeftReason::new(LeftKind::Lost, detail)
}

#[cfg(test)]
mod tests;
