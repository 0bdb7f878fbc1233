//! Registration and the coordinator election, and the writes of the other commands.

use super::*;

// ---------------------------------------------------------------------------------------
// Registration and the coordinator election
// ---------------------------------------------------------------------------------------

#[test]
fn register_claims_the_coordinator_key_when_nobody_holds_it() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, Command::Register { wants_round: 4 });
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.when,
        vec![Compare::Absent(k.key::<v1::Coordinator>(""))]
    );
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Coordinator>(""));
    assert_eq!(lease, LEASE);
    assert_eq!(v1::Coordinator::decode(value).unwrap().node_id, "a");
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Member>("a"));
    assert_eq!(lease, LEASE);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.wants_round, m.lease, m.incarnation), (4, LEASE, 1));
    // The registration is written even when the claim loses.
    put_at(&spec.otherwise, &k.key::<v1::Member>("a"));
    assert!(!touches(&spec.otherwise, &k.key::<v1::Coordinator>("")));
}

#[test]
fn winning_the_claim_resyncs_with_coordinator_watches() {
    let mut h = Harness::synced();
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    assert!(closes_watches(&e));
    assert_eq!(h.m.view().coordinator.as_deref(), Some("a"));
    assert_eq!(
        h.m.phase(),
        Phase::Syncing(Resync::RoleChanged { grace_until: None })
    );
    let me = member("a", LEASE, 1, 0);
    let (ops, _) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    // A role change asks nothing of the cluster's size.
    assert_eq!(
        ops,
        vec![
            read_root(),
            Op::TimeToLive { lease: LEASE },
            Op::Watch {
                role: Role::Coordinator,
                from: REV + 1,
                lease: LEASE,
                keep_stream: false
            },
        ]
    );
}

#[test]
fn register_does_not_claim_when_a_coordinator_is_known() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    let e = h.command(1, Command::Register { wants_round: 0 });
    let spec = txn(the_op(&e));
    assert!(spec.when.is_empty());
    assert!(!touches(&spec.then, &k.key::<v1::Coordinator>("")));
    put_at(&spec.then, &k.key::<v1::Member>("a"));
}

#[test]
fn a_lost_claim_is_still_a_registration_and_keeps_the_member_watches() {
    let mut h = Harness::synced();
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: false });
    replied_ok(&e, 1);
    assert!(!closes_watches(&e));
    no_op(&e);
    assert_eq!(h.m.view().coordinator, None);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: LEASE
        }
    );
}

#[test]
fn a_command_is_answered_only_after_its_answer() {
    let mut h = Harness::synced();
    let e = h.command(1, report_done(3));
    assert!(replied(&e).is_empty());
    let before = h.writes.load(Ordering::Relaxed);
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert_eq!(h.writes.load(Ordering::Relaxed), before + 1);
}

#[test]
fn lease_not_found_on_register_grants_a_new_lease_and_writes_again_as_incarnation_2() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.fail(no_such_lease());
    assert!(replied(&e).is_empty());
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Member>("a"));
    assert_eq!(lease, 300);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.lease, m.incarnation), (300, 2));
    assert_eq!((h.m.lease(), h.m.incarnation()), (300, 2));
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    // The open keep-alive stream is the old lease's: a resync opens one for the new.
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_ctl());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
}

/// A regranted lease that expires again before the write with it lands: etcd (or this
/// process) is slower than the TTL. `rdzv-bench --nodes 10000` exited on this; what
/// follows is another lease after a backoff, never a grant loop at full speed.
#[test]
fn a_lease_that_expires_again_before_its_write_lands_is_granted_again_after_a_backoff() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    h.fail(no_such_lease());
    h.answer(Answer::Granted { id: 300 });
    for (attempt, (id, wait_ms)) in [(301, 100), (302, 200), (303, 400)].into_iter().enumerate() {
        let e = h.fail(no_such_lease());
        assert!(
            etcd_ops(&e).is_empty(),
            "attempt {attempt}: nothing at once: {e:?}"
        );
        assert!(
            replied(&e).is_empty(),
            "attempt {attempt}: not answered yet"
        );
        let due = h.m.deadline().expect("the next grant is timed");
        assert_eq!(
            (due.duration_since(h.now).as_secs_f64() * 1e3).round() as u64,
            wait_ms
        );
        let e = h.fire();
        assert!(matches!(the_op(&e), Op::Grant { .. }), "{e:?}");
        let e = h.answer(Answer::Granted { id });
        assert!(matches!(the_op(&e), Op::Txn(_)), "the write again: {e:?}");
        assert_eq!(h.m.lease(), id);
    }
    let e = h.answer(Answer::Txn { succeeded: false });
    replied_ok(&e, 1);
}

#[test]
fn a_lease_that_keeps_expiring_past_the_outage_bound_is_the_reply() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    h.fail(no_such_lease());
    h.answer(Answer::Granted { id: 300 });
    let mut e = h.fail(no_such_lease());
    let mut id = 301;
    while replied(&e).is_empty() {
        assert!(id < 400, "the retries must end");
        h.later(Duration::from_secs(10));
        h.fire();
        h.answer(Answer::Granted { id });
        id += 1;
        e = h.fail(no_such_lease());
    }
    // Answered after the outage bound (60 s), and the session syncs again to keep the
    // lease it now holds alive.
    assert!(id > 306, "retried for the outage bound first: {id}");
    assert_eq!(the_op(&e), read_ctl());
    match reply_of(&e, 1) {
        Err(RendezvousError::Etcd { what, .. }) => assert_eq!(*what, "registering this node"),
        other => panic!("expected the refusal as the reply, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Other commands' writes
// ---------------------------------------------------------------------------------------

#[test]
fn report_failure_is_guarded_on_the_halt_key_being_absent() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, report_failure(3));
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.when,
        vec![
            Compare::Absent(k.key::<v1::Failure>(&format!("{:020}", 3))),
            Compare::Absent(k.key::<v1::Halt>(""))
        ]
    );
    let failure =
        v1::Failure::decode(put_at(&spec.then, &k.key::<v1::Failure>(&format!("{:020}", 3))).0)
            .unwrap();
    assert_eq!((failure.round, failure.node_id.as_str()), (3, "a"));
}

#[test]
fn publish_master_is_written_on_the_lease() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(
        1,
        write(&v1::Master {
            schema: SCHEMA_VERSION,
            round: 2,
            addr: "10.0.0.1".into(),
            port: 29500,
        }),
    );
    let Op::Put(Write::Put { key, value, lease }) = the_op(&e) else {
        panic!("expected a put: {e:?}")
    };
    assert_eq!((key, lease), (k.key::<v1::Master>(""), LEASE));
    let master = v1::Master::decode(value.as_slice()).unwrap();
    assert_eq!(
        (master.round, master.addr.as_str(), master.port),
        (2, "10.0.0.1", 29500)
    );
}
