//! A re-form's cost for a member that stays: after a loss it writes nothing (its
//! registration stands); after a failure it says it stopped; a round sent as a delta of a
//! round it does not hold makes it read the roster.

use super::*;

/// "a" (this machine, incarnation 1) registered and runs round 1 of b, a and c; b
/// coordinates.
fn running_round_one() -> Harness {
    let r = round(1, &[("b", 1), ("a", 1), ("c", 1)]);
    let mut h = Harness::synced_with(&[
        round_kv(&r, 7),
        member_kv(&member("b", 200, 1, 1), 3),
        member_kv(&member("c", 300, 1, 1), 5),
        coordinator_kv("b", 200),
    ]);
    h.register(1, 1, true);
    h.runs(2, r);
    h
}

fn gone(id: &str, incarnation: u64) -> WatchEvent {
    WatchEvent::Delete {
        key: keys().key::<v1::Member>(id),
        prev: Some(member(id, 300, incarnation, 1).encode_to_vec()),
    }
}

#[test]
fn a_survivor_of_a_loss_asks_for_the_next_round_without_a_write() {
    let mut h = running_round_one();
    no_op(&h.step(Input::Watched(vec![gone("c", 1)])));
    let writes = h.writes.load(Ordering::Relaxed);
    let e = h.command(3, Command::Register { wants_round: 2 });
    no_op(&e);
    replied_ok(&e, 3);
    assert_eq!(h.writes.load(Ordering::Relaxed), writes, "no write");
}

/// After a failure the coordinator waits for every member to say it stopped its workers
/// (so that a dying peer is not charged as a failure): the registration is written.
#[test]
fn a_survivor_of_a_failure_says_it_stopped() {
    let mut h = running_round_one();
    let failure = v1::Failure {
        schema: SCHEMA_VERSION,
        round: 1,
        node_id: "c".into(),
    };
    let kv = record_kv(&failure, 9);
    no_op(&h.step(Input::Watched(vec![WatchEvent::Put(kv)])));
    let e = h.command(3, Command::Register { wants_round: 2 });
    let spec = txn(the_op(&e));
    let m = v1::Member::decode(put_at(&spec.then, &keys().key::<v1::Member>("a")).0).unwrap();
    assert_eq!(m.wants_round, 2);
}

/// An intact round that this node leaves for a reason of its own: only its registration
/// tells the coordinator.
#[test]
fn a_node_that_wants_a_new_round_of_an_intact_one_writes() {
    let mut h = running_round_one();
    let e = h.command(3, Command::Register { wants_round: 2 });
    assert!(matches!(the_op(&e), Op::Txn(_)));
}

/// A registration this node's lease no longer holds (its own key seen deleted) is not
/// there to stand: it is written again.
#[test]
fn a_node_whose_key_went_writes_again() {
    let mut h = running_round_one();
    no_op(&h.step(Input::Watched(vec![gone("c", 1)])));
    h.step(Input::Watched(vec![WatchEvent::Delete {
        key: keys().key::<v1::Member>("a"),
        prev: Some(member("a", LEASE, 1, 1).encode_to_vec()),
    }]));
    let e = h.command(3, Command::Register { wants_round: 2 });
    assert!(matches!(the_op(&e), Op::Txn(_)));
}

/// The read of the whole round a member makes when a difference comes that it cannot apply.
fn read_roster() -> Op {
    Op::Range {
        key: keys().key::<v1::Roster>(""),
        prefix: false,
        keys_only: false,
        serializable: false,
    }
}

fn delta_kv(d: &v1::Round, mod_rev: i64) -> Kv {
    Kv {
        key: keys().key::<v1::Round>(""),
        value: d.encode_to_vec(),
        create_rev: 1,
        mod_rev,
        lease: 0,
    }
}

#[test]
fn a_delta_of_the_held_round_is_applied_without_a_read() {
    let mut h = running_round_one();
    let base = round(1, &[("b", 1), ("a", 1), ("c", 1)]);
    let mut next = round(2, &[("b", 1), ("a", 1)]);
    next.dropped = vec!["c".into()];
    let d = crate::etcd::roster::delta(&base, 7, &next).unwrap();
    no_op(&h.step(Input::Watched(vec![WatchEvent::Put(delta_kv(&d, 12))])));
    let r = h.m.view().round.clone().unwrap();
    assert_eq!((r.record.as_ref(), r.mod_rev), (&next, 12));
}

#[test]
fn a_delta_of_a_round_not_held_makes_the_member_read_the_roster() {
    let mut h = running_round_one();
    // Based on a round 1 at another revision (not the one this view holds).
    let base = round(1, &[("b", 1), ("a", 1), ("c", 1)]);
    let next = round(2, &[("b", 1), ("a", 1)]);
    let d = crate::etcd::roster::delta(&base, 6, &next).unwrap();
    let e = h.step(Input::Watched(vec![WatchEvent::Put(delta_kv(&d, 12))]));
    let roster_key = keys().key::<v1::Roster>("");
    assert_eq!(the_op(&e), read_roster());
    assert_eq!(h.m.view().round.as_ref().unwrap().record.number, 1);
    let roster = v1::Roster {
        schema: SCHEMA_VERSION,
        round: Some(next.clone()),
    };
    let e = h.answer(Answer::Range {
        revision: 12,
        kvs: vec![Kv {
            key: roster_key,
            value: roster.encode_to_vec(),
            create_rev: 1,
            mod_rev: 12,
            lease: 0,
        }],
    });
    no_op(&e);
    let r = h.m.view().round.clone().unwrap();
    assert_eq!((r.record.as_ref(), r.mod_rev), (&next, 12));
    assert_eq!(h.m.view().round_wanted, None);
}

fn coordinator_gone() -> WatchEvent {
    WatchEvent::Delete {
        key: keys().key::<v1::Coordinator>(""),
        prev: None,
    }
}

/// The coordinator b went with its registration: a, the round's first member left,
/// claims the key at once.
#[test]
fn the_first_member_left_claims_a_coordinator_key_that_went_at_once() {
    let mut h = running_round_one();
    let gone_b = WatchEvent::Delete {
        key: keys().key::<v1::Member>("b"),
        prev: Some(member("b", 200, 1, 1).encode_to_vec()),
    };
    let e = h.step(Input::Watched(vec![coordinator_gone(), gone_b]));
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.when,
        vec![Compare::Absent(keys().key::<v1::Coordinator>(""))]
    );
}

/// b, before a in the round, is still there: a waits its turn, and claims only if the key
/// is still free then (one transaction per coordinator loss, not one per node).
#[test]
fn a_later_member_claims_only_in_its_turn() {
    let mut h = running_round_one();
    let e = h.step(Input::Watched(vec![coordinator_gone()]));
    no_op(&e);
    let turn = h.now + std::time::Duration::from_millis(200);
    assert!(h.m.deadline().is_some_and(|d| d <= turn));
    h.now = turn;
    let mut e = h.timer();
    if the_op(&e) == Op::KeepAlive {
        e = h.answer(Answer::Done);
    }
    assert!(matches!(the_op(&e), Op::Txn(_)), "{e:?}");
    // Had b claimed first, the turn would have found the key taken and written nothing.
    let mut h = running_round_one();
    h.step(Input::Watched(vec![coordinator_gone()]));
    h.step(Input::Watched(vec![WatchEvent::Put(coordinator_kv(
        "b", 200,
    ))]));
    h.now = turn;
    let e = h.timer();
    if the_op(&e) == Op::KeepAlive {
        no_op(&h.answer(Answer::Done));
    } else {
        no_op(&e);
    }
}

/// A node joining a run whose round key holds a difference: its control-only first read
/// cannot hold the round, so the roster (outside the control keys) is read next, before
/// the watches open.
#[test]
fn a_first_sync_that_finds_a_delta_reads_the_roster_before_watching() {
    let base = round(1, &[("b", 1), ("c", 1)]);
    let next = round(2, &[("b", 1)]);
    let d = crate::etcd::roster::delta(&base, 6, &next).unwrap();
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    let (ops, e) = h.sync_through(e, &[delta_kv(&d, 9)]);
    assert_eq!(ops, vec![Op::ReopenKeepAlive { lease: LEASE }, read_ctl()]);
    assert_eq!(h.m.view().round_wanted, Some(2));
    let roster_key = keys().key::<v1::Roster>("");
    assert_eq!(the_op(&e), read_roster());
    let roster = v1::Roster {
        schema: SCHEMA_VERSION,
        round: Some(next.clone()),
    };
    let e = h.answer(Answer::Range {
        revision: REV,
        kvs: vec![Kv {
            key: roster_key,
            value: roster.encode_to_vec(),
            create_rev: 1,
            mod_rev: 9,
            lease: 0,
        }],
    });
    let (ops, _) = h.sync_through(e, &[]);
    assert!(matches!(ops.last(), Some(Op::Watch { from, .. }) if *from == REV + 1));
    assert_eq!(h.m.view().round.as_ref().unwrap().record.as_ref(), &next);
}

fn record_kv<R: crate::etcd::record::Record + prost::Message>(r: &R, mod_rev: i64) -> Kv {
    Kv {
        key: keys().of(r),
        value: r.encode_to_vec(),
        create_rev: mod_rev,
        mod_rev,
        lease: 0,
    }
}

/// A member watches no registrations: it learns that a round member went from the
/// records that say so — the node's own word (a leave, a fence), the coordinator's
/// "lost", the ring watcher's record of a node it evicted. A word about an older
/// incarnation than the round's is no departure from it.
#[test]
fn a_member_learns_of_departures_from_the_records_that_say_so() {
    let mut h = running_round_one();
    let old_word = v1::Left {
        schema: SCHEMA_VERSION,
        node_id: "c".into(),
        incarnation: 0,
        kind: v1::LeftKind::Left.into(),
        written_by: "c".into(),
        ..Default::default()
    };
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(
        &old_word, 10,
    ))]));
    let c = h.m.view().departed.get("c").map(|d| d.incarnation);
    assert!(c.is_none_or(|i| i < 1), "an older incarnation: {c:?}");
    let word = v1::Left {
        incarnation: 1,
        ..old_word
    };
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(&word, 11))]));
    assert_eq!(h.m.view().departed.get("c").map(|d| d.incarnation), Some(1));

    let evicted = crate::etcd::session::records::noticed(1, "b", v1::Detection::Refused, 40);
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(
        &evicted, 12,
    ))]));
    assert_eq!(h.m.view().departed.get("b").map(|d| d.incarnation), Some(1));
    // A record of another round's loss says nothing of this one.
    let other = crate::etcd::session::records::noticed(0, "d", v1::Detection::Refused, 40);
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(&other, 13))]));
    assert!(!h.m.view().departed.contains_key("d"));
}
