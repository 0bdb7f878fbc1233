//! A joining node's pace (`admission.rs`): its lease kept alive from the grant, before
//! its first read; its requests held while etcd answers slowly or refuses, drawn apart
//! from the crowd's; a lease lost before it registered replaced without a registration;
//! nothing held once it registered.

use super::overload::{keep_alives_beside, limited};
use super::*;

/// Started: the keep-alive stream opened before anything else; the first read in flight.
fn joining(h: &mut Harness) -> Vec<Effect> {
    let e = h.m.start(h.now);
    assert_eq!(the_op(&e), Op::ReopenKeepAlive { lease: LEASE });
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), read_ctl());
    e
}

fn empty_read() -> Answer {
    Answer::Range {
        revision: REV,
        kvs: Vec::new(),
    }
}

#[test]
fn a_joining_nodes_lease_is_kept_alive_while_its_first_read_waits_in_etcd() {
    let mut h = Harness::new();
    joining(&mut h);
    assert!(matches!(h.m.phase(), Phase::Syncing(Resync::First)));
    // The read waits in a crowd: a keep-alive goes beside it a third of a TTL on.
    let e = h.fire();
    assert_eq!(h.now - h.t0, TTL / 3);
    assert_eq!(keep_alives_beside(&e), 1);
    // Its answer moves the lease clock at once, the read still in flight.
    h.later(Duration::from_millis(5));
    no_op(&h.step(Input::LeaseAnswer(Some(6))));
    assert!(h.m.busy());
    let safe = h.m.view().lease_safe_until.expect("a clock");
    assert_eq!(safe, h.t0 + TTL / 3 + TTL);
    // And again a third of a TTL later.
    assert_eq!(keep_alives_beside(&h.fire()), 1);
    assert_eq!(h.now - h.t0, 2 * TTL / 3);
}

/// The watches open over the stream kept from the grant, not a second one (at 10,000
/// nodes the second open and its renewals were half of etcd's keep-alives at
/// formation): a keep-alive sent on it before the open and answered after still moves
/// the lease clock.
#[test]
fn the_stream_kept_from_the_grant_goes_on_under_the_watches() {
    let mut h = Harness::new();
    joining(&mut h);
    assert_eq!(keep_alives_beside(&h.fire()), 1);
    let sent = h.now;
    h.later(Duration::from_millis(5));
    let e = h.answer(empty_read());
    let (ops, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    assert!(
        matches!(
            ops.last(),
            Some(Op::Watch {
                keep_stream: true,
                ..
            })
        ),
        "{ops:?}"
    );
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    h.later(Duration::from_millis(5));
    h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(h.m.view().lease_safe_until, Some(sent + TTL));
}

#[test]
fn a_slow_answer_holds_a_joining_nodes_registration_around_the_latency_it_saw() {
    let mut h = Harness::new();
    joining(&mut h);
    // etcd took 2 s to answer the read (behind: its target is a tenth of the TTL).
    h.later(Duration::from_secs(2));
    let e = h.answer(empty_read());
    let (_, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    let asked = h.now;
    // The registration waits (the keep-alive due at once goes meanwhile).
    let e = h.command(1, Command::Register { wants_round: 0 });
    assert!(etcd_ops(&e).iter().all(|op| *op == Op::KeepAlive), "{e:?}");
    let mut e = h.answer(Answer::Done);
    while !matches!(etcd_ops(&e).first(), Some(Op::Txn(_))) {
        if etcd_ops(&e).first() == Some(&Op::KeepAlive) {
            e = h.answer(Answer::Done);
            continue;
        }
        e = h.fire();
    }
    let held = h.now - asked;
    assert!(
        held >= Duration::from_secs(1) && held <= Duration::from_secs(3),
        "held {held:?}"
    );
    replied_ok(&h.answer(Answer::Txn { succeeded: true }), 1);
}

#[test]
fn a_fast_etcd_holds_nothing() {
    let mut h = Harness::new();
    let e = joining(&mut h);
    h.later(Duration::from_millis(20));
    let (_, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    // The registration goes at once (`register` asserts the transaction is sent).
    h.register(1, 0, true);
}

#[test]
fn refused_joiners_go_again_drawn_apart_and_never_before_the_backoff() {
    let waits: Vec<Duration> = ["a", "b", "c"]
        .into_iter()
        .map(|node| {
            let mut h = Harness::with(|c| c.node_id = node.into());
            joining(&mut h);
            no_op(&h.fail(limited()));
            h.m.deadline().expect("the read goes again") - h.now
        })
        .collect();
    for w in &waits {
        assert!(
            *w >= Duration::from_millis(100) && *w <= Duration::from_millis(150),
            "{waits:?}"
        );
    }
    assert!(waits[0] != waits[1] || waits[1] != waits[2], "{waits:?}");
}

#[test]
fn a_lease_gone_before_the_node_registered_is_granted_again_without_a_registration() {
    let mut h = Harness::new();
    joining(&mut h);
    // etcd says the lease is gone while the read waits (it expired in the crowd).
    no_op(&h.step(Input::LeaseAnswer(Some(0))));
    // etcd is a TTL behind: the new grant waits this node's longest pause.
    let e = h.answer(empty_read());
    let e = h.paced_grant(e);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 200 });
    let (ops, rest) = h.sync_through(e, &[]);
    // At most the new lease's first keep-alive.
    if !etcd_ops(&rest).is_empty() {
        assert_eq!(the_op(&rest), Op::KeepAlive);
        no_op(&h.answer(Answer::Done));
    }
    assert_eq!(
        ops,
        vec![
            Op::MemberCount,
            Op::Watch {
                role: Role::Member,
                from: REV + 1,
                lease: 200,
                keep_stream: false
            }
        ],
        "no registration of a node that had none"
    );
    assert_eq!(h.counters.leases_lost.load(Ordering::Relaxed), 1);
    assert_eq!(h.counters.reregistered.load(Ordering::Relaxed), 0);
    // Its first registration (once its pace lets it go) is on the new lease, and is no
    // registration again.
    h.later(TTL / 2);
    h.register(1, 0, true);
    assert_eq!(h.counters.reregistered.load(Ordering::Relaxed), 0);
}

/// The puts among `e`'s ops.
fn puts(e: &[Effect]) -> usize {
    etcd_ops(e)
        .into_iter()
        .filter(|o| matches!(o, Op::Put(_)))
        .count()
}

/// A registered node, running a round or not.
fn registered(runs: bool) -> Harness {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 99)]);
    h.register(1, 0, true);
    if runs {
        replied_ok(&h.runs(2, round(1, &[("a", 1), ("b", 1)])), 2);
    }
    h
}

/// Registered but in no round yet, a node is still joining: a slow answer holds its next
/// request (a crowd's registered nodes that read the run again, unpaced, kept etcd from
/// ever draining at 10,000 nodes). Once it runs a round, nothing it asks waits.
#[test]
fn until_it_runs_a_round_a_slow_answer_holds_the_next_request_and_then_nothing() {
    for runs in [false, true] {
        let mut h = registered(runs);
        let e = h.command(3, report_done(0));
        assert_eq!(puts(&e), 1);
        h.later(Duration::from_secs(3));
        replied_ok(&h.answer(Answer::Done), 3);
        let e = h.command(4, report_done(1));
        assert_eq!(puts(&e), usize::from(runs), "runs a round: {runs}: {e:?}");
    }
}

/// A keep-alive answered late says etcd's apply loop is behind (etcd 3.4 renews a lease
/// only once it caught up) while its reads still come back at once: until the node runs
/// a round its next request waits; once it runs one, nothing does.
#[test]
fn until_it_runs_a_round_a_late_keep_alive_holds_the_next_request_and_then_nothing() {
    for runs in [false, true] {
        let mut h = registered(runs);
        let mut e = h.fire();
        while keep_alives_beside(&e) == 0 && !etcd_ops(&e).contains(&Op::KeepAlive) {
            e = h.fire();
        }
        if etcd_ops(&e).contains(&Op::KeepAlive) {
            no_op(&h.answer(Answer::Done));
        }
        h.later(Duration::from_secs(2));
        h.step(Input::LeaseAnswer(Some(6)));
        let e = h.command(3, report_done(0));
        assert_eq!(puts(&e), usize::from(runs), "runs a round: {runs}: {e:?}");
    }
}

/// The stream kept from the grant ended while the first read was in flight (its end
/// waits behind the sync's steps): the watches' open closes that stream, and its end is
/// not read as the end of the new watches.
#[test]
fn the_end_of_the_stream_kept_from_the_grant_does_not_end_the_new_watches() {
    let mut h = Harness::new();
    joining(&mut h);
    no_op(&h.step(Input::KeepAliveFailed(cut().into())));
    let e = h.answer(empty_read());
    let (ops, rest) = h.sync_through(e, &[]);
    // Not kept: the open brings a stream of its own.
    assert!(
        matches!(
            ops.last(),
            Some(Op::Watch {
                keep_stream: false,
                ..
            })
        ),
        "{ops:?}"
    );
    no_op(&rest);
    assert!(!closes_watches(&rest), "{rest:?}");
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}
