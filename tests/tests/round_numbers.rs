//! Round numbers are never reused, even when the store forgets a round (an etcd restored
//! from an old snapshot sealed round 4 twice with different members, and keys indexed by
//! round could collide). Here the store forgets by the simplest means, the
//! round key deleted under two running agents; before, round 0 was sealed a second time.

use std::collections::BTreeMap;
use std::time::Duration;

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, TempDir, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

fn agent(etcd: &Etcd, dir: &std::path::Path, name: &str) -> Agent {
    AgentCmd::new(dir, name)
        .args(["--nnodes", "2", "--nproc-per-node", "1"])
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--rdzv-id", "numbers", "--local-addr", "127.0.0.1"])
        .args(["--rdzv-conf", "last_call_timeout=1"])
        .args(["--no-python", "sleep", "600"])
        .spawn()
}

/// The `round=N` of every `round sealed` line in `logs`, with how often each was sealed.
fn sealed(logs: &[String]) -> BTreeMap<u64, usize> {
    let mut n = BTreeMap::new();
    for l in logs.iter().flat_map(|l| l.lines()) {
        if let Some(r) = l.contains("round sealed").then(|| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("round=")?.parse::<u64>().ok())
        }) {
            *n.entry(r.expect("a round number")).or_insert(0) += 1;
        }
    }
    n
}

#[test]
fn a_round_the_store_forgot_is_never_sealed_again_under_its_number() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let (a, b) = (agent(&etcd, dir.path(), "a"), agent(&etcd, dir.path(), "b"));
    wait_for("a group of two", LIMIT, || {
        a.stderr().contains("workers started") && b.stderr().contains("workers started")
    });
    etcd.with_client(
        |mut c| async move { c.delete("/fsdp/numbers/ctl/round", None).await.unwrap() },
    );
    wait_for("the group back", LIMIT, || {
        a.stderr().matches("workers started").count() >= 2
            && b.stderr().matches("workers started").count() >= 2
    });
    std::thread::sleep(Duration::from_secs(1));
    let logs = [a.stderr(), b.stderr()];
    let counts = sealed(&logs);
    assert!(counts.len() >= 2, "{counts:?}\n{}\n{}", logs[0], logs[1]);
    assert!(
        counts.values().all(|n| *n == 1),
        "a round number sealed twice: {counts:?}\n{}\n{}",
        logs[0],
        logs[1]
    );
}
