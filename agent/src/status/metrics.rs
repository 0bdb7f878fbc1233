//! The Prometheus text exposition of a [`Snapshot`]: a pure function, so its format is
//! tested without a server.

use std::collections::BTreeMap;
use std::fmt::Write;

use fsdp_proto::v1::{Phase, RankStatus};

use super::{Snapshot, Timing};

/// Renders every metric in Prometheus' text format (version 0.0.4).
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    group(&mut out, s);
    counter_by(
        &mut out,
        "fsdp_agent_worker_exits_total",
        "Workers of this node that exited on their own, by exit code or signal.",
        "exit",
        &s.worker_exits,
    );
    counter_by(
        &mut out,
        "fsdp_agent_reforms_total",
        "Times this node stopped its workers to re-form or restart, by reason.",
        "reason",
        &s.reforms,
    );
    counter_by(
        &mut out,
        "fsdp_agent_in_place_reforms_total",
        "Re-forms this node's workers took in place (same processes), by where they restored their state: memory (peer-memory snapshots) disk (the fallback: no step was whole in memory, e.g. both copies of a part lost), or unsaid (a worker did not say).",
        "restored",
        &s.in_place,
    );
    counter_by(
        &mut out,
        "fsdp_agent_member_losses_total",
        "Members this node's group lost, by how the loss was noticed (refused: its process was gone; left: it revoked its lease; lease expiry: it went silent; unsaid: it went from a round another member's departure had broken already, where nobody says how).",
        "detection",
        &s.losses,
    );
    health(&mut out, s);
    ranks(&mut out, &s.state.ranks);
    straggler_scores(&mut out, &s.state.straggler_scores);
    summary(
        &mut out,
        "fsdp_agent_refused_detect_seconds",
        "For a member proven dead by a refused connection: from its liveness stream breaking to the proof.",
        &s.refused_detect,
    );
    summary(
        &mut out,
        "fsdp_agent_detect_seconds",
        "From this node's group breaking to a sealed round without the lost node.",
        &s.detect,
    );
    summary(
        &mut out,
        "fsdp_agent_reform_seconds",
        "From this node's group breaking to its workers running again.",
        &s.reform,
    );
    rendezvous(&mut out, s);
    out
}

/// The agent, its round and its restarts.
fn group(out: &mut String, s: &Snapshot) {
    let st = &s.state;
    let phase = Phase::try_from(st.phase).unwrap_or(Phase::Unspecified);
    // Labels are escaped: node ids and run ids come from the user.
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_info The agent's identity; always 1.\n# TYPE fsdp_agent_info gauge\n\
         fsdp_agent_info{{node=\"{}\",run_id=\"{}\",backend=\"{}\",phase=\"{}\"}} 1",
        escape(&st.node_id),
        escape(&st.run_id),
        escape(&st.backend),
        phase_name(phase),
    );
    gauge(
        out,
        "fsdp_agent_round",
        "The round this node's workers run in (0 before the first).",
        st.round as f64,
    );
    gauge(
        out,
        "fsdp_agent_world_size",
        "Workers in the round, over all nodes (WORLD_SIZE).",
        f64::from(st.world_size),
    );
    gauge(
        out,
        "fsdp_agent_members",
        "Nodes in the round.",
        st.members.len() as f64,
    );
    gauge(
        out,
        "fsdp_agent_ready",
        "1 while workers run in a sealed round.",
        if st.ready { 1.0 } else { 0.0 },
    );
    gauge(
        out,
        "fsdp_agent_restarts_used",
        "Failure restarts the job used (TORCHELASTIC_RESTART_COUNT).",
        f64::from(st.restarts_used),
    );
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_worker_starts_total Worker starts of this node, warm (from a --prewarm spare) or cold.\n\
         # TYPE fsdp_agent_worker_starts_total counter\n\
         fsdp_agent_worker_starts_total{{start=\"warm\"}} {}\n\
         fsdp_agent_worker_starts_total{{start=\"cold\"}} {}",
        st.warm_starts, st.cold_starts
    );
    gauge(
        out,
        "fsdp_agent_restarts_left",
        "Failure restarts left before the job gives up (--max-restarts minus used).",
        f64::from(st.restarts_left),
    );
}

/// A counter per label value (`{label="value"}`), under one HELP and TYPE.
fn counter_by(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    counts: &BTreeMap<String, u64>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (value, n) in counts {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {n}", escape(value));
    }
}

/// Hangs and the health check.
fn health(out: &mut String, s: &Snapshot) {
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_hangs_total Times this node's group was found hung (a worker stopped reporting progress).\n\
         # TYPE fsdp_agent_hangs_total counter\n\
         fsdp_agent_hangs_total {}",
        s.hangs
    );
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_health_check_failures_total Failed --health-check runs of this node.\n\
         # TYPE fsdp_agent_health_check_failures_total counter\n\
         fsdp_agent_health_check_failures_total {}\n\
         # HELP fsdp_agent_unhealthy 1 while this node stays out of rounds because its health check fails.\n\
         # TYPE fsdp_agent_unhealthy gauge\n\
         fsdp_agent_unhealthy {}",
        s.health_failures,
        u8::from(!s.state.unhealthy.is_empty())
    );
}

/// One number a family shows for each rank.
type RankValue = fn(&RankStatus) -> f64;

/// Each local rank's progress, the straggler view; nothing before the ranks report.
fn ranks(out: &mut String, ranks: &[RankStatus]) {
    if ranks.is_empty() {
        return;
    }
    let families: [(&str, &str, RankValue); 4] = [
        (
            "fsdp_agent_rank_last_step",
            "The last step each local rank reported finished.",
            |r| r.last_step as f64,
        ),
        (
            "fsdp_agent_rank_step_seconds",
            "The duration of each local rank's last step (in a synchronous job, every rank's).",
            |r| r.step_seconds,
        ),
        (
            "fsdp_agent_rank_busy_seconds",
            "The median working time per step of each local rank, outside collectives, as it reports it (stragglers are slow here; 0: not reported).",
            |r| r.busy_seconds,
        ),
        (
            "fsdp_agent_rank_silent_seconds",
            "Seconds since each local rank's last progress report.",
            |r| r.silent_seconds,
        ),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in ranks {
            let _ = writeln!(out, "{name}{{rank=\"{}\"}} {}", r.rank, value(r));
        }
    }
}

/// The judge's scores (on the group's rank 0 only), one per judged node: families as in
/// [`ranks`], labelled by node.
fn straggler_scores(out: &mut String, scores: &[fsdp_proto::v1::NodeScore]) {
    if scores.is_empty() {
        return;
    }
    type NodeValue = fn(&fsdp_proto::v1::NodeScore) -> f64;
    let families: [(&str, &str, NodeValue); 2] = [
        (
            "fsdp_agent_straggler_score",
            "Each node's slowest rank's median working time over the other nodes' median (judged by the group's rank 0).",
            |n| n.score,
        ),
        (
            "fsdp_agent_straggler",
            "Whether each judged node is a straggler now (1) or not (0).",
            |n| f64::from(u8::from(n.straggler)),
        ),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for n in scores {
            let _ = writeln!(
                out,
                "{name}{{node=\"{}\"}} {}",
                escape(&n.node_id),
                value(n)
            );
        }
    }
}

/// The rendezvous' errors and the rounds this agent sealed.
fn rendezvous(out: &mut String, s: &Snapshot) {
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_rendezvous_errors_total Rendezvous errors (lost etcd connections, failed calls).\n\
         # TYPE fsdp_agent_rendezvous_errors_total counter\n\
         fsdp_agent_rendezvous_errors_total {}",
        s.rendezvous_errors
    );
    let _ = writeln!(
        out,
        "# HELP fsdp_agent_rounds_sealed_total Rounds this agent sealed as the rendezvous coordinator (alert on its rate: a healthy job seals one per membership change).\n\
         # TYPE fsdp_agent_rounds_sealed_total counter\n\
         fsdp_agent_rounds_sealed_total {}\n\
         # HELP fsdp_agent_round_seals_held_total Times the coordinator held a round back because rounds were sealed too fast (a re-form loop).\n\
         # TYPE fsdp_agent_round_seals_held_total counter\n\
         fsdp_agent_round_seals_held_total {}",
        s.rounds_sealed, s.seals_held
    );
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
    );
}

/// A summary without quantiles, plus the last observation as its own gauge: the last
/// re-form is what an operator looks at after killing a pod.
fn summary(out: &mut String, name: &str, help: &str, t: &Timing) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {}\n\
         # HELP {name}_last The last observation of {name}.\n# TYPE {name}_last gauge\n{name}_last {}",
        t.sum, t.count, t.last
    );
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The phase's name for labels and tables: "running", "rendezvous", ...
pub fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Unspecified => "unknown",
        Phase::Rendezvous => "rendezvous",
        Phase::Running => "running",
        Phase::Stopping => "stopping",
        Phase::Finishing => "finishing",
        Phase::Succeeded => "succeeded",
        Phase::Failed => "failed",
        Phase::Leaving => "leaving",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Board;
    use std::time::Duration;

    /// Every sample line is `name{labels} value` with a parsable value, and every metric
    /// has HELP and TYPE before its samples.
    fn parse(text: &str) -> Vec<(String, f64)> {
        let mut typed = std::collections::HashSet::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_owned());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (name, value) = line.rsplit_once(' ').expect("sample has a value");
            let base = name.split('{').next().unwrap();
            let family = ["_sum", "_count"]
                .iter()
                .find_map(|s| base.strip_suffix(s))
                .filter(|f| typed.contains(*f))
                .unwrap_or(base);
            assert!(typed.contains(family), "no TYPE before {line}");
            samples.push((name.to_owned(), value.parse().expect("numeric value")));
        }
        samples
    }

    #[test]
    fn the_judges_scores_are_shown_per_node_and_nothing_elsewhere() {
        let b = Board::new("j", "etcd", 3);
        assert!(!render(&b.snapshot()).contains("fsdp_agent_straggler"));
        b.straggler_scores(vec![fsdp_proto::v1::NodeScore {
            node_id: "n\"1".into(),
            score: 2.5,
            rank: 3,
            busy_seconds: 0.25,
            straggler: true,
        }]);
        let text = render(&b.snapshot());
        assert!(
            text.contains("fsdp_agent_straggler_score{node=\"n\\\"1\"} 2.5"),
            "{text}"
        );
        assert!(
            text.contains("fsdp_agent_straggler{node=\"n\\\"1\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE fsdp_agent_straggler gauge"), "{text}");
    }

    #[test]
    fn hangs_and_each_reporting_ranks_progress_are_shown() {
        let b = Board::new("j", "etcd", 3);
        let text = render(&b.snapshot());
        assert!(text.contains("fsdp_agent_hangs_total 0"), "{text}");
        assert!(!text.contains("fsdp_agent_rank_last_step"), "{text}");
        b.hung();
        b.ranks(vec![fsdp_proto::v1::RankStatus {
            rank: 3,
            last_step: 12,
            step_seconds: 0.25,
            silent_seconds: 1.5,
            busy_seconds: 0.125,
            paced_steps: 20,
        }]);
        let text = render(&b.snapshot());
        for line in [
            "fsdp_agent_hangs_total 1",
            "fsdp_agent_rank_last_step{rank=\"3\"} 12",
            "fsdp_agent_rank_step_seconds{rank=\"3\"} 0.25",
            "fsdp_agent_rank_silent_seconds{rank=\"3\"} 1.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
    }

    #[test]
    fn every_line_parses_and_numbers_follow_the_board() {
        let b = Board::new("job\"1", "etcd", 3);
        b.reform_started("worker failed");
        b.observe_reform(Duration::from_millis(1500));
        b.observe_reform(Duration::from_millis(500));
        b.workers(
            &[crate::supervisor::WorkerStatus {
                local_rank: 0,
                rank: 0,
                pid: 10,
                exit: Some(crate::failure::WorkerExit::Signal(9)),
                stopped_by_agent: false,
            }],
            true,
        );
        let text = render(&b.snapshot());
        let samples = parse(&text);
        let get = |n: &str| samples.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert_eq!(get("fsdp_agent_restarts_left"), Some(3.0));
        assert_eq!(get("fsdp_agent_reform_seconds_sum"), Some(2.0));
        assert_eq!(get("fsdp_agent_reform_seconds_count"), Some(2.0));
        assert_eq!(get("fsdp_agent_reform_seconds_last"), Some(0.5));
        assert_eq!(
            get("fsdp_agent_worker_exits_total{exit=\"SIGKILL\"}"),
            Some(1.0)
        );
        assert_eq!(
            get("fsdp_agent_reforms_total{reason=\"worker failed\"}"),
            Some(1.0)
        );
        assert!(text.contains("run_id=\"job\\\"1\""), "{text}");
    }
}
