//! The running group's hang watch: the progress judge, torchrun's file timer, what a hang
//! does (dumps, then a failure like a crash), and naming the rank behind across nodes
//! (every node of a hung round publishes where its ranks were; the node that declared
//! the hang compares them when the next round forms).

use std::time::Duration;

use fsdp_rendezvous::{HangReport, JobRecords, RankStep, Rendezvous, Round};
use nix::sys::signal::Signal;

use super::Phase;
use super::decide;
use super::driver::Loop;
use super::memory::RoundMembers;
use crate::config::{Config, HangTimeout};
use crate::failure::{Failure, WorkerExit};
use crate::hang::{self, Progress, Verdict};
use crate::supervisor::WorkerGroup;

/// How long the declaring node waits for the other nodes' reports once the next round
/// formed (they publish before they join it, so they are normally in already).
const REPORTS_PATIENCE: Duration = Duration::from_secs(2);
/// How long publishing a hang report may take: naming the culprit is worth a moment,
/// not a stuck re-form.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(2);

impl<R: Rendezvous> Loop<'_, R> {
    /// torchrun's file timer: signals the workers whose scopes expired (the group then
    /// fails like any crash and restarts); returns how long until the next expires.
    pub(super) fn reap_expired_scopes(&mut self, group: &WorkerGroup) -> Option<Duration> {
        let timer = self.file_timer.as_ref()?;
        let (expired, next) = timer.expired();
        let pids = group.pids();
        for s in expired {
            if s.signal <= 0 || !hang::file_timer::ours(s.pid, &pids) {
                continue;
            }
            let Ok(signal) = Signal::try_from(s.signal) else {
                continue;
            };
            tracing::warn!(scope = %s.scope_id, pid = s.pid, %signal, "a file-timer scope expired; signalling its worker");
            self.report.hung();
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(s.pid), signal);
        }
        next
    }

    /// The hang judge's verdict on the running `group` now (and the ranks' progress, for
    /// the straggler metrics). Ranks whose workers exited are not judged (a crash is the
    /// group's own event); once one exited 0 the group is finishing.
    pub(super) fn hang_verdict(&mut self, group: &WorkerGroup) -> Verdict {
        let Some(p) = &self.progress else {
            return Verdict::Healthy { recheck_at: None };
        };
        let now = std::time::Instant::now();
        let mut ranks = p.snapshot();
        self.report.ranks(&ranks, now);
        let workers = group.statuses();
        let exited = |rank: u32| workers.iter().any(|w| w.rank == rank && w.exit.is_some());
        // A worker here exited 0, or a rank here said its training is over (`finish`): a
        // rank that finished every step proves the others passed every collective too, and
        // what they do now is their end, not a step. Waiting for the exit alone judged a
        // slow final save as a hang whenever the finished rank's own teardown (the
        // interpreter, torch) took longer than a step's allowance, as under load.
        let finished = workers.iter().any(|w| w.exit.is_some_and(|e| e.success()))
            || ranks
                .iter()
                .any(|r| r.phase.as_ref().is_some_and(|(p, _)| p == hang::FINISH));
        if self.group_times.finishing.is_none() && finished {
            // Seen at the latest one look (a second) after it: never early.
            self.group_times.finishing = Some(now);
        }
        ranks.retain(|r| !exited(r.rank));
        hang::judge(now, &self.group_times, &ranks, &self.cfg.hang)
    }

    /// The group hangs: capture where every worker is, then fail it like a crash (the
    /// rank behind the others, if it is local, is named as the failing one).
    pub(super) async fn hung(
        &mut self,
        round: Round,
        group: WorkerGroup,
        behind: &[u32],
        reason: String,
    ) -> Phase {
        tracing::error!(%reason, "the worker group is hung");
        // Before anything stops: the other nodes learn of the hang from this record and
        // publish where their ranks were, so the culprit can be named across nodes.
        self.publish_hang(&round, true, reason.clone()).await;
        let workers: Vec<(u32, u32)> = group
            .statuses()
            .iter()
            .filter(|w| w.exit.is_none())
            .map(|w| (w.rank, w.pid))
            .collect();
        let dir = self.attempt.clone();
        let dumps =
            tokio::task::spawn_blocking(move || hang::dump::dump_all(&workers, dir.as_deref()))
                .await
                .unwrap_or_default();
        for d in &dumps {
            let path = d.path.as_ref().map(|p| p.display().to_string());
            tracing::warn!(rank = d.rank, pid = d.pid, dump = ?path, "where the hung worker is:\n{}", d.top(12));
        }
        self.report.hung();
        let statuses = group.statuses();
        let culprit = statuses
            .iter()
            .find(|w| behind.contains(&w.rank))
            .or(statuses.first());
        let first = Failure {
            local_rank: culprit.map_or(0, |w| w.local_rank),
            rank: culprit.map_or(0, |w| w.rank),
            pid: culprit.map_or(0, |w| w.pid),
            exit: WorkerExit::Hung,
            at: std::time::SystemTime::now(),
            error_file: None,
            report: None,
            stderr_tail: Vec::new(),
        };
        Phase::Failed {
            round,
            group,
            first,
        }
    }

    /// Publishes where this node's ranks were in the hung `round` (only rounds of several
    /// nodes whose ranks report progress, in shared records: there is nobody to compare
    /// with otherwise). The declaring node remembers the round, to name the culprit when
    /// the next forms.
    async fn publish_hang(&mut self, round: &Round, declared: bool, reason: String) {
        let Some(p) = &self.progress else { return };
        let ranks: Vec<RankStep> = p
            .snapshot()
            .into_iter()
            .filter(|r| r.reported)
            .map(|r| RankStep {
                rank: r.rank,
                last_step: r.last_step.map(|(n, _)| n),
                phase: r.phase.map(|(name, _)| name),
            })
            .collect();
        if round.group_world_size < 2 || ranks.is_empty() {
            return;
        }
        let report = HangReport {
            node_id: self.rdzv.node_id().unwrap_or(&self.host).to_owned(),
            declared,
            reason,
            ranks,
        };
        let Some(records) = self.rdzv.records() else {
            return;
        };
        let publish = records.report_hang(round.number, report);
        match tokio::time::timeout(PUBLISH_PATIENCE, publish).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not publish where this node's ranks were in the hang")
            }
            Err(_) => tracing::warn!(
                "publishing where this node's ranks were in the hang took too long; skipped"
            ),
        }
        if declared {
            self.memory.declared_hang = Some(RoundMembers::of(round));
        }
    }

    /// After this node's `round` broke (a failure here or elsewhere): if another node
    /// declared it hung, publish where this node's ranks were.
    pub(super) async fn answer_hang(&mut self, round: &Round) {
        if !decide::answers_hang(&self.memory, round, self.progress.is_some()) {
            return;
        }
        let Some(records) = self.rdzv.records() else {
            return;
        };
        let reports = records
            .hang_reports(round.number, &[], Duration::ZERO)
            .await;
        let declared = reports.iter().find(|r| r.declared);
        let Some(by) = declared.map(|r| r.node_id.clone()) else {
            return;
        };
        tracing::info!(round = round.number, declared_by = %by, "another node found the group hung; publishing where this node's ranks were");
        self.publish_hang(round, false, String::new()).await;
    }

    /// Once the round after a hang this node declared formed (or the run ends): compare
    /// every node's report and name the ranks behind.
    pub(super) async fn name_culprit(&mut self) {
        let Some(hung) = self.memory.declared_hang.take() else {
            return;
        };
        let (round, members) = (hung.number, hung.ids());
        let Some(records) = self.rdzv.records() else {
            return;
        };
        let reports = records
            .hang_reports(round, &members, REPORTS_PATIENCE)
            .await;
        let blame = hang::culprit::blame(&reports, &members);
        // `node rank` pairs, as a person reads them (not Rust's tuple text).
        let behind: Vec<String> = blame
            .behind
            .iter()
            .map(|(node, rank)| format!("{node} rank {rank}"))
            .collect();
        tracing::error!(round, behind = %behind.join(", "), "the hang's culprit: {}", blame.text);
        self.report.culprit(round, &blame.text);
    }
}

/// The socket workers report progress to, unless hang detection is off (or the socket
/// cannot be made: then nobody is judged, and the agent says so).
pub(super) fn progress_socket(cfg: &Config) -> Option<Progress> {
    if cfg.hang.timeout == HangTimeout::Off {
        return None;
    }
    match Progress::start(&std::env::temp_dir()) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the progress socket; hangs will not be detected");
            None
        }
    }
}

/// torchrun's file-timer server, when the agent's environment asks for it.
pub(super) fn file_timer() -> Option<hang::file_timer::FileTimer> {
    match hang::file_timer::FileTimer::from_env()? {
        Ok(t) => {
            tracing::info!(path = %t.path().display(), "serving torchrun's file timer");
            Some(t)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot make the file-timer FIFO; expired scopes will not be reaped");
            None
        }
    }
}
