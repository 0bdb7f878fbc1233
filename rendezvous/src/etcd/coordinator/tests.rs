use std::time::Duration;

use super::*;
use crate::etcd::view::{MemberEntry, RoundEntry};

const S: Duration = Duration::from_secs(1);

fn cfg(min: u32, max: u32) -> SealConfig {
    SealConfig {
        min_nodes: min,
        max_nodes: max,
        last_call: 30 * S,
        straggler_timeout: 10 * S,
        segment_size: 1,
    }
}

/// Registers `id` (joined at revision `rev`) wanting round `wants`.
fn join(v: &mut View, id: &str, rev: i64, wants: u64) {
    let record = v1::Member::from(v1::MemberFields {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 2,
        wants_round: wants,
        ..Default::default()
    });
    v.members.insert(
        id.into(),
        MemberEntry {
            record,
            create_rev: rev,
        },
    );
}

/// A view whose sealed round 4 (written at revision 40) has `members`, all registered and
/// running it.
fn running(members: &[&str]) -> View {
    let mut v = View::default();
    for (i, id) in members.iter().enumerate() {
        join(&mut v, id, i as i64 + 1, 4);
    }
    let record = v1::Round {
        schema: SCHEMA_VERSION,
        number: 4,
        members: members
            .iter()
            .map(|id| v.members[*id].record.clone())
            .collect(),
        restart_count: 1,
        reason: String::new(),
        ..Default::default()
    };
    v.round = Some(RoundEntry {
        record: record.into(),
        mod_rev: 40,
    });
    v
}

fn recheck(o: &Observation) -> Option<Instant> {
    match o.decision {
        SealDecision::Wait { recheck_at } | SealDecision::Reforming { recheck_at } => recheck_at,
        SealDecision::Seal(_) => None,
    }
}

fn sealed(o: &Observation) -> &Proposal {
    match &o.decision {
        SealDecision::Seal(p) => p,
        other => panic!("expected a seal, got {other:?} ({})", o.reason),
    }
}

#[test]
fn the_last_call_restarts_whenever_a_node_joins_or_leaves() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(2, 4), t);
    let mut v = View::default();
    join(&mut v, "a", 1, 0);
    join(&mut v, "b", 2, 0);
    let o = c.observe(t + 5 * S, &v);
    assert_eq!(recheck(&o), Some(t + 35 * S), "{}", o.reason);
    // Looking again without a change keeps the clock.
    assert_eq!(recheck(&c.observe(t + 20 * S, &v)), Some(t + 35 * S));
    join(&mut v, "c", 3, 0);
    assert_eq!(recheck(&c.observe(t + 25 * S, &v)), Some(t + 55 * S));
    assert!(matches!(
        c.observe(t + 35 * S, &v).decision,
        SealDecision::Wait { .. }
    ));
    let o = c.observe(t + 55 * S, &v);
    assert_eq!(sealed(&o).members, ["a", "b", "c"]);
    assert_eq!(
        o.fence, None,
        "the first round is fenced on no round at all"
    );
}

/// Below the minimum before the first round, the look takes no copy of the
/// registrations (at every registration of a formation that was O(N²)); it says what the
/// full look says, and the last call starts when the minimum is reached, as it did.
#[test]
fn below_the_minimum_the_first_round_waits_and_the_last_call_starts_at_the_minimum() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(3, 4), t);
    let mut v = View::default();
    join(&mut v, "a", 1, 0);
    let o = c.observe(t + S, &v);
    assert!(matches!(
        o.decision,
        SealDecision::Wait { recheck_at: None }
    ));
    assert_eq!(o.reason, "waiting for nodes: 1 of min 3 present");
    assert!(o.new_reason);
    join(&mut v, "b", 2, 0);
    let o = c.observe(t + 2 * S, &v);
    assert_eq!(o.reason, "waiting for nodes: 2 of min 3 present");
    assert!(
        !o.new_reason,
        "the same shape of reason is not logged again at once"
    );
    // A look woken by something else changes nothing.
    assert_eq!(recheck(&c.observe(t + 4 * S, &v)), None);
    join(&mut v, "c", 3, 0);
    assert_eq!(recheck(&c.observe(t + 10 * S, &v)), Some(t + 40 * S));
    assert_eq!(recheck(&c.observe(t + 20 * S, &v)), Some(t + 40 * S));
    let o = c.observe(t + 40 * S, &v);
    assert_eq!(sealed(&o).members, ["a", "b", "c"]);
}

#[test]
fn the_straggler_clock_starts_once_per_round_and_not_again_for_the_next() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(1, 3), t);
    let mut v = running(&["a", "b", "c"]);
    c.observe(t, &v);
    // A worker fails; a comes back for round 5, b and c do not (yet).
    v.failures.insert(4);
    join(&mut v, "a", 1, 5);
    let o = c.observe(t + S, &v);
    assert!(matches!(o.decision, SealDecision::Reforming { .. }));
    assert_eq!(recheck(&o), Some(t + 11 * S), "{}", o.reason);
    assert_eq!(recheck(&c.observe(t + 5 * S, &v)), Some(t + 11 * S));
    let o = c.observe(t + 11 * S, &v);
    assert_eq!(sealed(&o).members, ["a"], "b is left behind: {}", o.reason);
    assert_eq!(o.fence, Some(40));

    // Round 5 is sealed and breaks in turn: its clock starts when it is seen broken,
    // not when round 4 was.
    let mut v = running(&["a", "b"]);
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).number = 5;
    for m in v.members.values_mut() {
        m.record.wants_round = 5;
    }
    let o = c.observe(t + 12 * S, &v);
    assert!(o.reason.contains("intact"), "{}", o.reason);
    v.failures.insert(5);
    let o = c.observe(t + 50 * S, &v);
    assert_eq!(recheck(&o), Some(t + 60 * S), "{}", o.reason);
}

#[test]
fn each_reason_is_new_once() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(1, 2), t);
    let v = running(&["a", "b"]);
    let first = c.observe(t, &v);
    assert!(first.new_reason);
    assert!(first.reason.contains("intact"), "{}", first.reason);
    assert!(!c.observe(t + S, &v).new_reason);
    let mut failed = v.clone();
    failed.failures.insert(4);
    assert!(c.observe(t + 2 * S, &failed).new_reason);
    assert!(c.observe(t + 3 * S, &v).new_reason);
}

#[test]
fn a_seal_commits_the_members_own_records_fenced_on_the_round_it_replaces() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(1, 3), t);
    let mut v = running(&["a", "b"]);
    join(&mut v, "new", 9, 5);
    let o = c.observe(t, &v);
    let p = sealed(&o);
    assert_eq!(
        (p.number, p.members.as_slice(), o.fence),
        (5, ["a", "b", "new"].map(String::from).as_slice(), Some(40))
    );
    // What it was told of the group and its budget, too: status reads that from the
    // registrations, and every byte of a member is sent to every member.
    if let Some(m) = v.members.get_mut("new") {
        m.record.min_nodes = 1;
        m.record.max_nodes = 3;
        m.record.max_restarts = Some(3);
        m.record.restart_window_s = 600;
    }
    let r = round_record(p, &v, &o.reason, 1_000, Duration::ZERO);
    // Its own record, less the round it asked for (said nothing once it is in one).
    let own = v1::Member::from(v1::MemberFields {
        wants_round: 0,
        min_nodes: 0,
        max_nodes: 0,
        max_restarts: None,
        restart_window_s: 0,
        ..(*v.members["new"].record).clone()
    });
    assert_eq!(r.members[2], own);
    assert_eq!((r.restart_count, r.reason.as_str()), (1, o.reason.as_str()));
}

#[test]
fn counts_alone_do_not_make_a_reason_new_but_time_does() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(2, 1000), t);
    let mut v = View::default();
    join(&mut v, "n1", 1, 0);
    join(&mut v, "n2", 2, 0);
    assert!(c.observe(t, &v).new_reason);
    // More nodes gather: the reason's numbers change, its shape does not.
    for i in 3..50 {
        join(&mut v, &format!("n{i}"), i, 0);
        let o = c.observe(t + S / 10, &v);
        assert!(!o.new_reason, "{}", o.reason);
    }
    assert!(c.observe(t + RELOG_EVERY, &v).new_reason);
}

/// A loop seen outside testing, as the coordinator saw it: one member
/// registering for the next round right after each seal, on the same registration,
/// ~600 times a second. Three rounds go at once; the fourth is held, once with an error,
/// and sealed when the hold ends; a new registration (a real change) goes at once.
#[test]
fn a_member_that_stops_its_workers_after_every_seal_is_held_back() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(1, 1), t);
    let mut v = running(&["me"]);
    let mut now = t;
    for n in 5..8u64 {
        join(&mut v, "me", 1, n);
        let o = c.observe(now, &v);
        assert_eq!(sealed(&o).number, n, "{}", o.reason);
        assert!(
            o.reason.contains("me stopped their workers"),
            "{}",
            o.reason
        );
        c.sealed(now, n, &o.reason);
        std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).number = n;
        now += Duration::from_millis(2);
    }
    join(&mut v, "me", 1, 8);
    let o = c.observe(now, &v);
    let (held, rule) = o
        .held
        .clone()
        .expect("the fourth seal on one basis is held");
    assert_eq!(rule, crate::pace::HoldRule::SameBasis, "a loop, not churn");
    assert!(held.contains("3 rounds in a row"), "{held}");
    assert!(
        held.contains("round 7: re-form (me stopped their workers)"),
        "{held}"
    );
    let until = recheck(&o).expect("a hold says when to look again");
    assert!(matches!(o.decision, SealDecision::Reforming { .. }));
    // Looking again within the hold says nothing new.
    let again = c.observe(now + Duration::from_millis(1), &v);
    assert!(again.held.is_none() && recheck(&again) == Some(until));
    // At its end the round is sealed.
    let o = c.observe(until, &v);
    assert_eq!(sealed(&o).number, 8);
    c.sealed(until, 8, &o.reason);
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).number = 8;
    // The same node registered anew (a new lease: the next incarnation): a new basis.
    join(&mut v, "me", 2, 9);
    v.members.get_mut("me").unwrap().record.incarnation = 2;
    let o = c.observe(until + Duration::from_secs(1), &v);
    assert_eq!(sealed(&o).number, 9, "{}", o.reason);
}

/// etcd lost its data; a survivor registered for round 9 (it knew rounds up to 8) and a
/// newcomer for round 0: the first round sealed is numbered 9, so that both join it at
/// once (numbered 0, the survivor would wait it out and force one re-form per number).
#[test]
fn a_member_waiting_for_a_later_round_gets_it_in_one_seal() {
    let t = Instant::now();
    let mut v = View::default();
    join(&mut v, "survivor", 1, 9);
    join(&mut v, "newcomer", 2, 0);
    let mut c = Coordinator::new(cfg(2, 2), t);
    let obs = c.observe(t, &v);
    let SealDecision::Seal(p) = obs.decision else {
        panic!("two of max two seal at once: {}", obs.reason)
    };
    assert_eq!(p.number, 9);
    assert_eq!(p.members.len(), 2);
}

/// The restart window on one clock: coordinator A, its wall clock an hour
/// behind, charges a failure; B, with a correct clock, takes over 20 s later and charges
/// another. By the wall clocks A's charge was an hour before B's seal and fell out of a
/// 10-minute window ("restart 1 of 2" for the third crash within a minute). By ages,
/// measured on each coordinator's own monotonic clock, both count.
#[test]
fn the_charges_age_on_monotonic_clocks_whatever_the_wall_clocks_say() {
    const HOUR_MS: u64 = 3_600_000;
    let now_ms = 10 * HOUR_MS;
    let mut v = running(&["a", "b"]);
    let p = Proposal {
        number: 5,
        members: vec!["a".into(), "b".into()],
        restart_count: 2,
    };
    // A seals round 5, charging a failure, by a clock an hour behind.
    let by_a = round_record(
        &p,
        &v,
        "a worker failed",
        now_ms - HOUR_MS,
        Duration::from_secs(3),
    );
    assert_eq!(by_a.charged_ago_ms, vec![0]);
    v.round = Some(RoundEntry {
        record: by_a.into(),
        mod_rev: 50,
    });
    // B seals round 6 20 s after it saw round 5, charging again, by a correct clock.
    let p6 = Proposal {
        number: 6,
        restart_count: 3,
        ..p
    };
    let by_b = round_record(
        &p6,
        &v,
        "a worker failed",
        now_ms + 20_000,
        Duration::from_secs(20),
    );
    assert_eq!(by_b.charged_ago_ms, vec![20_000, 0]);
    let window = 600_000;
    let counted = ages(&by_b).filter(|a| *a < window).count();
    assert_eq!(counted, 2, "both charges within the window");
    // The wall clocks alone would have forgiven A's.
    let from = by_b.sealed_at_ms - window;
    assert_eq!(by_b.charged_at_ms.iter().filter(|t| **t > from).count(), 1);
}

/// A round of an older agent has no ages: its wall-clock times against its own seal.
#[test]
fn an_older_round_s_charges_age_from_its_own_clock() {
    let r = v1::Round {
        charged_at_ms: vec![1_000, 9_000],
        sealed_at_ms: 10_000,
        ..Default::default()
    };
    assert_eq!(ages(&r).collect::<Vec<_>>(), vec![9_000, 1_000]);
}

/// Registers `id` at revision `rev` for a first round, located in `segment`.
fn join_in(v: &mut View, id: &str, rev: i64, segment: &str) {
    join(v, id, rev, 0);
    if let Some(m) = v.members.get_mut(id) {
        m.record.segment = segment.into();
    }
}

/// The segments come from the registrations: a rack's nodes get contiguous ranks, the
/// round record does not carry them (ranks say it), and after a loss the next round is
/// still a small delta of the one before (survivors first, in their order).
#[test]
fn registrations_order_the_round_by_segment_and_a_loss_is_still_a_delta() {
    let t = Instant::now();
    let mut c = Coordinator::new(cfg(1, 4), t);
    let mut v = View::default();
    for (i, (id, segment)) in [("a", "r1"), ("b", "r0"), ("c", "r1"), ("d", "r0")]
        .into_iter()
        .enumerate()
    {
        join_in(&mut v, id, i as i64 + 1, segment);
    }
    let o = c.observe(t, &v);
    let p = sealed(&o).clone();
    assert_eq!(p.members, ["b", "d", "a", "c"]);
    let first = round_record(&p, &v, &o.reason, 1_000, Duration::ZERO);
    assert!(first.members.iter().all(|m| m.segment.is_empty()));
    c.sealed(t, p.number, &o.reason);
    v.round = Some(RoundEntry {
        record: first.clone().into(),
        mod_rev: 40,
    });
    v.members.remove("d");
    let o = c.observe(t + S, &v);
    let p = sealed(&o).clone();
    assert_eq!(p.members, ["b", "a", "c"]);
    let next = round_record(&p, &v, &o.reason, 2_000, S);
    let d = crate::etcd::roster::delta(&first, 40, &next).expect("a delta");
    assert_eq!(
        (d.removed.as_slice(), d.added.len()),
        (["d".to_owned()].as_slice(), 0)
    );
}
