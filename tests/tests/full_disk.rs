//! A full filesystem on one node. With `--redirects 3` into a full log
//! directory the worker died of ENOSPC on its stdout, was restarted until the job's budget
//! was spent (3 of 3 in 9 s, every rank each time), and the machine was quarantined for an
//! hour; the agents said `exit code 1`, the traceback went to the full disk. Now a full
//! log directory costs lines in the files, never the worker; and a worker that fails
//! because this node's working directory is full takes the node out as unhealthy (exit
//! 79, the filesystem named) without charging the job, whose other node goes on.
//!
//! Real agents and a real full filesystem: a tmpfs of 1 MiB, mounted by the test (root).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{AgentCmd, TempDir, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

/// A 1 MiB tmpfs at `dir/name`, unmounted when dropped.
struct Tiny(PathBuf);

impl Tiny {
    fn mount(dir: &Path, name: &str) -> Self {
        let at = dir.join(name);
        std::fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(&at)
            .status()
            .expect("mount")
            .success();
        assert!(ok, "mounting a tmpfs needs root (as CI has)");
        Self(at)
    }
}

impl Drop for Tiny {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A standalone agent whose worker runs `script`, its output redirected into a log
/// directory on a 1 MiB tmpfs, run to its end (dropped in this order: the agent, the
/// mount, the directory).
fn redirected_into_tiny_logs(script: &str) -> (TempDir, Tiny, fsdp_tests::Agent) {
    let dir = TempDir::new().unwrap();
    let tiny = Tiny::mount(dir.path(), "logs");
    let a = AgentCmd::new(dir.path(), "a")
        .args(["--standalone", "--nproc-per-node", "1"])
        .args(["--max-restarts", "3", "--redirects", "3", "--log-dir"])
        .arg_path(&tiny.0)
        .args(["--no-python", "/bin/sh", "-c", script])
        .run(LIMIT);
    (dir, tiny, a)
}

#[test]
fn a_full_log_directory_costs_lines_in_the_files_never_the_worker() {
    // 3 MB of output into 1 MiB: the file fills a third of the way through.
    let (_dir, _tiny, mut a) =
        redirected_into_tiny_logs("yes 'a line of training output' | head -c 3000000");
    assert_eq!(a.code(), 0, "{}", a.output());
    let err = a.stderr();
    assert!(err.contains("a worker log file refused a line"), "{err}");
    assert!(
        !err.contains("FAILED") && !err.contains("restarting"),
        "{err}"
    );
}

/// A worker that fails on its own while the log directory is full: its traceback never
/// reached `stderr.log` (0 bytes before); the summary quotes it from memory. The failure
/// is the worker's, charged as any (a full log directory fails no worker now).
#[test]
fn a_traceback_the_full_log_directory_refused_is_still_in_the_summary() {
    let (_dir, _tiny, mut a) = redirected_into_tiny_logs(
        "yes 'output' | head -c 2000000; echo 'RuntimeError: the real cause' >&2; exit 3",
    );
    assert_eq!(a.code(), 3, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("last lines of its stderr:") && err.contains("RuntimeError: the real cause"),
        "{err}"
    );
    assert!(err.contains("the restart budget is spent"), "{err}");
}

#[test]
fn a_worker_failed_by_its_nodes_full_working_directory_takes_the_node_out_not_the_job() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let tiny = Tiny::mount(dir.path(), "work");
    let roomy = dir.path().join("roomy");
    std::fs::create_dir_all(&roomy).unwrap();
    // Each worker writes a 2 MB checkpoint into its working directory, then trains.
    let start = |name: &str, cwd: &Path| {
        AgentCmd::new(dir.path(), name)
            .current_dir(cwd)
            .args([
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "3",
            ])
            .args([
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &etcd.endpoint(),
            ])
            .args(["--rdzv-id", "full", "--local-addr", "127.0.0.1"])
            .args(["--rdzv-conf", "last_call_timeout=1"])
            .args(["--no-python", "/bin/sh", "-c"])
            .arg("head -c 2000000 /dev/zero > ckpt || exit 1; sleep 600")
            .spawn()
    };
    // `a` is in the rendezvous before `b` starts, so `b` can only fail inside a group
    // with `a` (started together, a loaded machine let `b` form alone and end before `a`
    // joined, and `a` then formed alone once, which proves nothing).
    let a = start("a", &roomy);
    wait_for("a in the rendezvous", LIMIT, || {
        a.stderr().contains("joined the rendezvous")
    });
    let mut b = start("b", &tiny.0);
    assert_eq!(b.wait(LIMIT).code(), Some(79), "{}", b.output());
    let err = b.stderr();
    assert!(
        err.contains("the working directory's filesystem is full")
            && err.contains("without charging the restart budget")
            && !err.contains("restart budget is spent"),
        "{err}"
    );
    // The other node re-forms alone, nothing charged, and keeps training.
    // After a group of two (the one `b` failed in), a group of one, nothing charged,
    // and workers started in it.
    let re_formed_alone = || {
        let err = a.stderr();
        let formed: Vec<&str> = err.lines().filter(|l| l.contains("group formed")).collect();
        let Some(pair) = formed.iter().position(|l| l.contains("world_size=2")) else {
            return false;
        };
        let Some(alone) = formed[pair..]
            .iter()
            .find(|l| l.contains("world_size=1"))
            .and_then(|l| err.find(*l))
        else {
            return false;
        };
        formed[pair..].iter().all(|l| l.contains("restart_count=0"))
            && err[alone..].contains("workers started")
    };
    let end = std::time::Instant::now() + LIMIT;
    while !re_formed_alone() {
        assert!(
            std::time::Instant::now() < end,
            "a did not re-form alone within {LIMIT:?}:\n{}",
            a.output()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(fsdp_tests::alive(a.pid()), "{}", a.output());
    a.signal(libc::SIGTERM);
}
