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
}
