//! Connecting to etcd: several endpoints, TLS with a CA and client certificate, user and
//! password, and a bounded retry with backoff. Its parts:
//!
//! * `options.rs` — how to reach etcd, and the etcd-client options made of it;
//! * `tls.rs` — the TLS material, read from files;
//! * `retry.rs` — the backoff, requests sent again while etcd is overloaded, and the log
//!   lines of a connection being retried;
//! * `torchrun.rs` — telling torchrun's TCPStore at a c10d endpoint;
//! * `pick.rs` — choosing the member to talk to.
//!
//! Retries use `backon`, not the `backoff` crate, which is unmaintained
//! (RUSTSEC-2025-0012).

mod options;
mod pick;
mod retry;
mod tls;
mod torchrun;

use backon::Retryable;
use etcd_client::{Client, ConnectOptions};

pub use options::EtcdOptions;
pub(super) use options::{options, urls};
pub(super) use pick::ask_member;
pub use pick::pick;
pub(crate) use retry::while_overloaded;
pub use tls::TlsFiles;

use super::errors::transient;
use crate::RendezvousError;
use retry::{Repeats, join_backoff};
use torchrun::{torchrun_peer, torchrun_store};

/// The largest answer a read or a watch takes from etcd: its own Go client's limit
/// (2 GiB). gRPC's default, 4 MiB, was passed by a 20,000-node run's whole read (every
/// registration and the placed round's shards, ~5 MB): each read failed as "decoded
/// message length too large", the coordinator read again for ever, and the crowd stalled
/// at the seal. So do the nesting check's read of the control keys (a run's `done/`
/// records while it ends) and a watch opened at an older revision, whose first answers
/// batch the events since.
const LARGEST_ANSWER: usize = i32::MAX as usize;

/// A key-value client on `client`'s connection (its token included) that takes answers
/// up to [`LARGEST_ANSWER`].
pub fn reader(client: &Client) -> etcd_client::KvClient {
    client.kv_client().max_decoding_message_size(LARGEST_ANSWER)
}

/// A watch client on `client`'s connection that takes events up to [`LARGEST_ANSWER`].
pub fn watcher(client: &Client) -> etcd_client::WatchClient {
    client
        .watch_client()
        .max_decoding_message_size(LARGEST_ANSWER)
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
    let several = urls.len() > 1;
    // One endpoint at a time, in the order given: the client is pinned to the first that
    // answers (a client balanced over several kept sending to a dead member), and the
    // session picks another when that one fails ([`pick`]).
    let attempt = || {
        let urls = urls.clone();
        let o = connect_opts.clone();
        async move {
            let mut last = None;
            for url in urls {
                let one = first_read(url, o.clone(), several.then_some(opts.connect_timeout * 3));
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

/// A client for `url` once one read shows that its member answers with a leader behind
/// it (the channel connects lazily; the read is linearizable). Choosing among several
/// endpoints (`choosing`), the connection and the read are bounded together: a member
/// cut off from its quorum held the read for half a minute, and so did an authenticated
/// connection's token request, while the members after it in the list waited to be
/// tried. With one endpoint there is no other to try, and a busy etcd is waited for.
async fn first_read(
    url: String,
    o: ConnectOptions,
    choosing: Option<std::time::Duration>,
) -> Result<Client, etcd_client::Error> {
    let answered = async {
        let mut client = Client::connect([url], Some(o)).await?;
        let read = etcd_client::GetOptions::new().with_count_only();
        client.get("/", Some(read)).await?;
        Ok(client)
    };
    match choosing {
        None => answered.await,
        Some(patience) => tokio::time::timeout(patience, answered)
            .await
            .map_err(|_| super::errors::unanswered(patience))?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
}
