//! The commonest first mistakes of a torchrun user, each with a real agent: one node of
//! two started (on etcd, on c10d, static), a run that never formed read back with
//! `fsdp-agent status`, and the restart budget's counts.

use std::time::Duration;

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{AgentCmd, TempDir, free_port, status_cmd};

const LIMIT: Duration = Duration::from_secs(90);

/// The first agent of a `--nnodes 2` run `run` on the etcd at `ep`.
fn one_of_two_on_etcd(dir: &std::path::Path, ep: &str, run: &str) -> AgentCmd {
    AgentCmd::new(dir, "alone")
        .args(["--nnodes", "2", "--rdzv-backend", "etcd"])
        .args(["--rdzv-endpoint", ep, "--rdzv-id", run])
}

/// `--nnodes 2` on etcd with one node started: the waiting line every 30 s, then at the
/// join timeout one line with the count and the fix (it was Rust debug text after 600 s
/// of silence), and `fsdp-agent status` says why the run ended (it said `no run`).
#[test]
fn a_node_alone_on_etcd_says_what_it_waits_for_then_gives_up_in_words() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let dir = TempDir::new().unwrap();
    let mut a = one_of_two_on_etcd(dir.path(), &ep, "alone")
        .args(["--rdzv-conf", "join_timeout=33"])
        .args(["--no-python", "true"])
        .run(LIMIT);
    assert_eq!(a.code(), 69, "{}", a.output());
    let err = a.stderr();
    let place = format!("(run 'alone' on etcd at {ep})");
    let waiting = format!(
        "waiting for nodes: 1 of min 2 present {place} for 30 s; start the others with the same --rdzv-id, or lower --nnodes"
    );
    assert!(err.contains(&waiting), "{err}");
    let end = format!(
        "fsdp-agent: error: no round formed within join_timeout (33 s): waiting for nodes: 1 of min 2 present {place}; start the others with the same --rdzv-id, or lower --nnodes"
    );
    assert!(err.contains(&end), "{err}");

    let (code, out, stderr) = status_cmd(&["--rdzv-endpoint", &ep, "--rdzv-id", "alone"]);
    assert_eq!(code, 0, "{out}{stderr}");
    assert!(out.contains("stopped"), "{out}");
    assert!(out.contains("no round ever formed"), "{out}");
    assert!(out.contains("join_timeout (33 s)"), "{out}");
}

/// The same on c10d: the agent serves the store itself, and names it.
#[test]
fn a_node_alone_on_c10d_names_the_store_it_waits_on() {
    let dir = TempDir::new().unwrap();
    let port = free_port();
    let ep = format!("127.0.0.1:{port}");
    let mut a = AgentCmd::new(dir.path(), "alone")
        .args([
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &ep,
        ])
        .args(["--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=4"])
        .args(["--no-python", "true"])
        .run(LIMIT);
    assert_eq!(a.code(), 69, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains(&format!(
            "no round formed within join_timeout (4 s): waiting for nodes: 1 of min 2 present (run 'none' on the c10d store at {ep}); start the others with the same --rdzv-endpoint and --rdzv-id, or lower --nnodes"
        )),
        "{err}"
    );
}

/// A run whose only agent got Ctrl-C before any round: status said `forming: 0 node(s)
/// registered` beside the row saying it stopped.
#[test]
fn an_interrupted_run_that_never_formed_reads_as_ended() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let dir = TempDir::new().unwrap();
    let mut a = one_of_two_on_etcd(dir.path(), &ep, "ctrlc")
        .args(["--no-python", "true"])
        .spawn();
    fsdp_tests::wait_for("the agent joined", LIMIT, || {
        a.stderr().contains("joined the rendezvous")
    });
    a.signal(libc::SIGINT);
    assert_eq!(a.code(), 130, "{}", a.output());
    let (code, out, stderr) = status_cmd(&["--rdzv-endpoint", &ep, "--rdzv-id", "ctrlc"]);
    assert_eq!(code, 0, "{out}{stderr}");
    assert!(out.contains("stopped"), "{out}");
    assert!(!out.contains("forming"), "{out}");
}

/// A static `--nnodes 2` job with one node started starts no worker (it started them at
/// once, to hang in `init_process_group` for PyTorch's 30 minutes); the second node's
/// arrival starts both.
#[test]
fn a_static_job_starts_no_worker_until_every_node_is_there() {
    let dir = TempDir::new().unwrap();
    let port = free_port().to_string();
    let marks = dir.path().join("started");
    std::fs::create_dir(&marks).unwrap();
    let node = |rank: &str| {
        AgentCmd::new(dir.path(), &format!("node{rank}"))
            .args([
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--nproc-per-node",
                "2",
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["--no-python", "sh", "-c"])
            .arg(format!("touch {}/$RANK", marks.display()))
            .spawn()
    };
    let mut n0 = node("0");
    std::thread::sleep(Duration::from_secs(10));
    let started = std::fs::read_dir(&marks).unwrap().count();
    assert_eq!(
        started,
        0,
        "a worker started with one node of two\n{}",
        n0.output()
    );
    assert!(fsdp_tests::alive(n0.pid()), "{}", n0.output());
    let mut n1 = node("1");
    assert_eq!(n1.code(), 0, "{}", n1.output());
    assert_eq!(n0.code(), 0, "{}", n0.output());
    let mut ranks: Vec<String> = std::fs::read_dir(&marks)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    ranks.sort();
    assert_eq!(ranks, ["0", "1", "2", "3"]);
    assert!(
        n0.stderr()
            .contains("every node of the static group is here"),
        "{}",
        n0.output()
    );
    // Loopback is fine here (both nodes on this machine), and said once all the same.
    assert!(
        n0.stderr().contains("is this machine's loopback"),
        "{}",
        n0.output()
    );
}

/// Alone at the join timeout, each side of a static group says what it waited for.
#[test]
fn a_static_node_alone_gives_up_at_its_join_timeout_with_the_count_and_the_fix() {
    let dir = TempDir::new().unwrap();
    let port = free_port().to_string();
    let alone = |rank: &str| {
        let mut a = AgentCmd::new(dir.path(), &format!("node{rank}"))
            .args([
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--rdzv-conf",
                "join_timeout=3",
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["--no-python", "true"])
            .run(LIMIT);
        assert_eq!(a.code(), 69, "{}", a.output());
        a.stderr()
    };
    let at = format!("(static group at 127.0.0.1:{port})");
    let err = alone("0");
    assert!(
        err.contains(&format!(
            "fsdp-agent: error: no group formed within join_timeout (3 s): waiting for nodes: 1 of 2 present, missing node rank 1 {at}; start the others with --nnodes 2 and their own --node-rank, or lower --nnodes"
        )),
        "{err}"
    );
    let err = alone("1");
    assert!(
        err.contains(&format!(
            "no group formed within join_timeout (3 s): waiting for node rank 0 to answer {at}; start node rank 0 with the same --master-addr and --master-port"
        )),
        "{err}"
    );
}

/// Two nodes that claim one node rank: the second is refused in one line (exit 64).
#[test]
fn a_static_node_with_a_taken_rank_is_refused() {
    let dir = TempDir::new().unwrap();
    let port = free_port().to_string();
    let node = |name: &str, rank: &str| {
        AgentCmd::new(dir.path(), name)
            .args(["--nnodes", "3", "--node-rank", rank])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["--no-python", "true"])
    };
    let _n0 = node("n0", "0").spawn();
    let _first = node("first", "1").spawn();
    // Both knock at node 0's gate; the first holds rank 1 when the second comes.
    std::thread::sleep(Duration::from_secs(3));
    let mut second = node("second", "1").run(LIMIT);
    assert_eq!(second.code(), 64, "{}", second.output());
    assert!(
        second.stderr().contains(
            "refused this node: node rank 1 is already here; give each node its own --node-rank"
        ),
        "{}",
        second.output()
    );
}

/// Restart counts that read right: with `--max-restarts 0` the first failure ends the job
/// and no restart ever happened (it said `restart_count=1 max_restarts=0`).
#[test]
fn the_budget_line_counts_failures_not_restarts() {
    for (max, failures) in [("0", 1), ("1", 2)] {
        let dir = TempDir::new().unwrap();
        let mut a = AgentCmd::new(dir.path(), "a")
            .args(["--standalone", "--max-restarts", max])
            .args(["--no-python", "sh", "-c", "exit 3"])
            .run(LIMIT);
        assert_eq!(a.code(), 3, "{}", a.output());
        let err = a.stderr();
        let line = err
            .lines()
            .find(|l| l.contains("the restart budget is spent; giving up"))
            .unwrap_or_else(|| panic!("{err}"));
        assert!(
            line.contains(&format!("failures={failures} max_restarts={max}")),
            "{line}"
        );
        assert!(!line.contains("restart_count"), "{line}");
        if max == "1" {
            assert!(err.contains("restart 1 of 1"), "{err}");
        }
    }
}
