//! The departure records' pure parts on hand-built views: which old records go, and which
//! gone members the coordinator says "lost" for.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::*;
use crate::etcd::record::left_tail;
use crate::etcd::view::{MemberEntry, RoundEntry};

fn word(node: &str, incarnation: u64, kind: v1::LeftKind) -> v1::Left {
    v1::Left {
        schema: SCHEMA_VERSION,
        node_id: node.into(),
        incarnation,
        kind: kind.into(),
        detail: "why".into(),
        ..Default::default()
    }
}

/// `n` records, the i-th written at revision `first_rev + i`.
fn records(n: usize, first_rev: i64) -> BTreeMap<String, LeftEntry> {
    (0..n)
        .map(|i| {
            // Node names that sort against their age, so that the order is the revision's.
            let node = format!("n{:04}", n - i);
            let entry = LeftEntry {
                record: word(&node, 1, v1::LeftKind::Finished),
                mod_rev: first_rev + i as i64,
            };
            (left_tail(&node, 1), entry)
        })
        .collect()
}

#[test]
fn below_the_limit_nothing_is_trimmed() {
    let left = records(KEPT - 1, 10);
    assert!(trim(&left, Some("new/1")).is_empty());
    assert!(trim(&records(KEPT, 10), None).is_empty());
}

#[test]
fn the_oldest_go_so_that_the_last_hundred_stay() {
    let left = records(KEPT, 10);
    let gone = trim(&left, Some(&left_tail("new", 1)));
    assert_eq!(gone.len(), 1);
    assert_eq!(left[&gone[0]].mod_rev, 10, "the oldest by revision");

    // The record being written replaces one of its own: nothing more to make room for.
    let mine = left_tail("n0001", 1);
    assert!(left.contains_key(&mine));
    assert!(trim(&left, Some(&mine)).is_empty());

    // A coordinator that finds more than it keeps trims the excess, oldest first, and
    // never the record it writes.
    let left = records(KEPT + 3, 10);
    let newest = left_tail("n0001", 1);
    let gone = trim(&left, Some(&newest));
    let revs: Vec<i64> = gone.iter().map(|t| left[t].mod_rev).collect();
    assert_eq!(revs, [10, 11, 12]);
    let gone = trim(&records(KEPT + 3, 10), None);
    assert_eq!(gone.len(), 3);
}

/// A flood of departures leaves many more than a transaction may delete: each trim takes
/// a bounded bite, and bites until the hundred remain.
#[test]
fn a_flood_is_trimmed_in_bounded_bites_down_to_the_hundred() {
    let mut left = records(1000, 1);
    let mut bites = 0;
    loop {
        let gone = trim(&left, None);
        if gone.is_empty() {
            break;
        }
        assert!(gone.len() <= TRIM_PER_TXN, "{} in one bite", gone.len());
        for t in gone {
            left.remove(&t);
        }
        bites += 1;
    }
    assert_eq!(left.len(), KEPT);
    assert_eq!(bites, 900_usize.div_ceil(TRIM_PER_TXN));
    let oldest = left.values().map(|e| e.mod_rev).min().unwrap();
    assert_eq!(oldest, 901, "the newest hundred stay");
}

fn member(id: &str, incarnation: u64) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 1,
        lease: 7,
        incarnation,
        ..Default::default()
    })
}

/// A coordinator's view: round 3 of `round` (node, incarnation), `registered` now.
fn view(round: &[(&str, u64)], registered: &[(&str, u64)]) -> View {
    let mut v = View {
        round: Some(RoundEntry {
            record: Arc::new(v1::Round {
                schema: SCHEMA_VERSION,
                number: 3,
                members: round.iter().map(|(id, i)| member(id, *i)).collect(),
                ..Default::default()
            }),
            mod_rev: 1,
        }),
        ..View::default()
    };
    for (id, i) in registered {
        v.members.insert(
            (*id).into(),
            MemberEntry {
                record: member(id, *i),
                create_rev: 2,
            },
        );
    }
    v
}

fn said(v: &mut View, node: &str, incarnation: u64, rev: i64) {
    v.left.insert(
        left_tail(node, incarnation),
        LeftEntry {
            record: word(node, incarnation, v1::LeftKind::Unhealthy),
            mod_rev: rev,
        },
    );
}

fn names(found: &[Vanished]) -> Vec<(&str, bool)> {
    found
        .iter()
        .map(|g| (g.node_id.as_str(), g.explained))
        .collect()
}

#[test]
fn a_member_gone_without_a_word_is_lost_once() {
    let v = view(&[("me", 1), ("b", 4), ("c", 1)], &[("me", 1), ("c", 1)]);
    let found = vanished(&v, "me", &BTreeSet::new());
    assert_eq!(names(&found), [("b", false)]);
    let b = &found[0];
    assert_eq!((b.incarnation, b.round, b.addr.as_str()), (4, 3, "b.local"));

    // Dealt with (written, or found explained): never again.
    let dealt = BTreeSet::from([("b".to_owned(), 4)]);
    assert!(vanished(&v, "me", &dealt).is_empty());
}

/// No second row: a node that said why itself (for this registration or a later one: a
/// node that withdrew for its health check says why from its next incarnation) is not
/// lost, nor is one whose health check keeps it out (it says why when it leaves).
#[test]
fn a_member_that_said_why_is_never_also_lost() {
    let mut v = view(&[("me", 1), ("b", 4), ("c", 2), ("d", 5)], &[("me", 1)]);
    said(&mut v, "b", 4, 10);
    said(&mut v, "c", 3, 11);
    said(&mut v, "d", 4, 12);
    v.unhealthy.insert("e".into(), v1::Unhealthy::default());
    let mut v2 = v.clone();
    let found = vanished(&v, "me", &BTreeSet::new());
    assert_eq!(
        names(&found),
        [("b", true), ("c", true), ("d", false)],
        "d's record is of an earlier registration"
    );

    v2.round = Some(RoundEntry {
        record: Arc::new(v1::Round {
            number: 3,
            members: vec![member("me", 1), member("e", 2)],
            ..Default::default()
        }),
        mod_rev: 1,
    });
    assert_eq!(names(&vanished(&v2, "me", &BTreeSet::new())), [("e", true)]);
}

#[test]
fn the_coordinator_never_calls_itself_lost_and_registered_members_are_not_gone() {
    // Its own registration is being written again (a new lease): not a loss to record.
    let v = view(&[("me", 1), ("b", 1)], &[("b", 2)]);
    assert!(vanished(&v, "me", &BTreeSet::new()).is_empty());
    // No round: nobody to lose.
    assert!(vanished(&View::default(), "me", &BTreeSet::new()).is_empty());
}

#[test]
fn the_lost_word_says_how_the_loss_was_proven() {
    let mut v = view(&[("me", 1), ("b", 1)], &[("me", 1)]);
    let b = vanished(&v, "me", &BTreeSet::new()).remove(0);
    let why = lost_reason(&v, &b);
    assert_eq!(why.kind, LeftKind::Lost);
    assert!(why.detail.contains("lease expired"), "{why:?}");

    v.noticed.insert(
        "b".into(),
        v1::Noticed {
            schema: SCHEMA_VERSION,
            round: 3,
            node_id: "b".into(),
            how: v1::Detection::Refused.into(),
            detect_ms: 42,
        },
    );
    v.done.entry(3).or_default().insert("b".into());
    let why = lost_reason(&v, &b);
    assert!(
        why.detail.contains("refused a connection") && why.detail.contains("42 ms"),
        "{why:?}"
    );
    assert!(
        why.detail.ends_with("its workers had all finished"),
        "{why:?}"
    );
}

#[test]
fn a_word_is_one_line_cut_to_the_length_agents_accept() {
    let w = Word {
        node_id: "a",
        incarnation: 2,
        addr: "a.local",
        round: 1,
        at_ms: 5,
        by: "a",
    };
    let long = format!("first line\nsecond {}", "x".repeat(2000));
    let r = w.record(&LeftReason::new(LeftKind::Unhealthy, long));
    assert_eq!(r.kind(), v1::LeftKind::Unhealthy);
    assert_eq!(
        r.detail.chars().count(),
        crate::etcd::record::LEFT_DETAIL_MAX
    );
    assert!(r.detail.starts_with("first line second"), "{}", r.detail);
    assert!(View::default().allowed.left(&r).is_ok());
    // Its text too, as a reader judges every record's.
    use crate::etcd::record::Record;
    assert!(r.allowed(&View::default(), "").is_ok());
    assert_eq!(kind_of(&r), Some(LeftKind::Unhealthy));
}

/// Which departures told a round's members it broke: a word written after the round was
/// sealed, of the registration the round names or a later one, not a finish, from a node
/// not done with the round.
#[test]
fn a_round_is_broken_for_its_members_by_a_word_that_is_not_a_finish() {
    // The round was sealed at revision 1; the words are written at `rev`.
    let with = |words: &[(&str, u64, v1::LeftKind, i64)]| {
        let mut v = view(&[("a", 1), ("b", 2), ("c", 1)], &[]);
        for (node, incarnation, kind, rev) in words {
            v.left.insert(
                left_tail(node, *incarnation),
                LeftEntry {
                    record: word(node, *incarnation, *kind),
                    mod_rev: *rev,
                },
            );
        }
        v
    };
    let broke = |v: &View| -> Vec<String> {
        let r = v.round.as_ref().unwrap();
        breakers(v, r).into_iter().map(str::to_owned).collect()
    };
    let v = with(&[]);
    assert!(broke(&v).is_empty());
    assert!(news(&v, v.round.as_ref().unwrap(), "a"));

    let v = with(&[
        ("b", 1, v1::LeftKind::Left, 10),
        ("c", 1, v1::LeftKind::Finished, 11),
        ("d", 1, v1::LeftKind::Lost, 12),
        // Written before the round was sealed (a revoke that failed beside it): the round
        // names that registration, and its members did not take the word for a loss.
        ("a", 1, v1::LeftKind::Left, 0),
    ]);
    assert!(
        broke(&v).is_empty(),
        "an earlier b, a finish, no member, before"
    );

    let mut v = with(&[("b", 3, v1::LeftKind::Lost, 10)]);
    assert_eq!(broke(&v), ["b"]);
    assert!(!news(&v, v.round.as_ref().unwrap(), "a"), "b broke it");
    assert!(
        news(&v, v.round.as_ref().unwrap(), "b"),
        "its own word is news"
    );
    // b was done with the round before it went: its going breaks nothing.
    v.done.insert(3, BTreeSet::from(["b".to_owned()]));
    assert!(broke(&v).is_empty());
}
