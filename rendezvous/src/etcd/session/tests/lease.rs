//! Keep-alives, the lease clock and the prober.

use super::*;

fn probes(effects: &[Effect]) -> Vec<bool> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Probe(on) => Some(*on),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Keep-alives, the lease clock and the prober
// ---------------------------------------------------------------------------------------

#[test]
fn the_first_timer_sends_a_keep_alive_and_the_next_is_a_third_of_the_ttl_later() {
    let mut h = Harness::synced();
    assert_eq!(
        h.m.deadline(),
        Some(h.t0),
        "due as soon as the watches open"
    );
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    let e = h.answer(Answer::Done);
    no_op(&e);
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 3));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
}

/// In a crowd a joining node's lease is kept alive from its grant, and the watches'
/// open keeps those times: no keep-alive at once (it was one renewal more per node, a
/// fifth of what etcd renewed while 10,000 nodes formed); the first a third of a TTL
/// after the grant, and on from there.
#[test]
fn in_a_crowd_the_first_keep_alive_comes_a_third_of_a_ttl_after_the_grant() {
    let (mut h, rest) = Harness::with(|c| c.crowd = true).first_sync(&[]);
    no_op(&rest);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 3), "not at once");
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(h.m.deadline(), Some(h.t0 + 2 * TTL / 3));
}

/// A crowd node whose registration, waiting through the first sync, found its lease gone
/// and was written on a new one: the watches opened for the old lease, so it syncs again
/// for the new one, and that lease's keep-alives start at once (no stream was kept from
/// its grant).
#[test]
fn in_a_crowd_a_lease_granted_again_during_the_first_sync_is_kept_alive_at_once() {
    let mut h = Harness::with(|c| c.crowd = true);
    let effects = h.m.start(h.now);
    no_op(&h.command(1, Command::Register { wants_round: 0 }));
    let (ops, rest) = h.sync_through(effects, &[coordinator_kv("b", 200)]);
    assert!(matches!(ops.last(), Some(Op::Watch { .. })), "{ops:?}");
    assert!(
        matches!(the_op(&rest), Op::Txn(_)),
        "the registration: {rest:?}"
    );
    let e = h.fail(no_such_lease());
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert!(matches!(the_op(&e), Op::Txn(_)));
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    assert!(closes_watches(&e));
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
    let (_, rest) = h.sync_through(e, &[coordinator_kv("b", 200)]);
    // Its registration is not in the read: written again on the new lease.
    assert!(matches!(the_op(&rest), Op::Txn(_)), "{rest:?}");
    let e = h.answer(Answer::Txn { succeeded: true });
    let (ops, rest) = h.sync_through(e, &[]);
    assert!(
        matches!(ops.last(), Some(Op::Watch { lease: 300, .. })),
        "{ops:?}"
    );
    no_op(&rest);
    assert_eq!(h.m.deadline(), Some(h.now), "a keep-alive at once");
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
}

#[test]
fn an_answered_keep_alive_extends_lease_safe_until_from_when_it_was_sent() {
    let mut h = Harness::synced();
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + TTL));
    h.at_ms(1_000);
    let e = h.timer();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    let _ = h.m.changed_view();
    h.at_ms(1_050);
    h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + SECOND + TTL));
    // Later: handed on in place, waking nobody.
    assert!(h.m.changed_view().is_none());
    assert_eq!(h.m.lease_moved(), Some(Some(h.t0 + SECOND + TTL)));
    assert_eq!(h.m.lease_moved(), None, "once");
}

#[test]
fn a_lease_answer_of_none_grants_registers_and_resyncs() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.step(Input::LeaseAnswer(None));
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Member>("a"));
    assert_eq!(lease, 300);
    assert_eq!(v1::Member::decode(value).unwrap().incarnation, 2);
    let e = h.answer(Answer::Txn { succeeded: true });
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_ctl());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
}

/// A node that runs round R and registers again on a new lease asks for R at least: a
/// coordinator sealing afresh on an etcd that lost its data seals no lower number, which
/// the node would take for an old round (simulator seed 941517).
#[test]
fn a_running_node_registered_again_asks_for_the_round_it_runs() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    replied_ok(&h.runs(2, round(7, &[("a", 1), ("b", 1)])), 2);
    let e = h.step(Input::LeaseAnswer(None));
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    let spec = txn(the_op(&e));
    let (value, _) = put_at(&spec.then, &k.key::<v1::Member>("a"));
    assert_eq!(v1::Member::decode(value).unwrap().wants_round, 7);
}

/// An answer to a keep-alive sent before etcd said the lease is gone says it again, and
/// changes nothing: one lease lost, one grant.
#[test]
fn a_second_word_that_the_lease_is_gone_changes_nothing() {
    let mut h = Harness::synced();
    let e = h.step(Input::LeaseAnswer(None));
    no_op(&h.step(Input::LeaseAnswer(Some(0))));
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    assert_eq!(h.counters.leases_lost.load(Ordering::Relaxed), 1);
}

/// An ended keep-alive stream is taken for a lease gone; when etcd then says the lease
/// stands (the grant cut, the resync's time-to-live), a later word that it is gone is
/// heard again: a new grant.
#[test]
fn a_lease_said_to_stand_after_its_end_was_feared_is_granted_again_when_it_goes() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.step(Input::LeaseAnswer(None));
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    h.fail(cut());
    let e = h.fire();
    let (ops, rest) = h.sync_through(e, &[coordinator_kv("b", 200)]);
    assert!(ops.contains(&Op::TimeToLive { lease: LEASE }), "{ops:?}");
    // The lease stands: its registration is written on it again, no lease granted.
    let spec = txn(the_op(&rest));
    assert_eq!(put_at(&spec.then, &keys().key::<v1::Member>("a")).1, LEASE);
    let e = h.answer(Answer::Txn { succeeded: true });
    let (ops, _) = h.sync_through(e, &[]);
    assert!(matches!(ops.last(), Some(Op::Watch { .. })), "{ops:?}");
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    let e = h.step(Input::LeaseAnswer(Some(0)));
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
}

#[test]
fn a_lease_answer_of_none_without_a_registration_only_grants_and_resyncs() {
    let mut h = Harness::synced();
    let e = h.step(Input::LeaseAnswer(None));
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!(the_op(&e), read_ctl());
}

#[test]
fn a_lease_gone_after_safe_until_while_running_records_this_nodes_departure() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    h.runs(2, round(1, &[("a", 1), ("b", 1)]));
    // Safe until t0 + 6 s: from then on etcd may have expired it.
    h.at_ms(6_500);
    h.step(Input::LeaseAnswer(None));
    assert_eq!(
        h.m.view().departed.get("a"),
        Some(&Departed {
            at: h.now,
            incarnation: 1
        })
    );
}

#[test]
fn a_lease_gone_before_safe_until_records_no_departure() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    h.runs(2, round(1, &[("a", 1), ("b", 1)]));
    // etcd cannot have expired it yet: it lost its data, and nobody saw this node leave.
    h.at_ms(3_000);
    let e = h.step(Input::LeaseAnswer(None));
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    assert!(h.m.view().departed.is_empty());
}

/// A synced node that runs a round (its workers are what a probe's proof spares).
fn running() -> Harness {
    let mut h = Harness::synced();
    replied_ok(&h.runs(90, round(1, &[("a", 1), ("b", 1)])), 90);
    h
}

/// Two keep-alives sent and none answered: the next tick finds the lease in doubt.
fn late_tick(h: &mut Harness) -> Vec<Effect> {
    h.fire();
    h.answer(Answer::Done);
    h.fire();
    h.answer(Answer::Done);
    h.fire()
}

#[test]
fn with_one_member_a_keep_alive_unanswered_near_the_fence_asks_etcd() {
    let mut h = running();
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    let e = h.fire();
    assert_eq!(h.now, h.t0 + TTL / 3);
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    // Safe until t0 + 6 s; etcd is asked a margin (1 s), a quarter TTL and a sixteenth
    // before it.
    let due = h.t0 + TTL - SECOND - TTL / 4 - TTL / 16;
    assert_eq!(h.m.deadline(), Some(due));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    no_op(&h.answer(Answer::TimeToLive { ttl: 6 }));
    // In trouble: the next wake-up is the next keep-alive, not the answer again.
    assert_eq!(h.m.deadline(), Some(h.t0 + 2 * TTL / 3));
}

/// The look for proof that etcd has no leader (two fresh connections and a status call)
/// waits a sixteenth of a TTL for etcd's answer to the question about the lease, and
/// starts while that question is still in flight; asked that much earlier, the look starts
/// when it did. At the seal of 10,000 nodes on etcd 3.5, every member whose renewal was
/// a second late looked at once: thousands of fresh connections a second to an etcd that
/// was slow, not gone (13.6% of its CPU was setting them up), and the bench's own CPU
/// went to the kernel's search for free ports.
#[test]
fn the_look_for_proof_starts_only_if_etcd_has_not_answered_for_the_lease_a_sixteenth_ttl_later() {
    let mut h = running();
    let e = late_tick(&mut h);
    let asked = h.now;
    assert_eq!(asked, h.t0 + TTL - SECOND - TTL / 4 - TTL / 16);
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    assert_eq!(probes(&e), Vec::<bool>::new());
    // Unanswered: the look starts a sixteenth TTL later, the question still in flight.
    assert_eq!(h.m.deadline(), Some(asked + TTL / 16));
    let e = h.fire();
    assert_eq!(probes(&e), vec![true]);
    assert!(etcd_ops(&e).is_empty(), "{e:?}");
    // etcd's word that the lease stands then stops it.
    let e = h.answer(Answer::TimeToLive { ttl: 5 });
    assert_eq!(probes(&e), vec![false]);
}

/// A machine woken late for a late keep-alive (a busy runtime) asks and looks at once:
/// the look's moment is counted from the lease clock, not from the wake-up, so the proof
/// of a frozen etcd still has the time before the fence it had.
#[test]
fn a_late_keep_alive_heard_late_asks_and_looks_at_once() {
    let mut h = running();
    h.fire();
    h.answer(Answer::Done);
    h.fire();
    h.answer(Answer::Done);
    let asked = h.t0 + TTL - SECOND - TTL / 4 - TTL / 16;
    assert_eq!(h.m.deadline(), Some(asked));
    h.now = asked + TTL / 8;
    let e = h.timer();
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    assert_eq!(probes(&e), vec![true]);
    assert_eq!(h.m.look_held_until(), None);
}

/// A keep-alive answered while the look is held ends the trouble: the look never
/// starts, and nothing is held any more. A lost connection while it is held looks at
/// once (no question can be answered on it).
#[test]
fn a_held_look_ends_with_an_answered_keep_alive_and_starts_with_a_lost_connection() {
    let mut h = running();
    late_tick(&mut h);
    assert!(h.m.look_held_until().is_some());
    let e = h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(probes(&e), Vec::<bool>::new());
    assert_eq!(h.m.look_held_until(), None);

    let mut h = running();
    late_tick(&mut h);
    assert_eq!(probes(&h.fail(cut())), vec![true]);
    assert_eq!(h.m.look_held_until(), None);
}

/// etcd answering the question in time starts no look at all: a slow etcd that answers
/// is given no fresh connections.
#[test]
fn etcd_answering_for_the_lease_in_time_starts_no_look() {
    let mut h = running();
    let e = late_tick(&mut h);
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    h.later(Duration::from_millis(100));
    let e = h.answer(Answer::TimeToLive { ttl: 5 });
    assert_eq!(probes(&e), Vec::<bool>::new());
    // Nothing held: the next wake-up is the next keep-alive, and it looks for nothing.
    assert_eq!(h.m.deadline(), Some(h.t0 + 2 * TTL / 3));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    assert_eq!(probes(&e), Vec::<bool>::new());
}

/// A node still forming has no workers to fence, and does not look for proof (in a crowd
/// on a slow etcd, thousands of joining nodes' looks were fresh connections and status
/// requests every quarter TTL: half the bench's CPU at 10,000 nodes). It still asks etcd
/// once, but only at the fencing margin, not a quarter TTL before it (every late
/// keep-alive of a crowd on etcd 3.4 asked so: 12,863 questions by 27 s into a formation
/// of 10,000); the look starts when it runs a round, if the trouble lasts.
#[test]
fn a_forming_node_asks_etcd_at_the_margin_but_looks_for_no_proof_until_it_runs_a_round() {
    let mut h = Harness::synced();
    h.fire();
    h.answer(Answer::Done);
    h.fire();
    h.answer(Answer::Done);
    // Safe until t0 + 6 s: not asked a quarter TTL and a margin before (3.5 s)...
    let e = h.fire();
    assert_eq!((the_op(&e), h.now), (Op::KeepAlive, h.t0 + 2 * TTL / 3));
    h.answer(Answer::Done);
    // ...but at the margin (1 s) before.
    let e = h.fire();
    assert_eq!(h.now, h.t0 + TTL - SECOND);
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    assert_eq!(probes(&e), Vec::<bool>::new());
    no_op(&h.answer(Answer::TimeToLive { ttl: 0 }));
    // Asked once: the next wake-up is the next keep-alive.
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL));
    let round = std::sync::Arc::new(round(1, &[("a", 1), ("b", 1)]));
    let e = h.command(
        90,
        Command::Running {
            round: round.clone(),
        },
    );
    assert_eq!(probes(&e), vec![true]);
    // Only the first round starts it: a later one leaves the look as it goes.
    let e = h.command(91, Command::Running { round });
    assert_eq!(probes(&e), Vec::<bool>::new());
    // An answered keep-alive stops it.
    assert_eq!(probes(&h.step(Input::LeaseAnswer(Some(6)))), vec![false]);
}

/// A renewal that was only slow (a busy machine or etcd): etcd's answer that the lease
/// stands moves the lease clock, so the node is not fenced for it (1,000 agents started
/// right after another 1,000-agent run fenced 79 of them so).
#[test]
fn a_late_keep_alive_asks_etcd_and_its_word_that_the_lease_stands_moves_the_clock() {
    let mut h = Harness::synced();
    let (before, sent) = asked_after_a_late_keep_alive(&mut h);
    h.later(Duration::from_millis(300));
    no_op(&h.answer(Answer::TimeToLive { ttl: 5 }));
    let after = h.m.view().lease_safe_until.expect("a clock");
    assert_eq!(after, sent + Duration::from_secs(5));
    assert!(after > before);
}

/// etcd says the lease is gone: registered again as after a keep-alive that found it so.
#[test]
fn a_late_keep_alive_whose_lease_etcd_says_is_gone_grants_another() {
    let mut h = Harness::synced();
    asked_after_a_late_keep_alive(&mut h);
    let e = h.answer(Answer::TimeToLive { ttl: -1 });
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    assert_eq!(h.counters.leases_lost.load(Ordering::Relaxed), 1);
}

/// etcd answered that the lease stands: it has a leader (a one-member etcd answers for
/// its leases only as one), so a look for proof that it has none is moot, and each look
/// is two fresh connections. At the seal of 10,000 nodes on etcd 3.5, the members whose
/// renewals were late looked every quarter TTL until a keep-alive came back: thousands of
/// connections a second to an etcd already behind, whose renewals fell to a third and
/// whose leases then expired. The look stops; after a keep-alive answered, the next late
/// one is asked about again, and looked for if etcd is slow to answer (a lost connection
/// looks at once, below).
#[test]
fn etcd_saying_the_lease_stands_stops_the_look_for_proof() {
    let mut h = running();
    let e = late_tick(&mut h);
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    // etcd is slow to answer: the look starts.
    assert_eq!(probes(&h.fire()), vec![true]);
    let e = h.answer(Answer::TimeToLive { ttl: 5 });
    assert_eq!(probes(&e), vec![false], "{e:?}");
    // Not asked again before the next keep-alive is answered or late.
    assert_eq!(h.m.deadline(), Some(h.t0 + 2 * TTL / 3));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    assert_eq!(probes(&e), Vec::<bool>::new());
    // A keep-alive answered ends the trouble; the next late one is asked about again,
    // and looked for if etcd is slow to answer.
    h.answer(Answer::Done);
    let answered = h.now;
    assert!(!probes(&h.step(Input::LeaseAnswer(Some(6)))).contains(&true));
    let asked = until_asked(&mut h);
    // The answer was the keep-alive sent at t0, taken 4 s later: the one sent a third of
    // a TTL after it is asked about once it has waited as long, and an eighth of a TTL
    // (before, at once). Its look then starts at the fence: too late to spare it.
    assert_eq!(answered, h.t0 + 4 * SECOND);
    assert_eq!(h.now, h.t0 + TTL / 3 + 4 * SECOND + TTL / 8);
    assert_eq!(probes(&asked), Vec::<bool>::new());
    assert_eq!(probes(&h.fire()), vec![true]);
}

/// Fires the timers, each keep-alive sent and none answered by etcd, until etcd is asked
/// about the lease; returns what the machine did then.
fn until_asked(h: &mut Harness) -> Vec<Effect> {
    let ask = Op::TimeToLive { lease: LEASE };
    for _ in 0..8 {
        let mut e = h.fire();
        if etcd_ops(&e).contains(&Op::KeepAlive) {
            e.extend(h.answer(Answer::Done));
        }
        if etcd_ops(&e).contains(&ask) {
            return e;
        }
    }
    panic!("etcd was never asked about the lease");
}

/// The next keep-alive goes, and etcd's answer is taken `latency` later.
fn keep_alive_answered_after(h: &mut Harness, latency: Duration) {
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
    h.answer(Answer::Done);
    h.later(latency);
    no_op(&h.step(Input::LeaseAnswer(Some(6))));
}

/// A running node whose keep-alives are answered late, but answered, asks etcd nothing
/// while a keep-alive has waited no longer than the last one took (and an eighth of a
/// TTL): its question would be answered as late (a slow etcd, or a host too busy to read
/// the answers). At the seal of 10,000 nodes on one host, every member asked at once when
/// the host was busiest: 12,741 questions in 20 s, each answered seconds late, and the
/// leases lapsed behind them.
#[test]
fn keep_alives_answered_late_but_answered_ask_etcd_nothing_while_no_slower() {
    let mut h = running();
    let sent = h.now;
    // Answered 1.5 s late: safe until sent + TTL, the fence a second before.
    let slow = Duration::from_millis(1500);
    keep_alive_answered_after(&mut h, slow);
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
    let second = h.now;
    h.answer(Answer::Done);
    // Before, etcd was asked a quarter and a sixteenth of a TTL before the fence (3.125 s
    // after the first keep-alive); now once the second has waited 1.5 s and an eighth of
    // a TTL (4.25 s): the next wake-up is the next keep-alive (4 s), not a question.
    assert_eq!(h.m.deadline(), Some(sent + 2 * TTL / 3));
    // The answer comes as late as the first: nothing is asked.
    h.now = second + slow;
    no_op(&h.step(Input::LeaseAnswer(Some(6))));
    let e = h.fire();
    assert_eq!(etcd_ops(&e), vec![Op::KeepAlive]);
    let third = h.now;
    // Then the stream goes quiet: asked once the keep-alive has waited as long as the
    // last one and an eighth of a TTL, and looked for a sixteenth of a TTL later.
    h.answer(Answer::Done);
    let asked = until_asked(&mut h);
    assert_eq!(h.now, third + slow + TTL / 8);
    assert!(h.now < second + TTL - SECOND, "asked before the fence");
    assert_eq!(probes(&asked), Vec::<bool>::new());
    assert_eq!(probes(&h.fire()), vec![true]);
}

/// An etcd that answered promptly and then went silent (frozen) is asked at the moment it
/// was before, a quarter and a sixteenth of a TTL before the fence: the look for proof
/// that it has no leader keeps its time. One that answered slower is asked later.
/// "Promptly" is 23% of the TTL less the fence margin: 375 ms with this harness's TTL of
/// 6 s and margin of 1 s, 150 ms (3%) with the agent's 5 s (`answer_due`).
#[test]
fn a_silent_etcd_that_answered_promptly_is_asked_at_the_old_moment() {
    // The bound: the second keep-alive (a third of a TTL after the first) plus the
    // latency plus an eighth of a TTL reaches the old moment at 375 ms here (TTL 6 s).
    for (latency_ms, late_ms) in [(50, 0), (375, 0), (500, 125)] {
        let mut h = running();
        let sent = h.now;
        keep_alive_answered_after(&mut h, Duration::from_millis(latency_ms));
        let asked = until_asked(&mut h);
        let old = sent + TTL - SECOND - TTL / 4 - TTL / 16;
        assert_eq!(
            h.now,
            old + Duration::from_millis(late_ms),
            "answered in {latency_ms} ms"
        );
        assert_eq!(probes(&asked), Vec::<bool>::new());
        assert_eq!(h.now + TTL / 16, h.m.deadline().expect("the held look"));
        assert_eq!(probes(&h.fire()), vec![true]);
    }
}

/// A forming node whose late keep-alive etcd answered for (the lease stands) does not
/// start the look when its round comes: etcd spoke since.
#[test]
fn a_forming_node_etcd_answered_for_starts_no_look_with_its_round() {
    let mut h = Harness::synced();
    asked_after_a_late_keep_alive(&mut h);
    no_op(&h.answer(Answer::TimeToLive { ttl: 4 }));
    let round = std::sync::Arc::new(round(1, &[("a", 1), ("b", 1)]));
    let e = h.command(90, Command::Running { round });
    assert_eq!(probes(&e), Vec::<bool>::new());
}

/// A lost connection after etcd spoke for the lease looks again: etcd may have gone down
/// since (a restart right after a slow spell), and the proof of it spares the workers.
/// (Found by a review: the look stayed off until a keep-alive was answered, which a
/// stopped etcd never does.)
#[test]
fn a_lost_connection_after_etcd_spoke_for_the_lease_looks_again() {
    let mut h = running();
    late_tick(&mut h);
    assert_eq!(probes(&h.fire()), vec![true]);
    let e = h.answer(Answer::TimeToLive { ttl: 5 });
    assert_eq!(probes(&e), vec![false]);
    let e = h.disconnect();
    assert_eq!(probes(&e), vec![true]);
}

#[test]
fn an_answered_keep_alive_stops_the_probe() {
    let mut h = running();
    late_tick(&mut h);
    assert_eq!(probes(&h.fire()), vec![true]);
    let e = h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(probes(&e), vec![false]);
}

#[test]
fn no_leader_extends_lease_safe_until() {
    let mut h = Harness::synced();
    h.at_ms(3_500);
    h.step(Input::NoLeader {
        sent: h.t0 + 3 * SECOND,
        silent: false,
    });
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + 3 * SECOND + TTL));
}

/// "Nothing answered a fresh connection" is what a stopped etcd shows, and also one too
/// loaded to accept in time. A session that heard etcd within an eighth of a TTL before
/// the look takes it for the second: no proof. One that heard nothing takes the proof; a
/// leaderless status counts whatever was heard.
#[test]
fn a_silent_etcd_proves_no_leader_only_if_the_session_heard_nothing_from_it_lately() {
    let mut h = Harness::synced();
    let before = h.m.view().lease_safe_until;
    h.at_ms(3_000);
    // etcd answers a watch: it lives.
    h.step(Input::Watched(vec![]));
    let soon = h.t0 + 3 * SECOND + TTL / 8 - Duration::from_millis(1);
    h.now = soon;
    h.step(Input::NoLeader {
        sent: soon,
        silent: true,
    });
    assert_eq!(
        h.m.view().lease_safe_until,
        before,
        "heard just before: no proof"
    );
    h.step(Input::NoLeader {
        sent: soon,
        silent: false,
    });
    assert_eq!(
        h.m.view().lease_safe_until,
        Some(soon + TTL),
        "etcd said it has no leader"
    );
    // Heard nothing since 3 s: at 3 s + TTL/8 a silent look proves no leader again.
    let quiet = h.t0 + 3 * SECOND + TTL / 8;
    h.now = quiet;
    h.step(Input::NoLeader {
        sent: quiet,
        silent: true,
    });
    assert_eq!(h.m.view().lease_safe_until, Some(quiet + TTL));
}

/// The local answer to a keep-alive's send is not etcd speaking; its own answers are.
#[test]
fn a_keep_alives_local_send_is_not_hearing_from_etcd() {
    let mut h = Harness::synced();
    assert_eq!(the_op(&h.fire()), Op::KeepAlive);
    h.at_ms(500);
    // Heard during the sync at t0; the local "sent" at 0.5 s does not count.
    h.answer(Answer::Done);
    let sent = h.t0 + TTL / 8;
    h.now = sent;
    h.step(Input::NoLeader { sent, silent: true });
    assert_eq!(h.m.view().lease_safe_until, Some(sent + TTL));
}

#[test]
fn with_several_endpoints_a_late_keep_alive_drops_the_connection_and_the_next_sync_picks_an_endpoint()
 {
    let (mut h, rest) = Harness::with(|c| c.several_endpoints = true).first_sync(&[]);
    no_op(&rest);
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 4));
    let e = h.fire();
    no_op(&e);
    assert!(closes_watches(&e));
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::PickEndpoint);
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), read_ctl());
}

/// An op that etcd left unanswered past the driver's deadline may have died with its
/// connection (HTTP/2 closed under it by the client library), and the requests that
/// follow on that connection too: the next sync connects afresh even to the one member.
/// A plain cut (etcd restarted) reuses the client, which reconnects by itself.
#[test]
fn an_unanswered_op_makes_the_next_sync_connect_afresh_even_to_one_member() {
    for (error, fresh) in [
        (
            crate::etcd::errors::unanswered(Duration::from_secs(10)),
            true,
        ),
        (cut(), false),
    ] {
        let mut h = Harness::synced();
        let e = h.fire();
        assert_eq!(the_op(&e), Op::KeepAlive);
        let e = h.fail(error);
        assert!(closes_watches(&e));
        assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
        let e = h.fire();
        if fresh {
            assert_eq!(the_op(&e), Op::PickEndpoint);
            let e = h.answer(Answer::Done);
            assert_eq!(the_op(&e), read_ctl());
        } else {
            assert_eq!(the_op(&e), read_ctl());
        }
    }
}

/// A leader not yet keeping leases after an election answers a time-to-live with the
/// largest TTL there is: the clock moves by the TTL granted at most, or the node would
/// never fence.
#[test]
fn etcds_word_on_a_late_keep_alive_moves_the_clock_by_the_ttl_granted_at_most() {
    let mut h = Harness::synced();
    let (_, sent) = asked_after_a_late_keep_alive(&mut h);
    no_op(&h.answer(Answer::TimeToLive { ttl: 9_223_372_036 }));
    assert_eq!(h.m.view().lease_safe_until, Some(sent + TTL));
}

/// Two keep-alives sent and not answered, the second late near the fence: etcd is asked
/// how long the lease has left. Returns the lease clock before and when the question went.
fn asked_after_a_late_keep_alive(h: &mut Harness) -> (Instant, Instant) {
    h.fire();
    h.answer(Answer::Done);
    h.fire();
    h.answer(Answer::Done);
    let before = h.m.view().lease_safe_until.expect("a clock");
    let mut e = h.fire();
    // A forming node asks at the fencing margin, after the next keep-alive went.
    while the_op(&e) == Op::KeepAlive {
        h.answer(Answer::Done);
        e = h.fire();
    }
    assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
    (before, h.now)
}

// ---------------------------------------------------------------------------------------
// etcd's member count in a crowd
// ---------------------------------------------------------------------------------------

/// Fires the machine's timers, answering keep-alives (`answered`: with the lease's TTL, or
/// not at all), until an op other than a keep-alive comes; returns it and when.
#[track_caller]
fn until_other_than_keep_alive(h: &mut Harness, answered: bool) -> (Op, Instant) {
    for _ in 0..20 {
        let e = h.fire();
        match etcd_ops(&e).first() {
            Some(Op::KeepAlive) => {
                h.answer(Answer::Done);
                if answered {
                    h.step(Input::LeaseAnswer(Some(6)));
                }
            }
            Some(op) => return (op.clone(), h.now),
            None => {}
        }
    }
    panic!("only keep-alives came")
}

/// A crowd's node asks etcd's member count not at its join (10,000 member lists in the
/// seconds etcd is busiest) but once it runs its first round, at a moment drawn from its
/// id between half a TTL and a TTL after it: the prober it needs then (a one-member
/// etcd's lack of a leader) needs the count. A node outside a crowd asks at its join,
/// as before.
#[test]
fn a_crowds_node_asks_etcds_member_count_within_a_ttl_of_its_first_round_not_at_its_join() {
    for crowd in [false, true] {
        let mut h = Harness::with(|c| c.crowd = crowd);
        let effects = h.m.start(h.now);
        let (ops, rest) = h.sync_through(effects, &[coordinator_kv("b", 99)]);
        no_op(&rest);
        assert_eq!(
            ops.contains(&Op::MemberCount),
            !crowd,
            "crowd {crowd}: {ops:?}"
        );
        h.register(1, 0, true);
        replied_ok(&h.runs(2, round(1, &[("a", 1), ("b", 1)])), 2);
        if !crowd {
            continue;
        }
        let ran = h.now;
        let (op, at) = until_other_than_keep_alive(&mut h, true);
        assert_eq!(op, Op::MemberCount);
        assert!(at >= ran + TTL / 2 && at <= ran + TTL, "{:?}", at - ran);
        no_op(&h.answer(Answer::MemberCount(1)));
        // Asked once.
        let (op, _) = until_other_than_keep_alive(&mut h, false);
        assert_eq!(
            op,
            Op::TimeToLive { lease: LEASE },
            "a late keep-alive asks"
        );
    }
}

/// A crowd's forming node whose keep-alive is late asks etcd about its lease as a node
/// of a one-member etcd does, and learns the count with the question: with one member
/// the question follows; with several it is not asked (as before the count was put
/// off), and the machine does not wake again for it.
#[test]
fn a_crowds_forming_node_with_a_late_keep_alive_asks_the_member_count_with_the_lease_question() {
    for members in [1, 3] {
        let (mut h, rest) = Harness::with(|c| c.crowd = true).first_sync(&[]);
        no_op(&rest);
        let (op, _) = until_other_than_keep_alive(&mut h, false);
        assert_eq!(op, Op::MemberCount);
        let e = h.answer(Answer::MemberCount(members));
        if members == 1 {
            assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
            no_op(&h.answer(Answer::TimeToLive { ttl: 6 }));
        } else {
            no_op(&e);
        }
        assert!(
            h.m.deadline().is_some_and(|at| at > h.now),
            "{members} members: woken again at once"
        );
    }
}

/// Fires a disconnected machine's retry and answers the sync that follows (a run without
/// this node's registration, one etcd member, a live lease): the looks started or stopped
/// on the way, in order, and how many came before the member count was asked (none if
/// it was not).
fn through_resync(h: &mut Harness) -> (Vec<bool>, Option<usize>) {
    let mut e = h.fire();
    let (mut looks, mut before_count) = (Vec::new(), None);
    for _ in 0..12 {
        looks.extend(probes(&e));
        let Some(op) = etcd_ops(&e).first().cloned() else {
            break;
        };
        let answer = match op {
            Op::MemberCount => {
                before_count.get_or_insert(looks.len());
                Answer::MemberCount(1)
            }
            Op::Range { .. } => Answer::Range {
                revision: REV,
                kvs: Vec::new(),
            },
            Op::TimeToLive { .. } => Answer::TimeToLive { ttl: 6 },
            Op::Txn(_) => Answer::Txn { succeeded: true },
            _ => Answer::Done,
        };
        e = h.answer(answer);
    }
    (looks, before_count)
}

/// A crowd's node whose connection was lost while it formed, and that runs its round
/// before etcd is back, does not look for proof that etcd has no leader before it knows
/// etcd has one member (a look at one member of several proves nothing); the sync after
/// the outage asks the count, and with one member the look held back starts.
#[test]
fn a_crowds_node_that_runs_in_an_outage_looks_only_once_etcd_is_counted_one_member() {
    let crowd = Harness::with(|c| c.crowd = true);
    let (mut h, rest) = crowd.first_sync(&[coordinator_kv("b", 99)]);
    no_op(&rest);
    h.register(1, 0, true);
    assert_eq!(
        probes(&h.disconnect()),
        Vec::<bool>::new(),
        "forming: no look"
    );
    let e = h.runs(2, round(1, &[("a", 1), ("b", 1)]));
    replied_ok(&e, 2);
    assert_eq!(probes(&e), Vec::<bool>::new(), "the count is not known");
    let (looks, before_count) = through_resync(&mut h);
    assert_eq!(before_count, Some(0), "looked before the count: {looks:?}");
    assert_eq!(
        looks.first(),
        Some(&true),
        "the look held back starts: {looks:?}"
    );
}

/// A node that knew etcd's count before (outside a crowd, asked at its join) and lost its
/// connection while running looks once; the sync after the outage asks the count again,
/// and that answer does not start the look a second time (a new prober is two fresh
/// connections more, and its looks would no longer thin out).
#[test]
fn a_count_asked_again_after_an_outage_does_not_start_the_look_again() {
    let mut h = running();
    assert_eq!(probes(&h.disconnect()), vec![true]);
    let (looks, before_count) = through_resync(&mut h);
    assert!(
        before_count.is_some(),
        "the sync after the outage asks the count"
    );
    assert!(!looks.contains(&true), "the look started again: {looks:?}");
}

/// A crowd's node that runs its first round before it knows etcd's member count (asked up
/// to 2 ms a node of the run later: 40 s at 20,000), whose keep-alive is then late, asks
/// etcd about its lease with the count, as a forming node does. It asked nothing before,
/// and fenced on its lease clock without a word to etcd: at 20,000 nodes three such
/// fences after the seal re-formed the whole crowd. The look for proof of a leaderless
/// etcd still waits for the count: none before it, none on an etcd of three members.
#[test]
fn a_crowds_running_node_with_a_late_keep_alive_asks_its_lease_and_the_count_before_knowing_it() {
    for members in [1, 3] {
        let mut h = Harness::with(|c| {
            c.crowd = true;
            c.seal.max_nodes = 20_000;
        });
        let effects = h.m.start(h.now);
        let (_, rest) = h.sync_through(effects, &[coordinator_kv("b", 99)]);
        no_op(&rest);
        h.register(1, 0, true);
        replied_ok(&h.runs(2, round(1, &[("a", 1), ("b", 1)])), 2);
        let ran = h.now;
        let scheduled = crate::etcd::session::outage::count_delay("a", 20_000, TTL);
        let mut looked = Vec::new();
        let (op, at) = {
            let mut found = None;
            for _ in 0..20 {
                let e = h.fire();
                looked.extend(probes(&e));
                match etcd_ops(&e).first() {
                    Some(Op::KeepAlive) => no_op(&h.answer(Answer::Done)),
                    Some(op) => {
                        found = Some((op.clone(), h.now));
                        break;
                    }
                    None => {}
                }
            }
            found.expect("an op other than a keep-alive")
        };
        assert_eq!(op, Op::MemberCount, "{members} members");
        assert!(
            at < ran + scheduled,
            "asked with the late keep-alive, not at {scheduled:?}"
        );
        assert!(at < ran + TTL, "{:?} after the round", at - ran);
        let e = h.answer(Answer::MemberCount(members));
        looked.extend(probes(&e));
        assert!(
            !looked.contains(&true),
            "no look before the count: {looked:?}"
        );
        if members == 1 {
            assert_eq!(the_op(&e), Op::TimeToLive { lease: LEASE });
        } else {
            assert!(etcd_ops(&e).is_empty(), "three members: no question: {e:?}");
            for _ in 0..6 {
                let e = h.fire();
                assert!(
                    !probes(&e).contains(&true),
                    "no look on three members: {e:?}"
                );
                if etcd_ops(&e).first() == Some(&Op::KeepAlive) {
                    h.answer(Answer::Done);
                }
            }
        }
    }
}
