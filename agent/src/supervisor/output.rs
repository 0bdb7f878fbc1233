//! Worker output: prefixed lines on the console, files per attempt, filtered copies.
//!
//! Lines from all workers go through one bounded channel to one console thread. A slow
//! console therefore slows the workers' pipes (as a terminal would), never the agent's
//! runtime, and lines from different workers never interleave mid-line. Lines for the log
//! files go the same way to the log-file thread ([`Disk`]), where a stalled disk costs lines
//! in the files after a short wait, never the runtime.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::mpsc;

use super::disk::{Backlog, Disk};

/// Which of the agent's streams a line goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A handle to the console thread, and to the log-file thread that goes with it.
#[derive(Debug, Clone)]
pub struct Console {
    tx: mpsc::Sender<(Stream, Vec<u8>)>,
    disk: Disk,
}

/// Owns the console thread; [`ConsoleThread::close`] writes out every queued line, to the
/// console and to the log files.
pub struct ConsoleThread {
    console: Console,
    /// Resolves when the thread has written everything and stopped.
    finished: tokio::sync::oneshot::Receiver<()>,
}

/// An empty line on this stream tells the console thread to stop (real lines always end
/// in a newline, so they are never empty).
const CLOSE: (Stream, Vec<u8>) = (Stream::Stdout, Vec::new());

/// How long the agent waits for a console that is not being read (a full pipe, a stopped
/// terminal) before it gives up on the lines still queued. Exiting, stopping workers and
/// leaving the rendezvous never wait on the terminal longer than this.
const CONSOLE_PATIENCE: Duration = Duration::from_secs(2);

impl ConsoleThread {
    /// Waits until every line queued so far is written, or [`CONSOLE_PATIENCE`] when
    /// nobody reads the console. Lines still being pumped by workers that outlive this
    /// call are dropped; the agent is exiting.
    pub async fn close(self) {
        let disk = &self.console.disk;
        if !disk.flush(CONSOLE_PATIENCE).await {
            tracing::warn!(
                "the worker log directory is not answering; dropping the lines still queued for the log files"
            );
        }
        if disk.dropped() > 0 {
            tracing::warn!(
                lines = disk.dropped(),
                "lines of worker output were left out of the log files because the disk did not keep up"
            );
        }
        let written = async {
            if self.console.tx.send(CLOSE).await.is_ok() {
                let _ = self.finished.await;
            }
        };
        if tokio::time::timeout(CONSOLE_PATIENCE, written)
            .await
            .is_err()
        {
            // The thread stays blocked in `write`; the process exit ends it.
            tracing::warn!(
                "the console is not being read (a full pipe?); dropping the worker output still queued"
            );
        }
    }
}

impl Console {
    /// Writes `bytes` (ending in a newline) after every line queued before it. Waits at
    /// most [`CONSOLE_PATIENCE`] for room in the queue: the agent's own messages (a
    /// failure summary) must not stall its loop when the console is not being read.
    pub async fn write(&self, stream: Stream, bytes: Vec<u8>) {
        // An error means the console thread stopped: the agent is exiting.
        let _ = self
            .tx
            .send_timeout((stream, bytes), CONSOLE_PATIENCE)
            .await;
    }

    /// The log-file thread, for everything the workers' log directory needs.
    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    /// Starts the console thread and the log-file thread.
    pub fn start() -> (Self, ConsoleThread) {
        let (tx, mut rx) = mpsc::channel::<(Stream, Vec<u8>)>(1024);
        let (done, finished) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("console".into())
            .spawn(move || {
                let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
                while let Some((stream, line)) = rx.blocking_recv() {
                    if line.is_empty() {
                        break;
                    }
                    // Console write errors (a closed terminal) must not stop the workers.
                    let _ = match stream {
                        Stream::Stdout => out.write_all(&line).and_then(|()| out.flush()),
                        Stream::Stderr => err.write_all(&line).and_then(|()| err.flush()),
                    };
                }
                let _ = done.send(());
            })
            .expect("spawning the console thread");
        let console = Self {
            tx,
            disk: Disk::start(),
        };
        (console.clone(), ConsoleThread { console, finished })
    }
}

/// Where one worker stream's lines go.
pub struct Sinks {
    pub console: Option<(Console, Stream, String)>,
    pub file: Option<Arc<File>>,
    /// Lines containing any of these substrings are also copied to the shared file.
    pub filters: Vec<String>,
    pub filtered: Option<Arc<File>>,
    /// Writes the files.
    pub disk: Disk,
    /// The last lines, kept in memory for a failure's summary ([`Tail`]).
    pub tail: Option<Tail>,
}

/// The last [`crate::failure::TAIL_LINES`] lines of a stream that goes to a log file, kept
/// in memory: a full or stalled disk keeps them out of the file, and a failed worker's
/// traceback was lost there (`stderr.log` 0 bytes on a full log directory).
#[derive(Debug, Clone, Default)]
pub struct Tail(Arc<std::sync::Mutex<TailLines>>);

#[derive(Debug, Default)]
struct TailLines {
    lines: std::collections::VecDeque<String>,
    /// The pump read the stream to its end.
    ended: bool,
}

impl Tail {
    /// The lines; a pump that panicked holding them leaves them as they were.
    fn lock(&self) -> std::sync::MutexGuard<'_, TailLines> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line).trim_end().to_owned();
        let mut t = self.lock();
        if t.lines.len() == crate::failure::TAIL_LINES {
            t.lines.pop_front();
        }
        t.lines.push_back(text);
    }

    fn end(&self) {
        self.lock().ended = true;
    }

    /// The lines kept, once the pump read the stream to its end or after `patience` (the
    /// worker's own children may keep the pipe open).
    pub async fn lines(&self, patience: Duration) -> Vec<String> {
        let until = tokio::time::Instant::now() + patience;
        while !self.lock().ended && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.lock().lines.iter().cloned().collect()
    }
}

/// Longest line kept whole; longer output is split so one runaway worker cannot make the
/// agent buffer without bound.
const MAX_LINE: u64 = 64 * 1024;

/// Copies a worker stream line by line to its sinks until the stream ends.
pub async fn pump(reader: impl AsyncRead + Unpin, mut sinks: Sinks) {
    let mut reader = BufReader::new(reader);
    let mut line = Vec::new();
    let mut backlog = Backlog::default();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        if let Some(tail) = &sinks.tail {
            tail.push(&line);
        }
        if let Some(file) = &sinks.file {
            sinks.disk.write(file, line.clone(), &mut backlog).await;
        }
        if let Some(filtered) = &sinks.filtered {
            let text = String::from_utf8_lossy(&line);
            if sinks.filters.iter().any(|f| text.contains(f.as_str())) {
                sinks.disk.write(filtered, line.clone(), &mut backlog).await;
            }
        }
        if let Some((console, stream, prefix)) = &sinks.console {
            let mut out = Vec::with_capacity(prefix.len() + line.len());
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            if console.tx.send((*stream, out)).await.is_err() {
                sinks.console = None;
            }
        }
    }
    if let Some(tail) = &sinks.tail {
        tail.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last lines of a stream are kept in memory whatever the disk does: a full log
    /// directory lost a failed worker's traceback.
    #[test]
    fn the_last_lines_are_kept_in_memory_even_when_no_file_takes_them() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // /dev/full refuses every write with ENOSPC.
            let full = Arc::new(File::options().write(true).open("/dev/full").unwrap());
            let tail = Tail::default();
            let input: Vec<u8> = (0..30)
                .flat_map(|i| format!("line {i}\n").into_bytes())
                .collect();
            let sinks = Sinks {
                console: None,
                file: Some(full),
                filters: Vec::new(),
                filtered: None,
                disk: Disk::start(),
                tail: Some(tail.clone()),
            };
            pump(&input[..], sinks).await;
            let lines = tail.lines(Duration::from_secs(1)).await;
            assert_eq!(lines.len(), crate::failure::TAIL_LINES);
            assert_eq!(lines.first().map(String::as_str), Some("line 20"));
            assert_eq!(lines.last().map(String::as_str), Some("line 29"));
        });
    }

    /// A pipe nobody reads stands for a stalled disk: a write blocks once its buffer is full.
    #[test]
    fn a_stalled_log_file_costs_lines_in_the_file_never_the_runtime() {
        let (read_end, write_end) = nix::unistd::pipe().unwrap();
        let file = Arc::new(File::from(write_end));
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let disk = Disk::start();
                // Far more than the pipe's buffer and the queue together.
                let input: Vec<u8> = (0..20_000)
                    .flat_map(|i| format!("line {i} of a worker that logs a lot\n").into_bytes())
                    .collect();
                let sinks = Sinks {
                    console: None,
                    file: Some(file),
                    filters: Vec::new(),
                    filtered: None,
                    disk: disk.clone(),
                    tail: None,
                };
                pump(&input[..], sinks).await;
                let _ = done.send(disk.dropped());
            });
        });
        let dropped = finished
            .recv_timeout(Duration::from_secs(60))
            .expect("the pump blocked on a log file that cannot be written");
        assert!(dropped > 0, "nothing was dropped");
        drop(read_end);
    }
}
