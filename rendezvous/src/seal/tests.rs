use super::*;

const S: Duration = Duration::from_secs(1);

fn cfg(min: u32, max: u32) -> SealConfig {
    SealConfig {
        min_nodes: min,
        max_nodes: max,
        last_call: 30 * S,
        straggler_timeout: 10 * S,
        segment_size: 1,
    }
}

fn cand(id: &str, rev: i64, ready: bool) -> Candidate {
    Candidate {
        node_id: id.into(),
        joined_rev: rev,
        ready,
        segment: String::new(),
    }
}

fn current(members: &[&str], failed: bool) -> Current {
    Current {
        number: 4,
        members: members.iter().map(|s| s.to_string()).collect(),
        restart_count: 1,
        failed,
        departed: false,
        finished: BTreeSet::new(),
    }
}

fn seal(d: (SealDecision, String)) -> Proposal {
    match d.0 {
        SealDecision::Seal(p) => p,
        other => panic!("expected a seal, got {other:?} ({})", d.1),
    }
}

#[test]
fn first_round_seals_at_once_at_max_in_join_order() {
    let t = Instant::now();
    let c = [
        cand("c", 30, true),
        cand("a", 10, true),
        cand("b", 20, true),
    ];
    let s = SealState {
        current: None,
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let p = seal(decide(t, &s, &cfg(2, 3)));
    assert_eq!(p.members, ["a", "b", "c"]);
    assert_eq!((p.number, p.restart_count), (0, 0));
}

#[test]
fn first_round_between_min_and_max_waits_for_the_last_call() {
    let t = Instant::now();
    let c = [cand("a", 1, true), cand("b", 2, true)];
    let s = SealState {
        current: None,
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let (d, why) = decide(t + 5 * S, &s, &cfg(2, 4));
    assert_eq!(
        d,
        SealDecision::Wait {
            recheck_at: Some(t + 30 * S)
        },
        "{why}"
    );
    assert!(why.contains("last call"), "{why}");
    let p = seal(decide(t + 30 * S, &s, &cfg(2, 4)));
    assert_eq!(p.members, ["a", "b"]);
}

#[test]
fn below_min_waits_without_a_deadline() {
    let t = Instant::now();
    let c = [cand("a", 1, true)];
    let s = SealState {
        current: None,
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let (d, why) = decide(t + 100 * S, &s, &cfg(2, 4));
    assert_eq!(d, SealDecision::Wait { recheck_at: None });
    assert!(why.contains("1 of min 2"), "{why}");
}

#[test]
fn an_intact_round_stays() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [cand("a", 1, false), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    assert_eq!(
        decide(t, &s, &cfg(1, 2)).0,
        SealDecision::Wait { recheck_at: None }
    );
}

/// A loss re-forms at once with every survivor still registered, whether or not it said
/// anything since: survivors write nothing, so a re-form of N nodes is one write (at
/// 1,000 nodes, waiting for 999 registrations put etcd behind and the group collapsed).
#[test]
fn a_lost_member_reforms_at_once_with_the_survivors_still_registered() {
    let t = Instant::now();
    let cur = current(&["b", "a", "c"], false);
    // c is gone; neither a nor b wrote anything since.
    let c = [cand("a", 1, false), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(1, 3));
    let SealDecision::Seal(p) = d else {
        panic!("a loss must not wait for the survivors: {why}")
    };
    assert!(why.contains("lost c"), "{why}");
    // Survivors keep their relative order (b before a), the number advances, and the
    // failure budget is untouched.
    assert_eq!(p.members, ["b", "a"]);
    assert_eq!((p.number, p.restart_count), (5, 1));
}

/// A failure with a loss already seen is not charged, so nothing is gained by waiting for
/// the survivors to say they stopped; and a survivor that judged the loss alone (before
/// the failure report reached it) writes nothing, so waiting would cost it the straggler
/// timeout.
#[test]
fn a_failure_beside_a_loss_does_not_wait_for_survivors() {
    let t = Instant::now();
    let cur = current(&["a", "b", "c"], true);
    let c = [cand("a", 1, true), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!(
        (p.members.clone(), p.restart_count),
        (vec!["a".to_owned(), "b".to_owned()], 1)
    );
}

/// A member that went and registered again (a new incarnation) is present by name, yet its
/// departure was seen: survivors that judged the loss wrote nothing, so a failure then
/// reported must not make the round wait for them (found by the simulator, seed 222: a
/// cut node's failure report arrived after it rejoined, and the survivor waited for ever).
#[test]
fn a_failure_after_a_member_went_and_came_back_does_not_wait_for_survivors() {
    let t = Instant::now();
    let mut cur = current(&["a", "b"], true);
    cur.departed = true;
    let c = [cand("a", 1, false), cand("b", 2, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(2, 3)));
    assert_eq!(p.members, ["a", "b"]);
}

#[test]
fn after_a_failure_the_round_waits_for_survivors_to_stop_their_workers() {
    let t = Instant::now();
    let cur = current(&["b", "a"], true);
    let c = [cand("a", 1, false), cand("b", 2, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(1, 3));
    assert!(matches!(d, SealDecision::Reforming { .. }), "{why}");
    assert!(why.contains("waiting for a"), "{why}");
    let c = [cand("a", 1, true), cand("b", 2, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!(p.members, ["b", "a"]);
    assert_eq!((p.number, p.restart_count), (5, 2));
}

#[test]
fn a_straggler_is_left_out_after_the_timeout() {
    let t = Instant::now();
    let cur = current(&["a", "b"], true);
    let c = [cand("a", 1, true), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t + 10 * S, &s, &cfg(1, 3)));
    assert_eq!(p.members, ["a"]);
}

#[test]
fn a_failure_is_charged_only_without_a_lost_member() {
    let t = Instant::now();
    let c = [cand("a", 1, true), cand("b", 2, true)];
    let cur = current(&["a", "b"], true);
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!((p.members.len(), p.restart_count), (2, 2));

    let cur = current(&["a", "b", "gone"], true);
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(1, 3));
    let SealDecision::Seal(p) = d else {
        panic!("{why}")
    };
    assert_eq!(p.restart_count, 1, "a peer's death is not charged: {why}");
}

/// The reason is stored in the round record and shown by status while the round runs:
/// once sealed, the nodes that were waiting are members, and the reason says they were
/// admitted, not that they wait (status showed "1 node(s) waiting to join" beside three
/// running members). Only the nodes the round has room for count.
#[test]
fn a_sealed_growth_says_the_waiting_nodes_were_admitted() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [
        cand("a", 1, true),
        cand("b", 2, true),
        cand("n", 8, true),
        cand("o", 9, true),
    ];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(1, 3));
    assert_eq!(seal((d, why.clone())).members, ["a", "b", "n"]);
    assert_eq!(why, "re-form (admitted 1 waiting node(s))");
    assert!(!why.contains("waiting to join"), "{why}");

    // Lost and grown at once: both said, the growth as done.
    let c = [cand("a", 1, true), cand("n", 8, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (_, why) = decide(t, &s, &cfg(1, 3));
    assert_eq!(why, "re-form (lost b, admitted 1 waiting node(s))");
}

#[test]
fn a_waiting_node_grows_a_round_below_max_but_not_a_full_one() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [cand("a", 1, true), cand("b", 2, true), cand("n", 9, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!(p.members, ["a", "b", "n"]);
    let c = [cand("a", 1, false), cand("b", 2, false), cand("n", 9, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, _) = decide(t, &s, &cfg(1, 2));
    assert_eq!(
        d,
        SealDecision::Wait { recheck_at: None },
        "a full round keeps its spare waiting"
    );
}

#[test]
fn below_min_after_a_loss_keeps_reforming() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [cand("a", 1, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(2, 3));
    assert_eq!(d, SealDecision::Reforming { recheck_at: None }, "{why}");
}

#[test]
fn a_run_whose_members_are_all_gone_starts_fresh() {
    let t = Instant::now();
    let cur = current(&["old1", "old2"], true);
    let c = [cand("x", 50, true), cand("y", 51, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let p = seal(decide(t, &s, &cfg(1, 2)));
    assert_eq!(p.members, ["x", "y"]);
    assert_eq!(
        (p.number, p.restart_count),
        (5, 0),
        "history is not charged to the new job"
    );
}

#[test]
fn ranks_are_capped_at_max_and_newcomers_follow_in_join_order() {
    let t = Instant::now();
    let cur = current(&["a"], false);
    let c = [
        cand("a", 1, true),
        cand("z", 3, true),
        cand("y", 2, true),
        cand("w", 4, true),
    ];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!(p.members, ["a", "y", "z"]);
}

#[test]
fn a_member_that_stopped_its_workers_breaks_the_round_at_once() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [cand("a", 1, true), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &cfg(1, 2));
    assert!(why.contains("a stopped their workers"), "{why}");
    let SealDecision::Seal(p) = d else {
        panic!("{why}")
    };
    assert_eq!(
        p.members,
        ["a", "b"],
        "b is healthy and learns of the round from etcd"
    );
}

#[test]
fn growth_does_not_wait_for_survivors_that_know_nothing_of_it() {
    let t = Instant::now();
    let cur = current(&["a", "b"], false);
    let c = [cand("a", 1, false), cand("b", 2, false), cand("n", 3, true)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let p = seal(decide(t, &s, &cfg(1, 3)));
    assert_eq!(p.members, ["a", "b", "n"]);
    assert_eq!(p.restart_count, 1);
}

#[test]
fn reasons_name_a_few_nodes_and_count_the_rest() {
    let t = Instant::now();
    let members: Vec<String> = (0..1000).map(|i| format!("node-{i}")).collect();
    let current = Current {
        number: 3,
        members: members.clone(),
        restart_count: 0,
        failed: false,
        departed: false,
        finished: BTreeSet::new(),
    };
    // Every member is gone but the first: 999 lost.
    let candidates = vec![Candidate {
        node_id: "node-0".into(),
        joined_rev: 1,
        ready: true,
        segment: String::new(),
    }];
    let state = SealState {
        current: Some(&current),
        candidates: &candidates,
        quiet_since: t,
        reform_since: None,
    };
    let cfg = SealConfig {
        min_nodes: 1,
        max_nodes: 1000,
        last_call: Duration::from_secs(30),
        straggler_timeout: Duration::from_secs(10),
        segment_size: 1,
    };
    let (d, reason) = decide(t, &state, &cfg);
    assert!(matches!(d, SealDecision::Seal(_)), "{d:?}");
    assert!(reason.contains("and 994 more"), "{reason}");
    assert!(reason.len() < 200, "{} characters: {reason}", reason.len());
}

/// At a job's end members write `done` and leave one by one: the others are not re-formed
/// without them (they finish too), whereas a member gone without `done` is lost.
#[test]
fn a_member_that_finished_and_left_is_not_lost() {
    let t = Instant::now();
    let mut cur = current(&["a", "b", "c"], false);
    cur.finished = ["c".to_owned()].into();
    let c = [cand("a", 1, false), cand("b", 2, false)];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let (d, why) = decide(t, &s, &cfg(1, 3));
    assert_eq!(d, SealDecision::Wait { recheck_at: None }, "{why}");
    let mut lost = cur.clone();
    lost.finished.clear();
    let s = SealState {
        current: Some(&lost),
        ..s
    };
    assert_eq!(seal(decide(t, &s, &cfg(1, 3))).members, ["a", "b"]);
}

// ---- topology ----

fn at(id: &str, rev: i64, segment: &str) -> Candidate {
    Candidate {
        segment: segment.into(),
        ..cand(id, rev, true)
    }
}

fn blocks_of(k: u32, min: u32, max: u32) -> SealConfig {
    SealConfig {
        segment_size: k,
        ..cfg(min, max)
    }
}

fn fresh_state(c: &[Candidate], t: Instant) -> SealState<'_> {
    SealState {
        current: None,
        candidates: c,
        quiet_since: t,
        reform_since: None,
    }
}

/// Slurm's switch paths: nodes under one leaf switch get contiguous ranks, leaves under
/// one spine next to each other, in join order inside a leaf.
#[test]
fn a_first_round_ranks_nodes_under_one_switch_together() {
    let t = Instant::now();
    let c = [
        at("n1", 1, "spine1/leaf3"),
        at("n2", 2, "spine0/leaf1"),
        at("n3", 3, "spine1/leaf3"),
        at("n4", 4, "spine0/leaf0"),
        at("n5", 5, "spine0/leaf1"),
        at("n6", 6, "spine1/leaf2"),
    ];
    let p = seal(decide(t, &fresh_state(&c, t), &cfg(1, 6)));
    assert_eq!(p.members, ["n4", "n2", "n5", "n6", "n1", "n3"]);
}

/// A Kubernetes zone label (with a rack label under it where a pod has one): zones
/// contiguous, racks contiguous within them; pods with no label last, in join order.
#[test]
fn a_first_round_ranks_pods_of_one_zone_together_and_unlabelled_ones_last() {
    let t = Instant::now();
    let c = [
        at("pod-a", 1, ""),
        at("pod-b", 2, "us-east-1b"),
        at("pod-c", 3, "us-east-1a/rack-2"),
        at("pod-d", 4, "us-east-1b"),
        at("pod-e", 5, ""),
        at("pod-f", 6, "us-east-1a/rack-1"),
        at("pod-g", 7, "us-east-1a/rack-2"),
    ];
    let p = seal(decide(t + 30 * S, &fresh_state(&c, t), &cfg(1, 8)));
    assert_eq!(
        p.members,
        [
            "pod-f", "pod-c", "pod-g", "pod-b", "pod-d", "pod-a", "pod-e"
        ]
    );
}

/// The nodes are chosen first (join order, at most `max`), then ordered: a location
/// never buys a later node a place.
#[test]
fn a_location_orders_the_chosen_nodes_and_chooses_none() {
    let t = Instant::now();
    let c = [at("a", 1, "r1"), at("b", 2, "r1"), at("c", 3, "r0")];
    let p = seal(decide(t, &fresh_state(&c, t), &cfg(1, 2)));
    assert_eq!(p.members, ["a", "b"]);
}

/// With no location anywhere the order is the one before topology: survivors in their
/// order, newcomers in join order, and that is what makes a re-form a small delta.
#[test]
fn with_no_location_the_order_is_survivors_then_join_order() {
    let t = Instant::now();
    let cur = current(&["c", "a"], false);
    let c = [
        cand("a", 1, false),
        cand("c", 3, false),
        cand("z", 9, true),
        cand("y", 8, true),
    ];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    assert_eq!(
        seal(decide(t, &s, &cfg(1, 4))).members,
        ["c", "a", "y", "z"]
    );
    let p = seal(decide(t, &fresh_state(&c[2..], t), &cfg(1, 2)));
    assert_eq!(p.members, ["y", "z"]);
}

/// A loss keeps the survivors first and in their order (they were ordered when their
/// round was sealed); growth puts a newcomer beside the nodes of its segment.
#[test]
fn a_reform_keeps_survivors_in_order_and_puts_newcomers_in_their_segment() {
    let t = Instant::now();
    let c = [
        at("a", 1, "r0"),
        at("b", 2, "r1"),
        at("c", 3, "r0"),
        at("d", 4, "r1"),
    ];
    let first = seal(decide(t, &fresh_state(&c, t), &cfg(1, 4)));
    assert_eq!(first.members, ["a", "c", "b", "d"]);
    let mut cur = current(&["a", "c", "b", "d"], false);
    // c is lost.
    let left = [c[0].clone(), c[1].clone(), c[3].clone()];
    let s = SealState {
        current: Some(&cur),
        candidates: &left,
        quiet_since: t,
        reform_since: Some(t),
    };
    assert_eq!(seal(decide(t, &s, &cfg(1, 5))).members, ["a", "b", "d"]);
    // n joins rack r0 of a round of a, b, d.
    cur.members = ["a", "b", "d"].map(String::from).to_vec();
    let grown = [c[0].clone(), c[1].clone(), c[3].clone(), at("n", 9, "r0")];
    let s = SealState {
        current: Some(&cur),
        candidates: &grown,
        quiet_since: t,
        reform_since: Some(t),
    };
    assert_eq!(
        seal(decide(t, &s, &cfg(1, 5))).members,
        ["a", "n", "b", "d"]
    );
}

#[test]
fn the_same_nodes_seen_in_any_order_make_the_same_round() {
    let t = Instant::now();
    let mut c = vec![
        at("a", 1, "z1/r0"),
        at("b", 2, "z0/r1"),
        at("c", 3, "z0/r0"),
        at("d", 4, "z1/r0"),
        at("e", 5, ""),
        at("f", 6, "z0/r1"),
    ];
    let want = seal(decide(t, &fresh_state(&c, t), &cfg(1, 6))).members;
    assert_eq!(want, ["c", "b", "f", "a", "d", "e"]);
    for _ in 0..c.len() {
        c.rotate_left(1);
        assert_eq!(
            seal(decide(t, &fresh_state(&c, t), &cfg(1, 6))).members,
            want
        );
    }
}

// ---- segment size ----

#[test]
fn with_blocks_a_first_round_takes_whole_blocks_of_one_segment() {
    let t = Instant::now();
    let c = [
        at("a1", 1, "A"),
        at("b1", 2, "B"),
        at("a2", 3, "A"),
        at("c1", 4, "C"),
        at("b2", 5, "B"),
        at("a3", 6, "A"),
    ];
    // Blocks of 2 under max 5: at most 4 nodes, A's block and B's: sealed at once.
    let (d, why) = decide(t, &fresh_state(&c, t), &blocks_of(2, 2, 5));
    let p = seal((d, why.clone()));
    assert_eq!(p.members, ["a1", "a2", "b1", "b2"]);
    assert!(why.contains("whole blocks of 2"), "{why}");
    // Max 6 holds three blocks, and only two are whole: the last call decides.
    let (d, why) = decide(t, &fresh_state(&c, t), &blocks_of(2, 2, 6));
    assert!(
        matches!(
            d,
            SealDecision::Wait {
                recheck_at: Some(_)
            }
        ),
        "{why}"
    );
    let p = seal(decide(t + 30 * S, &fresh_state(&c, t), &blocks_of(2, 2, 6)));
    assert_eq!(p.members, ["a1", "a2", "b1", "b2"]);
}

#[test]
fn with_blocks_nodes_short_of_a_block_do_not_make_the_minimum() {
    let t = Instant::now();
    let c = [at("a1", 1, "A"), at("b1", 2, "B"), at("c1", 3, "C")];
    let (d, why) = decide(t + 100 * S, &fresh_state(&c, t), &blocks_of(2, 2, 4));
    assert_eq!(d, SealDecision::Wait { recheck_at: None }, "{why}");
    assert!(why.contains("0 of min 2 in whole blocks of 2"), "{why}");
    assert!(why.contains("3 present"), "{why}");
}

/// A loss that breaks a block leaves its other node out: the round stays whole blocks,
/// and the reason says who waits as a spare and why.
#[test]
fn with_blocks_a_broken_block_leaves_its_survivor_as_a_spare() {
    let t = Instant::now();
    let cur = current(&["a1", "a2", "b1", "b2"], false);
    // a2 is lost.
    let c = [at("a1", 1, "A"), at("b1", 3, "B"), at("b2", 4, "B")];
    let s = SealState {
        current: Some(&cur),
        candidates: &c,
        quiet_since: t,
        reform_since: Some(t),
    };
    let (d, why) = decide(t, &s, &blocks_of(2, 2, 4));
    assert_eq!(seal((d, why.clone())).members, ["b1", "b2"]);
    assert!(
        why.contains("a1 wait as spares (short of a whole block of 2 in their segment)"),
        "{why}"
    );
    // Below the minimum in blocks, the round keeps re-forming.
    let (d, why) = decide(t, &s, &blocks_of(2, 3, 4));
    assert_eq!(d, SealDecision::Reforming { recheck_at: None }, "{why}");
}

/// A waiting node grows the round only when it completes a block the round has room
/// for; the round it grows to is whole blocks and does not grow again.
#[test]
fn with_blocks_a_round_grows_by_whole_blocks_only() {
    let t = Instant::now();
    let cur = current(&["a1", "a2"], false);
    let mut c = vec![
        at("a1", 1, "A"),
        at("a2", 2, "A"),
        at("b1", 3, "B"),
        at("a3", 4, "A"),
    ];
    c[0].ready = false;
    c[1].ready = false;
    let state = |c: &[Candidate]| -> (SealDecision, String) {
        let s = SealState {
            current: Some(&cur),
            candidates: c,
            quiet_since: t,
            reform_since: Some(t),
        };
        decide(t, &s, &blocks_of(2, 2, 6))
    };
    let (d, why) = state(&c);
    assert_eq!(d, SealDecision::Wait { recheck_at: None }, "{why}");
    c.push(at("b2", 5, "B"));
    let (d, why) = state(&c);
    assert_eq!(seal((d, why.clone())).members, ["a1", "a2", "b1", "b2"]);
    assert!(why.contains("admitted 2 waiting node(s)"), "{why}");
    // Sealed: a3 alone is no block.
    let grown = current(&["a1", "a2", "b1", "b2"], false);
    for n in &mut c {
        n.ready = n.node_id == "a3";
    }
    let s = SealState {
        current: Some(&grown),
        candidates: &c,
        quiet_since: t,
        reform_since: None,
    };
    let (d, why) = decide(t, &s, &blocks_of(2, 2, 6));
    assert_eq!(d, SealDecision::Wait { recheck_at: None }, "{why}");
}
