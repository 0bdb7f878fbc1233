//! Topology-aware ranks with real agents on a real etcd: nodes that join interleaved
//! across two racks get contiguous ranks per rack; with `--segment-size 2` the world is
//! whole blocks of two nodes of one rack, and the odd node waits as a spare.

use std::path::Path;
use std::time::Duration;

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, TempDir, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

fn agent(dir: &Path, etcd: &Etcd, name: &str, segment: &str, extra: &[&str]) -> Agent {
    AgentCmd::new(dir, name)
        .env("FSDP_AGENT_SEGMENT", segment)
        .args(["--nproc-per-node", "1", "--max-restarts", "0"])
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--rdzv-id", "topology", "--local-addr", "127.0.0.1"])
        .args(["--rdzv-conf", "last_call_timeout=2"])
        .args(extra)
        .args(["--no-python", "/bin/sh", "-c", "sleep 600"])
        .spawn()
}

/// `key=` of the agent's last "group formed" line.
fn formed(a: &Agent, key: &str) -> Option<String> {
    let err = a.stderr();
    let line = err.lines().rev().find(|l| l.contains("group formed"))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .map(str::to_owned)
}

/// Starts the agents one after another, each registered before the next starts, so that
/// the join order is the order given.
fn start_in_order(dir: &Path, etcd: &Etcd, nodes: &[(&str, &str)], extra: &[&str]) -> Vec<Agent> {
    let mut out: Vec<Agent> = Vec::new();
    for (name, segment) in nodes {
        let a = agent(dir, etcd, name, segment, extra);
        wait_for("the agent in the rendezvous", LIMIT, || {
            a.stderr().contains("joined the rendezvous")
        });
        out.push(a);
    }
    out
}

#[test]
fn nodes_joining_across_two_racks_get_contiguous_ranks_per_rack() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let nodes = [
        ("a", "zone1/rack2"),
        ("b", "zone1/rack1"),
        ("c", "zone1/rack2"),
        ("d", "zone1/rack1"),
    ];
    let agents = start_in_order(dir.path(), &etcd, &nodes, &["--nnodes", "4"]);
    wait_for("a group of four", LIMIT, || {
        agents
            .iter()
            .all(|a| formed(a, "group_world_size").as_deref() == Some("4"))
    });
    let rank = |i: usize| formed(&agents[i], "group_rank").unwrap();
    // rack1 sorts first, each rack keeps its join order: b, d, then a, c.
    assert_eq!(
        [rank(1), rank(3), rank(0), rank(2)],
        ["0", "1", "2", "3"].map(String::from),
        "{}",
        agents[0].output()
    );
}

#[test]
fn with_segment_size_2_the_world_is_whole_blocks_of_one_rack_and_the_odd_node_waits() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let nodes = [
        ("a", "rack1"),
        ("b", "rack2"),
        ("c", "rack1"),
        ("d", "rack1"),
        ("e", "rack2"),
    ];
    let agents = start_in_order(
        dir.path(),
        &etcd,
        &nodes,
        &["--nnodes", "2:4", "--segment-size", "2"],
    );
    // rack1's first block (a, c) and rack2's (b, e); d, short of a block, waits.
    wait_for("a group of four", LIMIT, || {
        [0, 1, 2, 4]
            .iter()
            .all(|&i| formed(&agents[i], "group_world_size").as_deref() == Some("4"))
    });
    let rank = |i: usize| formed(&agents[i], "group_rank").unwrap();
    assert_eq!(
        [rank(0), rank(2), rank(1), rank(4)],
        ["0", "1", "2", "3"].map(String::from),
        "{}",
        agents[0].output()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        formed(&agents[3], "group_rank"),
        None,
        "{}",
        agents[3].output()
    );
    assert!(fsdp_tests::alive(agents[3].pid()), "{}", agents[3].output());
}
