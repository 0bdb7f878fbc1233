//! Two jobs started with one `--rdzv-id` on one etcd. They merged: the second
//! job's agents waited as spares of the first, and when one of its nodes died a stranger
//! took its rank and resumed from its own checkpoint. Now the newcomer refuses to join
//! another job's run (exit 64, one line naming the run and what differs), the first job
//! never sees it, and `fsdp-agent status` shows why it went. Real agents, a real etcd.

use std::path::Path;
use std::time::{Duration, Instant};

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, TempDir, fake_worker_args, status_cmd, wait_for};

const LIMIT: Duration = Duration::from_secs(60);
const RUN: &str = "shared-id";

/// An agent of a `--nnodes 1:3` job whose workers record into `dir/ckpt` (the job's own
/// "checkpoint directory": its arguments differ from another job's).
fn agent(etcd: &Etcd, dir: &Path, name: &str, ckpt: &str, conf: &str) -> Agent {
    let wdir = dir.join(ckpt);
    std::fs::create_dir_all(&wdir).unwrap();
    let mut cmd = AgentCmd::new(dir, name)
        .args(["--nnodes", "1:3", "--nproc-per-node", "1"])
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--rdzv-id", RUN, "--local-addr", "127.0.0.1"]);
    let mut rdzv_conf = "last_call_timeout=1".to_owned();
    if !conf.is_empty() {
        rdzv_conf = format!("{rdzv_conf},{conf}");
    }
    cmd = cmd.args(["--rdzv-conf", &rdzv_conf]);
    cmd.args(fake_worker_args(&wdir, &["--sleep", "600"]))
        .spawn()
}

#[test]
fn a_second_job_with_the_same_rdzv_id_is_refused_and_the_first_never_sees_it() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let a0 = agent(&etcd, dir.path(), "a0", "ckpt-a", "");
    let a1 = agent(&etcd, dir.path(), "a1", "ckpt-a", "");
    wait_for("job A's group of two", LIMIT, || {
        a0.stderr().contains("world_size=2") && a1.stderr().contains("world_size=2")
    });

    let started = Instant::now();
    let mut b = agent(&etcd, dir.path(), "b", "ckpt-b", "");
    let code = b.code();
    let took = started.elapsed();
    let err = b.stderr();
    assert_eq!(code, 64, "{}", b.output());
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        err.contains(&format!("run '{RUN}' on etcd at"))
            && err.contains(
                "is another job's: the command (the entrypoint or its arguments) differs from round"
            )
            && err.contains("give this job its own --rdzv-id"),
        "{err}"
    );

    // Job A never saw it: one round each, no spare, nobody new.
    std::thread::sleep(Duration::from_secs(2));
    for a in [&a0, &a1] {
        let log = a.stderr();
        assert_eq!(log.matches("group formed").count(), 1, "{log}");
        assert!(
            !log.contains("spare") && !log.contains("world_size=3"),
            "{log}"
        );
    }
    // Status says why the stranger went.
    let (code, out, err) = status_cmd(&["--rdzv-endpoint", &etcd.endpoint(), "--rdzv-id", RUN]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("another job's"), "{out}");
}

/// `--rdzv-conf job_check=0`: a job whose nodes differ on purpose forms as before.
#[test]
fn with_the_check_off_nodes_that_differ_form_one_group() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let a0 = agent(&etcd, dir.path(), "a0", "ckpt-a", "job_check=0");
    wait_for("a group of one", LIMIT, || {
        a0.stderr().contains("world_size=1")
    });
    let b = agent(&etcd, dir.path(), "b", "ckpt-b", "job_check=0");
    wait_for("the group grown to two", LIMIT, || {
        a0.stderr().contains("world_size=2") && b.stderr().contains("world_size=2")
    });
}

/// A finished run never blocks a new job with its id, whatever the new job's command:
/// its round key stays, but nobody runs it.
#[test]
fn a_finished_runs_id_is_free_for_another_job() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let run = |name: &str, ckpt: &str| {
        let wdir = dir.path().join(ckpt);
        std::fs::create_dir_all(&wdir).unwrap();
        AgentCmd::new(dir.path(), name)
            .args(["--nnodes", "1", "--nproc-per-node", "1"])
            .args([
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &etcd.endpoint(),
            ])
            .args(["--rdzv-id", RUN, "--local-addr", "127.0.0.1"])
            .args(fake_worker_args(&wdir, &["--sleep", "0"]))
            .run(LIMIT)
    };
    let mut first = run("first", "ckpt-a");
    assert_eq!(first.code(), 0, "{}", first.output());
    let mut second = run("second", "ckpt-b");
    assert_eq!(second.code(), 0, "{}", second.output());
}
