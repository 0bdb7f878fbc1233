//! Hostile conditions that outside testing found the agent did not survive:
//! error exits that left workers' children behind, an agent frozen past its lease, a
//! stdout nobody reads, a duplicated SIGTERM, a run prefix nested in another run, forged
//! records in etcd, and a status that showed a finished worker as running.

use std::path::Path;
use std::time::Duration;

use fsdp_proto::v1::agent_status_client::AgentStatusClient;
use fsdp_proto::v1::{GetStatusRequest, WorkerState};
use fsdp_rendezvous::etcd::{EtcdConfig, EtcdRendezvous, Keys, connect};
use fsdp_rendezvous::{Rendezvous, RendezvousError};
use fsdp_tests::etcd::Etcd;
use fsdp_tests::{
    Agent, AgentCmd, TempDir, alive, fake_worker_args, records, signal_pod, wait_for,
};
use prost::Message;

const LIMIT: Duration = Duration::from_secs(60);

fn pids(dir: &Path, kind: &str) -> Vec<i32> {
    records(dir, kind)
        .values()
        .map(|p| p.trim().parse().expect("a pid"))
        .collect()
}

/// An agent on the etcd rendezvous, alone in its run unless another joins.
fn etcd_agent(dir: &Path, etcd: &Etcd, run: &str, conf: &str, worker: &[&str]) -> Agent {
    AgentCmd::new(dir, run)
        .args([
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            run,
            "--rdzv-conf",
            conf,
            "--local-addr",
            "127.0.0.1",
            // Its own logs go with the test's directory, not to a default one in /tmp.
            "--log-dir",
            &dir.join("logs").to_string_lossy(),
        ])
        .args(fake_worker_args(dir, worker))
        .spawn()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Like [`wait_for`], with the agent's output in the failure message.
fn until(a: &Agent, what: &str, mut cond: impl FnMut(&Agent) -> bool) {
    let end = std::time::Instant::now() + LIMIT;
    while !cond(a) {
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}\n{}",
            a.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn group_formed_count(a: &Agent) -> usize {
    a.stderr().matches("group formed").count()
}

#[test]
fn a_rendezvous_error_mid_run_stops_every_worker_process_group() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let mut a = etcd_agent(
        dir.path(),
        &etcd,
        "errexit",
        "last_call_timeout=0.2,keep_alive_ttl=2",
        &["--sleep", "120", "--spawn-child"],
    );
    wait_for("both workers and their children", LIMIT, || {
        pids(dir.path(), "child").len() == 2 && pids(dir.path(), "pid").len() == 2
    });
    let (workers, children) = (pids(dir.path(), "pid"), pids(dir.path(), "child"));
    // Garbage in the run's round key: the agent must give up with a clear error...
    runtime().block_on(async {
        let mut c = connect(&EtcdConfig::new(vec![etcd.endpoint()], "errexit", 1, 2).options)
            .await
            .unwrap();
        let keys = Keys::new("/fsdp", "errexit").unwrap();
        c.put(
            keys.key::<fsdp_proto::v1::Round>(""),
            b"\xde\xad not a round".to_vec(),
            None,
        )
        .await
        .unwrap();
    });
    assert_eq!(a.code(), 69, "{}", a.output());
    assert!(
        a.stderr().contains("/fsdp/errexit/ctl/round"),
        "{}",
        a.output()
    );
    // ...and leave nothing behind: not the workers, not what they started.
    wait_for(
        "every worker process to be gone",
        Duration::from_secs(10),
        || workers.iter().chain(&children).all(|p| !alive(*p)),
    );
}

/// Freezes an agent and `workers` of its for `secs` ([`signal_pod`]).
fn freeze(agent: i32, workers: &[i32], secs: u64) {
    use nix::sys::signal::Signal;
    signal_pod(agent, workers, Signal::SIGSTOP);
    std::thread::sleep(Duration::from_secs(secs));
    signal_pod(agent, workers, Signal::SIGCONT);
}

/// Groups of two nodes this agent has formed so far.
fn pairs_formed(a: &Agent) -> usize {
    a.stderr()
        .lines()
        .filter(|l| l.contains("group formed") && l.contains("group_world_size=2"))
        .count()
}

#[test]
fn an_agent_frozen_past_its_lease_rejoins_as_a_new_node() {
    let etcd = Etcd::start();
    let (dir_a, dir_b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let conf = "last_call_timeout=0.2,keep_alive_ttl=2,straggler_timeout=5";
    let mut a = etcd_agent(dir_a.path(), &etcd, "frozen", conf, &["--sleep", "600"]);
    let mut b = etcd_agent(dir_b.path(), &etcd, "frozen", conf, &["--sleep", "600"]);
    until(&a, "a group of both nodes", |a| pairs_formed(a) >= 1);
    until(&b, "a group of both nodes", |b| pairs_formed(b) >= 1);

    // The agent alone (its workers keep running), for more than two lease TTLs: the
    // other node re-forms without it, and it must come back rather than exit.
    let before = pairs_formed(&a);
    freeze(a.pid(), &[], 5);
    until(
        &a,
        "both nodes together again after the agent's freeze",
        |a| pairs_formed(a) > before,
    );
    assert!(a.child.try_wait().unwrap().is_none(), "{}", a.output());

    // The whole pod: the agent and the workers it runs now.
    let before = pairs_formed(&a);
    let workers = || -> Vec<i32> {
        let all = pids(dir_a.path(), "pid");
        all.into_iter().filter(|p| alive(*p)).collect()
    };
    // The workers of the new group, once both have started.
    wait_for("the new group's two workers", LIMIT, || {
        workers().len() == 2
    });
    freeze(a.pid(), &workers(), 5);
    until(
        &a,
        "both nodes together again after the pod's freeze",
        |a| pairs_formed(a) > before,
    );
    for agent in [&mut a, &mut b] {
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "{}",
            agent.output()
        );
        assert!(
            !agent.stderr().contains("lease not found"),
            "{}",
            agent.output()
        );
        agent.signal(libc::SIGTERM);
        assert_eq!(agent.code(), 143, "{}", agent.output());
    }
}

#[test]
fn an_agent_whose_stdout_nobody_reads_still_exits_on_sigterm() {
    let dir = TempDir::new().unwrap();
    let (read_end, write_end) = nix::unistd::pipe().expect("pipe");
    let noisy = "while :; do echo 'a line of worker output that nobody is reading'; done";
    let mut cmd = std::process::Command::new(fsdp_tests::agent_bin());
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--term-timeout",
        "2",
    ])
    .args(["--no-python", "/bin/sh", "-c", noisy])
    .env("FSDP_STATUS_ADDR", "off")
    // Its default log directory goes with the test's.
    .env("TMPDIR", dir.path())
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::from(write_end))
    .stderr(std::fs::File::create(dir.path().join("agent.stderr")).unwrap());
    let mut child = cmd.spawn().expect("spawn the agent");
    let stderr = || std::fs::read_to_string(dir.path().join("agent.stderr")).unwrap_or_default();
    wait_for("the workers to start", LIMIT, || {
        stderr().contains("workers started")
    });
    // Long enough for the pipe, the console queue and the workers' pipes to fill.
    std::thread::sleep(Duration::from_secs(2));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the agent did not exit with a full stdout pipe:\n{}",
                stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(read_end);
    assert_eq!(status.code(), Some(143), "{}", stderr());
}

#[test]
fn a_duplicated_sigterm_is_one_request_and_workers_keep_their_grace() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--term-timeout",
            "30",
        ])
        .args(fake_worker_args(
            dir.path(),
            &["--sleep", "120", "--checkpoint-on-term", "3"],
        ))
        .spawn();
    wait_for("both workers", LIMIT, || pids(dir.path(), "pid").len() == 2);
    // As GNU timeout or Slurm do: the agent, then its process group, at once.
    a.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(20));
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
    assert_eq!(
        records(dir.path(), "checkpoint").len(),
        2,
        "every worker finished its checkpoint\n{}",
        a.output()
    );
    assert!(!a.stderr().contains("second signal"), "{}", a.output());
}

#[test]
fn a_run_prefix_nested_in_another_run_is_refused_and_harms_nothing() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let mut train = etcd_agent(
        dir.path(),
        &etcd,
        "train",
        "last_call_timeout=0.2,keep_alive_ttl=2",
        &["--sleep", "600"],
    );
    wait_for("the live run's group", LIMIT, || {
        group_formed_count(&train) == 1
    });
    // One agent of run `id` under `prefix`: refused (64), and what it said.
    let refused = |id: &str, prefix: &str| {
        let other = TempDir::new().unwrap();
        let mut a = AgentCmd::new(other.path(), id)
            .args([
                "--nnodes",
                "1",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &etcd.endpoint(),
                "--rdzv-id",
                id,
                "--rdzv-conf",
                &format!("etcd_prefix={prefix},last_call_timeout=0.2,keep_alive_ttl=2"),
            ])
            .args(fake_worker_args(other.path(), &["--sleep", "5"]))
            .run(LIMIT);
        assert_eq!(a.code(), 64, "{id} under {prefix}: {}", a.output());
        a.stderr()
    };
    for prefix in ["/fsdp/train/members", "/fsdp/train", "/fsdp/train/ctl"] {
        let said = refused("x", prefix);
        assert!(said.contains("etcd_prefix"), "{prefix}: {said}");
    }
    // A run around the live one: its root, /fsdp/, holds the live run's keys, which only
    // the reads of the gaps between a run's own keys can find.
    let said = refused("fsdp", "/");
    assert!(said.contains("another run's keys (/fsdp/train/"), "{said}");
    // The live run never noticed.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        train.child.try_wait().unwrap().is_none(),
        "{}",
        train.output()
    );
    assert_eq!(group_formed_count(&train), 1, "{}", train.output());
    train.signal(libc::SIGTERM);
    assert_eq!(train.code(), 143, "{}", train.output());
}

fn rdzv_config(etcd: &Etcd, run: &str) -> EtcdConfig {
    let mut c = EtcdConfig::new(vec![etcd.endpoint()], run, 1, 2);
    c.keep_alive_ttl = Duration::from_secs(2);
    c.last_call = Duration::from_millis(200);
    c.join_timeout = Duration::from_secs(20);
    c.straggler_timeout = Duration::from_secs(10);
    c.options.retry_window = Duration::from_secs(10);
    c.local_world_size = 2;
    c
}

/// Writes `value` at `key` (no lease) on the test's own connection.
async fn forge(etcd: &Etcd, key: String, value: Vec<u8>) {
    let mut c = connect(&rdzv_config(etcd, "x").options).await.unwrap();
    c.put(key, value, None).await.unwrap();
}

async fn expect_corrupt(n: &mut EtcdRendezvous, what: &str) -> String {
    let r = tokio::time::timeout(Duration::from_secs(15), n.next_round())
        .await
        .unwrap_or_else(|_| panic!("{what}: a hang instead of an error"));
    match r {
        Err(e @ RendezvousError::Corrupt(_)) => e.to_string(),
        Err(e) => panic!("{what}: expected a corrupt-record error, got {e}"),
        Ok(r) => panic!("{what}: a forged record was trusted: {r:?}"),
    }
}

fn member(id: &str, local_world_size: u32) -> fsdp_proto::v1::Member {
    fsdp_proto::v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: id.into(),
        addr: "127.0.0.1".into(),
        local_world_size,
        wants_round: 0,
        ..Default::default()
    }
    .into()
}

#[tokio::test]
async fn a_round_that_gives_this_node_a_forged_worker_count_is_refused() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "forged").unwrap();
    // Two nodes needed: the node's own coordinator never seals, only the forger does.
    let mut cfg = rdzv_config(&etcd, "forged");
    cfg.min_nodes = 2;
    let mut n = EtcdRendezvous::connect(cfg).await.unwrap();
    let me = n.node_id().to_owned();
    let forger = async {
        // Once the node waits for round 0: a round 0 that says it runs 5 workers, not 2.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let round = fsdp_proto::v1::Round {
            schema: fsdp_proto::SCHEMA_VERSION,
            number: 0,
            members: vec![member(&me, 5)],
            restart_count: 0,
            reason: "forged".into(),
            ..Default::default()
        };
        forge(
            &etcd,
            keys.key::<fsdp_proto::v1::Round>(""),
            round.encode_to_vec(),
        )
        .await;
        let master = fsdp_proto::v1::Master {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: 0,
            addr: "127.0.0.1".into(),
            port: 29_999,
        };
        forge(
            &etcd,
            keys.key::<fsdp_proto::v1::Master>(""),
            master.encode_to_vec(),
        )
        .await;
    };
    let (text, ()) = tokio::join!(
        expect_corrupt(&mut n, "local_world_size 5 for a node of 2"),
        forger
    );
    assert!(text.contains("local_world_size 5"), "{text}");
}

#[tokio::test]
async fn a_member_without_a_lease_or_with_a_huge_worker_count_is_refused() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "wrap").unwrap();
    // 2^32-1 workers would wrap the rank arithmetic of a u32.
    forge(
        &etcd,
        keys.key::<fsdp_proto::v1::Member>("ghost"),
        member("ghost", u32::MAX).encode_to_vec(),
    )
    .await;
    let mut n = EtcdRendezvous::connect(rdzv_config(&etcd, "wrap"))
        .await
        .unwrap();
    // Refused and ignored, not fatal: the node forms its round without the ghost.
    let r = tokio::time::timeout(Duration::from_secs(15), n.next_round())
        .await
        .expect("a round, not a hang")
        .expect("a round, not an error");
    let ids: Vec<&str> = r.members.iter().map(|m| m.node_id()).collect();
    assert_eq!(ids, [n.node_id()], "the ghost was trusted");
    let refused = n.view().refused;
    let why = &refused[&keys.key::<fsdp_proto::v1::Member>("ghost")];
    assert!(why.contains("lease"), "{why}");
}

#[tokio::test]
async fn a_master_port_out_of_range_is_refused() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "port").unwrap();
    let mut n = EtcdRendezvous::connect(rdzv_config(&etcd, "port"))
        .await
        .unwrap();
    let me = n.node_id().to_owned();
    let round = fsdp_proto::v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 5,
        members: vec![member(&me, 2)],
        restart_count: 0,
        reason: "forged".into(),
        ..Default::default()
    };
    forge(
        &etcd,
        keys.key::<fsdp_proto::v1::Round>(""),
        round.encode_to_vec(),
    )
    .await;
    let master = fsdp_proto::v1::Master {
        schema: fsdp_proto::SCHEMA_VERSION,
        round: 5,
        addr: "127.0.0.1".into(),
        port: 65_536 + 80,
    };
    forge(
        &etcd,
        keys.key::<fsdp_proto::v1::Master>(""),
        master.encode_to_vec(),
    )
    .await;
    // Refused and ignored: the node never starts round 5 on it; it seals a round of its
    // own and publishes its own master at that key.
    let r = tokio::time::timeout(Duration::from_secs(15), n.next_round())
        .await
        .expect("a round, not a hang")
        .expect("a round, not an error");
    assert!(r.number > 5, "a round on a forged master: {r:?}");
    assert_ne!(u32::from(r.master_port), 65_616);
}

#[test]
fn get_status_shows_a_worker_that_exited_0_as_succeeded() {
    let dir = TempDir::new().unwrap();
    // Local rank 0 exits 0 at once; local rank 1 runs on.
    let script = "if [ \"$LOCAL_RANK\" = 0 ]; then exit 0; else exec sleep 600; fi";
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--nproc-per-node", "2"])
        .args(["--no-python", "/bin/sh", "-c", script])
        .spawn();
    let addr = a.status_addr();
    let rt = runtime();
    let states = || {
        rt.block_on(async {
            let mut c = AgentStatusClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            let s = c
                .get_status(GetStatusRequest {})
                .await
                .unwrap()
                .into_inner();
            s.workers
                .iter()
                .map(|w| (w.local_rank, w.state()))
                .collect::<Vec<_>>()
        })
    };
    wait_for("rank 0 shown as succeeded", Duration::from_secs(20), || {
        states() == [(0, WorkerState::Succeeded), (1, WorkerState::Running)]
    });
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
}

#[test]
fn a_status_command_error_is_one_complete_line() {
    let (code, out, err) = fsdp_tests::status_cmd(&["--rdzv-id", "x"]);
    assert_eq!(code, 64, "{out}{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("--rdzv-endpoint"), "{err}");
}

/// Writes a halt with `code` into the c10d store at `endpoint`, as a process that is not
/// an agent (the store is open: no password configured). It names `node`, a member of the
/// round, as its writer: a halt from outside the round is refused whatever its code
/// (tests/tests/forged_records.rs), and here only the code is to decide.
fn forge_halt(endpoint: &str, run: &str, code: u32, node: &str) {
    let halt = fsdp_proto::v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: node.into(),
        exit_code: code,
        reason: "forged".into(),
        round: 0,
    };
    let key = Keys::new("/fsdp", run)
        .unwrap()
        .key::<fsdp_proto::v1::Halt>("");
    runtime().block_on(async {
        let mut c = etcd_client::Client::connect([endpoint], None)
            .await
            .unwrap();
        c.put(key, halt.encode_to_vec(), None).await.unwrap();
    });
}

#[test]
fn a_forged_halt_with_code_0_never_ends_a_c10d_job_as_a_success() {
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", fsdp_tests::free_port());
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint])
        // Elastic, so that the store serves the run (one fixed node runs standalone).
        .args(["--rdzv-id", "forged-halt", "--nnodes", "1:2"])
        .args(["--rdzv-conf", "last_call_timeout=0"])
        .args(["--nproc-per-node", "1", "--no-retry-exit-codes", "3"])
        .args(["--no-python", "/bin/sh", "-c", "exec sleep 600"])
        .spawn();
    wait_for("workers started", Duration::from_secs(60), || {
        a.stderr().contains("workers started")
    });
    let me = a
        .stderr()
        .lines()
        .find(|l| l.contains("joined the rendezvous"))
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("node_id="))
        })
        .expect("the agent's node id")
        .trim_matches('"')
        .to_owned();
    forge_halt(&endpoint, "forged-halt", 0, &me);
    wait_for("the forged halt refused", Duration::from_secs(20), || {
        a.stderr().contains("refused a record")
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        alive(a.pid()),
        "the agent obeyed a forged halt: {}",
        a.stderr()
    );
    assert!(a.stderr().contains("exit code 0"), "{}", a.stderr());
    // `fsdp-agent status` shows what the agents accepted: the forgery as refused.
    let (_, text, err) = fsdp_tests::status_cmd(&[
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "forged-halt",
    ]);
    assert!(
        text.contains("refused") && text.contains("exit code 0"),
        "{text}{err}"
    );
    assert!(!text.contains("halted"), "{text}");
    // A halt this node's policy writes (code 3, --no-retry-exit-codes) is obeyed: the
    // forgery reached the agent, and only the code made it refuse.
    forge_halt(&endpoint, "forged-halt", 3, &me);
    a.wait(Duration::from_secs(60));
    assert_eq!(a.code(), 3, "{}", a.stderr());
}
