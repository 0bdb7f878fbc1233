//! The status port's bounds on the generic listener ([`fsdp_store::bounded_listener`]):
//! its connection cap, its timeouts, and which of its requests are one-shot. What a flood
//! does to a port without them, and why each bound is what it is, is in that module and in
//! [`fsdp_store::streams`]; what is particular to this port is here.

use fsdp_store::bounded_listener::{
    HEAD_TIMEOUT, IDLE_TIMEOUT, Limits, STALL_TIMEOUT, StreamRules, connection_cap, soft_nofile,
};
use fsdp_store::streams::{self, Kind};

/// The requests that end by themselves at once: the probes, the scrape and the status.
/// Any other path counts as a stream, so that an unknown request cannot take the slots
/// kept for these.
const ONESHOT: &[&str] = &[
    "/metrics",
    "/grpc.health.v1.Health/Check",
    "/fsdp.v1.AgentStatus/GetStatus",
];

/// A request's kind, from its path.
pub fn kind(path: &str) -> Kind {
    if ONESHOT.contains(&path) {
        Kind::OneShot
    } else {
        Kind::Stream
    }
}

/// The status port's limits: the cap from this process's open-file limit (a quarter of
/// it, the rest kept for the workers, the logs and the store), and stream slots so that
/// `Liveness` streams and health `Watch`es never starve `Health/Check` and `/metrics`.
pub fn status_port() -> Limits {
    let max_connections = connection_cap(soft_nofile());
    Limits {
        max_connections,
        head_timeout: HEAD_TIMEOUT,
        idle_timeout: IDLE_TIMEOUT,
        stall_timeout: STALL_TIMEOUT,
        name: "status server",
        streams: Some(StreamRules {
            max_streams: streams::max_streams(max_connections),
            oneshot_timeout: streams::ONESHOT_TIMEOUT,
            kind,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probes_the_scrape_and_the_status_are_one_shot_and_the_rest_streams() {
        for p in ONESHOT {
            assert_eq!(kind(p), Kind::OneShot, "{p}");
        }
        for p in [
            "/fsdp.v1.AgentStatus/Liveness",
            "/grpc.health.v1.Health/Watch",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "/no/such/path",
            "/metrics/",
        ] {
            assert_eq!(kind(p), Kind::Stream, "{p}");
        }
    }

    #[test]
    fn long_requests_leave_slots_for_the_probes() {
        let l = status_port();
        let rules = l.streams.expect("the status port has stream slots");
        assert!(rules.max_streams < l.max_connections);
        assert_eq!(l.name, "status server");
    }
}
