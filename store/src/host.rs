//! Who serves the store: torchrun's "who hosts" rule as a pure function of what binding
//! the endpoint found ([`decide_host`]), the binding itself ([`bind`]), and the two
//! together ([`host_if_here`]).

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::server::{Security, StoreServer};
use crate::tls::TlsError;

/// Why this agent cannot host the store it was asked to host (a configuration error: the
/// agent exits 64).
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// `is_host=true` cannot be honoured; why, in words.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Tls(#[from] TlsError),
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

/// Serves the store here when this agent is its host ([`decide_host`]); `None` when
/// another agent serves it. A forced host (`is_host=true`) that cannot listen is a
/// configuration error. `hostname` is this machine's ([`bind`]); `security` says who the
/// store lets in.
pub async fn host_if_here(
    host: &str,
    port: u16,
    is_host: Option<bool>,
    hostname: &str,
    security: &Security,
) -> Result<Option<StoreServer>, HostError> {
    let (bound, listener) = if is_host == Some(false) {
        (Bind::NotLocal, None)
    } else {
        bind(host, port, hostname).await
    };
    let (decision, why) = decide_host(is_host, &bound);
    match (decision, listener) {
        (Hosting::Serve, Some(listener)) => {
            let server = StoreServer::start(listener, security)?;
            tracing::info!(addr = %server.addr(), why, tls = security.tls.is_some(), password = security.credentials.is_some(), max_connections = crate::listener::Limits::for_the_store().max_connections, "serving the c10d rendezvous store (the job ends if this agent dies; etcd is the resilient choice)");
            if security.is_open() {
                // torchrun's TCPStore is as open; the drop-in promise keeps the default,
                // and this line is the one place the operator learns what it means.
                tracing::warn!(addr = %server.addr(), "the c10d store is open: anyone who can reach this port can read and write the rendezvous, end the run or hijack it; close it by giving every agent the same password (FSDP_ETCD_PASSWORD or --rdzv-conf password_file=PATH; see docs/security.md)");
            }
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
