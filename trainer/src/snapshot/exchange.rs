//! The copy of each rank's snapshot to its buddy, a rank on another node: sent after a
//! step, in flight while the next step computes, finished before that step's optimizer
//! update (the loop's fence). At most one exchange is in flight.

use tch::{Kind, Tensor};

use super::Snapshot;
use crate::c10d::{C10dError, Pending, ProcessGroup};

const HEADER_TAG: i32 = 0x534e;
const DATA_TAG: i32 = 0x534f;

/// The rank this rank sends its snapshot to and the rank it keeps a copy for: one node
/// (`local_world` ranks) along, so that a copy never lives on the node it would have to
/// survive. `None` when every rank is on one node.
pub fn buddies(rank: usize, world: usize, local_world: usize) -> Option<(usize, usize)> {
    let step = local_world.max(1);
    (world > step).then(|| ((rank + step) % world, (rank + world - step % world) % world))
}

/// One exchange in flight: this rank's snapshot going out, its buddy's coming in.
pub struct Exchange {
    sends: Vec<Pending>,
    header: Pending,
    data: Pending,
}

impl Exchange {
    /// Starts sending `mine` to `to` and receiving the snapshot of `from`, whose runs are
    /// `from_runs` (the receiver knows the sender's layout, so both sizes are known), into
    /// `reuse` when it has the size (no fresh pages to fault in at every step).
    pub fn start(
        pg: &ProcessGroup,
        mine: &Snapshot,
        (to, from): (usize, usize),
        from_runs: &[(i64, i64)],
        reuse: Option<Tensor>,
    ) -> Result<Self, C10dError> {
        let header = Tensor::from_slice(&mine.header());
        let sends = vec![
            pg.send_start(header, to, HEADER_TAG)?,
            pg.send_start(mine.data.shallow_clone(), to, DATA_TAG)?,
        ];
        let words = 7 + 2 * from_runs.len() as i64 + 1;
        let len: i64 = from_runs.iter().map(|&(_, n)| n).sum();
        let cpu = tch::Device::Cpu;
        let header = pg.recv_start(Tensor::zeros([words], (Kind::Int64, cpu)), from, HEADER_TAG)?;
        let buffer = reuse
            .filter(|t| t.numel() == 3 * len as usize)
            .unwrap_or_else(|| Tensor::empty([3 * len], (Kind::Float, cpu)));
        let data = pg.recv_start(buffer, from, DATA_TAG)?;
        Ok(Self {
            sends,
            header,
            data,
        })
    }

    /// Waits for both directions: the buddy's copy, or the error that broke the group.
    pub fn finish(self) -> Result<Snapshot, C10dError> {
        for s in self.sends {
            drop(s.wait()?);
        }
        let header = self.header.wait()?;
        let data = self.data.wait()?;
        let words = Vec::<i64>::try_from(&header).map_err(|e| C10dError {
            op: "recv",
            message: e.to_string(),
        })?;
        Snapshot::from_parts(&words, data).ok_or_else(|| C10dError {
            op: "recv",
            message: "a snapshot header that does not parse".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buddy_is_one_node_along() {
        // Three nodes of one rank each: 0→1→2→0.
        assert_eq!(buddies(0, 3, 1), Some((1, 2)));
        assert_eq!(buddies(2, 3, 1), Some((0, 1)));
        // Two nodes of four: rank 1 sends to 5 and keeps 5's.
        assert_eq!(buddies(1, 8, 4), Some((5, 5)));
        assert_eq!(buddies(6, 8, 4), Some((2, 2)));
        // Three nodes of two.
        assert_eq!(buddies(5, 6, 2), Some((1, 3)));
        // One node: nowhere off-node to keep a copy.
        assert_eq!(buddies(0, 4, 4), None);
        assert_eq!(buddies(0, 1, 1), None);
    }
}
