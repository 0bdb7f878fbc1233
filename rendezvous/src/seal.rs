//! "Seal a round now?" as a pure function of (now, observed state, config) → (decision,
//! reason). The coordinator calls it on every change it observes and at the instant it
//! asks to be called back; tests call it with made-up states and clocks.
//!
//! The rules (brief §5.4):
//! * First round (or a run whose previous members are all gone): seal at once when `max`
//!   nodes are present; with at least `min`, seal once no node joined or left for
//!   `last_call`.
//! * A sealed round is re-formed when a member is lost, a worker failure was reported, or a
//!   node is waiting while the round is below `max`. After a loss, or growth, the new round
//!   is sealed at once with every survivor still registered (they write nothing: O(1)
//!   writes per re-form). After a failure with no member lost it is sealed as soon as every
//!   surviving member is back (ready for a later round) — no last call — or, for a
//!   survivor that never comes back, after `straggler_timeout` without it.
//! * Survivors keep their relative order; newcomers follow in join order; at most `max`.
//! * A failure is charged to the restart budget only when the round lost no member: a
//!   worker that fails because a peer died is the membership change, not a failure.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

/// A registered node as the coordinator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: String,
    /// etcd create revision of its registration: the join order.
    pub joined_rev: i64,
    /// The node is ready for a round after the current one (it stopped its workers).
    pub ready: bool,
}

/// The round currently sealed in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    pub number: u64,
    /// Node ids in rank order.
    pub members: Vec<String>,
    pub restart_count: u32,
    /// A worker failure was reported for this round.
    pub failed: bool,
    /// A member of this round was seen to go (the registration the round names, or a later
    /// one), even if it has registered again since: the survivors that saw it write
    /// nothing for the next round.
    pub departed: bool,
    /// Members whose workers all succeeded in this round (they wrote `done`): gone, they
    /// are not lost, they finished. Without this, a job's end (members leaving one by one)
    /// sealed a round at each exit once survivors were no longer waited for.
    pub finished: BTreeSet<String>,
}

/// Everything the decision depends on.
#[derive(Debug, Clone)]
pub struct SealState<'a> {
    pub current: Option<&'a Current>,
    /// Nodes registered now.
    pub candidates: &'a [Candidate],
    /// When the set of registered nodes last changed.
    pub quiet_since: Instant,
    /// When the coordinator first saw that the current round must re-form.
    pub reform_since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SealConfig {
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub last_call: Duration,
    pub straggler_timeout: Duration,
}

/// The round to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    pub number: u64,
    pub members: Vec<String>,
    pub restart_count: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SealDecision {
    /// Nothing to commit; evaluate again on the next change or at `recheck_at`.
    Wait {
        recheck_at: Option<Instant>,
    },
    /// The current round must re-form (members should stop their workers) but the next one
    /// cannot be sealed yet.
    Reforming {
        recheck_at: Option<Instant>,
    },
    Seal(Proposal),
}

/// Decides whether to seal a round now, and says why.
pub fn decide(now: Instant, s: &SealState<'_>, cfg: &SealConfig) -> (SealDecision, String) {
    // Indexed once: every lookup below is O(1), so a decision is O(N log N) at N nodes
    // (the sort), not a scan of every candidate for every member.
    let index: HashMap<&str, &Candidate> = s
        .candidates
        .iter()
        .map(|c| (c.node_id.as_str(), c))
        .collect();
    let present = |id: &str| index.get(id).copied();
    let max = cfg.max_nodes as usize;
    let min = cfg.min_nodes as usize;
    let next_number = s.current.map_or(0, |c| c.number + 1);
    let mut by_join: Vec<&Candidate> = s.candidates.iter().filter(|c| c.ready).collect();
    by_join.sort_by(|a, b| (a.joined_rev, &a.node_id).cmp(&(b.joined_rev, &b.node_id)));

    let survivors: Vec<&String> = s
        .current
        .map(|c| c.members.iter().filter(|m| present(m).is_some()).collect())
        .unwrap_or_default();

    let Some(current) = s.current.filter(|_| !survivors.is_empty()) else {
        // A fresh run: nobody from a previous round is here.
        let n = by_join.len();
        let members = |k: usize| by_join.iter().take(k).map(|c| c.node_id.clone()).collect();
        if n >= max {
            let p = Proposal {
                number: next_number,
                members: members(max),
                restart_count: 0,
            };
            return (
                SealDecision::Seal(p),
                format!("{max} nodes present (the maximum)"),
            );
        }
        if n >= min {
            let deadline = s.quiet_since + cfg.last_call;
            if now >= deadline {
                let p = Proposal {
                    number: next_number,
                    members: members(n),
                    restart_count: 0,
                };
                return (
                    SealDecision::Seal(p),
                    format!(
                        "{n} nodes present and none joined or left for the last call ({:?})",
                        cfg.last_call
                    ),
                );
            }
            return (
                SealDecision::Wait {
                    recheck_at: Some(deadline),
                },
                format!(
                    "{n} of max {max} nodes present; last call ends in {:?}",
                    deadline - now
                ),
            );
        }
        return (
            SealDecision::Wait { recheck_at: None },
            format!("waiting for nodes: {n} of min {min} present"),
        );
    };

    let lost: Vec<&String> = current
        .members
        .iter()
        .filter(|m| present(m).is_none() && !current.finished.contains(*m))
        .collect();
    let in_round: HashSet<&str> = current.members.iter().map(String::as_str).collect();
    let waiting: Vec<&&Candidate> = by_join
        .iter()
        .filter(|c| !in_round.contains(c.node_id.as_str()))
        .collect();
    let grow = !waiting.is_empty() && current.members.len() < max;
    // A member that declares itself ready for a later round has stopped its workers:
    // the current round is broken even though nobody is lost.
    let left: Vec<&String> = current
        .members
        .iter()
        .filter(|m| present(m).is_some_and(|c| c.ready))
        .collect();
    if lost.is_empty() && !current.failed && !grow && left.is_empty() {
        return (
            SealDecision::Wait { recheck_at: None },
            format!("round {} is intact", current.number),
        );
    }
    let mut why = Vec::new();
    if !lost.is_empty() {
        why.push(format!("lost {}", join(&lost)));
    }
    if current.failed {
        why.push("a worker failed".to_owned());
    }
    // Where the growth is said: once sealed, the waiting nodes are members, and the round
    // record keeps the reason (status shows it while they run).
    let grow_at = grow.then_some(why.len());
    if grow {
        why.push(format!("{} node(s) waiting to join", waiting.len()));
    }
    if why.is_empty() {
        why.push(format!("{} stopped their workers", join(&left)));
    }
    let mut parts = why;
    let why = parts.join(", ");

    // After a failure every member says it stopped its workers before the next round is
    // sealed: waiting for them keeps a dying peer's lease time to expire, so its death is
    // not charged as a failure. After a loss (the failure too, once a loss is seen: it is
    // not charged) or growth, survivors write nothing: the registrations still there are
    // the proof they live, the round is sealed at once with every one of them, and they
    // stop their workers when they see it. One write re-forms N nodes.
    let wait_for_survivors = current.failed && lost.is_empty() && !current.departed;
    let back = |m: &str| !wait_for_survivors || present(m).is_some_and(|c| c.ready);
    let not_back: Vec<&String> = survivors.iter().copied().filter(|m| !back(m)).collect();
    let since = s.reform_since.unwrap_or(now);
    let deadline = since + cfg.straggler_timeout;
    if !not_back.is_empty() && now < deadline {
        return (
            SealDecision::Reforming {
                recheck_at: Some(deadline),
            },
            format!(
                "re-forming ({why}); waiting for {} to stop their workers",
                join(&not_back)
            ),
        );
    }
    let mut members: Vec<String> = survivors
        .iter()
        .filter(|m| back(m))
        .map(|m| (*m).clone())
        .collect();
    members.extend(waiting.iter().map(|c| c.node_id.clone()));
    members.truncate(max);
    if members.len() < min {
        return (
            SealDecision::Reforming { recheck_at: None },
            format!(
                "re-forming ({why}); {} of min {min} nodes ready",
                members.len()
            ),
        );
    }
    let charged = current.failed && lost.is_empty();
    let restart_count = current.restart_count + u32::from(charged);
    if let Some(i) = grow_at {
        let admitted = members
            .iter()
            .filter(|m| !in_round.contains(m.as_str()))
            .count();
        parts[i] = format!("admitted {admitted} waiting node(s)");
    }
    let p = Proposal {
        number: next_number,
        members,
        restart_count,
    };
    (
        SealDecision::Seal(p),
        format!("re-form ({})", parts.join(", ")),
    )
}

/// Node ids named in a reason, at most [`NAMED`] of them: reasons are logged and stored in
/// the round record, and at 1,000 nodes a full list made lines of 17,000 characters.
fn join(ids: &[&String]) -> String {
    let mut out = ids
        .iter()
        .take(NAMED)
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > NAMED {
        out += &format!(" and {} more", ids.len() - NAMED);
    }
    out
}

/// How many node ids a reason names before it counts the rest.
const NAMED: usize = 5;

#[cfg(test)]
mod tests;
