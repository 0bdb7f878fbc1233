use super::*;

/// Orders `(id, segment)` pairs, as the seal rule orders candidates.
fn ordered<'a>(nodes: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut nodes = nodes.to_vec();
    order(&mut nodes, |n| n.1);
    nodes.into_iter().map(|n| n.0).collect()
}

#[test]
fn good_segments_pass_and_bad_ones_say_what_a_good_one_is() {
    for good in [
        "rack-3",
        "us-east-1a/rack-17",
        "s0/s1",
        "a/b/c/d/e",
        "zone_a/row.2/rack:3",
    ] {
        assert_eq!(check(good), Ok(()), "{good}");
    }
    assert_eq!(check(""), Err(SegmentError::Empty));
    for empty_name in ["/a", "a/", "a//b", "/"] {
        assert_eq!(
            check(empty_name),
            Err(SegmentError::EmptyName),
            "{empty_name}"
        );
    }
    for unprintable in ["a b", "a\tb", "rack\n", "a/\u{1b}[2J"] {
        assert!(
            matches!(check(unprintable), Err(SegmentError::Unprintable { .. })),
            "{unprintable:?}"
        );
    }
    let long = "r".repeat(SEGMENT_MAX + 1);
    assert_eq!(
        check(&long),
        Err(SegmentError::TooLong {
            chars: SEGMENT_MAX + 1
        })
    );
    assert_eq!(check(&long[1..]), Ok(()));
    let e = SegmentError::EmptyName.to_string();
    assert!(e.contains("e.g. zone-a/rack-3"), "{e}");
}

/// Every prefix is one contiguous run: names compare one by one, not as one string
/// (`-` sorts before `/`, which put `a/b-x` between `a/b/c` and `a/b` deeper down).
#[test]
fn segments_sort_name_by_name_and_no_location_last() {
    let mut s = vec!["a/b/c", "a/b-x/c", "a/b/d", "", "a/b", "a"];
    s.sort_by(|a, b| compare(a, b));
    assert_eq!(s, ["a", "a/b", "a/b/c", "a/b/d", "a/b-x/c", ""]);
}

/// Slurm's switch paths (`SLURM_TOPOLOGY_ADDR`, switches only): nodes under one leaf
/// switch are contiguous, leaves under one spine next to each other; join order is kept
/// inside a leaf.
#[test]
fn slurm_switch_paths_make_each_leaf_contiguous_under_its_spine() {
    let nodes = [
        ("n1", "core/spine1/leaf3"),
        ("n2", "core/spine0/leaf1"),
        ("n3", "core/spine1/leaf2"),
        ("n4", "core/spine0/leaf0"),
        ("n5", "core/spine1/leaf3"),
        ("n6", "core/spine0/leaf1"),
        ("n7", "core/spine0/leaf0"),
    ];
    assert_eq!(ordered(&nodes), ["n4", "n7", "n2", "n6", "n3", "n1", "n5"]);
}

/// A Kubernetes label (`topology.kubernetes.io/zone`, or a zone and a rack label joined):
/// a zone's nodes are contiguous, and so is each rack within it.
#[test]
fn kubernetes_zone_and_rack_labels_group_zones_then_racks() {
    let nodes = [
        ("pod-0", "us-east-1b/rack-2"),
        ("pod-1", "us-east-1a/rack-7"),
        ("pod-2", "us-east-1b/rack-1"),
        ("pod-3", "us-east-1a/rack-7"),
        ("pod-4", "us-east-1b/rack-2"),
        ("pod-5", "us-east-1a"),
    ];
    assert_eq!(
        ordered(&nodes),
        ["pod-5", "pod-1", "pod-3", "pod-2", "pod-0", "pod-4"]
    );
}

#[test]
fn with_no_location_anywhere_nothing_moves() {
    let nodes = [("c", ""), ("a", ""), ("b", "")];
    assert_eq!(ordered(&nodes), ["c", "a", "b"]);
}

#[test]
fn nodes_with_no_location_follow_in_the_order_given() {
    let nodes = [
        ("x", ""),
        ("r1", "rack-1"),
        ("y", ""),
        ("r0", "rack-0"),
        ("z", ""),
    ];
    assert_eq!(ordered(&nodes), ["r0", "r1", "x", "y", "z"]);
}

/// The survivors of a round were ordered when it was sealed: ordering them again keeps
/// them as they are, so a re-form after a loss is still a delta of the round before.
#[test]
fn an_ordered_round_less_some_members_keeps_its_order() {
    let round = [
        ("d", "r0"),
        ("a", "r0"),
        ("c", "r1"),
        ("b", "r1"),
        ("e", "r2"),
    ];
    assert_eq!(ordered(&round), ["d", "a", "c", "b", "e"]);
    let survivors: Vec<_> = round.iter().copied().filter(|n| n.0 != "c").collect();
    assert_eq!(ordered(&survivors), ["d", "a", "b", "e"]);
}

/// The same nodes given in another order make the same segments in the same order;
/// only the order inside a segment follows what was given.
#[test]
fn the_segments_order_does_not_depend_on_the_order_given() {
    let nodes = [
        ("a", "z1/r0"),
        ("b", "z0/r1"),
        ("c", "z0/r0"),
        ("d", "z1/r0"),
        ("e", ""),
        ("f", "z0/r1"),
    ];
    let segments = |ids: Vec<&str>| -> Vec<&str> {
        ids.iter()
            .map(|id| nodes.iter().find(|n| n.0 == *id).unwrap().1)
            .collect()
    };
    let want = segments(ordered(&nodes));
    let mut turned = nodes;
    for _ in 0..nodes.len() {
        turned.rotate_left(1);
        assert_eq!(segments(ordered(&turned)), want);
    }
    let mut reversed = nodes;
    reversed.reverse();
    assert_eq!(segments(ordered(&reversed)), want);
    assert_eq!(
        ordered(&nodes),
        ordered(&nodes),
        "the same input, the same order"
    );
}

fn taken<'a>(nodes: &[(&'a str, &'a str)], size: usize, max: usize) -> Vec<&'a str> {
    blocks(nodes, size, max, |n| n.1)
        .into_iter()
        .map(|n| n.0)
        .collect()
}

#[test]
fn whole_blocks_are_taken_per_segment_and_the_rest_wait() {
    let nodes = [
        ("a1", "A"),
        ("b1", "B"),
        ("a2", "A"),
        ("a3", "A"),
        ("b2", "B"),
        ("c1", "C"),
    ];
    // A block of A is whole at a2, of B at b2; a3 and c1 are short of one.
    assert_eq!(taken(&nodes, 2, 8), ["a1", "b1", "a2", "b2"]);
    // Room for one block: the one whole first.
    assert_eq!(taken(&nodes, 2, 3), ["a1", "a2"]);
    assert_eq!(taken(&nodes, 3, 8), ["a1", "a2", "a3"]);
    assert_eq!(taken(&nodes, 4, 8), Vec::<&str>::new());
    // No blocks: the first `max`.
    assert_eq!(taken(&nodes, 1, 4), ["a1", "b1", "a2", "a3"]);
    assert_eq!(taken(&nodes, 0, 2), ["a1", "b1"]);
}

#[test]
fn nodes_with_no_location_make_blocks_of_their_own() {
    let nodes = [("x", ""), ("a", "A"), ("y", ""), ("z", "")];
    assert_eq!(taken(&nodes, 2, 4), ["x", "y"]);
}

/// How many nodes whole blocks take does not depend on the order they are offered in
/// (which is what keeps a grown round from growing again).
#[test]
fn how_many_blocks_are_taken_does_not_depend_on_the_order() {
    let mut nodes = [
        ("a1", "A"),
        ("b1", "B"),
        ("a2", "A"),
        ("a3", "A"),
        ("b2", "B"),
        ("c1", "C"),
        ("a4", "A"),
    ];
    for max in 0..9 {
        let n = taken(&nodes, 2, max).len();
        for _ in 0..nodes.len() {
            nodes.rotate_left(1);
            assert_eq!(taken(&nodes, 2, max).len(), n, "max {max}");
        }
    }
}

#[test]
fn a_segment_size_needs_a_multiple_within_nnodes() {
    assert_eq!(check_size(1, (1, 1)), Ok(()));
    assert_eq!(check_size(4, (4, 16)), Ok(()));
    assert_eq!(check_size(4, (1, 4)), Ok(()));
    assert_eq!(check_size(4, (6, 9)), Ok(()));
    let e = check_size(4, (5, 7)).unwrap_err();
    assert!(
        e.contains("no multiple of 4 lies within --nnodes 5:7"),
        "{e}"
    );
    assert!(check_size(8, (1, 4)).is_err());
    assert!(check_size(0, (1, 4)).is_err());
    assert_eq!((most(4, 10), most(1, 10), most(0, 3)), (8, 10, 3));
}
