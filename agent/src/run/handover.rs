//! Re-forming in place, the driver's part: workers that said they can
//! ([`decide::in_place`]) keep their processes through a re-form, and the next round is
//! handed to them over their control sockets ([`crate::control`]) instead of spawning
//! new ones. A restart costs a worker its imports, its CUDA context and its model's load;
//! a handover costs a new process group and the state restored.
//!
//! ```text
//!   Running ──changed, all can──▶ Reform ──keeps the group──▶ Join ──round──▶ Start
//!                                                                                │
//!      ┌──── every local worker said `joined N` ◀── round N to each worker ◀─────┘
//!      ▼            │ timeout, a worker exits: stop them, spawn fresh (nothing charged)
//!   Running         │ changed again: Reform with the kept group
//!                   └ a signal: stop them, leave
//! ```
//!
//! Between the re-form and the next start the kept workers train on in their old group (a
//! node joining: it still works) or wait for their round (a member lost); a worker that
//! exits meanwhile gets its group stopped (the next start spawns fresh workers), and a
//! loop that ends there stops them ([`Loop::release_kept`]). Nothing of a
//! handover is charged to the restart budget: the group broke for a change, not a
//! failure, and the fallback is the restart that would have happened without it.
//!
//! The kept workers keep their attempt directory: they write on to the log files they
//! were spawned with, and no new `attempt_N` is made for a round handed over in place.

use std::time::{Duration, Instant};

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{Change, Rendezvous, RendezvousError, Round};
use nix::sys::signal::Signal;

use super::decide::{self, AfterChange, Handover, Kept, Reformable, signalled};
use super::driver::{Loop, interruptible};
use super::memory::RoundMembers;
use super::report::change_label;
use super::{AgentExit, Phase};
use crate::control;
use crate::error::AgentError;
use crate::hang::progress::{RankProgress, Restored};
use crate::hang::{GroupTimes, Progress};
use crate::supervisor::{WorkerGroup, WorkerStatus};

/// How often a handover looks whether every worker joined.
const HANDOVER_LOOK: Duration = Duration::from_millis(10);

/// What became of a round handed to workers kept in place.
pub(super) enum HandedOver {
    /// The next phase: the workers run in the round, the group changed again, or a signal
    /// ends the loop (boxed: a phase is large, and this is one value per round).
    Then(Box<Phase>),
    /// The kept workers are stopped: start fresh ones for this round.
    Fresh(Round),
}

impl HandedOver {
    fn then(phase: Phase) -> Self {
        Self::Then(Box::new(phase))
    }
}

/// How a handover's wait ended.
enum Joined {
    Done,
    /// Every local worker exited 0 instead ([`Handover::Finished`]).
    Finished,
    Fallback(&'static str),
    Changed(Change),
    Broken(RendezvousError),
    Signal(Signal),
}

/// The next exit of a worker kept for the next round (never, with none kept).
pub(super) async fn kept_exit(kept: &mut Option<WorkerGroup>) -> WorkerStatus {
    match kept {
        Some(group) => group.next_exit().await,
        None => std::future::pending().await,
    }
}

/// Which local workers (by local rank) said they joined `round`.
fn confirmed(progress: Option<&Progress>, round: &Round, nproc: u32) -> Vec<bool> {
    let ranks = progress.map(Progress::snapshot).unwrap_or_default();
    (0..nproc)
        .map(|local_rank| {
            ranks
                .iter()
                .any(|r| r.rank == round.base_rank + local_rank && r.joined == Some(round.number))
        })
        .collect()
}

/// Where this node's workers restored from on joining `round`: disk when any of them
/// says so (one rank from disk means the whole group went back to the checkpoint),
/// memory when every one says memory, `None` when one did not say.
fn restored_from(ranks: &[RankProgress], round: &Round, nproc: usize) -> Option<Restored> {
    let local = round.base_rank..round.base_rank + nproc as u32;
    let said: Vec<_> = ranks
        .iter()
        .filter(|r| local.contains(&r.rank) && r.joined == Some(round.number))
        .map(|r| r.restored)
        .collect();
    if said.contains(&Some(Restored::Disk)) {
        Some(Restored::Disk)
    } else if said.len() == nproc && said.iter().all(|r| *r == Some(Restored::Memory)) {
        Some(Restored::Memory)
    } else {
        None
    }
}

impl<R: Rendezvous> Loop<'_, R> {
    /// What each local worker said of itself and whether it runs (the exits already
    /// reported taken in first), for [`decide::in_place`].
    pub(super) fn reformable(&self, group: &mut WorkerGroup) -> Vec<Reformable> {
        group.all_running();
        let ranks = self
            .progress
            .as_ref()
            .map(Progress::snapshot)
            .unwrap_or_default();
        group
            .statuses()
            .iter()
            .map(|w| Reformable {
                declared: ranks.iter().any(|r| r.rank == w.rank && r.reforms_in_place),
                running: w.exit.is_none(),
            })
            .collect()
    }

    /// The group of `round` changed and its workers can take the next round in place: the
    /// same bookkeeping as a stop for the change, and the group is kept for the next
    /// start. A node that lost its own place (frozen, or cut off until its lease expired)
    /// is charged a restart like a failure, and its workers are stopped and start fresh as
    /// after one.
    pub(super) async fn reform_in_place(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
        change: Change,
        why: &'static str,
    ) -> Phase {
        let next = self.after_change(&round, &change, None);
        if next != AfterChange::Rejoin {
            tracing::info!(%change, "group changed; this node lost its own place, so its workers stop after all");
            if let Some(sig) = self.stop_for_change(&mut group, &change).await {
                return signalled(sig).into();
            }
            return self.carry_out(&round, &change, next).await;
        }
        tracing::info!(%change, reason = why, "group changed; the workers re-form in place");
        self.report.broke(
            change_label(&change),
            Shown::Rendezvous,
            format!("re-forming in place: {change}"),
        );
        self.kept = Some(group);
        Phase::Join
    }

    /// A worker kept for the next round exited before it: the kept group is stopped, and
    /// the next start spawns fresh workers. Nothing is charged: the group had broken
    /// anyway. A signal during the stop ends the loop (the phase returned).
    pub(super) async fn kept_worker_exited(&mut self, w: WorkerStatus) -> Option<Phase> {
        let exit = w.exit.map(|e| e.to_string()).unwrap_or_default();
        tracing::warn!(
            local_rank = w.local_rank,
            pid = w.pid,
            %exit,
            "a worker kept to re-form in place exited; stopping the others, the next round starts fresh workers (not charged: the group had broken anyway)"
        );
        let mut group = self.kept.take()?;
        let late = self
            .stop(&mut group, Signal::SIGTERM, self.rules.term_timeout)
            .await;
        self.report.workers(&group, false);
        late.map(|sig| signalled(sig).into())
    }

    /// Stops the workers kept for the next round, if any, when the loop ends before it:
    /// as a running group is stopped for the agent's signal (`exit`;
    /// [`decide::signal_for_workers`], by what they reported in the round they ran), or
    /// with SIGTERM. Kept workers still train in their old group until their round comes
    /// (a node joining), or wait for it (a member lost): one that saves on a warning takes
    /// it in either state (fsdp-trainer saves at its next step, or stops waiting).
    pub(super) async fn release_kept(&mut self, exit: Option<AgentExit>) {
        let Some(mut group) = self.kept.take() else {
            return;
        };
        let grace = self.rules.term_timeout;
        let signal = match exit {
            Some(AgentExit::Signalled(sig)) => {
                let (signal, why) = decide::signal_for_workers(sig, &self.stoppable(), grace);
                if signal != sig {
                    tracing::info!(%signal, "{why}");
                }
                signal
            }
            _ => Signal::SIGTERM,
        };
        tracing::info!(%signal, "stopping the workers kept to re-form in place");
        self.stop(&mut group, signal, grace).await;
        self.report.workers(&group, false);
    }

    /// Hands `round` to the kept `group`: each worker gets its round's variables, and the
    /// group runs in the round once every one said it joined, within
    /// [`decide::handover_bound`]. Otherwise the workers are stopped and fresh ones start
    /// (nothing charged); a change meanwhile re-forms with the kept group, a signal leaves.
    pub(super) async fn hand_over(
        &mut self,
        round: Round,
        mut group: WorkerGroup,
    ) -> Result<HandedOver, AgentError> {
        let set = self.cfg.hang.phases.get(decide::HANDOVER_KEY).copied();
        let bound = decide::handover_bound(self.stoppable().iter().map(|s| s.slowest_step), set);
        let nproc = self.cfg.nproc_per_node;
        // The round is this node's from here, as a spawn's is: whoever the next round
        // lacks of it was lost, also if the group changes again before the workers join.
        self.memory.last_round = Some(RoundMembers::of(&round));
        // Before the round goes out: a `joined` that comes back at once must find its rank.
        if let Some(p) = &self.progress {
            p.rerank(round.base_rank..round.base_rank + nproc);
        }
        group.move_to(&round);
        self.report.show(
            Shown::Rendezvous,
            format!("handing round {} to the workers in place", round.number),
        );
        let started = Instant::now();
        let joined = match self.send_round(&round).await {
            Ok(()) => self.await_joined(&round, &mut group, started, bound).await,
            Err(why) => Joined::Fallback(why),
        };
        Ok(match joined {
            Joined::Done => {
                self.handed_over(&round, &group, started);
                HandedOver::then(Phase::Running { round, group })
            }
            Joined::Finished => {
                tracing::info!(
                    round = round.number,
                    "every local worker exited 0 instead of joining: training is at its end"
                );
                let finished = interruptible(self.signals, group.finish()).await;
                self.report.workers(&group, true);
                match finished {
                    Err(sig) => HandedOver::then(signalled(sig).into()),
                    Ok(()) => {
                        self.report
                            .show(Shown::Finishing, "every local worker succeeded");
                        HandedOver::then(Phase::Barrier { round })
                    }
                }
            }
            Joined::Fallback(why) => match self.fall_back(&round, group, why).await {
                Some(end) => HandedOver::then(end),
                None => HandedOver::Fresh(round),
            },
            Joined::Changed(change) => HandedOver::then(Phase::Reform {
                round,
                group,
                change,
            }),
            Joined::Signal(sig) => {
                let grace = self.rules.term_timeout;
                HandedOver::then(self.stop_on_signal(&mut group, sig, grace).await)
            }
            Joined::Broken(error) => {
                let grace = self.rules.term_timeout;
                return Err(self.rendezvous_failed(&mut group, error, grace).await);
            }
        })
    }

    /// Sends each local worker its datagram of `round`. One that cannot be sent (no
    /// socket: that worker never bound it, or exited) is why the handover fails.
    async fn send_round(&self, round: &Round) -> Result<(), &'static str> {
        let progress = self.progress.as_ref().ok_or("progress is not watched")?;
        for local_rank in 0..self.cfg.nproc_per_node {
            let to = control::path(progress.path(), local_rank)
                .ok_or("a worker has no control socket")?;
            let text = control::round_message(self.cfg, round, local_rank);
            if let Err(e) = control::send(&to, &text).await {
                tracing::warn!(local_rank, path = %to.display(), error = %e, "could not send the round to a worker's control socket");
                return Err("a worker's control socket did not take the round");
            }
            tracing::debug!(local_rank, %text, "sent the round to the worker");
        }
        Ok(())
    }

    /// Waits until [`decide::handover`] decides, looking at the workers' reports every
    /// [`HANDOVER_LOOK`]; a signal or a change of the group ends the wait.
    async fn await_joined(
        &mut self,
        round: &Round,
        group: &mut WorkerGroup,
        started: Instant,
        bound: Duration,
    ) -> Joined {
        let nproc = self.cfg.nproc_per_node;
        let progress = self.progress.as_ref();
        let signals = &mut *self.signals;
        // One watch for the whole wait: a backend's change is not asked for again at
        // every look.
        let changed = self.rdzv.changed();
        tokio::pin!(changed);
        let mut change = None;
        loop {
            let kept = if group.all_running() {
                Kept::Running
            } else if group
                .statuses()
                .iter()
                .all(|w| w.exit.is_some_and(|e| e.success()))
            {
                Kept::Succeeded
            } else {
                Kept::Exited
            };
            let confirmed = confirmed(progress, round, nproc);
            let now = Instant::now();
            match decide::handover(now, started, bound, &confirmed, kept, change.is_some()) {
                Handover::Wait => {}
                Handover::Done => return Joined::Done,
                Handover::Finished => return Joined::Finished,
                Handover::Fallback(why) => return Joined::Fallback(why),
                Handover::Reform => {
                    if let Some(c) = change.take() {
                        return Joined::Changed(c);
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(HANDOVER_LOOK) => {}
                sig = signals.recv() => return Joined::Signal(sig),
                c = &mut changed, if change.is_none() => match c {
                    Ok(c) => change = Some(c),
                    Err(e) => return Joined::Broken(e),
                },
                // Seen at the next look.
                _ = group.next_exit() => {}
            }
        }
    }

    /// The kept workers joined `round`: the group runs in it as if started in it (the hang
    /// judge's clock restarted, status and metrics told).
    /// torchrun's file timer is left as it is: the same processes hold the same scopes.
    fn handed_over(&mut self, round: &Round, group: &WorkerGroup, started: Instant) {
        let ranks = self.progress.as_ref().map(Progress::snapshot);
        let from = restored_from(
            ranks.as_deref().unwrap_or_default(),
            round,
            group.pids().len(),
        );
        let label = from.map_or("unsaid", Restored::label);
        if from == Some(Restored::Disk) {
            tracing::warn!(
                round = round.number,
                "the workers re-formed in place but did not restore from peer memory: no step was whole there (both copies of a part lost?); they went back to the last checkpoint on disk (or to step 0 without one), and the steps since are trained again"
            );
        }
        tracing::info!(
            pids = ?group.pids(),
            round = round.number,
            handover_ms = started.elapsed().as_millis() as u64,
            restored = label,
            "workers re-formed in place"
        );
        self.group_times = GroupTimes::started(Instant::now());
        self.report.re_formed(round, group, label);
    }

    /// The kept workers did not take `round` (`why`): says so, naming the ranks that did
    /// not confirm, and stops them as a failed group is stopped. A signal during the stop
    /// ends the loop (the phase returned).
    async fn fall_back(
        &mut self,
        round: &Round,
        mut group: WorkerGroup,
        why: &'static str,
    ) -> Option<Phase> {
        let nproc = self.cfg.nproc_per_node;
        let unconfirmed: Vec<String> = confirmed(self.progress.as_ref(), round, nproc)
            .iter()
            .zip(round.base_rank..)
            .filter(|(joined, _)| !**joined)
            .map(|(_, rank)| rank.to_string())
            .collect();
        tracing::warn!(
            round = round.number,
            reason = why,
            unconfirmed = %unconfirmed.join(", "),
            "the workers did not re-form in place; stopping them and starting fresh workers (nothing is charged)"
        );
        let late = self
            .stop(&mut group, Signal::SIGTERM, self.rules.term_timeout)
            .await;
        self.report.workers(&group, false);
        late.map(|sig| signalled(sig).into())
    }
}
