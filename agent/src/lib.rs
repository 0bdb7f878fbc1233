//! fsdp-agent: a per-node launcher for PyTorch distributed training that replaces `torchrun`.
//!
//! # Tour
//!
//! A run goes through these modules in order:
//!
//! 1. [`cli`] declares torchrun's flags (both spellings, `PET_*` defaults) and
//!    [`config`] turns them, with the environment, into a checked [`config::Config`] that
//!    remembers where each value came from (`--print-config` shows it).
//! 2. [`run`] is the loop, as explicit phases (join, start, running, re-form, failed,
//!    exit barrier, leave): ask the rendezvous ([`fsdp_rendezvous::Rendezvous`]) for a
//!    round, start the group, wait for a worker exit, a group change or a signal, and
//!    decide. The decisions themselves are pure functions in [`policy`] (and, for a slow
//!    node, in [`straggler`]: who is one, and whom `--straggler-policy replace` takes out).
//! 3. [`supervisor`] starts workers with the environment from [`worker_env`], one process
//!    group each, dying with the agent; it stops them with signal, grace, SIGKILL, and
//!    carries their output to the console and to per-attempt log files.
//! 4. [`failure`] reads workers' error files and writes the failure summary;
//!    [`exit_code`] is the table of what the agent's exit status means, and
//!    [`error::AgentError::exit_code`] the one place an error is mapped to it.
//!
//! # One thread
//!
//! The agent runs on tokio's current-thread runtime, on the main thread. Besides being
//! light, this is what makes `PR_SET_PDEATHSIG` reliable: the kernel ties the death signal
//! to the thread that forked the worker, and the main thread lives exactly as long as the
//! agent.

#[macro_use]
mod console;
pub mod cli;
pub mod config;
pub mod control;
pub mod devices;
pub mod environment;
pub mod error;
pub mod exit_code;
pub mod failure;
pub mod hang;
pub mod health;
pub mod policy;
pub mod reaper;
pub mod run;
mod runtime;
pub mod signals;
pub mod status;
pub mod straggler;
pub mod supervisor;
pub mod worker_env;

use std::ffi::OsString;
use std::process::ExitCode;

use config::{Config, LogFormat, Mode};
use error::AgentError;
use fsdp_rendezvous::RendezvousError;
use fsdp_rendezvous::etcd::EtcdRendezvous;
use fsdp_rendezvous::standalone::StandaloneRendezvous;
use fsdp_rendezvous::static_group::{StaticConfig, StaticRendezvous};
use run::AgentExit;

/// The whole program: parse, resolve, run, and map the outcome to an exit code.
pub fn main_entry(argv: Vec<OsString>) -> ExitCode {
    // `status` and `help` are words only in the first place: a training script is a path
    // or carries flags before it, and `./status` still runs a program of that name.
    use cli::first_word::Request;
    match cli::first_word::request(&argv, cli::first_word::python_runs) {
        Request::Status => return status::command::main(argv),
        Request::Help(topic) => return help(topic),
        Request::Run => {}
    }
    signals::hold_until_handled();
    let config = match config::resolve(argv, &|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(Ok(help)) => {
            print_text(&help);
            return ExitCode::SUCCESS;
        }
        Err(Err(e)) => {
            console::error("fsdp-agent", &e.to_string());
            return ExitCode::from(exit_code::CONFIG);
        }
    };
    if config.print_config {
        console::out(&config.render());
        return ExitCode::SUCCESS;
    }
    if let Some(dir) = config
        .logs
        .dir
        .as_ref()
        .filter(|d| *d != std::path::Path::new("/dev/null"))
    {
        if let Err(e) = std::fs::create_dir_all(dir) {
            say_err!(
                "fsdp-agent: error: --log-dir {} cannot be created: {e}",
                dir.display()
            );
            return ExitCode::from(exit_code::CONFIG);
        }
    }
    init_tracing(config.log_format);
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    let runtime = match runtime::build("fsdp-agent") {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(run_agent(&config)) {
        Ok(AgentExit::Finished) => ExitCode::from(exit_code::SUCCESS),
        Ok(AgentExit::Failed { exit_code }) => ExitCode::from(exit_code),
        Ok(AgentExit::Signalled(sig)) => ExitCode::from(exit_code::signalled(sig as i32)),
        Err(e) => {
            let text = e.chain();
            // Once for people; a JSON log also gets it as a record of its own.
            if config.log_format == config::LogFormat::Json {
                tracing::error!("{text}");
            }
            console::error("fsdp-agent", &text);
            ExitCode::from(e.exit_code())
        }
    }
}

/// `fsdp-agent help [TOPIC]`: the same text as the flag it stands for.
fn help(topic: cli::first_word::HelpTopic) -> ExitCode {
    use cli::first_word::HelpTopic;
    match topic {
        HelpTopic::Summary => print_text(&cli::command().render_help().to_string()),
        HelpTopic::All => print_text(&cli::command().render_long_help().to_string()),
        HelpTopic::Status => {
            return status::command::main(
                ["fsdp-agent", "status", "--help"].map(Into::into).into(),
            );
        }
        HelpTopic::Unknown(topic) => {
            say_err!(
                "fsdp-agent: error: no help on '{topic}': try fsdp-agent help, fsdp-agent help all or fsdp-agent help status"
            );
            return ExitCode::from(exit_code::CONFIG);
        }
    }
    ExitCode::SUCCESS
}

/// Help text to stdout; a reader that stops early (`| head`) is no error.
fn print_text(text: &str) {
    console::out(text);
}

async fn run_agent(cfg: &Config) -> Result<AgentExit, AgentError> {
    // Signals are caught before anything else, so a SIGTERM during the rendezvous is
    // handled like any other, never the default "die without cleanup".
    let mut signals = signals::Signals::install(&cfg.signals).map_err(AgentError::Signals)?;
    announce(cfg);
    let backend = match &cfg.mode {
        Mode::Standalone { .. } => "standalone",
        Mode::Static { .. } => "static",
        Mode::Etcd(_) => "etcd",
    };
    reaper::start_if_init();
    let board = status::Board::new(&cfg.run_id, backend, cfg.max_restarts);
    // Before the rendezvous, so liveness probes answer while it connects and waits.
    let status_addr = start_status_server(cfg, &board).await?;
    match &cfg.mode {
        Mode::Standalone { master_addr } => {
            let mut rdzv = StandaloneRendezvous::new(
                cfg.run_id.clone(),
                master_addr.clone(),
                cfg.nproc_per_node,
            );
            run::run(cfg, &mut rdzv, &mut signals, &board).await
        }
        Mode::Etcd(m) => run_etcd(cfg, m, status_addr, &mut signals, &board).await,
        Mode::Static {
            nnodes,
            node_rank,
            master_addr,
            master_port,
            join_timeout,
        } => {
            let mut rdzv = StaticRendezvous::new(StaticConfig {
                run_id: cfg.run_id.clone(),
                nnodes: *nnodes,
                node_rank: *node_rank,
                local_world_size: cfg.nproc_per_node,
                master_addr: master_addr.clone(),
                master_port: *master_port,
                join_timeout: *join_timeout,
            })?;
            run::run(cfg, &mut rdzv, &mut signals, &board).await
        }
    }
}

/// The run's first log lines: what it is, and the thread count it sets for the workers.
fn announce(cfg: &Config) {
    if cfg.omp_threads_default {
        tracing::warn!(
            "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; \
             tune it for your application as needed"
        );
    }
    tracing::info!(
        run_id = %cfg.run_id,
        nproc_per_node = cfg.nproc_per_node,
        max_restarts = cfg.max_restarts,
        entrypoint = %cfg.entrypoint.display(),
        "fsdp-agent starting"
    );
}

/// The run over etcd or a c10d store, the store's host serving it from before anyone
/// joins until the other agents are done with it.
async fn run_etcd(
    cfg: &Config,
    m: &config::etcd::EtcdMode,
    status_addr: Option<std::net::SocketAddr>,
    signals: &mut signals::Signals,
    board: &status::Board,
) -> Result<AgentExit, AgentError> {
    // c10d: the store is served before anyone joins, by the agent at the endpoint.
    let store = match &m.store {
        Some(s) => {
            let hostname = fsdp_rendezvous::hostname();
            fsdp_store::host_if_here(&s.host, s.port, s.is_host, &hostname, &s.security)
                .await
                .map_err(RendezvousError::from)?
        }
        None => fsdp_store::Hosted::Elsewhere,
    };
    let rc = etcd_config(m, status_addr, &store);
    let mut rdzv = tokio::select! {
        r = EtcdRendezvous::connect(rc) => r?,
        sig = signals.recv() => return Ok(AgentExit::Signalled(sig)),
    };
    let store = store.joined().await;
    let over = match &m.store {
        Some(_) => "the c10d store",
        None => "etcd",
    };
    tracing::info!(node_id = rdzv.node_id(), over, "joined the rendezvous");
    let exit = run::run(cfg, &mut rdzv, signals, board).await;
    if let Some(store) = store.into_served().await {
        drop(rdzv);
        store.close(store_patience(&exit, m)).await;
    }
    exit
}

/// The rendezvous configuration from `config`, completed with what only running tells:
/// where the status server listens and the c10d store this agent may serve.
fn etcd_config(
    m: &config::etcd::EtcdMode,
    status_addr: Option<std::net::SocketAddr>,
    store: &fsdp_store::Hosted,
) -> fsdp_rendezvous::etcd::EtcdConfig {
    let mut rc = m.rendezvous.clone();
    rc.status_addr = status_addr.and_then(|bound| advertised(bound, &rc.addr));
    if let (Some(bound), None) = (status_addr, &rc.status_addr) {
        tracing::warn!(
            "peers cannot reach status server {bound} at {}: no fast detection here, death seen at lease expiry ({:?}); set --status-addr 0.0.0.0:PORT",
            rc.addr,
            rc.keep_alive_ttl,
        );
    }
    rc.torchrun_clients = store.torchrun_clients();
    rc.fresh_store = matches!(store, fsdp_store::Hosted::Serving(_));
    rc.store_taken_over = store.taken_over();
    rc
}

/// How long a c10d store host keeps serving after its own run ended, for the agents still
/// finishing theirs (their last records; a killed one's lease lapsing). None after a
/// signal: the pod is going, and the others learn it from the store's end.
fn store_patience(
    exit: &Result<AgentExit, AgentError>,
    m: &config::etcd::EtcdMode,
) -> std::time::Duration {
    match exit {
        Ok(AgentExit::Signalled(_)) => std::time::Duration::ZERO,
        _ => m.rendezvous.keep_alive_ttl + std::time::Duration::from_secs(5),
    }
}

/// Starts the status server; returns where it listens, if it does.
async fn start_status_server(
    cfg: &Config,
    board: &status::Board,
) -> Result<Option<std::net::SocketAddr>, AgentError> {
    let config::StatusAddr::Listen { addr, required } = cfg.status else {
        return Ok(None);
    };
    match status::server::start(addr, board.clone()).await {
        Ok(bound) => {
            tracing::info!(addr = %bound, "status server listening (gRPC status and health, HTTP /metrics)");
            Ok(Some(bound))
        }
        Err(e) if !required => {
            // Another agent on this machine (two jobs' steps on one Slurm node, pods with
            // hostNetwork) holds the default port. A free port keeps this agent watched
            // by its ring neighbour, which finds the port through the rendezvous: without
            // a status server its death would wait for its lease to expire.
            let free = std::net::SocketAddr::new(addr.ip(), 0);
            match status::server::start(free, board.clone()).await {
                Ok(bound) => {
                    tracing::warn!(
                        default = %addr,
                        addr = %bound,
                        error = %e,
                        "the default status port is taken (another agent on this machine?); listening on a free port instead (set --status-addr for a fixed one)"
                    );
                    Ok(Some(bound))
                }
                Err(e) => {
                    tracing::warn!(
                        %addr,
                        error = %e,
                        "cannot listen on the default status address; running without the status server (set --status-addr)"
                    );
                    Ok(None)
                }
            }
        }
        Err(source) => Err(AgentError::StatusAddrBusy { addr, source }),
    }
}

/// Where peers reach a status server bound at `bound`, for the ring neighbour that
/// watches this agent: a wildcard bind answers at the node's advertised address; a
/// loopback bind only if the node's own address is loopback too (peers on this host);
/// otherwise peers cannot reach it and nothing is advertised (the lease alone tells).
fn advertised(bound: std::net::SocketAddr, node_addr: &str) -> Option<String> {
    let node_loopback = node_addr
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
        || node_addr == "localhost";
    let ip = bound.ip();
    if ip.is_loopback() && !node_loopback {
        return None;
    }
    if !ip.is_unspecified() {
        return Some(bound.to_string());
    }
    Some(if node_addr.contains(':') && !node_addr.starts_with('[') {
        format!("[{node_addr}]:{}", bound.port())
    } else {
        format!("{node_addr}:{}", bound.port())
    })
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    // RUST_LOG wins; torchrun users set LOGLEVEL.
    let filter = std::env::var("RUST_LOG")
        .ok()
        .or_else(|| {
            std::env::var("LOGLEVEL")
                .ok()
                .map(|l| l.to_ascii_lowercase())
        })
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Its default prints a failed write with `eprintln!`, which panics on a closed
        // stderr (`| head`): see `console`.
        .log_internal_errors(false);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_target(false)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

#[cfg(test)]
mod advertised_tests {
    use super::advertised;

    #[test]
    fn peers_are_given_a_status_address_they_can_reach() {
        let at = |s: &str| s.parse().unwrap();
        assert_eq!(
            advertised(at("0.0.0.0:29450"), "10.0.0.5"),
            Some("10.0.0.5:29450".into())
        );
        assert_eq!(
            advertised(at("[::]:29450"), "fd00::5"),
            Some("[fd00::5]:29450".into())
        );
        assert_eq!(
            advertised(at("10.0.0.5:7"), "10.0.0.5"),
            Some("10.0.0.5:7".into())
        );
        // Pods on this host's loopback range reach each other's 127.0.0.1.
        assert_eq!(
            advertised(at("127.0.0.1:7"), "127.0.1.2"),
            Some("127.0.0.1:7".into())
        );
        // Seen from another host (or network namespace), 127.0.0.1 is the watcher itself.
        assert_eq!(advertised(at("127.0.0.1:7"), "10.0.0.5"), None);
    }
}
