//! The `--rdzv-conf` keys fsdp-agent knows, written once: which of our rendezvous read
//! each (etcd, and c10d's embedded store, which runs the same rendezvous), and for those
//! that are torchrun's own, what they meant there. Those are accepted so that a torchrun
//! command line still starts, and the warning says why they change nothing.

/// One known `--rdzv-conf` key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    pub name: &'static str,
    /// Read by the etcd rendezvous ([`super::etcd::build`]).
    pub etcd: bool,
    /// Read by `--rdzv-backend c10d` ([`super::etcd::build_c10d`]).
    pub c10d: bool,
    /// Why a backend that does not read it lets it go (for the warning).
    pub note: &'static str,
}

/// Read by both: the rendezvous' own timeouts and lease, the password and TLS files.
const fn both(name: &'static str) -> Key {
    Key {
        name,
        etcd: true,
        c10d: true,
        note: "",
    }
}

const fn torchrun(name: &'static str, note: &'static str) -> Key {
    Key {
        name,
        etcd: false,
        c10d: false,
        note,
    }
}

/// Every known key, in the order the unknown-key error lists them.
pub const KEYS: &[Key] = &[
    both("keep_alive_ttl"),
    both("straggler_timeout"),
    both("connect_timeout"),
    both("username"),
    both("password"),
    both("password_file"),
    both("join_timeout"),
    both("last_call_timeout"),
    both("close_timeout"),
    torchrun(
        "heartbeat_timeout",
        "a heartbeat write's deadline; the lease (keep_alive_ttl) bounds it here",
    ),
    both("keep_alive_interval"),
    both("keep_alive_max_attempt"),
    torchrun(
        "timeout",
        "torchrun's legacy-etcd and static deadline; the rendezvous deadline here is join_timeout",
    ),
    torchrun(
        "read_timeout",
        "a store request's timeout; requests here are retried until outage_timeout",
    ),
    Key {
        name: "is_host",
        etcd: false,
        c10d: true,
        note: "only the c10d backend hosts a store",
    },
    Key {
        name: "token_ttl",
        etcd: false,
        c10d: true,
        note: "an etcd's tokens live as long as its own --auth-token-ttl says",
    },
    torchrun(
        "store_type",
        "only a TCP store exists (store_type=tcp is torchrun's default)",
    ),
    both("etcd_prefix"),
    both("protocol"),
    both("cacert"),
    both("cert"),
    both("key"),
    both("ca_cert"),
    both("ssl_cert"),
    both("ssl_cert_key"),
    torchrun(
        "rank",
        "torchrun's legacy-etcd rank hint; the rendezvous assigns ranks",
    ),
    torchrun(
        "cas_backoff_max_seconds",
        "a back-off between lost compare-and-swaps; nodes here write once per round",
    ),
    both("fence_margin"),
    both("job_check"),
    both("outage_timeout"),
    both("segment"),
];

/// The known key called `name`.
pub fn find(name: &str) -> Option<Key> {
    KEYS.iter().find(|k| k.name == name).copied()
}
