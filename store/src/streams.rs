//! Long requests on the status port draw on slots of their own, so that they can never
//! starve the probes (the listener's [`crate::bounded_listener::StreamRules`]; the c10d store has
//! none: its watches and keep-alives are its own agents').
//!
//! Every connection with a request in flight is busy, and the listener never evicts a busy
//! connection for a newcomer ([`crate::bounded_listener`]). A `Liveness` stream (or a health
//! `Watch`, or a reflection session) is in flight for as long as its client likes: 300
//! of them against an agent with 1,024 descriptors held all 256 connection slots, every
//! `/metrics` scrape and `Health/Check` was refused, and kubelet's gRPC liveness probe
//! would have restarted a healthy pod. Hence two limits on streams, checked when one
//! begins ([`admission`]):
//!
//! * **Per peer**: at most [`STREAMS_PER_PEER`] streams from one source IP at a time. A
//!   ring neighbour watches with one `Liveness` stream; an operator's `grpcurl` may add
//!   one more. A client past the limit is answered at once with `RESOURCE_EXHAUSTED`,
//!   and its connection, idle again, is the first to go when the port is full.
//! * **In all**: at most [`max_streams`] at a time, a quarter of the connection cap fewer
//!   than the cap. The rest is the probes' reserve: however many addresses a flood comes
//!   from, streams can make at most that many connections busy, so a one-shot request
//!   always finds a slot that is free or evictable.
//!
//! The slots are generic; the status port is their one user, and which of its requests
//! are one-shot is its own list (`agent/src/status/limits.rs`). One-shot requests
//! (`Health/Check`, `GetStatus`, `/metrics`) are not limited here; they
//! get [`ONESHOT_TIMEOUT`] to be answered (a client that sends a request head and never
//! its body would otherwise hold its connection busy for good). Any other path counts as
//! a stream: an unknown request must not be able to take the reserve.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Streams one source address may hold at once.
pub const STREAMS_PER_PEER: usize = 4;
/// How long a one-shot request may take from its head to its response (the default of
/// `Limits::oneshot_timeout`).
pub const ONESHOT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a request is, as the limits see it: the port tells, from its path
/// ([`crate::bounded_listener::StreamRules::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    OneShot,
    Stream,
}

/// The streams a server with `max_connections` slots may hold at once: all but a quarter
/// (at least one), which stays for one-shot requests.
pub fn max_streams(max_connections: usize) -> usize {
    let reserve = (max_connections / 4).max(1);
    max_connections.saturating_sub(reserve)
}

/// Why a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    PerPeer,
    Full,
}

impl Refusal {
    /// The `RESOURCE_EXHAUSTED` message the client reads.
    pub fn message(self) -> String {
        match self {
            Refusal::PerPeer => format!(
                "this address already holds {STREAMS_PER_PEER} streams on the status port (a ring watcher needs one); close one first"
            ),
            Refusal::Full => {
                "the status port's stream slots are full; the rest are kept for health checks and /metrics".into()
            }
        }
    }
}

/// Whether a new stream may begin, when this peer holds `from_peer` and everyone
/// `total`.
pub fn admission(from_peer: usize, total: usize, max_streams: usize) -> Result<(), Refusal> {
    if from_peer >= STREAMS_PER_PEER {
        Err(Refusal::PerPeer)
    } else if total >= max_streams {
        Err(Refusal::Full)
    } else {
        Ok(())
    }
}

/// The streams open now, by source address.
#[derive(Debug, Default)]
struct Open {
    by_peer: HashMap<IpAddr, usize>,
    total: usize,
}

/// The server's stream slots, shared by its connections.
#[derive(Debug)]
pub struct Streams {
    open: Mutex<Open>,
    max: usize,
}

impl Streams {
    pub fn new(max_streams: usize) -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::default(),
            max: max_streams,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        // Plain counters: still right after a panic elsewhere.
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a slot for a stream from `peer`, held until the returned value is dropped.
    pub fn begin(self: &Arc<Self>, peer: IpAddr) -> Result<StreamSlot, Refusal> {
        // An IPv4 client of a dual-stack socket is the same peer as over IPv4.
        let peer = peer.to_canonical();
        let mut open = self.lock();
        let from_peer = open.by_peer.get(&peer).copied().unwrap_or(0);
        admission(from_peer, open.total, self.max)?;
        *open.by_peer.entry(peer).or_default() += 1;
        open.total += 1;
        Ok(StreamSlot {
            streams: self.clone(),
            peer,
        })
    }
}

/// One stream's slot, given back when the stream ends.
#[derive(Debug)]
pub struct StreamSlot {
    streams: Arc<Streams>,
    peer: IpAddr,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                open.by_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_of_the_connections_is_kept_from_streams() {
        assert_eq!(max_streams(256), 192);
        assert_eq!(max_streams(64), 48);
        assert_eq!(max_streams(4), 3);
        assert_eq!(max_streams(1), 0);
    }

    #[test]
    fn a_peer_gets_a_few_streams_and_everyone_together_the_streams_slots() {
        assert_eq!(admission(0, 0, 192), Ok(()));
        assert_eq!(admission(STREAMS_PER_PEER - 1, 10, 192), Ok(()));
        assert_eq!(admission(STREAMS_PER_PEER, 10, 192), Err(Refusal::PerPeer));
        assert_eq!(admission(0, 192, 192), Err(Refusal::Full));
    }

    #[test]
    fn slots_are_counted_per_address_and_given_back() {
        let streams = Streams::new(6);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let a_mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut held: Vec<StreamSlot> = (0..STREAMS_PER_PEER)
            .map(|i| {
                streams
                    .begin(if i % 2 == 0 { a } else { a_mapped })
                    .unwrap()
            })
            .collect();
        assert_eq!(streams.begin(a).unwrap_err(), Refusal::PerPeer);
        held.push(streams.begin(b).unwrap());
        held.push(streams.begin(b).unwrap());
        assert_eq!(streams.begin(b).unwrap_err(), Refusal::Full);
        held.remove(0);
        let again = streams.begin(a).expect("a slot given back");
        drop(again);
        drop(held);
        let open = streams.lock();
        assert_eq!((open.total, open.by_peer.len()), (0, 0));
    }
}
