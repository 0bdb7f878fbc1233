//! The agent's handle on the etcd rendezvous: joining (a lease, then the session's first
//! sync), the commands it sends the session, and the ring neighbour's liveness watch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use fsdp_proto::v1;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::connect::while_overloaded;
use super::keys::past;
use super::record::{Outgoing, Record};
use super::session::{Command, Config as SessionConfig, Driver, Machine, Request};
use super::waiter::{Waiter, Watch};
use super::*;
use crate::seal::SealConfig;
use crate::{Change, Counters, RendezvousError, text, topology};

/// An agent's handle on the etcd rendezvous. It reads the session's [`View`] and asks the
/// session (which makes every etcd write) for writes through [`Command`]s.
pub struct EtcdRendezvous {
    pub(super) cfg: EtcdConfig,
    pub(super) keys: Keys,
    pub(super) view: watch::Receiver<View>,
    pub(super) commands: mpsc::UnboundedSender<Request>,
    pub(super) session: JoinHandle<()>,
    pub(super) writes: Arc<AtomicU64>,
    pub(super) counters: Counters,
    /// Waits for rounds and watches the one held ([`super::waiter`]).
    pub(super) waiter: Waiter,
    /// Watches the held round's ring neighbour ([`liveness`]).
    pub(super) watcher: Option<Watching>,
    /// A connection of its own for counting the registrations a waiting node reports
    /// ([`super::waiting`]): the session's view holds none but the coordinator's.
    pub(super) counter: Client,
}

/// The ring watcher and what it watches. A new round whose neighbour is the same
/// registration keeps it: at 1,000 nodes a re-form changes one node's neighbour, and
/// 999 streams torn down and opened again cost the re-form about half a second on two
/// cores, besides leaving every node unwatched while its new watcher settles.
pub(super) struct Watching {
    _watcher: liveness::Watcher,
    /// Node, incarnation, lease and status address of the neighbour watched.
    target: (String, u64, i64, String),
    /// The round the watch serves now (a proof of death names it).
    round: Arc<AtomicU64>,
}

/// `--nnodes MIN:MAX` must have 0 < MIN <= MAX, the segment size a multiple within it,
/// and the segment be one the others accept.
fn check_nnodes(cfg: &EtcdConfig) -> Result<(), RendezvousError> {
    if cfg.min_nodes == 0 || cfg.min_nodes > cfg.max_nodes {
        return Err(RendezvousError::InvalidConfig(format!(
            "nnodes {}:{} is not 0 < MIN <= MAX",
            cfg.min_nodes, cfg.max_nodes
        )));
    }
    topology::check_size(cfg.segment_size, (cfg.min_nodes, cfg.max_nodes)).map_err(|e| {
        RendezvousError::InvalidConfig(format!("segment size {}: {e}", cfg.segment_size))
    })?;
    if !cfg.segment.is_empty() {
        topology::check(&cfg.segment).map_err(|e| {
            RendezvousError::InvalidConfig(format!("segment '{}' {e}", text::shown(&cfg.segment)))
        })?;
    }
    Ok(())
}

/// Waits until this node's first request to etcd, the connection's read included: in a
/// crowd, its turn's first look ([`session::Turn`], drawn from the node id, which is
/// chosen here if not given), so that a large run's nodes do not all come to etcd in one
/// instant. Returns the turn, if it has one, to wait out once connected.
async fn spread_out(cfg: &mut EtcdConfig) -> Option<session::Turn> {
    if cfg.node_id.is_empty() {
        cfg.node_id = new_node_id();
    }
    let turn = session::Turn::new(&cfg.node_id, cfg.max_nodes, Instant::now())?;
    tokio::time::sleep_until(turn.first_look().into()).await;
    Some(turn)
}

/// A look at the admission keys that failed (etcd busy or away) is made again this long
/// after, until the turn's latest moment.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// Waits out this node's turn ([`session::Turn`]). Its first look is the nesting check,
/// which reads the admission keys from its own to the last beside the control keys (one
/// request: a read of its own was 9,000 more at 10,000 nodes); if none is there, it
/// watches them, and the control keys with them, from the read's revision until one is
/// put (the coordinator let the crowd this far) or its latest moment comes. A node let
/// in keeps the read, brought up to date by what the watch saw of the control keys, for
/// its session's first sync, and the watch's stream for its session's watches
/// ([`session::TurnStream`]); one that goes at its latest gets neither: it goes through
/// the gate, which reads again.
async fn await_turn(
    client: &mut Client,
    keys: &Keys,
    prefix: &str,
    turn: session::Turn,
    counters: &Counters,
) -> Result<Option<(session::FirstRead, Option<session::TurnStream>)>, RendezvousError> {
    let began = Instant::now();
    let mut looks = 0;
    let pushed = loop {
        let Some(limit) = turn.latest().checked_duration_since(Instant::now()) else {
            break None;
        };
        looks += 1;
        match tokio::time::timeout(limit, turn_look(client, keys, prefix, turn.key(), limit)).await
        {
            Ok(Ok(pushed)) => break Some(pushed),
            Ok(Err(e @ RendezvousError::Etcd { .. })) => {
                tracing::debug!(error = %e, "could not look for this node's turn; looking again");
                tokio::time::sleep(LOOK_AGAIN.min(limit)).await;
            }
            Ok(Err(refused)) => return Err(refused),
            Err(_) => break None,
        }
    };
    counters.turn_looks.fetch_add(looks, Ordering::Relaxed);
    if pushed.is_some() {
        counters.turn_pushed.fetch_add(1, Ordering::Relaxed);
    }
    let ns = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counters.turn_ns.fetch_add(ns, Ordering::Relaxed);
    Ok(pushed)
}

/// One look for this node's turn (place slice `own`): the nesting check with the
/// admission keys, then, if none is there yet, the watch. Returns once an admission key
/// from `own` on is there; an etcd error when etcd fails or the watch ends.
async fn turn_look(
    client: &mut Client,
    keys: &Keys,
    prefix: &str,
    own: u32,
    window: Duration,
) -> Result<(session::FirstRead, Option<session::TurnStream>), RendezvousError> {
    let from = keys.admission(own);
    let (read, admitted) = nesting_check(client, keys, prefix, window, false, Some(&from)).await?;
    if admitted {
        return Ok((read, None));
    }
    let (read, stream) = wait_for_push(client, keys, &from, read).await?;
    Ok((read, Some(stream)))
}

/// Watches the admission keys from `from` (a waiting node's own) to the last, and the
/// control keys with them, from the revision after `read`'s, until one of the admission
/// keys is put: the coordinator let the crowd this far. Returns `read` brought up to date
/// by the control keys' events, and the stream, its watch cancelled, for the session's
/// watches ([`session::TurnStream`]); an etcd error when etcd fails or the watch ends.
async fn wait_for_push(
    client: &mut Client,
    keys: &Keys,
    from: &str,
    mut read: session::FirstRead,
) -> Result<(session::FirstRead, session::TurnStream), RendezvousError> {
    use etcd_client::{EventType, WatchOptions};
    let failed = |e: etcd_client::Error| RendezvousError::Etcd {
        what: "watching for this node's turn",
        source: e.into(),
    };
    // The admission keys sort just before the control keys, and no key of the run lies
    // between them: one watch has both.
    let opts = WatchOptions::new()
        .with_range(past(&keys.ctl()))
        .with_start_revision(read.revision + 1);
    let mut stream = super::connect::watcher(client)
        .watch(from, Some(opts))
        .await
        .map_err(failed)?;
    while let Some(batch) = stream.message().await.map_err(failed)? {
        if batch.canceled() {
            break;
        }
        let mut came = false;
        for event in batch.events() {
            let Some(kv) = event.kv() else { continue };
            let key = kv.key_str().unwrap_or("");
            let put = event.event_type() == EventType::Put;
            if keys.is_admission(key) {
                came |= put;
            } else if key.starts_with(&keys.ctl()) {
                read.caught_up(kv, put);
            }
        }
        if came {
            // Its later puts would reach this node for nothing, one event each.
            let id = batch.watch_id();
            stream.cancel(id).await.map_err(failed)?;
            return Ok((read, session::TurnStream { stream, id }));
        }
    }
    let e = std::io::Error::other("etcd ended the watch of the admission keys");
    Err(failed(etcd_client::Error::IoError(e)))
}

/// The nesting check, which in a crowd is also the gate before the grant
/// ([`session::Gate`]) of a node whose turn was not pushed (a node let in made its check
/// as it looked for its turn): read linearizably there, and again after a drawn pause
/// for as long as etcd answers it slowly (its apply loop behind), for at most half of
/// what is left until `deadline` (the join's): the grant and the first sync need the
/// rest, and a node held that long joins and lets the pace after its grant hold it. A
/// look still unanswered then is given up, and the check made as outside a crowd.
///
/// A node held there goes on as soon as the coordinator lets the crowd as far as its
/// place: each look reads the admission keys from its own, and a pause watches them (as
/// a turn does, and with the same stream handed to the session when it is let in).
/// Held out its pauses, the crowd's first nodes, whose first looks meet etcd busiest
/// with the rest of the crowd's, were the last to join: at 10,000 nodes, held 5 to 11 s
/// while the nodes after them went at 2,000 a second.
async fn through_gate(
    client: &mut Client,
    keys: &Keys,
    cfg: &EtcdConfig,
    deadline: Instant,
    counters: &Counters,
) -> Result<(session::FirstRead, Option<session::TurnStream>), RendezvousError> {
    let mut gate =
        session::gated(cfg.max_nodes).then(|| session::Gate::new(&cfg.node_id, cfg.keep_alive_ttl));
    let own = keys.admission(session::admission_key(&cfg.node_id, cfg.max_nodes));
    let began = Instant::now();
    let gate_until = began + deadline.saturating_duration_since(began) / 2;
    // From the first slow look's answer: slow looks after it count as held too.
    let mut held_since = None;
    let held = |since: Option<Instant>| {
        let ns = since.map_or(0, |s| {
            Instant::now().saturating_duration_since(s).as_nanos()
        });
        counters
            .gated_ns
            .fetch_add(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
    };
    while let Some(g) = gate.as_mut() {
        let sent = Instant::now();
        // A refusal is asked again within the look (the join's own backoff), and the
        // look then counts as slow; the gate's time bounds it.
        let left = deadline.saturating_duration_since(sent);
        let look = nesting_check(client, keys, &cfg.prefix, left, true, Some(&own));
        let Ok(looked) = tokio::time::timeout_at(gate_until.into(), look).await else {
            tracing::info!("etcd is still behind at half the join timeout; joining anyway");
            held(held_since.or(Some(sent)));
            break;
        };
        let (read, admitted) = looked?;
        let now = Instant::now();
        // Let in by the coordinator, or answered promptly: through.
        let at = (!admitted)
            .then(|| g.looked(sent, now))
            .flatten()
            .filter(|at| *at < gate_until);
        let Some(at) = at else {
            held(held_since);
            return Ok((read, None));
        };
        let answered_in_ms = now.duration_since(sent).as_millis() as u64;
        if held_since.is_none() {
            // Once: a node held for minutes must not look hung, nor log every look.
            held_since = Some(now);
            tracing::info!(
                answered_in_ms,
                "etcd is behind; holding this node's join until it catches up"
            );
        } else {
            tracing::debug!(
                answered_in_ms,
                "etcd is still behind; holding this node's join"
            );
        }
        match tokio::time::timeout_at(at.into(), wait_for_push(client, keys, &own, read)).await {
            Ok(Ok((read, stream))) => {
                held(held_since);
                counters.gate_pushed.fetch_add(1, Ordering::Relaxed);
                return Ok((read, Some(stream)));
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "could not watch for the crowd's reach; waiting out the pause");
                tokio::time::sleep_until(at.into()).await;
            }
            Err(_) => {}
        }
    }
    let left = deadline.saturating_duration_since(Instant::now());
    Ok((
        refuse_nesting(client, keys, &cfg.prefix, left, false).await?,
        None,
    ))
}

/// The membership lease granted at join, and when: the session maps the moment of the
/// grant onto the Unix time then.
struct Granted {
    id: i64,
    at: Instant,
    unix_ms: u64,
}

/// Grants the membership lease of `ttl_s` seconds, asking again for at most `window`
/// while etcd is overloaded.
async fn grant_lease(
    client: &Client,
    window: Duration,
    ttl_s: i64,
) -> Result<Granted, RendezvousError> {
    // The moment of the grant that took, with the Unix time then.
    let (mut at, mut unix_ms) = (Instant::now(), crate::unix_ms());
    let grant = while_overloaded(window, || {
        (at, unix_ms) = (Instant::now(), crate::unix_ms());
        let mut client = client.clone();
        async move { client.lease_grant(ttl_s, None).await }
    })
    .await
    .map_err(|e| RendezvousError::Etcd {
        what: "granting the membership lease",
        source: e.into(),
    })?;
    Ok(Granted {
        id: grant.id(),
        at,
        unix_ms,
    })
}

/// The session's configuration for the agent of `cfg`, on the lease granted at join.
fn session_config(cfg: &EtcdConfig, keys: &Keys, ttl_s: i64, lease: &Granted) -> SessionConfig {
    SessionConfig {
        keys: keys.clone(),
        node_id: cfg.node_id.clone(),
        addr: cfg.addr.clone(),
        status_addr: cfg.status_addr.clone().unwrap_or_default(),
        local_world_size: cfg.local_world_size,
        ttl: Duration::from_secs(ttl_s as u64),
        outage_limit: cfg.outage_timeout,
        fence_margin: cfg.margin(),
        seal: SealConfig {
            min_nodes: cfg.min_nodes,
            max_nodes: cfg.max_nodes,
            last_call: cfg.last_call,
            straggler_timeout: cfg.straggler_timeout,
            segment_size: cfg.segment_size,
        },
        several_endpoints: cfg.options.endpoints.len() > 1,
        budget: cfg.budget,
        job: cfg.job.clone(),
        segment: cfg.segment.clone(),
        fresh_store: cfg.serves_a_fresh_store(),
        placement_above: cfg.placement_above,
        placement_shape: cfg.placement_shape,
        can_probe: true,
        crowd: session::gated(cfg.max_nodes),
        crowd_window: session::CROWD,
        embedded_store: cfg.options.embedded_store,
        lease: lease.id,
        granted_at: lease.at,
        unix_ms_at_grant: lease.unix_ms,
        first_incarnation: session::first_incarnation(lease.unix_ms),
        allowed: Allowed {
            nodes: 1..=cfg.max_nodes.min(*cfg.allowed.nodes.end()),
            ..cfg.allowed.clone()
        },
    }
}

/// Waits for the session's first view of the run (the read the handle made, taken once
/// the lease's keep-alive stream is open), for at most `window` (what is left of the join
/// timeout: a crowd's first requests wait in a busy etcd for far longer than a
/// connection's retry window); the session is stopped when it does not come.
async fn first_sync(
    view: &mut watch::Receiver<View>,
    session: &JoinHandle<()>,
    window: Duration,
) -> Result<(), RendezvousError> {
    let synced = view.wait_for(|v| v.connected);
    if tokio::time::timeout(window, synced).await.is_err() {
        session.abort();
        return Err(RendezvousError::SessionEnded(
            "etcd did not answer this node's first requests after its lease grant within join_timeout",
        ));
    }
    Ok(())
}

impl Drop for EtcdRendezvous {
    fn drop(&mut self) {
        self.session.abort();
    }
}

impl EtcdRendezvous {
    /// Connects (bounded retry) and joins the run.
    pub async fn connect(mut cfg: EtcdConfig) -> Result<Self, RendezvousError> {
        check_nnodes(&cfg)?;
        let turn = spread_out(&mut cfg).await;
        let client = connect::connect(&cfg.options).await?;
        Self::joined_over(client, cfg, turn).await
    }

    /// Joins the run over an existing connection (several simulated nodes can share one).
    pub async fn join(client: Client, mut cfg: EtcdConfig) -> Result<Self, RendezvousError> {
        check_nnodes(&cfg)?;
        let turn = spread_out(&mut cfg).await;
        Self::joined_over(client, cfg, turn).await
    }

    /// [`EtcdRendezvous::join`] once this node's first look came: its turn waited out,
    /// then the gate, the grant and the first sync.
    async fn joined_over(
        mut client: Client,
        cfg: EtcdConfig,
        turn: Option<session::Turn>,
    ) -> Result<Self, RendezvousError> {
        let keys = Keys::new(&cfg.prefix, &cfg.run_id).map_err(RendezvousError::InvalidConfig)?;
        // Asked again while etcd says it is too busy, and waited for, for as long as the
        // join may take (one deadline for the nesting check, the gate, the grant and the
        // first sync): a crowd's grants were refused, and
        // its first syncs unanswered, past the connection's retry window at 10,000 and
        // 20,000 nodes, and each node that gave up was an agent that exited.
        let counters = Counters::default();
        let pushed = match turn {
            Some(turn) => await_turn(&mut client, &keys, &cfg.prefix, turn, &counters).await?,
            None => None,
        };
        // From the turn's end: at 20,000 nodes a turn may take a minute.
        let deadline = Instant::now() + cfg.join_timeout.max(cfg.options.retry_window);
        let left = || deadline.saturating_duration_since(Instant::now());
        // A node the coordinator let in skips the gate: the coordinator's writes already
        // said etcd keeps up.
        let (read, turn_stream) = match pushed {
            Some(pushed) => pushed,
            None => through_gate(&mut client, &keys, &cfg, deadline, &counters).await?,
        };
        let ttl_s = cfg.keep_alive_ttl.as_secs().max(1) as i64;
        let lease = grant_lease(&client, left(), ttl_s).await?;
        let writes = Arc::new(AtomicU64::new(1));
        let (tx, mut view) = watch::channel(View::default());
        let (commands, inbox) = mpsc::unbounded_channel();
        let machine = Machine::new(
            session_config(&cfg, &keys, ttl_s, &lease),
            counters.clone(),
            writes.clone(),
        )
        .with_first_read(read);
        let counter = client.clone();
        let driver = Driver::new(client, Some(cfg.options.clone()), machine, tx, inbox)
            .with_turn_stream(turn_stream);
        let session = tokio::spawn(Box::new(driver).run());
        first_sync(&mut view, &session, left()).await?;
        let waiter = Waiter::new(
            cfg.node_id.clone(),
            cfg.local_world_size,
            cfg.max_nodes,
            cfg.margin(),
        );
        Ok(Self {
            cfg,
            keys,
            view,
            commands,
            session,
            writes,
            counters,
            waiter,
            watcher: None,
            counter,
        })
    }

    /// This agent's node id.
    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// etcd writes this agent made so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The key layout of the run.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The agent's current view of the run (a copy).
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    /// The agent's view as it changes (a bench's look at a node that waits too long).
    pub fn views(&self) -> watch::Receiver<View> {
        self.view.clone()
    }

    /// Resolves when the held round is no longer the group's round (or this node must
    /// fence itself).
    pub(super) async fn next_change(&mut self) -> Result<Change, RendezvousError> {
        if self.waiter.held().is_none() {
            return std::future::pending().await;
        }
        loop {
            let watch = {
                let v = self.view.borrow_and_update();
                self.waiter.on_running_view(&v, Instant::now())?
            };
            let recheck_at = match watch {
                Watch::Over(change) => return Ok(change),
                Watch::Fence { abandon, change } => {
                    self.tell(Command::Abandon { reason: abandon });
                    self.watcher = None;
                    return Ok(change);
                }
                Watch::Keep { recheck } => recheck,
            };
            let fence_timer = async {
                match recheck_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = fence_timer => {}
                e = torchrun_seen(self.cfg.torchrun_clients.clone()) => return Err(e),
            }
        }
    }

    /// Starts watching `round`'s ring neighbour: proven gone, it is evicted at once.
    pub(super) fn watch_neighbour(&mut self, round: &v1::Round) {
        let me = self.cfg.node_id.clone();
        let Some(target) = liveness::neighbour(round, &me) else {
            self.watcher = None;
            return;
        };
        let key = (
            target.node_id.clone(),
            target.incarnation,
            target.lease,
            target.status_addr.clone(),
        );
        if let Some(w) = self.watcher.as_ref().filter(|w| w.target == key) {
            w.round.store(round.number, Ordering::Relaxed);
            return;
        }
        let serving = Arc::new(AtomicU64::new(round.number));
        let number = serving.clone();
        let watcher = {
            let commands = self.commands.clone();
            let view = self.view.clone();
            liveness::Watcher::start(me, target.clone(), move |node, lease, proof| {
                let number = number.load(Ordering::Relaxed);
                let liveness::Proof { reason, detect } = proof;
                // A neighbour whose workers all succeeded exits when the job is done: its
                // port closing is the end of the run, not a death.
                if view
                    .borrow()
                    .done
                    .get(&number)
                    .is_some_and(|d| d.contains(&node))
                {
                    tracing::debug!(%node, "finished neighbour exited");
                    return;
                }
                let detect_ms = u32::try_from(detect.as_millis()).unwrap_or(u32::MAX);
                tracing::warn!(%node, %reason, detect_ms, "ring neighbour gone; revoking its lease");
                let command = Command::Evict {
                    node,
                    lease,
                    round: number,
                    detect_ms,
                };
                let _ = commands.send(Request {
                    command,
                    reply: None,
                });
            })
        };
        self.watcher = Some(Watching {
            _watcher: watcher,
            target: key,
            round: serving,
        });
    }

    /// Tells the session `command` without waiting: nothing the handle does next depends on
    /// it, and a session that ended will say so at the next request.
    pub(super) fn tell(&self, command: Command) {
        let _ = self.commands.send(Request {
            command,
            reply: None,
        });
    }

    /// Why the session is gone: it gave up on etcd, or its task stopped.
    pub(super) fn ended(&self) -> RendezvousError {
        match &self.view.borrow().gave_up {
            Some(reason) => RendezvousError::Outage(reason.clone()),
            None => RendezvousError::SessionEnded("its task stopped"),
        }
    }

    /// Asks the session for `command` and waits for its outcome.
    /// Asks the session to write `record` as its declaration says.
    pub(super) async fn write<R: Record>(&self, record: &R) -> Result<(), RendezvousError> {
        self.ask(Command::Write(Outgoing::of(&self.keys, record)))
            .await
    }

    pub(super) async fn ask(&self, command: Command) -> Result<(), RendezvousError> {
        let (reply, outcome) = oneshot::channel();
        let ended = || self.ended();
        self.commands
            .send(Request {
                command,
                reply: Some(reply),
            })
            .map_err(|_| ended())?;
        outcome.await.map_err(|_| ended())?
    }
}

/// The nesting check's reads: a count under each of `outer`, the keys of each of `gaps`,
/// and last every key under `ctl` (the session's first read, [`session::FirstRead`]).
/// Serializable, as the session's own reads of the run, unless `linearizable`: another
/// run's keys are not written in the moment this one starts, so only the gate
/// (`through_gate`) wants the answer to wait for etcd's apply loop. With `turn` (the
/// admission keys from a waiting node's own to the last), whether one of them is there,
/// after the rest.
fn nesting_reads(
    outer: &[String],
    gaps: &[(String, String)],
    ctl: &str,
    linearizable: bool,
    turn: Option<(&str, &str)>,
) -> Vec<etcd_client::TxnOp> {
    use etcd_client::TxnOp;
    let read = |o: GetOptions| {
        if linearizable {
            o
        } else {
            o.with_serializable()
        }
    };
    let count = || read(GetOptions::new().with_prefix().with_count_only());
    let keys_in = |to: &str| read(GetOptions::new().with_range(to).with_keys_only());
    outer
        .iter()
        .map(|p| TxnOp::get(p.as_str(), Some(count())))
        .chain(
            gaps.iter()
                .map(|(from, to)| TxnOp::get(from.as_str(), Some(keys_in(to)))),
        )
        .chain([TxnOp::get(ctl, Some(read(GetOptions::new().with_prefix())))])
        .chain(turn.map(|(from, to)| {
            let one = read(
                GetOptions::new()
                    .with_range(to)
                    .with_keys_only()
                    .with_limit(1),
            );
            TxnOp::get(from, Some(one))
        }))
        .collect()
}

/// Refuses to start a run whose keys would lie inside another run's (its prefix is
/// below another run's root) or around one (another run's prefix is below this run's
/// root): the outer run would read the inner one's keys as its own. One read-only
/// transaction at start (at a crowd's gate, once per look, and once more if a look is
/// given up): a count per level of the prefix (its `members/` and
/// `ctl/`) and the keys of the four gaps between this run's own keys, none of them O(N).
/// Reading every key under the root made the k-th agent to join read k registrations,
/// 50 million keys in all for 10,000 agents; and as eight reads they were
/// eight of the sixteen requests an agent made to join, where etcd 3.4 copies its
/// buffer of writes not yet committed for each one (a third of its CPU at formation).
///
/// The same transaction reads the run's control keys, the session's first read: returned
/// with the revision it was read at. As a request of its own after the grant it was one
/// of the seven a node made to join (the floor makes four). At a crowd's gate every look
/// reads them: few at formation (the coordinator key), but a run's `done/` records while
/// it ends, which a node that joins then reads at each look.
pub(super) async fn refuse_nesting(
    client: &mut Client,
    keys: &Keys,
    prefix: &str,
    window: Duration,
    linearizable: bool,
) -> Result<session::FirstRead, RendezvousError> {
    let (read, _) = nesting_check(client, keys, prefix, window, linearizable, None).await?;
    Ok(read)
}

/// [`refuse_nesting`], and with `turn` (a waiting node's own admission key) whether an
/// admission key from it to the last is there: its turn came.
async fn nesting_check(
    client: &mut Client,
    keys: &Keys,
    prefix: &str,
    window: Duration,
    linearizable: bool,
    turn: Option<&str>,
) -> Result<(session::FirstRead, bool), RendezvousError> {
    use etcd_client::{Txn, TxnOpResponse};
    let outer: Vec<String> = keys
        .enclosing_roots()
        .into_iter()
        .flat_map(|outer| ["members/", "ctl/"].map(|sub| format!("{outer}{sub}")))
        .collect();
    let gaps = keys.foreign_ranges();
    let admissions_end = past(&keys.admissions());
    let turn = turn.map(|from| (from, admissions_end.as_str()));
    let reads = nesting_reads(&outer, &gaps, &keys.ctl(), linearizable, turn);
    let client = &*client;
    let answer = while_overloaded(window, || {
        super::token::renewing(client, || {
            // Its control keys are a run's `done/` records while it ends, 80–150 bytes a
            // node: over 4 MiB at a few tens of thousands (`connect::reader`).
            let (mut c, txn) = (
                super::connect::reader(client),
                Txn::new().and_then(reads.clone()),
            );
            async move { c.txn(txn).await }
        })
    })
    .await;
    let what = "checking that the run's keys nest in no other run, and none in it";
    let failed = |e: etcd_client::Error| RendezvousError::Etcd {
        what,
        source: e.into(),
    };
    let answer = answer.map_err(failed)?;
    // Without it the watches would start from revision 1: the run's whole history.
    let Some(revision) = answer.header().map(|h| h.revision()) else {
        let e = std::io::Error::other("etcd answered without a header (no revision)");
        return Err(failed(etcd_client::Error::IoError(e)));
    };
    let mut got: Vec<_> = answer
        .op_responses()
        .into_iter()
        .filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        })
        .collect();
    let asked = outer.len() + gaps.len() + 1 + usize::from(turn.is_some());
    if got.len() != asked {
        let e = std::io::Error::other(format!(
            "etcd answered {} of the {asked} reads of the run's surroundings",
            got.len(),
        ));
        return Err(failed(etcd_client::Error::IoError(e)));
    }
    let admitted = turn.is_some() && !got.pop().expect("counted above").kvs().is_empty();
    let control = got.pop().expect("counted above");
    let fix = "choose an etcd_prefix outside other runs' keys (e.g. the default /fsdp)";
    let (counts, inner) = got.split_at(outer.len());
    if let Some((p, _)) = outer.iter().zip(counts).find(|(_, g)| g.count() > 0) {
        let root = p.trim_end_matches("members/").trim_end_matches("ctl/");
        return Err(RendezvousError::InvalidConfig(format!(
            "etcd_prefix '{prefix}' puts this run's keys ({}) inside those of the run at {root}; {fix}",
            keys.root()
        )));
    }
    if let Some(k) = inner
        .iter()
        .flat_map(|g| g.kvs())
        .filter_map(|kv| kv.key_str().ok())
        .find(|k| keys.nested_run_key(k))
    {
        return Err(RendezvousError::InvalidConfig(format!(
            "another run's keys ({k}) lie inside this run's ({}); give that run or this one a different etcd_prefix or --rdzv-id",
            keys.root()
        )));
    }
    Ok((session::FirstRead::of(revision, control.kvs()), admitted))
}

/// Resolves when a torchrun client reached the store this agent serves (never when it
/// serves none): the job cannot form, and waiting for it would be forever.
pub(super) async fn torchrun_seen(
    clients: Option<tokio::sync::watch::Receiver<Option<std::net::IpAddr>>>,
) -> RendezvousError {
    let Some(mut clients) = clients else {
        return std::future::pending().await;
    };
    let Ok(ip) = clients.wait_for(Option::is_some).await.map(|ip| *ip) else {
        // The store stopped: the agent is ending anyway.
        return std::future::pending().await;
    };
    let ip = ip.map_or_else(String::new, |ip| ip.to_string());
    RendezvousError::TorchrunPeer(format!(
        "{ip} spoke torchrun's TCPStore protocol to the c10d store this agent serves: {}",
        fsdp_store::tcpstore::SAME_LAUNCHER
    ))
}
