//! The agent's loop: rendezvous, start the group, watch it, and decide — restart, re-form,
//! finish or give up — until the job ends for this node.

use std::path::PathBuf;

use fsdp_rendezvous::{Departure, Finish, Rendezvous};
use nix::sys::signal::Signal;

use crate::config::Config;
use crate::exit_code;
use crate::failure::WorkerExit;
use crate::failure::summary;
use crate::policy::{Budget, budget, restart_backoff};
use crate::signals::Signals;
use crate::status::Board;
use crate::supervisor::output::{Console, Stream};
use crate::supervisor::{GroupEvent, GroupSpec, WorkerGroup, attempt_dir, run_log_dir};
use fsdp_proto::v1::Phase;
use fsdp_rendezvous::Change;
use std::time::Instant;

/// How the agent's run ended.
#[derive(Debug)]
pub enum AgentExit {
    /// Every worker succeeded.
    Finished,
    /// The restart budget is spent; exit with this code.
    Failed { exit_code: u8 },
    /// The agent was told to stop by this signal.
    Signalled(Signal),
}

/// Runs the job on this node until it ends.
pub async fn run<R: Rendezvous>(
    cfg: &Config,
    rdzv: &mut R,
    signals: &mut Signals,
    board: &Board,
) -> anyhow::Result<AgentExit> {
    let (console, console_thread) = Console::start();
    let result = supervise(cfg, rdzv, signals, &console, board).await;
    match &result {
        Ok(AgentExit::Finished) => board.transition(Phase::Succeeded, "every node finished"),
        Ok(AgentExit::Failed { exit_code }) => board.transition(
            Phase::Failed,
            format!("giving up with exit code {exit_code}"),
        ),
        Ok(AgentExit::Signalled(sig)) => {
            board.transition(Phase::Leaving, format!("{sig} received"))
        }
        Err(e) => {
            board.rendezvous_error();
            board.transition(Phase::Failed, format!("{e:#}"));
        }
    }
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
    board: &Board,
) -> anyhow::Result<AgentExit> {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    board.set_node(rdzv.node_id().unwrap_or(&host), rdzv.error_counter());
    // When this node's running group last broke, and who was in it: the start of the
    // detect and re-form timings.
    let mut broke_at: Option<Instant> = None;
    let mut previous_members: Vec<String> = Vec::new();
    let run_dir = log_root(cfg)?;
    if let Some(dir) = &run_dir {
        tracing::info!(log_dir = %dir.display(), "worker logs and error files");
    }
    // This node's last worker failure: its code is the exit code if the budget runs out.
    let mut last_failure: Option<WorkerExit> = None;
    let mut last_restart_count = 0;

    loop {
        let round = tokio::select! {
            r = rdzv.next_round() => r?,
            sig = signals.recv() => {
                rdzv.depart(Departure::Left).await?;
                return Ok(AgentExit::Signalled(sig));
            }
        };
        board.round(&round, rdzv.coordinator());
        let members: Vec<String> = round.members.iter().map(|m| m.node_id.clone()).collect();
        if let Some(t) = broke_at {
            if previous_members.iter().any(|m| !members.contains(m)) {
                board.observe_detect(t.elapsed());
            }
        }
        previous_members = members;
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
        match budget(round.restart_count, cfg.max_restarts, last_failure) {
            Budget::Spent { exit_code } => {
                tracing::error!(
                    restart_count = round.restart_count,
                    max_restarts = cfg.max_restarts,
                    exit_code,
                    "the restart budget is spent; giving up"
                );
                rdzv.depart(Departure::Failed).await?;
                return Ok(AgentExit::Failed { exit_code });
            }
            Budget::Left => {
                if round.restart_count > last_restart_count {
                    tracing::warn!(
                        "restarting the worker group after a failure: restart {} of {}",
                        round.restart_count,
                        cfg.max_restarts
                    );
                }
            }
        }
        last_restart_count = round.restart_count;
        let attempt = match &run_dir {
            Some(dir) => Some(attempt_dir(dir, round.restart_count)?),
            None => None,
        };
        let spec = GroupSpec {
            config: cfg,
            round: &round,
            attempt_dir: attempt,
            console,
            host: &host,
        };
        let mut group = WorkerGroup::spawn(&spec).await?;
        tracing::info!(pids = ?group.pids(), entrypoint = %cfg.entrypoint.display(), "workers started");
        board.workers(&group.statuses(), false);
        board.transition(
            Phase::Running,
            format!(
                "workers started in round {} ({})",
                round.number, round.reason
            ),
        );
        if let Some(t) = broke_at.take() {
            board.observe_reform(t.elapsed());
        }

        let event = tokio::select! {
            ev = group.next_event(|workers| board.workers(workers, false)) => ev,
            sig = signals.recv() => {
                tracing::info!(signal = %sig, "signal received; stopping workers and leaving the run");
                group.stop(sig, cfg.term_timeout, async { signals.recv().await; }).await;
                rdzv.depart(Departure::Left).await?;
                return Ok(AgentExit::Signalled(sig));
            }
            change = rdzv.changed() => {
                let change = match change {
                    Ok(c) => c,
                    Err(e) => {
                        // The workers get their grace (a checkpoint on SIGTERM) before the
                        // agent gives up on the rendezvous.
                        tracing::error!(error = %e, "the rendezvous failed; stopping workers");
                        board.transition(Phase::Stopping, format!("rendezvous failed: {e}"));
                        stop_for_reform(&mut group, cfg, signals).await;
                        return Err(e.into());
                    }
                };
                tracing::info!(?change, "group changed; re-forming");
                broke_at = Some(Instant::now());
                board.reform_started(change_label(&change));
                board.transition(Phase::Stopping, describe(&change));
                let late = stop_for_reform(&mut group, cfg, signals).await;
                board.workers(&group.statuses(), false);
                board.transition(Phase::Rendezvous, format!("re-forming: {}", describe(&change)));
                if let Some(sig) = late {
                    rdzv.depart(Departure::Left).await?;
                    return Ok(AgentExit::Signalled(sig));
                }
                continue;
            }
        };

        match event {
            GroupEvent::Succeeded => {
                group.finish().await;
                board.workers(&group.statuses(), true);
                board.transition(Phase::Finishing, "every local worker succeeded");
                if round.group_world_size > 1 {
                    tracing::info!(
                        timeout_s = cfg.exit_barrier().as_secs_f64(),
                        "all workers finished; waiting for the other nodes"
                    );
                }
                let outcome = tokio::select! {
                    f = rdzv.finish(cfg.exit_barrier()) => f?,
                    sig = signals.recv() => {
                        rdzv.depart(Departure::Left).await?;
                        return Ok(AgentExit::Signalled(sig));
                    }
                };
                match outcome {
                    Finish::AllDone => {
                        tracing::info!(
                            nodes = round.group_world_size,
                            "every node finished; the job is done"
                        );
                        rdzv.depart(Departure::Finished).await?;
                        return Ok(AgentExit::Finished);
                    }
                    Finish::Changed(change) => {
                        broke_at = Some(Instant::now());
                        board.reform_started(change_label(&change));
                        board.transition(
                            Phase::Rendezvous,
                            format!("re-forming: {}", describe(&change)),
                        );
                        tracing::warn!(
                            ?change,
                            "the group broke before every node finished; re-forming"
                        );
                        continue;
                    }
                    Finish::TimedOut { unfinished } => {
                        tracing::error!(
                            ?unfinished,
                            "other nodes did not finish within the exit barrier timeout"
                        );
                        rdzv.depart(Departure::Finished).await?;
                        return Ok(AgentExit::Failed {
                            exit_code: exit_code::BARRIER_TIMEOUT,
                        });
                    }
                }
            }
            GroupEvent::Failed(first) => {
                broke_at = Some(Instant::now());
                board.reform_started("worker failed");
                board.transition(
                    Phase::Stopping,
                    format!("worker rank {} failed: {}", first.rank, first.exit),
                );
                // A signal during the stop escalates to SIGKILL; it is honoured right after.
                let mut late_signal = None;
                group
                    .stop(Signal::SIGTERM, cfg.term_timeout, async {
                        late_signal = Some(signals.recv().await)
                    })
                    .await;
                board.workers(&group.statuses(), true);
                tracing::error!(
                    rank = first.rank,
                    local_rank = first.local_rank,
                    pid = first.pid,
                    exit = %first.exit,
                    "worker group failed"
                );
                // Through the console, so it follows the workers' last lines.
                let text = summary(
                    &cfg.entrypoint.display(),
                    round.restart_count,
                    &host,
                    group.failures(),
                );
                console
                    .write(Stream::Stderr, format!("{text}\n").into_bytes())
                    .await;
                if let Some(sig) = late_signal {
                    rdzv.depart(Departure::Left).await?;
                    return Ok(AgentExit::Signalled(sig));
                }
                last_failure = Some(first.exit);
                board.transition(
                    Phase::Rendezvous,
                    format!(
                        "restarting after worker rank {} failed: {}",
                        first.rank, first.exit
                    ),
                );
                rdzv.record_failure().await?;
                let pause = restart_backoff(round.restart_count);
                tracing::info!(
                    backoff_ms = pause.as_millis() as u64,
                    "worker failure reported; re-forming"
                );
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    sig = signals.recv() => {
                        rdzv.depart(Departure::Left).await?;
                        return Ok(AgentExit::Signalled(sig));
                    }
                }
            }
        }
    }
}

/// The metric label of a re-form's reason.
fn change_label(change: &Change) -> &'static str {
    match change {
        Change::MemberLost { .. } => "member lost",
        Change::NodeWaiting { .. } => "node waiting",
        Change::PeerFailed { .. } => "peer failed",
        Change::NewRound { .. } => "new round",
    }
}

/// A change in words, for the status' last transition.
fn describe(change: &Change) -> String {
    match change {
        Change::MemberLost { node } => format!("node {node} left the group"),
        Change::NodeWaiting { waiting } => format!("{waiting} node(s) waiting to join"),
        Change::PeerFailed { restart_count } => {
            format!("another node's worker failed (restart {restart_count})")
        }
        Change::NewRound { number } => format!("round {number} was sealed"),
    }
}

/// Stops the group for a re-form; returns a signal that arrived meanwhile.
async fn stop_for_reform(
    group: &mut WorkerGroup,
    cfg: &Config,
    signals: &mut Signals,
) -> Option<Signal> {
    let mut late_signal = None;
    group
        .stop(Signal::SIGTERM, cfg.term_timeout, async {
            late_signal = Some(signals.recv().await)
        })
        .await;
    late_signal
}

/// The run's log directory, or `None` when logs go to `/dev/null`.
fn log_root(cfg: &Config) -> anyhow::Result<Option<PathBuf>> {
    use anyhow::Context;
    let base = match &cfg.logs.dir {
        Some(d) if d == std::path::Path::new("/dev/null") => return Ok(None),
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "fsdp-agent-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )),
    };
    let dir = run_log_dir(&base, &cfg.run_id)
        .with_context(|| format!("creating log directory under {}", base.display()))?;
    Ok(Some(dir))
}
