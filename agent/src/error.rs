//! The one error type of the agent's run, and the exit code each error means.
//!
//! Configuration errors found before anything starts are [`crate::config::ConfigError`]
//! (always exit 64); everything that can go wrong once the agent runs is an
//! [`AgentError`], and [`AgentError::exit_code`] is the only place that maps one to the
//! table in [`crate::exit_code`].

use std::path::PathBuf;

use fsdp_rendezvous::RendezvousError;

use crate::exit_code;
use crate::supervisor::SpawnError;

/// Why the agent's run ended in an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The status address the user chose cannot be bound.
    #[error("--status-addr {addr} cannot be bound ({source}); pick a free port or 'off'")]
    StatusAddrBusy {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    #[error("creating log directory under {path}")]
    LogDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
}

impl AgentError {
    /// The agent's exit status for this error (see [`crate::exit_code`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Rendezvous(r) if r.is_configuration() => exit_code::CONFIG,
            Self::Rendezvous(_) => exit_code::RENDEZVOUS_UNAVAILABLE,
            Self::StatusAddrBusy { .. } => exit_code::CONFIG,
            Self::Spawn(_) | Self::LogDir { .. } | Self::Signals(_) => exit_code::INTERNAL,
        }
    }

    /// The error and its causes on one line, outermost first: `a: b: c`.
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            let text = s.to_string();
            // Some messages quote their cause already (e.g. the busy status address).
            if !out.contains(&text) {
                out = format!("{out}: {text}");
            }
            source = s.source();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_has_its_exit_code() {
        let config = AgentError::Rendezvous(RendezvousError::InvalidConfig("x".into()));
        assert_eq!(config.exit_code(), exit_code::CONFIG);
        let gone = AgentError::Rendezvous(RendezvousError::SessionEnded("x"));
        assert_eq!(gone.exit_code(), exit_code::RENDEZVOUS_UNAVAILABLE);
        let logs = AgentError::LogDir {
            path: "/x".into(),
            source: std::io::Error::other("disk full"),
        };
        assert_eq!(logs.exit_code(), exit_code::INTERNAL);
        assert_eq!(logs.chain(), "creating log directory under /x: disk full");
    }
}
