//! Supervision with real processes and real signals: restart budget, stop escalation,
//! signal forwarding, and workers dying with the agent.

use std::time::{Duration, Instant};

use fsdp_tests::{AgentCmd, TempDir, alive, fake_worker_args, records, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

fn pids(dir: &TempDir) -> Vec<i32> {
    records(dir.path(), "pid")
        .values()
        .map(|p| p.trim().parse().unwrap())
        .collect()
}

#[test]
fn a_worker_that_fails_twice_succeeds_within_a_budget_of_two() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
        ])
        .args(fake_worker_args(
            dir.path(),
            &[
                "--write-env",
                "--exit-code",
                "3",
                "--fail-until-restart",
                "2",
                "--only-local-rank",
                "1",
            ],
        ))
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    // Both workers were started three times and saw restart counts 0, 1, 2.
    let seen: Vec<String> = records(dir.path(), "env").keys().cloned().collect();
    // The failing rank ran with restart counts 0, 1 and 2, and the last attempt ran both
    // ranks to success. (Rank 0 of a failed attempt may be stopped before it records.)
    for attempt in ["0.1", "1.1", "2.0", "2.1"] {
        assert!(
            seen.iter().any(|s| s == attempt),
            "{attempt} missing from {seen:?}"
        );
    }
    assert!(seen.iter().all(|s| s.as_str() < "3"), "{seen:?}");
    let err = a.stderr();
    assert_eq!(err.matches("FAILED (attempt").count(), 2, "{err}");
    assert!(
        err.contains("restart 1 of 2") && err.contains("restart 2 of 2"),
        "{err}"
    );
}

#[test]
fn the_workers_own_exit_code_is_propagated_when_the_budget_is_spent() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
        ])
        .args(fake_worker_args(
            dir.path(),
            &[
                "--exit-code",
                "3",
                "--fail-until-restart",
                "2",
                "--only-local-rank",
                "1",
                "--sleep",
                "30",
            ],
        ))
        .run(LIMIT);
    assert_eq!(a.code(), 3, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("Root cause (first observed failure):\n  rank 1 (local_rank 1"),
        "{err}"
    );
    assert!(err.contains("exit code 3"), "{err}");
    // The healthy sibling (sleeping 30 s) was stopped each time, not left running: two
    // stops within a run that took far less than its sleep.
    assert!(err.matches("stopping workers").count() >= 2, "{err}");
    // Rounds 0 and 1 ran workers; round 2 only found the budget spent: it is not said to
    // have formed.
    assert_eq!(err.matches("group formed").count(), 2, "{err}");
    assert!(err.contains("the restart budget is spent"), "{err}");
    for pid in pids(&dir) {
        assert!(!alive(pid), "worker {pid} outlived the agent");
    }
}

#[test]
fn error_file_message_and_signals_appear_in_the_summary() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--nproc-per-node", "2", "--log-dir"])
        .arg_path(dir.path().join("logs"))
        .args(fake_worker_args(
            dir.path(),
            &[
                "--exit-code",
                "9",
                "--only-local-rank",
                "0",
                "--error-message",
                "RuntimeError: out of cheese",
                "--sleep",
                "30",
            ],
        ))
        .run(LIMIT);
    assert_eq!(a.code(), 9, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("message: RuntimeError: out of cheese"),
        "{err}"
    );
    assert!(err.contains("error.json"), "{err}");
}

#[test]
fn sigterm_is_forwarded_and_the_agent_exits_143_within_the_grace() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--term-timeout",
            "20",
        ])
        .args(fake_worker_args(dir.path(), &["--sleep", "120"]))
        .spawn();
    wait_for("both workers to start", LIMIT, || pids(&dir).len() == 2);
    let start = Instant::now();
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    // Workers that honour SIGTERM exit at once: far below the 20 s grace.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(
        records(dir.path(), "sigterm").len(),
        2,
        "workers did not see SIGTERM"
    );
    for pid in pids(&dir) {
        assert!(!alive(pid), "worker {pid} outlived the agent");
    }
}

#[test]
fn sigint_and_sighup_are_forwarded_with_their_own_exit_codes() {
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGHUP, 129)] {
        let dir = TempDir::new().unwrap();
        let mut a = AgentCmd::new(dir.path(), "agent")
            .args(["--standalone", "--nproc-per-node", "1"])
            .args(fake_worker_args(dir.path(), &["--sleep", "120"]))
            .spawn();
        wait_for("the worker to start", LIMIT, || pids(&dir).len() == 1);
        a.signal(sig);
        assert_eq!(a.code(), code, "{}", a.output());
        wait_for("the worker to exit", LIMIT, || {
            pids(&dir).iter().all(|p| !alive(*p))
        });
    }
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--term-timeout",
            "1",
        ])
        .args(fake_worker_args(
            dir.path(),
            &["--sleep", "120", "--ignore-sigterm"],
        ))
        .spawn();
    wait_for("both workers to start", LIMIT, || pids(&dir).len() == 2);
    let start = Instant::now();
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "SIGKILL came before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(a.stderr().contains("sending SIGKILL"), "{}", a.stderr());
    for pid in pids(&dir) {
        assert!(!alive(pid), "worker {pid} survived SIGKILL");
    }
}

#[test]
fn a_second_signal_skips_the_rest_of_the_grace() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "1",
            "--term-timeout",
            "60",
        ])
        .args(fake_worker_args(
            dir.path(),
            &["--sleep", "120", "--ignore-sigterm"],
        ))
        .spawn();
    wait_for("the worker to start", LIMIT, || pids(&dir).len() == 1);
    a.signal(libc::SIGTERM);
    wait_for("the stop to begin", LIMIT, || {
        a.stderr().contains("stopping workers")
    });
    // A repeat within the window is the same request (see a_duplicated_sigterm_... in
    // hardening.rs); a second one later is an escalation.
    std::thread::sleep(Duration::from_millis(1500));
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    assert!(a.stderr().contains("second signal"), "{}", a.stderr());
}

#[test]
fn sigkill_of_the_agent_leaves_no_worker_behind() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--nproc-per-node", "2"])
        .args(fake_worker_args(
            dir.path(),
            &["--sleep", "120", "--ignore-sigterm"],
        ))
        .spawn();
    wait_for("both workers to start", LIMIT, || pids(&dir).len() == 2);
    let workers = pids(&dir);
    a.signal(libc::SIGKILL);
    a.wait(LIMIT);
    // PR_SET_PDEATHSIG delivers SIGKILL to each worker as the agent dies.
    wait_for(
        "workers to die with the agent",
        Duration::from_secs(10),
        || workers.iter().all(|p| !alive(*p)),
    );
}

#[test]
fn a_stop_reaches_what_the_workers_started() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--nproc-per-node", "1"])
        .args(fake_worker_args(
            dir.path(),
            &["--sleep", "120", "--spawn-child"],
        ))
        .spawn();
    wait_for("the worker to start", LIMIT, || pids(&dir).len() == 1);
    let child: i32 = records(dir.path(), "child")
        .values()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(child));
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    // The grandchild shares the worker's process group, so the group signal reached it.
    wait_for("the grandchild to exit", Duration::from_secs(10), || {
        !alive(child)
    });
}

#[test]
fn a_signal_during_a_failure_restart_still_stops_everything() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "100",
            "--term-timeout",
            "30",
        ])
        .args(fake_worker_args(
            dir.path(),
            &[
                "--exit-code",
                "1",
                "--only-local-rank",
                "1",
                "--sleep",
                "120",
                "--ignore-sigterm",
            ],
        ))
        .spawn();
    // Rank 0 ignores SIGTERM, so each restart sits in the grace period: signal it there.
    wait_for("the first stop", LIMIT, || {
        a.stderr().contains("stopping workers")
    });
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    for pid in pids(&dir) {
        assert!(!alive(pid), "worker {pid} outlived the agent");
    }
}

/// Children of the agent's process, as `(pid, state)` from /proc.
fn children_states(pid: i32) -> Vec<(i32, char)> {
    let list =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .filter_map(|c| {
            let stat = std::fs::read_to_string(format!("/proc/{c}/stat")).ok()?;
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some((c, state))
        })
        .collect()
}

/// As PID 1 of a container, the agent inherits what workers leave behind; an orphan that
/// exits must not stay a zombie.
#[test]
fn as_pid_1_the_agent_reaps_orphans_the_workers_leave() {
    let dir = TempDir::new().unwrap();
    let out = dir.path().join("pid1.out");
    let mut pod = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(fsdp_tests::agent_bin())
        .args([
            "--standalone",
            "--nproc-per-node",
            "1",
            "--status-addr",
            "off",
        ])
        // The subshell exits at once, so its `sleep 0.2` is re-parented to PID 1 (the
        // agent) and exits while the worker is still running.
        .args(["--no-python", "/bin/sh", "-c", "(sleep 0.2 &); sleep 4"])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&out).unwrap())
        .spawn()
        .expect("unshare");
    let mut agent = 0;
    wait_for("the agent inside the namespace", LIMIT, || {
        agent = std::fs::read_to_string(format!("/proc/{}/task/{}/children", pod.id(), pod.id()))
            .ok()
            .and_then(|c| c.split_whitespace().next().and_then(|p| p.parse().ok()))
            .unwrap_or(0);
        agent != 0
    });
    wait_for("the agent to say it is PID 1", LIMIT, || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .contains("running as PID 1")
    });
    // Long enough for the orphan to exit and be seen; the worker itself still runs.
    std::thread::sleep(Duration::from_millis(1500));
    let kids = children_states(agent);
    assert!(
        kids.iter().any(|(_, s)| *s != 'Z'),
        "the worker is still running: {kids:?}"
    );
    assert!(
        kids.iter().all(|(_, s)| *s != 'Z'),
        "a zombie is left under the agent: {kids:?}"
    );
    let status = pod.wait().unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&out).unwrap()
    );
}

/// A static node shares nothing with the others: when its workers finish it cannot know
/// that the job is done, and does not say so (node 1 once said "every node finished"
/// before node 0's workers had).
#[test]
fn a_static_node_does_not_claim_the_job_is_done() {
    let dir = TempDir::new().unwrap();
    let port = fsdp_tests::free_port().to_string();
    let node = |rank: &str, worker: &[&str]| {
        AgentCmd::new(dir.path(), &format!("node{rank}"))
            .args(["--nnodes", "2", "--node-rank", rank])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .arg("--no-python")
            .args(worker)
    };
    // Node 0's worker outlasts node 1's: node 1 exits 0 while node 0 still runs.
    let node0 = node("0", &["sleep", "120"]).spawn();
    let mut a = node("1", &["true"]).run(LIMIT);
    assert!(fsdp_tests::alive(node0.pid()), "{}", node0.output());
    assert_eq!(a.code(), 0, "{}", a.output());
    let err = a.stderr();
    assert!(
        !err.contains("every node finished") && !err.contains("waiting for the other nodes"),
        "{err}"
    );
    assert!(err.contains("a static group has no exit barrier"), "{err}");
}

/// `--max-restarts 0`: the first failure ends the run; nothing says it re-forms or that a
/// group formed again: a user reading the log would wait for a restart that never comes.
#[test]
fn with_no_restarts_a_failure_ends_the_run_without_a_re_form() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
        ])
        .args(fake_worker_args(dir.path(), &["--exit-code", "3"]))
        .run(LIMIT);
    assert_eq!(a.code(), 3, "{}", a.output());
    let err = a.stderr();
    assert!(!err.contains("re-forming"), "{err}");
    assert_eq!(err.matches("group formed").count(), 1, "{err}");
    assert!(err.contains("the restart budget is spent"), "{err}");
}
