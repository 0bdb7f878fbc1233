//! The coordinator's seal: its commits and their fences, and withdrawing.

use super::*;

fn unhealthy() -> v1::Unhealthy {
    v1::Unhealthy {
        schema: SCHEMA_VERSION,
        node_id: "a".into(),
        reason: "gpu check failed".into(),
        failures: 1,
        at_ms: 0,
    }
}

/// A node that registered first and won the coordinator key, at `at_ms`: its role-change
/// sync opened the coordinator's watches and its first commit is in flight.
fn coordinating(at_ms: u64) -> (Harness, TxnSpec) {
    let mut h = Harness::synced();
    h.at_ms(at_ms);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    let me = member("a", LEASE, 1, 0);
    let (ops, e) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    assert!(ops.contains(&Op::Watch {
        role: Role::Coordinator,
        from: REV + 1,
        lease: LEASE,
        keep_stream: false
    }));
    let spec = txn(the_op(&e));
    (h, spec)
}

// ---------------------------------------------------------------------------------------
// The coordinator's seal
// ---------------------------------------------------------------------------------------

#[test]
fn a_coordinator_with_enough_members_commits_a_round_fenced_on_an_absent_round_key() {
    let k = keys();
    let (mut h, spec) = coordinating(0);
    // Never after a halt either.
    assert_eq!(spec.when, first_seal_fences());
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Round>(""));
    assert_eq!(lease, 0, "a round outlives its coordinator");
    let r = v1::Round::decode(value).unwrap();
    assert_eq!(r.number, 0);
    assert_eq!(r.members, vec![member("a", LEASE, 1, 0)]);
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 0);
    h.answer(Answer::Txn { succeeded: true });
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 1);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Coordinator,
            lease: LEASE
        }
    );
}

/// Sealing a round it is rank 0 of, the coordinator names the master in the same write:
/// the members form on one event instead of waiting for rank 0 to see the round and
/// publish it.
#[test]
fn a_coordinator_that_is_rank_0_names_the_master_in_the_seal() {
    let k = keys();
    let (_, spec) = coordinating(0);
    let (value, lease) = put_at(&spec.then, &k.key::<v1::Master>(""));
    assert_eq!(lease, LEASE, "the master goes with rank 0's lease");
    let master = v1::Master::decode(value).unwrap();
    assert_eq!(
        (master.round, master.addr.as_str(), master.port),
        (0, "10.0.0.1", 29_501)
    );
}

/// A coordinator that is not the round's rank 0 leaves the master to rank 0 (its host's
/// port), and one that finds no free port seals all the same.
#[test]
fn a_coordinator_that_is_not_rank_0_or_has_no_port_seals_without_a_master() {
    let k = keys();
    let earlier = member("b", LEASE + 1, 1, 0);
    let mut h = Harness::synced();
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    let me = member("a", LEASE, 1, 0);
    let kvs = [
        member_kv(&earlier, 5),
        member_kv(&me, 6),
        coordinator_kv("a", LEASE),
    ];
    let (_, e) = h.sync_through(e, &kvs);
    let spec = txn(the_op(&e));
    let (value, _) = put_at(&spec.then, &k.key::<v1::Round>(""));
    let ranks: Vec<String> = v1::Round::decode(value)
        .unwrap()
        .members
        .into_iter()
        .map(|m| m.node_id.clone())
        .collect();
    assert_eq!(ranks, ["b", "a"]);
    let master_key = k.key::<v1::Master>("");
    let names_master = |spec: &TxnSpec| {
        spec.then
            .iter()
            .any(|w| matches!(w, Write::Put { key, .. } if *key == master_key))
    };
    assert!(!names_master(&spec), "{spec:?}");

    let mut h = Harness::with_port(None, |_| {});
    let e = h.m.start(h.now);
    let (_, e) = h.sync_through(e, &[]);
    no_op(&e);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    let (_, e) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    let spec = txn(the_op(&e));
    put_at(&spec.then, &k.key::<v1::Round>(""));
    assert!(!names_master(&spec), "{spec:?}");
}

/// A rank 0 with no port at hand (the one found at start went to an earlier seal) asks
/// the driver for one and seals with it. When the seal was decided again at once, before
/// the driver's answer, the master went apart: one more etcd write at every re-form of
/// `rdzv-bench --lose leave`.
#[test]
fn a_rank_0_without_a_port_seals_with_the_one_the_driver_then_finds() {
    let k = keys();
    let mut h = Harness::with_port(None, |_| {});
    h.port = Some(29_502);
    let e = h.m.start(h.now);
    let (_, e) = h.sync_through(e, &[]);
    no_op(&e);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    let me = member("a", LEASE, 1, 0);
    let (_, e) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    let spec = txn(the_op(&e));
    let master = v1::Master::decode(put_at(&spec.then, &k.key::<v1::Master>("")).0).unwrap();
    assert_eq!(master.port, 29_502);
}

#[test]
fn a_failed_commit_does_not_count_as_sealed() {
    let (mut h, _) = coordinating(0);
    let e = h.answer(Answer::Txn { succeeded: false });
    no_op(&e);
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 0);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

#[test]
fn a_commit_is_fenced_on_the_round_it_replaces_and_the_coordinators_lease() {
    let k = keys();
    let old = round(1, &[("b", 1)]);
    let me = member("a", LEASE, 1, 2);
    let (_, rest) = Harness::new().first_sync(&[
        round_kv(&old, 9),
        member_kv(&me, 4),
        coordinator_kv("a", LEASE),
    ]);
    // Round 1's only member is gone: "a", ready for round 2, gets it.
    let spec = txn(the_op(&rest));
    assert_eq!(
        spec.when,
        vec![
            Compare::ModRevision(k.key::<v1::Round>(""), 9),
            Compare::Lease(k.key::<v1::Coordinator>(""), LEASE),
            Compare::Absent(k.key::<v1::Halt>(""))
        ]
    );
    // The round key gets the difference from round 1 (b went, a came); the roster beside
    // it, in the same transaction, the whole round.
    let d = v1::Round::decode(put_at(&spec.then, &k.key::<v1::Round>("")).0).unwrap();
    let me = v1::Member::from(v1::MemberFields {
        wants_round: 0,
        ..(*me).clone()
    });
    assert!(d.delta && d.members.is_empty());
    assert_eq!((d.base, d.base_rev, d.number), (1, 9, 2));
    assert_eq!(
        (d.removed.as_slice(), d.added.as_slice()),
        (["b".to_owned()].as_slice(), [me.clone()].as_slice())
    );
    let roster = put_at(&spec.then, &k.key::<v1::Roster>("")).0;
    let r = v1::Roster::decode(roster).unwrap().round.unwrap();
    assert_eq!(r.number, 2);
    assert_eq!(r.members, vec![me]);
}

#[test]
fn unix_ms_counts_from_unix_ms_at_grant() {
    let k = keys();
    let (_, spec) = coordinating(2_345);
    let r = v1::Round::decode(put_at(&spec.then, &k.key::<v1::Round>("")).0).unwrap();
    assert_eq!(r.sealed_at_ms, UNIX_MS_AT_GRANT + 2_345);
}

#[test]
fn withdraw_as_coordinator_deletes_the_coordinator_key() {
    let k = keys();
    let (mut h, _) = coordinating(0);
    h.answer(Answer::Txn { succeeded: true });
    let e = h.command(
        5,
        Command::Withdraw {
            record: unhealthy(),
        },
    );
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.then,
        vec![
            Write::Delete(k.key::<v1::Member>("a")),
            Write::Put {
                key: k.key::<v1::Unhealthy>("a"),
                value: unhealthy().encode_to_vec(),
                lease: LEASE
            },
            Write::Delete(k.key::<v1::Coordinator>("")),
        ]
    );
    // The next registration is a new incarnation.
    assert_eq!(h.m.incarnation(), 2);
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 5);
}

#[test]
fn withdraw_as_a_member_leaves_the_coordinator_key() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.command(
        2,
        Command::Withdraw {
            record: unhealthy(),
        },
    );
    let spec = txn(the_op(&e));
    assert!(touches(&spec.then, &k.key::<v1::Member>("a")));
    assert!(!touches(&spec.then, &k.key::<v1::Coordinator>("")));
}

/// etcd refuses a request over `--max-request-bytes` (1.5 MiB by default). A round written
/// whole was written twice, at `ctl/round` and at the roster: a first round of 10,000
/// nodes (~95 bytes each) made a 1.9 MB transaction that etcd could never take. The roster
/// is needed only beside a delta; a whole round is written once. And plain, once, it held
/// only ~12,000 such nodes: it is stored packed (`fsdp_proto::encode`), and 30,000 fit.
#[test]
fn a_first_round_of_30000_nodes_fits_etcds_default_request_limit() {
    let k = keys();
    let members: Vec<v1::Member> = (0..30_000u64)
        .map(|i| {
            v1::Member::from(v1::MemberFields {
                schema: SCHEMA_VERSION,
                node_id: format!("trainer-{i:05}.gpu.example.internal-1234567-9f3a2c"),
                addr: format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256),
                local_world_size: 8,
                wants_round: 1,
                status_addr: format!("10.{}.{}.{}:29401", i / 65536, (i / 256) % 256, i % 256),
                // Leases as etcd gives them: nothing a packer can guess.
                lease: (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1) as i64,
                incarnation: 1_764_200_000_000_000 + i,
                min_nodes: 30_000,
                max_nodes: 30_000,
                max_restarts: Some(3),
                restart_window_s: 3600,
                job: "cmd=cfd6caedeae80bde;nproc=gpu;nnodes=30000".into(),
                // Not in rounds (`coordinator::round_record` clears it).
                segment: String::new(),
            })
        })
        .collect();
    let r = v1::Round {
        schema: SCHEMA_VERSION,
        number: 1,
        members,
        reason: "30000 of 30000 nodes present".into(),
        ..Default::default()
    };
    let spec = crate::etcd::session::records::commit_round(&k, None, LEASE, &r, None);
    let bytes: usize = spec
        .then
        .iter()
        .map(|w| match w {
            Write::Put { key, value, .. } => key.len() + value.len(),
            Write::Delete(key) => key.len(),
            Write::DeleteRange { from, to } => from.len() + to.len(),
        })
        .sum();
    assert!(
        bytes < 1_400_000,
        "a 30,000-node seal is {bytes} bytes, over etcd's 1.5 MiB request limit"
    );
    assert!(!touches(&spec.then, &k.key::<v1::Roster>("")));
    let key = k.key::<v1::Round>("");
    let whole: v1::Round = fsdp_proto::decode(&key, put_at(&spec.then, &key).0).unwrap();
    assert_eq!(whole, r, "the round reads back as it was sealed");
}

/// What the coordinator's decisions cost is counted (rdzv-bench prints it): the seal's
/// part of it too.
#[test]
fn the_coordinators_cpu_for_its_decisions_and_its_seals_is_counted() {
    let (h, _) = coordinating(0);
    let all = h.counters.coordinating_ns.load(Ordering::Relaxed);
    let sealing = h.counters.sealing_ns.load(Ordering::Relaxed);
    assert!(sealing > 0, "the seal took no time at all?");
    assert!(all >= sealing, "{all} < {sealing}");
}

/// The deletion of `id`'s registration (incarnation 1), as the coordinator's watch sees it.
fn registration_gone(id: &str) -> WatchEvent {
    WatchEvent::Delete {
        key: keys().key::<v1::Member>(id),
        prev: Some(member(id, 300, 1, 1).encode_to_vec()),
    }
}

/// Coordinator "a" of round 1 (a, b, c) that sealed round 2 without b: the seal's writes,
/// and when etcd took them.
fn sealed_round_two() -> (Harness, Vec<Write>, Instant) {
    let r1 = round(1, &[("a", 1), ("b", 1), ("c", 1)]);
    let (mut h, rest) = Harness::new().first_sync(&[
        round_kv(&r1, 9),
        member_kv(&member("a", LEASE, 1, 1), 4),
        member_kv(&member("b", 300, 1, 1), 5),
        member_kv(&member("c", 300, 1, 1), 6),
        coordinator_kv("a", LEASE),
    ]);
    no_op(&rest);
    let spec = txn(the_op(
        &h.step(Input::Watched(vec![registration_gone("b")])),
    ));
    assert_eq!(
        spec.when[0],
        Compare::ModRevision(keys().key::<v1::Round>(""), 9)
    );
    let e = h.answer(Answer::Txn { succeeded: true });
    let at = h.now;
    words_only(&mut h, e);
    (h, spec.then, at)
}

/// A coordinator that sealed a round does not seal again until its watch brings that
/// round back: its view still holds the round before, and every seal decided from it is
/// fenced out. At 10,000 nodes, with 50 members leaving at once, each departure seen in
/// the 3.3 s before the coordinator's own round came back was a seal of all 9,950 others
/// sent again and refused (51 of them, each through etcd's log), which is what made the
/// watch that slow.
#[test]
fn a_coordinator_waits_for_its_own_seal_before_deciding_again() {
    let k = keys();
    let (mut h, sealed, _) = sealed_round_two();
    // c leaves before the watch brings round 2 back: no seal is sent (its word may be).
    let e = h.step(Input::Watched(vec![registration_gone("c")]));
    words_only(&mut h, e);
    // Round 2 comes back (its round key and roster, at revision 12): round 3 without c,
    // fenced on round 2.
    let back: Vec<WatchEvent> = sealed
        .iter()
        .filter_map(|w| match w {
            Write::Put { key, value, .. } => Some(WatchEvent::Put(Kv {
                key: key.clone(),
                value: value.clone(),
                create_rev: 1,
                mod_rev: 12,
                lease: 0,
            })),
            _ => None,
        })
        .collect();
    let spec = txn(the_op(&h.step(Input::Watched(back))));
    assert_eq!(
        spec.when[0],
        Compare::ModRevision(k.key::<v1::Round>(""), 12)
    );
    let roster = put_at(&spec.then, &k.key::<v1::Roster>("")).0;
    let r = v1::Roster::decode(roster).unwrap().round.unwrap();
    assert_eq!(r.number, 3);
    let ids: Vec<&str> = r.members.iter().map(|m| m.node_id.as_str()).collect();
    assert_eq!(ids, ["a"]);
}

/// It waits a TTL at most: a round key deleted meanwhile (or a watch that lags that far)
/// must not leave the run with nobody sealing. Then it decides from what its view holds.
#[test]
fn a_coordinator_whose_seal_does_not_come_back_decides_again_a_ttl_later() {
    let (mut h, _, sealed_at) = sealed_round_two();
    let e = h.step(Input::Watched(vec![registration_gone("c")]));
    words_only(&mut h, e);
    // Its keep-alives go on meanwhile (answered at once); the first transaction is the seal.
    let mut spec = None;
    let mut e = Vec::new();
    for _ in 0..50 {
        if etcd_ops(&e).is_empty() {
            e = h.fire();
        }
        match etcd_ops(&e).first() {
            Some(Op::Txn(s)) => {
                spec = Some(s.clone());
                break;
            }
            Some(Op::KeepAlive) => {
                e = h.answer(Answer::Done);
                e.extend(h.step(Input::LeaseAnswer(Some(6))));
            }
            Some(other) => panic!("{other:?}"),
            None => {}
        }
    }
    let spec = spec.expect("a seal within a TTL and a few keep-alives");
    assert!(h.now >= sealed_at + TTL, "{:?}", h.now - sealed_at);
    assert_eq!(
        spec.when[0],
        Compare::ModRevision(keys().key::<v1::Round>(""), 9)
    );
}

/// Answers the coordinator's words for members lost without one (`ctl/left/`) from `e`
/// on, until it sends nothing more; any other op fails the test.
fn words_only(h: &mut Harness, mut e: Vec<Effect>) {
    while !etcd_ops(&e).is_empty() {
        let spec = txn(the_op(&e));
        assert!(
            spec.then.iter().all(|w| matches!(w,
                Write::Put { key, .. } if key.starts_with(&format!("{}left/", keys().ctl())))),
            "only words for the lost: {spec:?}"
        );
        e = h.answer(Answer::Txn { succeeded: true });
    }
}
