use super::*;

fn member(i: usize, workers: u32, watchable: bool) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: format!("node-{i:05}"),
        addr: format!("10.0.{}.{}", i / 256, i % 256),
        local_world_size: workers,
        status_addr: if watchable {
            format!("10.0.{}.{}:29450", i / 256, i % 256)
        } else {
            String::new()
        },
        lease: 7_000 + i as i64,
        incarnation: 1,
        ..Default::default()
    })
}

fn round(members: Vec<v1::Member>) -> v1::Round {
    v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 3,
        members,
        restart_count: 1,
        reason: "first round".into(),
        sealed_at_ms: 1_000,
        ..Default::default()
    }
}

/// Every member is in the shard its id hashes to, with the ranks and the neighbour the
/// whole round gives it; the shards make the whole round again; the header is small.
#[test]
fn a_placed_round_gives_each_member_what_the_whole_round_would() {
    let n = 1_000;
    let r = round(
        (0..n)
            .map(|i| member(i, 1 + (i % 3) as u32, i % 7 != 0))
            .collect(),
    );
    let (header, shards) = place(&r, None, Shape::ETCD).unwrap();
    assert_eq!(header.shards, Shape::ETCD.shards_for(n, false));
    assert_eq!(shards.len(), n.div_ceil(SHARD_MEMBERS));
    assert!(header.members.is_empty());
    assert!(prost::Message::encoded_len(&header) < 200);
    let (ranks, world) = crate::ranks::assign(
        &r.members
            .iter()
            .map(|m| m.local_world_size)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert_eq!(
        (header.group_world_size, header.world_size),
        (n as u32, world)
    );
    for (i, m) in r.members.iter().enumerate() {
        let shard = &shards[shard_of(&m.node_id, header.shards) as usize];
        let w = window(&header, shard, &m.node_id).expect("placed in its shard");
        let p = w.placed.as_ref().unwrap();
        assert_eq!(
            (p.group_rank, p.base_rank),
            (ranks[i].group_rank, ranks[i].base_rank)
        );
        assert_eq!(w.members[0].node_id, m.node_id);
        // Its liveness watcher finds the neighbour the whole round gives it, with what
        // it watches it by.
        let expected = crate::etcd::liveness::neighbour(&r, &m.node_id);
        let found = crate::etcd::liveness::neighbour(&w, &m.node_id);
        let by = |n: Option<&v1::Member>| {
            n.map(|n| {
                (
                    n.node_id.clone(),
                    n.status_addr.clone(),
                    n.lease,
                    n.incarnation,
                )
            })
        };
        assert_eq!(by(found), by(expected), "node {i}");
        assert_eq!(by(p.neighbour.as_ref()), by(expected), "node {i}");
    }
    assert_eq!(whole(&header, &shards).unwrap().members, r.members);
    // A node the round was sealed without finds no place.
    let stranger = member(n + 1, 1, true).node_id.clone();
    let shard = &shards[shard_of(&stranger, header.shards) as usize];
    assert!(window(&header, shard, &stranger).is_none());
}

/// A round every member reads is placed in shards of about [`SHARD_MEMBERS`] members at
/// any size (each member reads a shard, not a hundredth of the round); a round that moves
/// from the one before, whose shards few read, in at most [`INLINE_SHARDS`], and all of
/// it still fits the seal's one request under etcd's limit (1.5 MiB) at 20,000 members,
/// with real host names and status ports (every member is stored twice: itself, and its
/// watcher's neighbour), stored as the coordinator writes them: packed.
#[test]
fn shards_stay_small_at_any_size_and_a_moved_round_fits_one_request() {
    let scramble = |i: usize| (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let real = |i: usize| {
        let host = format!("gpu-node-{i:05}.cluster.example.com");
        v1::Member::from(v1::MemberFields {
            schema: fsdp_proto::SCHEMA_VERSION,
            // Its pid and random suffix, which no packing shortens.
            node_id: format!("{host}-{}-{:06x}", 4_000 + i % 997, scramble(i) >> 40),
            status_addr: format!("{host}:29450"),
            addr: host,
            local_world_size: 8,
            lease: (scramble(i) >> 2) as i64,
            incarnation: 1,
            ..Default::default()
        })
    };
    let stored = |header: &v1::Round, shards: &[v1::Placement]| -> usize {
        let shards: usize = shards
            .iter()
            .map(|s| fsdp_proto::encode_packed(s).len())
            .sum();
        shards + fsdp_proto::encode(header).len()
    };
    for n in [1_000, 20_000] {
        let r = round((0..n).map(real).collect());
        let (header, shards) = place(&r, None, Shape::ETCD).unwrap();
        assert_eq!(header.shards as usize, n.div_ceil(SHARD_MEMBERS));
        let largest = shards.iter().map(|s| s.members.len()).max().unwrap();
        assert!(largest <= 3 * SHARD_MEMBERS, "{n}: {largest}");
        let mean = stored(&header, &shards) / shards.len();
        assert!(mean < 2_000, "{n} members: {mean} bytes a shard");
        eprintln!("{n} members: {mean} bytes a shard, {largest} members at most");
    }
    // 20,000 left of 20,001: the header says the one gone; the shards fit its request.
    let n = 20_001;
    let before = round((0..n).map(real).collect());
    let (h0, s0) = place(&before, None, Shape::ETCD).unwrap();
    let base = whole(&h0, &s0).unwrap();
    let after = v1::Round {
        number: 4,
        members: before.members[1..].to_vec(),
        ..before.clone()
    };
    let (header, shards) = place(&after, Some((&base, 7)), Shape::ETCD).unwrap();
    assert_eq!(header.gone.len(), 1);
    assert_eq!(shards.len(), INLINE_SHARDS);
    let bytes = stored(&header, &shards);
    assert!(bytes < 1_400_000, "{bytes} bytes in one transaction");
    assert_eq!(whole(&header, &shards).unwrap().members, after.members);
}

/// A tag names one attempt at one round, and nothing else passes for one.
#[test]
fn a_tag_names_its_round_and_nothing_else_passes() {
    let t = tag(7, 0x1234_abcd, 3);
    assert!(tag_fits(&t, 7));
    assert!(!tag_fits(&t, 8), "another round's");
    assert!(tag(7, -1, u64::MAX).len() < 64);
    assert!(tag_fits(&tag(7, -1, u64::MAX), 7), "any lease, any count");
    for bad in [
        "",
        "00000000000000000007",
        "00000000000000000007.1234.3",
        "00000000000000000007.000000001234abcd.",
        "00000000000000000007.000000001234abcd.3/x",
        "00000000000000000007.000000001234abcd.3.4",
        "../00000000000000000007.000000001234abcd.3",
    ] {
        assert!(!tag_fits(bad, 7), "{bad}");
    }
    // Older rounds sort first, whatever their lease and count.
    assert!(tag(9, -1, 99) < tag(10, 0, 0));
}

/// A node that forms a group alone has nobody to watch.
#[test]
fn a_lone_member_has_no_neighbour() {
    let r = round(vec![member(0, 2, true)]);
    let (header, shards) = place(&r, None, Shape::ETCD).unwrap();
    let w = window(&header, &shards[0], "node-00000").unwrap();
    assert_eq!(w.placed.unwrap().neighbour, None);
    assert_eq!(w.members.len(), 1);
}

/// Shards missing, of another round, or two members at one rank are refused, never made
/// into a round.
#[test]
fn whole_refuses_shards_that_do_not_make_the_round() {
    let r = round((0..200).map(|i| member(i, 1, true)).collect());
    let (header, shards) = place(&r, None, Shape::ETCD).unwrap();
    let why = whole(&header, &shards[1..]).unwrap_err();
    assert!(why.contains("shard 0") && why.contains("missing"), "{why}");
    let mut other = shards.clone();
    other[1].round = 2;
    assert!(whole(&header, &other).unwrap_err().contains("round 2"));
    let mut twice = shards.clone();
    let copy = twice[0].members[0].clone();
    twice[1].members.push(copy);
    assert!(whole(&header, &twice).unwrap_err().contains("taken"));
}

/// The hash is the one every agent computes (FNV-1a of the id): a changed function would
/// put a node in another shard than the coordinator did.
#[test]
fn the_shard_of_a_node_is_fixed() {
    assert_eq!(
        shard_of("", 1_000),
        (0xcbf2_9ce4_8422_2325u64 % 1_000) as u32
    );
    assert_eq!(
        shard_of("a", u32::MAX),
        (0xaf63_dc4c_8601_ec8cu64 % u64::from(u32::MAX)) as u32
    );
    assert_eq!(shard_of("anything", 0), 0);
}

/// Every member's copy of `header` from its shard, by node id.
fn windows(header: &v1::Round, shards: &[v1::Placement], r: &v1::Round) -> Vec<v1::Round> {
    r.members
        .iter()
        .map(|m| {
            let shard = &shards[shard_of(&m.node_id, header.shards) as usize];
            window(header, shard, &m.node_id).expect("placed in its shard")
        })
        .collect()
}

/// A re-form that leaves members out (the first, the last, a run of four, one beside a
/// member nobody watches) is said as moves: every member kept makes from its copy of the
/// round before exactly the copy its new shard gives it, without reading it; a member left
/// out makes none (it reads its shard and finds no place); the coordinator's whole copy
/// becomes the new whole round.
#[test]
fn a_member_makes_its_copy_of_a_re_form_that_leaves_members_out_without_a_read() {
    let n = 1_000;
    let before = round(
        (0..n)
            .map(|i| member(i, 1 + (i % 3) as u32, i % 7 != 0))
            .collect(),
    );
    let (h1, s1) = place(&before, None, Shape::ETCD).unwrap();
    let held_whole = whole(&h1, &s1).unwrap();
    let copies = windows(&h1, &s1, &before);
    let out = [0, n - 1, 500, 501, 502, 503, 13, 699];
    let after = v1::Round {
        number: 4,
        reason: "a re-form".into(),
        members: before
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| !out.contains(i))
            .map(|(_, m)| m.clone())
            .collect(),
        ..before.clone()
    };
    let (h2, s2) = place(&after, Some((&held_whole, 41)), Shape::ETCD).unwrap();
    assert_eq!((h2.base, h2.base_rev, h2.gone.len()), (3, 41, out.len()));
    // A few entries, not the round: the header every member receives stays small.
    assert!(h2.rewired.len() <= out.len(), "{}", h2.rewired.len());
    assert!(prost::Message::encoded_len(&h2) < 2_000);
    let fresh = windows(&h2, &s2, &after);
    let mut kept = fresh.iter();
    for (i, copy) in copies.iter().enumerate() {
        let made = moved(copy, &h2);
        if out.contains(&i) {
            assert!(made.is_none(), "member {i} was left out");
            continue;
        }
        let made = made.unwrap_or_else(|| panic!("member {i} makes its copy"));
        let want = kept.next().unwrap();
        assert_eq!(made.placed, want.placed, "member {i}");
        assert_eq!(made.members, want.members, "member {i}");
        assert_eq!(
            (made.number, made.group_world_size, made.world_size),
            (4, want.group_world_size, want.world_size)
        );
        assert!(made.gone.is_empty() && made.rewired.is_empty() && made.base_rev == 0);
    }
    let made = moved(&held_whole, &h2).unwrap();
    assert_eq!(made.members, after.members);
    assert_eq!(made.shards, h2.shards);
    // Not from another round than the one it moves from.
    let older = v1::Round {
        number: 2,
        ..copies[1].clone()
    };
    assert!(moved(&older, &h2).is_none());
}

/// A re-form that keeps everyone (after a failure) moves nobody: every copy keeps its
/// place. One that adds a node, or keeps a node registered anew, is no move: every member
/// reads its shard.
#[test]
fn only_a_re_form_that_leaves_members_out_in_their_order_is_said_as_moves() {
    let before = round((0..300).map(|i| member(i, 2, true)).collect());
    let (h1, s1) = place(&before, None, Shape::ETCD).unwrap();
    let held = whole(&h1, &s1).unwrap();
    let next = |members: Vec<v1::Member>| v1::Round {
        number: 4,
        members,
        ..before.clone()
    };
    let same = next(before.members.clone());
    let (h2, _) = place(&same, Some((&held, 9)), Shape::ETCD).unwrap();
    assert_eq!((h2.base_rev, h2.gone.len(), h2.rewired.len()), (9, 0, 0));
    let copy = &windows(&h1, &s1, &before)[7];
    assert_eq!(moved(copy, &h2).unwrap().placed, copy.placed);

    let mut added = before.members.clone();
    added.push(member(300, 2, true));
    let mut anew = before.members.clone();
    anew[5].incarnation = 2;
    let mut reordered = before.members.clone();
    reordered.swap(1, 2);
    for members in [added, anew, reordered] {
        let (h, _) = place(&next(members), Some((&held, 9)), Shape::ETCD).unwrap();
        assert_eq!((h.base, h.base_rev), (0, 0));
        assert!(moved(copy, &h).is_none());
    }
    // Nor from a member's copy, which lists too little to say what moved.
    let (h, _) = place(&same, Some((copy, 9)), Shape::ETCD).unwrap();
    assert_eq!(h.base_rev, 0);
    // Nor more moves than a shard holds: the header goes to every member.
    let many = next(before.members[MAX_MOVES + 1..].to_vec());
    let (h, _) = place(&many, Some((&held, 9)), Shape::ETCD).unwrap();
    assert_eq!(h.base_rev, 0);
    let few = next(before.members[MAX_MOVES..].to_vec());
    let (h, _) = place(&few, Some((&held, 9)), Shape::ETCD).unwrap();
    assert_eq!((h.base_rev, h.gone.len()), (9, MAX_MOVES));
    // A header whose sizes are not the round before less its moves is not applied.
    let later = &windows(&h1, &s1, &before)[200];
    assert!(moved(later, &h).is_some());
    for forged in [
        v1::Round {
            world_size: h.world_size + 2,
            ..h.clone()
        },
        v1::Round {
            group_world_size: h.group_world_size - 1,
            ..h.clone()
        },
    ] {
        assert!(moved(later, &forged).is_none());
        assert!(moved(&held, &forged).is_none());
    }
}
