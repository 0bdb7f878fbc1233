//! Pre-warmed workers (`--prewarm`): one spare interpreter per local rank that has already
//! imported the slow modules (torch) and waits; at a group start it is handed the round's
//! environment, arguments, working directory and output descriptors and runs the script
//! as `__main__` (`spare.py`), so a re-form does not wait for `import torch`.
//!
//! A spare is started by the same code path as a cold worker ([`super::unix::prepare`]:
//! its own session and process group, SIGKILL on the agent's death), with the environment
//! a cold worker of this local rank gets minus the per-round variables ([`PER_ROUND`]):
//! those are the only ones allowed to differ at the handoff. Whether a start is warm is
//! [`decide`], a pure function; [`Spares`] keeps the pool and counts.

use std::ffi::OsString;
use std::io::IoSlice;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::signal::Signal;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use super::unix;
use crate::reaper;

/// The `-c` program of a spare: runs `spare.py`, read from the descriptor `{fd}` (a memfd
/// the agent fills once), in a namespace of its own, binding no name in `__main__`. The
/// source stays off the command line, so `ps` shows a short one.
fn launcher(fd: RawFd) -> String {
    // pread, not open(): a file object left to the collector warns (ResourceWarning), and
    // even an ignored warning leaves `__warningregistry__` in `__main__`.
    let len = SOURCE.len();
    format!(
        "exec(compile(__import__('os').pread({fd},{len},0),'<fsdp-agent spare>','exec'),{{'__name__':'fsdp_agent_spare'}})"
    )
}
const SOURCE: &str = include_str!("spare.py");

/// `spare.py` in an anonymous in-memory file, shared by every spare of this agent
/// (close-on-exec here; each spare inherits it at the same number).
///
/// Sealed read-only before any spare can read it: the file is reachable as
/// `/proc/<agent>/fd/N` to every process of the same user, and without the seals one of
/// them could open it for writing and have the next spare run its code. A memfd created
/// without `MFD_ALLOW_SEALING` carries only `F_SEAL_SEAL`, which forbids adding the seals
/// that matter, hence the flag.
fn source_fd() -> std::io::Result<RawFd> {
    static SOURCE_FD: OnceLock<OwnedFd> = OnceLock::new();
    if let Some(fd) = SOURCE_FD.get() {
        return Ok(fd.as_raw_fd());
    }
    let fd = memfd_create(
        c"fsdp-agent-spare.py",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    std::fs::File::from(fd.try_clone()?).write_all(SOURCE.as_bytes())?;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(SOURCE_SEALS))?;
    Ok(SOURCE_FD.get_or_init(|| fd).as_raw_fd())
}

/// No writes, no size change, and no change to the seals themselves.
const SOURCE_SEALS: SealFlag = SealFlag::F_SEAL_WRITE
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SHRINK)
    .union(SealFlag::F_SEAL_SEAL);

/// How long a start waits for a spare that is still importing: it is further along than a
/// cold start would be, unless its import hangs.
pub const READY_PATIENCE: Duration = Duration::from_secs(30);
/// How long a handoff waits for the spare to confirm its orders.
const ACK_PATIENCE: Duration = Duration::from_secs(5);
/// Orders larger than this (an enormous environment) go to a cold start.
const MAX_ORDERS: usize = 16 << 20;

/// Variables that change from round to round: a spare starts without them and gets them
/// with its orders. Every other variable must be what the spare was started with.
pub const PER_ROUND: &[&str] = &[
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    crate::hang::progress::ENV,
    crate::control::ENV,
    crate::hang::file_timer::FILE,
];

/// Changes to the agent's environment for one process: `Some` sets, `None` removes.
pub type Overlay = Vec<(String, Option<String>)>;

/// Where a spare is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Importing,
    Ready,
    /// It could not import the modules (or run this entrypoint warm), in its words.
    Failed(String),
    /// It exited (or closed its socket) before its orders.
    Gone(String),
}

/// What a start knows of the spare for its local rank.
#[derive(Debug, Clone)]
pub struct SpareView<'a> {
    pub readiness: Readiness,
    /// Since the spare was started.
    pub age: Duration,
    pub overlay: &'a Overlay,
}

/// How a worker starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    Warm,
    /// Wait at most this long for the spare to finish importing, then decide again.
    Wait(Duration),
    Cold,
}

/// Warm, wait or cold for one worker, and why. `round` is the overlay the worker needs.
pub fn decide(
    spare: Option<&SpareView<'_>>,
    round: &Overlay,
    patience: Duration,
) -> (Start, String) {
    let Some(s) = spare else {
        return (Start::Cold, "no spare".into());
    };
    match &s.readiness {
        Readiness::Failed(why) => return (Start::Cold, format!("the spare failed: {why}")),
        Readiness::Gone(how) => return (Start::Cold, format!("the spare {how}")),
        Readiness::Importing if s.age >= patience => {
            return (
                Start::Cold,
                format!(
                    "the spare was still importing after {:.0} s",
                    s.age.as_secs_f64()
                ),
            );
        }
        Readiness::Importing | Readiness::Ready => {}
    }
    if let Some(diff) = mismatch(s.overlay, round) {
        return (Start::Cold, format!("the spare was started with {diff}"));
    }
    match s.readiness {
        Readiness::Importing => (
            Start::Wait(patience - s.age),
            "the spare is still importing".into(),
        ),
        _ => (Start::Warm, "the spare is ready".into()),
    }
}

/// The first variable outside [`PER_ROUND`] that the spare has and the round would not
/// give it, in words.
fn mismatch(spare: &Overlay, round: &Overlay) -> Option<String> {
    let per_round = |k: &str| PER_ROUND.contains(&k);
    let value = |o: &Overlay, k: &str| o.iter().rev().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let shown = |v: Option<Option<String>>| match v {
        Some(Some(v)) => format!("={v}"),
        Some(None) => " removed".into(),
        None => " as the agent has it".into(),
    };
    spare
        .iter()
        .chain(round.iter())
        .map(|(k, _)| k.as_str())
        .filter(|k| !per_round(k))
        .find(|k| value(spare, k) != value(round, k))
        .map(|k| {
            format!(
                "{k}{}, the round needs {k}{}",
                shown(value(spare, k)),
                shown(value(round, k))
            )
        })
}

/// What a spare is told to become.
pub struct Orders {
    /// The interpreter's arguments after `-u`, as a cold start has them.
    pub args: Vec<String>,
    pub env: Vec<(OsString, OsString)>,
    pub cwd: PathBuf,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// A started spare.
pub struct Spare {
    child: Option<Child>,
    pid: u32,
    sock: UnixStream,
    overlay: Overlay,
    started: Instant,
    readiness: Readiness,
}

impl Drop for Spare {
    fn drop(&mut self) {
        if self.child.is_some() {
            unix::signal_group(self.pid, Signal::SIGKILL);
            reaper::unregister(self.pid);
        }
    }
}

impl Spare {
    /// Starts the spare for a worker whose cold command is `program args` (`args[0]` is
    /// `-u`), with `overlay` over the agent's environment.
    pub fn spawn(
        program: &std::path::Path,
        args: &[String],
        modules: &str,
        overlay: Overlay,
    ) -> std::io::Result<Self> {
        let (mine, theirs) = std::os::unix::net::UnixStream::pair()?;
        mine.set_nonblocking(true)?;
        let fd = theirs.as_raw_fd();
        let source = source_fd()?;
        let mut cmd = Command::new(program);
        cmd.args(["-u", "-c", &launcher(source), &source.to_string()])
            .args([&fd.to_string(), modules])
            .args(args.iter().skip(1))
            .stdin(Stdio::inherit())
            // Until its orders: what the pre-imports print is not any round's output.
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in &overlay {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        unix::prepare(&mut cmd);
        unix::inherit_fd(&mut cmd, fd);
        unix::inherit_fd(&mut cmd, source);
        let child = cmd.spawn()?;
        let pid = child.id().unwrap_or(0);
        reaper::register(pid);
        drop(theirs);
        Ok(Self {
            child: Some(child),
            pid,
            sock: UnixStream::from_std(mine)?,
            overlay,
            started: Instant::now(),
            readiness: Readiness::Importing,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// What is known of it now, without waiting.
    pub fn view(&mut self) -> SpareView<'_> {
        self.poll();
        SpareView {
            readiness: self.readiness.clone(),
            age: self.started.elapsed(),
            overlay: &self.overlay,
        }
    }

    /// Reads what the spare said so far and whether it still lives.
    fn poll(&mut self) {
        if self.readiness == Readiness::Importing {
            let mut b = [0u8; 1];
            match self.sock.try_read(&mut b) {
                Ok(1) if b[0] == b'R' => self.readiness = Readiness::Ready,
                Ok(1) if b[0] == b'E' => self.readiness = Readiness::Failed(self.rest()),
                Ok(_) => self.readiness = Readiness::Gone("closed its socket".into()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => self.readiness = Readiness::Gone(format!("could not be read: {e}")),
            }
        }
        if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
            if !matches!(self.readiness, Readiness::Failed(_)) {
                let exit = crate::failure::WorkerExit::from_status(status);
                self.readiness = Readiness::Gone(format!("exited ({exit})"));
            }
        }
    }

    /// The rest of a failure message (the spare closes its socket right after it).
    fn rest(&mut self) -> String {
        let mut msg = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = self.sock.try_read(&mut buf) {
            msg.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&msg).into_owned()
    }

    /// Waits until it is ready, gone, or `patience` has passed.
    pub async fn settle(&mut self, patience: Duration) {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            self.poll();
            if self.readiness != Readiness::Importing {
                return;
            }
            let readable = self.sock.ready(Interest::READABLE);
            if tokio::time::timeout_at(deadline, readable).await.is_err() {
                return;
            }
            // A spare that exits without a word makes the socket readable (EOF) too.
        }
    }

    /// Hands the spare its orders; on success it is the worker, this its process.
    pub async fn hand_off(mut self, orders: Orders) -> Result<Child, String> {
        let body = encode(&orders);
        if body.len() > MAX_ORDERS {
            return Err(format!("its orders are {} bytes", body.len()));
        }
        let mut msg = (body.len() as u64).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        let fds = [orders.stdout.as_raw_fd(), orders.stderr.as_raw_fd()];
        let sent = self
            .sock
            .async_io(Interest::WRITABLE, || {
                let cmsg = [ControlMessage::ScmRights(&fds)];
                sendmsg::<()>(
                    self.sock.as_raw_fd(),
                    &[IoSlice::new(&msg)],
                    &cmsg,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            })
            .await
            .map_err(|e| format!("could not be given its orders: {e}"))?;
        self.sock
            .write_all(&msg[sent..])
            .await
            .map_err(|e| format!("could not be given its orders: {e}"))?;
        // Ours: the spare has its own copies now.
        drop(orders);
        let mut ack = [0u8; 1];
        match tokio::time::timeout(ACK_PATIENCE, self.sock.read(&mut ack)).await {
            Ok(Ok(1)) if ack[0] == b'G' => {}
            Ok(Ok(_)) => return Err("closed its socket instead of starting".into()),
            Ok(Err(e)) => return Err(format!("did not confirm its orders: {e}")),
            Err(_) => {
                return Err(format!(
                    "did not confirm its orders within {} s",
                    ACK_PATIENCE.as_secs()
                ));
            }
        }
        Ok(self.child.take().expect("a spare is handed off once"))
    }
}

/// `argc, argv..., envc, KEY=VALUE..., cwd`, NUL-separated (none of them can hold a NUL).
fn encode(o: &Orders) -> Vec<u8> {
    let mut fields: Vec<Vec<u8>> = Vec::new();
    fields.push(o.args.len().to_string().into_bytes());
    fields.extend(o.args.iter().map(|a| a.as_bytes().to_vec()));
    fields.push(o.env.len().to_string().into_bytes());
    fields.extend(o.env.iter().map(|(k, v)| {
        let mut kv = k.as_bytes().to_vec();
        kv.push(b'=');
        kv.extend_from_slice(v.as_bytes());
        kv
    }));
    fields.push(o.cwd.as_os_str().as_bytes().to_vec());
    fields.join(&0u8)
}

/// The environment a process started with `overlay` over the agent's own would have.
pub fn environment(overlay: &Overlay) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    for (k, v) in overlay {
        env.retain(|(n, _)| n.as_os_str() != std::ffi::OsStr::new(k));
        if let Some(v) = v {
            env.push((k.into(), v.into()));
        }
    }
    env
}

/// The spares of one agent, one slot per local rank, and how the starts went.
pub struct Spares {
    modules: String,
    slots: Vec<Option<Spare>>,
    /// Why no more spares are started (their import failed), once known.
    off: Option<String>,
    pub warm: u32,
    pub cold: u32,
    /// Why the last cold start was cold.
    pub last_cold: String,
}

impl Spares {
    pub fn new(modules: &[String], nproc_per_node: u32) -> Self {
        Self {
            modules: modules.join(","),
            slots: (0..nproc_per_node).map(|_| None).collect(),
            off: None,
            warm: 0,
            cold: 0,
            last_cold: String::new(),
        }
    }

    /// Starts a spare in every empty slot. `command(local_rank)` is the program, the cold
    /// arguments and the spare's overlay.
    pub fn fill(&mut self, command: impl Fn(u32) -> (PathBuf, Vec<String>, Overlay)) {
        if self.off.is_some() {
            return;
        }
        for (local_rank, slot) in self.slots.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let (program, args, overlay) = command(local_rank as u32);
            match Spare::spawn(&program, &args, &self.modules, overlay) {
                Ok(s) => {
                    tracing::debug!(local_rank, pid = s.pid(), "spare started");
                    *slot = Some(s);
                }
                Err(e) => {
                    tracing::warn!(local_rank, error = %e, "could not start a spare; the next start of this rank is cold");
                }
            }
        }
    }

    /// Why a rank has no spare.
    pub fn why_none(&self) -> String {
        match &self.off {
            Some(why) => format!("pre-warming is off ({why})"),
            None => "no spare was started for it".into(),
        }
    }

    /// The spare of `local_rank`, if there is one.
    pub fn take(&mut self, local_rank: u32) -> Option<Spare> {
        self.slots.get_mut(local_rank as usize)?.take()
    }

    /// Records a start; a spare that could not import turns pre-warming off for the run.
    pub fn counted(&mut self, warm: bool, why: &str) {
        if warm {
            self.warm += 1;
            return;
        }
        self.cold += 1;
        self.last_cold = why.to_owned();
        if why.starts_with("the spare failed") && self.off.is_none() {
            tracing::warn!(
                reason = why,
                "--prewarm: no more spares; workers start cold"
            );
            self.off = Some(why.to_owned());
        }
    }
}

#[cfg(test)]
mod tests;
