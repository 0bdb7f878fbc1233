//! The session machine without etcd: inputs in, effects out, the clock in the test's hand.
//!
//! The harness drives one node ("a") whose handle granted lease [`LEASE`] at `t0`; every op
//! the machine sends is answered by the test, as the driver would answer it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fsdp_proto::{SCHEMA_VERSION, v1};
use prost::Message;

use super::{
    Answer, Command, CommandId, Compare, Config, Effect, Input, Kv, Machine, Op, Phase, Resync,
    Role, TxnSpec, WatchEvent, Write,
};
use crate::etcd::keys::Keys;
use crate::etcd::record::{Outgoing, Record};
use crate::etcd::view::Departed;
use crate::seal::SealConfig;
use crate::{Counters, Departure, RendezvousError};
use effects::*;

mod admission;
mod commands;
mod coordinator;
mod departures;
mod effects;
mod eviction;
mod lease;
mod outage;
mod overload;
mod placed;
mod reform;
mod sync;

pub(super) const TTL: Duration = Duration::from_secs(6);
pub(super) const SECOND: Duration = Duration::from_secs(1);
/// The lease the handle granted at join.
pub(super) const LEASE: i64 = 100;
/// The revision of every ranged read the harness answers.
pub(super) const REV: i64 = 5;
pub(super) const UNIX_MS_AT_GRANT: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------
// Records and errors
// ---------------------------------------------------------------------------------------

pub(super) fn keys() -> Keys {
    Keys::new("/fsdp", "r").unwrap()
}

fn config(t0: Instant) -> Config {
    Config {
        keys: keys(),
        node_id: "a".into(),
        addr: "10.0.0.1".into(),
        status_addr: String::new(),
        local_world_size: 2,
        ttl: TTL,
        outage_limit: Duration::from_secs(60),
        fence_margin: SECOND,
        seal: SealConfig {
            min_nodes: 1,
            max_nodes: 2,
            last_call: Duration::ZERO,
            straggler_timeout: Duration::from_secs(10),
            segment_size: 1,
        },
        several_endpoints: false,
        budget: Default::default(),
        job: String::new(),
        segment: String::new(),
        fresh_store: false,
        placement_above: crate::etcd::PLACEMENT_ABOVE,
        placement_shape: crate::etcd::placement::Shape::ETCD,
        can_probe: true,
        crowd: false,
        crowd_window: super::CROWD,
        embedded_store: false,
        lease: LEASE,
        granted_at: t0,
        unix_ms_at_grant: UNIX_MS_AT_GRANT,
        // Incarnations 1, 2, ... keep the expectations readable.
        first_incarnation: 1,
        allowed: Default::default(),
    }
}

/// The command that writes `record` as its declaration says.
pub(super) fn write<R: Record>(record: &R) -> Command {
    Command::Write(Outgoing::of(&keys(), record))
}

/// "a"'s workers all succeeded in `round`.
pub(super) fn report_done(round: u64) -> Command {
    write(&v1::Done {
        schema: SCHEMA_VERSION,
        round,
        node_id: "a".into(),
    })
}

/// "a" fenced itself.
pub(super) fn abandon() -> Command {
    Command::Abandon {
        reason: "the lease could not be renewed".into(),
    }
}

/// "a" leaves `how`, saying `kind`.
pub(super) fn depart(how: Departure, kind: crate::LeftKind) -> Command {
    Command::Depart {
        how,
        why: crate::LeftReason::new(kind, "the test's reason"),
    }
}

/// The departure record put among `writes` at `node`'s `incarnation`.
#[track_caller]
pub(super) fn left_put(writes: &[Write], node: &str, incarnation: u64) -> v1::Left {
    let key = keys().key::<v1::Left>(&crate::etcd::record::left_tail(node, incarnation));
    v1::Left::decode(put_at(writes, &key).0).unwrap()
}

/// A failure in `round`, charged by "a".
pub(super) fn report_failure(round: u64) -> Command {
    write(&v1::Failure {
        schema: SCHEMA_VERSION,
        round,
        node_id: "a".into(),
    })
}

/// etcd no longer has the lease a request named.
pub(super) fn no_such_lease() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::not_found(
        "etcdserver: requested lease not found",
    ))
}

/// A connection that broke: transient.
pub(super) fn cut() -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::other("cut"))
}

pub(super) fn member(id: &str, lease: i64, incarnation: u64, wants_round: u64) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 2,
        wants_round,
        status_addr: String::new(),
        lease,
        incarnation,
        ..Default::default()
    })
}

/// Round `number` of `members` (node, incarnation).
pub(super) fn round(number: u64, members: &[(&str, u64)]) -> v1::Round {
    v1::Round {
        schema: SCHEMA_VERSION,
        number,
        members: members
            .iter()
            .map(|(id, inc)| member(id, LEASE, *inc, number))
            .collect(),
        restart_count: 0,
        reason: "test".into(),
        ..Default::default()
    }
}

/// What the first seal of a run is fenced on: no round yet, this node's coordinator
/// lease, no halt.
pub(super) fn first_seal_fences() -> Vec<Compare> {
    let k = keys();
    vec![
        Compare::Absent(k.key::<v1::Round>("")),
        Compare::Lease(k.key::<v1::Coordinator>(""), LEASE),
        Compare::Absent(k.key::<v1::Halt>("")),
    ]
}

pub(super) fn member_kv(m: &v1::Member, create_rev: i64) -> Kv {
    Kv {
        key: keys().key::<v1::Member>(&m.node_id),
        value: m.encode_to_vec(),
        create_rev,
        mod_rev: create_rev,
        lease: m.lease,
    }
}

pub(super) fn coordinator_kv(id: &str, lease: i64) -> Kv {
    let c = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
    };
    Kv {
        key: keys().key::<v1::Coordinator>(""),
        value: c.encode_to_vec(),
        create_rev: 2,
        mod_rev: 2,
        lease,
    }
}

/// `r` as etcd holds it at its key, written at revision `rev`.
pub(super) fn record_kv<R: Record + Message>(r: &R, rev: i64) -> Kv {
    Kv {
        key: keys().of(r),
        value: r.encode_to_vec(),
        create_rev: rev,
        mod_rev: rev,
        lease: 0,
    }
}

pub(super) fn round_kv(r: &v1::Round, mod_rev: i64) -> Kv {
    Kv {
        key: keys().key::<v1::Round>(""),
        value: r.encode_to_vec(),
        create_rev: 1,
        mod_rev,
        lease: 0,
    }
}

/// A joining member's first read: the control keys alone.
pub(super) fn read_ctl() -> Op {
    Op::Range {
        key: keys().ctl(),
        prefix: true,
        keys_only: false,
        serializable: true,
    }
}

/// After a member's control-only read on a resync: its own registration.
pub(super) fn read_own() -> Op {
    Op::Range {
        key: keys().key::<v1::Member>("a"),
        prefix: false,
        keys_only: false,
        serializable: false,
    }
}

pub(super) fn read_root() -> Op {
    Op::Range {
        key: keys().root().to_owned(),
        prefix: true,
        keys_only: false,
        serializable: true,
    }
}

// ---------------------------------------------------------------------------------------
// The harness
// ---------------------------------------------------------------------------------------

pub(super) struct Harness {
    pub(super) m: Machine,
    pub(super) t0: Instant,
    pub(super) now: Instant,
    pub(super) counters: Counters,
    pub(super) writes: Arc<AtomicU64>,
    /// The port the driver finds free whenever the machine asks ([`Effect::PickPort`]).
    pub(super) port: Option<u16>,
}

impl Harness {
    pub(super) fn with(edit: impl FnOnce(&mut Config)) -> Self {
        Self::with_port(Some(29_501), edit)
    }

    pub(super) fn with_port(port: Option<u16>, edit: impl FnOnce(&mut Config)) -> Self {
        let t0 = Instant::now();
        let mut cfg = config(t0);
        edit(&mut cfg);
        let counters = Counters::default();
        let writes = Arc::new(AtomicU64::new(0));
        let mut m = Machine::new(cfg, counters.clone(), writes.clone());
        // A port in hand from the start, as a seal's ask for one finds (`duty.rs`).
        m.step(t0, Input::Port(port));
        Self {
            m,
            t0,
            now: t0,
            counters,
            writes,
            port,
        }
    }

    pub(super) fn new() -> Self {
        Self::with(|_| {})
    }

    /// A machine through its first sync of a run holding `kvs`, watching.
    pub(super) fn synced_with(kvs: &[Kv]) -> Self {
        let (h, rest) = Self::new().first_sync(kvs);
        no_op(&rest);
        assert!(matches!(h.m.phase(), Phase::Watching { .. }));
        h
    }

    pub(super) fn synced() -> Self {
        Self::synced_with(&[])
    }

    /// Starts the machine and answers its first sync; returns the effects after the
    /// watches opened.
    pub(super) fn first_sync(mut self, kvs: &[Kv]) -> (Self, Vec<Effect>) {
        let effects = self.m.start(self.now);
        let (ops, rest) = self.sync_through(effects, kvs);
        assert!(
            matches!(ops.last(), Some(Op::Watch { .. })),
            "the first sync stopped early: {ops:?} then {rest:?}"
        );
        (self, rest)
    }

    /// Answers the ops of one sync — reads of the run with `kvs` at [`REV`], one etcd
    /// member, a live lease, watches opened, an endpoint picked — until the watches are
    /// open or an op of another kind comes. Returns the ops answered and the effects that
    /// came last (they hold the other op, if one came).
    pub(super) fn sync_through(
        &mut self,
        mut effects: Vec<Effect>,
        kvs: &[Kv],
    ) -> (Vec<Op>, Vec<Effect>) {
        let mut seen = Vec::new();
        loop {
            let ops = etcd_ops(&effects);
            let Some(op) = ops.first() else {
                return (seen, effects);
            };
            assert_eq!(ops.len(), 1, "one op at a time: {effects:?}");
            let answer = match op {
                Op::PickEndpoint | Op::Watch { .. } | Op::ReopenKeepAlive { .. } => Answer::Done,
                Op::Range {
                    key,
                    prefix: true,
                    keys_only: false,
                    ..
                } if *op == read_root() || *op == read_ctl() => Answer::Range {
                    revision: REV,
                    kvs: kvs
                        .iter()
                        .filter(|kv| kv.key.starts_with(key.as_str()))
                        .cloned()
                        .collect(),
                },
                // A member's own registration, read after a control-only read.
                Op::Range {
                    key,
                    prefix: false,
                    keys_only: false,
                    ..
                } if *key == keys().key::<v1::Member>("a") => Answer::Range {
                    revision: REV,
                    kvs: kvs.iter().filter(|kv| kv.key == *key).cloned().collect(),
                },
                Op::MemberCount => Answer::MemberCount(1),
                Op::TimeToLive { .. } => Answer::TimeToLive { ttl: 6 },
                _ => return (seen, effects),
            };
            let watch = matches!(op, Op::Watch { .. });
            seen.push(op.clone());
            effects = self.answer(answer);
            if watch {
                return (seen, effects);
            }
        }
    }

    pub(super) fn at_ms(&mut self, ms: u64) {
        self.now = self.t0 + Duration::from_millis(ms);
    }

    pub(super) fn later(&mut self, d: Duration) {
        self.now += d;
    }

    pub(super) fn step(&mut self, input: Input) -> Vec<Effect> {
        let mut effects = self.m.step(self.now, input);
        if effects.iter().any(|e| matches!(e, Effect::PickPort)) {
            effects.extend(self.m.step(self.now, Input::Port(self.port)));
        }
        effects
    }

    pub(super) fn answer(&mut self, answer: Answer) -> Vec<Effect> {
        self.step(Input::Answer(Ok(answer)))
    }

    pub(super) fn fail(&mut self, e: etcd_client::Error) -> Vec<Effect> {
        self.step(Input::Answer(Err(e.into())))
    }

    pub(super) fn command(&mut self, id: CommandId, command: Command) -> Vec<Effect> {
        self.step(Input::Command(id, command))
    }

    /// Tells the session, as command `id`, that this agent runs `round`.
    pub(super) fn runs(&mut self, id: CommandId, round: v1::Round) -> Vec<Effect> {
        self.command(
            id,
            Command::Running {
                round: Arc::new(round),
            },
        )
    }

    pub(super) fn timer(&mut self) -> Vec<Effect> {
        self.step(Input::Timer)
    }

    /// Moves the clock to the machine's deadline and fires it.
    #[track_caller]
    pub(super) fn fire(&mut self) -> Vec<Effect> {
        let at = self.m.deadline().expect("a deadline");
        self.now = self.now.max(at);
        self.timer()
    }

    /// A forming node whose lease etcd let expire (`e`, what the machine did on hearing
    /// it) grants another only after its pace's longest pause, drawn around (from a
    /// quarter to three quarters of the TTL), and sends no keep-alive for the lease gone
    /// meanwhile: the effects that send the grant.
    #[track_caller]
    pub(super) fn paced_grant(&mut self, e: Vec<Effect>) -> Vec<Effect> {
        let lost = self.now;
        let mut e = e;
        loop {
            match etcd_ops(&e).first() {
                Some(Op::Grant { .. }) => break,
                Some(other) => panic!("{other:?} before the grant"),
                None => e = self.fire(),
            }
        }
        let waited = self.now - lost;
        assert!(waited >= TTL / 4 && waited <= TTL * 3 / 4, "{waited:?}");
        e
    }

    /// Registers for `wants_round`; etcd answers the transaction with `succeeded`.
    pub(super) fn register(
        &mut self,
        id: CommandId,
        wants_round: u64,
        succeeded: bool,
    ) -> Vec<Effect> {
        let e = self.command(id, Command::Register { wants_round });
        assert!(matches!(the_op(&e), Op::Txn(_)));
        let e = self.answer(Answer::Txn { succeeded });
        replied_ok(&e, id);
        e
    }

    /// How long the machine waits before it syncs again, in ms (the backoff computes in
    /// floating point: a few nanoseconds either way are no difference).
    #[track_caller]
    pub(super) fn retry_in_ms(&self) -> u64 {
        let Phase::Disconnected { until } = self.m.phase() else {
            panic!("not disconnected: {:?}", self.m.phase())
        };
        assert_eq!(self.m.deadline(), Some(until));
        (until.duration_since(self.now).as_secs_f64() * 1e3).round() as u64
    }

    /// etcd lost the connection under the watches: the machine waits to retry.
    pub(super) fn disconnect(&mut self) -> Vec<Effect> {
        let e = self.step(Input::StreamFailed(cut().into()));
        assert!(matches!(self.m.phase(), Phase::Disconnected { .. }));
        e
    }
}
