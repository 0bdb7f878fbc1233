//! A bounded accept loop for any axum router, so that whoever can reach a port cannot
//! silence it or take the process's descriptors. Two ports of the agent serve on it: the
//! c10d store (where 1,100 idle connections to a host with 1,024 descriptors once ended
//! the job) and the status port, whose limits and request kinds the agent states
//! (`agent/src/status/limits.rs`). It lives in this crate, below the agent, because the
//! store serves on it. What is particular to a port comes in with its [`Limits`] (its
//! cap, timeouts, name, and which requests are long) and, for the store, the TCPStore
//! greeting it is asked to tell apart ([`serve_tls`]).
//!
//! Each port has its own [`Limits`]: the status port's are the agent's, with the cap
//! [`connection_cap`]; the store's [`Limits::for_the_store`] ([`store_connection_cap`]). With a
//! [`TlsAcceptor`], the handshake happens inside the connection's first deadline.
//!
//! `axum::serve` accepts every connection and keeps it for as long as the peer likes. On
//! a port that listens on `0.0.0.0` by default, a few hundred idle or slowloris
//! connections then used up the agent's open-file limit (often 1,024 in containers): the
//! health checks timed out, so Kubernetes restarted the pod, and the next worker restart
//! failed with "Too many open files" and ended the job. Hence:
//!
//! * **A connection cap from the open-file limit** ([`connection_cap`]): a quarter of the
//!   soft `RLIMIT_NOFILE`, between [`MIN_CONNECTIONS`] and [`MAX_CONNECTIONS`]. The other
//!   three quarters stay in reserve for what the agent cannot do without: worker pipes and
//!   log files, the etcd connection behind the lease. The status port's clients (kubelet
//!   probes, a Prometheus scrape, an operator's `grpcurl`) need a handful.
//! * **At the cap, evict rather than refuse** ([`admission`]): the newcomer is most
//!   likely the kubelet's probe, and a refused probe restarts the pod. The connection
//!   free the longest goes instead (no request in flight, or stuck writing to a peer that
//!   does not read); a newcomer is refused (closed at once, so the backlog never fills)
//!   only when every connection is busy.
//! * **Timeouts** ([`verdict`]): a connection must finish its first request head within
//!   [`HEAD_TIMEOUT`] of being accepted. That one deadline covers a peer that never sends,
//!   a slowloris trickling an HTTP/1 head, a slow HTTP/2 preface or HEADERS frame, and
//!   the auto builder's sniffing of which protocol it is. After that, a connection with no
//!   request in flight for [`IDLE_TIMEOUT`] is closed (HTTP/1 heads after the first get
//!   hyper's header timeout of the same length), and so is one whose writes have made no
//!   progress for [`STALL_TIMEOUT`] (a peer that sends requests but never reads the
//!   answers would otherwise stay "busy" forever). HTTP/2 keep-alive pings find dead
//!   peers that never close.
//! * **Closing is a plain close.** Every close above happens with no request in flight (or
//!   none that can make progress), so there is nothing a graceful shutdown could finish;
//!   HTTP clients treat the end of an idle connection as a reason to reconnect, and
//!   lingering in a grace period would hold the descriptor a flood is trying to take.
//! * **accept() errors never end the server**: out of descriptors (`EMFILE`, `ENFILE`)
//!   or memory, it backs off briefly ([`accept_backoff`]) and tries again, logging once
//!   in a while ([`Throttle`]) rather than once per error.
//!
//! The server stays on the agent's runtime on purpose: the liveness check answering is
//! the proof that the agent's loop runs. The cap bounds the work a flood can queue there.
//!
//! * **Streams cannot take every slot** of the status port ([`crate::streams`], through
//!   [`Limits::streams`]): long requests (a `Liveness` stream, a health `Watch`) are
//!   limited per source address and in all, so a quarter of the slots is always free or
//!   evictable for `Health/Check` and `/metrics`; a one-shot request that is not answered
//!   within its timeout (a head whose body never comes) is answered with an error, which
//!   frees its connection. The c10d store has no stream slots: its watches and
//!   keep-alives are its own agents', and its cap is its defence.
//!
//! What remains: an attacker who keeps the reserve's connections each with a one-shot
//! request in flight, renewed every few seconds, can still make newcomers wait; the agent
//! itself, its workers and its lease are not affected.

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::streams::{Kind, StreamSlot, Streams};
use crate::tcpstore::{GREETING_LEN, Greeting, greeting};
pub use tokio_rustls::TlsAcceptor;

/// The fewest connections the port accepts, however low the open-file limit.
pub const MIN_CONNECTIONS: usize = 4;
/// The most: far above what probes, scrapes and operators need.
pub const MAX_CONNECTIONS: usize = 256;
/// From accept to the end of the first request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// With no request in flight, after the first.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// With a request in flight whose writes make no progress.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(20);
/// A busy connection stuck writing this long may be evicted for a newcomer.
pub const STALL_EVICTABLE: Duration = Duration::from_secs(1);
/// HTTP/2 keep-alive: ping an idle peer this often, and give up after as long.
const H2_PING: Duration = Duration::from_secs(20);
/// How often the limits' own warnings may be logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// The store's connection cap with no open-file limit (and its ceiling): far above the
/// two connections per agent a thousand-node job needs.
pub const MAX_STORE_CONNECTIONS: usize = 65_536;
/// The fewest connections the store accepts: a small job's agents, however low the limit.
pub const MIN_STORE_CONNECTIONS: usize = 16;
/// Descriptors kept for the agent's own work besides its two ports: worker pipes, log
/// files, the free-port probes of a restart, the store connection of its own client.
pub const OWN_RESERVE: u64 = 256;
/// The store's idle timeout: agents keep a lease keep-alive stream open, so only a
/// connection nobody uses goes idle; `etcdctl` and `fsdp-agent status` are one-shot.
pub const STORE_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The store's cap for a soft open-file limit: what is left after the status port's cap
/// ([`connection_cap`]) and [`OWN_RESERVE`], within [`MIN_STORE_CONNECTIONS`] and
/// [`MAX_STORE_CONNECTIONS`]. At 1,024: 1024 - 256 - 256 = 512.
pub fn store_connection_cap(soft_nofile: Option<u64>) -> usize {
    let Some(soft) = soft_nofile else {
        return MAX_STORE_CONNECTIONS;
    };
    let status = u64::try_from(connection_cap(Some(soft))).unwrap_or(u64::MAX);
    let left = soft.saturating_sub(status).saturating_sub(OWN_RESERVE);
    usize::try_from(left)
        .unwrap_or(usize::MAX)
        .clamp(MIN_STORE_CONNECTIONS, MAX_STORE_CONNECTIONS)
}

/// The connection cap for a soft open-file limit (`None`: unlimited or unknown).
pub fn connection_cap(soft_nofile: Option<u64>) -> usize {
    let quarter = soft_nofile.map_or(u64::MAX, |n| n / 4);
    usize::try_from(quarter)
        .unwrap_or(usize::MAX)
        .clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

/// This process's soft open-file limit, `None` when unlimited or unreadable.
pub fn soft_nofile() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit};
    getrlimit(Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft)
        .filter(|&s| s != nix::sys::resource::RLIM_INFINITY)
}

/// The bounds one server works with.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub head_timeout: Duration,
    pub idle_timeout: Duration,
    pub stall_timeout: Duration,
    /// Which port, in log lines ("status server", "c10d store").
    pub name: &'static str,
    /// Stream slots and the one-shot timeout ([`crate::streams`]), for a port whose long
    /// requests must not starve its probes; `None`: every request runs as long as it
    /// likes (the store's watches and keep-alives are its clients' own).
    pub streams: Option<StreamRules>,
}

/// How a port tells and limits its long requests.
#[derive(Debug, Clone, Copy)]
pub struct StreamRules {
    /// Long requests in flight at once ([`crate::streams::max_streams`]).
    pub max_streams: usize,
    /// From a one-shot request's head to its response ([`crate::streams::ONESHOT_TIMEOUT`] is a
    /// sensible value).
    pub oneshot_timeout: Duration,
    /// What a request is, from its path.
    pub kind: fn(&str) -> Kind,
}

impl Limits {
    /// The c10d store's: its own cap ([`store_connection_cap`]), a longer idle timeout.
    pub fn for_the_store() -> Self {
        Self {
            max_connections: store_connection_cap(soft_nofile()),
            head_timeout: HEAD_TIMEOUT,
            idle_timeout: STORE_IDLE_TIMEOUT,
            stall_timeout: STALL_TIMEOUT,
            name: "c10d store",
            streams: None,
        }
    }
}

/// What one connection is doing, as the limits see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnState {
    pub accepted: Instant,
    /// Request heads received so far.
    pub requests: u64,
    /// Requests whose response has not been fully handed to the connection.
    pub in_flight: u32,
    /// When the last request in flight ended (or the accept, before any).
    pub idle_since: Instant,
    /// Since when writes have been waiting on the peer, if they are.
    pub stalled_since: Option<Instant>,
}

impl ConnState {
    pub fn new(now: Instant) -> Self {
        Self {
            accepted: now,
            requests: 0,
            in_flight: 0,
            idle_since: now,
            stalled_since: None,
        }
    }
}

/// Why a connection was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// No complete request head within the head timeout of the accept.
    NoRequest,
    /// No request in flight for the idle timeout.
    Idle,
    /// A response's writes made no progress for the stall timeout.
    Stalled,
}

/// A connection's fate at `now`: keep it until `recheck` (when its verdict may change if
/// nothing happens on it), or close it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Keep { recheck: Instant },
    Close(CloseReason),
}

/// The timeouts, as one decision.
pub fn verdict(c: &ConnState, limits: &Limits, now: Instant) -> Verdict {
    let (deadline, reason) = if c.in_flight > 0 {
        match c.stalled_since {
            Some(since) => (since + limits.stall_timeout, CloseReason::Stalled),
            // Busy and writing: look again later, when it may have stalled or gone idle.
            None => {
                return Verdict::Keep {
                    recheck: now + limits.head_timeout.min(limits.stall_timeout),
                };
            }
        }
    } else if c.requests == 0 {
        (c.accepted + limits.head_timeout, CloseReason::NoRequest)
    } else {
        (c.idle_since + limits.idle_timeout, CloseReason::Idle)
    };
    if now >= deadline {
        Verdict::Close(reason)
    } else {
        Verdict::Keep { recheck: deadline }
    }
}

/// Since when a connection could be given up for a newcomer, if it could: idle, or stuck
/// writing to a peer that does not read.
fn free_since(c: &ConnState, now: Instant) -> Option<Instant> {
    if c.in_flight == 0 {
        return Some(c.idle_since);
    }
    c.stalled_since
        .filter(|&s| now.saturating_duration_since(s) >= STALL_EVICTABLE)
}

/// What to do with a newly accepted connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Admit it and close the connection with this id.
    Evict(u64),
    /// Every connection is busy: close the newcomer.
    Refuse,
}

/// Admission at the cap: below it everyone gets in; at it, the connection free the longest
/// makes room (ties: the oldest id), and only when none is free is the newcomer refused.
pub fn admission<'a>(
    conns: impl IntoIterator<Item = (u64, &'a ConnState)>,
    max_connections: usize,
    now: Instant,
) -> Admission {
    let mut count = 0;
    let mut victim: Option<(Instant, u64)> = None;
    for (id, c) in conns {
        count += 1;
        if let Some(since) = free_since(c, now) {
            if victim.is_none_or(|v| (since, id) < v) {
                victim = Some((since, id));
            }
        }
    }
    if count < max_connections {
        Admission::Admit
    } else {
        victim.map_or(Admission::Refuse, |(_, id)| Admission::Evict(id))
    }
}

/// How long to wait after a failed accept before the next; `None`: at once. The errors
/// about one connection (reset before it was accepted) say nothing about the next;
/// anything else (out of descriptors or memory, unknown) would fail again at once, since
/// the listener stays readable, so the loop must not spin on it.
pub fn accept_backoff(e: &io::Error) -> Option<Duration> {
    use io::ErrorKind::*;
    match e.kind() {
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock => None,
        _ => Some(Duration::from_millis(100)),
    }
}

/// Lets a repeated warning through once per period; counts what it held back.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    last: Option<Instant>,
    held: u64,
}

impl Throttle {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            held: 0,
        }
    }

    /// `Some(n)` when this occurrence should be logged, `n` being how many were held
    /// back since the last one logged.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|l| now.saturating_duration_since(l) < self.every)
        {
            self.held += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// One connection's shared state: written by its service and I/O, read by the
/// connection's task and by the accept loop.
#[derive(Debug)]
struct Activity(Mutex<ConnState>);

impl Activity {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        // A panic while holding this lock leaves plain counters behind, still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Slot {
    activity: Arc<Activity>,
    evict: oneshot::Sender<()>,
}

/// The open connections, by id.
#[derive(Default)]
struct Table(Mutex<BTreeMap<u64, Slot>>);

impl Table {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Slot>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Seats a newcomer under `id` if [`admission`] lets it in, evicting an idle
    /// connection to make room when the table is full; `false`: refused.
    fn admit(&self, id: u64, slot: Slot, max_connections: usize, now: Instant) -> bool {
        let mut conns = self.lock();
        // Copied out: each state sits behind its own lock, and admission weighs them all.
        let states: Vec<(u64, ConnState)> = conns
            .iter()
            .map(|(&id, s)| (id, *s.activity.lock()))
            .collect();
        match admission(states.iter().map(|(id, c)| (*id, c)), max_connections, now) {
            Admission::Admit => {}
            Admission::Evict(old) => {
                if let Some(slot) = conns.remove(&old) {
                    let _ = slot.evict.send(());
                }
            }
            Admission::Refuse => return false,
        }
        conns.insert(id, slot);
        true
    }
}

/// Takes a connection out of the table when its task ends, however it ends.
struct Leave {
    table: Arc<Table>,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

/// Serves `router` on `listener` within `limits`, forever.
pub async fn serve(listener: TcpListener, router: axum::Router, limits: Limits) {
    serve_tls(listener, router, limits, None, None).await;
}

/// Where a store tells that a torchrun client reached it ([`crate::tcpstore::greeting`]):
/// the client's address.
pub type TorchrunSeen = Arc<tokio::sync::watch::Sender<Option<IpAddr>>>;

/// [`serve`], with TLS when `tls` is given, and told in `torchrun` when a connection
/// opens with TCPStore's greeting.
pub async fn serve_tls(
    listener: TcpListener,
    router: axum::Router,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    torchrun: Option<TorchrunSeen>,
) {
    let builder = connection_builder(&limits);
    let table = Arc::new(Table::default());
    let streams = limits.streams.map(|r| (r, Streams::new(r.max_streams)));
    let mut next_id = 0u64;
    let mut accept_errors = Throttle::new(LOG_EVERY);
    let mut refusals = Throttle::new(LOG_EVERY);
    // The connections live as long as the loop: whoever drops it (the store closing)
    // ends them too.
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = accept_next(&listener, &limits, &mut accept_errors).await;
        let now = Instant::now();
        let activity = Arc::new(Activity(Mutex::new(ConnState::new(now))));
        let (evict_tx, evict_rx) = oneshot::channel();
        let id = next_id;
        next_id += 1;
        let slot = Slot {
            activity: activity.clone(),
            evict: evict_tx,
        };
        if !table.admit(id, slot, limits.max_connections, now) {
            if let Some(held) = refusals.allow(now) {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    repeats = held,
                    "{} refused a connection: every connection is busy",
                    limits.name
                );
            }
            continue;
        }
        let _ = stream.set_nodelay(true);
        let leave = Leave {
            table: table.clone(),
            id,
        };
        let service = Tracked {
            inner: TowerToHyperService::new(router.clone()),
            activity: activity.clone(),
            mark: ConnectionMark::default(),
            peer,
            streams: streams.clone(),
            name: limits.name,
        };
        tasks.spawn(serve_connection(
            stream,
            builder.clone(),
            service,
            activity,
            evict_rx,
            limits,
            leave,
            tls.clone(),
            torchrun.clone(),
        ));
    }
}

/// HTTP/1 and HTTP/2 alike, each with its own guard against a peer that goes quiet:
/// a slow request head on HTTP/1, unanswered pings on HTTP/2.
fn connection_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_PING)
        .keep_alive_timeout(H2_PING);
    builder
}

/// The next connection and its peer's address. An accept error never ends the server:
/// it is logged (throttled) and, when the system is short of something, waited out.
async fn accept_next(
    listener: &TcpListener,
    limits: &Limits,
    errors: &mut Throttle,
) -> (TcpStream, IpAddr) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => return (stream, peer.ip()),
            Err(e) => {
                if let Some(held) = errors.allow(Instant::now()) {
                    tracing::warn!(error = %e, repeats = held, "{} cannot accept a connection; retrying", limits.name);
                }
                if let Some(pause) = accept_backoff(&e) {
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

/// One connection, until the peer ends it, a limit closes it, or a newcomer evicts it.
#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    stream: TcpStream,
    builder: auto::Builder<TokioExecutor>,
    service: Tracked,
    activity: Arc<Activity>,
    mut evicted: oneshot::Receiver<()>,
    limits: Limits,
    _leave: Leave,
    tls: Option<TlsAcceptor>,
    torchrun: Option<TorchrunSeen>,
) {
    if let Some(seen) = torchrun {
        // Evictable meanwhile like any connection: a flood of silent ones must not hold
        // descriptors here past the cap.
        let greeting = tokio::select! {
            g = sniff(&stream, limits.head_timeout) => g,
            _ = &mut evicted => return,
        };
        match greeting {
            Greeting::Torchrun => {
                if let Ok(peer) = stream.peer_addr() {
                    seen.send_replace(Some(peer.ip()));
                }
                // Closed unanswered: whatever we answered, torchrun's client retries.
                return;
            }
            Greeting::OurProbe => return,
            Greeting::Other | Greeting::Unsure => {}
        }
    }
    // Stalls are seen on the socket itself, below TLS: that is where a peer that does not
    // read makes writes wait.
    let io = Watched {
        stream,
        activity: activity.clone(),
    };
    let Some(acceptor) = tls else {
        return drive(
            builder.serve_connection(TokioIo::new(io), service),
            &activity,
            evicted,
            &limits,
        )
        .await;
    };
    // The handshake counts against the first request's deadline: a peer that opens a
    // connection and never finishes it is the cheapest way to hold a descriptor.
    let deadline = activity.lock().accepted + limits.head_timeout;
    let tls_io = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), acceptor.accept(io)) => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "{}: TLS handshake failed", limits.name);
                return;
            }
            Err(_) => return,
        },
        _ = &mut evicted => return,
    };
    drive(
        builder.serve_connection(TokioIo::new(tls_io), service),
        &activity,
        evicted,
        &limits,
    )
    .await;
}

/// Who opened `stream`, from its first bytes, without taking them: an HTTP/2 or TLS client
/// is told by its first byte; a TCPStore greeting needs its ten bytes, which a client sends
/// at once. `Unsure` when the peer says nothing within `patience` (the head timeout then
/// deals with it as with any silent connection).
async fn sniff(stream: &TcpStream, patience: Duration) -> Greeting {
    let deadline = tokio::time::Instant::now() + patience;
    let mut first = [0u8; GREETING_LEN];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut first)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return Greeting::Unsure,
        };
        match greeting(&first[..n]) {
            // peek returns the bytes already there at once: wait for the rest.
            Greeting::Unsure => tokio::time::sleep(Duration::from_millis(10)).await,
            g => return g,
        }
    }
}

/// Runs a connection until it ends, a limit closes it, or it is evicted.
async fn drive<F: std::future::Future>(
    conn: F,
    activity: &Activity,
    mut evicted: oneshot::Receiver<()>,
    limits: &Limits,
) {
    tokio::pin!(conn);
    loop {
        let state = *activity.lock();
        let recheck = match verdict(&state, limits, Instant::now()) {
            Verdict::Keep { recheck } => recheck,
            Verdict::Close(reason) => {
                tracing::debug!(?reason, "{} closed a connection", limits.name);
                return;
            }
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            // Sent or not (the table is gone), the slot is no longer ours.
            _ = &mut evicted => {
                tracing::debug!("{} evicted an idle connection for a new one", limits.name);
                return;
            }
            () = tokio::time::sleep_until(recheck.into()) => {}
        }
    }
}

/// One flag per connection, in every request's extensions: what a service learned about
/// the connection, for its later requests (the store: that it authenticated).
#[derive(Debug, Clone, Default)]
pub struct ConnectionMark(Arc<std::sync::atomic::AtomicBool>);

impl ConnectionMark {
    pub fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The router, counting requests in flight for the connection it serves, and holding
/// long requests to the stream slots where the port has them.
#[derive(Clone)]
struct Tracked {
    inner: TowerToHyperService<axum::Router>,
    activity: Arc<Activity>,
    mark: ConnectionMark,
    peer: IpAddr,
    streams: Option<(StreamRules, Arc<Streams>)>,
    name: &'static str,
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<TrackedBody>;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        req.extensions_mut().insert(self.mark.clone());
        let grpc = req
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let (kind, timeout, slot) = match &self.streams {
            None => (Kind::Stream, None, None),
            Some((rules, slots)) => match (rules.kind)(req.uri().path()) {
                Kind::OneShot => (Kind::OneShot, Some(rules.oneshot_timeout), None),
                Kind::Stream => match slots.begin(self.peer) {
                    Ok(slot) => (Kind::Stream, None, Some(slot)),
                    Err(refusal) => {
                        tracing::debug!(peer = %self.peer, ?refusal, "{} refused a stream", self.name);
                        // Answered at once, so the connection is idle again: the first to
                        // go when a newcomer needs its slot.
                        InFlight::refused(&self.activity);
                        let status = tonic::Status::resource_exhausted(refusal.message());
                        return Box::pin(std::future::ready(Ok(TrackedBody::plain(
                            status.into_http(),
                        ))));
                    }
                },
            },
        };
        let in_flight = InFlight::begin(self.activity.clone());
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = match (kind, timeout) {
                (Kind::OneShot, Some(t)) => tokio::time::timeout(t, response)
                    .await
                    .unwrap_or_else(|_| Ok(too_slow(grpc)))?,
                _ => response.await?,
            };
            Ok(response.map(|body| TrackedBody {
                body,
                _in_flight: Some(in_flight),
                _slot: slot,
            }))
        })
    }
}

/// The answer to a one-shot request not answered in time (most likely its body never
/// came).
fn too_slow(grpc: bool) -> Response<Body> {
    if grpc {
        tonic::Status::deadline_exceeded("the request was not complete in time").into_http()
    } else {
        let mut r = Response::new(Body::from("the request was not complete in time\n"));
        *r.status_mut() = hyper::StatusCode::REQUEST_TIMEOUT;
        r
    }
}

/// One request in flight, from its head until its response body is done or dropped.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(activity: Arc<Activity>) -> Self {
        {
            let mut c = activity.lock();
            c.requests += 1;
            c.in_flight += 1;
        }
        Self(activity)
    }

    /// A request answered at once without running: counted, never in flight.
    fn refused(activity: &Activity) {
        let mut c = activity.lock();
        c.requests += 1;
        if c.in_flight == 0 {
            c.idle_since = Instant::now();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut c = self.0.lock();
        c.in_flight = c.in_flight.saturating_sub(1);
        c.idle_since = Instant::now();
    }
}

/// A response body that ends its request's time in flight, and gives back its stream
/// slot, when hyper is done with it.
struct TrackedBody {
    body: Body,
    _in_flight: Option<InFlight>,
    _slot: Option<StreamSlot>,
}

impl TrackedBody {
    /// A response that never ran: nothing to give back.
    fn plain(response: Response<Body>) -> Response<Self> {
        response.map(|body| TrackedBody {
            body,
            _in_flight: None,
            _slot: None,
        })
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket, noting when writes wait on a peer that does not read.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl Watched {
    fn note<T>(&self, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        let mut c = self.activity.lock();
        match &poll {
            Poll::Pending => {
                c.stalled_since.get_or_insert_with(Instant::now);
            }
            Poll::Ready(_) => c.stalled_since = None,
        }
        poll
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.note(poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.note(poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn limits() -> Limits {
        Limits {
            max_connections: 3,
            head_timeout: 10 * S,
            idle_timeout: 30 * S,
            stall_timeout: 20 * S,
            name: "test",
            streams: None,
        }
    }

    #[test]
    fn the_cap_is_a_quarter_of_the_open_file_limit_within_bounds() {
        assert_eq!(connection_cap(Some(256)), 64);
        assert_eq!(connection_cap(Some(1024)), 256);
        assert_eq!(connection_cap(Some(1 << 20)), MAX_CONNECTIONS);
        assert_eq!(connection_cap(None), MAX_CONNECTIONS);
        assert_eq!(connection_cap(Some(8)), MIN_CONNECTIONS);
        assert_eq!(connection_cap(Some(0)), MIN_CONNECTIONS);
    }

    #[test]
    fn the_store_keeps_room_for_the_status_port_and_the_agents_own_work() {
        assert_eq!(store_connection_cap(Some(1024)), 512);
        assert_eq!(store_connection_cap(Some(65_536)), 65_536 - 256 - 256);
        assert_eq!(store_connection_cap(Some(1 << 20)), MAX_STORE_CONNECTIONS);
        assert_eq!(store_connection_cap(None), MAX_STORE_CONNECTIONS);
        assert_eq!(store_connection_cap(Some(256)), MIN_STORE_CONNECTIONS);
        // Never more than the limit leaves once the status port has its share.
        for soft in [600u64, 1024, 4096, 65_536] {
            let total = store_connection_cap(Some(soft)) + connection_cap(Some(soft));
            assert!(total as u64 + OWN_RESERVE <= soft, "{soft}");
        }
    }

    #[test]
    fn a_connection_must_send_a_request_head_within_the_head_timeout() {
        let t0 = Instant::now();
        let c = ConnState::new(t0);
        assert_eq!(
            verdict(&c, &limits(), t0 + 9 * S),
            Verdict::Keep {
                recheck: t0 + 10 * S
            }
        );
        assert_eq!(
            verdict(&c, &limits(), t0 + 10 * S),
            Verdict::Close(CloseReason::NoRequest)
        );
    }

    #[test]
    fn an_idle_connection_closes_after_the_idle_timeout_from_its_last_request() {
        let t0 = Instant::now();
        let c = ConnState {
            requests: 1,
            idle_since: t0 + 5 * S,
            ..ConnState::new(t0)
        };
        assert_eq!(
            verdict(&c, &limits(), t0 + 20 * S),
            Verdict::Keep {
                recheck: t0 + 35 * S
            }
        );
        assert_eq!(
            verdict(&c, &limits(), t0 + 35 * S),
            Verdict::Close(CloseReason::Idle)
        );
    }

    #[test]
    fn a_busy_connection_stays_unless_its_writes_stall() {
        let t0 = Instant::now();
        let busy = ConnState {
            requests: 1,
            in_flight: 1,
            ..ConnState::new(t0)
        };
        // A long request (a Watch stream) outlives every timeout while it makes progress.
        assert!(matches!(
            verdict(&busy, &limits(), t0 + 3600 * S),
            Verdict::Keep { recheck } if recheck > t0 + 3600 * S
        ));
        let stalled = ConnState {
            stalled_since: Some(t0 + 100 * S),
            ..busy
        };
        assert_eq!(
            verdict(&stalled, &limits(), t0 + 119 * S),
            Verdict::Keep {
                recheck: t0 + 120 * S
            }
        );
        assert_eq!(
            verdict(&stalled, &limits(), t0 + 120 * S),
            Verdict::Close(CloseReason::Stalled)
        );
    }

    #[test]
    fn below_the_cap_everyone_is_admitted() {
        let t0 = Instant::now();
        let c = ConnState::new(t0);
        assert_eq!(admission([(0, &c), (1, &c)], 3, t0), Admission::Admit);
        assert_eq!(admission([], 3, t0), Admission::Admit);
    }

    #[test]
    fn at_the_cap_the_connection_idle_the_longest_makes_room() {
        let t0 = Instant::now();
        let fresh = ConnState::new(t0 + 5 * S);
        let kept_alive = ConnState {
            requests: 3,
            idle_since: t0 + 2 * S,
            ..ConnState::new(t0)
        };
        let silent = ConnState::new(t0 + 3 * S);
        let busy = ConnState {
            requests: 1,
            in_flight: 1,
            ..ConnState::new(t0)
        };
        let now = t0 + 6 * S;
        assert_eq!(
            admission(
                [(0, &busy), (1, &fresh), (2, &silent), (3, &kept_alive)],
                4,
                now
            ),
            Admission::Evict(3)
        );
        // A newcomer that has not spoken yet is the last to go: it is the newest.
        assert_eq!(
            admission([(0, &busy), (1, &fresh), (2, &silent)], 3, now),
            Admission::Evict(2)
        );
        // Equal ages: the older id.
        assert_eq!(
            admission([(7, &silent), (4, &silent), (9, &busy)], 3, now),
            Admission::Evict(4)
        );
    }

    #[test]
    fn at_the_cap_a_writer_stuck_on_its_peer_can_go_but_a_working_one_cannot() {
        let t0 = Instant::now();
        let busy = ConnState {
            requests: 1,
            in_flight: 1,
            ..ConnState::new(t0)
        };
        let briefly_stalled = ConnState {
            stalled_since: Some(t0 + 10 * S),
            ..busy
        };
        let now = t0 + 10 * S + STALL_EVICTABLE / 2;
        assert_eq!(
            admission([(0, &busy), (1, &briefly_stalled)], 2, now),
            Admission::Refuse,
            "every connection busy: the newcomer is refused"
        );
        assert_eq!(
            admission([(0, &busy), (1, &briefly_stalled)], 2, t0 + 12 * S),
            Admission::Evict(1)
        );
    }

    #[test]
    fn accept_errors_about_one_connection_retry_at_once_the_rest_back_off() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let enfile = io::Error::from_raw_os_error(libc::ENFILE);
        assert!(accept_backoff(&emfile).is_some());
        assert!(accept_backoff(&enfile).is_some());
        assert!(accept_backoff(&io::Error::from_raw_os_error(libc::ENOMEM)).is_some());
        assert_eq!(
            accept_backoff(&io::Error::from(io::ErrorKind::ConnectionAborted)),
            None
        );
        assert_eq!(
            accept_backoff(&io::Error::from_raw_os_error(libc::ECONNABORTED)),
            None
        );
    }

    /// A one-shot request whose body never comes is answered anyway, so its connection
    /// cannot stay busy and keep a probe out of the reserved slots.
    #[tokio::test]
    async fn a_one_shot_request_whose_body_never_comes_is_answered_in_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        // A handler that reads the whole body first, as a gRPC unary call does.
        let router = axum::Router::new().route(
            "/grpc.health.v1.Health/Check",
            axum::routing::post(|body: String| async move { body }),
        );
        let limits = Limits {
            max_connections: 8,
            streams: Some(StreamRules {
                max_streams: 6,
                oneshot_timeout: S / 5,
                kind: |path| match path {
                    "/grpc.health.v1.Health/Check" => Kind::OneShot,
                    _ => Kind::Stream,
                },
            }),
            ..limits()
        };
        let server = tokio::spawn(serve(socket, router, limits));
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(
            b"POST /grpc.health.v1.Health/Check HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab",
        )
        .await
        .unwrap();
        let mut answer = [0u8; 64];
        let n = tokio::time::timeout(5 * S, c.read(&mut answer))
            .await
            .expect("an answer within the one-shot timeout, not never")
            .unwrap();
        let head = String::from_utf8_lossy(&answer[..n]).into_owned();
        assert!(head.starts_with("HTTP/1.1 408"), "{head}");
        server.abort();
    }

    #[test]
    fn the_throttle_logs_once_per_period_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut t = Throttle::new(30 * S);
        assert_eq!(t.allow(t0), Some(0));
        assert_eq!(t.allow(t0 + S), None);
        assert_eq!(t.allow(t0 + 29 * S), None);
        assert_eq!(t.allow(t0 + 30 * S), Some(2));
        assert_eq!(t.allow(t0 + 31 * S), None);
        assert_eq!(t.allow(t0 + 90 * S), Some(1));
    }
}
