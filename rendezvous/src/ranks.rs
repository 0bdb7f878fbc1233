//! Rank assignment as a pure function of the ordered member list.

/// A node's place in a sealed round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRanks {
    /// `GROUP_RANK`: the node's index in the member order.
    pub group_rank: u32,
    /// Global rank of the node's local rank 0.
    pub base_rank: u32,
}

/// Assigns group ranks in member order and global ranks by prefix sums of each node's
/// worker count, so nodes with different `--nproc-per-node` get contiguous, disjoint
/// ranges. Returns one entry per member and the world size.
pub fn assign(local_world_sizes: &[u32]) -> (Vec<NodeRanks>, u32) {
    let mut next = 0u32;
    let ranks = local_world_sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let r = NodeRanks {
                group_rank: i as u32,
                base_rank: next,
            };
            next += n;
            r
        })
        .collect();
    (ranks, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn homogeneous_nodes_get_contiguous_blocks() {
        let (ranks, world) = assign(&[2, 2, 2]);
        assert_eq!(world, 6);
        let bases: Vec<u32> = ranks.iter().map(|r| r.base_rank).collect();
        assert_eq!(bases, [0, 2, 4]);
        let groups: Vec<u32> = ranks.iter().map(|r| r.group_rank).collect();
        assert_eq!(groups, [0, 1, 2]);
    }

    #[test]
    fn heterogeneous_nodes_use_prefix_sums() {
        let (ranks, world) = assign(&[8, 1, 4]);
        assert_eq!(world, 13);
        let bases: Vec<u32> = ranks.iter().map(|r| r.base_rank).collect();
        assert_eq!(bases, [0, 8, 9]);
    }

    #[test]
    fn no_members_means_an_empty_world() {
        let (ranks, world) = assign(&[]);
        assert!(ranks.is_empty());
        assert_eq!(world, 0);
    }
}
