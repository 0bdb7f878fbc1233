//! The records of why nodes left: found at their node and incarnation, refused when
//! forged, and never read by the agent loop.

use fsdp_proto::v1;
use prost::Message;

use super::*;

#[test]
fn a_departure_is_found_at_its_node_and_incarnation_and_goes_with_its_delete() {
    let k = keys();
    let mut v = View::default();
    let l = left("n1", 7, v1::LeftKind::Unhealthy);
    let key = k.of(&l);
    assert_eq!(found(&key), (v1::Left::PLACE, left_tail("n1", 7)));
    let at = At {
        create_rev: 4,
        mod_rev: 9,
        lease: 0,
    };
    put(&mut v, &k, &key, &l.encode_to_vec(), at);
    assert_eq!(v.left[&left_tail("n1", 7)].mod_rev, 9);
    assert_eq!(v.left[&left_tail("n1", 7)].record, l);
    delete(&mut v, &k, &key, std::time::Instant::now(), None);
    assert!(v.left.is_empty());
}

/// A forged departure record (one no agent writes: at another node's key, without a
/// kind, with pages of detail) is refused, never shown; and a trusted one changes nothing
/// the group does: it is kept out of the view the agent loop reads.
#[test]
fn a_forged_departure_is_refused_and_none_reaches_the_handle() {
    let k = keys();
    let mut v = View::default();
    let own = left("n1", 7, v1::LeftKind::Lost);
    let forged = [
        // At n2's key, naming n1.
        (
            k.key::<v1::Left>(&left_tail("n2", 7)),
            own.clone(),
            "names node n1",
        ),
        // At its node's key but another registration's.
        (
            k.key::<v1::Left>(&left_tail("n1", 8)),
            own.clone(),
            "names node n1",
        ),
        (
            k.of(&own),
            left("n1", 7, v1::LeftKind::Unspecified),
            "no agent writes",
        ),
        (
            k.of(&own),
            v1::Left {
                kind: 99,
                ..own.clone()
            },
            "no agent writes",
        ),
        (
            k.of(&own),
            v1::Left {
                detail: "x".repeat(LEFT_DETAIL_MAX + 1),
                ..own.clone()
            },
            "at most 500",
        ),
        (
            k.of(&own),
            v1::Left {
                detail: "two\nlines".into(),
                ..own.clone()
            },
            "control character (\\u{a}) in its detail",
        ),
    ];
    for (key, record, why) in forged {
        put(&mut v, &k, &key, &record.encode_to_vec(), At::default());
        assert!(v.left.is_empty(), "{key}: {record:?} was trusted");
        assert_eq!(v.corruption(), None, "refused, not fatal");
        let said = &v.refused[&key];
        assert!(
            said.starts_with(&format!("left record at {key}")) && said.contains(why),
            "{said}"
        );
    }
    put(&mut v, &k, &k.of(&own), &own.encode_to_vec(), At::default());
    assert_eq!(v.left.len(), 1);
    assert!(
        v.for_handle().left.is_empty(),
        "the loop decides nothing from them"
    );
}
