//! etcd answering that it is overloaded, on a connection that works: the request goes
//! again after a backoff, the watches and the view stay (at 3,000 joining nodes
//! each dropped their watches on "request timed out" and read the run again, and etcd
//! never caught up).

use super::*;

/// etcd's answer when a proposal or a linearizable read timed out inside it.
pub(super) fn timed_out() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable(
        "etcdserver: request timed out, waiting for the applied index took too long",
    ))
}

pub(super) fn limited() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::resource_exhausted(
        "etcdserver: too many requests",
    ))
}

/// Watching, with the first keep-alive (due at once) sent and answered; past formation
/// (its requests are not paced: a joining node's pace is in `tests/admission.rs`).
fn watching(h: Harness) -> Harness {
    let (mut h, rest) = h.first_sync(&[]);
    no_op(&rest);
    h.m.admission.ran_a_round();
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
    no_op(&h.answer(Answer::Done));
    h
}

fn wait_ms(h: &Harness) -> u64 {
    let at = h.m.deadline().expect("a retry is due");
    (at.duration_since(h.now).as_secs_f64() * 1e3).round() as u64
}

#[test]
fn only_etcds_own_busy_answers_count_as_overload() {
    use crate::etcd::errors::overloaded;
    assert!(overloaded(&timed_out()) && overloaded(&limited()));
    let refused = etcd_client::Error::GRpcStatus(tonic::Status::unavailable(
        "error trying to connect: tcp connect error: Connection refused",
    ));
    assert!(!overloaded(&refused) && !overloaded(&cut()) && !overloaded(&no_such_lease()));
}

#[test]
fn a_command_etcd_was_too_busy_for_is_sent_again_with_the_watches_open() {
    let mut h = watching(Harness::new());
    let e = h.command(1, report_done(3));
    let sent = the_op(&e);
    let e = h.fail(timed_out());
    assert!(!closes_watches(&e) && replied(&e).is_empty());
    no_op(&e);
    assert!(h.m.view().connected);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert_eq!(wait_ms(&h), 100, "the first retry waits 100 ms");
    // Nothing else goes out meanwhile: a second command waits behind the first.
    no_op(&h.command(2, report_done(4)));
    // Busy again: the next wait doubles.
    let e = h.fire();
    assert_eq!(the_op(&e), sent);
    no_op(&h.fail(timed_out()));
    assert_eq!(wait_ms(&h), 200);
    let e = h.fire();
    assert_eq!(the_op(&e), sent);
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    // Then the second command, and the backoff starts afresh.
    assert!(matches!(the_op(&e), Op::Put(_)));
    replied_ok(&h.answer(Answer::Done), 2);
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 2);
}

#[test]
fn the_first_read_etcd_was_too_busy_for_is_sent_again_not_the_whole_sync() {
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), read_ctl());
    no_op(&h.fail(limited()));
    assert!(matches!(h.m.phase(), Phase::Syncing(Resync::First)));
    let e = h.fire();
    assert_eq!(the_op(&e), read_ctl());
    let (ops, _) = h.sync_through(e, &[]);
    assert!(matches!(ops.last(), Some(Op::Watch { .. })));
}

#[test]
fn an_etcd_busy_for_longer_than_the_outage_bound_ends_the_session() {
    let mut h = watching(Harness::new());
    h.command(1, report_done(3));
    no_op(&h.fail(timed_out()));
    h.later(Duration::from_secs(61));
    h.fire();
    let e = h.fail(timed_out());
    assert!(h.m.ended());
    let Err(err) = reply_of(&e, 1) else {
        panic!("the waiting command hears why")
    };
    assert!(err.to_string().contains("has not answered"), "{err}");
}

/// With several members, "request timed out" may be a member cut from its quorum: after
/// a quarter TTL of it, the outage path picks another member.
#[test]
fn with_several_members_a_long_busy_spell_tries_another_member() {
    let mut h = watching(Harness::with(|c| c.several_endpoints = true));
    h.command(1, report_done(3));
    let e = h.fail(timed_out());
    assert!(!closes_watches(&e));
    h.later(TTL / 4);
    h.fire();
    let e = h.fail(timed_out());
    assert!(closes_watches(&e));
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

/// A busy spell can outlast a TTL in retries: the lease is kept alive meanwhile, and the
/// answers move its clock, while the op itself waits for its turn.
#[test]
fn the_lease_is_kept_alive_while_a_request_waits_to_be_sent_again() {
    let mut h = watching(Harness::new());
    let e = h.command(1, report_done(3));
    let sent = the_op(&e);
    h.fail(timed_out());
    // The keep-alive falls due a third of a TTL later, before the op's next try ends.
    let mut kept_alive = 0;
    while kept_alive < 2 {
        let e = h.fire();
        if the_op(&e) == sent {
            h.fail(timed_out());
        } else {
            assert_eq!(the_op(&e), Op::KeepAlive);
            kept_alive += 1;
            h.step(Input::LeaseAnswer(Some(6)));
            no_op(&h.answer(Answer::Done));
        }
        assert!(h.now - h.t0 < TTL, "two keep-alives within a TTL");
    }
    let safe = h.m.view().lease_safe_until.expect("the clock moved");
    assert!(
        safe > h.t0 + TTL,
        "the keep-alive's answer moved the lease clock"
    );
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

pub(super) fn keep_alives_beside(effects: &[Effect]) -> usize {
    effects
        .iter()
        .filter(|e| matches!(e, Effect::KeepAlive))
        .count()
}

/// A write can wait in etcd longer than a TTL before "request timed out" comes back: the
/// lease's keep-alives go beside it when due, and their answers move the lease clock at
/// once, so the agent does not fence itself and etcd does not expire the lease while a
/// slow op is in flight (at 10,000 nodes, thousands of leases expired so).
#[test]
fn the_lease_is_kept_alive_while_an_op_waits_in_etcd() {
    let mut h = watching(Harness::new());
    no_op(&h.step(Input::LeaseAnswer(Some(6))));
    h.command(1, report_done(3));
    let mut beside = 0;
    for n in 1..=5 {
        let e = h.fire();
        assert_eq!(
            keep_alives_beside(&e),
            1,
            "keep-alive {n} went beside the op"
        );
        assert!(etcd_ops(&e).is_empty(), "nothing else is sent: {e:?}");
        assert_eq!(h.now, h.t0 + TTL / 3 * n, "one each third of a TTL");
        beside += 1;
        let e = h.step(Input::LeaseAnswer(Some(6)));
        no_op(&e);
        assert_eq!(
            h.m.view().lease_safe_until,
            Some(h.now + TTL),
            "the answer counted at once"
        );
    }
    assert!(h.now - h.t0 > TTL, "the op waited longer than a TTL");
    assert!(h.m.busy(), "still the same op in flight");
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert_eq!(beside, 5);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

/// A keep-alive answer that arrives while an op is in flight behind another answer still
/// queued counts after it, in order; and no keep-alive goes beside the op on a stream etcd
/// ended (a new one is opened after the answer).
#[test]
fn no_keep_alive_goes_beside_an_op_on_an_ended_stream() {
    let mut h = watching(Harness::new());
    h.command(1, report_done(3));
    let e = h.step(Input::KeepAliveFailed(timed_out().into()));
    no_op(&e);
    // Queued: the machine hears of the end after the answer; until then the stream
    // still counts as open, and one keep-alive goes on it.
    assert_eq!(keep_alives_beside(&h.fire()), 1);
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    no_op(&h.answer(Answer::Done));
    h.command(2, report_done(4));
    assert!(h.m.busy());
    assert!(
        h.m.deadline().is_some(),
        "the reopened stream is kept alive"
    );
}

/// What the watches bring while an op waits is kept for after its answer, and counted
/// (the driver stops reading the watches past a bound, see `driver.rs`).
#[test]
fn watch_events_that_come_while_an_op_waits_are_counted_until_taken() {
    let mut h = watching(Harness::new());
    h.command(1, report_done(3));
    let kv = Kv {
        key: "k".repeat(10),
        value: vec![0; 990],
        create_rev: 5,
        mod_rev: 5,
        lease: 0,
    };
    no_op(&h.step(Input::Watched(vec![WatchEvent::Put(kv.clone())])));
    no_op(&h.step(Input::Watched(vec![WatchEvent::Put(kv)])));
    assert_eq!(h.m.queued_bytes(), 2_000);
    h.answer(Answer::Done);
    assert_eq!(h.m.queued_bytes(), 0, "taken once the op was answered");
}

/// etcd ends a keep-alive stream it is too busy to renew on: a new keep-alive stream
/// for the same lease, the watches kept. Any other end of it is an outage as before.
#[test]
fn a_keep_alive_stream_etcd_ended_for_load_is_opened_again_beside_the_watches() {
    let mut h = watching(Harness::new());
    let e = h.step(Input::KeepAliveFailed(timed_out().into()));
    assert!(!closes_watches(&e));
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    no_op(&h.answer(Answer::Done));
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);

    let e = h.step(Input::KeepAliveFailed(cut().into()));
    // (The keep-alive in flight is answered first: one op at a time.)
    assert!(e.is_empty());
    let e = h.answer(Answer::Done);
    assert!(closes_watches(&e));
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

/// The keep-alive stream ended while a request waits to be sent again: the keep-alives
/// that fall due meanwhile go on a new stream, never on the ended one (found at 4,000
/// nodes: "channel closed", and an outage for every node).
#[test]
fn a_keep_alive_stream_ended_during_a_retry_is_opened_again_before_the_next_keep_alive() {
    let mut h = watching(Harness::new());
    let e = h.command(1, report_done(3));
    let sent = the_op(&e);
    h.fail(timed_out());
    // A new stream at once, while the request still waits.
    let e = h.step(Input::KeepAliveFailed(timed_out().into()));
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    no_op(&h.answer(Answer::Done));
    loop {
        let e = h.fire();
        match the_op(&e) {
            // On the new stream.
            Op::KeepAlive => break,
            op => {
                assert_eq!(op, sent);
                h.fail(timed_out());
            }
        }
        assert!(h.now - h.t0 < TTL, "a keep-alive within a TTL");
    }
}

/// A new keep-alive stream that etcd is too busy to open (its first renewal times out)
/// while a command waits to be sent again: the command keeps its place and is answered,
/// and the reopen waits for the next keep-alive period instead of going out again at once.
#[test]
fn a_reopen_etcd_is_too_busy_for_never_takes_a_waiting_commands_place() {
    let mut h = watching(Harness::new());
    let e = h.command(1, report_done(3));
    let sent = the_op(&e);
    h.fail(timed_out());
    let e = h.step(Input::KeepAliveFailed(timed_out().into()));
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    no_op(&h.fail(timed_out()));
    // Next: the command, not another reopen.
    let e = h.fire();
    assert_eq!(the_op(&e), sent);
    replied_ok(&h.answer(Answer::Done), 1);
    // The reopen comes back when the next keep-alive falls due, a third of a TTL on.
    let e = h.fire();
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    assert!(h.now - h.t0 >= TTL / 3);
}

/// A departure goes ahead of a command waiting to go again after etcd was too busy for
/// it, and ends the session: that command is told the session ended, not left unanswered.
#[test]
fn a_command_waiting_its_backoff_is_answered_when_a_departure_ends_the_session() {
    let mut h = watching(Harness::new());
    h.command(1, report_done(3));
    no_op(&h.fail(timed_out()));
    let e = h.command(2, depart(Departure::Finished, crate::LeftKind::Finished));
    assert!(matches!(the_op(&e), Op::Depart { .. }), "{e:?}");
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 2);
    assert!(reply_of(&e, 1).is_err(), "{e:?}");
    assert_eq!(h.m.phase(), Phase::Ended);
}
