//! The etcd v3 backend: lease-bound membership, a coordinator elected through etcd,
//! rounds committed by fenced transactions, and watch-driven change detection.
//!
//! # How a round forms
//!
//! 1. Each agent grants a lease (TTL `keep_alive_ttl`) and writes its [`v1::Member`](fsdp_proto::v1::Member)
//!    record under `members/` with that lease, saying which round it is ready for.
//! 2. One agent holds `ctl/coordinator` (a lease-bound create-if-absent). It watches the
//!    registrations and asks [`crate::seal::decide`] whether to seal; when yes it writes
//!    `ctl/round` in a transaction fenced on the revision of the round it replaces.
//! 3. The round's group rank 0 picks a free port and writes `ctl/master` (the coordinator,
//!    when it is rank 0, in the seal's own transaction); every member
//!    that sees the round and its master returns from [`EtcdRendezvous::next_round`](crate::Rendezvous::next_round).
//!
//! Every etcd write of an agent after its lease grant is made by one task, the session
//! (`session/`), which owns the lease; [`EtcdRendezvous`] asks it for writes through
//! commands and reads the [`View`] it publishes.
//!
//! Per round each agent writes its registration once; the coordinator and rank 0 write one
//! key each: O(N) writes, no key that every node compare-and-swaps in a loop.
//!
//! # How a round ends
//!
//! A member's key disappears (its lease expired, or it left and revoked it), a failure is
//! reported under `ctl/failures/`, or the coordinator seals a newer round (to admit a
//! waiting node). Each agent sees this in its watch ([`detect`]) and stops its workers.

mod backend;
mod connect;
mod coordinator;
pub(crate) mod errors;
#[cfg(all(test, feature = "sim"))]
mod explore;
mod handle;
pub mod inspect;
mod joining;
mod keys;
pub mod left;
pub mod liveness;
pub mod placement;
mod probe;
pub mod record;
pub mod roster;
pub(crate) mod session;
#[cfg(test)]
mod tests;
mod token;
mod view;
pub(crate) mod waiter;
pub mod waiting;

use std::time::Duration;

pub use connect::{EtcdOptions, TlsFiles, connect, reader, watcher};
pub use errors::{overloaded as is_overloaded, short_cause, transient as is_transient};
pub use keys::Keys;
pub use record::Allowed;
pub use session::{Fault, FaultKind, commit_round, lease_holds, place_in_crowd};
pub use view::View;

/// Members above which a round is placed ([`EtcdConfig::placement_above`]): at 1,000 a
/// whole round and a placed one cost the same (0.106 and 0.110 s to reach every member,
/// `rdzv-bench --ceiling-round`), and a whole round keeps what only the whole gives (a
/// member that judges any departure from the round by itself, the round put back by any
/// member after etcd lost its data).
pub const PLACEMENT_ABOVE: usize = 2_000;

/// Configuration of one agent's etcd rendezvous.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub options: EtcdOptions,
    /// Key prefix; the run's keys live under `<prefix>/<run_id>/`.
    pub prefix: String,
    pub run_id: String,
    /// Unique id of this agent; generated from host name, pid and a random suffix if empty.
    pub node_id: String,
    /// Address this node advertises (becomes `MASTER_ADDR` when it is group rank 0).
    pub addr: String,
    pub local_world_size: u32,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub last_call: Duration,
    /// How long `next_round` waits for a round before giving up.
    pub join_timeout: Duration,
    /// Lease TTL: a dead agent is noticed within this time.
    pub keep_alive_ttl: Duration,
    /// How long a re-form waits for a surviving member that does not come back.
    pub straggler_timeout: Duration,
    /// How long before its lease can expire an agent that cannot renew it stops its
    /// workers ([`crate::fence`]); `None`: [`crate::fence::default_margin`] of the TTL.
    pub fence_margin: Option<Duration>,
    /// How long etcd may stay unreachable mid-run before the agent gives up.
    pub outage_timeout: Duration,
    /// Where this agent's status port answers (`host:port`), if it serves one: its ring
    /// neighbour watches it ([`liveness`]).
    pub status_addr: Option<String>,
    /// What this node accepts from the records others write (a round's size is also
    /// bounded by `max_nodes`).
    pub allowed: Allowed,
    /// The store this agent serves ([`fsdp_store::StoreServer::torchrun_clients`]): a
    /// torchrun client reaching it ends the rendezvous ([`RendezvousError::TorchrunPeer`](crate::RendezvousError::TorchrunPeer)).
    pub torchrun_clients: Option<tokio::sync::watch::Receiver<Option<std::net::IpAddr>>>,
    /// The agent's restart budget, told to `fsdp-agent status` in its registration.
    pub budget: Budget,
    /// What makes agents one job ([`crate::job::fingerprint`]); empty: no check.
    pub job: String,
    /// Where this node sits in the network, checked ([`crate::topology::check`]); empty:
    /// no location. The coordinator orders ranks by it.
    pub segment: String,
    /// Rounds are made of whole blocks of this many nodes of one segment
    /// ([`crate::topology::blocks`]); 1: of any nodes.
    pub segment_size: u32,
    /// This agent serves the c10d store, freshly started and empty: the other agents of a
    /// running job are on their way back ([`crate::etcd::session`]'s re-registration
    /// grace).
    pub fresh_store: bool,
    /// Set once this agent's standby took over the c10d store's port (its predecessor
    /// gone): the store it serves from then on is as fresh. Read when the session
    /// starts, after the join reached the store, so a standby that took over meanwhile
    /// counts ([`EtcdConfig::serves_a_fresh_store`]).
    pub store_taken_over: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// A round of more members than this is placed ([`placement`]): a header to every
    /// member and each member's part in a shard it reads, not the whole round to each.
    pub placement_above: usize,
    /// How a placed round is cut ([`placement::Shape::ETCD`]: for etcd's limits); a
    /// finer cut makes a test's few nodes write their shards ahead as thousands do.
    pub placement_shape: placement::Shape,
}

/// An agent's restart budget as it was given it (`--max-restarts`, the restart window).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Budget {
    /// `None` where the agent did not say (the status tool, tests).
    pub max_restarts: Option<u32>,
    /// The restart window in seconds; 0 for none.
    pub window_s: u64,
}

impl EtcdConfig {
    /// Defaults for everything but the endpoints, run id and group size.
    pub fn new(endpoints: Vec<String>, run_id: &str, min_nodes: u32, max_nodes: u32) -> Self {
        Self {
            options: EtcdOptions::new(endpoints),
            prefix: "/fsdp".into(),
            run_id: run_id.into(),
            node_id: String::new(),
            addr: "127.0.0.1".into(),
            local_world_size: 1,
            min_nodes,
            max_nodes,
            last_call: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            keep_alive_ttl: Duration::from_secs(5),
            straggler_timeout: Duration::from_secs(30),
            fence_margin: None,
            outage_timeout: Duration::from_secs(900),
            status_addr: None,
            allowed: Allowed::default(),
            torchrun_clients: None,
            budget: Budget::default(),
            job: String::new(),
            segment: String::new(),
            segment_size: 1,
            fresh_store: false,
            store_taken_over: None,
            placement_above: PLACEMENT_ABOVE,
            placement_shape: placement::Shape::ETCD,
        }
    }
}

impl EtcdConfig {
    /// Whether this agent serves a store that started empty, as the session starts: one
    /// it started itself, or one its standby took over before the join reached it (a host
    /// restarted while its predecessor still held the port). Decided at start-up alone,
    /// the second kind joined without the grace and, as coordinator, sealed at once with
    /// the first members back and admitted the others one round each.
    pub fn serves_a_fresh_store(&self) -> bool {
        self.fresh_store
            || self
                .store_taken_over
                .as_ref()
                .is_some_and(|f| f.load(std::sync::atomic::Ordering::Acquire))
    }
}

impl EtcdConfig {
    /// The fencing margin in effect.
    pub fn margin(&self) -> Duration {
        self.fence_margin
            .unwrap_or_else(|| crate::fence::default_margin(self.keep_alive_ttl))
    }
}

/// A unique node id: host name, pid and a random suffix, so agents that share a host name
/// and a pid (PID 1 in containers) are still told apart.
pub fn new_node_id() -> String {
    let host = crate::hostname().replace('/', "_");
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("{host}-{}-{suffix}", std::process::id())
}

pub use handle::EtcdRendezvous;
pub use joining::{detect, hang_report};
