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
//! A group whose workers all re-form in place ([`decide::in_place`]) is not stopped in
//! `Reform`: it is kept through `Join`, and `Start` hands it the round instead of spawning
//! (`handover.rs`).
//!
//! Three parts, one purpose each:
//!
//! * [`memory`]: what the loop remembers across phases, as types ([`memory::Memory`],
//!   [`memory::RoundMembers`]).
//! * [`decide`]: the pure handler. Each phase's decision is a function of the memory,
//!   what happened (a round, a [`decide::Wake`], a change, a failure, the barrier's
//!   outcome) and the [`decide::Rules`], returning what to do next; no I/O, no async,
//!   tested on hand-built values.
//! * `driver.rs`: the only place that awaits. Each phase there does its I/O (the
//!   rendezvous, the worker group, sleeps, signals, the reporter), hands what it learnt
//!   to a decision and carries the decision out. Every await that can take time goes
//!   through [`driver::interruptible`], and a signal there ends in `Leave` (the workers,
//!   if any, are stopped with the signal first). `gate.rs`, `halt.rs`, `hang.rs`,
//!   `handover.rs` (re-forming in place) and `quarantine.rs` are the driver's I/O for
//!   those concerns.
//!
//! Status and metrics follow the phases through one [`report::Reporter`]. A new event
//! (say, "a worker hung") is one more [`decide::Wake`] variant, its decision, and the
//! phase it leads to.

mod decide;
mod driver;
mod gate;
mod halt;
mod handover;
mod hang;
mod memory;
mod quarantine;
mod report;
mod straggler;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::Duration;

use fsdp_rendezvous::{Change, JobRecords, Rendezvous, Round};
use nix::sys::signal::Signal;

use crate::config::Config;
use crate::error::AgentError;
use crate::failure::Failure;
use crate::signals::Signals;
use crate::status::Board;
use crate::supervisor::WorkerGroup;
use crate::supervisor::output::Console;
use crate::supervisor::run_log_dir;
use decide::Leave;
use driver::Loop;
use report::Reporter;

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

/// Where the loop is; each variant carries what its phase needs (the resources the
/// driver holds, beside the values the decisions read).
enum Phase {
    /// Ask the rendezvous for the next round.
    Join,
    /// A sealed round with this node in it and budget left: start its workers.
    Start(Round),
    /// The workers run: wait for them, the group, or a signal.
    Running { round: Round, group: WorkerGroup },
    /// The group changed: stop the workers (or keep them, to take the next round in
    /// place), then join the next round.
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
    Leave(Leave),
}

impl From<Leave> for Phase {
    fn from(leave: Leave) -> Self {
        Self::Leave(leave)
    }
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
    report.machine(&cfg.failure.machine);
    let run_dir = log_root(cfg)?;
    if let Some(dir) = &run_dir {
        tracing::info!(log_dir = %dir.display(), "worker logs and error files");
    }
    let mut l = Loop::new(cfg, rdzv, signals, console, report, host, run_dir);
    let mut phase = Phase::Join;
    loop {
        let next = match phase {
            Phase::Join => l.join().await,
            Phase::Start(round) => l.start(round).await,
            Phase::Running { round, group } => l.running(round, group).await,
            Phase::Reform {
                round,
                group,
                change,
            } => Ok(l.reform(round, group, change).await),
            Phase::Failed {
                round,
                group,
                first,
            } => l.failed(round, group, first).await,
            Phase::Barrier { round } => l.barrier(round).await,
            Phase::Leave(leave) => {
                // Workers kept to re-form in place go with the node.
                l.release_kept(Some(leave.exit)).await;
                // Nothing came to say a peer was lost first: the failure was this node's.
                l.settle_summary(&[]).await;
                if let AgentExit::Signalled(sig) = leave.exit {
                    tracing::warn!(signal = %sig, "leaving the run on a signal");
                }
                let result = l.leave(leave).await;
                l.write_launcher_error(&result);
                return result;
            }
        };
        phase = match next {
            Ok(phase) => phase,
            Err(e) => {
                // Stopped as the loop would stop them, not SIGKILLed by a dropped group.
                l.release_kept(None).await;
                return Err(e);
            }
        };
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
