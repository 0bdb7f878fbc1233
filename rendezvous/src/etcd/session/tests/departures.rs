//! The records of why nodes left, as the machine writes them: the coordinator's "lost"
//! for a member gone without a word (once, and never beside the member's own word, never
//! while an outage's grace lets members come back), and the trim of the oldest.

use super::*;
use crate::etcd::record::left_tail;

/// "a" coordinates round 1 of "a" and "b" (incarnation 1 each), both registered and
/// running it: nothing to seal, nothing to say.
fn coordinating_a_round_of_two() -> Harness {
    coordinating_with(&[])
}

fn coordinating_with(extra: &[Kv]) -> Harness {
    let r = round(1, &[("a", 1), ("b", 1)]);
    let mut kvs = vec![
        round_kv(&r, 7),
        member_kv(&member("a", LEASE, 1, 1), 3),
        member_kv(&member("b", 200, 1, 1), 4),
        coordinator_kv("a", LEASE),
    ];
    kvs.extend_from_slice(extra);
    // At least two nodes: a loss leaves the round re-forming, so the word is the only write
    // (with one, the coordinator seals the survivor's round first).
    let (h, rest) = Harness::with(|c| {
        c.can_probe = false;
        c.seal.min_nodes = 2;
    })
    .first_sync(&kvs);
    no_op(&rest);
    assert!(matches!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Coordinator,
            ..
        }
    ));
    h
}

fn b_deleted() -> WatchEvent {
    WatchEvent::Delete {
        key: keys().key::<v1::Member>("b"),
        prev: None,
    }
}

fn said(node: &str, incarnation: u64, kind: v1::LeftKind) -> v1::Left {
    v1::Left {
        schema: SCHEMA_VERSION,
        node_id: node.into(),
        incarnation,
        kind: kind.into(),
        detail: "its own reason".into(),
        written_by: node.into(),
        ..Default::default()
    }
}

#[test]
fn a_member_gone_without_a_word_is_recorded_lost_once_by_the_coordinator() {
    let k = keys();
    let mut h = coordinating_a_round_of_two();
    let writes = h.writes.load(Ordering::Relaxed);
    let e = h.step(Input::Watched(vec![b_deleted()]));
    let spec = txn(the_op(&e));
    let key = k.key::<v1::Left>(&left_tail("b", 1));
    // Only while the key is absent: b's own word, however late, stands.
    assert_eq!(spec.when, vec![Compare::Absent(key.clone())]);
    let word = left_put(&spec.then, "b", 1);
    assert_eq!(word.kind(), v1::LeftKind::Lost);
    assert_eq!(
        (word.round, word.addr.as_str(), word.written_by.as_str()),
        (1, "b.local", "a")
    );
    assert!(word.detail.contains("lease expired"), "{word:?}");
    let e = h.answer(Answer::Txn { succeeded: true });
    no_op(&e);
    assert_eq!(h.writes.load(Ordering::Relaxed), writes + 1);
    // Later events (here b's key deleted again, a stale echo) write nothing more.
    let e = h.step(Input::Watched(vec![b_deleted()]));
    no_op(&e);
    // Nor when the first word lost the race to b's own (the transaction failed).
    let mut h = coordinating_a_round_of_two();
    h.step(Input::Watched(vec![b_deleted()]));
    let e = h.answer(Answer::Txn { succeeded: false });
    no_op(&e);
    no_op(&h.step(Input::Watched(vec![b_deleted()])));
}

#[test]
fn a_member_that_said_why_gets_no_second_row() {
    let mut h = coordinating_a_round_of_two();
    let own = said("b", 1, v1::LeftKind::Unhealthy);
    let e = h.step(Input::Watched(vec![
        WatchEvent::Put(record_kv(&own, 20)),
        b_deleted(),
    ]));
    no_op(&e);
    // Its word may also come after its registration went (it is sent beside the revoke):
    // the coordinator's "lost" is at the same key, where b's own put replaces it.
    let mut h = coordinating_a_round_of_two();
    let spec = txn(the_op(&h.step(Input::Watched(vec![b_deleted()]))));
    assert_eq!(spec.when, vec![Compare::Absent(keys().of(&own))]);
    assert!(touches(&spec.then, &keys().of(&own)));
}

/// A round its members know broke (a word of another member's departure from it is
/// there): the next member gone without one is no news to them, and a run leaving at once
/// would send each such word to every member still watching. A finish breaks nothing.
#[test]
fn no_word_is_said_for_a_member_of_a_round_its_members_know_broke() {
    let r = round(1, &[("a", 1), ("b", 1), ("c", 1)]);
    let coordinating = |c: Kv| {
        let kvs = vec![
            round_kv(&r, 7),
            member_kv(&member("a", LEASE, 1, 1), 3),
            member_kv(&member("b", 200, 1, 1), 4),
            coordinator_kv("a", LEASE),
            c,
        ];
        let (h, rest) = Harness::with(|c| {
            c.can_probe = false;
            c.seal.min_nodes = 3;
        })
        .first_sync(&kvs);
        no_op(&rest);
        h
    };
    let mut h = coordinating(record_kv(&said("c", 1, v1::LeftKind::Left), 20));
    no_op(&h.step(Input::Watched(vec![b_deleted()])));

    let mut h = coordinating(record_kv(&said("c", 1, v1::LeftKind::Finished), 20));
    let spec = txn(the_op(&h.step(Input::Watched(vec![b_deleted()]))));
    assert_eq!(left_put(&spec.then, "b", 1).kind(), v1::LeftKind::Lost);

    // Its own "lost" breaks the round as well, before it comes back on the watch...
    let c_deleted = || WatchEvent::Delete {
        key: keys().key::<v1::Member>("c"),
        prev: None,
    };
    let mut h = coordinating(member_kv(&member("c", 300, 1, 1), 5));
    let spec = txn(the_op(&h.step(Input::Watched(vec![b_deleted()]))));
    assert_eq!(left_put(&spec.then, "b", 1).kind(), v1::LeftKind::Lost);
    no_op(&h.answer(Answer::Txn { succeeded: true }));
    no_op(&h.step(Input::Watched(vec![c_deleted()])));
    // ...unless the member it was said for was done with the round: c's loss is news.
    let b_done = v1::Done {
        schema: SCHEMA_VERSION,
        round: 1,
        node_id: "b".into(),
    };
    let mut h = coordinating(member_kv(&member("c", 300, 1, 1), 5));
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(&b_done, 6))]));
    let spec = txn(the_op(&h.step(Input::Watched(vec![b_deleted()]))));
    assert_eq!(left_put(&spec.then, "b", 1).kind(), v1::LeftKind::Lost);
    no_op(&h.answer(Answer::Txn { succeeded: true }));
    let spec = txn(the_op(&h.step(Input::Watched(vec![c_deleted()]))));
    assert_eq!(left_put(&spec.then, "c", 1).kind(), v1::LeftKind::Lost);
}

/// A member of a round its members know broke leaves without a word: it revokes only.
#[test]
fn a_node_leaving_a_round_its_members_know_broke_says_nothing() {
    let r = round(4, &[("a", 1), ("b", 1), ("c", 1)]);
    let leave = |b_word: Kv| {
        let mut h = Harness::synced_with(&[round_kv(&r, 7), b_word]);
        h.runs(2, r.clone());
        let e = h.command(3, depart(Departure::Left, crate::LeftKind::Left));
        let Op::Depart { record, lease } = the_op(&e) else {
            panic!("a departure: {e:?}")
        };
        assert_eq!(lease, LEASE);
        record
    };
    assert_eq!(
        leave(record_kv(&said("b", 1, v1::LeftKind::Left), 20)),
        None
    );
    // A finish of b's breaks nothing: a's leave is news.
    let finished = leave(record_kv(&said("b", 1, v1::LeftKind::Finished), 20));
    let spec = finished.expect("a's word");
    assert_eq!(left_put(&spec.then, "a", 1).kind(), v1::LeftKind::Left);
}

/// After an outage etcd may have come back empty and the members are still registering
/// again: nobody is called lost before the grace is over.
#[test]
fn nobody_is_called_lost_during_an_outages_grace() {
    let mut h = coordinating_a_round_of_two();
    h.disconnect();
    let e = h.fire();
    let r = round(1, &[("a", 1), ("b", 1)]);
    let (_, rest) = h.sync_through(
        e,
        &[
            round_kv(&r, 7),
            member_kv(&member("a", LEASE, 1, 1), 3),
            coordinator_kv("a", LEASE),
        ],
    );
    no_op(&rest);
    let grace = h.now + TTL + SECOND;
    let lost = loop {
        let e = h.fire();
        match the_op(&e) {
            Op::KeepAlive => {
                assert!(h.now < grace, "no word at the end of the grace");
                h.answer(Answer::Done);
            }
            Op::Txn(spec) => {
                assert!(h.now >= grace, "a word before the grace was over");
                break spec;
            }
            other => panic!("unexpected {other:?} during the grace"),
        }
    };
    assert_eq!(left_put(&lost.then, "b", 1).kind(), v1::LeftKind::Lost);
}

/// More than the hundred kept (a flood the writers' own trims could not keep up with):
/// the coordinator deletes the oldest, and not again once they are gone.
#[test]
fn the_coordinator_trims_the_records_beyond_the_hundred() {
    let k = keys();
    let extra: Vec<Kv> = (0..102)
        .map(|i| {
            record_kv(
                &said(&format!("n{i:03}"), 1, v1::LeftKind::Finished),
                100 + i,
            )
        })
        .collect();
    let r = round(1, &[("a", 1), ("b", 1)]);
    let mut kvs = vec![
        round_kv(&r, 7),
        member_kv(&member("a", LEASE, 1, 1), 3),
        member_kv(&member("b", 200, 1, 1), 4),
        coordinator_kv("a", LEASE),
    ];
    kvs.extend(extra);
    let (mut h, rest) = Harness::with(|c| c.can_probe = false).first_sync(&kvs);
    let spec = txn(the_op(&rest));
    assert!(spec.when.is_empty());
    assert_eq!(
        spec.then,
        vec![
            Write::Delete(k.key::<v1::Left>(&left_tail("n000", 1))),
            Write::Delete(k.key::<v1::Left>(&left_tail("n001", 1))),
        ]
    );
    let e = h.answer(Answer::Txn { succeeded: true });
    no_op(&e);
    assert_eq!(h.m.view().left.len(), 100);
}

/// A departing node makes room for its own word in the same transaction.
#[test]
fn a_departing_node_deletes_the_oldest_record_beside_its_word() {
    let k = keys();
    let extra: Vec<Kv> = (0..100)
        .map(|i| {
            record_kv(
                &said(&format!("n{i:03}"), 1, v1::LeftKind::Finished),
                100 + i,
            )
        })
        .collect();
    let mut h = Harness::synced_with(&extra);
    let e = h.command(1, depart(Departure::Finished, crate::LeftKind::Finished));
    let Op::Depart {
        record: Some(spec), ..
    } = the_op(&e)
    else {
        panic!("a departure with its word: {e:?}")
    };
    assert_eq!(left_put(&spec.then, "a", 1).kind(), v1::LeftKind::Finished);
    assert!(touches(
        &spec.then,
        &k.key::<v1::Left>(&left_tail("n000", 1))
    ));
    assert_eq!(spec.then.len(), 2, "{spec:?}");
}

/// A departure that etcd left unanswered past the driver's deadline is answered (leaving
/// never fails the agent) and ends the session; it is not kept for after a re-sync, which
/// would grant a new lease and register the leaving node again.
#[test]
fn an_unanswered_departure_ends_the_session_without_registering_again() {
    let mut h = Harness::synced();
    let e = h.command(1, depart(Departure::Finished, crate::LeftKind::Finished));
    assert!(matches!(the_op(&e), Op::Depart { .. }), "{e:?}");
    let e = h.fail(crate::etcd::errors::unanswered(Duration::from_secs(10)));
    replied_ok(&e, 1);
    assert!(h.m.ended(), "{:?}", h.m.phase());
    no_op(&e);
}

/// Departures applied to the store the simulator runs (its `etcd` module is the
/// simulator's).
#[cfg(feature = "sim")]
mod in_etcd {
    use super::*;

    /// Members of one round that leave together each built their departure before any word
    /// of the others reached them, so each view says its word is news. At 10,000 members
    /// every word under `ctl/` is sent to each of them (0.1–0.9 s of etcd's apply loop a
    /// word): 50 leaving at once stalled etcd past the TTL, the survivors' renewals waited
    /// for it, and the run collapsed (`rdzv-bench --lose leave --lose-count 50`). In etcd's
    /// own order only the first is news: the others' transactions write nothing.
    #[test]
    fn members_leaving_together_say_one_word_in_etcd() {
        let r = round(4, &[("a", 1), ("b", 1), ("c", 1)]);
        let going = |me: &str, how: Departure, kind: crate::LeftKind| {
            let (mut h, _) =
                Harness::with(|c| c.node_id = me.into()).first_sync(&[round_kv(&r, 7)]);
            h.runs(2, r.clone());
            let e = h.command(3, depart(how, kind));
            let Op::Depart {
                record: Some(spec), ..
            } = the_op(&e)
            else {
                panic!("{me}'s word: {e:?}")
            };
            spec
        };
        let leaving = |me: &str| going(me, Departure::Left, crate::LeftKind::Left);
        let (a, b) = (leaving("a"), leaving("b"));
        // A finish breaks nothing: each finishing member's word is news, never held back
        // (fenced, every node finishing after the first would be called lost at a run's end).
        let finish = going("c", Departure::Finished, crate::LeftKind::Finished);
        assert!(
            !finish
                .when
                .iter()
                .any(|c| matches!(c, Compare::NoneWrittenAfter { .. })),
            "{finish:?}"
        );
        // In either order: the range below a node's own key holds it back as the one above.
        for (first, then, said) in [(&a, &b, "a"), (&b, &a, "b")] {
            let mut etcd = store_at_the_rounds_revision();
            assert!(etcd.txn(crate::sim::etcd::txn(first)).unwrap().succeeded);
            assert!(!etcd.txn(crate::sim::etcd::txn(then)).unwrap().succeeded);
            let words: Vec<_> = words_of_round(&etcd, 4).map(|w| w.node_id).collect();
            assert_eq!(words, vec![said.to_owned()]);
        }
        // The revoke goes beside the word, and at 10,000 members the coordinator saw a's
        // registration go and wrote "lost" at a's key first: a's own word still replaces it
        // (its own key holds nothing back), b's stays unsaid.
        let mut etcd = store_at_the_rounds_revision();
        let mut lost = said("a", 1, v1::LeftKind::Lost);
        (lost.round, lost.written_by) = (4, "c".into());
        put_word(&mut etcd, &lost);
        assert!(etcd.txn(crate::sim::etcd::txn(&a)).unwrap().succeeded);
        assert!(!etcd.txn(crate::sim::etcd::txn(&b)).unwrap().succeeded);
        let kinds: Vec<_> = words_of_round(&etcd, 4)
            .map(|w| (w.node_id.clone(), w.kind()))
            .collect();
        assert_eq!(kinds, vec![("a".to_owned(), v1::LeftKind::Left)]);
    }

    /// The store the simulator runs, holding words of an older round up to revision 7, the
    /// round's own in these tests (the store starts at 1): they break nothing of round 4.
    fn store_at_the_rounds_revision() -> fsdp_store::state::State {
        let mut etcd = fsdp_store::state::State::new();
        for i in 0..6 {
            put_word(&mut etcd, &said("x", i, v1::LeftKind::Left));
        }
        assert_eq!(etcd.revision(), 7);
        etcd
    }

    fn put_word(etcd: &mut fsdp_store::state::State, word: &v1::Left) {
        etcd.put(fsdp_proto::etcdserverpb::PutRequest {
            key: keys().of(word).into_bytes(),
            value: fsdp_proto::encode(word),
            ..Default::default()
        })
        .unwrap();
    }

    /// The departure records `etcd` holds for round `n`.
    fn words_of_round(etcd: &fsdp_store::state::State, n: u64) -> impl Iterator<Item = v1::Left> {
        let prefix = keys().key::<v1::Left>("");
        let got = etcd
            .range(&fsdp_proto::etcdserverpb::RangeRequest {
                range_end: crate::sim::etcd::prefix_end(prefix.as_bytes()),
                key: prefix.into_bytes(),
                ..Default::default()
            })
            .unwrap();
        got.kvs
            .into_iter()
            .filter_map(|kv| v1::Left::decode(kv.value.as_slice()).ok())
            .filter(move |w| w.round == n)
    }
}
