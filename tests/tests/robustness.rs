//! What the rendezvous survives beyond clean deaths, with real agents and workers: a node
//! whose network is cut (in its own network namespace), and an etcd that comes back empty
//! while one agent is slow to reconnect.

use std::time::Duration;

use fsdp_tests::alive;
use fsdp_tests::etcd::Etcd;
use fsdp_tests::job::{Job, logged_at, nth_start_world, starts, wait_until};
use fsdp_tests::netns::Net;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Outside testing: a pod cut from etcd and its peers kept its worker running for 13-15 s
/// beside the group that re-formed without it (two rank-0 processes at once). Now it stops
/// its worker before its lease can expire, so before the others re-form, and rejoins when
/// its network is back.
#[test]
fn a_node_cut_off_fences_itself_before_the_others_re_form_and_rejoins_when_healed() {
    let mut net = Net::new();
    let hosts: Vec<_> = (0..3).map(|i| net.host(i)).collect();
    let gateway = net.gateway();
    let job = Job::with_etcd(Etcd::start_also_on(&gateway), "cut", "2:3", 0, 1_000_000, 0);
    let pods: Vec<_> = (0..3)
        .map(|i| job.pod_on(&hosts[i], &gateway, i as u8, &[]))
        .collect();
    let all: Vec<_> = pods.iter().collect();
    wait_until("a group of 3", &all, || {
        pods.iter().all(|p| nth_start_world(p, 0, 3))
    });
    job.progresses(5, &all);

    net.cut(&hosts[2]);
    wait_until("the others to re-form without the cut node", &all, || {
        nth_start_world(&pods[0], 1, 2) && nth_start_world(&pods[1], 1, 2)
    });
    let cut = &pods[2];
    assert!(
        cut.stderr().contains("fencing: stopping the workers"),
        "the cut node did not fence\n{}",
        cut.output()
    );
    // Its worker was gone before the others formed their new group.
    let stopped = logged_at(cut, "fencing", "workers stopped").expect("stopped after fencing");
    for p in &pods[..2] {
        let formed = logged_at(p, "group formed", "world_size=2").expect("a group of 2");
        assert!(
            stopped < formed,
            "the cut node's worker stopped at {stopped:.3}, after {} formed a group of 2 at {formed:.3}\n{}\n{}",
            p.name,
            cut.output(),
            p.output()
        );
    }
    job.progresses(5, &all[..2]);
    // A silent host is found by its lease, as before.
    for p in &pods[..2] {
        assert!(
            p.stderr().contains("detection=\"lease expiry\""),
            "{} does not say how the cut node was lost\n{}",
            p.name,
            p.output()
        );
    }

    net.heal(&hosts[2]);
    wait_until("the healed node to rejoin", &all, || {
        nth_start_world(&pods[0], 2, 3) && nth_start_world(&pods[2], 1, 3)
    });
    job.progresses(5, &all);
    for p in &pods {
        assert!(alive(p.agent_pid()), "{} exited\n{}", p.name, p.output());
    }
}

/// Outside testing: after etcd restarted empty, an agent that reconnected after another
/// had already put the round back took its own missing key for an eviction and restarted
/// its workers. A lease found gone before it could have expired was lost with etcd's
/// data: nobody restarts.
#[test]
fn an_agent_slow_to_reconnect_to_an_etcd_back_empty_restarts_no_worker() {
    let mut job = Job::new("stagger", "2:2", 0, 1_000_000, 10);
    // A TTL that outlasts the freeze below: the slow agent has no reason to fence.
    job.rdzv_conf = "last_call_timeout=1,keep_alive_ttl=6".into();
    let (p0, p1) = (job.pod(0, &[]), job.pod(1, &[]));
    wait_until("a group of 2", &[&p0, &p1], || {
        nth_start_world(&p0, 0, 2) && nth_start_world(&p1, 0, 2)
    });
    job.progresses(5, &[&p0, &p1]);
    // p1's agent sleeps through the restart (its worker keeps training); p0 reconnects
    // first and puts the round back.
    let slow = Pid::from_raw(p1.agent_pid());
    kill(slow, Signal::SIGSTOP).unwrap();
    job.etcd_mut().restart(false);
    wait_until("p0 to put the round back", &[&p0], || {
        p0.stderr()
            .contains("etcd lost the round record; put the newest round it knew back")
            || p0.stderr().contains("granted a new one")
    });
    std::thread::sleep(Duration::from_millis(700));
    kill(slow, Signal::SIGCONT).unwrap();
    std::thread::sleep(Duration::from_secs(8));
    job.progresses(5, &[&p0, &p1]);
    assert_eq!(
        (starts(&p0).len(), starts(&p1).len()),
        (1, 1),
        "workers restarted\n{}\n{}",
        p0.output(),
        p1.output()
    );
    assert!(
        !p1.stderr().contains("evicted"),
        "the slow agent thought itself evicted\n{}",
        p1.output()
    );
}
