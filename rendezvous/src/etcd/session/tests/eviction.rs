//! Abandon, eviction and departure.

use super::*;

// ---------------------------------------------------------------------------------------
// Abandon, eviction and departure
// ---------------------------------------------------------------------------------------

#[test]
fn abandon_makes_the_next_sync_say_why_then_revoke_then_grant_then_read() {
    let mut h = Harness::synced();
    h.runs(9, round(3, &[("a", 1), ("b", 1)]));
    let e = h.command(1, abandon());
    replied_ok(&e, 1);
    assert!(closes_watches(&e));
    // Why, before the revoke: the coordinator never sees the registration go without it.
    let said = txn(the_op(&e));
    assert!(said.when.is_empty(), "{said:?}");
    let word = left_put(&said.then, "a", 1);
    assert_eq!(word.kind(), v1::LeftKind::Fenced);
    assert_eq!((word.round, word.written_by.as_str()), (3, "a"));
    assert!(word.detail.contains("could not be renewed"), "{word:?}");
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!((h.m.lease(), h.m.incarnation()), (300, 2));
    let (ops, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    assert_eq!(
        ops,
        vec![
            read_ctl(),
            read_own(),
            Op::MemberCount,
            Op::TimeToLive { lease: 300 },
            Op::Watch {
                role: Role::Member,
                from: REV + 1,
                lease: 300,
                keep_stream: false
            },
        ]
    );
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: 300
        }
    );
}

#[test]
fn a_revoke_answered_lease_not_found_still_grants_and_reads() {
    let mut h = Harness::synced();
    h.command(1, abandon());
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
    // The fenced lease expired meanwhile: gone either way.
    let e = h.fail(no_such_lease());
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!(the_op(&e), read_ctl());
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 0);
}

#[test]
fn abandon_while_disconnected_revokes_first_at_the_next_sync() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(1, abandon());
    replied_ok(&e, 1);
    no_op(&e);
    let e = h.fire();
    assert!(matches!(the_op(&e), Op::Txn(_)), "why first: {e:?}");
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
}

/// A word refused for good (not a lost connection) is dropped: the fenced node still
/// revokes its lease and joins again.
#[test]
fn a_refused_fence_word_does_not_hold_up_the_revoke() {
    let mut h = Harness::synced();
    h.command(1, abandon());
    let denied = etcd_client::Error::GRpcStatus(tonic::Status::permission_denied("no"));
    let e = h.fail(denied);
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
}

fn evict_b() -> Command {
    Command::Evict {
        node: "b".into(),
        lease: 200,
        round: 1,
        detect_ms: 5,
    }
}

#[test]
fn evicting_a_node_already_departed_needs_no_op() {
    let k = keys();
    let mut h = Harness::synced();
    let prev = member("b", 200, 1, 1).encode_to_vec();
    h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.key::<v1::Member>("b"),
        prev: Some(prev),
    }]));
    assert!(h.m.view().departed.contains_key("b"));
    let e = h.command(1, evict_b());
    replied_ok(&e, 1);
    no_op(&e);
}

#[test]
fn evicting_a_node_whose_lease_no_longer_holds_its_registration_takes_one_txn() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, evict_b());
    assert!(replied(&e).is_empty());
    assert_eq!(
        txn(the_op(&e)),
        TxnSpec {
            when: vec![Compare::Lease(k.key::<v1::Member>("b"), 200)],
            ..TxnSpec::default()
        }
    );
    let e = h.answer(Answer::Txn { succeeded: false });
    replied_ok(&e, 1);
    no_op(&e);
}

#[test]
fn evicting_a_node_that_holds_says_gone_then_revokes() {
    let k = keys();
    let mut h = Harness::synced();
    h.command(1, evict_b());
    let e = h.answer(Answer::Txn { succeeded: true });
    let spec = txn(the_op(&e));
    let key = k.key::<v1::Noticed>(&crate::etcd::record::per_round(1, "b"));
    assert_eq!(spec.when, vec![Compare::Absent(key.clone())]);
    let gone = v1::Noticed::decode(put_at(&spec.then, &key).0).unwrap();
    assert_eq!(
        (
            gone.round,
            gone.node_id.as_str(),
            gone.how(),
            gone.detect_ms
        ),
        (1, "b", v1::Detection::Refused, 5)
    );
    let e = h.answer(Answer::Txn { succeeded: true });
    assert!(replied(&e).is_empty());
    assert_eq!(the_op(&e), Op::Revoke { lease: 200 });
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    no_op(&e);
}

/// In a round its members know broke (another member's word is there), how b went is no
/// news to them: its lease is revoked without a record first. A run half killed at once
/// would send each neighbour's record to every member still watching.
#[test]
fn evicting_a_node_of_a_round_its_members_know_broke_only_revokes() {
    let r = round(1, &[("a", 1), ("b", 1), ("c", 1)]);
    let c_left = v1::Left {
        schema: SCHEMA_VERSION,
        node_id: "c".into(),
        incarnation: 1,
        kind: v1::LeftKind::Left.into(),
        ..Default::default()
    };
    let mut h = Harness::synced_with(&[round_kv(&r, 7), record_kv(&c_left, 20)]);
    h.command(1, evict_b());
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(the_op(&e), Op::Revoke { lease: 200 });
    replied_ok(&h.answer(Answer::Done), 1);
}

#[test]
fn evicting_a_node_whose_lease_went_during_the_revoke_is_answered_ok() {
    let mut h = Harness::synced();
    h.command(1, evict_b());
    h.answer(Answer::Txn { succeeded: true });
    h.answer(Answer::Txn { succeeded: true });
    let e = h.fail(no_such_lease());
    replied_ok(&e, 1);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

#[test]
fn depart_while_running_records_the_leave_beside_the_revoke_and_ends() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 4, true);
    h.runs(2, round(4, &[("a", 1), ("b", 1)]));
    let e = h.command(3, depart(Departure::Left, crate::LeftKind::Left));
    let Op::Depart {
        record: Some(spec),
        lease,
    } = the_op(&e)
    else {
        panic!("expected a departure with its record: {e:?}")
    };
    assert_eq!(lease, LEASE);
    // It stops watching first: a run leaving at once would otherwise send each departure
    // to every node still leaving.
    let closed = e.iter().position(|e| matches!(e, Effect::CloseWatches));
    let sent = e
        .iter()
        .position(|e| matches!(e, Effect::Etcd(Op::Depart { .. })));
    assert!(closed.is_some_and(|c| Some(c) < sent), "{e:?}");
    let key = k.key::<v1::Noticed>(&crate::etcd::record::per_round(4, "a"));
    assert_eq!(spec.when, vec![Compare::Absent(key.clone())]);
    let gone = v1::Noticed::decode(put_at(&spec.then, &key).0).unwrap();
    assert_eq!(gone.how(), v1::Detection::Left);
    // Why it left, whether or not the first word on how stands.
    for writes in [&spec.then, &spec.otherwise] {
        let word = left_put(writes, "a", 1);
        assert_eq!(word.kind(), v1::LeftKind::Left);
        assert_eq!(
            (word.round, word.addr.as_str(), word.detail.as_str()),
            (4, "10.0.0.1", "the test's reason")
        );
    }
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 3);
    assert_eq!(h.m.phase(), Phase::Ended);
    assert_eq!(h.m.deadline(), None);
}

#[test]
fn depart_after_finishing_sends_no_gone_record() {
    let mut h = Harness::synced();
    h.runs(1, round(4, &[("a", 1)]));
    let e = h.command(2, depart(Departure::Finished, crate::LeftKind::Finished));
    let Op::Depart {
        record: Some(spec),
        lease: LEASE,
    } = the_op(&e)
    else {
        panic!("expected a departure with its record: {e:?}")
    };
    assert!(spec.when.is_empty(), "{spec:?}");
    assert_eq!(spec.then.len(), 1, "the word only: {spec:?}");
    assert_eq!(left_put(&spec.then, "a", 1).kind(), v1::LeftKind::Finished);
}
