//! The command line: every torchrun flag, in both spellings, with `PET_*` defaults.
//!
//! Values stay strings here; [`crate::config`] parses and checks them, so that every bad
//! value, whether from a flag or from the environment, gets the same clear error.
//! Boolean flags read their `PET_*` variable in `config` too, because Kubeflow sets
//! `PET_STANDALONE` to an empty string, which clap would not treat as "on".

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;

pub mod abbrev;
pub mod first_word;
pub mod help;
pub mod torchrun_flags;

use abbrev::AmbiguousFlag;
pub use help::{command, parser};
use torchrun_flags::TORCHRUN_LONG_FLAGS;

/// The status server's address unless told otherwise (next to torchrun's 29400 and 29500).
pub const DEFAULT_STATUS_ADDR: &str = "0.0.0.0:29450";

/// The command line. Fields are in the order `--help` lists them: torchrun's flags first, in
/// torchrun's own order ([`TORCHRUN_LONG_FLAGS`]), then fsdp-agent's by topic ([`help`]
/// has the headings, and the test that keeps each flag under the right one).
///
/// A flag's comment starts with its one line in `--help` (short enough for one line: a
/// test checks); the paragraphs after it add to that line in `--help-all`, which also shows
/// the flag's variable, default and other spellings.
#[derive(Debug, Parser)]
#[command(
    name = "fsdp-agent",
    version,
    // The comment above is for readers of the code; `--help-all` has its own preamble.
    about = None,
    long_about = None,
    max_term_width = 100,
    allow_negative_numbers = true,
    // As argparse takes them: a flag given twice keeps its last value. Abbreviations are
    // written out before clap sees them (`agent_words`), as torchrun would read them.
    args_override_self = true,
    // Declared below, so that `--help` is the summary and `--help-all` the long text
    // (clap's own pair is `-h` short, `--help` long), each under its heading.
    disable_help_flag = true,
    disable_version_flag = true,
    override_usage = help::USAGE,
    help_template = help::TEMPLATE
)]
pub struct Args {
    /// This summary; every option in full: --help-all.
    ///
    /// `fsdp-agent help` prints the same, and `fsdp-agent help all` the same as `--help-all`.
    #[arg(help_heading = help::TORCHRUN, short = 'h', long, action = clap::ArgAction::HelpShort)]
    pub help: Option<bool>,

    /// Number of nodes: N, or MIN:MAX for an elastic job.
    ///
    /// A range needs a rendezvous that lets nodes come and go: `etcd` or `c10d`.
    #[arg(help_heading = help::TORCHRUN, long, env = "PET_NNODES", default_value = "1:1")]
    pub nnodes: String,

    /// Workers on this node: a number, gpu, cpu or auto.
    ///
    /// `gpu` counts the entries of `CUDA_VISIBLE_DEVICES` (or the `/dev/nvidiaN` devices),
    /// `cpu` the CPUs this process may use, `auto` the GPUs or else the CPUs.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "nproc-per-node",
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1",
        value_name = "N"
    )]
    pub nproc_per_node: String,

    /// Rendezvous: static, etcd, or c10d (no etcd needed).
    ///
    /// `static`: fixed ranks (`--node-rank`, `--master-addr`, `--master-port`). `etcd`: etcd
    /// v3 at `--rdzv-endpoint` (`etcd-v2` and `etcd-v3` are read as `etcd`). `c10d`: no
    /// etcd, on one node or several: the agent on the `--rdzv-endpoint` host (or the one
    /// given `--rdzv-conf is_host=1`) serves the rendezvous store to every node (port 29400
    /// by default), and the job ends if that agent dies. `etcd` and `c10d` take a range of
    /// nodes and re-form the group when nodes come and go.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "rdzv-backend",
        alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "static",
        value_name = "BACKEND"
    )]
    pub rdzv_backend: String,

    // The comment below is the flag's --help text, where `[:port]` must read as written,
    // not as a link.
    #[allow(rustdoc::broken_intra_doc_links)]
    /// Rendezvous endpoint host[:port] (etcd: a list).
    ///
    /// etcd: one or more endpoints, comma-separated. c10d: the one host whose agent serves
    /// the store (port 29400 by default).
    #[arg(
        help_heading = help::TORCHRUN,
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = "",
        value_name = "HOST:PORT"
    )]
    pub rdzv_endpoint: String,

    /// Run id shared by every node of one job.
    #[arg(help_heading = help::TORCHRUN, long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID", value_name = "ID")]
    pub rdzv_id: Option<String>,

    /// Rendezvous options key=value,... (torchrun's keys).
    ///
    /// docs/rendezvous.md lists every key, its default and which backends read it.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "rdzv-conf",
        alias = "rdzv_conf",
        env = "PET_RDZV_CONF",
        default_value = "",
        value_name = "K=V,..."
    )]
    pub rdzv_conf: String,

    /// Rounds of whole blocks of K nodes of one segment.
    ///
    /// The world size stays a multiple of K: each segment (`--rdzv-conf segment`, Slurm's
    /// switches, `FSDP_AGENT_SEGMENT`) gives whole blocks of K nodes, at most --nnodes MAX
    /// and at least MIN, and its other nodes wait as spares. docs/rendezvous.md, Topology.
    #[arg(
        help_heading = help::FAILURES,
        long = "segment-size",
        alias = "segment_size",
        env = "FSDP_SEGMENT_SIZE",
        value_name = "K",
        hide_short_help = true
    )]
    pub segment_size: Option<String>,

    /// One node, no rendezvous service, a fresh run id.
    ///
    /// The master port is a free local port. Also set by `PET_STANDALONE` (Kubeflow's empty
    /// value means on).
    #[arg(help_heading = help::TORCHRUN, long)]
    pub standalone: bool,

    /// Restarts of the worker group on failure, then fail.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "max-restarts",
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value = "0",
        value_name = "N"
    )]
    pub max_restarts: String,

    /// Accepted and checked; worker exits are seen at once.
    ///
    /// torchrun polls its workers this often. Nothing polls here: a worker's exit is seen
    /// as it happens. The value must still be a duration above 0.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "monitor-interval",
        alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        default_value = "0.1",
        value_name = "SECONDS"
    )]
    pub monitor_interval: String,

    /// Accepted; workers here are always exec'd.
    ///
    /// torchrun uses it for function entrypoints, which a command line never starts.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "start-method",
        alias = "start_method",
        env = "PET_START_METHOD",
        default_value = "spawn",
        value_name = "METHOD"
    )]
    pub start_method: String,

    /// Event sink: null or console.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "event-log-handler",
        alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        default_value = "null",
        value_name = "HANDLER"
    )]
    pub event_log_handler: String,

    /// Worker role name (ROLE_NAME, log prefix).
    #[arg(help_heading = help::TORCHRUN, long, env = "PET_ROLE", default_value = "default")]
    pub role: String,

    /// Run the script as a Python module (python -m).
    ///
    /// Also set by `PET_MODULE`.
    #[arg(help_heading = help::TORCHRUN, short = 'm', long)]
    pub module: bool,

    /// Exec the training program itself, not under Python.
    ///
    /// Also set by `PET_NO_PYTHON`.
    #[arg(help_heading = help::TORCHRUN, long = "no-python", alias = "no_python")]
    pub no_python: bool,

    /// Run the script through runpy.run_path.
    ///
    /// Also set by `PET_RUN_PATH`.
    #[arg(help_heading = help::TORCHRUN, long = "run-path", alias = "run_path")]
    pub run_path: bool,

    /// Base directory of per-attempt worker logs.
    ///
    /// Worker output files (with `--redirects` or `--tee`) and error files go to one
    /// directory per attempt under it.
    #[arg(help_heading = help::TORCHRUN, long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Worker streams to files: 0-3, or per rank 0:1,1:2.
    ///
    /// 0 none, 1 stdout, 2 stderr, 3 both; `0:1,1:2` sets it per local rank.
    #[arg(
        help_heading = help::TORCHRUN,
        short = 'r',
        long,
        env = "PET_REDIRECTS",
        default_value = "0",
        value_name = "STREAMS"
    )]
    pub redirects: String,

    /// Like --redirects, and also to the console.
    ///
    /// The console copy of each line carries the rank prefix.
    #[arg(
        help_heading = help::TORCHRUN,
        short = 't',
        long,
        env = "PET_TEE",
        default_value = "0",
        value_name = "STREAMS"
    )]
    pub tee: String,

    /// Local ranks whose output reaches the console: 0,3.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = "",
        value_name = "RANKS"
    )]
    pub local_ranks_filter: String,

    /// Copy stdout lines holding these to a file too.
    ///
    /// Comma-separated substrings (`,,` is a comma); matching stdout lines are also copied
    /// to `attempt_N/filtered_stdout.log`.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        default_value = "",
        value_name = "FILTERS"
    )]
    pub duplicate_stdout_filters: String,

    /// Copy stderr lines holding these to a file too.
    ///
    /// Comma-separated substrings (`,,` is a comma); matching stderr lines are also copied
    /// to `attempt_N/filtered_stderr.log`.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        default_value = "",
        value_name = "FILTERS"
    )]
    pub duplicate_stderr_filters: String,

    /// This node's rank (static backend).
    #[arg(
        help_heading = help::TORCHRUN,
        long = "node-rank",
        alias = "node_rank",
        env = "PET_NODE_RANK",
        default_value = "0",
        value_name = "RANK"
    )]
    pub node_rank: String,

    /// Master address (static backend).
    #[arg(
        help_heading = help::TORCHRUN,
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1",
        value_name = "ADDR"
    )]
    pub master_addr: String,

    /// Master port (static backend).
    ///
    /// 29500 when unset with more than one node.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "master-port",
        alias = "master_port",
        env = "PET_MASTER_PORT",
        value_name = "PORT"
    )]
    pub master_port: Option<String>,

    /// Address this node advertises to its peers.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "local-addr",
        alias = "local_addr",
        env = "PET_LOCAL_ADDR",
        value_name = "ADDR"
    )]
    pub local_addr: Option<String>,

    /// torchrun's Python logs-specs plugin; not supported.
    #[arg(help_heading = help::TORCHRUN, long = "logs-specs", alias = "logs_specs", hide = true)]
    pub logs_specs: Option<String>,

    /// torchrun's NUMA binding; not supported.
    #[arg(help_heading = help::TORCHRUN, long = "numa-binding", alias = "numa_binding", hide = true)]
    pub numa_binding: Option<String>,

    /// Signals forwarded to the workers.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "signals-to-handle",
        alias = "signals_to_handle",
        env = "PET_SIGNALS_TO_HANDLE",
        default_value = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        value_name = "SIGNALS"
    )]
    pub signals_to_handle: String,

    /// Grace before SIGKILL (torchrun's --shutdown-timeout).
    ///
    /// The time between the stop signal and SIGKILL: seconds, or a duration like `500ms`.
    /// Defaults to `$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, then 30.
    #[arg(
        help_heading = help::TORCHRUN,
        long = "term-timeout",
        aliases = ["term_timeout", "shutdown-timeout", "shutdown_timeout"],
        env = "PET_SHUTDOWN_TIMEOUT",
        value_name = "DURATION"
    )]
    pub term_timeout: Option<String>,

    /// Each worker: LOCAL_RANK=0, and only its own GPU.
    ///
    /// The GPU is the only one in the worker's `CUDA_VISIBLE_DEVICES`. Also set by
    /// `PET_VIRTUAL_LOCAL_RANK`.
    #[arg(help_heading = help::TORCHRUN, long = "virtual-local-rank", alias = "virtual_local_rank")]
    pub virtual_local_rank: bool,

    /// Exit codes that end the job at once, no restart.
    ///
    /// Comma-separated, e.g. `2,3`: a worker exiting with one of them ends the job on every
    /// node with that code, and the restart budget is not spent.
    #[arg(
        help_heading = help::FAILURES,
        long = "no-retry-exit-codes",
        alias = "no_retry_exit_codes",
        env = "FSDP_NO_RETRY_EXIT_CODES",
        default_value = "",
        value_name = "CODES"
    )]
    pub no_retry_exit_codes: String,

    /// Stop (exit 78) after N restarts with no progress.
    ///
    /// Restarts in a row that never get past the step reached before (from progress
    /// reports), after which the job stops on every node with exit code 78; 0: never.
    #[arg(
        help_heading = help::FAILURES,
        long = "no-progress-restarts",
        alias = "no_progress_restarts",
        env = "FSDP_NO_PROGRESS_RESTARTS",
        default_value = "3",
        value_name = "N"
    )]
    pub no_progress_restarts: String,

    /// Count --max-restarts over a window, e.g. 1h.
    ///
    /// Only the failure restarts charged within the sliding window count, job-wide, so old
    /// failures are forgiven. Default: the whole run.
    #[arg(
        help_heading = help::FAILURES,
        long = "restart-window",
        alias = "restart_window",
        env = "FSDP_RESTART_WINDOW",
        default_value = "",
        value_name = "DURATION"
    )]
    pub restart_window: String,

    /// Quarantine this machine after N failed rounds.
    ///
    /// Failed rounds in a row whose first failure came from this node, while no member was
    /// lost, after which its machine is quarantined and the agent exits 80; 0: never.
    #[arg(
        help_heading = help::FAILURES,
        long = "quarantine-after",
        alias = "quarantine_after",
        env = "FSDP_QUARANTINE_AFTER",
        default_value = "3",
        value_name = "N"
    )]
    pub quarantine_after: String,

    /// Quarantine this machine when a worker exits with one of CODES.
    ///
    /// Comma-separated, e.g. `74`: codes a worker's own checks exit with when the machine,
    /// not the job, is at fault (a GPU that fails a self-test). The node leaves the group
    /// at once, its machine quarantined for --quarantine-for, and the agent exits 80; the
    /// restart budget is not spent and the other nodes go on without it.
    #[arg(
        help_heading = help::FAILURES,
        long = "quarantine-on-exit",
        alias = "quarantine_on_exit",
        env = "FSDP_QUARANTINE_ON_EXIT",
        default_value = "",
        value_name = "CODES"
    )]
    pub quarantine_on_exit: String,

    /// How long a quarantined machine stays out.
    ///
    /// An agent started on a quarantined machine exits 80 until then.
    #[arg(
        help_heading = help::FAILURES,
        long = "quarantine-for",
        alias = "quarantine_for",
        env = "FSDP_QUARANTINE_FOR",
        default_value = "1h",
        value_name = "DURATION"
    )]
    pub quarantine_for: String,

    /// What a straggler costs: warn (named) or replace (also taken out).
    ///
    /// A straggler is a node whose slowest rank works at least 1.5 times the other nodes' median
    /// per step (over its last 20 steps, as workers report their working time with each
    /// step). `warn`: it is named in the log, `fsdp-agent status` and the metrics.
    /// `replace`: a node named for 20 s is taken out, its machine quarantined for
    /// --quarantine-for; a waiting spare, if any, takes its place; never below --nnodes'
    /// minimum; at most one node every 5 minutes.
    #[arg(
        help_heading = help::FAILURES,
        long = "straggler-policy",
        alias = "straggler_policy",
        env = "FSDP_STRAGGLER_POLICY",
        default_value = "warn",
        value_name = "POLICY",
        hide_short_help = true
    )]
    pub straggler_policy: String,

    /// This machine, for quarantine (default: host name).
    ///
    /// On Kubernetes set it from the downward API (`spec.nodeName`): a pod started again
    /// keeps its name but may land on another machine.
    #[arg(
        help_heading = help::FAILURES,
        long = "node-name",
        alias = "node_name",
        env = "FSDP_NODE_NAME",
        default_value = "",
        value_name = "NAME"
    )]
    pub node_name: String,

    /// Hang detection: auto, seconds per step, or off.
    ///
    /// For workers that report progress (`FSDP_AGENT_PROGRESS`): `auto` is ten times the
    /// slowest recent step, at least `--hang-min`. Optionally followed by `,startup=D`
    /// (before the first step, default 600 s), `,phase=D` (inside any reported phase,
    /// default 1800 s) and `,NAME=D` (inside the phase NAME), e.g. `auto,checkpoint=2h`;
    /// `,handover=D` bounds an in-place re-form's handover (default: max(90 s, 20 slowest
    /// steps)). Workers that never report are never judged.
    #[arg(
        help_heading = help::FAILURES,
        long = "hang-timeout",
        alias = "hang_timeout",
        env = "FSDP_HANG_TIMEOUT",
        default_value = "auto",
        value_name = "SPEC"
    )]
    pub hang_timeout: String,

    /// The least time an automatic hang timeout allows.
    ///
    /// After a step: seconds, or a duration like `500ms`.
    #[arg(
        help_heading = help::FAILURES,
        long = "hang-min",
        alias = "hang_min",
        env = "FSDP_HANG_MIN",
        default_value = "30",
        value_name = "DURATION"
    )]
    pub hang_min: String,

    /// A command that must exit 0 before this node joins.
    ///
    /// Run with `sh -c`, e.g. a GPU or NIC check. While it fails the node stays out of the
    /// group, recorded in etcd with the command's last output line; after
    /// `--health-check-attempts` failures in a row the agent exits 79 so the pod is
    /// replaced.
    #[arg(
        help_heading = help::READINESS,
        long = "health-check",
        alias = "health_check",
        env = "FSDP_HEALTH_CHECK",
        default_value = "",
        value_name = "COMMAND"
    )]
    pub health_check: String,

    /// How long one health check may take.
    ///
    /// A check that takes longer counts as failed.
    #[arg(
        help_heading = help::READINESS,
        long = "health-check-timeout",
        alias = "health_check_timeout",
        env = "FSDP_HEALTH_CHECK_TIMEOUT",
        default_value = "60",
        value_name = "DURATION"
    )]
    pub health_check_timeout: String,

    /// Failed checks in a row, then the agent exits 79.
    #[arg(
        help_heading = help::READINESS,
        long = "health-check-attempts",
        alias = "health_check_attempts",
        env = "FSDP_HEALTH_CHECK_ATTEMPTS",
        default_value = "3",
        value_name = "N"
    )]
    pub health_check_attempts: String,

    /// How often a waiting spare checks again.
    ///
    /// A node waiting for a round (a spare) runs its health check again this often.
    #[arg(
        help_heading = help::READINESS,
        long = "health-check-interval",
        alias = "health_check_interval",
        env = "FSDP_HEALTH_CHECK_INTERVAL",
        default_value = "300",
        value_name = "DURATION"
    )]
    pub health_check_interval: String,

    /// A spare interpreter per rank, its imports done.
    ///
    /// Keeps one spare interpreter per local rank that has already imported
    /// `--prewarm-modules`, so a (re)start does not wait for the imports. Costs one idle
    /// interpreter per local rank. Also set by `FSDP_PREWARM`.
    #[arg(help_heading = help::READINESS, long = "prewarm")]
    pub prewarm: bool,

    /// Modules a --prewarm spare imports, e.g. torch,numpy.
    #[arg(
        help_heading = help::READINESS,
        long = "prewarm-modules",
        env = "FSDP_PREWARM_MODULES",
        default_value = "torch",
        value_name = "MODULES"
    )]
    pub prewarm_modules: String,

    /// Status server (gRPC, health, /metrics), or off.
    ///
    /// Where the status server listens: gRPC `fsdp.v1.AgentStatus` and `grpc.health.v1`,
    /// and HTTP `GET /metrics`, all on one port. `HOST:PORT`, port 0 for any, or `off`.
    #[arg(
        help_heading = help::STATUS,
        long = "status-addr",
        alias = "status_addr",
        env = "FSDP_STATUS_ADDR",
        default_value = DEFAULT_STATUS_ADDR,
        value_name = "HOST:PORT"
    )]
    pub status_addr: String,

    /// Agent log format: text or json.
    #[arg(
        help_heading = help::STATUS,
        long = "log-format",
        env = "FSDP_AGENT_LOG_FORMAT",
        default_value = "text",
        value_name = "FORMAT"
    )]
    pub log_format: String,

    /// Prefix of worker lines, e.g. '[${rank}]:'.
    ///
    /// Macros: `${role_name}`, `${local_rank}`, `${rank}`, `${hostname}`. torchrun has this
    /// flag from 2.15 on.
    #[arg(
        help_heading = help::STATUS,
        long = "log-line-prefix-template",
        alias = "log_line_prefix_template",
        env = "PET_LOG_LINE_PREFIX_TEMPLATE",
        value_name = "TEMPLATE"
    )]
    pub log_line_prefix_template: Option<String>,

    /// Print the settings, where each came from, and exit.
    ///
    /// Every check of a real run applies, so the training script must exist.
    #[arg(help_heading = help::STATUS, long = "print-config", alias = "print_config")]
    pub print_config: bool,

    /// Every option in full: its long text, variable and default.
    ///
    /// Also `fsdp-agent help all`.
    #[arg(help_heading = help::STATUS, long = "help-all", action = clap::ArgAction::HelpLong, hide_short_help = true)]
    pub help_all: Option<bool>,

    /// Print the version.
    #[arg(help_heading = help::STATUS, short = 'V', long, action = clap::ArgAction::Version)]
    pub version: Option<bool>,

    /// torchrun's shell-completion printer; not supported.
    #[arg(help_heading = help::STATUS, long = "print-completion", alias = "print_completion", hide = true)]
    pub print_completion: Option<String>,

    /// The training program (a `.py` script, a module with -m, or a binary with --no-python),
    /// followed by its own arguments.
    #[arg(
        value_name = "TRAINING_SCRIPT",
        required = true,
        hide_short_help = true
    )]
    pub training_script: String,

    /// Arguments passed to the training program unchanged (`${local_rank}` is substituted).
    /// Everything after the script is the script's, agent flags included.
    // Never filled by clap: `config::resolve` hands clap only the words up to the script
    // (see `agent_words`) and puts the rest here. Declared for the usage line and help.
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        hide_short_help = true
    )]
    pub script_args: Vec<String>,
}

/// The agent's part of the command line, ready for clap: abbreviations written out.
#[derive(Debug, PartialEq, Eq)]
pub struct AgentWords {
    /// `argv` with every abbreviated agent flag replaced by the flag's name (`--te=3`
    /// becomes `--tee=3`); values and the words from the script on are unchanged.
    pub argv: Vec<OsString>,
    /// Where the training script is: the first word that is neither an agent flag nor a
    /// flag's value, as torchrun's argparse finds it; `--` ends the agent's flags. `None`
    /// when there is no script.
    pub script: Option<usize>,
}

/// Reads `argv` (`argv[0]` is the program) up to the training script: writes out each
/// abbreviated long flag as [`abbrev::resolve_long`] decides, and finds the script.
///
/// clap's trailing var arg would still match known flags right after the script
/// (`train.py --help` printing the agent's help), and clap's own abbreviations know only
/// our flag list; deciding both here means clap sees full names and never the script's
/// words. Which flags take a value comes from `cmd`, so the split follows the flag table.
/// Unknown flags are taken as taking no value: clap reports them.
pub fn agent_words(cmd: &clap::Command, argv: Vec<OsString>) -> Result<AgentWords, AmbiguousFlag> {
    let flags = LongFlags::of(cmd);
    let takes_value = |a: &clap::Arg| a.get_action().takes_values();
    let short = |c: char| {
        cmd.get_arguments().find(|a| {
            a.get_short() == Some(c)
                || a.get_all_short_aliases()
                    .is_some_and(|aliases| aliases.contains(&c))
        })
    };
    let mut argv = argv;
    let mut i = 1;
    let script = loop {
        if i >= argv.len() {
            break None;
        }
        // A word that is not UTF-8 cannot be one of our flags.
        let Some(word) = argv[i].to_str() else {
            break Some(i);
        };
        if word == "--" {
            break (i + 1 < argv.len()).then_some(i + 1);
        }
        if word.starts_with("--") {
            // `--flag=value` carries its value; `--flag value` takes the next word.
            let (typed, value) = match word.split_once('=') {
                Some((typed, value)) => (typed, Some(value)),
                None => (word, None),
            };
            if let Some(name) = flags.resolve(typed)? {
                let takes_next = value.is_none() && arg_named(cmd, &name).is_some_and(takes_value);
                if name != typed {
                    let full = match value {
                        Some(v) => format!("{name}={v}"),
                        None => name,
                    };
                    argv[i] = full.into();
                }
                if takes_next {
                    i += 1;
                }
            }
        } else if let Some(cluster) = word.strip_prefix('-').filter(|c| !c.is_empty()) {
            // `-m`, `-r3`, `-r 3`, `-mr3`: flags without a value, then at most one that
            // takes the rest of the word or, at its end, the next word.
            for (pos, c) in cluster.char_indices() {
                match short(c) {
                    Some(a) if takes_value(a) => {
                        if pos + c.len_utf8() == cluster.len() {
                            i += 1;
                        }
                        break;
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        } else {
            break Some(i);
        }
        i += 1;
    };
    Ok(AgentWords { argv, script })
}

/// The long names of the agent's flags (`--` included, main name first), help and version
/// included, for [`abbrev::resolve_long`].
pub struct LongFlags {
    ours: Vec<Vec<String>>,
}

impl LongFlags {
    pub fn of(cmd: &clap::Command) -> Self {
        // clap adds --help and --version when it builds the command.
        let mut built = cmd.clone();
        built.build();
        let ours = built
            .get_arguments()
            .map(|a| long_names(a).map(|n| format!("--{n}")).collect::<Vec<_>>())
            .filter(|names| !names.is_empty())
            .collect();
        Self { ours }
    }

    /// The flag `typed` (a long flag as typed, without `=value`) means; see
    /// [`abbrev::resolve_long`].
    pub fn resolve(&self, typed: &str) -> Result<Option<String>, AmbiguousFlag> {
        let ours: Vec<Vec<&str>> = self
            .ours
            .iter()
            .map(|names| names.iter().map(String::as_str).collect())
            .collect();
        let ours: Vec<&[&str]> = ours.iter().map(Vec::as_slice).collect();
        abbrev::resolve_long(typed, TORCHRUN_LONG_FLAGS, &ours)
    }

    /// Every long name, for checking that torchrun's names are all ours too.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.ours.iter().flatten().map(String::as_str)
    }
}

/// The argument of `cmd` named `--name` exactly (`None` for help and version, which `cmd`
/// gets only when built, and which take no value).
fn arg_named<'c>(cmd: &'c clap::Command, name: &str) -> Option<&'c clap::Arg> {
    let name = name.strip_prefix("--")?;
    cmd.get_arguments()
        .find(|a| long_names(a).any(|n| n == name))
}

/// A flag's long name and all its aliases, without `--`.
fn long_names(a: &clap::Arg) -> impl Iterator<Item = &str> {
    a.get_long()
        .into_iter()
        .chain(a.get_all_aliases().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Result<AgentWords, AmbiguousFlag> {
        let argv: Vec<OsString> = std::iter::once("fsdp-agent")
            .chain(line.split_whitespace())
            .map(OsString::from)
            .collect();
        agent_words(&command(), argv)
    }

    fn split(line: &str) -> Option<usize> {
        words(line).unwrap_or_else(|e| panic!("{line}: {e}")).script
    }

    /// The agent's words as clap gets them, `argv[0]` left out.
    fn written_out(line: &str) -> String {
        let w = words(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        let argv: Vec<_> = w.argv[1..].iter().map(|a| a.to_str().unwrap()).collect();
        argv.join(" ")
    }

    #[test]
    fn the_script_is_the_first_word_that_is_no_flag_or_value() {
        assert_eq!(split("train.py --nnodes 4"), Some(1));
        assert_eq!(split("--nnodes 4 train.py --help"), Some(3));
        assert_eq!(split("--nnodes=4 train.py"), Some(2));
        assert_eq!(split("--nproc_per_node 2 train.py"), Some(3));
        assert_eq!(split("--shutdown_timeout 5 train.py"), Some(3));
        assert_eq!(split("-r 3 train.py"), Some(3));
        assert_eq!(split("-r3 -t 1 train.py"), Some(4));
        assert_eq!(split("-m pkg.mod -m"), Some(2));
        assert_eq!(split("-mr3 pkg.mod"), Some(2));
        assert_eq!(split("--standalone --no-python /bin/echo -r 3"), Some(3));
        assert_eq!(split("--max-restarts -1 train.py"), Some(3));
    }

    #[test]
    fn an_abbreviation_is_written_out_as_torchrun_reads_it() {
        assert_eq!(split("--nproc-per 2 train.py"), Some(3));
        assert_eq!(split("--stand train.py"), Some(2));
        assert_eq!(split("--nproc_per 2 train.py"), Some(3));
        assert_eq!(
            written_out("--nproc-per 2 --stand --no-p /bin/echo --max 3"),
            "--nproc-per-node 2 --standalone --no-python /bin/echo --max 3"
        );
        // torchrun's flags win over ours that share the prefix (--restart-window,
        // --term-timeout, --log-format).
        assert_eq!(
            written_out("--re 3 --te=3 --log- /tmp/l x.py"),
            "--redirects 3 --tee=3 --log-dir /tmp/l x.py"
        );
        // A prefix torchrun does not claim reaches our flags.
        assert_eq!(
            written_out("--prewarm-m torch --hang-t 5 --quarantine-f 1h x.py"),
            "--prewarm-modules torch --hang-timeout 5 --quarantine-for 1h x.py"
        );
        // Names in full, short flags and values pass unchanged.
        assert_eq!(
            written_out("--tee 3 -r 1 -mt2 --rdzv-conf --max x"),
            "--tee 3 -r 1 -mt2 --rdzv-conf --max x"
        );
    }

    #[test]
    fn an_ambiguous_abbreviation_names_its_candidates() {
        let e = words("--max 3 train.py").unwrap_err();
        assert_eq!(e.candidates, ["--max-restarts", "--max_restarts"]);
        assert!(e.torchrun);
        let e = words("--max=3 train.py").unwrap_err();
        assert_eq!(e.word, "--max", "the value stays out of the message");
        let e = words("--hang 3 train.py").unwrap_err();
        assert_eq!(e.candidates, ["--hang-timeout", "--hang-min"]);
        assert!(!e.torchrun);
        // Words after the script or after `--`, and values, are not flags.
        assert_eq!(split("train.py --max 3"), Some(1));
        assert_eq!(split("-- train.py --max 3"), Some(2));
        assert_eq!(split("--role --max train.py"), Some(3));
    }

    #[test]
    fn every_torchrun_name_is_a_flag_here() {
        let flags = LongFlags::of(&command());
        let ours: Vec<&str> = flags.names().collect();
        for name in TORCHRUN_LONG_FLAGS.iter().copied().flatten() {
            assert!(ours.contains(name), "{name} is torchrun's but not ours");
        }
    }

    #[test]
    fn double_dash_ends_the_agent_flags() {
        assert_eq!(split("--standalone -- --weird-name.py --nnodes 2"), Some(3));
        assert_eq!(split("--standalone --"), None);
    }

    #[test]
    fn no_script_and_unknown_flags_are_left_to_clap() {
        assert_eq!(split(""), None);
        assert_eq!(split("--nnodes 4"), None);
        assert_eq!(split("--nnodes"), None);
        // Unknown flags take no value here; clap then names them.
        assert_eq!(split("--bogus x.py"), Some(2));
        assert_eq!(written_out("--bogus x.py"), "--bogus x.py");
        assert_eq!(split("-z x.py"), Some(2));
    }
}
