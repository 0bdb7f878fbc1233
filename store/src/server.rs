//! The store on a listener: the gRPC services of [`service`] behind the [`auth`](crate::auth) gate,
//! on the bounded accept loop of [`listener`] (with TLS when [`Security::tls`] is set),
//! and the lease expiry, until [`StoreServer::close`].

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use fsdp_proto::etcdserverpb as pb;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use crate::auth::{Credentials, Gate};
use crate::bounded_listener::{self as listener, Limits};
use crate::service;
use crate::tls::{self, ServerTls, TlsError};

/// Who the store lets in: everyone who reaches the port (both `None`, torchrun's
/// TCPStore), holders of the password, clients with a certificate, or both.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Security {
    pub credentials: Option<Credentials>,
    pub tls: Option<ServerTls>,
}

impl Security {
    /// Anyone who can reach the port can read and write every key.
    pub fn is_open(&self) -> bool {
        self.credentials.is_none() && self.tls.as_ref().is_none_or(|t| t.client_ca.is_none())
    }
}

/// A store this agent serves; it stops when [`StoreServer::close`] is called or when it is
/// dropped.
pub struct StoreServer {
    shared: service::Shared,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
    torchrun: watch::Receiver<Option<IpAddr>>,
}

impl StoreServer {
    /// Serves the store on `listener`, within the store's [`Limits::for_the_store`].
    pub fn start(listener: TcpListener, security: &Security) -> Result<Self, TlsError> {
        Self::start_within(listener, security, Limits::for_the_store())
    }

    /// [`StoreServer::start`] within `limits`.
    pub fn start_within(
        listener: TcpListener,
        security: &Security,
        limits: Limits,
    ) -> Result<Self, TlsError> {
        Self::start_reporting(listener, security, limits, watch::channel(None).0)
    }

    /// [`StoreServer::start_within`], telling torchrun clients to `seen`: a receiver handed
    /// out before the store was served ([`crate::host::Standby`]) learns of them too.
    pub(crate) fn start_reporting(
        listener: TcpListener,
        security: &Security,
        limits: Limits,
        seen: watch::Sender<Option<IpAddr>>,
    ) -> Result<Self, TlsError> {
        use pb::{
            auth_server::AuthServer, cluster_server::ClusterServer, kv_server::KvServer,
            lease_server::LeaseServer, maintenance_server::MaintenanceServer,
            watch_server::WatchServer,
        };
        let addr = listener
            .local_addr()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let acceptor = security.tls.as_ref().map(tls::acceptor).transpose()?;
        let gate = Gate::new(security.credentials.as_ref());
        let shared = service::Shared::with_gate(gate.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        // KV, Watch and Maintenance behind the gate: the token is checked once per call (a
        // Watch stream's at its start), as etcd checks it. Lease and Cluster get no token
        // from etcd-client (etcd does not ask); LeaseRevoke checks the connection itself.
        let g = gate.clone();
        let checked = move |req: tonic::Request<()>| g.check(&req).map(|()| req);
        let router = tonic::service::Routes::new(KvServer::with_interceptor(
            shared.clone(),
            checked.clone(),
        ))
        .add_service(WatchServer::with_interceptor(
            shared.clone(),
            checked.clone(),
        ))
        .add_service(LeaseServer::new(shared.clone()))
        .add_service(ClusterServer::new(shared.clone()))
        .add_service(MaintenanceServer::with_interceptor(shared.clone(), checked))
        .add_service(AuthServer::new(service::Authenticator::new(
            gate,
            shared.clone(),
        )))
        .into_axum_router();
        let expiry = shared.clone().expire_leases();
        let torchrun = seen.subscribe();
        let seen = Some(std::sync::Arc::new(seen));
        let served = tokio::spawn(async move {
            tokio::select! {
                () = listener::serve_tls(listener, router, limits, acceptor, seen) => {}
                () = expiry => {}
                _ = stopped => {}
            }
        });
        Ok(Self {
            shared,
            addr,
            stop: Some(stop),
            served,
            torchrun,
        })
    }

    /// Becomes the address of the first client that spoke torchrun's TCPStore protocol to
    /// this store (a node of the job runs torchrun: the job cannot form).
    pub fn torchrun_clients(&self) -> watch::Receiver<Option<IpAddr>> {
        self.torchrun.clone()
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
