//! A round too large to send whole to every member, as pure functions: a header at
//! `ctl/round` that every member receives, and the members in shards outside `ctl/`
//! (`placement/<tag>/<shard>`), each member in the shard its node id hashes to, with its
//! ranks and its ring neighbour. A member reads its own shard; a coordinator, which needs
//! the whole round, reads them all ([`whole`]).
//!
//! Why: every member watches `ctl/`, so a round written there is sent once per member. At
//! 10,000 members that was 0.73 MB to each of them, and etcd took 27.9 s to send it all,
//! 4.4 times the floor of the whole formation (`rdzv-bench --ceiling-round`).
//!
//! Why shards of [`SHARD_MEMBERS`], in transactions of their own: when every member reads
//! its shard (a formation), the seal costs etcd a shard's bytes per member. Shards that
//! fitted the header's one transaction (at most 100) held 100 members at 10,000 and 200
//! at 20,000, and the seal had etcd answer 104 MB and 422 MB in a second or two: where
//! formations collapsed. A round of more shards than [`INLINE_SHARDS`] writes them first,
//! each transaction fenced as the header is, under a name no other attempt uses
//! ([`tag`]), and the header names them: no member reads a shard of a round not sealed,
//! and a late write of a lost attempt lands where no header points.

use fsdp_proto::v1;

/// Members in one shard (about 1 KB, packed, read by each of them).
pub const SHARD_MEMBERS: usize = 16;

/// The most shards written in the seal's own transaction, beside the header, the master
/// and the deletes of earlier rounds' shards: etcd takes at most 128 operations in one
/// (`--max-txn-ops`). A round that moves from the one it replaces ([`moved`]), whose
/// shards few read, is placed in at most this many, as large as they need be; any other
/// in as many as [`SHARD_MEMBERS`] asks for, written ahead.
pub const INLINE_SHARDS: usize = 100;

/// The most bytes of shards in one transaction: under etcd's request limit (1.5 MiB),
/// whatever a shard holds.
pub const SHARD_BYTES_PER_TXN: usize = 1 << 20;

/// How long after one transaction of a placed round's seal the next one goes: etcd's
/// backend commits its writes every 100 ms (`--backend-batch-interval`), and etcd 3.4
/// copies the buffer of writes not yet committed into every answer it sends (the
/// header's revision, read through a transaction that copies it), a copy as long as the
/// most writes one batch ever held. The shards of 10,000 members written at once (1,250
/// keys) were followed by a collapse at the seal in 3 runs of 3, with etcd's CPU mostly
/// that copy and its garbage; the same code formed once etcd committed every 100 writes
/// (`--backend-batch-limit=100`), and spaced a commit apart, 9 formations of 11.
pub const AHEAD_SPACING: std::time::Duration = std::time::Duration::from_millis(100);

/// How placed rounds are cut: [`Shape::ETCD`], for etcd's limits. The simulator cuts its
/// small rounds as finely, so that its seals write shards ahead as large ones do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Members in one shard.
    pub shard_members: usize,
    /// The most shards in the seal's own transaction.
    pub inline: usize,
    /// The most shards in one transaction written ahead of the header.
    pub per_txn: usize,
}

impl Shape {
    /// Shards of [`SHARD_MEMBERS`]; [`INLINE_SHARDS`] in the seal's transaction; 120 in
    /// one written ahead (under etcd's 128 operations, and at about 1 KB a shard far
    /// under its 1.5 MiB a request).
    pub const ETCD: Shape = Shape {
        shard_members: SHARD_MEMBERS,
        inline: INLINE_SHARDS,
        per_txn: 120,
    };

    /// A shard a member, one in the seal's transaction, two in one written ahead: a
    /// handful of nodes sealed as finely as thousands are (the simulator, tests).
    pub const FINEST: Shape = Shape {
        shard_members: 1,
        inline: 1,
        per_txn: 2,
    };

    /// The shards of a round of `members` members; `moves`: the round moves from the one
    /// it replaces, and its members make their copies without a read.
    pub fn shards_for(&self, members: usize, moves: bool) -> u32 {
        let n = members.div_ceil(self.shard_members.max(1)).max(1);
        let n = if moves { n.min(self.inline.max(1)) } else { n };
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

/// The name of one attempt to seal round `number`, by the coordinating process whose own
/// lease is `lease`, its `attempt`th: the segment its shards are under. Not the
/// coordinator key's lease: a process restarted under the same node id coordinates
/// under the key its predecessor left while that lease lives, and counts its attempts
/// from 0 again; under the key's lease its header named its predecessor's shards of
/// another membership beside its own (found by the simulator). The number first, padded, so that the
/// shards of older rounds sort before a newer round's and one range deletes them.
pub fn tag(number: u64, lease: i64, attempt: u64) -> String {
    format!("{number:020}.{:016x}.{attempt}", lease as u64)
}

/// Whether `tag` names an attempt to seal round `number` ([`tag`]'s form): what a
/// header's placement must be before anyone reads under it.
pub fn tag_fits(tag: &str, number: u64) -> bool {
    let mut parts = tag.split('.');
    let round = parts.next().is_some_and(|r| r == format!("{number:020}"));
    let lease = parts
        .next()
        .is_some_and(|l| l.len() == 16 && l.bytes().all(|b| b.is_ascii_hexdigit()));
    let attempt = parts
        .next()
        .is_some_and(|a| !a.is_empty() && a.len() <= 20 && a.bytes().all(|b| b.is_ascii_digit()));
    round && lease && attempt && parts.next().is_none()
}

/// The shard of `node_id` among `shards`. FNV-1a, spelled out: every agent of every
/// version must find a node in the same shard, which a standard library's hasher (free to
/// change between releases) does not promise.
pub fn shard_of(node_id: &str, shards: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    u32::try_from(h % u64::from(shards.max(1))).unwrap_or(0)
}

/// `round` (whole, its members in rank order) as its header and its shards, cut to
/// `shape`. Fails when its
/// members' worker counts do not form a group. With `base`, the whole copy of the placed
/// round it replaces and that round's revision, the header also says how `round` moves
/// from it when it only leaves members out ([`moves`]).
pub fn place(
    round: &v1::Round,
    base: Option<(&v1::Round, i64)>,
    shape: Shape,
) -> Result<(v1::Round, Vec<v1::Placement>), String> {
    let members = &round.members;
    let sizes: Vec<u32> = members.iter().map(|m| m.local_world_size).collect();
    let (ranks, world_size) = crate::ranks::assign(&sizes)?;
    let next = neighbours(members);
    let moves = base.and_then(|(base, base_rev)| {
        moves(base, base_rev, round, &next).map(|m| (base.number, base_rev, m))
    });
    let shards = shape.shards_for(members.len(), moves.is_some());
    let mut out: Vec<v1::Placement> = (0..shards)
        .map(|shard| v1::Placement {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: round.number,
            shard,
            members: Vec::new(),
        })
        .collect();
    for ((m, r), n) in members.iter().zip(ranks).zip(next.iter().copied()) {
        out[shard_of(&m.node_id, shards) as usize]
            .members
            .push(v1::Placed {
                member: Some(m.clone()),
                group_rank: r.group_rank,
                base_rank: r.base_rank,
                neighbour: n.map(|i| watched(&members[i])),
            });
    }
    let mut header = v1::Round {
        members: Vec::new(),
        shards,
        group_world_size: u32::try_from(members.len()).map_err(|e| e.to_string())?,
        world_size,
        placed: None,
        ..round.clone()
    };
    if let Some((base, base_rev, (gone, rewired))) = moves {
        (header.base, header.base_rev) = (base, base_rev);
        (header.gone, header.rewired) = (gone, rewired);
    }
    Ok((header, out))
}

/// How `full` moves from `base`, the whole copy of the placed round it replaces (at
/// revision `base_rev`), when it keeps `base`'s members less some, in their order and with
/// the same records: the members left out at their ranks in `base`, and the members kept
/// whose ring neighbour went, with their new one. `None` for any other change (a member
/// added or registered anew, an order changed): then every member reads its shard.
fn moves(
    base: &v1::Round,
    base_rev: i64,
    full: &v1::Round,
    next: &[Option<usize>],
) -> Option<(Vec<v1::Placed>, Vec<v1::Placed>)> {
    if base.shards == 0 || base.placed.is_some() || base_rev == 0 {
        return None;
    }
    let d = crate::etcd::roster::delta(base, base_rev, full)?;
    if !d.added.is_empty() || !d.updated.is_empty() || d.removed.len() > MAX_MOVES {
        return None;
    }
    let removed: std::collections::BTreeSet<&str> = d.removed.iter().map(String::as_str).collect();
    let sizes: Vec<u32> = base.members.iter().map(|m| m.local_world_size).collect();
    let (ranks, _) = crate::ranks::assign(&sizes).ok()?;
    let gone = base
        .members
        .iter()
        .zip(&ranks)
        .filter(|(m, _)| removed.contains(m.node_id.as_str()))
        .map(|(m, r)| v1::Placed {
            member: Some(watched(m)),
            group_rank: r.group_rank,
            base_rank: r.base_rank,
            neighbour: None,
        })
        .collect();
    let before: std::collections::HashMap<&str, Option<&str>> = base
        .members
        .iter()
        .zip(neighbours(&base.members))
        .map(|(m, n)| {
            let n = n.map(|i| base.members[i].node_id.as_str());
            (m.node_id.as_str(), n)
        })
        .collect();
    let rewired = full
        .members
        .iter()
        .zip(next.iter().copied())
        .filter(|(m, n)| {
            let now = n.map(|i| full.members[i].node_id.as_str());
            before.get(m.node_id.as_str()) != Some(&now)
        })
        .map(|(m, n)| v1::Placed {
            member: Some(watched(m)),
            neighbour: n.map(|i| watched(&full.members[i])),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    // The header goes to every member: past [`MAX_MOVES`], reading the shards costs etcd
    // less than sending every member all the moves.
    (rewired.len() <= MAX_MOVES).then_some((gone, rewired))
}

/// The most members gone, and the most rewired, that a header says (each a few dozen
/// bytes, sent to every member).
pub const MAX_MOVES: usize = 64;

/// `header` as a copy's fields: a copy holds its members (or its window), not the moves
/// it was made from.
fn plain(header: &v1::Round) -> v1::Round {
    v1::Round {
        members: Vec::new(),
        placed: None,
        base: 0,
        base_rev: 0,
        gone: Vec::new(),
        rewired: Vec::new(),
        ..header.clone()
    }
}

/// A member's copy of the round `plain`: itself and its neighbour, its place in `placed`.
fn copy(plain: v1::Round, placed: v1::Placed) -> v1::Round {
    v1::Round {
        members: placed
            .member
            .iter()
            .chain(placed.neighbour.iter())
            .cloned()
            .collect(),
        placed: Some(placed),
        ..plain
    }
}

/// The copy of the placed round `header` that `held`, a copy of the round it moves from
/// ([`v1::Round::gone`]), makes without a read: a member's own window with its ranks
/// shifted past the members gone before it and its new neighbour if its own went, or a
/// coordinator's whole copy less the members gone. `None` when `held` is not the round
/// `header` moves from, when this member is itself gone, or when the moves do not fit
/// what `held` holds: then the shard is read as for any placed round. The caller checks
/// that `held` is the very seal `header` names (its revision).
pub fn moved(held: &v1::Round, header: &v1::Round) -> Option<v1::Round> {
    let too_many = header.gone.len() > MAX_MOVES || header.rewired.len() > MAX_MOVES;
    if header.base_rev == 0 || header.shards == 0 || held.shards == 0 || too_many {
        return None;
    }
    if held.number != header.base {
        return None;
    }
    fn id(p: &v1::Placed) -> &str {
        p.member.as_ref().map_or("", |m| m.node_id.as_str())
    }
    let gone: std::collections::BTreeSet<&str> = header.gone.iter().map(id).collect();
    let plain = plain(header);
    // What the moves take out must be what the header's sizes lack: a header that says
    // otherwise is not applied (its shard is read, and judged).
    let workers_gone: u64 = header
        .gone
        .iter()
        .map(|g| u64::from(g.member.as_ref().map_or(0, |m| m.local_world_size)))
        .sum();
    let nodes_fit = held.group_world_size as usize == plain.group_world_size as usize + gone.len();
    let workers_fit = u64::from(held.world_size) == u64::from(plain.world_size) + workers_gone;
    if !nodes_fit || !workers_fit || gone.len() != header.gone.len() {
        return None;
    }
    let Some(mine) = &held.placed else {
        // A coordinator's whole copy: every member gone must be in it.
        let members: Vec<v1::Member> = held
            .members
            .iter()
            .filter(|m| !gone.contains(m.node_id.as_str()))
            .cloned()
            .collect();
        let all_found = held.members.len() - members.len() == gone.len();
        let fits = members.len() == header.group_world_size as usize;
        return (all_found && fits && held.members.len() == held.group_world_size as usize)
            .then_some(v1::Round { members, ..plain });
    };
    let me = mine.member.as_ref()?;
    if gone.contains(me.node_id.as_str()) {
        return None;
    }
    let ahead: Vec<&v1::Placed> = header
        .gone
        .iter()
        .filter(|g| g.group_rank < mine.group_rank)
        .collect();
    let workers_ahead: u64 = ahead
        .iter()
        .map(|g| u64::from(g.member.as_ref().map_or(0, |m| m.local_world_size)))
        .sum();
    let neighbour = match header.rewired.iter().find(|r| id(r) == me.node_id) {
        Some(r) => r.neighbour.clone(),
        None if mine
            .neighbour
            .as_ref()
            .is_some_and(|n| gone.contains(n.node_id.as_str())) =>
        {
            return None;
        }
        None => mine.neighbour.clone(),
    };
    let placed = v1::Placed {
        member: Some(me.clone()),
        group_rank: mine
            .group_rank
            .checked_sub(u32::try_from(ahead.len()).ok()?)?,
        base_rank: mine
            .base_rank
            .checked_sub(u32::try_from(workers_ahead).ok()?)?,
        neighbour,
    };
    Some(copy(plain, placed))
}

/// What a member's liveness stream needs of its neighbour (and what judging its copy of
/// the round reads): every member is in two shards, its own and its watcher's, and the
/// seal is one request under etcd's limit.
fn watched(m: &v1::Member) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: m.schema,
        node_id: m.node_id.clone(),
        local_world_size: m.local_world_size,
        status_addr: m.status_addr.clone(),
        lease: m.lease,
        incarnation: m.incarnation,
        ..Default::default()
    })
}

/// Each member's ring neighbour ([`crate::etcd::liveness::neighbour`]: the next one in
/// rank order, wrapping around, that serves a status port on a lease), by index, found in
/// one pass from the end: a lookup per member would be N² at the sizes this is for.
fn neighbours(members: &[v1::Member]) -> Vec<Option<usize>> {
    let watchable = |m: &v1::Member| !m.status_addr.is_empty() && m.lease != 0;
    let first = members.iter().position(watchable);
    let mut out = vec![None; members.len()];
    let mut after: Option<usize> = None;
    for i in (0..members.len()).rev() {
        // The next watchable one after i, or wrapping around to the first.
        out[i] = after.or(first).filter(|j| *j != i);
        if watchable(&members[i]) {
            after = Some(i);
        }
    }
    out
}

/// The member `me`'s copy of the placed round `header`, from its shard: itself and its
/// neighbour as the members, its place in `placed`. `None` when the shard does not hold
/// it (the round was sealed without it).
pub fn window(header: &v1::Round, shard: &v1::Placement, me: &str) -> Option<v1::Round> {
    let mine = shard
        .members
        .iter()
        .find(|p| p.member.as_ref().is_some_and(|m| m.node_id == me))?;
    Some(copy(plain(header), mine.clone()))
}

/// The whole round that the placed `header` and its `shards` make, its members in rank
/// order: what a coordinator holds. It keeps the header's shard count: it is still a
/// placed round (nobody puts it back whole, and a member's copy of it is the same round).
/// Fails unless the shards are all there, of this round, and their ranks are each of
/// `0..group_world_size` once.
pub fn whole(header: &v1::Round, shards: &[v1::Placement]) -> Result<v1::Round, String> {
    let n = header.group_world_size as usize;
    let mut slots: Vec<Option<v1::Member>> = vec![None; n];
    let mut seen = vec![false; header.shards as usize];
    for s in shards {
        if s.round != header.number {
            return Err(format!(
                "a shard of round {} is read for round {}",
                s.round, header.number
            ));
        }
        let Some(slot) = seen.get_mut(s.shard as usize) else {
            return Err(format!(
                "shard {} of {} shards is no shard of round {}",
                s.shard, header.shards, header.number
            ));
        };
        *slot = true;
        for p in &s.members {
            let m = p.member.as_ref().ok_or("a placed member with no record")?;
            match slots.get_mut(p.group_rank as usize) {
                Some(slot @ None) => *slot = Some(m.clone()),
                _ => {
                    return Err(format!(
                        "places node {} at rank {}, taken or outside the group of {n}",
                        m.node_id, p.group_rank
                    ));
                }
            }
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(format!(
            "shard {missing} of round {} is missing",
            header.number
        ));
    }
    let members: Option<Vec<v1::Member>> = slots.into_iter().collect();
    Ok(v1::Round {
        members: members.ok_or_else(|| format!("round {} has an empty rank", header.number))?,
        ..plain(header)
    })
}

#[cfg(test)]
mod tests;
