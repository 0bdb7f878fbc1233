//! Rebuilding a step from memory in a new group (every rank calls it, in the same order):
//! each rank says which intact snapshots it holds (one all-gather), every rank computes
//! the same [`plan`], then each part is broadcast by its sender and every rank takes its
//! new shard of the assembled state. A joiner holds nothing and receives everything.
//!
//! The whole state is assembled on every rank, in host memory, for the time of the load:
//! simple and world-size independent (it is what a checkpoint load does), and fine for the
//! models this trainer runs on one machine; a rank of a model too large for that would
//! fetch only the runs of its new shard.

use tch::{Device, Kind, Tensor};

use super::plan::{self, Entry, Plan, Short};
use super::{At, Snapshots, Tag};
use crate::c10d::{C10dError, Comm};
use crate::engine::Engine;
use crate::shard::{Assembly, FullState};

/// Snapshots a rank reports at most (two own generations and two of its buddy's).
const SLOTS: usize = 4;
const WORDS: usize = 6;

/// This rank's intact snapshots as fixed-size words: a count, then six words a slot.
fn inventory(kept: &Snapshots) -> Vec<i64> {
    let mut words = vec![0i64; 1 + SLOTS * WORDS];
    let intact: Vec<_> = kept.all().filter(|s| s.intact()).take(SLOTS).collect();
    words[0] = intact.len() as i64;
    for (i, s) in intact.iter().enumerate() {
        words[1 + i * WORDS..1 + (i + 1) * WORDS].copy_from_slice(&[
            s.tag.group as i64,
            i64::from(s.tag.world),
            i64::from(s.tag.rank),
            s.at.step as i64,
            s.at.samples_seen as i64,
            s.at.adam_step as i64,
        ]);
    }
    words
}

/// Every rank's inventory, read back as entries.
fn entries(all: &[i64]) -> Vec<Entry> {
    all.chunks(1 + SLOTS * WORDS)
        .enumerate()
        .flat_map(|(holder, words)| {
            let n = (words[0].max(0) as usize).min(SLOTS);
            (0..n).map(move |i| {
                let w = &words[1 + i * WORDS..1 + (i + 1) * WORDS];
                Entry {
                    holder,
                    tag: Tag {
                        group: w[0] as u64,
                        world: w[1] as u32,
                        rank: w[2] as u32,
                    },
                    at: At {
                        step: w[3] as u64,
                        samples_seen: w[4] as u64,
                        adam_step: w[5] as u64,
                    },
                }
            })
        })
        .collect()
}

/// Broadcasts `t` (on the host) from `root` through `device` (NCCL takes device tensors).
fn broadcast(comm: &Comm, t: Tensor, root: usize, device: Device) -> Result<Tensor, C10dError> {
    let mut on = t.to_device(device);
    comm.broadcast(&mut on, root)?;
    Ok(on.to_device(Device::Cpu))
}

/// Which step the group can rebuild from memory (a collective: one all-gather of every
/// rank's inventory): the plan, or why none.
pub fn survey(
    comm: &Comm,
    device: Device,
    kept: &Snapshots,
) -> Result<Result<Plan, Short>, C10dError> {
    let mine = Tensor::from_slice(&inventory(kept)).to_device(device);
    let mut all = Tensor::zeros(
        [(comm.world() * (1 + SLOTS * WORDS)) as i64],
        (Kind::Int64, device),
    );
    comm.all_gather(&mut all, &mut mine.shallow_clone())?;
    let all = Vec::<i64>::try_from(&all.to_device(Device::Cpu)).unwrap_or_default();
    Ok(plan::plan(&entries(&all)))
}

/// Rebuilds `plan`'s step into `engine` (a collective) and returns where it stands.
pub fn rebuild(
    comm: &Comm,
    device: Device,
    kept: &Snapshots,
    plan: &Plan,
    engine: &mut Engine,
) -> Result<At, C10dError> {
    let full = assemble(comm, device, kept, plan, engine.numel())?;
    engine.load(&full, plan.at.adam_step);
    Ok(plan.at)
}

/// Each part of `plan`'s step, broadcast by its sender, written into the whole state.
fn assemble(
    comm: &Comm,
    device: Device,
    kept: &Snapshots,
    plan: &Plan,
    total: i64,
) -> Result<FullState, C10dError> {
    let mut whole = Assembly::new(total);
    let bad = |message: String| C10dError {
        op: "restore",
        message,
    };
    for (rank, &sender) in plan.senders.iter().enumerate() {
        let tag = Tag {
            group: plan.group,
            world: plan.world,
            rank: rank as u32,
        };
        let held = (comm.rank() == sender)
            .then(|| kept.all().find(|s| s.tag == tag && s.at == plan.at))
            .flatten();
        let sizes = held.map_or([0, 0], |s| [s.header().len() as i64, s.data.numel() as i64]);
        let sizes = broadcast(comm, Tensor::from_slice(&sizes), sender, device)?;
        let (words, len) = (sizes.int64_value(&[0]), sizes.int64_value(&[1]));
        if words <= 0 {
            return Err(bad(format!(
                "rank {sender} was to send rank {rank}'s part and holds none"
            )));
        }
        let header = held.map_or_else(
            || Tensor::zeros([words], (Kind::Int64, Device::Cpu)),
            |s| Tensor::from_slice(&s.header()),
        );
        let data = held.map_or_else(
            || Tensor::empty([len], (Kind::Float, Device::Cpu)),
            |s| s.data.shallow_clone(),
        );
        let header = broadcast(comm, header, sender, device)?;
        let data = broadcast(comm, data, sender, device)?;
        let words = Vec::<i64>::try_from(&header).unwrap_or_default();
        let part = super::Snapshot::from_parts(&words, data)
            .filter(|p| p.tag == tag && p.at == plan.at && p.intact())
            .ok_or_else(|| bad(format!("rank {rank}'s part came back damaged")))?;
        let n = part.len();
        let data = &part.data;
        whole
            .add(
                part.runs.iter().copied(),
                [
                    &data.narrow(0, 0, n),
                    &data.narrow(0, n, n),
                    &data.narrow(0, 2 * n, n),
                ],
            )
            .map_err(|why| bad(format!("rank {rank}'s part: {why}")))?;
    }
    whole.finish().map_err(|(covered, total)| {
        bad(format!(
            "the parts hold {covered} of the model's {total} elements"
        ))
    })
}
