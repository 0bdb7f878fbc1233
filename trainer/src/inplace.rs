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
    handle: std::thread::JoinHandle<Result<ProcessGroup, C10dError>>,
}

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
    /// Every rank's next group is ready (a node joins: each rank joined the new group in
    /// the background): every rank leaves the old group here and goes on in the new one.
    Reform,
}

/// The decision at a step boundary, from the counts of ranks `warned`, whose next group
/// is ready (`ready`) and re-forming in place (`in_place`), in a group of `world`.
pub fn boundary(warned: usize, ready: usize, in_place: usize, world: usize) -> Boundary {
    let all_in_place = in_place == world;
    match (warned, ready) {
        (0, r) if r == world && all_in_place => Boundary::Reform,
        // Some next groups are not ready yet (or a rank cannot re-form in place, and its
        // agent restarts it, which breaks this group): train on meanwhile.
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
    /// How this process's groups meet (the address, port and ranks come with each order).
    template: GroupSpec,
    joining: Option<Joining>,
    pub cost: Cost,
}

impl<'c> InPlace<'c> {
    pub fn new(
        control: &'c mut Control,
        group: u64,
        comm: &Comm,
        (local_world, freq): (usize, u64),
        template: GroupSpec,
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
            template,
            joining: None,
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
            let reuse = kept.spare_held();
            self.exchange = Some(Exchange::start(pg, &snap, (to, from), &runs, reuse)?);
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
    /// thread, which ends when its store gives up); the old group trains on meanwhile.
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
            self.joining = Some(Joining { order, handle });
        }
        self.joining
            .as_ref()
            .is_some_and(|j| j.handle.is_finished())
    }

    /// The next group: the one being joined in the background, else the agent's next
    /// order (waited for up to `limit`; a warning signal for this process ends the wait:
    /// its node is leaving). Nothing is joined here: the caller ends the old group first,
    /// since a peer may be blocked in it on this rank, and only then joins (or waits for
    /// the join under way: it needs that peer too).
    pub fn next_group(&mut self, limit: Duration) -> Option<Next> {
        if let Some(j) = self.joining.take() {
            return Some(Next {
                order: j.order,
                joining: Some(j.handle),
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

/// Where this rank goes next: the agent's order, and the join of its group under way.
pub struct Next {
    pub order: Order,
    joining: Option<std::thread::JoinHandle<Result<ProcessGroup, C10dError>>>,
}

impl Next {
    /// The group joined in the background, once its join ends (`None`: none was under
    /// way, or it failed: the caller joins in the foreground and says what fails).
    pub fn joined(&mut self) -> Option<ProcessGroup> {
        self.joining.take()?.join().ok()?.ok()
    }
}
