//! The log directory's file-system work, on a thread of its own.
//!
//! The runtime thread also keeps the etcd lease alive, so it never waits on a disk: a hung
//! NFS mount or a stalled volume under `--log-dir` would otherwise cost the node its place
//! in the group. Every call into the log directory (emptying and creating an attempt's
//! directories, opening log files, writing worker lines to them, reading error files) runs
//! on this thread, in the order queued. The runtime waits for an answer with a deadline and
//! carries on without one; a job it gave up on before the thread reached it is skipped.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

/// Jobs queued for the thread. Worker lines are most of them, so the queue bounds the
/// memory a stalled disk can cost (lines are at most 64 KiB, see `output::MAX_LINE`).
const QUEUE: usize = 1024;

/// How long a worker's output waits for room in the queue before its lines are dropped
/// from the files. A slow disk slows the worker's pipe this long at most; a stalled one
/// costs lines in the files, never on the console.
const WRITE_PATIENCE: Duration = Duration::from_secs(2);

enum Job {
    Write(Arc<File>, Vec<u8>),
    Call(Box<dyn FnOnce() + Send>),
}

/// A handle to the log-file thread.
#[derive(Clone)]
pub struct Disk {
    tx: mpsc::Sender<Job>,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk")
            .field("dropped", &self.dropped())
            .finish()
    }
}

/// Where a stream's lines to the files stand: a stream that found the queue full stops
/// waiting for room until the disk catches up, so a stalled disk costs its pipe
/// [`WRITE_PATIENCE`] once, not per line.
#[derive(Debug, Default)]
pub struct Backlog {
    stalled: bool,
}

impl Disk {
    /// Starts the thread; it ends when the last handle is dropped.
    pub fn start() -> Self {
        let (tx, mut rx) = mpsc::channel::<Job>(QUEUE);
        std::thread::Builder::new()
            .name("log-files".into())
            .spawn(move || {
                let mut refused = false;
                while let Some(job) = rx.blocking_recv() {
                    match job {
                        // A full disk must not stop the run: the line is lost from the file,
                        // said once (the console still has it if it is tee'd).
                        Job::Write(file, line) => match (&*file).write_all(&line) {
                            Ok(()) => refused = false,
                            Err(e) if !refused => {
                                refused = true;
                                tracing::warn!(error = %e, "a worker log file refused a line; the workers keep running, and lines are lost from the files until it takes them again");
                            }
                            Err(_) => {}
                        },
                        Job::Call(f) => f(),
                    }
                }
            })
            .expect("spawning the log-file thread");
        Self {
            tx,
            dropped: Arc::default(),
        }
    }

    /// Runs `f` on the thread after everything queued before it. `None` when it did not
    /// finish within `patience`: the disk is not answering.
    pub async fn call<T: Send + 'static>(
        &self,
        patience: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (reply, answer) = oneshot::channel();
        let abandoned = Arc::new(AtomicBool::new(false));
        let skip = abandoned.clone();
        let job = Job::Call(Box::new(move || {
            if !skip.load(Ordering::SeqCst) {
                let _ = reply.send(f());
            }
        }));
        let done = async {
            self.tx.send(job).await.ok()?;
            answer.await.ok()
        };
        let out = tokio::time::timeout(patience, done).await.ok().flatten();
        if out.is_none() {
            abandoned.store(true, Ordering::SeqCst);
        }
        out
    }

    /// Waits until every line queued so far is written; `false` after `patience`.
    pub async fn flush(&self, patience: Duration) -> bool {
        self.call(patience, || ()).await.is_some()
    }

    /// Queues `line` for `file`, waiting for room as [`Backlog`] allows; a line that
    /// finds no room is dropped and counted.
    pub async fn write(&self, file: &Arc<File>, line: Vec<u8>, backlog: &mut Backlog) {
        let job = Job::Write(file.clone(), line);
        let queued = if backlog.stalled {
            self.tx.try_send(job).is_ok()
        } else {
            self.tx.send_timeout(job, WRITE_PATIENCE).await.is_ok()
        };
        if queued {
            backlog.stalled = false;
            return;
        }
        if !backlog.stalled {
            tracing::warn!(
                "the worker log files are not being written (a stalled disk?); dropping lines \
                 from the files until it catches up; the console still shows them"
            );
        }
        backlog.stalled = true;
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Lines dropped from the files so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
