//! The agent's loop as explicit phases: rendezvous, start the group, watch it, and decide —
//! restart, re-form, finish or give up — until the job ends for this node.
//!
//! ```text
//!            ┌─────────────────────────────────────────────────────────────┐
//!            ▼                                                             │
//!   Join ──round──▶ Start ──▶ Running ──group changed──▶ Reform ───────────┤
//!    │               │          │  └────worker failed──▶ Failed ───────────┤
//!    │         budget spent     └──every worker 0──▶ Barrier ──changed─────┘
//!    │               │                                  │  all done / timed out
//!    └──signal──▶ Leave ◀──────── signal (any phase) ───┴──────────▶ Leave ──▶ exit
//! ```
//!
//! Each phase is one async function that does its work and returns the next [`Phase`].
//! Interruption has one rule: every await that can take time goes through
//! [`Loop::interruptible`], and a signal there ends in `Leave` (the workers, if any, are
//! stopped with the signal first); while workers run, the group changing is the other
//! interruption ([`Wake`]). Status and metrics follow the phases through one
//! [`report::Reporter`]; the budget and backoff decisions are pure functions in
//! [`crate::policy`]. A new event (say, "a worker hung") is one more [`Wake`] variant
//! and the phase it leads to.

mod gate;
mod halt;
mod hang;
mod quarantine;
mod report;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{Change, Departure, Finish, JobRecords, Rendezvous, RendezvousError, Round};
use nix::sys::signal::Signal;

use crate::config::Config;
use crate::error::AgentError;
use crate::exit_code;
use crate::failure::{Failure, WorkerExit, summary};
use crate::hang::{Progress, Verdict};
use crate::policy::{AfterFailure, Budget, budget, restart_backoff, restarts_counted};
use crate::signals::Signals;
use crate::status::Board;
use crate::supervisor::output::{Console, Stream};
use crate::supervisor::spare::Spares;
use crate::supervisor::{
    Channels, GroupEvent, GroupSpec, WorkerGroup, attempt_dir, run_log_dir, spare_command,
};
use report::{Reporter, change_label, describe};

/// How the agent's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentExit {
    /// Every worker succeeded.
    Finished,
    /// The restart budget is spent; exit with this code.
    Failed { exit_code: u8 },
    /// The agent was told to stop by this signal.
    Signalled(Signal),
}

/// How often a running group's progress is judged at the least.
const HANG_LOOK: Duration = Duration::from_secs(1);

/// How long leaving the rendezvous may take before the agent exits without it.
const DEPART_PATIENCE: Duration = Duration::from_secs(5);

/// Where the loop is; each variant carries what its phase needs.
enum Phase {
    /// Ask the rendezvous for the next round.
    Join,
    /// A sealed round with this node in it and budget left: start its workers.
    Start(Round),
    /// The workers run: wait for them, the group, or a signal.
    Running { round: Round, group: WorkerGroup },
    /// The group changed: stop the workers, then join the next round.
    Reform {
        round: Round,
        group: WorkerGroup,
        change: Change,
    },
    /// A worker failed: stop the rest, report the failure, back off, join again.
    Failed {
        round: Round,
        group: WorkerGroup,
        first: Failure,
    },
    /// Every local worker succeeded: wait for the other nodes (the exit barrier).
    Barrier { round: Round },
    /// Leave the rendezvous this way and end with this exit.
    Leave { how: Departure, exit: AgentExit },
}

/// What woke a running group's phase: each source of events, as one value.
enum Wake {
    Group(GroupEvent),
    Signal(Signal),
    Changed(Result<Change, RendezvousError>),
    /// A rank's progress allowance ran out (it may have reported since: judge again).
    HangCheck,
}

/// Runs the job on this node until it ends.
pub async fn run<R: Rendezvous>(
    cfg: &Config,
    rdzv: &mut R,
    signals: &mut Signals,
    board: &Board,
) -> Result<AgentExit, AgentError> {
    let (console, console_thread) = Console::start();
    let mut report = Reporter::new(board);
    let result = supervise(cfg, rdzv, signals, &console, &mut report).await;
    report.ended(&result);
    drop(console);
    // Every worker line queued before the end is written before the agent exits.
    console_thread.close().await;
    result
}

async fn supervise<R: Rendezvous>(
    cfg: &Config,
    rdzv: &mut R,
    signals: &mut Signals,
    console: &Console,
    report: &mut Reporter,
) -> Result<AgentExit, AgentError> {
    let host = fsdp_rendezvous::hostname();
    let node = rdzv.node_id().unwrap_or(&host).to_owned();
    report.node(&node, rdzv.records().map(|r| r.counters()));
    let run_dir = log_root(cfg)?;
    if let Some(dir) = &run_dir {
        tracing::info!(log_dir = %dir.display(), "worker logs and error files");
    }
    let mut l = Loop {
        cfg,
        rdzv,
        signals,
        console,
        report,
        host,
        run_dir,
        last_failure: None,
        last_restart_count: 0,
        last_round: None,
        progress: hang::progress_socket(cfg),
        file_timer: hang::file_timer(),
        group_times: crate::hang::GroupTimes::started(std::time::Instant::now()),
        attempt: None,
        declared_hang: None,
        ledger: crate::policy::ProgressLedger::default(),
        failed: None,
        failed_rounds: Vec::new(),
        root_cause: None,
        spares: cfg.prewarm.as_ref().map(|modules| {
            let mut spares = Spares::new(modules, cfg.nproc_per_node);
            // The first round's spares import while the rendezvous gathers nodes.
            spares.fill(|local_rank| spare_command(cfg, local_rank));
            spares
        }),
    };
    let mut phase = Phase::Join;
    loop {
        phase = match phase {
            Phase::Join => l.join().await?,
            Phase::Start(round) => l.start(round).await?,
            Phase::Running { round, group } => l.running(round, group).await?,
            Phase::Reform {
                round,
                group,
                change,
            } => l.reform(round, group, change).await,
            Phase::Failed {
                round,
                group,
                first,
            } => l.failed(round, group, first).await?,
            Phase::Barrier { round } => l.barrier(round).await?,
            Phase::Leave { how, exit } => {
                let result = l.leave(how, exit).await;
                l.write_launcher_error(&result);
                return result;
            }
        };
    }
}

/// The loop's state that lives across phases.
struct Loop<'a, R> {
    cfg: &'a Config,
    rdzv: &'a mut R,
    signals: &'a mut Signals,
    console: &'a Console,
    report: &'a mut Reporter,
    host: String,
    run_dir: Option<PathBuf>,
    /// This node's last worker failure: its code is the exit code if the budget runs out.
    last_failure: Option<WorkerExit>,
    last_restart_count: u32,
    /// The last round this node ran, and its members: whoever of them the next round
    /// lacks was lost, and how that was noticed is reported once the next round forms (by
    /// then every agent has the record), whatever change woke this node first (a peer's
    /// death often reaches the survivors' workers, as a failure, before its eviction).
    last_round: Option<(u64, Vec<String>)>,
    /// The workers' progress reports, when hang detection is on.
    progress: Option<Progress>,
    /// torchrun's file-timer watchdog, when `TORCHELASTIC_ENABLE_FILE_TIMER=1`.
    file_timer: Option<crate::hang::file_timer::FileTimer>,
    /// When the running group started and since when it is finishing (for the hang
    /// judge), and its attempt directory (for hang dumps).
    group_times: crate::hang::GroupTimes,
    attempt: Option<PathBuf>,
    /// The round this node found hung, and its members: the culprit is named once every
    /// node had the chance to say where its ranks were.
    declared_hang: Option<(u64, Vec<String>)>,
    /// How far the ranks got over the run's failed attempts (the no-progress rule).
    ledger: crate::policy::ProgressLedger,
    /// The last round, if it ended in a failure, and its members (quarantine judges it
    /// once the next round forms).
    failed: Option<(u64, Vec<String>)>,
    /// The latest failed rounds, oldest first.
    failed_rounds: Vec<crate::policy::FailedRound>,
    /// The first failure of this node's last failed group: the root cause when the job
    /// ends on it.
    root_cause: Option<Failure>,
    /// `--prewarm`'s spare interpreters; dropped (killed) with the loop.
    spares: Option<Spares>,
}

/// Leaving after `sig`: the run goes on without this node.
fn signalled(sig: Signal) -> Phase {
    Phase::Leave {
        how: Departure::Left,
        exit: AgentExit::Signalled(sig),
    }
}

impl<R: Rendezvous> Loop<'_, R> {
    /// The one interruption rule: `work`, unless a signal comes first.
    async fn interruptible<T>(
        signals: &mut Signals,
        work: impl Future<Output = T>,
    ) -> Result<T, Signal> {
        tokio::select! {
            v = work => Ok(v),
            sig = signals.recv() => Err(sig),
        }
    }

    /// Stops the group with `signal` and `grace`; a signal meanwhile skips the grace.
    /// Returns it.
    async fn stop(
        &mut self,
        group: &mut WorkerGroup,
        signal: Signal,
        grace: Duration,
    ) -> Option<Signal> {
        let mut late = None;
        let signals = &mut *self.signals;
        group
            .stop(signal, grace, async { late = Some(signals.recv().await) })
            .await;
        late
    }

    async fn join(&mut self) -> Result<Phase, AgentError> {
        let round = loop {
            if let Some(end) = self.kept_out() {
                return Ok(end);
            }
            if let Some(end) = self.gate().await {
                return Ok(end);
            }
            // A node that waits long (a spare) checks its health again now and then.
            let recheck = self.cfg.health.as_ref().map(|h| h.interval);
            let recheck = async {
                match recheck {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = self.rdzv.next_round() => match r {
                    Err(RendezvousError::Halted(h)) => return Ok(self.halted(&h)),
                    r => break r?,
                },
                sig = self.signals.recv() => return Ok(signalled(sig)),
                () = recheck => {}
            }
        };
        let coordinator = self.rdzv.records().and_then(|r| r.coordinator());
        self.report.formed(&round, coordinator);
        self.report_losses(&round);
        self.name_culprit().await;
        if let Some(end) = self.judge_quarantine(&round).await {
            return Ok(end);
        }
        tracing::info!(
            master_addr = %round.master_addr,
            master_port = round.master_port,
            round = round.number,
            world_size = round.world_size,
            group_rank = round.group_rank,
            group_world_size = round.group_world_size,
            restart_count = round.restart_count,
            "group formed"
        );
        // The budget is read from the sealed round, so every node decides alike.
        let counted = restarts_counted(&round, self.cfg.failure.restart_window);
        self.report.restarts(counted);
        match budget(counted, self.cfg.max_restarts, self.last_failure) {
            Budget::Spent { exit_code } => {
                tracing::error!(
                    restart_count = round.restart_count,
                    counted,
                    max_restarts = self.cfg.max_restarts,
                    exit_code,
                    "the restart budget is spent; giving up"
                );
                return Ok(Phase::Leave {
                    how: Departure::Failed,
                    exit: AgentExit::Failed { exit_code },
                });
            }
            Budget::Left if round.restart_count > self.last_restart_count => {
                let window = match self.cfg.failure.restart_window {
                    Some(w) => format!(" within the last {w:?}"),
                    None => String::new(),
                };
                tracing::warn!(
                    "restarting the worker group after a failure: restart {counted} of {}{window}",
                    self.cfg.max_restarts
                );
            }
            Budget::Left => {}
        }
        self.last_restart_count = round.restart_count;
        Ok(Phase::Start(round))
    }

    async fn start(&mut self, round: Round) -> Result<Phase, AgentError> {
        let attempt = match &self.run_dir {
            Some(dir) => Some(attempt_dir(dir, round.restart_count).map_err(|source| {
                AgentError::LogDir {
                    path: dir.clone(),
                    source,
                }
            })?),
            None => None,
        };
        self.attempt = attempt.clone();
        let members = round.members.iter().map(|m| m.node_id.clone()).collect();
        self.last_round = Some((round.number, members));
        if let Some(p) = &self.progress {
            p.reset(round.base_rank..round.base_rank + self.cfg.nproc_per_node);
        }
        if let Some(t) = &self.file_timer {
            t.reset();
        }
        self.group_times = crate::hang::GroupTimes::started(std::time::Instant::now());
        let spec = GroupSpec {
            config: self.cfg,
            round: &round,
            attempt_dir: attempt,
            console: self.console,
            host: &self.host,
            channels: Channels {
                progress: self.progress.as_ref().map(Progress::path),
                timer_file: self.file_timer.as_ref().map(|t| t.path()),
            },
        };
        // A start may wait for a spare that is still importing: a signal meanwhile ends it
        // (the workers already started die with the dropped group).
        let spawn = WorkerGroup::spawn(&spec, self.spares.as_mut());
        let group = match Self::interruptible(self.signals, spawn).await {
            Ok(group) => group?,
            Err(sig) => {
                tracing::info!(signal = %sig, "signal received while starting workers; leaving the run");
                return Ok(signalled(sig));
            }
        };
        if let Some(spares) = &mut self.spares {
            self.report.starts(spares);
            // The next start's spares import while this group trains.
            spares.fill(|local_rank| spare_command(self.cfg, local_rank));
        }
        tracing::info!(pids = ?group.pids(), entrypoint = %self.cfg.entrypoint.display(), "workers started");
        self.report.started(&round, &group);
        Ok(Phase::Running { round, group })
    }

    async fn running(&mut self, round: Round, mut group: WorkerGroup) -> Result<Phase, AgentError> {
        let deadline = match self.hang_verdict(&group) {
            Verdict::Hung { behind, reason } => {
                return Ok(self.hung(round, group, &behind, reason).await);
            }
            Verdict::Healthy { recheck_at } => recheck_at,
        };
        let now = std::time::Instant::now();
        // Reports arrive without waking the loop: with progress watched, look again at
        // least once a second, so a rank that starts reporting (or a deadline that moves)
        // is seen.
        let look = self.progress.as_ref().map(|_| now + HANG_LOOK);
        let scope = self.reap_expired_scopes(&group).map(|next| now + next);
        let recheck_at = [deadline, look, scope].into_iter().flatten().min();
        let hang_timer = async {
            match recheck_at {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let report = &*self.report;
        let wake = tokio::select! {
            ev = group.next_event(|workers| report.exits(workers)) => Wake::Group(ev),
            sig = self.signals.recv() => Wake::Signal(sig),
            change = self.rdzv.changed() => Wake::Changed(change),
            () = hang_timer => Wake::HangCheck,
        };
        match wake {
            Wake::HangCheck => Ok(Phase::Running { round, group }),
            Wake::Signal(sig) => {
                tracing::info!(signal = %sig, "signal received; stopping workers and leaving the run");
                self.stop(&mut group, sig, self.cfg.term_timeout).await;
                Ok(signalled(sig))
            }
            Wake::Changed(Ok(change)) => Ok(Phase::Reform {
                round,
                group,
                change,
            }),
            Wake::Changed(Err(e)) => {
                // The workers get their grace (a checkpoint on SIGTERM) before the agent
                // gives up on the rendezvous.
                tracing::error!(error = %e, "the rendezvous failed; stopping workers");
                self.report
                    .show(Shown::Stopping, format!("rendezvous failed: {e}"));
                self.stop(&mut group, Signal::SIGTERM, self.cfg.term_timeout)
                    .await;
                Err(e.into())
            }
            Wake::Group(GroupEvent::Failed(first)) => Ok(Phase::Failed {
                round,
                group,
                first,
            }),
            Wake::Group(GroupEvent::Succeeded) => {
                let finished = Self::interruptible(self.signals, group.finish()).await;
                self.report.workers(&group, true);
                if let Err(sig) = finished {
                    return Ok(signalled(sig));
                }
                self.report
                    .show(Shown::Finishing, "every local worker succeeded");
                Ok(Phase::Barrier { round })
            }
        }
    }

    async fn reform(&mut self, round: Round, mut group: WorkerGroup, change: Change) -> Phase {
        // A fenced node's workers must be gone before etcd can expire its lease and hand
        // their ranks to others: their grace is cut to half the time left.
        let grace = match &change {
            Change::Fenced {
                reason,
                stop_within,
            } => {
                tracing::warn!(%reason, "fencing: stopping the workers");
                self.cfg.term_timeout.min(*stop_within / 2)
            }
            _ => {
                tracing::info!(?change, "group changed; re-forming");
                self.cfg.term_timeout
            }
        };
        self.report
            .broke(change_label(&change), Shown::Stopping, describe(&change));
        let late = self.stop(&mut group, Signal::SIGTERM, grace).await;
        self.report.workers(&group, false);
        if let Some(sig) = late {
            return signalled(sig);
        }
        match &change {
            Change::Halted(h) => return self.halted(h),
            Change::PeerFailed { .. } => {
                self.failed_round(&round);
                // A node that found the group hung charges a failure after saying so.
                self.answer_hang(&round).await;
                // A peer's failure ended this attempt too: it counts for the no-progress
                // rule (the peer judges its own exit code).
                if let AfterFailure::Halt { exit_code, reason } =
                    self.judge_failure(WorkerExit::Lost)
                {
                    if let Err(sig) = self.announce_halt(exit_code, &reason).await {
                        return signalled(sig);
                    }
                    return self.leave_halted(exit_code, &reason);
                }
            }
            Change::Fenced { .. } | Change::MemberLost { .. } if self.own_loss(&change) => {
                if let Err(sig) = self.charge_own_loss(&change).await {
                    return signalled(sig);
                }
            }
            _ => {}
        }
        self.report.show(
            Shown::Rendezvous,
            format!("re-forming: {}", describe(&change)),
        );
        Phase::Join
    }

    async fn failed(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
        first: Failure,
    ) -> Result<Phase, AgentError> {
        let label = match first.exit {
            WorkerExit::Hung => "hang",
            _ => "worker failed",
        };
        self.report.broke(
            label,
            Shown::Stopping,
            format!("worker rank {} failed: {}", first.rank, first.exit),
        );
        self.report_fault(&round, first.exit).await;
        self.root_cause = Some(first.clone());
        let verdict = self.judge_failure(first.exit);
        if let AfterFailure::Halt { exit_code, reason } = &verdict {
            if let Err(sig) = self.announce_halt(*exit_code, reason).await {
                self.stop(&mut group, sig, Duration::ZERO).await;
                return Ok(signalled(sig));
            }
        }
        // A signal during the stop escalates to SIGKILL; it is honoured right after.
        let late = self
            .stop(&mut group, Signal::SIGTERM, self.cfg.term_timeout)
            .await;
        self.report.workers(&group, true);
        tracing::error!(
            rank = first.rank,
            local_rank = first.local_rank,
            pid = first.pid,
            exit = %first.exit,
            "worker group failed"
        );
        self.print_summary(&round, &group, &first).await;
        drop(group);
        if let Some(sig) = late {
            return Ok(signalled(sig));
        }
        if let AfterFailure::Halt { exit_code, reason } = &verdict {
            return Ok(self.leave_halted(*exit_code, reason));
        }
        self.last_failure = Some(first.exit);
        self.report.show(
            Shown::Rendezvous,
            format!(
                "restarting after worker rank {} failed: {}",
                first.rank, first.exit
            ),
        );
        match Self::interruptible(self.signals, self.rdzv.record_failure()).await {
            Ok(r) => r?,
            Err(sig) => return Ok(signalled(sig)),
        };
        let pause = restart_backoff(round.restart_count);
        tracing::info!(
            backoff_ms = pause.as_millis() as u64,
            "worker failure reported; re-forming"
        );
        if let Err(sig) = Self::interruptible(self.signals, tokio::time::sleep(pause)).await {
            return Ok(signalled(sig));
        }
        // Our workers may have failed because another node stopped its hung ones.
        self.answer_hang(&round).await;
        Ok(Phase::Join)
    }

    /// The failure summary, through the console so that it follows the workers' last
    /// lines. A hung worker did not fail on its own: the group has no failure of it.
    async fn print_summary(&self, round: &Round, group: &WorkerGroup, first: &Failure) {
        let failures = if group.failures().is_empty() {
            std::slice::from_ref(first)
        } else {
            group.failures()
        };
        let text = summary(
            &self.cfg.entrypoint.display(),
            round.restart_count,
            &self.host,
            failures,
        );
        self.console
            .write(Stream::Stderr, format!("{text}\n").into_bytes())
            .await;
    }

    /// Whether `change` is this node losing its place in its round by its own fault: it
    /// fenced itself, or its lease expired while it was frozen or cut off.
    fn own_loss(&self, change: &Change) -> bool {
        match change {
            Change::Fenced { .. } => true,
            Change::MemberLost { node } => self.rdzv.node_id() == Some(node.as_str()),
            _ => false,
        }
    }

    /// After an [`Self::own_loss`]: its workers were stopped as if they had failed, and the
    /// job is charged a restart like a worker failure. The coordinator charges it only if
    /// the round lost no other member, so the survivors of a group that went on without
    /// this node are not charged; a node alone in its job is, and its workers see the
    /// restart count move (without it, a worker whose start freezes its node would start
    /// again with the same count forever).
    async fn charge_own_loss(&mut self, change: &Change) -> Result<(), Signal> {
        tracing::warn!(
            change = %describe(change),
            "this node lost its place in the group; charging a restart"
        );
        match Self::interruptible(self.signals, self.rdzv.record_failure()).await? {
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not charge the restart"),
        }
        Ok(())
    }

    /// The members of the last round that `round` lacks were lost: says how each loss was
    /// noticed.
    fn report_losses(&mut self, round: &Round) {
        let Some((from, members)) = self.last_round.take() else {
            return;
        };
        let me = self.rdzv.node_id().map(str::to_owned);
        let Some(records) = self.rdzv.records() else {
            return;
        };
        let lost = members
            .iter()
            .filter(|id| Some(id.as_str()) != me.as_deref())
            .filter(|id| !round.members.iter().any(|m| &m.node_id == *id));
        for node in lost {
            let how = records.detection(node, from);
            tracing::info!(%node, round = from, detection = how.label(), detect = ?how, "how the lost member was noticed");
            self.report.lost(node, from, how);
        }
    }

    async fn barrier(&mut self, round: Round) -> Result<Phase, AgentError> {
        let timeout = self.cfg.exit_barrier();
        if round.group_world_size > 1 {
            tracing::info!(
                timeout_s = timeout.as_secs_f64(),
                "all workers finished; waiting for the other nodes"
            );
        }
        let outcome = match Self::interruptible(self.signals, self.rdzv.finish(timeout)).await {
            Ok(f) => f?,
            Err(sig) => return Ok(signalled(sig)),
        };
        Ok(match outcome {
            Finish::AllDone => {
                tracing::info!(
                    nodes = round.group_world_size,
                    "every node finished; the job is done"
                );
                Phase::Leave {
                    how: Departure::Finished,
                    exit: AgentExit::Finished,
                }
            }
            Finish::Changed(Change::Halted(h)) => self.halted(&h),
            Finish::Changed(change) => {
                self.report.broke(
                    change_label(&change),
                    Shown::Rendezvous,
                    format!("re-forming: {}", describe(&change)),
                );
                tracing::warn!(
                    ?change,
                    "the group broke before every node finished; re-forming"
                );
                Phase::Join
            }
            Finish::TimedOut { unfinished } => {
                tracing::error!(
                    ?unfinished,
                    "other nodes did not finish within the exit barrier timeout"
                );
                Phase::Leave {
                    how: Departure::Finished,
                    exit: AgentExit::Failed {
                        exit_code: exit_code::BARRIER_TIMEOUT,
                    },
                }
            }
        })
    }

    /// The job failed on this node's own worker: tell the scheduler, in torchrun's format,
    /// through `TORCHELASTIC_ERROR_FILE` if it set one.
    fn write_launcher_error(&self, result: &Result<AgentExit, AgentError>) {
        let (Some(path), Some(root), Ok(AgentExit::Failed { exit_code })) =
            (&self.cfg.launcher_error_file, &self.root_cause, result)
        else {
            return;
        };
        match crate::failure::write_launcher_error(path, root, &self.host, *exit_code) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "wrote the root cause to the launcher's error file")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not write the launcher's error file")
            }
        }
    }

    async fn leave(&mut self, how: Departure, exit: AgentExit) -> Result<AgentExit, AgentError> {
        // Leaving is a courtesy (peers notice at once instead of after a lease TTL): a hung
        // etcd or a second signal must not keep the agent from exiting.
        let depart = tokio::time::timeout(DEPART_PATIENCE, self.rdzv.depart(how));
        match Self::interruptible(self.signals, depart).await {
            Ok(Ok(r)) => r?,
            Ok(Err(_)) => tracing::warn!(
                "the rendezvous did not take the goodbye within {DEPART_PATIENCE:?}; peers notice within a lease TTL"
            ),
            Err(sig) => tracing::warn!(signal = %sig, "signal while leaving the run; not waiting"),
        }
        Ok(exit)
    }
}

/// The run's log directory, or `None` when logs go to `/dev/null`.
fn log_root(cfg: &Config) -> Result<Option<PathBuf>, AgentError> {
    let base = match &cfg.logs.dir {
        Some(d) if d == std::path::Path::new("/dev/null") => return Ok(None),
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "fsdp-agent-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )),
    };
    let dir = run_log_dir(&base, &cfg.run_id).map_err(|source| AgentError::LogDir {
        path: base.clone(),
        source,
    })?;
    Ok(Some(dir))
}
