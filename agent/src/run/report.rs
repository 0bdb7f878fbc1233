//! What the outside world sees of the loop: the status [`Board`] (gRPC status, health,
//! metrics) follows the phases through this one reporter, so the loop's decisions carry
//! no bookkeeping of their own.

use std::sync::Arc;
use std::time::Instant;

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{Change, Round, RoundMember};

use super::AgentExit;
use super::memory::missing;
use crate::error::AgentError;
use crate::status::Board;
use crate::supervisor::{WorkerGroup, WorkerStatus};

/// Turns the loop's transitions into status updates and timings.
pub struct Reporter {
    board: Board,
    /// When this node's running group last broke: the start of the detect and re-form
    /// timings.
    broke_at: Option<Instant>,
    /// The members of the last round, to tell a loss (detect timing) from a growth.
    previous_members: Arc<[RoundMember]>,
}

impl Reporter {
    pub fn new(board: &Board) -> Self {
        Self {
            board: board.clone(),
            broke_at: None,
            previous_members: Vec::new().into(),
        }
    }

    /// Names this node and where its backend counts what the metrics export.
    pub fn node(&self, node_id: &str, counters: Option<fsdp_rendezvous::Counters>) {
        self.board.set_node(node_id, counters);
    }

    /// The machine this agent runs on.
    pub fn machine(&self, machine: &str) {
        self.board.machine(machine);
    }

    /// The straggler judge's scores (this node judges its group), or none.
    pub fn straggler_scores(&self, scores: Vec<fsdp_proto::v1::NodeScore>) {
        self.board.straggler_scores(scores);
    }

    /// The reporting ranks' progress at `now`, for the straggler metrics.
    pub fn ranks(&self, ranks: &[crate::hang::RankProgress], now: std::time::Instant) {
        let views = ranks
            .iter()
            .filter(|r| r.reported)
            .map(|r| fsdp_proto::v1::RankStatus {
                rank: r.rank,
                last_step: r.last_step.map_or(0, |(n, _)| n),
                step_seconds: r.recent.back().map_or(0.0, |d| d.as_secs_f64()),
                silent_seconds: r
                    .last_report
                    .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
                busy_seconds: crate::straggler::median_s(r.busy.iter().copied()).unwrap_or(0.0),
                paced_steps: r.busy.len() as u32,
            })
            .collect();
        self.board.ranks(views);
    }

    /// The group hung, or a file-timer scope expired (the re-form itself is recorded by
    /// the failure that follows).
    pub fn hung(&self) {
        self.board.hung();
    }

    /// The health check failed for `reason`, or passed (`None`).
    pub fn health(&self, failed: Option<&str>) {
        self.board.health(failed);
        if let Some(reason) = failed {
            self.show(Shown::Rendezvous, format!("health check failed: {reason}"));
        }
    }

    /// How many worker starts were warm (`--prewarm`), how many cold, and why the last
    /// cold one was.
    pub fn starts(&self, warm: u32, cold: u32, last_cold: &str) {
        self.board.starts(warm, cold, last_cold);
    }

    /// The restarts `--max-restarts` is held against now (all, or those in the window).
    pub fn restarts(&self, counted: u32) {
        self.board.restarts(counted);
    }

    /// The hang this node declared in `round` points at this (see [`crate::hang::culprit`]).
    pub fn culprit(&self, round: u64, text: &str) {
        self.board.culprit(round, text);
    }

    /// The group lost `node` from `round`, noticed this way.
    pub fn lost(&self, node: &str, round: u64, how: fsdp_rendezvous::Detection) {
        self.board.lost(node, round, how);
    }

    pub fn formed(&mut self, round: &Round, coordinator: Option<String>) {
        self.board.round(round, coordinator);
        if let Some(t) = self.broke_at
            && missing(&self.previous_members, &round.members)
                .next()
                .is_some()
        {
            self.board.observe_detect(t.elapsed());
        }
        self.previous_members = round.members.clone();
    }

    /// The round's workers run.
    pub fn started(&mut self, round: &Round, group: &WorkerGroup) {
        self.runs(
            group,
            format!("workers started in round {}", round.number),
            round,
        );
    }

    /// The kept workers took `round` in place: they run, as if started in it, and the
    /// re-form is timed like one that restarted them.
    pub fn re_formed(&mut self, round: &Round, group: &WorkerGroup, restored: &str) {
        self.board.in_place(restored);
        let what = format!(
            "workers re-formed in place in round {} (restored from {restored})",
            round.number
        );
        self.runs(group, what, round);
    }

    fn runs(&mut self, group: &WorkerGroup, what: String, round: &Round) {
        self.board.workers(&group.statuses(), false);
        self.board
            .transition(Shown::Running, format!("{what} ({})", round.reason));
        if let Some(t) = self.broke_at.take() {
            self.board.observe_reform(t.elapsed());
        }
    }

    /// The running group broke (`label` names why in the metric); `shown` is the phase
    /// the status shows meanwhile.
    pub fn broke(&mut self, label: &str, shown: Shown, text: String) {
        self.broke_at = Some(Instant::now());
        self.board.reform_started(label);
        self.board.transition(shown, text);
    }

    /// The group's workers as they are now; `count_exits` counts their own exits (not the
    /// agent's stops) in the exit-code metric.
    pub fn workers(&self, group: &WorkerGroup, count_exits: bool) {
        self.board.workers(&group.statuses(), count_exits);
    }

    /// A worker exited while the others may still run (a rank that finished first).
    pub fn exits(&self, workers: &[WorkerStatus]) {
        self.board.workers(workers, false);
    }

    pub fn show(&self, shown: Shown, text: impl Into<String>) {
        self.board.transition(shown, text);
    }

    /// The loop ended.
    pub fn ended(&self, result: &Result<AgentExit, AgentError>) {
        match result {
            Ok(AgentExit::Finished) => self.show(Shown::Succeeded, "every node finished"),
            Ok(AgentExit::Failed { exit_code }) => self.show(
                Shown::Failed,
                format!("giving up with exit code {exit_code}"),
            ),
            Ok(AgentExit::Signalled(sig)) => self.show(Shown::Leaving, format!("{sig} received")),
            Err(e) => {
                self.board.rendezvous_error();
                self.show(Shown::Failed, e.chain());
            }
        }
    }
}

/// The metric label of a re-form's reason.
pub fn change_label(change: &Change) -> &'static str {
    match change {
        Change::MemberLost { .. } => "member lost",
        Change::NodeWaiting { .. } => "node waiting",
        Change::PeerFailed { .. } => "peer failed",
        Change::NewRound { .. } => "new round",
        Change::Fenced { .. } => "fenced",
        Change::Halted(_) => "halted",
    }
}
