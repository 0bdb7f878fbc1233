//! Livelocks outside testing found: an agent that lost its lease, or a store that
//! came back empty, sealed rounds forever — hundreds a second, no exit code, etcd growing.
//! Each reproduction is kept here as it was found; the deterministic halves of the same
//! causes are unit tests beside the code (`detect`, the coordinator's pace, the store's
//! lease ids).

use std::time::Duration;

use fsdp_rendezvous::etcd::{EtcdConfig, Keys, connect, lease_holds};
use fsdp_tests::etcd::Etcd;
use fsdp_tests::{AgentCmd, TempDir, metrics_text, wait_for};

/// The command, with a shorter last sleep: the worker of the first attempt freezes
/// its own agent for 8 s with a 3 s lease TTL, as a node swapping hard or a VM pause
/// would. Before the fix, after the thaw the agent sealed ~600 rounds a second, each
/// "the round broke before it started ... MemberLost { node: <itself> }", in 4 runs of 5.
#[test]
fn an_agent_frozen_past_its_lease_restarts_its_worker_once_and_finishes() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let script = "echo start restart=$TORCHELASTIC_RESTART_COUNT; \
        if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then \
        sleep 2; P=$PPID; kill -STOP $P; (sleep 8; kill -CONT $P) & fi; exec sleep 4";
    let mut agent = AgentCmd::new(dir.path(), "frozen")
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-conf",
            "keep_alive_ttl=3,straggler_timeout=10",
            "--rdzv-id",
            "stoploop",
            "--max-restarts",
            "1",
            "--term-timeout",
            "2",
            "--no-python",
            "/bin/sh",
            "-c",
            script,
        ])
        .spawn();
    let addr = agent.status_addr();
    // The second attempt runs for 4 s: long enough to read what the coordinator counted.
    let mut sealed = None;
    wait_for("the worker's second start", Duration::from_secs(60), || {
        agent.stdout().contains("start restart=1")
            || agent.child.try_wait().ok().flatten().is_some()
    });
    if agent.child.try_wait().unwrap().is_none() {
        let text = metrics_text(&addr);
        sealed = text
            .lines()
            .find_map(|l| l.strip_prefix("fsdp_agent_rounds_sealed_total "))
            .map(|v| v.trim().parse::<f64>().unwrap());
    }
    let code = agent.code();
    let out = agent.output();
    assert_eq!(code, 0, "{out}");
    let starts: Vec<&str> = agent_lines(&out, "start restart=");
    assert_eq!(starts, ["start restart=0", "start restart=1"], "{out}");
    let rounds = out.matches("round sealed").count();
    assert!(
        (2..=5).contains(&rounds),
        "{rounds} rounds sealed for one freeze\n{out}"
    );
    assert!(!out.contains("broke before it started"), "{out}");
    assert!(
        !out.contains("too fast"),
        "the safety net was not needed\n{out}"
    );
    assert_eq!(sealed, Some(2.0), "fsdp_agent_rounds_sealed_total\n{out}");
}

fn agent_lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// A ring watcher that proved a node dead revokes the lease the round names for it only
/// while that lease still holds the node's registration: the node may have registered
/// again since, and a store restarted empty may have handed the id to another agent (the
/// second reproduction: it revoked the restarted store host's own new lease).
#[test]
fn a_lease_is_revoked_for_a_dead_node_only_while_it_holds_that_nodes_registration() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg = EtcdConfig::new(vec![etcd.endpoint()], "revoke", 1, 2);
        let mut c = connect(&cfg.options).await.unwrap();
        let keys = Keys::new("/fsdp", "revoke").unwrap();
        let old = c.lease_grant(30, None).await.unwrap().id();
        let new = c.lease_grant(30, None).await.unwrap().id();
        let put = |lease| etcd_client::PutOptions::new().with_lease(lease);
        c.put(
            keys.key::<fsdp_proto::v1::Member>("a"),
            b"a".to_vec(),
            Some(put(old)),
        )
        .await
        .unwrap();
        assert!(lease_holds(&mut c, &keys, "a", old).await.unwrap());
        assert!(!lease_holds(&mut c, &keys, "a", new).await.unwrap());
        assert!(
            !lease_holds(&mut c, &keys, "b", old).await.unwrap(),
            "no key"
        );
        // The node registered again on a new lease: the old id proves nothing any more.
        c.put(
            keys.key::<fsdp_proto::v1::Member>("a"),
            b"a".to_vec(),
            Some(put(new)),
        )
        .await
        .unwrap();
        assert!(!lease_holds(&mut c, &keys, "a", old).await.unwrap());
        assert!(lease_holds(&mut c, &keys, "a", new).await.unwrap());
    });
}
