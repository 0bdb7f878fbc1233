//! The view built from etcd's keys: records decoded and checked, garbage and foreign keys,
//! departures, hang reports and finished rounds.

use super::*;
use prost::Message;

#[test]
fn garbage_is_recorded_with_its_key_and_cleared_by_a_good_value() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Round>(""),
        b"\x08\xff\xff garbage",
        1,
        1,
        0,
    );
    assert!(v.round.is_none());
    assert!(v.corruption().unwrap().contains("/fsdp/r/ctl/round"));
    let good = v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 3,
        members: vec![v1::Member::from(v1::MemberFields {
            node_id: "a".into(),
            local_world_size: 1,
            ..Default::default()
        })],
        ..Default::default()
    };
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Round>(""),
        &good.encode_to_vec(),
        1,
        2,
        0,
    );
    assert_eq!(v.round.as_ref().unwrap().record.number, 3);
    assert!(v.corruption().is_none());
}

#[test]
fn hang_reports_are_kept_by_round_for_the_latest_rounds_only() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    for round in 0..6u64 {
        for node in ["a", "b"] {
            let h = v1::HangReport {
                schema: fsdp_proto::SCHEMA_VERSION,
                round,
                node_id: node.into(),
                ..Default::default()
            };
            v.put(
                &keys,
                &keys.key::<fsdp_proto::v1::HangReport>(&crate::etcd::record::per_round(
                    round, node,
                )),
                &h.encode_to_vec(),
                1,
                1,
                0,
            );
        }
    }
    assert!(v.corruption().is_none());
    let rounds: Vec<u64> = v.hangs.keys().copied().collect();
    assert_eq!(rounds, [2, 3, 4, 5]);
    assert_eq!(v.hangs[&5].len(), 2);
}

#[test]
fn a_round_is_finished_once_every_member_reported_done() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    assert!(!v.round_finished());
    let member = |id: &str| {
        v1::Member::from(v1::MemberFields {
            node_id: id.into(),
            local_world_size: 1,
            ..Default::default()
        })
    };
    let round = v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 4,
        members: vec![member("a"), member("b")],
        ..Default::default()
    };
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Round>(""),
        &round.encode_to_vec(),
        1,
        1,
        0,
    );
    assert!(v.corruption().is_none(), "{:?}", v.corruption());
    let done = |id: &str| v1::Done {
        schema: fsdp_proto::SCHEMA_VERSION,
        round: 4,
        node_id: id.into(),
    };
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Done>(&crate::etcd::record::per_round(4, "a")),
        &done("a").encode_to_vec(),
        1,
        2,
        0,
    );
    assert_eq!(v.unfinished(&round), ["b"]);
    assert!(!v.round_finished());
    // Done in another round does not count.
    let mut old = done("b");
    old.round = 3;
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Done>(&crate::etcd::record::per_round(3, "b")),
        &old.encode_to_vec(),
        1,
        3,
        0,
    );
    assert!(!v.round_finished());
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Done>(&crate::etcd::record::per_round(4, "b")),
        &done("b").encode_to_vec(),
        1,
        4,
        0,
    );
    assert!(v.unfinished(&round).is_empty() && v.round_finished());
}

#[test]
fn deletes_of_members_are_remembered_as_departures() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    let m = v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "a".into(),
        local_world_size: 1,
        incarnation: 3,
        ..Default::default()
    });
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        &m.encode_to_vec(),
        5,
        5,
        7,
    );
    assert!(v.members.contains_key("a"));
    v.delete(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        Instant::now(),
        None,
    );
    assert!(!v.members.contains_key("a") && v.departed.contains_key("a"));
    // The incarnation that went is the one the view knew; a later one did not go.
    let d = v.departed["a"];
    assert_eq!(d.incarnation, 3);
    let mut later = m.clone();
    assert!(v.departed_since(&later, d.at));
    later.incarnation = 4;
    assert!(!v.departed_since(&later, d.at));
    // A delete that carries the old value says which incarnation went.
    v.delete(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        d.at,
        Some(&later.encode_to_vec()),
    );
    assert!(v.departed_since(&later, d.at));
}

/// A failure under load: the round's rank 0 sealed itself out of the budget and left
/// (taking the master) while the last member became coordinator and switched watches;
/// its view had no registration of it (members see none after their snapshot), so
/// nothing recorded the departure, and the member waited for the master forever.
#[test]
fn members_that_left_while_the_watches_switched_include_those_only_a_round_names() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let member = |id: &str, incarnation: u64| {
        v1::Member::from(v1::MemberFields {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: id.into(),
            local_world_size: 1,
            incarnation,
            ..Default::default()
        })
    };
    let round = |members: Vec<v1::Member>| RoundEntry {
        record: std::sync::Arc::new(v1::Round {
            schema: fsdp_proto::SCHEMA_VERSION,
            number: 2,
            members,
            ..Default::default()
        }),
        mod_rev: 9,
    };
    let mut old = View::default();
    old.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("b"),
        &member("b", 1).encode_to_vec(),
        1,
        1,
        7,
    );
    old.round = Some(round(vec![member("a", 1), member("b", 1)]));
    let mut fresh = View::default();
    fresh.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("b"),
        &member("b", 1).encode_to_vec(),
        1,
        1,
        7,
    );
    fresh.round = Some(round(vec![member("a", 2), member("b", 1), member("c", 1)]));
    let running = v1::Round {
        members: vec![member("d", 3)],
        ..Default::default()
    };
    assert_eq!(
        left_between(&old, Some(&running), &fresh),
        [
            ("a".to_owned(), 2),
            ("c".to_owned(), 1),
            ("d".to_owned(), 3)
        ]
    );
    // Registered in the snapshot: not gone, whatever the rounds say.
    assert!(
        left_between(&fresh, None, &fresh)
            .iter()
            .all(|(id, _)| id != "b")
    );
}

#[test]
fn foreign_keys_and_mislabelled_members_are_not_trusted() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    v.put(&keys, "/fsdp/r/other", b"x", 1, 1, 0);
    assert!(v.corruption().is_none(), "refused, not fatal");
    assert!(v.refused["/fsdp/r/other"].contains("unexpected key"));
    let m = v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "b".into(),
        ..Default::default()
    });
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        &m.encode_to_vec(),
        1,
        1,
        7,
    );
    assert!(!v.members.contains_key("a"));
}

#[test]
fn records_that_decode_are_still_checked_and_refused() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let member = |n: u32| {
        v1::Member::from(v1::MemberFields {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: "a".into(),
            local_world_size: n,
            ..Default::default()
        })
    };
    let mut v = View::default();
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        &member(2).encode_to_vec(),
        1,
        1,
        0,
    );
    let key = keys.key::<fsdp_proto::v1::Member>("a");
    assert!(v.refused[&key].contains("lease"));
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        &member(u32::MAX).encode_to_vec(),
        1,
        1,
        9,
    );
    assert!(v.refused[&key].contains("local_world_size"));
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Member>("a"),
        &member(2).encode_to_vec(),
        1,
        1,
        9,
    );
    assert!(v.refused.is_empty() && v.members.contains_key("a"));

    let round = v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 1,
        members: vec![member(2), member(2)],
        ..Default::default()
    };
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Round>(""),
        &round.encode_to_vec(),
        1,
        1,
        0,
    );
    assert!(v.refused[&keys.key::<fsdp_proto::v1::Round>("")].contains("twice"));
    assert!(v.round.is_none());
    let master = v1::Master {
        schema: fsdp_proto::SCHEMA_VERSION,
        round: 1,
        addr: "h".into(),
        port: 70_000,
    };
    v.put(
        &keys,
        &keys.key::<fsdp_proto::v1::Master>(""),
        &master.encode_to_vec(),
        1,
        1,
        0,
    );
    assert!(v.refused[&keys.key::<fsdp_proto::v1::Master>("")].contains("70000"));
    assert!(v.master.is_none() && v.corruption().is_none());
}

#[test]
fn a_nested_runs_keys_are_ignored_not_foreign() {
    let keys = Keys::new("/fsdp", "r").unwrap();
    let mut v = View::default();
    v.put(&keys, "/fsdp/r/x/members/n", b"whatever", 1, 1, 3);
    assert!(v.corruption().is_none() && v.members.is_empty());
}
