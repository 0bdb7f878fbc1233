//! Errors a rendezvous backend reports to the agent.

use std::io;

/// A rendezvous could not produce or keep a round.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// No port could be reserved to publish as `MASTER_PORT`.
    #[error("could not reserve a free TCP port on {addr} for MASTER_PORT")]
    NoFreePort {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The configuration cannot form a group (checked before any round is attempted).
    #[error("invalid rendezvous configuration: {0}")]
    InvalidConfig(String),
    /// etcd could not be reached or refused us, after retrying if retrying could help.
    #[error(
        "{store} at {endpoints} {}: {}; {check}",
        tried(*.retried, .spent),
        crate::etcd::short_cause(.error)
    )]
    Unreachable {
        /// `etcd`, or the c10d store an agent serves.
        store: &'static str,
        endpoints: String,
        /// From the first attempt to giving up (attempts each wait up to the connect
        /// timeout, so this can exceed the retry window).
        spent: std::time::Duration,
        /// What to check, naming only what applies (TLS files when TLS is configured, ...).
        check: String,
        /// Whether the request was tried again: a failure no retry can fix (a wrong
        /// password, a refused CA) ends the first attempt, and saying "retried for 30s"
        /// then sent people looking for a network problem.
        retried: bool,
        /// Said in short in the message (its own text runs to hundreds of characters of
        /// nested transport errors), so not a source (thiserror takes a field named
        /// `source` as one).
        error: etcd_client::Error,
    },
    /// An etcd request failed.
    #[error("etcd request failed: {what}")]
    Etcd {
        what: &'static str,
        #[source]
        source: crate::etcd::Fault,
    },
    /// A value under the run's prefix is not something this agent can trust.
    #[error("{0}; refusing to use it (use another --rdzv-id, or delete the run's keys)")]
    Corrupt(String),
    /// The session task that keeps the lease and the view stopped; nothing more will come.
    #[error("the etcd session ended: {0}")]
    SessionEnded(&'static str),
    /// etcd stayed unreachable longer than the configured bound (`outage_timeout`).
    #[error("{0}; raise --rdzv-conf outage_timeout to wait longer")]
    Outage(String),
    /// A node ended the run for every node; this one exits with the same code.
    #[error("{0}; a new run needs another --rdzv-id (or the run's keys deleted)")]
    Halted(crate::Halt),
    /// Another node of the job runs torchrun ([`fsdp_store::tcpstore`]): what was seen, and
    /// the fix.
    #[error("{0}")]
    TorchrunPeer(String),
    /// The run is another job's ([`crate::job`]): what differs, and the fix.
    #[error("{0}")]
    AnotherJob(String),
    /// No round could be formed in time: what the node waited for, and the fix
    /// ([`crate::etcd::waiting`]).
    #[error("{0}")]
    Timeout(String),
}

/// How the connection failed, as the error says it.
fn tried(retried: bool, spent: &std::time::Duration) -> String {
    if retried {
        // Tenths of a second: what a person compares with the timeouts they set.
        let spent = std::time::Duration::from_millis(spent.as_millis() as u64 / 100 * 100);
        format!("is unreachable or refused the connection (retried for {spent:?})")
    } else {
        "refused the connection on the first attempt (not retried: retrying cannot fix this)".into()
    }
}

/// A store this agent must host and cannot is the user's configuration, as every other
/// refused rendezvous setting.
impl From<fsdp_store::HostError> for RendezvousError {
    fn from(e: fsdp_store::HostError) -> Self {
        Self::InvalidConfig(e.to_string())
    }
}

impl RendezvousError {
    /// Whether the error is the user's configuration (exit 64: fix the command line)
    /// rather than etcd being unavailable (exit 69: retry later). A refused credential or
    /// certificate is configuration: no retry will make it work.
    pub fn is_configuration(&self) -> bool {
        match self {
            Self::InvalidConfig(_) | Self::TorchrunPeer(_) | Self::AnotherJob(_) => true,
            Self::Unreachable { error, .. } => !crate::etcd::is_transient(error),
            _ => false,
        }
    }
}
