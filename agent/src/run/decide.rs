//! The loop's decisions, as a pure handler: each phase's choice is a function of the
//! loop's [`Memory`], what just happened (a round, a wake, a change, a failure, the
//! barrier's outcome) and the [`Rules`], and returns what to do next. Nothing here awaits
//! or touches a process, a socket or the clock, so every branch is tested on hand-built
//! values (`decide/tests.rs`); the driver (`driver.rs`) does the I/O and carries the
//! decisions out. [`crate::policy`] holds the failure policy they apply: the budget, the
//! backoff and the rules that judge a failed attempt.

use std::time::{Duration, Instant};

use fsdp_rendezvous::{
    Change, Departure, Finish, Halt, LeftKind, LeftReason, RendezvousError, Round,
};
use nix::sys::signal::Signal;

use super::AgentExit;
use super::memory::{Memory, RoundMembers};
use crate::config::{Config, FailurePolicy};
use crate::exit_code;
use crate::failure::{Failure, WorkerExit};
use crate::policy::{
    AfterFailure, Budget, FailedRound, after_failure, blame, budget, restart_backoff,
    restarts_counted,
};
use crate::supervisor::GroupEvent;

/// The part of the configuration the decisions read.
#[derive(Debug, Clone)]
pub struct Rules {
    pub max_restarts: u32,
    /// The workers' SIGTERM grace before SIGKILL.
    pub term_timeout: Duration,
    pub failure: FailurePolicy,
}

impl Rules {
    pub fn of(cfg: &Config) -> Self {
        Self {
            max_restarts: cfg.max_restarts,
            term_timeout: cfg.term_timeout,
            failure: cfg.failure.clone(),
        }
    }
}

/// Leave the rendezvous this way and end with this exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leave {
    pub how: Departure,
    pub exit: AgentExit,
    /// Why, as the record `fsdp-agent status` shows after the node is gone.
    pub why: LeftReason,
}

/// Leaving after `sig`: the run goes on without this node.
pub fn signalled(sig: Signal) -> Leave {
    Leave {
        how: Departure::Left,
        exit: AgentExit::Signalled(sig),
        why: LeftReason::new(
            LeftKind::Left,
            format!(
                "stopped by {sig}; agent exit code {}",
                exit_code::signalled(sig as i32)
            ),
        ),
    }
}

/// Leaving failed with `exit_code`: the restart budget is spent.
pub fn failed(exit_code: u8) -> Leave {
    Leave {
        how: Departure::Failed,
        exit: AgentExit::Failed { exit_code },
        why: LeftReason::new(
            LeftKind::Failed,
            format!("the restart budget is spent; agent exit code {exit_code}"),
        ),
    }
}

/// This node ended the run for every node with `exit_code`, for `reason`.
pub fn halting(exit_code: u8, reason: &str) -> Leave {
    Leave {
        why: LeftReason::new(
            LeftKind::Halted,
            format!("ended the run: {reason}; agent exit code {exit_code}"),
        ),
        ..failed(exit_code)
    }
}

/// Another node ended the run: this one ends with the same code.
pub fn halted_by(h: &Halt) -> Leave {
    Leave {
        why: LeftReason::new(LeftKind::Halted, h.to_string()),
        ..failed(h.exit_code)
    }
}

/// This node leaves the group for `reason`, as `kind`, with exit `code`; the others go on
/// without it.
fn node_out(kind: LeftKind, code: u8, reason: &str) -> Leave {
    Leave {
        how: Departure::Left,
        exit: AgentExit::Failed { exit_code: code },
        why: LeftReason::new(kind, format!("{reason}; agent exit code {code}")),
    }
}

/// This node's machine is kept out of the run (`reason`); the others go on without it.
pub fn kept_out(reason: &str) -> Leave {
    node_out(LeftKind::Quarantined, exit_code::QUARANTINED, reason)
}

/// A filesystem this node's workers write to is full (`reason`): it leaves as unhealthy,
/// so that it is replaced, without charging the job ([`crate::environment`]).
pub fn environment_failed(reason: &str) -> Leave {
    node_out(LeftKind::Unhealthy, exit_code::UNHEALTHY, reason)
}

/// This node's health check failed `failures` times in a row, the last for `reason`: it
/// leaves with `exit_code` so that it is replaced.
pub fn unhealthy(exit_code: u8, failures: u32, reason: &str) -> Leave {
    Leave {
        how: Departure::Left,
        exit: AgentExit::Failed { exit_code },
        why: LeftReason::new(
            LeftKind::Unhealthy,
            format!(
                "health check failed {failures} time(s) in a row: {reason}; agent exit code {exit_code}"
            ),
        ),
    }
}

/// What to do with a round that formed with this node in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFormed {
    /// Start its workers; `restart` is the warning to log when the job's failure count
    /// moved since the last round this node started.
    Start { restart: Option<String> },
    /// More failure restarts than allowed: leave failed with the code [`budget`] chose.
    GiveUp { exit_code: u8 },
}

/// The budget is read from the sealed round, so every node decides alike. Returns the
/// restarts counted against `--max-restarts` too (status shows them).
pub fn formed(memory: &mut Memory, round: &Round, rules: &Rules) -> (AfterFormed, u32) {
    let window = rules.failure.restart_window;
    let counted = restarts_counted(round, window);
    let restart = match budget(counted, rules.max_restarts, memory.last_failure) {
        Budget::Spent { exit_code } => return (AfterFormed::GiveUp { exit_code }, counted),
        Budget::Left if round.restart_count > memory.last_restart_count => {
            let window = window.map_or(String::new(), |w| format!(" within the last {w:?}"));
            Some(format!(
                "restarting the worker group after a failure: restart {counted} of {}{window}",
                rules.max_restarts
            ))
        }
        Budget::Left => None,
    };
    memory.last_restart_count = round.restart_count;
    (AfterFormed::Start { restart }, counted)
}

/// Whether `round`, sealed but broken before it started, spent the budget: the exit code
/// and the failures counted against `--max-restarts` if it did. Nothing is remembered of it (the next round is asked for).
pub fn spent(memory: &Memory, round: &Round, rules: &Rules) -> Option<(u8, u32)> {
    let counted = restarts_counted(round, rules.failure.restart_window);
    match budget(counted, rules.max_restarts, memory.last_failure) {
        Budget::Spent { exit_code } => Some((exit_code, counted)),
        Budget::Left => None,
    }
}

/// Whether the failure just charged (`charged` restarts so far) spent the budget, when
/// this node can tell alone: a backend that shares no records counts every restart here,
/// so with no restart window the count is final and there is no round to re-form for.
/// Elsewhere the next round's count decides ([`formed`]): a member lost meanwhile
/// excuses the failure.
pub fn spent_at_once(
    charged: u32,
    has_records: bool,
    memory: &Memory,
    rules: &Rules,
) -> Option<u8> {
    if has_records || rules.failure.restart_window.is_some() {
        return None;
    }
    match budget(charged, rules.max_restarts, memory.last_failure) {
        Budget::Spent { exit_code } => Some(exit_code),
        Budget::Left => None,
    }
}

/// The members of the round this node ran last that `next` lacks (this node aside), and
/// that round's number; forgets the round.
pub fn losses(memory: &mut Memory, next: &Round, me: Option<&str>) -> Option<(u64, Vec<String>)> {
    let last = memory.last_round.take()?;
    let lost = last
        .missing_from(next)
        .filter(|id| Some(*id) != me)
        .map(str::to_owned)
        .collect();
    Some((last.number, lost))
}

/// The round after a failed one formed: enters the failed round (`first_fault` says
/// whose failure in it was reported first) and returns why this node is to be
/// quarantined, if the policy blames it.
pub fn blamed(
    memory: &mut Memory,
    next: &Round,
    first_fault: impl FnOnce(u64) -> Option<String>,
    policy: &FailurePolicy,
    me: Option<&str>,
) -> Option<String> {
    let failed = memory.failed.take()?;
    let lost_member = failed.missing_from(next).next().is_some();
    let first = first_fault(failed.number);
    if first.as_deref().is_some_and(|f| Some(f) != me) {
        // Another node's failure came first: this node's own worker, if it failed too,
        // failed of that one (a collective cut by the peer's exit), and the budget this
        // round spends is that node's to answer for, not this one's code.
        memory.last_failure = None;
    }
    memory.failed_rounds.push(FailedRound {
        round: failed.number,
        first,
        lost_member,
    });
    let keep = policy.quarantine_after.max(1) as usize;
    if memory.failed_rounds.len() > keep {
        memory.failed_rounds.remove(0);
    }
    let (node, reason) = blame(&memory.failed_rounds, policy.quarantine_after)?;
    (Some(node.as_str()) == me).then_some(reason)
}

/// What woke a running group's phase: each source of events, as one value.
#[derive(Debug)]
pub enum Wake {
    Group(GroupEvent),
    Signal(Signal),
    Changed(Result<Change, RendezvousError>),
    /// A rank's progress allowance ran out (it may have reported since: judge again).
    HangCheck,
}

/// What a wake leads to while the workers run.
#[derive(Debug)]
pub enum OnWake {
    /// Judge the group's progress again and keep running.
    Judge,
    /// Stop the workers with `signal` (their grace as given) and leave.
    Stop { signal: Signal, grace: Duration },
    /// The group changed: stop the workers and re-form.
    Reform(Change),
    /// The rendezvous failed: the workers get their grace (a checkpoint on SIGTERM)
    /// before the agent gives up with the error.
    Broken {
        error: RendezvousError,
        grace: Duration,
    },
    /// A worker failed first with this.
    Failed(Failure),
    /// Every worker exited 0: wait for the group's end, then the exit barrier.
    Finish,
}

pub fn on_wake(wake: Wake, rules: &Rules) -> OnWake {
    match wake {
        Wake::HangCheck => OnWake::Judge,
        Wake::Signal(signal) => OnWake::Stop {
            signal,
            grace: rules.term_timeout,
        },
        Wake::Changed(Ok(change)) => OnWake::Reform(change),
        Wake::Changed(Err(error)) => OnWake::Broken {
            error,
            grace: rules.term_timeout,
        },
        Wake::Group(GroupEvent::Failed(first)) => OnWake::Failed(first),
        Wake::Group(GroupEvent::Succeeded) => OnWake::Finish,
    }
}

/// Whether a worker of this node that exited on its own before `change` was seen is
/// handled as this node's failure first (reported with its exit time, charged, its code
/// kept for the budget), the change being news of the same breakage or of something the
/// failure outranks. A halt ends the run whatever failed, and a fence must stop the
/// workers before the lease can expire: those go on as they are.
pub fn own_exit_first(change: &Change) -> bool {
    !matches!(change, Change::Halted(_) | Change::Fenced { .. })
}

/// The SIGTERM grace of workers stopped for `change`. A fenced node's workers must be
/// gone before etcd can expire its lease and hand their ranks to others: their grace is
/// cut to half the time left.
pub fn stop_grace(change: &Change, term_timeout: Duration) -> Duration {
    match change {
        Change::Fenced { stop_within, .. } => term_timeout.min(*stop_within / 2),
        _ => term_timeout,
    }
}

/// What a local worker said of itself, for choosing how to stop it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stoppable {
    /// It said a SIGUSR1 makes it save a checkpoint at the next step and stop.
    pub saves_on_warning: bool,
    /// Its slowest recent step (`None`: no step reported yet).
    pub slowest_step: Option<Duration>,
}

/// Whether every local worker saves on a warning and can be expected to: its steps take
/// at most half the grace, so the step it is in and the save end before the SIGKILL. A
/// worker with no step yet is still starting: a warning would wait for its first step.
fn all_save_within(workers: &[Stoppable], grace: Duration) -> bool {
    !workers.is_empty()
        && workers.iter().all(|w| {
            w.saves_on_warning && w.slowest_step.is_some_and(|s| s.saturating_mul(2) <= grace)
        })
}

/// The signal that first stops the workers of a group that changed, and why. A node
/// joining is a new round with every member of this one in it (a round that left one out
/// is a [`Change::MemberLost`]), so as far as the rendezvous knows every member lives.
/// Workers that all save on a warning within the grace ([`all_save_within`]) then get
/// SIGUSR1: they save a checkpoint at the next step and stop, and the next group resumes
/// there, with no step redone. Any other change stops them with SIGTERM: a save would wait
/// on a peer that may be gone. A member that is in the new round but frozen or cut off
/// (its lease not yet expired) holds the save until the grace ends and the SIGKILL comes:
/// the grace is the bound either way.
pub fn first_stop_signal(
    change: &Change,
    workers: &[Stoppable],
    grace: Duration,
) -> (Signal, &'static str) {
    match change {
        Change::NodeWaiting { .. } | Change::NewRound { .. } if all_save_within(workers, grace) => {
            (
                Signal::SIGUSR1,
                "the new round keeps every member: the workers save a checkpoint at the next step, then stop",
            )
        }
        Change::NodeWaiting { .. } | Change::NewRound { .. } => (
            Signal::SIGTERM,
            "not every local worker saves on a warning within the grace",
        ),
        _ => (
            Signal::SIGTERM,
            "a member may be gone, and a save would wait on it",
        ),
    }
}

/// The signal the workers get when this agent is told to stop with `received`. A SIGTERM
/// is a pod deleted or a node drained while the group lives: workers that all save on a
/// warning within the grace get SIGUSR1 instead, and the warning spreads to every rank at
/// the next step, so the whole group saves there before this node goes and the others
/// resume from it. Any other signal (Ctrl-C, a second signal) is passed on as it is.
pub fn signal_for_workers(
    received: Signal,
    workers: &[Stoppable],
    grace: Duration,
) -> (Signal, &'static str) {
    if received == Signal::SIGTERM && all_save_within(workers, grace) {
        (
            Signal::SIGUSR1,
            "the workers save a checkpoint at the next step (the whole group does), then stop",
        )
    } else {
        (received, "passed on as received")
    }
}

/// Whether this node leaves the rendezvous before it stops its workers, for the signal
/// `received`: a SIGTERM (a pod delete, a drain) to a node whose workers all re-form in
/// place. The others then form the next round while this node's workers finish their
/// step and hand their parts to their buddies (they stop at the step boundary on the
/// warning), instead of after they exited: the others' pause shrinks by a step and an
/// exit. Safe for the lease: the workers stay in their old group, which the next round
/// does not include. Workers that are restarted on a change are stopped first, as before
/// (the others' agents would stop theirs on the loss before their save).
pub fn depart_first(received: Signal, workers: &[Reformable]) -> bool {
    received == Signal::SIGTERM
        && !workers.is_empty()
        && workers.iter().all(|w| w.declared && w.running)
}

/// What a local worker said of itself and whether it runs, for [`in_place`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reformable {
    /// It said it takes a new round in place (`can re-form-in-place`).
    pub declared: bool,
    /// It has not exited.
    pub running: bool,
}

/// Whether the workers of a group that changed keep their processes and take the next
/// round in place ([`crate::control`]) instead of being stopped, and why. Only for a
/// change where the round goes on without a failure: a member lost (its peers' processes
/// are sound; their group is not), a node joining. Never for a fence: a fenced node's
/// workers must be gone before its lease can expire and their ranks go to others. Never
/// for a peer's failure (every node restarts its workers, as torchrun does) nor a halt
/// (the run is over). And only when every local worker said it can and still runs: the
/// agent re-forms a node's workers all in place or all fresh, never half, so a group
/// never mixes a fresh worker with the kept ones of the same node.
pub fn in_place(change: &Change, workers: &[Reformable]) -> (bool, &'static str) {
    match change {
        Change::MemberLost { .. } | Change::NodeWaiting { .. } | Change::NewRound { .. } => {}
        Change::Fenced { .. } => {
            return (
                false,
                "a fenced node's workers stop before its lease can expire",
            );
        }
        Change::PeerFailed { .. } => {
            return (
                false,
                "a peer's worker failed: every node restarts its workers",
            );
        }
        Change::Halted(_) => return (false, "the run is over"),
    }
    if workers.is_empty() {
        return (false, "no local worker");
    }
    if !workers.iter().all(|w| w.declared) {
        return (false, "not every local worker said it can re-form in place");
    }
    if !workers.iter().all(|w| w.running) {
        return (false, "a local worker has exited");
    }
    (
        true,
        "every local worker runs and said it can re-form in place",
    )
}

/// The least time the workers get to join a round in place. A survivor of a peer that
/// froze (no connection closed) learns of the loss only when its collective times out
/// (fsdp-trainer's `--collective_timeout`, 60 s by default), and a node coming back makes
/// the survivors wait for its process to start and open its data: both then still
/// re-form in place, and only a worker wedged past this is restarted.
pub const HANDOVER_MIN: Duration = Duration::from_secs(90);
/// How many of the slowest recent step the workers get to join, when that is more.
pub const HANDOVER_STEPS: u32 = 20;

/// The `--hang-timeout` key (`auto,handover=30s`) that sets [`handover_bound`]. No
/// worker reports a phase of that name: it bounds the agent's wait, not a worker's phase.
pub const HANDOVER_KEY: &str = "handover";

/// How long the workers may take to join a round in place: `--hang-timeout`'s
/// [`HANDOVER_KEY`] allowance where it sets one (`set`), else
/// [`HANDOVER_STEPS`] times the slowest recent step of any local worker (`None`: none
/// reported), at least [`HANDOVER_MIN`]. Joining makes a new group (its store, its
/// communicator) and restores the state, a few steps' worth of collectives on a large
/// model; past the bound a restart is the surer way.
pub fn handover_bound(
    slowest_steps: impl IntoIterator<Item = Option<Duration>>,
    set: Option<Duration>,
) -> Duration {
    set.unwrap_or_else(|| {
        slowest_steps
            .into_iter()
            .flatten()
            .max()
            .map_or(HANDOVER_MIN, |s| s.saturating_mul(HANDOVER_STEPS))
            .max(HANDOVER_MIN)
    })
}

/// Where a handover of a round to workers kept in place stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// Look again shortly.
    Wait,
    /// Every local worker joined: the group runs in the new round.
    Done,
    /// The group changed again: re-form with the kept workers as the running group (they
    /// get the next round; they need not have confirmed this one).
    Reform,
    /// Stop the workers and start fresh ones, for this reason. Nothing is charged: the
    /// group had broken anyway, and a restart is what would have happened without the
    /// attempt.
    Fallback(&'static str),
    /// Every local worker exited 0 instead of joining: training had reached its end (the
    /// step the group rebuilt was the last), so the node finishes as after a run.
    Finished,
}

/// The kept workers' processes during a handover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    Running,
    /// Every one exited 0.
    Succeeded,
    /// One exited otherwise (or was killed).
    Exited,
}

/// The handover at `now`, begun at `started`, with `bound` to finish in: which local
/// workers confirmed the round (`joined`), whether they all still run, and whether the
/// rendezvous reported a change meanwhile.
pub fn handover(
    now: Instant,
    started: Instant,
    bound: Duration,
    confirmed: &[bool],
    kept: Kept,
    changed: bool,
) -> Handover {
    if changed {
        return Handover::Reform;
    }
    match kept {
        Kept::Running => {}
        // Not a failure: fresh workers would only find the run at its end.
        Kept::Succeeded => return Handover::Finished,
        // Even one that confirmed: an exit now would be a failure charged to the new round.
        Kept::Exited => return Handover::Fallback("a worker exited during the handover"),
    }
    if !confirmed.is_empty() && confirmed.iter().all(|c| *c) {
        return Handover::Done;
    }
    if now.saturating_duration_since(started) >= bound {
        return Handover::Fallback("not every worker joined the round in time");
    }
    Handover::Wait
}

/// What follows the stop of a group that changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterChange {
    /// A signal came during the stop: leave.
    Leave(Leave),
    /// Another node ended the run: this one ends with the same code.
    Halted(Halt),
    /// A peer's failure ended this attempt too: the policy's verdict (a halt is told to
    /// every node before leaving; a restart re-forms). A node that found the group hung
    /// answers first.
    PeerFailed(AfterFailure),
    /// This node lost its place by its own fault: charge a restart, then re-form.
    OwnLoss,
    /// Re-form.
    Rejoin,
}

/// After the workers of `round` were stopped for `change` (`late`: a signal during the
/// stop). `reached` is the best step the ranks reported: a peer's failure counts for the
/// no-progress rule like one here (the peer judges its own exit code).
pub fn after_change(
    memory: &mut Memory,
    round: &Round,
    change: &Change,
    late: Option<Signal>,
    me: Option<&str>,
    reached: Option<u64>,
    rules: &Rules,
) -> AfterChange {
    if let Some(sig) = late {
        return AfterChange::Leave(signalled(sig));
    }
    match change {
        Change::Halted(h) => AfterChange::Halted(h.clone()),
        Change::PeerFailed { .. } => {
            memory.failed = Some(RoundMembers::of(round));
            AfterChange::PeerFailed(judge(memory, WorkerExit::Lost, reached, &rules.failure))
        }
        _ if own_loss(change, me) => AfterChange::OwnLoss,
        _ => AfterChange::Rejoin,
    }
}

/// Whether `change` is this node losing its place in its round by its own fault: it
/// fenced itself, or its lease expired while it was frozen or cut off. The coordinator
/// charges the restart only if the round lost no other member, so the survivors of a
/// group that went on without this node are not charged; a node alone in its job is, and
/// its workers see the restart count move (without it, a worker whose start freezes its
/// node would start again with the same count forever).
pub fn own_loss(change: &Change, me: Option<&str>) -> bool {
    match change {
        Change::Fenced { .. } => true,
        Change::MemberLost { node } => me == Some(node.as_str()),
        _ => false,
    }
}

/// The attempt that just ended failed (here, or on a peer) with `exit` first: enters how
/// far its ranks got (`reached`) and asks the policy.
pub fn judge(
    memory: &mut Memory,
    exit: WorkerExit,
    reached: Option<u64>,
    policy: &FailurePolicy,
) -> AfterFailure {
    memory.ledger.failed_attempt(reached);
    after_failure(exit, &memory.ledger, policy)
}

/// The metric label of a failure of this node's group.
pub fn failure_label(exit: WorkerExit) -> &'static str {
    match exit {
        WorkerExit::Hung => "hang",
        _ => "worker failed",
    }
}

/// Whether this node's failure is reported to the shared records (quarantine compares
/// the reports' order): a hang is named by its own means, and one node is nothing to
/// compare.
pub fn reports_fault(round: &Round, exit: WorkerExit, policy: &FailurePolicy) -> bool {
    round.group_world_size >= 2 && exit != WorkerExit::Hung && policy.quarantine_after > 0
}

/// A worker of this node failed first with `first` in `round`: the round is remembered
/// as failed, `first` as the root cause, and the policy judges the attempt.
pub fn failed_here(
    memory: &mut Memory,
    round: &Round,
    first: &Failure,
    reached: Option<u64>,
    rules: &Rules,
) -> AfterFailure {
    memory.failed = Some(RoundMembers::of(round));
    memory.root_cause = Some(first.clone());
    judge(memory, first.exit, reached, &rules.failure)
}

/// Whether the summary of a failure of this node's group waits for the next round. In a
/// group of several nodes, workers whose peer died fail (their collectives break) before
/// the peer's loss is known; the next round says whether a member was lost, and then the
/// loss is named instead of a healthy rank ([`lost_peer_words`]). Only a failure that
/// re-forms waits; one that ends the run is this node's to report at once.
pub fn defer_summary(round: &Round, has_records: bool, verdict: &AfterFailure) -> bool {
    has_records && round.group_world_size >= 2 && *verdict == AfterFailure::Restart
}

/// The words for the members lost between a failed round and the next (node, how it was
/// noticed), or `None` when none was lost (the failure was this node's own).
pub fn lost_peer_words(lost: &[(String, &str)]) -> Option<String> {
    if lost.is_empty() {
        return None;
    }
    let said: Vec<String> = lost
        .iter()
        .map(|(node, how)| format!("node {node} was lost ({how})"))
        .collect();
    Some(said.join(", "))
}

/// What follows the stop of a failed group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailed {
    /// A signal came during the stop.
    Leave(Leave),
    /// The policy ended the run (every node was told before the stop).
    Halt { leave: Leave, reason: String },
    /// The policy keeps this node's machine out for `reason`: record it and leave,
    /// charging nothing.
    Quarantine { reason: String },
    /// Charge the failure, pause this long, re-form.
    Restart { backoff: Duration },
}

/// After the failed group of `round` was stopped (`late`: a signal meanwhile).
pub fn after_failed(
    memory: &mut Memory,
    round: &Round,
    exit: WorkerExit,
    verdict: AfterFailure,
    late: Option<Signal>,
) -> AfterFailed {
    if let Some(sig) = late {
        return AfterFailed::Leave(signalled(sig));
    }
    match verdict {
        AfterFailure::Halt { exit_code, reason } => AfterFailed::Halt {
            leave: halting(exit_code, &reason),
            reason,
        },
        AfterFailure::Quarantine { reason } => AfterFailed::Quarantine { reason },
        AfterFailure::Restart => {
            memory.last_failure = Some(exit);
            AfterFailed::Restart {
                backoff: restart_backoff(round.restart_count),
            }
        }
    }
}

/// What the exit barrier's outcome leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterBarrier {
    /// Every node finished: the job is done.
    Done(Leave),
    /// Another node ended the run.
    Halted(Halt),
    /// The group broke before every node finished: re-form.
    Rejoin(Change),
    /// These nodes did not finish in time.
    TimedOut {
        unfinished: Vec<String>,
        leave: Leave,
    },
}

pub fn after_barrier(outcome: Finish) -> AfterBarrier {
    match outcome {
        Finish::AllDone => AfterBarrier::Done(Leave {
            how: Departure::Finished,
            exit: AgentExit::Finished,
            why: LeftReason::new(
                LeftKind::Finished,
                "every worker exited 0; agent exit code 0",
            ),
        }),
        Finish::Changed(Change::Halted(h)) => AfterBarrier::Halted(h),
        Finish::Changed(change) => AfterBarrier::Rejoin(change),
        Finish::TimedOut { unfinished } => {
            let code = exit_code::BARRIER_TIMEOUT;
            let why = format!(
                "its workers finished, but {} did not within the exit barrier; agent exit code {code}",
                unfinished.join(", ")
            );
            AfterBarrier::TimedOut {
                unfinished,
                leave: Leave {
                    how: Departure::Finished,
                    exit: AgentExit::Failed { exit_code: code },
                    why: LeftReason::new(LeftKind::Failed, why),
                },
            }
        }
    }
}

/// Whether this node, whose `round` broke, looks for another node's hang declaration
/// (to publish where its ranks were): only with progress watched, in rounds of several
/// nodes, and not for a hang it declared itself.
pub fn answers_hang(memory: &Memory, round: &Round, progress_on: bool) -> bool {
    progress_on
        && round.group_world_size >= 2
        && memory
            .declared_hang
            .as_ref()
            .is_none_or(|d| d.number != round.number)
}

#[cfg(test)]
mod tests;
