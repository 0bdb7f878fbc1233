//! Progress reports from workers: a Unix datagram socket, one short text message each.
//!
//! ```text
//! <rank> step <n> [<busy>]
//!                        a step finished; `busy`, if said: the seconds the rank worked in
//!                        it, not counting time blocked in collectives (what tells a
//!                        straggler, see [`crate::straggler`])
//! <rank> begin <phase>   a long phase starts (checkpoint, eval, ...)
//! <rank> end <phase>     it ended
//! <rank> begin finish    training is over (sent at the interpreter's exit by progress.py)
//! <rank> can save-on-warning
//!                        SIGUSR1 makes it save a checkpoint at the next step and stop
//!                        (fsdp-trainer with a --checkpoint_dir says so at its start)
//! <rank> can re-form-in-place
//!                        it bound its control socket (`FSDP_AGENT_CONTROL`): on a re-form
//!                        it keeps its process and takes the next round from the agent
//!                        ([`crate::control`])
//! <rank> reforming       it left its broken group and waits for the next round (a phase,
//!                        ended by `joined`)
//! <rank> joined <round> [memory|disk]
//!                        it joined the group of that round (under the round's rank) and
//!                        restored its state, from peer memory or (a fallback: a step was
//!                        not whole in memory) from the last checkpoint on disk
//! ```
//!
//! Datagrams keep a worker's cost to one `sendto` with no connection to hold, and a worker
//! whose agent is gone loses nothing but the message. The socket's path is in the
//! workers' `FSDP_AGENT_PROGRESS`; `examples/progress.py` is the ten-line helper.
//!
//! Only this user's processes may report: the socket is `progress` (mode 0600) inside a
//! directory of this agent's own (mode 0700), both set explicitly so that the umask cannot
//! open them to other users. The directory is made with `mkdir` (which fails on a name
//! that exists, so nobody can prepare it in advance) and is already 0700 or less when the
//! socket appears in it: there is no moment when another user could reach the socket.
//!
//! A SIGKILLed agent cannot remove its socket, so each agent, [`SWEEP_AFTER`] after its
//! start, sweeps the directories of dead agents ([`sweep`]) on a thread of its own:
//! housekeeping that no start waits for (with 1,000 agents on one host, each start's
//! sweep read every other agent's directory, a tenth of its CPU). "Dead" is asked of the
//! socket itself rather than of a pid:
//! connecting to a datagram socket that no process holds is refused, which is true in any
//! pid namespace and after the pid is reused, and never true for a live agent. A pid that
//! names another live process only spares the look (a reused pid keeps a dead agent's
//! directory while its new owner lives, never longer).

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UnixDatagram;
use tokio::task::AbortHandle;

/// The worker environment variable that names the socket.
pub const ENV: &str = "FSDP_AGENT_PROGRESS";
/// Step durations kept per rank for the automatic timeout.
const RECENT: usize = 20;
/// The name of an agent's socket directory starts so.
const DIR_PREFIX: &str = "fsdp-agent-progress-";
/// The socket's name in it.
const SOCKET: &str = "progress";

/// What one rank reported in the current group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankProgress {
    pub rank: u32,
    /// It reported anything at all (only then is it judged).
    pub reported: bool,
    pub last_report: Option<Instant>,
    /// The last step it finished, and when.
    pub last_step: Option<(u64, Instant)>,
    /// Durations of its recent steps, oldest first.
    pub recent: VecDeque<Duration>,
    /// Its own working time in its recent steps, as it said it, oldest first (the
    /// straggler's measure).
    pub busy: VecDeque<Duration>,
    /// The phase it is in, and since when.
    pub phase: Option<(String, Instant)>,
    /// It said a SIGUSR1 makes it save a checkpoint and stop (`can save-on-warning`).
    pub saves_on_warning: bool,
    /// It said it takes a new round in place (`can re-form-in-place`).
    pub reforms_in_place: bool,
    /// The last round whose group it said it joined (`joined <round>`).
    pub joined: Option<u64>,
    /// Where it restored its state from when it joined that round, if it said.
    pub restored: Option<Restored>,
}

/// Where a worker that re-formed in place restored its state from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// Peer memory: nothing read from disk, no step redone.
    Memory,
    /// The last checkpoint: no step was whole in memory (both copies of a part lost).
    Disk,
}

impl Restored {
    pub fn label(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Disk => "disk",
        }
    }
}

impl RankProgress {
    pub fn new(rank: u32) -> Self {
        Self {
            rank,
            reported: false,
            last_report: None,
            last_step: None,
            recent: VecDeque::new(),
            busy: VecDeque::new(),
            phase: None,
            saves_on_warning: false,
            reforms_in_place: false,
            joined: None,
            restored: None,
        }
    }

    /// The same worker under a new rank (a re-form in place): what it declared of itself
    /// stays true of the process; its progress starts over, as a new group's does.
    fn renamed(&self, rank: u32) -> Self {
        Self {
            saves_on_warning: self.saves_on_warning,
            reforms_in_place: self.reforms_in_place,
            ..Self::new(rank)
        }
    }

    fn heard(&mut self, at: Instant) {
        self.reported = true;
        self.last_report = Some(at);
    }

    pub fn step(&mut self, n: u64, busy: Option<Duration>, at: Instant) {
        self.heard(at);
        if let Some(b) = busy {
            if self.busy.len() == RECENT {
                self.busy.pop_front();
            }
            self.busy.push_back(b);
        }
        // A step's duration runs from the previous step or the end of a phase, whichever
        // is later: a checkpoint between two steps is not a slow step.
        if let Some((_, prev)) = self.last_step {
            if self.recent.len() == RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(at.saturating_duration_since(prev));
        }
        self.last_step = Some((n, at));
    }

    pub fn phase_begin(&mut self, name: &str, at: Instant) {
        self.heard(at);
        self.phase = Some((name.to_owned(), at));
    }

    /// It joined round `round`'s group: a sign of life (it is judged from now on, by the
    /// start-up allowance until its first step), and the end of its re-form.
    pub fn joined(&mut self, round: u64, restored: Option<Restored>, at: Instant) {
        self.heard(at);
        self.joined = Some(round);
        self.restored = restored;
        if self.phase.as_ref().is_some_and(|(p, _)| p == REFORMING) {
            self.phase = None;
        }
    }

    pub fn phase_end(&mut self, _name: &str, at: Instant) {
        self.heard(at);
        self.phase = None;
        // The next step is measured from here, not across the phase.
        if let Some((n, _)) = self.last_step {
            self.last_step = Some((n, at));
        }
    }
}

/// One parsed report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// A step finished, and how long the rank worked in it if it said.
    Step(u64, Option<Duration>),
    Begin(String),
    End(String),
    /// What the rank can do (a declaration, not progress: the hang judge ignores it).
    Can(String),
    /// It left its broken group to re-form in place.
    Reforming,
    /// It joined the group of this round, restoring from there.
    Joined(u64, Option<Restored>),
}

/// What a rank that saves on a warning declares.
pub const SAVES_ON_WARNING: &str = "save-on-warning";
/// What a rank that takes a new round in place declares.
pub const REFORMS_IN_PLACE: &str = "re-form-in-place";
/// The phase of a rank between its broken group and the next (`reforming`).
pub const REFORMING: &str = "reforming";

/// Parses `"<rank> step <n>"`, `"<rank> begin <phase>"`, `"<rank> end <phase>"`,
/// `"<rank> can <what>"`, `"<rank> reforming"`, `"<rank> joined <round>"`.
pub fn parse(text: &str) -> Option<(u32, Report)> {
    let mut words = text.split_whitespace();
    let rank = words.next()?.parse().ok()?;
    let kind = words.next()?;
    if kind == REFORMING {
        return Some((rank, Report::Reforming));
    }
    let arg = words.next()?;
    let report = match kind {
        "step" => Report::Step(
            arg.parse().ok()?,
            words
                .next()
                .and_then(|b| b.parse::<f64>().ok())
                .and_then(|b| Duration::try_from_secs_f64(b).ok()),
        ),
        "begin" => Report::Begin(arg.chars().take(64).collect()),
        "end" => Report::End(arg.chars().take(64).collect()),
        "can" => Report::Can(arg.chars().take(64).collect()),
        "joined" => Report::Joined(
            arg.parse().ok()?,
            match words.next() {
                Some("memory") => Some(Restored::Memory),
                Some("disk") => Some(Restored::Disk),
                _ => None,
            },
        ),
        _ => return None,
    };
    Some((rank, report))
}

/// Enters one report of rank `p` heard `now`.
fn enter(p: &mut RankProgress, report: Report, now: Instant) {
    match report {
        Report::Step(s, busy) => p.step(s, busy, now),
        Report::Begin(name) => p.phase_begin(&name, now),
        Report::End(name) => p.phase_end(&name, now),
        Report::Can(what) => match what.as_str() {
            SAVES_ON_WARNING => p.saves_on_warning = true,
            REFORMS_IN_PLACE => p.reforms_in_place = true,
            _ => {}
        },
        Report::Reforming => p.phase_begin(REFORMING, now),
        Report::Joined(round, from) => p.joined(round, from, now),
    }
}

type Ranks = Arc<Mutex<BTreeMap<u32, RankProgress>>>;

/// The agent's progress socket and what it heard, per rank of the current group.
pub struct Progress {
    path: PathBuf,
    ranks: Ranks,
    task: AbortHandle,
    /// The background sweep of dead agents' directories (how many it removed).
    sweeper: Option<std::thread::JoinHandle<usize>>,
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            // The workers' control sockets beside it (they bind them; nobody else removes
            // a killed worker's), or the directory stays.
            crate::control::remove_in(dir);
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A directory under `parent` that only this user can enter, made for this agent alone.
fn private_dir(parent: &Path) -> io::Result<PathBuf> {
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dir = parent.join(format!("{DIR_PREFIX}{}-{tag}", std::process::id()));
    // The umask can only take bits away from 0700; the explicit chmod then puts back an
    // owner bit a strange umask (0700) removed.
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// Removes the socket directories under `parent` that agents of user `uid` left behind
/// when they were killed; returns how many. A directory stays unless its socket is
/// there and refuses a connection (an agent between `mkdir` and `bind` has none yet).
/// One whose name's process id is another live process is passed over at the cost of
/// one signal-0 `kill`: with many agents on one host (1,000 in `bench/agents_scale.py`),
/// every agent's start otherwise tried every other agent's socket. One named with this
/// process's own id is not ours (ours has no socket yet) but an earlier process's that
/// had the same id: a restarted container's agent is pid 1 again, with `/tmp` on a volume
/// that outlived the last one. Its socket decides.
pub fn sweep(parent: &Path, uid: u32) -> usize {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return 0;
    };
    let own = std::process::id() as i32;
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        // Another pid namespace's agent may look dead by its pid here: the socket decides.
        if rest
            .split_once('-')
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
            .is_some_and(|pid| pid != own && process_exists(pid))
        {
            continue;
        }
        let dir = entry.path();
        // symlink_metadata: a link planted under the prefix is never followed.
        let ours = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        let socket = dir.join(SOCKET);
        if ours && abandoned(&socket) {
            let _ = std::fs::remove_file(&socket);
            crate::control::remove_in(&dir);
            if std::fs::remove_dir(&dir).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// How long after its start an agent sweeps: past its start and its first rendezvous, the
/// busiest seconds of a node, and of a host of many agents (1,000 on two cores in
/// `bench/agents_scale.py`, where each sweep reads every other agent's directory). An
/// agent that ends sooner leaves the sweep to the next one.
pub const SWEEP_AFTER: Duration = Duration::from_secs(5);

/// [`sweep`] on a thread of its own, `after` from now, so that no start waits for it. At
/// the normal priority: a thread at `SCHED_IDLE` that a busy machine never ran kept a
/// SIGKILLed agent's process, and with it the c10d store's port, alive until it ran (its
/// exit needs the CPU too), and the store host restarted in place found its own port
/// taken (the loaded suite's `a_store_host_restarted_in_place_brings_the_job_back`).
fn sweep_in_background(
    parent: PathBuf,
    uid: u32,
    after: Duration,
) -> Option<std::thread::JoinHandle<usize>> {
    let spawned = std::thread::Builder::new()
        .name("progress-sweep".into())
        .spawn(move || {
            std::thread::sleep(after);
            let swept = sweep(&parent, uid);
            if swept > 0 {
                tracing::debug!(swept, "removed the progress sockets of killed agents");
            }
            swept
        });
    spawned
        .inspect_err(|e| {
            tracing::debug!(error = %e, "no thread for the sweep of dead agents' sockets; leaving them");
        })
        .ok()
}

/// Whether a process with id `pid` exists (in this pid namespace).
fn process_exists(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(e) => e == nix::errno::Errno::EPERM,
    }
}

/// Whether the socket at `path` exists and no process holds it.
fn abandoned(path: &Path) -> bool {
    let Ok(probe) = std::os::unix::net::UnixDatagram::unbound() else {
        return false;
    };
    probe
        .connect(path)
        .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused)
}

impl Progress {
    /// Binds a socket in a private directory under `parent`, starts reading it, and
    /// sweeps the directories of dead agents in the background, [`SWEEP_AFTER`] later.
    pub fn start(parent: &Path) -> io::Result<Self> {
        Self::start_sweeping_after(parent, SWEEP_AFTER)
    }

    fn start_sweeping_after(parent: &Path, after: Duration) -> io::Result<Self> {
        let dir = private_dir(parent)?;
        // Our own directory says who we are (and its live socket keeps it from the sweep).
        let uid = std::fs::metadata(&dir)?.uid();
        let path = dir.join(SOCKET);
        let socket = match UnixDatagram::bind(&path) {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        // The directory already keeps others out; the mode says so on the socket too.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let sweeper = sweep_in_background(parent.to_owned(), uid, after);
        let ranks: Ranks = Arc::default();
        let heard = ranks.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 256];
            loop {
                let Ok(n) = socket.recv(&mut buf).await else {
                    continue;
                };
                let Some((rank, report)) = std::str::from_utf8(&buf[..n]).ok().and_then(parse)
                else {
                    continue;
                };
                let now = Instant::now();
                let mut ranks = heard.lock().unwrap_or_else(|p| p.into_inner());
                // Only the current group's ranks: a stale worker's report is not progress.
                let Some(p) = ranks.get_mut(&rank) else {
                    continue;
                };
                enter(p, report, now);
            }
        });
        Ok(Self {
            path,
            ranks,
            task: task.abort_handle(),
            sweeper,
        })
    }

    /// Waits for the background sweep; how many directories it removed (0 when it was
    /// waited for already, or had no thread).
    pub fn swept(&mut self) -> usize {
        self.sweeper.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new group with these global ranks: nothing heard yet.
    pub fn reset(&self, ranks: impl IntoIterator<Item = u32>) {
        let mut all = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        *all = ranks
            .into_iter()
            .map(|r| (r, RankProgress::new(r)))
            .collect();
    }

    /// The same workers under the ranks of a new round (a re-form in place), in order:
    /// the worker that was the group's lowest rank is the new lowest, and so on. What each
    /// declared of itself is kept (it said so once, at its start); everything else
    /// starts over, as for a new group.
    pub fn rerank(&self, ranks: impl IntoIterator<Item = u32>) {
        let mut all = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        let before: Vec<RankProgress> = all.values().cloned().collect();
        let mut old = before.iter();
        *all = ranks
            .into_iter()
            .map(|r| {
                let p = old
                    .next()
                    .map_or_else(|| RankProgress::new(r), |p| p.renamed(r));
                (r, p)
            })
            .collect();
    }

    /// What every rank of the group reported, by rank.
    pub fn snapshot(&self) -> Vec<RankProgress> {
        let all = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        all.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_parse_and_garbage_does_not() {
        assert_eq!(parse("3 step 12"), Some((3, Report::Step(12, None))));
        assert_eq!(
            parse("3 step 12 0.250000"),
            Some((3, Report::Step(12, Some(Duration::from_millis(250)))))
        );
        // A busy time that is no duration is not said at all; the step still counts.
        for bad in ["-1", "NaN", "inf", "x"] {
            assert_eq!(
                parse(&format!("3 step 12 {bad}")),
                Some((3, Report::Step(12, None)))
            );
        }
        assert_eq!(
            parse("0 begin checkpoint\n"),
            Some((0, Report::Begin("checkpoint".into())))
        );
        assert_eq!(
            parse("0 end checkpoint"),
            Some((0, Report::End("checkpoint".into())))
        );
        assert_eq!(
            parse("2 can save-on-warning"),
            Some((2, Report::Can(SAVES_ON_WARNING.into())))
        );
        for bad in [
            "",
            "x step 1",
            "1 step x",
            "1 leap 2",
            "1 step",
            "-1 step 2",
            "1 joined",
            "1 joined x",
            "1 joined -2",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_re_form_in_place_reports_parse_and_are_entered() {
        assert_eq!(
            parse("5 can re-form-in-place"),
            Some((5, Report::Can(REFORMS_IN_PLACE.into())))
        );
        assert_eq!(parse("5 joined 12\n"), Some((5, Report::Joined(12, None))));
        assert_eq!(
            parse("5 joined 12 disk"),
            Some((5, Report::Joined(12, Some(Restored::Disk))))
        );
        assert_eq!(
            parse("5 joined 12 memory"),
            Some((5, Report::Joined(12, Some(Restored::Memory))))
        );
        assert_eq!(parse("5 reforming"), Some((5, Report::Reforming)));
        assert_eq!(parse("5 reforming now"), Some((5, Report::Reforming)));
        let t0 = Instant::now();
        let mut p = RankProgress::new(5);
        enter(&mut p, Report::Can(REFORMS_IN_PLACE.into()), t0);
        assert!(p.reforms_in_place && !p.saves_on_warning);
        assert!(!p.reported, "a declaration is no progress");
        enter(&mut p, Report::Reforming, t0);
        assert_eq!(p.phase.as_ref().map(|(n, _)| n.as_str()), Some(REFORMING));
        enter(&mut p, Report::Joined(12, Some(Restored::Memory)), t0);
        assert_eq!(p.joined, Some(12));
        assert_eq!(p.phase, None, "joining ends the re-form");
        assert!(p.reported, "a joined rank is judged from now on");
        // Any other phase is the worker's own to end.
        enter(&mut p, Report::Begin("checkpoint".into()), t0);
        enter(&mut p, Report::Joined(13, None), t0);
        assert!(p.phase.is_some());
    }

    #[tokio::test]
    async fn a_reranked_group_keeps_what_its_workers_declared() {
        let progress = Progress::start(&std::env::temp_dir()).unwrap();
        progress.reset([4, 5]);
        let worker = std::os::unix::net::UnixDatagram::unbound().unwrap();
        for msg in [
            "4 can re-form-in-place",
            "5 can save-on-warning",
            "5 step 3",
        ] {
            worker.send_to(msg.as_bytes(), progress.path()).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        progress.rerank([0, 1]);
        let ranks = progress.snapshot();
        assert_eq!(ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), [0, 1]);
        assert!(ranks[0].reforms_in_place && !ranks[0].saves_on_warning);
        assert!(ranks[1].saves_on_warning && !ranks[1].reforms_in_place);
        assert_eq!(ranks[1].last_step, None, "progress starts over");
        worker.send_to(b"1 joined 7", progress.path()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(progress.snapshot()[1].joined, Some(7));
    }

    #[test]
    fn a_phase_is_not_counted_as_a_slow_step() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut p = RankProgress::new(0);
        p.step(1, None, t0);
        p.step(2, None, t0 + s);
        p.phase_begin("checkpoint", t0 + s);
        p.phase_end("checkpoint", t0 + 30 * s);
        p.step(3, None, t0 + 31 * s);
        assert_eq!(Vec::from(p.recent.clone()), [s, s]);
    }

    #[tokio::test]
    async fn reports_reach_the_group_s_ranks_only() {
        let progress = Progress::start(&std::env::temp_dir()).unwrap();
        progress.reset([4, 5]);
        let worker = std::os::unix::net::UnixDatagram::unbound().unwrap();
        for msg in ["4 step 1", "9 step 1", "5 begin eval", "junk"] {
            worker.send_to(msg.as_bytes(), progress.path()).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ranks = progress.snapshot();
        assert_eq!(ranks.len(), 2);
        assert_eq!(ranks[0].last_step.map(|(n, _)| n), Some(1));
        assert_eq!(
            ranks[1].phase.as_ref().map(|(n, _)| n.as_str()),
            Some("eval")
        );
        let path = progress.path().to_owned();
        drop(progress);
        assert!(!path.exists(), "the socket file is removed");
        assert!(!path.parent().unwrap().exists(), "and its directory");
    }

    #[tokio::test]
    async fn the_workers_control_sockets_go_with_the_directory() {
        let parent = tempfile::tempdir().unwrap();
        let progress = Progress::start(parent.path()).unwrap();
        let ctl = crate::control::path(progress.path(), 0).unwrap();
        // What a worker killed with its agent leaves.
        drop(std::os::unix::net::UnixDatagram::bind(&ctl).unwrap());
        let dir = progress.path().parent().unwrap().to_owned();
        drop(progress);
        assert!(!dir.exists(), "nothing is left behind");
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn the_socket_is_private_to_this_user() {
        let parent = tempfile::tempdir().unwrap();
        let progress = Progress::start(parent.path()).unwrap();
        assert_eq!(mode(progress.path()), 0o600);
        assert_eq!(mode(progress.path().parent().unwrap()), 0o700);
    }

    /// An agent's start sweeps, in the background, what a killed one left.
    #[tokio::test]
    async fn a_start_sweeps_a_killed_agents_directory_in_the_background() {
        let parent = tempfile::tempdir().unwrap();
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let dead = parent
            .path()
            .join(format!("{DIR_PREFIX}{}-dead", gone.id()));
        std::fs::create_dir(&dead).unwrap();
        drop(std::os::unix::net::UnixDatagram::bind(dead.join(SOCKET)).unwrap());
        let mut progress = Progress::start_sweeping_after(parent.path(), Duration::ZERO).unwrap();
        assert_eq!(progress.swept(), 1);
        assert!(!dead.exists());
        assert!(progress.path().exists(), "its own stays");
        assert_eq!(progress.swept(), 0, "waited for once");
    }

    /// A killed agent's socket is a file nobody holds; a live agent's is held.
    #[tokio::test]
    async fn the_sweep_removes_dead_agents_sockets_only() {
        let parent = tempfile::tempdir().unwrap();
        let dir = |name: String| {
            let d = parent.path().join(format!("{DIR_PREFIX}{name}"));
            std::fs::create_dir(&d).unwrap();
            d
        };
        // Under this process's id, holding its socket; its own sweep, in the background,
        // is over before the directories below are made (it found nothing to remove).
        let mut live = Progress::start_sweeping_after(parent.path(), Duration::ZERO).unwrap();
        assert_eq!(live.swept(), 0);
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let dead = dir(format!("{}-dead", gone.id()));
        drop(std::os::unix::net::UnixDatagram::bind(dead.join(SOCKET)).unwrap());
        assert!(dead.join(SOCKET).exists(), "what SIGKILL leaves behind");
        let starting = dir(format!("{}-starting", gone.id()));
        // Under a dead process's id (another pid namespace's agent), a held socket.
        let elsewhere = dir(format!("{}-elsewhere", gone.id()));
        let _held = std::os::unix::net::UnixDatagram::bind(elsewhere.join(SOCKET)).unwrap();
        // A live process's directory is passed over without a look at its socket (this
        // one's socket is what SIGKILL leaves, but its process lives).
        let mut sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let alive = dir(format!("{}-alive", sleeper.id()));
        drop(std::os::unix::net::UnixDatagram::bind(alive.join(SOCKET)).unwrap());
        // This process's own id on a directory that is not its own: an earlier process
        // that had the id (a restarted container's pid 1).
        let earlier = dir(format!("{}-earlier", std::process::id()));
        drop(std::os::unix::net::UnixDatagram::bind(earlier.join(SOCKET)).unwrap());
        let other = parent.path().join("someone-else");
        std::fs::create_dir(&other).unwrap();
        drop(std::os::unix::net::UnixDatagram::bind(other.join(SOCKET)).unwrap());

        let uid = std::fs::metadata(parent.path()).unwrap().uid();
        assert_eq!(sweep(parent.path(), uid + 1), 0, "another user's");
        assert!(dead.exists());
        assert_eq!(sweep(parent.path(), uid), 2);
        assert!(!dead.exists());
        assert!(
            !earlier.exists(),
            "an earlier process's, under this one's id"
        );
        assert!(live.path().exists(), "a live agent's socket stays");
        assert!(
            starting.exists(),
            "no socket yet: maybe an agent about to bind"
        );
        assert!(elsewhere.join(SOCKET).exists(), "held, whatever its pid");
        assert!(other.join(SOCKET).exists(), "not ours by name");
        assert!(alive.join(SOCKET).exists(), "its process lives");
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
    }
}
