//! Signals to the agent: caught from the first instant, including during the rendezvous,
//! and handed to the run loop as values.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// The signals the agent handles (`--signals-to-handle`), as a stream.
pub struct Signals {
    rx: mpsc::UnboundedReceiver<Signal>,
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
        Ok(Self { rx })
    }

    /// The next signal received.
    pub async fn recv(&mut self) -> Signal {
        match self.rx.recv().await {
            Some(s) => s,
            // No handler was installed: no signal will ever come.
            None => std::future::pending().await,
        }
    }
}
