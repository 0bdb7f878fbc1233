//! torchrun's TCPStore, as far as telling a node that runs torchrun apart.
//!
//! A job run half under torchrun and half under fsdp-agent waits forever: each side waits
//! for the other's protocol (torchrun's agents exchange their ranks through a TCPStore,
//! fsdp-agent's static nodes exchange nothing and its c10d store speaks etcd's API). So
//! this agent looks for torchrun where it would show:
//!
//! * **static**: torchrun's agent keys (`<run>/torchelastic/...`) in the TCPStore at the
//!   master's address, whoever hosts it ([`probe`], [`has_torchrun_agent_keys`]);
//! * **c10d, joining**: a TCPStore where this agent expects the c10d store ([`probe`]);
//! * **c10d, hosting**: a client whose first bytes are TCPStore's greeting ([`greeting`],
//!   checked by the store's listener).
//!
//! and fails with one line ([`SAME_LAUNCHER`]) instead of waiting.
//!
//! The wire facts (torch 2.13's `TCPStoreBackend.hpp`): a client opens with the query byte
//! VALIDATE and a 32-bit magic; PING carries a 32-bit nonce that the server sends back;
//! LIST_KEYS answers a 64-bit count and each key as a 64-bit length and its bytes. Integers
//! are little-endian on every machine torch runs on.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What every node of a mixed job is told, whichever side noticed.
pub const SAME_LAUNCHER: &str = "the other node runs torchrun; run the same launcher on every node (all torchrun, or all fsdp-agent)";

const VALIDATE: u8 = 0;
const PING: u8 = 13;
const LIST_KEYS: u8 = 17;
const MAGIC: u32 = 0x3C85_F7CE;
/// The high half of our own probes' PING nonce. torchrun's clients send their pid, which is
/// below 2^22: a store this agent serves tells its own kind's probe from torchrun by it.
const OUR_NONCE: u32 = 0x5a17_0000;

/// A listing larger than this is not believed (a garbage answer must not allocate at will).
const MAX_KEYS: u64 = 100_000;
const MAX_KEY_LEN: u64 = 64 * 1024;

/// What answered at an address.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing listens, or nothing answered in time.
    Nothing,
    /// Something listens that is not a TCPStore (an etcd, fsdp-agent's c10d store).
    NotTcpStore,
    /// A TCPStore; its keys when it could list them (torch before 2.6 cannot).
    TcpStore { keys: Option<Vec<Vec<u8>>> },
}

/// Who opened a connection, from its first bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Greeting {
    /// Not a TCPStore client (HTTP/2 starts with `PRI`, TLS with 0x16).
    Other,
    /// A TCPStore client: torchrun's agent or its workers.
    Torchrun,
    /// A TCPStore greeting from [`probe`]: an fsdp-agent looking for torchrun.
    OurProbe,
    /// The first bytes so far fit a greeting; more are needed to tell.
    Unsure,
}

/// How many bytes [`greeting`] needs to be sure.
pub const GREETING_LEN: usize = 10;

/// Who sent `first`, a connection's first bytes (VALIDATE and its magic, then PING and its
/// nonce, for a TCPStore client).
pub fn greeting(first: &[u8]) -> Greeting {
    let mut hello = [VALIDATE; 5];
    hello[1..].copy_from_slice(&MAGIC.to_le_bytes());
    let n = first.len().min(5);
    if first[..n] != hello[..n] {
        return Greeting::Other;
    }
    if first.len() < GREETING_LEN {
        return Greeting::Unsure;
    }
    let nonce = u32::from_le_bytes([first[6], first[7], first[8], first[9]]);
    if first[5] == PING && nonce & 0xffff_0000 == OUR_NONCE {
        Greeting::OurProbe
    } else {
        Greeting::Torchrun
    }
}

/// Whether a TCPStore's keys are a torchrun agent's: its rendezvous writes
/// `torchelastic/role_info/<node>` (and more under `torchelastic/`) through a prefix store,
/// so the keys read `/<run id>/torchelastic/...`. Workers' own keys never have that part.
pub fn has_torchrun_agent_keys(keys: &[Vec<u8>]) -> bool {
    const MARK: &[u8] = b"/torchelastic/";
    keys.iter()
        .any(|k| k.windows(MARK.len()).any(|w| w == MARK) || k.starts_with(&MARK[1..]))
}

/// Asks `host:port` whether it is a TCPStore (and for its keys), within `patience`.
pub async fn probe(host: &str, port: u16, patience: Duration) -> Found {
    tokio::time::timeout(patience, ask(host, port))
        .await
        .unwrap_or(Found::Nothing)
}

async fn ask(host: &str, port: u16) -> Found {
    let Ok(mut s) = TcpStream::connect((host, port)).await else {
        return Found::Nothing;
    };
    let nonce: u32 = OUR_NONCE | (std::process::id() & 0xffff);
    let mut hello = vec![VALIDATE];
    hello.extend(MAGIC.to_le_bytes());
    hello.push(PING);
    hello.extend(nonce.to_le_bytes());
    if s.write_all(&hello).await.is_err() {
        return Found::NotTcpStore;
    }
    let mut echo = [0u8; 4];
    // Anything but the nonce back (a close, an HTTP/2 frame) is some other server.
    if s.read_exact(&mut echo).await.is_err() || u32::from_le_bytes(echo) != nonce {
        return Found::NotTcpStore;
    }
    let keys = list_keys(&mut s).await;
    Found::TcpStore { keys }
}

async fn list_keys(s: &mut TcpStream) -> Option<Vec<Vec<u8>>> {
    s.write_all(&[LIST_KEYS]).await.ok()?;
    let count = s.read_u64_le().await.ok()?;
    if count > MAX_KEYS {
        return None;
    }
    let mut keys = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let len = s.read_u64_le().await.ok()?;
        if len > MAX_KEY_LEN {
            return None;
        }
        let mut key = vec![0u8; len as usize];
        s.read_exact(&mut key).await.ok()?;
        keys.push(key);
    }
    Some(keys)
}

/// How often a static node looks at the master's store: every second while a job would
/// normally be starting (a mixed job then fails within a few seconds of its second node),
/// then every ten; and never faster than 64 probes a second over the whole job, so that a
/// thousand-node static job does not load the store its workers meet at.
pub fn probe_every(nnodes: u32, looked_for: Duration) -> Duration {
    let spread = Duration::from_secs_f64(f64::from(nnodes) / 64.0);
    let base = Duration::from_secs(1).max(spread);
    if looked_for < Duration::from_secs(120) {
        base
    } else {
        base * 10
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(nonce: u32) -> Vec<u8> {
        let mut h = vec![0u8];
        h.extend(0x3C85_F7CEu32.to_le_bytes());
        h.push(13);
        h.extend(nonce.to_le_bytes());
        h
    }

    #[test]
    fn a_greeting_tells_torchrun_from_our_probe_and_from_grpc() {
        // torchrun's client pings with its pid.
        assert_eq!(greeting(&hello(31_337)), Greeting::Torchrun);
        assert_eq!(greeting(&hello(OUR_NONCE | 42)), Greeting::OurProbe);
        assert_eq!(greeting(&hello(1)[..5]), Greeting::Unsure);
        assert_eq!(greeting(&[]), Greeting::Unsure);
        assert_eq!(greeting(b"PRI * HTTP/2.0\r\n"), Greeting::Other);
        assert_eq!(greeting(&[0x16, 3, 1, 0, 0]), Greeting::Other);
        let mut wrong = hello(1);
        wrong[1] ^= 1;
        assert_eq!(greeting(&wrong), Greeting::Other);
    }

    #[test]
    fn torchrun_agent_keys_are_told_from_workers_keys() {
        let keys = |ks: &[&str]| ks.iter().map(|k| k.as_bytes().to_vec()).collect::<Vec<_>>();
        assert!(has_torchrun_agent_keys(&keys(&[
            "init/",
            "/none/torchelastic/role_info/0"
        ])));
        assert!(has_torchrun_agent_keys(&keys(&[
            "torchelastic/agent/terminal_state"
        ])));
        assert!(!has_torchrun_agent_keys(&keys(&["init/"])));
        assert!(!has_torchrun_agent_keys(&keys(&[
            "/default_pg/0//cuda//0",
            "store_based_barrier_key:1"
        ])));
        assert!(!has_torchrun_agent_keys(&[]));
    }

    #[test]
    fn probes_are_frequent_at_first_and_bounded_over_the_job() {
        let s = Duration::from_secs;
        assert_eq!(probe_every(2, s(0)), s(1));
        assert_eq!(probe_every(2, s(119)), s(1));
        assert_eq!(probe_every(2, s(120)), s(10));
        // 1,000 nodes: at most 64 probes a second in all.
        let every = probe_every(1000, s(0));
        assert!(1000.0 / every.as_secs_f64() <= 64.0 + 1e-9, "{every:?}");
    }

    #[tokio::test]
    async fn nothing_listening_and_another_server_are_not_tcpstores() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        assert_eq!(
            probe("127.0.0.1", port, Duration::from_secs(2)).await,
            Found::Nothing
        );
        // A server that answers garbage and closes.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        assert_eq!(
            probe("127.0.0.1", port, Duration::from_secs(2)).await,
            Found::NotTcpStore
        );
    }
}
