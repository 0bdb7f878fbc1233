//! Who serves the store: torchrun's "who hosts" rule as a pure function of what binding
//! the endpoint found ([`decide_host`]), the binding itself ([`bind`]), and the two
//! together ([`host_if_here`]), with the [`Standby`] of an agent that found the port taken
//! on its own machine.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

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
    /// The port is taken on this machine: another agent of the job got there first, or a
    /// previous agent's process is not gone yet.
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
    /// Connect, and serve should the port be freed ([`Standby`]): it was taken on this
    /// machine, where the holder may be a previous agent that is still dying rather than
    /// the job's host.
    StandBy,
    /// `is_host=true` was asked for and cannot be honoured.
    Refuse,
}

/// torchrun's rule: with `is_host` unset, the agent whose machine has the endpoint's
/// address serves, and when several agents match, the first to bind serves and the others
/// connect; `is_host` set forces the choice, and a forced host that cannot listen is an
/// error. One that finds the port taken on its own machine stands by: the holder may be
/// its own predecessor, still dying, and then nobody would serve once it is gone. Returns
/// the decision and why, in words for the log.
pub fn decide_host(is_host: Option<bool>, bind: &Bind) -> (Hosting, String) {
    match (is_host, bind) {
        (Some(false), _) => (Hosting::Connect, "is_host=false".into()),
        (_, Bind::Bound(addr)) => (
            Hosting::Serve,
            format!("this machine has {addr} and the port was free"),
        ),
        (None, Bind::InUse(addr)) => (
            Hosting::StandBy,
            format!(
                "{addr} is taken on this machine: another agent serves it (the first to bind serves); this agent stands by to serve it should the port be freed"
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
        match bind_one(addr).await {
            bound @ (Bind::Bound(_), Some(_)) => return bound,
            (Bind::Failed(e), _) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {}
            (Bind::Failed(e), _) if !matches!(outcome, Bind::NotLocal) => drop(e),
            (found, _) => outcome = found,
        }
    }
    (outcome, None)
}

/// Tries to listen on `addr` alone: bound, in use, or failed otherwise.
async fn bind_one(addr: SocketAddr) -> (Bind, Option<TcpListener>) {
    match TcpListener::bind(addr).await {
        Ok(l) => (Bind::Bound(l.local_addr().unwrap_or(addr)), Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => (Bind::InUse(addr), None),
        Err(e) => (Bind::Failed(e), None),
    }
}

/// The store as this agent has it ([`host_if_here`]).
pub enum Hosted {
    /// This agent serves it.
    Serving(StoreServer),
    /// Another agent on this machine holds the port; this one serves should it be freed.
    Standby(Standby),
    /// Another machine serves it, or `is_host=false`.
    Elsewhere,
}

impl Hosted {
    /// Becomes the address of the first torchrun client of the store this agent serves
    /// ([`StoreServer::torchrun_clients`]), now or once its standby took over; `None` when
    /// it never will serve.
    pub fn torchrun_clients(&self) -> Option<watch::Receiver<Option<IpAddr>>> {
        match self {
            Hosted::Serving(s) => Some(s.torchrun_clients()),
            Hosted::Standby(s) => Some(s.torchrun.clone()),
            Hosted::Elsewhere => None,
        }
    }

    /// Set once this agent's standby took over the port and serves the store (a store as
    /// fresh as one it started); `None` unless it stands by.
    pub fn taken_over(&self) -> Option<Arc<AtomicBool>> {
        match self {
            Hosted::Standby(s) => Some(s.took_over.clone()),
            _ => None,
        }
    }

    /// Called once this agent's client has reached a store that answers: a standby that has
    /// not taken over ends, since the port's holder is then a live host, not a predecessor
    /// dying. That host's death later ends the job as any c10d host's does; another agent
    /// of its machine serving an empty store in its place would only hide it.
    pub async fn joined(self) -> Hosted {
        match self {
            Hosted::Standby(s) => match s.stop().await {
                Some(server) => Hosted::Serving(server),
                None => {
                    tracing::debug!("the c10d store answered: the standby ends");
                    Hosted::Elsewhere
                }
            },
            other => other,
        }
    }

    /// The store this agent serves, from the start or since its standby took over, to be
    /// closed as a host closes it. Ends a standby still waiting: when the run is over, a
    /// port freed by the host's own closing must not become a store nobody will use.
    pub async fn into_served(self) -> Option<StoreServer> {
        match self {
            Hosted::Serving(s) => Some(s),
            Hosted::Standby(s) => s.stop().await,
            Hosted::Elsewhere => None,
        }
    }
}

/// The first pause of a [`Standby`] between binds: a predecessor that dies in a moment is
/// replaced in a moment.
const STANDBY_FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest: one that lingers (D state) costs a failed bind a second.
const STANDBY_MAX_PAUSE: Duration = Duration::from_secs(1);

/// The pause after `pause` between a [`Standby`]'s binds: twice as long, at most
/// [`STANDBY_MAX_PAUSE`].
fn next_standby_pause(pause: Duration) -> Duration {
    (pause * 2).min(STANDBY_MAX_PAUSE)
}

/// An agent that found the endpoint's port taken on its own machine keeps trying to bind
/// it until its client reaches a store that answers ([`Hosted::joined`]), and once it
/// binds, serves the store there for the rest of its life. The port may have been held by
/// this agent's own predecessor, still dying (a host restarted in place, its SIGKILLed
/// process not yet gone or stuck on a hung mount): without a second look nobody would
/// serve once it went. Two agents standing by on one machine race for the bind and one
/// wins: torchrun's first-to-bind rule, applied again.
///
/// The look is a bind, not a connection: a failed bind touches nobody, and a listener left
/// in a hung process accepts connections it never answers.
pub struct Standby {
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Option<StoreServer>>>,
    torchrun: watch::Receiver<Option<IpAddr>>,
    /// Set once it took over and serves.
    took_over: Arc<AtomicBool>,
}

impl Standby {
    /// Stands by for `addr`, the address whose port was found taken.
    fn start(addr: SocketAddr, security: Security) -> Self {
        let (stop, stopped) = oneshot::channel();
        let (seen, torchrun) = watch::channel(None);
        let took_over = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(stand_by(addr, security, stopped, seen, took_over.clone()));
        Self {
            stop: Some(stop),
            task: Some(task),
            torchrun,
            took_over,
        }
    }

    /// Ends the standby: the store it serves if it took over.
    pub async fn stop(mut self) -> Option<StoreServer> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.take()?.await.ok().flatten()
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        // A store it took over goes with it, as a host's goes with its StoreServer.
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Binds `addr` once the port is free and serves the store there; `None` when stopped
/// first. `seen` is the sender behind the receiver the rendezvous was given.
async fn stand_by(
    addr: SocketAddr,
    security: Security,
    mut stopped: oneshot::Receiver<()>,
    seen: watch::Sender<Option<IpAddr>>,
    took_over: Arc<AtomicBool>,
) -> Option<StoreServer> {
    let mut pause = STANDBY_FIRST_PAUSE;
    let listener = loop {
        tokio::select! {
            _ = &mut stopped => return None,
            () = tokio::time::sleep(pause) => {}
        }
        pause = next_standby_pause(pause);
        let (bound, listener) = bind_one(addr).await;
        match (decide_host(None, &bound), listener) {
            ((Hosting::Serve, _), Some(listener)) => break listener,
            ((_, why), _) => tracing::trace!(%addr, why, "the c10d standby goes on standing by"),
        }
    };
    let why = format!(
        "{addr} was taken on this machine when this agent started, by another agent or by a previous agent not yet gone, and nobody holds it now: the first to bind serves"
    );
    tracing::info!(%addr, why, "the c10d standby takes over: this agent serves the rendezvous store from now on");
    let limits = crate::bounded_listener::Limits::for_the_store();
    let server = StoreServer::start_reporting(listener, &security, limits, seen);
    match server {
        Ok(server) => {
            announce(&server, &security, "the standby took over the free port");
            took_over.store(true, Ordering::Release);
            Some(server)
        }
        Err(e) => {
            tracing::error!(%addr, error = %e, "the c10d standby cannot serve the store; this agent only connects");
            None
        }
    }
}

/// Says in the log that this agent serves the store, and how open it is.
fn announce(server: &StoreServer, security: &Security, why: &str) {
    tracing::info!(addr = %server.addr(), why, tls = security.tls.is_some(), password = security.credentials.is_some(), max_connections = crate::bounded_listener::Limits::for_the_store().max_connections, "serving the c10d rendezvous store (the job ends if this agent dies; etcd is the resilient choice)");
    if security.is_open() {
        // torchrun's TCPStore is as open; the drop-in promise keeps the default,
        // and this line is the one place the operator learns what it means.
        tracing::warn!(addr = %server.addr(), "the c10d store is open: anyone who can reach this port can read and write the rendezvous, end the run or hijack it; close it by giving every agent the same password (FSDP_ETCD_PASSWORD or --rdzv-conf password_file=PATH; see docs/security.md)");
    }
}

/// Serves the store here when this agent is its host ([`decide_host`]), or stands by to
/// serve it when the port was taken on this machine ([`Standby`]). A forced host
/// (`is_host=true`) that cannot listen is a configuration error. `hostname` is this
/// machine's ([`bind`]); `security` says who the store lets in.
pub async fn host_if_here(
    host: &str,
    port: u16,
    is_host: Option<bool>,
    hostname: &str,
    security: &Security,
) -> Result<Hosted, HostError> {
    let (bound, listener) = if is_host == Some(false) {
        (Bind::NotLocal, None)
    } else {
        bind(host, port, hostname).await
    };
    let (decision, why) = decide_host(is_host, &bound);
    match (decision, listener, bound) {
        (Hosting::Serve, Some(listener), _) => {
            let server = StoreServer::start(listener, security)?;
            announce(&server, security, &why);
            Ok(Hosted::Serving(server))
        }
        (Hosting::Refuse, _, _) => Err(HostError::Refused(why)),
        (decision, _, bound) => {
            tracing::info!(endpoint = %format!("{host}:{port}"), why, "the c10d rendezvous store is served by another agent");
            match (decision, bound) {
                (Hosting::StandBy, Bind::InUse(addr)) => {
                    Ok(Hosted::Standby(Standby::start(addr, security.clone())))
                }
                _ => Ok(Hosted::Elsewhere),
            }
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
        assert_eq!(decide_host(None, &in_use()).0, Hosting::StandBy);
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

    #[test]
    fn an_agent_that_finds_the_port_taken_here_stands_by_unless_told_otherwise() {
        let (d, why) = decide_host(None, &in_use());
        assert_eq!(d, Hosting::StandBy);
        assert!(why.contains("stands by"), "{why}");
        // Told it does not host, or the endpoint is elsewhere: nothing to stand by for.
        assert_eq!(decide_host(Some(false), &in_use()).0, Hosting::Connect);
        assert_eq!(decide_host(None, &Bind::NotLocal).0, Hosting::Connect);
    }

    #[test]
    fn the_standby_looks_again_soon_then_once_a_second() {
        let ms = Duration::from_millis;
        let mut pause = STANDBY_FIRST_PAUSE;
        let mut pauses = vec![pause];
        for _ in 0..5 {
            pause = next_standby_pause(pause);
            pauses.push(pause);
        }
        assert_eq!(
            pauses,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
    }

    /// Whether something listens on 127.0.0.1:`port` (a standby took over).
    async fn listening(port: u16) -> bool {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_port_freed_here_is_served_by_exactly_one_of_the_agents_standing_by() {
        use tokio::io::AsyncWriteExt;

        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = holder.local_addr().unwrap().port();
        let open = Security::default();
        let mut standbys = Vec::new();
        for _ in 0..3 {
            let hosted = host_if_here("127.0.0.1", port, None, "", &open)
                .await
                .unwrap();
            assert!(matches!(hosted, Hosted::Standby(_)));
            // What the rendezvous is given before anyone serves.
            let torchrun = hosted.torchrun_clients().unwrap();
            standbys.push((hosted, torchrun));
        }
        // One whose client reached the holder's store ends its standby: it serves
        // nothing, then or later.
        let (joined, _) = standbys.pop().unwrap();
        assert!(matches!(joined.joined().await, Hosted::Elsewhere));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(listening(port).await, "the holder listens");

        drop(holder);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !listening(port).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no standby took over the freed port"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut served = Vec::new();
        let mut flags = 0;
        for (hosted, torchrun) in standbys {
            let taken_over = hosted.taken_over().unwrap();
            let flagged = taken_over.load(Ordering::Acquire);
            if let Hosted::Serving(server) = hosted.joined().await {
                assert!(flagged, "the one serving says it took over");
                served.push((server, torchrun));
            }
            flags += usize::from(flagged);
        }
        assert_eq!(flags, 1, "only the one that took over says so");
        assert_eq!(served.len(), 1, "two agents served one port");
        let (server, mut torchrun) = served.pop().unwrap();
        assert_eq!(server.addr().port(), port);

        // A torchrun client of the store taken over reaches the receiver handed out
        // before: VALIDATE with TCPStore's magic, then PING with a pid.
        let mut hello = vec![0u8];
        hello.extend(0x3C85_F7CEu32.to_le_bytes());
        hello.push(13);
        hello.extend(31_337u32.to_le_bytes());
        let mut client = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        client.write_all(&hello).await.unwrap();
        let seen =
            tokio::time::timeout(Duration::from_secs(10), torchrun.wait_for(Option::is_some))
                .await
                .expect("the torchrun client went unseen")
                .map(|ip| *ip)
                .unwrap();
        assert_eq!(seen, Some(IpAddr::from([127, 0, 0, 1])));

        let server = Hosted::Serving(server).into_served().await.unwrap();
        server.close(Duration::ZERO).await;
        assert!(!listening(port).await, "the store outlived its close");
    }
}
