//! One port, three services: `fsdp.v1.AgentStatus` and `grpc.health.v1.Health` over gRPC,
//! and `GET /metrics` over HTTP/1.1 for Prometheus. One port keeps the pod spec simple
//! (one `containerPort`, probes and scrape annotations all point at it).
//!
//! Server reflection (`grpc.reflection.v1`) is on, so `grpcurl -plaintext HOST:PORT list`
//! works without the .proto files.
//!
//! The port is bounded (a connection cap from the open-file limit, timeouts for slow and
//! idle peers, eviction at the cap): see [`super::limits`]. Long streams (`Liveness`,
//! health `Watch`) have slots of their own, a few per source address, so that they never
//! starve the probes: see [`fsdp_store::streams`].
//!
//! Health services: `""` and `"liveness"` are SERVING as long as the agent's loop runs
//! (a wedged agent stops answering, and the probe fails); `"readiness"` is SERVING only
//! while workers run in a sealed round.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::http::header;
use axum::routing::get;
use fsdp_proto::v1::agent_status_server::{AgentStatus, AgentStatusServer};
use fsdp_proto::v1::{AgentState, GetStatusRequest, Heartbeat, LivenessRequest};
use tonic::codegen::Service;
use tonic::server::NamedService;
use tonic_health::ServingStatus;

use fsdp_store::bounded_listener;

use super::{Board, limits, metrics};

/// Server reflection over this port's services: built from the descriptors compiled in.
fn reflection() -> impl Service<
    axum::http::Request<tonic::body::Body>,
    Response = axum::http::Response<tonic::body::Body>,
    Error = std::convert::Infallible,
    Future: Send,
> + NamedService
+ Clone
+ Send
+ Sync
+ 'static {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fsdp_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptor sets compiled in are well formed")
}

/// A service built on its first request, not at the agent's start: decoding the
/// reflection's descriptors was a twentieth of each agent's start (1,000 agents on two
/// cores), for a service a person with grpcurl asks now and then.
struct Lazy<S> {
    built: Arc<OnceLock<S>>,
    build: fn() -> S,
}

impl<S> Clone for Lazy<S> {
    fn clone(&self) -> Self {
        Self {
            built: self.built.clone(),
            build: self.build,
        }
    }
}

impl<S> Lazy<S> {
    fn new(build: fn() -> S) -> Self {
        Self {
            built: Arc::default(),
            build,
        }
    }
}

impl<S: NamedService> NamedService for Lazy<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, R> Service<R> for Lazy<S>
where
    S: Service<R> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // tonic's generated servers are always ready; the clone called below is asked
        // nothing else.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.built.get_or_init(self.build).clone().call(request)
    }
}

/// Health service names (see the module docs).
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";

struct StatusService {
    board: Board,
}

/// How often a liveness stream says the agent lives. A death is proven by the stream
/// breaking, not by a missed beat, and a stream in flight is never idle to the port's
/// timeouts: the beat only keeps middleboxes from forgetting the connection. Once a second
/// it was a fifth of what 1,000 idle agents cost on two cores.
const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(10);
/// Before the agent joined a run it has no lease to follow: how often a liveness stream
/// looks whether it joined.
const JOIN_LOOK: std::time::Duration = std::time::Duration::from_secs(1);

type HeartbeatStream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<Heartbeat, tonic::Status>> + Send + 'static>,
>;

#[tonic::async_trait]
impl AgentStatus for StatusService {
    async fn get_status(
        &self,
        _request: tonic::Request<GetStatusRequest>,
    ) -> Result<tonic::Response<AgentState>, tonic::Status> {
        Ok(tonic::Response::new(self.board.snapshot().state))
    }

    type LivenessStream = HeartbeatStream;

    /// The stream a ring neighbour watches: a heartbeat now, then one every
    /// [`HEARTBEAT`] or as soon as the lease changed, for as long as this process lives (see `fsdp_rendezvous::etcd::liveness`).
    async fn liveness(
        &self,
        request: tonic::Request<LivenessRequest>,
    ) -> Result<tonic::Response<HeartbeatStream>, tonic::Status> {
        tracing::debug!(watcher = %request.get_ref().watcher, "watched by a ring neighbour");
        let board = self.board.clone();
        // The state: the lease followed, the lease last announced, and when the last beat
        // went (none yet).
        let start = (None, 0i64, None);
        let beats = futures::stream::unfold(start, move |(mut follow, said, sent)| {
            let board = board.clone();
            async move {
                let mut sent: Option<tokio::time::Instant> = sent;
                loop {
                    if follow.is_none() {
                        follow = board.lease();
                    }
                    let lease = follow.as_mut().map_or(0, |f| *f.borrow_and_update());
                    let next_beat = sent.map(|t| t + HEARTBEAT);
                    let now = tokio::time::Instant::now();
                    if next_beat.is_none_or(|t| t <= now) || lease != said {
                        let beat = Heartbeat {
                            node_id: board.node_id(),
                            lease,
                        };
                        sent = Some(now);
                        return Some((Ok(beat), (follow, lease, sent)));
                    }
                    let next_beat = next_beat.unwrap_or(now);
                    match follow.as_mut() {
                        Some(f) => {
                            tokio::select! {
                                // A dropped sender (the backend gone) leaves the beat.
                                r = f.changed() => if r.is_err() {
                                    follow = None;
                                    tokio::time::sleep_until(next_beat).await;
                                },
                                () = tokio::time::sleep_until(next_beat) => {}
                            }
                        }
                        None => tokio::time::sleep_until(next_beat.min(now + JOIN_LOOK)).await,
                    }
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(beats)))
    }
}

/// Binds `addr` and serves until the runtime ends. Returns the bound address (useful
/// with port 0).
pub async fn start(addr: SocketAddr, board: Board) -> std::io::Result<SocketAddr> {
    let reflection = Lazy::new(reflection);
    let socket = tokio::net::TcpListener::bind(addr).await?;
    let local = socket.local_addr()?;

    let (reporter, health) = tonic_health::server::health_reporter();
    for name in ["", LIVENESS] {
        reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let mut ready = board.ready();
    tokio::spawn(async move {
        loop {
            let status = if *ready.borrow_and_update() {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            reporter.set_service_status(READINESS, status).await;
            if ready.changed().await.is_err() {
                return;
            }
        }
    });

    let metrics_board = board.clone();
    let router = tonic::service::Routes::new(AgentStatusServer::new(StatusService { board }))
        .add_service(health)
        .add_service(reflection)
        .into_axum_router()
        .route(
            "/metrics",
            get(move || {
                let text = metrics::render(&metrics_board.snapshot());
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        text,
                    )
                }
            }),
        );
    let limits = limits::status_port();
    tracing::debug!(
        max_connections = limits.max_connections,
        max_streams = limits.streams.map_or(0, |s| s.max_streams),
        streams_per_peer = fsdp_store::streams::STREAMS_PER_PEER,
        head_timeout_s = limits.head_timeout.as_secs(),
        idle_timeout_s = limits.idle_timeout.as_secs(),
        "status server limits"
    );
    tokio::spawn(bounded_listener::serve(socket, router, limits));
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reflection is built on its first request, where a failure could only panic:
    /// the descriptors compiled in must build, and one build serves every clone.
    #[test]
    fn the_reflection_builds_once_from_the_descriptors_compiled_in() {
        let lazy = Lazy::new(reflection);
        let other = lazy.clone();
        assert!(lazy.built.get().is_none(), "built before any request");
        let first = other.built.get_or_init(other.build) as *const _;
        assert_eq!(lazy.built.get().map(|s| s as *const _), Some(first));
        fn name<S: NamedService>(_: &S) -> &'static str {
            S::NAME
        }
        assert_eq!(name(&lazy), "grpc.reflection.v1.ServerReflection");
    }
}
