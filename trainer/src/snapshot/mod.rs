//! Peer-memory snapshots: after a step, each rank copies its part of the state (its shard
//! of the parameters and of AdamW's moments, with the step, the data position and AdamW's
//! step count) to its own host memory and to the host memory of a buddy rank on another
//! node. When a node is lost, the survivors' processes re-form in place and rebuild the
//! newest step every shard of which survives somewhere ([`plan`]), instead of reading the
//! last checkpoint back from disk and redoing the steps since.
//!
//! * [`Snapshot`]: one rank's part at one step, with a checksum taken when it was copied.
//! * [`Snapshots`]: what this process keeps, across process groups: its own last two and
//!   its buddy's last two (two, because the newest copy may still be in flight when a
//!   node dies: the step before it is then the newest one whole).
//! * [`exchange`]: the copy to the buddy, in flight while the next step computes.
//! * [`plan`]: which step to rebuild and who sends each part (pure).
//! * [`restore`]: the inventory, the plan and the transfer in a new group.

pub mod exchange;
pub mod plan;
pub mod restore;

use std::collections::VecDeque;

use tch::{Kind, Tensor};

use crate::shard::LiveState;

/// Whose part a snapshot is: rank `rank` of a group of `world` ranks, the group named by
/// an id every rank of it agreed on when it formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    pub group: u64,
    pub world: u32,
    pub rank: u32,
}

/// Where training stood when the snapshot was taken (after step `step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct At {
    pub step: u64,
    pub samples_seen: u64,
    pub adam_step: u64,
}

/// One rank's part of the state at one step, in host memory.
pub struct Snapshot {
    pub tag: Tag,
    pub at: At,
    /// `(flat offset, length)` of each run, in the whole model's flat order.
    pub runs: Vec<(i64, i64)>,
    /// The runs' parameters, then their first moments, then their second moments (f32).
    pub data: Tensor,
    /// Of the header and `data`, taken when the copy was made.
    pub checksum: u64,
}

impl Snapshot {
    /// Copies `live` (this rank's part, on any device) into host memory, reusing `reuse`
    /// (an older snapshot's buffer) when it has the size.
    pub fn take(tag: Tag, at: At, live: &LiveState, reuse: Option<Tensor>) -> Self {
        let (in_params, in_moments) = live.offsets();
        let len: i64 = live.pieces.iter().map(|&(_, _, n)| n).sum();
        let data = reuse
            .filter(|t| t.numel() == 3 * len as usize)
            .unwrap_or_else(|| Tensor::empty([3 * len], (Kind::Float, tch::Device::Cpu)));
        tch::no_grad(|| {
            let mut at = 0;
            for (t, runs) in [
                (&live.params, &in_params),
                (&live.m, &in_moments),
                (&live.v, &in_moments),
            ] {
                for &(offset, n) in runs {
                    data.narrow(0, at, n).copy_(&t.narrow(0, offset, n));
                    at += n;
                }
            }
        });
        let runs = live.runs();
        let checksum = checksum(&header_words(tag, at, &runs), &data);
        Self {
            tag,
            at,
            runs,
            data,
            checksum,
        }
    }

    /// Whether the bytes are still the ones the checksum was taken of.
    pub fn intact(&self) -> bool {
        checksum(&header_words(self.tag, self.at, &self.runs), &self.data) == self.checksum
    }

    /// Elements per tensor (parameters, m, v each).
    pub fn len(&self) -> i64 {
        self.runs.iter().map(|&(_, n)| n).sum()
    }

    /// The header that travels with the data: tag, position, checksum, runs.
    pub fn header(&self) -> Vec<i64> {
        let mut h = header_words(self.tag, self.at, &self.runs);
        h.push(self.checksum as i64);
        h
    }

    /// Reads a header and its data back (the receiving side of [`Self::header`]).
    pub fn from_parts(header: &[i64], data: Tensor) -> Option<Self> {
        let (&checksum, words) = header.split_last()?;
        let [
            group,
            world,
            rank,
            step,
            samples_seen,
            adam_step,
            n,
            rest @ ..,
        ] = words
        else {
            return None;
        };
        let n = usize::try_from(*n).ok()?;
        if rest.len() != 2 * n {
            return None;
        }
        let runs = rest.chunks(2).map(|c| (c[0], c[1])).collect();
        Some(Self {
            tag: Tag {
                group: *group as u64,
                world: u32::try_from(*world).ok()?,
                rank: u32::try_from(*rank).ok()?,
            },
            at: At {
                step: *step as u64,
                samples_seen: *samples_seen as u64,
                adam_step: *adam_step as u64,
            },
            runs,
            data,
            checksum: checksum as u64,
        })
    }
}

/// The header's words before the checksum.
fn header_words(tag: Tag, at: At, runs: &[(i64, i64)]) -> Vec<i64> {
    let mut h = vec![
        tag.group as i64,
        i64::from(tag.world),
        i64::from(tag.rank),
        at.step as i64,
        at.samples_seen as i64,
        at.adam_step as i64,
        runs.len() as i64,
    ];
    h.extend(runs.iter().flat_map(|&(f, n)| [f, n]));
    h
}

/// Header words then data bytes, mixed a 64-bit word at a time (FNV-1a's constants) in
/// four independent lanes, so that the multiplies overlap and the hash runs near memory
/// speed (it is taken of every snapshot, every step): a flipped byte anywhere changes it;
/// it is not meant to resist anyone choosing the bytes.
fn checksum(header: &[i64], data: &Tensor) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    const BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    let mix = |h: u64, w: u64| (h ^ w).wrapping_mul(PRIME).rotate_left(23);
    let mut lanes = [BASIS, BASIS ^ 1, BASIS ^ 2, BASIS ^ 3];
    for (i, &w) in header.iter().enumerate() {
        lanes[i % 4] = mix(lanes[i % 4], w as u64);
    }
    let data = data.contiguous();
    let bytes = data.numel() * 4;
    let raw: &[u8] = if bytes == 0 {
        // An empty tensor's data pointer may be null, which no slice may have.
        &[]
    } else {
        // SAFETY: a contiguous, non-empty f32 CPU tensor of numel elements: numel × 4
        // readable bytes, alive (held by `data`) for the borrow.
        unsafe { std::slice::from_raw_parts(data.data_ptr() as *const u8, bytes) }
    };
    let mut blocks = raw.chunks_exact(32);
    for b in &mut blocks {
        for (lane, w) in lanes.iter_mut().zip(b.chunks_exact(8)) {
            *lane = mix(*lane, u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
        }
    }
    for (i, &b) in blocks.remainder().iter().enumerate() {
        lanes[i % 4] = mix(lanes[i % 4], u64::from(b) | (i as u64) << 8);
    }
    lanes.iter().fold(bytes as u64, |h, &l| mix(h, l))
}

/// How many of each kind a process keeps.
const GENERATIONS: usize = 2;

/// This process's snapshots: its own and its buddy's, newest last. They outlive the
/// process group they were taken in: that is what they are for.
#[derive(Default)]
pub struct Snapshots {
    pub own: VecDeque<Snapshot>,
    pub held: VecDeque<Snapshot>,
}

impl Snapshots {
    /// Keeps `s` as this rank's newest; returns the buffer of the one it displaces.
    pub fn keep_own(&mut self, s: Snapshot) -> Option<Tensor> {
        self.own.push_back(s);
        (self.own.len() > GENERATIONS)
            .then(|| self.own.pop_front().map(|old| old.data))
            .flatten()
    }

    /// The buffer the next own snapshot may reuse.
    pub fn spare_own(&mut self) -> Option<Tensor> {
        (self.own.len() >= GENERATIONS)
            .then(|| self.own.pop_front().map(|old| old.data))
            .flatten()
    }

    /// The buffer the next copy from the buddy may be received into: the oldest copy's,
    /// once two are held. That copy is no longer needed: the newer one is whole (it was
    /// received before this step changed the state).
    pub fn spare_held(&mut self) -> Option<Tensor> {
        (self.held.len() >= GENERATIONS)
            .then(|| self.held.pop_front().map(|old| old.data))
            .flatten()
    }

    /// Keeps a copy received from the buddy; the oldest goes.
    pub fn keep_held(&mut self, s: Snapshot) {
        self.held.push_back(s);
        while self.held.len() > GENERATIONS {
            self.held.pop_front();
        }
    }

    /// Every snapshot this process holds, own first.
    pub fn all(&self) -> impl Iterator<Item = &Snapshot> {
        self.own.iter().chain(self.held.iter())
    }

    /// Fault injection for the tests (`FSDP_TRAINER_FAULT_FLIP=own|held`): flips one bit
    /// of every snapshot of that kind, as a bad DIMM or a stray write would, so that the
    /// checksum refuses them at the next restore.
    pub fn flip_for_test(&mut self, which: &str) {
        let kind = match which {
            "own" => &mut self.own,
            "held" => &mut self.held,
            _ => return,
        };
        for s in kind.iter_mut().filter(|s| s.data.numel() > 0) {
            let bits = s.data.view_dtype(Kind::Int);
            let _ = bits.narrow(0, 0, 1).bitwise_xor_(1 << 20);
        }
    }

    /// Host bytes held now: own, then the buddy's.
    pub fn bytes(&self) -> (i64, i64) {
        (
            self.own.iter().map(|s| s.data.numel() as i64 * 4).sum(),
            self.held.iter().map(|s| s.data.numel() as i64 * 4).sum(),
        )
    }
}

/// The host memory snapshots take at most for a part of `len` elements per tensor: two
/// generations of this rank's own part and two of its buddy's (about the same size).
pub fn budget_bytes(len: i64, replicas: bool) -> i64 {
    let one = 3 * len * 4;
    GENERATIONS as i64 * one * if replicas { 2 } else { 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live() -> LiveState {
        let params = Tensor::arange(10, (Kind::Float, tch::Device::Cpu));
        let m = &params * 0.5;
        let v = &params * 0.25;
        LiveState::new(vec![(100, 2, 3), (200, 7, 2)], &params, false, &m, &v)
    }

    fn tag() -> Tag {
        Tag {
            group: 0xfeed,
            world: 3,
            rank: 1,
        }
    }

    fn at() -> At {
        At {
            step: 41,
            samples_seen: 41 * 24,
            adam_step: 41,
        }
    }

    #[test]
    fn a_snapshot_holds_the_runs_and_survives_the_trip() {
        let s = Snapshot::take(tag(), at(), &live(), None);
        assert_eq!(s.runs, [(100, 3), (200, 2)]);
        assert_eq!(
            Vec::<f32>::try_from(&s.data).unwrap(),
            [
                2.0, 3.0, 4.0, 7.0, 8.0, 1.0, 1.5, 2.0, 3.5, 4.0, 0.5, 0.75, 1.0, 1.75, 2.0
            ]
        );
        assert!(s.intact());
        let back = Snapshot::from_parts(&s.header(), s.data.copy()).unwrap();
        assert_eq!((back.tag, back.at, &back.runs), (tag(), at(), &s.runs));
        assert!(back.intact());
        assert!(Snapshot::from_parts(&s.header()[..5], s.data.copy()).is_none());
    }

    #[test]
    fn a_flipped_byte_or_a_changed_header_is_caught() {
        let s = Snapshot::take(tag(), at(), &live(), None);
        let flipped = s.data.copy();
        // One bit of one element's bytes.
        let bits = flipped.view_dtype(Kind::Int);
        let _ = bits.narrow(0, 7, 1).bitwise_xor_(0x0000_0100);
        assert!(!Snapshot::from_parts(&s.header(), flipped).unwrap().intact());
        let mut header = s.header();
        header[3] += 1; // another step
        assert!(
            !Snapshot::from_parts(&header, s.data.copy())
                .unwrap()
                .intact()
        );
    }

    #[test]
    fn two_generations_of_each_are_kept() {
        let mut kept = Snapshots::default();
        for step in 1..=3 {
            let a = At { step, ..at() };
            let reuse = kept.spare_own();
            assert_eq!(
                reuse.is_some(),
                step == 3,
                "a buffer comes back at step {step}"
            );
            assert!(
                kept.keep_own(Snapshot::take(tag(), a, &live(), reuse))
                    .is_none()
            );
            kept.keep_held(Snapshot::take(tag(), a, &live(), None));
        }
        let steps: Vec<u64> = kept.all().map(|s| s.at.step).collect();
        assert_eq!(steps, [2, 3, 2, 3]);
        assert_eq!(kept.bytes(), (2 * 15 * 4, 2 * 15 * 4));
        assert_eq!(budget_bytes(5, true), 4 * 15 * 4);
    }
}
