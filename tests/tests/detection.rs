//! Refused means dead: a SIGKILLed pod is evicted by its ring neighbour as soon
//! as its status port refuses a connection, long before its lease (default TTL, 5 s)
//! expires; a live agent whose liveness connection breaks is never evicted.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fsdp_tests::job::{Job, logged_at, nth_start_world, starts, wait_until};
use fsdp_tests::metrics_text;
use fsdp_tests::pod::Pod;

/// Where a pod's status server listens (`127.0.0.1:<port>`), from its log.
fn status_addr(pod: &Pod) -> String {
    pod.stderr()
        .lines()
        .find(|l| l.contains("status server listening"))
        .and_then(|l| l.split("addr=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .expect("the pod's status address")
        .to_owned()
}

/// Now, as seconds of the day in UTC: the clock of the agents' log timestamps.
fn now_of_day() -> f64 {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) / 1e9
}

/// Three pods with the default lease TTL (5 s).
fn three(run: &str, net: u8) -> (Job, Vec<Pod>) {
    let mut job = Job::new(run, "2:3", 0, 1_000_000, net);
    job.rdzv_conf = "last_call_timeout=1".into();
    let pods: Vec<Pod> = (0..3).map(|i| job.pod(i, &[])).collect();
    let all: Vec<&Pod> = pods.iter().collect();
    wait_until("a group of 3", &all, || {
        pods.iter().all(|p| nth_start_world(p, 0, 3))
    });
    job.progresses(3, &all);
    (job, pods)
}

/// Waits until `survivors` run a group of 2; how long after `t0` the last of them formed
/// it (seconds, by the agents' log timestamps).
fn slowest_to_a_group_of_two(pods: &[Pod], survivors: &[usize], t0: f64) -> f64 {
    let all: Vec<&Pod> = survivors.iter().map(|&i| &pods[i]).collect();
    wait_until("a group of 2", &all, || {
        survivors
            .iter()
            .all(|&i| starts(&pods[i]).last().is_some_and(|s| s.world == 2))
    });
    survivors
        .iter()
        .map(|&i| logged_at(&pods[i], "group formed", "world_size=2").expect("a group of 2") - t0)
        .fold(0.0, f64::max)
}

/// SIGKILLs pod `victim`; the survivors must re-form through the refused path, well
/// before the dead pod's lease could expire. Prints the figure.
fn a_killed_pod_is_evicted_before_its_lease_expires(run: &str, net: u8, coordinator: bool) {
    let (job, mut pods) = three(run, net);
    let victim = if coordinator {
        let mut c = None;
        wait_until("etcd to name the coordinator", &[], || {
            c = job.coordinator();
            c.is_some()
        });
        c.unwrap()
    } else {
        job.coordinator().map_or(1, |c| (c + 1) % 3)
    };
    let t0 = now_of_day();
    pods[victim].kill();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let all: Vec<&Pod> = survivors.iter().map(|&i| &pods[i]).collect();
    wait_until("the survivors to re-form", &all, || {
        survivors.iter().all(|&i| nth_start_world(&pods[i], 1, 2))
    });
    let mut slowest = 0.0f64;
    for &i in &survivors {
        let formed = logged_at(&pods[i], "group formed", "world_size=2").expect("a group of 2");
        slowest = slowest.max(formed - t0);
    }
    eprintln!(
        "detection: SIGKILL of pod{victim} ({}) -> survivors re-formed in {slowest:.3} s",
        if coordinator {
            "the coordinator"
        } else {
            "a member"
        }
    );
    let evicted = survivors.iter().any(|&i| {
        pods[i]
            .stderr()
            .contains("ring neighbour gone; revoking its lease")
    });
    let outputs: Vec<String> = survivors.iter().map(|&i| pods[i].output()).collect();
    assert!(
        evicted,
        "no survivor evicted the dead pod\n{}",
        outputs.join("\n")
    );
    // Every survivor's /metrics says how the member was lost.
    for &i in &survivors {
        let text = metrics_text(&status_addr(&pods[i]));
        assert!(
            text.contains("fsdp_agent_member_losses_total{detection=\"refused\"} 1"),
            "pod{i}: {text}"
        );
    }
    // The lease TTL is 5 s: a re-form well inside it came from the refused connection.
    assert!(
        slowest < 3.0,
        "re-formed {slowest:.3} s after the kill\n{}",
        outputs.join("\n")
    );
    job.progresses(5, &all);
}

#[test]
fn a_sigkilled_member_is_out_long_before_its_lease_expires() {
    a_killed_pod_is_evicted_before_its_lease_expires("detect-member", 14, false);
}

#[test]
fn a_sigkilled_coordinator_is_out_long_before_its_lease_expires() {
    a_killed_pod_is_evicted_before_its_lease_expires("detect-coord", 15, true);
}

/// The liveness connections to a live agent are cut (`ss -K`): its watcher reconnects,
/// finds it answering as itself, and nothing happens.
#[test]
fn a_broken_liveness_connection_to_a_live_agent_evicts_no_one() {
    let (job, pods) = three("detect-live", 16);
    let addr = status_addr(&pods[1]);
    let port = addr.rsplit(':').next().unwrap();
    // Give the watcher time to be connected, then cut every connection to that port.
    std::thread::sleep(Duration::from_secs(1));
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", "dst", "127.0.0.1", "dport", "=", port])
        .output()
        .expect("ss (iproute2)");
    let cut = String::from_utf8_lossy(&out.stdout)
        .lines()
        .count()
        .saturating_sub(1);
    assert!(
        cut >= 1,
        "no liveness connection to cut: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    std::thread::sleep(Duration::from_secs(4));
    let all: Vec<&Pod> = pods.iter().collect();
    job.progresses(5, &all);
    for p in &pods {
        assert_eq!(starts(p).len(), 1, "a re-form\n{}", p.output());
        assert!(
            !p.stderr().contains("ring neighbour gone"),
            "a live agent was evicted\n{}",
            p.output()
        );
    }
}

/// A pod delete (SIGTERM): the agent says it leaves before it revokes its lease, and the
/// survivors report a leave, not a death.
#[test]
fn a_deleted_pod_is_reported_as_a_leave() {
    let (_job, mut pods) = three("detect-leave", 17);
    pods[2].signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        pods[2].wait(fsdp_tests::job::LIMIT),
        143,
        "{}",
        pods[2].output()
    );
    let all: Vec<&Pod> = pods[..2].iter().collect();
    wait_until("the survivors to re-form", &all, || {
        pods[..2].iter().all(|p| nth_start_world(p, 1, 2))
    });
    for (i, p) in pods[..2].iter().enumerate() {
        let text = metrics_text(&status_addr(p));
        assert!(
            text.contains("fsdp_agent_member_losses_total{detection=\"left\"} 1"),
            "pod{i}: {text}"
        );
    }
}

/// A dead peer often reaches the survivors' workers first: their collective fails and
/// their agents go back to the rendezvous to wait for the next round. Here the
/// coordinator's agent is frozen, its worker killed (the survivors' workers fail), then the
/// agent SIGKILLed: the survivors, still watching the old round's neighbours, prove it dead
/// and re-form well before its lease could expire. The elastic demo found them waiting out
/// the lease (3.5 s of 5) when the watch ended with the round.
#[test]
fn a_peer_whose_workers_died_first_is_still_evicted_when_its_agent_dies() {
    // A long lease: re-forming within 3 s can only be the eviction.
    let mut job = Job::new("detect-after", "2:3", 0, 1_000_000, 17);
    job.rdzv_conf = "last_call_timeout=1,keep_alive_ttl=10".into();
    let mut pods: Vec<Pod> = (0..3).map(|i| job.pod(i, &[])).collect();
    {
        let all: Vec<&Pod> = pods.iter().collect();
        wait_until("a group of 3", &all, || {
            pods.iter().all(|p| nth_start_world(p, 0, 3))
        });
        job.progresses(3, &all);
    }
    let mut c = None;
    wait_until("etcd to name the coordinator", &[], || {
        c = job.coordinator();
        c.is_some()
    });
    let victim = c.unwrap();
    // The worker as the test sees it: the agent's child (its own pid is the pod's).
    let agent = pods[victim].agent_pid();
    let worker: i32 = std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the victim's worker pid");
    pods[victim].signal(nix::sys::signal::Signal::SIGSTOP);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(worker),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    // The survivors' workers fail and their agents go back to the rendezvous.
    {
        let all: Vec<&Pod> = pods.iter().collect();
        wait_until("the survivors to stop their workers", &all, || {
            survivors.iter().all(|&i| {
                let e = pods[i].stderr();
                // Its own worker failed (said at once, or held for the next round), or
                // another node's did.
                e.contains("worker group failed")
                    || e.contains("a worker exited; re-forming")
                    || e.contains("another node's worker failed")
            })
        });
    }
    let t0 = now_of_day();
    pods[victim].kill();
    let slowest = slowest_to_a_group_of_two(&pods, &survivors, t0);
    let outputs: Vec<String> = survivors.iter().map(|&i| pods[i].output()).collect();
    assert!(
        survivors.iter().any(|&i| pods[i]
            .stderr()
            .contains("ring neighbour gone; revoking its lease")),
        "no survivor evicted the dead agent\n{}",
        outputs.join("\n")
    );
    assert!(
        slowest < 3.0,
        "re-formed {slowest:.3} s after the agent's death\n{}",
        outputs.join("\n")
    );
}

/// Outside testing: after etcd came back empty every agent holds a new lease, but the
/// round put back still names the old ones, so the ring watcher tried to revoke a lease
/// that no longer held anything (`nothing to revoke`) and the loss waited out the TTL.
/// The watcher must evict the lease the dead agent last announced.
#[test]
fn a_member_killed_after_etcd_came_back_empty_is_still_evicted_at_once() {
    // A long lease: re-forming within 3 s can only be the eviction.
    let mut job = Job::new("detect-empty", "2:3", 0, 1_000_000, 58);
    job.rdzv_conf = "last_call_timeout=1,keep_alive_ttl=10".into();
    let mut pods: Vec<Pod> = (0..3).map(|i| job.pod(i, &[])).collect();
    {
        let all: Vec<&Pod> = pods.iter().collect();
        wait_until("a group of 3", &all, || {
            pods.iter().all(|p| nth_start_world(p, 0, 3))
        });
        job.progresses(3, &all);
        job.etcd_mut().restart(false);
        wait_until("every agent on a new lease", &all, || {
            pods.iter()
                .all(|p| p.stderr().contains("the lease was gone; granted a new one"))
        });
        wait_until("the round put back", &all, || {
            pods.iter().any(|p| {
                p.stderr()
                    .contains("etcd lost the round record; put the newest round it knew back")
            })
        });
        // A new lease is announced within a second.
        std::thread::sleep(Duration::from_secs(2));
        job.progresses(2, &all);
    }
    let victim = job.coordinator().map_or(1, |c| (c + 1) % 3);
    let t0 = now_of_day();
    pods[victim].kill();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let slowest = slowest_to_a_group_of_two(&pods, &survivors, t0);
    let outputs: Vec<String> = survivors.iter().map(|&i| pods[i].output()).collect();
    assert!(
        survivors
            .iter()
            .all(|&i| !pods[i].stderr().contains("nothing to revoke")),
        "a watcher revoked the round's old lease\n{}",
        outputs.join("\n")
    );
    assert!(
        slowest < 3.0,
        "re-formed {slowest:.3} s after the kill\n{}",
        outputs.join("\n")
    );
}
