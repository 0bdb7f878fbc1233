//! How to reach etcd ([`EtcdOptions`]: endpoints, user, TLS, timeouts) and the
//! etcd-client options made of them: URLs with their scheme, and HTTP/2 keep-alive pings
//! patient enough for an etcd that is merely busy.

use std::time::Duration;

use etcd_client::ConnectOptions;

use super::tls::{TlsFiles, tls_options};
use crate::RendezvousError;

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

/// The endpoints as URLs: `http://` or `https://` (with TLS) where none names a scheme.
pub(in crate::etcd) fn urls(opts: &EtcdOptions) -> Vec<String> {
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

/// The etcd-client options of `opts`: connect timeout, keep-alive pings, user, TLS.
pub(in crate::etcd) fn options(opts: &EtcdOptions) -> Result<ConnectOptions, RendezvousError> {
    let mut o = ConnectOptions::new()
        .with_connect_timeout(opts.connect_timeout)
        // A ping unanswered for 2 s said "connection dead" whenever etcd or this machine
        // was merely busy (1,000 agents on two cores at a re-form): hundreds of agents
        // dropped their connections at once and re-read the whole run, the load that made
        // etcd slower still, until most of the agents gave up. A dead connection costs
        // nothing until a lease could expire, and the lease clock, not the connection,
        // decides fencing; so it is given up only after a silence longer than any lease
        // TTL in use.
        .with_keep_alive(PING_EVERY, PING_PATIENCE)
        .with_keep_alive_while_idle(true);
    if let Some((u, p)) = &opts.user {
        o = o.with_user(u.clone(), p.clone());
    }
    if let Some(tls) = &opts.tls {
        o = o.with_tls(tls_options(tls)?);
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
