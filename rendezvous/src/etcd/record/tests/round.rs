//! The round: refused when larger than the run allows, shared between the views of one
//! process, and the next seal fenced on a refused one.

use fsdp_proto::v1;
use prost::Message;

use super::*;

#[test]
fn a_round_larger_than_the_run_allows_is_refused_and_the_old_round_stands() {
    let k = keys();
    let mut v = View {
        allowed: Allowed {
            nodes: 1..=2,
            workers_per_node: 1..=1,
            ..Allowed::default()
        },
        ..View::default()
    };
    let key = k.key::<v1::Round>("");
    let good = round(1, vec![member("a", 1), member("b", 1)]);
    put(&mut v, &k, &key, &good.encode_to_vec(), At::default());
    let three = round(2, vec![member("a", 1), member("b", 1), member("c", 1)]);
    put(&mut v, &k, &key, &three.encode_to_vec(), At::default());
    assert!(v.refused[&key].contains("has 3 nodes, outside 1..=2"));
    let seven = round(3, vec![member("a", 1), member("b", 5)]);
    put(&mut v, &k, &key, &seven.encode_to_vec(), At::default());
    assert!(
        v.refused[&key].contains("gives node b a count"),
        "{:?}",
        v.refused
    );
    assert_eq!(v.round.as_ref().map(|r| r.record.number), Some(1));
}

/// Nodes simulated in one process (`rdzv-bench`) each take the same round: they hold one
/// decode of it between them, not a copy each, and each still judges it by its own run.
#[test]
fn views_in_one_process_share_the_round_they_take_and_each_still_judges_it() {
    let k = keys();
    let key = k.key::<v1::Round>("");
    let sealed = round(1, vec![member("a", 1), member("b", 1), member("c", 1)]);
    let bytes = sealed.encode_to_vec();
    let taken: Vec<View> = (0..2)
        .map(|_| {
            let mut v = View::default();
            put(&mut v, &k, &key, &bytes, At::default());
            v
        })
        .collect();
    let held = |v: &View| v.round.as_ref().expect("the round is taken").record.clone();
    let (one, other) = (held(&taken[0]), held(&taken[1]));
    assert_eq!(*one, sealed);
    for (x, y) in one.members.iter().zip(&other.members) {
        assert!(v1::Member::same(x, y), "node {} was copied", x.node_id);
    }
    let mut smaller = View {
        allowed: Allowed {
            nodes: 1..=2,
            ..Allowed::default()
        },
        ..View::default()
    };
    put(&mut smaller, &k, &key, &bytes, At::default());
    assert!(smaller.round.is_none());
    assert!(smaller.refused[&key].contains("has 3 nodes, outside 1..=2"));
}

#[test]
fn the_next_seal_is_fenced_on_a_refused_round_so_that_it_replaces_it() {
    let k = keys();
    let mut v = View {
        allowed: Allowed {
            nodes: 1..=1,
            ..Allowed::default()
        },
        ..View::default()
    };
    let key = k.key::<v1::Round>("");
    let at = |rev| At {
        mod_rev: rev,
        ..At::default()
    };
    put(
        &mut v,
        &k,
        &key,
        &round(1, vec![member("a", 1)]).encode_to_vec(),
        at(10),
    );
    assert_eq!(v.round_fence(), Some(10));
    let forged = round(2, vec![member("a", 1), member("x", 1)]);
    put(&mut v, &k, &key, &forged.encode_to_vec(), at(12));
    assert_eq!(
        v.round.as_ref().map(|r| r.mod_rev),
        Some(10),
        "the old round stands"
    );
    assert_eq!(v.round_fence(), Some(12), "but the key has moved on");
    put(
        &mut v,
        &k,
        &key,
        &round(3, vec![member("a", 1)]).encode_to_vec(),
        at(13),
    );
    assert_eq!(v.round_fence(), Some(13));
}
