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
