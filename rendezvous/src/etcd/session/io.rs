//! What the session machine asks of the world and what it is told: [`Op`]s and their
//! [`Answer`]s, the [`Input`]s of [`super::Machine::step`] and the [`Effect`]s it returns.
//! Plain data: the real driver carries an op out with etcd-client, the simulator with the
//! pure store ([`fsdp_store::state`]).

use std::time::Instant;

use fsdp_proto::v1;

use super::fault::Fault;
use crate::RendezvousError;
use crate::etcd::record::Outgoing;

/// A command's number, for its reply.
pub type CommandId = u64;

/// One key-value as etcd returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub create_rev: i64,
    pub mod_rev: i64,
    pub lease: i64,
}

/// One event of a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Kv),
    /// The key went; `prev` is its last value when the watch asked for it.
    Delete {
        key: String,
        prev: Option<Vec<u8>>,
    },
}

impl WatchEvent {
    /// The key it is about.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    /// About how many bytes it holds.
    pub fn size(&self) -> usize {
        match self {
            WatchEvent::Put(kv) => kv.key.len() + kv.value.len(),
            WatchEvent::Delete { key, prev } => key.len() + prev.as_ref().map_or(0, Vec::len),
        }
    }
}

/// A condition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key was last written at this revision.
    ModRevision(String, i64),
    /// The key lives on this lease.
    Lease(String, i64),
    /// Every key present in `[from, to)` was last written at or before revision `rev`
    /// (none at all will do; deleted ones do not count).
    NoneWrittenAfter { from: String, to: String, rev: i64 },
}

/// A write of a transaction (or alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// `lease` 0: no lease.
    Put {
        key: String,
        value: Vec<u8>,
        lease: i64,
    },
    Delete(String),
    /// Every key in `[from, to)`.
    DeleteRange {
        from: String,
        to: String,
    },
}

/// An etcd transaction: `then` if every comparison holds, else `otherwise`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxnSpec {
    pub when: Vec<Compare>,
    pub then: Vec<Write>,
    pub otherwise: Vec<Write>,
}

/// Which watches the session holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Watches control keys and member departures.
    Member,
    /// Watches every key of the run, and seals rounds.
    Coordinator,
}

/// One request to etcd (or the connection to it). The machine has at most one in flight,
/// answered by [`Input::Answer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Range {
        key: String,
        prefix: bool,
        keys_only: bool,
        /// Served from the member's own state, without waiting for its apply loop to
        /// catch up with the leader: a sync's read, which the watches opened from its
        /// revision bring up to date, and a member's read of its shard at a seal (the
        /// answer's revision tells one that predates the header). etcd 3.4 makes a
        /// linearizable read wait for the applied index, and a crowd of joiners each
        /// reading so was answered "waiting for the applied index took too long"
        /// thousands of times at 10,000 nodes.
        serializable: bool,
    },
    /// How many members the etcd cluster has.
    MemberCount,
    Txn(TxnSpec),
    Put(Write),
    Grant {
        ttl: i64,
    },
    /// Revoke; a lease etcd no longer has counts as revoked.
    Revoke {
        lease: i64,
    },
    TimeToLive {
        lease: i64,
    },
    /// Open the watches of `role` from revision `from` (replacing any open ones) and,
    /// unless `keep_stream`, a keep-alive stream for `lease`.
    Watch {
        role: Role,
        from: i64,
        lease: i64,
        /// Keep the keep-alive stream open for `lease` since its grant: at formation a
        /// second stream was a second open and two more renewals per node, the busiest
        /// second of etcd's life (10,000 nodes: half its keep-alives). If that stream
        /// ended meanwhile, the op fails (the machine counts its keep-alives as sent on
        /// it).
        keep_stream: bool,
    },
    /// Send one keep-alive on the open stream.
    KeepAlive,
    /// A new keep-alive stream for `lease` beside the open watches (etcd ended the old
    /// one because it was too busy to renew).
    ReopenKeepAlive {
        lease: i64,
    },
    /// Pin the connection to a member that answers.
    PickEndpoint,
    /// Leave: `record` (the first word on how) beside the revoke of `lease`, both at once.
    Depart {
        record: Option<TxnSpec>,
        lease: i64,
    },
}

impl Op {
    /// Whether the op opens, uses or replaces the connection's streams (or the connection
    /// itself), rather than being one request on it.
    pub fn uses_streams(&self) -> bool {
        matches!(
            self,
            Op::Watch { .. } | Op::KeepAlive | Op::ReopenKeepAlive { .. } | Op::PickEndpoint
        )
    }
}

/// What an [`Op`] returned.
#[derive(Debug)]
pub enum Answer {
    Range {
        revision: i64,
        kvs: Vec<Kv>,
    },
    MemberCount(usize),
    Txn {
        succeeded: bool,
    },
    Granted {
        id: i64,
    },
    TimeToLive {
        ttl: i64,
    },
    /// A put, revoke, keep-alive sent, watches opened, endpoint picked.
    Done,
    Departed {
        said: Option<Fault>,
        revoked: Option<Fault>,
    },
}

/// A command from the agent-facing handle.
#[derive(Debug, Clone)]
pub enum Command {
    /// Write this node's registration, ready for `wants_round`; claim the coordinator role
    /// in the same transaction when nobody holds it (one write per node).
    Register { wants_round: u64 },
    /// Write one record as its declaration says ([`crate::etcd::record`]): the master
    /// address, a failure, a fault, a finish, a hang report, a halt, a quarantine.
    Write(Outgoing),
    /// This node runs `round`: put it back if etcd loses it, and after an outage wait
    /// for its members, not for strangers. Answered at once.
    Running { round: std::sync::Arc<v1::Round> },
    /// This node's health check failed: withdraw its registration (and the coordinator
    /// role) and say why; it registers again when the check passes.
    Withdraw { record: v1::Unhealthy },
    /// Revoke the lease (the others learn at once) and end the session; `why` is written
    /// beside the revoke for status.
    Depart {
        how: crate::Departure,
        why: crate::LeftReason,
    },
    /// This node fenced itself (for `reason`): at the next contact with etcd, say so, revoke
    /// the lease (the others see it leave instead of waiting out the TTL) and join again on
    /// a new one.
    Abandon { reason: String },
    /// `node`'s agent is proven gone (its status port refused a connection): revoke its
    /// lease, so every agent sees it leave now rather than after its TTL.
    Evict {
        node: String,
        lease: i64,
        round: u64,
        detect_ms: u32,
    },
}

/// What happened, told to [`super::Machine::step`].
#[derive(Debug)]
pub enum Input {
    Command(CommandId, Command),
    /// The handle is gone.
    CommandsClosed,
    /// A batch from a watch stream, in etcd's order.
    Watched(Vec<WatchEvent>),
    /// A watch was created when etcd was at `revision` (its first answer).
    WatchCreated {
        revision: i64,
    },
    /// A watch stream ended or was cancelled (compaction, a restart).
    WatchEnded,
    /// A watch or keep-alive stream failed.
    StreamFailed(Fault),
    /// The keep-alive stream alone failed (the watches did not).
    KeepAliveFailed(Fault),
    /// The keep-alive stream answered with the lease's TTL left (`None`: it ended).
    LeaseAnswer(Option<i64>),
    /// The answer to the op in flight.
    Answer(Result<Answer, Fault>),
    /// A deadline the machine gave ([`super::Machine::deadline`]) passed.
    Timer,
    /// The prober saw etcd without a leader, looking at `sent`; `silent`: it saw only
    /// that nothing answered a fresh connection (see [`super::Machine`]'s use of it).
    NoLeader {
        sent: Instant,
        silent: bool,
    },
    /// A port free on this node's address now ([`Effect::PickPort`]), for the master of
    /// the next round this node seals as its rank 0; `None`: none could be found.
    Port(Option<u16>),
}

impl Input {
    /// Whether this ends the keep-alive stream it came on (failed, or closed by etcd).
    pub fn ends_keep_alive(&self) -> bool {
        matches!(self, Input::KeepAliveFailed(_) | Input::LeaseAnswer(None))
    }
}

impl From<crate::etcd::probe::Proof> for Input {
    fn from(p: crate::etcd::probe::Proof) -> Self {
        Input::NoLeader {
            sent: p.sent,
            silent: p.silent,
        }
    }
}

/// What the machine asks its driver to do.
#[derive(Debug)]
pub enum Effect {
    Etcd(Op),
    Reply(CommandId, Result<(), RendezvousError>),
    /// Drop the watch and keep-alive streams (their events belong to the past).
    CloseWatches,
    /// Start (`true`) or stop looking for proof that etcd has no leader.
    Probe(bool),
    /// Send one keep-alive on the open stream beside the op in flight. Nothing answers
    /// it but the stream, as [`Input::LeaseAnswer`].
    KeepAlive,
    /// Find a port free on this node's address, and tell it as [`Input::Port`].
    PickPort,
}
