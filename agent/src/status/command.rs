//! `fsdp-agent status`: a run's state from etcd (or from a c10d job's store), as a table
//! or as JSON.
//!
//! It reads the same keys the agents write (one ranged read) and never writes, so it is
//! safe against a live run.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use fsdp_rendezvous::RendezvousError;
use fsdp_rendezvous::etcd::EtcdConfig;
use fsdp_rendezvous::etcd::inspect::{LeftNode, MemberReport, RunReport, inspect};

use crate::config::{etcd, parse};
use crate::exit_code;

/// Shows a run's state from etcd: members, ranks, round, coordinator, restarts, health.
#[derive(Debug, Parser)]
#[command(name = "fsdp-agent status")]
struct StatusArgs {
    /// `etcd` (also `etcd-v2`, `etcd-v3`), or `c10d` for a job whose agent serves the store.
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "etcd"
    )]
    rdzv_backend: String,
    /// etcd endpoint(s), `host[:port]`, comma-separated; with c10d, the store's
    /// `host[:port]` (29400 by default).
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT"
    )]
    rdzv_endpoint: String,
    /// The run id the agents were started with (required with etcd; c10d's default is
    /// `none`, as the agents').
    #[arg(long = "rdzv-id", visible_alias = "rdzv_id", env = "PET_RDZV_ID")]
    rdzv_id: Option<String>,
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
    let a = match parse_args(argv) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let cfg = match rendezvous_config(&a) {
        Ok(cfg) => cfg,
        Err(e) => return usage(&e),
    };
    let runtime = match crate::runtime::build("fsdp-agent status") {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let result = runtime.block_on(query(&cfg));
    match result {
        Ok(Some(report)) => print_report(&report, a.json),
        Ok(None) => {
            say_err!(
                "fsdp-agent status: error: no run '{}' under {}/ at {}; check --rdzv-id (and --rdzv-conf etcd_prefix)",
                cfg.run_id,
                cfg.prefix.trim_end_matches('/'),
                cfg.options.endpoints.join(",")
            );
            ExitCode::from(exit_code::NO_SUCH_RUN)
        }
        Err(e) => {
            crate::console::error("fsdp-agent status", &e.to_string());
            ExitCode::from(if e.is_configuration() {
                exit_code::CONFIG
            } else {
                exit_code::RENDEZVOUS_UNAVAILABLE
            })
        }
    }
}

/// The command's flags; `Err` is the exit once help is shown or the mistake told.
fn parse_args(argv: Vec<OsString>) -> Result<StatusArgs, ExitCode> {
    let args = argv.into_iter().skip(2);
    match StatusArgs::try_parse_from(std::iter::once("fsdp-agent status".into()).chain(args)) {
        Ok(a) => Ok(a),
        Err(e) if !e.use_stderr() => {
            crate::console::out(&e.to_string());
            Err(ExitCode::SUCCESS)
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
            Err(usage(&format!(
                "{}; see fsdp-agent status --help",
                problem.join(" ").trim_start_matches("error: ")
            )))
        }
    }
}

/// Where to read the run, built as the agents build it from the same flags.
fn rendezvous_config(a: &StatusArgs) -> Result<EtcdConfig, String> {
    let conf = parse::rdzv_conf(&a.rdzv_conf).map_err(|e| format!("--rdzv-conf: {e}"))?;
    let built = match (a.rdzv_backend.to_ascii_lowercase().as_str(), &a.rdzv_id) {
        ("c10d", id) => etcd::build_c10d(
            &a.rdzv_endpoint,
            id.as_deref().unwrap_or("none"),
            (1, 1),
            &conf,
            String::new(),
            1,
            std::env::var(etcd::PASSWORD_ENV).ok().as_deref(),
        ),
        ("etcd" | "etcd-v2" | "etcd-v3", Some(id)) => etcd::build(
            &a.rdzv_endpoint,
            id,
            (1, 1),
            &conf,
            String::new(),
            1,
            std::env::var(etcd::PASSWORD_ENV).ok().as_deref(),
        ),
        ("etcd" | "etcd-v2" | "etcd-v3", None) => {
            Err("--rdzv-id is required with etcd: the run id the agents were started with".into())
        }
        (other, _) => Err(format!(
            "--rdzv-backend {other}: status reads etcd or a c10d job's store"
        )),
    };
    let mut cfg = built?.rendezvous;
    // A status query should answer quickly: a short retry unless told otherwise.
    if !conf.contains_key("connect_timeout") {
        cfg.options.retry_window = Duration::from_secs(5);
    }
    Ok(cfg)
}

/// The run's state, its slowest ranks and its latest hang's culprit; `None`: no such run.
async fn query(cfg: &EtcdConfig) -> Result<Option<Shown>, RendezvousError> {
    let mut client = fsdp_rendezvous::etcd::connect(&cfg.options).await?;
    let Some(run) = inspect(&mut client, &cfg.prefix, &cfg.run_id).await? else {
        return Ok(None);
    };
    let (ranks, stragglers) = slowest_ranks(&run).await;
    let last_hang = run.last_hang.as_ref().map(|h| {
        let nodes: Vec<String> = h.reports.iter().map(|r| r.node_id.clone()).collect();
        let blame = crate::hang::culprit::blame(&h.reports, &nodes);
        format!("round {}: {}", h.round, blame.text)
    });
    Ok(Some(Shown {
        run,
        stragglers,
        slowest_ranks: ranks,
        last_hang,
    }))
}

/// The report on stdout, as JSON or a table.
fn print_report(report: &Shown, json: bool) -> ExitCode {
    if json {
        match serde_json::to_string_pretty(report) {
            Ok(j) => crate::console::out(&format!("{j}\n")),
            Err(e) => {
                crate::console::error("fsdp-agent status", &e.to_string());
                return ExitCode::from(exit_code::INTERNAL);
            }
        }
    } else {
        crate::console::out(&table(report));
    }
    ExitCode::SUCCESS
}

fn usage(msg: &str) -> ExitCode {
    crate::console::error("fsdp-agent status", msg);
    ExitCode::from(exit_code::CONFIG)
}

/// What the command shows: the run from etcd, and the slowest ranks as their agents
/// report them.
#[derive(Debug, serde::Serialize)]
pub struct Shown {
    #[serde(flatten)]
    pub run: RunReport,
    /// The straggler judge's scores (the group's rank 0 judges), slowest node first.
    pub stragglers: Vec<ScoreLine>,
    /// The reporting ranks of the round, slowest last step first (at most [`SLOWEST`]).
    pub slowest_ranks: Vec<RankLine>,
    /// Who the latest hang points at, in words (`last_hang` is the run's own record).
    #[serde(rename = "last_hang_culprit")]
    pub last_hang: Option<String>,
}

/// One rank in the straggler view.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RankLine {
    pub rank: u32,
    pub node_id: String,
    pub last_step: u64,
    pub step_seconds: f64,
    pub silent_seconds: f64,
    /// The median of its recent working times per step (0: it does not say).
    pub busy_seconds: f64,
}

/// One judged node: its slowest rank's median working time over the other nodes' median.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScoreLine {
    pub node_id: String,
    pub score: f64,
    pub rank: u32,
    pub busy_seconds: f64,
    pub straggler: bool,
}

/// Ranks the straggler view lists.
pub const SLOWEST: usize = 5;
/// How long an agent's status port may take to answer: status must answer quickly even
/// when some agents do not.
const ASK_PATIENCE: Duration = Duration::from_secs(2);

/// Asks every member of the round for its ranks' progress (at once, each within
/// [`ASK_PATIENCE`]) and keeps the slowest; and the straggler judge's scores (from
/// whichever member judges).
async fn slowest_ranks(run: &RunReport) -> (Vec<RankLine>, Vec<ScoreLine>) {
    let asks = run
        .members
        .iter()
        .filter(|m| m.group_rank.is_some() && !m.status_addr.is_empty())
        .map(|m| async move {
            let ask = async {
                let mut client =
                    fsdp_rendezvous::etcd::liveness::status_client(&m.status_addr, ASK_PATIENCE)
                        .await?;
                let state = client
                    .get_status(fsdp_proto::v1::GetStatusRequest {})
                    .await
                    .ok()?
                    .into_inner();
                Some(state)
            };
            let state = tokio::time::timeout(ASK_PATIENCE, ask)
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            let ranks: Vec<RankLine> = state
                .ranks
                .into_iter()
                .map(|r| RankLine {
                    rank: r.rank,
                    node_id: m.node_id.clone(),
                    last_step: r.last_step,
                    step_seconds: r.step_seconds,
                    silent_seconds: r.silent_seconds,
                    busy_seconds: r.busy_seconds,
                })
                .collect();
            let scores: Vec<ScoreLine> = state
                .straggler_scores
                .into_iter()
                .map(|n| ScoreLine {
                    node_id: n.node_id,
                    score: n.score,
                    rank: n.rank,
                    busy_seconds: n.busy_seconds,
                    straggler: n.straggler,
                })
                .collect();
            (m.group_rank == Some(0), ranks, scores)
        });
    let mut all = Vec::new();
    let mut scores = Vec::new();
    for (judge, ranks, judged) in futures::future::join_all(asks).await {
        all.extend(ranks);
        // The round's rank 0 judges (another member's scores are from when it did).
        if judge {
            scores = judged;
        }
    }
    (slowest(all), scores)
}

/// The [`SLOWEST`] ranks by working time where ranks report it (in a synchronous job
/// every rank's step takes the slowest one's time), then by last step time, slowest
/// first (ties: lower rank first).
pub fn slowest(mut all: Vec<RankLine>) -> Vec<RankLine> {
    all.sort_by(|a, b| {
        b.busy_seconds
            .total_cmp(&a.busy_seconds)
            .then(b.step_seconds.total_cmp(&a.step_seconds))
            .then(a.rank.cmp(&b.rank))
    });
    all.truncate(SLOWEST);
    all
}

/// The report as a table: the run's facts, one line per node, then the slowest ranks.
pub fn table(shown: &Shown) -> String {
    let text = table_text(shown);
    // Every field comes from the store, where anyone who can write it writes any bytes:
    // no control character reaches the terminal (ESC could clear the screen, set the
    // title or forge a line), each is shown as its escape.
    let lines: Vec<_> = text.lines().map(fsdp_rendezvous::text::shown).collect();
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

fn table_text(shown: &Shown) -> String {
    use std::fmt::Write;
    let mut out = run_table(&shown.run);
    if let Some(h) = &shown.last_hang {
        let _ = writeln!(out, "\n{:<12} {h}", "last hang");
    }
    if !shown.stragglers.is_empty() {
        let _ = writeln!(
            out,
            "\nstragglers (each node's slowest rank's median working time per step against the other nodes'):"
        );
        let rows: Vec<Vec<String>> = shown
            .stragglers
            .iter()
            .map(|n| {
                vec![
                    n.node_id.clone(),
                    format!("{:.2}x", n.score),
                    n.rank.to_string(),
                    format!("{:.3}s", n.busy_seconds),
                    if n.straggler { "straggler" } else { "ok" }.to_owned(),
                ]
            })
            .collect();
        columns(
            &mut out,
            &["NODE", "SCORE", "RANK", "WORKS", "VERDICT"],
            &rows,
        );
    }
    if !shown.slowest_ranks.is_empty() {
        let _ = writeln!(
            out,
            "\nslowest ranks (working time per step, then last step time, as their agents report):"
        );
        let rows: Vec<Vec<String>> = shown
            .slowest_ranks
            .iter()
            .map(|r| {
                vec![
                    r.rank.to_string(),
                    r.node_id.clone(),
                    r.last_step.to_string(),
                    format!("{:.3}s", r.step_seconds),
                    busy_cell(r.busy_seconds),
                    format!("{:.1}s", r.silent_seconds),
                ]
            })
            .collect();
        columns(
            &mut out,
            &["RANK", "NODE", "LAST STEP", "STEP TIME", "WORKS", "SILENT"],
            &rows,
        );
    }
    out
}

/// A rank's median working time, or `-` where it does not say.
fn busy_cell(busy_s: f64) -> String {
    if busy_s > 0.0 {
        format!("{busy_s:.3}s")
    } else {
        "-".to_owned()
    }
}

/// Writes `rows` under `header`, each column as wide as its widest cell.
fn columns(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    use std::fmt::Write;
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
}

/// The run's facts, then one line per node.
fn run_table(r: &RunReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let now = fsdp_rendezvous::unix_ms();
    let round = r.round.map(|n| {
        let fact = round_fact(n, &r.round_reason);
        match r.sealed_at_ms {
            Some(at) => format!("{fact}, {}", ago(now, at)),
            None => fact,
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
        ("restarts", restarts_fact(r)),
        ("master", or_dash(r.master.clone())),
        ("coordinator", or_dash(r.coordinator.clone())),
    ];
    for (k, v) in facts {
        let _ = writeln!(out, "{k:<12} {v}");
    }
    for c in &r.corrupt {
        let _ = writeln!(out, "{:<12} {c}", "untrusted");
    }
    for c in &r.refused {
        let _ = writeln!(out, "{:<12} {c}", "refused");
    }
    for q in &r.quarantined {
        let left = q.until_ms.saturating_sub(now) / 1000;
        let until = if left > 0 {
            format!("for {}m{:02}s more", left / 60, left % 60)
        } else {
            "expired".to_owned()
        };
        let _ = writeln!(
            out,
            "{:<12} {} ({until}): {}",
            "quarantined", q.machine, q.reason
        );
    }
    for u in &r.unhealthy {
        let _ = writeln!(
            out,
            "{:<12} {}: {} ({} failed check{} in a row)",
            "unhealthy",
            u.node_id,
            u.reason,
            u.failures,
            if u.failures == 1 { "" } else { "s" }
        );
    }
    let rows: Vec<Vec<String>> = r.members.iter().map(row).collect();
    let _ = writeln!(out);
    columns(
        &mut out,
        &["NODE", "ADDR", "RANK", "GLOBAL RANKS", "NPROC", "STATE"],
        &rows,
    );
    if !r.left.is_empty() {
        let _ = writeln!(out, "\nleft (newest last):");
        let rows: Vec<Vec<String>> = r.left.iter().map(|l| left_row(l, now)).collect();
        columns(
            &mut out,
            &["NODE", "ADDR", "ROUND", "WHEN", "REASON", "DETAIL"],
            &rows,
        );
    }
    out
}

/// The round line: its number and why it was sealed, said as done. The reason is the
/// coordinator's at the moment it sealed; read as the present ("re-form (1 node(s) waiting
/// to join)") it was false once the waiting node had joined.
pub fn round_fact(number: u64, reason: &str) -> String {
    if reason.is_empty() {
        return number.to_string();
    }
    match reason
        .strip_prefix("re-form (")
        .and_then(|r| r.strip_suffix(')'))
    {
        Some(why) => format!("{number} (re-formed: {why})"),
        None => format!("{number} (sealed: {reason})"),
    }
}

/// One departure, its time said as an age at `now_ms`.
fn left_row(l: &LeftNode, now_ms: u64) -> Vec<String> {
    vec![
        l.node_id.clone(),
        if l.addr.is_empty() {
            "-".into()
        } else {
            l.addr.clone()
        },
        l.round.to_string(),
        ago(now_ms, l.at_ms),
        l.reason.to_owned(),
        l.detail.clone(),
    ]
}

/// How long before `now_ms` the Unix time `at_ms` was, in the largest two units.
/// The restarts used, against the budget when the agents told it.
fn restarts_fact(r: &RunReport) -> String {
    let Some(max) = r.max_restarts else {
        return r.restarts.to_string();
    };
    let window = match r.restart_window_s {
        0 => String::new(),
        s if s % 3600 == 0 => format!(", window {}h", s / 3600),
        s if s % 60 == 0 => format!(", window {}m", s / 60),
        s => format!(", window {s}s"),
    };
    format!("{} of {max}{window}", r.restarts)
}

pub fn ago(now_ms: u64, at_ms: u64) -> String {
    let s = now_ms.saturating_sub(at_ms) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m{:02}s ago", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m ago", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h ago", s / 86_400, s % 86_400 / 3600),
    }
}

fn row(m: &MemberReport) -> Vec<String> {
    let ranks = match m.base_rank {
        Some(b) if m.nproc > 1 => format!("{b}-{}", b + m.nproc - 1),
        Some(b) => b.to_string(),
        None => "-".into(),
    };
    vec![
        m.node_id.clone(),
        m.addr.clone(),
        m.group_rank.map_or("-".into(), |g| g.to_string()),
        ranks,
        m.nproc.to_string(),
        format!("{:?}", m.state).to_lowercase(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(rank: u32, step_seconds: f64) -> RankLine {
        RankLine {
            rank,
            node_id: format!("n{}", rank / 2),
            last_step: 10,
            step_seconds,
            silent_seconds: 0.1,
            busy_seconds: 0.0,
        }
    }

    #[test]
    fn the_slowest_ranks_come_first_and_only_a_few() {
        let all: Vec<RankLine> = [0.2, 0.9, 0.2, 0.5, 0.3, 0.2, 0.4]
            .iter()
            .enumerate()
            .map(|(r, s)| line(r as u32, *s))
            .collect();
        let ranks: Vec<u32> = slowest(all).iter().map(|r| r.rank).collect();
        assert_eq!(ranks, [1, 3, 6, 4, 0]);
        // Where ranks say their working time, it decides: their steps all took as long.
        let said: Vec<RankLine> = [0.05, 0.21, 0.1]
            .iter()
            .enumerate()
            .map(|(r, b)| RankLine {
                busy_seconds: *b,
                ..line(r as u32, 0.25)
            })
            .collect();
        let ranks: Vec<u32> = slowest(said).iter().map(|r| r.rank).collect();
        assert_eq!(ranks, [1, 2, 0]);
    }

    #[test]
    fn the_round_line_says_why_the_round_was_sealed_as_done() {
        assert_eq!(round_fact(2, ""), "2");
        assert_eq!(
            round_fact(2, "re-form (admitted 1 waiting node(s))"),
            "2 (re-formed: admitted 1 waiting node(s))"
        );
        // A record sealed by an older agent still reads as history.
        assert_eq!(
            round_fact(2, "re-form (1 node(s) waiting to join)"),
            "2 (re-formed: 1 node(s) waiting to join)"
        );
        assert_eq!(
            round_fact(0, "3 nodes present (the maximum)"),
            "0 (sealed: 3 nodes present (the maximum))"
        );
    }

    #[test]
    fn an_age_is_said_in_its_two_largest_units() {
        let now = 10_000_000_000;
        assert_eq!(ago(now, now - 12_400), "12s ago");
        assert_eq!(ago(now, now - 184_000), "3m04s ago");
        assert_eq!(ago(now, now - 7_500_000), "2h05m ago");
        assert_eq!(ago(now, now - 97_200_000), "1d03h ago");
        assert_eq!(ago(now, now + 5_000), "0s ago", "a writer's clock ahead");
    }

    #[test]
    fn the_nodes_that_left_follow_the_members_newest_last() {
        let left = |node: &str, reason: &'static str, detail: &str, at_ms: u64| LeftNode {
            node_id: node.into(),
            addr: format!("{node}.local"),
            reason,
            detail: detail.into(),
            at_ms,
            round: 1,
            written_by: node.into(),
        };
        let now = fsdp_rendezvous::unix_ms();
        let mut run = report();
        run.members = vec![MemberReport {
            node_id: "a".into(),
            addr: "a.local".into(),
            nproc: 1,
            group_rank: Some(0),
            base_rank: Some(0),
            state: fsdp_rendezvous::etcd::inspect::MemberState::Running,
            status_addr: String::new(),
        }];
        run.left = vec![
            left(
                "c",
                "unhealthy",
                "GPU 3: 12 ECC errors (exit code 1)",
                now - 90_000,
            ),
            left("d", "lost", "its registration vanished", now - 3_000),
        ];
        let t = run_table(&run);
        let tail: Vec<&str> = t.lines().skip_while(|l| !l.starts_with("left")).collect();
        assert_eq!(tail.len(), 4, "{t}");
        assert!(
            tail[1].starts_with("NODE") && tail[1].ends_with("DETAIL"),
            "{t}"
        );
        assert!(
            tail[2].starts_with("c ") && tail[2].contains("1m30s ago"),
            "{t}"
        );
        assert!(
            tail[2].contains("unhealthy")
                && tail[2].ends_with("GPU 3: 12 ECC errors (exit code 1)"),
            "{t}"
        );
        assert!(tail[3].starts_with("d ") && tail[3].contains("lost"), "{t}");
        let members = t.find("\na ").expect("the member row");
        assert!(
            members < t.find("\nleft").unwrap(),
            "after the members: {t}"
        );
        // Nobody left: no section.
        run.left.clear();
        assert!(!run_table(&run).contains("left"), "{}", run_table(&run));
    }

    fn report() -> RunReport {
        RunReport {
            run_id: "job".into(),
            round: Some(2),
            round_reason: String::new(),
            restarts: 1,
            sealed_at_ms: None,
            max_restarts: None,
            restart_window_s: 0,
            nodes: None,
            world_size: 2,
            master: None,
            coordinator: None,
            members: Vec::new(),
            health: fsdp_rendezvous::etcd::inspect::Health::Healthy,
            health_reason: "ok".into(),
            corrupt: Vec::new(),
            refused: Vec::new(),
            last_hang: None,
            unhealthy: Vec::new(),
            quarantined: Vec::new(),
            left: Vec::new(),
        }
    }

    #[test]
    fn restarts_are_shown_against_the_budget_the_agents_told() {
        let mut r = report();
        assert_eq!(restarts_fact(&r), "1", "older agents said no budget");
        r.max_restarts = Some(3);
        assert_eq!(restarts_fact(&r), "1 of 3");
        r.restart_window_s = 3600;
        assert_eq!(restarts_fact(&r), "1 of 3, window 1h");
        r.restart_window_s = 90;
        assert_eq!(restarts_fact(&r), "1 of 3, window 90s");
        r.sealed_at_ms = Some(fsdp_rendezvous::unix_ms() - 192_000);
        assert!(
            run_table(&r).contains("round        2, 3m12s ago"),
            "{}",
            run_table(&r)
        );
    }

    #[test]
    fn the_json_has_each_key_once() {
        let shown = Shown {
            run: report(),
            stragglers: Vec::new(),
            slowest_ranks: Vec::new(),
            last_hang: Some("round 1: rank 1".into()),
        };
        let json = serde_json::to_string(&shown).unwrap();
        assert_eq!(json.matches("\"last_hang\"").count(), 1, "{json}");
        assert_eq!(json.matches("\"last_hang_culprit\"").count(), 1, "{json}");
    }

    #[test]
    fn the_table_shows_the_last_hang_and_the_straggler_view() {
        let shown = Shown {
            run: report(),
            stragglers: vec![
                ScoreLine {
                    node_id: "n1".into(),
                    score: 2.04,
                    rank: 3,
                    busy_seconds: 0.2,
                    straggler: true,
                },
                ScoreLine {
                    node_id: "n0".into(),
                    score: 1.0,
                    rank: 0,
                    busy_seconds: 0.098,
                    straggler: false,
                },
            ],
            slowest_ranks: vec![line(1, 0.9), line(0, 0.2)],
            last_hang: Some("round 1: rank 1 on node n0 last finished step 9".into()),
        };
        let t = table(&shown);
        assert!(t.contains("last hang    round 1: rank 1 on node n0"), "{t}");
        let judged: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("NODE  SCORE"))
            .collect();
        assert!(
            judged[1].starts_with("n1    2.04x  3     0.200s  straggler"),
            "{t}"
        );
        assert!(
            judged[2].starts_with("n0    1.00x  0     0.098s  ok"),
            "{t}"
        );
        let view: Vec<&str> = t.lines().skip_while(|l| !l.starts_with("RANK")).collect();
        assert_eq!(view.len(), 3, "{t}");
        assert!(
            view[1].starts_with("1     n0    10         0.900s     -"),
            "{t}"
        );
        let json = serde_json::to_value(&shown).unwrap();
        assert_eq!(json["stragglers"][0]["straggler"], true, "{json}");
    }
}
