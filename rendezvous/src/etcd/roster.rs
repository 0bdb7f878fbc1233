//! A round written as its difference from the round it replaces, and the whole round
//! beside it (the [`v1::Roster`]), as pure functions.
//!
//! Every member watches `ctl/`, so whatever `ctl/round` holds is sent once per member: at
//! 1,000 members a whole round (~90 KB) made each re-form ~90 MB of watch traffic, and
//! etcd, busy sending it, answered keep-alives too late. A re-form after a
//! loss changes one name: the delta is a few bytes, and a member applies it to the round
//! it holds. The whole round sits at `roster`, a key no member watches, written in the
//! same transaction; a view that cannot apply a delta (it holds another round, or none)
//! reads it once.

use std::collections::{BTreeMap, BTreeSet};

use fsdp_proto::v1;

/// `full` as a delta from `base` (the round `full` replaces, whose record had revision
/// `base_rev`), or `None` when `full` does not keep `base`'s survivors first and in their
/// order (then it is written whole).
pub fn delta(base: &v1::Round, base_rev: i64, full: &v1::Round) -> Option<v1::Round> {
    let before: BTreeMap<&str, &v1::Member> = base
        .members
        .iter()
        .map(|m| (m.node_id.as_str(), m))
        .collect();
    let kept = full
        .members
        .iter()
        .take_while(|m| before.contains_key(m.node_id.as_str()))
        .count();
    let (survivors, added) = full.members.split_at(kept);
    if added
        .iter()
        .any(|m| before.contains_key(m.node_id.as_str()))
    {
        return None;
    }
    let stay: BTreeSet<&str> = survivors.iter().map(|m| m.node_id.as_str()).collect();
    let in_order = base
        .members
        .iter()
        .filter(|m| stay.contains(m.node_id.as_str()))
        .map(|m| m.node_id.as_str())
        .eq(survivors.iter().map(|m| m.node_id.as_str()));
    if !in_order {
        return None;
    }
    Some(v1::Round {
        members: Vec::new(),
        delta: true,
        base: base.number,
        base_rev,
        removed: base
            .members
            .iter()
            .filter(|m| !stay.contains(m.node_id.as_str()))
            .map(|m| m.node_id.clone())
            .collect(),
        updated: survivors
            .iter()
            .filter(|m| before.get(m.node_id.as_str()) != Some(m))
            .cloned()
            .collect(),
        added: added.to_vec(),
        dropped: Vec::new(),
        ..full.clone()
    })
}

/// The whole round `d` (a delta) makes of `base`, or why it does not apply to it. When
/// `base` lists no node twice, neither does the result.
pub fn apply(base: &v1::Round, d: &v1::Round) -> Result<v1::Round, String> {
    // Every member applies every delta to a round of N: one pass over the round, looking
    // each member up among the delta's few names (sorted), not sets of all N names built
    // per member per re-form (at 1,000 nodes such sets were a tenth of an agent's CPU
    // per re-form).
    let mut removed: Vec<&str> = d.removed.iter().map(String::as_str).collect();
    removed.sort_unstable();
    removed.dedup();
    // The last update of a node named twice wins, as it would in a map.
    let mut updated: Vec<&v1::Member> = d.updated.iter().rev().collect();
    updated.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    updated.dedup_by(|a, b| a.node_id == b.node_id);
    // The round applied to was checked distinct; the result is too when no name is added
    // twice or added while kept, which the same pass checks (no set of all N names).
    let mut added: Vec<&str> = d.added.iter().map(|m| m.node_id.as_str()).collect();
    added.sort_unstable();
    if let Some(twice) = added.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("adds node {} twice", twice[0]));
    }
    let mut seen_removed = vec![false; removed.len()];
    let mut seen_updated = vec![false; updated.len()];
    let mut members = Vec::with_capacity(base.members.len() + d.added.len());
    for m in &base.members {
        let id = m.node_id.as_str();
        let update = updated
            .binary_search_by(|u| u.node_id.as_str().cmp(id))
            .ok();
        if let Some(i) = update {
            seen_updated[i] = true;
        }
        if let Ok(i) = removed.binary_search(&id) {
            seen_removed[i] = true;
        } else if added.binary_search(&id).is_ok() {
            return Err(format!(
                "adds node {id}, which round {} has already",
                base.number
            ));
        } else {
            members.push(update.map_or(m, |i| updated[i]).clone());
        }
    }
    let unseen_removed = removed.iter().zip(&seen_removed).find(|(_, seen)| !**seen);
    let unseen_updated = updated.iter().zip(&seen_updated).find(|(_, seen)| !**seen);
    if let Some(stray) = unseen_removed
        .map(|(id, _)| *id)
        .or(unseen_updated.map(|(u, _)| u.node_id.as_str()))
    {
        return Err(format!(
            "changes node {stray}, which round {} does not have",
            base.number
        ));
    }
    members.extend(d.added.iter().cloned());
    Ok(v1::Round {
        members,
        delta: false,
        base: 0,
        base_rev: 0,
        removed: Vec::new(),
        updated: Vec::new(),
        added: Vec::new(),
        dropped: d.removed.clone(),
        ..d.clone()
    })
}

#[cfg(test)]
mod tests;
