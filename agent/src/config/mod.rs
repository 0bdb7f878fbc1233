//! The resolved configuration: every flag and `PET_*` variable parsed, checked and tied to
//! where its value came from.
//!
//! [`resolve`] is the only place that reads flags and environment together. It either returns
//! a [`Config`] the agent can run as is, or a [`ConfigError`] naming the bad value, where it
//! came from and how to fix it; nothing has been spawned at that point.

mod entrypoint;
pub mod etcd;
pub mod parse;
mod print;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use nix::sys::signal::Signal;

use crate::cli::Args;
pub use entrypoint::Entrypoint;
pub use parse::{StreamSpec, Streams};

/// Default grace between the stop signal and SIGKILL (torchrun's `--shutdown-timeout`).
pub const DEFAULT_TERM_TIMEOUT: Duration = Duration::from_secs(30);
/// Master port of a static group when none is given (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// How this node finds its group.
#[derive(Debug, Clone)]
pub enum Mode {
    /// One node, in-process rendezvous, a free master port on `master_addr`.
    Standalone { master_addr: String },
    /// Elastic: the etcd v3 rendezvous (`--rdzv-backend etcd`, `etcd-v2`, `etcd-v3`).
    Etcd(Box<etcd::EtcdMode>),
    /// A fixed group: ranks and master given up front.
    Static {
        nnodes: u32,
        node_rank: u32,
        master_addr: String,
        master_port: u16,
    },
}

/// Where worker output goes.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Base log dir; a fresh temporary one is made when unset.
    pub dir: Option<PathBuf>,
    pub redirects: StreamSpec,
    pub tee: StreamSpec,
    /// Local ranks whose output reaches the console; `None` means all.
    pub console_ranks: Option<BTreeSet<u32>>,
    pub prefix_template: String,
    pub stdout_filters: Vec<String>,
    pub stderr_filters: Vec<String>,
}

/// The agent's own log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Where a configuration value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(String),
    Env(String),
    Default,
    /// Computed from other values; the string says how.
    Derived(String),
}

/// One line of the configuration printout.
#[derive(Debug, Clone)]
pub struct Setting {
    pub name: &'static str,
    pub value: String,
    pub source: Source,
}

/// Everything the agent needs to run.
#[derive(Debug, Clone)]
pub struct Config {
    pub mode: Mode,
    pub run_id: String,
    pub nproc_per_node: u32,
    pub role: String,
    pub max_restarts: u32,
    pub monitor_interval: Duration,
    pub term_timeout: Duration,
    pub entrypoint: Entrypoint,
    pub logs: LogConfig,
    pub signals: Vec<Signal>,
    pub virtual_local_rank: bool,
    pub local_addr: Option<String>,
    /// Set `OMP_NUM_THREADS=1` for the workers (unset in the agent's env and nproc > 1).
    pub omp_threads_default: bool,
    pub log_format: LogFormat,
    pub status: StatusAddr,
    pub console_events: bool,
    pub print_config: bool,
    pub settings: Vec<Setting>,
    /// Things the user should know that do not stop the run.
    pub warnings: Vec<String>,
    /// Variables of the agent's environment the workers get changed: `Some` replaces the
    /// value, `None` removes the variable (the etcd password; see `worker_env::scrub`).
    pub worker_env_scrub: Vec<(String, Option<String>)>,
}

/// Where the status server listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusAddr {
    Off,
    /// `required` is false for the default address: a node that runs two agents (or a
    /// test machine) loses only the second one's status server to a busy port, not its
    /// training. An address the user chose must bind or the agent refuses to start.
    Listen {
        addr: std::net::SocketAddr,
        required: bool,
    },
}

/// A configuration that cannot run. Printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {what} '{value}' (from {origin}): {reason}")]
    Invalid {
        what: String,
        value: String,
        origin: String,
        reason: String,
    },
    #[error("{0}")]
    Conflict(String),
    #[error("{flag} is not supported by fsdp-agent: {hint}")]
    Unsupported {
        flag: &'static str,
        hint: &'static str,
    },
    #[error("{0}")]
    Entrypoint(String),
    #[error("{0}; see fsdp-agent --help")]
    CommandLine(String),
}

/// Parses `argv` and the environment into a [`Config`]. Help and version requests come
/// back as `Err(Ok(text))` so the caller can print them and exit 0.
pub fn resolve(
    argv: Vec<OsString>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, Result<String, ConfigError>> {
    let command = Args::command();
    // Only the words up to the script go through clap; the rest are the script's, verbatim.
    let (argv, script_args) = match crate::cli::script_index(&command, &argv) {
        Some(i) => {
            let mut argv = argv;
            let rest = argv.split_off(i + 1);
            (argv, rest)
        }
        None => (argv, Vec::new()),
    };
    let script_args = script_args
        .into_iter()
        .map(|a| {
            a.into_string().map_err(|a| {
                Err(ConfigError::CommandLine(format!(
                    "script argument {a:?} is not valid UTF-8"
                )))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let matches = match command.clone().try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) => {
            use clap::error::ErrorKind;
            return Err(match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Ok(e.render().to_string()),
                _ => Err(ConfigError::CommandLine(clap_message(&e))),
            });
        }
    };
    let mut args = Args::from_arg_matches(&matches)
        .map_err(|e| Err(ConfigError::CommandLine(clap_message(&e))))?;
    args.script_args = script_args;
    Resolver {
        command,
        matches,
        env,
        settings: Vec::new(),
        warnings: Vec::new(),
    }
    .resolve(args)
    .map_err(Err)
}

/// A clap error as one complete line. clap's own text spreads over several lines (the
/// missing argument on the line after "were not provided:", then usage and tips).
fn clap_message(e: &clap::Error) -> String {
    use clap::error::ErrorKind;
    if e.kind() == ErrorKind::MissingRequiredArgument {
        // The training script is the only required argument.
        return "the training script is missing: fsdp-agent [options] TRAINING_SCRIPT [script args...]"
            .into();
    }
    let text = e.render().to_string();
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"));
    let mut out = lines
        .next()
        .unwrap_or("bad command line")
        .trim_start_matches("error: ")
        .to_owned();
    for l in lines {
        // clap's "use '-- --flag'" tip would make the flag the training script here.
        if l.starts_with("tip: to pass") {
            continue;
        }
        if out.ends_with(':') {
            out.push(' ');
        } else {
            out.push_str("; ");
        }
        out.push_str(l);
    }
    out
}

/// The group-shape values [`Resolver::mode`] needs, already parsed.
#[derive(Debug, Clone, Copy)]
struct GroupArgs {
    min_nodes: u32,
    max_nodes: u32,
    node_rank: u32,
    master_port: Option<u16>,
    nproc_per_node: u32,
}

struct Resolver<'a> {
    command: clap::Command,
    matches: ArgMatches,
    env: &'a dyn Fn(&str) -> Option<String>,
    settings: Vec<Setting>,
    warnings: Vec<String>,
}

impl Config {
    /// How long a node whose workers all succeeded waits for the rest of its round.
    pub fn exit_barrier(&self) -> Duration {
        match &self.mode {
            Mode::Etcd(m) => m.exit_barrier,
            _ => Duration::ZERO,
        }
    }
}

impl Resolver<'_> {
    /// Where the clap argument `id` got its value.
    fn source(&self, id: &str) -> Source {
        let arg = self.command.get_arguments().find(|a| a.get_id() == id);
        match self.matches.value_source(id) {
            Some(ValueSource::CommandLine) => Source::Flag(format!(
                "--{}",
                arg.and_then(|a| a.get_long()).unwrap_or(id)
            )),
            Some(ValueSource::EnvVariable) => Source::Env(
                arg.and_then(|a| a.get_env())
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
            _ => Source::Default,
        }
    }

    fn explicit(&self, id: &str) -> bool {
        !matches!(self.source(id), Source::Default)
    }

    fn origin(&self, id: &str) -> String {
        describe(&self.source(id))
    }

    fn record(&mut self, name: &'static str, value: impl ToString, source: Source) {
        self.settings.push(Setting {
            name,
            value: value.to_string(),
            source,
        });
    }

    /// Parses a clap value with `parse`, turning a failure into an error that names the
    /// flag and the origin of the value, and records the result.
    fn value<T>(
        &mut self,
        id: &str,
        name: &'static str,
        raw: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let parsed = parse(raw).map_err(|reason| ConfigError::Invalid {
            what: format!("--{name}"),
            value: raw.to_owned(),
            origin: self.origin(id),
            reason,
        })?;
        let source = self.source(id);
        self.record(name, raw, source);
        Ok(parsed)
    }

    /// A boolean flag: on when given, else from its `PET_*` variable, else off.
    fn flag(&mut self, name: &'static str, on: bool, env_name: &str) -> Result<bool, ConfigError> {
        let (v, source) = if on {
            (true, Source::Flag(format!("--{name}")))
        } else if let Some(raw) = (self.env)(env_name) {
            let v = parse::env_bool(&raw).map_err(|reason| ConfigError::Invalid {
                what: format!("--{name}"),
                value: raw.clone(),
                origin: format!("env {env_name}"),
                reason,
            })?;
            (v, Source::Env(env_name.to_owned()))
        } else {
            (false, Source::Default)
        };
        self.record(name, v, source);
        Ok(v)
    }

    fn resolve(mut self, a: Args) -> Result<Config, ConfigError> {
        for (given, flag, hint) in [
            (
                a.logs_specs.is_some(),
                "--logs-specs",
                "it loads a Python plugin; use --log-dir, --redirects and --tee",
            ),
            (
                a.numa_binding.is_some(),
                "--numa-binding",
                "bind workers with numactl in the entrypoint instead",
            ),
            (
                a.print_completion.is_some(),
                "--print-completion",
                "shell completion is not provided yet",
            ),
        ] {
            if given {
                return Err(ConfigError::Unsupported { flag, hint });
            }
        }

        let standalone = self.flag("standalone", a.standalone, "PET_STANDALONE")?;
        let module = self.flag("module", a.module, "PET_MODULE")?;
        let no_python = self.flag("no-python", a.no_python, "PET_NO_PYTHON")?;
        let run_path = self.flag("run-path", a.run_path, "PET_RUN_PATH")?;
        let virtual_local_rank = self.flag(
            "virtual-local-rank",
            a.virtual_local_rank,
            "PET_VIRTUAL_LOCAL_RANK",
        )?;

        let (min_nodes, max_nodes) = self.value("nnodes", "nnodes", &a.nnodes, parse::nnodes)?;
        let nproc_req = self.value(
            "nproc_per_node",
            "nproc-per-node",
            &a.nproc_per_node,
            parse::nproc,
        )?;
        let nproc_per_node = self.count_workers(nproc_req)?;
        let max_restarts = self.value("max_restarts", "max-restarts", &a.max_restarts, |s| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| "expected a whole number ≥ 0".to_owned())
        })?;
        let monitor_interval = self.value(
            "monitor_interval",
            "monitor-interval",
            &a.monitor_interval,
            parse::duration,
        )?;
        if monitor_interval.is_zero() {
            return Err(ConfigError::Invalid {
                what: "--monitor-interval".into(),
                value: a.monitor_interval.clone(),
                origin: self.origin("monitor_interval"),
                reason: "must be greater than 0".into(),
            });
        }
        let rdzv_conf = self.rdzv_conf(&a.rdzv_conf)?;
        let node_rank = self.value("node_rank", "node-rank", &a.node_rank, |s| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| "expected a whole number ≥ 0".to_owned())
        })?;
        let master_port = match &a.master_port {
            Some(p) => Some(self.value("master_port", "master-port", p, port)?),
            None => None,
        };
        let term_timeout = self.term_timeout(&a)?;
        let signals = self.value(
            "signals_to_handle",
            "signals-to-handle",
            &a.signals_to_handle,
            parse::signals,
        )?;

        self.value(
            "start_method",
            "start-method",
            &a.start_method,
            |s| match s {
                "spawn" | "fork" | "forkserver" => Ok(()),
                _ => Err("expected spawn, fork or forkserver".into()),
            },
        )?;
        if self.explicit("start_method") {
            self.warnings.push(
                "--start-method has no effect: fsdp-agent always execs workers (as torchrun does for scripts)".into(),
            );
        }
        let console_events = self.value(
            "event_log_handler",
            "event-log-handler",
            &a.event_log_handler,
            |s| match s {
                "null" => Ok(false),
                "console" => Ok(true),
                _ => Err("expected null or console".into()),
            },
        )?;
        self.value("role", "role", &a.role, |s| {
            if s.is_empty() {
                Err("must not be empty".into())
            } else {
                Ok(())
            }
        })?;

        let group = GroupArgs {
            min_nodes,
            max_nodes,
            node_rank,
            master_port,
            nproc_per_node,
        };
        let mode = self.mode(&a, standalone, group, &rdzv_conf)?;
        let run_id = self.run_id(&a, &mode);
        let entrypoint = entrypoint::resolve(
            &a.training_script,
            &a.script_args,
            module,
            no_python,
            run_path,
            self.env,
        )?;
        self.record(
            "entrypoint",
            entrypoint.display(),
            Source::Derived("training script and mode flags".into()),
        );
        let logs = self.logs(&a)?;
        let log_format = self.value("log_format", "log-format", &a.log_format, |s| match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err("expected text or json".into()),
        })?;
        let status = self.value(
            "status_addr",
            "status-addr",
            &a.status_addr,
            parse::status_addr,
        )?;
        let status = match status {
            Some(addr) => StatusAddr::Listen {
                addr,
                required: !matches!(self.source("status_addr"), Source::Default),
            },
            None => StatusAddr::Off,
        };
        let local_addr = a.local_addr.clone();
        if let Some(addr) = &local_addr {
            let src = self.source("local_addr");
            self.record("local-addr", addr, src);
            if !matches!(mode, Mode::Etcd(_)) {
                self.warnings.push(format!(
                    "--local-addr {addr} has no effect with a single-node or static rendezvous (the master is --master-addr)"
                ));
            }
        }
        if console_events {
            self.warnings.push(
                "--event-log-handler console: the agent's events are its log lines (see --log-format json)".into(),
            );
        }
        if virtual_local_rank {
            let visible = (self.env)("CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty());
            if let Some(v) = visible {
                let n = v.split(',').count() as u32;
                if n < nproc_per_node {
                    return Err(ConfigError::Conflict(format!(
                        "--virtual-local-rank gives each worker one device, but CUDA_VISIBLE_DEVICES={v} lists {n} for {nproc_per_node} workers"
                    )));
                }
            }
        }
        let omp_threads_default = nproc_per_node > 1 && (self.env)("OMP_NUM_THREADS").is_none();

        Ok(Config {
            mode,
            run_id,
            nproc_per_node,
            role: a.role,
            max_restarts,
            monitor_interval,
            term_timeout,
            entrypoint,
            logs,
            signals,
            virtual_local_rank,
            local_addr,
            omp_threads_default,
            log_format,
            status,
            console_events,
            print_config: a.print_config,
            worker_env_scrub: self.worker_env_scrub(),
            settings: self.settings,
            warnings: self.warnings,
        })
    }

    fn count_workers(&mut self, req: parse::NprocRequest) -> Result<u32, ConfigError> {
        use parse::NprocRequest::*;
        let gpus = || crate::devices::gpu_count(self.env);
        let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let (n, how) = match req {
            Count(n) => return Ok(n),
            Cpu => (cpus(), "cpu: CPUs available to this process"),
            Gpu => match gpus() {
                0 => {
                    return Err(ConfigError::Invalid {
                        what: "--nproc-per-node".into(),
                        value: "gpu".into(),
                        origin: self.origin("nproc_per_node"),
                        reason: "no NVIDIA GPU is visible (no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES is empty); use a number or `cpu`".into(),
                    });
                }
                n => (n, "gpu: visible NVIDIA GPUs"),
            },
            Auto => match gpus() {
                0 => (cpus(), "auto: no GPU, so CPUs available"),
                n => (n, "auto: visible NVIDIA GPUs"),
            },
        };
        self.record("nproc-per-node (resolved)", n, Source::Derived(how.into()));
        Ok(n)
    }

    /// `--rdzv-conf`, shown (recorded and in errors) with its password item hidden.
    fn rdzv_conf(&mut self, raw: &str) -> Result<BTreeMap<String, String>, ConfigError> {
        let shown = parse::redact_rdzv_conf(raw);
        let conf = parse::rdzv_conf(raw).map_err(|reason| ConfigError::Invalid {
            what: "--rdzv-conf".into(),
            value: shown.clone(),
            origin: self.origin("rdzv_conf"),
            reason,
        })?;
        let source = self.source("rdzv_conf");
        self.record("rdzv-conf", shown, source);
        Ok(conf)
    }

    /// What the workers must not inherit from the agent: the password variable, and the
    /// password item of `PET_RDZV_CONF` (the rest of it stays, as torchrun passes it on).
    fn worker_env_scrub(&self) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        if (self.env)(etcd::PASSWORD_ENV).is_some() {
            out.push((etcd::PASSWORD_ENV.to_owned(), None));
        }
        if let Some(conf) = (self.env)("PET_RDZV_CONF") {
            let kept = parse::without_password(&conf);
            if kept != conf {
                out.push(("PET_RDZV_CONF".to_owned(), Some(kept)));
            }
        }
        out
    }

    fn term_timeout(&mut self, a: &Args) -> Result<Duration, ConfigError> {
        if let Some(raw) = &a.term_timeout {
            return self.value("term_timeout", "term-timeout", raw, parse::duration);
        }
        if let Some(raw) = (self.env)("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
            let d = parse::duration(&raw).map_err(|reason| ConfigError::Invalid {
                what: "--term-timeout".into(),
                value: raw.clone(),
                origin: "env TORCH_ELASTIC_SHUTDOWN_TIMEOUT".into(),
                reason,
            })?;
            self.record(
                "term-timeout",
                raw,
                Source::Env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT".into()),
            );
            return Ok(d);
        }
        self.record("term-timeout", "30", Source::Default);
        Ok(DEFAULT_TERM_TIMEOUT)
    }

    fn mode(
        &mut self,
        a: &Args,
        standalone: bool,
        g: GroupArgs,
        rdzv_conf: &BTreeMap<String, String>,
    ) -> Result<Mode, ConfigError> {
        let GroupArgs {
            min_nodes,
            max_nodes,
            node_rank,
            master_port,
            nproc_per_node,
        } = g;
        let backend = a.rdzv_backend.trim().to_ascii_lowercase();
        for (id, name, value) in [
            ("rdzv_backend", "rdzv-backend", &a.rdzv_backend),
            ("rdzv_endpoint", "rdzv-endpoint", &a.rdzv_endpoint),
            ("master_addr", "master-addr", &a.master_addr),
        ] {
            let source = self.source(id);
            self.record(name, value, source);
        }
        let single = max_nodes == 1;
        let standalone_mode = || Mode::Standalone {
            master_addr: "localhost".into(),
        };
        let mode = if standalone {
            let ignored: Vec<&str> = [
                ("rdzv_backend", "--rdzv-backend"),
                ("rdzv_endpoint", "--rdzv-endpoint"),
                ("nnodes", "--nnodes"),
            ]
            .into_iter()
            .filter(|(id, _)| self.explicit(id))
            .map(|(_, f)| f)
            .collect();
            if !ignored.is_empty() {
                self.warnings.push(format!(
                    "--standalone runs one node; ignoring {}",
                    ignored.join(", ")
                ));
            }
            standalone_mode()
        } else {
            match backend.as_str() {
                "static" => {
                    if min_nodes != max_nodes {
                        return Err(ConfigError::Conflict(format!(
                            "--nnodes {min_nodes}:{max_nodes} is elastic but the static backend needs a fixed node count; \
                             use --rdzv-backend etcd for elastic jobs or --nnodes N"
                        )));
                    }
                    let endpoint = a.rdzv_endpoint.trim();
                    if single && endpoint.is_empty() && master_port.is_none() {
                        // torchrun does the same: one node with no master port runs as
                        // standalone instead of colliding on port 29500.
                        if self.explicit("master_addr") {
                            self.warnings.push(
                                "--master-addr is not used: one node without --master-port runs standalone on a free local port".into(),
                            );
                        }
                        standalone_mode()
                    } else {
                        let (master_addr, port) = if endpoint.is_empty() {
                            (
                                a.master_addr.clone(),
                                master_port.unwrap_or(DEFAULT_MASTER_PORT),
                            )
                        } else {
                            let (h, p) = split_host_port(endpoint).map_err(|reason| {
                                ConfigError::Invalid {
                                    what: "--rdzv-endpoint".into(),
                                    value: endpoint.into(),
                                    origin: self.origin("rdzv_endpoint"),
                                    reason,
                                }
                            })?;
                            (h, p.or(master_port).unwrap_or(DEFAULT_MASTER_PORT))
                        };
                        if node_rank >= max_nodes {
                            return Err(ConfigError::Invalid {
                                what: "--node-rank".into(),
                                value: node_rank.to_string(),
                                origin: self.origin("node_rank"),
                                reason: format!(
                                    "must be below --nnodes {max_nodes} (node ranks are 0..{})",
                                    max_nodes - 1
                                ),
                            });
                        }
                        Mode::Static {
                            nnodes: max_nodes,
                            node_rank,
                            master_addr,
                            master_port: port,
                        }
                    }
                }
                "c10d" if single => {
                    self.warnings.push(
                        "--rdzv-backend c10d with one node runs as --standalone (the c10d store protocol is torchrun's own)".into(),
                    );
                    standalone_mode()
                }
                "c10d" => {
                    return Err(ConfigError::Conflict(
                        "--rdzv-backend c10d keeps the rendezvous inside one training pod and is not supported for several nodes; \
                         use --rdzv-backend etcd --rdzv-endpoint <etcd host:2379>"
                            .into(),
                    ));
                }
                "etcd" | "etcd-v2" | "etcd-v3" => {
                    let Some(run_id) = a.rdzv_id.as_deref() else {
                        return Err(ConfigError::Conflict(
                            "--rdzv-id is required with --rdzv-backend etcd: without it every job on this etcd would share one \
                             rendezvous; pass a name unique to the job (Kubeflow: elasticPolicy.rdzvId)"
                                .into(),
                        ));
                    };
                    let addr = a
                        .local_addr
                        .clone()
                        .unwrap_or_else(fsdp_rendezvous::hostname);
                    let m = etcd::build(
                        &a.rdzv_endpoint,
                        run_id,
                        (min_nodes, max_nodes),
                        rdzv_conf,
                        addr,
                        nproc_per_node,
                        (self.env)(etcd::PASSWORD_ENV).as_deref(),
                    )
                    .map_err(ConfigError::Conflict)?;
                    Mode::Etcd(Box::new(m))
                }
                other => {
                    return Err(ConfigError::Invalid {
                        what: "--rdzv-backend".into(),
                        value: other.into(),
                        origin: self.origin("rdzv_backend"),
                        reason: "expected static, etcd (etcd-v2, etcd-v3 are the same) or c10d"
                            .into(),
                    });
                }
            }
        };
        self.check_rdzv_conf(rdzv_conf, matches!(mode, Mode::Etcd(_)))?;
        let (desc, source) = match &mode {
            Mode::Standalone { .. } if standalone => {
                ("standalone".to_owned(), self.source_of_standalone())
            }
            Mode::Standalone { .. } => (
                "standalone".to_owned(),
                Source::Derived("one node and no master port or endpoint".into()),
            ),
            Mode::Etcd(m) => (
                format!(
                    "etcd endpoints={} nnodes={min_nodes}:{max_nodes} addr={} lease_ttl={:?} last_call={:?}",
                    m.rendezvous.options.endpoints.join(","),
                    m.rendezvous.addr,
                    m.rendezvous.keep_alive_ttl,
                    m.rendezvous.last_call
                ),
                Source::Derived(
                    "--rdzv-backend etcd with --rdzv-endpoint, --rdzv-id, --nnodes, --rdzv-conf"
                        .into(),
                ),
            ),
            Mode::Static {
                nnodes,
                node_rank,
                master_addr,
                master_port,
            } => (
                format!(
                    "static nnodes={nnodes} node_rank={node_rank} master={master_addr}:{master_port}"
                ),
                Source::Derived(
                    "--rdzv-backend static with --nnodes, --node-rank, --master-addr/port".into(),
                ),
            ),
        };
        self.record("rendezvous", desc, source);
        Ok(mode)
    }

    fn source_of_standalone(&self) -> Source {
        self.settings
            .iter()
            .find(|s| s.name == "standalone")
            .map(|s| s.source.clone())
            .unwrap_or(Source::Default)
    }

    /// Known torchrun keys that mean nothing for the chosen backend are reported, not
    /// silently dropped; unknown keys are an error.
    fn check_rdzv_conf(
        &mut self,
        conf: &BTreeMap<String, String>,
        etcd: bool,
    ) -> Result<(), ConfigError> {
        const KNOWN: &[&str] = &[
            "keep_alive_ttl",
            "straggler_timeout",
            "connect_timeout",
            "username",
            "password",
            "password_file",
            "join_timeout",
            "last_call_timeout",
            "close_timeout",
            "heartbeat_timeout",
            "keep_alive_interval",
            "keep_alive_max_attempt",
            "timeout",
            "read_timeout",
            "is_host",
            "store_type",
            "etcd_prefix",
            "protocol",
            "cacert",
            "cert",
            "key",
            "ca_cert",
            "ssl_cert",
            "ssl_cert_key",
            "rank",
            "cas_backoff_max_seconds",
        ];
        for key in conf.keys() {
            if !KNOWN.contains(&key.as_str()) {
                return Err(ConfigError::Invalid {
                    what: "--rdzv-conf key".into(),
                    value: key.clone(),
                    origin: self.origin("rdzv_conf"),
                    reason: format!("unknown key; known keys: {}", KNOWN.join(", ")),
                });
            }
        }
        let unused: Vec<&str> = conf
            .keys()
            .map(String::as_str)
            .filter(|k| !etcd || !etcd::KEYS.contains(k))
            .collect();
        if !unused.is_empty() {
            let backend = if etcd {
                "the etcd rendezvous"
            } else {
                "a single-node or static rendezvous"
            };
            self.warnings.push(format!(
                "--rdzv-conf {} has no effect with {backend}",
                unused.join(",")
            ));
        }
        Ok(())
    }

    fn run_id(&mut self, a: &Args, mode: &Mode) -> String {
        match (&a.rdzv_id, mode) {
            (Some(id), _) => {
                let src = self.source("rdzv_id");
                self.record("rdzv-id", id, src);
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
            // The etcd mode refuses to start without --rdzv-id; this is its copy.
            (None, Mode::Etcd(m)) => m.rendezvous.run_id.clone(),
            (None, Mode::Static { .. }) => {
                self.record("rdzv-id", "none", Source::Default);
                "none".into()
            }
        }
    }

    fn logs(&mut self, a: &Args) -> Result<LogConfig, ConfigError> {
        let redirects = self.value("redirects", "redirects", &a.redirects, parse::stream_spec)?;
        let tee = self.value("tee", "tee", &a.tee, parse::stream_spec)?;
        let console_ranks = self.value(
            "local_ranks_filter",
            "local-ranks-filter",
            &a.local_ranks_filter,
            parse::rank_list,
        )?;
        let stdout_filters = self.value(
            "duplicate_stdout_filters",
            "duplicate-stdout-filters",
            &a.duplicate_stdout_filters,
            |s| Ok(parse::filter_list(s)),
        )?;
        let stderr_filters = self.value(
            "duplicate_stderr_filters",
            "duplicate-stderr-filters",
            &a.duplicate_stderr_filters,
            |s| Ok(parse::filter_list(s)),
        )?;
        let prefix_template = match (
            &a.log_line_prefix_template,
            (self.env)("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        ) {
            (Some(t), _) => {
                let src = self.source("log_line_prefix_template");
                self.record("log-line-prefix-template", t, src);
                t.clone()
            }
            (None, Some(t)) => {
                self.record(
                    "log-line-prefix-template",
                    &t,
                    Source::Env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE".into()),
                );
                t
            }
            (None, None) => "[${role_name}${local_rank}]:".to_owned(),
        };
        if let Some(dir) = &a.log_dir {
            let src = self.source("log_dir");
            self.record("log-dir", dir.display(), src);
        }
        Ok(LogConfig {
            dir: a.log_dir.clone(),
            redirects,
            tee,
            console_ranks,
            prefix_template,
            stdout_filters,
            stderr_filters,
        })
    }
}

fn port(s: &str) -> Result<u16, String> {
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

pub(crate) fn describe(s: &Source) -> String {
    match s {
        Source::Flag(f) => format!("flag {f}"),
        Source::Env(e) => format!("env {e}"),
        Source::Default => "default".into(),
        Source::Derived(how) => format!("derived: {how}"),
    }
}

#[cfg(test)]
mod tests;
