//! Signals to the agent: caught from the first instant, including during the rendezvous,
//! and handed to the run loop as values.
//!
//! The same signal twice within [`REPEAT_WINDOW`] is one request, not two. GNU `timeout`,
//! Slurm and anything else that signals both a process and its process group deliver
//! SIGTERM to the agent twice within microseconds; taking the copy as "a second signal"
//! would escalate to SIGKILL at once and cost the workers their checkpoint-on-SIGTERM.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// How long a repeat of the last signal counts as the same request. Short enough that a
/// person pressing Ctrl-C again on purpose still escalates.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// Whether `sig` at `now` repeats the last signal delivered (`last`) within `window`.
pub fn is_repeat(
    last: Option<(Signal, Instant)>,
    sig: Signal,
    now: Instant,
    window: Duration,
) -> bool {
    last.is_some_and(|(s, at)| s == sig && now.saturating_duration_since(at) < window)
}

/// The signals a run may be asked to handle (torchrun's `--signals-to-handle` choices).
const HANDLEABLE: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// Holds the handleable signals pending from the first instant until [`Signals::install`]
/// releases them. As PID 1 of a container the agent would otherwise lose a SIGTERM sent
/// before its handler exists (the kernel drops a signal whose action is the default for a
/// namespace's init, unless it is blocked), and a pod deleted as it starts would keep
/// running until the kubelet's SIGKILL. Called first thing in `main_entry`, before any
/// thread exists; a signal sent before `main` runs at all cannot be helped. Workers start
/// with an empty mask (the standard library resets it in the child).
pub fn hold_until_handled() {
    let mut set = nix::sys::signal::SigSet::empty();
    for sig in HANDLEABLE {
        set.add(sig);
    }
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_BLOCK,
        Some(&set),
        None,
    );
}

/// Lets the held signals in (on this thread, where the runtime polls): a handled one
/// reaches the run loop, one not handled takes its default action as it would have.
fn release() {
    let mut set = nix::sys::signal::SigSet::empty();
    for sig in HANDLEABLE {
        set.add(sig);
    }
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_UNBLOCK,
        Some(&set),
        None,
    );
}

/// The signals the agent handles (`--signals-to-handle`), as a stream.
pub struct Signals {
    rx: mpsc::UnboundedReceiver<Signal>,
    last: Option<(Signal, Instant)>,
}

impl Signals {
    /// Installs a handler for each signal. Must be called inside the runtime.
    pub fn install(list: &[Signal]) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        for &sig in list {
            let mut stream = signal(SignalKind::from_raw(sig as i32))?;
            let tx = tx.clone();
            // These tasks live as long as the runtime; the agent exits by leaving it.
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        break;
                    }
                }
            });
        }
        release();
        Ok(Self { rx, last: None })
    }

    /// Signals sent by hand through the returned sender, for in-process tests of the loop.
    #[cfg(test)]
    pub fn by_hand() -> (mpsc::UnboundedSender<Signal>, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Self { rx, last: None })
    }

    /// The next signal received, repeats within [`REPEAT_WINDOW`] left out.
    pub async fn recv(&mut self) -> Signal {
        loop {
            let Some(sig) = self.rx.recv().await else {
                // No handler was installed: no signal will ever come.
                return std::future::pending().await;
            };
            let now = Instant::now();
            if is_repeat(self.last, sig, now, REPEAT_WINDOW) {
                tracing::info!(signal = %sig, "the same signal again within {REPEAT_WINDOW:?}: one request, not an escalation");
                continue;
            }
            self.last = Some((sig, now));
            return sig;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_is_the_same_signal_within_the_window() {
        let t0 = Instant::now();
        let w = Duration::from_secs(1);
        let term = Signal::SIGTERM;
        assert!(!is_repeat(None, term, t0, w));
        assert!(is_repeat(
            Some((term, t0)),
            term,
            t0 + Duration::from_millis(5),
            w
        ));
        assert!(!is_repeat(
            Some((term, t0)),
            term,
            t0 + Duration::from_millis(1500),
            w
        ));
        // A different signal is always news (SIGTERM then SIGINT escalates).
        assert!(!is_repeat(Some((term, t0)), Signal::SIGINT, t0, w));
    }
}
