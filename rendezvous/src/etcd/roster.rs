//! A round written as its difference from the round it replaces, and the whole round
//! beside it (the [`v1::Roster`]), as pure functions.
//!
//! Every member watches `ctl/`, so whatever `ctl/round` holds is sent once per member: at
//! 1,000 members a whole round (~90 KB) made each re-form ~90 MB of watch traffic, and
//! etcd, busy sending it, answered keep-alives too late (issue 30). A re-form after a
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
        ..full.clone()
    })
}

/// The whole round `d` (a delta) makes of `base`, or why it does not apply to it.
pub fn apply(base: &v1::Round, d: &v1::Round) -> Result<v1::Round, String> {
    let names: BTreeSet<&str> = base.members.iter().map(|m| m.node_id.as_str()).collect();
    if let Some(stray) = d
        .removed
        .iter()
        .map(String::as_str)
        .chain(d.updated.iter().map(|m| m.node_id.as_str()))
        .find(|id| !names.contains(id))
    {
        return Err(format!(
            "changes node {stray}, which round {} does not have",
            base.number
        ));
    }
    let removed: BTreeSet<&str> = d.removed.iter().map(String::as_str).collect();
    let updated: BTreeMap<&str, &v1::Member> =
        d.updated.iter().map(|m| (m.node_id.as_str(), m)).collect();
    let members = base
        .members
        .iter()
        .filter(|m| !removed.contains(m.node_id.as_str()))
        .map(|m| (*updated.get(m.node_id.as_str()).unwrap_or(&m)).clone())
        .chain(d.added.iter().cloned())
        .collect();
    Ok(v1::Round {
        members,
        delta: false,
        base: 0,
        base_rev: 0,
        removed: Vec::new(),
        updated: Vec::new(),
        added: Vec::new(),
        ..d.clone()
    })
}

#[cfg(test)]
mod tests;
