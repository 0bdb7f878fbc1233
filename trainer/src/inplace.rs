//! Re-forming in place: the loop's side of fsdp-agent's in-place re-form (docs/goodput.md).
//! The process keeps running when its group changes: it snapshots every step into peer
//! memory ([`crate::snapshot`]), and when a peer is lost (a collective fails) or its agent
//! sends a new round (a node joins or leaves), it leaves the group at a step boundary,
//! joins the new one and rebuilds the newest step held whole in memory.
//!
//! At every step boundary the ranks agree, with one all-reduce, on three counts: ranks
//! warned by a signal, ranks holding a new round, and ranks that re-form in place; then
//! [`boundary`] says what every rank does, the same on each.

use std::time::{Duration, Instant};

use crate::c10d::{C10dError, Comm};
use crate::control::{Control, Order};
use crate::engine::Engine;
use crate::snapshot::exchange::{self, Exchange};
use crate::snapshot::{At, Snapshot, Snapshots, Tag};

/// How long a rank whose group broke waits for its agent's new round before failing as a
/// restartable worker would. The agent notices a lost node within its lease TTL and sends
/// the round once the next one forms; it stops this process if it will not re-form it.
pub const ORDER_WAIT: Duration = Duration::from_secs(120);

/// What every rank does after a step, from the counts summed over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// Train on.
    Go,
    /// Save and stop (a warning, and not every rank re-forms in place, or every rank was
    /// warned: a pre-emption of the whole job).
    Stop,
    /// Some ranks were warned (their nodes are leaving) and the rest re-form in place:
    /// the warned ones finish their snapshot copy and stop, the others wait for the round
    /// that forms without them.
    Leave,
    /// A new round is waiting (a node joins, or one was lost): every rank leaves the group
    /// here and joins the next one.
    Reform,
}

/// The decision at a step boundary, from the counts of ranks `warned`, holding a new
/// round (`pending`) and re-forming in place (`in_place`), in a group of `world`.
pub fn boundary(warned: usize, pending: usize, in_place: usize, world: usize) -> Boundary {
    let all_in_place = in_place == world;
    match (warned, pending) {
        (0, 0) => Boundary::Go,
        (0, _) if all_in_place => Boundary::Reform,
        // A round offered to some of a group that cannot re-form in place: their agents
        // fall back to a restart; train on until it comes.
        (0, _) => Boundary::Go,
        (w, _) if all_in_place && w < world => Boundary::Leave,
        _ => Boundary::Stop,
    }
}

/// The counts [`boundary`] reads: one all-reduce of three numbers.
pub fn counts(
    comm: &Comm,
    device: tch::Device,
    warned: bool,
    pending: bool,
    in_place: bool,
) -> Result<(usize, usize, usize), C10dError> {
    let mut t = tch::Tensor::from_slice(&[
        f32::from(u8::from(warned)),
        f32::from(u8::from(pending)),
        f32::from(u8::from(in_place)),
    ])
    .to_device(device);
    comm.all_reduce_sum(&mut t)?;
    let v = Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).unwrap_or_default();
    let n = |i: usize| v.get(i).copied().unwrap_or(0.0).round() as usize;
    Ok((n(0), n(1), n(2)))
}

/// Snapshot overhead, for the closing line.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cost {
    pub taken: u64,
    pub spent: Duration,
}

/// One process group's in-place state: the control socket, the group's id, the buddies,
/// the copy in flight.
pub struct InPlace<'c> {
    pub control: &'c mut Control,
    group: u64,
    world: usize,
    rank: usize,
    buddies: Option<(usize, usize)>,
    freq: u64,
    exchange: Option<Exchange>,
    pub cost: Cost,
}

impl<'c> InPlace<'c> {
    pub fn new(
        control: &'c mut Control,
        group: u64,
        comm: &Comm,
        local_world: usize,
        freq: u64,
    ) -> Self {
        let (rank, world) = (comm.rank(), comm.world());
        Self {
            control,
            group,
            world,
            rank,
            buddies: exchange::buddies(rank, world, local_world),
            freq,
            exchange: None,
            cost: Cost::default(),
        }
    }

    /// The rank that keeps a copy of this rank's snapshots, if any.
    pub fn buddy(&self) -> Option<usize> {
        self.buddies.map(|(to, _)| to)
    }

    /// Snapshots the state after step `at.step` (when due) and starts copying it to the
    /// buddy. The copy before it finished at this step's fence ([`Self::fence`]).
    pub fn after_step(
        &mut self,
        kept: &mut Snapshots,
        engine: &Engine,
        comm: &Comm,
        at: At,
        force: bool,
    ) -> Result<(), C10dError> {
        if !force && (self.freq == 0 || at.step % self.freq != 0) {
            return Ok(());
        }
        let began = Instant::now();
        // The copy in flight (a forced snapshot right after a restore has none).
        self.fence(kept)?;
        let tag = Tag {
            group: self.group,
            world: self.world as u32,
            rank: self.rank as u32,
        };
        let snap = Snapshot::take(tag, at, &engine.live_state(comm), kept.spare_own());
        if let (Some(pg), Some((to, from))) = (comm.group(), self.buddies) {
            let runs = engine.runs_of(from, self.world);
            self.exchange = Some(Exchange::start(pg, &snap, (to, from), &runs)?);
        }
        kept.keep_own(snap);
        self.cost.taken += 1;
        self.cost.spent += began.elapsed();
        Ok(())
    }

    /// Finishes the copy in flight: the buddy's snapshot is kept. Called before the
    /// optimizer changes the state again, and before leaving the group.
    pub fn fence(&mut self, kept: &mut Snapshots) -> Result<(), C10dError> {
        let Some(x) = self.exchange.take() else {
            return Ok(());
        };
        let began = Instant::now();
        let got = x.finish();
        self.cost.spent += began.elapsed();
        kept.keep_held(got?);
        Ok(())
    }

    /// After the group broke: whatever of the copy in flight arrived is kept, the rest is
    /// given up (the peer is gone or is leaving too).
    pub fn settle(&mut self, kept: &mut Snapshots) {
        if let Some(x) = self.exchange.take() {
            if let Ok(s) = x.finish() {
                kept.keep_held(s);
            }
        }
    }

    /// Whether the agent sent a new round.
    pub fn pending(&mut self) -> bool {
        self.control.pending()
    }

    /// Waits for the agent's round (up to `limit`); a warning signal for this process
    /// ends the wait (its node is leaving).
    pub fn wait_order(&mut self, limit: Duration) -> Option<Order> {
        self.control
            .wait(limit, &|| crate::warning::received().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_reads_the_same_boundary_from_the_counts() {
        // Nothing happened.
        assert_eq!(boundary(0, 0, 3, 3), Boundary::Go);
        // One rank's agent sent a new round: everyone leaves here, even the ranks whose
        // agents have not sent theirs yet.
        assert_eq!(boundary(0, 1, 3, 3), Boundary::Reform);
        // ...unless some rank cannot re-form in place: its agent restarts it, and the
        // rest train on until theirs stop them.
        assert_eq!(boundary(0, 1, 2, 3), Boundary::Go);
        // One node leaving (its agent got SIGTERM and warned its worker).
        assert_eq!(boundary(1, 0, 3, 3), Boundary::Leave);
        assert_eq!(boundary(1, 2, 3, 3), Boundary::Leave);
        // The whole job warned (Slurm's pre-emption), or ranks that cannot re-form in
        // place: save and stop, as before.
        assert_eq!(boundary(3, 0, 3, 3), Boundary::Stop);
        assert_eq!(boundary(1, 0, 2, 3), Boundary::Stop);
        assert_eq!(boundary(1, 0, 0, 1), Boundary::Stop);
    }
}
