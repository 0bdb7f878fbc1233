//! The real driver: carries the machine's effects out with etcd-client and turns what the
//! streams, the handle, the prober and the clock say into inputs. The only `select!` of
//! the session.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, WatchResponse};
use tokio::sync::{mpsc, watch};

use super::Request;
use super::fault::Fault;
use super::io::{Answer, Effect, Input, Op, WatchEvent};
use super::machine::Machine;
use crate::etcd::connect::EtcdOptions;
use crate::etcd::errors;
use crate::etcd::probe::{Prober, Proof};
use crate::etcd::view::View;

use super::conn::{Conn, EtcdResult, TurnStream, kv, next_answer, next_watch, request};

pub struct Driver {
    conn: Conn,
    machine: Machine,
    view: watch::Sender<View>,
    commands: mpsc::UnboundedReceiver<Request>,
    replies: Replies,
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
                turn: None,
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

    /// The stream this node waited for its turn on: the session's first watch of the
    /// control keys opens there ([`TurnStream`]).
    pub fn with_turn_stream(mut self, stream: Option<TurnStream>) -> Self {
        self.conn.turn = stream;
        self
    }

    /// Runs the machine until the session ends (or the task is aborted). Boxed: a future
    /// keeps a driver taken by value twice (the argument and the body's own), and a
    /// simulated crowd of 10,000 sessions in one process touched every kilobyte of it.
    pub async fn run(mut self: Box<Self>) {
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
                        // but keep-alives and the prober's switch (both carried out
                        // already) and a port to pick then.
                        debug_assert!(beside.iter().all(|e| matches!(e, Effect::PickPort)));
                        queue.extend(beside);
                        answer
                    };
                    self.cuts = match &answer {
                        Err(e) if errors::is_unanswered(e) => self.cuts.saturating_add(1),
                        _ => 0,
                    };
                    queue.extend(self.step(Input::Answer(answer.map_err(Fault::from))));
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
                Effect::PickPort => {
                    let port = crate::port::free_port(self.machine.addr()).ok();
                    queue.extend(self.step(Input::Port(port)));
                }
            }
        }
    }

    /// Carries out an op that opens or uses the streams (or replaces the client): nothing
    /// else moves meanwhile but the prober, whose proofs count while an op waits on a
    /// stalled etcd (that is when they are needed) and whose held look starts at its time
    /// (a stream opened on a frozen etcd waits out its patience). These ops are local or
    /// short.
    async fn wait_alone(&mut self, op: Op, patience: Duration) -> EtcdResult<Answer> {
        let (opts, ttl) = (self.conn.options.clone(), self.conn.ttl);
        // Boxed, as in `wait_reading`.
        let mut exec = Box::pin(self.conn.execute(op));
        let give_up = tokio::time::sleep(patience);
        tokio::pin!(give_up);
        loop {
            let held = self.machine.look_held_until();
            let look = async {
                match held {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                answer = &mut exec => break answer,
                () = &mut give_up => break Err(errors::unanswered(patience)),
                Some(p) = self.proofs.1.recv() => {
                    self.machine.step(Instant::now(), Input::from(p));
                    publish(&mut self.machine, &self.view);
                }
                () = look => {
                    let effects = self.machine.held_look_due(Instant::now());
                    if effects.iter().any(|e| matches!(e, Effect::Probe(true))) {
                        self.prober = prober_for(opts.as_ref(), ttl, &self.proofs.0);
                    }
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
    /// again, more load on an etcd already behind (at 10,000 nodes, 40,000 such deadlines in
    /// 300 s). Returns the answer and what the machine asked for meanwhile.
    async fn wait_reading(
        &mut self,
        op: Op,
        patience: Duration,
    ) -> (EtcdResult<Answer>, Vec<Effect>) {
        // Boxed: held in place, the request's future (etcd-client's and tonic's, several
        // kilobytes) was part of the session's own for its whole life, and a simulated
        // crowd of 10,000 sessions in one process touched that much memory per node.
        let mut exec = Box::pin(request(self.conn.client.clone(), op));
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
                commands,
                replies,
                next_id,
                ..
            } = self;
            let (ctl, members, kept) = match streams.as_mut() {
                Some(s) if watches_open && room => {
                    (s.ctl.as_mut(), s.members.as_mut(), s.kept.as_mut())
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
                () = &mut give_up => return (Err(errors::unanswered(patience)), beside),
                Some(p) = proofs.1.recv() => Input::from(p),
                msg = next_answer(kept) => match msg {
                    Ok(answer) => Input::LeaseAnswer(answer.map(|r| r.ttl())),
                    Err(e) => Input::KeepAliveFailed(e.into()),
                },
                () = timer => Input::Timer,
                // A command waits in the machine for this op's answer; read now, a
                // departure goes right after it, before what the watches brought
                // (`Flight::leave`). A closed channel is heard between ops.
                Some(req) = commands.recv() => command_input(req, next_id, replies),
                msg = next_watch(ctl) => watch_input(msg),
                msg = next_watch(members) => watch_input(msg),
            };
            if input.ends_keep_alive() {
                if let Some(s) = streams.as_mut() {
                    s.kept = None;
                }
            }
            if matches!(input, Input::WatchEnded | Input::StreamFailed(_)) {
                watches_open = false;
            }
            for effect in machine.step(Instant::now(), input) {
                match effect {
                    Effect::KeepAlive => self.conn.keep_alive().await,
                    // At once: the op in flight may be the question about the lease
                    // that a stopped etcd never answers (`Machine::start_held_look`).
                    Effect::Probe(on) => {
                        self.prober = on.then(|| self.start_prober()).flatten();
                    }
                    other => beside.push(other),
                }
            }
            publish(&mut self.machine, &self.view);
        }
    }

    fn start_prober(&self) -> Option<Prober> {
        prober_for(self.conn.options.as_ref(), self.conn.ttl, &self.proofs.0)
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
            Some(s) => (s.ctl.as_mut(), s.members.as_mut(), s.kept.as_mut()),
            None => (None, None, None),
        };
        // In this order when several are ready: the keep-alive stream's end before the
        // timer that would send a keep-alive on it ("channel closed", an outage), the
        // timer before the watches, so that a busy watch never holds up a keep-alive, and
        // commands before the watches, so that a busy watch never holds up a departure.
        let input = tokio::select! {
            biased;
            msg = next_answer(kept) => match msg {
                Ok(answer) => Input::LeaseAnswer(answer.map(|r| r.ttl())),
                Err(e) => Input::KeepAliveFailed(e.into()),
            },
            () = sleep => Input::Timer,
            req = commands.recv() => match req {
                Some(req) => command_input(req, next_id, replies),
                None => Input::CommandsClosed,
            },
            msg = next_watch(ctl) => watch_input(msg),
            msg = next_watch(members) => watch_input(msg),
            Some(p) = proofs.1.recv() => Input::from(p),
        };
        if input.ends_keep_alive() {
            if let Some(s) = streams.as_mut() {
                s.kept = None;
            }
        }
        input
    }
}

/// Where the handle waits for each command's answer, by command id.
type Replies = HashMap<u64, tokio::sync::oneshot::Sender<Result<(), crate::RendezvousError>>>;

/// A prober looking at the first endpoint of `opts`, its proofs sent to `proofs`.
fn prober_for(
    opts: Option<&EtcdOptions>,
    ttl: Duration,
    proofs: &mpsc::UnboundedSender<Proof>,
) -> Option<Prober> {
    let opts = opts?;
    let endpoint = opts.endpoints.first()?.clone();
    Some(Prober::start(endpoint, opts.clone(), ttl, proofs.clone()))
}

/// A command from the handle, numbered, its reply kept for when the machine answers it.
fn command_input(req: Request, next_id: &mut u64, replies: &mut Replies) -> Input {
    *next_id += 1;
    if let Some(reply) = req.reply {
        replies.insert(*next_id, reply);
    }
    Input::Command(*next_id, req.command)
}

fn watch_input(msg: EtcdResult<Option<WatchResponse>>) -> Input {
    match msg {
        Err(e) => Input::StreamFailed(e.into()),
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
