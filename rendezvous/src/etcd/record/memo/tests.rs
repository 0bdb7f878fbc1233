use fsdp_proto::v1;

use super::round;

const KEY: &str = "/fsdp/r/ctl/round";

fn stored(number: u64, ids: &[&str]) -> Vec<u8> {
    let members = ids
        .iter()
        .map(|id| {
            v1::Member::from(v1::MemberFields {
                schema: fsdp_proto::SCHEMA_VERSION,
                node_id: (*id).into(),
                addr: format!("{id}.local"),
                local_world_size: 8,
                ..Default::default()
            })
        })
        .collect();
    fsdp_proto::encode(&v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number,
        members,
        ..Default::default()
    })
}

fn shares(a: &v1::Round, b: &v1::Round) -> bool {
    a.members.len() == b.members.len()
        && a.members
            .iter()
            .zip(&b.members)
            .all(|(x, y)| v1::Member::same(x, y))
}

#[test]
fn the_same_bytes_are_decoded_once_and_their_members_shared() {
    let bytes = stored(3, &["a", "b", "c"]);
    let first = round(KEY, &bytes).unwrap();
    let second = round(KEY, &bytes.clone()).unwrap();
    assert_eq!(first, second);
    assert!(
        shares(&first, &second),
        "the second decode copied the members"
    );
}

#[test]
fn other_bytes_are_decoded_as_they_are_not_taken_from_the_memo() {
    let first = round(KEY, &stored(3, &["a", "b", "c"])).unwrap();
    let next = round(KEY, &stored(3, &["a", "b", "d"])).unwrap();
    let names: Vec<&str> = next.members.iter().map(|m| m.node_id.as_str()).collect();
    assert_eq!(names, ["a", "b", "d"]);
    assert!(!shares(&first, &next));
    let again = round(KEY, &stored(4, &["a", "b", "c"])).unwrap();
    assert_eq!(again.number, 4, "a round differing only in its number");
}

#[test]
fn a_value_that_does_not_decode_is_refused_and_forgets_nothing() {
    let bytes = stored(5, &["a", "b"]);
    let first = round(KEY, &bytes).unwrap();
    let err = round(KEY, b"\xde\xad not a protobuf").unwrap_err();
    assert!(err.to_string().contains(KEY), "{err}");
    let again = round(KEY, &bytes).unwrap();
    assert!(
        shares(&first, &again),
        "the refused value replaced the memo"
    );
}

#[test]
fn a_packed_round_is_shared_as_a_plain_one_is() {
    let ids: Vec<String> = (0..5_000).map(|i| format!("node-{i:05}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let bytes = stored(9, &ids);
    assert_eq!(bytes.first(), Some(&0), "large enough to be stored packed");
    let first = round(KEY, &bytes).unwrap();
    let second = round(KEY, &bytes).unwrap();
    assert_eq!(first.members.len(), 5_000);
    assert!(shares(&first, &second));
}
