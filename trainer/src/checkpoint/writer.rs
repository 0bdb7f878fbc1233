//! The background writer of sharded saves: at most one save in flight per rank. Its thread
//! writes the rank's shard from the live tensors (no copy: the optimizer's next update
//! waits in [`Writer::fence`] until they are read) and, on the lead, waits for every
//! rank's shard in the shared directory and writes the manifest as soon as the last one is
//! there, so a checkpoint is complete when its slowest shard is written, not at a step.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CheckpointError, Meta, invalid, sharded};
use crate::shard::LiveState;

/// How long the lead looks for shards that every rank has said are written before it
/// calls the directory unshared (a network filesystem may show a new name late).
const UNSEEN_GRACE: Duration = Duration::from_secs(30);

/// What the lead needs to make the checkpoint complete.
pub struct Lead {
    pub dir: PathBuf,
    pub meta: Meta,
    pub keep: usize,
    pub token: u64,
}

/// The lead's finished checkpoint: where, and when it became complete.
pub struct Finished {
    pub path: PathBuf,
    pub at: Instant,
}

/// This rank's save in flight, if any.
#[derive(Default)]
pub struct Writer {
    job: Option<Job>,
}

struct Job {
    step: u64,
    /// Disconnected once the thread no longer reads the live tensors.
    reading: Option<Receiver<()>>,
    /// This rank's shard, written (in how long) or failed: sent once.
    shard: Receiver<Result<Duration, CheckpointError>>,
    shard_result: Option<Result<Duration, CheckpointError>>,
    /// The lead's thread stops waiting for the others' shards when set.
    cancel: Arc<AtomicBool>,
    /// Every rank has said its shard is written: the lead stops waiting after a grace.
    reported: Arc<AtomicBool>,
    thread: JoinHandle<Result<Option<Finished>, CheckpointError>>,
}

impl Writer {
    /// Starts writing `live` as this rank's shard of step `step`'s checkpoint; the lead
    /// then completes the checkpoint.
    pub fn start(
        &mut self,
        step: u64,
        partial: PathBuf,
        (rank, world): (usize, usize),
        live: LiveState,
        lead: Option<Lead>,
    ) {
        debug_assert!(self.job.is_none(), "one save in flight at a time");
        let (done_reading, reading) = mpsc::channel::<()>();
        let (shard_tx, shard) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let reported = Arc::new(AtomicBool::new(false));
        let (stop, all_said) = (cancel.clone(), reported.clone());
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let written =
                sharded::write_shard(&partial, step, rank, world, &live, || drop(done_reading));
            drop(live);
            let ok = written.is_ok();
            let _ = shard_tx.send(written.map(|_| started.elapsed()));
            match lead {
                Some(lead) if ok => {
                    await_shards(&partial, world, &stop, &all_said)?;
                    let path = sharded::finish(
                        &lead.dir, &partial, &lead.meta, world, lead.keep, lead.token,
                    )?;
                    Ok(Some(Finished {
                        path,
                        at: Instant::now(),
                    }))
                }
                _ => Ok(None),
            }
        });
        self.job = Some(Job {
            step,
            reading: Some(reading),
            shard,
            shard_result: None,
            cancel,
            reported,
            thread,
        });
    }

    /// Waits until the save in flight no longer reads the live tensors: call it before
    /// anything changes them. Returns how long it waited.
    pub fn fence(&mut self) -> Duration {
        let began = Instant::now();
        if let Some(reading) = self.job.as_mut().and_then(|j| j.reading.take()) {
            // Only ever disconnected: the thread drops its end when it is done reading.
            let _ = reading.recv();
        }
        began.elapsed()
    }

    /// The step whose save is in flight (written or not, not yet made complete).
    pub fn in_flight(&self) -> Option<u64> {
        self.job.as_ref().map(|j| j.step)
    }

    /// Whether this rank's shard is written (or failed), waiting for it when `wait`.
    pub fn shard_written(&mut self, wait: bool) -> Option<&Result<Duration, CheckpointError>> {
        let job = self.job.as_mut()?;
        if job.shard_result.is_none() {
            let got = if wait {
                job.shard.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                job.shard.try_recv()
            };
            job.shard_result = match got {
                Ok(r) => Some(r),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Err(panicked())),
            };
        }
        job.shard_result.as_ref()
    }

    /// Whether the thread has ended (on the lead: the checkpoint is complete, or failed).
    pub fn thread_ended(&self) -> bool {
        self.job.as_ref().is_some_and(|j| j.thread.is_finished())
    }

    /// Ends the save in flight once every rank has said its shard is written: on the lead,
    /// waits for the checkpoint to be complete and returns it.
    pub fn end(&mut self) -> Result<Option<Finished>, CheckpointError> {
        let Some(job) = self.job.take() else {
            return Ok(None);
        };
        job.reported.store(true, Ordering::Relaxed);
        job.thread.join().unwrap_or_else(|_| Err(panicked()))
    }

    /// Every other rank has said its shard is written: the lead's wait for them is bounded
    /// from now on.
    pub fn others_written(&self) {
        if let Some(job) = &self.job {
            job.reported.store(true, Ordering::Relaxed);
        }
    }

    /// Abandons the save in flight (another rank's shard failed): the lead stops waiting.
    pub fn abandon(&mut self) {
        if let Some(job) = self.job.take() {
            job.cancel.store(true, Ordering::Relaxed);
        }
    }
}

/// The lead's wait for every rank's shard to appear in `partial`.
fn await_shards(
    partial: &std::path::Path,
    world: usize,
    cancel: &AtomicBool,
    reported: &AtomicBool,
) -> Result<(), CheckpointError> {
    let mut pause = Duration::from_millis(1);
    let mut reported_at = None;
    loop {
        let seen = sharded::shards_written(partial, world);
        if seen == world {
            return Ok(());
        }
        if cancel.load(Ordering::Relaxed) {
            return Err(invalid(partial, "abandoned: another rank's shard failed"));
        }
        if reported.load(Ordering::Relaxed) {
            let since = *reported_at.get_or_insert_with(Instant::now);
            if since.elapsed() > UNSEEN_GRACE {
                return Err(invalid(
                    partial,
                    format!(
                        "{} of {world} shards are missing though their ranks wrote them: every rank must see the same --checkpoint_dir (a filesystem all nodes share)",
                        world - seen
                    ),
                ));
            }
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn panicked() -> CheckpointError {
    CheckpointError::Io {
        path: PathBuf::from("(checkpoint writer)"),
        source: std::io::Error::other("the writer thread panicked"),
    }
}
