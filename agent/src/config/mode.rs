//! Mode selection: standalone, a static group, or the etcd rendezvous (on an etcd, or on
//! the store a c10d agent serves), and the `--rdzv-conf` keys checked against the chosen
//! backend.

use std::collections::BTreeMap;

use fsdp_rendezvous::etcd::EtcdConfig;
use fsdp_rendezvous::topology;

use super::sources::{Resolver, whole_number};
use super::{ConfigError, DEFAULT_MASTER_PORT, Mode, Source, etcd, parse, rdzv_keys, slurm};
use crate::cli::Args;

/// Where a node is told its place when neither `--rdzv-conf segment` nor Slurm says: a
/// Kubernetes pod sets it from a label through the downward API.
pub const SEGMENT_ENV: &str = "FSDP_AGENT_SEGMENT";

/// The group-shape values [`Resolver::mode`] needs, already parsed.
#[derive(Debug, Clone, Copy)]
pub(super) struct GroupArgs {
    pub(super) min_nodes: u32,
    pub(super) max_nodes: u32,
    pub(super) node_rank: u32,
    pub(super) master_port: Option<u16>,
    pub(super) nproc_per_node: u32,
}

/// How long a static group's first round waits for its nodes without `join_timeout`
/// (torchrun's static rendezvous: 600 s).
const STATIC_JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether `host` names this machine's loopback (which no other node can reach).
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The run id of a c10d job started without `--rdzv-id` (torchrun's default id).
const C10D_RUN_ID: &str = "none";

fn standalone() -> Mode {
    Mode::Standalone {
        master_addr: "localhost".into(),
    }
}

impl Resolver<'_> {
    /// `--rdzv-conf`, shown (recorded and in errors) with its password item hidden.
    pub(super) fn rdzv_conf(&mut self, raw: &str) -> Result<BTreeMap<String, String>, ConfigError> {
        let shown = parse::redact_rdzv_conf(raw);
        let conf =
            parse::rdzv_conf(raw).map_err(|reason| self.invalid("rdzv-conf", &shown, reason))?;
        self.record_flag("rdzv-conf", shown);
        Ok(conf)
    }

    pub(super) fn mode(
        &mut self,
        a: &Args,
        standalone: bool,
        g: GroupArgs,
        rdzv_conf: &BTreeMap<String, String>,
    ) -> Result<Mode, ConfigError> {
        self.record_flag("rdzv-backend", &a.rdzv_backend);
        self.record_flag("rdzv-endpoint", &a.rdzv_endpoint);
        let mode = if standalone {
            self.standalone_mode()
        } else {
            self.backend_mode(a, g, rdzv_conf)?
        };
        self.record_master(&mode, a, g);
        self.check_rdzv_conf(rdzv_conf, &mode)?;
        if let Some(k) = a
            .segment_size
            .as_deref()
            .filter(|_| !matches!(mode, Mode::Etcd(_)))
        {
            self.warn(format!(
                "--segment-size {k} has no effect without --rdzv-backend etcd or c10d: a single-node or static group has the nodes it is given"
            ));
        }
        let (desc, source) = self.describe_mode(&mode, standalone, g);
        self.record("rendezvous", desc, source);
        Ok(mode)
    }

    /// `MASTER_ADDR` and `MASTER_PORT` as the workers get them, with where each comes
    /// from: `--print-config` showed `master-addr 127.0.0.1 (default)` to a standalone job
    /// whose workers got `localhost`, and no port at all.
    fn record_master(&mut self, mode: &Mode, a: &Args, g: GroupArgs) {
        let endpoint = !a.rdzv_endpoint.trim().is_empty();
        match mode {
            Mode::Standalone { master_addr } => {
                let why = Source::Derived("one node: its workers meet on this machine".into());
                self.record("master-addr", master_addr, why.clone());
                self.record("master-port", "a free port, chosen each round", why);
            }
            Mode::Static {
                master_addr,
                master_port,
                ..
            } => {
                let from_endpoint = Source::Derived("--rdzv-endpoint".into());
                let addr_source = match endpoint {
                    true => from_endpoint.clone(),
                    false => self.source("master-addr"),
                };
                let port_source = match (g.master_port.is_some(), endpoint) {
                    (true, _) => self.source("master-port"),
                    (false, true) => from_endpoint,
                    (false, false) => Source::Default,
                };
                self.record("master-addr", master_addr, addr_source);
                self.record("master-port", master_port, port_source);
            }
            Mode::Etcd(_) => {
                let why = Source::Derived("the rendezvous: group rank 0's node".into());
                self.record(
                    "master-addr",
                    "group rank 0's --local-addr, each round",
                    why.clone(),
                );
                self.record(
                    "master-port",
                    "a free port on group rank 0's node, each round",
                    why,
                );
            }
        }
    }

    /// `--standalone`: one node whatever the rendezvous flags say, which are reported.
    fn standalone_mode(&mut self) -> Mode {
        let ignored: Vec<String> = ["rdzv-backend", "rdzv-endpoint", "nnodes"]
            .into_iter()
            .filter(|name| self.explicit(name))
            .map(|name| format!("--{name}"))
            .collect();
        if !ignored.is_empty() {
            self.warn(format!(
                "--standalone runs one node; ignoring {}",
                ignored.join(", ")
            ));
        }
        standalone()
    }

    fn backend_mode(
        &mut self,
        a: &Args,
        g: GroupArgs,
        rdzv_conf: &BTreeMap<String, String>,
    ) -> Result<Mode, ConfigError> {
        match a.rdzv_backend.trim().to_ascii_lowercase().as_str() {
            "static" => self.static_mode(a, g, rdzv_conf),
            "c10d" if g.max_nodes == 1 => {
                self.warn(
                    "--rdzv-backend c10d with one node runs as --standalone (the c10d store protocol is torchrun's own)",
                );
                Ok(standalone())
            }
            "c10d" => self.elastic_mode(a, g, rdzv_conf, true),
            "etcd" | "etcd-v2" | "etcd-v3" => self.elastic_mode(a, g, rdzv_conf, false),
            other => Err(self.invalid(
                "rdzv-backend",
                other,
                "expected static, etcd (etcd-v2, etcd-v3 are the same) or c10d",
            )),
        }
    }

    fn static_mode(
        &mut self,
        a: &Args,
        g: GroupArgs,
        rdzv_conf: &BTreeMap<String, String>,
    ) -> Result<Mode, ConfigError> {
        let GroupArgs {
            min_nodes,
            max_nodes,
            node_rank,
            master_port,
            ..
        } = g;
        if min_nodes != max_nodes {
            return Err(ConfigError::Conflict(format!(
                "--nnodes {min_nodes}:{max_nodes} is elastic but the static backend needs a fixed node count; \
                 use --rdzv-backend etcd or c10d for elastic jobs, or --nnodes N"
            )));
        }
        let endpoint = a.rdzv_endpoint.trim();
        if max_nodes == 1 && endpoint.is_empty() && master_port.is_none() {
            // torchrun does the same: one node with no master port runs as standalone
            // instead of colliding on port 29500.
            if self.explicit("master-addr") {
                self.warn(
                    "--master-addr is not used: one node without --master-port runs standalone on a free local port",
                );
            }
            return Ok(standalone());
        }
        let (master_addr, port) = if endpoint.is_empty() {
            let addr = a.master_addr.trim();
            // The workers' MASTER_ADDR as given: checked as an endpoint's host would be.
            if addr.parse::<std::net::Ipv6Addr>().is_err() {
                etcd::check_host(addr).map_err(|reason| {
                    self.invalid(
                        "master-addr",
                        addr,
                        format!("{reason}; write a host name or an IP address (the port is --master-port)"),
                    )
                })?;
            }
            (addr.to_owned(), master_port.unwrap_or(DEFAULT_MASTER_PORT))
        } else {
            let (h, p) = parse::checked_host_port(endpoint)
                .map_err(|reason| self.invalid("rdzv-endpoint", endpoint, reason))?;
            (h, p.or(master_port).unwrap_or(DEFAULT_MASTER_PORT))
        };
        if node_rank >= max_nodes {
            return Err(self.invalid(
                "node-rank",
                node_rank.to_string(),
                format!(
                    "must be below --nnodes {max_nodes} (node ranks are 0..{})",
                    max_nodes - 1
                ),
            ));
        }
        let join_timeout = match rdzv_conf.get("join_timeout") {
            Some(raw) => parse::duration(raw)
                .map_err(|reason| self.invalid("rdzv-conf join_timeout", raw, reason))?,
            None => STATIC_JOIN_TIMEOUT,
        };
        if max_nodes > 1 && is_loopback(&master_addr) {
            // The other nodes would knock at their own loopback: node 0 waits for them
            // until its join timeout, they for a node 0 that is not on their machine.
            self.warn(format!(
                "--master-addr {master_addr} is this machine's loopback, but --nnodes {max_nodes} needs the other nodes to reach node rank 0 there; give node rank 0's host name or address (fine only when every node runs on this machine)"
            ));
        }
        Ok(Mode::Static {
            nnodes: max_nodes,
            node_rank,
            master_addr,
            master_port: port,
            join_timeout,
        })
    }

    /// The etcd rendezvous, on an etcd or (`c10d`) on the store the agent at the endpoint
    /// serves. With c10d the run id may be left out, as with torchrun: the store belongs
    /// to one job.
    fn elastic_mode(
        &mut self,
        a: &Args,
        g: GroupArgs,
        rdzv_conf: &BTreeMap<String, String>,
        c10d: bool,
    ) -> Result<Mode, ConfigError> {
        let run_id = match a.rdzv_id.as_deref() {
            Some(id) => id,
            None if c10d => C10D_RUN_ID,
            None => {
                return Err(ConfigError::Conflict(
                    "--rdzv-id is required with --rdzv-backend etcd: without it every job on this etcd would share one \
                     rendezvous; pass a name unique to the job (Kubeflow: elasticPolicy.rdzvId)"
                        .into(),
                ));
            }
        };
        let addr = a
            .local_addr
            .clone()
            .unwrap_or_else(fsdp_rendezvous::hostname);
        let nodes = (g.min_nodes, g.max_nodes);
        let (endpoint, lws) = (&a.rdzv_endpoint, g.nproc_per_node);
        let password = (self.env)(etcd::PASSWORD_ENV);
        let build = if c10d { etcd::build_c10d } else { etcd::build };
        let mut m = build(
            endpoint,
            run_id,
            nodes,
            rdzv_conf,
            addr,
            lws,
            password.as_deref(),
        )
        .map_err(ConfigError::Conflict)?;
        self.topology(a, rdzv_conf, g, &mut m.rendezvous)?;
        Ok(Mode::Etcd(Box::new(m)))
    }

    /// Where this node sits and what rounds are made of: the segment from `--rdzv-conf
    /// segment` (read by [`etcd::build`]), else from Slurm's topology in a step, else from
    /// [`SEGMENT_ENV`]; and `--segment-size`. Both recorded with their source.
    fn topology(
        &mut self,
        a: &Args,
        conf: &BTreeMap<String, String>,
        g: GroupArgs,
        rc: &mut EtcdConfig,
    ) -> Result<(), ConfigError> {
        let source = if conf.contains_key("segment") {
            self.source("rdzv-conf")
        } else if let Some((segment, source)) =
            slurm::segment(self.env).map_err(ConfigError::Conflict)?
        {
            rc.segment = segment;
            source
        } else if let Some(raw) = (self.env)(SEGMENT_ENV) {
            self.segment_from_env(&raw, rc)?
        } else {
            Source::Default
        };
        let shown = if rc.segment.is_empty() {
            "none"
        } else {
            rc.segment.as_str()
        };
        self.record("segment", shown, source);
        let Some(raw) = a.segment_size.as_deref() else {
            return Ok(());
        };
        let nnodes = (g.min_nodes, g.max_nodes);
        rc.segment_size = self.value("segment-size", raw, |s| {
            let k = whole_number(s)?;
            topology::check_size(k, nnodes)?;
            Ok(k)
        })?;
        if rc.segment.is_empty() && rc.segment_size > 1 {
            self.warn(format!(
                "--segment-size {raw}: this node has no segment (--rdzv-conf segment, Slurm's SLURM_TOPOLOGY_ADDR or {SEGMENT_ENV}), so it makes blocks only with other nodes that have none"
            ));
        }
        Ok(())
    }

    /// The segment [`SEGMENT_ENV`] gives, checked. Empty, it is no location: a pod's
    /// variable set from a label the pod lacks is empty, and that is said.
    fn segment_from_env(&mut self, raw: &str, rc: &mut EtcdConfig) -> Result<Source, ConfigError> {
        if raw.trim().is_empty() {
            self.warn(format!(
                "{SEGMENT_ENV} is set but empty (is the pod label it is set from missing?): this node registers no segment, and its rank follows the nodes that have one"
            ));
            return Ok(Source::Default);
        }
        let segment = raw.trim();
        topology::check(segment).map_err(|e| ConfigError::Invalid {
            what: "segment".into(),
            value: fsdp_rendezvous::text::shown(segment).into_owned(),
            origin: format!("env {SEGMENT_ENV}"),
            reason: e.to_string(),
        })?;
        rc.segment = segment.to_owned();
        Ok(Source::Env(SEGMENT_ENV.into()))
    }

    /// The `rendezvous` line of `--print-config`.
    fn describe_mode(&self, mode: &Mode, standalone: bool, g: GroupArgs) -> (String, Source) {
        match mode {
            Mode::Standalone { .. } if standalone => {
                ("standalone".to_owned(), self.recorded_source("standalone"))
            }
            Mode::Standalone { .. } => (
                "standalone".to_owned(),
                Source::Derived("one node and no master port or endpoint".into()),
            ),
            Mode::Etcd(m) => {
                let (what, served, flags) = if m.store.is_some() {
                    (
                        "c10d store=",
                        " (served by the agent there, etcd's protocol)",
                        "--rdzv-backend c10d with --rdzv-endpoint, --nnodes, --rdzv-conf",
                    )
                } else {
                    (
                        "etcd endpoints=",
                        "",
                        "--rdzv-backend etcd with --rdzv-endpoint, --rdzv-id, --nnodes, --rdzv-conf",
                    )
                };
                (
                    format!(
                        "{what}{}{served} nnodes={}:{} addr={} lease_ttl={:?} last_call={:?} exit_barrier={:?}",
                        m.rendezvous.options.endpoints.join(","),
                        g.min_nodes,
                        g.max_nodes,
                        m.rendezvous.addr,
                        m.rendezvous.keep_alive_ttl,
                        m.rendezvous.last_call,
                        m.exit_barrier
                    ),
                    Source::Derived(flags.into()),
                )
            }
            Mode::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
                join_timeout,
            } => (
                format!(
                    // Static nodes share no records, so none can learn that the others
                    // finished: said here, where a torchrun user would expect 300 s.
                    "static nnodes={nnodes} node_rank={node_rank} master={master_addr}:{master_port} join_timeout={join_timeout:?} exit_barrier=none"
                ),
                Source::Derived(
                    "--rdzv-backend static with --nnodes, --node-rank, --master-addr/port".into(),
                ),
            ),
        }
    }

    /// Known torchrun keys that mean nothing for the chosen backend are reported with why,
    /// not silently dropped; unknown keys are an error.
    fn check_rdzv_conf(
        &mut self,
        conf: &BTreeMap<String, String>,
        mode: &Mode,
    ) -> Result<(), ConfigError> {
        let (read, backend): (fn(&rdzv_keys::Key) -> bool, &str) = match mode {
            Mode::Etcd(m) if m.store.is_some() => (|k| k.c10d, "the c10d rendezvous"),
            Mode::Etcd(_) => (|k| k.etcd, "the etcd rendezvous"),
            // The static group's first round waits for its nodes (`crate::static_gate`).
            Mode::Static { .. } => (|k| k.name == "join_timeout", "a static rendezvous"),
            _ => (|_| false, "a single-node rendezvous"),
        };
        let mut unused = Vec::new();
        for key in conf.keys() {
            let Some(known) = rdzv_keys::find(key) else {
                let known: Vec<&str> = rdzv_keys::KEYS.iter().map(|k| k.name).collect();
                return Err(ConfigError::Invalid {
                    what: "--rdzv-conf key".into(),
                    value: key.clone(),
                    origin: self.origin("rdzv-conf"),
                    reason: format!("unknown key; known keys: {}", known.join(", ")),
                });
            };
            if !read(&known) {
                unused.push(known);
            }
        }
        if !unused.is_empty() {
            let names: Vec<&str> = unused.iter().map(|k| k.name).collect();
            // Why each is let go, where the table says; a single-node run reads none.
            let notes: Vec<String> = unused
                .iter()
                .filter(|k| matches!(mode, Mode::Etcd(_)) && !k.note.is_empty())
                .map(|k| format!("{}: {}", k.name, k.note))
                .collect();
            let why = if notes.is_empty() {
                String::new()
            } else {
                format!(" ({})", notes.join("; "))
            };
            self.warn(format!(
                "--rdzv-conf {} has no effect with {backend}{why}",
                names.join(",")
            ));
        }
        Ok(())
    }

    pub(super) fn run_id(&mut self, a: &Args, mode: &Mode) -> String {
        match (&a.rdzv_id, mode) {
            (Some(id), _) => {
                self.record_flag("rdzv-id", id);
                id.clone()
            }
            (None, Mode::Standalone { .. }) => {
                let id = uuid::Uuid::new_v4().to_string();
                self.record(
                    "rdzv-id",
                    &id,
                    Source::Derived("fresh per standalone run".into()),
                );
                id
            }
            (None, Mode::Etcd(m)) if m.store.is_some() => {
                self.record(
                    "rdzv-id",
                    C10D_RUN_ID,
                    Source::Derived("torchrun's default; the c10d store is the job's own".into()),
                );
                C10D_RUN_ID.into()
            }
            // The etcd mode refuses to start without --rdzv-id; this is its copy.
            (None, Mode::Etcd(m)) => m.rendezvous.run_id.clone(),
            (None, Mode::Static { .. }) => {
                self.record("rdzv-id", "none", Source::Default);
                "none".into()
            }
        }
    }
}
