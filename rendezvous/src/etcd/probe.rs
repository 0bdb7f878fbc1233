//! Looking for proof that etcd has no leader, while the session cannot reach it.
//!
//! A lease can only expire through a leader, and a new leader gives every lease a full TTL
//! again ([`crate::fence`]). So when a one-member etcd is seen *down* at `t` — its port
//! refuses connections, or accepts them but serves nothing (etcd serves clients only once
//! it has a leader), or it answers that it has no leader — this agent's lease lives until
//! at least `t + TTL`, and the agent need not fence its workers: everyone is cut off alike
//! and nobody can seal a round without it. A connection that times out proves nothing
//! (this node may be the one cut off), and neither does a member of a larger cluster (the
//! others may still have a quorum): then the lease clock runs out and the agent fences.
//!
//! The prober runs only while the session has trouble (a lost connection, or no
//! keep-alive answered when the fence is a quarter TTL away), every TTL/4, waiting TTL/8
//! per step, so that a healthy run — or a slow one — costs etcd nothing extra.

use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::connect::{self, EtcdOptions};

/// What one look at the etcd member found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Nothing listens: no etcd process runs there.
    Refused,
    /// The port accepts connections but etcd does not answer: it is starting (it serves
    /// clients only once it has a leader) or stalled.
    Silent,
    /// etcd answered and has no leader.
    Leaderless,
    /// etcd answered and has a leader: it works, only this agent's connection did not.
    Led,
    /// The connection timed out or failed otherwise: maybe this node is cut off.
    Unreachable,
}

impl Probe {
    /// Whether this finding proves that no leader can expire a lease (for a one-member
    /// etcd).
    pub fn proves_no_leader(self) -> bool {
        matches!(self, Self::Refused | Self::Silent | Self::Leaderless)
    }
}

/// `host:port` of an endpoint given as `[scheme://]host:port`.
pub fn host_port(endpoint: &str) -> &str {
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    rest.trim_end_matches('/')
}

/// What a plain TCP connection to an address found (the first step of the prober here and
/// of the liveness watcher in `liveness.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Something listens (the kernel completed the handshake).
    Accepted,
    /// Nothing listens there.
    Refused,
    /// No answer in time, or another error.
    NoAnswer,
}

/// Connects to `addr` (`host:port`) and closes again, waiting at most `patience`.
pub async fn reach(addr: &str, patience: Duration) -> Reach {
    match tokio::time::timeout(patience, TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Reach::Accepted,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Reach::Refused,
        Ok(Err(_)) | Err(_) => Reach::NoAnswer,
    }
}

/// Looks once at the member behind `endpoint`, waiting at most `patience` per step.
pub async fn probe(endpoint: &str, opts: &EtcdOptions, patience: Duration) -> Probe {
    match reach(host_port(endpoint), patience).await {
        Reach::Accepted => {}
        Reach::Refused => return Probe::Refused,
        Reach::NoAnswer => return Probe::Unreachable,
    }
    let mut one = opts.clone();
    one.endpoints = vec![endpoint.to_owned()];
    let (Some(url), Ok(o)) = (connect::urls(&one).pop(), connect::options(&one)) else {
        return Probe::Unreachable;
    };
    match connect::ask_member(url, o, patience).await {
        Some((_, false)) => Probe::Leaderless,
        Some((_, true)) => Probe::Led,
        // It accepted the connection a moment ago; a TLS or credential problem would have
        // stopped the agent at start.
        None => Probe::Silent,
    }
}

/// A running prober; dropping it stops it.
pub struct Prober(AbortHandle);

impl Drop for Prober {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Prober {
    /// Probes `endpoint` every `ttl / 4` and sends the time of every look that proves etcd
    /// has no leader (the session extends its lease clock from it).
    pub fn start(
        endpoint: String,
        opts: EtcdOptions,
        ttl: Duration,
        proofs: mpsc::UnboundedSender<Instant>,
    ) -> Self {
        let every = ttl / 4;
        // A healthy etcd answers in milliseconds; the proof only counts from when the probe
        // was sent, so it must come back well within the fencing margin.
        let patience = ttl / 8;
        let task = tokio::spawn(async move {
            loop {
                let sent = Instant::now();
                let found = probe(&endpoint, &opts, patience).await;
                if found.proves_no_leader() && proofs.send(sent).is_err() {
                    return;
                }
                tracing::debug!(?found, %endpoint, "etcd probe");
                tokio::time::sleep_until((sent + every).into()).await;
            }
        });
        Self(task.abort_handle())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_lose_their_scheme() {
        assert_eq!(host_port("http://10.0.0.1:2379"), "10.0.0.1:2379");
        assert_eq!(host_port("https://etcd:2379/"), "etcd:2379");
        assert_eq!(host_port("etcd:2379"), "etcd:2379");
    }

    #[tokio::test]
    async fn a_closed_port_is_refused_and_a_listener_that_never_answers_is_silent() {
        let opts = EtcdOptions::new(vec![]);
        let patience = Duration::from_millis(300);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let found = probe(&format!("127.0.0.1:{port}"), &opts, patience).await;
        assert_eq!(found, Probe::Refused);
        // A socket that accepts (the kernel completes the handshake) and never speaks,
        // as a starting etcd does.
        let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = mute.local_addr().unwrap();
        let found = probe(&addr.to_string(), &opts, patience).await;
        assert_eq!(found, Probe::Silent);
        assert!(Probe::Silent.proves_no_leader() && !Probe::Unreachable.proves_no_leader());
        assert!(!Probe::Led.proves_no_leader());
    }
}
