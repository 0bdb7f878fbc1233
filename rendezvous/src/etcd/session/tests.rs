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
use crate::etcd::view::Departed;
use crate::seal::SealConfig;
use crate::{Counters, Departure, RendezvousError};

const TTL: Duration = Duration::from_secs(6);
const SECOND: Duration = Duration::from_secs(1);
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// The lease the handle granted at join.
const LEASE: i64 = 100;
/// The revision of every ranged read the harness answers.
const REV: i64 = 5;
const UNIX_MS_AT_GRANT: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------
// Records and errors
// ---------------------------------------------------------------------------------------

fn keys() -> Keys {
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
        },
        several_endpoints: false,
        can_probe: true,
        embedded_store: false,
        lease: LEASE,
        granted_at: t0,
        unix_ms_at_grant: UNIX_MS_AT_GRANT,
        // Incarnations 1, 2, ... keep the expectations readable.
        first_incarnation: 1,
    }
}

/// etcd no longer has the lease a request named.
fn no_such_lease() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::not_found(
        "etcdserver: requested lease not found",
    ))
}

/// A connection that broke: transient.
fn cut() -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::other("cut"))
}

/// etcd said no for good.
fn denied() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::permission_denied("no rights"))
}

fn member(id: &str, lease: i64, incarnation: u64, wants_round: u64) -> v1::Member {
    v1::Member {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
        addr: format!("{id}.local"),
        local_world_size: 2,
        wants_round,
        status_addr: String::new(),
        lease,
        incarnation,
    }
}

/// Round `number` of `members` (node, incarnation).
fn round(number: u64, members: &[(&str, u64)]) -> v1::Round {
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

fn member_kv(m: &v1::Member, create_rev: i64) -> Kv {
    Kv {
        key: keys().member(&m.node_id),
        value: m.encode_to_vec(),
        create_rev,
        mod_rev: create_rev,
        lease: m.lease,
    }
}

fn coordinator_kv(id: &str, lease: i64) -> Kv {
    let c = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: id.into(),
    };
    Kv {
        key: keys().coordinator(),
        value: c.encode_to_vec(),
        create_rev: 2,
        mod_rev: 2,
        lease,
    }
}

fn round_kv(r: &v1::Round, mod_rev: i64) -> Kv {
    Kv {
        key: keys().round(),
        value: r.encode_to_vec(),
        create_rev: 1,
        mod_rev,
        lease: 0,
    }
}

fn unhealthy() -> v1::Unhealthy {
    v1::Unhealthy {
        schema: SCHEMA_VERSION,
        node_id: "a".into(),
        reason: "gpu check failed".into(),
        failures: 1,
        at_ms: 0,
    }
}

fn read_root() -> Op {
    Op::Range {
        key: keys().root().to_owned(),
        prefix: true,
        keys_only: false,
    }
}

// ---------------------------------------------------------------------------------------
// Effects
// ---------------------------------------------------------------------------------------

fn etcd_ops(effects: &[Effect]) -> Vec<Op> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Etcd(op) => Some(op.clone()),
            _ => None,
        })
        .collect()
}

/// The one etcd op among `effects`.
#[track_caller]
fn the_op(effects: &[Effect]) -> Op {
    let ops = etcd_ops(effects);
    assert_eq!(ops.len(), 1, "expected one etcd op in {effects:?}");
    ops.into_iter().next().unwrap()
}

#[track_caller]
fn no_op(effects: &[Effect]) {
    assert!(
        etcd_ops(effects).is_empty(),
        "expected no etcd op in {effects:?}"
    );
}

#[track_caller]
fn txn(op: Op) -> TxnSpec {
    match op {
        Op::Txn(spec) => spec,
        other => panic!("expected a transaction, got {other:?}"),
    }
}

fn replied(effects: &[Effect]) -> Vec<CommandId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply(id, _) => Some(*id),
            _ => None,
        })
        .collect()
}

/// The one reply to command `id` among `effects`.
#[track_caller]
fn reply_of(effects: &[Effect], id: CommandId) -> &Result<(), RendezvousError> {
    let found: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply(i, r) if *i == id => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(found.len(), 1, "expected one reply to {id} in {effects:?}");
    found[0]
}

#[track_caller]
fn replied_ok(effects: &[Effect], id: CommandId) {
    let r = reply_of(effects, id);
    assert!(r.is_ok(), "command {id} answered {r:?}");
}

fn closes_watches(effects: &[Effect]) -> bool {
    effects.iter().any(|e| matches!(e, Effect::CloseWatches))
}

fn probes(effects: &[Effect]) -> Vec<bool> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Probe(on) => Some(*on),
            _ => None,
        })
        .collect()
}

/// The value and lease of the put of `key` among `writes`.
#[track_caller]
fn put_at<'a>(writes: &'a [Write], key: &str) -> (&'a [u8], i64) {
    writes
        .iter()
        .find_map(|w| match w {
            Write::Put {
                key: k,
                value,
                lease,
            } if k == key => Some((value.as_slice(), *lease)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no put of {key} in {writes:?}"))
}

fn touches(writes: &[Write], key: &str) -> bool {
    writes.iter().any(|w| match w {
        Write::Put { key: k, .. } | Write::Delete(k) => k == key,
    })
}

// ---------------------------------------------------------------------------------------
// The harness
// ---------------------------------------------------------------------------------------

struct Harness {
    m: Machine,
    t0: Instant,
    now: Instant,
    counters: Counters,
    writes: Arc<AtomicU64>,
}

impl Harness {
    fn with(edit: impl FnOnce(&mut Config)) -> Self {
        let t0 = Instant::now();
        let mut cfg = config(t0);
        edit(&mut cfg);
        let counters = Counters::default();
        let writes = Arc::new(AtomicU64::new(0));
        Self {
            m: Machine::new(cfg, counters.clone(), writes.clone()),
            t0,
            now: t0,
            counters,
            writes,
        }
    }

    fn new() -> Self {
        Self::with(|_| {})
    }

    /// A machine through its first sync of a run holding `kvs`, watching.
    fn synced_with(kvs: &[Kv]) -> Self {
        let (h, rest) = Self::new().first_sync(kvs);
        no_op(&rest);
        assert!(matches!(h.m.phase(), Phase::Watching { .. }));
        h
    }

    fn synced() -> Self {
        Self::synced_with(&[])
    }

    /// Starts the machine and answers its first sync; returns the effects after the
    /// watches opened.
    fn first_sync(mut self, kvs: &[Kv]) -> (Self, Vec<Effect>) {
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
    fn sync_through(&mut self, mut effects: Vec<Effect>, kvs: &[Kv]) -> (Vec<Op>, Vec<Effect>) {
        let mut seen = Vec::new();
        loop {
            let ops = etcd_ops(&effects);
            let Some(op) = ops.first() else {
                return (seen, effects);
            };
            assert_eq!(ops.len(), 1, "one op at a time: {effects:?}");
            let answer = match op {
                Op::PickEndpoint | Op::Watch { .. } => Answer::Done,
                Op::Range {
                    keys_only: false, ..
                } if *op == read_root() => Answer::Range {
                    revision: REV,
                    kvs: kvs.to_vec(),
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

    fn at_ms(&mut self, ms: u64) {
        self.now = self.t0 + Duration::from_millis(ms);
    }

    fn later(&mut self, d: Duration) {
        self.now += d;
    }

    fn step(&mut self, input: Input) -> Vec<Effect> {
        self.m.step(self.now, input)
    }

    fn answer(&mut self, answer: Answer) -> Vec<Effect> {
        self.step(Input::Answer(Ok(answer)))
    }

    fn fail(&mut self, e: etcd_client::Error) -> Vec<Effect> {
        self.step(Input::Answer(Err(e)))
    }

    fn command(&mut self, id: CommandId, command: Command) -> Vec<Effect> {
        self.step(Input::Command(id, command))
    }

    fn timer(&mut self) -> Vec<Effect> {
        self.step(Input::Timer)
    }

    /// Moves the clock to the machine's deadline and fires it.
    #[track_caller]
    fn fire(&mut self) -> Vec<Effect> {
        let at = self.m.deadline().expect("a deadline");
        self.now = self.now.max(at);
        self.timer()
    }

    /// Registers for `wants_round`; etcd answers the transaction with `succeeded`.
    fn register(&mut self, id: CommandId, wants_round: u64, succeeded: bool) -> Vec<Effect> {
        let e = self.command(id, Command::Register { wants_round });
        assert!(matches!(the_op(&e), Op::Txn(_)));
        let e = self.answer(Answer::Txn { succeeded });
        replied_ok(&e, id);
        e
    }

    /// How long the machine waits before it syncs again, in ms (the backoff computes in
    /// floating point: a few nanoseconds either way are no difference).
    #[track_caller]
    fn retry_in_ms(&self) -> u64 {
        let Phase::Disconnected { until } = self.m.phase() else {
            panic!("not disconnected: {:?}", self.m.phase())
        };
        assert_eq!(self.m.deadline(), Some(until));
        (until.duration_since(self.now).as_secs_f64() * 1e3).round() as u64
    }

    /// etcd lost the connection under the watches: the machine waits to retry.
    fn disconnect(&mut self) -> Vec<Effect> {
        let e = self.step(Input::StreamFailed(cut()));
        assert!(matches!(self.m.phase(), Phase::Disconnected { .. }));
        e
    }
}

/// A node that registered first and won the coordinator key, at `at_ms`: its role-change
/// sync opened the coordinator's watches and its first commit is in flight.
fn coordinating(at_ms: u64) -> (Harness, TxnSpec) {
    let mut h = Harness::synced();
    h.at_ms(at_ms);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    let me = member("a", LEASE, 1, 0);
    let (ops, e) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    assert!(ops.contains(&Op::Watch {
        role: Role::Coordinator,
        from: REV + 1,
        lease: LEASE
    }));
    let spec = txn(the_op(&e));
    (h, spec)
}

// ---------------------------------------------------------------------------------------
// The first sync
// ---------------------------------------------------------------------------------------

#[test]
fn the_first_sync_reads_counts_members_checks_the_lease_and_watches_from_the_next_revision() {
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    let (ops, rest) = h.sync_through(e, &[]);
    assert_eq!(
        ops,
        vec![
            read_root(),
            Op::MemberCount,
            Op::TimeToLive { lease: LEASE },
            Op::Watch {
                role: Role::Member,
                from: REV + 1,
                lease: LEASE
            },
        ]
    );
    // On the first sync the registration claims the role: no campaign of its own.
    no_op(&rest);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: LEASE
        }
    );
}

#[test]
fn the_view_is_connected_once_the_first_sync_opened_the_watches() {
    let mut h = Harness::new();
    let e = h.m.start(h.now);
    assert!(!h.m.view().connected);
    let (_, rest) = h.sync_through(e, &[coordinator_kv("b", 200)]);
    no_op(&rest);
    let v = h.m.changed_view().expect("the sync changed the view");
    assert!(v.connected);
    assert_eq!(v.coordinator.as_deref(), Some("b"));
    assert!(h.m.changed_view().is_none(), "reported once");
}

#[test]
fn deadline_is_none_while_an_op_is_in_flight() {
    let mut h = Harness::new();
    h.m.start(h.now);
    assert_eq!(h.m.deadline(), None);
    let mut h = Harness::synced();
    assert!(h.m.deadline().is_some());
    h.command(1, Command::ReportDone { round: 1 });
    assert!(h.m.busy());
    assert_eq!(h.m.deadline(), None);
    h.answer(Answer::Done);
    assert!(h.m.deadline().is_some());
}

// ---------------------------------------------------------------------------------------
// Registration and the coordinator election
// ---------------------------------------------------------------------------------------

#[test]
fn register_claims_the_coordinator_key_when_nobody_holds_it() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, Command::Register { wants_round: 4 });
    let spec = txn(the_op(&e));
    assert_eq!(spec.when, vec![Compare::Absent(k.coordinator())]);
    let (value, lease) = put_at(&spec.then, &k.coordinator());
    assert_eq!(lease, LEASE);
    assert_eq!(v1::Coordinator::decode(value).unwrap().node_id, "a");
    let (value, lease) = put_at(&spec.then, &k.member("a"));
    assert_eq!(lease, LEASE);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.wants_round, m.lease, m.incarnation), (4, LEASE, 1));
    // The registration is written even when the claim loses.
    put_at(&spec.otherwise, &k.member("a"));
    assert!(!touches(&spec.otherwise, &k.coordinator()));
}

#[test]
fn winning_the_claim_resyncs_with_coordinator_watches() {
    let mut h = Harness::synced();
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    assert!(closes_watches(&e));
    assert_eq!(h.m.view().coordinator.as_deref(), Some("a"));
    assert_eq!(
        h.m.phase(),
        Phase::Syncing(Resync::RoleChanged { grace_until: None })
    );
    let me = member("a", LEASE, 1, 0);
    let (ops, _) = h.sync_through(e, &[member_kv(&me, 6), coordinator_kv("a", LEASE)]);
    // A role change asks nothing of the cluster's size.
    assert_eq!(
        ops,
        vec![
            read_root(),
            Op::TimeToLive { lease: LEASE },
            Op::Watch {
                role: Role::Coordinator,
                from: REV + 1,
                lease: LEASE
            },
        ]
    );
}

#[test]
fn register_does_not_claim_when_a_coordinator_is_known() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    let e = h.command(1, Command::Register { wants_round: 0 });
    let spec = txn(the_op(&e));
    assert!(spec.when.is_empty());
    assert!(!touches(&spec.then, &k.coordinator()));
    put_at(&spec.then, &k.member("a"));
}

#[test]
fn a_lost_claim_is_still_a_registration_and_keeps_the_member_watches() {
    let mut h = Harness::synced();
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.answer(Answer::Txn { succeeded: false });
    replied_ok(&e, 1);
    assert!(!closes_watches(&e));
    no_op(&e);
    assert_eq!(h.m.view().coordinator, None);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: LEASE
        }
    );
}

#[test]
fn a_command_is_answered_only_after_its_answer() {
    let mut h = Harness::synced();
    let e = h.command(1, Command::ReportDone { round: 3 });
    assert!(replied(&e).is_empty());
    let before = h.writes.load(Ordering::Relaxed);
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert_eq!(h.writes.load(Ordering::Relaxed), before + 1);
}

#[test]
fn lease_not_found_on_register_grants_a_new_lease_and_writes_again_as_incarnation_2() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    let e = h.fail(no_such_lease());
    assert!(replied(&e).is_empty());
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.member("a"));
    assert_eq!(lease, 300);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.lease, m.incarnation), (300, 2));
    assert_eq!((h.m.lease(), h.m.incarnation()), (300, 2));
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 1);
    // The open keep-alive stream is the old lease's: a resync opens one for the new.
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
}

#[test]
fn a_second_lease_not_found_after_the_regrant_is_the_reply() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    h.fail(no_such_lease());
    h.answer(Answer::Granted { id: 300 });
    let e = h.fail(no_such_lease());
    // Answered, and the session syncs again to keep the lease it now holds alive.
    assert_eq!(the_op(&e), read_root());
    match reply_of(&e, 1) {
        Err(RendezvousError::Etcd { what, .. }) => assert_eq!(*what, "registering this node"),
        other => panic!("expected the refusal as the reply, got {other:?}"),
    }
}

#[test]
fn a_second_lease_not_found_after_the_regrant_grants_no_third_lease_at_once() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.command(1, Command::Register { wants_round: 0 });
    h.fail(no_such_lease());
    h.answer(Answer::Granted { id: 300 });
    let e = h.fail(no_such_lease());
    assert!(
        !etcd_ops(&e).iter().any(|op| matches!(op, Op::Grant { .. })),
        "no grant loop: {e:?}"
    );
    assert_eq!(h.m.lease(), 300);
}

// ---------------------------------------------------------------------------------------
// Errors, outages and the backoff
// ---------------------------------------------------------------------------------------

#[test]
fn a_transient_error_keeps_the_command_until_the_next_sync_serves_it() {
    let k = keys();
    let mut h = Harness::synced();
    h.command(1, Command::ReportDone { round: 3 });
    let e = h.fail(cut());
    assert!(
        replied(&e).is_empty(),
        "never answered with a transient error"
    );
    no_op(&e);
    assert!(closes_watches(&e));
    assert_eq!(h.retry_in_ms(), 100);
    assert!(!h.m.view().connected);
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 1);

    let e = h.fire();
    let (ops, e) = h.sync_through(e, &[]);
    assert_eq!(
        ops.len(),
        4,
        "read, member count, time-to-live, watch: {ops:?}"
    );
    // The waiting command is served once the watches are open again.
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the done record again: {e:?}")
    };
    assert_eq!(key, k.done(3, "a"));
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert!(h.m.view().connected);
}

#[test]
fn a_permanent_error_is_the_reply() {
    let mut h = Harness::synced();
    h.command(1, Command::ReportDone { round: 3 });
    let e = h.fail(denied());
    no_op(&e);
    match reply_of(&e, 1) {
        Err(RendezvousError::Etcd { what, .. }) => {
            assert_eq!(*what, "reporting this node finished")
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 0);
}

#[test]
fn running_and_abandon_are_served_while_disconnected_and_other_commands_wait() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(
        1,
        Command::Running {
            round: round(2, &[("a", 1)]),
        },
    );
    replied_ok(&e, 1);
    no_op(&e);
    let e = h.command(2, Command::Abandon);
    replied_ok(&e, 2);
    no_op(&e);
    let e = h.command(3, Command::ReportDone { round: 2 });
    assert!(e.is_empty(), "waits for etcd: {e:?}");
    let e = h.command(
        4,
        Command::Halt {
            halt: v1::Halt::default(),
        },
    );
    assert!(e.is_empty(), "waits for etcd: {e:?}");
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

#[test]
fn depart_is_served_while_disconnected() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(
        1,
        Command::Depart {
            how: Departure::Failed,
        },
    );
    assert_eq!(
        the_op(&e),
        Op::Depart {
            record: None,
            lease: LEASE
        }
    );
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 1);
    assert!(h.m.ended());
}

#[test]
fn the_backoff_doubles_after_another_failure() {
    let mut h = Harness::synced();
    h.disconnect();
    assert_eq!(h.retry_in_ms(), 100);
    let e = h.fire();
    assert_eq!(the_op(&e), read_root());
    h.fail(cut());
    assert_eq!(h.retry_in_ms(), 200);
    let e = h.fire();
    assert_eq!(the_op(&e), read_root());
    h.fail(cut());
    assert_eq!(h.retry_in_ms(), 400);
}

#[test]
fn a_timer_before_the_retry_deadline_does_nothing() {
    let mut h = Harness::synced();
    h.disconnect();
    h.later(FIRST_RETRY / 2);
    let e = h.timer();
    assert!(e.is_empty(), "{e:?}");
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
}

#[test]
fn the_session_gives_up_after_the_outage_limit_and_answers_the_waiting_commands() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(7, Command::ReportDone { round: 1 });
    assert!(e.is_empty());
    h.later(Duration::from_secs(61));
    let e = h.timer();
    assert_eq!(the_op(&e), read_root());
    let e = h.fail(cut());
    no_op(&e);
    assert_eq!(h.m.phase(), Phase::Ended);
    let why = h.m.view().gave_up.clone().expect("the view says why");
    assert!(why.contains("etcd has not answered for 61s"), "{why}");
    assert!(
        matches!(reply_of(&e, 7), Err(RendezvousError::Outage(r)) if *r == why),
        "{e:?}"
    );
    assert_eq!(h.m.deadline(), None);
    // A command after the end hears the same.
    let e = h.command(8, Command::ReportDone { round: 1 });
    assert!(matches!(reply_of(&e, 8), Err(RendezvousError::Outage(_))));
}

#[test]
fn an_outage_shorter_than_the_limit_does_not_give_up() {
    let mut h = Harness::synced();
    h.disconnect();
    h.later(Duration::from_secs(59));
    let e = h.timer();
    assert_eq!(the_op(&e), read_root());
    h.fail(cut());
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
    assert_eq!(h.m.view().gave_up, None);
}

#[test]
fn a_watch_that_ended_resyncs_without_raising_the_backoff() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.fire();
    let (_, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    let e = h.step(Input::WatchEnded);
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
    h.fail(cut());
    // One failure before the good watch, none since: the backoff starts over.
    assert_eq!(h.retry_in_ms(), 100);
}

#[test]
fn commands_closed_ends_the_session_and_answers_waiting_commands() {
    let mut h = Harness::synced();
    h.disconnect();
    h.command(1, Command::ReportDone { round: 1 });
    let e = h.step(Input::CommandsClosed);
    assert_eq!(h.m.phase(), Phase::Ended);
    assert!(matches!(
        reply_of(&e, 1),
        Err(RendezvousError::SessionEnded(_))
    ));
    assert_eq!(h.m.deadline(), None);
}

// ---------------------------------------------------------------------------------------
// Keep-alives, the lease clock and the prober
// ---------------------------------------------------------------------------------------

#[test]
fn the_first_timer_sends_a_keep_alive_and_the_next_is_a_third_of_the_ttl_later() {
    let mut h = Harness::synced();
    assert_eq!(
        h.m.deadline(),
        Some(h.t0),
        "due as soon as the watches open"
    );
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    let e = h.answer(Answer::Done);
    no_op(&e);
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 3));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
}

#[test]
fn an_answered_keep_alive_extends_lease_safe_until_from_when_it_was_sent() {
    let mut h = Harness::synced();
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + TTL));
    h.at_ms(1_000);
    let e = h.timer();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    let _ = h.m.changed_view();
    h.at_ms(1_050);
    h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + SECOND + TTL));
    assert!(h.m.changed_view().is_some(), "the driver publishes it");
}

#[test]
fn a_lease_answer_of_none_grants_registers_and_resyncs() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.step(Input::LeaseAnswer(None));
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.member("a"));
    assert_eq!(lease, 300);
    assert_eq!(v1::Member::decode(value).unwrap().incarnation, 2);
    let e = h.answer(Answer::Txn { succeeded: true });
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
    assert_eq!(h.m.phase(), Phase::Syncing(Resync::Outage));
}

#[test]
fn a_lease_answer_of_none_without_a_registration_only_grants_and_resyncs() {
    let mut h = Harness::synced();
    let e = h.step(Input::LeaseAnswer(None));
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!(the_op(&e), read_root());
}

#[test]
fn a_lease_gone_after_safe_until_while_running_records_this_nodes_departure() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    h.command(
        2,
        Command::Running {
            round: round(1, &[("a", 1), ("b", 1)]),
        },
    );
    // Safe until t0 + 6 s: from then on etcd may have expired it.
    h.at_ms(6_500);
    h.step(Input::LeaseAnswer(None));
    assert_eq!(
        h.m.view().departed.get("a"),
        Some(&Departed {
            at: h.now,
            incarnation: 1
        })
    );
}

#[test]
fn a_lease_gone_before_safe_until_records_no_departure() {
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    h.command(
        2,
        Command::Running {
            round: round(1, &[("a", 1), ("b", 1)]),
        },
    );
    // etcd cannot have expired it yet: it lost its data, and nobody saw this node leave.
    h.at_ms(3_000);
    let e = h.step(Input::LeaseAnswer(None));
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    assert!(h.m.view().departed.is_empty());
}

#[test]
fn with_one_member_a_keep_alive_unanswered_near_the_fence_starts_the_probe() {
    let mut h = Harness::synced();
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    let e = h.fire();
    assert_eq!(h.now, h.t0 + TTL / 3);
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    // Safe until t0 + 6 s; the probe starts a margin (1 s) and a quarter TTL before.
    let due = h.t0 + TTL - SECOND - TTL / 4;
    assert_eq!(h.m.deadline(), Some(due));
    let e = h.fire();
    no_op(&e);
    assert_eq!(probes(&e), vec![true]);
    // Probing: the next wake-up is the next keep-alive, not the answer again.
    assert_eq!(h.m.deadline(), Some(h.t0 + 2 * TTL / 3));
}

#[test]
fn an_answered_keep_alive_stops_the_probe() {
    let mut h = Harness::synced();
    h.fire();
    h.answer(Answer::Done);
    h.fire();
    h.answer(Answer::Done);
    let e = h.fire();
    assert_eq!(probes(&e), vec![true]);
    let e = h.step(Input::LeaseAnswer(Some(6)));
    assert_eq!(probes(&e), vec![false]);
}

#[test]
fn no_leader_extends_lease_safe_until() {
    let mut h = Harness::synced();
    h.at_ms(3_500);
    h.step(Input::NoLeader {
        sent: h.t0 + 3 * SECOND,
    });
    assert_eq!(h.m.view().lease_safe_until, Some(h.t0 + 3 * SECOND + TTL));
}

#[test]
fn with_several_endpoints_a_late_keep_alive_drops_the_connection_and_the_next_sync_picks_an_endpoint()
 {
    let (mut h, rest) = Harness::with(|c| c.several_endpoints = true).first_sync(&[]);
    no_op(&rest);
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    h.answer(Answer::Done);
    assert_eq!(h.m.deadline(), Some(h.t0 + TTL / 4));
    let e = h.fire();
    no_op(&e);
    assert!(closes_watches(&e));
    assert!(matches!(h.m.phase(), Phase::Disconnected { .. }));
    let e = h.fire();
    assert_eq!(the_op(&e), Op::PickEndpoint);
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), read_root());
}

// ---------------------------------------------------------------------------------------
// Watch events
// ---------------------------------------------------------------------------------------

#[test]
fn a_deleted_coordinator_key_makes_a_registered_node_campaign() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.coordinator(),
        prev: None,
    }]));
    let spec = txn(the_op(&e));
    assert_eq!(spec.when, vec![Compare::Absent(k.coordinator())]);
    let (value, lease) = put_at(&spec.then, &k.coordinator());
    assert_eq!(lease, LEASE);
    assert_eq!(v1::Coordinator::decode(value).unwrap().node_id, "a");
    // The campaign claims the role only; the registration stands as it was.
    assert!(!touches(&spec.then, &k.member("a")));
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(h.m.view().coordinator.as_deref(), Some("a"));
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
}

#[test]
fn an_unregistered_node_does_not_campaign() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    let e = h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.coordinator(),
        prev: None,
    }]));
    no_op(&e);
    assert_eq!(h.m.view().coordinator, None);
}

#[test]
fn stale_watch_events_queued_before_a_resync_are_dropped() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.fire();
    assert_eq!(the_op(&e), Op::KeepAlive);
    // All three wait for the keep-alive's answer.
    assert!(h.step(Input::WatchEnded).is_empty());
    let stale = WatchEvent::Put(round_kv(&round(1, &[("b", 1)]), 8));
    assert!(h.step(Input::Watched(vec![stale])).is_empty());
    assert!(h.command(1, Command::ReportDone { round: 1 }).is_empty());
    let e = h.answer(Answer::Done);
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), read_root());
    let (_, e) = h.sync_through(e, &[]);
    // The put came from the closed watch: the read says there is no round.
    assert!(h.m.view().round.is_none());
    // The command is not stream traffic: it survives the resync.
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the done record: {e:?}")
    };
    assert_eq!(key, k.done(1, "a"));
}

#[test]
fn inputs_that_come_while_an_op_is_in_flight_are_handled_after_it_in_order() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, Command::ReportDone { round: 1 });
    assert!(matches!(the_op(&e), Op::Put(_)));
    assert!(
        h.command(
            2,
            Command::PublishMaster {
                round: 1,
                port: 29500
            }
        )
        .is_empty()
    );
    let halt = v1::Halt {
        schema: SCHEMA_VERSION,
        node_id: "a".into(),
        exit_code: 3,
        reason: "stop".into(),
        round: 1,
    };
    assert!(h.command(3, Command::Halt { halt }).is_empty());
    let e = h.answer(Answer::Done);
    assert_eq!(replied(&e), vec![1]);
    let Op::Put(Write::Put { key, .. }) = the_op(&e) else {
        panic!("expected the master: {e:?}")
    };
    assert_eq!(key, k.master());
    let e = h.answer(Answer::Done);
    assert_eq!(replied(&e), vec![2]);
    let spec = txn(the_op(&e));
    put_at(&spec.then, &k.halt());
    let e = h.answer(Answer::Txn { succeeded: true });
    assert_eq!(replied(&e), vec![3]);
    no_op(&e);
}

// ---------------------------------------------------------------------------------------
// The coordinator's seal
// ---------------------------------------------------------------------------------------

#[test]
fn a_coordinator_with_enough_members_commits_a_round_fenced_on_an_absent_round_key() {
    let k = keys();
    let (mut h, spec) = coordinating(0);
    // Never after a halt either.
    assert_eq!(
        spec.when,
        vec![Compare::Absent(k.round()), Compare::Absent(k.halt())]
    );
    let (value, lease) = put_at(&spec.then, &k.round());
    assert_eq!(lease, 0, "a round outlives its coordinator");
    let r = v1::Round::decode(value).unwrap();
    assert_eq!(r.number, 0);
    assert_eq!(r.members, vec![member("a", LEASE, 1, 0)]);
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 0);
    h.answer(Answer::Txn { succeeded: true });
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 1);
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Coordinator,
            lease: LEASE
        }
    );
}

#[test]
fn a_failed_commit_does_not_count_as_sealed() {
    let (mut h, _) = coordinating(0);
    let e = h.answer(Answer::Txn { succeeded: false });
    no_op(&e);
    assert_eq!(h.counters.rounds_sealed.load(Ordering::Relaxed), 0);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

#[test]
fn a_commit_is_fenced_on_the_mod_revision_of_the_round_it_replaces() {
    let k = keys();
    let old = round(1, &[("b", 1)]);
    let me = member("a", LEASE, 1, 2);
    let (_, rest) = Harness::new().first_sync(&[
        round_kv(&old, 9),
        member_kv(&me, 4),
        coordinator_kv("a", LEASE),
    ]);
    // Round 1's only member is gone: "a", ready for round 2, gets it.
    let spec = txn(the_op(&rest));
    assert_eq!(
        spec.when,
        vec![
            Compare::ModRevision(k.round(), 9),
            Compare::Absent(k.halt())
        ]
    );
    let r = v1::Round::decode(put_at(&spec.then, &k.round()).0).unwrap();
    assert_eq!(r.number, 2);
    assert_eq!(r.members, vec![me]);
}

#[test]
fn unix_ms_counts_from_unix_ms_at_grant() {
    let k = keys();
    let (_, spec) = coordinating(2_345);
    let r = v1::Round::decode(put_at(&spec.then, &k.round()).0).unwrap();
    assert_eq!(r.sealed_at_ms, UNIX_MS_AT_GRANT + 2_345);
}

#[test]
fn withdraw_as_coordinator_deletes_the_coordinator_key() {
    let k = keys();
    let (mut h, _) = coordinating(0);
    h.answer(Answer::Txn { succeeded: true });
    let e = h.command(
        5,
        Command::Withdraw {
            record: unhealthy(),
        },
    );
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.then,
        vec![
            Write::Delete(k.member("a")),
            Write::Put {
                key: k.unhealthy("a"),
                value: unhealthy().encode_to_vec(),
                lease: LEASE
            },
            Write::Delete(k.coordinator()),
        ]
    );
    // The next registration is a new incarnation.
    assert_eq!(h.m.incarnation(), 2);
    let e = h.answer(Answer::Txn { succeeded: true });
    replied_ok(&e, 5);
}

#[test]
fn withdraw_as_a_member_leaves_the_coordinator_key() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 0, true);
    let e = h.command(
        2,
        Command::Withdraw {
            record: unhealthy(),
        },
    );
    let spec = txn(the_op(&e));
    assert!(touches(&spec.then, &k.member("a")));
    assert!(!touches(&spec.then, &k.coordinator()));
}

// ---------------------------------------------------------------------------------------
// Outages and the round this node runs
// ---------------------------------------------------------------------------------------

#[test]
fn after_an_outage_the_grace_timer_reads_member_keys_and_departs_absent_round_members() {
    let k = keys();
    let (mut h, _) = Harness::with(|c| c.can_probe = false).first_sync(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.command(
        2,
        Command::Running {
            round: mine.clone(),
        },
    );
    h.disconnect();
    let e = h.fire();
    let grace = h.now + TTL + SECOND;
    let (_, rest) = h.sync_through(
        e,
        &[
            member_kv(&member("a", LEASE, 1, 1), 6),
            round_kv(&mine, 7),
            coordinator_kv("b", 200),
        ],
    );
    no_op(&rest);
    // After an outage nobody is judged by the read: "b" has a TTL to come back.
    assert!(h.m.view().departed.is_empty());
    let op = loop {
        let e = h.fire();
        match the_op(&e) {
            Op::KeepAlive => {
                h.answer(Answer::Done);
            }
            other => break other,
        }
    };
    assert_eq!(h.now, grace);
    assert_eq!(
        op,
        Op::Range {
            key: k.members(),
            prefix: true,
            keys_only: true
        }
    );
    let present = Kv {
        key: k.member("a"),
        value: Vec::new(),
        create_rev: 6,
        mod_rev: 6,
        lease: LEASE,
    };
    h.answer(Answer::Range {
        revision: 9,
        kvs: vec![present],
    });
    let departed = &h.m.view().departed;
    assert_eq!(
        departed.get("b"),
        Some(&Departed {
            at: grace,
            incarnation: 1
        })
    );
    assert!(!departed.contains_key("a"));
}

#[test]
fn a_running_round_missing_after_a_resync_is_republished() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.command(
        2,
        Command::Running {
            round: mine.clone(),
        },
    );
    let e = h.step(Input::WatchEnded);
    // etcd came back empty: neither our registration nor our round is there.
    let (_, e) = h.sync_through(e, &[]);
    let spec = txn(the_op(&e));
    put_at(&spec.then, &k.member("a"));
    let e = h.answer(Answer::Txn { succeeded: true });
    let spec = txn(the_op(&e));
    assert_eq!(spec.when, vec![Compare::Absent(k.round())]);
    let (value, _) = put_at(&spec.then, &k.round());
    assert_eq!(value, mine.encode_to_vec().as_slice());
}

#[test]
fn an_evicted_node_records_its_departure_and_registers_as_the_next_incarnation() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 1, true);
    let mine = round(1, &[("a", 1), ("b", 1)]);
    h.command(
        2,
        Command::Running {
            round: mine.clone(),
        },
    );
    h.later(SECOND);
    let e = h.step(Input::WatchEnded);
    // The lease lives and the round is there, but our key is gone: someone deleted it.
    let (_, e) = h.sync_through(
        e,
        &[
            round_kv(&mine, 7),
            coordinator_kv("b", 200),
            member_kv(&member("b", 200, 1, 1), 3),
        ],
    );
    assert_eq!(
        h.m.view().departed.get("a"),
        Some(&Departed {
            at: h.now,
            incarnation: 1
        })
    );
    let spec = txn(the_op(&e));
    let (value, lease) = put_at(&spec.then, &k.member("a"));
    assert_eq!(lease, LEASE);
    let m = v1::Member::decode(value).unwrap();
    assert_eq!((m.lease, m.incarnation), (LEASE, 2));
    assert_eq!(h.m.incarnation(), 2);
}

// ---------------------------------------------------------------------------------------
// Abandon, eviction and departure
// ---------------------------------------------------------------------------------------

#[test]
fn abandon_makes_the_next_sync_revoke_then_grant_then_read() {
    let mut h = Harness::synced();
    let e = h.command(1, Command::Abandon);
    replied_ok(&e, 1);
    assert!(closes_watches(&e));
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
    let e = h.answer(Answer::Done);
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!((h.m.lease(), h.m.incarnation()), (300, 2));
    let (ops, rest) = h.sync_through(e, &[]);
    no_op(&rest);
    assert_eq!(
        ops,
        vec![
            read_root(),
            Op::MemberCount,
            Op::TimeToLive { lease: 300 },
            Op::Watch {
                role: Role::Member,
                from: REV + 1,
                lease: 300
            },
        ]
    );
    assert_eq!(
        h.m.phase(),
        Phase::Watching {
            role: Role::Member,
            lease: 300
        }
    );
}

#[test]
fn a_revoke_answered_lease_not_found_still_grants_and_reads() {
    let mut h = Harness::synced();
    let e = h.command(1, Command::Abandon);
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
    // The fenced lease expired meanwhile: gone either way.
    let e = h.fail(no_such_lease());
    assert_eq!(the_op(&e), Op::Grant { ttl: 6 });
    let e = h.answer(Answer::Granted { id: 300 });
    assert_eq!(the_op(&e), read_root());
    assert_eq!(h.counters.errors.load(Ordering::Relaxed), 0);
}

#[test]
fn abandon_while_disconnected_revokes_first_at_the_next_sync() {
    let mut h = Harness::synced();
    h.disconnect();
    let e = h.command(1, Command::Abandon);
    replied_ok(&e, 1);
    no_op(&e);
    let e = h.fire();
    assert_eq!(the_op(&e), Op::Revoke { lease: LEASE });
}

fn evict_b() -> Command {
    Command::Evict {
        node: "b".into(),
        lease: 200,
        round: 1,
        detect_ms: 5,
    }
}

#[test]
fn evicting_a_node_already_departed_needs_no_op() {
    let k = keys();
    let mut h = Harness::synced();
    let prev = member("b", 200, 1, 1).encode_to_vec();
    h.step(Input::Watched(vec![WatchEvent::Delete {
        key: k.member("b"),
        prev: Some(prev),
    }]));
    assert!(h.m.view().departed.contains_key("b"));
    let e = h.command(1, evict_b());
    replied_ok(&e, 1);
    no_op(&e);
}

#[test]
fn evicting_a_node_whose_lease_no_longer_holds_its_registration_takes_one_txn() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, evict_b());
    assert!(replied(&e).is_empty());
    assert_eq!(
        txn(the_op(&e)),
        TxnSpec {
            when: vec![Compare::Lease(k.member("b"), 200)],
            ..TxnSpec::default()
        }
    );
    let e = h.answer(Answer::Txn { succeeded: false });
    replied_ok(&e, 1);
    no_op(&e);
}

#[test]
fn evicting_a_node_that_holds_says_gone_then_revokes() {
    let k = keys();
    let mut h = Harness::synced();
    h.command(1, evict_b());
    let e = h.answer(Answer::Txn { succeeded: true });
    let spec = txn(the_op(&e));
    let key = k.gone(1, "b");
    assert_eq!(spec.when, vec![Compare::Absent(key.clone())]);
    let gone = v1::Gone::decode(put_at(&spec.then, &key).0).unwrap();
    assert_eq!(
        (
            gone.round,
            gone.node_id.as_str(),
            gone.how(),
            gone.detect_ms
        ),
        (1, "b", v1::Detection::Refused, 5)
    );
    let e = h.answer(Answer::Txn { succeeded: true });
    assert!(replied(&e).is_empty());
    assert_eq!(the_op(&e), Op::Revoke { lease: 200 });
    let e = h.answer(Answer::Done);
    replied_ok(&e, 1);
    no_op(&e);
}

#[test]
fn evicting_a_node_whose_lease_went_during_the_revoke_is_answered_ok() {
    let mut h = Harness::synced();
    h.command(1, evict_b());
    h.answer(Answer::Txn { succeeded: true });
    h.answer(Answer::Txn { succeeded: true });
    let e = h.fail(no_such_lease());
    replied_ok(&e, 1);
    assert!(matches!(h.m.phase(), Phase::Watching { .. }));
}

#[test]
fn depart_while_running_records_the_leave_beside_the_revoke_and_ends() {
    let k = keys();
    let mut h = Harness::synced_with(&[coordinator_kv("b", 200)]);
    h.register(1, 4, true);
    h.command(
        2,
        Command::Running {
            round: round(4, &[("a", 1), ("b", 1)]),
        },
    );
    let e = h.command(
        3,
        Command::Depart {
            how: Departure::Left,
        },
    );
    let Op::Depart {
        record: Some(spec),
        lease,
    } = the_op(&e)
    else {
        panic!("expected a departure with its record: {e:?}")
    };
    assert_eq!(lease, LEASE);
    let key = k.gone(4, "a");
    assert_eq!(spec.when, vec![Compare::Absent(key.clone())]);
    let gone = v1::Gone::decode(put_at(&spec.then, &key).0).unwrap();
    assert_eq!(gone.how(), v1::Detection::Left);
    let e = h.answer(Answer::Departed {
        said: None,
        revoked: None,
    });
    replied_ok(&e, 3);
    assert_eq!(h.m.phase(), Phase::Ended);
    assert_eq!(h.m.deadline(), None);
}

#[test]
fn depart_after_finishing_sends_no_gone_record() {
    let mut h = Harness::synced();
    h.command(
        1,
        Command::Running {
            round: round(4, &[("a", 1)]),
        },
    );
    let e = h.command(
        2,
        Command::Depart {
            how: Departure::Finished,
        },
    );
    assert_eq!(
        the_op(&e),
        Op::Depart {
            record: None,
            lease: LEASE
        }
    );
}

// ---------------------------------------------------------------------------------------
// Other commands' writes
// ---------------------------------------------------------------------------------------

#[test]
fn report_failure_is_guarded_on_the_halt_key_being_absent() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(1, Command::ReportFailure { round: 3 });
    let spec = txn(the_op(&e));
    assert_eq!(
        spec.when,
        vec![Compare::Absent(k.failure(3)), Compare::Absent(k.halt())]
    );
    let failure = v1::Failure::decode(put_at(&spec.then, &k.failure(3)).0).unwrap();
    assert_eq!((failure.round, failure.node_id.as_str()), (3, "a"));
}

#[test]
fn publish_master_is_written_on_the_lease() {
    let k = keys();
    let mut h = Harness::synced();
    let e = h.command(
        1,
        Command::PublishMaster {
            round: 2,
            port: 29500,
        },
    );
    let Op::Put(Write::Put { key, value, lease }) = the_op(&e) else {
        panic!("expected a put: {e:?}")
    };
    assert_eq!((key, lease), (k.master(), LEASE));
    let master = v1::Master::decode(value.as_slice()).unwrap();
    assert_eq!(
        (master.round, master.addr.as_str(), master.port),
        (2, "10.0.0.1", 29500)
    );
}
