//! Tests of the report `fsdp-agent status` shows: member rows, health verdicts and the
//! nodes that left.

use super::*;
use crate::etcd::left;
use crate::etcd::view::{LeftEntry, MemberEntry, RoundEntry};

fn member(id: &str, n: u32) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: 1,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: n,
        wants_round: 0,
        ..Default::default()
    })
}

fn view(round_members: &[(&str, u32)], live: &[&str]) -> View {
    let mut v = View::default();
    let all: Vec<_> = round_members.iter().map(|(id, n)| member(id, *n)).collect();
    v.round = Some(RoundEntry {
        record: std::sync::Arc::new(v1::Round {
            schema: 1,
            number: 4,
            members: all.clone(),
            restart_count: 1,
            reason: "a member was lost".into(),
            ..Default::default()
        }),
        mod_rev: 1,
    });
    v.master = Some(v1::Master {
        schema: 1,
        round: 4,
        addr: "a.local".into(),
        port: 29500,
    });
    for (i, id) in live.iter().enumerate() {
        v.members.insert(
            (*id).into(),
            MemberEntry {
                record: member(id, 2),
                create_rev: i as i64,
            },
        );
    }
    v
}

/// Where status reaches a member: its registration says, and for a member whose
/// registration is gone, the round's own record of it.
#[test]
fn a_members_status_address_is_its_registrations_else_the_rounds() {
    let mut v = view(&[("a", 2), ("b", 2)], &["a"]);
    let round = v.round.as_mut().unwrap();
    let rec = std::sync::Arc::make_mut(&mut round.record);
    rec.members[0].status_addr = "a.local:1".into();
    rec.members[1].status_addr = "b.local:1".into();
    v.members.get_mut("a").unwrap().record.status_addr = "a.local:2".into();
    let r = report("job", &v);
    let addrs: Vec<&str> = r.members.iter().map(|m| m.status_addr.as_str()).collect();
    assert_eq!(addrs, ["a.local:2", "b.local:1"]);
}

#[test]
fn a_full_round_is_healthy_with_ranks_and_waiting_nodes_listed() {
    let r = report("job", &view(&[("a", 2), ("b", 4)], &["a", "b", "c"]));
    assert_eq!(r.health, Health::Healthy, "{}", r.health_reason);
    assert_eq!(r.world_size, 6);
    assert_eq!(r.master.as_deref(), Some("a.local:29500"));
    assert_eq!(r.members[1].base_rank, Some(2));
    assert_eq!(r.members[2].state, MemberState::Waiting);
    assert!(r.health_reason.contains("1 node(s) waiting"));
}

#[test]
fn a_missing_member_degrades_and_all_done_finishes() {
    let r = report("job", &view(&[("a", 2), ("b", 2)], &["a"]));
    assert_eq!(r.health, Health::Degraded);
    assert!(r.health_reason.contains('b'), "{}", r.health_reason);

    let mut v = view(&[("a", 2), ("b", 2)], &[]);
    v.done
        .entry(4)
        .or_default()
        .extend(["a".into(), "b".into()]);
    assert_eq!(report("job", &v).health, Health::Finished);

    let v = view(&[("a", 2)], &[]);
    assert_eq!(report("job", &v).health, Health::Stopped);
}

/// The nodes that left, ordered by the revision that wrote each record (etcd's
/// order, not the writers' clocks), newest last; the last hundred.
#[test]
fn departures_are_listed_by_revision_newest_last_the_last_hundred() {
    let mut v = view(&[("a", 2)], &["a"]);
    let said = |node: &str, kind: v1::LeftKind, at_ms: u64| v1::Left {
        schema: 1,
        node_id: node.into(),
        incarnation: 1,
        addr: format!("{node}.local"),
        kind: kind.into(),
        detail: format!("{node}'s reason"),
        at_ms,
        round: 3,
        written_by: "a".into(),
    };
    fn put(v: &mut View, l: v1::Left, mod_rev: i64) {
        let tail = crate::etcd::record::left_tail(&l.node_id, l.incarnation);
        v.left.insert(tail, LeftEntry { record: l, mod_rev });
    }
    // c's clock runs ahead; b was written later all the same.
    put(&mut v, said("c", v1::LeftKind::Unhealthy, 9_000), 10);
    put(&mut v, said("b", v1::LeftKind::Lost, 5_000), 11);
    let r = report("job", &v);
    let got: Vec<(&str, &str)> = r
        .left
        .iter()
        .map(|l| (l.node_id.as_str(), l.reason))
        .collect();
    assert_eq!(got, [("c", "unhealthy"), ("b", "lost")]);
    assert_eq!(r.left[0].detail, "c's reason");
    assert_eq!((r.left[1].round, r.left[1].at_ms), (3, 5_000));
    assert_eq!(r.health, Health::Healthy, "departures change no health");

    for i in 0..150 {
        put(
            &mut v,
            said(&format!("n{i}"), v1::LeftKind::Finished, 0),
            100 + i,
        );
    }
    let r = report("job", &v);
    assert_eq!(r.left.len(), left::KEPT);
    assert_eq!(r.left.last().unwrap().node_id, "n149");
}

/// A run whose only agent gave up (its join timeout) or was stopped before any round:
/// it said "forming: 0 node(s) registered" beside the row saying it left.
#[test]
fn a_run_that_never_formed_and_has_nobody_left_is_stopped_and_says_why() {
    let mut v = View::default();
    let l = v1::Left {
        schema: 1,
        node_id: "n1".into(),
        incarnation: 1,
        addr: "n1.local".into(),
        kind: v1::LeftKind::Left.into(),
        detail: "no round formed within join_timeout (8 s)".into(),
        at_ms: 1,
        round: 0,
        written_by: "n1".into(),
    };
    let tail = crate::etcd::record::left_tail(&l.node_id, l.incarnation);
    v.left.insert(
        tail,
        LeftEntry {
            record: l,
            mod_rev: 3,
        },
    );
    let r = report("job", &v);
    assert_eq!(r.health, Health::Stopped, "{}", r.health_reason);
    assert!(
        r.health_reason.contains("no round ever formed"),
        "{}",
        r.health_reason
    );
    assert!(
        r.health_reason.contains("join_timeout (8 s)"),
        "{}",
        r.health_reason
    );
    // One still waiting: forming, as before.
    v.members.insert(
        "n2".into(),
        MemberEntry {
            record: member("n2", 2),
            create_rev: 4,
        },
    );
    assert_eq!(report("job", &v).health, Health::Forming);
}

#[test]
fn an_unpublished_master_is_forming_and_garbage_is_corrupt() {
    let mut v = view(&[("a", 2)], &["a"]);
    v.master = None;
    assert_eq!(report("job", &v).health, Health::Forming);
    v.corrupt.insert("k".into(), "value at k is garbage".into());
    let r = report("job", &v);
    assert_eq!(r.health, Health::Corrupt);
    assert!(r.health_reason.contains("garbage"));
}
