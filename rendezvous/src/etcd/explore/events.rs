//! The events of the search: every step the coordinator, an agent or a fault can take
//! from a world, each with the world after it.

use super::{NODES, Phase, World, master, waiting, wants_of};
use crate::Change;
use crate::etcd::coordinator::round_record;
use crate::etcd::detect;
use crate::etcd::joining::{Step, step};
use crate::etcd::liveness;
use crate::etcd::view::RoundEntry;
use crate::seal::SealDecision;

impl World {
    /// The events possible now, each with the world after it: the coordinator's look, then
    /// each node's own steps and the faults that can befall it, then the store's restarts.
    pub(super) fn next(&self) -> Vec<World> {
        let mut out: Vec<World> = self.coordinator_looks().into_iter().collect();
        for node in NODES {
            out.extend(self.acts(node));
            out.extend(self.renews_revoked_lease(node));
            out.extend(self.evict_neighbour(node));
            out.extend(self.node_faults(node));
        }
        out.extend(self.store_restarts());
        out
    }

    /// This world with `what` as the last event of its trace.
    fn traced(mut self, what: String) -> World {
        self.trace.push(what);
        self
    }

    /// The coordinator looks: it seals, or time passes to its recheck. Only when it would
    /// do something, or the search would spin on a no-op.
    fn coordinator_looks(&self) -> Option<World> {
        let mut c = self.coordinator.clone();
        let obs = c.observe(self.now, &self.view);
        match &obs.decision {
            SealDecision::Seal(p) => {
                let mut w = self.clone();
                w.coordinator = c;
                let record = round_record(p, &w.view, &obs.reason, 0, std::time::Duration::ZERO);
                w.rev += 1;
                w.view.round = Some(RoundEntry {
                    record: record.into(),
                    mod_rev: w.rev,
                });
                // The coordinator runs on node a: when a is the round's rank 0, the seal's
                // transaction names the master too (`session::sync`'s `coordinate`), and a
                // starts without publishing it.
                let names_master = p.members.first().is_some_and(|m| m == NODES[0])
                    && matches!(self.phases[NODES[0]], Phase::Waiting { .. });
                w.view.master = names_master.then(|| master(p.number));
                w.coordinator.sealed(w.now, p.number, &obs.reason);
                w.sealed_since_fault += 1;
                Some(w.traced(format!(
                    "seal round {} {:?}: {}",
                    p.number, p.members, obs.reason
                )))
            }
            SealDecision::Wait {
                recheck_at: Some(at),
            }
            | SealDecision::Reforming {
                recheck_at: Some(at),
            } if *at > self.now => {
                let mut w = self.clone();
                w.now = *at;
                Some(w.traced(format!(
                    "time passes to the coordinator's recheck ({})",
                    obs.reason
                )))
            }
            _ => None,
        }
    }

    /// What `node` does in its phase: registers, takes a step towards its round, stops
    /// its workers (or has them fail), or thaws.
    fn acts(&self, node: &'static str) -> Vec<World> {
        match &self.phases[node] {
            Phase::Waiting {
                wants,
                registered: false,
                published,
            } => {
                let mut w = self.clone();
                w.register(node, *wants);
                w.phases.insert(
                    node,
                    Phase::Waiting {
                        wants: *wants,
                        registered: true,
                        published: *published,
                    },
                );
                vec![w.traced(format!("{node} registers for round {wants}"))]
            }
            Phase::Waiting {
                wants,
                registered: true,
                published,
            } => self.steps(node, *wants, *published).into_iter().collect(),
            Phase::Running(_) => self.running(node),
            Phase::Frozen(before) => {
                // Thaws: a new lease, the next incarnation, its last registration
                // written again (as the session does).
                // The other half of the freeze: a change, but no new fault.
                let mut w = self.clone();
                w.sealed_since_fault = 0;
                w.renew(node);
                w.register(node, wants_of(before));
                w.phases.insert(node, (**before).clone());
                vec![w.traced(format!("FAULT {node} thaws on a new lease"))]
            }
            Phase::Dead => Vec::new(),
        }
    }

    /// A registered `node` waiting for round `wants` takes its step: starts the round,
    /// publishes its master, comes back for the next, or waits as a spare.
    fn steps(&self, node: &'static str, wants: u64, published: Option<u64>) -> Option<World> {
        let s = step(&self.view, node, 1, wants, published, self.since[node]);
        let mut w = self.clone();
        let what = match s {
            Ok(Step::Done(done)) => {
                let (record, _) = *done;
                w.phases.insert(node, Phase::Running(record.number));
                w.held.insert(node, (*record).clone());
                format!("{node} starts round {}", record.number)
            }
            Ok(Step::PublishMaster { round }) => {
                w.view.master = Some(master(round));
                w.rev += 1;
                w.phases.insert(
                    node,
                    Phase::Waiting {
                        wants,
                        registered: true,
                        published: Some(round),
                    },
                );
                format!("{node} publishes the master of round {round}")
            }
            Ok(Step::Broken { next, change }) => {
                w.phases.insert(node, waiting(next));
                format!(
                    "{node}: round {} broke before it started ({change:?})",
                    next - 1
                )
            }
            Ok(Step::Spare { next, .. }) => {
                w.phases.insert(node, waiting(next));
                format!("{node} waits as a spare for round {next}")
            }
            Ok(Step::Wait) => return None,
            Err(e) => panic!("{node}: {e}\n{}", self.trace.join("\n")),
        };
        Some(w.traced(what))
    }

    /// A running `node` stops its workers when its round is over, and (from the fault
    /// budget) its worker fails.
    fn running(&self, node: &'static str) -> Vec<World> {
        let mut out = Vec::new();
        let held = &self.held[node];
        if let Some(change) = detect(&self.view, held, node, self.since[node]) {
            let mut w = self.clone();
            if change == (Change::MemberLost { node: node.into() }) {
                // It lost its place by its own fault: charged (as the agent does).
                w.view.failures.insert(held.number);
            }
            w.phases.insert(node, waiting(held.number + 1));
            w.since.insert(node, w.now);
            out.push(w.traced(format!("{node} stops its workers: {change:?}")));
        }
        if self.faults_left > 0 {
            let mut w = self.clone();
            w.fault();
            w.view.failures.insert(held.number);
            w.rev += 1;
            w.phases.insert(node, waiting(held.number + 1));
            w.since.insert(node, w.now);
            out.push(w.traced(format!(
                "FAULT {node}'s worker fails in round {}",
                held.number
            )));
        }
        out
    }

    /// Its lease was revoked under `node`: the session grants a new one and writes its
    /// registration again.
    fn renews_revoked_lease(&self, node: &'static str) -> Option<World> {
        let phase = &self.phases[node];
        if !self.lease_lost.contains(node) || matches!(phase, Phase::Frozen(_) | Phase::Dead) {
            return None;
        }
        let mut w = self.clone();
        w.sealed_since_fault = 0;
        w.renew(node);
        w.register(node, wants_of(phase));
        Some(w.traced(format!(
            "{node} finds its lease revoked and registers on a new one"
        )))
    }

    /// From the fault budget, a live `node` is frozen past its lease (its key goes), or
    /// killed.
    fn node_faults(&self, node: &'static str) -> Vec<World> {
        let phase = &self.phases[node];
        if self.faults_left == 0 || matches!(phase, Phase::Frozen(_) | Phase::Dead) {
            return Vec::new();
        }
        let mut frozen = self.clone();
        frozen.fault();
        frozen.delete_member(node);
        frozen
            .phases
            .insert(node, Phase::Frozen(Box::new(phase.clone())));
        let mut killed = self.clone();
        killed.fault();
        killed.delete_member(node);
        killed.phases.insert(node, Phase::Dead);
        vec![
            frozen.traced(format!("FAULT {node} frozen past its lease (its key goes)")),
            killed.traced(format!("FAULT {node} killed")),
        ]
    }

    /// From the fault budget, the store restarts, alone or with each running node that
    /// serves it, each node in turn reconnecting first.
    fn store_restarts(&self) -> Vec<World> {
        let mut out = Vec::new();
        if self.faults_left == 0 {
            return out;
        }
        for first in 0..NODES.len() {
            out.push(self.store_restart(None, first));
            for victim in NODES {
                if matches!(self.phases[victim], Phase::Running(_)) {
                    out.push(self.store_restart(Some(victim), first));
                }
            }
        }
        out
    }

    /// `node`'s ring watcher proves its neighbour in the round it runs dead (a refused
    /// connection) and revokes the lease the neighbour last announced (its heartbeats say
    /// it; the round's, under the old store), as `Command::Evict` does.
    fn evict_neighbour(&self, node: &'static str) -> Option<World> {
        let Phase::Running(_) = self.phases[node] else {
            return None;
        };
        let round = &self.held[node];
        let target = liveness::neighbour(round, node)?;
        let dead = matches!(self.phases.get(target.node_id.as_str()), Some(Phase::Dead));
        // It left (or its lease went) before the proof came: nothing to add.
        if !dead || self.view.departed.contains_key(&target.node_id) {
            return None;
        }
        let lease = if self.old_store {
            target.lease
        } else {
            self.lease[target.node_id.as_str()]
        };
        if self.revoked.contains(&lease) {
            return None;
        }
        let holds = self
            .view
            .members
            .get(&target.node_id)
            .is_some_and(|m| m.record.lease == lease);
        if !self.old_store && !holds {
            return None;
        }
        let mut w = self.clone();
        w.revoked.insert(lease);
        let victim = w
            .view
            .members
            .iter()
            .find(|(_, m)| m.record.lease == lease)
            .map(|(id, _)| id.clone());
        let mut what = format!("{node} evicts {} (lease {lease})", target.node_id);
        if let Some(v) = victim {
            w.delete_member(&v);
            let v = NODES.into_iter().find(|n| *n == v).unwrap();
            if !matches!(w.phases[v], Phase::Dead) {
                w.lease_lost.insert(v);
                w.evicted_live = Some(v);
            }
            what += &format!(": deletes {v}'s key");
        }
        w.trace.push(what);
        Some(w)
    }

    /// The store restarts empty (`victim`, when given, was serving it and died with it):
    /// every agent's lease and key are gone, no delete was seen; each live agent grants a
    /// new lease and registers again, in the order `first` comes first, and the members of
    /// the running round put it back.
    fn store_restart(&self, victim: Option<&'static str>, first: usize) -> World {
        let mut w = self.clone();
        w.fault();
        if let Some(v) = victim {
            w.phases.insert(v, Phase::Dead);
        }
        w.view.members.clear();
        w.view.master = None;
        w.view.failures.clear();
        w.revoked.clear();
        w.rev += 1;
        if w.old_store {
            w.next_lease = 1;
        }
        let running = NODES
            .iter()
            .filter(|n| matches!(w.phases[**n], Phase::Running(_)))
            .map(|n| w.held[*n].clone())
            .max_by_key(|r| r.number);
        w.view.round = running.map(|record| RoundEntry {
            record: record.into(),
            mod_rev: w.rev,
        });
        for k in 0..NODES.len() {
            let node = NODES[(first + k) % NODES.len()];
            let phase = w.phases[node].clone();
            if matches!(phase, Phase::Dead | Phase::Frozen(_)) {
                continue;
            }
            w.renew(node);
            w.register(node, wants_of(&phase));
        }
        w.trace.push(match victim {
            Some(v) => format!("FAULT {v} dies with the store it serves; the store restarts empty ({} reconnects first)", NODES[first]),
            None => format!("FAULT the store restarts empty ({} reconnects first)", NODES[first]),
        });
        w
    }
}
