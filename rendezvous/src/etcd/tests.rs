//! The pure parts of the handle, tested on hand-built views.

use std::time::Instant;

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::joining::{Step, detect, step};
use super::view::{RoundEntry, View};
use crate::Change;

fn member(id: &str) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
        addr: "a".into(),
        local_world_size: 2,
        wants_round: 3,
        ..Default::default()
    })
}

fn view_with_round(members: &[&str]) -> View {
    let record = v1::Round {
        schema: SCHEMA_VERSION,
        number: 3,
        members: members.iter().map(|m| member(m)).collect(),
        restart_count: 0,
        reason: String::new(),
        ..Default::default()
    };
    View {
        round: Some(RoundEntry {
            record: record.into(),
            mod_rev: 7,
        }),
        ..View::default()
    }
}

#[test]
fn a_round_whose_rank_0_died_before_publishing_the_master_is_skipped() {
    let since = Instant::now();
    let mut v = view_with_round(&["ghost", "me"]);
    assert!(matches!(step(&v, "me", 2, 3, None, since), Ok(Step::Wait)));
    v.depart("ghost", 0, Instant::now());
    match step(&v, "me", 2, 3, None, since) {
        Ok(Step::Broken {
            next: 4,
            change: Change::MemberLost { node },
        }) => assert_eq!(node, "ghost"),
        other => panic!("expected a broken round, got {:?}", other.map(|_| ())),
    }
}

/// A livelock seen outside testing: an agent frozen past its lease saw its
/// own old registration deleted while it waited for the next round, and read that
/// departure as a loss in every round sealed after it, with its new registration:
/// "the round broke before it started" ~600 times a second.
#[test]
fn a_departure_of_an_earlier_incarnation_breaks_no_later_round() {
    let since = Instant::now();
    let mut v = view_with_round(&["me", "peer"]);
    for m in &mut std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).members {
        m.incarnation = 2;
    }
    // Both nodes' first registrations went after this agent started waiting (its own
    // expired lease, a peer's restart), and both registered again.
    v.depart("me", 1, Instant::now());
    v.depart("peer", 1, Instant::now());
    assert!(matches!(
        step(&v, "me", 2, 3, None, since),
        Ok(Step::PublishMaster { round: 3 })
    ));
    let held = v.round.clone().unwrap().record;
    assert_eq!(detect(&v, &held, "me", since), None);
    // The incarnation the round names going (or a later one) is a loss, as before.
    v.depart("peer", 2, Instant::now());
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::MemberLost {
            node: "peer".into()
        })
    );
    v.depart("me", 3, Instant::now());
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::MemberLost { node: "me".into() })
    );
    // A departure whose incarnation nobody knew (a record of an older agent) counts.
    let mut v = view_with_round(&["me", "peer"]);
    v.depart("peer", u64::MAX, Instant::now());
    assert!(matches!(
        step(&v, "me", 2, 3, None, since),
        Ok(Step::Broken { next: 4, .. })
    ));
}

#[test]
fn rank_0_publishes_the_master_and_ranks_follow_worker_counts() {
    let since = Instant::now();
    let mut v = view_with_round(&["me", "other"]);
    assert!(matches!(
        step(&v, "me", 2, 3, None, since),
        Ok(Step::PublishMaster { round: 3 })
    ));
    assert!(matches!(
        step(&v, "me", 2, 3, Some(3), since),
        Ok(Step::Wait)
    ));
    v.master = Some(master_of(3));
    let Ok(Step::Done(done)) = step(&v, "other", 2, 3, None, since) else {
        panic!("a sealed round with a master")
    };
    let (_, round) = *done;
    assert_eq!(
        (round.group_rank, round.base_rank, round.world_size),
        (1, 2, 4)
    );
    assert_eq!(
        (round.master_addr.as_str(), round.master_port),
        ("10.0.0.1", 29400)
    );
}

#[test]
fn a_finished_member_that_leaves_is_not_a_loss_but_an_unfinished_one_is() {
    let since = Instant::now();
    let mut v = view_with_round(&["a", "b"]);
    let held = v.round.clone().unwrap().record;
    v.depart("b", 0, Instant::now());
    v.done.entry(3).or_default().insert("b".into());
    assert_eq!(detect(&v, &held, "a", since), None);
    v.done.clear();
    assert_eq!(
        detect(&v, &held, "a", since),
        Some(Change::MemberLost { node: "b".into() })
    );
    v.failures.insert(3);
    assert_eq!(
        detect(&v, &held, "a", since),
        Some(Change::PeerFailed { restart_count: 1 })
    );
}

/// A member watches no registrations: when the coordinator's next round reaches it before
/// any word of a loss, the round says who is missing — a loss, as the deleted
/// registration said before (the real-etcd test of a dead node found the change read as a
/// plain new round). A round that only adds members, or drops one that finished, is not.
#[test]
fn a_next_round_without_a_member_of_the_held_one_is_its_loss() {
    let since = Instant::now();
    let held = view_with_round(&["me", "peer", "gone"])
        .round
        .unwrap()
        .record;
    let mut v = view_with_round(&["me", "peer"]);
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).number = held.number + 1;
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::MemberLost {
            node: "gone".into()
        })
    );
    v.done
        .entry(held.number)
        .or_default()
        .insert("gone".to_owned());
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::NewRound {
            number: held.number + 1
        })
    );
    let mut grown = view_with_round(&["me", "peer", "gone", "new"]);
    std::sync::Arc::make_mut(&mut grown.round.as_mut().unwrap().record).number = held.number + 1;
    assert_eq!(
        detect(&grown, &held, "me", since),
        Some(Change::NewRound {
            number: held.number + 1
        })
    );
}

/// etcd came back empty; a coordinator that never saw round 3 (frozen meanwhile) sealed
/// its own round 3 before the members wrote theirs back. The number alone said "the
/// round held": one member ran on with the other's workers gone, another waited for
/// ever (the simulator's seed 8847). The round written back (the same record) is no
/// change; another seal under the number is.
#[test]
fn another_round_under_the_held_number_is_a_change_and_the_same_one_written_back_is_not() {
    let since = Instant::now();
    let mut held = view_with_round(&["me", "peer"]).round.unwrap().record;
    std::sync::Arc::make_mut(&mut held).sealed_at_ms = 1_000;
    let mut same = view_with_round(&["me", "peer"]);
    std::sync::Arc::make_mut(&mut same.round.as_mut().unwrap().record).sealed_at_ms = 1_000;
    assert_eq!(detect(&same, &held, "me", since), None, "written back");
    // Another coordinator's round 3: "me" in it, "peer" not.
    let other = view_with_round(&["me", "late"]);
    assert_eq!(
        detect(&other, &held, "me", since),
        Some(Change::MemberLost {
            node: "peer".into()
        })
    );
    // The same nodes, sealed at another time: still another round.
    let mut resealed = view_with_round(&["me", "peer"]);
    std::sync::Arc::make_mut(&mut resealed.round.as_mut().unwrap().record).sealed_at_ms = 2_000;
    assert_eq!(
        detect(&resealed, &held, "me", since),
        Some(Change::NewRound { number: 3 })
    );
    // A member left out of the other round has lost its place.
    let without = view_with_round(&["late", "other"]);
    assert_eq!(
        detect(&without, &held, "me", since),
        Some(Change::MemberLost { node: "me".into() })
    );
}

/// The round an agent runs holds the record's members themselves: building it at every
/// re-form copies no member (a copy is N records per agent per re-form, 1,000 at 1,000
/// nodes), and the ranks still come from the record's order.
#[test]
fn the_round_an_agent_runs_shares_the_records_members() {
    let v = view_with_round(&["b", "a", "c"]);
    let rec = &v.round.as_ref().unwrap().record;
    let change = Change::NewRound { number: 4 };
    let round = super::joining::broken_round(rec, "a", change).unwrap();
    assert_eq!(
        (round.group_rank, round.base_rank, round.world_size),
        (1, 2, 6)
    );
    for (m, r) in round.members.iter().zip(&rec.members) {
        assert!(v1::Member::same(&m.record, r), "{} was copied", m.node_id());
    }
}

/// `view_with_round(members)` as round `number`, charged `restart_count` restarts.
fn round_view(number: u64, members: &[&str], restart_count: u32) -> View {
    let mut v = view_with_round(members);
    let rec = std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record);
    rec.number = number;
    rec.restart_count = restart_count;
    v
}

fn waiter() -> super::waiter::Waiter {
    super::waiter::Waiter::new("me".into(), 2, 8, std::time::Duration::from_secs(1))
}

/// The master record of round `round` (rank 0 at 10.0.0.1:29400).
fn master_of(round: u64) -> v1::Master {
    v1::Master {
        schema: SCHEMA_VERSION,
        round,
        addr: "10.0.0.1".into(),
        port: 29400,
    }
}

/// Found by the simulator (seed 207789): a node sealed into a round that spent the
/// budget, whose lease ran out before the round started, next saw only the round the
/// coordinator sealed without it. As a spare of that round it asked for the next one, and
/// waited for a round that never came, where the others gave up. The round it saw itself
/// sealed into is handed to the loop as broken, as the others were handed it.
#[test]
fn a_member_left_out_of_the_next_round_is_handed_the_round_that_spent_its_budget() {
    use super::waiter::Action;
    let now = Instant::now();
    let mut w = waiter();
    let v = round_view(2, &["a", "b"], 4);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 3 }));
    // Sealed into round 3; "a" is its rank 0 and has not published the master yet.
    let v = round_view(3, &["a", "me", "b"], 5);
    assert!(matches!(w.on_view(&v, now), Ok(Action::Wait)));
    // Round 4, sealed without this node (its lease ran out), is all it sees next.
    let v = round_view(4, &["a", "b"], 5);
    match w.on_view(&v, now) {
        Ok(Action::Charged(r)) => {
            assert_eq!((r.number, r.restart_count), (3, 5));
            assert_eq!(r.broken, Some(Change::MemberLost { node: "me".into() }));
        }
        other => panic!("expected round 3 handed over, got {other:?}"),
    }
    // The loop, within its budget, asks for the next round: the same count is not handed
    // over twice.
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 5 }));
    let v5 = round_view(5, &["a", "me", "b"], 5);
    assert!(matches!(w.on_view(&v5, now), Ok(Action::Wait)));
    let v6 = round_view(6, &["a", "b"], 5);
    assert!(matches!(
        w.on_view(&v6, now),
        Ok(Action::Register { wants: 7 })
    ));
}

/// A round sealed while this node's lease clock is in doubt (its keep-alives late, as a
/// busy etcd makes them while it sends a 10,000-node round's header to every member) is
/// neither started nor given up: the node waits for etcd's word (the session asks it),
/// and runs the round once the clock moves (docs/rendezvous.md, "Start").
#[test]
fn a_round_sealed_while_the_lease_is_in_doubt_waits_for_etcds_word() {
    use super::waiter::Action;
    let now = Instant::now();
    let mut w = waiter();
    let v = round_view(2, &["a", "me"], 0);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 3 }));
    let mut v = round_view(3, &["a", "me"], 0);
    v.master = Some(master_of(3));
    // Half a second left on the clock, within the fence margin (1 s here).
    v.lease_safe_until = Some(now + std::time::Duration::from_millis(500));
    assert!(matches!(w.on_view(&v, now), Ok(Action::Wait)));
    // Past it altogether: still only waiting (etcd has the word, not the clock).
    let later = now + std::time::Duration::from_secs(2);
    assert!(matches!(w.on_view(&v, later), Ok(Action::Wait)));
    // etcd answered: the lease stands for another TTL.
    v.lease_safe_until = Some(later + std::time::Duration::from_secs(5));
    match w.on_view(&v, later) {
        Ok(Action::Run { round, .. }) => assert_eq!(round.number, 3),
        other => panic!("expected round 3 to start, got {other:?}"),
    }
}

/// The same, with a round this node was sealed into seen while it ran the one before:
/// it stopped its workers for it, and by its next look that round was replaced by one
/// without it.
#[test]
fn a_runner_left_out_of_the_round_after_its_own_is_handed_that_round() {
    use super::waiter::{Action, Watch};
    let now = Instant::now();
    let mut w = waiter();
    let mut v = round_view(3, &["me", "a"], 1);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 4 }));
    v = round_view(4, &["me", "a"], 1);
    v.master = Some(master_of(4));
    assert!(matches!(w.on_view(&v, now), Ok(Action::Run { .. })));
    let v = round_view(5, &["a", "me"], 2);
    assert_eq!(
        w.on_running_view(&v, now).ok(),
        Some(Watch::Over(Change::NewRound { number: 5 }))
    );
    let v = round_view(6, &["a"], 2);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 5 }));
    match w.on_view(&v, now) {
        Ok(Action::Charged(r)) => assert_eq!((r.number, r.restart_count), (5, 2)),
        other => panic!("expected round 5 handed over, got {other:?}"),
    }
}

/// etcd came back empty; before the members wrote the round they ran back, another
/// coordinator sealed its own round under the same number, with this node and a higher
/// restart count (seed 209829). This node leaves the round it ran for the next number:
/// the other seal, which it will never run, is handed over first.
#[test]
fn another_seal_under_the_held_number_is_handed_over_before_the_next_round() {
    use super::waiter::{Action, Watch};
    let now = Instant::now();
    let mut w = waiter();
    let v = round_view(3, &["me", "a"], 1);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 4 }));
    let mut v = round_view(4, &["me", "a"], 1);
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).sealed_at_ms = 1_000;
    v.master = Some(master_of(4));
    assert!(matches!(w.on_view(&v, now), Ok(Action::Run { .. })));
    // The held round, shown again (a keep-alive answer), is not remembered.
    assert_eq!(
        w.on_running_view(&v, now).ok(),
        Some(Watch::Keep { recheck: None })
    );
    let mut v = round_view(4, &["b", "me"], 2);
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).sealed_at_ms = 2_000;
    assert_eq!(
        w.on_running_view(&v, now).ok(),
        Some(Watch::Over(Change::MemberLost { node: "a".into() }))
    );
    match w.begin(&v, now) {
        Action::Charged(r) => {
            assert_eq!((r.number, r.restart_count), (4, 2));
            assert_eq!(r.broken, Some(Change::MemberLost { node: "me".into() }));
        }
        other => panic!("expected the other round 4 handed over, got {other:?}"),
    }
    // The loop, within its budget, asks for the next round.
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 5 }));
}

/// A waiter that waited for round 4 after round 3 and saw `seen` (each a round naming
/// it, not started), then `fresh` (the round etcd sealed after it lost its data, naming
/// it first), first without its master (the waiter publishes it), then with it: what it
/// does then.
fn once_charges_are_lost(
    w: &mut super::waiter::Waiter,
    seen: &[View],
    fresh: &View,
) -> Result<super::waiter::Action, crate::RendezvousError> {
    use super::waiter::Action;
    let now = Instant::now();
    let v = round_view(3, &["a", "me"], 3);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 4 }));
    for v in seen {
        assert!(matches!(w.on_view(v, now), Ok(Action::Wait)));
    }
    let number = fresh.round.as_ref().unwrap().record.number;
    assert!(matches!(
        w.on_view(fresh, now),
        Ok(Action::PublishMaster { round }) if round == number
    ));
    let mut v = fresh.clone();
    v.master = Some(master_of(number));
    w.on_view(&v, now)
}

/// `view` with its round's seal time set to `ms`.
fn sealed_at(mut view: View, ms: u64) -> View {
    std::sync::Arc::make_mut(&mut view.round.as_mut().unwrap().record).sealed_at_ms = ms;
    view
}

/// Found by the simulator (seed 3805): a member of a placed round that spent the budget
/// (it holds its own part, too little to put the round back) saw etcd come back empty
/// before the round started; the next round, sealed from what etcd had left, named it
/// with the charges gone. It ran that round where the others gave up. The round that
/// charged them is handed over first, and a later one that carries fewer charges does not
/// make the node forget it.
#[test]
fn a_round_whose_charges_etcd_lost_is_handed_over_before_the_next_one_runs() {
    use super::waiter::Action;
    let seen = [round_view(4, &["a", "me"], 4)];
    match once_charges_are_lost(&mut waiter(), &seen, &round_view(5, &["me", "b"], 0)) {
        Ok(Action::Charged(r)) => assert_eq!((r.number, r.restart_count), (4, 4)),
        other => panic!("expected round 4 handed over, got {other:?}"),
    }
    // The same with another seal under the number of the round that charged them, its
    // master there at the first look (seed 487326625).
    let now = Instant::now();
    let mut w = waiter();
    let v = round_view(3, &["a", "me"], 3);
    assert!(matches!(w.begin(&v, now), Action::Register { wants: 4 }));
    let v = sealed_at(round_view(4, &["a", "me"], 4), 1_000);
    assert!(matches!(w.on_view(&v, now), Ok(Action::Wait)));
    let mut v = sealed_at(round_view(4, &["me", "b"], 0), 2_000);
    v.master = Some(master_of(4));
    match w.on_view(&v, now) {
        Ok(Action::Charged(r)) => assert_eq!((r.number, r.restart_count), (4, 4)),
        other => panic!("expected the first round 4 handed over, got {other:?}"),
    }
}

/// Found by the simulator (seed 1456934009): a node saw itself in rounds 18 and 19 of a
/// placed run, both past the budget, before either started for it; etcd then came back
/// empty and the next round, sealed under a lower number (18) without the charges, named
/// it. Numbered below the round that charged them, it was taken for an older round and
/// the charges were forgotten: the node ran on where the others gave up. A round that
/// carries fewer charges than one this node was sealed into hands that one over first,
/// whatever its number.
#[test]
fn charges_etcd_lost_are_handed_over_when_the_next_round_is_numbered_lower() {
    use super::waiter::Action;
    let mut w = waiter();
    let seen = [
        round_view(4, &["a", "me"], 4),
        round_view(5, &["a", "me"], 4),
    ];
    let fresh = round_view(4, &["me", "b"], 0);
    match once_charges_are_lost(&mut w, &seen, &fresh) {
        Ok(Action::Charged(r)) => assert_eq!((r.number, r.restart_count), (5, 4)),
        other => panic!("expected round 5 handed over, got {other:?}"),
    }
    // Within the budget, the loop asks for the round after the one etcd shows.
    assert!(matches!(
        w.begin(&fresh, Instant::now()),
        Action::Register { wants: 5 }
    ));
}

/// A member's copy of a placed round lists itself and its neighbour: a later round
/// compared member by member with it, or it with a round held whole, named live nodes
/// lost (a round of 2,000 that grew past placement, the view two rounds on). The later
/// round's own word (`dropped`) says who went.
#[test]
fn a_copy_of_a_placed_round_names_nobody_lost_that_its_round_did_not_drop() {
    let since = Instant::now();
    let held = view_with_round(&["me", "a", "b", "c"])
        .round
        .unwrap()
        .record;
    let mut v = round_view(5, &["me", "c"], 0);
    {
        let r = std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record);
        r.shards = 1;
        r.group_world_size = 4;
        r.placed = Some(v1::Placed {
            member: Some(member("me")),
            ..Default::default()
        });
    }
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::NewRound { number: 5 })
    );
    std::sync::Arc::make_mut(&mut v.round.as_mut().unwrap().record).dropped = vec!["b".into()];
    assert_eq!(
        detect(&v, &held, "me", since),
        Some(Change::MemberLost { node: "b".into() })
    );
}

/// A store this agent's standby took over before the session starts is as fresh as one
/// it started: the session gets the returning members' grace (a host restarted while its
/// predecessor still held the port sealed 3 rounds without it, under load).
#[test]
fn a_store_the_standby_took_over_before_the_session_started_is_fresh() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut cfg = super::EtcdConfig::new(vec!["127.0.0.1:2379".into()], "r", 1, 4);
    assert!(!cfg.serves_a_fresh_store());
    let flag = Arc::new(AtomicBool::new(false));
    cfg.store_taken_over = Some(flag.clone());
    assert!(!cfg.serves_a_fresh_store(), "standing by, not serving");
    flag.store(true, Ordering::Release);
    assert!(cfg.serves_a_fresh_store(), "took over");
    cfg.store_taken_over = None;
    cfg.fresh_store = true;
    assert!(cfg.serves_a_fresh_store(), "started it");
}
