//! `--rdzv-backend etcd`: endpoints, run id and `--rdzv-conf` keys turned into the etcd
//! rendezvous configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use fsdp_rendezvous::etcd::{EtcdConfig, TlsFiles};

use super::parse;

/// Keys the etcd backend reads, with torchrun's names where torchrun has one.
pub const KEYS: &[&str] = &[
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "keep_alive_ttl",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "straggler_timeout",
    "connect_timeout",
    "etcd_prefix",
    "protocol",
    "cacert",
    "cert",
    "key",
    "ca_cert",
    "ssl_cert",
    "ssl_cert_key",
    "username",
    "password",
];

/// Default wait for the other members once this node's workers all succeeded.
pub const DEFAULT_EXIT_BARRIER: Duration = Duration::from_secs(300);

/// What the etcd mode needs beyond the rendezvous itself.
#[derive(Debug, Clone)]
pub struct EtcdMode {
    pub rendezvous: EtcdConfig,
    /// How long a finished node waits for the rest of its round (`close_timeout`).
    pub exit_barrier: Duration,
}

/// Builds the etcd configuration; errors name the key or flag at fault.
pub fn build(
    endpoint: &str,
    run_id: &str,
    (min, max): (u32, u32),
    conf: &BTreeMap<String, String>,
    addr: String,
    local_world_size: u32,
) -> Result<EtcdMode, String> {
    let endpoints: Vec<String> = endpoint
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let bare = e.rsplit("://").next().unwrap_or(e);
            if bare.contains(':') {
                e.to_owned()
            } else {
                format!("{e}:2379")
            }
        })
        .collect();
    if endpoints.is_empty() {
        return Err("--rdzv-endpoint is required with --rdzv-backend etcd (e.g. etcd-host:2379, or a comma-separated list)".into());
    }
    let dur = |k: &str| -> Result<Option<Duration>, String> {
        conf.get(k)
            .map(|v| parse::duration(v).map_err(|e| format!("--rdzv-conf {k}: {e}")))
            .transpose()
    };
    let num = |k: &str| -> Result<Option<u32>, String> {
        conf.get(k)
            .map(|v| {
                v.parse::<u32>()
                    .map_err(|_| format!("--rdzv-conf {k}={v}: expected a whole number"))
            })
            .transpose()
    };
    let mut c = EtcdConfig::new(endpoints, run_id, min, max);
    c.addr = addr;
    c.local_world_size = local_world_size;
    if let Some(p) = conf.get("etcd_prefix") {
        c.prefix = p.clone();
    }
    if let Some(d) = dur("join_timeout")? {
        c.join_timeout = d;
    }
    if let Some(d) = dur("last_call_timeout")? {
        c.last_call = d;
    }
    if let Some(d) = dur("straggler_timeout")? {
        c.straggler_timeout = d;
    }
    if let Some(d) = dur("connect_timeout")? {
        c.options.retry_window = d;
    }
    // torchrun declares a node dead after interval × attempts without a heartbeat; our
    // lease TTL is that same bound.
    c.keep_alive_ttl = match (
        dur("keep_alive_ttl")?,
        dur("keep_alive_interval")?,
        num("keep_alive_max_attempt")?,
    ) {
        (Some(ttl), _, _) => ttl,
        (None, Some(i), attempts) => {
            let attempts = attempts.unwrap_or(3);
            i.checked_mul(attempts)
                .filter(|ttl| *ttl <= parse::MAX_DURATION)
                .ok_or_else(|| {
                    format!(
                        "--rdzv-conf keep_alive_interval × keep_alive_max_attempt ({i:?} × {attempts}) is too long for the lease: {}",
                        parse::TOO_LONG
                    )
                })?
        }
        (None, None, _) => c.keep_alive_ttl,
    };
    if c.keep_alive_ttl < Duration::from_secs(1) {
        return Err(
            "--rdzv-conf keep_alive_ttl must be at least 1s (etcd leases count whole seconds)"
                .into(),
        );
    }
    // A dead peer must be seen as lost (its lease expiring) before the coordinator stops
    // waiting for it; otherwise its death would be charged to the restart budget.
    if c.keep_alive_ttl >= c.straggler_timeout {
        return Err(format!(
            "--rdzv-conf keep_alive_ttl ({:?}) must be shorter than straggler_timeout ({:?})",
            c.keep_alive_ttl, c.straggler_timeout
        ));
    }
    let file = |a: &str, b: &str| conf.get(a).or_else(|| conf.get(b)).map(PathBuf::from);
    let tls = TlsFiles {
        ca: file("ca_cert", "cacert"),
        cert: file("ssl_cert", "cert"),
        key: file("ssl_cert_key", "key"),
    };
    let https = match conf.get("protocol").map(String::as_str) {
        None | Some("http") => false,
        Some("https") => true,
        Some(other) => {
            return Err(format!(
                "--rdzv-conf protocol={other}: expected http or https"
            ));
        }
    };
    if https || tls.ca.is_some() || tls.cert.is_some() {
        c.options.tls = Some(tls);
    }
    match (conf.get("username"), conf.get("password")) {
        (Some(u), Some(p)) => c.options.user = Some((u.clone(), p.clone())),
        (None, None) => {}
        _ => return Err("--rdzv-conf username and password go together".into()),
    }
    let exit_barrier = dur("close_timeout")?.unwrap_or(DEFAULT_EXIT_BARRIER);
    Ok(EtcdMode {
        rendezvous: c,
        exit_barrier,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn endpoints_get_the_default_port() {
        let m = build(
            "a, b:2380,http://c:1",
            "job",
            (1, 2),
            &conf(&[]),
            "h".into(),
            8,
        )
        .unwrap();
        assert_eq!(
            m.rendezvous.options.endpoints,
            ["a:2379", "b:2380", "http://c:1"]
        );
        assert!(
            build(" ", "job", (1, 2), &conf(&[]), "h".into(), 8)
                .unwrap_err()
                .contains("--rdzv-endpoint")
        );
    }

    #[test]
    fn torchrun_keys_map_onto_the_lease() {
        let m = build(
            "e",
            "j",
            (1, 1),
            &conf(&[
                ("keep_alive_interval", "2"),
                ("keep_alive_max_attempt", "4"),
            ]),
            "h".into(),
            1,
        )
        .unwrap();
        assert_eq!(m.rendezvous.keep_alive_ttl, Duration::from_secs(8));
        let m = build(
            "e",
            "j",
            (1, 1),
            &conf(&[("last_call_timeout", "5"), ("close_timeout", "60")]),
            "h".into(),
            1,
        )
        .unwrap();
        assert_eq!(m.rendezvous.last_call, Duration::from_secs(5));
        assert_eq!(m.exit_barrier, Duration::from_secs(60));
    }

    #[test]
    fn durations_are_bounded_and_the_lease_product_cannot_overflow() {
        let err = |pairs: &[(&str, &str)]| build("e", "j", (1, 1), &conf(pairs), "h".into(), 1);
        for key in [
            "join_timeout",
            "last_call_timeout",
            "close_timeout",
            "keep_alive_ttl",
            "keep_alive_interval",
            "straggler_timeout",
            "connect_timeout",
        ] {
            let e = err(&[(key, "99999999999999999999999")]).unwrap_err();
            assert!(
                e.contains(key) && e.contains("at most 7 days"),
                "{key}: {e}"
            );
        }
        let e = err(&[
            ("keep_alive_interval", "100h"),
            ("keep_alive_max_attempt", "4294967295"),
            ("straggler_timeout", "168h"),
        ])
        .unwrap_err();
        assert!(
            e.contains("keep_alive_max_attempt") && e.contains("at most 7 days"),
            "{e}"
        );
    }

    #[test]
    fn tls_and_auth_keys() {
        let m = build(
            "e",
            "j",
            (1, 1),
            &conf(&[("cacert", "/ca"), ("username", "u"), ("password", "p")]),
            "h".into(),
            1,
        )
        .unwrap();
        assert_eq!(
            m.rendezvous.options.tls.unwrap().ca,
            Some(PathBuf::from("/ca"))
        );
        assert!(build("e", "j", (1, 1), &conf(&[("username", "u")]), "h".into(), 1).is_err());
        assert!(
            build(
                "e",
                "j",
                (1, 1),
                &conf(&[("protocol", "gopher")]),
                "h".into(),
                1
            )
            .is_err()
        );
    }
}
