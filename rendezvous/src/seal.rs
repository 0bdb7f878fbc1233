//! "Seal a round now?" as a pure function of (now, observed state, config) → (decision,
//! reason). The coordinator calls it on every change it observes and at the instant it
//! asks to be called back; tests call it with made-up states and clocks.
//!
//! The rules:
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
//!   Then nodes that share the longest prefix of their segment are made contiguous (a
//!   stable sort, [`topology::order`]): with no segment anywhere the order is exactly
//!   that one, and a re-form after a loss keeps survivors first and in order (a small
//!   delta, `etcd::roster`).
//! * With a segment size K ([`SealConfig::segment_size`]) a round is made of whole blocks
//!   of K nodes of one segment ([`topology::blocks`]): its size a multiple of K, at most
//!   `max`, at least `min`; a segment's nodes short of a block wait as spares.
//! * A failure is charged to the restart budget only when the round lost no member: a
//!   worker that fails because a peer died is the membership change, not a failure.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::topology;

/// A registered node as the coordinator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: String,
    /// etcd create revision of its registration: the join order.
    pub joined_rev: i64,
    /// The node is ready for a round after the current one (it stopped its workers).
    pub ready: bool,
    /// Where the node sits (`Member.segment`, [`topology`]); empty: no location.
    pub segment: String,
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
    /// `--segment-size`: rounds are made of whole blocks of this many nodes of one
    /// segment ([`topology::blocks`]); 1: of any nodes.
    pub segment_size: u32,
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
    let look = Look::new(now, s, *cfg);
    match s.current.filter(|_| !look.survivors.is_empty()) {
        // A fresh run: nobody from a previous round is here.
        None => look.fresh(),
        Some(current) => look.reform(current),
    }
}

/// What one decision looks at: the registered nodes, indexed; the ready ones in join
/// order; the current round's members still registered.
struct Look<'a> {
    now: Instant,
    cfg: SealConfig,
    /// Indexed once: every lookup is O(1), so a decision is O(N log N) at N nodes (the
    /// sort), not a scan of every candidate for every member.
    index: HashMap<&'a str, &'a Candidate>,
    /// The nodes ready for the next round, in join order.
    by_join: Vec<&'a Candidate>,
    /// The current round's members that are still registered, in rank order.
    survivors: Vec<&'a String>,
    next_number: u64,
    quiet_since: Instant,
    reform_since: Option<Instant>,
}

/// Why the current round must re-form, as one look sees it.
struct Breaks<'a> {
    /// Members gone without having finished.
    lost: Vec<&'a String>,
    in_round: HashSet<&'a str>,
    /// Ready nodes that are not members, in join order.
    waiting: Vec<&'a Candidate>,
    /// Waiting nodes can join: the round is below the maximum.
    grow: bool,
    /// Members that declare themselves ready for a later round: they stopped their
    /// workers, so the round is broken even though nobody is lost.
    left: Vec<&'a String>,
}

impl<'a> Look<'a> {
    fn new(now: Instant, s: &SealState<'a>, cfg: SealConfig) -> Self {
        let index: HashMap<&str, &Candidate> = s
            .candidates
            .iter()
            .map(|c| (c.node_id.as_str(), c))
            .collect();
        let mut by_join: Vec<&Candidate> = s.candidates.iter().filter(|c| c.ready).collect();
        by_join.sort_by(|a, b| (a.joined_rev, &a.node_id).cmp(&(b.joined_rev, &b.node_id)));
        let survivors: Vec<&String> = s
            .current
            .map(|c| {
                c.members
                    .iter()
                    .filter(|m| index.contains_key(m.as_str()))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            now,
            cfg,
            index,
            by_join,
            survivors,
            next_number: s.current.map_or(0, |c| c.number + 1),
            quiet_since: s.quiet_since,
            reform_since: s.reform_since,
        }
    }

    fn present(&self, id: &str) -> Option<&'a Candidate> {
        self.index.get(id).copied()
    }

    fn max(&self) -> usize {
        self.cfg.max_nodes as usize
    }

    fn min(&self) -> usize {
        self.cfg.min_nodes as usize
    }

    /// The block size: 1 when rounds take any nodes.
    fn block(&self) -> usize {
        self.cfg.segment_size.max(1) as usize
    }

    /// The most nodes a round can have: `max`, or with blocks the largest multiple of
    /// the block size within it.
    fn most(&self) -> usize {
        topology::most(self.cfg.segment_size, self.cfg.max_nodes) as usize
    }

    /// The nodes a round takes from `pool` (in order of preference): the first `max`, or
    /// whole blocks of one segment.
    fn take(&self, pool: &[&'a Candidate]) -> Vec<&'a Candidate> {
        topology::blocks(pool, self.block(), self.max(), |c| c.segment.as_str())
    }

    /// A fresh run: sealed at once with `max` nodes (with blocks: as many as whole blocks
    /// can hold), else with at least `min` once none joined or left for the last call.
    fn fresh(&self) -> (SealDecision, String) {
        let (n, max, min, k) = (self.by_join.len(), self.max(), self.min(), self.block());
        let chosen = self.take(&self.by_join);
        let c = chosen.len();
        let proposal = |chosen: Vec<&Candidate>| Proposal {
            number: self.next_number,
            members: ranked(chosen),
            restart_count: 0,
        };
        if c >= self.most() && c >= min {
            let why = match k {
                1 => format!("{max} nodes present (the maximum)"),
                _ => format!("{c} nodes present in whole blocks of {k} (the most max {max} holds)"),
            };
            return (SealDecision::Seal(proposal(chosen)), why);
        }
        if c < min {
            let why = match k {
                1 => format!("waiting for nodes: {n} of min {min} present"),
                _ => format!(
                    "waiting for nodes: {c} of min {min} in whole blocks of {k} of one segment ({n} present)"
                ),
            };
            return (SealDecision::Wait { recheck_at: None }, why);
        }
        let deadline = self.quiet_since + self.cfg.last_call;
        if self.now >= deadline {
            return (
                SealDecision::Seal(proposal(chosen)),
                format!(
                    "{c} nodes present and none joined or left for the last call ({:?})",
                    self.cfg.last_call
                ),
            );
        }
        (
            SealDecision::Wait {
                recheck_at: Some(deadline),
            },
            format!(
                "{n} of max {max} nodes present; last call ends in {:?}",
                deadline - self.now
            ),
        )
    }

    /// What breaks `current`: members lost or stopped, nodes waiting to join.
    fn breaks(&self, current: &'a Current) -> Breaks<'a> {
        let lost = current
            .members
            .iter()
            .filter(|m| self.present(m).is_none() && !current.finished.contains(*m))
            .collect();
        let in_round: HashSet<&str> = current.members.iter().map(String::as_str).collect();
        let waiting: Vec<&Candidate> = self
            .by_join
            .iter()
            .copied()
            .filter(|c| !in_round.contains(c.node_id.as_str()))
            .collect();
        let grow = !waiting.is_empty() && self.room(current, &waiting);
        let left = current
            .members
            .iter()
            .filter(|m| self.present(m).is_some_and(|c| c.ready))
            .collect();
        Breaks {
            lost,
            in_round,
            waiting,
            grow,
            left,
        }
    }

    /// Whether `current` would be larger with `waiting` nodes: it is below `max`, or with
    /// blocks, they complete a block it has room for. How many whole blocks a set of
    /// nodes makes does not depend on their order, so the round this grows to does not
    /// grow again.
    fn room(&self, current: &Current, waiting: &[&'a Candidate]) -> bool {
        if self.block() == 1 {
            return current.members.len() < self.max();
        }
        let mut pool: Vec<&Candidate> = current
            .members
            .iter()
            .filter_map(|m| self.present(m))
            .collect();
        pool.extend(waiting);
        self.take(&pool).len() > current.members.len()
    }

    /// The next round's members from `survivors` (first, in their order) and `waiting`,
    /// and the survivors it has no room for: only blocks (or a `max` lowered since) leave
    /// one out.
    fn choose(
        &self,
        survivors: &[&'a Candidate],
        waiting: &[&'a Candidate],
    ) -> (Vec<&'a Candidate>, Vec<&'a String>) {
        let pool: Vec<&Candidate> = survivors.iter().chain(waiting).copied().collect();
        let chosen = self.take(&pool);
        if self.block() == 1 {
            // The first `max`: no set of every id needed to tell who is left out.
            let spared = survivors.iter().skip(self.max()).map(|c| &c.node_id);
            return (chosen, spared.collect());
        }
        let taken: HashSet<&str> = chosen.iter().map(|c| c.node_id.as_str()).collect();
        let spared = survivors
            .iter()
            .filter(|c| !taken.contains(c.node_id.as_str()))
            .map(|c| &c.node_id)
            .collect();
        (chosen, spared)
    }

    /// Why survivors are left out, in words.
    fn spared(&self, spared: &[&String]) -> String {
        match self.block() {
            1 => format!("{} wait as spares (above max {})", join(spared), self.max()),
            k => format!(
                "{} wait as spares (short of a whole block of {k} in their segment)",
                join(spared)
            ),
        }
    }

    /// A sealed round: kept while intact, else re-formed with its survivors (once they
    /// are back, after a failure) and the nodes waiting, at most `max`.
    fn reform(&self, current: &'a Current) -> (SealDecision, String) {
        let b = self.breaks(current);
        if b.lost.is_empty() && !current.failed && !b.grow && b.left.is_empty() {
            return (
                SealDecision::Wait { recheck_at: None },
                format!("round {} is intact", current.number),
            );
        }
        let (mut parts, grow_at) = b.reasons(current);
        let why = parts.join(", ");
        // After a failure every member says it stopped its workers before the next round
        // is sealed: waiting for them keeps a dying peer's lease time to expire, so its
        // death is not charged as a failure. After a loss (the failure too, once a loss is
        // seen: it is not charged) or growth, survivors write nothing: the registrations
        // still there are the proof they live, the round is sealed at once with every one
        // of them, and they stop their workers when they see it. One write re-forms N
        // nodes.
        let wait_for_survivors = current.failed && b.lost.is_empty() && !current.departed;
        let back = |m: &str| !wait_for_survivors || self.present(m).is_some_and(|c| c.ready);
        let not_back: Vec<&String> = self
            .survivors
            .iter()
            .copied()
            .filter(|m| !back(m))
            .collect();
        let deadline = self.reform_since.unwrap_or(self.now) + self.cfg.straggler_timeout;
        if !not_back.is_empty() && self.now < deadline {
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
        let survivors: Vec<&Candidate> = self
            .survivors
            .iter()
            .filter(|m| back(m))
            .filter_map(|m| self.present(m))
            .collect();
        let (chosen, spared) = self.choose(&survivors, &b.waiting);
        let members = ranked(chosen);
        if members.len() < self.min() {
            return (
                SealDecision::Reforming { recheck_at: None },
                format!(
                    "re-forming ({why}); {} of min {} nodes ready",
                    members.len(),
                    self.min()
                ),
            );
        }
        let charged = current.failed && b.lost.is_empty();
        if let Some(i) = grow_at {
            let admitted = members
                .iter()
                .filter(|m| !b.in_round.contains(m.as_str()))
                .count();
            parts[i] = format!("admitted {admitted} waiting node(s)");
        }
        if !spared.is_empty() {
            parts.push(self.spared(&spared));
        }
        let p = Proposal {
            number: self.next_number,
            members,
            restart_count: current.restart_count + u32::from(charged),
        };
        (
            SealDecision::Seal(p),
            format!("re-form ({})", parts.join(", ")),
        )
    }
}

impl Breaks<'_> {
    /// The reasons to re-form, in words, and which of them says the growth (`None`: no
    /// growth). Once sealed the waiting nodes are members, and the round record keeps the
    /// reason (status shows it while they run): the growth is then said as admitted.
    fn reasons(&self, current: &Current) -> (Vec<String>, Option<usize>) {
        let mut why = Vec::new();
        if !self.lost.is_empty() {
            why.push(format!("lost {}", join(&self.lost)));
        }
        if current.failed {
            why.push("a worker failed".to_owned());
        }
        let grow_at = self.grow.then_some(why.len());
        if self.grow {
            why.push(format!("{} node(s) waiting to join", self.waiting.len()));
        }
        if why.is_empty() {
            why.push(format!("{} stopped their workers", join(&self.left)));
        }
        (why, grow_at)
    }
}

/// `chosen` in rank order ([`topology::order`]), as node ids.
fn ranked(mut chosen: Vec<&Candidate>) -> Vec<String> {
    topology::order(&mut chosen, |c| c.segment.as_str());
    chosen.into_iter().map(|c| c.node_id.clone()).collect()
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
