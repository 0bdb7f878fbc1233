//! The first sync, and what the machine does with watch events and with inputs that come
//! while an op is in flight.

use super::*;
use crate::etcd::session::FirstRead;

// ---------------------------------------------------------------------------------------
// The first sync
// ---------------------------------------------------------------------------------------

#[test]
fn the_first_sync_reads_counts_members_and_watches_from_the_next_revision() {
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    let (ops, rest) = h.sync_through(e, &[]);
    assert_eq!(
        ops,
        vec![
            // Its lease kept alive from the grant on: the read and the registration may
            // wait in a crowd longer than a TTL (`admission.rs`).
            Op::ReopenKeepAlive { lease: LEASE },
            // A joining member reads the control keys, not every registration: N members
            // each reading every registration was O(N²) bytes at formation.
            read_ctl(),
            Op::MemberCount,
            // No time-to-live of the lease granted just before (one request
            // fewer per joining agent, each costly to etcd 3.4 at formation), and the
            // stream kept from the grant goes on under the watches (one open fewer).
            Op::Watch {
                role: Role::Member,
                from: REV + 1,
                lease: LEASE,
                keep_stream: true
            },
        ]
    );
    // On the first sync the registration claims the role: no campaign of its own.
    no_op(&rest);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: LEASE
        }
    );
}

/// The handle reads the run's control keys before the grant, in the nesting check's
/// transaction: the first sync takes that read and sends none of its own (one request less
/// for each joining node), and its watches go on from the revision after the handle's read,
/// so nothing written since is missed.
#[test]
fn a_first_sync_given_the_handles_read_reads_nothing_and_watches_from_after_it() {
    let mut h = Harness::new();
    let three = round(3, &[("b", 1)]);
    h.m.first_read = Some(FirstRead {
        revision: 7,
        kvs: vec![round_kv(&three, 6), coordinator_kv("b", 200)],
    });
    let e = h.m.start(h.now);
    let (ops, rest) = h.sync_through(e, &[]);
    assert_eq!(
        ops,
        vec![
            Op::ReopenKeepAlive { lease: LEASE },
            Op::MemberCount,
            Op::Watch {
                role: Role::Member,
                from: 8,
                lease: LEASE,
                keep_stream: true
            },
        ]
    );
    no_op(&rest);
    let v = h.m.view();
    assert_eq!(v.round.as_ref().map(|r| r.record.number), Some(3));
    assert_eq!(v.coordinator.as_deref(), Some("b"));
}

/// With the handle's read naming this node coordinator, the whole run is read after it,
/// and the watches go on from that read.
#[test]
fn a_first_sync_whose_handle_read_finds_itself_coordinator_reads_the_whole_run() {
    let other = member("b", 200, 1, 0);
    let kvs = [coordinator_kv("a", 99), member_kv(&other, 5)];
    let mut h = Harness::new();
    h.m.first_read = Some(FirstRead {
        revision: 7,
        kvs: vec![coordinator_kv("a", 99)],
    });
    let e = h.m.start(h.now);
    let (ops, _) = h.sync_through(e, &kvs);
    assert_eq!(
        ops[..2],
        [Op::ReopenKeepAlive { lease: LEASE }, read_root()]
    );
    assert!(
        matches!(ops.last(), Some(Op::Watch { role: Role::Coordinator, from, .. }) if *from == REV + 1),
        "{ops:?}"
    );
}

/// The handle's read is for the first sync only: one that failed before taking it leaves
/// it unused, and the sync after the outage reads the run itself.
#[test]
fn a_sync_after_a_failed_first_one_reads_the_run_itself() {
    let mut h = Harness::new();
    h.m.first_read = Some(FirstRead {
        revision: 7,
        kvs: Vec::new(),
    });
    let e = h.m.start(h.now);
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    h.fail(cut());
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
    let e = h.fire();
    let (ops, _) = h.sync_through(e, &[]);
    assert!(ops.contains(&read_ctl()), "{ops:?}");
}

/// The coordinator key names this node (an earlier run of it, its lease not expired
/// yet): a coordinator seals from every registration, so the control-only read is
/// followed by a whole one, and the watches open for the coordinator.
#[test]
fn a_first_sync_that_finds_itself_coordinator_reads_the_whole_run() {
    let other = member("b", 200, 1, 0);
    let kvs = [coordinator_kv("a", 99), member_kv(&other, 5)];
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    let (ops, _) = h.sync_through(e, &kvs);
    assert_eq!(
        ops[..3],
        [
            Op::ReopenKeepAlive { lease: LEASE },
            read_ctl(),
            read_root()
        ]
    );
    assert!(matches!(
        ops.last(),
        Some(Op::Watch {
            role: Role::Coordinator,
            ..
        })
    ));
    assert!(h.m.view().members.contains_key("b"));
}

/// A member's view read from the control keys holds no registrations: were it to seal
/// (or call the round's members lost) before the whole read its role change brings, it
/// would seal without the others. The claim won on registration resyncs first.
#[test]
fn a_claim_won_on_a_control_only_view_reads_the_whole_run_before_anything_else() {
    let mut h = Harness::synced();
    assert!(h.m.view().members.is_empty());
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    // Straight to the whole read: no round committed from the view without registrations.
    assert!(!etcd_ops(&e).iter().any(|op| matches!(op, Op::Txn(_))));
    assert_eq!(etcd_ops(&e), vec![read_root()]);
}

#[test]
fn the_view_is_connected_once_the_first_sync_opened_the_watches() {
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    assert!(!h.m.view().connected);
    let (_, rest) = h.sync_through(e, &[coordinator_kv("b", 200)]);
    no_op(&rest);
    let v = h.m.changed_view().expect("the sync changed the view");
    assert!(v.connected);
    assert_eq!(v.coordinator.as_deref(), Some("b"));
    assert!(h.m.changed_view().is_none(), "reported once");
}

#[test]
fn while_an_op_is_in_flight_the_only_deadline_is_the_next_keep_alive() {
    let mut h = Harness::new();
    h.m.start(h.now);
    assert_eq!(h.m.deadline(), None, "no lease is kept while syncing");
    let mut h = Harness::synced();
    assert_eq!(h.m.deadline(), Some(h.t0), "the first keep-alive");
    // The keep-alive itself in flight: nothing goes beside it.
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
    assert_eq!(h.m.deadline(), None);
    h.answer(Answer::Done);
    h.command(1, report_done(1));
    assert!(h.m.busy());
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 3), "the next keep-alive");
    h.answer(Answer::Done);
    assert!(h.m.deadline().is_some());
}

// ---------------------------------------------------------------------------------------
// Watch events
// ---------------------------------------------------------------------------------------

#[test]
fn a_deleted_coordinator_key_makes_a_registered_node_campaign() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.key::<v1::Coordinator>(""),
        prev: None,
    }]));
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.when,
        vec![Compare::Absent(k.key::<v1::Coordinator>(""))]
    );
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Coordinator>(""));
    assert_eq!(lease, LEASE);
    assert_eq!(v1::Coordinator::decode(value).unwrap().node_id, "a");
    // The campaign claims the role only; the registration stands as it was.
    assert!(!touches(&spec.then, &k.key::<v1::Member>("a")));
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(h.m.view().coordinator.as_deref(), Some("a"));
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
}

#[test]
fn an_unregistered_node_does_not_campaign() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    let e = h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.key::<v1::Coordinator>(""),
        prev: None,
    }]));
    no_op(&e);
    assert_eq!(h.m.view().coordinator, None);
}

#[test]
fn stale_watch_events_queued_before_a_resync_are_dropped() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    // All three wait for the keep-alive's answer.
    assert!(h.step(Input::WatchEnded).is_empty());
    let stale = WatchEvent::Put(round_kv(&round(1, &[("b", 1)]), 8));
    assert!(h.step(Input::Watched(vec![stale])).is_empty());
    assert!(h.command(1, report_done(1)).is_empty());
    let e = h.answer(Answer::Done);
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_ctl());
    let (_, e) = h.sync_through(e, &[]);
    // The put came from the closed watch: the read says there is no round.
    assert!(h.m.view().round.is_none());
    // The command is not stream traffic: it survives the resync.
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the done record: {e:?}")
    };
    assert_eq!(
        key,
        k.key::<v1::Done>(&crate::etcd::record::per_round(1, "a"))
    );
}

#[test]
fn inputs_that_come_while_an_op_is_in_flight_are_handled_after_it_in_order() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, report_done(1));
    assert!(matches!(the_op(&e), Op::Put(_)));
    assert!(
        h.command(
            2,
            write(&v1::Master {
                schema: SCHEMA_VERSION,
                round: 1,
                addr: "10.0.0.1".into(),
                port: 29500
            })
        )
        .is_empty()
    );
    let halt = v1::Halt {
        schema: SCHEMA_VERSION,
        node_id: "a".into(),
        exit_code: 3,
        reason: "stop".into(),
        round: 1,
    };
    assert!(h.command(3, write(&halt)).is_empty());
    let e = h.answer(Answer::Done);
    assert_eq!(replied(&e), vec![1]);
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the master: {e:?}")
    };
    assert_eq!(key, k.key::<v1::Master>(""));
    let e = h.answer(Answer::Done);
    assert_eq!(replied(&e), vec![2]);
    let spec = txn(the_op(&e));
    put_at(&spec.then, &k.key::<v1::Halt>(""));
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(replied(&e), vec![3]);
    no_op(&e);
}
