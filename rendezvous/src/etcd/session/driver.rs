//! The real driver: carries the machine's effects out with etcd-client and turns what the
//! streams, the handle, the prober and the clock say into inputs. The only `select!` of
//! the session.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchResponse, WatchStream,
};
use fsdp_proto::v1;
use tokio::sync::{mpsc, watch};

use super::io::{Answer, Compare, Effect, Input, Kv, Op, Role, TxnSpec, WatchEvent, Write};
use super::machine::Machine;
use super::{Request, records};
use crate::etcd::connect::{self, EtcdOptions};
use crate::etcd::keys::Keys;
use crate::etcd::probe::{Prober, Proof};
use crate::etcd::token;
use crate::etcd::view::View;

type EtcdResult<T> = Result<T, etcd_client::Error>;

/// The streams of [`crate::etcd::session::Phase::Watching`].
struct Streams {
    /// Control keys; for the coordinator, every key of the run.
    ctl: WatchStream,
    /// Member departures (members only: the coordinator's one watch has them in order).
    members: Option<WatchStream>,
    keeper: LeaseKeeper,
    /// `None` once it failed or ended, until a new one is opened: an ended stream answers
    /// every poll at once, and each answer would be read as the lease gone again.
    kept: Option<LeaseKeepAliveStream>,
}

/// The connection to etcd and the streams open on it: what an op needs.
struct Conn {
    client: Client,
    keys: Keys,
    options: Option<EtcdOptions>,
    ttl: std::time::Duration,
    streams: Option<Streams>,
}

pub struct Driver {
    conn: Conn,
    machine: Machine,
    view: watch::Sender<View>,
    commands: mpsc::UnboundedReceiver<Request>,
    replies: HashMap<u64, tokio::sync::oneshot::Sender<Result<(), crate::RendezvousError>>>,
    next_id: u64,
    prober: Option<Prober>,
    /// Ops in a row that went unanswered past their deadline (see [`op_patience`]).
    cuts: u32,
    proofs: (mpsc::UnboundedSender<Proof>, mpsc::UnboundedReceiver<Proof>),
}

impl Driver {
    pub fn new(
        client: Client,
        options: Option<EtcdOptions>,
        machine: Machine,
        view: watch::Sender<View>,
        commands: mpsc::UnboundedReceiver<Request>,
    ) -> Self {
        let (keys, ttl) = (machine.keys().clone(), machine.ttl());
        Self {
            conn: Conn {
                client,
                keys,
                options,
                ttl,
                streams: None,
            },
            machine,
            view,
            commands,
            replies: HashMap::new(),
            cuts: 0,
            next_id: 0,
            prober: None,
            proofs: mpsc::unbounded_channel(),
        }
    }

    /// Runs the machine until the session ends (or the task is aborted).
    pub async fn run(mut self) {
        let effects = self.machine.start(Instant::now());
        self.publish();
        self.carry_out(effects).await;
        while !self.machine.ended() {
            let input = self.next_input().await;
            let effects = self.step(input);
            self.carry_out(effects).await;
        }
    }

    fn step(&mut self, input: Input) -> Vec<Effect> {
        let effects = self.machine.step(Instant::now(), input);
        self.publish();
        effects
    }

    fn publish(&mut self) {
        publish(&mut self.machine, &self.view);
    }

    async fn carry_out(&mut self, effects: Vec<Effect>) {
        let mut queue = VecDeque::from(effects);
        while let Some(effect) = queue.pop_front() {
            match effect {
                Effect::Etcd(op) => {
                    let patience = op_patience(self.conn.ttl, self.cuts);
                    let answer = if op.uses_streams() {
                        self.wait_alone(op, patience).await
                    } else {
                        let (answer, beside) = self.wait_reading(op, patience).await;
                        // Stepped while the op was in flight: the machine gives nothing
                        // but keep-alives (sent already) and the prober's switch then.
                        debug_assert!(beside.iter().all(|e| matches!(e, Effect::Probe(_))));
                        queue.extend(beside);
                        answer
                    };
                    self.cuts = match &answer {
                        Err(e) if connect::is_unanswered(e) => self.cuts.saturating_add(1),
                        _ => 0,
                    };
                    queue.extend(self.step(Input::Answer(answer)));
                }
                Effect::Reply(id, result) => {
                    // The handle may have stopped waiting (its future was dropped).
                    if let Some(reply) = self.replies.remove(&id) {
                        let _ = reply.send(result);
                    }
                }
                Effect::CloseWatches => self.conn.streams = None,
                Effect::KeepAlive => self.conn.keep_alive().await,
                Effect::Probe(on) => self.prober = on.then(|| self.start_prober()).flatten(),
            }
        }
    }

    /// Carries out an op that opens or uses the streams (or replaces the client): nothing
    /// else moves meanwhile but the prober's proofs, which count while an op waits on a
    /// stalled etcd (that is when they are needed). These ops are local or short.
    async fn wait_alone(&mut self, op: Op, patience: Duration) -> EtcdResult<Answer> {
        let exec = self.conn.execute(op);
        tokio::pin!(exec);
        let give_up = tokio::time::sleep(patience);
        tokio::pin!(give_up);
        loop {
            tokio::select! {
                answer = &mut exec => break answer,
                () = &mut give_up => break Err(connect::unanswered(patience)),
                Some(p) = self.proofs.1.recv() => {
                    self.machine.step(Instant::now(), Input::from(p));
                    publish(&mut self.machine, &self.view);
                }
            }
        }
    }

    /// Carries out a request on its own handle to the client while the streams are read
    /// and the lease is kept alive. What the streams bring goes to the machine as it
    /// comes (the machine keeps it for after the answer). An unread stream kept its data
    /// in the connection's HTTP/2 window: at 10,000 nodes on 100 connections a round
    /// waiting unread on a few watches held whole connections still, every op on them
    /// went unanswered until its deadline, and each node reconnected and read the run
    /// again, more load on an etcd already behind (issue 30: 40,000 such deadlines in
    /// 300 s). Returns the answer and what the machine asked for meanwhile.
    async fn wait_reading(
        &mut self,
        op: Op,
        patience: Duration,
    ) -> (EtcdResult<Answer>, Vec<Effect>) {
        let exec = request(self.conn.client.clone(), op);
        tokio::pin!(exec);
        let give_up = tokio::time::sleep(patience);
        tokio::pin!(give_up);
        let mut beside = Vec::new();
        // An ended stream answers every poll at once: it is read no more until the
        // answer, and the machine hears of its end then.
        let mut watches_open = true;
        loop {
            let due = self.machine.deadline();
            // What the watches bring waits in the machine; past this much they are left
            // to the connection's flow control again (etcd keeps a slow watcher's events
            // in its store, not in memory). 10,000 simulated nodes in one process, each
            // keeping up to 4 MiB, grew to 18 GB while etcd was behind.
            let room = self.machine.queued_bytes() < QUEUED_WHILE_WAITING;
            let Self {
                conn: Conn { streams, .. },
                machine,
                proofs,
                ..
            } = self;
            let (ctl, members, kept) = match streams.as_mut() {
                Some(s) if watches_open && room => {
                    (Some(&mut s.ctl), s.members.as_mut(), s.kept.as_mut())
                }
                Some(s) => (None, None, s.kept.as_mut()),
                None => (None, None, None),
            };
            let timer = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let input = tokio::select! {
                biased;
                answer = &mut exec => return (answer, beside),
                () = &mut give_up => return (Err(connect::unanswered(patience)), beside),
                Some(p) = proofs.1.recv() => Input::from(p),
                msg = next_answer(kept) => match msg {
                    Ok(answer) => Input::LeaseAnswer(answer.map(|r| r.ttl())),
                    Err(e) => Input::KeepAliveFailed(e),
                },
                () = timer => Input::Timer,
                msg = next_watch(ctl) => watch_input(msg),
                msg = next_watch(members) => watch_input(msg),
            };
            match &input {
                Input::KeepAliveFailed(_) | Input::LeaseAnswer(None) => {
                    if let Some(s) = streams.as_mut() {
                        s.kept = None;
                    }
                }
                Input::WatchEnded | Input::StreamFailed(_) => watches_open = false,
                _ => {}
            }
            for effect in machine.step(Instant::now(), input) {
                match effect {
                    Effect::KeepAlive => self.conn.keep_alive().await,
                    other => beside.push(other),
                }
            }
            publish(&mut self.machine, &self.view);
        }
    }

    fn start_prober(&self) -> Option<Prober> {
        let opts = self.conn.options.as_ref()?;
        let endpoint = opts.endpoints.first()?.clone();
        let proofs = self.proofs.0.clone();
        Some(Prober::start(endpoint, opts.clone(), self.conn.ttl, proofs))
    }

    async fn next_input(&mut self) -> Input {
        let sleep = async {
            match self.machine.deadline() {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let Self {
            conn: Conn { streams, .. },
            commands,
            proofs,
            replies,
            next_id,
            ..
        } = self;
        let (ctl, members, kept) = match streams {
            Some(s) => (Some(&mut s.ctl), s.members.as_mut(), s.kept.as_mut()),
            None => (None, None, None),
        };
        // In this order when several are ready: the keep-alive stream's end before the
        // timer that would send a keep-alive on it ("channel closed", an outage), and the
        // timer before the watches, so that a busy watch never holds up a keep-alive.
        let input = tokio::select! {
            biased;
            msg = next_answer(kept) => match msg {
                Ok(answer) => Input::LeaseAnswer(answer.map(|r| r.ttl())),
                Err(e) => Input::KeepAliveFailed(e),
            },
            () = sleep => Input::Timer,
            msg = next_watch(ctl) => watch_input(msg),
            msg = next_watch(members) => watch_input(msg),
            req = commands.recv() => match req {
                Some(req) => {
                    *next_id += 1;
                    if let Some(reply) = req.reply {
                        replies.insert(*next_id, reply);
                    }
                    Input::Command(*next_id, req.command)
                }
                None => Input::CommandsClosed,
            },
            Some(p) = proofs.1.recv() => Input::from(p),
        };
        if matches!(input, Input::KeepAliveFailed(_) | Input::LeaseAnswer(None)) {
            if let Some(s) = streams.as_mut() {
                s.kept = None;
            }
        }
        input
    }
}

impl Conn {
    /// Sends one keep-alive on the open stream, if there is one (the lease clock counts
    /// it sent: an error here ends the stream, and its end is what the machine hears).
    async fn keep_alive(&mut self) {
        if let Some(s) = self.streams.as_mut() {
            if let Err(e) = s.keeper.keep_alive().await {
                tracing::debug!(error = %e, "a keep-alive beside an op could not be sent");
            }
        }
    }

    async fn execute(&mut self, op: Op) -> EtcdResult<Answer> {
        if !op.uses_streams() {
            return request(self.client.clone(), op).await;
        }
        match self.on_streams(op.clone()).await {
            Err(e) if token::expired(&e) => {
                token::renew(&self.client, &e).await?;
                self.on_streams(op).await
            }
            answer => answer,
        }
    }

    async fn on_streams(&mut self, op: Op) -> EtcdResult<Answer> {
        Ok(match op {
            Op::Watch { role, from, lease } => {
                self.streams = None;
                self.streams = Some(self.open(role, from, lease).await?);
                Answer::Done
            }
            Op::KeepAlive => {
                let Some(s) = self.streams.as_mut() else {
                    let e = std::io::Error::other("no keep-alive stream is open");
                    return Err(etcd_client::Error::IoError(e));
                };
                s.keeper.keep_alive().await?;
                Answer::Done
            }
            Op::ReopenKeepAlive { lease } => {
                let Some(s) = self.streams.as_mut() else {
                    let e = std::io::Error::other("no streams are open");
                    return Err(etcd_client::Error::IoError(e));
                };
                let (keeper, kept) = self.client.lease_keep_alive(lease).await?;
                (s.keeper, s.kept) = (keeper, Some(kept));
                Answer::Done
            }
            Op::PickEndpoint => {
                if let Some(opts) = &self.options {
                    let patience = (self.ttl / 4).min(opts.connect_timeout);
                    if let Some(client) = connect::pick(opts, patience).await {
                        self.client = client;
                    }
                }
                Answer::Done
            }
            _ => unreachable!("a request, not a stream's op"),
        })
    }

    /// Opens the watches for `role` from revision `from`, and the keep-alive.
    async fn open(&mut self, role: Role, from: i64, lease: i64) -> EtcdResult<Streams> {
        let c = &mut self.client;
        let ctl_opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let (ctl, members) = if role == Role::Coordinator {
            // One watch over the whole run, so that the view the coordinator seals from is
            // always etcd's history up to one revision. Two streams (control keys and
            // registrations) were read in whatever order they became ready: a node's
            // failure report and its registration for the next round, written in that
            // order, were seen the other way round, and the round was sealed without
            // charging the failure. (It knows every registration, so a delete needs no
            // previous value to say which incarnation went.)
            let all = c.watch(self.keys.root(), Some(ctl_opts)).await?;
            (all, None)
        } else {
            // Only the coordinator watches registrations; the others learn of new rounds
            // through the round key and of departures through the records that say so
            // (`state.rs`, `said_gone`).
            let ctl = c.watch(self.keys.ctl(), Some(ctl_opts)).await?;
            (ctl, None)
        };
        let (keeper, kept) = c.lease_keep_alive(lease).await?;
        Ok(Streams {
            ctl,
            members,
            keeper,
            kept: Some(kept),
        })
    }
}

/// Carries out an op that needs no stream, on its own handle to the connection
/// (authenticating again if the token it carried had expired).
async fn request(client: Client, op: Op) -> EtcdResult<Answer> {
    token::renewing(&client, || send(client.clone(), op.clone())).await
}

async fn send(mut client: Client, op: Op) -> EtcdResult<Answer> {
    let c = &mut client;
    Ok(match op {
        Op::Range {
            key,
            prefix,
            keys_only,
        } => {
            let mut opts = GetOptions::new();
            if prefix {
                opts = opts.with_prefix();
            }
            if keys_only {
                opts = opts.with_keys_only();
            }
            let resp = c.get(key, Some(opts)).await?;
            Answer::Range {
                revision: resp.header().map_or(0, |h| h.revision()),
                kvs: resp.kvs().iter().map(kv).collect(),
            }
        }
        Op::MemberCount => Answer::MemberCount(c.member_list().await?.members().len()),
        Op::Txn(spec) => Answer::Txn {
            succeeded: c.txn(txn(spec)).await?.succeeded(),
        },
        Op::Put(Write::Put { key, value, lease }) => {
            c.put(key, value, lease_opts(lease)).await?;
            Answer::Done
        }
        Op::Put(Write::Delete(key)) => {
            c.delete(key, None).await?;
            Answer::Done
        }
        Op::Grant { ttl } => Answer::Granted {
            id: c.lease_grant(ttl, None).await?.id(),
        },
        Op::Revoke { lease } => {
            c.lease_revoke(lease).await?;
            Answer::Done
        }
        Op::TimeToLive { lease } => Answer::TimeToLive {
            ttl: c.lease_time_to_live(lease, None).await?.ttl(),
        },
        Op::Depart { record, lease } => depart(c, record, lease).await,
        Op::Watch { .. } | Op::KeepAlive | Op::ReopenKeepAlive { .. } | Op::PickEndpoint => {
            unreachable!("a stream's op, not a request")
        }
    })
}

async fn next_watch(s: Option<&mut WatchStream>) -> EtcdResult<Option<WatchResponse>> {
    match s {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

async fn next_answer(
    s: Option<&mut LeaseKeepAliveStream>,
) -> EtcdResult<Option<etcd_client::LeaseKeepAliveResponse>> {
    match s {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

fn watch_input(msg: EtcdResult<Option<WatchResponse>>) -> Input {
    match msg {
        Err(e) => Input::StreamFailed(e),
        Ok(None) => Input::WatchEnded,
        Ok(Some(r)) if r.canceled() => Input::WatchEnded,
        Ok(Some(r)) if r.created() && r.events().is_empty() => Input::WatchCreated {
            revision: r.header().map_or(0, |h| h.revision()),
        },
        Ok(Some(r)) => Input::Watched(
            r.events()
                .iter()
                .filter_map(|ev| {
                    let kv = ev.kv()?;
                    Some(match ev.event_type() {
                        EventType::Put => WatchEvent::Put(self::kv(kv)),
                        EventType::Delete => WatchEvent::Delete {
                            key: kv.key_str().unwrap_or("").to_owned(),
                            prev: ev.prev_kv().map(|p| p.value().to_vec()),
                        },
                    })
                })
                .collect(),
        ),
    }
}

/// The most bytes of watch events read while ops wait and the machine has not taken
/// them (see `wait_reading`): a round of 10,000 members is about 1.3 MB plain, 0.36 MB as
/// stored (packed).
const QUEUED_WHILE_WAITING: usize = 2 << 20;

/// How long one op may go unanswered before it counts as a broken connection (a
/// transient failure: the session reconnects on a fresh connection, as after any
/// outage). Requests on an HTTP/2 connection that the client library had closed
/// (`GoAway(too_many_data_frames)`, a flood of small watch events at a mass departure)
/// never returned, and the session waited on them for ever: no keep-alive, no leave.
/// Twice the lease's TTL, and at least 10 s: an op slower than that has outlived the
/// lease it works for, while one merely slow (etcd under load answers in seconds) must
/// not be cut. Doubled for each op in a row cut before it (`cuts`, up to 16 times), so
/// that an etcd slower than the deadline still answers the retry instead of every agent
/// reconnecting and asking again at the same pace.
pub(super) fn op_patience(ttl: Duration, cuts: u32) -> Duration {
    (2 * ttl).max(Duration::from_secs(10)) * (1 << cuts.min(4))
}

/// The first word on how this node left, beside the revoke of its lease (both at once:
/// one more round trip first would delay what every survivor waits for).
async fn depart(c: &Client, record: Option<TxnSpec>, lease: i64) -> Answer {
    let (mut a, mut b) = (c.clone(), c.clone());
    let said = async move {
        match record {
            Some(spec) => a.txn(txn(spec)).await.map(drop),
            None => Ok(()),
        }
    };
    let (said, revoked) = tokio::join!(said, b.lease_revoke(lease));
    Answer::Departed {
        said: said.err(),
        revoked: revoked.err(),
    }
}

fn kv(kv: &etcd_client::KeyValue) -> Kv {
    Kv {
        key: kv.key_str().unwrap_or("").to_owned(),
        value: kv.value().to_vec(),
        create_rev: kv.create_revision(),
        mod_rev: kv.mod_revision(),
        lease: kv.lease(),
    }
}

fn lease_opts(lease: i64) -> Option<PutOptions> {
    (lease != 0).then(|| PutOptions::new().with_lease(lease))
}

fn write(w: Write) -> TxnOp {
    match w {
        Write::Put { key, value, lease } => TxnOp::put(key, value, lease_opts(lease)),
        Write::Delete(key) => TxnOp::delete(key, None),
    }
}

/// A [`TxnSpec`] as etcd-client's transaction.
pub fn txn(spec: TxnSpec) -> Txn {
    let when: Vec<EtcdCompare> = spec
        .when
        .into_iter()
        .map(|c| match c {
            Compare::Absent(key) => EtcdCompare::version(key, CompareOp::Equal, 0),
            Compare::ModRevision(key, rev) => EtcdCompare::mod_revision(key, CompareOp::Equal, rev),
            Compare::Lease(key, id) => EtcdCompare::lease(key, CompareOp::Equal, id),
        })
        .collect();
    let then: Vec<TxnOp> = spec.then.into_iter().map(write).collect();
    let otherwise: Vec<TxnOp> = spec.otherwise.into_iter().map(write).collect();
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// Whether `node`'s registration lives on `lease` now (one comparison, no read).
pub async fn lease_holds(
    client: &mut Client,
    keys: &Keys,
    node: &str,
    lease: i64,
) -> EtcdResult<bool> {
    let spec = records::lease_holds(keys, node, lease);
    Ok(client.txn(txn(spec)).await?.succeeded())
}

/// Commits `record` as the next round, fenced on the round it replaces
/// ([`records::commit_round`]).
pub async fn commit_round(
    client: &mut Client,
    keys: &Keys,
    fence: Option<i64>,
    lease: i64,
    record: &v1::Round,
) -> EtcdResult<bool> {
    let spec = records::commit_round(keys, fence, lease, record, None);
    Ok(client.txn(txn(spec)).await?.succeeded())
}

/// Hands the machine's view on to the handle when it changed.
fn publish(machine: &mut Machine, view: &watch::Sender<View>) {
    if let Some(v) = machine.changed_view() {
        view.send_replace(v.for_handle());
    } else if let Some(safe_until) = machine.lease_moved() {
        // In place, waking nobody: a wait timed by the older moment wakes early and reads
        // this one.
        view.send_if_modified(|v| {
            v.lease_safe_until = safe_until;
            false
        });
    }
}
