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

mod judged {
    use std::cell::Cell;

    use fsdp_proto::v1;

    use super::super::{Judgement, judged};
    use super::{KEY, stored};

    /// Judges `members` under `judgement`, counting the times the judge is asked.
    fn judge(
        judgement: Judgement,
        members: &[v1::Member],
        asked: &Cell<u32>,
    ) -> Result<(), String> {
        judged(judgement, members, || {
            asked.set(asked.get() + 1);
            if members.iter().any(|m| m.node_id == "bad") {
                return Err("names bad".into());
            }
            Ok(())
        })
    }

    #[test]
    fn the_same_member_handles_are_judged_once_and_a_verdict_is_kept_whatever_it_said() {
        let asked = Cell::new(0);
        let round = super::round(KEY, &stored(5, &["a", "b", "c"])).unwrap();
        let again = super::round(KEY, &stored(5, &["a", "b", "c"])).unwrap();
        judge(Judgement::Text, &round.members, &asked).unwrap();
        judge(Judgement::Text, &again.members, &asked).unwrap();
        assert_eq!(asked.get(), 1, "the memo's handles were judged again");
        let bad = super::round(KEY, &stored(6, &["a", "bad"])).unwrap();
        assert!(judge(Judgement::Text, &bad.members, &asked).is_err());
        assert!(judge(Judgement::Text, &bad.members, &asked).is_err());
        assert_eq!(asked.get(), 2, "a refusal is kept too");
    }

    #[test]
    fn equal_members_in_other_handles_or_under_other_rules_are_judged_anew() {
        let asked = Cell::new(0);
        let round = super::round(KEY, &stored(7, &["a", "b"])).unwrap();
        judge(Judgement::Text, &round.members, &asked).unwrap();
        // Equal fields, copied: a changed member is a copy, so only the handle proves it
        // unchanged.
        let copied: Vec<v1::Member> = round
            .members
            .iter()
            .map(|m| v1::Member::from((**m).clone()))
            .collect();
        judge(Judgement::Text, &copied, &asked).unwrap();
        assert_eq!(asked.get(), 2);
        // One fewer member: another round.
        judge(Judgement::Text, &copied[..1], &asked).unwrap();
        assert_eq!(asked.get(), 3);
        let rules = |max: u32, check_distinct: bool| Judgement::Group {
            nodes: 1..=max,
            workers_per_node: 1..=8,
            check_distinct,
        };
        judge(rules(4, true), &copied, &asked).unwrap();
        judge(rules(4, true), &copied, &asked).unwrap();
        assert_eq!(asked.get(), 4);
        judge(rules(8, true), &copied, &asked).unwrap();
        judge(rules(8, false), &copied, &asked).unwrap();
        assert_eq!(
            asked.get(),
            6,
            "another node's rules, or another check, were not asked"
        );
        // Each kind of judgement keeps its own last verdict: the text's is still held.
        judge(Judgement::Text, &copied[..1], &asked).unwrap();
        assert_eq!(asked.get(), 6);
    }

    /// A member changed through its handle is a copy while the memo holds the handle: the
    /// round holding it is judged anew, and a verdict never outlives the fields it judged.
    #[test]
    fn a_member_changed_after_its_judgement_is_judged_again() {
        let asked = Cell::new(0);
        let round = super::round(KEY, &stored(11, &["a", "b"])).unwrap();
        let mut members = round.members.clone();
        judge(Judgement::Text, &members, &asked).unwrap();
        members[1].node_id = "bad".into();
        assert!(judge(Judgement::Text, &members, &asked).is_err());
        assert_eq!(asked.get(), 2);
        drop(round);
        // Even with every other handle gone but the memo's.
        let mut alone = super::round(KEY, &stored(12, &["c", "d"])).unwrap().members;
        judge(Judgement::Text, &alone, &asked).unwrap();
        alone[0].node_id = "bad".into();
        assert!(judge(Judgement::Text, &alone, &asked).is_err());
        assert_eq!(asked.get(), 4);
    }
}

#[test]
fn the_nodes_of_a_thread_share_one_ranked_list_of_a_round() {
    let round = super::round(KEY, &stored(9, &["a", "b", "c"])).unwrap();
    let again = super::round(KEY, &stored(9, &["a", "b", "c"])).unwrap();
    let (first, world) = super::ranked(&round.members).unwrap();
    let (second, _) = super::ranked(&again.members).unwrap();
    assert_eq!(world, 24);
    assert!(std::sync::Arc::ptr_eq(&first, &second), "ranked twice");
    let bases: Vec<u32> = first.iter().map(|m| m.base_rank).collect();
    assert_eq!(bases, [0, 8, 16]);
    // Another round: its own list, with its own ranks.
    let other = super::round(KEY, &stored(10, &["c", "a"])).unwrap();
    let (list, world) = super::ranked(&other.members).unwrap();
    assert_eq!(world, 16);
    assert_eq!(list[0].node_id(), "c");
    assert_eq!(list[1].base_rank, 8);
    assert!(!std::sync::Arc::ptr_eq(&first, &list));
}

/// Members whose worker counts overflow the rank arithmetic: refused every time they are
/// asked for (the second time from the memo) in the words a fresh ranking says.
#[test]
fn a_ranked_refusal_says_what_a_fresh_ranking_says_every_time() {
    let big = |id: &str| {
        v1::Member::from(v1::MemberFields {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: id.into(),
            local_world_size: u32::MAX / 2,
            ..Default::default()
        })
    };
    let members = vec![big("a"), big("b"), big("c")];
    let first = super::ranked(&members).expect_err("ranks past 2^31 - 1");
    let again = super::ranked(&members).expect_err("kept");
    assert_eq!(first, again);
    let mut fresh: Vec<crate::RoundMember> = members.iter().map(crate::RoundMember::from).collect();
    assert_eq!(
        Err(first),
        crate::ranks::rank_members(&mut fresh),
        "the words a fresh ranking says"
    );
}
