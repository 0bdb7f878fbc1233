//! The halt: obeyed only with a code this node's policy writes, and only from a node of
//! the round it ends or the one before, judged when the round comes.

use fsdp_proto::v1;
use prost::Message;

use super::*;

#[test]
fn a_halt_with_code_0_is_refused_and_never_reaches_the_view() {
    let k = keys();
    let mut v = View::default();
    let h = halt(0);
    put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
    assert!(v.halt.is_none(), "a forged success was obeyed");
    assert_eq!(v.corruption(), None, "refused, not fatal");
    let why = &v.refused[&k.of(&h)];
    assert!(why.contains("exit code 0"), "{why}");
}

#[test]
fn a_halt_is_accepted_only_with_a_code_this_nodes_policy_writes() {
    let k = keys();
    let mut v = View {
        allowed: Allowed {
            halt_codes: Some([3, 78].into()),
            ..Allowed::default()
        },
        ..View::default()
    };
    let h = halt(1);
    put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
    assert!(v.halt.is_none());
    assert!(v.refused[&k.of(&h)].contains("halts with 3, 78"));
    // The same key, now with a code the policy writes: accepted, the refusal gone.
    let h = halt(3);
    put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
    assert_eq!(v.halt.as_ref().map(|h| h.exit_code), Some(3));
    assert!(v.refused.is_empty());
}

/// A forged halt from a node in no round (`evil-node`) ended every agent with its code.
#[test]
fn a_halt_is_obeyed_only_from_a_node_of_the_round_or_the_one_before() {
    let k = keys();
    let round_key = k.key::<v1::Round>("");
    let mut v = View::default();
    let r1 = round(1, vec![member("a", 1), member("b", 1)]);
    put(&mut v, &k, &round_key, &r1.encode_to_vec(), At::default());
    let mut evil = halt(78);
    evil.node_id = "evil-node".into();
    put(
        &mut v,
        &k,
        &k.of(&evil),
        &evil.encode_to_vec(),
        At::default(),
    );
    assert!(v.halt.is_none(), "a halt from outside the round was obeyed");
    assert!(v.refused[&k.of(&evil)].contains("member of neither round 1"));
    // b left; round 2 has a alone: b decided in round 1, its halt stands.
    let r2 = round(2, vec![member("a", 1)]);
    put(&mut v, &k, &round_key, &r2.encode_to_vec(), At::default());
    let mut from_b = halt(78);
    from_b.node_id = "b".into();
    put(
        &mut v,
        &k,
        &k.of(&from_b),
        &from_b.encode_to_vec(),
        At::default(),
    );
    assert_eq!(v.halt.as_ref().map(|h| h.node_id.as_str()), Some("b"));
}

/// A fresh agent reads `ctl/halt` before `ctl/round` (keys come sorted): the halt waits
/// for the round's judgement.
#[test]
fn a_halt_read_before_the_round_is_judged_when_the_round_comes() {
    let k = keys();
    let round_key = k.key::<v1::Round>("");
    for (writer, obeyed) in [("a", true), ("evil-node", false)] {
        let mut v = View::default();
        let mut h = halt(78);
        h.node_id = writer.into();
        put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
        let r = round(1, vec![member("a", 1)]);
        put(&mut v, &k, &round_key, &r.encode_to_vec(), At::default());
        assert_eq!(v.halt.is_some(), obeyed, "{writer}");
        assert_eq!(v.refused.is_empty(), obeyed, "{writer}: {:?}", v.refused);
    }
}

/// Found by the simulator (seed 2183617580): etcd restarted empty, n0's worker exited 3 in
/// round 4 and n0 halted the run, while the coordinator sealed round 5 without it. A node
/// that synced afresh held round 5 alone, refused n0's halt and waited for a round that the
/// halt keeps anyone from sealing. The round names who of the round before it left out,
/// so a node that never held that round judges a halt from them too.
#[test]
fn a_node_holding_only_the_next_round_obeys_a_halt_from_one_it_left_out() {
    use crate::etcd::view::RoundEntry;
    let k = keys();
    let round_key = k.key::<v1::Round>("");
    // The coordinator held round 4 (n0, n1, n3) and seals round 5 without n0.
    let mut coordinator = View::default();
    for id in ["n0", "n1", "n3"] {
        coordinator.members.insert(
            id.into(),
            crate::etcd::view::MemberEntry {
                record: member(id, 1),
                create_rev: 1,
            },
        );
    }
    coordinator.round = Some(RoundEntry {
        record: round(4, ["n0", "n1", "n3"].map(|id| member(id, 1)).into()).into(),
        mod_rev: 40,
    });
    let p = crate::seal::Proposal {
        number: 5,
        members: vec!["n3".into(), "n1".into()],
        restart_count: 0,
    };
    let r5 = crate::etcd::coordinator::round_record(
        &p,
        &coordinator,
        "re-form (lost n0)",
        1_000,
        std::time::Duration::ZERO,
    );
    // Written whole (the store had lost round 4), read by a node that never held round 4.
    for (writer, obeyed) in [("n0", true), ("evil-node", false)] {
        let mut v = View::default();
        put(&mut v, &k, &round_key, &r5.encode_to_vec(), At::default());
        assert!(v.previous_round.is_none());
        let mut h = halt(3);
        h.node_id = writer.into();
        h.round = 4;
        put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
        assert_eq!(v.halt.is_some(), obeyed, "{writer}: {:?}", v.refused);
    }
}
