use std::time::{Duration, Instant};

use fsdp_proto::etcdserverpb as pb;
use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;

use super::{Replay, State, StoreError, WatchSpec};

fn put(key: &str, value: &str, lease: i64) -> pb::PutRequest {
    pb::PutRequest {
        key: key.into(),
        value: value.into(),
        lease,
        ..Default::default()
    }
}

fn get(s: &State, key: &str) -> Option<pb::KeyValue> {
    let r = pb::RangeRequest {
        key: key.into(),
        ..Default::default()
    };
    s.range(&r).unwrap().kvs.into_iter().next()
}

/// The range etcd clients send for "every key under `prefix`".
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    end
}

fn version_is(key: &str, version: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Version as i32,
        key: key.into(),
        target_union: Some(TargetUnion::Version(version)),
        range_end: Vec::new(),
    }
}

fn op(p: pb::PutRequest) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(Request::RequestPut(p)),
    }
}

#[test]
fn each_write_is_one_revision_and_a_key_counts_its_versions() {
    let mut s = State::new();
    let first = s.revision();
    s.put(put("/a", "1", 0)).unwrap();
    s.put(put("/a", "2", 0)).unwrap();
    let a = get(&s, "/a").unwrap();
    assert_eq!(s.revision(), first + 2);
    assert_eq!(
        (a.create_revision, a.mod_revision, a.version),
        (first + 1, first + 2, 2)
    );
    assert_eq!(a.value, b"2");
    // Deleting nothing writes nothing.
    s.delete_range(&pb::DeleteRangeRequest {
        key: "/missing".into(),
        ..Default::default()
    });
    assert_eq!(s.revision(), first + 2);
    // A key created again starts over.
    s.delete_range(&pb::DeleteRangeRequest {
        key: "/a".into(),
        ..Default::default()
    });
    s.put(put("/a", "3", 0)).unwrap();
    let a = get(&s, "/a").unwrap();
    assert_eq!((a.create_revision, a.version), (first + 4, 1));
}

#[test]
fn a_transaction_commits_on_its_comparisons_in_one_revision() {
    let mut s = State::new();
    let claim = |s: &mut State, v: &str| {
        s.txn(pb::TxnRequest {
            compare: vec![version_is("/coord", 0)],
            success: vec![op(put("/coord", v, 0)), op(put("/round", v, 0))],
            failure: vec![],
        })
        .unwrap()
        .succeeded
    };
    let before = s.revision();
    assert!(claim(&mut s, "a"), "a missing key has version 0");
    assert_eq!(s.revision(), before + 1, "both writes share one revision");
    assert_eq!(get(&s, "/round").unwrap().mod_revision, before + 1);
    assert!(!claim(&mut s, "b"), "the second claim is fenced out");
    assert_eq!(get(&s, "/coord").unwrap().value, b"a");
    assert_eq!(
        s.revision(),
        before + 1,
        "a failed comparison writes nothing"
    );
}

#[test]
fn a_missing_key_compares_as_zeros_but_never_equals_a_value() {
    let mut s = State::new();
    let value_is = |v: &str| pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Value as i32,
        key: "/k".into(),
        target_union: Some(TargetUnion::Value(v.into())),
        range_end: Vec::new(),
    };
    let holds = |s: &mut State, c: pb::Compare| {
        s.txn(pb::TxnRequest {
            compare: vec![c],
            ..Default::default()
        })
        .unwrap()
        .succeeded
    };
    assert!(!holds(&mut s, value_is("")));
    let mod_is_zero = pb::Compare {
        target: CompareTarget::Mod as i32,
        target_union: Some(TargetUnion::ModRevision(0)),
        ..value_is("")
    };
    assert!(holds(&mut s, mod_is_zero));
    s.put(put("/k", "v", 0)).unwrap();
    assert!(holds(&mut s, value_is("v")));
    let greater = pb::Compare {
        result: CompareResult::Greater as i32,
        target: CompareTarget::Mod as i32,
        target_union: Some(TargetUnion::ModRevision(0)),
        ..value_is("")
    };
    assert!(holds(&mut s, greater));
}

#[test]
fn a_lease_takes_its_keys_with_it_when_revoked_or_lapsed() {
    let mut s = State::new();
    let t0 = Instant::now();
    let (a, ttl) = s.grant(2, 0, t0).unwrap();
    assert_eq!(ttl, 2);
    let (b, _) = s.grant(2, 0, t0).unwrap();
    assert_ne!(a, b);
    s.put(put("/m/a1", "x", a)).unwrap();
    s.put(put("/m/a2", "x", a)).unwrap();
    s.put(put("/m/b", "x", b)).unwrap();
    let before = s.revision();
    s.revoke(a).unwrap();
    assert_eq!(s.revision(), before + 1, "one revision for all of its keys");
    assert!(get(&s, "/m/a1").is_none() && get(&s, "/m/a2").is_none());
    assert_eq!(s.revoke(a), Err(StoreError::LeaseNotFound));

    // b is kept alive once, then lapses a TTL after the keep-alive.
    assert!(s.expire(t0 + Duration::from_millis(1500)).is_empty());
    assert_eq!(s.keep_alive(b, t0 + Duration::from_millis(1500)), Some(2));
    assert!(s.expire(t0 + Duration::from_millis(3000)).is_empty());
    assert_eq!(
        s.time_to_live(b, t0 + Duration::from_millis(3000))
            .unwrap()
            .0,
        0
    );
    assert_eq!(s.expire(t0 + Duration::from_millis(3500)), vec![b]);
    assert!(get(&s, "/m/b").is_none());
    assert_eq!(s.keep_alive(b, t0 + Duration::from_secs(4)), None);
    assert_eq!(s.leases(), 0);
}

#[test]
fn a_write_under_a_missing_lease_is_refused_whole() {
    let mut s = State::new();
    assert_eq!(s.put(put("/k", "v", 42)), Err(StoreError::LeaseNotFound));
    let before = s.revision();
    let refused = s.txn(pb::TxnRequest {
        compare: vec![],
        success: vec![op(put("/first", "v", 0)), op(put("/second", "v", 42))],
        failure: vec![],
    });
    assert_eq!(refused, Err(StoreError::LeaseNotFound));
    assert!(
        get(&s, "/first").is_none(),
        "nothing of a refused transaction is written"
    );
    assert_eq!(s.revision(), before);
    // A key moved to another lease leaves the first.
    let (a, _) = s.grant(5, 0, Instant::now()).unwrap();
    let (b, _) = s.grant(5, 0, Instant::now()).unwrap();
    s.put(put("/k", "v", a)).unwrap();
    s.put(put("/k", "v", b)).unwrap();
    s.revoke(a).unwrap();
    assert!(get(&s, "/k").is_some());
    assert_eq!(s.grant(5, b, Instant::now()), Err(StoreError::LeaseExists));
}

#[test]
fn ranges_read_prefixes_counts_and_keys_only() {
    let mut s = State::new();
    for k in ["/r/a", "/r/b", "/r/c", "/s/a"] {
        s.put(put(k, "value", 0)).unwrap();
    }
    let mut r = pb::RangeRequest {
        key: "/r/".into(),
        range_end: prefix_end("/r/"),
        ..Default::default()
    };
    let all = s.range(&r).unwrap();
    assert_eq!(all.count, 3);
    assert_eq!(all.kvs.len(), 3);
    r.limit = 2;
    let some = s.range(&r).unwrap();
    assert_eq!((some.kvs.len(), some.more, some.count), (2, true, 3));
    r.limit = 0;
    r.keys_only = true;
    assert!(
        s.range(&r)
            .unwrap()
            .kvs
            .iter()
            .all(|kv| kv.value.is_empty())
    );
    r.count_only = true;
    let counted = s.range(&r).unwrap();
    assert_eq!((counted.kvs.len(), counted.count), (0, 3));
    let from = pb::RangeRequest {
        key: "/r/b".into(),
        range_end: vec![0],
        ..Default::default()
    };
    assert_eq!(s.range(&from).unwrap().count, 3, "every key from /r/b on");
}

#[test]
fn a_watch_replays_from_its_start_with_its_filters() {
    let mut s = State::new();
    let (lease, _) = s.grant(5, 0, Instant::now()).unwrap();
    s.put(put("/m/a", "1", lease)).unwrap();
    let start = s.revision() + 1;
    s.put(put("/m/b", "1", 0)).unwrap();
    s.put(put("/other", "1", 0)).unwrap();
    s.revoke(lease).unwrap();
    let mut w = WatchSpec {
        key: "/m/".into(),
        range_end: prefix_end("/m/"),
        ..Default::default()
    };
    let Replay::Events(all) = s.replay(start, &w) else {
        panic!("compacted")
    };
    let kinds: Vec<(i32, &[u8])> = all
        .iter()
        .map(|e| (e.r#type, &e.kv.as_ref().unwrap().key[..]))
        .collect();
    assert_eq!(kinds, vec![(0, &b"/m/b"[..]), (1, &b"/m/a"[..])]);
    assert!(
        all.iter().all(|e| e.prev_kv.is_none()),
        "prev_kv only on request"
    );
    w.no_put = true;
    w.prev_kv = true;
    let Replay::Events(deletes) = s.replay(start, &w) else {
        panic!("compacted")
    };
    assert_eq!(deletes.len(), 1);
    assert_eq!(deletes[0].prev_kv.as_ref().unwrap().lease, lease);
    let Replay::Events(none) = s.replay(s.revision() + 1, &w) else {
        panic!("compacted")
    };
    assert!(none.is_empty());
}

/// A c10d store restarted in place once handed out lease 1 again, and a survivor's
/// ring watcher, revoking the dead host's lease 1, revoked the restarted host's new one.
#[test]
fn a_store_restarted_later_never_hands_out_an_id_it_handed_out_before() {
    use super::first_lease_id;
    let now = Instant::now();
    let start = 1_795_000_000_000u64;
    let mut before = State::with_first_lease(first_lease_id(start));
    let mut ids = Vec::new();
    for _ in 0..1000 {
        ids.push(before.grant(3, 0, now).unwrap().0);
    }
    // Restarted one millisecond later (and an hour later): every id is new.
    for later in [start + 1, start + 3_600_000] {
        let mut after = State::with_first_lease(first_lease_id(later));
        let id = after.grant(3, 0, now).unwrap().0;
        assert!(id > *ids.last().unwrap(), "{id} reuses an id below {ids:?}");
    }
    assert!(ids.iter().all(|id| *id > 0));
    assert!(first_lease_id(u64::MAX) > 0);
}

/// Every number a `LeaseGrant`, `LeaseKeepAlive` or `LeaseTimeToLive` can bring, at the
/// edges of its type: nothing panics (the tests run with overflow checks), and what is out
/// of bounds is refused in etcd's words. `ttl = i64::MAX` panicked in the host agent on
/// every such request; `id = i64::MAX` wrapped the next id to negative.
#[test]
fn no_request_number_overflows_the_store() {
    let edges = [
        i64::MIN,
        i64::MIN + 1,
        -1,
        0,
        1,
        super::MAX_TTL,
        super::MAX_TTL + 1,
        i64::MAX - 1,
        i64::MAX,
    ];
    let now = Instant::now();
    for serving in [false, true] {
        let mut s = if serving {
            State::serving()
        } else {
            State::new()
        };
        for ttl in edges {
            for id in edges {
                match s.grant(ttl, id, now) {
                    Ok((granted, t)) => {
                        assert!(granted > 0, "ttl {ttl} id {id}: id {granted}");
                        assert!((1..=super::MAX_TTL).contains(&t), "ttl {ttl}: {t}");
                        assert_eq!(s.keep_alive(granted, now), Some(t));
                        assert!(s.time_to_live(granted, now).is_some());
                        s.revoke(granted).unwrap();
                    }
                    Err(e) => {
                        let expected = if ttl > super::MAX_TTL {
                            StoreError::TtlTooLarge
                        } else {
                            StoreError::BadLeaseId
                        };
                        assert_eq!(e, expected, "ttl {ttl} id {id}");
                    }
                }
                assert_eq!(s.keep_alive(id, now), None);
                assert!(s.time_to_live(id, now).is_none());
            }
        }
        // After a grant at i64::MAX the next id is still positive.
        s.grant(5, i64::MAX, now).unwrap();
        let (next, _) = s.grant(5, 0, now).unwrap();
        assert!(next > 0, "{next}");
        s.expire(now + Duration::from_secs(u64::from(u32::MAX)));
    }
}

#[test]
fn the_store_holds_a_bounded_number_of_leases() {
    let now = Instant::now();
    let mut s = State::new();
    for _ in 0..super::MAX_LEASES {
        s.grant(5, 0, now).unwrap();
    }
    assert_eq!(s.grant(5, 0, now), Err(StoreError::TooManyLeases));
    assert_eq!(
        s.expire(now + Duration::from_secs(6)).len(),
        super::MAX_LEASES
    );
    assert!(s.grant(5, 0, now).is_ok(), "room again once they lapsed");
}

/// A serving store's ids are not derivable from its start time or from each other.
#[test]
fn a_serving_store_draws_its_lease_ids_at_random() {
    let now = Instant::now();
    let mut s = State::serving();
    let ids: Vec<i64> = (0..64).map(|_| s.grant(5, 0, now).unwrap().0).collect();
    assert!(ids.iter().all(|id| *id > 0));
    let consecutive = ids.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert_eq!(consecutive, 0, "{ids:?}");
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len());
}
