//! The background writer of sharded saves: at most one save in flight per rank. Training
//! hands it a host copy of the rank's part and goes on; it waits only when the next save
//! comes before this one is written, or at the end.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CheckpointError, sharded};
use crate::shard::LocalState;

/// This rank's save in flight, if any.
#[derive(Default)]
pub struct Writer {
    job: Option<Job>,
}

struct Job {
    step: u64,
    state: Progress,
}

enum Progress {
    Writing(JoinHandle<Result<Duration, CheckpointError>>),
    Written(Result<Duration, CheckpointError>),
}

impl Writer {
    /// Starts writing `local` as this rank's shard of step `step`'s checkpoint.
    pub fn start(
        &mut self,
        step: u64,
        partial: PathBuf,
        rank: usize,
        world: usize,
        local: LocalState,
    ) {
        debug_assert!(self.job.is_none(), "one save in flight at a time");
        let handle = std::thread::spawn(move || {
            let started = Instant::now();
            sharded::write_shard(&partial, step, rank, world, &local)?;
            Ok(started.elapsed())
        });
        self.job = Some(Job {
            step,
            state: Progress::Writing(handle),
        });
    }

    /// The step whose save is in flight (written or not, not yet made complete).
    pub fn in_flight(&self) -> Option<u64> {
        self.job.as_ref().map(|j| j.step)
    }

    /// Whether this rank's shard is written (or failed), waiting for it when `wait`.
    pub fn written(&mut self, wait: bool) -> Option<&Result<Duration, CheckpointError>> {
        let job = self.job.as_mut()?;
        if let Progress::Writing(h) = &job.state {
            if !wait && !h.is_finished() {
                return None;
            }
            let Progress::Writing(h) =
                std::mem::replace(&mut job.state, Progress::Written(Ok(Duration::ZERO)))
            else {
                unreachable!()
            };
            let result = h.join().unwrap_or_else(|_| {
                Err(CheckpointError::Io {
                    path: PathBuf::from("(checkpoint writer)"),
                    source: std::io::Error::other("the writer thread panicked"),
                })
            });
            job.state = Progress::Written(result);
        }
        match &job.state {
            Progress::Written(r) => Some(r),
            Progress::Writing(_) => None,
        }
    }

    /// Ends the save in flight (its result was read through [`Self::written`]).
    pub fn clear(&mut self) -> Option<u64> {
        self.job.take().map(|j| j.step)
    }
}
