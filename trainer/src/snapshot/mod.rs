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
            .filter(|t| t.numel() == 3 * len as usize && host_floats(t).is_some())
            .unwrap_or_else(|| Tensor::empty([3 * len], (Kind::Float, tch::Device::Cpu)));
        let runs = live.runs();
        let mut sum = Checksum::new(&header_words(tag, at, &runs));
        let mut at_elem = 0;
        for (t, runs) in [
            (&live.params, &in_params),
            (&live.m, &in_moments),
            (&live.v, &in_moments),
        ] {
            for &(offset, n) in runs {
                let mut to = data.narrow(0, at_elem, n);
                let from = t.narrow(0, offset, n);
                // SAFETY: `to` is part of this snapshot's own buffer, which nothing else
                // reads or writes until it is kept (a reused one's copy was fenced).
                let dst = unsafe { host_floats_mut(&to) };
                if let (Some(src), Some(dst)) = (host_floats(&from), dst) {
                    // One pass over memory: each chunk is summed while it is in cache.
                    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
                        d.copy_from_slice(s);
                        sum.add(bytes_of(d));
                    }
                } else {
                    // A device tensor: copied by libtorch, then summed.
                    tch::no_grad(|| to.copy_(&from));
                    let d = host_floats(&to).expect("a snapshot's buffer is f32 on the host");
                    sum.add(bytes_of(d));
                }
                at_elem += n;
            }
        }
        Self {
            tag,
            at,
            runs,
            data,
            checksum: sum.finish(),
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

/// Floats copied and summed at a time: small enough to be summed from cache.
const CHUNK: usize = 16 * 1024;

/// A contiguous f32 CPU tensor's elements; `None` for any other tensor.
fn host_floats(t: &Tensor) -> Option<&[f32]> {
    let ok = t.device() == tch::Device::Cpu && t.kind() == Kind::Float && t.is_contiguous();
    match t.numel() {
        _ if !ok => None,
        // An empty tensor's data pointer may be null, which no slice may have.
        0 => Some(&[]),
        // SAFETY: a contiguous, non-empty f32 CPU tensor of numel elements, alive for the
        // borrow of `t`.
        n => Some(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, n) }),
    }
}

/// [`host_floats`], writable.
///
/// # Safety
/// No other reference to these elements (through this tensor or any that shares its
/// storage) may be used while the slice lives.
#[allow(clippy::mut_from_ref)]
unsafe fn host_floats_mut(t: &Tensor) -> Option<&mut [f32]> {
    let n = host_floats(t)?.len();
    // SAFETY: as host_floats; exclusive by the caller's promise.
    Some(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) })
}

fn bytes_of(f: &[f32]) -> &[u8] {
    // SAFETY: any f32 is four readable bytes; u8 has no alignment.
    unsafe { std::slice::from_raw_parts(f.as_ptr() as *const u8, std::mem::size_of_val(f)) }
}

/// Header words then data bytes, mixed a 64-bit word at a time (FNV-1a's constants) in
/// four independent lanes, so that the multiplies overlap and the sum runs near memory
/// speed (it is taken of every snapshot, every step): a flipped byte anywhere changes it;
/// it is not meant to resist anyone choosing the bytes. Bytes come in pieces
/// ([`Self::add`]); the sum is that of the pieces one after the other.
struct Checksum {
    lanes: [u64; 4],
    /// A block begun by one piece and ended by the next.
    partial: Vec<u8>,
    bytes: u64,
}

impl Checksum {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    const BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const BLOCK: usize = 32;

    fn mix(h: u64, w: u64) -> u64 {
        (h ^ w).wrapping_mul(Self::PRIME).rotate_left(23)
    }

    fn new(header: &[i64]) -> Self {
        let b = Self::BASIS;
        let mut lanes = [b, b ^ 1, b ^ 2, b ^ 3];
        for (i, &w) in header.iter().enumerate() {
            lanes[i % 4] = Self::mix(lanes[i % 4], w as u64);
        }
        Self {
            lanes,
            partial: Vec::with_capacity(Self::BLOCK),
            bytes: 0,
        }
    }

    fn add(&mut self, mut raw: &[u8]) {
        self.bytes += raw.len() as u64;
        if !self.partial.is_empty() {
            let take = (Self::BLOCK - self.partial.len()).min(raw.len());
            self.partial.extend_from_slice(&raw[..take]);
            raw = &raw[take..];
            if self.partial.len() < Self::BLOCK {
                return;
            }
            let block = std::mem::take(&mut self.partial);
            self.blocks(&block);
            self.partial = block;
            self.partial.clear();
        }
        let whole = raw.len() / Self::BLOCK * Self::BLOCK;
        self.blocks(&raw[..whole]);
        self.partial.extend_from_slice(&raw[whole..]);
    }

    fn blocks(&mut self, raw: &[u8]) {
        for b in raw.chunks_exact(Self::BLOCK) {
            for (lane, w) in self.lanes.iter_mut().zip(b.chunks_exact(8)) {
                *lane = Self::mix(*lane, u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
            }
        }
    }

    fn finish(mut self) -> u64 {
        for (i, &b) in self.partial.iter().enumerate() {
            self.lanes[i % 4] = Self::mix(self.lanes[i % 4], u64::from(b) | (i as u64) << 8);
        }
        self.lanes.iter().fold(self.bytes, |h, &l| Self::mix(h, l))
    }
}

/// The checksum of a header and a tensor's bytes, as [`Snapshot::take`] computes it.
fn checksum(header: &[i64], data: &Tensor) -> u64 {
    let mut sum = Checksum::new(header);
    let data = data.contiguous();
    if let Some(d) = host_floats(&data) {
        sum.add(bytes_of(d));
    }
    sum.finish()
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
    fn the_sum_of_pieces_is_the_sum_of_the_whole() {
        // Pieces that end inside a block, shorter than one, and empty.
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = {
            let mut c = Checksum::new(&[5, -1]);
            c.add(&bytes);
            c.finish()
        };
        for cuts in [
            vec![0, 1000],
            vec![0, 5, 37, 37, 64, 999, 1000],
            vec![0, 31, 33, 1000],
        ] {
            let mut c = Checksum::new(&[5, -1]);
            for w in cuts.windows(2) {
                c.add(&bytes[w[0]..w[1]]);
            }
            assert_eq!(c.finish(), whole, "{cuts:?}");
        }
        // The bytes count, not only their values: a zero appended changes the sum.
        let mut c = Checksum::new(&[5, -1]);
        c.add(&bytes);
        c.add(&[0]);
        assert_ne!(c.finish(), whole);
        // What take() computes while it copies is what intact() recomputes.
        assert!(Snapshot::take(tag(), at(), &live(), None).intact());
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
