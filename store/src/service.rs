//! The gRPC face of the embedded store: etcd's `KV`, `Watch`, `Lease`, `Cluster` and
//! `Maintenance` services over one [`State`], for the requests the rendezvous makes, and
//! `Auth/Authenticate` ([`Authenticator`]) over the [`Gate`] the server puts before them.
//!
//! Every request takes the state's lock for the length of one state call (no await inside);
//! a write wakes the watch streams through a revision channel, and each stream replays
//! what its watches have not seen yet. A ticker revokes lapsed leases.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fsdp_proto::etcdserverpb as pb;
use futures::{Stream, StreamExt};
use pb::cluster_server::Cluster;
use pb::kv_server::Kv;
use pb::lease_server::Lease;
use pb::maintenance_server::Maintenance;
use pb::watch_server::Watch;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use super::auth::Gate;
use super::state::{Replay, State, StoreError, WatchSpec};

/// The store's one member, as etcd clients ask for it (status, member list).
const MEMBER_ID: u64 = 1;
const CLUSTER_ID: u64 = 0xf5d9;
/// Events per watch response, well under a gRPC message's default 4 MiB.
const EVENTS_PER_RESPONSE: usize = 1000;
/// How often lapsed leases are looked for; a lease outlives its TTL by at most this.
const EXPIRY_TICK: Duration = Duration::from_millis(100);

/// The state and the signal that it changed, shared by every service and stream.
#[derive(Clone)]
pub struct Shared {
    state: Arc<Mutex<State>>,
    revision: watch::Sender<i64>,
    version: &'static str,
    /// For `LeaseRevoke`, which etcd-client sends without a token ([`Gate::admit`]).
    gate: Gate,
}

impl Default for Shared {
    fn default() -> Self {
        Self::new()
    }
}

impl Shared {
    pub fn new() -> Self {
        let state = State::serving();
        let (revision, _) = watch::channel(state.revision());
        Self {
            state: Arc::new(Mutex::new(state)),
            revision,
            version: env!("CARGO_PKG_VERSION"),
            gate: Gate::open(),
        }
    }

    /// The store behind `gate`.
    pub fn with_gate(gate: Gate) -> Self {
        Self {
            gate,
            ..Self::new()
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic inside a state call cannot leave it half-written in a way a later call
        // trips on more than the panic itself did; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the state; wakes the watches when the revision moved.
    fn write<T>(&self, f: impl FnOnce(&mut State) -> T) -> (T, pb::ResponseHeader) {
        let mut state = self.lock();
        let before = state.revision();
        let out = f(&mut state);
        let after = state.revision();
        drop(state);
        if after != before {
            self.revision.send_replace(after);
        }
        (out, header(after))
    }

    fn read<T>(&self, f: impl FnOnce(&State) -> T) -> (T, pb::ResponseHeader) {
        let state = self.lock();
        (f(&state), header(state.revision()))
    }

    /// Leases still held (by agents that have not left).
    pub fn leases(&self) -> usize {
        self.lock().leases()
    }

    /// Revokes lapsed leases until the store is dropped.
    pub async fn expire_leases(self) {
        let mut tick = tokio::time::interval(EXPIRY_TICK);
        loop {
            tick.tick().await;
            let now = std::time::Instant::now();
            let (lapsed, _) = self.write(|s| s.expire(now));
            if !lapsed.is_empty() {
                tracing::debug!(leases = ?lapsed, "embedded store: leases lapsed");
            }
        }
    }
}

fn header(revision: i64) -> pb::ResponseHeader {
    pb::ResponseHeader {
        cluster_id: CLUSTER_ID,
        member_id: MEMBER_ID,
        revision,
        raft_term: 1,
    }
}

impl From<StoreError> for Status {
    fn from(e: StoreError) -> Self {
        let msg = e.to_string();
        match e {
            StoreError::LeaseNotFound => Status::not_found(msg),
            StoreError::LeaseExists => Status::failed_precondition(msg),
            StoreError::KeyNotFound => Status::invalid_argument(msg),
            StoreError::Compacted | StoreError::FutureRevision => Status::out_of_range(msg),
            StoreError::TtlTooLarge | StoreError::BadLeaseId => Status::invalid_argument(msg),
            StoreError::TooManyLeases => Status::resource_exhausted(msg),
        }
    }
}

type Answer<T> = Result<Response<T>, Status>;

/// etcd's `Auth` service, of which the store answers only `Authenticate`.
#[derive(Clone)]
pub struct Authenticator {
    gate: Gate,
    shared: Shared,
    failures: Arc<Failures>,
}

/// Failed logins, answered one at a time and slowly, and said in the log: 2,000 guesses
/// took 0.31 s, and nothing said so.
#[derive(Default)]
struct Failures {
    /// Held while a refusal waits out [`FAILED_LOGIN_DELAY`]: guesses, from however many
    /// connections, get at most one answer per delay.
    one_at_a_time: tokio::sync::Mutex<()>,
    /// Refusals since the last warning, and when that was.
    since_said: std::sync::Mutex<(u64, Option<std::time::Instant>)>,
}

/// How long a refused login waits before its answer.
const FAILED_LOGIN_DELAY: std::time::Duration = std::time::Duration::from_millis(200);
/// How often the refusals are said.
const SAY_FAILURES_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl Failures {
    async fn refused(&self) {
        let say = {
            let mut s = self.since_said.lock().unwrap_or_else(|p| p.into_inner());
            s.0 += 1;
            let due = s.1.is_none_or(|at| at.elapsed() >= SAY_FAILURES_EVERY);
            due.then(|| {
                let n = s.0;
                *s = (0, Some(std::time::Instant::now()));
                n
            })
        };
        if let Some(n) = say {
            tracing::warn!(
                refused = n,
                "the c10d store refused a login with a wrong user or password (is something guessing the password, or started with another one?)"
            );
        }
        let _turn = self.one_at_a_time.lock().await;
        tokio::time::sleep(FAILED_LOGIN_DELAY).await;
    }
}

impl Authenticator {
    pub fn new(gate: Gate, shared: Shared) -> Self {
        Self {
            gate,
            shared,
            failures: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl pb::auth_server::Auth for Authenticator {
    async fn authenticate(
        &self,
        r: Request<pb::AuthenticateRequest>,
    ) -> Answer<pb::AuthenticateResponse> {
        let mark = r
            .extensions()
            .get::<crate::bounded_listener::ConnectionMark>()
            .cloned();
        let r = r.into_inner();
        let token = match self.gate.authenticate(&r.name, &r.password) {
            Ok(t) => t,
            Err(refused) => {
                if refused.code() == tonic::Code::InvalidArgument {
                    self.failures.refused().await;
                }
                return Err(refused);
            }
        };
        if let Some(m) = mark {
            m.set();
        }
        let ((), h) = self.shared.read(|_| ());
        Ok(Response::new(pb::AuthenticateResponse {
            header: Some(h),
            token,
        }))
    }
}
type Outgoing<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Kv for Shared {
    async fn range(&self, r: Request<pb::RangeRequest>) -> Answer<pb::RangeResponse> {
        let (resp, h) = self.read(|s| s.range(r.get_ref()));
        let mut resp = resp?;
        resp.header = Some(h);
        Ok(Response::new(resp))
    }

    async fn put(&self, r: Request<pb::PutRequest>) -> Answer<pb::PutResponse> {
        let (resp, h) = self.write(|s| s.put(r.into_inner()));
        let mut resp = resp?;
        resp.header = Some(h);
        Ok(Response::new(resp))
    }

    async fn delete_range(
        &self,
        r: Request<pb::DeleteRangeRequest>,
    ) -> Answer<pb::DeleteRangeResponse> {
        let (mut resp, h) = self.write(|s| s.delete_range(r.get_ref()));
        resp.header = Some(h);
        Ok(Response::new(resp))
    }

    async fn txn(&self, r: Request<pb::TxnRequest>) -> Answer<pb::TxnResponse> {
        let (resp, h) = self.write(|s| s.txn(r.into_inner()));
        let mut resp = resp?;
        resp.header = Some(h);
        Ok(Response::new(resp))
    }
}

#[tonic::async_trait]
impl Lease for Shared {
    async fn lease_grant(
        &self,
        r: Request<pb::LeaseGrantRequest>,
    ) -> Answer<pb::LeaseGrantResponse> {
        // Every lease call is behind the password too: etcd-client sends them without a
        // token, so they are taken on a connection that authenticated ([`Gate::admit`]).
        // Open, an outsider kept a killed agent's lease alive and the group never re-formed.
        self.gate.admit(&r)?;
        let now = std::time::Instant::now();
        let r = r.into_inner();
        let (granted, h) = self.write(|s| s.grant(r.ttl, r.id, now));
        let (id, ttl) = granted?;
        Ok(Response::new(pb::LeaseGrantResponse {
            header: Some(h),
            id,
            ttl,
            error: String::new(),
        }))
    }

    async fn lease_revoke(
        &self,
        r: Request<pb::LeaseRevokeRequest>,
    ) -> Answer<pb::LeaseRevokeResponse> {
        // Revoking an agent's lease takes it out of the round: only for a connection
        // that authenticated (lease IDs are not secret).
        self.gate.admit(&r)?;
        let (revoked, h) = self.write(|s| s.revoke(r.get_ref().id));
        revoked?;
        Ok(Response::new(pb::LeaseRevokeResponse { header: Some(h) }))
    }

    type LeaseKeepAliveStream = Outgoing<pb::LeaseKeepAliveResponse>;

    async fn lease_keep_alive(
        &self,
        r: Request<Streaming<pb::LeaseKeepAliveRequest>>,
    ) -> Answer<Self::LeaseKeepAliveStream> {
        self.gate.admit(&r)?;
        let shared = self.clone();
        // Each keep-alive is answered with the lease's TTL, or 0 when it is gone (etcd's
        // answer, which tells the agent to register again).
        let answers = r.into_inner().map(move |req| {
            let id = req?.id;
            let now = std::time::Instant::now();
            let (ttl, h) = shared.write(|s| s.keep_alive(id, now));
            Ok(pb::LeaseKeepAliveResponse {
                header: Some(h),
                id,
                ttl: ttl.unwrap_or(0),
            })
        });
        Ok(Response::new(Box::pin(answers)))
    }

    async fn lease_time_to_live(
        &self,
        r: Request<pb::LeaseTimeToLiveRequest>,
    ) -> Answer<pb::LeaseTimeToLiveResponse> {
        // Its answer names the run, its members and their keys.
        self.gate.admit(&r)?;
        let now = std::time::Instant::now();
        let r = r.into_inner();
        let (found, h) = self.read(|s| s.time_to_live(r.id, now));
        // etcd answers an unknown lease with a TTL of -1, not an error.
        let (ttl, granted_ttl, keys) = found.unwrap_or((-1, 0, Vec::new()));
        Ok(Response::new(pb::LeaseTimeToLiveResponse {
            header: Some(h),
            id: r.id,
            ttl,
            granted_ttl,
            keys: if r.keys { keys } else { Vec::new() },
        }))
    }
}

#[tonic::async_trait]
impl Cluster for Shared {
    async fn member_list(
        &self,
        r: Request<pb::MemberListRequest>,
    ) -> Answer<pb::MemberListResponse> {
        self.gate.admit(&r)?;
        let ((), h) = self.read(|_| ());
        Ok(Response::new(pb::MemberListResponse {
            header: Some(h),
            members: vec![pb::Member {
                id: MEMBER_ID,
                name: "fsdp-agent-store".into(),
                peer_ur_ls: Vec::new(),
                client_ur_ls: Vec::new(),
            }],
        }))
    }
}

#[tonic::async_trait]
impl Maintenance for Shared {
    async fn status(&self, _r: Request<pb::StatusRequest>) -> Answer<pb::StatusResponse> {
        let (rev, h) = self.read(State::revision);
        Ok(Response::new(pb::StatusResponse {
            header: Some(h),
            version: self.version.into(),
            db_size: 0,
            // The one member is its own leader.
            leader: MEMBER_ID,
            raft_index: rev.unsigned_abs(),
            raft_term: 1,
        }))
    }
}

/// One watch of a stream: what it asks for and the next revision it has not seen.
struct Watcher {
    id: i64,
    spec: WatchSpec,
    next: i64,
}

#[tonic::async_trait]
impl Watch for Shared {
    type WatchStream = Outgoing<pb::WatchResponse>;

    async fn watch(&self, r: Request<Streaming<pb::WatchRequest>>) -> Answer<Self::WatchStream> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(serve_watches(self.clone(), r.into_inner(), tx));
        Ok(Response::new(Box::pin(tokio_stream_from(rx))))
    }
}

fn tokio_stream_from<T: Send + 'static>(
    rx: mpsc::Receiver<Result<T, Status>>,
) -> impl Stream<Item = Result<T, Status>> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

/// One client's watch stream: creates and cancels its watches, and sends each watch the
/// events it has not seen whenever the revision moves. Ends when either side goes.
async fn serve_watches(
    shared: Shared,
    mut requests: Streaming<pb::WatchRequest>,
    tx: mpsc::Sender<Result<pb::WatchResponse, Status>>,
) {
    use pb::watch_request::RequestUnion;
    let mut revision = shared.revision.subscribe();
    let mut watchers: Vec<Watcher> = Vec::new();
    let mut next_id = 0;
    loop {
        tokio::select! {
            req = requests.message() => {
                let Ok(Some(req)) = req else { return };
                match req.request_union {
                    Some(RequestUnion::CreateRequest(c)) => {
                        let id = if c.watch_id > 0 { c.watch_id } else { next_id };
                        next_id = next_id.max(id) + 1;
                        let ((), h) = shared.read(|_| ());
                        let next = if c.start_revision > 0 { c.start_revision } else { h.revision + 1 };
                        let spec = WatchSpec {
                            no_put: c.filters.contains(&(pb::watch_create_request::FilterType::Noput as i32)),
                            no_delete: c.filters.contains(&(pb::watch_create_request::FilterType::Nodelete as i32)),
                            key: c.key,
                            range_end: c.range_end,
                            prev_kv: c.prev_kv,
                        };
                        let created = pb::WatchResponse { header: Some(h), watch_id: id, created: true, ..Default::default() };
                        if tx.send(Ok(created)).await.is_err() {
                            return;
                        }
                        watchers.push(Watcher { id, spec, next });
                    }
                    Some(RequestUnion::CancelRequest(c)) => {
                        watchers.retain(|w| w.id != c.watch_id);
                        let ((), h) = shared.read(|_| ());
                        let canceled = pb::WatchResponse { header: Some(h), watch_id: c.watch_id, canceled: true, ..Default::default() };
                        if tx.send(Ok(canceled)).await.is_err() {
                            return;
                        }
                    }
                    Some(RequestUnion::ProgressRequest(_)) => {
                        let ((), h) = shared.read(|_| ());
                        let progress = pb::WatchResponse { header: Some(h), watch_id: -1, ..Default::default() };
                        if tx.send(Ok(progress)).await.is_err() {
                            return;
                        }
                    }
                    None => {}
                }
            }
            changed = revision.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
        if !deliver(&shared, &mut watchers, &tx).await {
            return;
        }
    }
}

/// Sends every watcher its events up to the current revision; false when the client went.
async fn deliver(
    shared: &Shared,
    watchers: &mut Vec<Watcher>,
    tx: &mpsc::Sender<Result<pb::WatchResponse, Status>>,
) -> bool {
    let mut compacted = Vec::new();
    for w in watchers.iter_mut() {
        let (replay, h) =
            shared.read(|s| (w.next <= s.revision()).then(|| s.replay(w.next, &w.spec)));
        let Some(replay) = replay else { continue };
        let revision = h.revision;
        match replay {
            Replay::Compacted(rev) => {
                let resp = pb::WatchResponse {
                    header: Some(h),
                    watch_id: w.id,
                    canceled: true,
                    compact_revision: rev,
                    cancel_reason: StoreError::Compacted.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return false;
                }
                compacted.push(w.id);
            }
            Replay::Events(events) => {
                w.next = revision + 1;
                for chunk in events.chunks(EVENTS_PER_RESPONSE) {
                    let resp = pb::WatchResponse {
                        header: Some(h),
                        watch_id: w.id,
                        events: chunk.to_vec(),
                        ..Default::default()
                    };
                    if tx.send(Ok(resp)).await.is_err() {
                        return false;
                    }
                }
            }
        }
    }
    watchers.retain(|w| !compacted.contains(&w.id));
    true
}
