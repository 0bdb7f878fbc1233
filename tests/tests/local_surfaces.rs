//! The progress socket is private to the agent's user whatever the umask, and a killed
//! agent's socket does not linger.
//!
//! One test per file on purpose: the test sets its own umask for a moment so that the
//! agent it spawns inherits it, which must not leak into other tests.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_tests::{Agent, AgentCmd, wait_for};
use nix::sys::stat::{Mode, umask};

const LIMIT: Duration = Duration::from_secs(60);

/// A worker that writes the progress socket's path where the test reads it, then waits
/// for the gate file.
fn reporting_worker(records: &Path) -> Vec<String> {
    let script = format!(
        "d={}; printf %s \"$FSDP_AGENT_PROGRESS\" > $d/path.tmp; mv $d/path.tmp $d/path; \
         while [ ! -f $d/gate ]; do sleep 0.05; done",
        records.display()
    );
    vec!["--no-python".into(), "/bin/sh".into(), "-c".into(), script]
}

/// An agent whose temporary directory is `tmp`, started under `umask 000`.
fn spawn_open_umask(tmp: &Path, records: &Path, name: &str) -> Agent {
    let cmd = AgentCmd::new(records, name)
        .env("TMPDIR", tmp)
        .args(["--standalone", "--nproc-per-node", "1"])
        .args(reporting_worker(records));
    let old = umask(Mode::empty());
    let agent = cmd.spawn();
    umask(old);
    agent
}

fn socket_path(agent: &Agent, records: &Path) -> PathBuf {
    let file = records.join("path");
    wait_for("the worker to write the socket's path", LIMIT, || {
        file.exists()
    });
    let path = PathBuf::from(std::fs::read_to_string(&file).unwrap());
    assert!(
        !path.as_os_str().is_empty(),
        "the worker got no FSDP_AGENT_PROGRESS\n{}",
        agent.output()
    );
    path
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn the_progress_socket_is_private_under_any_umask_and_a_killed_agents_is_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let first = tempfile::tempdir().unwrap();
    let mut agent = spawn_open_umask(tmp.path(), first.path(), "first");
    let socket = socket_path(&agent, first.path());
    let dir = socket.parent().unwrap().to_owned();
    assert!(
        std::fs::metadata(&socket).unwrap().file_type().is_socket(),
        "{}",
        socket.display()
    );
    assert_eq!(
        mode(&socket),
        0o600,
        "the socket under umask 000: {}",
        socket.display()
    );
    assert_eq!(mode(&dir), 0o700, "its directory: {}", dir.display());

    // SIGKILL: the agent cannot clean up; what it leaves is the precondition here.
    agent.signal(libc::SIGKILL);
    agent.wait(LIMIT);
    assert!(socket.exists(), "a SIGKILLed agent leaves its socket file");

    // The next agent on the host sweeps it, and keeps its own. The sweep runs in the
    // background (no start waits for it), so it is waited for.
    let second = tempfile::tempdir().unwrap();
    let mut next = spawn_open_umask(tmp.path(), second.path(), "second");
    let own = socket_path(&next, second.path());
    let end = std::time::Instant::now() + LIMIT;
    while dir.exists() && std::time::Instant::now() < end {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !dir.exists(),
        "the killed agent's socket directory lingers: {}\n{}",
        dir.display(),
        next.output()
    );
    assert!(own.exists());
    std::fs::write(second.path().join("gate"), "").unwrap();
    assert_eq!(next.code(), 0, "{}", next.output());
    assert!(!own.parent().unwrap().exists(), "a clean exit removes it");
}
