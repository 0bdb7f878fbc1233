//! The running group's straggler watch ([`crate::straggler`] decides; this is its I/O).
//!
//! The group's rank 0 judges: every [`JUDGE_EVERY`] it asks every member's status server
//! for its ranks' paces (on a task, so the loop never waits for a slow peer), judges
//! them, says in the log when a node becomes a straggler and when it stops being one, and
//! shows the scores in its status and metrics. Under `--straggler-policy replace` it
//! quarantines the machine of a node named past the bound, as the failure policy
//! quarantines a faulty one; that node sees its machine quarantined in the view it
//! watches and leaves (exit 80), and the others re-form without it.
//!
//! One judge, not every node: each look asks every member once (N requests, not N²).
//! Each answer is a member's whole status, which lists the round's members: a look moves
//! O(N²) bytes, nothing at tens of nodes and megabytes at a thousand; a dedicated, smaller
//! request is the scale work's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{JobRecords, Rendezvous, Round};
use nix::sys::signal::Signal;
use tokio::task::JoinHandle;

use super::Phase;
use super::decide;
use super::driver::Loop;
use crate::config::Mode;
use crate::straggler::{self, Judgement, Pace, Policy, Room};
use crate::supervisor::WorkerGroup;

/// How often the judge looks.
pub const JUDGE_EVERY: Duration = Duration::from_secs(5);
/// How long one member's status server may take to answer the judge.
const ASK_PATIENCE: Duration = Duration::from_secs(2);

/// One member's answer to the judge.
pub(super) struct Answer {
    node: String,
    /// Its machine, as its agent names it (what a quarantine keeps out).
    machine: String,
    paces: Vec<Pace>,
}

/// What the judge remembers between looks.
#[derive(Default)]
pub(super) struct Judge {
    /// The round judged: a new group starts over (its ranks' windows do).
    round: u64,
    asking: Option<JoinHandle<Vec<Answer>>>,
    next_at: Option<Instant>,
    named: BTreeSet<String>,
    named_since: BTreeMap<String, Instant>,
    /// When this node last took a straggler out (kept across rounds: one per window;
    /// another judge's take-outs are read from the quarantine records).
    last_out: Option<Instant>,
}

impl<R: Rendezvous> Loop<'_, R> {
    /// The straggler watch's turn in the running loop: leaves when this node's machine
    /// was quarantined meanwhile (by the judge, as a straggler, or by any rule), and, on
    /// the group's rank 0, judges.
    pub(super) async fn watch_stragglers(
        &mut self,
        round: &Round,
        group: &mut WorkerGroup,
    ) -> Option<Phase> {
        if let Some(phase) = self.quarantined_while_running(group).await {
            return Some(phase);
        }
        if self.progress.is_none() || round.group_rank != 0 || round.members.len() < 2 {
            // Not the judge (or no longer): scores it showed would be stale for good.
            self.report.straggler_scores(Vec::new());
            self.judge = Judge {
                last_out: self.judge.last_out,
                ..Judge::default()
            };
            return None;
        }
        if self.judge.round != round.number {
            self.judge = Judge {
                round: round.number,
                last_out: self.judge.last_out,
                ..Judge::default()
            };
            self.report.straggler_scores(Vec::new());
        }
        let now = Instant::now();
        if self
            .judge
            .asking
            .as_ref()
            .is_some_and(JoinHandle::is_finished)
        {
            let asked = self.judge.asking.take()?;
            let answers = asked.await.unwrap_or_default();
            return self.judged(round, answers, now).await;
        }
        if self.judge.asking.is_none() && self.judge.next_at.is_none_or(|t| now >= t) {
            self.judge.next_at = Some(now + JUDGE_EVERY);
            let members = round
                .members
                .iter()
                .filter(|m| !m.status_addr().is_empty())
                .map(|m| (m.node_id().to_owned(), m.status_addr().to_owned()))
                .collect();
            self.judge.asking = Some(tokio::spawn(ask_paces(members)));
        }
        None
    }

    /// Judges the members' answers; says what changed; under `replace`, takes one node
    /// out when [`straggler::take_out`] says so.
    async fn judged(&mut self, round: &Round, answers: Vec<Answer>, now: Instant) -> Option<Phase> {
        if answers.len() < 2 {
            // Nobody to compare: the next look judges again, the named stay named.
            return None;
        }
        let paces: Vec<Pace> = answers.iter().flat_map(|a| a.paces.clone()).collect();
        let j = straggler::judge(&paces, &self.judge.named, &straggler::RULES);
        let named = j.still_named(&self.judge.named);
        let (became, cleared) = straggler::changes(&self.judge.named, &named);
        for node in &became {
            let words = j.words(node).unwrap_or_default();
            tracing::warn!(round = round.number, "a straggler: {words}");
            self.judge.named_since.insert(node.clone(), now);
        }
        for node in &cleared {
            let words = j
                .words(node)
                .unwrap_or_else(|| format!("node {node}: no longer judged"));
            tracing::info!(round = round.number, "no longer a straggler: {words}");
            self.judge.named_since.remove(node);
        }
        self.judge.named = named;
        self.report.straggler_scores(scores(&j));
        if self.cfg.failure.straggler != Policy::Replace {
            return None;
        }
        let room = Room {
            members: round.members.len() as u32,
            min_nodes: min_nodes(&self.cfg.mode),
        };
        let machines = || {
            answers
                .iter()
                .map(|a| (a.node.as_str(), a.machine.as_str()))
        };
        let last_out = self.last_take_out(now);
        let (out, why) = straggler::take_out(
            now,
            &j,
            &self.judge.named_since,
            last_out,
            room,
            |node| straggler::on_machine(machines(), node),
            &straggler::PACING,
        );
        let Some(node) = out else {
            if !self.judge.named.is_empty() {
                tracing::debug!("{why}");
            }
            return None;
        };
        let machine = &answers.iter().find(|a| a.node == node)?.machine;
        if self.take_out(&node, machine, &why).await {
            self.judge.last_out = Some(now);
        }
        None
    }

    /// When a straggler was last taken out of the run: by this node, or by any judge as
    /// the standing quarantines say (written `--quarantine-for` before they end; every
    /// agent of a run is given the same).
    fn last_take_out(&mut self, now: Instant) -> Option<Instant> {
        let for_ms = u64::try_from(self.cfg.failure.quarantine_for.as_millis()).unwrap_or(u64::MAX);
        let now_ms = fsdp_rendezvous::unix_ms();
        let written = self.rdzv.records().and_then(|r| {
            r.quarantines()
                .into_iter()
                .filter(|(reason, _)| reason.starts_with(straggler::REASON))
                .map(|(_, until)| until.saturating_sub(for_ms))
                .max()
        });
        let recorded = written.map(|ms| {
            now.checked_sub(Duration::from_millis(now_ms.saturating_sub(ms)))
                .unwrap_or(now)
        });
        self.judge.last_out.max(recorded)
    }

    /// Quarantines `machine`, where the straggler `node` runs: it leaves on seeing it.
    /// Whether the record was written. The write holds the loop for at most
    /// [`ASK_PATIENCE`]: a signal meanwhile waits for it, and is not lost.
    async fn take_out(&mut self, node: &str, machine: &str, why: &str) -> bool {
        let reason = format!("{}{why}", straggler::REASON);
        tracing::warn!(%node, %machine, "--straggler-policy replace: taking the straggler out ({why})");
        let until = fsdp_rendezvous::unix_ms().saturating_add(
            u64::try_from(self.cfg.failure.quarantine_for.as_millis()).unwrap_or(u64::MAX),
        );
        let Some(records) = self.rdzv.records() else {
            return false;
        };
        let said = tokio::time::timeout(
            ASK_PATIENCE,
            records.quarantine(machine.to_owned(), Some(node.to_owned()), reason, until),
        )
        .await;
        let written = matches!(said, Ok(Ok(())));
        if !written {
            tracing::warn!(%node, "could not record the straggler's quarantine; it stays until a later look takes it out");
        }
        written
    }

    /// This node was taken out while its workers ran (a straggler: its machine quarantined
    /// under its node id): stops them as a SIGTERM would (the others re-form in place
    /// first when the workers can) and leaves with exit 80. A quarantine of the machine
    /// that names another node (an agent of the same host that failed) keeps this one
    /// running: it applies at the next join, as before.
    async fn quarantined_while_running(&mut self, group: &mut WorkerGroup) -> Option<Phase> {
        let machine = self.cfg.failure.machine.clone();
        let me = self.rdzv.node_id()?.to_owned();
        let records = self.rdzv.records()?;
        if records.quarantined_node(&machine)? != me {
            return None;
        }
        let (reason, _) = records.quarantined(&machine)?;
        tracing::error!(%machine, %reason, "this machine was quarantined; stopping the workers and leaving the run");
        let leave = decide::kept_out(&format!("machine {machine} quarantined: {reason}"));
        self.report
            .show(Shown::Stopping, format!("quarantined: {reason}"));
        let grace = self.rules.term_timeout;
        let (first, _) = decide::signal_for_workers(Signal::SIGTERM, &self.stoppable(), grace);
        let reformable = self.reformable(group);
        if decide::depart_first(Signal::SIGTERM, &reformable) {
            self.depart_early(leave.clone()).await;
        }
        if let Some(sig) = self.stop(group, first, grace).await {
            return Some(decide::signalled(sig).into());
        }
        Some(leave.into())
    }
}

/// `--nnodes`' minimum (a fixed group's size: it can lose nobody).
fn min_nodes(mode: &Mode) -> u32 {
    match mode {
        Mode::Etcd(m) => m.rendezvous.min_nodes,
        Mode::Static { nnodes, .. } => *nnodes,
        Mode::Standalone { .. } => 1,
    }
}

/// The judgement as status shows it.
fn scores(j: &Judgement) -> Vec<fsdp_proto::v1::NodeScore> {
    j.nodes
        .iter()
        .map(|n| fsdp_proto::v1::NodeScore {
            node_id: n.node.clone(),
            score: n.score,
            rank: n.rank,
            busy_seconds: n.busy_s,
            straggler: n.straggler,
        })
        .collect()
}

/// Every member's answer from its `(node, status address)`, asked at once; a member that
/// does not answer within [`ASK_PATIENCE`] is left out of this look.
async fn ask_paces(members: Vec<(String, String)>) -> Vec<Answer> {
    let asks = members.into_iter().map(|(node, addr)| async move {
        let ask = async {
            let mut client =
                fsdp_rendezvous::etcd::liveness::status_client(&addr, ASK_PATIENCE).await?;
            client
                .get_status(fsdp_proto::v1::GetStatusRequest {})
                .await
                .ok()
                .map(tonic::Response::into_inner)
        };
        let state = tokio::time::timeout(ASK_PATIENCE, ask)
            .await
            .ok()
            .flatten()?;
        // Only the member asked, and one that names its machine: a status port reused by
        // another agent, or an agent too old to say its machine, is not judged (a
        // quarantine of the wrong machine, or of none, would take out the wrong node).
        if state.node_id != node || state.machine.is_empty() {
            return None;
        }
        let paces = state
            .ranks
            .iter()
            .map(|r| Pace {
                node: node.clone(),
                rank: r.rank,
                busy_s: r.busy_seconds,
                steps: r.paced_steps,
            })
            .collect();
        Some(Answer {
            node,
            machine: state.machine,
            paces,
        })
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}
