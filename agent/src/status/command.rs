//! `fsdp-agent status`: a run's state from etcd, as a table or as JSON.
//!
//! It reads the same keys the agents write (one ranged read) and never writes, so it is
//! safe against a live run.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use fsdp_rendezvous::etcd::inspect::{MemberReport, RunReport, inspect};

use crate::config::{etcd, parse};
use crate::exit_code;

/// Shows a run's state from etcd: members, ranks, round, coordinator, restarts, health.
#[derive(Debug, Parser)]
#[command(name = "fsdp-agent status")]
struct StatusArgs {
    /// etcd endpoint(s), `host[:port]`, comma-separated.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT"
    )]
    rdzv_endpoint: String,
    /// The run id the agents were started with.
    #[arg(long = "rdzv-id", visible_alias = "rdzv_id", env = "PET_RDZV_ID")]
    rdzv_id: String,
    /// The agents' `--rdzv-conf` (for `etcd_prefix`, TLS files, credentials, `connect_timeout`).
    #[arg(
        long = "rdzv-conf",
        visible_alias = "rdzv_conf",
        env = "PET_RDZV_CONF",
        default_value = ""
    )]
    rdzv_conf: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs the command; `argv` starts with the program name, then `status`.
pub fn main(argv: Vec<OsString>) -> ExitCode {
    let args = argv.into_iter().skip(2);
    let a =
        match StatusArgs::try_parse_from(std::iter::once("fsdp-agent status".into()).chain(args)) {
            Ok(a) => a,
            Err(e) if !e.use_stderr() => {
                print!("{e}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                // One line, like the agent's own errors: clap spreads a missing argument
                // over the lines after "were not provided:", then adds usage and tips.
                let text = e.render().to_string();
                let problem: Vec<&str> = text
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("tip:"))
                    .collect();
                return usage(&format!(
                    "{}; see fsdp-agent status --help",
                    problem.join(" ").trim_start_matches("error: ")
                ));
            }
        };
    let conf = match parse::rdzv_conf(&a.rdzv_conf) {
        Ok(c) => c,
        Err(e) => return usage(&format!("--rdzv-conf: {e}")),
    };
    let mut cfg = match etcd::build(
        &a.rdzv_endpoint,
        &a.rdzv_id,
        (1, 1),
        &conf,
        String::new(),
        1,
        std::env::var(etcd::PASSWORD_ENV).ok().as_deref(),
    ) {
        Ok(m) => m.rendezvous,
        Err(e) => return usage(&e),
    };
    // A status query should answer quickly: a short retry unless told otherwise.
    if !conf.contains_key("connect_timeout") {
        cfg.options.retry_window = Duration::from_secs(5);
    }
    let runtime = match crate::runtime("fsdp-agent status") {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let result = runtime.block_on(async {
        let mut client = fsdp_rendezvous::etcd::connect(&cfg.options).await?;
        inspect(&mut client, &cfg.prefix, &cfg.run_id).await
    });
    match result {
        Ok(Some(report)) => {
            if a.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(j) => println!("{j}"),
                    Err(e) => {
                        eprintln!("fsdp-agent status: error: {e}");
                        return ExitCode::from(exit_code::INTERNAL);
                    }
                }
            } else {
                print!("{}", table(&report));
            }
            ExitCode::SUCCESS
        }
        Ok(None) => {
            eprintln!(
                "fsdp-agent status: error: no run '{}' under {}/ at {}; check --rdzv-id (and --rdzv-conf etcd_prefix)",
                cfg.run_id,
                cfg.prefix.trim_end_matches('/'),
                cfg.options.endpoints.join(",")
            );
            ExitCode::from(exit_code::NO_SUCH_RUN)
        }
        Err(e) => {
            eprintln!("fsdp-agent status: error: {e}");
            ExitCode::from(if e.is_configuration() {
                exit_code::CONFIG
            } else {
                exit_code::RENDEZVOUS_UNAVAILABLE
            })
        }
    }
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("fsdp-agent status: error: {msg}");
    ExitCode::from(exit_code::CONFIG)
}

/// The report as a table: the run's facts, then one line per node.
pub fn table(r: &RunReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let round = r.round.map(|n| {
        if r.round_reason.is_empty() {
            n.to_string()
        } else {
            format!("{n} ({})", r.round_reason)
        }
    });
    let facts = [
        ("run", r.run_id.clone()),
        (
            "health",
            format!("{}: {}", r.health.as_str(), r.health_reason),
        ),
        ("round", or_dash(round)),
        ("world size", r.world_size.to_string()),
        ("restarts", r.restarts.to_string()),
        ("master", or_dash(r.master.clone())),
        ("coordinator", or_dash(r.coordinator.clone())),
    ];
    for (k, v) in facts {
        let _ = writeln!(out, "{k:<12} {v}");
    }
    for c in &r.corrupt {
        let _ = writeln!(out, "{:<12} {c}", "untrusted");
    }
    let rows: Vec<[String; 6]> = r.members.iter().map(row).collect();
    let header = ["NODE", "ADDR", "RANK", "GLOBAL RANKS", "NPROC", "STATE"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let _ = writeln!(out);
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

fn row(m: &MemberReport) -> [String; 6] {
    let ranks = match m.base_rank {
        Some(b) if m.nproc > 1 => format!("{b}-{}", b + m.nproc - 1),
        Some(b) => b.to_string(),
        None => "-".into(),
    };
    [
        m.node_id.clone(),
        m.addr.clone(),
        m.group_rank.map_or("-".into(), |g| g.to_string()),
        ranks,
        m.nproc.to_string(),
        format!("{:?}", m.state).to_lowercase(),
    ]
}
