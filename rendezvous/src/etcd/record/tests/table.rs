//! The table of declarations: unambiguous, each record found again at its own key and
//! written as its mode says; what fails a check, or lies where no record does, refused.

use fsdp_proto::v1;
use prost::Message;

use super::*;

#[test]
fn no_place_lies_inside_another() {
    for (i, a) in DECLARED.iter().enumerate() {
        for b in &DECLARED[i + 1..] {
            let (pa, pb) = (a.place.path(), b.place.path());
            assert!(
                !pa.starts_with(pb) && !pb.starts_with(pa),
                "{pa} and {pb}: a key could be either record"
            );
        }
    }
}

#[test]
fn every_record_is_found_at_its_own_key() {
    let k = keys();
    let member = v1::Member::from(v1::MemberFields {
        node_id: "n1".into(),
        ..Default::default()
    });
    let fault = v1::Fault {
        round: 3,
        node_id: "n1".into(),
        ..Default::default()
    };
    let quarantine = v1::Quarantine {
        machine: "host-7".into(),
        ..Default::default()
    };
    let failure = v1::Failure {
        round: 3,
        ..Default::default()
    };
    let halt = v1::Halt::default();
    assert_eq!(found(&k.of(&member)), (v1::Member::PLACE, "n1".into()));
    assert_eq!(found(&k.of(&fault)), (v1::Fault::PLACE, per_round(3, "n1")));
    assert_eq!(
        found(&k.of(&quarantine)),
        (v1::Quarantine::PLACE, "host-7".into())
    );
    assert_eq!(found(&k.of(&failure)).0, v1::Failure::PLACE);
    assert_eq!(found(&k.of(&halt)), (v1::Halt::PLACE, String::new()));
    assert!(find(&k, "/fsdp/r/ctl/roundabout").is_none());
    assert!(find(&k, "/fsdp/other/ctl/round").is_none());
}

#[test]
fn a_put_then_a_delete_of_each_removable_record_leaves_the_view_as_it_was() {
    let k = keys();
    let mut v = View::default();
    let at = At {
        create_rev: 1,
        mod_rev: 1,
        lease: 7,
    };
    let halt = v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "n1".into(),
        exit_code: 3,
        ..Default::default()
    };
    let unhealthy = v1::Unhealthy {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "n1".into(),
        ..Default::default()
    };
    let o = Outgoing::of(&k, &halt);
    put(&mut v, &k, &o.key, &o.value, at);
    put(
        &mut v,
        &k,
        &k.of(&unhealthy),
        &unhealthy.encode_to_vec(),
        at,
    );
    assert!(v.halt.is_some() && v.unhealthy.contains_key("n1"));
    assert_eq!(v.corruption(), None);
    let now = Instant::now();
    delete(&mut v, &k, &k.of(&halt), now, None);
    delete(&mut v, &k, &k.of(&unhealthy), now, None);
    assert!(v.halt.is_none() && v.unhealthy.is_empty());
}

#[test]
fn a_record_that_fails_its_check_is_refused_with_its_kind_and_key() {
    let k = keys();
    let mut v = View::default();
    let master = v1::Master {
        schema: fsdp_proto::SCHEMA_VERSION,
        addr: "10.0.0.1".into(),
        port: 0,
        ..Default::default()
    };
    let key = k.of(&master);
    put(&mut v, &k, &key, &master.encode_to_vec(), At::default());
    let why = &v.refused[&key];
    assert!(
        why.starts_with(&format!("master record at {key} has address")),
        "{why}"
    );
    assert!(v.master.is_none() && v.corruption().is_none());
    // A good value at the same key clears it.
    let good = v1::Master {
        port: 29_500,
        ..master
    };
    put(&mut v, &k, &key, &good.encode_to_vec(), At::default());
    assert!(v.refused.is_empty());
    assert_eq!(v.master.map(|m| m.port), Some(29_500));
}

#[test]
fn writes_follow_the_declared_mode() {
    let k = keys();
    let done = v1::Done {
        round: 2,
        node_id: "n1".into(),
        ..Default::default()
    };
    let gone = v1::Noticed {
        round: 2,
        node_id: "n1".into(),
        ..Default::default()
    };
    let master = v1::Master::default();
    assert_eq!(Outgoing::of(&k, &done).mode, Mode::Put);
    assert_eq!(Outgoing::of(&k, &master).mode, Mode::Leased);
    assert_eq!(
        Outgoing::of(&k, &gone).mode,
        Mode::FirstWord { unless: &[] }
    );
    let failure = Outgoing::of(&k, &v1::Failure::default());
    assert_eq!(
        failure.mode,
        Mode::FirstWord {
            unless: &[v1::Halt::PLACE]
        }
    );
    assert_eq!(failure.writing, "reporting a worker failure");
}

#[test]
fn an_unexpected_key_is_refused_and_garbage_is_still_a_clear_error() {
    let k = keys();
    let mut v = View::default();
    put(&mut v, &k, "/fsdp/r/ctl/surprise", b"x", At::default());
    assert_eq!(v.corruption(), None);
    assert!(v.refused.contains_key("/fsdp/r/ctl/surprise"));
    let key = k.key::<v1::Round>("");
    put(&mut v, &k, &key, b"\xde\xad not a protobuf", At::default());
    assert!(v.corruption().is_some_and(|c| c.contains(&key)));
}

/// Text from the store reaches terminals: ESC, a newline or a megabyte is refused.
#[test]
fn text_fields_with_control_characters_or_past_their_length_are_refused() {
    let k = keys();
    let mut l = left("n1", 1, v1::LeftKind::Left);
    l.detail = "\u{1b}]0;owned\u{7}".into();
    let mut v = View::default();
    put(&mut v, &k, &k.of(&l), &l.encode_to_vec(), At::default());
    assert!(v.left.is_empty());
    assert!(v.refused[&k.of(&l)].contains("control character"));
    let mut l = left("n1", 2, v1::LeftKind::Left);
    l.addr = "10.0.0.1\nhealth healthy".into();
    put(&mut v, &k, &k.of(&l), &l.encode_to_vec(), At::default());
    assert!(v.refused[&k.of(&l)].contains("in its address"));
    let mut h = halt(3);
    h.reason = "x".repeat(10_000);
    let mut v = View::default();
    put(&mut v, &k, &k.of(&h), &h.encode_to_vec(), At::default());
    assert!(v.halt.is_none());
    assert!(v.refused[&k.of(&h)].contains("reason of 10000 characters"));
    // The refusal names the key as it is, shown escaped (the log line prints it).
    let mut m = member("n\u{1b}[2J", 1);
    m.addr = "a".into();
    let at = At {
        lease: 9,
        ..At::default()
    };
    let key = k.of(&m);
    put(&mut v, &k, &key, &m.encode_to_vec(), at);
    assert!(v.members.is_empty());
    assert!(v.refused[&key].contains("control character"));
    // A segment orders ranks and is shown: bounded, one line.
    let mut m = member("n2", 1);
    m.segment = format!("zone/{}", "r".repeat(300));
    let key = k.of(&m);
    put(&mut v, &k, &key, &m.encode_to_vec(), at);
    assert!(
        v.refused[&key].contains("segment of 305 characters"),
        "{:?}",
        v.refused
    );
    m.segment = "zone/rack\u{1b}[2J".into();
    let mut v = View::default();
    put(&mut v, &k, &key, &m.encode_to_vec(), at);
    assert!(
        v.refused[&key].contains("in its segment"),
        "{:?}",
        v.refused
    );
}

/// A record at another's key stands for that other: refused.
#[test]
fn a_record_at_another_records_key_is_refused() {
    let k = keys();
    let done = v1::Done {
        schema: fsdp_proto::SCHEMA_VERSION,
        round: 3,
        node_id: "a".into(),
    };
    let b_key = k.key::<v1::Done>(&per_round(3, "b"));
    let mut v = View::default();
    put(&mut v, &k, &b_key, &done.encode_to_vec(), At::default());
    assert!(v.done.is_empty());
    assert!(v.refused[&b_key].contains("not at its own key"));
}
