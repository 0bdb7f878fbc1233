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

use crate::c10d::{C10dError, Comm, GroupSpec, ProcessGroup};
use crate::control::{Control, Order};
use crate::engine::Engine;
use crate::snapshot::exchange::{self, Exchange};
use crate::snapshot::{At, Snapshot, Snapshots, Tag};

/// How long a rank whose group broke waits for its agent's new round before failing as a
/// restartable worker would. The agent notices a lost node within its lease TTL and sends
/// the round once the next one forms; it stops this process if it will not re-form it.
pub const ORDER_WAIT: Duration = Duration::from_secs(120);

/// A group of the agent's newest round, being joined on a thread while the old group
/// trains on: a node coming back costs the survivors no wait for its process to start.
struct Joining {
    order: Order,
    handle: Option<std::thread::JoinHandle<Result<ProcessGroup, C10dError>>>,
    /// The group, once the thread made it.
    joined: Option<ProcessGroup>,
}

/// What every rank does after a step, from every rank's [`Flags`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// Train on.
    Go,
    /// Save and stop: a warning, where leaving without a save would lose a part (not every
    /// rank re-forms in place, every rank was warned (a pre-emption of the whole job), or
    /// a warned rank's buddy, which holds its copy, is warned too).
    Stop,
    /// Some ranks were warned (their nodes are leaving) and every part survives them:
    /// the warned ones finish their snapshot copy and stop, the others wait for the round
    /// that forms without them.
    Leave,
    /// Every rank's next group is ready (a node joins: each rank joined the new group in
    /// the background): every rank leaves the old group here and goes on in the new one.
    Reform,
}

/// What one rank says at a step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Flags {
    /// A warning signal reached this rank (its node is leaving, or the job is pre-empted).
    pub warned: bool,
    /// Its next group is joined ([`InPlace::ready`]).
    pub ready: bool,
    /// It re-forms in place.
    pub in_place: bool,
}

/// The decision at a step boundary, from every rank's flags (in rank order) and the rank
/// that holds each rank's snapshot copy (`buddy_of`): the same on every rank.
pub fn boundary(flags: &[Flags], buddy_of: &dyn Fn(usize) -> Option<usize>) -> Boundary {
    let all_in_place = !flags.is_empty() && flags.iter().all(|f| f.in_place);
    let warned: Vec<usize> = (0..flags.len()).filter(|&r| flags[r].warned).collect();
    if warned.is_empty() {
        // Some next groups are not ready yet (or a rank cannot re-form in place, and its
        // agent restarts it, which breaks this group): train on meanwhile.
        return if all_in_place && flags.iter().all(|f| f.ready) {
            Boundary::Reform
        } else {
            Boundary::Go
        };
    }
    let parts_survive = warned
        .iter()
        .all(|&r| buddy_of(r).is_some_and(|b| !flags.get(b).is_some_and(|f| f.warned)));
    if all_in_place && warned.len() < flags.len() && parts_survive {
        Boundary::Leave
    } else {
        Boundary::Stop
    }
}

/// Every rank's flags: one all-gather of three numbers a rank.
pub fn flags(comm: &Comm, device: tch::Device, mine: Flags) -> Result<Vec<Flags>, C10dError> {
    let bit = |b: bool| f32::from(u8::from(b));
    let mut input =
        tch::Tensor::from_slice(&[bit(mine.warned), bit(mine.ready), bit(mine.in_place)])
            .to_device(device);
    let mut all = tch::Tensor::zeros([3 * comm.world() as i64], (tch::Kind::Float, device));
    comm.all_gather(&mut all, &mut input)?;
    let v = Vec::<f32>::try_from(&all.to_device(tch::Device::Cpu)).unwrap_or_default();
    Ok(v.chunks(3)
        .map(|c| Flags {
            warned: c[0] > 0.5,
            ready: c[1] > 0.5,
            in_place: c[2] > 0.5,
        })
        .collect())
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
    /// The runs of the rank whose copy this rank keeps: the size of what it receives.
    from_runs: Vec<(i64, i64)>,
    local_world: usize,
    freq: u64,
    exchange: Option<Exchange>,
    /// How this process's groups meet (the address, port and ranks come with each order).
    template: GroupSpec,
    joining: Option<Joining>,
    pub cost: Cost,
}

impl<'c> InPlace<'c> {
    pub fn new(
        control: &'c mut Control,
        group: u64,
        (comm, engine): (&Comm, &Engine),
        (local_world, freq): (usize, u64),
        template: GroupSpec,
    ) -> Self {
        let (rank, world) = (comm.rank(), comm.world());
        let buddies = exchange::buddies(rank, world, local_world);
        Self {
            control,
            group,
            world,
            rank,
            buddies,
            from_runs: buddies.map_or_else(Vec::new, |(_, from)| engine.runs_of(from, world)),
            local_world,
            freq,
            exchange: None,
            template,
            joining: None,
            cost: Cost::default(),
        }
    }

    /// The rank that keeps a copy of this rank's snapshots, if any.
    pub fn buddy(&self) -> Option<usize> {
        self.buddies.map(|(to, _)| to)
    }

    /// The rank that keeps a copy of rank `rank`'s snapshots, if any.
    pub fn buddy_of(&self, rank: usize) -> Option<usize> {
        exchange::buddies(rank, self.world, self.local_world).map(|(to, _)| to)
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
            let reuse = kept.spare_held();
            let runs = &self.from_runs;
            self.exchange = Some(Exchange::start(pg, &snap, (to, from), runs, reuse)?);
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

    /// Whether this rank's next group is ready. A new order from the agent starts joining
    /// its group on a thread (a newer order supersedes it: the older join is left to its
    /// thread, which ends when its store gives up); the old group trains on meanwhile. A
    /// join that failed is dropped and said: that round is gone, the agent sends another.
    pub fn ready(&mut self) -> bool {
        if let Some(order) = self.control.take() {
            let spec = GroupSpec {
                master_addr: order.launch.master_addr.clone(),
                master_port: order.launch.master_port,
                rank: order.launch.rank,
                world: order.launch.world,
                ..self.template.clone()
            };
            let handle = std::thread::spawn(move || ProcessGroup::connect(&spec));
            self.joining = Some(Joining {
                order,
                handle: Some(handle),
                joined: None,
            });
        }
        let Some(j) = self.joining.as_mut() else {
            return false;
        };
        if let Some(h) = j.handle.take_if(|h| h.is_finished()) {
            match h.join() {
                Ok(Ok(pg)) => j.joined = Some(pg),
                Ok(Err(e)) => {
                    eprintln!(
                        "fsdp-trainer: warning: joining round {}'s group failed ({e}); waiting for the agent's next round",
                        j.order.round
                    );
                    self.joining = None;
                    return false;
                }
                Err(_) => {
                    self.joining = None;
                    return false;
                }
            }
        }
        j.joined.is_some()
    }

    /// The next group: the newest order's, joined in the background when it was, else the
    /// agent's next order (waited for up to `limit`; a warning signal for this process
    /// ends the wait: its node is leaving). Nothing is joined here: the caller ends the
    /// old group first, since a peer may be blocked in it on this rank, and only then
    /// joins (or waits for the join under way: it needs that peer too).
    pub fn next_group(&mut self, limit: Duration) -> Option<Next> {
        if let Some(order) = self.control.take() {
            // Newer than any join under way: that one's round is gone.
            self.joining = None;
            return Some(Next {
                order,
                joining: None,
            });
        }
        if let Some(j) = self.joining.take() {
            let joining = match (j.joined, j.handle) {
                (Some(pg), _) => Some(Ok(pg)),
                (None, Some(h)) => Some(Err(h)),
                (None, None) => None,
            };
            return Some(Next {
                order: j.order,
                joining,
            });
        }
        let order = self
            .control
            .wait(limit, &|| crate::warning::received().is_some())?;
        Some(Next {
            order,
            joining: None,
        })
    }
}

/// A join under way on its thread.
type JoinThread = std::thread::JoinHandle<Result<ProcessGroup, C10dError>>;

/// Where this rank goes next: the agent's order, and its group, joined or being joined.
pub struct Next {
    pub order: Order,
    joining: Option<Result<ProcessGroup, JoinThread>>,
}

impl Next {
    /// The group joined in the background, once its join ends (`None`: none was under
    /// way, or it failed: the caller joins in the foreground and says what fails).
    pub fn joined(&mut self) -> Option<ProcessGroup> {
        match self.joining.take()? {
            Ok(pg) => Some(pg),
            Err(handle) => handle.join().ok()?.ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(warned: bool, ready: bool, in_place: bool) -> Flags {
        Flags {
            warned,
            ready,
            in_place,
        }
    }

    /// Three nodes of one rank: rank r's copy lives on r + 1.
    fn ring(r: usize) -> Option<usize> {
        Some((r + 1) % 3)
    }

    #[test]
    fn every_rank_reads_the_same_boundary_from_the_flags() {
        let go = f(false, false, true);
        let ready = f(false, true, true);
        let warned = f(true, false, true);
        // Nothing happened.
        assert_eq!(boundary(&[go, go, go], &ring), Boundary::Go);
        // A node joins: every rank's next group is ready, and every rank leaves here.
        assert_eq!(boundary(&[ready, ready, ready], &ring), Boundary::Reform);
        // Not yet every rank's: train on until they are.
        assert_eq!(boundary(&[ready, go, ready], &ring), Boundary::Go);
        // A rank that cannot re-form in place is restarted by its agent: train on until
        // that breaks the group.
        assert_eq!(
            boundary(&[ready, ready, f(false, true, false)], &ring),
            Boundary::Go
        );
        // One node leaving (its agent got SIGTERM and warned its worker): its copy is on
        // rank 2, which stays.
        assert_eq!(boundary(&[go, warned, ready], &ring), Boundary::Leave);
        // Two buddies leaving at once: rank 1's copy would go with rank 2. Save instead.
        assert_eq!(boundary(&[go, warned, warned], &ring), Boundary::Stop);
        // The whole job warned (Slurm's pre-emption), a rank that cannot re-form in
        // place, or nowhere off-node to hold a copy: save and stop, as before.
        assert_eq!(boundary(&[warned, warned, warned], &ring), Boundary::Stop);
        assert_eq!(
            boundary(&[go, warned, f(false, false, false)], &ring),
            Boundary::Stop
        );
        assert_eq!(boundary(&[warned, go], &|_| None), Boundary::Stop);
    }
}
