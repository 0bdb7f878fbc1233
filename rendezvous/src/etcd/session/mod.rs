//! The etcd session: the one owner of an agent's lease and maker of every etcd write of
//! the agent. It keeps the lease alive, keeps the [`View`](super::View) current through watches, takes
//! part in the coordinator election, seals rounds while coordinator, and serves the
//! agent-facing handle's [`Command`]s between watch events.
//!
//! The protocol is a machine without I/O ([`Machine`], `machine.rs`): `step(now, input)`
//! returns effects — an etcd op to send (at most one in flight; its answer is the next
//! input that counts), a reply to a command, watches to close, a prober to start — and
//! [`Machine::deadline`] says when it wants to be woken. Its parts:
//!
//! * `io.rs` — the data that crosses the boundary: [`Op`], [`Answer`], [`Input`],
//!   [`Effect`], [`Command`];
//! * `machine.rs` — the state, [`Machine::step`] and the one op in flight;
//! * `inbox.rs` — the inputs that wait while an op is in flight;
//! * `phases.rs` — the phases (syncing, watching, disconnected, ended) and what each does
//!   with an input: watch batches, keep-alive answers, timers, commands; outages;
//! * `state.rs` — small steps on the state: the view, the lease, the incarnation;
//! * `sync.rs` — the queued steps ([`sync::Todo`]) from a ranged read to open watches,
//!   and the coordinator's seal;
//! * `serve.rs` — each command's ops and answers;
//! * `records.rs` — the transactions, as data;
//! * `departures.rs` — the records of why nodes left: this node's word when it fences,
//!   and the coordinator's for members lost without one;
//! * `driver.rs` — the real driver: etcd-client, the streams, the prober (the only
//!   `select!`). The simulator (`crate::sim`, docs/simulation.md) drives the same machine
//!   over the pure store.
//!
//! Every failure of etcd (a closed stream, a restart, lost data) ends in the same place: a
//! fresh ranged read, a rebuilt view, and new watches from the read's revision. The
//! etcd-client lease keeper does not reconnect by itself, so the keep-alive is ours too.
//! With one owner of the lease, a lease found gone is replaced exactly once.

mod departures;
mod conn;
mod driver;
mod duty;
mod fault;
mod flight;
mod inbox;
mod io;
mod lease;
mod machine;
mod outage;
mod phases;
mod published;
mod rebuild;
mod records;
mod registration;
mod serve;
mod state;
mod sync;
mod watches;
#[cfg(test)]
mod tests;

pub use conn::{commit_round, lease_holds};
pub use driver::Driver;
pub use io::Command;
// What a driver other than `driver.rs` needs: the simulator's.
#[cfg(any(test, feature = "sim"))]
pub use io::{
    Answer, CommandId, Compare, Effect, Input, Kv, Op, Role, TxnSpec, WatchEvent, Write,
};
pub use fault::{Fault, FaultKind};
pub use machine::{Config, Machine, first_incarnation};
#[cfg(any(test, feature = "sim"))]
pub use machine::{Phase, Resync};

use tokio::sync::oneshot;

use crate::RendezvousError;

/// A command and where its outcome goes.
#[derive(Debug)]
pub struct Request {
    pub command: Command,
    pub reply: Option<oneshot::Sender<Result<(), RendezvousError>>>,
}
