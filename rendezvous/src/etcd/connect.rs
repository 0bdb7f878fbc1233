//! Connecting to etcd: several endpoints, TLS with a CA and client certificate, user and
//! password, and a bounded retry with backoff.
//!
//! Retries use `backon`: the brief named `backoff`, which is unmaintained
//! (RUSTSEC-2025-0012).

use std::path::PathBuf;
use std::time::Duration;

use backon::Retryable;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use crate::RendezvousError;

/// TLS material, as files.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// How to reach etcd. Its `Debug` hides the password.
#[derive(Clone)]
pub struct EtcdOptions {
    /// `host:port` or `http(s)://host:port`, one or more.
    pub endpoints: Vec<String>,
    pub user: Option<(String, String)>,
    pub tls: Option<TlsFiles>,
    /// Per-attempt connect timeout.
    pub connect_timeout: Duration,
    /// Give up after retrying this long.
    pub retry_window: Duration,
    /// The endpoint is the store a c10d agent serves, not an etcd (for messages).
    pub embedded_store: bool,
}

impl std::fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(u, _)| (u, "***")))
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("retry_window", &self.retry_window)
            .field("embedded_store", &self.embedded_store)
            .finish()
    }
}

impl EtcdOptions {
    /// What the endpoint is, in messages.
    pub fn store_name(&self) -> &'static str {
        if self.embedded_store {
            "the c10d store"
        } else {
            "etcd"
        }
    }

    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            user: None,
            tls: None,
            connect_timeout: Duration::from_secs(2),
            retry_window: Duration::from_secs(30),
            embedded_store: false,
        }
    }
}

fn read(path: &PathBuf, what: &str) -> Result<Vec<u8>, RendezvousError> {
    std::fs::read(path).map_err(|e| {
        RendezvousError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    })
}

pub(super) fn urls(opts: &EtcdOptions) -> Vec<String> {
    let scheme = if opts.tls.is_some() { "https" } else { "http" };
    opts.endpoints
        .iter()
        .map(|e| {
            if e.contains("://") {
                e.clone()
            } else {
                format!("{scheme}://{e}")
            }
        })
        .collect()
}

/// How long an HTTP/2 ping may go unanswered before the connection counts as dead.
const PING_PATIENCE: Duration = Duration::from_secs(10);
/// How often the connection is pinged. Lease keep-alives cross it every TTL/3 anyway; a
/// ping every 2 s was 500 a second on one etcd at 1,000 agents.
const PING_EVERY: Duration = Duration::from_secs(10);

pub(super) fn options(opts: &EtcdOptions) -> Result<ConnectOptions, RendezvousError> {
    let mut o = ConnectOptions::new()
        .with_connect_timeout(opts.connect_timeout)
        // A ping unanswered for 2 s said "connection dead" whenever etcd or this machine
        // was merely busy (1,000 agents on two cores at a re-form): hundreds of agents
        // dropped their connections at once and re-read the whole run, the load that made
        // etcd slower still (issue 30). A dead connection costs nothing until a lease could
        // expire, and the lease clock, not the connection, decides fencing; so it is given
        // up only after a silence longer than any lease TTL in use.
        .with_keep_alive(PING_EVERY, PING_PATIENCE)
        .with_keep_alive_while_idle(true);
    if let Some((u, p)) = &opts.user {
        o = o.with_user(u.clone(), p.clone());
    }
    if let Some(tls) = &opts.tls {
        let mut t = TlsOptions::new();
        if let Some(ca) = &tls.ca {
            t = t.ca_certificate(Certificate::from_pem(read(ca, "CA certificate")?));
        }
        match (&tls.cert, &tls.key) {
            (Some(c), Some(k)) => {
                t = t.identity(Identity::from_pem(
                    read(c, "client certificate")?,
                    read(k, "client key")?,
                ))
            }
            (None, None) => {}
            _ => {
                return Err(RendezvousError::InvalidConfig(
                    "a client certificate needs both ssl_cert and ssl_cert_key".into(),
                ));
            }
        }
        o = o.with_tls(t);
    }
    Ok(o)
}

/// The error of an op that etcd did not answer within `patience` (the driver's deadline):
/// a transient failure, and a sign that the connection itself is wedged.
pub(crate) fn unanswered(patience: std::time::Duration) -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        Unanswered(patience),
    ))
}

/// Whether `e` is [`unanswered`]'s: requests on that connection may never return, so the
/// session reconnects on a fresh one, even to the same endpoint.
pub(crate) fn is_unanswered(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::IoError(io) if io.get_ref().is_some_and(|r| r.is::<Unanswered>()))
}

#[derive(Debug)]
struct Unanswered(std::time::Duration);

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd did not answer within {:?}", self.0)
    }
}

impl std::error::Error for Unanswered {}

/// Whether an error can go away by itself (etcd starting, a network blip) as opposed to a
/// configuration problem that retrying cannot fix. Decided by the error's kind and gRPC
/// code, never its text: a malformed endpoint or a refused credential fails at once
/// instead of being retried for the whole window as if etcd were down.
pub fn transient(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        // The request never left: the endpoint, an argument or a header is malformed.
        E::InvalidArgs(_)
        | E::InvalidUri(_)
        | E::InvalidMetadataValue(_)
        | E::EndpointError(_)
        | E::EndpointsNotManaged
        | E::Utf8Error(_) => false,
        // etcd answered and said no: bad user or password (InvalidArgument), credentials
        // given to an etcd without auth (FailedPrecondition), missing rights.
        E::GRpcStatus(s) => {
            !matches!(
                s.code(),
                Code::InvalidArgument
                    | Code::FailedPrecondition
                    | Code::PermissionDenied
                    | Code::Unauthenticated
                    | Code::Unimplemented
                    | Code::OutOfRange
            ) && !tls_refused(s)
        }
        E::TransportError(t) => !tls_refused(t),
        E::IoError(io) => !tls_refused(io),
        // Connecting and everything else: possibly a server still starting.
        _ => true,
    }
}

/// Whether etcd answered that it is too busy for the request, on a connection that
/// works: a proposal or a linearizable read that timed out inside the server ("request
/// timed out", "waiting for the applied index took too long"), or its request limiter
/// ("too many requests"). The gRPC code (Unavailable, ResourceExhausted) is shared with a
/// connection that failed, so etcd's own error descriptions decide, as etcd's Go client
/// decides them (its rpctypes match the same descriptions). Such an answer is no reason
/// to drop the watches and read the run again: that is load added exactly when etcd is
/// slowest (the collapse of issue 30); the request is sent again later instead.
pub fn overloaded(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    let said = s.message();
    // The limiter's answer reaches etcd-client with the code Unknown (seen at 4,000
    // joining nodes), not ResourceExhausted: its description alone decides.
    // Not "request timed out, possibly due to previous leader failure" nor "…connection
    // lost": those are a member without its leader, where another member is the way on.
    said == "etcdserver: too many requests"
        || (s.code() == Code::Unavailable
            && matches!(
                said,
                "etcdserver: request timed out"
                    | "etcdserver: request timed out, waiting for the applied index took too long"
            ))
}

/// Whether etcd refused a request for its size: over `--max-request-bytes` (1.5 MiB by
/// default) etcd says so itself, and over that plus its gRPC margin (512 KiB) gRPC does.
/// Sending it again cannot help.
pub(crate) fn too_large(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    match s.code() {
        Code::InvalidArgument => s.message() == "etcdserver: request is too large",
        Code::ResourceExhausted => s
            .message()
            .starts_with("grpc: received message larger than max"),
        _ => false,
    }
}

/// A TLS handshake that failed on its content (a certificate refused by either side, or
/// TLS spoken to a plaintext server): rustls reports it as an `InvalidData` I/O error
/// somewhere down the error's source chain.
fn tls_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// Connects and checks the connection with one read, retrying transient failures with
/// exponential backoff and jitter for at most `retry_window`.
pub async fn connect(opts: &EtcdOptions) -> Result<Client, RendezvousError> {
    if opts.endpoints.is_empty() {
        return Err(RendezvousError::InvalidConfig(
            "no etcd endpoint given (--rdzv-endpoint host:2379)".into(),
        ));
    }
    let urls = urls(opts);
    let connect_opts = options(opts)?;
    // One endpoint at a time, in the order given: the client is pinned to the first that
    // answers (a client balanced over several kept sending to a dead member), and the
    // session picks another when that one fails ([`pick`]).
    let attempt = || {
        let urls = urls.clone();
        let o = connect_opts.clone();
        async move {
            let mut last = None;
            for url in urls {
                let one = async {
                    let mut client = Client::connect([url], Some(o.clone())).await?;
                    // The channel connects lazily; one read proves etcd answers.
                    client
                        .get("/", Some(etcd_client::GetOptions::new().with_count_only()))
                        .await?;
                    Ok::<_, etcd_client::Error>(client)
                };
                match one.await {
                    Ok(client) => return Ok(client),
                    Err(e) if !transient(&e) => return Err(e),
                    Err(e) => last = Some(e),
                }
            }
            Err(last.unwrap_or(etcd_client::Error::EndpointsNotManaged))
        }
    };
    let backoff = join_backoff(opts.retry_window);
    let retried = std::sync::atomic::AtomicBool::new(false);
    let torchrun = std::sync::Mutex::new(None);
    // A c10d store that does not answer may be torchrun's TCPStore: its host runs torchrun,
    // and no retry would help.
    let attempt = || async {
        let e = match attempt().await {
            Ok(client) => return Ok(client),
            Err(e) => e,
        };
        if opts.embedded_store && transient(&e) {
            if let Some(found) = torchrun_store(&opts.endpoints).await {
                *torchrun.lock().expect("not poisoned") = Some(found);
                return Err(etcd_client::Error::EndpointsNotManaged);
            }
        }
        Err(e)
    };
    let began = std::time::Instant::now();
    // A TCPStore already at the endpoint fails the job now rather than after a gRPC attempt
    // it would leave hanging (our own store closes the probe at its first bytes).
    if opts.embedded_store {
        if let Some(endpoint) = torchrun_store(&opts.endpoints).await {
            return Err(torchrun_peer(&endpoint));
        }
    }
    let mut said = Repeats::new(opts, began);
    let connected = attempt
        .retry(backoff)
        .when(transient)
        .notify(|e, _| {
            retried.store(true, std::sync::atomic::Ordering::Relaxed);
            said.failed(e);
        })
        .await;
    if let Some(endpoint) = torchrun.lock().expect("not poisoned").take() {
        return Err(torchrun_peer(&endpoint));
    }
    connected.map_err(|error| RendezvousError::Unreachable {
        store: opts.store_name(),
        endpoints: opts.endpoints.join(","),
        spent: began.elapsed(),
        check: what_to_check(opts),
        retried: retried.load(std::sync::atomic::Ordering::Relaxed),
        error,
    })
}

/// The retries of what an agent asks at start: from 100 ms with jitter, doubling up to
/// 2 s, for at most `window`.
fn join_backoff(window: Duration) -> backon::ExponentialBuilder {
    crate::backoff::exponential(Duration::from_millis(100), Duration::from_secs(2))
        .with_jitter()
        .with_max_times(10_000)
        .with_total_delay(Some(window))
}

/// Runs `op` again while etcd answers that it is overloaded ([`overloaded`]), backing off
/// with jitter, for at most `window`. What an agent asks once at join (the nesting check,
/// its lease) must not end it because thousands of others joined in the same second:
/// `rdzv-bench --nodes 10000` lost nodes to one "request timed out" at their lease grant.
/// Both are safe to send twice (reads, and a grant that only leaves a lease to expire).
pub(crate) async fn while_overloaded<T, F, Fut>(
    window: Duration,
    op: F,
) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    op.retry(join_backoff(window))
        .when(overloaded)
        .notify(|e, wait| tracing::debug!(error = %e, ?wait, "etcd is overloaded; asking again"))
        .await
}

/// How often a store that stays unreachable is said to be, after the first time.
const SAY_AGAIN: Duration = Duration::from_secs(10);

/// The log lines of a connection being retried: the first failure, then one line every
/// [`SAY_AGAIN`] with the tries so far, each with its cause in a few words.
struct Repeats<'a> {
    opts: &'a EtcdOptions,
    began: std::time::Instant,
    tries: u32,
    said_at: Option<std::time::Instant>,
}

impl<'a> Repeats<'a> {
    fn new(opts: &'a EtcdOptions, began: std::time::Instant) -> Self {
        Self {
            opts,
            began,
            tries: 0,
            said_at: None,
        }
    }

    fn failed(&mut self, e: &etcd_client::Error) {
        self.tries += 1;
        let now = std::time::Instant::now();
        let (store, at) = (self.opts.store_name(), self.opts.endpoints.join(","));
        match self.said_at {
            None => tracing::warn!(
                "{store} at {at} is not reachable ({}); retrying for up to {:?}",
                short_cause(e),
                self.opts.retry_window
            ),
            Some(last) if now - last >= SAY_AGAIN => tracing::warn!(
                "{store} at {at} still unreachable after {}s, {} tries ({})",
                (now - self.began).as_secs(),
                self.tries,
                short_cause(e)
            ),
            Some(_) => return,
        }
        self.said_at = Some(now);
    }
}

/// An etcd client error in a few words: the innermost I/O error ("Connection refused")
/// where there is one, else the gRPC status' message, else its own text cut short. Its
/// own text nests every layer (hundreds of characters of debug output).
pub fn short_cause(e: &etcd_client::Error) -> String {
    use std::error::Error as _;
    let mut io = None;
    // etcd-client's error names no source: start from the status' or transport's own.
    let mut next: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(s) => s.source().map(|s| s as _),
        etcd_client::Error::TransportError(t) => Some(t),
        etcd_client::Error::IoError(io) => Some(io),
        _ => None,
    };
    while let Some(err) = next {
        if let Some(found) = err.downcast_ref::<std::io::Error>() {
            io = Some(found.to_string());
        }
        next = err.source();
    }
    if let Some(io) = io {
        // "Connection refused (os error 111)": the number adds nothing for a person.
        return io.split(" (os error").next().unwrap_or(&io).to_owned();
    }
    let text = match e {
        etcd_client::Error::GRpcStatus(s) => s.message().to_owned(),
        other => other.to_string(),
    };
    match text.char_indices().nth(160) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// What a person should look at when the store does not answer: only what applies.
fn what_to_check(opts: &EtcdOptions) -> String {
    let mut check = vec!["--rdzv-endpoint"];
    if opts.embedded_store {
        check.push("that the agent on the endpoint's machine (which serves the store) is running");
    }
    if opts.tls.is_some() {
        check.push("the TLS files");
    }
    if opts.user.is_some() {
        check.push("the user and password");
    }
    let last = check.pop().expect("one at least");
    if check.is_empty() {
        format!("check {last}")
    } else {
        format!("check {} and {last}", check.join(", "))
    }
}

fn torchrun_peer(endpoint: &str) -> RendezvousError {
    RendezvousError::TorchrunPeer(format!(
        "the c10d store at {endpoint} is torchrun's TCPStore: {}",
        fsdp_store::tcpstore::SAME_LAUNCHER
    ))
}

/// The first endpoint where a TCPStore answers, if any.
async fn torchrun_store(endpoints: &[String]) -> Option<String> {
    for endpoint in endpoints {
        let Some((host, port)) = host_and_port(endpoint) else {
            continue;
        };
        let found = fsdp_store::tcpstore::probe(&host, port, Duration::from_secs(1)).await;
        if matches!(found, fsdp_store::tcpstore::Found::TcpStore { .. }) {
            return Some(endpoint.clone());
        }
    }
    None
}

/// `host` and `port` of an endpoint (`host:port`, `scheme://host:port`, `[v6]:port`).
fn host_and_port(endpoint: &str) -> Option<(String, u16)> {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let rest = rest.split('/').next()?;
    let (host, port) = rest.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

/// A client pinned to the first endpoint (in the order given) whose member answers within
/// `patience` and knows a leader, else to the first that answers at all; `None` when none
/// answers. All are asked at once.
pub async fn pick(opts: &EtcdOptions, patience: Duration) -> Option<Client> {
    let o = options(opts).ok()?;
    let tries = urls(opts)
        .into_iter()
        .map(|url| ask_member(url, o.clone(), patience));
    let answers: Vec<(Client, bool)> = futures::future::join_all(tries)
        .await
        .into_iter()
        .flatten()
        .collect();
    let led = answers.iter().position(|(_, led)| *led).unwrap_or(0);
    answers.into_iter().nth(led).map(|(client, _)| client)
}

/// A client pinned to the member at `url`, and whether that member knows a leader (its
/// status answer); `None` when it does not answer within `patience`.
pub(super) async fn ask_member(
    url: String,
    o: ConnectOptions,
    patience: Duration,
) -> Option<(Client, bool)> {
    let ask = async {
        let mut client = Client::connect([url], Some(o)).await.ok()?;
        let led = client.status().await.ok()?.leader() != 0;
        Some((client, led))
    };
    tokio::time::timeout(patience, ask).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::Error as E;
    use tonic::Status;

    /// An op that etcd answers "request timed out" `busy` times, then answers; and how
    /// many times it was sent.
    fn answered_after(
        busy: usize,
        other: Option<E>,
    ) -> (
        impl FnMut() -> std::future::Ready<Result<u32, E>>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        let mut other = other;
        let op = move || {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::future::ready(match other.take() {
                Some(e) => Err(e),
                None if n < busy => Err(E::GRpcStatus(Status::unavailable(
                    "etcdserver: request timed out",
                ))),
                None => Ok(7),
            })
        };
        (op, sent)
    }

    #[tokio::test]
    async fn a_join_request_etcd_is_too_busy_for_is_sent_again() {
        let (op, sent) = answered_after(2, None);
        let got = while_overloaded(Duration::from_secs(30), op).await;
        assert_eq!(got.unwrap(), 7);
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn any_other_failure_is_the_answer_at_once() {
        let (op, sent) = answered_after(0, Some(E::GRpcStatus(Status::permission_denied("no"))));
        assert!(while_overloaded(Duration::from_secs(30), op).await.is_err());
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_etcd_busy_past_the_window_is_the_answer() {
        let (op, sent) = answered_after(usize::MAX, None);
        let began = std::time::Instant::now();
        let got = while_overloaded(Duration::from_millis(500), op).await;
        assert!(got.as_ref().is_err_and(overloaded), "{got:?}");
        assert!(began.elapsed() < Duration::from_secs(5));
        assert!(sent.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    }

    #[test]
    fn a_request_over_etcds_size_limit_is_told_from_other_refusals() {
        let big = E::GRpcStatus(Status::invalid_argument("etcdserver: request is too large"));
        let bigger = E::GRpcStatus(Status::resource_exhausted(
            "grpc: received message larger than max (2700000 vs. 2097152)",
        ));
        assert!(too_large(&big) && too_large(&bigger));
        for other in [
            E::GRpcStatus(Status::invalid_argument("etcdserver: key is not provided")),
            E::GRpcStatus(Status::unavailable("etcdserver: request timed out")),
            E::GRpcStatus(Status::resource_exhausted(
                "etcdserver: mvcc: database space exceeded",
            )),
        ] {
            assert!(!too_large(&other), "{other}");
        }
    }

    #[test]
    fn debug_hides_the_password() {
        let mut o = EtcdOptions::new(vec!["e:2379".into()]);
        o.user = Some(("root".into(), "s3cret".into()));
        let shown = format!("{o:?}");
        assert!(
            shown.contains("root") && !shown.contains("s3cret"),
            "{shown}"
        );
    }

    #[test]
    fn configuration_errors_are_permanent_and_outages_transient() {
        for permanent in [
            E::InvalidArgs("x".into()),
            E::EndpointError("x".into()),
            E::GRpcStatus(Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            )),
            E::GRpcStatus(Status::invalid_argument("etcdserver: user name is empty")),
            E::GRpcStatus(Status::failed_precondition(
                "etcdserver: authentication is not enabled",
            )),
            E::GRpcStatus(Status::permission_denied("etcdserver: permission denied")),
            E::GRpcStatus(Status::unauthenticated("etcdserver: invalid auth token")),
            // What a refused client certificate looks like: a rustls alert under the status.
            E::GRpcStatus(Status::from_error(Box::new(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "received fatal alert: BadCertificate",
            )))),
        ] {
            assert!(!transient(&permanent), "{permanent}");
        }
        for passing in [
            E::GRpcStatus(Status::unavailable("etcdserver: leader changed")),
            E::GRpcStatus(Status::deadline_exceeded("etcdserver: request timed out")),
            E::GRpcStatus(Status::unknown("transport error")),
            E::IoError(std::io::ErrorKind::ConnectionRefused.into()),
        ] {
            assert!(transient(&passing), "{passing}");
        }
    }

    /// What configuration checks would catch, reached here directly: refused at once, not
    /// retried for the whole window, and the error does not claim it was.
    #[tokio::test]
    async fn a_malformed_endpoint_is_not_retried() {
        for endpoint in ["a b c", "ét.cd:2379"] {
            let mut opts = EtcdOptions::new(vec![endpoint.into()]);
            opts.retry_window = Duration::from_secs(20);
            let start = std::time::Instant::now();
            let err = connect(&opts).await.err().expect("no client");
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{endpoint}: retried for {:?}: {err}",
                start.elapsed()
            );
            let said = err.to_string();
            assert!(
                !said.contains("retried for") && said.contains("first attempt"),
                "{endpoint}: {said}"
            );
        }
    }

    /// A port where nothing listens is an outage, retried: the error says for how long.
    #[tokio::test]
    async fn an_outage_is_retried_and_says_so() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let mut opts = EtcdOptions::new(vec![addr.to_string()]);
        opts.retry_window = Duration::from_millis(500);
        let said = connect(&opts).await.err().expect("no client").to_string();
        assert!(said.contains("retried for "), "{said}");
        // The time it took, not the window: each attempt also waits to connect.
        let spent = said.split("retried for ").nth(1).unwrap();
        assert!(!spent.starts_with("0ns"), "{said}");
        // Only the causes that apply: no TLS, no password here.
        assert!(said.ends_with("check --rdzv-endpoint"), "{said}");
    }

    #[test]
    fn the_hint_names_only_what_is_configured() {
        let mut o = EtcdOptions::new(vec!["e:2379".into()]);
        assert_eq!(what_to_check(&o), "check --rdzv-endpoint");
        o.embedded_store = true;
        o.user = Some(("u".into(), "p".into()));
        let said = what_to_check(&o);
        assert!(said.contains("agent on the endpoint's machine"), "{said}");
        assert!(said.ends_with("and the user and password"), "{said}");
        assert!(!said.contains("TLS"), "{said}");
    }

    #[test]
    fn endpoints_give_their_host_and_port() {
        for (e, host, port) in [
            ("node0:29400", "node0", 29400),
            ("http://10.0.0.1:2379", "10.0.0.1", 2379),
            ("[::1]:29400", "::1", 29400),
        ] {
            assert_eq!(host_and_port(e), Some((host.into(), port)), "{e}");
        }
        assert_eq!(host_and_port("node0"), None);
    }
}
