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
    let (header, shards) = place(&r).unwrap();
    assert_eq!(header.shards, shards_for(n));
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
        let expected = crate::etcd::liveness::neighbour(&r, &m.node_id);
        assert_eq!(p.neighbour.as_ref(), expected, "node {i}");
        // Its liveness watcher finds the same neighbour in its copy.
        assert_eq!(crate::etcd::liveness::neighbour(&w, &m.node_id), expected);
    }
    assert_eq!(whole(&header, &shards).unwrap().members, r.members);
    // A node the round was sealed without finds no place.
    let stranger = member(n + 1, 1, true).node_id.clone();
    let shard = &shards[shard_of(&stranger, header.shards) as usize];
    assert!(window(&header, shard, &stranger).is_none());
}

/// A shard holds about [`SHARD_MEMBERS`] up to [`MAX_SHARDS`] shards, and the seal stays
/// one transaction beyond: at 20,000 members it is 100 shards of about 200.
#[test]
fn shards_are_small_and_few_enough_for_one_transaction() {
    for (n, most) in [
        (1_000, 2 * SHARD_MEMBERS),
        (20_000, 2 * 20_000 / MAX_SHARDS),
    ] {
        let r = round((0..n).map(|i| member(i, 8, true)).collect());
        let (_, shards) = place(&r).unwrap();
        assert!(shards.len() <= MAX_SHARDS);
        let largest = shards.iter().map(|s| s.members.len()).max().unwrap();
        assert!(largest < most, "{n}: {largest}");
    }
}

/// A node that forms a group alone has nobody to watch.
#[test]
fn a_lone_member_has_no_neighbour() {
    let r = round(vec![member(0, 2, true)]);
    let (header, shards) = place(&r).unwrap();
    let w = window(&header, &shards[0], "node-00000").unwrap();
    assert_eq!(w.placed.unwrap().neighbour, None);
    assert_eq!(w.members.len(), 1);
}

/// Shards missing, of another round, or two members at one rank are refused, never made
/// into a round.
#[test]
fn whole_refuses_shards_that_do_not_make_the_round() {
    let r = round((0..200).map(|i| member(i, 1, true)).collect());
    let (header, shards) = place(&r).unwrap();
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
