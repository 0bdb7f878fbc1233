//! The embedded store of `--rdzv-backend c10d`: multi-node training without an etcd.
//!
//! torchrun's c10d backend keeps the rendezvous in a TCP store served by the agent whose
//! host matches `--rdzv-endpoint`. We keep that deployment (same flag, same endpoint, same
//! "who hosts" rule) but not a second protocol: the agent that hosts serves the part of
//! etcd's v3 API the rendezvous uses, and every agent, the host included, runs the etcd
//! rendezvous against it through its ordinary etcd client. Fenced rounds, leases, re-forms,
//! the restart budget and the status view are the etcd backend's, unchanged.
//!
//! What it cannot survive is the host: the store lives in one agent's memory, so when that
//! agent dies the others lose the rendezvous (as every torchrun c10d job does). A host
//! that comes back within the others' outage window serves an empty store, and they
//! register again as they would after an etcd restart without data; otherwise the job
//! ends. etcd is the resilient choice.
//!
//! * [`state`]: the keys, revisions, leases and watch history, pure.
//! * [`service`]: the gRPC services over that state.
//! * [`decide_host`]: whether this agent serves, as a pure function of what binding the
//!   endpoint found ([`bind`] does the binding, [`host_if_here`] both).
//!
//! A crate of its own, below the rendezvous: the agent serves it, and the rendezvous
//! crate's deterministic simulator runs [`state`] as its etcd. It knows nothing of the
//! rendezvous; what it needs from the agent (this machine's host name) is passed in.

pub mod service;
pub mod state;

use std::net::SocketAddr;
use std::time::Duration;

use fsdp_proto::etcdserverpb as pb;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Why this agent cannot host the store it was asked to host (a configuration error: the
/// agent exits 64).
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// `is_host=true` cannot be honoured; why, in words.
    #[error("{0}")]
    Refused(String),
    #[error("cannot serve the c10d store: {0}")]
    Serve(#[source] std::io::Error),
}

/// torchrun's default port for `--rdzv-backend c10d`.
pub const DEFAULT_PORT: u16 = 29400;

/// What trying to listen on the endpoint found.
#[derive(Debug)]
pub enum Bind {
    /// This machine has the address and the port was free.
    Bound(SocketAddr),
    /// The port is taken: on this machine, another agent of the job got there first.
    InUse(SocketAddr),
    /// None of the endpoint's addresses is this machine's.
    NotLocal,
    /// Listening failed otherwise (a privileged port, say).
    Failed(std::io::Error),
}

/// Whether this agent serves the store.
#[derive(Debug, PartialEq, Eq)]
pub enum Hosting {
    Serve,
    Connect,
    /// `is_host=true` was asked for and cannot be honoured.
    Refuse,
}

/// torchrun's rule: with `is_host` unset, the agent whose machine has the endpoint's
/// address serves, and when several agents match, the first to bind serves and the others
/// connect; `is_host` set forces the choice, and a forced host that cannot listen is an
/// error. Returns the decision and why, in words for the log.
pub fn decide_host(is_host: Option<bool>, bind: &Bind) -> (Hosting, String) {
    match (is_host, bind) {
        (Some(false), _) => (Hosting::Connect, "is_host=false".into()),
        (_, Bind::Bound(addr)) => (
            Hosting::Serve,
            format!("this machine has {addr} and the port was free"),
        ),
        (None, Bind::InUse(addr)) => (
            Hosting::Connect,
            format!(
                "{addr} is taken on this machine: another agent serves it (the first to bind serves)"
            ),
        ),
        (None, Bind::NotLocal) => (
            Hosting::Connect,
            "the endpoint is not an address of this machine".into(),
        ),
        (None, Bind::Failed(e)) => (
            Hosting::Connect,
            format!("cannot listen on the endpoint here ({e})"),
        ),
        (Some(true), Bind::InUse(addr)) => (
            Hosting::Refuse,
            format!("--rdzv-conf is_host=true but {addr} is already in use on this machine"),
        ),
        (Some(true), Bind::NotLocal) => (
            Hosting::Refuse,
            "--rdzv-conf is_host=true but the endpoint's host is not an address of this machine"
                .into(),
        ),
        (Some(true), Bind::Failed(e)) => (
            Hosting::Refuse,
            format!("--rdzv-conf is_host=true but the endpoint cannot be listened on: {e}"),
        ),
    }
}

/// Whether `host` names this machine: its host name, or a DNS name whose first label is it
/// (`worker-0.job.ns.svc` in the pod `worker-0`).
pub fn names_this_machine(host: &str, hostname: &str) -> bool {
    let (host, hostname) = (host.to_ascii_lowercase(), hostname.to_ascii_lowercase());
    !hostname.is_empty()
        && (host == hostname
            || host
                .strip_prefix(&hostname)
                .is_some_and(|rest| rest.starts_with('.')))
}

/// Tries to listen on the endpoint; the listener when it binds. A host name that is this
/// machine's own is served on every address without a lookup: in Kubernetes a pod's DNS
/// name often resolves only once the pod is ready, which is after its group formed. A
/// name that does not resolve (yet) is another machine's: the agent connects, and its
/// client retries until it does. `hostname` is this machine's.
pub async fn bind(host: &str, port: u16, hostname: &str) -> (Bind, Option<TcpListener>) {
    let addrs: Vec<SocketAddr> = if names_this_machine(host, hostname) {
        vec![SocketAddr::from(([0, 0, 0, 0], port))]
    } else {
        match tokio::net::lookup_host((host, port)).await {
            Ok(found) => found.collect(),
            Err(e) => {
                tracing::debug!(host, error = %e, "the c10d endpoint does not resolve here");
                Vec::new()
            }
        }
    };
    let mut outcome = Bind::NotLocal;
    for addr in addrs {
        match TcpListener::bind(addr).await {
            Ok(l) => return (Bind::Bound(l.local_addr().unwrap_or(addr)), Some(l)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => outcome = Bind::InUse(addr),
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {}
            Err(e) if matches!(outcome, Bind::NotLocal) => outcome = Bind::Failed(e),
            Err(_) => {}
        }
    }
    (outcome, None)
}

/// A store this agent serves; it stops when [`StoreServer::close`] is called or when it is
/// dropped.
pub struct StoreServer {
    shared: service::Shared,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
}

impl StoreServer {
    /// Serves the store on `listener`.
    pub fn start(listener: TcpListener) -> std::io::Result<Self> {
        use pb::{
            cluster_server::ClusterServer, kv_server::KvServer, lease_server::LeaseServer,
            maintenance_server::MaintenanceServer, watch_server::WatchServer,
        };
        let addr = listener.local_addr()?;
        let shared = service::Shared::new();
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| {
                // Rendezvous requests are small and latency-bound.
                let _ = s.set_nodelay(true);
                s
            });
            Some((conn, l))
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let router = tonic::transport::Server::builder()
            .add_service(KvServer::new(shared.clone()))
            .add_service(WatchServer::new(shared.clone()))
            .add_service(LeaseServer::new(shared.clone()))
            .add_service(ClusterServer::new(shared.clone()))
            .add_service(MaintenanceServer::new(shared.clone()));
        let expiry = shared.clone().expire_leases();
        let served = tokio::spawn(async move {
            let serve = router.serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            });
            tokio::select! {
                r = serve => if let Err(e) = r {
                    tracing::error!(error = %e, "embedded rendezvous store stopped");
                },
                () = expiry => {}
            }
        });
        Ok(Self {
            shared,
            addr,
            stop: Some(stop),
            served,
        })
    }

    /// Where the store listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Leases still held: agents of the job that have not left.
    pub fn leases(&self) -> usize {
        self.shared.leases()
    }

    /// Keeps serving until every agent has left (its lease revoked or lapsed), at most
    /// `patience`, then stops. The host's own run ending must not take the store from
    /// agents still finishing theirs (their last records, their exit barrier).
    pub async fn close(mut self, patience: Duration) {
        let deadline = tokio::time::Instant::now() + patience;
        while self.leases() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if self.leases() > 0 {
            tracing::warn!(
                agents = self.leases(),
                "closing the embedded rendezvous store while agents still hold leases"
            );
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.served).await;
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.served.abort();
    }
}

/// Serves the store here when this agent is its host ([`decide_host`]); `None` when
/// another agent serves it. A forced host (`is_host=true`) that cannot listen is a
/// configuration error. `hostname` is this machine's ([`bind`]).
pub async fn host_if_here(
    host: &str,
    port: u16,
    is_host: Option<bool>,
    hostname: &str,
) -> Result<Option<StoreServer>, HostError> {
    let (bound, listener) = if is_host == Some(false) {
        (Bind::NotLocal, None)
    } else {
        bind(host, port, hostname).await
    };
    let (decision, why) = decide_host(is_host, &bound);
    match (decision, listener) {
        (Hosting::Serve, Some(listener)) => {
            let server = StoreServer::start(listener).map_err(HostError::Serve)?;
            tracing::info!(addr = %server.addr(), why, "serving the c10d rendezvous store (the job ends if this agent dies; etcd is the resilient choice)");
            Ok(Some(server))
        }
        (Hosting::Refuse, _) => Err(HostError::Refused(why)),
        _ => {
            tracing::info!(endpoint = %format!("{host}:{port}"), why, "the c10d rendezvous store is served by another agent");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_use() -> Bind {
        Bind::InUse("127.0.0.1:29400".parse().unwrap())
    }

    #[test]
    fn the_first_agent_to_bind_serves_and_the_others_connect() {
        let bound = Bind::Bound("127.0.0.1:29400".parse().unwrap());
        assert_eq!(decide_host(None, &bound).0, Hosting::Serve);
        assert_eq!(decide_host(None, &in_use()).0, Hosting::Connect);
        assert_eq!(decide_host(None, &Bind::NotLocal).0, Hosting::Connect);
        let denied = Bind::Failed(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        assert_eq!(decide_host(None, &denied).0, Hosting::Connect);
    }

    #[test]
    fn a_pods_own_name_is_this_machine_whatever_the_dns_says() {
        assert!(names_this_machine("job-worker-0", "job-worker-0"));
        assert!(names_this_machine(
            "JOB-worker-0.job.ns.svc",
            "job-worker-0"
        ));
        assert!(!names_this_machine("job-worker-0", "job-worker-1"));
        assert!(!names_this_machine("job-worker-01", "job-worker-0"));
        assert!(!names_this_machine("10.0.0.1", ""));
    }

    #[test]
    fn is_host_forces_the_choice_and_a_forced_host_that_cannot_listen_is_an_error() {
        let bound = Bind::Bound("127.0.0.1:29400".parse().unwrap());
        assert_eq!(decide_host(Some(false), &bound).0, Hosting::Connect);
        assert_eq!(decide_host(Some(true), &bound).0, Hosting::Serve);
        let (d, why) = decide_host(Some(true), &in_use());
        assert_eq!(d, Hosting::Refuse);
        assert!(why.contains("already in use"), "{why}");
        let (d, why) = decide_host(Some(true), &Bind::NotLocal);
        assert_eq!(d, Hosting::Refuse);
        assert!(why.contains("not an address of this machine"), "{why}");
    }
}
