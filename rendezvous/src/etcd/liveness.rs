//! Refused means dead: a dead agent is evicted in milliseconds, not a lease TTL.
//!
//! When a process dies its kernel closes its sockets. So in a round every member holds a
//! liveness stream (`AgentStatus/Liveness`, on the status port the agents already serve) to
//! its ring neighbour: the next member in group-rank order that serves a status port. When
//! the stream breaks, the watcher reconnects at once, and [`verdict`] reads the outcome:
//!
//! - **refused** — nothing listens at that address any more: the agent is gone, and the
//!   watcher revokes its lease (the id its heartbeats last announced), so every agent
//!   sees the delete at once and re-forms;
//! - **another node answers** (or one that has not joined a run yet) — a restarted pod
//!   took the address: the watched agent is gone too;
//! - **it answers as itself** — it lives (only the connection broke): nothing happens;
//! - **no answer** (a timeout, any other error) proves nothing — a cut network looks the
//!   same — and the lease TTL decides, as without this path.
//!
//! Only an address where the watched agent has answered as itself counts: until then a
//! refusal or a stranger means the address is wrong from here (a loopback address seen
//! from another network namespace, say), never that the agent is dead.
//!
//! A ring rather than a star (everyone watching the coordinator): at 1,000 nodes each
//! agent holds one stream and serves one, instead of one agent — the busiest one, the
//! coordinator — serving 999 and taking 999 reconnections whenever it restarts; every
//! agent, the coordinator included, is watched by exactly one other. Two neighbours dying
//! at once leaves the second to its lease TTL.

use std::time::{Duration, Instant};

use fsdp_proto::v1;
use fsdp_proto::v1::agent_status_client::AgentStatusClient;

use super::probe::{Reach, reach};
use tokio::task::AbortHandle;

/// How long one contact may take (connecting, and the first heartbeat).
pub const PATIENCE: Duration = Duration::from_secs(1);
/// Between contacts that prove nothing.
const RETRY: Duration = Duration::from_millis(500);
/// The first pause after the stream broke, doubling up to [`RETRY`]. A killed agent's
/// kernel closes the stream's connection before its listening socket, so the look made
/// at once can still be accepted by the dying process and then cut: no proof. The
/// refusal comes milliseconds later; waiting the whole [`RETRY`] for it made every
/// SIGKILL at 1,000 agents half a second slower to notice (`detect: 502ms`).
const AFTER_BREAK: Duration = Duration::from_millis(10);

/// The pause before the next look when the last one proved nothing: short and growing
/// for the `n`th look after the stream broke, else [`RETRY`].
fn pause(since_break: Option<u32>) -> Duration {
    match since_break {
        Some(n) => AFTER_BREAK.saturating_mul(1 << n.min(16)).min(RETRY),
        None => RETRY,
    }
}

/// Before the first contact, plus up to as much again at random: a round's forming is
/// the busiest moment of a run (at 1,000 agents every one of them re-registers and reads
/// the new round), and connecting 1,000 streams then slowed it by half a second. A death
/// in that second is found by its lease.
const SETTLE: Duration = Duration::from_secs(1);

/// What one contact with the watched agent's status port found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contact {
    /// The connection was refused: nothing listens there.
    Refused,
    /// An agent answered with this node id (empty: it has not joined a run) and the lease
    /// it holds (0: none yet, or an agent too old to say).
    Answered { node_id: String, lease: i64 },
    /// No answer in time, or another error: proves nothing.
    Silent,
}

/// What to do about the watched agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It lives, or nothing is proven: keep watching.
    Keep,
    /// It is gone: evict it.
    Gone { reason: String },
}

/// Reads a contact with the agent of `watched` at `addr`; `seen` says whether it has
/// answered there as itself before.
pub fn verdict(watched: &str, addr: &str, contact: &Contact, seen: bool) -> Verdict {
    if !seen {
        return Verdict::Keep;
    }
    match contact {
        Contact::Refused => Verdict::Gone {
            reason: format!(
                "its status port {addr} refused the connection: the agent's process is gone"
            ),
        },
        Contact::Answered { node_id, .. } if node_id != watched => Verdict::Gone {
            reason: if node_id.is_empty() {
                format!(
                    "a new agent that has not joined yet answers at {addr}: the watched one is gone"
                )
            } else {
                format!("node {node_id} answers at {addr}: the watched one is gone")
            },
        },
        Contact::Answered { .. } | Contact::Silent => Verdict::Keep,
    }
}

/// The member `me` watches in `round`: the next one in rank order, wrapping around, that
/// serves a status port and is not `me`.
pub fn neighbour<'a>(round: &'a v1::Round, me: &str) -> Option<&'a v1::Member> {
    let pos = round.members.iter().position(|m| m.node_id == me)?;
    let n = round.members.len();
    (1..n)
        .map(|k| &round.members[(pos + k) % n])
        .find(|m| !m.status_addr.is_empty() && m.node_id != me && m.lease != 0)
}

type Stream = tonic::Streaming<v1::Heartbeat>;

/// The lease to revoke after the watched agent announced `said`: an agent that has none
/// yet, or is too old to say, announces 0 and leaves the one known before.
fn announced(known: i64, said: i64) -> i64 {
    if said == 0 { known } else { said }
}

/// A gRPC client of the agent status service at `addr` (`host:port`), connected within
/// `patience`; `None` when it cannot be reached.
pub async fn status_client(
    addr: &str,
    patience: std::time::Duration,
) -> Option<AgentStatusClient<tonic::transport::Channel>> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(patience);
    Some(AgentStatusClient::new(endpoint.connect().await.ok()?))
}

/// One contact: a TCP connection (refused or not), then a liveness stream and its first
/// heartbeat.
async fn contact(addr: &str, me: &str) -> (Contact, Option<Stream>) {
    match reach(addr, PATIENCE).await {
        Reach::Accepted => {}
        Reach::Refused => return (Contact::Refused, None),
        Reach::NoAnswer => return (Contact::Silent, None),
    }
    let open = async {
        let mut client = status_client(addr, PATIENCE).await?;
        let request = v1::LivenessRequest {
            watcher: me.to_owned(),
        };
        let mut stream = client.liveness(request).await.ok()?.into_inner();
        let first = stream.message().await.ok()??;
        Some((first, stream))
    };
    match tokio::time::timeout(PATIENCE, open).await {
        Ok(Some((beat, stream))) => (
            Contact::Answered {
                node_id: beat.node_id,
                lease: beat.lease,
            },
            Some(stream),
        ),
        _ => (Contact::Silent, None),
    }
}

/// Why the watched agent is gone, and how long the proof took from the first sign (its
/// stream breaking; zero when it was found gone at the first contact).
#[derive(Debug, Clone)]
pub struct Proof {
    pub reason: String,
    pub detect: Duration,
}

/// A running watcher; dropping it stops it.
pub struct Watcher(AbortHandle);

impl Drop for Watcher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Watcher {
    /// Watches `target` for `me`; calls `evict(node_id, lease, proof)` once if it proves
    /// it gone, with the lease it last announced (the round's when it never said).
    /// A round records each member's lease when it was sealed; a store restarted empty
    /// makes every agent take a new one while the round put back keeps the old ids, and
    /// revoking those would find nothing, leaving the death to the TTL.
    pub fn start(
        me: String,
        target: v1::Member,
        evict: impl FnOnce(String, i64, Proof) + Send + 'static,
    ) -> Self {
        let task = tokio::spawn(async move {
            let addr = target.status_addr.clone();
            tracing::debug!(node = %target.node_id, %addr, "watching the ring neighbour");
            let jitter = uuid::Uuid::new_v4().as_u128() % SETTLE.as_millis();
            tokio::time::sleep(SETTLE + Duration::from_millis(jitter as u64)).await;
            let mut broke = None;
            // Looks since the stream last broke, while they prove nothing.
            let mut since_break = None::<u32>;
            let mut seen = false;
            let mut warned = false;
            let mut lease = target.lease;
            loop {
                let (found, stream) = contact(&addr, &me).await;
                if let Verdict::Gone { reason } = verdict(&target.node_id, &addr, &found, seen) {
                    let detect = broke.map_or(Duration::ZERO, |t: Instant| t.elapsed());
                    evict(target.node_id.clone(), lease, Proof { reason, detect });
                    return;
                }
                let itself = match &found {
                    Contact::Answered { node_id, lease: l } if *node_id == target.node_id => {
                        lease = announced(lease, *l);
                        true
                    }
                    _ => false,
                };
                seen |= itself;
                if !seen && !warned && found != Contact::Silent {
                    warned = true;
                    tracing::warn!(node = %target.node_id, %addr, ?found, "the ring neighbour's status address does not reach it from here; its lease alone will tell if it dies");
                }
                match stream.filter(|_| itself) {
                    // Follow it until it breaks, then look again at once.
                    Some(mut s) => {
                        while let Ok(Some(beat)) = s.message().await {
                            if beat.node_id == target.node_id {
                                lease = announced(lease, beat.lease);
                            }
                        }
                        broke = Some(Instant::now());
                        since_break = Some(0);
                    }
                    None => {
                        tokio::time::sleep(pause(since_break)).await;
                        since_break = since_break.map(|n| n.saturating_add(1));
                    }
                }
            }
        });
        Self(task.abort_handle())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_proto::SCHEMA_VERSION;

    #[test]
    fn looks_after_the_stream_broke_come_quickly_then_slow_to_the_retry() {
        let looks: Vec<u128> = (0..8).map(|n| pause(Some(n)).as_millis()).collect();
        assert_eq!(looks, [10, 20, 40, 80, 160, 320, 500, 500]);
        assert_eq!(pause(Some(u32::MAX)), RETRY);
        // Before any stream (the neighbour not reached yet): the plain retry.
        assert_eq!(pause(None), RETRY);
        // The quick looks before the plain pace add up to about one retry.
        let quick: Duration = (0..6).map(|n| pause(Some(n))).sum();
        assert!(quick < 2 * RETRY, "{quick:?}");
    }

    #[test]
    fn the_lease_evicted_is_the_last_one_announced() {
        // The round named 7; the store came back empty and the agent took 9.
        assert_eq!(announced(7, 9), 9);
        // An agent with no lease yet, or too old to say, leaves the known one.
        assert_eq!(announced(9, 0), 9);
    }

    #[test]
    fn only_a_refusal_or_a_stranger_proves_the_agent_gone() {
        let gone = |c: &Contact| matches!(verdict("a", "h:1", c, true), Verdict::Gone { .. });
        assert!(gone(&Contact::Refused));
        let answered = |node_id: &str| Contact::Answered {
            node_id: node_id.into(),
            lease: 9,
        };
        assert!(gone(&answered("b")));
        assert!(gone(&answered("")));
        assert!(!gone(&answered("a")));
        assert!(!gone(&Contact::Silent));
        // An address where it never answered as itself proves nothing: it may be wrong
        // from here (a loopback address seen from another network namespace).
        assert_eq!(verdict("a", "h:1", &Contact::Refused, false), Verdict::Keep);
        assert_eq!(verdict("a", "h:1", &answered("b"), false), Verdict::Keep);
    }

    fn round(members: &[(&str, &str)]) -> v1::Round {
        v1::Round {
            schema: SCHEMA_VERSION,
            members: members
                .iter()
                .map(|(id, status)| {
                    v1::Member::from(v1::MemberFields {
                        node_id: (*id).into(),
                        status_addr: (*status).into(),
                        lease: 7,
                        ..Default::default()
                    })
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn each_member_watches_the_next_with_a_status_port_in_a_ring() {
        let r = round(&[("a", "a:1"), ("b", ""), ("c", "c:1"), ("d", "d:1")]);
        let watched = |me| neighbour(&r, me).map(|m| m.node_id.as_str());
        assert_eq!(watched("a"), Some("c"));
        assert_eq!(watched("b"), Some("c"));
        assert_eq!(watched("c"), Some("d"));
        assert_eq!(watched("d"), Some("a"));
        // Everyone is watched by someone, the coordinator included.
        assert_eq!(neighbour(&round(&[("a", "a:1")]), "a"), None);
        assert_eq!(neighbour(&r, "x"), None);
    }

    #[tokio::test]
    async fn a_closed_port_is_refused_and_a_mute_one_proves_nothing() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap().to_string();
        drop(closed);
        assert_eq!(contact(&addr, "me").await.0, Contact::Refused);
        let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = mute.local_addr().unwrap().to_string();
        assert_eq!(contact(&addr, "me").await.0, Contact::Silent);
    }
}
