//! Fault tests of the elastic agent: each "pod" is an agent with its workers in its own PID
//! and UTS namespace, on a real etcd, running real PyTorch gloo workers that all-reduce in
//! a loop and checkpoint a step counter to a shared directory (the harness is
//! `fsdp_tests::job`).

use std::time::Duration;

use fsdp_tests::TempDir;
use fsdp_tests::etcd::Etcd;
use fsdp_tests::job::{Job, LIMIT, nth_start_world, starts, wait_until};
use fsdp_tests::pod::Pod;
use nix::sys::signal::Signal;

#[test]
fn killed_and_deleted_pods_leave_the_rest_training_and_the_group_grows_back() {
    let job = Job::new("kill3", "2:3", 0, 1_000_000, 1);
    let (mut p0, mut p1, mut p2) = (job.pod(0, &[]), job.pod(1, &[]), job.pod(2, &[]));
    wait_until("a group of 3", &[&p0, &p1, &p2], || {
        [&p0, &p1, &p2].iter().all(|p| nth_start_world(p, 0, 3))
    });
    job.progresses(10, &[&p0, &p1, &p2]);

    // SIGKILL of a pod: the other two re-form with world 2 and resume from the checkpoint,
    // without charging the restart budget (--max-restarts 0).
    p2.kill();
    wait_until("survivors in a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 1, 2) && nth_start_world(&p1, 1, 2)
    });
    for p in [&p0, &p1] {
        let s = &starts(p)[1];
        assert!(s.step > 0, "did not resume from the checkpoint: {s:?}");
        assert_eq!(s.restart, 0, "a pod death consumed the restart budget");
    }
    job.progresses(10, &[&p0, &p1]);

    // The killed pod comes back with the same host name: the group grows back to 3.
    let p2b = job.pod(2, &[]);
    wait_until("the group to grow back to 3", &[&p0, &p1, &p2b], || {
        nth_start_world(&p0, 2, 3) && nth_start_world(&p1, 2, 3) && nth_start_world(&p2b, 0, 3)
    });
    job.progresses(10, &[&p0, &p1, &p2b]);

    // SIGTERM (a pod delete): it leaves gracefully and exits 143; the rest re-form.
    p1.signal(Signal::SIGTERM);
    assert_eq!(p1.wait(LIMIT), 143, "{}", p1.output());
    wait_until("survivors after a delete", &[&p0, &p2b], || {
        nth_start_world(&p0, 3, 2) && nth_start_world(&p2b, 1, 2)
    });
    job.progresses(10, &[&p0, &p2b]);
    assert!(starts(&p0).iter().all(|s| s.restart == 0));
    p0.kill();
}

#[test]
fn a_killed_worker_restarts_every_node_with_the_same_restart_count() {
    let job = Job::new("worker", "2:2", 3, 1_000_000, 2);
    let (p0, p1) = (job.pod(0, &[]), job.pod(1, &[]));
    wait_until("a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 0, 2) && nth_start_world(&p1, 0, 2)
    });
    job.progresses(5, &[&p0, &p1]);
    // The worker is the agent's only child in the pod.
    let agent = p0.agent_pid();
    let worker: i32 = std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .expect("a worker")
        .parse()
        .unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker), Signal::SIGKILL).unwrap();
    wait_until("both nodes to restart", &[&p0, &p1], || {
        starts(&p0).len() >= 2 && starts(&p1).len() >= 2
    });
    let (a, b) = (starts(&p0)[1].clone(), starts(&p1)[1].clone());
    assert_eq!(
        (a.restart, b.restart),
        (1, 1),
        "restart counts differ or are wrong: {a:?} {b:?}"
    );
    assert!(a.step > 0, "{a:?}");
    job.progresses(5, &[&p0, &p1]);
}

#[test]
fn the_coordinators_death_does_not_stop_training() {
    let job = Job::new("coord", "2:3", 0, 1_000_000, 3);
    let mut pods = [job.pod(0, &[]), job.pod(1, &[]), job.pod(2, &[])];
    let all: Vec<&Pod> = pods.iter().collect();
    wait_until("a group of 3", &all, || {
        pods.iter().all(|p| nth_start_world(p, 0, 3))
    });
    let mut coord = None;
    wait_until("etcd to name a coordinator", &all, || {
        coord = job.coordinator();
        coord.is_some()
    });
    let coord = coord.unwrap();
    assert!(
        pods[coord]
            .stderr()
            .contains("elected rendezvous coordinator"),
        "etcd names pod{coord} the coordinator but its log does not say so\n{}",
        pods[coord].output()
    );
    pods[coord].kill();
    let rest: Vec<&Pod> = pods
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != coord)
        .map(|(_, p)| p)
        .collect();
    wait_until("the rest to re-form", &rest, || {
        rest.iter().all(|p| nth_start_world(p, 1, 2))
    });
    let mut next = None;
    wait_until("a survivor to take over as coordinator", &rest, || {
        next = job.coordinator().filter(|&i| i != coord);
        next.is_some()
    });
    let next = next.unwrap();
    assert!(
        pods[next]
            .stderr()
            .contains("elected rendezvous coordinator"),
        "etcd names pod{next} the new coordinator but its log does not say so\n{}",
        pods[next].output()
    );
    job.progresses(10, &rest);
}

#[test]
fn a_frozen_pod_is_evicted_and_rejoins_cleanly_when_thawed() {
    let job = Job::new("freeze", "2:3", 0, 1_000_000, 4);
    let (p0, p1, p2) = (job.pod(0, &[]), job.pod(1, &[]), job.pod(2, &[]));
    wait_until("a group of 3", &[&p0, &p1, &p2], || {
        [&p0, &p1, &p2].iter().all(|p| nth_start_world(p, 0, 3))
    });
    let agent = p2.agent_pid();
    let worker: i32 = std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .expect("a worker")
        .parse()
        .unwrap();
    let freeze = |sig| fsdp_tests::signal_pod(agent, &[worker], sig);
    freeze(Signal::SIGSTOP);
    wait_until("the others to evict the frozen pod", &[&p0, &p1], || {
        nth_start_world(&p0, 1, 2) && nth_start_world(&p1, 1, 2)
    });
    job.progresses(10, &[&p0, &p1]);
    freeze(Signal::SIGCONT);
    // Its stale worker is stopped and it rejoins: one group of 3 again, no split brain.
    wait_until("the thawed pod to rejoin", &[&p0, &p1, &p2], || {
        nth_start_world(&p0, 2, 3) && nth_start_world(&p1, 2, 3) && nth_start_world(&p2, 1, 3)
    });
    job.progresses(10, &[&p0, &p1, &p2]);
}

#[test]
fn an_etcd_restart_does_not_restart_the_workers() {
    let mut job = Job::new("etcdrestart", "2:2", 0, 1_000_000, 5);
    let (p0, p1) = (job.pod(0, &[]), job.pod(1, &[]));
    wait_until("a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 0, 2) && nth_start_world(&p1, 0, 2)
    });
    for keep_data in [true, false] {
        job.progresses(5, &[&p0, &p1]);
        job.etcd_mut().restart(keep_data);
        // Several lease TTLs pass; training goes on in the same workers.
        std::thread::sleep(Duration::from_secs(8));
        job.progresses(5, &[&p0, &p1]);
        assert_eq!(
            (starts(&p0).len(), starts(&p1).len()),
            (1, 1),
            "keep_data={keep_data}: workers restarted\n{}\n{}",
            p0.output(),
            p1.output()
        );
    }
}

#[test]
fn the_1638_scenario_a_deleted_pod_neither_stops_the_other_nor_crash_loops() {
    let job = Job::new("kf1638", "1:2", 0, 1_000_000, 6);
    let (p0, mut p1) = (job.pod(0, &[]), job.pod(1, &[]));
    wait_until("a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 0, 2) && nth_start_world(&p1, 0, 2)
    });
    p1.signal(Signal::SIGTERM);
    assert_eq!(p1.wait(LIMIT), 143, "{}", p1.output());
    wait_until("the other to go on alone", &[&p0], || {
        nth_start_world(&p0, 1, 1)
    });
    job.progresses(5, &[&p0]);
    let p1b = job.pod(1, &[]);
    wait_until("the recreated pod to rejoin", &[&p0, &p1b], || {
        nth_start_world(&p0, 2, 2) && nth_start_world(&p1b, 0, 2)
    });
    job.progresses(5, &[&p0, &p1b]);
    assert!(!p0.stderr().contains("ERROR"), "{}", p0.stderr());
}

#[test]
fn a_finished_job_exits_zero_everywhere_and_the_run_id_can_be_reused() {
    for attempt in 0..2 {
        let job = Job::new("finish", "2:2", 0, 20, 7 + attempt);
        let (mut p0, mut p1) = (job.pod(0, &[]), job.pod(1, &[]));
        assert_eq!(p0.wait(LIMIT), 0, "{}", p0.output());
        assert_eq!(p1.wait(LIMIT), 0, "{}", p1.output());
        assert!(p0.stdout().contains("done host=pod0") && p1.stdout().contains("done host=pod1"));
        assert!(
            p0.stderr().contains("every node finished"),
            "{}",
            p0.stderr()
        );
        // The members leaving a finished round end the job: no node reports a re-form.
        for p in [&p0, &p1] {
            assert!(!p.stderr().contains("re-form"), "{}", p.stderr());
        }
    }
}

#[test]
fn a_spent_budget_ends_every_node_with_a_permanent_code() {
    let job = Job::new("budget", "2:2", 1, 1_000_000, 9);
    let (mut p0, mut p1) = (
        job.pod(0, &["--fail-on", "pod0"]),
        job.pod(1, &["--fail-on", "pod0"]),
    );
    // pod0's worker exits 3 every time: one restart is allowed, the second failure ends it.
    assert_eq!(p0.wait(LIMIT), 3, "{}", p0.output());
    assert_eq!(p1.wait(LIMIT), 76, "{}", p1.output());
    assert!(
        p1.stderr().contains("restart budget is spent"),
        "{}",
        p1.stderr()
    );
}

/// Two agents with fake workers: node A finishes at once, node B's worker fails later.
/// A must not exit 0 while B fails: it leaves the exit barrier, re-forms, and both finish
/// in the next round.
#[test]
fn a_peer_failing_during_the_exit_barrier_makes_the_finished_node_re_form() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let agent = |name: &str, fail: bool| {
        let mut c = fsdp_tests::AgentCmd::new(dir.path(), name)
            .args([
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &etcd.endpoint(),
                "--rdzv-id",
                "barrier",
            ])
            .args([
                "--nnodes",
                "2:2",
                "--max-restarts",
                "1",
                "--rdzv-conf",
                "keep_alive_ttl=2",
            ])
            .args(["--no-python"])
            .arg_path(fsdp_tests::fake_worker())
            .args([
                "--exit-code",
                "5",
                "--fail-until-restart",
                "1",
                "--only-if-env",
                "FAIL_HERE",
            ]);
        if fail {
            // B's worker fails a second after A's has already succeeded.
            c = c.env("FAIL_HERE", "1").args(["--sleep", "1"]);
        }
        c.spawn()
    };
    let (mut a, mut b) = (agent("a", false), agent("b", true));
    assert_eq!(b.wait(LIMIT).code(), Some(0), "{}", b.output());
    assert_eq!(a.wait(LIMIT).code(), Some(0), "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("the group broke before every node finished"),
        "{err}"
    );
    assert!(
        err.contains("restart_count=1"),
        "A ran a second round: {err}"
    );
}

/// A node SIGKILLed while liveness is off: its peer's workers fail at once (their
/// collectives break) and the loss is known only when its lease expires. The survivor
/// names the lost node, not its own healthy rank as a root cause (outside testing found it
/// blamed its own rank).
#[test]
fn a_lost_peer_is_named_and_no_healthy_rank_is_blamed() {
    let job = Job::new("lostpeer", "1:2", 0, 1_000_000, 57);
    let quiet = ["--status-addr", "off"];
    let (mut p0, mut p1) = (job.pod(0, &quiet), job.pod(1, &quiet));
    wait_until("a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 0, 2) && nth_start_world(&p1, 0, 2)
    });
    job.progresses(5, &[&p0, &p1]);
    p1.kill();
    wait_until("the survivor alone", &[&p0], || nth_start_world(&p0, 1, 1));
    let err = p0.stderr();
    assert!(
        !err.contains("Root cause") && !err.contains("worker group failed"),
        "{err}"
    );
    if err.contains("a worker exited; re-forming") {
        assert!(
            err.contains(
                "was lost (lease expiry); the local workers stopped because their group broke"
            ),
            "{err}"
        );
    }
    assert_eq!(starts(&p0)[1].restart, 0, "a lost peer spent the budget");
    p0.kill();
}
