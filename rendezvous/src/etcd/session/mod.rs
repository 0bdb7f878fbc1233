//! The etcd session: the one owner of an agent's lease and maker of every etcd write of
//! the agent. It keeps the lease alive, keeps the [`View`](super::View) current through watches, takes
//! part in the coordinator election, seals rounds while coordinator, and serves the
//! agent-facing handle's [`Command`]s between watch events.
//!
//! The protocol is a machine without I/O ([`Machine`], `machine.rs`): `step(now, input)`
//! returns effects — an etcd op to send (at most one in flight; its answer is the next
//! input that counts), a reply to a command, watches to close, a prober to start, a port
//! to find — and [`Machine::deadline`] says when it wants to be woken. What crosses the
//! boundary is in `io.rs` (ops, answers, inputs, effects, [`Command`]s); etcd's errors come
//! in sorted once by the driver into a [`Fault`] (`fault.rs`), so nothing in the machine
//! reads an error's text.
//!
//! The machine's state is in parts, each in its own file with its fields private to it
//! (so each field is written from one file):
//!
//! * `lease.rs` — the lease keeper: the lease, the incarnation, the lease clock, the
//!   keep-alives;
//! * `admission.rs` — a joining node's pace, from how etcd answers (a crowd joins no
//!   faster than etcd drains);
//! * `turn.rs` — a crowd node's turn, and the coordinator's reach for the crowd, which
//!   `admit.rs` publishes;
//! * `outage.rs` — etcd's trouble: failures and busy answers in a row, the prober;
//! * `flight.rs` — the work in hand: the op in flight (and one waiting to go again), the
//!   queued steps, the inputs and commands that wait (`inbox.rs`), the effects;
//! * `duty.rs` — the coordinator's duty: the election in turn, observing and sealing, the
//!   master's port;
//! * `departures.rs` — the records of why nodes left: this node's word when it fences,
//!   and the coordinator's for members lost without one;
//! * `registration.rs` — this node's registration and the round it runs;
//! * `watches.rs` — what the last sync read, the watches it opened, the outage grace;
//! * `published.rs` — the view, changed only through a method that publishes the change.
//!
//! And the steps: `phases.rs` — the phases (syncing, watching, disconnected, ended; the
//! one place the phase changes) and what each does with an input; `sync.rs` — the queued
//! steps ([`sync::Todo`]) from a ranged read to open watches; `rebuild.rs` — what a read
//! rebuilds; `serve.rs` — each command's stages; `state.rs` — small steps on the view and
//! the lease; `records.rs` — the transactions, as data. `driver.rs` is the real driver
//! (etcd-client, the streams, the prober: the only `select!`), with `conn.rs` for how each
//! op goes to etcd. The simulator (`crate::sim`, docs/simulation.md) drives the same
//! machine over the pure store.
//!
//! Every failure of etcd (a closed stream, a restart, lost data) ends in the same place: a
//! fresh ranged read, a rebuilt view, and new watches from the read's revision. The
//! etcd-client lease keeper does not reconnect by itself, so the keep-alive is ours too.
//! With one owner of the lease, a lease found gone is replaced exactly once.

mod admission;
mod admit;
mod conn;
mod departures;
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
pub(super) mod shard_read;
mod state;
mod sync;
#[cfg(test)]
mod tests;
mod turn;
mod watches;

pub use admission::{CROWD, Gate, gated, place_in_crowd};
pub use turn::{Turn, admission_key};
// The join spread's numbers, which the simulator runs scaled down.
#[cfg(feature = "sim")]
pub use admission::{JOINS_PER_SECOND, a_crowd};
pub use conn::{FirstRead, TurnStream, commit_round, lease_holds};
pub use driver::Driver;
pub use io::Command;
// What a driver other than `driver.rs` needs: the simulator's.
pub use fault::{Fault, FaultKind};
#[cfg(any(test, feature = "sim"))]
pub use io::{Answer, CommandId, Compare, Effect, Input, Kv, Op, Role, TxnSpec, WatchEvent, Write};
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
