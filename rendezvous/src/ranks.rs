//! Rank assignment as a pure function of the ordered member list.

/// A node's place in a sealed round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRanks {
    /// `GROUP_RANK`: the node's index in the member order.
    pub group_rank: u32,
    /// Global rank of the node's local rank 0.
    pub base_rank: u32,
}

/// Most workers one node may run: far above any machine, far below where rank
/// arithmetic could overflow.
pub const MAX_LOCAL_WORLD_SIZE: u32 = 1 << 16;
/// Most workers in a group: `RANK` and `WORLD_SIZE` are C `int`s in PyTorch.
pub const MAX_WORLD_SIZE: u32 = i32::MAX as u32;

/// Assigns group ranks in member order and global ranks by prefix sums of each node's
/// worker count, so nodes with different `--nproc-per-node` get contiguous, disjoint
/// ranges. Returns one entry per member and the world size, or why the sizes cannot form
/// a group (a node with no workers or more than [`MAX_LOCAL_WORLD_SIZE`], or a world
/// above [`MAX_WORLD_SIZE`]); records from etcd are not trusted to be sane.
pub fn assign(local_world_sizes: &[u32]) -> Result<(Vec<NodeRanks>, u32), String> {
    let mut next = 0u32;
    let mut ranks = Vec::with_capacity(local_world_sizes.len());
    for (i, &n) in local_world_sizes.iter().enumerate() {
        if n == 0 || n > MAX_LOCAL_WORLD_SIZE {
            return Err(format!(
                "node {i} has local_world_size {n}, outside 1..={MAX_LOCAL_WORLD_SIZE}"
            ));
        }
        ranks.push(NodeRanks {
            group_rank: i as u32,
            base_rank: next,
        });
        next = next
            .checked_add(n)
            .filter(|w| *w <= MAX_WORLD_SIZE)
            .ok_or_else(|| format!("the world size exceeds {MAX_WORLD_SIZE}"))?;
    }
    Ok((ranks, next))
}

/// Gives each member its ranks by [`assign`], in the order given; returns the world size.
pub fn rank_members(members: &mut [crate::RoundMember]) -> Result<u32, String> {
    let sizes: Vec<u32> = members.iter().map(|m| m.local_world_size()).collect();
    let (ranks, world_size) = assign(&sizes)?;
    for (m, r) in members.iter_mut().zip(ranks) {
        m.group_rank = r.group_rank;
        m.base_rank = r.base_rank;
    }
    Ok(world_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn homogeneous_nodes_get_contiguous_blocks() {
        let (ranks, world) = assign(&[2, 2, 2]).unwrap();
        assert_eq!(world, 6);
        let bases: Vec<u32> = ranks.iter().map(|r| r.base_rank).collect();
        assert_eq!(bases, [0, 2, 4]);
        let groups: Vec<u32> = ranks.iter().map(|r| r.group_rank).collect();
        assert_eq!(groups, [0, 1, 2]);
    }

    #[test]
    fn heterogeneous_nodes_use_prefix_sums() {
        let (ranks, world) = assign(&[8, 1, 4]).unwrap();
        assert_eq!(world, 13);
        let bases: Vec<u32> = ranks.iter().map(|r| r.base_rank).collect();
        assert_eq!(bases, [0, 8, 9]);
    }

    #[test]
    fn no_members_means_an_empty_world() {
        let (ranks, world) = assign(&[]).unwrap();
        assert!(ranks.is_empty());
        assert_eq!(world, 0);
    }

    #[test]
    fn sizes_that_would_wrap_or_make_no_sense_are_refused() {
        assert!(assign(&[u32::MAX, 2]).is_err());
        assert!(assign(&[2, 0]).is_err());
        let many = vec![MAX_LOCAL_WORLD_SIZE; 40_000];
        assert!(assign(&many).unwrap_err().contains("world size"));
    }
}
