//! Worker faults and quarantines: the first fault is the earliest exit, and a
//! quarantine is obeyed only as this node's own policy would write it.

use fsdp_proto::v1;
use prost::Message;

use super::*;

/// The loaded suite's finding: node a's worker failed first, but a busy agent wrote its
/// report after b's — whose worker failed only because a's cut its collective. The exit
/// times decide, not the order of arrival; reports without one fall back to that order.
#[test]
fn the_first_fault_is_the_earliest_exit_not_the_first_report() {
    let k = keys();
    let report = |v: &mut View, node: &str, exited_ms: u64, rev: i64| {
        let fault = v1::Fault {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: 4,
            node_id: node.into(),
            exit: "exit code 1".into(),
            exited_ms,
        };
        let at = At {
            create_rev: rev,
            mod_rev: rev,
            lease: 0,
        };
        put(v, &k, &k.of(&fault), &fault.encode_to_vec(), at);
    };
    let mut v = View::default();
    report(&mut v, "b", 1_700_000_000_250, 10);
    report(&mut v, "a", 1_700_000_000_100, 11);
    assert_eq!(v.first_fault(4).as_deref(), Some("a"));
    assert_eq!(v.first_fault(5), None);

    let mut old = View::default();
    report(&mut old, "b", 1_700_000_000_250, 10);
    report(&mut old, "a", 0, 11);
    assert_eq!(old.first_fault(4).as_deref(), Some("b"));
}

/// One put of `ctl/quarantine/<machine>` with `until_ms = u64::MAX` kept every agent on
/// that machine out for ever, even with `--quarantine-after 0`.
#[test]
fn a_quarantine_is_obeyed_only_as_this_nodes_own_policy_would_write_it() {
    let k = keys();
    let now = crate::unix_ms();
    let hour = Some(std::time::Duration::from_secs(3600));
    let judged = |quarantine_for, q: &v1::Quarantine| {
        let mut v = View {
            allowed: Allowed {
                quarantine_for,
                ..Allowed::default()
            },
            ..View::default()
        };
        put(&mut v, &k, &k.of(q), &q.encode_to_vec(), At::default());
        (
            v.quarantine.contains_key("host-7"),
            v.refused.get(&k.of(q)).cloned(),
        )
    };
    let forever = quarantine(u64::MAX);
    let (obeyed, why) = judged(hour, &forever);
    assert!(!obeyed, "a quarantine for ever was obeyed");
    assert!(
        why.unwrap()
            .contains("longer than --quarantine-for (3600 s)")
    );
    let fair = quarantine(now + 3_000_000);
    assert!(
        judged(hour, &fair).0,
        "a quarantine within the policy's bound"
    );
    let (obeyed, why) = judged(None, &fair);
    assert!(!obeyed, "obeyed with --quarantine-after 0");
    assert!(why.unwrap().contains("--quarantine-after 0"));
    // At another machine's key: it would keep that one out.
    let mut elsewhere = fair.clone();
    elsewhere.machine = "host-8".into();
    let mut v = View::default();
    put(
        &mut v,
        &k,
        &k.of(&fair),
        &elsewhere.encode_to_vec(),
        At::default(),
    );
    assert!(v.quarantine.is_empty());
    assert!(v.refused[&k.of(&fair)].contains("not at its own key"));
}

/// The same forged quarantine was logged as refused twice when the store was read again a
/// second later: the reason named the seconds "from now", so it was a new reason each second
/// and the once-per-reason log repeated it (CI, `forged_records`).
#[test]
fn a_refused_quarantine_reads_the_same_whenever_it_is_judged() {
    let allowed = Allowed {
        quarantine_for: Some(std::time::Duration::from_secs(3600)),
        ..Allowed::default()
    };
    let forever = quarantine(u64::MAX);
    let now = crate::unix_ms();
    let first = allowed.quarantine(&forever, now).unwrap_err();
    let later = allowed.quarantine(&forever, now + 1_500).unwrap_err();
    assert_eq!(first, later);
}
