//! The embedded store of `--rdzv-backend c10d`: multi-node training without an etcd.
//!
//! torchrun's c10d backend keeps the rendezvous in a TCP store served by the agent whose
//! host matches `--rdzv-endpoint`. We keep that deployment (same flag, same endpoint, same
//! "who hosts" rule) but not a second protocol: the agent that hosts serves the part of
//! etcd's v3 API the rendezvous uses, and every agent, the host included, runs the etcd
//! rendezvous against it through its ordinary etcd client. Fenced rounds, leases, re-forms,
//! the restart budget and the status view are the etcd backend's, unchanged.
//!
//! What it cannot survive is the host: the store lives in one agent's memory, so when that
//! agent dies the others lose the rendezvous (as every torchrun c10d job does). A host
//! that comes back within the others' outage window serves an empty store, and they
//! register again as they would after an etcd restart without data (once its
//! predecessor's process has let go of the port: it stands by until then); otherwise the
//! job ends. etcd is the resilient choice.
//!
//! * [`state`]: the keys, revisions, leases and watch history, pure.
//! * [`service`]: the gRPC services over that state.
//! * [`auth`]: etcd's password authentication ([`auth::Gate`]): tokens from
//!   `Authenticate`, checked on every call when a password is configured.
//! * [`tls`]: the rustls acceptor from the certificate, key and client CA files.
//! * [`bounded_listener`]: a bounded accept loop for any axum router (connection cap from
//!   the open-file limit, timeouts, eviction, accept back-off, optional stream slots);
//!   the store serves on it, and so does the agent's status port, with limits of its own.
//! * [`server`]: [`StoreServer`], those services behind the gate on that loop, and how it
//!   closes; [`Security`] says who gets in.
//! * [`tcpstore`]: torchrun's TCPStore, as far as telling a torchrun node apart (a probe of
//!   an address, a client's greeting), so that a job run half under torchrun fails in
//!   seconds instead of waiting forever.
//! * [`host`]: whether this agent serves ([`decide_host`], a pure function of what binding
//!   the endpoint found; [`host::bind`] does the binding, [`host_if_here`] both), and the
//!   [`host::Standby`] of an agent that found the port taken on its own machine: it serves
//!   once the port is free, should the holder have been its own predecessor, still dying.
//!
//! A crate of its own, below the rendezvous: the agent serves it, and the rendezvous
//! crate's deterministic simulator runs [`state`] as its etcd. It knows nothing of the
//! rendezvous; what it needs from the agent (this machine's host name) is passed in.

pub mod auth;
pub mod bounded_listener;
pub mod host;
pub mod server;
pub mod service;
pub mod state;
pub mod streams;
pub mod tcpstore;
pub mod tls;

pub use auth::Credentials;
pub use host::{DEFAULT_PORT, HostError, Hosted, decide_host, host_if_here};
pub use server::{Security, StoreServer};
pub use tls::ServerTls;
