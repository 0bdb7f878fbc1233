//! A placed round ([`crate::etcd::placement`]): a member that receives its header reads its
//! own shard, not the whole round, and runs at the ranks its place gives it; a node the
//! round was sealed without reads its shard and waits as a spare; a coordinator seals a
//! round above `placement_above` as a header and shards, the shards of a large one in
//! transactions of their own ahead of the header.

use super::*;
use crate::etcd::joining::{Step, step};
use crate::etcd::placement;
use crate::etcd::placement::AHEAD_SPACING;

/// `whole` placed as the coordinator on [`LEASE`] places it in its first attempt.
fn place(whole: &v1::Round, base: Option<(&v1::Round, i64)>) -> (v1::Round, Vec<v1::Placement>) {
    let (mut header, shards) = placement::place(whole, base, placement::Shape::ETCD).unwrap();
    header.placement = placement::tag(whole.number, LEASE, 0);
    (header, shards)
}

/// Round 2 of d, b, a, c (two workers each), placed: its header and shards.
fn placed_round_two() -> (v1::Round, v1::Round, Vec<v1::Placement>) {
    let mut whole = round(2, &[("d", 1), ("b", 1), ("a", 1), ("c", 1)]);
    whole.sealed_at_ms = 5_000;
    let (header, shards) = place(&whole, None);
    (whole, header, shards)
}

/// `s` where [`place`] puts it.
fn shard_kv(s: &v1::Placement, mod_rev: i64) -> Kv {
    Kv {
        key: keys().placement(&placement::tag(s.round, LEASE, 0), s.shard),
        value: fsdp_proto::encode(s),
        create_rev: 1,
        mod_rev,
        lease: 0,
    }
}

/// The read "a" makes of its own shard of the placed round `header`: serializable, one key.
fn own_shard_read(header: &v1::Round) -> Op {
    Op::Range {
        key: keys().placement(&header.placement, placement::shard_of("a", header.shards)),
        prefix: false,
        keys_only: false,
        serializable: true,
    }
}

/// Where `me` waits or runs in the view: the step a waiting agent takes for round 2.
fn step_for(h: &Harness, me: &str) -> Step {
    step(h.m.view(), me, 2, 2, None, h.now).unwrap()
}

#[test]
fn a_member_reads_its_own_shard_and_runs_at_its_placed_ranks() {
    let mut h = Harness::synced();
    let (_, header, shards) = placed_round_two();
    let e = h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let mine = placement::shard_of("a", header.shards);
    assert_eq!(
        the_op(&e),
        own_shard_read(&header),
        "its own shard, nothing else, without waiting for etcd's apply loop"
    );
    // Not the round yet: the header alone names nobody's place.
    assert!(h.m.view().round.is_none());
    no_op(&h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine as usize], 12)],
    }));
    let v = h.m.view();
    let held = v.round.as_ref().unwrap();
    assert_eq!((held.record.number, held.mod_rev), (2, 12));
    assert_eq!(v.round_wanted, None);
    // The master is rank 0's (d's) to publish: a waits for it.
    assert!(matches!(step_for(&h, "a"), Step::Wait));
    let master = v1::Master {
        schema: SCHEMA_VERSION,
        round: 2,
        addr: "d.local".into(),
        port: 29500,
    };
    h.step(Input::Watched(vec![WatchEvent::Put(record_kv(
        &master, 13,
    ))]));
    let Step::Done(done) = step_for(&h, "a") else {
        panic!("a runs round 2");
    };
    let r = &done.1;
    assert_eq!(
        (r.group_rank, r.base_rank, r.group_world_size, r.world_size),
        (2, 4, 4, 8)
    );
    assert_eq!((r.master_addr.as_str(), r.master_port), ("d.local", 29500));
}

/// A crowd's first placed round: its members read their shards at moments drawn within
/// the spread, not all when the header comes (at 10,000 nodes on two cores, 10,000 reads
/// in two or three seconds left renewals late, and leases expired at the seal).
#[test]
fn a_crowd_member_reads_its_shard_of_the_first_round_at_its_moment_in_the_spread() {
    let (mut h, _) = Harness::with(|c| {
        c.crowd = true;
        c.seal.max_nodes = 10_000;
    })
    .first_sync(&[]);
    let (_, header, shards) = placed_round_two();
    let e = h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    no_op(&e);
    let delay = crate::etcd::session::shard_read::shard_read_delay("a", 10_000, TTL);
    assert!(delay > Duration::ZERO && delay <= TTL / 2, "{delay:?}");
    let at = h.now + delay;
    assert!(
        h.m.deadline().is_some_and(|d| d <= at),
        "{:?}",
        h.m.deadline()
    );
    // Renewals due before go as usual; the read goes at its moment.
    let mut e = h.fire();
    while h.now < at {
        if etcd_ops(&e).contains(&Op::KeepAlive) {
            e = h.answer(Answer::Done);
        } else {
            e = h.fire();
        }
    }
    assert_eq!(h.now, at);
    assert_eq!(the_op(&e), own_shard_read(&header));
    let mine = placement::shard_of("a", header.shards);
    no_op(&h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine as usize], 12)],
    }));
    assert_eq!(h.m.view().round.as_ref().map(|r| r.record.number), Some(2));
}

/// A member that holds its copy of round 2 makes its copy of round 3, sealed without b,
/// from the header's moves alone: no read, its ranks shifted past b's. A member the header
/// moves from another seal reads its shard.
#[test]
fn a_member_holding_the_round_before_takes_a_re_form_without_a_read() {
    let mut h = Harness::synced();
    let (whole, header, shards) = placed_round_two();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let mine = placement::shard_of("a", header.shards);
    h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine as usize], 12)],
    });
    let held = h.m.view().round.clone().unwrap();
    assert_eq!(held.record.placed.as_ref().unwrap().group_rank, 2);
    // The coordinator's whole copy of round 2, at the revision a's copy has.
    let coordinators = placement::whole(&header, &shards).unwrap();
    // The same registrations, b's left out (a round's members carry no `wants_round`).
    let next = v1::Round {
        number: 3,
        sealed_at_ms: 6_000,
        members: whole
            .members
            .iter()
            .filter(|m| m.node_id != "b")
            .cloned()
            .collect(),
        ..whole.clone()
    };
    let (moving, _) = place(&next, Some((&coordinators, 12)));
    assert_eq!(moving.gone.len(), 1);
    let e = h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&moving, 20))]));
    no_op(&e);
    let v = h.m.view();
    let r = v.round.as_ref().unwrap();
    assert_eq!((r.record.number, r.mod_rev), (3, 20));
    assert_eq!(v.round_wanted, None);
    let p = r.record.placed.as_ref().unwrap();
    assert_eq!((p.group_rank, p.base_rank), (1, 2), "b, ahead of a, went");
    // Nobody here serves a status port: nobody is watched (the pure tests rewire).
    assert_eq!(p.neighbour, None);
    // Moves from a seal a does not hold (another revision): its shard is read.
    let mut h = Harness::synced();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine as usize], 12)],
    });
    let (elsewhere, _) = place(&next, Some((&coordinators, 11)));
    let e = h.step(Input::Watched(vec![WatchEvent::Put(round_kv(
        &elsewhere, 20,
    ))]));
    assert!(matches!(the_op(&e), Op::Range { .. }));
}

/// A node the round was sealed without finds no place in its shard: it holds the header,
/// and waits for the next round as a spare of a group of four.
#[test]
fn a_node_sealed_without_waits_as_a_spare() {
    let mut h = Harness::synced();
    let mut whole = round(2, &[("d", 1), ("b", 1), ("c", 1)]);
    whole.sealed_at_ms = 5_000;
    let (header, shards) = place(&whole, None);
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let mine = placement::shard_of("a", header.shards) as usize;
    h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine], 12)],
    });
    assert!(matches!(
        step_for(&h, "a"),
        Step::Spare {
            next: 3,
            members: 3
        }
    ));
}

/// The rank 0 of a placed round publishes the master, as the first member of a whole one.
#[test]
fn rank_zero_of_a_placed_round_publishes_the_master() {
    let mut h = Harness::synced();
    let mut whole = round(2, &[("a", 1), ("b", 1)]);
    whole.sealed_at_ms = 5_000;
    let (header, shards) = place(&whole, None);
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[0], 12)],
    });
    assert!(matches!(
        step_for(&h, "a"),
        Step::PublishMaster { round: 2 }
    ));
}

/// A coordinator with `placement_above` below the round's size seals it placed: the
/// header at the round key and every shard, fenced as any seal; and what it seals makes
/// the whole round again.
#[test]
fn a_coordinator_seals_a_round_above_placement_above_as_header_and_shards() {
    let k = keys();
    let me = member("a", LEASE, 1, 0);
    let (_, rest) = Harness::with(|c| c.placement_above = 0)
        .first_sync(&[member_kv(&me, 4), coordinator_kv("a", LEASE)]);
    let spec = txn(the_op(&rest));
    assert_eq!(spec.when, first_seal_fences());
    let header: v1::Round =
        fsdp_proto::decode("k", put_at(&spec.then, &k.key::<v1::Round>("")).0).unwrap();
    assert!(header.members.is_empty());
    assert_eq!(
        (header.shards, header.group_world_size, header.world_size),
        (1, 1, 2)
    );
    assert_eq!(header.placement, placement::tag(header.number, LEASE, 0));
    let shard: v1::Placement = fsdp_proto::decode(
        "k",
        put_at(&spec.then, &k.placement(&header.placement, 0)).0,
    )
    .unwrap();
    let whole = placement::whole(&header, &[shard]).unwrap();
    assert_eq!(whole.members.len(), 1);
    assert_eq!(whole.members[0].node_id, "a");
    // Rank 0 names the master in the same write, as for a whole round.
    put_at(&spec.then, &k.key::<v1::Master>(""));
}

/// A coordinator's read of the whole run has every shard of a placed round: it holds the
/// whole round at once, with no read of its own (found by the simulator: a coordinator
/// back from an outage waited for a placement nothing would read, and sealed nothing).
#[test]
fn a_coordinators_whole_read_makes_the_placed_round_whole() {
    let (whole, header, shards) = placed_round_two();
    let mut kvs = vec![
        round_kv(&header, 9),
        member_kv(&member("a", LEASE, 1, 2), 4),
        coordinator_kv("a", LEASE),
    ];
    kvs.extend(shards.iter().map(|s| shard_kv(s, 9)));
    let (h, _) = Harness::new().first_sync(&kvs);
    let v = h.m.view();
    let held = v.round.as_ref().expect("the round, whole");
    assert_eq!(held.record.members, whole.members);
    // Still a placed round: nobody puts it back whole.
    assert_eq!((held.record.shards, held.mod_rev), (header.shards, 9));
    assert!(v.placing.is_none() && v.round_wanted.is_none());
}

/// "a" takes placed round two from its header and its own shard; the whole round.
fn takes_round_two(h: &mut Harness) -> v1::Round {
    let (whole, header, shards) = placed_round_two();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let mine = placement::shard_of("a", header.shards) as usize;
    h.answer(Answer::Range {
        revision: 12,
        kvs: vec![shard_kv(&shards[mine], 12)],
    });
    whole
}

/// Round 3, sealed without b, as a delta of round two (`whole`) at `ctl/round`.
fn round_three_as_a_delta(whole: &v1::Round) -> Kv {
    let mut next = round(3, &[("d", 1), ("a", 1), ("c", 1)]);
    next.dropped = vec!["b".into()];
    let d = crate::etcd::roster::delta(whole, 12, &next).expect("a delta");
    Kv {
        key: keys().key::<v1::Round>(""),
        value: d.encode_to_vec(),
        create_rev: 1,
        mod_rev: 14,
        lease: 0,
    }
}

/// A round below `placement_above` after a placed one is sealed as a delta of it: a member
/// holds only its own copy of the placed round, too little to apply it to, and reads the
/// roster instead (applied to its copy, a loss of anyone but its neighbour failed, and its
/// neighbour's made it a group of one).
#[test]
fn a_member_of_a_placed_round_reads_the_roster_for_a_delta_of_it() {
    let mut h = Harness::synced();
    let whole = takes_round_two(&mut h);
    let kv = round_three_as_a_delta(&whole);
    let e = h.step(Input::Watched(vec![WatchEvent::Put(kv)]));
    assert_eq!(
        the_op(&e),
        Op::Range {
            key: keys().key::<v1::Roster>(""),
            prefix: false,
            keys_only: false,
            serializable: false,
        }
    );
    assert_eq!(h.m.view().round.as_ref().unwrap().record.number, 2);
}

/// `n` members, "a" on [`LEASE`] and the others on leases of their own.
fn crowd(n: usize) -> Vec<v1::Member> {
    (0..n)
        .map(|i| match i {
            0 => member("a", LEASE, 1, 0),
            _ => member(&format!("n{i:04}"), LEASE + i as i64, 1, 0),
        })
        .collect()
}

/// A round of more shards than the header's transaction holds has them written ahead,
/// each transaction fenced as the header, under this attempt's name; the header's
/// transaction holds no shard, deletes every other shard but the replaced round's, and
/// the shards make the whole round again.
#[test]
fn a_large_placed_round_writes_its_shards_ahead_each_fenced_as_the_header() {
    let k = keys();
    let whole = v1::Round {
        members: crowd(2_000),
        ..round(6, &[])
    };
    let base = v1::Round {
        shards: 300,
        placement: placement::tag(5, LEASE, 4),
        ..round(5, &[("a", 1)])
    };
    let fence = Some(40);
    let tag = placement::tag(6, LEASE, 7);
    let seal = crate::etcd::session::records::commit_placed(
        &k,
        fence,
        LEASE,
        &whole,
        Some((&base, 40)),
        tag.clone(),
        placement::Shape::ETCD,
    )
    .unwrap();
    let fences = seal.header.when.clone();
    assert_eq!(fences[0], Compare::ModRevision(k.key::<v1::Round>(""), 40));
    assert!(seal.ahead.len() >= 2, "{} transactions", seal.ahead.len());
    let mut shards = Vec::new();
    for t in &seal.ahead {
        assert_eq!(t.when, fences, "each fenced as the header");
        assert!(t.then.len() <= 120 && t.otherwise.is_empty());
        for w in &t.then {
            let Write::Put { key, value, lease } = w else {
                panic!("a shard transaction writes shards: {w:?}");
            };
            assert!(key.starts_with(&k.placement_of(&tag)), "{key}");
            assert_eq!(*lease, 0);
            shards.push(fsdp_proto::decode::<v1::Placement>(key, value).unwrap());
        }
    }
    let header: v1::Round =
        fsdp_proto::decode("k", put_at(&seal.header.then, &k.key::<v1::Round>("")).0).unwrap();
    assert_eq!(header.placement, tag);
    assert_eq!(
        header.shards as usize,
        2_000usize.div_ceil(placement::SHARD_MEMBERS)
    );
    assert_eq!(
        placement::whole(&header, &shards).unwrap().members,
        whole.members
    );
    let w = &seal.header.then;
    assert!(
        !w.iter()
            .any(|w| matches!(w, Write::Put { key, .. } if key.starts_with(&k.placements())))
    );
    assert!(
        touches(w, &k.placement(&placement::tag(4, LEASE, 0), 3)),
        "older rounds'"
    );
    assert!(
        touches(w, &k.placement(&placement::tag(6, LEASE, 6), 3)),
        "a lost attempt's"
    );
    assert!(
        !touches(w, &k.placement(&base.placement, 3)),
        "the replaced round's"
    );
    assert!(!touches(w, &k.placement(&tag, 3)), "its own");
}

/// The coordinator sends a large placed round's shards one transaction at a time, each a
/// backend commit after the one before, and its header only once they are all in;
/// shards that lost their fence are followed by nothing.
#[test]
fn a_coordinator_sends_the_header_only_after_the_shards_written_ahead() {
    let kvs = |n: u32| -> Vec<Kv> {
        let mut kvs: Vec<Kv> = crowd(n as usize).iter().map(|m| member_kv(m, 4)).collect();
        kvs.push(coordinator_kv("a", LEASE));
        kvs
    };
    let n = 2_000;
    let edit = |c: &mut Config| {
        c.placement_above = 0;
        (c.seal.min_nodes, c.seal.max_nodes) = (n, n);
    };
    let k = keys();
    let round_key = k.key::<v1::Round>("");
    let (mut h, rest) = Harness::with(edit).first_sync(&kvs(n));
    let mut spec = txn(the_op(&rest));
    let mut shards = 0;
    while !touches(&spec.then, &round_key) {
        assert_eq!(spec.when, first_seal_fences(), "each fenced as the header");
        assert!(
            spec.then
                .iter()
                .all(|w| matches!(w, Write::Put { key, .. } if key.starts_with(&k.placements())))
        );
        shards += spec.then.len();
        let sent = h.now;
        no_op(&h.answer(Answer::Txn { succeeded: true }));
        spec = txn(the_op(&h.fire()));
        assert!(h.now >= sent + AHEAD_SPACING, "a backend commit later");
    }
    assert_eq!(shards, 2_000usize.div_ceil(placement::SHARD_MEMBERS));
    assert_eq!(spec.when, first_seal_fences());
    h.answer(Answer::Txn { succeeded: true });
    let per_txn = placement::Shape::ETCD.per_txn;
    let ahead = u64::try_from(shards.div_ceil(per_txn)).unwrap();
    assert_eq!(h.m.counters.shard_txns.load(Ordering::Relaxed), ahead);
    // The shards lost their fence: nothing follows.
    let (mut h, rest) = Harness::with(edit).first_sync(&kvs(n));
    assert!(!touches(&txn(the_op(&rest)).then, &round_key));
    no_op(&h.answer(Answer::Txn { succeeded: false }));
    h.later(AHEAD_SPACING * 2);
    let e = h.timer();
    let txns = e.iter().filter(|e| matches!(e, Effect::Etcd(Op::Txn(_))));
    assert_eq!(txns.count(), 0, "no shards, no header: {e:?}");
}

/// A member whose shard is gone when it reads it (two seals came between its header and
/// its read, each deleting the shards of the round before the one it replaces) reads the
/// round key and takes the newer seal from it as a watch would bring it: it reads that
/// seal's shard, not the whole run again (at 10,000 members, a resync each was a crowd's
/// whole reads again). The same seal at the round key means keys no agent wrote: the run
/// is read again.
#[test]
fn a_member_whose_shard_a_newer_seal_deleted_reads_that_seal_not_the_run() {
    let ranged = |key: String| Op::Range {
        key,
        prefix: false,
        keys_only: false,
        serializable: false,
    };
    let shard_read = |key: String| Op::Range {
        key,
        prefix: false,
        keys_only: false,
        serializable: true,
    };
    let k = keys();
    let (whole, header, _) = placed_round_two();
    let mut h = Harness::synced();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let gone = Answer::Range {
        revision: 30,
        kvs: Vec::new(),
    };
    assert_eq!(the_op(&h.answer(gone)), ranged(k.key::<v1::Round>("")));
    let next = v1::Round {
        number: 4,
        sealed_at_ms: 7_000,
        ..whole.clone()
    };
    let (newer, _) = place(&next, None);
    let e = h.answer(Answer::Range {
        revision: 30,
        kvs: vec![round_kv(&newer, 25)],
    });
    let mine = placement::shard_of("a", newer.shards);
    assert_eq!(the_op(&e), shard_read(k.placement(&newer.placement, mine)));
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    // The same seal at the round key: the run is read again.
    let mut h = Harness::synced();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    h.answer(Answer::Range {
        revision: 30,
        kvs: Vec::new(),
    });
    h.answer(Answer::Range {
        revision: 30,
        kvs: vec![round_kv(&header, 12)],
    });
    assert!(matches!(h.m.phase(), Phase::Syncing(_)));
}

/// A member's shard read is served from whichever etcd member it reaches, without waiting
/// for it to catch up: one that had not applied the header yet answers with an older
/// revision and no shard. That is not a missing shard (no newer seal to look for, no run
/// to read again): the same shard is read from the leader's state, and it makes the round.
#[test]
fn a_shard_read_served_before_its_header_is_read_again_not_judged_missing() {
    let k = keys();
    let (_, header, shards) = placed_round_two();
    let mine = placement::shard_of("a", header.shards);
    let mut h = Harness::synced();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    let behind = Answer::Range {
        revision: 11,
        kvs: Vec::new(),
    };
    let again = Op::Range {
        key: k.placement(&header.placement, mine),
        prefix: false,
        keys_only: false,
        serializable: false,
    };
    assert_eq!(
        the_op(&h.answer(behind)),
        again,
        "the shard again, linearizable"
    );
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    no_op(&h.answer(Answer::Range {
        revision: 13,
        kvs: vec![shard_kv(&shards[mine as usize], 12)],
    }));
    let held = h.m.view().round.clone().unwrap();
    assert_eq!((held.record.number, held.mod_rev), (2, 12));
    // Read from the leader's state and still missing: the round key tells why.
    let mut h = Harness::synced();
    h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    h.answer(Answer::Range {
        revision: 11,
        kvs: Vec::new(),
    });
    let e = h.answer(Answer::Range {
        revision: 13,
        kvs: Vec::new(),
    });
    assert_eq!(
        the_op(&e),
        Op::Range {
            key: k.key::<v1::Round>(""),
            prefix: false,
            keys_only: false,
            serializable: false,
        }
    );
}

/// A departure goes as soon as the op in flight is answered, before whatever was queued
/// behind that op (events, the work they bring, a sync's next steps): it needs nothing of
/// the run. At the end of a 10,000-node run, all leaving at once, one node's departure
/// waited behind everyone else's for more than a minute (`rdzv-bench`, 2026-11-30).
#[test]
fn a_departure_goes_next_whatever_was_queued_before_it() {
    let leave = || depart(Departure::Finished, crate::LeftKind::Finished);
    let departs = |e: &[Effect]| matches!(the_op(e), Op::Depart { .. });
    // Watching, a write in flight, a placed round's header queued behind it (its shard
    // read would be next).
    let (_, header, _) = placed_round_two();
    let mut h = Harness::synced();
    let master = v1::Master {
        schema: SCHEMA_VERSION,
        round: 1,
        addr: "a.local".into(),
        port: 29500,
    };
    let e = h.command(1, write(&master));
    assert!(matches!(the_op(&e), Op::Txn(_) | Op::Put(_)), "{e:?}");
    no_op(&h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))])));
    no_op(&h.command(2, leave()));
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    assert!(departs(&e), "the departure, not the shard read: {e:?}");
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 2);
    assert_eq!(h.m.phase(), Phase::Ended);
    // In the first sync: it does not wait for the sync to end.
    let mut h = Harness::new();
    let first = h.m.start(h.now);
    no_op(&h.command(1, leave()));
    let (ops, rest) = h.sync_through(first, &[]);
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert!(
        departs(&rest),
        "the departure after the op in flight: {rest:?}"
    );
}

/// A process that coordinates under the coordinator key its predecessor on the same node
/// left (same node id, that process's lease still live) names its shards after its own
/// lease: both count their seals from 0, and under the key's lease the new one's header
/// named the dead one's shards of another membership beside its own (found by the
/// simulator: "shard 2 of 2 shards is no shard of round 1", a round nobody could read).
#[test]
fn a_restarted_coordinator_names_its_shards_apart_from_its_predecessors() {
    const PREDECESSOR: i64 = LEASE + 7;
    let k = keys();
    let me = member("a", LEASE, 1, 0);
    let (_, rest) = Harness::with(|c| c.placement_above = 0)
        .first_sync(&[member_kv(&me, 4), coordinator_kv("a", PREDECESSOR)]);
    let spec = txn(the_op(&rest));
    assert!(
        spec.when
            .contains(&Compare::Lease(k.key::<v1::Coordinator>(""), PREDECESSOR)),
        "fenced by the key it holds: {:?}",
        spec.when
    );
    let header: v1::Round =
        fsdp_proto::decode("k", put_at(&spec.then, &k.key::<v1::Round>("")).0).unwrap();
    assert_eq!(header.placement, placement::tag(header.number, LEASE, 0));
}

/// Paces the joining node of `h` as a keep-alive answered late does (as at a crowd's
/// seal): its next paced request waits.
fn paced_by_a_late_keep_alive(h: &mut Harness) {
    let mut e = h.fire();
    while super::overload::keep_alives_beside(&e) == 0 && !etcd_ops(&e).contains(&Op::KeepAlive) {
        e = h.fire();
    }
    if etcd_ops(&e).contains(&Op::KeepAlive) {
        no_op(&h.answer(Answer::Done));
    }
    h.later(Duration::from_secs(2));
    h.step(Input::LeaseAnswer(Some(6)));
    assert!(h.m.admission.wait(h.now).is_some(), "paced");
}

/// A joining node whose pace holds its next request reads its own shard of a sealed round
/// at once: one small key, where its formation ends; held, it made the node the
/// formation's straggler.
#[test]
fn a_joining_node_held_by_its_pace_reads_its_shard_of_a_sealed_round_at_once() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 99)]);
    h.register(1, 0, true);
    paced_by_a_late_keep_alive(&mut h);
    let (_, header, _) = placed_round_two();
    let e = h.step(Input::Watched(vec![WatchEvent::Put(round_kv(&header, 12))]));
    assert_eq!(the_op(&e), own_shard_read(&header));
}

/// The roster (a whole round of up to 2,000 members) stays paced: a crowd's nodes that
/// find a delta they cannot apply read it while their grants and registrations load etcd.
#[test]
fn a_joining_node_held_by_its_pace_waits_to_read_the_roster() {
    let mut h = Harness::synced();
    let whole = takes_round_two(&mut h);
    paced_by_a_late_keep_alive(&mut h);
    let kv = round_three_as_a_delta(&whole);
    let roster = Op::Range {
        key: keys().key::<v1::Roster>(""),
        prefix: false,
        keys_only: false,
        serializable: false,
    };
    let mut e = h.step(Input::Watched(vec![WatchEvent::Put(kv)]));
    let held_at = h.now;
    assert!(!etcd_ops(&e).contains(&roster), "held: {e:?}");
    // Keep-alives go meanwhile; the roster once the pause is over.
    for _ in 0..10 {
        if etcd_ops(&e).contains(&roster) {
            break;
        }
        if etcd_ops(&e).contains(&Op::KeepAlive) {
            h.answer(Answer::Done);
        }
        e = h.fire();
    }
    assert!(etcd_ops(&e).contains(&roster), "{e:?}");
    assert!(h.now > held_at, "read after the pause");
}
