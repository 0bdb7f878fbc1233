//! Worker supervision: spawn a group, watch it, stop it.
//!
//! Each worker is the leader of its own process group, so a stop signal reaches whatever
//! it started too; each dies with the agent through `PR_SET_PDEATHSIG` ([`launch`] for a
//! cold start, [`unix`] for a spare). A stop
//! is the signal (SIGTERM, or the one the agent received), a grace period, then SIGKILL to
//! every group still alive.

pub mod disk;
pub mod files;
mod launch;
pub mod output;
pub mod spare;
mod unix;

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use fsdp_rendezvous::Round;
use nix::sys::signal::Signal;
use tokio::net::unix::pipe::Receiver;
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::config::{Config, parse::expand_prefix};
use crate::failure::{ErrorReport, Failure, WorkerExit, read_error_file};
use crate::reaper;
use crate::worker_env::{GroupEnv, worker_env};
use disk::Disk;
use files::{AttemptFiles, Files, Route};
use launch::{Launch, Launched};
use output::{Console, Sinks, Stream};
use spare::{Spares, Start};

pub use files::{attempt_dir, run_log_dir};

/// How long a group start waits for the log directory (emptying the attempt directory,
/// creating it, opening the log files) before it starts the workers without log files.
/// A hung mount delays a group start by this much, never the lease.
pub const LOG_DIR_PATIENCE: Duration = Duration::from_secs(10);

/// How long the agent waits to read a failed worker's error file before the summary
/// goes out without it.
pub const ERROR_FILE_PATIENCE: Duration = Duration::from_secs(2);

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
    pub channels: Channels<'a>,
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

/// A worker's exit, as its waiter reports it.
struct Exit {
    index: usize,
    exit: WorkerExit,
    at: SystemTime,
    /// Its error file, read when it failed on its own.
    report: Option<ErrorReport>,
    /// The end of its stderr log file, read then too.
    stderr_tail: Vec<String>,
}

/// A running group of workers.
pub struct WorkerGroup {
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<Exit>,
    waiters: JoinSet<()>,
    pumps: JoinSet<()>,
    failures: Vec<Failure>,
    /// Set once the agent sent a stop signal: later exits are not failures of their own.
    /// Shared with the waiters, which then skip reading error files.
    stopping: Arc<AtomicBool>,
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
    /// Starts one worker per local rank, after the log files are ready (or the log
    /// directory did not answer within [`LOG_DIR_PATIENCE`]). If any worker cannot be
    /// started, the ones already running are killed before the error is returned.
    ///
    /// With `spares` (`--prewarm`), each worker is its local rank's spare when
    /// [`spare::decide`] says so, else a cold start; the reason is logged and counted.
    pub async fn spawn(
        spec: &GroupSpec<'_>,
        mut spares: Option<&mut Spares>,
    ) -> Result<Self, SpawnError> {
        let (tx, exits) = mpsc::unbounded_channel();
        let mut group = Self {
            workers: Vec::new(),
            exits,
            waiters: JoinSet::new(),
            pumps: JoinSet::new(),
            failures: Vec::new(),
            stopping: Arc::new(AtomicBool::new(false)),
            settled: false,
        };
        let (files, mut opened) = open_files(spec).await?;
        for local_rank in 0..spec.config.nproc_per_node {
            let streams = opened
                .ranks
                .get_mut(local_rank as usize)
                .map(std::mem::take)
                .unwrap_or_default();
            let io = StreamIo {
                files,
                opened: streams,
                filtered: &opened.filtered,
            };
            let started = group
                .spawn_one(spec, local_rank, io, &tx, spares.as_deref_mut())
                .await;
            if let Err(e) = started {
                group.kill_now();
                return Err(e);
            }
        }
        Ok(group)
    }

    async fn spawn_one(
        &mut self,
        spec: &GroupSpec<'_>,
        local_rank: u32,
        io: StreamIo<'_>,
        tx: &mpsc::UnboundedSender<Exit>,
        spares: Option<&mut Spares>,
    ) -> Result<(), SpawnError> {
        let cfg = spec.config;
        let rank = spec.round.base_rank + local_rank;
        let error_file = match (io.files, &spec.attempt_dir) {
            (Files::Written, Some(dir)) => Some(files::error_file(dir, local_rank)),
            _ => None,
        };
        let overlay = worker_overlay(
            cfg,
            spec.round,
            local_rank,
            error_file.as_deref(),
            spec.channels,
        );
        let [(out_wire, out_sinks), (err_wire, mut err_sinks)] = io.wire(spec, local_rank, rank);
        // Kept when stderr goes to a log file, which a full disk may not hold.
        let tail = err_sinks
            .as_mut()
            .filter(|s| s.file.is_some())
            .map(|s| s.tail.insert(output::Tail::default()).clone());
        let warm = try_warm(spares, cfg, local_rank, &overlay, [&out_wire, &err_wire]).await;
        let (child, pid) = match warm {
            Some((child, pipes)) => {
                let pid = child.id().unwrap_or(0);
                tracing::info!(local_rank, pid, "worker started from its spare");
                self.pump_output(pipes, [out_sinks, err_sinks]);
                (Process::Spare(child), pid)
            }
            None => {
                let (child, pipes) = start_cold(cfg, local_rank, &overlay, [&out_wire, &err_wire])
                    .map_err(|source| SpawnError::Exec {
                        local_rank,
                        program: cfg.entrypoint.program.display().to_string(),
                        source,
                    })?;
                let pid = child.id();
                // Before any await: the PID-1 reaper must never wait for a worker leader.
                reaper::register(pid);
                self.pump_output(pipes, [out_sinks, err_sinks]);
                (Process::Cold(child), pid)
            }
        };
        self.watch(
            child,
            pid,
            error_file.clone(),
            (spec.console.disk().clone(), tail),
            tx,
        );
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

    /// Carries a worker's piped streams (stdout, stderr) to their sinks; a stream not
    /// piped reaches its destination without the agent.
    fn pump_output(&mut self, pipes: [Option<Receiver>; 2], sinks: [Option<Sinks>; 2]) {
        for (pipe, sinks) in pipes.into_iter().zip(sinks) {
            if let (Some(pipe), Some(sinks)) = (pipe, sinks) {
                self.pumps.spawn(output::pump(pipe, sinks));
            }
        }
    }

    /// Waits for the worker in a task of its own and reports its exit, with its error
    /// file when it failed on its own (read off the runtime thread, with a deadline).
    fn watch(
        &mut self,
        mut child: Process,
        pid: u32,
        error_file: Option<PathBuf>,
        (disk, tail): (Disk, Option<output::Tail>),
        tx: &mpsc::UnboundedSender<Exit>,
    ) {
        let index = self.workers.len();
        let (tx, stopping) = (tx.clone(), self.stopping.clone());
        self.waiters.spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => WorkerExit::from_status(status),
                Err(_) => WorkerExit::Lost,
            };
            let at = SystemTime::now();
            reaper::unregister(pid);
            let (report, stderr_tail) = match error_file {
                Some(path) if !exit.success() && !stopping.load(Ordering::SeqCst) => {
                    // The lines the pump kept in memory: a full disk kept them out of
                    // `stderr.log`.
                    let tail = match tail {
                        Some(t) => t.lines(ERROR_FILE_PATIENCE).await,
                        None => Vec::new(),
                    };
                    (read_report(&disk, path).await, tail)
                }
                _ => (None, Vec::new()),
            };
            // The receiver is gone only when the group was dropped.
            let _ = tx.send(Exit {
                index,
                exit,
                at,
                report,
                stderr_tail,
            });
        });
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

    fn record(&mut self, reported: Exit) -> Option<Failure> {
        let Exit {
            index,
            exit,
            at,
            report,
            stderr_tail,
        } = reported;
        let w = &mut self.workers[index];
        w.exit = Some(exit);
        tracing::debug!(local_rank = w.local_rank, pid = w.pid, %exit, "worker exited");
        if exit.success() || self.stopping.load(Ordering::SeqCst) {
            return None;
        }
        let failure = Failure {
            local_rank: w.local_rank,
            rank: w.rank,
            pid: w.pid,
            exit,
            at,
            error_file: w.error_file.clone(),
            report,
            stderr_tail,
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
            let Some(reported) = self.exits.recv().await else {
                // Every waiter is gone without reporting; treat as a failure of rank 0.
                return GroupEvent::Failed(Failure {
                    local_rank: 0,
                    rank: 0,
                    pid: 0,
                    exit: WorkerExit::Lost,
                    at: SystemTime::now(),
                    error_file: None,
                    report: None,
                    stderr_tail: Vec::new(),
                });
            };
            let failure = self.record(reported);
            on_exit(&self.statuses());
            if let Some(f) = failure {
                return GroupEvent::Failed(f);
            }
        }
    }

    /// The same processes, now the workers of `round` (a re-form in place): the global
    /// ranks that failure reports, status and the hang judge name them by move with them.
    /// Their error files stay where their environment points, in the attempt they were
    /// spawned in.
    pub fn move_to(&mut self, round: &Round) {
        for w in &mut self.workers {
            w.rank = round.base_rank + w.local_rank;
        }
    }

    /// Whether every worker still runs, after taking in the exits already reported.
    pub fn all_running(&mut self) -> bool {
        self.take_queued();
        self.workers.iter().all(|w| w.exit.is_none())
    }

    /// Waits for the next worker to exit and returns its state (never, once every waiter
    /// has reported). For a group kept between two rounds, whose exits are no events of a
    /// running group; cancel-safe.
    pub async fn next_exit(&mut self) -> WorkerStatus {
        let Some(reported) = self.exits.recv().await else {
            return std::future::pending().await;
        };
        let index = reported.index;
        self.record(reported);
        self.statuses()[index]
    }

    /// The first failure of a worker that exited on its own before now, though its waiter
    /// may not have reported it yet: a busy agent can see a peer's news of the same
    /// breakage first, and a stop signal sent then would pass the exit off as the agent's.
    /// Waits for those reports (each waiter reads its output's tail and its error file
    /// within [`ERROR_FILE_PATIENCE`] each); nothing is signalled.
    pub async fn failed_before_now(&mut self) -> Option<Failure> {
        let seen = self.failures.len();
        self.take_queued();
        let gone: Vec<usize> = (0..self.workers.len())
            .filter(|&i| self.workers[i].exit.is_none() && unix::has_exited(self.workers[i].pid))
            .collect();
        let patience = tokio::time::sleep(ERROR_FILE_PATIENCE * 2 + Duration::from_secs(1));
        tokio::pin!(patience);
        while gone.iter().any(|&i| self.workers[i].exit.is_none()) {
            tokio::select! {
                Some(reported) = self.exits.recv() => { self.record(reported); }
                () = &mut patience => break,
            }
        }
        self.failures.get(seen).cloned()
    }

    /// Takes in the exits the waiters have reported and nobody read yet.
    fn take_queued(&mut self) {
        while let Ok(reported) = self.exits.try_recv() {
            self.record(reported);
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
        self.stopping.store(true, Ordering::SeqCst);
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
        self.take_queued();
        self.stopping.store(true, Ordering::SeqCst);
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
                Some(reported) = self.exits.recv() => { self.record(reported); }
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
        tracing::info!(killed, "workers stopped");
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
        self.stopping.store(true, Ordering::SeqCst);
        self.signal_all(Signal::SIGKILL);
        self.settled = true;
        self.drain_output().await;
    }
}

/// Prepares the attempt's directory and log files on the log-file thread. A directory that
/// does not answer within [`LOG_DIR_PATIENCE`] is given up on: the workers start without
/// log files or error files, their output on the console.
async fn open_files(spec: &GroupSpec<'_>) -> Result<(Files, AttemptFiles), SpawnError> {
    let Some(dir) = spec.attempt_dir.clone() else {
        return Ok((Files::DevNull, AttemptFiles::default()));
    };
    let logs = &spec.config.logs;
    let routes: Vec<[Route; 2]> = (0..spec.config.nproc_per_node)
        .map(|r| files::routes(logs, r, Files::Written))
        .collect();
    let filtered = [
        !logs.stdout_filters.is_empty(),
        !logs.stderr_filters.is_empty(),
    ];
    let job_dir = dir.clone();
    let prepared = spec
        .console
        .disk()
        .call(LOG_DIR_PATIENCE, move || {
            files::prepare(&job_dir, &routes, filtered)
        })
        .await;
    match prepared {
        Some(Ok(opened)) => Ok((Files::Written, opened)),
        Some(Err((path, source))) => Err(SpawnError::LogDir { path, source }),
        None => {
            tracing::warn!(
                dir = %dir.display(),
                patience_s = LOG_DIR_PATIENCE.as_secs(),
                "the worker log directory did not respond (a hung mount?); starting the workers \
                 without log files or error files, their output on the console"
            );
            Ok((Files::Unavailable, AttemptFiles::default()))
        }
    }
}

/// What a worker of `round` changes in the agent's environment: torchrun's variables, the
/// agent's own channels, and what it must not inherit ([`Config::worker_env_scrub`]).
pub fn worker_overlay(
    cfg: &Config,
    round: &Round,
    local_rank: u32,
    error_file: Option<&std::path::Path>,
    channels: Channels<'_>,
) -> spare::Overlay {
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
        round,
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
    let mut overlay: spare::Overlay = worker_env(&group_env, local_rank, error_file)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Some(v)))
        .collect();
    if let Some(p) = channels.progress {
        overlay.push((
            crate::hang::progress::ENV.into(),
            Some(p.display().to_string()),
        ));
        // Only beside a progress socket: a worker re-formed in place says it joined there.
        if let Some(ctl) = crate::control::path(p, local_rank) {
            overlay.push((crate::control::ENV.into(), Some(ctl.display().to_string())));
        }
    }
    if let Some(p) = channels.timer_file {
        overlay.push((
            crate::hang::file_timer::FILE.into(),
            Some(p.display().to_string()),
        ));
    }
    overlay.extend(cfg.worker_env_scrub.iter().cloned());
    overlay
}

/// The agent's channels a worker is told about.
#[derive(Debug, Clone, Copy, Default)]
pub struct Channels<'a> {
    /// The progress socket (`FSDP_AGENT_PROGRESS`); with it, each worker's control
    /// socket beside it (`FSDP_AGENT_CONTROL`, [`crate::control`]).
    pub progress: Option<&'a std::path::Path>,
    /// torchrun's file-timer FIFO (`TORCHELASTIC_TIMER_FILE`).
    pub timer_file: Option<&'a std::path::Path>,
}

/// Worker `local_rank`'s arguments, `${local_rank}` substituted.
fn worker_args(cfg: &Config, local_rank: u32) -> Vec<String> {
    let lr = local_rank.to_string();
    cfg.entrypoint
        .args
        .iter()
        .map(|a| a.replace("${local_rank}", &lr))
        .collect()
}

/// The spare of `local_rank`: the interpreter, the cold arguments, and the environment of
/// a worker of any round (the per-round variables left out; they come with its orders).
pub fn spare_command(cfg: &Config, local_rank: u32) -> (PathBuf, Vec<String>, spare::Overlay) {
    let any_round = Round {
        number: 0,
        group_rank: 0,
        group_world_size: 0,
        base_rank: 0,
        world_size: 0,
        master_addr: String::new(),
        master_port: 0,
        restart_count: 0,
        members: Vec::new().into(),
        reason: String::new(),
        charged_at_ms: Vec::new(),
        sealed_at_ms: 0,
        broken: None,
    };
    let mut overlay = worker_overlay(cfg, &any_round, local_rank, None, Channels::default());
    overlay.retain(|(k, _)| !spare::PER_ROUND.contains(&k.as_str()));
    (
        cfg.entrypoint.program.clone(),
        worker_args(cfg, local_rank),
        overlay,
    )
}

/// Starts worker `local_rank` cold ([`launch`]): the entrypoint with its arguments and
/// environment, its output where `wires` say; the read ends the agent pumps.
fn start_cold(
    cfg: &Config,
    local_rank: u32,
    overlay: &spare::Overlay,
    wires: [&Wire; 2],
) -> std::io::Result<(Launched, [Option<Receiver>; 2])> {
    // The agent's stdin stays the worker's, as under torchrun (each worker leads its own
    // session, so a terminal there is readable without job control stopping it).
    let (stdout, out) = wires[0].descriptor(Stream::Stdout)?;
    let (stderr, err) = wires[1].descriptor(Stream::Stderr)?;
    let child = launch::start(&Launch {
        program: &cfg.entrypoint.program,
        args: &worker_args(cfg, local_rank),
        env: overlay,
        stdout: &stdout,
        stderr: &stderr,
    })?;
    Ok((child, [out, err]))
}

/// A started worker: started cold by the agent, or a spare that became the worker.
enum Process {
    Cold(Launched),
    Spare(Child),
}

impl Process {
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            Process::Cold(c) => c.wait().await,
            Process::Spare(c) => c.wait().await,
        }
    }
}

/// What one of a worker's output streams is connected to.
enum Wire {
    /// The agent's own stream.
    Inherit,
    Null,
    /// Through the agent, which pumps it to its sinks.
    Pipe,
}

impl Wire {
    /// What the worker puts in place of its `stream`: a descriptor of its own, and the
    /// read end the agent pumps when it is a pipe. The wire itself stays usable for a cold
    /// start should a spare's handoff fail.
    fn descriptor(&self, stream: Stream) -> std::io::Result<(OwnedFd, Option<Receiver>)> {
        Ok(match self {
            Wire::Inherit => match stream {
                Stream::Stdout => (std::io::stdout().as_fd().try_clone_to_owned()?, None),
                Stream::Stderr => (std::io::stderr().as_fd().try_clone_to_owned()?, None),
            },
            Wire::Null => (File::options().write(true).open("/dev/null")?.into(), None),
            Wire::Pipe => {
                let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
                (writer, Some(Receiver::from_owned_fd(reader)?))
            }
        })
    }
}

/// The worker started from its local rank's spare, when `--prewarm` keeps spares and
/// one fits; why it starts cold instead is logged and counted.
async fn try_warm(
    spares: Option<&mut Spares>,
    cfg: &Config,
    local_rank: u32,
    overlay: &spare::Overlay,
    wires: [&Wire; 2],
) -> Option<(Child, [Option<Receiver>; 2])> {
    let spares = spares?;
    match start_warm(spares, cfg, local_rank, overlay, wires).await {
        Ok(started) => {
            spares.counted(true, "");
            Some(started)
        }
        Err(why) => {
            tracing::info!(local_rank, reason = %why, "starting the worker cold");
            spares.counted(false, &why);
            None
        }
    }
}

/// Starts worker `local_rank` from its spare, or says why it must start cold.
async fn start_warm(
    spares: &mut Spares,
    cfg: &Config,
    local_rank: u32,
    overlay: &spare::Overlay,
    wires: [&Wire; 2],
) -> Result<(Child, [Option<Receiver>; 2]), String> {
    let Some(mut spare) = spares.take(local_rank) else {
        return Err(spares.why_none());
    };
    loop {
        let (start, why) = spare::decide(Some(&spare.view()), overlay, spare::READY_PATIENCE);
        match start {
            Start::Warm => break,
            Start::Cold => return Err(why),
            Start::Wait(patience) => spare.settle(patience).await,
        }
    }
    let opened = |w: &Wire, stream| {
        w.descriptor(stream)
            .map_err(|e| format!("could not give the spare its output: {e}"))
    };
    let (stdout, out) = opened(wires[0], Stream::Stdout)?;
    let (stderr, err) = opened(wires[1], Stream::Stderr)?;
    let mut args = worker_args(cfg, local_rank);
    if args.first().is_some_and(|a| a == "-u") {
        args.remove(0);
    }
    let orders = spare::Orders {
        args,
        env: spare::environment(overlay),
        cwd: std::env::current_dir().map_err(|e| format!("no working directory: {e}"))?,
        stdout,
        stderr,
    };
    let child = spare
        .hand_off(orders)
        .await
        .map_err(|e| format!("the spare {e}"))?;
    Ok((child, [out, err]))
}

/// One rank's share of the attempt's log files.
struct StreamIo<'a> {
    files: Files,
    /// Its `stdout.log`, `stderr.log`, when its routes name them.
    opened: [Option<File>; 2],
    filtered: &'a [Option<Arc<File>>; 2],
}

impl StreamIo<'_> {
    /// What the worker's stdout and stderr are connected to, and the sinks of those that
    /// are pumped through the agent.
    fn wire(self, spec: &GroupSpec<'_>, local_rank: u32, rank: u32) -> [(Wire, Option<Sinks>); 2] {
        let logs = &spec.config.logs;
        let prefix = expand_prefix(
            &logs.prefix_template,
            &spec.config.role,
            local_rank,
            rank,
            spec.host,
        );
        let routes = files::routes(logs, local_rank, self.files);
        let [out_file, err_file] = self.opened;
        let wire_one = |i: usize, stream: Stream, file: Option<File>, filters: &Vec<String>| {
            let route = routes[i];
            // A redirected stream goes through the agent too: a worker that wrote straight
            // to its file died of ENOSPC when the log directory filled up (and its
            // traceback went to the same full disk); through the agent a full disk costs
            // lines in the file, never the worker.
            match file {
                // Console only and unprefixed (a rank that --local-ranks-filter keeps
                // included): the agent's own stream, as torchrun's workers have it (a
                // terminal stays a terminal: colours, progress bars, pdb).
                _ if route.console_only() && !logs.prefixed => {
                    return (Wire::Inherit, None);
                }
                _ if !route.file && !route.console && !route.filtered => {
                    return (Wire::Null, None);
                }
                _ => {}
            }
            let sinks = Sinks {
                console: route
                    .console
                    .then(|| (spec.console.clone(), stream, prefix.clone())),
                file: file.filter(|_| route.file).map(Arc::new),
                filters: filters.clone(),
                filtered: self.filtered[i].clone().filter(|_| route.filtered),
                disk: spec.console.disk().clone(),
                tail: None,
            };
            (Wire::Pipe, Some(sinks))
        };
        [
            wire_one(0, Stream::Stdout, out_file, &logs.stdout_filters),
            wire_one(1, Stream::Stderr, err_file, &logs.stderr_filters),
        ]
    }
}

/// A failed worker's error file, read on the log-file thread. One that cannot be read
/// within [`ERROR_FILE_PATIENCE`] is reported as such instead of stalling the summary.
async fn read_report(disk: &Disk, path: PathBuf) -> Option<ErrorReport> {
    match disk
        .call(ERROR_FILE_PATIENCE, move || read_error_file(&path))
        .await
    {
        Some(report) => report,
        None => Some(ErrorReport {
            message: format!(
                "(not read: the log directory did not answer within {} s)",
                ERROR_FILE_PATIENCE.as_secs()
            ),
            traceback: None,
        }),
    }
}
