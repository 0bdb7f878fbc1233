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

/// A shard holds about [`SHARD_MEMBERS`] members up to [`MAX_SHARDS`] shards, and the
/// seal, one transaction, stays under etcd's request limit (1.5 MiB) with real host names
/// and status ports (every member is stored twice: itself, and its watcher's neighbour),
/// stored as the coordinator writes them: packed.
#[test]
fn a_placed_round_of_twenty_thousand_fits_in_one_request() {
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
    for (n, most) in [
        (1_000, 2 * SHARD_MEMBERS),
        (20_000, 2 * 20_000 / MAX_SHARDS),
    ] {
        let r = round((0..n).map(real).collect());
        let (header, shards) = place(&r).unwrap();
        let largest = shards.iter().map(|s| s.members.len()).max().unwrap();
        assert!(largest < most, "{n}: {largest}");
        let stored: usize = shards
            .iter()
            .map(|s| fsdp_proto::encode_packed(s).len())
            .sum();
        let bytes = stored + fsdp_proto::encode(&header).len();
        assert!(
            bytes < 1_400_000,
            "{n} members: {bytes} bytes in one transaction"
        );
        let plain: usize = shards.iter().map(prost::Message::encoded_len).sum();
        eprintln!("{n} members: {bytes} bytes stored, {plain} plain");
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
