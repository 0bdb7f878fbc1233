//! Errors, outages and the backoff, and the round this node runs across an outage.

use super::*;

const FIRST_RETRY: Duration = Duration::from_millis(100);

/// etcd said no for good.
fn denied() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::permission_denied("no rights"))
}

// ---------------------------------------------------------------------------------------
// Errors, outages and the backoff
// ---------------------------------------------------------------------------------------

#[test]
fn a_transient_error_keeps_the_command_until_the_next_sync_serves_it() {
    let k = keys();
    let mut h = Harness::synced();
    h.command(1, report_done(3));
    let e = h.fail(cut());
    assert!(
        replied(&e).is_empty(),
        "never answered with a transient error"
    );
    no_op(&e);
    assert!(closes_watches(&e));
    assert_eq!(h.retry_in_ms(), 100);
    assert!(!h.m.view().connected);
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 1);

    let e = h.fire();
    let (ops, e) = h.sync_through(e, &[]);
    assert_eq!(
        ops.len(),
        5,
        "read, own registration, member count, time-to-live, watch: {ops:?}"
    );
    // The waiting command is served once the watches are open again.
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the done record again: {e:?}")
    };
    assert_eq!(
        key,
        k.key::<v1::Done>(&crate::etcd::record::per_round(3, "a"))
    );
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert!(h.m.view().connected);
}

#[test]
fn a_permanent_error_is_the_reply() {
    let mut h = Harness::synced();
    h.command(1, report_done(3));
    let e = h.fail(denied());
    no_op(&e);
    match reply_of(&e, 1) {
        Err(RendezvousError::Etcd { what, .. }) => {
            assert_eq!(*what, "reporting this node finished")
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 0);
}

#[test]
fn running_and_abandon_are_served_while_disconnected_and_other_commands_wait() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.runs(1, round(2, &[("a", 1)]));
    replied_ok(&e, 1);
    no_op(&e);
    let e = h.command(2, abandon());
    replied_ok(&e, 2);
    no_op(&e);
    let e = h.command(3, report_done(2));
    assert!(e.is_empty(), "waits for etcd: {e:?}");
    let e = h.command(4, write(&v1::Halt::default()));
    assert!(e.is_empty(), "waits for etcd: {e:?}");
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

#[test]
fn depart_is_served_while_disconnected() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(1, depart(Departure::Failed, crate::LeftKind::Failed));
    assert!(
        matches!(
            the_op(&e),
            Op::Depart {
                record: Some(_),
                lease: LEASE
            }
        ),
        "{e:?}"
    );
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 1);
    assert!(h.m.ended());
}

/// A node that fenced itself while cut off says so at its next contact with etcd; leaving
/// before that contact (the departure goes before the sync's steps), its departure says
/// it: the fence is why its registration went, not the leave.
#[test]
fn a_fenced_node_that_leaves_before_it_could_say_so_says_it_in_its_departure() {
    let mut h = Harness::synced();
    h.runs(9, round(3, &[("a", 1), ("b", 1)]));
    h.disconnect();
    replied_ok(&h.command(1, abandon()), 1);
    let e = h.command(2, depart(Departure::Left, crate::LeftKind::Left));
    let Op::Depart {
        record: Some(spec),
        lease: LEASE,
    } = the_op(&e)
    else {
        panic!("a departure with its word: {e:?}")
    };
    let word = left_put(&spec.then, "a", 1);
    assert_eq!(word.kind(), v1::LeftKind::Fenced, "{word:?}");
}

#[test]
fn the_backoff_doubles_after_another_failure() {
    let mut h = Harness::synced();
    h.disconnect();
    assert_eq!(h.retry_in_ms(), 100);
    let e = h.fire();
    assert_eq!(the_op(&e), read_ctl());
    h.fail(cut());
    assert_eq!(h.retry_in_ms(), 200);
    let e = h.fire();
    assert_eq!(the_op(&e), read_ctl());
    h.fail(cut());
    assert_eq!(h.retry_in_ms(), 400);
}

#[test]
fn a_timer_before_the_retry_deadline_does_nothing() {
    let mut h = Harness::synced();
    h.disconnect();
    h.later(FIRST_RETRY / 2);
    let e = h.timer();
    assert!(e.is_empty(), "{e:?}");
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

#[test]
fn the_session_gives_up_after_the_outage_limit_and_answers_the_waiting_commands() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(7, report_done(1));
    assert!(e.is_empty());
    h.later(Duration::from_secs(61));
    let e = h.timer();
    assert_eq!(the_op(&e), read_ctl());
    let e = h.fail(cut());
    no_op(&e);
    assert_eq!(h.m.phase(), Phase::Ended);
    let why = h.m.view().gave_up.clone().expect("the view says why");
    assert!(why.contains("etcd has not answered for 61s"), "{why}");
    assert!(
        matches!(reply_of(&e, 7), Err(RendezvousError::Outage(r)) if *r == why),
        "{e:?}"
    );
    assert_eq!(h.m.deadline(), None);
    // A command after the end hears the same.
    let e = h.command(8, report_done(1));
    assert!(matches!(reply_of(&e, 8), Err(RendezvousError::Outage(_))));
}

#[test]
fn an_outage_shorter_than_the_limit_does_not_give_up() {
    let mut h = Harness::synced();
    h.disconnect();
    h.later(Duration::from_secs(59));
    let e = h.timer();
    assert_eq!(the_op(&e), read_ctl());
    h.fail(cut());
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
    assert_eq!(h.m.view().gave_up, None);
}

#[test]
fn a_watch_that_ended_resyncs_without_raising_the_backoff() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.fire();
    let (_, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    let e = h.step(Input::WatchEnded);
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_ctl());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
    h.fail(cut());
    // One failure before the good watch, none since: the backoff starts over.
    assert_eq!(h.retry_in_ms(), 100);
}

#[test]
fn commands_closed_ends_the_session_and_answers_waiting_commands() {
    let mut h = Harness::synced();
    h.disconnect();
    h.command(1, report_done(1));
    let e = h.step(Input::CommandsClosed);
    assert_eq!(h.m.phase(), Phase::Ended);
    assert!(matches!(
        reply_of(&e, 1),
        Err(RendezvousError::SessionEnded(_))
    ));
    assert_eq!(h.m.deadline(), None);
}

// ---------------------------------------------------------------------------------------
// Outages and the round this node runs
// ---------------------------------------------------------------------------------------

#[test]
fn after_an_outage_the_grace_timer_reads_member_keys_and_departs_absent_round_members() {
    let k = keys();
    let (mut h, _) = Harness::with(|c| c.can_probe = false).first_sync(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.runs(2, mine.clone());
    h.disconnect();
    let e = h.fire();
    let grace = h.now + TTL + SECOND;
    let (_, rest) = h.sync_through(
        e,
        &[
            member_kv(&member("a", LEASE, 1, 1), 6),
            round_kv(&mine, 7),
            coordinator_kv("b", 200),
        ],
    );
    no_op(&rest);
    // After an outage nobody is judged by the read: "b" has a TTL to come back.
    assert!(h.m.view().departed.is_empty());
    let op = loop {
        let e = h.fire();
        match the_op(&e) {
            Op::KeepAlive => {
                h.answer(Answer::Done);
            }
            other => break other,
        }
    };
    assert_eq!(h.now, grace);
    assert_eq!(
        op,
        Op::Range {
            key: k.members(),
            prefix: true,
            keys_only: true,
            serializable: false
        }
    );
    let present = Kv {
        key: k.key::<v1::Member>("a"),
        value: Vec::new(),
        create_rev: 6,
        mod_rev: 6,
        lease: LEASE,
    };
    h.answer(Answer::Range {
        revision: 9,
        kvs: vec![present],
    });
    let departed = &h.m.view().departed;
    assert_eq!(
        departed.get("b"),
        Some(&Departed {
            at: grace,
            incarnation: 1
        })
    );
    assert!(!departed.contains_key("a"));
}

#[test]
fn a_running_round_missing_after_a_resync_is_republished() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.runs(2, mine.clone());
    let e = h.step(Input::WatchEnded);
    // etcd came back empty: neither our registration nor our round is there.
    let (_, e) = h.sync_through(e, &[]);
    let spec = txn(the_op(&e));
    put_at(&spec.then, &k.key::<v1::Member>("a"));
    let e = h.answer(Answer::Txn { succeeded: true });
    let spec = txn(the_op(&e));
    assert_eq!(spec.when, vec![Compare::Absent(k.key::<v1::Round>(""))]);
    let (value, _) = put_at(&spec.then, &k.key::<v1::Round>(""));
    assert_eq!(value, mine.encode_to_vec().as_slice());
}

#[test]
fn an_evicted_node_records_its_departure_and_registers_as_the_next_incarnation() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.runs(2, mine.clone());
    h.later(SECOND);
    let e = h.step(Input::WatchEnded);
    // The lease lives and the round is there, but our key is gone: someone deleted it.
    let (_, e) = h.sync_through(
        e,
        &[
            round_kv(&mine, 7),
            coordinator_kv("b", 200),
            member_kv(&member("b", 200, 1, 1), 3),
        ],
    );
    assert_eq!(
        h.m.view().departed.get("a"),
        Some(&Departed {
            at: h.now,
            incarnation: 1
        })
    );
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Member>("a"));
    assert_eq!(lease, LEASE);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.lease, m.incarnation), (LEASE, 2));
    assert_eq!(h.m.incarnation(), 2);
}

/// After an outage a member reads the control keys and its own registration; if its
/// campaign then wins the free coordinator key, it reads every registration before it
/// watches as the coordinator. Found by the simulator (seed 275): a coordinator elected
/// inside such a sync watched with a view of no registrations and never sealed.
#[test]
fn a_campaign_won_during_a_resync_reads_every_registration_before_watching_as_coordinator() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, false);
    h.disconnect();
    let me = member("a", LEASE, 1, 0);
    let other = member("c", 300, 1, 0);
    let kvs = [member_kv(&me, 6), member_kv(&other, 7)];
    let e = h.fire();
    let (ops, e) = h.sync_through(e, &kvs);
    assert_eq!(
        ops,
        vec![
            read_ctl(),
            read_own(),
            Op::MemberCount,
            Op::TimeToLive { lease: LEASE }
        ]
    );
    // The coordinator key went with the outage: the campaign.
    assert!(matches!(the_op(&e), Op::Txn(_)));
    let e = h.answer(Answer::Txn { succeeded: true });
    let elected = [kvs[0].clone(), kvs[1].clone(), coordinator_kv("a", LEASE)];
    let (ops, rest) = h.sync_through(e, &elected);
    assert_eq!(ops[0], read_root(), "{ops:?} then {rest:?}");
    assert!(
        matches!(
            ops.last(),
            Some(Op::Watch {
                role: Role::Coordinator,
                ..
            })
        ),
        "{ops:?} then {rest:?}"
    );
    assert!(
        h.m.view().members.contains_key("c"),
        "every registration read"
    );
}
