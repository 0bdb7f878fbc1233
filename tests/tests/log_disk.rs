//! A worker log directory that stops answering (a hung NFS mount, a stalled volume) must
//! never cost the agent its etcd lease: the lease is kept alive on the same thread that
//! supervises the workers, so no file-system call may block there.
//!
//! A hung mount cannot be built without privileges, so the stall here is a FIFO that
//! nobody writes: a worker turns its `TORCHELASTIC_ERROR_FILE` into one and fails. Opening
//! it for reading blocks forever, the way a read from a hung mount does. Everything the
//! agent does in the log directory afterwards (reading the error file, emptying and
//! creating the next attempt's directory, opening its log files) goes to the same stuck
//! place.

use std::path::Path;
use std::time::{Duration, Instant};

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, TempDir};

const LIMIT: Duration = Duration::from_secs(90);
const CONF: &str = "last_call_timeout=0.2,keep_alive_ttl=2,straggler_timeout=5";

fn agent(dir: &Path, etcd: &Etcd, name: &str, script: &str) -> Agent {
    AgentCmd::new(dir, name)
        .args([
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            "logdisk",
            "--rdzv-conf",
            CONF,
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "3",
            "--term-timeout",
            "5",
            "--tee",
            "3",
            "--log-dir",
        ])
        .arg_path(dir.join("logs"))
        .args(["--no-python", "/bin/sh", "-c", script])
        .spawn()
}

/// The node lost its lease: the other node saw it leave the group.
fn lost_a_member(b: &Agent) -> bool {
    // How a lost member is said (`Change::MemberLost` in words).
    b.stderr().contains("left the group")
}

/// Polls `cond` until it holds, failing at once if `b` saw a member lost.
fn until(a: &Agent, b: &Agent, what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + LIMIT;
    while !cond() {
        assert!(
            !lost_a_member(b),
            "node b saw node a leave while waiting for {what}: a blocked its runtime on the \
             log directory and lost its lease\n--- a\n{}\n--- b\n{}",
            a.output(),
            b.output()
        );
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}\n--- a\n{}\n--- b\n{}",
            a.output(),
            b.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stuck_log_directory_does_not_cost_the_lease() {
    let etcd = Etcd::start();
    let (dir_a, dir_b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    // Attempt 0 of node a fails with its error file a FIFO that nobody will ever write.
    let stuck = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                 mkfifo \"$TORCHELASTIC_ERROR_FILE\"; echo failing; exit 1; fi; \
                 echo running; exec sleep 600";
    let mut a = agent(dir_a.path(), &etcd, "a", stuck);
    let mut b = agent(dir_b.path(), &etcd, "b", "echo running; exec sleep 600");

    // Node a reports its failure (with the error file unread), and both nodes restart
    // together: b re-forms because a peer failed, never because a vanished.
    until(&a, &b, "node a's failure summary", || {
        a.stderr().contains("FAILED (attempt 0)")
    });
    until(&a, &b, "both nodes in the restarted group", || {
        a.stderr()
            .lines()
            .chain(b.stderr().lines())
            .filter(|l| l.contains("group formed") && l.contains("restart_count=1"))
            .count()
            >= 2
    });
    // The next attempt's directory sits behind the stuck read: a starts its workers
    // without log files once it gave up waiting, and keeps its place in the group.
    until(&a, &b, "node a's restarted workers", || {
        a.stderr().matches("workers started").count() >= 2
    });
    assert!(
        a.stderr().contains("did not respond"),
        "no warning about the log directory\n{}",
        a.output()
    );
    until(
        &a,
        &b,
        "the restarted worker's output on node a's console",
        || a.stdout().matches("running").count() >= 1,
    );
    // A few lease TTLs more with the log directory still stuck.
    let settle = Instant::now() + Duration::from_secs(6);
    until(&a, &b, "a few lease TTLs", || Instant::now() > settle);
    for agent in [&a, &b] {
        assert!(
            !agent.stderr().contains("lease expired"),
            "{}",
            agent.output()
        );
    }

    // Both still stop cleanly; a's exit does not wait on the stuck directory.
    for agent in [&mut a, &mut b] {
        agent.signal(libc::SIGTERM);
        assert_eq!(agent.code(), 143, "{}", agent.output());
    }
}
