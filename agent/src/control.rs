//! The agent's word to a worker that re-forms in place: a Unix datagram socket per local
//! rank, named in the worker's `FSDP_AGENT_CONTROL`, that the worker binds and the agent
//! only sends to.
//!
//! A worker that survives a re-form keeps its process (its CUDA context, its model, its
//! imports) and needs only what torchrun would have given a fresh one: the per-round
//! variables of its environment, which a running process cannot have set again. The agent
//! sends them as one ASCII datagram:
//!
//! ```text
//! round <number> RANK=<r> LOCAL_RANK=<l> GROUP_RANK=<g> ROLE_RANK=<r> LOCAL_WORLD_SIZE=<n>
//!   WORLD_SIZE=<w> GROUP_WORLD_SIZE=<gw> ROLE_WORLD_SIZE=<w> MASTER_ADDR=<addr>
//!   MASTER_PORT=<port> TORCHELASTIC_RESTART_COUNT=<c>
//! ```
//!
//! (one line), the values those a fresh worker of that round would get
//! ([`crate::supervisor::worker_overlay`], not computed twice). The worker answers on the
//! progress socket ([`crate::hang::progress`]): `can re-form-in-place` once it bound its
//! socket, `joined <number>` once it joined that round's group.
//!
//! The socket lives beside the progress socket, in the agent's private directory (mode
//! 0700: only this user's processes can bind or send there), and is only offered when
//! progress is watched: without the progress socket no worker could say it joined.
//! Datagrams, like progress reports: nothing to connect, and a worker that never bound
//! its socket refuses the send at once, which is the answer "not in place".

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_rendezvous::Round;

use crate::config::Config;
use crate::supervisor::{Channels, worker_overlay};

/// The worker environment variable that names the socket.
pub const ENV: &str = "FSDP_AGENT_CONTROL";

/// The variables a round's datagram carries, in its order: those of torchrun's worker
/// environment that change from round to round, and the local ones a worker checks them
/// against (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`).
pub const ROUND_VARS: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
];

/// The longest socket path `bind` takes: `sun_path` is 108 bytes with its NUL.
const SUN_PATH_MAX: usize = 107;

/// What the long name adds to the progress socket's path: `<progress>.ctl<local rank>`.
const LONG_INFIX: &str = ".ctl";
/// The short name in the same directory, for a long temporary directory: `c<local rank>`.
const SHORT_PREFIX: &str = "c";

/// The control socket of `local_rank`, beside the progress socket at `progress`:
/// `<progress>.ctl<local_rank>`, or `<its directory>/c<local_rank>` when that name is too
/// long for a socket (a long `TMPDIR`). `None` when neither fits: that worker is then
/// never offered a control socket, and is restarted on a re-form as before.
pub fn path(progress: &Path, local_rank: u32) -> Option<PathBuf> {
    let mut long = progress.as_os_str().to_owned();
    long.push(format!("{LONG_INFIX}{local_rank}"));
    let long = PathBuf::from(long);
    if fits(&long) {
        return Some(long);
    }
    let short = progress
        .parent()?
        .join(format!("{SHORT_PREFIX}{local_rank}"));
    fits(&short).then_some(short)
}

fn fits(p: &Path) -> bool {
    p.as_os_str().len() <= SUN_PATH_MAX
}

/// Whether `name`, in the progress socket's directory, is a control socket's (either
/// form of [`path`]).
fn is_control(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    name.split_once(LONG_INFIX).is_some_and(|(_, n)| digits(n))
        || name.strip_prefix(SHORT_PREFIX).is_some_and(digits)
}

/// Removes the control sockets of local ranks `0..nproc` beside `progress`, if they exist.
/// A worker binds its own: one left by an earlier worker of the same local rank would make
/// the new worker's `bind` fail (`EADDRINUSE`), and that worker could never re-form in
/// place.
pub fn remove(progress: &Path, nproc: u32) {
    for local_rank in 0..nproc {
        if let Some(p) = path(progress, local_rank) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Removes every control socket in `dir` (the progress socket's directory), so that the
/// directory itself can go.
pub fn remove_in(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(is_control) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The datagram of round `number` from a worker's environment `overlay` (the round's
/// [`worker_overlay`] of that worker): `round <number>` and [`ROUND_VARS`] as `KEY=VALUE`.
pub fn message(number: u64, overlay: &[(String, Option<String>)]) -> String {
    let mut text = format!("round {number}");
    for key in ROUND_VARS {
        // The overlay's last word on a variable is the one a fresh worker would see.
        let value = overlay
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.as_deref())
            .unwrap_or_default();
        text.push_str(&format!(" {key}={value}"));
    }
    text
}

/// The datagram worker `local_rank` gets for `round`: exactly what a fresh worker of that
/// round would have in its environment.
pub fn round_message(cfg: &Config, round: &Round, local_rank: u32) -> String {
    let overlay = worker_overlay(cfg, round, local_rank, None, Channels::default());
    message(round.number, &overlay)
}

/// How often a send finding the worker's queue full is tried, and the pause between.
const SEND_TRIES: u32 = 5;
const SEND_PAUSE: Duration = Duration::from_millis(5);

/// Sends `text` to the control socket at `to`, without blocking the loop. A full queue
/// (the worker reads it only between steps) is tried again a few times; any other error
/// (no socket there: the worker never bound it, or exited) is returned at once.
pub async fn send(to: &Path, text: &str) -> io::Result<()> {
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    socket.set_nonblocking(true)?;
    let mut tries = 0;
    loop {
        match socket.send_to(text.as_bytes(), to) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && tries + 1 < SEND_TRIES => {
                tries += 1;
                tokio::time::sleep(SEND_PAUSE).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    /// `nproc` workers per node, progress watched (the default).
    fn cfg(nproc: u32) -> Config {
        let argv: Vec<std::ffi::OsString> = [
            "fsdp-agent",
            "--standalone",
            "--nproc-per-node",
            &nproc.to_string(),
            "--no-python",
            "/bin/true",
        ]
        .map(Into::into)
        .into();
        config::resolve(argv, &|_| None).unwrap_or_else(|e| panic!("config: {e:?}"))
    }

    /// Round 3 seen from the second of two nodes of four workers each.
    fn second_node() -> Round {
        Round {
            number: 3,
            group_rank: 1,
            group_world_size: 2,
            base_rank: 4,
            world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 29_511,
            restart_count: 2,
            members: Vec::new().into(),
            reason: String::new(),
            charged_at_ms: Vec::new(),
            sealed_at_ms: 0,
            broken: None,
        }
    }

    #[test]
    fn the_datagram_carries_exactly_the_fresh_workers_round_values() {
        let cfg = cfg(4);
        let round = second_node();
        let text = round_message(&cfg, &round, 1);
        assert_eq!(
            text,
            "round 3 RANK=5 LOCAL_RANK=1 GROUP_RANK=1 ROLE_RANK=5 LOCAL_WORLD_SIZE=4 \
             WORLD_SIZE=8 GROUP_WORLD_SIZE=2 ROLE_WORLD_SIZE=8 MASTER_ADDR=10.0.0.1 \
             MASTER_PORT=29511 TORCHELASTIC_RESTART_COUNT=2"
        );
        // Word for word what the environment of a worker spawned in that round says.
        let env = worker_overlay(&cfg, &round, 1, None, Channels::default());
        for word in text.split(' ').skip(2) {
            let (k, v) = word.split_once('=').unwrap();
            let spawned = env.iter().rev().find(|(n, _)| n == k).unwrap();
            assert_eq!(spawned.1.as_deref(), Some(v), "{k}");
        }
    }

    #[test]
    fn a_watched_worker_is_offered_its_own_control_socket() {
        let cfg = cfg(2);
        let round = second_node();
        let progress = Path::new("/tmp/fsdp-agent-progress-1-abcd/progress");
        let channels = Channels {
            progress: Some(progress),
            timer_file: None,
        };
        let env_of = |local_rank, channels| {
            worker_overlay(&cfg, &round, local_rank, None, channels)
                .into_iter()
                .find(|(k, _)| k == ENV)
                .and_then(|(_, v)| v)
        };
        assert_eq!(
            env_of(1, channels).as_deref(),
            Some("/tmp/fsdp-agent-progress-1-abcd/progress.ctl1")
        );
        assert_eq!(
            env_of(0, channels).as_deref(),
            Some("/tmp/fsdp-agent-progress-1-abcd/progress.ctl0")
        );
        assert_eq!(env_of(0, Channels::default()), None, "progress not watched");
    }

    #[test]
    fn a_long_directory_gets_the_short_name_and_a_too_long_one_none() {
        let dir = format!("/{}", "d".repeat(95));
        let progress = Path::new(&dir).join("progress");
        // 96 + 9 + 6 bytes: the long name does not fit, the short one (96 + 4) does.
        assert_eq!(path(&progress, 12), Some(Path::new(&dir).join("c12")));
        let deep = format!("/{}", "d".repeat(104));
        assert_eq!(path(&Path::new(&deep).join("progress"), 3), None);
        for name in ["progress.ctl0", "progress.ctl17", "c3"] {
            assert!(is_control(name), "{name}");
        }
        for name in ["progress", "progress.ctl", "c", "cx", "other"] {
            assert!(!is_control(name), "{name}");
        }
    }

    #[tokio::test]
    async fn a_bound_socket_takes_the_round_and_a_missing_one_refuses_it() {
        let dir = tempfile::tempdir().unwrap();
        let progress = dir.path().join("progress");
        let at = path(&progress, 0).unwrap();
        let err = send(&at, "round 1").await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "never bound");
        let worker = std::os::unix::net::UnixDatagram::bind(&at).unwrap();
        send(&at, "round 1 RANK=0").await.unwrap();
        let mut buf = [0u8; 64];
        let n = worker.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"round 1 RANK=0");
        drop(worker);
        let err = send(&at, "round 2").await.unwrap_err();
        assert_eq!(
            err.kind(),
            io::ErrorKind::ConnectionRefused,
            "a worker that exited leaves its file"
        );
        remove(&progress, 2);
        assert!(!at.exists());
    }
}
