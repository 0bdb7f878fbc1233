//! Connecting to etcd: several endpoints, TLS with a CA and client certificate, user and
//! password, and a bounded retry with backoff.
//!
//! Retries use `backon`: the brief named `backoff`, which is unmaintained
//! (RUSTSEC-2025-0012).

use std::path::PathBuf;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use crate::RendezvousError;

/// TLS material, as files.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// `host:port` or `http(s)://host:port`, one or more.
    pub endpoints: Vec<String>,
    pub user: Option<(String, String)>,
    pub tls: Option<TlsFiles>,
    /// Per-attempt connect timeout.
    pub connect_timeout: Duration,
    /// Give up after retrying this long.
    pub retry_window: Duration,
}

impl EtcdOptions {
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            user: None,
            tls: None,
            connect_timeout: Duration::from_secs(2),
            retry_window: Duration::from_secs(30),
        }
    }
}

fn read(path: &PathBuf, what: &str) -> Result<Vec<u8>, RendezvousError> {
    std::fs::read(path).map_err(|e| {
        RendezvousError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    })
}

fn urls(opts: &EtcdOptions) -> Vec<String> {
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

fn options(opts: &EtcdOptions) -> Result<ConnectOptions, RendezvousError> {
    let mut o = ConnectOptions::new()
        .with_connect_timeout(opts.connect_timeout)
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
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

/// Whether an error can go away by itself (etcd starting, a network blip) as opposed to a
/// configuration problem that retrying cannot fix.
fn transient(e: &etcd_client::Error) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    !(text.contains("authentication failed")
        || text.contains("invalid auth")
        || text.contains("permission denied")
        || text.contains("certificate")
        || text.contains("user name is empty"))
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
    let attempt = || {
        let urls = urls.clone();
        let o = connect_opts.clone();
        async move {
            let mut client = Client::connect(&urls, Some(o)).await?;
            // The channel connects lazily; one read proves etcd answers.
            client
                .get("/", Some(etcd_client::GetOptions::new().with_count_only()))
                .await?;
            Ok::<_, etcd_client::Error>(client)
        }
    };
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
        .with_jitter()
        .with_max_times(10_000)
        .with_total_delay(Some(opts.retry_window));
    attempt
        .retry(backoff)
        .when(transient)
        .notify(|e, delay| tracing::warn!(error = %e, retry_in = ?delay, "etcd not reachable yet"))
        .await
        .map_err(|source| RendezvousError::Unreachable {
            endpoints: opts.endpoints.join(","),
            window: opts.retry_window,
            source,
        })
}
