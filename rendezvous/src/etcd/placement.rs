//! A round too large to send whole to every member, as pure functions: a header at
//! `ctl/round` that every member receives, and the members in shards outside `ctl/`
//! (`placement/<shard>`), each member in the shard its node id hashes to, with its
//! ranks and its ring neighbour. A member reads its own shard; a coordinator, which needs
//! the whole round, reads them all ([`whole`]). The header and the shards are one fenced
//! transaction, so no member reads a shard of a round that was not sealed.
//!
//! Why: every member watches `ctl/`, so a round written there is sent once per member. At
//! 10,000 members that was 0.73 MB to each of them, and etcd took 27.9 s to send it all,
//! 4.4 times the floor of the whole formation (`rdzv-bench --ceiling-round`); the header
//! and a shard of [`SHARD_MEMBERS`] took 1.64 s.

use fsdp_proto::v1;

/// Members in one shard, up to [`MAX_SHARDS`] shards.
pub const SHARD_MEMBERS: usize = 64;

/// The most shards a round has: they are written in the seal's one transaction, beside
/// the header and the master, and etcd takes at most 128 operations in one
/// (`--max-txn-ops`). Above 6,400 members the shards grow instead.
pub const MAX_SHARDS: usize = 100;

/// The shards of a round of `members` members.
pub fn shards_for(members: usize) -> u32 {
    let n = members.div_ceil(SHARD_MEMBERS).clamp(1, MAX_SHARDS);
    u32::try_from(n).unwrap_or(1)
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

/// `round` (whole, its members in rank order) as its header and its shards. Fails when its
/// members' worker counts do not form a group.
pub fn place(round: &v1::Round) -> Result<(v1::Round, Vec<v1::Placement>), String> {
    let members = &round.members;
    let sizes: Vec<u32> = members.iter().map(|m| m.local_world_size).collect();
    let (ranks, world_size) = crate::ranks::assign(&sizes)?;
    let shards = shards_for(members.len());
    let mut out: Vec<v1::Placement> = (0..shards)
        .map(|shard| v1::Placement {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: round.number,
            shard,
            members: Vec::new(),
        })
        .collect();
    let next = neighbours(members);
    for ((m, r), n) in members.iter().zip(ranks).zip(next) {
        out[shard_of(&m.node_id, shards) as usize]
            .members
            .push(v1::Placed {
                member: Some(m.clone()),
                group_rank: r.group_rank,
                base_rank: r.base_rank,
                neighbour: n.map(|i| watched(&members[i])),
            });
    }
    let header = v1::Round {
        members: Vec::new(),
        shards,
        group_world_size: u32::try_from(members.len()).map_err(|e| e.to_string())?,
        world_size,
        placed: None,
        ..round.clone()
    };
    Ok((header, out))
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
    let members = mine
        .member
        .iter()
        .chain(mine.neighbour.iter())
        .cloned()
        .collect();
    Some(v1::Round {
        members,
        placed: Some(mine.clone()),
        ..header.clone()
    })
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
        placed: None,
        ..header.clone()
    })
}

#[cfg(test)]
mod tests;
