//! Looking for proof that etcd has no leader, while the session cannot reach it.
//!
//! A lease can only expire through a leader, and a new leader gives every lease a full TTL
//! again ([`crate::fence`]). So when a one-member etcd is seen *down* at `t` — its port
//! refuses connections, or accepts them but nothing answers the first bytes of a
//! connection (a stopped process's kernel accepts for it), or it answers that it has no
//! leader — this agent's lease lives until
//! at least `t + TTL`, and the agent need not fence its workers: everyone is cut off alike
//! and nobody can seal a round without it. A connection that times out proves nothing
//! (this node may be the one cut off), and neither does a member of a larger cluster (the
//! others may still have a quorum): then the lease clock runs out and the agent fences.
//! Neither does a process that answers the connection but not its status in time: it is
//! loaded, and may well have a leader that expires leases.
//!
//! The prober runs only while the session has trouble (a lost connection, or a late
//! keep-alive — unanswered when the fence is a quarter TTL away, and for longer than the
//! last one took and an eighth of a TTL — and no answer yet to the question about the
//! lease asked a sixteenth of a TTL before the look), every TTL/4,
//! waiting TTL/8 per step, so that a healthy run — or a slow one — costs etcd nothing
//! extra.

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
    /// The port accepts connections but nothing reads them: the process is stopped,
    /// or it is starting and not serving yet.
    Silent,
    /// etcd answered and has no leader.
    Leaderless,
    /// etcd answered and has a leader: it works, only this agent's connection did not.
    Led,
    /// etcd's process answered on the fresh connection but not the status request in
    /// time: it runs and is loaded, which proves nothing of its leader. (Taken for
    /// `Silent` before, a status that took longer than an eighth of a TTL under load
    /// was a false proof: at 10,000 nodes thousands of agents extended their lease
    /// clocks from it while etcd, with a leader, could expire their leases.)
    Busy,
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
    dial(addr, patience)
        .await
        .map_or_else(|r| r, |_| Reach::Accepted)
}

/// A connection to `addr` within `patience`, or how it failed.
async fn dial(addr: &str, patience: Duration) -> Result<TcpStream, Reach> {
    match tokio::time::timeout(patience, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(Reach::Refused),
        Ok(Err(_)) | Err(_) => Err(Reach::NoAnswer),
    }
}

/// The first bytes of an HTTP/2 connection: the client preface and an empty SETTINGS
/// frame. etcd's gRPC port answers them with its own SETTINGS at once; a TLS port, or
/// anything else, answers with an alert or by closing. Any of these shows a process that
/// reads its connections.
const HTTP2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// Connects to `addr` and says hello; whether anything came back (bytes, a close, a
/// reset) within `patience`, or how the connection itself failed.
async fn hears_back(addr: &str, patience: Duration) -> Result<bool, Reach> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = dial(addr, patience).await?;
    // A stopped process's kernel still takes the bytes: only the read tells.
    let said = async {
        let _ = stream.write_all(HTTP2_HELLO).await;
        let mut buf = [0u8; 64];
        let _ = stream.read(&mut buf).await;
    };
    Ok(tokio::time::timeout(patience, said).await.is_ok())
}

/// Looks once at the member behind `endpoint`, waiting at most `patience` per step.
pub async fn probe(endpoint: &str, opts: &EtcdOptions, patience: Duration) -> Probe {
    match hears_back(host_port(endpoint), patience).await {
        Ok(true) => {}
        Ok(false) => return Probe::Silent,
        Err(Reach::Refused) => return Probe::Refused,
        Err(_) => return Probe::Unreachable,
    }
    let mut one = opts.clone();
    one.endpoints = vec![endpoint.to_owned()];
    let (Some(url), Ok(o)) = (connect::urls(&one).pop(), connect::options(&one)) else {
        return Probe::Unreachable;
    };
    match connect::ask_member(url, o, patience).await {
        Some((_, false)) => Probe::Leaderless,
        Some((_, true)) => Probe::Led,
        // Its process answered a moment ago; a TLS or credential problem would have
        // stopped the agent at start.
        None => Probe::Busy,
    }
}

impl Probe {
    /// Whether etcd's process was seen to run and answer (loaded, or fine).
    fn lives(self) -> bool {
        matches!(self, Self::Led | Self::Busy)
    }
}

/// How long after a look the next one goes, after `lives` looks in a row that found etcd
/// running: `every`, doubling from the second such look up to `ttl`. Every agent that
/// cannot renew probes; when etcd is merely slow for everyone, a connection from each
/// every quarter TTL was more load on it (100,000 probes a minute at 10,000
/// nodes). A proof that comes later only makes a fence likelier, never a lease outlive
/// its clock.
fn next_look(every: Duration, ttl: Duration, lives: u32) -> Duration {
    (every * (1 << lives.saturating_sub(1).min(4))).min(ttl.max(every))
}

/// A look that found etcd without a leader, sent at `sent`. `silent`: all it found is
/// that nothing answered a fresh connection, which an etcd too loaded to accept in time
/// shows as well as a stopped one (the session weighs that against what it heard).
#[derive(Debug, Clone, Copy)]
pub struct Proof {
    pub sent: Instant,
    pub silent: bool,
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
        proofs: mpsc::UnboundedSender<Proof>,
    ) -> Self {
        let every = ttl / 4;
        // A healthy etcd answers in milliseconds; the proof only counts from when the probe
        // was sent, so it must come back well within the fencing margin.
        let patience = ttl / 8;
        let task = tokio::spawn(async move {
            let mut lives = 0;
            loop {
                let sent = Instant::now();
                let found = probe(&endpoint, &opts, patience).await;
                let silent = found == Probe::Silent;
                if found.proves_no_leader() && proofs.send(Proof { sent, silent }).is_err() {
                    return;
                }
                tracing::debug!(?found, %endpoint, "etcd probe");
                lives = if found.lives() { lives + 1 } else { 0 };
                tokio::time::sleep_until((sent + next_look(every, ttl, lives)).into()).await;
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

    /// A process that answers a fresh connection but not the status request in time is
    /// loaded, not down: no proof. (Before, this was `Silent`, and a proof.) A socket
    /// that only reads is silent still: a stopped process's kernel takes the bytes too.
    #[tokio::test]
    async fn a_member_that_answers_the_connection_but_not_the_status_is_busy_not_silent() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let opts = EtcdOptions::new(vec![]);
        let patience = Duration::from_millis(300);
        // `say`: what each connection is answered with before it is held open and read.
        let listen = |say: &'static [u8]| async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap().to_string();
            tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((mut s, _)) = l.accept().await {
                    let _ = s.write_all(say).await;
                    let mut buf = [0u8; 64];
                    let _ = s.read(&mut buf).await;
                    held.push(s);
                }
            });
            addr
        };
        // An empty SETTINGS frame, as etcd's gRPC port answers the hello.
        let busy = listen(b"\0\0\0\x04\0\0\0\0\0").await;
        assert_eq!(probe(&busy, &opts, patience).await, Probe::Busy);
        let reads_only = listen(b"").await;
        assert_eq!(probe(&reads_only, &opts, patience).await, Probe::Silent);
        // Closing at once (as etcd does with bytes it cannot serve) is an answer too.
        let closer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closer_addr = closer.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((s, _)) = closer.accept().await {
                drop(s);
            }
        });
        assert_eq!(hears_back(&closer_addr, patience).await, Ok(true));
        assert!(!Probe::Busy.proves_no_leader() && Probe::Busy.lives());
    }

    #[test]
    fn looks_at_an_etcd_seen_running_thin_out_to_one_a_ttl() {
        let (every, ttl) = (Duration::from_millis(2500), Duration::from_secs(10));
        let looks: Vec<_> = (0..6)
            .map(|n| next_look(every, ttl, n).as_millis())
            .collect();
        assert_eq!(looks, [2500, 2500, 5000, 10000, 10000, 10000]);
    }
}
