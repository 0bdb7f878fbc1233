//! A run's state as `fsdp-agent status` shows it: one ranged read of the run's keys,
//! decoded into a [`View`] and summarised by [`report`], a pure function.

use etcd_client::{Client, GetOptions};
use fsdp_proto::v1;
use serde::Serialize;

use super::keys::Keys;
use super::left;
use super::view::View;
use crate::{RendezvousError, RoundMember, ranks};

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

/// Declares [`Health`] with its names and [`Health::ALL`] from one list, so the list the
/// docs are checked against (tests/tests/doc_claims.rs) cannot miss a value.
macro_rules! health {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// The verdict `fsdp-agent status` gives a run.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Health {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Health {
            /// Every value, in the order `fsdp-agent status` documents them.
            pub const ALL: &'static [Health] = &[$(Health::$variant),*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }
    };
}

health! {
    /// Every member of the round is alive and the master is published.
    Healthy => "healthy",
    /// Nodes are gathering for a round, or rank 0 has not published the master yet.
    Forming => "forming",
    /// A member of the round is gone or a worker failed: the group is re-forming.
    Degraded => "degraded",
    /// Every member of the round finished.
    Finished => "finished",
    /// No node is registered and the last round did not finish.
    Stopped => "stopped",
    /// A value in the run's keys cannot be trusted.
    Corrupt => "corrupt",
    /// A node ended the run for every node (a failure no restart mends).
    Halted => "halted",
}

/// Summarises a run's view. A pure function of what etcd holds.
pub fn report(run_id: &str, v: &View) -> RunReport {
    // Any live registration says the budget and group size every agent was given; the
    // coordinator's first.
    let told = v
        .coordinator
        .as_ref()
        .and_then(|c| v.members.get(c))
        .or_else(|| v.members.values().next())
        .map(|m| &m.record);
    let mut r = RunReport {
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
            reports: h.values().map(super::hang_report).collect(),
        }),
    };
    let round = v.round.as_ref().map(|e| &e.record);
    let done = round.and_then(|rd| v.done.get(&rd.number));
    if let Some(rd) = round {
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
    let count = |s: MemberState| r.members.iter().filter(|m| m.state == s).count();
    let (health, why) = if !r.corrupt.is_empty() {
        (
            Health::Corrupt,
            format!("{} untrusted key(s): {}", r.corrupt.len(), r.corrupt[0]),
        )
    } else if let Some(h) = v.halted() {
        (Health::Halted, h.to_string())
    } else if let Some(rd) = round {
        let in_round = rd.members.len();
        if count(MemberState::Done) == in_round {
            (
                Health::Finished,
                format!("all {in_round} node(s) of round {} finished", rd.number),
            )
        } else if v.members.is_empty() {
            (
                Health::Stopped,
                "no node is registered; the run is not running".into(),
            )
        } else if v.failures.contains(&rd.number) {
            (
                Health::Degraded,
                format!("a worker failed in round {}; restarting", rd.number),
            )
        } else if count(MemberState::Missing) > 0 {
            let gone: Vec<_> = r
                .members
                .iter()
                .filter(|m| m.state == MemberState::Missing)
                .map(|m| m.node_id.as_str())
                .collect();
            (
                Health::Degraded,
                format!(
                    "node(s) gone from round {}: {}; re-forming",
                    rd.number,
                    gone.join(", ")
                ),
            )
        } else if r.master.is_none() {
            (
                Health::Forming,
                format!(
                    "round {} sealed; rank 0 has not published the master yet",
                    rd.number
                ),
            )
        } else {
            let waiting = count(MemberState::Waiting);
            let extra = if waiting > 0 {
                format!("; {waiting} node(s) waiting to join")
            } else {
                String::new()
            };
            (
                Health::Healthy,
                format!(
                    "{in_round} node(s), {} worker(s) running{extra}",
                    r.world_size
                ),
            )
        }
    } else if let (true, Some(last)) = (v.members.is_empty(), r.left.last()) {
        // Nobody waits any more: the run ended before a round formed (every agent gave up
        // at its join timeout, or was stopped). "Forming" beside the left rows read as if
        // it still might.
        (
            Health::Stopped,
            format!(
                "no round ever formed and no node is registered; the last to go was {} ({}: {})",
                last.node_id, last.reason, last.detail
            ),
        )
    } else {
        (
            Health::Forming,
            match r.nodes {
                Some((min, max)) if v.members.len() < min as usize => format!(
                    "{} node(s) registered of the {min} needed (--nnodes {min}:{max}); waiting for {} more (each agent gives up after its join timeout)",
                    v.members.len(),
                    min as usize - v.members.len()
                ),
                Some((min, max)) => format!(
                    "{} node(s) registered (--nnodes {min}:{max}); the coordinator seals when {max} are there or the last call after the latest arrival ends",
                    v.members.len()
                ),
                None => format!(
                    "{} node(s) registered; no round sealed yet",
                    v.members.len()
                ),
            },
        )
    };
    r.health = health;
    r.health_reason = why;
    r
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

/// The rules the run's agents judge records by, as far as their registrations tell them:
/// the coordinator's `--nnodes` (else the first registration's). Status judges as the
/// agents do: a round larger than the run allows, or a halt no member wrote, is shown as
/// `refused`, not as the run's state.
fn told_bounds(keys: &Keys, kvs: &[etcd_client::KeyValue]) -> super::Allowed {
    let registrations: Vec<v1::Member> = kvs
        .iter()
        .filter(|kv| kv.key().starts_with(keys.members().as_bytes()))
        .filter_map(|kv| fsdp_proto::decode::<v1::Member>("", kv.value()).ok())
        .collect();
    let coordinator = kvs
        .iter()
        .find(|kv| kv.key() == keys.key::<v1::Coordinator>("").as_bytes())
        .and_then(|kv| fsdp_proto::decode::<v1::Coordinator>("", kv.value()).ok());
    let told = coordinator
        .and_then(|c| registrations.iter().find(|m| m.node_id == c.node_id))
        .or(registrations.first())
        .filter(|m| m.max_nodes > 0);
    let defaults = super::Allowed::default();
    super::Allowed {
        nodes: told.map_or(defaults.nodes.clone(), |m| 1..=m.max_nodes),
        ..defaults
    }
}

/// Reads the run's keys and summarises them; `Ok(None)` when the run has no keys at all.
pub async fn inspect(
    client: &mut Client,
    prefix: &str,
    run_id: &str,
) -> Result<Option<RunReport>, RendezvousError> {
    let keys = Keys::new(prefix, run_id).map_err(RendezvousError::InvalidConfig)?;
    let resp = client
        .get(keys.root(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|source| RendezvousError::Etcd {
            what: "reading the run's keys",
            source,
        })?;
    if resp.kvs().is_empty() {
        return Ok(None);
    }
    let mut view = View {
        allowed: told_bounds(&keys, resp.kvs()),
        ..View::default()
    };
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        view.put(
            &keys,
            &key,
            kv.value(),
            kv.create_revision(),
            kv.mod_revision(),
            kv.lease(),
        );
    }
    // A halt is judged by the round it ends when that round comes after it in the read
    // (keys come sorted: `ctl/halt` before `ctl/round`). With no round at all (lost, or
    // refused as a forgery) nothing can vouch for its writer: shown refused, not halted.
    if view.round.is_none() && view.halt.is_some() {
        view.halt = None;
        let key = keys.key::<v1::Halt>("");
        let why = format!(
            "halt record at {key} names a writer no round of this run can vouch for (no round is readable)"
        );
        view.refused.insert(key, why);
    }
    Ok(Some(report(run_id, &view)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::view::{LeftEntry, MemberEntry, RoundEntry};

    fn member(id: &str, n: u32) -> v1::Member {
        v1::Member::from(v1::MemberFields {
            schema: 1,
            node_id: id.into(),
            addr: format!("{id}.local"),
            local_world_size: n,
            wants_round: 0,
            ..Default::default()
        })
    }

    fn view(round_members: &[(&str, u32)], live: &[&str]) -> View {
        let mut v = View::default();
        let all: Vec<_> = round_members.iter().map(|(id, n)| member(id, *n)).collect();
        v.round = Some(RoundEntry {
            record: std::sync::Arc::new(v1::Round {
                schema: 1,
                number: 4,
                members: all.clone(),
                restart_count: 1,
                reason: "a member was lost".into(),
                ..Default::default()
            }),
            mod_rev: 1,
        });
        v.master = Some(v1::Master {
            schema: 1,
            round: 4,
            addr: "a.local".into(),
            port: 29500,
        });
        for (i, id) in live.iter().enumerate() {
            v.members.insert(
                (*id).into(),
                MemberEntry {
                    record: member(id, 2),
                    create_rev: i as i64,
                },
            );
        }
        v
    }

    /// Where status reaches a member: its registration says, and for a member whose
    /// registration is gone, the round's own record of it.
    #[test]
    fn a_members_status_address_is_its_registrations_else_the_rounds() {
        let mut v = view(&[("a", 2), ("b", 2)], &["a"]);
        let round = v.round.as_mut().unwrap();
        let rec = std::sync::Arc::make_mut(&mut round.record);
        rec.members[0].status_addr = "a.local:1".into();
        rec.members[1].status_addr = "b.local:1".into();
        v.members.get_mut("a").unwrap().record.status_addr = "a.local:2".into();
        let r = report("job", &v);
        let addrs: Vec<&str> = r.members.iter().map(|m| m.status_addr.as_str()).collect();
        assert_eq!(addrs, ["a.local:2", "b.local:1"]);
    }

    #[test]
    fn a_full_round_is_healthy_with_ranks_and_waiting_nodes_listed() {
        let r = report("job", &view(&[("a", 2), ("b", 4)], &["a", "b", "c"]));
        assert_eq!(r.health, Health::Healthy, "{}", r.health_reason);
        assert_eq!(r.world_size, 6);
        assert_eq!(r.master.as_deref(), Some("a.local:29500"));
        assert_eq!(r.members[1].base_rank, Some(2));
        assert_eq!(r.members[2].state, MemberState::Waiting);
        assert!(r.health_reason.contains("1 node(s) waiting"));
    }

    #[test]
    fn a_missing_member_degrades_and_all_done_finishes() {
        let r = report("job", &view(&[("a", 2), ("b", 2)], &["a"]));
        assert_eq!(r.health, Health::Degraded);
        assert!(r.health_reason.contains('b'), "{}", r.health_reason);

        let mut v = view(&[("a", 2), ("b", 2)], &[]);
        v.done
            .entry(4)
            .or_default()
            .extend(["a".into(), "b".into()]);
        assert_eq!(report("job", &v).health, Health::Finished);

        let v = view(&[("a", 2)], &[]);
        assert_eq!(report("job", &v).health, Health::Stopped);
    }

    /// The nodes that left, ordered by the revision that wrote each record (etcd's
    /// order, not the writers' clocks), newest last; the last hundred.
    #[test]
    fn departures_are_listed_by_revision_newest_last_the_last_hundred() {
        let mut v = view(&[("a", 2)], &["a"]);
        let said = |node: &str, kind: v1::LeftKind, at_ms: u64| v1::Left {
            schema: 1,
            node_id: node.into(),
            incarnation: 1,
            addr: format!("{node}.local"),
            kind: kind.into(),
            detail: format!("{node}'s reason"),
            at_ms,
            round: 3,
            written_by: "a".into(),
        };
        fn put(v: &mut View, l: v1::Left, mod_rev: i64) {
            let tail = crate::etcd::record::left_tail(&l.node_id, l.incarnation);
            v.left.insert(tail, LeftEntry { record: l, mod_rev });
        }
        // c's clock runs ahead; b was written later all the same.
        put(&mut v, said("c", v1::LeftKind::Unhealthy, 9_000), 10);
        put(&mut v, said("b", v1::LeftKind::Lost, 5_000), 11);
        let r = report("job", &v);
        let got: Vec<(&str, &str)> = r
            .left
            .iter()
            .map(|l| (l.node_id.as_str(), l.reason))
            .collect();
        assert_eq!(got, [("c", "unhealthy"), ("b", "lost")]);
        assert_eq!(r.left[0].detail, "c's reason");
        assert_eq!((r.left[1].round, r.left[1].at_ms), (3, 5_000));
        assert_eq!(r.health, Health::Healthy, "departures change no health");

        for i in 0..150 {
            put(
                &mut v,
                said(&format!("n{i}"), v1::LeftKind::Finished, 0),
                100 + i,
            );
        }
        let r = report("job", &v);
        assert_eq!(r.left.len(), left::KEPT);
        assert_eq!(r.left.last().unwrap().node_id, "n149");
    }

    /// A run whose only agent gave up (its join timeout) or was stopped before any round:
    /// it said "forming: 0 node(s) registered" beside the row saying it left.
    #[test]
    fn a_run_that_never_formed_and_has_nobody_left_is_stopped_and_says_why() {
        let mut v = View::default();
        let l = v1::Left {
            schema: 1,
            node_id: "n1".into(),
            incarnation: 1,
            addr: "n1.local".into(),
            kind: v1::LeftKind::Left.into(),
            detail: "no round formed within join_timeout (8 s)".into(),
            at_ms: 1,
            round: 0,
            written_by: "n1".into(),
        };
        let tail = crate::etcd::record::left_tail(&l.node_id, l.incarnation);
        v.left.insert(
            tail,
            LeftEntry {
                record: l,
                mod_rev: 3,
            },
        );
        let r = report("job", &v);
        assert_eq!(r.health, Health::Stopped, "{}", r.health_reason);
        assert!(
            r.health_reason.contains("no round ever formed"),
            "{}",
            r.health_reason
        );
        assert!(
            r.health_reason.contains("join_timeout (8 s)"),
            "{}",
            r.health_reason
        );
        // One still waiting: forming, as before.
        v.members.insert(
            "n2".into(),
            MemberEntry {
                record: member("n2", 2),
                create_rev: 4,
            },
        );
        assert_eq!(report("job", &v).health, Health::Forming);
    }

    #[test]
    fn an_unpublished_master_is_forming_and_garbage_is_corrupt() {
        let mut v = view(&[("a", 2)], &["a"]);
        v.master = None;
        assert_eq!(report("job", &v).health, Health::Forming);
        v.corrupt.insert("k".into(), "value at k is garbage".into());
        let r = report("job", &v);
        assert_eq!(r.health, Health::Corrupt);
        assert!(r.health_reason.contains("garbage"));
    }
}
