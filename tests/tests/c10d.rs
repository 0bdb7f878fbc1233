//! `--rdzv-backend c10d` on several nodes, with no etcd anywhere: pod 0's agent serves the
//! store (torchrun's "the agent at the endpoint hosts" rule) and every agent runs the etcd
//! rendezvous against it. Real pods (PID and UTS namespaces), real gloo workers, real
//! signals; the harness is `fsdp_tests::job`.

use fsdp_tests::job::{Job, LIMIT, nth_start_world, starts, wait_until};
use fsdp_tests::pod::Pod;
use fsdp_tests::status_cmd;

const SERVING: &str = "serving the c10d rendezvous store";

/// Pod 0 first, serving the store, then the others.
fn start(job: &Job, n: u8) -> Vec<Pod> {
    let p0 = job.pod(0, &[]);
    wait_until("pod 0 to serve the store", &[&p0], || {
        p0.stderr().contains(SERVING)
    });
    let mut pods = vec![p0];
    pods.extend((1..n).map(|i| job.pod(i, &[])));
    pods
}

#[test]
fn a_third_pod_grows_the_group_and_a_killed_pod_leaves_the_rest_training() {
    let job = Job::c10d("c10d", "2:3", 0, 1_000_000, 40);
    let pods = start(&job, 2);
    let (p0, p1) = (&pods[0], &pods[1]);
    wait_until("a group of 2", &[p0, p1], || {
        nth_start_world(p0, 0, 2) && nth_start_world(p1, 0, 2)
    });
    assert!(
        p1.stderr()
            .contains("the c10d rendezvous store is served by another agent"),
        "{}",
        p1.stderr()
    );
    // `fsdp-agent status` reads the store as it reads an etcd.
    let (code, json, err) = status_cmd(&[
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &job.endpoint(),
        "--rdzv-id",
        &job.run_id,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        report["members"].as_array().map(Vec::len),
        Some(2),
        "{json}"
    );
    job.progresses(5, &[p0, p1]);

    // torchrun's c10d does not grow a running group by default; here a pod that joins a
    // 2:3 job is taken in at once, without charging the restart budget.
    let mut p2 = job.pod(2, &[]);
    wait_until("the group to grow to 3", &[p0, p1, &p2], || {
        nth_start_world(p0, 1, 3) && nth_start_world(p1, 1, 3) && nth_start_world(&p2, 0, 3)
    });
    job.progresses(5, &[p0, p1, &p2]);

    // SIGKILL of a pod that does not serve the store: the others re-form with world 2 and
    // resume from the checkpoint.
    p2.kill();
    wait_until("survivors in a group of 2", &[p0, p1], || {
        nth_start_world(p0, 2, 2) && nth_start_world(p1, 2, 2)
    });
    for p in [p0, p1] {
        let s = &starts(p)[2];
        assert!(s.step > 0, "did not resume from the checkpoint: {s:?}");
        assert_eq!(s.restart, 0, "a pod death consumed the restart budget");
    }
    job.progresses(5, &[p0, p1]);
}

#[test]
fn a_finished_job_exits_zero_everywhere_and_the_host_serves_until_the_others_are_done() {
    let job = Job::c10d("c10d-finish", "2:2", 0, 20, 41);
    let mut pods = start(&job, 2);
    for p in &mut pods {
        assert_eq!(p.wait(LIMIT), 0, "{}", p.output());
    }
    let (p0, p1) = (&pods[0], &pods[1]);
    assert!(p0.stdout().contains("done host=pod0") && p1.stdout().contains("done host=pod1"));
    for p in [p0, p1] {
        assert!(p.stderr().contains("every node finished"), "{}", p.stderr());
        // The members leaving a finished round end the job: nobody reports a re-form
        // (the host, which stays longest, saw the others go).
        assert!(!p.stderr().contains("re-form"), "{}", p.stderr());
    }
    assert!(
        !p0.stderr().contains("while agents still hold leases"),
        "the host closed the store under a member: {}",
        p0.stderr()
    );
}

#[test]
fn the_store_hosts_death_ends_the_job_on_every_node_with_a_clear_error() {
    let mut job = Job::c10d("c10d-host", "2:2", 3, 1_000_000, 42);
    job.rdzv_conf = "last_call_timeout=1,keep_alive_ttl=2,outage_timeout=4".into();
    let mut pods = start(&job, 2);
    wait_until("a group of 2", &[&pods[0], &pods[1]], || {
        nth_start_world(&pods[0], 0, 2) && nth_start_world(&pods[1], 0, 2)
    });
    job.progresses(3, &[&pods[0], &pods[1]]);
    let step = job.step();
    pods[0].kill();
    // The survivor cannot keep a rendezvous nobody serves: it stops its workers and exits
    // with the "rendezvous unavailable" code once its outage allowance is spent, naming
    // what is gone. It does not hang and does not train on alone.
    let p1 = &mut pods[1];
    assert_eq!(p1.wait(LIMIT), 69, "{}", p1.output());
    assert!(
        p1.stderr().contains("the c10d store has not answered for")
            && p1.stderr().contains("a c10d job cannot outlive it"),
        "no reason given: {}",
        p1.stderr()
    );
    assert!(
        job.step() <= step + 3,
        "the survivor kept training without the store"
    );
    // Its outage lines name the store it lost (not etcd) and say when it will give up.
    let err = p1.stderr();
    let lost: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("connection lost") || l.contains("store lost"))
        .collect();
    assert!(!lost.is_empty(), "{err}");
    for l in &lost {
        assert!(
            l.contains("connection to the c10d store lost; reconnecting")
                && l.contains("gives_up_in="),
            "{l}"
        );
    }
}

#[test]
fn a_store_host_restarted_in_place_brings_the_job_back() {
    // Kubernetes restarts a failed pod in place, with its name and address: its new agent
    // serves an empty store, and the survivor registers again as after an etcd restart
    // without data. torchrun's c10d job ends here (pytorch#67742).
    let job = Job::c10d("c10d-back", "2:2", 3, 1_000_000, 43);
    let mut pods = start(&job, 2);
    wait_until("a group of 2", &[&pods[0], &pods[1]], || {
        nth_start_world(&pods[0], 0, 2) && nth_start_world(&pods[1], 0, 2)
    });
    job.progresses(3, &[&pods[0], &pods[1]]);
    pods[0].kill();
    let p0b = job.pod(0, &[]);
    let p1 = &pods[1];
    wait_until("the group back at 2 on the new store", &[&p0b, p1], || {
        nth_start_world(&p0b, 0, 2) && nth_start_world(p1, 1, 2)
    });
    assert!(p0b.stderr().contains(SERVING), "{}", p0b.stderr());
    let s = &starts(p1)[1];
    assert!(s.step > 0, "did not resume from the checkpoint: {s:?}");
    job.progresses(3, &[&p0b, p1]);
    // A restart of the store is a re-form or two, not a loop (once, the restarted
    // store handed out lease 1 again, the survivor revoked it as the dead host's, and
    // rounds were sealed 300 a second for 90 s).
    let logs = [p0b.stderr(), p1.stderr()];
    let sealed: usize = logs.iter().map(|l| l.matches("round sealed").count()).sum();
    assert!(
        sealed <= 5,
        "{sealed} rounds sealed\n{}\n{}",
        logs[0],
        logs[1]
    );
    assert!(
        logs.iter().all(|l| !l.contains("too fast")),
        "{}\n{}",
        logs[0],
        logs[1]
    );
}

/// Four pods in a group of 4, then the store's host (pod 0) SIGKILLed: the pods, the
/// host's dead.
fn four_with_their_host_killed(job: &Job) -> Vec<Pod> {
    let mut pods = start(job, 4);
    wait_until("a group of 4", &pods.iter().collect::<Vec<_>>(), || {
        pods.iter().all(|p| nth_start_world(p, 0, 4))
    });
    pods[0].kill();
    pods
}

/// Pod 0 started again as the new store host, once it and `others` are back at 4 (its
/// first start, their second).
fn new_host_back_at_four(job: &Job, others: &[Pod]) -> Pod {
    let p0b = job.pod(0, &[]);
    wait_until("the group back at 4 on the new store", &[&p0b], || {
        nth_start_world(&p0b, 0, 4) && others.iter().all(|p| nth_start_world(p, 1, 4))
    });
    p0b
}

/// A host restarted in place under four pods: the new host sealed at once with the first
/// two back, declared the others lost, then admitted one per round (5 to 6 rounds in
/// 0.6 s, and the pace net's "no node joining" error). It now waits a lease TTL for the
/// round's members to register again: at most 2 rounds, no error.
#[test]
fn a_store_host_restarted_under_four_pods_re_forms_in_at_most_two_rounds() {
    let job = Job::c10d("c10d-four", "2:4", 3, 1_000_000, 44);
    let pods = four_with_their_host_killed(&job);
    let others = &pods[1..];
    let p0b = new_host_back_at_four(&job, others);
    let log = p0b.stderr();
    let sealed = log.matches("round sealed").count();
    assert!(sealed <= 2, "{sealed} rounds sealed by the new host\n{log}");
    for l in std::iter::once(log.as_str()).chain(
        others
            .iter()
            .map(|p| p.stderr())
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    ) {
        assert!(!l.contains("too fast"), "{l}");
    }
    // The host's death is a node lost: nothing charged.
    assert!(
        others.iter().all(|p| starts(p)[1].restart == 0),
        "the host's restart was charged"
    );
}

/// A predecessor still holding the store's port at `host:port` for `secs` seconds: a
/// socket that listens and accepts nothing (bound as soon as the port is free).
fn hold_port(host: &str, port: &str, secs: u32) -> std::process::Child {
    use std::io::BufRead;
    let mut holder = std::process::Command::new(fsdp_tests::python())
        .args([
            "-c",
            &format!(
                "import socket, time\n\
                 s = socket.socket()\n\
                 s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                 for _ in range(100):\n\
                 \x20   try:\n\
                 \x20       s.bind(('{host}', {port}))\n\
                 \x20       break\n\
                 \x20   except OSError:\n\
                 \x20       time.sleep(0.05)\n\
                 s.listen(1)\n\
                 print('held', flush=True)\n\
                 time.sleep({secs})\n"
            ),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run the predecessor");
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "held",
        "the predecessor did not bind {host}:{port}"
    );
    holder
}

/// The same, but the new host's agent starts while the port is still held (its
/// predecessor not yet gone): it stands by, takes the port over, and then serves a store
/// as empty as one it started itself, so it waits for the round's members as such a host
/// does. Found under load: an agent whose standby took over before its join sealed at
/// once with the first two back and admitted the others one round each (3 rounds).
#[test]
fn a_restarted_host_whose_standby_took_the_port_over_re_forms_in_at_most_two_rounds() {
    let job = Job::c10d("c10d-standby", "2:4", 3, 1_000_000, 45);
    let pods = four_with_their_host_killed(&job);
    let endpoint = job.endpoint();
    let (host, port) = endpoint.rsplit_once(':').unwrap();
    // The predecessor, still holding the port for a second.
    let mut holder = hold_port(host, port, 1);
    let p0b = new_host_back_at_four(&job, &pods[1..]);
    let _ = holder.wait();
    let log = p0b.stderr();
    assert!(log.contains("the c10d standby takes over"), "{log}");
    let sealed = log.matches("round sealed").count();
    assert!(sealed <= 2, "{sealed} rounds sealed by the new host\n{log}");
}

#[test]
fn an_agent_whose_port_a_dying_predecessor_holds_serves_the_store_once_it_is_gone() {
    // A store host restarted in place can start while its SIGKILLed predecessor still
    // holds the port (a process not yet reaped, one in D state on a hung mount). Finding
    // the port taken, the new agent takes it for another agent's store and connects; when
    // the predecessor goes, nobody serves. It must bind again and serve. The predecessor
    // here is a socket that listens and accepts nothing, for 3 s.
    use fsdp_tests::{AgentCmd, TempDir, free_port, wait_for};
    use std::time::Duration;

    let dir = TempDir::new().unwrap();
    let port = free_port();
    let endpoint = format!("127.0.0.1:{port}");
    let mut holder = hold_port("127.0.0.1", &port.to_string(), 3);

    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint])
        // Elastic, so that the store serves the run (one fixed node runs standalone).
        .args(["--rdzv-id", "standby", "--nnodes", "1:2"])
        .args(["--rdzv-conf", "last_call_timeout=0"])
        .args(["--nproc-per-node", "1"])
        .args(["--no-python", "/bin/sh", "-c", "echo the-worker-ran"])
        .spawn();
    wait_for("the predecessor to exit", Duration::from_secs(30), || {
        holder.try_wait().unwrap().is_some()
    });
    a.wait(Duration::from_secs(90));
    assert_eq!(a.code(), 0, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("the c10d rendezvous store is served by another agent"),
        "the port was taken, yet the agent did not stand by: {err}"
    );
    assert!(err.contains("standby takes over"), "{err}");
    assert!(err.contains(SERVING), "{err}");
    assert!(a.stdout().contains("the-worker-ran"), "{}", a.output());
}
