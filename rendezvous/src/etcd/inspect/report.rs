//! The report `fsdp-agent status` shows ([`RunReport`] and its rows), made by [`report`],
//! a pure function of a run's view.

use fsdp_proto::v1;
use serde::Serialize;

use super::health::{Health, verdict};
use crate::etcd::left;
use crate::etcd::view::View;
use crate::{RoundMember, ranks};

/// The run as a whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunReport {
    pub run_id: String,
    /// The sealed round's number, if any round was sealed.
    pub round: Option<u64>,
    /// Why the coordinator sealed it.
    pub round_reason: String,
    /// Failure restarts the job used when the round was sealed.
    pub restarts: u32,
    /// When the round was sealed (Unix ms, the coordinator's clock).
    pub sealed_at_ms: Option<u64>,
    /// The agents' restart budget and group size, as their registrations say (every agent
    /// of a run is given the same; `None` from agents too old to say).
    pub max_restarts: Option<u32>,
    /// The restart window in seconds; 0 for none.
    pub restart_window_s: u64,
    /// `--nnodes MIN:MAX`, when the registrations say.
    pub nodes: Option<(u32, u32)>,
    pub world_size: u32,
    pub master: Option<String>,
    pub coordinator: Option<String>,
    /// Round members in rank order, then registered nodes waiting to join.
    pub members: Vec<MemberReport>,
    pub health: Health,
    /// Why the run has that health, in words.
    pub health_reason: String,
    /// Keys holding values that cannot be trusted, with the reason.
    pub corrupt: Vec<String>,
    /// Records the agents refuse (a halt with code 0, a registration without a lease, a
    /// round no agent could seal), with the reason: what is shown is what they accepted.
    pub refused: Vec<String>,
    /// The latest round that hung: where every reporting node's ranks were.
    pub last_hang: Option<HangRound>,
    /// Live nodes whose health check fails: out of the rounds until it passes.
    pub unhealthy: Vec<UnhealthyNode>,
    /// Machines kept out of the run (expired ones too, with their end).
    pub quarantined: Vec<QuarantinedMachine>,
    /// Nodes that left the run or its group, and why: the last [`left::KEPT`], newest
    /// last.
    pub left: Vec<LeftNode>,
}

/// A node that left, in its own word or, when it said none, the coordinator's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeftNode {
    pub node_id: String,
    /// The address it advertised.
    pub addr: String,
    /// finished, left, unhealthy, quarantined, halted, failed, fenced or lost.
    pub reason: &'static str,
    /// One line: the health check's message, the signal, the exit code, how it was lost.
    pub detail: String,
    /// Unix ms when it left, by the writer's clock.
    pub at_ms: u64,
    /// The round it ran (or the latest it knew) when it left.
    pub round: u64,
    /// Who wrote the record: the node itself, or the coordinator that found it gone.
    pub written_by: String,
}

/// A machine kept out because its node failed first round after round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuarantinedMachine {
    pub machine: String,
    /// The node (agent) it was blamed as.
    pub node_id: String,
    pub reason: String,
    /// Unix ms when the quarantine ends.
    pub until_ms: u64,
}

/// A node kept out by its health check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnhealthyNode {
    pub node_id: String,
    /// The check's last output line, or how it ended.
    pub reason: String,
    /// Failed checks in a row.
    pub failures: u32,
}

/// The reports of a round that hung.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HangRound {
    pub round: u64,
    pub reports: Vec<crate::HangReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberReport {
    pub node_id: String,
    pub addr: String,
    pub nproc: u32,
    /// `None` for a node that is registered but not in the sealed round.
    pub group_rank: Option<u32>,
    /// Global ranks `base_rank .. base_rank + nproc`.
    pub base_rank: Option<u32>,
    pub state: MemberState,
    /// Where its agent's status port answers, empty if it serves none.
    pub status_addr: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// In the round, its lease alive.
    Running,
    /// Its workers all succeeded in the round.
    Done,
    /// In the round, but its registration is gone (dead or left): the group must re-form.
    Missing,
    /// Registered, not in the round: joins at the next re-form.
    Waiting,
}

/// Summarises a run's view. A pure function of what etcd holds.
pub fn report(run_id: &str, v: &View) -> RunReport {
    let mut r = summary(run_id, v);
    let round = v.round.as_ref().map(|e| &*e.record);
    if let Some(rd) = round {
        add_round(&mut r, v, rd);
    }
    add_waiting(&mut r, v);
    (r.health, r.health_reason) = verdict(v, &r, round);
    r
}

/// The report of what `v` holds besides the round: the budget and group size the
/// registrations tell, the coordinator, and the records of nodes kept out, lost or gone;
/// no member rows yet, and its health still to be judged.
fn summary(run_id: &str, v: &View) -> RunReport {
    // Any live registration says the budget and group size every agent was given; the
    // coordinator's first.
    let told = v
        .coordinator
        .as_ref()
        .and_then(|c| v.members.get(c))
        .or_else(|| v.members.values().next())
        .map(|m| &m.record);
    RunReport {
        run_id: run_id.to_owned(),
        round: None,
        round_reason: String::new(),
        restarts: 0,
        sealed_at_ms: None,
        max_restarts: told.and_then(|m| m.max_restarts),
        restart_window_s: told.map_or(0, |m| m.restart_window_s),
        nodes: told
            .filter(|m| m.max_nodes > 0)
            .map(|m| (m.min_nodes, m.max_nodes)),
        world_size: 0,
        master: None,
        coordinator: v.coordinator.clone(),
        members: Vec::new(),
        health: Health::Forming,
        health_reason: String::new(),
        corrupt: v.corrupt.values().cloned().collect(),
        refused: v.refused.values().cloned().collect(),
        unhealthy: v
            .unhealthy
            .values()
            .map(|u| UnhealthyNode {
                node_id: u.node_id.clone(),
                reason: u.reason.clone(),
                failures: u.failures,
            })
            .collect(),
        quarantined: v
            .quarantine
            .values()
            .map(|q| QuarantinedMachine {
                machine: q.machine.clone(),
                node_id: q.node_id.clone(),
                reason: q.reason.clone(),
                until_ms: q.until_ms,
            })
            .collect(),
        left: left_nodes(v),
        last_hang: v.hangs.last_key_value().map(|(round, h)| HangRound {
            round: *round,
            reports: h.values().map(crate::etcd::hang_report).collect(),
        }),
    }
}

/// The sealed round `rd` into `r`: its number, reason and master, and one row per member
/// in rank order, with its state.
fn add_round(r: &mut RunReport, v: &View, rd: &v1::Round) {
    let done = v.done.get(&rd.number);
    r.round = Some(rd.number);
    r.round_reason = rd.reason.clone();
    r.restarts = rd.restart_count;
    r.sealed_at_ms = Some(rd.sealed_at_ms).filter(|&t| t > 0);
    let mut ranked: Vec<RoundMember> = rd.members.iter().map(RoundMember::from).collect();
    // The view refuses rounds whose sizes cannot form a group; none get here.
    r.world_size = ranks::rank_members(&mut ranked).unwrap_or_default();
    r.master = v
        .master
        .as_ref()
        .filter(|m| m.round == rd.number)
        .map(|m| format!("{}:{}", m.addr, m.port));
    for m in ranked {
        let state = if done.is_some_and(|d| d.contains(m.node_id())) {
            MemberState::Done
        } else if v.members.contains_key(m.node_id()) {
            MemberState::Running
        } else {
            MemberState::Missing
        };
        // The registration's, else the round's own record of the member (which the
        // ranked member holds: no search of the round per member).
        let status_addr = v
            .members
            .get(m.node_id())
            .map_or(&m.record, |e| &e.record)
            .status_addr
            .clone();
        r.members.push(MemberReport {
            status_addr,
            group_rank: Some(m.group_rank),
            base_rank: Some(m.base_rank),
            node_id: m.node_id().to_owned(),
            addr: m.addr().to_owned(),
            nproc: m.local_world_size(),
            state,
        });
    }
}

/// The registered nodes that are not in the round, after its members, oldest
/// registration first.
fn add_waiting(r: &mut RunReport, v: &View) {
    let mut waiting: Vec<_> = v
        .members
        .values()
        .filter(|m| !r.members.iter().any(|x| x.node_id == m.record.node_id))
        .collect();
    waiting.sort_by_key(|m| m.create_rev);
    for m in waiting {
        r.members.push(MemberReport {
            node_id: m.record.node_id.clone(),
            addr: m.record.addr.clone(),
            nproc: m.record.local_world_size,
            group_rank: None,
            base_rank: None,
            state: MemberState::Waiting,
            status_addr: m.record.status_addr.clone(),
        });
    }
}

/// The departures `v` holds, oldest first by the revision that wrote them; the last
/// [`left::KEPT`] (more stay in etcd only while a flood of them is being trimmed).
fn left_nodes(v: &View) -> Vec<LeftNode> {
    let mut all: Vec<_> = v.left.values().collect();
    all.sort_by_key(|e| e.mod_rev);
    let skip = all.len().saturating_sub(left::KEPT);
    all.into_iter()
        .skip(skip)
        .filter_map(|e| {
            let l = &e.record;
            Some(LeftNode {
                node_id: l.node_id.clone(),
                addr: l.addr.clone(),
                reason: left::kind_of(l)?.label(),
                detail: l.detail.clone(),
                at_ms: l.at_ms,
                round: l.round,
                written_by: l.written_by.clone(),
            })
        })
        .collect()
}
