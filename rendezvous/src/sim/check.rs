//! The invariants, checked after every event; the first broken one ends the seed.

use fsdp_proto::v1;

use super::agent::Life;
use super::world::{Sealed, World, names};

/// Rounds a fault or a membership change (a registration created or deleted, a failure
/// reported) may cost: each adds this many to the budget seals spend, so that a burst of
/// changes (every agent registering again after etcd came back empty) may be sealed one by
/// one, and rounds sealed with nothing changing run it out: a loop.
pub const SEALS_PER_CHANGE: u32 = 3;

impl World {
    /// A fault or a membership change: up to [`SEALS_PER_CHANGE`] more rounds (the budget
    /// never holds more than one change per agent's worth).
    pub fn changed(&mut self, changes: u32) {
        let cap = SEALS_PER_CHANGE * self.agents.len() as u32;
        self.seal_budget = (self.seal_budget + SEALS_PER_CHANGE * changes).min(cap);
    }

    pub fn violate(&mut self, what: String) {
        if self.violation.is_none() {
            self.note(|| format!("VIOLATION: {what}"));
            self.violation = Some(what);
        }
    }

    /// A round was committed: ranks dense and unique, the world size within MIN..MAX, the
    /// restart count never lower than the round before, no run halted, one record per
    /// number, and no loop.
    pub fn on_sealed(&mut self, r: &v1::Round) {
        let epoch = self.etcd.epoch;
        let members: Vec<String> = r.members.iter().map(|m| m.node_id.clone()).collect();
        if let Some(before) = self.sealed.get(&r.number) {
            if before.members == members && before.restart_count == r.restart_count {
                // Put back after etcd lost it: the same round.
                return;
            }
            if before.epoch == epoch {
                let b = before.members.clone();
                return self.violate(format!(
                    "two rounds numbered {}: {b:?} and {members:?} (the fence let both through)",
                    r.number
                ));
            }
        }
        self.note(|| {
            format!(
                "etcd: round {} sealed {:?} restart_count {} ({})",
                r.number,
                names(r),
                r.restart_count,
                r.reason
            )
        });
        let mut unique = members.clone();
        unique.sort();
        unique.dedup();
        let n = members.len() as u32;
        if unique.len() != members.len() {
            return self.violate(format!(
                "round {} names a node twice: {members:?}",
                r.number
            ));
        }
        if n < self.opts.min_nodes || n > self.opts.max_nodes {
            return self.violate(format!(
                "round {} has {n} nodes, outside {}..{}",
                r.number, self.opts.min_nodes, self.opts.max_nodes
            ));
        }
        if let Some(why) = self.misplaced(r) {
            return self.violate(format!("round {} {why}: {:?}", r.number, names(r)));
        }
        // Within one store epoch: when etcd lost its data, the history survives only if an
        // agent that knew the last round puts it back before a fresh round is sealed
        // (docs/simulation.md, "What the model leaves out").
        if let Some((num, prev)) = self
            .sealed
            .iter()
            .next_back()
            .filter(|(_, p)| p.epoch == epoch)
        {
            if *num > r.number {
                return self.violate(format!("round {} sealed after round {num}", r.number));
            }
            // A group none of whose members were in the round before is a fresh start
            // (seal.rs: history is not charged to a new job); one that keeps a member
            // keeps the count.
            let kept = prev.members.iter().any(|m| members.contains(m));
            if kept && r.restart_count < prev.restart_count {
                let p = prev.restart_count;
                return self.violate(format!(
                    "round {}'s restart count {} is below round {num}'s {p}",
                    r.number, r.restart_count
                ));
            }
        }
        if self.halted() {
            return self.violate(format!("round {} sealed in a halted run", r.number));
        }
        self.sealed.insert(
            r.number,
            Sealed {
                epoch,
                members,
                restart_count: r.restart_count,
            },
        );
        if self.seal_budget == 0 {
            self.violate(format!(
                "livelock: more than {SEALS_PER_CHANGE} rounds sealed per fault or membership change (round {})",
                r.number
            ));
        }
        self.seal_budget = self.seal_budget.saturating_sub(1);
    }

    /// The departure records in etcd: each one every agent accepts (an agent never writes
    /// one that is refused), and no more than are kept (the writers and the coordinator
    /// trim; a handful of agents never overshoot).
    pub fn check_departures(&mut self) {
        let prefix = self.keys.key::<v1::Left>("");
        let req = fsdp_proto::etcdserverpb::RangeRequest {
            range_end: super::etcd::prefix_end(prefix.as_bytes()),
            key: prefix.into_bytes(),
            ..Default::default()
        };
        let Ok(found) = self.etcd.state.range(&req) else {
            return;
        };
        let mut v = crate::etcd::View::default();
        for kv in &found.kvs {
            let key = String::from_utf8_lossy(&kv.key);
            v.put(
                &self.keys,
                &key,
                &kv.value,
                kv.create_revision,
                kv.mod_revision,
                kv.lease,
            );
        }
        self.note(|| {
            let rows: Vec<String> = v
                .left
                .values()
                .map(|e| {
                    let l = &e.record;
                    let kind = l.kind().as_str_name().trim_start_matches("LEFT_KIND_");
                    let inc = l.incarnation % 1_000_000;
                    format!(
                        "{}#..{inc:06} {kind} round {} by {}",
                        l.node_id, l.round, l.written_by
                    )
                })
                .collect();
            format!("etcd: departures at settle: {rows:?}")
        });
        if let Some((key, why)) = v.refused.iter().chain(&v.corrupt).next() {
            return self.violate(format!(
                "a departure record no agent accepts at {key}: {why}"
            ));
        }
        if v.left.len() > crate::etcd::left::KEPT {
            let n = v.left.len();
            self.violate(format!(
                "{n} departure records kept, more than {}",
                crate::etcd::left::KEPT
            ));
        }
    }

    /// How a round breaks the topology rules, if it does: a segment's members not
    /// contiguous, or (with blocks) a segment with a number of members that is not a
    /// multiple of the block size.
    fn misplaced(&self, r: &v1::Round) -> Option<String> {
        // Rounds do not carry segments (the registrations do): each agent's is known here.
        let segments: Vec<String> = r
            .members
            .iter()
            .map(|m| {
                let a = self.agents.iter().position(|ag| ag.node == m.node_id);
                a.map(|a| self.opts.segment(a)).unwrap_or_default()
            })
            .collect();
        let mut seen = std::collections::BTreeMap::<&str, usize>::new();
        for (i, s) in segments.iter().enumerate() {
            let runs_on = i > 0 && segments[i - 1] == *s;
            let count = seen.entry(s.as_str()).or_default();
            if *count > 0 && !runs_on {
                return Some(format!("splits segment '{s}'"));
            }
            *count += 1;
        }
        let k = self.opts.segment_size.max(1) as usize;
        seen.iter()
            .find(|(_, n)| **n % k != 0)
            .map(|(s, n)| format!("has {n} nodes of segment '{s}', not whole blocks of {k}"))
    }

    /// How many of the agents `live` a settled run runs: each segment's whole blocks (one
    /// node a block without blocks), at most as many as MAX holds.
    fn runnable(&self, live: &[usize]) -> usize {
        let k = self.opts.segment_size.max(1) as usize;
        let mut per_segment = std::collections::BTreeMap::<String, usize>::new();
        for a in live {
            *per_segment.entry(self.opts.segment(*a)).or_default() += 1;
        }
        let whole: usize = per_segment.values().map(|n| n - n % k).sum();
        whole.min(crate::topology::most(self.opts.segment_size, self.opts.max_nodes) as usize)
    }

    fn halted(&self) -> bool {
        let key = self.keys.key::<v1::Halt>("");
        let req = fsdp_proto::etcdserverpb::RangeRequest {
            key: key.into_bytes(),
            ..Default::default()
        };
        self.etcd.state.range(&req).is_ok_and(|r| !r.kvs.is_empty())
    }

    /// Agent `a`'s workers start `round`: not once it saw the run halted. (One that has
    /// not seen the halt yet stops when it does; the settled check sees that every agent
    /// of a halted run exits.)
    pub fn check_start(&mut self, a: usize, round: &v1::Round) {
        let saw = self.agents[a]
            .machine
            .as_ref()
            .is_some_and(|m| m.view().halt.is_some());
        if saw {
            let n = round.number;
            self.violate(format!(
                "n{a} started round {n} after it saw the run halted"
            ));
        }
    }

    /// Fencing: no workers run under a lease etcd expired or revoked — the others may
    /// have re-formed without them.
    pub fn check_fencing(&mut self) {
        for a in 0..self.agents.len() {
            if self.agents[a].life != Life::Up {
                continue;
            }
            let Some(r) = self.agents[a].running() else {
                continue;
            };
            let node = &self.agents[a].node;
            let Some(me) = r.members.iter().find(|m| &m.node_id == node) else {
                continue;
            };
            let same_epoch = self
                .sealed
                .get(&r.number)
                .is_some_and(|s| s.epoch == self.etcd.epoch);
            if same_epoch && self.etcd.ended.contains(&me.lease) {
                let (n, lease) = (r.number, me.lease);
                return self.violate(format!(
                    "fencing: n{a}'s workers run round {n} after its lease {lease} ended in etcd"
                ));
            }
        }
    }

    /// The budget: a node that saw itself a member of a round past the restart budget
    /// gives up — never asks for a later round, which never comes — unless its lease may
    /// have been gone (it abandoned: the round was never its own).
    pub fn check_register(&mut self, a: usize, wants: u64) {
        let ag = &self.agents[a];
        if ag.abandoned {
            return;
        }
        // Every agent has the same budget: a round past it that this one saw itself in
        // ends it, whether or not another member gave up first.
        let spent = ag
            .saw_member_of
            .iter()
            .find(|(n, count)| *n < wants && *count > ag.max_restarts);
        if let Some(&(n, _)) = spent {
            self.violate(format!(
                "budget: the restart budget was spent in round {n}, but its member n{a} asks for round {wants}"
            ));
        }
    }

    /// Liveness, once faults are over and the bound passed: every live agent is in one
    /// running group (as many as MAX allows; spares wait), or fewer than MIN are left.
    pub fn check_settled(&mut self) {
        let live: Vec<usize> = (0..self.agents.len())
            .filter(|a| self.agents[*a].life == Life::Up)
            .collect();
        if self.halted() {
            if !live.is_empty() {
                let live: Vec<String> = live.iter().map(|a| format!("n{a}")).collect();
                self.violate(format!(
                    "liveness: the run halted, but {live:?} did not exit"
                ));
            }
            return;
        }
        if (live.len() as u32) < self.opts.min_nodes {
            return;
        }
        let running: Vec<(usize, u64)> = live
            .iter()
            .filter_map(|a| self.agents[*a].running().map(|r| (*a, r.number)))
            .collect();
        let want = self.runnable(&live);
        if want < self.opts.min_nodes as usize {
            return;
        }
        let rounds: std::collections::BTreeSet<u64> = running.iter().map(|(_, n)| *n).collect();
        if running.len() != want || rounds.len() != 1 {
            let waiting: Vec<String> = live
                .iter()
                .filter(|a| self.agents[**a].running().is_none())
                .map(|a| format!("n{a}"))
                .collect();
            self.violate(format!(
                "liveness: {} s after the last fault, {} of {} live agents run ({running:?}); waiting: {waiting:?}",
                self.opts.liveness_bound().as_secs_f64(),
                running.len(),
                want
            ));
        }
    }
}
