//! Records forged by anyone who can write the store, against real agents on a
//! real etcd: each is refused, never obeyed, and `fsdp-agent status` shows it as refused
//! and prints none of its control characters.

use std::time::Duration;

use fsdp_rendezvous::etcd::Keys;
use fsdp_tests::etcd::Etcd;
use fsdp_tests::{AgentCmd, TempDir, status_cmd, wait_for};
use prost::Message;

const LIMIT: Duration = Duration::from_secs(60);

fn put(etcd: &Etcd, key: String, value: Vec<u8>) {
    etcd.with_client(|mut c| async move { c.put(key, value, None).await.unwrap() });
}

fn keys(run: &str) -> Keys {
    Keys::new("/fsdp", run).unwrap()
}

/// One put of `ctl/quarantine/<machine>` with `until_ms = u64::MAX` made every agent that
/// started on that machine exit 80, for ever, even with `--quarantine-after 0`.
#[test]
fn a_forged_quarantine_keeps_no_agent_out() {
    let etcd = Etcd::start();
    for (run, after) in [("q-default", "3"), ("q-off", "0")] {
        let q = fsdp_proto::v1::Quarantine {
            schema: fsdp_proto::SCHEMA_VERSION,
            machine: "host-7".into(),
            node_id: "intruder".into(),
            reason: "forged".into(),
            until_ms: u64::MAX,
        };
        put(&etcd, keys(run).of(&q), q.encode_to_vec());
        let dir = TempDir::new().unwrap();
        let mut a = AgentCmd::new(dir.path(), run)
            .args(["--nnodes", "1", "--rdzv-backend", "etcd"])
            .args(["--rdzv-endpoint", &etcd.endpoint(), "--rdzv-id", run])
            .args(["--node-name", "host-7", "--quarantine-after", after])
            .args(["--no-python", "true"])
            .run(LIMIT);
        assert_eq!(a.code(), 0, "{run}: {}", a.output());
        let err = a.stderr();
        assert_eq!(err.matches("refused a record").count(), 1, "{run}: {err}");
        assert!(!err.contains("quarantined"), "{run}: {err}");
    }
}

/// A halt with code 78 from `evil-node`, a node of no round, ended every agent with 78.
#[test]
fn a_halt_from_outside_the_round_ends_nobody() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "a")
        .args(["--nnodes", "1", "--rdzv-backend", "etcd"])
        .args(["--rdzv-endpoint", &etcd.endpoint(), "--rdzv-id", "evil"])
        .args(["--no-python", "sleep", "600"])
        .spawn();
    wait_for("workers started", LIMIT, || {
        a.stderr().contains("workers started")
    });
    let halt = fsdp_proto::v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "evil-node".into(),
        exit_code: 78,
        reason: "forged".into(),
        round: 0,
    };
    put(
        &etcd,
        keys("evil").key::<fsdp_proto::v1::Halt>(""),
        halt.encode_to_vec(),
    );
    wait_for("the forged halt refused", LIMIT, || {
        a.stderr().contains("member of neither round")
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(fsdp_tests::alive(a.pid()), "{}", a.output());
    // One refusal, one line: the same refusal was logged twice.
    assert_eq!(
        a.stderr().matches("refused a record").count(),
        1,
        "{}",
        a.output()
    );
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
}

/// Status judged records with no rules of the run: a refused halt showed as `halted`, a
/// 50-node round of a `--nnodes 2` run as the round, and a forged key's ESC reached the
/// terminal (it cleared the screen and printed a fake `health healthy` line).
#[test]
fn status_judges_as_the_agents_do_and_prints_no_control_character() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "a")
        .args(["--nnodes", "1:2", "--rdzv-backend", "etcd"])
        .args(["--rdzv-endpoint", &etcd.endpoint(), "--rdzv-id", "st"])
        .args(["--rdzv-conf", "last_call_timeout=0"])
        .args(["--no-python", "sleep", "600"])
        .spawn();
    wait_for("workers started", LIMIT, || {
        a.stderr().contains("workers started")
    });
    let k = keys("st");
    let halt = fsdp_proto::v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "evil-node".into(),
        exit_code: 42,
        reason: "forged".into(),
        round: 0,
    };
    put(
        &etcd,
        k.key::<fsdp_proto::v1::Halt>(""),
        halt.encode_to_vec(),
    );
    let left = fsdp_proto::v1::Left {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "x".into(),
        incarnation: 1,
        addr: "10.0.0.1".into(),
        kind: fsdp_proto::v1::LeftKind::Left.into(),
        detail: "\u{1b}[2J\u{1b}]0;owned\u{7}".into(),
        at_ms: 1,
        round: 0,
        written_by: "x".into(),
    };
    put(&etcd, k.of(&left), left.encode_to_vec());
    // A registration whose key holds ESC and a newline.
    let member = fsdp_proto::v1::Member::from(fsdp_proto::v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "n".into(),
        addr: "10.0.0.2".into(),
        local_world_size: 1,
        ..Default::default()
    });
    put(
        &etcd,
        format!("{}members/n\u{1b}[2J\nhealth healthy", k.root()),
        member.encode_to_vec(),
    );
    // A round of 50 nodes in a run of `--nnodes 1:2`.
    let fifty = fsdp_proto::v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 9,
        members: (0..50)
            .map(|i| {
                fsdp_proto::v1::Member::from(fsdp_proto::v1::MemberFields {
                    schema: fsdp_proto::SCHEMA_VERSION,
                    node_id: format!("ghost{i}"),
                    addr: "10.0.0.3".into(),
                    local_world_size: 1,
                    ..Default::default()
                })
            })
            .collect(),
        reason: "forged".into(),
        ..Default::default()
    };
    put(
        &etcd,
        k.key::<fsdp_proto::v1::Round>(""),
        fifty.encode_to_vec(),
    );
    wait_for("the agent refused them", LIMIT, || {
        a.stderr().matches("refused a record").count() >= 4
    });
    let (code, out, err) = status_cmd(&["--rdzv-endpoint", &etcd.endpoint(), "--rdzv-id", "st"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
    assert!(
        !out.lines().any(|l| l.starts_with("health healthy")),
        "{out}"
    );
    assert!(out.contains("refused"), "{out}");
    // The real round is overwritten by the forged one, which status refuses: no round is
    // left to vouch for the halt's writer, so it is refused too.
    assert!(out.contains("no round of this run can vouch for"), "{out}");
    assert!(out.contains("has 50 nodes, outside 1..=2"), "{out}");
    assert!(
        !out.contains("ghost"),
        "the forged round is not the run's: {out}"
    );
    assert!(!out.contains("halted"), "{out}");
    assert!(
        out.contains("\\u{1b}"),
        "the forged bytes are shown escaped: {out}"
    );
    // The agent's own log line named the key escaped too.
    assert!(!a.stderr().contains('\u{1b}'), "{}", a.stderr());
    a.signal(libc::SIGTERM);
    assert_eq!(a.code(), 143, "{}", a.output());
}
