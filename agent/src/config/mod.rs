//! The resolved configuration: every flag and `PET_*` variable parsed, checked and tied to
//! where its value came from.
//!
//! [`resolve`] is the only place that reads flags and environment together. It either returns
//! a [`Config`] the agent can run as is, or a [`ConfigError`] naming the bad value, where it
//! came from and how to fix it; nothing has been spawned at that point. `env` is its seam:
//! the variables the resolver reads itself come through it (clap reads the `PET_*`
//! variables of valued flags from the process), so unit tests need no real environment.
//!
//! One concern per file: `sources` (where each value came from, the [`Setting`]s),
//! `mode` (standalone, static, etcd, c10d), `logs` (worker output and the agent's log
//! format), `workers` (program, count, stop grace, devices, scrubbed environment),
//! `rdzv_keys` (the known `--rdzv-conf` keys), `etcd`, `parse`, `entrypoint`, `print`,
//! `slurm` (the values a `srun` step fills in) and `hostlist` (Slurm's node-list syntax);
//! the settings of the parts the configuration feeds: `hang` ([`HangConfig`]), `health`
//! ([`HealthCheck`]) and `policy` ([`FailurePolicy`]).
//!
//! Configuration is plain data below the modules it configures: they use its types, it
//! uses none of theirs, with one exception: `peers` derives what this node accepts from
//! its peers' records from the failure policy's rule table ([`crate::policy::writes`]),
//! the one description of what the rules can write, rather than from a copy that a new
//! rule could forget. In here too the arrows go one way (`mode` uses `etcd`, both use
//! `parse` and `sources`).

mod entrypoint;
pub mod etcd;
mod hang;
mod health;
mod hostlist;
mod logs;
mod mode;
pub mod parse;
mod peers;
mod policy;
mod print;
mod rdzv_keys;
mod slurm;
mod sources;
mod workers;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::FromArgMatches;
use nix::sys::signal::Signal;

use crate::cli::Args;
pub use entrypoint::Entrypoint;
pub use hang::{HangConfig, HangTimeout};
pub use health::HealthCheck;
use mode::GroupArgs;
pub use parse::{StreamSpec, Streams, split_host_port};
pub use policy::FailurePolicy;
pub(crate) use sources::describe;
use sources::{Resolver, exit_codes, whole_number};

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
        /// How long the first round waits for every node (`--rdzv-conf join_timeout`).
        join_timeout: Duration,
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
    /// A prefix template was asked for (flag or variable): every console line is
    /// prefixed. Otherwise a stream that only goes to the console is the agent's own,
    /// inherited unprefixed, as under torchrun.
    pub prefixed: bool,
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
    /// `--nproc-per-node` was a number (every node of the run is given the same), not
    /// `gpu`, `cpu` or `auto` (each node counts its own).
    pub nproc_given: bool,
    pub role: String,
    pub max_restarts: u32,
    pub term_timeout: Duration,
    /// When a group that reports progress is hung (`crate::hang`).
    pub hang: HangConfig,
    /// Failures the budget does not decide alone (`crate::policy`).
    pub failure: FailurePolicy,
    /// The health gate before each round (`crate::health`), if any.
    pub health: Option<HealthCheck>,
    /// `TORCHELASTIC_ERROR_FILE` in the agent's own environment: where the root cause of a
    /// failed job is written for the scheduler (`crate::failure::write_launcher_error`).
    pub launcher_error_file: Option<PathBuf>,
    pub entrypoint: Entrypoint,
    /// `--prewarm`: the modules each local rank's spare imports (`supervisor::spare`).
    pub prewarm: Option<Vec<String>>,
    pub logs: LogConfig,
    pub signals: Vec<Signal>,
    pub virtual_local_rank: bool,
    /// Set `OMP_NUM_THREADS=1` for the workers (unset in the agent's env and nproc > 1).
    pub omp_threads_default: bool,
    pub log_format: LogFormat,
    pub status: StatusAddr,
    pub print_config: bool,
    pub settings: Vec<Setting>,
    /// Things the user should know that do not stop the run.
    pub warnings: Vec<String>,
    /// Variables of the agent's environment the workers get changed: `Some` replaces the
    /// value, `None` removes the variable (the etcd password; see `supervisor::worker_overlay`).
    pub worker_env_scrub: Vec<(String, Option<String>)>,
}

/// The status address of a standalone job when none is given ([`Resolver::status`]).
const STANDALONE_STATUS_ADDR: &str = "127.0.0.1:0";

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
    let command = crate::cli::parser();
    let argv0 = argv.first().map(std::path::PathBuf::from);
    // Only the words up to the script go through clap, abbreviations written out; the rest
    // are the script's, verbatim.
    let words = crate::cli::agent_words(&command, argv)
        .map_err(|e| Err(ConfigError::CommandLine(e.to_string())))?;
    let (argv, script_args) = match words.script {
        Some(i) => {
            let mut argv = words.argv;
            let rest = argv.split_off(i + 1);
            (argv, rest)
        }
        None => (words.argv, Vec::new()),
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
    let matches = match command.clone().try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(quick) => {
            // Printed by the command whose help is shown: the same words, the same error.
            let e = crate::cli::command()
                .try_get_matches_from(argv)
                .err()
                .unwrap_or(quick);
            use clap::error::ErrorKind;
            return Err(match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Ok(e.render().to_string()),
                _ => Err(ConfigError::CommandLine(clap_message(&e))),
            });
        }
    };
    let agent_dir = argv0_dir(argv0.as_deref(), env);
    let typed = argv
        .iter()
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    let mut args = Args::from_arg_matches(&matches)
        .map_err(|e| Err(ConfigError::CommandLine(clap_message(&e))))?;
    args.script_args = script_args;
    Resolver {
        command,
        matches,
        env,
        agent_dir,
        settings: Vec::new(),
        warnings: Vec::new(),
        filled: Vec::new(),
        typed,
    }
    .resolve(args)
    .map_err(Err)
}

/// The directory the agent was started from: `argv[0]`'s own when it names a path, else
/// the `PATH` entry that holds it (as the shell found it). Links are not followed: a venv's
/// `bin/fsdp-agent` is in that venv, wherever the file really is.
fn argv0_dir(
    argv0: Option<&std::path::Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Option<std::path::PathBuf> {
    let argv0 = argv0?;
    if argv0.components().count() > 1 {
        return argv0.parent().map(|d| {
            if d.as_os_str().is_empty() {
                std::path::PathBuf::from(".")
            } else {
                d.to_owned()
            }
        });
    }
    let path = env("PATH")?;
    std::env::split_paths(&path).find(|d| d.join(argv0).is_file())
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

impl Config {
    /// How long a node whose workers all succeeded waits for the rest of its round.
    pub fn exit_barrier(&self) -> Duration {
        match &self.mode {
            Mode::Etcd(m) => m.exit_barrier,
            _ => Duration::ZERO,
        }
    }
}

/// torchrun flags that load Python or need features fsdp-agent does not have.
fn refuse_unsupported(a: &Args) -> Result<(), ConfigError> {
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
    Ok(())
}

/// Whether `--nproc-per-node` was a number, the same on every node (not a device kind
/// each node counts for itself).
fn nproc_given(nproc_per_node: &str) -> bool {
    matches!(
        parse::nproc(nproc_per_node),
        Ok(parse::NprocRequest::Count(_))
    )
}

/// Completes an etcd (or c10d) rendezvous from the run, for the rules its peers follow;
/// the other modes take nothing from it.
fn complete_peers(mode: &mut Mode, run: &peers::Run<'_>) {
    if let Mode::Etcd(m) = mode {
        peers::complete(m, run);
    }
}

impl Resolver<'_> {
    /// Every value in the order `--print-config` lists it; the first bad one is the error.
    fn resolve(mut self, mut a: Args) -> Result<Config, ConfigError> {
        refuse_unsupported(&a)?;
        let standalone = self.flag("standalone", a.standalone, "PET_STANDALONE")?;
        // Under srun, what the user left out comes from Slurm; --standalone is one node.
        let slurm_is_host = match standalone {
            false => self.slurm(&mut a)?,
            true => None,
        };
        let program = self.program_flags(&a)?;
        let virtual_local_rank = self.flag(
            "virtual-local-rank",
            a.virtual_local_rank,
            "PET_VIRTUAL_LOCAL_RANK",
        )?;
        let (min_nodes, max_nodes) = self.value("nnodes", &a.nnodes, parse::nnodes)?;
        let nproc_per_node = self.nproc_per_node(&a.nproc_per_node)?;
        let max_restarts = self.value("max-restarts", &a.max_restarts, whole_number)?;
        self.monitor_interval(&a.monitor_interval)?;
        let rdzv_conf = self.rdzv_conf_with_slurm(&a.rdzv_conf, slurm_is_host)?;
        let node_rank = self.value("node-rank", &a.node_rank, whole_number)?;
        let master_port = self.master_port(a.master_port.as_deref())?;
        let term_timeout = self.term_timeout(&a)?;
        let hang = self.hang(&a.hang_timeout, &a.hang_min)?;
        let health = self.health(&a)?;
        let launcher_error_file = self.launcher_error_file();
        let failure = self.failure_policy(&a)?;
        let signals = self.value("signals-to-handle", &a.signals_to_handle, parse::signals)?;
        let console_events = self.flags_without_effect(&a)?;
        self.role(&a.role)?;
        let group = GroupArgs {
            min_nodes,
            max_nodes,
            node_rank,
            master_port,
            nproc_per_node,
        };
        let mut mode = self.mode(&a, standalone, group, &rdzv_conf)?;
        let run_id = self.run_id(&a, &mode);
        let entrypoint = self.entrypoint(&a, program)?;
        let nproc_given = nproc_given(&a.nproc_per_node);
        let run = peers::Run {
            failure: &failure,
            max_restarts,
            nproc: nproc_given.then_some(nproc_per_node),
            entrypoint: &entrypoint,
        };
        complete_peers(&mut mode, &run);
        let prewarm = self.prewarm(&a, program)?;
        let logs = self.logs(&a)?;
        let log_format = self.log_format(&a.log_format)?;
        let status = self.status(&a.status_addr, matches!(mode, Mode::Standalone { .. }))?;
        self.local_addr(a.local_addr.as_deref(), &mode);
        if console_events {
            self.warn_console_events();
        }
        self.check_virtual_local_rank(virtual_local_rank, nproc_per_node)?;
        Ok(Config {
            omp_threads_default: self.omp_threads_default(nproc_per_node),
            worker_env_scrub: self.worker_env_scrub(),
            mode,
            run_id,
            nproc_per_node,
            nproc_given,
            role: a.role,
            max_restarts,
            term_timeout,
            hang,
            failure,
            health,
            launcher_error_file,
            entrypoint,
            prewarm,
            logs,
            signals,
            virtual_local_rank,
            log_format,
            status,
            print_config: a.print_config,
            settings: self.settings,
            warnings: self.warnings,
        })
    }

    /// `--rdzv-conf`, with the `is_host` Slurm decided when the user gave none.
    fn rdzv_conf_with_slurm(
        &mut self,
        raw: &str,
        slurm_is_host: Option<(bool, Source)>,
    ) -> Result<BTreeMap<String, String>, ConfigError> {
        let mut rdzv_conf = self.rdzv_conf(raw)?;
        if let Some((is_host, source)) = slurm_is_host {
            rdzv_conf.insert("is_host".into(), is_host.to_string());
            self.record("rdzv-conf is_host", is_host, source);
        }
        Ok(rdzv_conf)
    }

    /// `--master-port`, checked but not recorded: it is recorded with the mode, which
    /// decides what the workers really get.
    fn master_port(&self, given: Option<&str>) -> Result<Option<u16>, ConfigError> {
        given
            .map(|p| parse::port(p).map_err(|reason| self.invalid("master-port", p, reason)))
            .transpose()
    }

    /// `--role`: any name but an empty one.
    fn role(&mut self, role: &str) -> Result<(), ConfigError> {
        self.value("role", role, |s| match s {
            "" => Err("must not be empty".into()),
            _ => Ok(()),
        })
    }

    /// `--event-log-handler console` asks for what the log already does.
    fn warn_console_events(&mut self) {
        self.warn(
            "--event-log-handler console: the agent's events are its log lines (see --log-format json)",
        );
    }

    /// torchrun flags that are checked and shown but change nothing here. Returns whether
    /// `--event-log-handler console` was asked for (warned about later, after the mode).
    fn flags_without_effect(&mut self, a: &Args) -> Result<bool, ConfigError> {
        self.value("start-method", &a.start_method, |s| match s {
            "spawn" | "fork" | "forkserver" => Ok(()),
            _ => Err("expected spawn, fork or forkserver".into()),
        })?;
        if self.explicit("start-method") {
            self.warn(
                "--start-method has no effect: fsdp-agent always execs workers (as torchrun does for scripts)",
            );
        }
        self.value("event-log-handler", &a.event_log_handler, |s| match s {
            "null" => Ok(false),
            "console" => Ok(true),
            _ => Err("expected null or console".into()),
        })
    }

    /// The status address. By default a job of several nodes listens on the known port on
    /// every address (probes, peers and Prometheus find it there); a standalone job stays
    /// private, on loopback and any free port (logged), so that a laptop or a shared node
    /// runs several without a warning.
    fn status(&mut self, raw: &str, standalone: bool) -> Result<StatusAddr, ConfigError> {
        let explicit = self.explicit("status-addr");
        if standalone && !explicit {
            let addr = STANDALONE_STATUS_ADDR;
            self.record("status-addr", addr, Source::Default);
            return Ok(StatusAddr::Listen {
                addr: addr.parse().expect("a valid address"),
                required: false,
            });
        }
        Ok(match self.value("status-addr", raw, parse::status_addr)? {
            Some(addr) => StatusAddr::Listen {
                addr,
                required: explicit,
            },
            None => StatusAddr::Off,
        })
    }

    /// `--local-addr` is what an etcd member advertises (read by the etcd mode); shown
    /// here, and reported when another mode ignores it.
    fn local_addr(&mut self, addr: Option<&str>, mode: &Mode) {
        let Some(addr) = addr else { return };
        self.record_flag("local-addr", addr);
        if !matches!(mode, Mode::Etcd(_)) {
            self.warn(format!(
                "--local-addr {addr} has no effect with a single-node or static rendezvous (the master is --master-addr)"
            ));
        }
    }
}

#[cfg(test)]
mod tests;
