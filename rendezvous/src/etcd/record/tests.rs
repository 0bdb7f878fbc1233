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

fn halt(code: u32) -> v1::Halt {
    v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "n1".into(),
        exit_code: code,
        ..Default::default()
    }
}

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

fn member(id: &str, local_world_size: u32) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: id.into(),
        addr: "10.0.0.9".into(),
        local_world_size,
        ..Default::default()
    })
}

#[test]
fn a_member_asking_for_more_workers_than_the_run_gives_a_node_is_refused() {
    let k = keys();
    let mut v = View {
        allowed: Allowed {
            workers_per_node: 1..=1,
            ..Allowed::default()
        },
        ..View::default()
    };
    let at = At {
        lease: 9,
        ..At::default()
    };
    let forged = member("forged", 5);
    put(&mut v, &k, &k.of(&forged), &forged.encode_to_vec(), at);
    let fine = member("fine", 1);
    put(&mut v, &k, &k.of(&fine), &fine.encode_to_vec(), at);
    assert_eq!(v.members.keys().collect::<Vec<_>>(), ["fine"]);
    assert!(v.refused[&k.of(&forged)].contains("local_world_size 5"));
    assert_eq!(v.corruption(), None);
}

#[test]
fn a_member_without_a_lease_is_refused_not_fatal() {
    let k = keys();
    let mut v = View::default();
    let ghost = member("ghost", 1);
    put(
        &mut v,
        &k,
        &k.of(&ghost),
        &ghost.encode_to_vec(),
        At::default(),
    );
    assert!(v.members.is_empty());
    assert_eq!(v.corruption(), None);
    assert!(v.refused[&k.of(&ghost)].contains("not bound to a lease"));
}

fn round(number: u64, members: Vec<v1::Member>) -> v1::Round {
    v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number,
        members,
        ..Default::default()
    }
}

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

fn left(node: &str, incarnation: u64, kind: v1::LeftKind) -> v1::Left {
    v1::Left {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: node.into(),
        incarnation,
        kind: kind.into(),
        detail: "health check failed 3 time(s) in a row: GPU 3 (exit code 79)".into(),
        ..Default::default()
    }
}

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

/// The loaded suite's finding: node a's worker failed first, but a busy agent wrote its
/// report after b's — whose worker failed only because a's cut its collective. The exit
/// times decide, not the order of arrival; reports without one fall back to that order.
#[test]
fn the_first_fault_is_the_earliest_exit_not_the_first_report() {
    let k = keys();
    let report = |v: &mut View, node: &str, exited_ms: u64, rev: i64| {
        let fault = v1::Fault {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: 4,
            node_id: node.into(),
            exit: "exit code 1".into(),
            exited_ms,
        };
        let at = At {
            create_rev: rev,
            mod_rev: rev,
            lease: 0,
        };
        put(v, &k, &k.of(&fault), &fault.encode_to_vec(), at);
    };
    let mut v = View::default();
    report(&mut v, "b", 1_700_000_000_250, 10);
    report(&mut v, "a", 1_700_000_000_100, 11);
    assert_eq!(v.first_fault(4).as_deref(), Some("a"));
    assert_eq!(v.first_fault(5), None);

    let mut old = View::default();
    report(&mut old, "b", 1_700_000_000_250, 10);
    report(&mut old, "a", 0, 11);
    assert_eq!(old.first_fault(4).as_deref(), Some("b"));
}

// ---- every record kind has its rule (issue 55) ----

fn quarantine(until_ms: u64) -> v1::Quarantine {
    v1::Quarantine {
        schema: fsdp_proto::SCHEMA_VERSION,
        machine: "host-7".into(),
        node_id: "n1".into(),
        reason: "failed 3 rounds in a row".into(),
        until_ms,
    }
}

/// One put of `ctl/quarantine/<machine>` with `until_ms = u64::MAX` kept every agent on
/// that machine out for ever, even with `--quarantine-after 0`.
#[test]
fn a_quarantine_is_obeyed_only_as_this_nodes_own_policy_would_write_it() {
    let k = keys();
    let now = crate::unix_ms();
    let hour = Some(std::time::Duration::from_secs(3600));
    let judged = |quarantine_for, q: &v1::Quarantine| {
        let mut v = View {
            allowed: Allowed {
                quarantine_for,
                ..Allowed::default()
            },
            ..View::default()
        };
        put(&mut v, &k, &k.of(q), &q.encode_to_vec(), At::default());
        (
            v.quarantine.contains_key("host-7"),
            v.refused.get(&k.of(q)).cloned(),
        )
    };
    let forever = quarantine(u64::MAX);
    let (obeyed, why) = judged(hour, &forever);
    assert!(!obeyed, "a quarantine for ever was obeyed");
    assert!(
        why.unwrap()
            .contains("longer than --quarantine-for (3600 s)")
    );
    let fair = quarantine(now + 3_000_000);
    assert!(
        judged(hour, &fair).0,
        "a quarantine within the policy's bound"
    );
    let (obeyed, why) = judged(None, &fair);
    assert!(!obeyed, "obeyed with --quarantine-after 0");
    assert!(why.unwrap().contains("--quarantine-after 0"));
    // At another machine's key: it would keep that one out.
    let mut elsewhere = fair.clone();
    elsewhere.machine = "host-8".into();
    let mut v = View::default();
    put(
        &mut v,
        &k,
        &k.of(&fair),
        &elsewhere.encode_to_vec(),
        At::default(),
    );
    assert!(v.quarantine.is_empty());
    assert!(v.refused[&k.of(&fair)].contains("not at its own key"));
}

/// The same forged quarantine was logged as refused twice when the store was read again a
/// second later: the reason named the seconds "from now", so it was a new reason each second
/// and the once-per-reason log repeated it (CI, `forged_records`).
#[test]
fn a_refused_quarantine_reads_the_same_whenever_it_is_judged() {
    let allowed = Allowed {
        quarantine_for: Some(std::time::Duration::from_secs(3600)),
        ..Allowed::default()
    };
    let forever = quarantine(u64::MAX);
    let now = crate::unix_ms();
    let first = allowed.quarantine(&forever, now).unwrap_err();
    let later = allowed.quarantine(&forever, now + 1_500).unwrap_err();
    assert_eq!(first, later);
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
