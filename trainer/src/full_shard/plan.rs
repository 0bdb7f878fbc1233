//! Where each unit's parameters live under `full` sharding: a pure layout, so the
//! arithmetic of padding and offsets is tested without tensors or collectives.

use std::ops::Range;

/// One unit (the embedding, a decoder layer, or the final norm with the head), flattened
/// in layout order and padded to `shard × world` elements; rank r holds elements
/// `r·shard .. (r+1)·shard` of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// The unit's parameters, as indices into the model's layout.
    pub params: Range<usize>,
    /// Real elements (without padding).
    pub numel: i64,
    /// Elements per rank.
    pub shard: i64,
    /// Where the unit starts in the whole, unpadded flat order (the checkpoint's).
    pub flat_at: i64,
    /// Where this unit's shard starts in a rank's local vectors (the same on every rank).
    pub local_at: i64,
}

impl Unit {
    /// The real elements rank `rank` holds, as `(offset in the unit, length)`; the rest of
    /// its shard is padding (zero, and kept zero: its gradient is zero).
    pub fn owned(&self, rank: i64) -> (i64, i64) {
        let start = (rank * self.shard).min(self.numel);
        (start, (self.numel - start).min(self.shard))
    }

    /// Length of the gathered (padded) unit.
    pub fn padded(&self, world: i64) -> i64 {
        self.shard * world
    }
}

/// Lays out `units` (ranges over parameters of `sizes` elements) for `world` ranks.
pub fn plan(sizes: &[i64], units: &[Range<usize>], world: i64) -> Vec<Unit> {
    let (mut flat_at, mut local_at) = (0, 0);
    units
        .iter()
        .map(|r| {
            let numel: i64 = sizes[r.clone()].iter().sum();
            // At least one element per rank: Gloo refuses empty tensors.
            let shard = ((numel + world - 1) / world).max(1);
            let unit = Unit {
                params: r.clone(),
                numel,
                shard,
                flat_at,
                local_at,
            };
            flat_at += numel;
            local_at += shard;
            unit
        })
        .collect()
}

/// Elements of a rank's local vectors (parameters, gradients, each AdamW moment).
pub fn local_len(plan: &[Unit]) -> i64 {
    plan.iter().map(|u| u.shard).sum()
}

/// The units gathered in one step, in order: forward through all but the last, then
/// backward from the last (whose forward runs only there, with the loss) to the first.
/// Prefetching walks this list one ahead.
pub fn gather_order(units: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..units.saturating_sub(1)).collect();
    order.extend((0..units).rev());
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_real_element_is_owned_by_exactly_one_rank() {
        let sizes = [10, 3, 4, 7, 1];
        let units = [0..1, 1..3, 3..5];
        for world in [1, 2, 3, 4, 16] {
            let p = plan(&sizes, &units, world);
            assert_eq!(p.iter().map(|u| u.numel).sum::<i64>(), 25);
            for u in &p {
                assert!(u.padded(world) >= u.numel);
                assert!(
                    u.padded(world) - u.numel < world.max(2),
                    "padding below one row"
                );
                let mut seen = vec![0; u.numel as usize];
                for r in 0..world {
                    let (start, len) = u.owned(r);
                    assert!(len >= 0 && len <= u.shard);
                    for i in start..start + len {
                        seen[i as usize] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "world {world}: {u:?}");
            }
            assert_eq!(p[1].flat_at, 10);
            assert_eq!(p[2].flat_at, 17);
            assert_eq!(p[2].local_at, p[0].shard + p[1].shard);
            assert_eq!(local_len(&p), p.iter().map(|u| u.shard).sum::<i64>());
        }
        // 3 ranks, 10 elements: shards of 4, the last rank holds 2 real ones and 2 of padding.
        let one = std::iter::once(0..1).collect::<Vec<_>>();
        let p = plan(&[10], &one, 3);
        assert_eq!(p[0].shard, 4);
        assert_eq!(p[0].owned(2), (8, 2));
        // More ranks than elements: the surplus ranks hold only padding.
        let p = plan(&[2], &one, 4);
        assert_eq!((p[0].owned(1), p[0].owned(3)), ((1, 1), (2, 0)));
    }

    #[test]
    fn gathers_go_forward_then_backward_with_the_last_unit_once() {
        assert_eq!(gather_order(4), vec![0, 1, 2, 3, 2, 1, 0]);
        assert_eq!(gather_order(1), vec![0]);
    }
}
