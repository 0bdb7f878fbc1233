//! The loop's driver: the only place that awaits. Each phase does its I/O (the
//! rendezvous, the worker group, sleeps, signals, the reporter), hands what it learnt to
//! a decision in [`super::decide`], and carries the decision out.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{
    Change, Departure, JobRecords, LeftKind, LeftReason, Rendezvous, RendezvousError, Round,
};
use nix::sys::signal::Signal;

use super::decide::{
    self, AfterBarrier, AfterChange, AfterFailed, AfterFormed, Leave, OnWake, Rules, Wake,
    signalled,
};
use super::handover::{HandedOver, kept_exit};
use super::memory::{Memory, RoundMembers};
use super::report::{Reporter, change_label};
use super::{AgentExit, DEPART_PATIENCE, HANG_LOOK, Phase, hang};
use crate::config::Config;
use crate::environment;
use crate::error::AgentError;
use crate::failure::{Failure, summary};
use crate::hang::{Progress, Verdict};
use crate::policy::AfterFailure;
use crate::signals::Signals;
use crate::supervisor::output::{Console, Stream};
use crate::supervisor::spare::Spares;
use crate::supervisor::{Channels, GroupSpec, WorkerGroup, attempt_dir, spare_command};

/// The one interruption rule: `work`, unless a signal comes first.
pub(super) async fn interruptible<T>(
    signals: &mut Signals,
    work: impl Future<Output = T>,
) -> Result<T, Signal> {
    tokio::select! {
        v = work => Ok(v),
        sig = signals.recv() => Err(sig),
    }
}

/// What the driver holds: the I/O it does, and the [`Memory`] the decisions read.
pub(super) struct Loop<'a, R> {
    pub(super) cfg: &'a Config,
    pub(super) rules: Rules,
    pub(super) rdzv: &'a mut R,
    pub(super) signals: &'a mut Signals,
    pub(super) console: &'a Console,
    pub(super) report: &'a mut Reporter,
    pub(super) host: String,
    pub(super) run_dir: Option<PathBuf>,
    pub(super) memory: Memory,
    /// The workers' progress reports, when hang detection is on.
    pub(super) progress: Option<Progress>,
    /// torchrun's file-timer watchdog, when `TORCHELASTIC_ENABLE_FILE_TIMER=1`.
    pub(super) file_timer: Option<crate::hang::file_timer::FileTimer>,
    /// When the running group started and since when it is finishing (for the hang
    /// judge), and its attempt directory (for hang dumps).
    pub(super) group_times: crate::hang::GroupTimes,
    pub(super) attempt: Option<PathBuf>,
    /// `--prewarm`'s spare interpreters; dropped (killed) with the loop.
    spares: Option<Spares>,
    /// A failure summary waiting for the next round to say whether a peer was lost first
    /// ([`decide::defer_summary`]): the worker and the banner that would blame it.
    pending_summary: Option<(Failure, String)>,
    /// Workers started cold without `--prewarm` (with it the spares count).
    cold_starts: u32,
    /// This node already left the rendezvous ([`decide::depart_first`]).
    departed: bool,
    /// The workers of a group that changed, kept running to take the next round in place
    /// ([`decide::in_place`]): from the re-form to the next start, which hands them the
    /// round (`handover.rs`), or to the loop's end, which stops them.
    pub(super) kept: Option<WorkerGroup>,
    /// The straggler judge's memory (`straggler.rs`), on the group's rank 0.
    pub(super) judge: super::straggler::Judge,
}

impl<'a, R: Rendezvous> Loop<'a, R> {
    pub(super) fn new(
        cfg: &'a Config,
        rdzv: &'a mut R,
        signals: &'a mut Signals,
        console: &'a Console,
        report: &'a mut Reporter,
        host: String,
        run_dir: Option<PathBuf>,
    ) -> Self {
        Self {
            cfg,
            rules: Rules::of(cfg),
            rdzv,
            signals,
            console,
            report,
            host,
            run_dir,
            memory: Memory::default(),
            progress: hang::progress_socket(cfg),
            file_timer: hang::file_timer(),
            group_times: crate::hang::GroupTimes::started(std::time::Instant::now()),
            attempt: None,
            spares: cfg.prewarm.as_ref().map(|modules| {
                let mut spares = Spares::new(modules, cfg.nproc_per_node);
                // The first round's spares import while the rendezvous gathers nodes.
                spares.fill(|local_rank| spare_command(cfg, local_rank));
                spares
            }),
            pending_summary: None,
            cold_starts: 0,
            departed: false,
            kept: None,
            judge: super::straggler::Judge::default(),
        }
    }

    /// Stops the group with `signal` and `grace`; a signal meanwhile skips the grace.
    /// Returns it.
    pub(super) async fn stop(
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

    /// What each local rank of the running group said of itself (empty: progress is not
    /// watched), for [`decide::first_stop_signal`] and [`decide::signal_for_workers`].
    pub(super) fn stoppable(&self) -> Vec<decide::Stoppable> {
        self.progress.as_ref().map_or_else(Vec::new, |p| {
            p.snapshot()
                .iter()
                .map(|r| decide::Stoppable {
                    // A worker that re-forms in place takes SIGUSR1 as its node leaving:
                    // it stops at the next step boundary, its part handed to its buddy.
                    saves_on_warning: r.saves_on_warning || r.reforms_in_place,
                    slowest_step: r.last_step.and(r.recent.iter().max().copied()),
                })
                .collect()
        })
    }

    /// The best step this node's ranks reported in the attempt that just ended (`None`:
    /// none, or progress is not watched).
    fn reached(&self) -> Option<u64> {
        self.progress.as_ref().and_then(|p| {
            p.snapshot()
                .iter()
                .filter_map(|r| r.last_step.map(|(n, _)| n))
                .max()
        })
    }

    /// Waits for the next round (a health gate before each try, a quarantined machine
    /// leaves), then hands it to the decisions of a formed round.
    pub(super) async fn join(&mut self) -> Result<Phase, AgentError> {
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
                    Ok(round) if round.broken.is_some() => {
                        if let Some((exit_code, failures)) = decide::spent(&self.memory, &round, &self.rules) {
                            // Failures, not restarts: with --max-restarts 0 the first
                            // failure spends the budget and no restart ever happened.
                            tracing::error!(
                                round = round.number,
                                failures,
                                max_restarts = self.cfg.max_restarts,
                                exit_code,
                                "the restart budget is spent; giving up"
                            );
                            return Ok(decide::failed(exit_code).into());
                        }
                    }
                    Err(e @ (RendezvousError::Timeout(_) | RendezvousError::AnotherJob(_))) => {
                        return Err(self.gave_up_waiting(e).await);
                    }
                    r => break r?,
                },
                sig = self.signals.recv() => return Ok(signalled(sig).into()),
                () = recheck => {}
                w = kept_exit(&mut self.kept) => {
                    if let Some(end) = self.kept_worker_exited(w).await {
                        return Ok(end);
                    }
                }
            }
        };
        self.formed(round).await
    }

    /// No round formed within the join timeout, or the run is another job's: the run's
    /// records keep why this node went (`fsdp-agent status` showed nothing of a run whose
    /// agents all gave up, nor of a stranger turned away), then the error ends the agent.
    async fn gave_up_waiting(&mut self, e: RendezvousError) -> AgentError {
        let why = LeftReason::new(LeftKind::Failed, e.to_string());
        let depart =
            tokio::time::timeout(DEPART_PATIENCE, self.rdzv.depart(Departure::Failed, why));
        if let Ok(Ok(Err(left))) = interruptible(self.signals, depart).await {
            tracing::warn!(error = %left, "could not record why this node left");
        }
        e.into()
    }

    async fn formed(&mut self, round: Round) -> Result<Phase, AgentError> {
        let coordinator = self.rdzv.records().and_then(|r| r.coordinator());
        self.report.formed(&round, coordinator);
        let lost = self.report_losses(&round);
        self.settle_summary(&lost).await;
        self.name_culprit().await;
        if let Some(end) = self.judge_quarantine(&round).await {
            return Ok(end);
        }
        let (next, counted) = decide::formed(&mut self.memory, &round, &self.rules);
        self.report.restarts(counted);
        match next {
            // No "group formed" first: no worker of this round will start.
            AfterFormed::GiveUp { exit_code } => {
                tracing::error!(
                    round = round.number,
                    failures = counted,
                    max_restarts = self.cfg.max_restarts,
                    exit_code,
                    "the restart budget is spent; giving up"
                );
                Ok(decide::failed(exit_code).into())
            }
            AfterFormed::Start { restart } => {
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
                if let Some(warning) = restart {
                    tracing::warn!("{warning}");
                }
                Ok(Phase::Start(round))
            }
        }
    }

    /// Starts the round's workers: hands it to the workers kept in place, if any, and
    /// spawns fresh ones where there are none (or they did not take it).
    pub(super) async fn start(&mut self, round: Round) -> Result<Phase, AgentError> {
        let round = match self.kept.take() {
            Some(group) => match self.hand_over(round, group).await? {
                HandedOver::Then(phase) => return Ok(*phase),
                HandedOver::Fresh(round) => round,
            },
            None => round,
        };
        self.start_fresh(round).await
    }

    /// Spawns the round's workers, in a new attempt directory.
    async fn start_fresh(&mut self, round: Round) -> Result<Phase, AgentError> {
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
        self.memory.last_round = Some(RoundMembers::of(&round));
        if let Some(p) = &self.progress {
            p.reset(round.base_rank..round.base_rank + self.cfg.nproc_per_node);
            // A socket an earlier worker bound would fail the new one's bind.
            crate::control::remove(p.path(), self.cfg.nproc_per_node);
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
        let group = match interruptible(self.signals, spawn).await {
            Ok(group) => group?,
            Err(sig) => {
                tracing::info!(signal = %sig, "signal received while starting workers; leaving the run");
                return Ok(signalled(sig).into());
            }
        };
        match &mut self.spares {
            Some(spares) => {
                self.report
                    .starts(spares.warm, spares.cold, &spares.last_cold);
                // The next start's spares import while this group trains.
                spares.fill(|local_rank| spare_command(self.cfg, local_rank));
            }
            None => {
                self.cold_starts += group.pids().len() as u32;
                self.report.starts(0, self.cold_starts, "no --prewarm");
            }
        }
        tracing::info!(pids = ?group.pids(), entrypoint = %self.cfg.entrypoint.display(), "workers started");
        self.report.started(&round, &group);
        Ok(Phase::Running { round, group })
    }

    /// Waits for the first of the group's events, a signal, the group changing and the
    /// hang judge's next look, and carries out what it leads to.
    pub(super) async fn running(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
    ) -> Result<Phase, AgentError> {
        if let Some(phase) = self.watch_stragglers(&round, &mut group).await {
            return Ok(phase);
        }
        let wake = match self.wake(&mut group).await {
            Ok(wake) => wake,
            Err((behind, reason)) => return Ok(self.hung(round, group, &behind, reason).await),
        };
        match decide::on_wake(wake, &self.rules) {
            OnWake::Judge => Ok(Phase::Running { round, group }),
            OnWake::Stop { signal, grace } => {
                Ok(self.stop_on_signal(&mut group, signal, grace).await)
            }
            OnWake::Reform(change) => {
                // Here only, not in `reform()`: a group handed over to re-form in place
                // (`handover.rs`) re-initialises with its new peers, and a worker that
                // exits then is the change's doing, deliberately not charged there.
                if decide::own_exit_first(&change) {
                    if let Some(first) = group.failed_before_now().await {
                        tracing::info!(%change, "a worker had failed before the change was seen: the failure is this node's");
                        return Ok(Phase::Failed {
                            round,
                            group,
                            first,
                        });
                    }
                }
                Ok(Phase::Reform {
                    round,
                    group,
                    change,
                })
            }
            OnWake::Broken { error, grace } => {
                Err(self.rendezvous_failed(&mut group, error, grace).await)
            }
            OnWake::Failed(first) => Ok(Phase::Failed {
                round,
                group,
                first,
            }),
            OnWake::Finish => {
                let finished = interruptible(self.signals, group.finish()).await;
                self.report.workers(&group, true);
                if let Err(sig) = finished {
                    return Ok(signalled(sig).into());
                }
                self.report
                    .show(Shown::Finishing, "every local worker succeeded");
                Ok(Phase::Barrier { round })
            }
        }
    }

    /// The agent was told to stop with `signal`: stops the workers (with a warning instead
    /// where they all save on one, [`decide::signal_for_workers`]) and leaves.
    pub(super) async fn stop_on_signal(
        &mut self,
        group: &mut WorkerGroup,
        signal: Signal,
        grace: Duration,
    ) -> Phase {
        tracing::warn!(
            "{signal} received: stopping the workers (grace {:?}) and leaving the run; send it again (Ctrl-C) to kill them now",
            grace
        );
        let (first, why) = decide::signal_for_workers(signal, &self.stoppable(), grace);
        if first != signal {
            tracing::info!(signal = %first, "{why}");
        }
        let reformable = self.reformable(group);
        if decide::depart_first(signal, &reformable) {
            tracing::info!(
                "leaving the rendezvous first: the others re-form in place while this node's workers finish their step and hand their parts over"
            );
            self.depart_early(signalled(signal)).await;
        }
        self.stop(group, first, grace).await;
        signalled(signal).into()
    }

    /// The rendezvous failed while workers run: they get their grace, then the error ends
    /// the agent.
    pub(super) async fn rendezvous_failed(
        &mut self,
        group: &mut WorkerGroup,
        error: RendezvousError,
        grace: Duration,
    ) -> AgentError {
        tracing::error!(error = %error, "the rendezvous failed; stopping workers");
        self.report
            .show(Shown::Stopping, format!("rendezvous failed: {error}"));
        self.stop(group, Signal::SIGTERM, grace).await;
        error.into()
    }

    /// The next event of a running group, or the ranks behind and why, when the hang
    /// judge finds it hung now.
    async fn wake(&mut self, group: &mut WorkerGroup) -> Result<Wake, (Vec<u32>, String)> {
        let deadline = match self.hang_verdict(group) {
            Verdict::Hung { behind, reason } => return Err((behind, reason)),
            Verdict::Healthy { recheck_at } => recheck_at,
        };
        let now = std::time::Instant::now();
        // Reports arrive without waking the loop: with progress watched, look again at
        // least once a second, so a rank that starts reporting (or a deadline that moves)
        // is seen.
        let look = self.progress.as_ref().map(|_| now + HANG_LOOK);
        let scope = self.reap_expired_scopes(group).map(|next| now + next);
        let recheck_at = [deadline, look, scope].into_iter().flatten().min();
        let hang_timer = async {
            match recheck_at {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let report = &*self.report;
        Ok(tokio::select! {
            ev = group.next_event(|workers| report.exits(workers)) => Wake::Group(ev),
            sig = self.signals.recv() => Wake::Signal(sig),
            change = self.rdzv.changed() => Wake::Changed(change),
            () = hang_timer => Wake::HangCheck,
        })
    }

    /// A group changed: its workers keep running to take the next round in place when
    /// they all can ([`decide::in_place`]); otherwise they are stopped (their grace cut
    /// for a fence). Then carries out what the change leads to.
    pub(super) async fn reform(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
        change: Change,
    ) -> Phase {
        let (in_place, why) = decide::in_place(&change, &self.reformable(&mut group));
        if in_place {
            return self.reform_in_place(round, group, change, why).await;
        }
        match &change {
            Change::Fenced { reason, .. } => {
                tracing::warn!(%reason, "fencing: stopping the workers")
            }
            _ => tracing::info!(%change, "group changed; re-forming"),
        }
        tracing::debug!(reason = why, "the workers do not re-form in place");
        let late = self.stop_for_change(&mut group, &change).await;
        let next = self.after_change(&round, &change, late);
        self.carry_out(&round, &change, next).await
    }

    /// Stops the workers of a group that changed as the change asks
    /// ([`decide::first_stop_signal`], [`decide::stop_grace`]); returns a signal that came
    /// meanwhile.
    pub(super) async fn stop_for_change(
        &mut self,
        group: &mut WorkerGroup,
        change: &Change,
    ) -> Option<Signal> {
        let grace = decide::stop_grace(change, self.rules.term_timeout);
        self.report
            .broke(change_label(change), Shown::Stopping, change.to_string());
        let (first, why) = decide::first_stop_signal(change, &self.stoppable(), grace);
        if first != Signal::SIGTERM {
            tracing::info!(signal = %first, "{why}");
        }
        let late = self.stop(group, first, grace).await;
        self.report.workers(group, false);
        late
    }

    /// [`decide::after_change`] for this node's group of `round` (`late`: a signal during
    /// the stop, if the workers were stopped).
    pub(super) fn after_change(
        &mut self,
        round: &Round,
        change: &Change,
        late: Option<Signal>,
    ) -> AfterChange {
        let me = self.rdzv.node_id().map(str::to_owned);
        let reached = self.reached();
        decide::after_change(
            &mut self.memory,
            round,
            change,
            late,
            me.as_deref(),
            reached,
            &self.rules,
        )
    }

    /// Carries out what a change of the group of `round` leads to.
    pub(super) async fn carry_out(
        &mut self,
        round: &Round,
        change: &Change,
        next: AfterChange,
    ) -> Phase {
        match next {
            AfterChange::Leave(leave) => return leave.into(),
            AfterChange::Halted(h) => return self.halted(&h),
            AfterChange::PeerFailed(verdict) => {
                // A node that found the group hung charges a failure after saying so.
                self.answer_hang(round).await;
                match verdict {
                    AfterFailure::Halt { exit_code, reason } => {
                        if let Err(sig) = self.announce_halt(exit_code, &reason).await {
                            return signalled(sig).into();
                        }
                        return self.leave_halted(decide::halting(exit_code, &reason), &reason);
                    }
                    AfterFailure::Quarantine { reason } => return self.quarantine(&reason).await,
                    AfterFailure::Restart => {}
                }
            }
            AfterChange::OwnLoss => {
                if let Err(sig) = self.charge_own_loss(change).await {
                    return signalled(sig).into();
                }
            }
            AfterChange::Rejoin => {}
        }
        self.report
            .show(Shown::Rendezvous, format!("re-forming: {change}"));
        Phase::Join
    }

    /// A worker failed: reports it, tells every node first if the run ends on it, stops
    /// the group, and carries out the verdict (leave, or charge, back off and re-form).
    pub(super) async fn failed(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
        first: Failure,
    ) -> Result<Phase, AgentError> {
        self.report.broke(
            decide::failure_label(first.exit),
            Shown::Stopping,
            format!("worker rank {} failed: {}", first.rank, first.exit),
        );
        if let Some(full) = self.environment_full().await {
            return Ok(self.environment_failed(&round, group, &first, &full).await);
        }
        self.report_fault(&round, &first).await;
        let reached = self.reached();
        let verdict = decide::failed_here(&mut self.memory, &round, &first, reached, &self.rules);
        if let AfterFailure::Halt { exit_code, reason } = &verdict {
            if let Err(sig) = self.announce_halt(*exit_code, reason).await {
                self.stop(&mut group, sig, Duration::ZERO).await;
                return Ok(signalled(sig).into());
            }
        }
        // A signal during the stop escalates to SIGKILL; it is honoured right after.
        let late = self
            .stop(&mut group, Signal::SIGTERM, self.rules.term_timeout)
            .await;
        self.report.workers(&group, true);
        let text = self.summary_text(&round, &group, &first);
        if decide::defer_summary(&round, self.rdzv.records().is_some(), &verdict) {
            tracing::warn!(
                rank = first.rank,
                exit = %first.exit,
                "a worker exited; re-forming (the next round tells whether a lost node broke the group first)"
            );
            self.pending_summary = Some((first.clone(), text));
        } else {
            self.blame_worker(&first, text).await;
        }
        drop(group);
        let backoff =
            match decide::after_failed(&mut self.memory, &round, first.exit, verdict, late) {
                AfterFailed::Leave(leave) => return Ok(leave.into()),
                AfterFailed::Halt { leave, reason } => return Ok(self.leave_halted(leave, &reason)),
                AfterFailed::Quarantine { reason } => return Ok(self.quarantine(&reason).await),
                AfterFailed::Restart { backoff } => backoff,
            };
        self.restart_after(&round, &first, backoff).await
    }

    /// The working directory's local filesystem is full ([`environment`]), or `None`. The
    /// look runs on the log-file thread: a hung mount answers nothing, and costs nothing.
    async fn environment_full(&self) -> Option<String> {
        let cwd = std::env::current_dir().ok()?;
        let places = self
            .console
            .disk()
            .call(Duration::from_secs(2), move || environment::look(&cwd))
            .await?;
        environment::full(&places)
    }

    /// The worker failed where this node's environment is at fault (`full`): the same
    /// would fail every attempt, here only. The node stops its workers and leaves as
    /// unhealthy, so that it is replaced; nothing is charged to the job, whose other nodes
    /// re-form without it.
    async fn environment_failed(
        &mut self,
        round: &Round,
        mut group: WorkerGroup,
        first: &Failure,
        full: &str,
    ) -> Phase {
        tracing::error!(
            rank = first.rank,
            exit = %first.exit,
            "{full}: this node's environment failed its worker, not the job; leaving the group (exit 79) without charging the restart budget"
        );
        let late = self
            .stop(&mut group, Signal::SIGTERM, self.rules.term_timeout)
            .await;
        self.report.workers(&group, true);
        let text = self.summary_text(round, &group, first);
        self.blame_worker(
            first,
            format!(
                "{text}
cause: {full}"
            ),
        )
        .await;
        match late {
            Some(sig) => signalled(sig).into(),
            None => decide::environment_failed(full).into(),
        }
    }

    /// Charges the failure to the job, pauses, and re-forms.
    async fn restart_after(
        &mut self,
        round: &Round,
        first: &Failure,
        backoff: Duration,
    ) -> Result<Phase, AgentError> {
        self.report.show(
            Shown::Rendezvous,
            format!(
                "restarting after worker rank {} failed: {}",
                first.rank, first.exit
            ),
        );
        let charged = match interruptible(self.signals, self.rdzv.record_failure()).await {
            Ok(r) => r?,
            Err(sig) => return Ok(signalled(sig).into()),
        };
        let has_records = self.rdzv.records().is_some();
        if let Some(exit_code) =
            decide::spent_at_once(charged, has_records, &self.memory, &self.rules)
        {
            tracing::error!(
                failures = charged,
                max_restarts = self.cfg.max_restarts,
                exit_code,
                "the restart budget is spent; giving up"
            );
            return Ok(decide::failed(exit_code).into());
        }
        tracing::info!(
            backoff_ms = backoff.as_millis() as u64,
            "worker failure reported; re-forming"
        );
        if let Err(sig) = interruptible(self.signals, tokio::time::sleep(backoff)).await {
            return Ok(signalled(sig).into());
        }
        // Our workers may have failed because another node stopped its hung ones.
        self.answer_hang(round).await;
        Ok(Phase::Join)
    }

    /// The failure summary of `group`. A hung worker did not fail on its own: the group has
    /// no failure of it.
    fn summary_text(&self, round: &Round, group: &WorkerGroup, first: &Failure) -> String {
        let failures = if group.failures().is_empty() {
            std::slice::from_ref(first)
        } else {
            group.failures()
        };
        summary(
            &self.cfg.entrypoint.display(),
            self.cfg.entrypoint.runs_python(),
            round.restart_count,
            &self.host,
            failures,
        )
    }

    /// Says that this node's group failed on its own worker: the log line and the summary,
    /// through the console so that it follows the workers' last lines.
    async fn blame_worker(&self, first: &Failure, summary: String) {
        tracing::error!(
            rank = first.rank,
            local_rank = first.local_rank,
            pid = first.pid,
            exit = %first.exit,
            "worker group failed"
        );
        self.console
            .write(Stream::Stderr, format!("{summary}\n").into_bytes())
            .await;
    }

    /// The summary held back for the round after a failure: a member lost between the two
    /// rounds broke the group (the local workers only followed), else the failure was this
    /// node's and the summary is printed as it stood.
    pub(super) async fn settle_summary(&mut self, lost: &[(String, &'static str)]) {
        let Some((first, text)) = self.pending_summary.take() else {
            return;
        };
        match decide::lost_peer_words(lost) {
            Some(words) => tracing::warn!(
                rank = first.rank,
                exit = %first.exit,
                "{words}; the local workers stopped because their group broke"
            ),
            None => self.blame_worker(&first, text).await,
        }
    }

    /// After [`decide::own_loss`]: the job is charged a restart like a worker failure.
    async fn charge_own_loss(&mut self, change: &Change) -> Result<(), Signal> {
        tracing::warn!(
            change = %change,
            "this node lost its place in the group; charging a restart"
        );
        match interruptible(self.signals, self.rdzv.record_failure()).await? {
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not charge the restart"),
        }
        Ok(())
    }

    /// The members of the last round that `round` lacks were lost: says how each loss was
    /// noticed (only the shared records know).
    /// Returns each lost node and how its loss was noticed.
    fn report_losses(&mut self, round: &Round) -> Vec<(String, &'static str)> {
        let me = self.rdzv.node_id().map(str::to_owned);
        let Some((from, lost)) = decide::losses(&mut self.memory, round, me.as_deref()) else {
            return Vec::new();
        };
        let Some(records) = self.rdzv.records() else {
            return Vec::new();
        };
        let mut said = Vec::new();
        for node in lost {
            let how = records.detection(&node, from);
            // From the neighbour's stream breaking to the proof, when a neighbour proved it.
            let detect_ms = match how {
                fsdp_rendezvous::Detection::Refused { detect } => Some(detect.as_millis() as u64),
                _ => None,
            };
            tracing::info!(%node, round = from, detection = how.label(), detect_ms, "how the lost member was noticed");
            self.report.lost(&node, from, how);
            said.push((node, how.label()));
        }
        said
    }

    /// The exit barrier: waits for the other nodes, and carries out its outcome.
    pub(super) async fn barrier(&mut self, round: Round) -> Result<Phase, AgentError> {
        let timeout = self.cfg.exit_barrier();
        // Nodes that share no records (static) cannot learn that the others finished:
        // this node's part is done, and nothing more is claimed.
        let shared = self.rdzv.records().is_some();
        if round.group_world_size > 1 && shared {
            tracing::info!(
                timeout_s = timeout.as_secs_f64(),
                "all workers finished; waiting for the other nodes"
            );
        }
        let outcome = match interruptible(self.signals, self.rdzv.finish(timeout)).await {
            Ok(f) => f?,
            Err(sig) => return Ok(signalled(sig).into()),
        };
        Ok(match decide::after_barrier(outcome) {
            AfterBarrier::Done(leave) if round.group_world_size > 1 && !shared => {
                tracing::info!(
                    nodes = round.group_world_size,
                    "this node's workers finished; a static group has no exit barrier, so the other nodes finish on their own"
                );
                leave.into()
            }
            AfterBarrier::Done(leave) => {
                tracing::info!(
                    nodes = round.group_world_size,
                    "every node finished; the job is done"
                );
                leave.into()
            }
            AfterBarrier::Halted(h) => self.halted(&h),
            AfterBarrier::Rejoin(change) => {
                self.report.broke(
                    change_label(&change),
                    Shown::Rendezvous,
                    format!("re-forming: {change}"),
                );
                tracing::warn!(
                    %change,
                    "the group broke before every node finished; re-forming"
                );
                Phase::Join
            }
            AfterBarrier::TimedOut { unfinished, leave } => {
                tracing::error!(
                    unfinished = %unfinished.join(", "),
                    "other nodes did not finish within the exit barrier timeout"
                );
                leave.into()
            }
        })
    }

    /// The job failed on this node's own worker: tell the scheduler, in torchrun's format,
    /// through `TORCHELASTIC_ERROR_FILE` if it set one.
    pub(super) fn write_launcher_error(&self, result: &Result<AgentExit, AgentError>) {
        let (Some(path), Some(root), Ok(AgentExit::Failed { exit_code })) = (
            &self.cfg.launcher_error_file,
            &self.memory.root_cause,
            result,
        ) else {
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

    /// Leaves the rendezvous now, before the workers are stopped ([`decide::depart_first`]);
    /// the leave at the end then has nothing left to do there.
    pub(super) async fn depart_early(&mut self, leave: Leave) {
        if let Err(e) = self.depart(&leave).await {
            tracing::warn!(error = %e, "could not leave the rendezvous early; leaving after the workers stop");
            return;
        }
        self.departed = true;
    }

    pub(super) async fn leave(&mut self, leave: Leave) -> Result<AgentExit, AgentError> {
        if !self.departed {
            self.depart(&leave).await?;
        }
        Ok(leave.exit)
    }

    /// Says goodbye to the rendezvous. Leaving is a courtesy (peers notice at once instead
    /// of after a lease TTL): a hung etcd or a second signal must not keep the agent from
    /// exiting.
    async fn depart(&mut self, leave: &Leave) -> Result<(), AgentError> {
        let depart = tokio::time::timeout(
            DEPART_PATIENCE,
            self.rdzv.depart(leave.how, leave.why.clone()),
        );
        match interruptible(self.signals, depart).await {
            Ok(Ok(r)) => r?,
            Ok(Err(_)) => tracing::warn!(
                "the rendezvous did not take the goodbye within {DEPART_PATIENCE:?}; peers notice within a lease TTL"
            ),
            Err(sig) => tracing::warn!(signal = %sig, "signal while leaving the run; not waiting"),
        }
        Ok(())
    }
}
