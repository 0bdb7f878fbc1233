//! Pure functions of the view: what a waiting agent does next ([`step`]), whether the
//! round an agent holds is still the group's ([`detect`]).

use std::time::Instant;

use fsdp_proto::v1;

use super::View;
use crate::{Change, RendezvousError, Round};

/// What `next_round` should do after looking at the view.
pub(crate) enum Step {
    Wait,
    /// The round `next - 1` was sealed without this node; it had `members` nodes.
    Spare {
        next: u64,
        members: usize,
    },
    Broken {
        next: u64,
        change: Change,
    },
    PublishMaster {
        round: u64,
    },
    /// The round record is the view's own (shared): a member list is not copied per round.
    Done(Box<(std::sync::Arc<v1::Round>, Round)>),
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
            members: group_size(rec),
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
    let broken = |change| {
        Ok(Step::Broken {
            next: rec.number + 1,
            change,
        })
    };
    if rec.members[pos].incarnation < v.incarnation {
        // Sealed from a registration of this node that is gone (an earlier process, or a
        // lease it gave up): the coordinator seals the next round with the current one.
        let node = me.to_owned();
        return broken(Change::MemberLost { node });
    }
    // Broken already (a member left, a failure was reported; e.g. rank 0 died before
    // publishing the master): come back for the next one. Waiting would leave everyone
    // waiting for a master that never comes while the coordinator waits for them, and
    // workers started now would only be stopped again.
    if let Some(change) = detect(v, rec, me, since) {
        return broken(change);
    }
    let master = v.master.as_ref().filter(|m| m.round == rec.number);
    let Some(master) = master else {
        return Ok(
            if group_rank(rec, pos) == 0 && published != Some(rec.number) {
                Step::PublishMaster { round: rec.number }
            } else {
                Step::Wait
            },
        );
    };
    // The view admits only ports 1-65535.
    let at = (
        master.addr.clone(),
        u16::try_from(master.port).unwrap_or_default(),
    );
    let round = joined(rec, pos, at)?;
    Ok(Step::Done(Box::new((std::sync::Arc::clone(rec), round))))
}

/// Round `rec`, which names `me`, as this node would have run it had it not broken with
/// `change` before it started: for its restart count (no master: it never runs).
pub(crate) fn broken_round(rec: &v1::Round, me: &str, change: Change) -> Option<Round> {
    let pos = rec.members.iter().position(|m| m.node_id == me)?;
    let mut round = joined(rec, pos, (String::new(), 0)).ok()?;
    round.broken = Some(change);
    Some(round)
}

/// Whether `rec` lists every member of its round: not a member's copy of a placed round,
/// nor its header alone.
pub(crate) fn lists_all(rec: &v1::Round) -> bool {
    rec.placed.is_none() && (rec.shards == 0 || rec.members.len() == rec.group_world_size as usize)
}

/// The nodes in round `rec`: counted by its header when it is placed.
fn group_size(rec: &v1::Round) -> usize {
    if rec.shards > 0 {
        rec.group_world_size as usize
    } else {
        rec.members.len()
    }
}

/// The group rank of the member at `pos` in `rec`: its place, in a member's copy of a
/// placed round (which lists it first, then its neighbour).
fn group_rank(rec: &v1::Round, pos: usize) -> u32 {
    rec.placed
        .as_ref()
        .map_or(u32::try_from(pos).unwrap_or(u32::MAX), |p| p.group_rank)
}

/// Round `rec` as this node, at position `pos`, runs it with the master at `at`.
fn joined(rec: &v1::Round, pos: usize, at: (String, u16)) -> Result<Round, RendezvousError> {
    let corrupt = |e| RendezvousError::Corrupt(format!("round {}: {e}", rec.number));
    let mut round = match &rec.placed {
        // A member's copy of a placed round: its own ranks, as placed; the group's sizes
        // from the header. It lists the member alone.
        Some(p) => {
            let me = crate::RoundMember::placed(&rec.members[pos], p.group_rank, p.base_rank);
            let mut round = Round::of_ranked(
                rec.number,
                std::sync::Arc::from([me]),
                rec.world_size,
                0,
                at,
                rec.restart_count,
                rec.reason.clone(),
            )
            .map_err(corrupt)?;
            round.group_world_size = rec.group_world_size;
            round
        }
        None => {
            let (members, world_size) = super::record::ranked(&rec.members).map_err(corrupt)?;
            Round::of_ranked(
                rec.number,
                members,
                world_size,
                pos,
                at,
                rec.restart_count,
                rec.reason.clone(),
            )
            .map_err(corrupt)?
        }
    };
    // A record from before the field existed: the charges of the whole run count.
    if rec.sealed_at_ms > 0 {
        round.sealed_at_ms = rec.sealed_at_ms;
        // The charges as their ages at the seal (monotonic clocks only), put back on the
        // seal's time: the window compares them with that time alone, so no other host's
        // wall clock enters the count.
        round.charged_at_ms = super::coordinator::ages(rec)
            .map(|age| rec.sealed_at_ms.saturating_sub(age))
            .collect();
    } else {
        round.charged_at_ms = rec.charged_at_ms.clone();
    }
    Ok(round)
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
    // Looked at on every change of the view: the members are scanned only when someone
    // went since (most views have no departure at all).
    let any_went = v.departed.values().any(|d| d.at >= since);
    let lost = any_went.then(|| {
        let mine = held.members.iter().find(|m| m.node_id == me);
        let others = held.members.iter().filter(|m| m.node_id != me);
        mine.into_iter().chain(others).find(|m| departed(m))
    });
    if let Some(m) = lost.flatten() {
        return Some(Change::MemberLost {
            node: m.node_id.clone(),
        });
    }
    match v.round.as_ref().map(|r| &r.record) {
        Some(r) if r.number > held.number || another_seal(r, held) => {
            if r.members.iter().any(|m| m.node_id == me) {
                // A member does not watch registrations: when the coordinator's next round
                // comes before the word of a loss, the round itself says who is missing
                // (as the deleted registration said before; the agent tells a loss from a
                // change of membership by it).
                // A member's copy of a placed round lists only it and its neighbour:
                // the next round names who of it it left out.
                // Compared member by member only when both list every member: a copy
                // that lacks most of them would name live nodes lost.
                let missing: Vec<&str> = if lists_all(held) && lists_all(r) {
                    crate::lacking::lacking(&held.members, &r.members, |m| &m.node_id)
                } else {
                    r.dropped.iter().map(String::as_str).collect()
                };
                let missing = missing
                    .into_iter()
                    .find(|id| *id != me && !done.is_some_and(|d| d.contains(*id)));
                Some(match missing {
                    Some(node) => Change::MemberLost {
                        node: node.to_owned(),
                    },
                    None => Change::NewRound { number: r.number },
                })
            } else {
                Some(Change::MemberLost {
                    node: me.to_owned(),
                })
            }
        }
        _ => None,
    }
}

/// Whether `r` is another round under the number of the one held. An etcd that lost its
/// data lost the round record too; its members write the round they run back, but a
/// coordinator that never saw that round (frozen meanwhile) can seal its own under the
/// same number first. A member of both took it for the round it runs, the others waited
/// for it without end (found by the simulator: seed 8847, an empty restart of etcd as a
/// frozen node came back). The same round written back has the same nodes in the same
/// order and the same seal time.
fn another_seal(r: &v1::Round, held: &v1::Round) -> bool {
    // Looked at on every change of the view, most often with the very record held (the
    // view's, shared): then nothing is compared.
    if r.number != held.number || std::ptr::eq(r, held) {
        return false;
    }
    let sealed_apart =
        r.sealed_at_ms != 0 && held.sealed_at_ms != 0 && r.sealed_at_ms != held.sealed_at_ms;
    // A placed round's copies list different members (a member's, itself and its
    // neighbour; a coordinator's, all): its seal's time tells it apart.
    if r.shards > 0 || held.shards > 0 {
        return sealed_apart;
    }
    let (a, b) = (r.members.iter(), held.members.iter());
    sealed_apart || !a.map(|m| &m.node_id).eq(b.map(|m| &m.node_id))
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

/// Whether `round` was sealed with registration `incarnation` of node `me`.
pub(crate) fn names(round: &v1::Round, me: &str, incarnation: u64) -> bool {
    round
        .members
        .iter()
        .any(|m| m.node_id == me && m.incarnation == incarnation)
}

/// Whether this node's registration — incarnation `incarnation`, written and still in
/// etcd — already makes it a member of round `wants`, so that asking for that round
/// writes nothing: a re-form after a loss costs the coordinator's one round write, not
/// one registration per survivor (1,000 of them at 1,000 nodes, which put etcd behind
/// until the group collapsed).
///
/// It stands when the coordinator already sealed round `wants` (or a later one) with this
/// incarnation in it, or when the round before `wants` names this incarnation and broke
/// by a member's departure alone: the coordinator seals the survivors whose keys are still
/// there without waiting for a word from them. It does not stand after a reported failure
/// (the coordinator waits for every member of the failed round to say it stopped, so that
/// a dying peer is not charged as a failure), when a health record of this node is there
/// (a registration clears it), or when the round is intact (the node wants a new round
/// for a reason of its own, which only its registration says). A coordinator that went
/// is claimed in turn by the session, not by every registration.
pub(crate) fn registration_stands(v: &View, me: &str, incarnation: u64, wants: u64) -> bool {
    if v.unhealthy.contains_key(me) || v.halted().is_some() {
        return false;
    }
    let Some(round) = v.round.as_ref().map(|r| &r.record) else {
        return false;
    };
    let names_me = names(round, me, incarnation);
    if round.number >= wants || !names_me {
        return names_me;
    }
    if round.number + 1 != wants || v.failures.contains(&round.number) {
        return false;
    }
    let done = v.done.get(&round.number);
    round.members.iter().any(|m| {
        m.node_id != me
            && v.departed
                .get(&m.node_id)
                .is_some_and(|d| d.incarnation >= m.incarnation)
            && !done.is_some_and(|d| d.contains(&m.node_id))
    })
}
