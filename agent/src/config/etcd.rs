//! `--rdzv-backend etcd`: endpoints, run id and `--rdzv-conf` keys turned into the etcd
//! rendezvous configuration. The keys read here are those marked `etcd` in
//! [`super::rdzv_keys::KEYS`]. `--rdzv-backend c10d` runs the same rendezvous on the store
//! an agent of the job serves ([`build_c10d`]; the keys marked `c10d`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use fsdp_rendezvous::etcd::{EtcdConfig, Keys, TlsFiles};

use super::parse;

/// The variable the etcd password can come from instead of `--rdzv-conf`: the agent reads
/// it and removes it from the workers' environment.
pub const PASSWORD_ENV: &str = "FSDP_ETCD_PASSWORD";

/// Default wait for the other members once this node's workers all succeeded.
pub const DEFAULT_EXIT_BARRIER: Duration = Duration::from_secs(300);

/// What the etcd mode needs beyond the rendezvous itself.
#[derive(Debug, Clone)]
pub struct EtcdMode {
    pub rendezvous: EtcdConfig,
    /// How long a finished node waits for the rest of its round (`close_timeout`).
    pub exit_barrier: Duration,
    /// `--rdzv-backend c10d`: the store is served by the agent at the endpoint, maybe
    /// this one.
    pub store: Option<EmbeddedStore>,
    /// `--rdzv-conf job_check` (default on): refuse to join a run that is another job's
    /// ([`fsdp_rendezvous::job`]).
    pub job_check: bool,
}

/// How long a c10d agent waits for a store that stopped answering: long enough for the
/// host's pod to be restarted in place (its agent then serves an empty store and everyone
/// registers again, as after an etcd restart), short enough that a host gone for good
/// ends the job within a minute, as torchrun's c10d does (its `read_timeout`, 60 s).
pub const C10D_OUTAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a c10d job's store is served, and whether this agent was told to serve it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedStore {
    pub host: String,
    pub port: u16,
    /// `--rdzv-conf is_host`: unset, the agent whose machine has the address serves.
    pub is_host: Option<bool>,
    /// Who the store lets in (the serving agent's part of the password and TLS keys).
    pub security: fsdp_store::Security,
}

/// Builds the etcd configuration; errors name the key or flag at fault and never echo the
/// password. `env_password` is `$FSDP_ETCD_PASSWORD`.
pub fn build(
    endpoint: &str,
    run_id: &str,
    nodes: (u32, u32),
    conf: &BTreeMap<String, String>,
    addr: String,
    local_world_size: u32,
    env_password: Option<&str>,
) -> Result<EtcdMode, String> {
    let parsed = endpoints(endpoint)?;
    let urls = parsed.iter().map(Endpoint::to_string).collect();
    let mut m = rendezvous(urls, run_id, nodes, conf, addr, local_world_size)?;
    if let Some(tls) = tls(conf, &parsed, endpoint)? {
        m.rendezvous.options.tls = Some(tls);
    }
    if let Some(user) = user(conf, env_password)? {
        m.rendezvous.options.user = Some(user);
    }
    Ok(m)
}

/// The user name of a c10d store's one user when only a password is given: the store is
/// the job's own, so there is no one else to tell apart.
pub const C10D_DEFAULT_USER: &str = "fsdp";

/// `--rdzv-backend c10d`: one `host[:port]` (29400 by default, as torchrun's), served by
/// the agent whose machine has it. The password and TLS keys are etcd mode's: every agent
/// is given the same ones, the serving agent requires them, and the others present them
/// (docs/security.md). `env_password` is `$FSDP_ETCD_PASSWORD`.
pub fn build_c10d(
    endpoint: &str,
    run_id: &str,
    nodes: (u32, u32),
    conf: &BTreeMap<String, String>,
    addr: String,
    local_world_size: u32,
    env_password: Option<&str>,
) -> Result<EtcdMode, String> {
    let endpoint = endpoint.trim();
    if endpoint.is_empty() {
        return Err("--rdzv-endpoint is required with --rdzv-backend c10d on several nodes: host[:port] of the node whose agent serves the store (port 29400 by default), e.g. the first pod's name".into());
    }
    if endpoint.contains(',') {
        return Err(format!(
            "--rdzv-endpoint {endpoint}: c10d takes one host[:port], the agent that serves the store; several endpoints are for an etcd cluster (--rdzv-backend etcd)"
        ));
    }
    let (host, port) = parse::checked_host_port(endpoint)
        .map_err(|reason| format!("--rdzv-endpoint '{endpoint}': {reason}"))?;
    if host.is_empty() || host.contains('/') {
        return Err(format!(
            "--rdzv-endpoint '{endpoint}': expected host[:port] for c10d (no scheme)"
        ));
    }
    let port = port.unwrap_or(fsdp_store::DEFAULT_PORT);
    if let Some(t) = conf
        .get("store_type")
        .filter(|t| !t.eq_ignore_ascii_case("tcp"))
    {
        return Err(format!(
            "--rdzv-conf store_type={t}: only tcp is supported (the agent at --rdzv-endpoint serves the store over TCP)"
        ));
    }
    let is_host = conf
        .get("is_host")
        .map(|v| parse::env_bool(v).map_err(|e| format!("--rdzv-conf is_host={v}: {e}")))
        .transpose()?;
    let url = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let mut m = rendezvous(vec![url], run_id, nodes, conf, addr, local_world_size)?;
    m.rendezvous.options.embedded_store = true;
    if !conf.contains_key("outage_timeout") {
        m.rendezvous.outage_timeout = C10D_OUTAGE_TIMEOUT;
    }
    let tls = c10d_tls(conf)?;
    let credentials = c10d_user(conf, env_password)?;
    let token_ttl = token_ttl(conf, credentials.is_some())?;
    m.rendezvous.options.tls = tls.clone();
    m.rendezvous.options.user = credentials.clone();
    m.store = Some(EmbeddedStore {
        host,
        port,
        is_host,
        security: fsdp_store::Security {
            credentials: credentials.map(|(user, password)| fsdp_store::Credentials {
                token_ttl,
                ..fsdp_store::Credentials::new(user, password, run_id.to_owned())
            }),
            tls: tls.map(|t| fsdp_store::ServerTls {
                // c10d_tls gives all three or none.
                cert: t.cert.unwrap_or_default(),
                key: t.key.unwrap_or_default(),
                client_ca: t.ca,
            }),
        },
    });
    Ok(m)
}

/// `--rdzv-conf token_ttl`: how long the c10d store's tokens are good for (etcd's
/// `--auth-token-ttl`); only a store with a password hands any out.
fn token_ttl(conf: &BTreeMap<String, String>, password: bool) -> Result<Duration, String> {
    let Some(ttl) = dur(conf, "token_ttl")? else {
        return Ok(fsdp_store::auth::TOKEN_TTL);
    };
    if !password {
        return Err("--rdzv-conf token_ttl: the c10d store hands out tokens only with a password; give every agent FSDP_ETCD_PASSWORD or password_file=PATH, or drop token_ttl".into());
    }
    if ttl < Duration::from_secs(1) {
        return Err(
            "--rdzv-conf token_ttl must be at least 1s (tokens count whole seconds)".into(),
        );
    }
    Ok(ttl)
}

/// The c10d store's user: etcd mode's keys, the user name optional ([`C10D_DEFAULT_USER`]).
fn c10d_user(
    conf: &BTreeMap<String, String>,
    env_password: Option<&str>,
) -> Result<Option<(String, String)>, String> {
    match (conf.get("username"), password(conf, env_password)?) {
        (u, Some(p)) => Ok(Some((
            u.cloned().unwrap_or_else(|| C10D_DEFAULT_USER.into()),
            p,
        ))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(format!(
            "--rdzv-conf username needs a password: password_file=PATH, ${PASSWORD_ENV}, or password=..."
        )),
    }
}

/// The TLS files `--rdzv-conf` names (torchrun's names or etcdctl's), given or not.
fn tls_files(conf: &BTreeMap<String, String>) -> TlsFiles {
    let file = |a: &str, b: &str| conf.get(a).or_else(|| conf.get(b)).map(PathBuf::from);
    TlsFiles {
        ca: file("ca_cert", "cacert"),
        cert: file("ssl_cert", "cert"),
        key: file("ssl_cert_key", "key"),
    }
}

/// Whether `--rdzv-conf protocol` asks for https (absent: no).
fn https(conf: &BTreeMap<String, String>) -> Result<bool, String> {
    match conf.get("protocol").map(String::as_str) {
        None | Some("http") => Ok(false),
        Some("https") => Ok(true),
        Some(other) => Err(format!(
            "--rdzv-conf protocol={other}: expected http or https"
        )),
    }
}

/// The c10d store's TLS: the CA, the certificate and its key together or none of them.
/// The serving agent presents the certificate and requires client certificates signed by
/// the CA; the others verify it with the CA and present the same certificate.
fn c10d_tls(conf: &BTreeMap<String, String>) -> Result<Option<TlsFiles>, String> {
    let tls = tls_files(conf);
    let https = https(conf)?;
    match (&tls.ca, &tls.cert, &tls.key) {
        (None, None, None) if !https => Ok(None),
        // As for etcd: the files used to mean TLS whatever protocol said.
        (Some(_), Some(_), Some(_)) if conf.get("protocol").is_some_and(|p| p == "http") => Err(
            "--rdzv-conf protocol=http asks for plaintext but cacert,cert,key ask for TLS; write protocol=https (or drop protocol) to use TLS, or drop the TLS keys for plaintext".into(),
        ),
        (Some(_), Some(_), Some(_)) => Ok(Some(tls)),
        _ => Err("--rdzv-conf: TLS for the c10d store needs cacert, cert and key together (the serving agent presents cert/key and requires client certificates signed by cacert; every agent is given the same three files)".into()),
    }
}

/// What both backends read: the run, the node, the timeouts and the exit barrier.
fn rendezvous(
    urls: Vec<String>,
    run_id: &str,
    (min, max): (u32, u32),
    conf: &BTreeMap<String, String>,
    addr: String,
    local_world_size: u32,
) -> Result<EtcdMode, String> {
    let mut c = EtcdConfig::new(urls, run_id, min, max);
    c.addr = addr;
    c.local_world_size = local_world_size;
    if let Some(p) = conf.get("etcd_prefix") {
        c.prefix = p.clone();
    }
    // The key layout refuses prefixes and run ids that could reach into another run's
    // keys; say so now rather than after connecting.
    Keys::new(&c.prefix, run_id)
        .map_err(|e| format!("--rdzv-conf etcd_prefix / --rdzv-id: {e}"))?;
    timeouts(&mut c, conf)?;
    if let Some(segment) = conf.get("segment") {
        fsdp_rendezvous::topology::check(segment).map_err(|e| {
            let shown = fsdp_rendezvous::text::shown(segment);
            format!("--rdzv-conf segment={shown} {e}")
        })?;
        c.segment = segment.clone();
    }
    let exit_barrier = dur(conf, "close_timeout")?.unwrap_or(DEFAULT_EXIT_BARRIER);
    let job_check = conf
        .get("job_check")
        .map(|v| parse::env_bool(v).map_err(|e| format!("--rdzv-conf job_check={v}: {e}")))
        .transpose()?
        .unwrap_or(true);
    Ok(EtcdMode {
        rendezvous: c,
        exit_barrier,
        store: None,
        job_check,
    })
}

/// `--rdzv-endpoint`: a comma-separated list of at least one endpoint.
fn endpoints(endpoint: &str) -> Result<Vec<Endpoint>, String> {
    let parsed: Vec<Endpoint> = endpoint
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| parse_endpoint(e).map_err(|reason| format!("--rdzv-endpoint '{e}': {reason}")))
        .collect::<Result<_, _>>()?;
    if parsed.is_empty() {
        return Err("--rdzv-endpoint is required with --rdzv-backend etcd (e.g. etcd-host:2379, or a comma-separated list)".into());
    }
    Ok(parsed)
}

/// The duration key `k`, if given.
fn dur(conf: &BTreeMap<String, String>, k: &str) -> Result<Option<Duration>, String> {
    conf.get(k)
        .map(|v| parse::duration(v).map_err(|e| format!("--rdzv-conf {k}: {e}")))
        .transpose()
}

/// The whole-number key `k`, if given.
fn num(conf: &BTreeMap<String, String>, k: &str) -> Result<Option<u32>, String> {
    conf.get(k)
        .map(|v| {
            v.parse::<u32>()
                .map_err(|_| format!("--rdzv-conf {k}={v}: expected a whole number"))
        })
        .transpose()
}

/// The rendezvous timeouts and the lease, checked against each other.
fn timeouts(c: &mut EtcdConfig, conf: &BTreeMap<String, String>) -> Result<(), String> {
    if let Some(d) = dur(conf, "join_timeout")? {
        c.join_timeout = d;
    }
    if let Some(d) = dur(conf, "last_call_timeout")? {
        c.last_call = d;
    }
    if let Some(d) = dur(conf, "straggler_timeout")? {
        c.straggler_timeout = d;
    }
    if let Some(d) = dur(conf, "connect_timeout")? {
        c.options.retry_window = d;
    }
    c.keep_alive_ttl = lease_ttl(conf)?.unwrap_or(c.keep_alive_ttl);
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
    if let Some(d) = dur(conf, "outage_timeout")? {
        c.outage_timeout = d;
    }
    c.fence_margin = dur(conf, "fence_margin")?;
    // The margin is cut from the lease: one that leaves less than a keep-alive interval
    // (TTL/3) would fence at the first late answer.
    if let Some(m) = c.fence_margin.filter(|m| *m > c.keep_alive_ttl / 2) {
        return Err(format!(
            "--rdzv-conf fence_margin ({m:?}) must be at most half of keep_alive_ttl ({:?})",
            c.keep_alive_ttl
        ));
    }
    Ok(())
}

/// The lease TTL: `keep_alive_ttl`, or torchrun's pair. torchrun declares a node dead after
/// interval × attempts without a heartbeat; our lease TTL is that same bound.
fn lease_ttl(conf: &BTreeMap<String, String>) -> Result<Option<Duration>, String> {
    Ok(
        match (
            dur(conf, "keep_alive_ttl")?,
            dur(conf, "keep_alive_interval")?,
            num(conf, "keep_alive_max_attempt")?,
        ) {
            (Some(ttl), _, _) => Some(ttl),
            (None, Some(i), attempts) => {
                let attempts = attempts.unwrap_or(3);
                let ttl = i
                    .checked_mul(attempts)
                    .filter(|ttl| *ttl <= parse::MAX_DURATION)
                    .ok_or_else(|| {
                        format!(
                            "--rdzv-conf keep_alive_interval × keep_alive_max_attempt ({i:?} × {attempts}) is too long for the lease: {}",
                            parse::TOO_LONG
                        )
                    })?;
                Some(ttl)
            }
            (None, None, _) => None,
        },
    )
}

/// The TLS files, when TLS is asked for (a TLS key, `protocol=https` or an `https://`
/// endpoint); `None` for plaintext.
fn tls(
    conf: &BTreeMap<String, String>,
    parsed: &[Endpoint],
    endpoint: &str,
) -> Result<Option<TlsFiles>, String> {
    let tls = tls_files(conf);
    // Either half alone used to run silently in plaintext: TLS was only turned on by a CA,
    // a certificate or https.
    match (&tls.cert, &tls.key) {
        (Some(_), None) => {
            return Err("--rdzv-conf cert (ssl_cert) needs its private key too: add key=PATH (or ssl_cert_key=PATH)".into());
        }
        (None, Some(_)) => {
            return Err("--rdzv-conf key (ssl_cert_key) needs its certificate too: add cert=PATH (or ssl_cert=PATH)".into());
        }
        _ => {}
    }
    let https = https(conf)?;
    let schemes: Vec<Scheme> = parsed.iter().filter_map(|e| e.scheme).collect();
    if schemes.contains(&Scheme::Http) && schemes.contains(&Scheme::Https) {
        return Err(format!(
            "--rdzv-endpoint {endpoint} mixes http:// and https://; one etcd cluster speaks one of them"
        ));
    }
    let tls_keys: Vec<&str> = [
        "protocol",
        "cacert",
        "ca_cert",
        "cert",
        "ssl_cert",
        "key",
        "ssl_cert_key",
    ]
    .into_iter()
    .filter(|k| conf.contains_key(*k) && (https || *k != "protocol"))
    .collect();
    if schemes.contains(&Scheme::Http) && !tls_keys.is_empty() {
        // tonic would connect in plaintext and ignore the files: refuse rather than retry a
        // TLS server in plaintext, or silently skip the TLS the user asked for.
        return Err(format!(
            "--rdzv-endpoint {endpoint} is plaintext http:// but --rdzv-conf {} asks for TLS; write https:// (or host:port) or drop the TLS keys",
            tls_keys.join(",")
        ));
    }
    let explicit_http = conf.get("protocol").is_some_and(|p| p == "http");
    if explicit_http && !tls_keys.is_empty() {
        // The files used to turn TLS on regardless, so `protocol=http` was silently
        // ignored: say which of the two the user meant instead of guessing.
        return Err(format!(
            "--rdzv-conf protocol=http asks for plaintext but {} asks for TLS; write protocol=https (or drop protocol) to use TLS, or drop the TLS keys for plaintext",
            tls_keys.join(",")
        ));
    }
    let wanted = https || !tls_keys.is_empty() || schemes.contains(&Scheme::Https);
    Ok(wanted.then_some(tls))
}

/// The user name and password, both or neither.
fn user(
    conf: &BTreeMap<String, String>,
    env_password: Option<&str>,
) -> Result<Option<(String, String)>, String> {
    match (conf.get("username"), password(conf, env_password)?) {
        (Some(u), Some(p)) => Ok(Some((u.clone(), p))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(format!(
            "--rdzv-conf username needs a password: password_file=PATH, ${PASSWORD_ENV}, or password=..."
        )),
        (None, Some(_)) => Err("an etcd password needs --rdzv-conf username=... as well".into()),
    }
}

/// The largest password file read: a password is a line, and `/dev/zero` was read until
/// the agent ran out of memory.
const SECRET_FILE_MAX: u64 = 64 * 1024;

/// The text of the secret file at `path`: a regular file of at most [`SECRET_FILE_MAX`]
/// bytes (a FIFO would block even `--print-config`, a device would never end).
fn read_secret(path: &str) -> Result<String, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("--rdzv-conf password_file={path} cannot be read: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "--rdzv-conf password_file={path} is not a regular file; write the password into a file (a Kubernetes Secret mounted as a volume is one)"
        ));
    }
    if meta.len() > SECRET_FILE_MAX {
        return Err(format!(
            "--rdzv-conf password_file={path} holds {} bytes; a password file holds one line (at most {SECRET_FILE_MAX} bytes)",
            meta.len()
        ));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(SECRET_FILE_MAX).read_to_string(&mut text))
        .map_err(|e| format!("--rdzv-conf password_file={path} cannot be read: {e}"))?;
    Ok(text)
}

/// The etcd password from exactly one of `password=`, `password_file=` and
/// `$FSDP_ETCD_PASSWORD`. A variable set but empty is refused, as an empty file is: it is
/// what a Secret key that does not exist gives, and it used to serve an open store.
fn password(
    conf: &BTreeMap<String, String>,
    env_password: Option<&str>,
) -> Result<Option<String>, String> {
    if env_password == Some("") {
        return Err(format!(
            "${PASSWORD_ENV} is set but empty (a Secret key that does not exist?); give the password, or unset the variable for no password"
        ));
    }
    match (
        conf.get("password"),
        conf.get("password_file"),
        env_password,
    ) {
        (None, None, None) => Ok(None),
        (Some(p), None, None) => Ok(Some(p.clone())),
        (None, None, Some(p)) => Ok(Some(p.to_owned())),
        (None, Some(path), None) => {
            let text = read_secret(path)?;
            // One trailing newline is the file's, not the password's.
            let p = text
                .strip_suffix('\n')
                .map(|t| t.strip_suffix('\r').unwrap_or(t))
                .unwrap_or(&text);
            if p.is_empty() {
                return Err(format!("--rdzv-conf password_file={path} is empty"));
            }
            Ok(Some(p.to_owned()))
        }
        _ => Err(format!(
            "the etcd password is given more than once (--rdzv-conf password, --rdzv-conf password_file, ${PASSWORD_ENV}); give one"
        )),
    }
}

/// The port etcd clients use when none is given.
pub const DEFAULT_PORT: u16 = 2379;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Http,
    Https,
}

/// One etcd endpoint, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    scheme: Option<Scheme>,
    /// A DNS name, an IPv4 address, or an IPv6 address in brackets.
    host: String,
    port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.scheme {
            Some(Scheme::Http) => write!(f, "http://")?,
            Some(Scheme::Https) => write!(f, "https://")?,
            None => {}
        }
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// `[scheme://]host[:port]`: scheme http or https, host a DNS name or an IP address
/// (IPv6 in brackets), port 1-65535 (2379 when left out). Checked here so that a typo is a
/// configuration error at once, not an etcd that never answers.
fn parse_endpoint(e: &str) -> Result<Endpoint, String> {
    let (scheme, rest) = match e.split_once("://") {
        None => (None, e),
        Some((s, rest)) => match s.to_ascii_lowercase().as_str() {
            "http" => (Some(Scheme::Http), rest),
            "https" => (Some(Scheme::Https), rest),
            _ => return Err(format!("scheme '{s}' is not http or https")),
        },
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let port = |p: &str| match p.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("port '{p}' is not a number 1-65535")),
    };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (addr, tail) = v6
            .split_once(']')
            .ok_or("'[' opens an IPv6 address that no ']' closes")?;
        addr.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("'{addr}' is not an IPv6 address"))?;
        let p = match tail {
            "" => DEFAULT_PORT,
            _ => port(
                tail.strip_prefix(':')
                    .ok_or_else(|| format!("unexpected '{tail}' after ']'"))?,
            )?,
        };
        (format!("[{addr}]"), p)
    } else {
        let (host, p) = match rest.split_once(':') {
            Some((_, tail)) if tail.contains(':') => {
                return Err("write an IPv6 address in brackets, e.g. [::1]:2379".into());
            }
            Some((h, p)) => (h, port(p)?),
            None => (rest, DEFAULT_PORT),
        };
        check_host(host)?;
        (host.to_owned(), p)
    };
    Ok(Endpoint { scheme, host, port })
}

/// An IPv4 address or a DNS name (letters, digits, `-`, `_`; labels of 1-63 characters).
pub(super) fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        return Ok(());
    }
    if !host.is_ascii() {
        return Err(format!(
            "host '{host}' is not ASCII; write an internationalised name in its xn-- form"
        ));
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!("'{host}' is not a valid host name or IP address"));
    }
    Ok(())
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
            None,
        )
        .unwrap();
        assert_eq!(
            m.rendezvous.options.endpoints,
            ["a:2379", "b:2380", "http://c:1"]
        );
        assert!(
            build(" ", "job", (1, 2), &conf(&[]), "h".into(), 8, None)
                .unwrap_err()
                .contains("--rdzv-endpoint")
        );
    }

    #[test]
    fn endpoints_are_checked_at_configuration_time() {
        for (e, normal) in [
            ("etcd", "etcd:2379"),
            (
                "etcd-0.etcd.ns.svc.cluster.local.:2380",
                "etcd-0.etcd.ns.svc.cluster.local.:2380",
            ),
            ("10.0.0.1", "10.0.0.1:2379"),
            ("[::1]", "[::1]:2379"),
            ("[fe80::1]:1", "[fe80::1]:1"),
            ("HTTPS://e:65535/", "https://e:65535"),
        ] {
            assert_eq!(
                parse_endpoint(e).map(|e| e.to_string()),
                Ok(normal.into()),
                "{e}"
            );
        }
        for (e, why) in [
            ("a b c", "not a valid host"),
            ("ét.cd", "not ASCII"),
            ("e:99999", "port '99999'"),
            ("e:0", "port '0'"),
            ("e:", "port ''"),
            ("ftp://e", "scheme 'ftp'"),
            ("::1", "brackets"),
            ("[::1", "no ']'"),
            ("[::g]:1", "not an IPv6"),
            ("-e", "not a valid host"),
            ("user@e:1", "not a valid host"),
            ("e:1/v3", "port '1/v3'"),
            ("", "not a valid host"),
        ] {
            let err = parse_endpoint(e).unwrap_err();
            assert!(err.contains(why), "{e}: {err}");
        }
    }

    #[test]
    fn plaintext_endpoints_and_tls_keys_conflict() {
        let b = |ep: &str, pairs: &[(&str, &str)]| {
            build(ep, "j", (1, 1), &conf(pairs), "h".into(), 1, None)
                .map(|m| m.rendezvous.options.tls.is_some())
        };
        assert!(
            b("http://e", &[("cacert", "/ca")])
                .unwrap_err()
                .contains("http://")
        );
        assert!(
            b("http://e", &[("protocol", "https")])
                .unwrap_err()
                .contains("protocol")
        );
        assert!(b("http://e,https://f", &[]).unwrap_err().contains("mixes"));
        assert_eq!(b("http://e", &[("protocol", "http")]), Ok(false));
        // protocol=http with TLS files used to connect over TLS without a word.
        for key in ["cacert", "ca_cert", "cert", "ssl_cert"] {
            let mut pairs = vec![("protocol", "http"), (key, "/f")];
            if key.contains("cert") && !key.contains("ca") {
                pairs.push(("key", "/k"));
            }
            let err = b("e", &pairs).unwrap_err();
            assert!(
                err.contains("protocol=http")
                    && err.contains(key)
                    && err.contains("protocol=https"),
                "{err}"
            );
        }
        // The c10d store the same: its three files with protocol=http are a contradiction.
        let files = [("cacert", "/ca"), ("cert", "/c"), ("key", "/k")];
        let c10d = |extra: &[(&'static str, &'static str)]| {
            let pairs: Vec<_> = files.iter().chain(extra).copied().collect();
            build_c10d(
                "127.0.0.1:29400",
                "j",
                (1, 2),
                &conf(&pairs),
                "h".into(),
                1,
                None,
            )
            .map(|m| m.rendezvous.options.tls.is_some())
        };
        assert_eq!(c10d(&[]), Ok(true));
        let err = c10d(&[("protocol", "http")]).unwrap_err();
        assert!(err.contains("protocol=http"), "{err}");
        assert_eq!(b("https://e", &[]), Ok(true));
        assert_eq!(b("e", &[("cacert", "/ca")]), Ok(true));
    }

    #[test]
    fn the_c10d_token_ttl_is_the_run_s_and_needs_a_password() {
        let c10d = |pairs: &[(&str, &str)], password: Option<&str>| {
            build_c10d(
                "127.0.0.1:29400",
                "job-9",
                (1, 2),
                &conf(pairs),
                "h".into(),
                1,
                password,
            )
            .map(|m| m.store.and_then(|s| s.security.credentials))
        };
        let c = c10d(&[], Some("pw")).unwrap().unwrap();
        assert_eq!(
            (c.run.as_str(), c.token_ttl),
            ("job-9", fsdp_store::auth::TOKEN_TTL)
        );
        let c = c10d(&[("token_ttl", "90s")], Some("pw")).unwrap().unwrap();
        assert_eq!(c.token_ttl, Duration::from_secs(90));
        let e = c10d(&[("token_ttl", "90")], None).unwrap_err();
        assert!(e.contains("token_ttl") && e.contains("password"), "{e}");
        let e = c10d(&[("token_ttl", "0.5")], Some("pw")).unwrap_err();
        assert!(e.contains("at least 1s"), "{e}");
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
            None,
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
            None,
        )
        .unwrap();
        assert_eq!(m.rendezvous.last_call, Duration::from_secs(5));
        assert_eq!(m.exit_barrier, Duration::from_secs(60));
    }

    #[test]
    fn durations_are_bounded_and_the_lease_product_cannot_overflow() {
        let err =
            |pairs: &[(&str, &str)]| build("e", "j", (1, 1), &conf(pairs), "h".into(), 1, None);
        for key in [
            "join_timeout",
            "last_call_timeout",
            "close_timeout",
            "keep_alive_ttl",
            "keep_alive_interval",
            "straggler_timeout",
            "connect_timeout",
            "fence_margin",
            "outage_timeout",
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
    fn the_outage_bound_and_the_fencing_margin_are_taken_and_checked() {
        let build = |pairs: &[(&str, &str)]| {
            build("e", "j", (1, 1), &conf(pairs), "h".into(), 1, None).map(|m| m.rendezvous)
        };
        let r = build(&[("outage_timeout", "60"), ("fence_margin", "1.5")]).unwrap();
        assert_eq!(r.outage_timeout, Duration::from_secs(60));
        assert_eq!(r.margin(), Duration::from_millis(1500));
        // Not given: a fifth of the lease, whatever the lease is.
        let r = build(&[("keep_alive_ttl", "10")]).unwrap();
        assert_eq!((r.fence_margin, r.margin()), (None, Duration::from_secs(2)));
        let e = build(&[("keep_alive_ttl", "4"), ("fence_margin", "3")]).unwrap_err();
        assert!(
            e.contains("fence_margin") && e.contains("at most half of keep_alive_ttl"),
            "{e}"
        );
    }

    #[test]
    fn the_password_comes_from_one_place() {
        let dir = std::env::temp_dir().join(format!("fsdp-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "from-file\r\n").unwrap();
        let path = file.display().to_string();
        let user = |pairs: &[(&str, &str)], env: Option<&str>| {
            build("e", "j", (1, 1), &conf(pairs), "h".into(), 1, env)
                .map(|m| m.rendezvous.options.user.map(|(_, p)| p))
        };
        let u = ("username", "u");
        assert_eq!(
            user(&[u, ("password_file", &path)], None),
            Ok(Some("from-file".into()))
        );
        assert_eq!(user(&[u], Some("from-env")), Ok(Some("from-env".into())));
        // Set but empty: a Secret key that does not exist, refused as an empty file is.
        for pairs in [&[u, ("password", "p")][..], &[u]] {
            assert!(
                user(pairs, Some(""))
                    .unwrap_err()
                    .contains("FSDP_ETCD_PASSWORD is set but empty"),
                "{pairs:?}"
            );
        }
        assert!(
            user(&[u, ("password", "p")], Some("e"))
                .unwrap_err()
                .contains("more than once")
        );
        assert!(user(&[u, ("password", "p"), ("password_file", &path)], None).is_err());
        assert!(user(&[u], None).unwrap_err().contains("FSDP_ETCD_PASSWORD"));
        assert!(user(&[], Some("e")).unwrap_err().contains("username"));
        std::fs::write(&file, "\n").unwrap();
        assert!(
            user(&[u, ("password_file", &path)], None)
                .unwrap_err()
                .contains("empty")
        );
        // A device never ends and a FIFO blocks: neither is read.
        assert!(
            user(&[u, ("password_file", "/dev/zero")], None)
                .unwrap_err()
                .contains("not a regular file")
        );
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let fifo = fifo.display().to_string();
        assert!(
            user(&[u, ("password_file", &fifo)], None)
                .unwrap_err()
                .contains("not a regular file")
        );
        std::fs::write(&file, vec![b'x'; 100_000]).unwrap();
        assert!(
            user(&[u, ("password_file", &path)], None)
                .unwrap_err()
                .contains("holds 100000 bytes")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn half_a_client_certificate_is_refused() {
        let err = |pairs: &[(&str, &str)]| {
            build("e", "j", (1, 1), &conf(pairs), "h".into(), 1, None).unwrap_err()
        };
        assert!(err(&[("key", "/k")]).contains("cert=PATH"));
        assert!(err(&[("ssl_cert_key", "/k")]).contains("cert=PATH"));
        assert!(err(&[("cert", "/c")]).contains("key=PATH"));
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
            None,
        )
        .unwrap();
        assert_eq!(
            m.rendezvous.options.tls.unwrap().ca,
            Some(PathBuf::from("/ca"))
        );
        assert!(
            build(
                "e",
                "j",
                (1, 1),
                &conf(&[("username", "u")]),
                "h".into(),
                1,
                None
            )
            .is_err()
        );
        assert!(
            build(
                "e",
                "j",
                (1, 1),
                &conf(&[("protocol", "gopher")]),
                "h".into(),
                1,
                None,
            )
            .is_err()
        );
    }
}
