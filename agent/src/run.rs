//! The agent's loop: rendezvous, start the group, watch it, and decide — restart, re-form,
//! finish or give up — until the job ends for this node.

use std::path::PathBuf;

use fsdp_rendezvous::{Departure, Rendezvous};
use nix::sys::signal::Signal;

use crate::config::Config;
use crate::failure::summary;
use crate::policy::{AfterFailure, after_failure};
use crate::signals::Signals;
use crate::supervisor::output::{Console, Stream};
use crate::supervisor::{GroupEvent, GroupSpec, WorkerGroup, attempt_dir, run_log_dir};

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
) -> anyhow::Result<AgentExit> {
    let (console, console_thread) = Console::start();
    let result = supervise(cfg, rdzv, signals, &console).await;
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
) -> anyhow::Result<AgentExit> {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    let run_dir = log_root(cfg)?;
    if let Some(dir) = &run_dir {
        tracing::info!(log_dir = %dir.display(), "worker logs and error files");
    }

    loop {
        let round = tokio::select! {
            r = rdzv.next_round() => r?,
            sig = signals.recv() => {
                rdzv.depart(Departure::Left).await?;
                return Ok(AgentExit::Signalled(sig));
            }
        };
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
        let mut group = WorkerGroup::spawn(&spec)?;
        tracing::info!(pids = ?group.pids(), entrypoint = %cfg.entrypoint.display(), "workers started");

        let event = tokio::select! {
            ev = group.next_event() => ev,
            sig = signals.recv() => {
                tracing::info!(signal = %sig, "signal received; stopping workers and leaving the run");
                group.stop(sig, cfg.term_timeout, async { signals.recv().await; }).await;
                rdzv.depart(Departure::Left).await?;
                return Ok(AgentExit::Signalled(sig));
            }
            change = rdzv.changed() => {
                let change = change?;
                tracing::info!(?change, "group changed; re-forming");
                let mut late_signal = None;
                group
                    .stop(Signal::SIGTERM, cfg.term_timeout, async { late_signal = Some(signals.recv().await) })
                    .await;
                if let Some(sig) = late_signal {
                    rdzv.depart(Departure::Left).await?;
                    return Ok(AgentExit::Signalled(sig));
                }
                continue;
            }
        };

        match event {
            GroupEvent::Succeeded => {
                group.finish().await;
                tracing::info!("all workers finished successfully");
                rdzv.depart(Departure::Finished).await?;
                return Ok(AgentExit::Finished);
            }
            GroupEvent::Failed(first) => {
                // A signal during the stop escalates to SIGKILL; it is honoured right after.
                let mut late_signal = None;
                group
                    .stop(Signal::SIGTERM, cfg.term_timeout, async {
                        late_signal = Some(signals.recv().await)
                    })
                    .await;
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
                let (decision, reason) =
                    after_failure(round.restart_count, cfg.max_restarts, first.exit);
                match decision {
                    AfterFailure::Restart => {
                        tracing::warn!(%reason, "restarting the worker group");
                        rdzv.record_failure().await?;
                    }
                    AfterFailure::GiveUp { exit_code } => {
                        tracing::error!(%reason, exit_code, "giving up");
                        rdzv.depart(Departure::Failed).await?;
                        return Ok(AgentExit::Failed { exit_code });
                    }
                }
            }
        }
    }
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
