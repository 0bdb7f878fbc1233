//! Choosing the etcd member to talk to: all endpoints asked at once, the first (in the
//! order given) whose member answers and knows a leader.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::options::{EtcdOptions, options, urls};

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
pub(in crate::etcd) async fn ask_member(
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
