use prost::Message;

use super::*;
use crate::v1;

fn fields(id: &str) -> MemberFields {
    MemberFields {
        schema: 1,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 8,
        status_addr: format!("{id}.local:29401"),
        lease: 7,
        incarnation: 2,
        max_restarts: Some(3),
        ..Default::default()
    }
}

#[test]
fn a_member_is_encoded_as_its_fields_are_and_decodes_back() {
    let m = Member::from(fields("a"));
    assert_eq!(m.encode_to_vec(), fields("a").encode_to_vec());
    assert_eq!(m.encoded_len(), fields("a").encoded_len());
    let back = Member::decode(&*fields("a").encode_to_vec()).unwrap();
    assert_eq!(*back, fields("a"));
    // Inside a round too, where members repeat.
    let round = v1::Round {
        members: vec![m.clone(), Member::from(fields("b"))],
        ..Default::default()
    };
    let back = v1::Round::decode(&*round.encode_to_vec()).unwrap();
    assert_eq!(back, round);
    assert_eq!(back.members[1].node_id, "b");
}

#[test]
fn a_copy_shares_the_fields_until_one_of_them_is_changed() {
    let a = Member::from(fields("a"));
    let mut b = a.clone();
    assert!(Member::same(&a, &b));
    b.wants_round = 9;
    assert!(!Member::same(&a, &b));
    assert_eq!(a.wants_round, 0, "the change showed in the other record");
    assert_eq!(b.wants_round, 9);
    assert_ne!(a, b);
    b.wants_round = 0;
    assert_eq!(a, b, "equal fields are equal members, shared or not");
}

#[test]
fn a_cleared_member_is_the_default_and_leaves_its_copies_alone() {
    let a = Member::from(fields("a"));
    let mut b = a.clone();
    b.clear();
    assert_eq!(b, Member::default());
    assert_eq!(a.node_id, "a");
}
