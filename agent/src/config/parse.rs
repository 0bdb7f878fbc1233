//! Parsers for the values torchrun's flags take. Pure functions of a string, each with an
//! error that says what a valid value looks like.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nix::sys::signal::Signal;

/// `--nnodes`: `N` or `MIN:MAX` with `0 < MIN <= MAX`.
pub fn nnodes(s: &str) -> Result<(u32, u32), String> {
    let num = |p: &str| {
        p.trim()
            .parse::<u32>()
            .map_err(|_| format!("'{p}' is not a whole number"))
    };
    let (min, max) = match s.split_once(':') {
        None => {
            let n = num(s)?;
            (n, n)
        }
        Some((a, b)) => {
            if b.contains(':') {
                return Err("expected N or MIN:MAX, found more than one ':'".into());
            }
            (num(a)?, num(b)?)
        }
    };
    if min == 0 {
        return Err("the number of nodes must be at least 1".into());
    }
    if min > max {
        return Err(format!(
            "MIN ({min}) is greater than MAX ({max}); write MIN:MAX, e.g. {max}:{min}"
        ));
    }
    Ok((min, max))
}

/// What `--nproc-per-node` asked for, before devices are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NprocRequest {
    Count(u32),
    Gpu,
    Cpu,
    Auto,
}

/// `--nproc-per-node`: a positive number or `gpu`, `cpu`, `auto`.
pub fn nproc(s: &str) -> Result<NprocRequest, String> {
    match s.trim() {
        "gpu" => Ok(NprocRequest::Gpu),
        "cpu" => Ok(NprocRequest::Cpu),
        "auto" => Ok(NprocRequest::Auto),
        other => match other.parse::<u32>() {
            Ok(0) => Err("must be at least 1".into()),
            // Every node's workers get a rank: a count no group can hold is refused here,
            // not when the first round is sealed.
            Ok(n) if n > fsdp_rendezvous::ranks::MAX_LOCAL_WORLD_SIZE => Err(format!(
                "at most {} workers per node",
                fsdp_rendezvous::ranks::MAX_LOCAL_WORLD_SIZE
            )),
            Ok(n) => Ok(NprocRequest::Count(n)),
            Err(_) => Err("expected a positive number, `gpu`, `cpu` or `auto`".into()),
        },
    }
}

/// `--rdzv-conf`: `key=value,key=value`. Values cannot contain commas (as in torchrun); a
/// key given twice is an error rather than a silent override.
pub fn rdzv_conf(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    if s.trim().is_empty() {
        return Ok(out);
    }
    for item in s.split(',') {
        let item = item.trim();
        let Some((k, v)) = item.split_once('=') else {
            return Err(format!("'{}' is not key=value", redact_item(item)));
        };
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() {
            return Err(format!("'{}' has an empty key", redact_item(item)));
        }
        if v.is_empty() {
            return Err(format!("key '{k}' has an empty value"));
        }
        if out.insert(k.to_owned(), v.to_owned()).is_some() {
            return Err(format!("key '{k}' is given twice"));
        }
    }
    Ok(out)
}

/// Whether a `--rdzv-conf` item carries the etcd password. Anything that starts like
/// `password` but is not `password_file=` counts, so that a typo such as `password:x` is
/// hidden too.
fn is_password_item(item: &str) -> bool {
    let item = item.trim_start();
    item.starts_with("password") && !item.starts_with("password_file")
}

fn redact_item(item: &str) -> &str {
    if is_password_item(item) {
        "password=***"
    } else {
        item
    }
}

/// `--rdzv-conf` as it may be shown (`--print-config`, errors): the password item reads
/// `password=***`.
pub fn redact_rdzv_conf(s: &str) -> String {
    s.split(',').map(redact_item).collect::<Vec<_>>().join(",")
}

/// `--rdzv-conf` without its password item, as the workers get `PET_RDZV_CONF`.
pub fn without_password(s: &str) -> String {
    s.split(',')
        .filter(|item| !is_password_item(item))
        .collect::<Vec<_>>()
        .join(",")
}

/// Which standard streams of a worker a spec selects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    fn from_digit(d: &str) -> Result<Self, String> {
        match d.trim() {
            "0" => Ok(Self::default()),
            "1" => Ok(Self {
                stdout: true,
                stderr: false,
            }),
            "2" => Ok(Self {
                stdout: false,
                stderr: true,
            }),
            "3" => Ok(Self {
                stdout: true,
                stderr: true,
            }),
            other => Err(format!(
                "'{other}' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
            )),
        }
    }
}

/// `-r/--redirects` and `-t/--tee`: one value for all local ranks, or `rank:value,...`.
/// Unlike torchrun, local ranks above 9 can be addressed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamSpec {
    pub all: Streams,
    pub per_rank: BTreeMap<u32, Streams>,
}

impl StreamSpec {
    pub fn for_rank(&self, local_rank: u32) -> Streams {
        self.per_rank.get(&local_rank).copied().unwrap_or(self.all)
    }
}

pub fn stream_spec(s: &str) -> Result<StreamSpec, String> {
    if !s.contains(':') {
        return Ok(StreamSpec {
            all: Streams::from_digit(s)?,
            per_rank: BTreeMap::new(),
        });
    }
    let mut per_rank = BTreeMap::new();
    for item in s.split(',') {
        let Some((rank, v)) = item.split_once(':') else {
            return Err(format!("'{item}' is not local_rank:value"));
        };
        let rank = rank
            .trim()
            .parse::<u32>()
            .map_err(|_| format!("'{rank}' is not a local rank"))?;
        per_rank.insert(rank, Streams::from_digit(v)?);
    }
    Ok(StreamSpec {
        all: Streams::default(),
        per_rank,
    })
}

/// `--local-ranks-filter`: a comma list of local ranks; empty means all.
pub fn rank_list(s: &str) -> Result<Option<BTreeSet<u32>>, String> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.split(',')
        .map(|r| {
            r.trim()
                .parse::<u32>()
                .map_err(|_| format!("'{r}' is not a local rank"))
        })
        .collect::<Result<BTreeSet<_>, _>>()
        .map(Some)
}

/// `--duplicate-*-filters`: comma list, `,,` escapes a literal comma.
pub fn filter_list(s: &str) -> Vec<String> {
    if s.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out.retain(|f| !f.is_empty());
    out
}

/// The longest duration any flag or `--rdzv-conf` key takes: 7 days. Every timer the agent
/// sets is `now + d` (or a small sum of such durations); bounding `d` here keeps that
/// arithmetic far from overflow, where a huge value would otherwise panic or end a session.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// A duration: plain seconds (`30`, `0.5`) as torchrun takes them, or with a unit
/// (`500ms`, `2s`, `5m`, `1h`), at most [`MAX_DURATION`].
pub fn duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (seconds, or e.g. 500ms, 2s, 5m)"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{s}' (use ms, s, m or h)"
            ));
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("'{s}' is not a non-negative duration"));
    }
    // Compared as a float before converting: `Duration::from_secs_f64` panics on overflow.
    if secs > MAX_DURATION.as_secs_f64() {
        return Err(format!("'{s}' is too long: {TOO_LONG}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Why a duration above [`MAX_DURATION`] is refused.
pub const TOO_LONG: &str = "durations are at most 7 days (604800s, or 168h)";

/// A boolean from a `PET_*` variable. torchrun accepts integers; Kubeflow sets
/// `PET_STANDALONE` to the empty string to mean "on".
pub fn env_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "true" | "t" | "yes" | "y" | "on" => Ok(true),
        "0" | "false" | "f" | "no" | "n" | "off" => Ok(false),
        other => Err(format!("'{other}' is not a boolean (use 1 or 0)")),
    }
}

/// `--signals-to-handle`: names with or without the `SIG` prefix.
pub fn signals(s: &str) -> Result<Vec<Signal>, String> {
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let upper = name.to_ascii_uppercase();
        let full = if upper.starts_with("SIG") {
            upper
        } else {
            format!("SIG{upper}")
        };
        let sig: Signal = full
            .parse()
            .map_err(|_| format!("'{name}' is not a signal name (e.g. SIGTERM,SIGUSR1)"))?;
        if matches!(sig, Signal::SIGKILL | Signal::SIGSTOP | Signal::SIGCHLD) {
            return Err(format!("{sig} cannot be handled"));
        }
        if !out.contains(&sig) {
            out.push(sig);
        }
    }
    Ok(out)
}

/// Expands torchrun's log-line prefix macros.
pub fn expand_prefix(template: &str, role: &str, local_rank: u32, rank: u32, host: &str) -> String {
    template
        .replace("${role_name}", role)
        .replace("${local_rank}", &local_rank.to_string())
        .replace("${rank}", &rank.to_string())
        .replace("${hostname}", host)
}

/// `HOST:PORT` (a host name is resolved now) or `off`.
pub fn status_addr(s: &str) -> Result<Option<std::net::SocketAddr>, String> {
    use std::net::ToSocketAddrs;
    if s.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    if !s.contains(':') {
        return Err("expected HOST:PORT (e.g. 0.0.0.0:29450) or off".into());
    }
    s.to_socket_addrs()
        .map_err(|e| format!("cannot resolve it ({e}); expected HOST:PORT or off"))?
        .next()
        .map(Some)
        .ok_or_else(|| "the host has no address; expected HOST:PORT or off".into())
}

/// `--prewarm-modules`: comma-separated module names, each a dotted Python identifier
/// (they are imported by name, never evaluated). Empty: the interpreter alone.
pub fn modules(s: &str) -> Result<Vec<String>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(Vec::new());
    }
    let modules: Vec<String> = s.split(',').map(|m| m.trim().to_owned()).collect();
    for m in &modules {
        let ok = !m.is_empty()
            && m.split('.').all(|part| {
                let mut chars = part.chars();
                chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                    && chars.all(|c| c == '_' || c.is_alphanumeric())
            });
        if !ok {
            return Err(format!(
                "'{m}' is not a module name; expected names like torch,numpy"
            ));
        }
    }
    Ok(modules)
}

/// A TCP port, 1-65535 (`--master-port`, the port of an endpoint).
pub fn port(s: &str) -> Result<u16, String> {
    match s.trim().parse::<u16>() {
        Ok(0) | Err(_) => Err("expected a port number 1-65535".into()),
        Ok(p) => Ok(p),
    }
}

/// `host[:port]`, with IPv6 written `[addr]:port`.
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or("unclosed '[' in IPv6 address")?;
        let port = match tail.strip_prefix(':') {
            Some(p) => Some(port(p)?),
            None if tail.is_empty() => None,
            None => return Err(format!("unexpected '{tail}' after ']'")),
        };
        return Ok((host.to_owned(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Ok((h.to_owned(), Some(port(p)?))),
        _ => Ok((s.to_owned(), None)),
    }
}

/// `host[:port]` as [`split_host_port`], with the host checked as an etcd endpoint's is
/// (an IP address, IPv6 in brackets when a port follows, or a DNS name): the host becomes
/// the workers' `MASTER_ADDR`, and a value like `::::` must be refused here, not handed to
/// every worker to fail on.
pub fn checked_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    let (host, port) = split_host_port(s)?;
    if host.parse::<std::net::Ipv6Addr>().is_err() {
        super::etcd::check_host(&host).map_err(|reason| {
            format!(
                "{reason}; write a host name, an IPv4 address, or an IPv6 address in brackets (e.g. [fd00::1]:29500)"
            )
        })?;
    }
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_master_host_is_checked_like_an_etcd_host() {
        assert_eq!(
            checked_host_port("job-0:12"),
            Ok(("job-0".into(), Some(12)))
        );
        assert_eq!(checked_host_port("10.0.0.1"), Ok(("10.0.0.1".into(), None)));
        assert_eq!(
            checked_host_port("[fd00::1]:9"),
            Ok(("fd00::1".into(), Some(9)))
        );
        assert_eq!(checked_host_port("::1"), Ok(("::1".into(), None)));
        for (bad, says) in [
            ("::::", "'::::' is not a valid host name"),
            ("h\u{e9}\u{2603}:12", "not ASCII"),
            ("[::::]:1", "[fd00::1]"),
            ("a b:1", "not a valid host name"),
            ("", "not a valid host name"),
        ] {
            let err = checked_host_port(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn nnodes_forms() {
        assert_eq!(nnodes("2"), Ok((2, 2)));
        assert_eq!(nnodes("1:4"), Ok((1, 4)));
        assert!(nnodes("3:2").unwrap_err().contains("greater than MAX"));
        assert!(nnodes("0").is_err());
        assert!(nnodes("1:2:3").unwrap_err().contains("more than one"));
        assert!(nnodes("x").is_err());
    }

    #[test]
    fn nproc_forms() {
        assert_eq!(nproc("8"), Ok(NprocRequest::Count(8)));
        assert_eq!(nproc("gpu"), Ok(NprocRequest::Gpu));
        assert_eq!(nproc("auto"), Ok(NprocRequest::Auto));
        assert!(nproc("0").unwrap_err().contains("at least 1"));
        assert!(nproc("many").is_err());
    }

    #[test]
    fn rdzv_conf_forms() {
        let c = rdzv_conf("join_timeout=60, last_call_timeout=5").unwrap();
        assert_eq!(c["join_timeout"], "60");
        assert_eq!(c["last_call_timeout"], "5");
        assert!(rdzv_conf("").unwrap().is_empty());
        assert!(rdzv_conf("novalue").unwrap_err().contains("not key=value"));
        assert!(rdzv_conf("a=").unwrap_err().contains("empty value"));
        assert!(rdzv_conf("=1").unwrap_err().contains("empty key"));
        assert!(rdzv_conf("a=1,a=2").unwrap_err().contains("twice"));
    }

    #[test]
    fn the_password_item_is_hidden_or_dropped() {
        let conf = "username=u, password=s3cret,password_file=/p,join_timeout=5";
        assert_eq!(
            redact_rdzv_conf(conf),
            "username=u,password=***,password_file=/p,join_timeout=5"
        );
        assert_eq!(
            without_password(conf),
            "username=u,password_file=/p,join_timeout=5"
        );
        assert_eq!(without_password("password=x"), "");
        let err = rdzv_conf("password:s3cret").unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[test]
    fn stream_specs() {
        let all = stream_spec("3").unwrap();
        assert!(all.for_rank(7).stdout && all.for_rank(7).stderr);
        let per = stream_spec("0:1,12:2").unwrap();
        assert!(per.for_rank(0).stdout && !per.for_rank(0).stderr);
        assert!(per.for_rank(12).stderr);
        assert_eq!(per.for_rank(3), Streams::default());
        assert!(stream_spec("4").is_err());
        assert!(stream_spec("a:1").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("2m"), Ok(Duration::from_secs(120)));
        assert!(duration("soon").is_err());
        assert!(duration("3d").is_err());
        assert_eq!(duration("168h"), Ok(MAX_DURATION));
        assert_eq!(duration("604800"), Ok(MAX_DURATION));
        for huge in [
            "604800.5",
            "169h",
            "99999999999999999999999",
            "10000000000000000000",
        ] {
            let err = duration(huge).unwrap_err();
            assert!(err.contains("at most 7 days"), "{huge}: {err}");
        }
        assert!(
            duration("99999999999999999999999h")
                .unwrap_err()
                .contains("at most 7 days")
        );
    }

    #[test]
    fn env_bools() {
        assert_eq!(env_bool(""), Ok(true));
        assert_eq!(env_bool("1"), Ok(true));
        assert_eq!(env_bool("0"), Ok(false));
        assert!(env_bool("maybe").is_err());
    }

    #[test]
    fn signal_names() {
        assert_eq!(
            signals("SIGTERM,usr1").unwrap(),
            [Signal::SIGTERM, Signal::SIGUSR1]
        );
        assert!(signals("SIGKILL").is_err());
        assert!(signals("SIGNOPE").is_err());
    }

    #[test]
    fn filters_unescape_commas() {
        assert_eq!(filter_list("loss,,x,step"), ["loss,x", "step"]);
        assert!(filter_list("").is_empty());
    }

    #[test]
    fn prefix_macros() {
        assert_eq!(
            expand_prefix(
                "[${role_name}${local_rank}|${rank}@${hostname}]:",
                "default",
                1,
                5,
                "h"
            ),
            "[default1|5@h]:"
        );
    }

    #[test]
    fn rank_lists() {
        assert_eq!(rank_list("").unwrap(), None);
        assert_eq!(rank_list("0,3").unwrap().unwrap().len(), 2);
        assert!(rank_list("x").is_err());
    }

    #[test]
    fn prewarm_modules_are_dotted_names_or_nothing() {
        assert_eq!(
            modules(" torch, numpy.linalg ").unwrap(),
            ["torch", "numpy.linalg"]
        );
        assert!(modules("").unwrap().is_empty());
        for bad in ["torch;import os", "1torch", "torch,,numpy", "a..b"] {
            let err = modules(bad).unwrap_err();
            assert!(err.contains("is not a module name"), "{bad}: {err}");
        }
    }
}
