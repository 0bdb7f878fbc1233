//! Saving checkpoints from the training loop. Sharded (the default): each rank hands its
//! live state to its background [`Writer`] and trains on; the optimizer's next update
//! waits until the writer has read it ([`Saver::fence`]); the lead's writer makes the
//! checkpoint complete as soon as every shard is in the shared directory. Once a step,
//! while a save is in flight, one all-reduce asks whether every rank's part is done, to
//! report it (and stop every rank if one failed). The next save, and the end of training,
//! wait for the one in flight. Gathered
//! (`--sharded_checkpoints=0`): the whole state is gathered on the lead and written there
//! while every rank waits, as before.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use tch::{Device, Tensor};

use crate::c10d::Comm;
use crate::checkpoint::writer::{Lead, Writer};
use crate::checkpoint::{self, Meta, sharded};
use crate::engine::Engine;

/// The lead's result of its part of a save, agreed by every rank (a collective): when it
/// failed every rank stops, the lead with its error, instead of the others waiting in the
/// next collective until it times out.
pub fn lead_result<T>(
    comm: &Comm,
    device: Device,
    result: Result<Option<T>, checkpoint::CheckpointError>,
    step: u64,
) -> anyhow::Result<Option<T>> {
    let failed = comm.sum_over_ranks(f32::from(u8::from(result.is_err())), device)?;
    match result {
        Err(e) => Err(e.into()),
        Ok(_) if failed > 0.0 => {
            bail!("the lead rank could not complete the checkpoint of step {step} (see its error)")
        }
        Ok(v) => Ok(v),
    }
}

/// A rank's answer to "is your shard written?", summed over ranks.
const WRITING: f32 = 1.0;
/// The lead's shard is written and it waits for the others': a sum of exactly this says
/// every other rank has written its own.
const LEAD_WAITING: f32 = 0.5;
const FAILED: f32 = 1_000_000.0;

pub struct Saver {
    /// Where the collectives' small tensors live (NCCL takes device tensors only).
    device: Device,
    dir: PathBuf,
    keep: usize,
    sharded: bool,
    /// The same on every rank of this run: names the partial directories they share.
    token: u64,
    writer: Writer,
    /// The manifest of the save in flight, for the lead to write, when it began and how
    /// long training paused for it.
    pending: Option<(Meta, Instant, Duration)>,
}

impl Saver {
    /// Agrees on this run's token (a collective: every rank calls it).
    pub fn new(
        dir: PathBuf,
        keep: usize,
        sharded: bool,
        comm: &Comm,
        device: Device,
    ) -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mine = (i64::from(std::process::id()) << 20) ^ i64::from(nanos >> 12);
        let mut token = Tensor::from_slice(&[mine]).to_device(device);
        comm.broadcast(&mut token, 0)?;
        Ok(Self {
            device,
            dir,
            keep,
            sharded,
            token: token.int64_value(&[0]) as u64,
            writer: Writer::default(),
            pending: None,
        })
    }

    /// Saves `meta.step`'s state: in the background, or (gathered, or the `last` save) to
    /// the end. Returns how long training paused for it.
    pub fn save(
        &mut self,
        engine: &Engine,
        comm: &Comm,
        meta: Meta,
        last: bool,
        say: &dyn Fn(String),
    ) -> anyhow::Result<Duration> {
        let paused = Instant::now();
        if !self.sharded {
            let saved = engine
                .full_state(comm, comm.rank() == 0)?
                .map(|state| checkpoint::save(&self.dir, &meta, &state, self.keep))
                .transpose();
            // Nobody runs ahead of a save that may still fail.
            let path = lead_result(comm, self.device, saved, meta.step)?;
            if let Some(path) = path {
                say(format!(
                    "Saved checkpoint {} (step {}, sample {}; gathered, training paused {:.3} s)",
                    path.display(),
                    meta.step,
                    meta.samples_seen,
                    paused.elapsed().as_secs_f64()
                ));
            }
            return Ok(paused.elapsed());
        }
        // At most one in flight: the next save waits for the last.
        self.complete(comm, true, say)?;
        let began = Instant::now();
        let live = engine.live_state(comm);
        let partial = sharded::partial_dir(&self.dir, meta.step, self.token);
        let lead = (comm.rank() == 0).then(|| Lead {
            dir: self.dir.clone(),
            meta: meta.clone(),
            keep: self.keep,
            token: self.token,
        });
        self.writer
            .start(meta.step, partial, (comm.rank(), comm.world()), live, lead);
        self.pending = Some((meta, began, paused.elapsed()));
        if last {
            self.complete(comm, true, say)?;
            comm.barrier()?;
        }
        Ok(paused.elapsed())
    }

    /// Before the optimizer changes the state: waits until the save in flight has read it.
    /// Returns how long it waited (training paused for the save).
    pub fn fence(&mut self) -> Duration {
        let waited = self.writer.fence();
        if let Some((_, _, paused)) = &mut self.pending {
            *paused += waited;
        }
        waited
    }

    /// Once a step: completes the save in flight if every rank's shard is written.
    pub fn poll(&mut self, comm: &Comm, say: &dyn Fn(String)) -> anyhow::Result<()> {
        self.complete(comm, false, say)
    }

    /// Completes the save in flight once every rank has written its shard, waiting for
    /// this rank's when `wait` (every rank passes the same `wait`: it is a collective).
    fn complete(&mut self, comm: &Comm, wait: bool, say: &dyn Fn(String)) -> anyhow::Result<()> {
        let Some(step) = self.writer.in_flight() else {
            return Ok(());
        };
        let lead = comm.rank() == 0;
        let ended = self.writer.thread_ended();
        let (code, written_in) = match self.writer.shard_written(wait) {
            None => (WRITING, Duration::ZERO),
            Some(Err(e)) => {
                eprintln!("fsdp-trainer: error: writing this rank's checkpoint shard: {e}");
                (FAILED, Duration::ZERO)
            }
            // The lead's part is done when the checkpoint is complete; waiting, it waits
            // for that below, once every rank has said its shard is written.
            Some(Ok(_)) if lead && !wait && !ended => (LEAD_WAITING, Duration::ZERO),
            Some(Ok(took)) => (0.0, *took),
        };
        let sum = comm.sum_over_ranks(code, self.device)?;
        if sum >= f64::from(FAILED) {
            self.writer.abandon();
            bail!(
                "the checkpoint of step {step} could not be written (see the failing ranks' errors)"
            );
        }
        if sum > 0.0 {
            if sum == f64::from(LEAD_WAITING) {
                // Their shards are written: if the lead cannot see them, the directory is
                // not shared, and it says so after a grace instead of at the next save.
                self.writer.others_written();
            }
            return Ok(());
        }
        let finished = self.writer.end();
        let pending = self.pending.take();
        let finished = lead_result(comm, self.device, finished, step)?;
        if let (Some(done), Some((meta, began, paused))) = (finished, pending) {
            say(format!(
                "Saved checkpoint {} (step {step}, sample {}; {} shards written in the background, rank 0's in {:.2} s; complete {:.2} s after the step, training paused {:.3} s)",
                done.path.display(),
                meta.samples_seen,
                comm.world(),
                written_in.as_secs_f64(),
                done.at.duration_since(began).as_secs_f64(),
                paused.as_secs_f64()
            ));
        }
        Ok(())
    }
}
