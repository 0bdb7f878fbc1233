//! The table of declarations: unambiguous, and each record found again at its own key.

use fsdp_proto::v1;
use prost::Message;

use super::*;

fn keys() -> Keys {
    Keys::new("/fsdp", "r").unwrap()
}

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

/// Where `key` is found, as the place of its declaration and its tail.
fn found(key: &str) -> (Place, String) {
    let (d, tail) = find(&keys(), key).unwrap_or_else(|| panic!("{key} is no record's"));
    (d.place, tail.to_owned())
}

#[test]
fn every_record_is_found_at_its_own_key() {
    let k = keys();
    let member = v1::Member {
        node_id: "n1".into(),
        ..Default::default()
    };
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
fn a_record_that_fails_its_check_is_held_corrupt_with_its_kind_and_key() {
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
    let why = v.corruption().unwrap();
    assert!(
        why.starts_with(&format!("master record at {key} has address")),
        "{why}"
    );
    // A good value at the same key clears it.
    let good = v1::Master {
        port: 29_500,
        ..master
    };
    put(&mut v, &k, &key, &good.encode_to_vec(), At::default());
    assert_eq!(v.corruption(), None);
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
    let gone = v1::Gone {
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
