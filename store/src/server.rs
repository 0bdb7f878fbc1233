//! The store on a listener: the gRPC services of [`service`] and the lease expiry, until
//! [`StoreServer::close`].

use std::net::SocketAddr;
use std::time::Duration;

use fsdp_proto::etcdserverpb as pb;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::service;

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
