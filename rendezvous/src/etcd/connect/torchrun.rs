//! Telling torchrun's TCPStore at a c10d endpoint: an agent of this launcher cannot join
//! a job whose store torchrun serves, and no retry would make it answer.

use std::time::Duration;

use crate::RendezvousError;

pub(super) fn torchrun_peer(endpoint: &str) -> RendezvousError {
    RendezvousError::TorchrunPeer(format!(
        "the c10d store at {endpoint} is torchrun's TCPStore: {}",
        fsdp_store::tcpstore::SAME_LAUNCHER
    ))
}

/// The first endpoint where a TCPStore answers, if any.
pub(super) async fn torchrun_store(endpoints: &[String]) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
