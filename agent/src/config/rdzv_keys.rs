//! The `--rdzv-conf` keys fsdp-agent knows, written once: which the etcd rendezvous reads,
//! and which are torchrun's own (accepted so a torchrun command line still starts, and
//! reported as having no effect).

/// One known `--rdzv-conf` key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    pub name: &'static str,
    /// Read by the etcd rendezvous ([`super::etcd::build`]); otherwise torchrun-only.
    pub etcd: bool,
}

const fn etcd(name: &'static str) -> Key {
    Key { name, etcd: true }
}

const fn torchrun(name: &'static str) -> Key {
    Key { name, etcd: false }
}

/// Every known key, in the order the unknown-key error lists them.
pub const KEYS: &[Key] = &[
    etcd("keep_alive_ttl"),
    etcd("straggler_timeout"),
    etcd("connect_timeout"),
    etcd("username"),
    etcd("password"),
    etcd("password_file"),
    etcd("join_timeout"),
    etcd("last_call_timeout"),
    etcd("close_timeout"),
    torchrun("heartbeat_timeout"),
    etcd("keep_alive_interval"),
    etcd("keep_alive_max_attempt"),
    torchrun("timeout"),
    torchrun("read_timeout"),
    torchrun("is_host"),
    torchrun("store_type"),
    etcd("etcd_prefix"),
    etcd("protocol"),
    etcd("cacert"),
    etcd("cert"),
    etcd("key"),
    etcd("ca_cert"),
    etcd("ssl_cert"),
    etcd("ssl_cert_key"),
    torchrun("rank"),
    torchrun("cas_backoff_max_seconds"),
    etcd("fence_margin"),
    etcd("outage_timeout"),
];

/// The known key called `name`.
pub fn find(name: &str) -> Option<Key> {
    KEYS.iter().find(|k| k.name == name).copied()
}
