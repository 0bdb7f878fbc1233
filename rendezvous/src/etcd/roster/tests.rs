use super::*;
use prost::Message;

fn member(id: &str, incarnation: u64) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 8,
        status_addr: format!("{id}.local:29450"),
        lease: 7_000 + incarnation as i64,
        incarnation,
        ..Default::default()
    })
}

fn round(number: u64, ids: &[(&str, u64)]) -> v1::Round {
    v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number,
        members: ids.iter().map(|(id, i)| member(id, *i)).collect(),
        restart_count: 2,
        reason: format!("round {number}"),
        charged_at_ms: vec![10, 20],
        sealed_at_ms: 1_000 + number,
        ..Default::default()
    }
}

#[test]
fn a_loss_a_rejoin_and_growth_go_and_come_back_whole() {
    let base = round(4, &[("b", 1), ("a", 1), ("c", 1), ("d", 1)]);
    // c lost, d registered again (incarnation 2), e and f joined.
    let mut full = round(5, &[("b", 1), ("a", 1), ("d", 2), ("e", 1), ("f", 1)]);
    // As the coordinator writes it whole: naming who of round 4 it left out.
    full.dropped = vec!["c".into()];
    let d = delta(&base, 40, &full).expect("survivors first, in order");
    assert!(d.delta && d.members.is_empty());
    assert_eq!((d.base, d.base_rev), (4, 40));
    assert_eq!(d.removed, ["c"]);
    assert_eq!(d.updated, [member("d", 2)]);
    assert_eq!(d.added, [member("e", 1), member("f", 1)]);
    assert_eq!(apply(&base, &d).unwrap(), full);
}

/// The point of it: one lost node out of 1,000 is a record of a few bytes, not the whole
/// round sent to every member.
#[test]
fn a_loss_at_a_thousand_nodes_is_a_few_bytes() {
    let ids: Vec<String> = (0..1000).map(|i| format!("node-{i:04}-abcdef")).collect();
    let all: Vec<(&str, u64)> = ids.iter().map(|id| (id.as_str(), 1)).collect();
    let base = round(7, &all);
    let mut rest = all.clone();
    rest.remove(500);
    let mut full = round(8, &rest);
    full.dropped = vec![ids[500].clone()];
    let d = delta(&base, 99, &full).unwrap();
    let (whole, small) = (full.encoded_len(), d.encoded_len());
    assert!(whole > 50_000, "{whole}");
    assert!(small < 200, "{small} bytes");
    assert_eq!(apply(&base, &d).unwrap(), full);
}

#[test]
fn a_round_that_reorders_the_survivors_is_written_whole() {
    let base = round(1, &[("a", 1), ("b", 1)]);
    assert_eq!(delta(&base, 3, &round(2, &[("b", 1), ("a", 1)])), None);
    // A newcomer before a survivor: not the coordinator's order either.
    assert_eq!(delta(&base, 3, &round(2, &[("x", 1), ("a", 1)])), None);
}

#[test]
fn a_delta_naming_a_node_the_base_lacks_does_not_apply() {
    let base = round(1, &[("a", 1), ("b", 1)]);
    let mut d = delta(&base, 3, &round(2, &[("a", 1)])).unwrap();
    d.removed = vec!["z".into()];
    let e = apply(&base, &d).unwrap_err();
    assert!(e.contains("node z"), "{e}");
}

/// `apply` looks names up in the delta's sorted lists: a name given twice, or both gone
/// and updated, reads as a map of them would (the last update wins; gone is gone).
#[test]
fn a_delta_that_names_a_node_twice_applies_as_sets_of_names_would() {
    let base = round(1, &[("a", 1), ("b", 1), ("c", 1), ("d", 1)]);
    let mut d = delta(&base, 3, &round(2, &[("b", 1), ("d", 1)])).unwrap();
    d.removed = vec!["c".into(), "a".into(), "c".into()];
    d.updated = vec![member("b", 2), member("b", 3), member("a", 4)];
    d.added = vec![member("e", 1)];
    let whole = apply(&base, &d).unwrap();
    let got: Vec<(&str, u64)> = whole
        .members
        .iter()
        .map(|m| (m.node_id.as_str(), m.incarnation))
        .collect();
    assert_eq!(got, [("b", 3), ("d", 1), ("e", 1)]);
    d.updated.push(member("z", 1));
    let e = apply(&base, &d).unwrap_err();
    assert!(
        e.contains("node z"),
        "an update of a node the base lacks: {e}"
    );
}

/// The view takes a round made from a delta without checking its N names again, so the
/// delta may not add a node twice, nor one the round keeps.
#[test]
fn a_delta_that_adds_a_node_twice_or_one_the_round_keeps_does_not_apply() {
    let base = round(1, &[("a", 1), ("b", 1), ("c", 1)]);
    let mut d = delta(&base, 3, &round(2, &[("a", 1), ("b", 1)])).unwrap();
    d.added = vec![member("e", 1), member("e", 1)];
    let e = apply(&base, &d).unwrap_err();
    assert!(e.contains("adds node e twice"), "{e}");
    d.added = vec![member("e", 1), member("b", 2)];
    let e = apply(&base, &d).unwrap_err();
    assert!(e.contains("adds node b"), "{e}");
    // A node removed and added back in one delta is listed once.
    d.added = vec![member("c", 2)];
    let whole = apply(&base, &d).unwrap();
    let ids: Vec<&str> = whole.members.iter().map(|m| m.node_id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
}

/// Every agent applies every delta to the round it holds: the round it makes shares the
/// kept members' records with that round, nothing is copied per member (a copy is N
/// records per agent per re-form, 1,000 at 1,000 nodes).
#[test]
fn the_round_a_delta_makes_shares_its_kept_members_with_the_round_it_applied_to() {
    let base = round(4, &[("b", 1), ("a", 1), ("c", 1), ("d", 1)]);
    let full = round(5, &[("b", 1), ("a", 1), ("d", 2), ("e", 1)]);
    let d = delta(&base, 40, &full).unwrap();
    let next = apply(&base, &d).unwrap();
    let shared = |i: usize, j: usize| v1::Member::same(&next.members[i], &base.members[j]);
    assert!(shared(0, 0) && shared(1, 1), "kept members were copied");
    // The updated and the added are the delta's own.
    assert!(!shared(2, 3));
    assert!(v1::Member::same(&next.members[2], &d.updated[0]));
    assert!(v1::Member::same(&next.members[3], &d.added[0]));
}
