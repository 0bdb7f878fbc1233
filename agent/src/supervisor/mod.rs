//! Worker supervision: spawn a group, watch it, stop it.
//!
//! Each worker is the leader of its own process group, so a stop signal reaches whatever
//! it started too; each dies with the agent through `PR_SET_PDEATHSIG` ([`unix`]). A stop
//! is the signal (SIGTERM, or the one the agent received), a grace period, then SIGKILL to
//! every group still alive.

pub mod output;
pub mod reaper;
mod unix;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fsdp_rendezvous::Round;
use nix::sys::signal::Signal;
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::config::{Config, parse::expand_prefix};
use crate::failure::{Failure, WorkerExit};
use crate::worker_env::{GroupEnv, worker_env};
use output::{Console, Sinks, Stream};

/// A worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("could not start worker {local_rank} ({program})")]
    Exec {
        local_rank: u32,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not create the worker log directory {path}")]
    LogDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the agent needs to start one group.
pub struct GroupSpec<'a> {
    pub config: &'a Config,
    pub round: &'a Round,
    /// `attempt_N` directory; `None` when logs go to `/dev/null`.
    pub attempt_dir: Option<PathBuf>,
    pub console: &'a Console,
    pub host: &'a str,
}

#[derive(Debug)]
struct Worker {
    local_rank: u32,
    rank: u32,
    pid: u32,
    exit: Option<WorkerExit>,
    error_file: Option<PathBuf>,
}

/// A worker as the status server shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerStatus {
    pub local_rank: u32,
    pub rank: u32,
    pub pid: u32,
    /// `None` while it runs.
    pub exit: Option<WorkerExit>,
    /// It exited because the agent stopped the group, not on its own.
    pub stopped_by_agent: bool,
}

/// Something the group did that the agent must act on.
#[derive(Debug)]
pub enum GroupEvent {
    /// A worker failed on its own; the first such failure of the group.
    Failed(Failure),
    /// Every worker exited 0.
    Succeeded,
}

/// A running group of workers.
pub struct WorkerGroup {
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<(usize, WorkerExit, SystemTime)>,
    waiters: JoinSet<()>,
    pumps: JoinSet<()>,
    failures: Vec<Failure>,
    /// Set once the agent sent a stop signal: later exits are not failures of their own.
    stopping: bool,
    /// Every leader is reaped and its process group was sent SIGKILL: nothing is left.
    settled: bool,
}

/// Every way out of the agent stops every worker process group. A `?` on an error path
/// drops the group while it runs; tokio's `kill_on_drop` would kill only the leaders and
/// leave what they started behind, reparented to PID 1.
impl Drop for WorkerGroup {
    fn drop(&mut self) {
        if !self.settled {
            self.signal_all(Signal::SIGKILL);
        }
    }
}

impl WorkerGroup {
    /// Starts one worker per local rank. If any cannot be started, the ones already
    /// running are killed before the error is returned.
    pub fn spawn(spec: &GroupSpec<'_>) -> Result<Self, SpawnError> {
        let (tx, exits) = mpsc::unbounded_channel();
        let mut group = Self {
            workers: Vec::new(),
            exits,
            waiters: JoinSet::new(),
            pumps: JoinSet::new(),
            failures: Vec::new(),
            stopping: false,
            settled: false,
        };
        let filtered =
            |name: &str, filters: &[String]| -> Result<Option<Arc<Mutex<File>>>, SpawnError> {
                match (&spec.attempt_dir, filters.is_empty()) {
                    (Some(dir), false) => {
                        let path = dir.join(name);
                        let f = File::create(&path)
                            .map_err(|source| SpawnError::LogDir { path, source })?;
                        Ok(Some(Arc::new(Mutex::new(f))))
                    }
                    _ => Ok(None),
                }
            };
        let logs = &spec.config.logs;
        let filtered_out = filtered("filtered_stdout.log", &logs.stdout_filters)?;
        let filtered_err = filtered("filtered_stderr.log", &logs.stderr_filters)?;
        for local_rank in 0..spec.config.nproc_per_node {
            if let Err(e) = group.spawn_one(spec, local_rank, &tx, [&filtered_out, &filtered_err]) {
                group.kill_now();
                return Err(e);
            }
        }
        Ok(group)
    }

    fn spawn_one(
        &mut self,
        spec: &GroupSpec<'_>,
        local_rank: u32,
        tx: &mpsc::UnboundedSender<(usize, WorkerExit, SystemTime)>,
        filtered: [&Option<Arc<Mutex<File>>>; 2],
    ) -> Result<(), SpawnError> {
        let cfg = spec.config;
        let rank = spec.round.base_rank + local_rank;
        let rank_dir = match &spec.attempt_dir {
            Some(dir) => {
                let d = dir.join(local_rank.to_string());
                std::fs::create_dir_all(&d).map_err(|source| SpawnError::LogDir {
                    path: d.clone(),
                    source,
                })?;
                Some(d)
            }
            None => None,
        };
        let error_file = rank_dir.as_ref().map(|d| d.join("error.json"));
        let env_of = |k: &str| std::env::var(k).ok();
        let nccl = env_of("TORCH_NCCL_ASYNC_ERROR_HANDLING");
        let cuda = env_of("CUDA_VISIBLE_DEVICES");
        let signals = cfg
            .signals
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let group_env = GroupEnv {
            round: spec.round,
            role: &cfg.role,
            local_world_size: cfg.nproc_per_node,
            run_id: &cfg.run_id,
            max_restarts: cfg.max_restarts,
            virtual_local_rank: cfg.virtual_local_rank,
            nccl_async_error_handling: nccl.as_deref(),
            cuda_visible_devices: cuda.as_deref(),
            omp_threads_default: cfg.omp_threads_default,
            signals_to_handle: &signals,
        };

        let mut cmd = Command::new(&cfg.entrypoint.program);
        let lr = local_rank.to_string();
        cmd.args(
            cfg.entrypoint
                .args
                .iter()
                .map(|a| a.replace("${local_rank}", &lr)),
        )
        .envs(worker_env(&group_env, local_rank, error_file.as_deref()))
        .stdin(Stdio::null())
        .kill_on_drop(true);
        crate::worker_env::scrub(&mut cmd, &cfg.worker_env_scrub);
        unix::prepare(&mut cmd);

        let prefix = expand_prefix(
            &cfg.logs.prefix_template,
            &cfg.role,
            local_rank,
            rank,
            spec.host,
        );
        let on_console = cfg
            .logs
            .console_ranks
            .as_ref()
            .is_none_or(|r| r.contains(&local_rank));
        let (redirect, tee) = (
            cfg.logs.redirects.for_rank(local_rank),
            cfg.logs.tee.for_rank(local_rank),
        );
        let mut plans = Vec::new();
        for (stream, name, to_file, teed, filters, filtered) in [
            (
                Stream::Stdout,
                "stdout.log",
                redirect.stdout || tee.stdout,
                tee.stdout,
                &cfg.logs.stdout_filters,
                filtered[0],
            ),
            (
                Stream::Stderr,
                "stderr.log",
                redirect.stderr || tee.stderr,
                tee.stderr,
                &cfg.logs.stderr_filters,
                filtered[1],
            ),
        ] {
            let file = match (&rank_dir, to_file) {
                (Some(d), true) => {
                    let path = d.join(name);
                    Some(
                        File::create(&path)
                            .map_err(|source| SpawnError::LogDir { path, source })?,
                    )
                }
                _ => None,
            };
            // A redirected stream leaves the console unless it is also tee'd.
            let console = (on_console && (!to_file || teed))
                .then(|| (spec.console.clone(), stream, prefix.clone()));
            let filtered = if teed { filtered.clone() } else { None };
            plans.push(Sinks {
                console,
                file,
                filters: filters.clone(),
                filtered,
            });
        }
        let [out_plan, err_plan]: [Sinks; 2] = plans.try_into().unwrap_or_else(|_| unreachable!());
        cmd.stdout(stdio_for(&out_plan))
            .stderr(stdio_for(&err_plan));

        let mut child = cmd.spawn().map_err(|source| SpawnError::Exec {
            local_rank,
            program: cfg.entrypoint.program.display().to_string(),
            source,
        })?;
        let pid = child.id().unwrap_or(0);
        // Before any await: the PID-1 reaper must never wait for a worker leader.
        reaper::register(pid);
        if let Some(out) = child.stdout.take() {
            self.pumps.spawn(output::pump(out, out_plan));
        }
        if let Some(err) = child.stderr.take() {
            self.pumps.spawn(output::pump(err, err_plan));
        }
        let index = self.workers.len();
        let tx = tx.clone();
        self.waiters.spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => WorkerExit::from_status(status),
                Err(_) => WorkerExit::Code(-1),
            };
            reaper::unregister(pid);
            // The receiver is gone only when the group was dropped.
            let _ = tx.send((index, exit, SystemTime::now()));
        });
        tracing::debug!(local_rank, rank, pid, "worker started");
        self.workers.push(Worker {
            local_rank,
            rank,
            pid,
            exit: None,
            error_file,
        });
        Ok(())
    }

    /// Process ids of the workers, by local rank.
    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.pid).collect()
    }

    /// Every worker's state, by local rank.
    pub fn statuses(&self) -> Vec<WorkerStatus> {
        self.workers
            .iter()
            .map(|w| WorkerStatus {
                local_rank: w.local_rank,
                rank: w.rank,
                pid: w.pid,
                exit: w.exit,
                stopped_by_agent: w.exit.is_some_and(|e| !e.success())
                    && !self.failures.iter().any(|f| f.local_rank == w.local_rank),
            })
            .collect()
    }

    fn record(&mut self, index: usize, exit: WorkerExit, at: SystemTime) -> Option<Failure> {
        let w = &mut self.workers[index];
        w.exit = Some(exit);
        tracing::debug!(local_rank = w.local_rank, pid = w.pid, %exit, "worker exited");
        if exit.success() || self.stopping {
            return None;
        }
        let failure = Failure {
            local_rank: w.local_rank,
            rank: w.rank,
            pid: w.pid,
            exit,
            at,
            error_file: w.error_file.clone(),
        };
        self.failures.push(failure.clone());
        Some(failure)
    }

    /// Waits for the next thing the agent must act on. `on_exit` sees the workers' states
    /// after every exit, also those that need no action (a rank that finished first).
    pub async fn next_event(&mut self, mut on_exit: impl FnMut(&[WorkerStatus])) -> GroupEvent {
        loop {
            if self
                .workers
                .iter()
                .all(|w| w.exit.is_some_and(WorkerExit::success))
            {
                return GroupEvent::Succeeded;
            }
            let Some((index, exit, at)) = self.exits.recv().await else {
                // Every waiter is gone without reporting; treat as a failure of rank 0.
                return GroupEvent::Failed(Failure {
                    local_rank: 0,
                    rank: 0,
                    pid: 0,
                    exit: WorkerExit::Code(-1),
                    at: SystemTime::now(),
                    error_file: None,
                });
            };
            let failure = self.record(index, exit, at);
            on_exit(&self.statuses());
            if let Some(f) = failure {
                return GroupEvent::Failed(f);
            }
        }
    }

    /// Every failure observed before the stop, in the order seen.
    pub fn failures(&self) -> &[Failure] {
        &self.failures
    }

    fn running(&self) -> bool {
        self.workers.iter().any(|w| w.exit.is_none())
    }

    fn signal_all(&self, signal: Signal) {
        for w in &self.workers {
            // Exited leaders are signalled too: their group may still hold children.
            unix::signal_group(w.pid, signal);
        }
    }

    fn kill_now(&mut self) {
        self.stopping = true;
        self.signal_all(Signal::SIGKILL);
    }

    /// Stops the group: `signal` to every worker's process group, then SIGKILL after
    /// `grace`, or at once when `escalate` resolves (a second signal to the agent).
    /// Returns when every worker has been reaped and its output drained.
    pub async fn stop(
        &mut self,
        signal: Signal,
        grace: Duration,
        escalate: impl Future<Output = ()>,
    ) {
        // Exits already queued happened before the stop; they may be failures of their own.
        while let Ok((index, exit, at)) = self.exits.try_recv() {
            self.record(index, exit, at);
        }
        self.stopping = true;
        if self.running() {
            tracing::info!(%signal, grace_s = grace.as_secs_f64(), "stopping workers");
            self.signal_all(signal);
        }
        let deadline = tokio::time::sleep(grace);
        tokio::pin!(deadline);
        tokio::pin!(escalate);
        let mut killed = false;
        while self.running() {
            tokio::select! {
                Some((index, exit, at)) = self.exits.recv() => { self.record(index, exit, at); }
                () = &mut deadline, if !killed => {
                    tracing::warn!(grace_s = grace.as_secs_f64(), "workers still running after the grace period; sending SIGKILL");
                    self.signal_all(Signal::SIGKILL);
                    killed = true;
                }
                () = &mut escalate, if !killed => {
                    tracing::warn!("second signal: sending SIGKILL to the workers");
                    self.signal_all(Signal::SIGKILL);
                    killed = true;
                }
            }
        }
        // Leaders are gone; SIGKILL anything they left in their groups.
        self.signal_all(Signal::SIGKILL);
        self.settled = true;
        self.drain_output().await;
    }

    /// Waits briefly for the output pumps so the last lines of a failed worker appear
    /// before the failure summary.
    async fn drain_output(&mut self) {
        let drained = async { while self.pumps.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(2), drained)
            .await
            .is_err()
        {
            self.pumps.abort_all();
        }
    }

    /// After [`GroupEvent::Succeeded`]: kills what the workers left running in their
    /// process groups (as torchrun does on completion) and waits for the output to drain.
    pub async fn finish(&mut self) {
        self.stopping = true;
        self.signal_all(Signal::SIGKILL);
        self.settled = true;
        self.drain_output().await;
    }
}

fn stdio_for(sinks: &Sinks) -> Stdio {
    match (&sinks.file, &sinks.console, &sinks.filtered) {
        // Redirect only: the worker writes straight to its file, no copy through the agent.
        (Some(f), None, None) => f
            .try_clone()
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::piped()),
        (None, None, _) => Stdio::null(),
        _ => Stdio::piped(),
    }
}

/// `<base>/<run_id>_<random>`: one directory per agent run, as torchrun lays it out.
pub fn run_log_dir(base: &Path, run_id: &str) -> std::io::Result<PathBuf> {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dir = base.join(format!("{run_id}_{suffix}"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `attempt_<n>` under the run's log directory, emptied if a previous round used it.
pub fn attempt_dir(run_dir: &Path, attempt: u32) -> std::io::Result<PathBuf> {
    let dir = run_dir.join(format!("attempt_{attempt}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
