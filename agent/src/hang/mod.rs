//! Hangs: a group whose workers are alive but no longer make progress.
//!
//! Workers that want to be watched report progress on a Unix datagram socket the agent
//! names in `FSDP_AGENT_PROGRESS` ([`progress`]): `"<rank> step <n>"` when a step ends,
//! `"<rank> begin <phase>"` / `"<rank> end <phase>"` around a long phase (a checkpoint,
//! an evaluation). A rank that never reports is never judged: watching is opt-in by use.
//!
//! [`judge`] decides, as a pure function of (now, the ranks' progress, config), whether the
//! group hangs and which ranks are to blame; the agent loop waits on it beside the workers,
//! signals and the rendezvous, and a hang ends like a crash: stacks dumped ([`dump`]),
//! workers stopped, a restart charged.
//!
//! Its settings ([`HangConfig`]: `--hang-timeout`, `--hang-min`) are parsed in
//! `config::hang`; this module only judges by them.

pub mod culprit;
pub mod dump;
pub mod file_timer;
pub mod progress;

use std::time::Instant;

pub use progress::{Progress, RankProgress};

use crate::config::{HangConfig, HangTimeout};

/// The phase of a rank whose training is over: `examples/progress.py` reports it at the
/// interpreter's exit (or when the script calls `finish()`), and every rank of a group
/// where a worker already exited 0 is judged by its allowance. What follows the last step
/// (a final save without a phase, `destroy_process_group`, the interpreter's own teardown)
/// is not a step and must not be timed as one.
pub const FINISH: &str = "finish";

/// Steps observed before the automatic timeout trusts their durations.
pub const AUTO_AFTER_STEPS: usize = 3;
/// The automatic allowance: this many times the slowest recent step.
pub const AUTO_FACTOR: u32 = 10;

/// The verdict on a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nobody is late; look again at `recheck_at` (`None`: nobody is judged yet).
    Healthy { recheck_at: Option<Instant> },
    /// Some rank is past its allowance. `behind` are this node's ranks that did not reach
    /// the furthest step any of its ranks reached (the ones to look at); empty when they all
    /// did — then the rank behind is on another node.
    Hung { behind: Vec<u32>, reason: String },
}

/// One rank's deadline and what it is waiting for, or `None` if it is not judged: its own,
/// or, once the group is finishing, the finish allowance if that is later.
fn deadline(p: &RankProgress, group: &GroupTimes, cfg: &HangConfig) -> Option<(Instant, String)> {
    if !p.reported {
        return None;
    }
    let own = own_deadline(p, group.started, cfg);
    let Some(since) = group.finishing else {
        return own;
    };
    let finish = (
        since + cfg.phase_allowance(FINISH),
        "while the group finishes (a worker here exited 0)".to_owned(),
    );
    Some(match own {
        Some(own) if own.0 > finish.0 => own,
        _ => finish,
    })
}

/// When the running group started, and since when it is finishing (a local worker exited
/// 0; the others are ending too, and the time they take is not a step's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupTimes {
    pub started: Instant,
    pub finishing: Option<Instant>,
}

impl GroupTimes {
    pub fn started(at: Instant) -> Self {
        Self {
            started: at,
            finishing: None,
        }
    }
}

/// A rank's deadline from its own reports alone.
fn own_deadline(
    p: &RankProgress,
    group_start: Instant,
    cfg: &HangConfig,
) -> Option<(Instant, String)> {
    if let Some((name, since)) = &p.phase {
        return Some((
            *since + cfg.phase_allowance(name),
            format!("in phase '{name}'"),
        ));
    }
    let Some((step, at)) = p.last_step else {
        return Some((group_start + cfg.startup, "before its first step".into()));
    };
    let allowance = match cfg.timeout {
        HangTimeout::Off => return None,
        HangTimeout::Fixed(d) => d,
        HangTimeout::Auto { min } if p.recent.len() >= AUTO_AFTER_STEPS => {
            let slowest = p.recent.iter().max().copied().unwrap_or_default();
            (slowest * AUTO_FACTOR).max(min)
        }
        // Too few steps to know what a step takes: the start-up allowance.
        HangTimeout::Auto { .. } => cfg.startup,
    };
    Some((at + allowance, format!("after step {step}")))
}

/// Decides whether the group of `ranks` (the ranks of its workers that still run) hangs
/// at `now`.
pub fn judge(
    now: Instant,
    group: &GroupTimes,
    ranks: &[RankProgress],
    cfg: &HangConfig,
) -> Verdict {
    if cfg.timeout == HangTimeout::Off {
        return Verdict::Healthy { recheck_at: None };
    }
    let judged: Vec<(&RankProgress, Instant, String)> = ranks
        .iter()
        .filter_map(|p| deadline(p, group, cfg).map(|(d, what)| (p, d, what)))
        .collect();
    let Some((late, at, what)) = judged
        .iter()
        .filter(|(_, d, _)| *d <= now)
        .min_by_key(|(_, d, _)| *d)
    else {
        return Verdict::Healthy {
            recheck_at: judged.iter().map(|(_, d, _)| *d).min(),
        };
    };
    let furthest = ranks
        .iter()
        .filter_map(|p| p.last_step.map(|(s, _)| s))
        .max();
    let behind: Vec<u32> = ranks
        .iter()
        .filter(|p| p.reported && p.last_step.map(|(s, _)| s) < furthest)
        .map(|p| p.rank)
        .collect();
    let silent = now.saturating_duration_since(late.last_report.unwrap_or(group.started));
    let mut reason = format!(
        "rank {} made no progress {what} for {:.1}s (allowed until {:.1}s ago)",
        late.rank,
        silent.as_secs_f64(),
        now.saturating_duration_since(*at).as_secs_f64()
    );
    match furthest {
        Some(f) if behind.is_empty() => reason.push_str(&format!(
            "; every rank here finished step {f}: the rank behind is on another node"
        )),
        Some(f) => {
            let names: Vec<String> = behind.iter().map(u32::to_string).collect();
            reason.push_str(&format!(
                "; furthest step {f}, behind it: rank {}",
                names.join(", ")
            ));
        }
        None => {}
    }
    Verdict::Hung { behind, reason }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn cfg(timeout: HangTimeout) -> HangConfig {
        HangConfig {
            timeout,
            startup: 60 * S,
            phase: 600 * S,
            phases: BTreeMap::new(),
        }
    }

    #[test]
    fn a_named_phase_gets_its_own_allowance() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let mut c = cfg(HangTimeout::Auto { min: S });
        c.phases.insert("checkpoint".into(), 3000 * S);
        let mut saving = stepping(0, t0, &[(1, 0.2), (2, 0.4), (3, 0.6), (4, 0.8)]);
        saving.phase_begin("checkpoint", t0 + S);
        assert!(matches!(
            judge(t0 + 1000 * S, &g, &[saving.clone()], &c),
            Verdict::Healthy { .. }
        ));
        let mut eval = stepping(0, t0, &[(1, 0.2), (2, 0.4), (3, 0.6), (4, 0.8)]);
        eval.phase_begin("eval", t0 + S);
        assert!(matches!(
            judge(t0 + 1000 * S, &g, &[eval], &c),
            Verdict::Hung { .. }
        ));
    }

    fn stepping(rank: u32, t0: Instant, steps: &[(u64, f64)]) -> RankProgress {
        let mut p = RankProgress::new(rank);
        for (n, at) in steps {
            p.step(*n, None, t0 + Duration::from_secs_f64(*at));
        }
        p
    }

    #[test]
    fn a_rank_that_never_reports_is_never_judged() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let quiet = [RankProgress::new(0), RankProgress::new(1)];
        let v = judge(t0 + 10_000 * S, &g, &quiet, &cfg(HangTimeout::Fixed(S)));
        assert_eq!(v, Verdict::Healthy { recheck_at: None });
    }

    #[test]
    fn the_automatic_timeout_follows_the_steps_with_a_floor() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        // Steps of 0.2 s: the allowance is max(10 × 0.2 s, 1 s) = 2 s after the last.
        let steps: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.2 * n as f64)).collect();
        let ranks = [stepping(0, t0, &steps), stepping(1, t0, &steps[..4])];
        let c = cfg(HangTimeout::Auto { min: S });
        let last = t0 + Duration::from_secs_f64(0.8);
        match judge(t0 + S, &g, &ranks, &c) {
            Verdict::Healthy { recheck_at } => {
                assert_eq!(recheck_at, Some(last + 2 * S));
            }
            v => panic!("{v:?}"),
        }
        match judge(last + 2 * S, &g, &ranks, &c) {
            Verdict::Hung { behind, reason } => {
                assert_eq!(behind, [1]);
                assert!(
                    reason.contains("rank 1") && reason.contains("furthest step 5"),
                    "{reason}"
                );
            }
            v => panic!("{v:?}"),
        }
        // The floor: fast steps still get the minimum.
        let fast: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.001 * n as f64)).collect();
        let ranks = [stepping(0, t0, &fast)];
        let c = cfg(HangTimeout::Auto { min: 30 * S });
        assert!(matches!(
            judge(t0 + 29 * S, &g, &ranks, &c),
            Verdict::Healthy { .. }
        ));
        assert!(matches!(
            judge(t0 + 31 * S, &g, &ranks, &c),
            Verdict::Hung { .. }
        ));
    }

    #[test]
    fn ranks_all_at_the_same_step_point_at_another_node() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let steps: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.2 * n as f64)).collect();
        let ranks = [stepping(0, t0, &steps), stepping(1, t0, &steps)];
        let c = cfg(HangTimeout::Auto { min: S });
        match judge(t0 + 10 * S, &g, &ranks, &c) {
            Verdict::Hung { behind, reason } => {
                assert!(behind.is_empty());
                assert!(reason.contains("on another node"), "{reason}");
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn the_first_steps_get_the_startup_allowance() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let mut started = RankProgress::new(0);
        started.phase_begin("load", t0);
        started.phase_end("load", t0 + S);
        let c = cfg(HangTimeout::Auto { min: S });
        assert!(matches!(
            judge(t0 + 59 * S, &g, &[started.clone()], &c),
            Verdict::Healthy { .. }
        ));
        assert!(matches!(
            judge(t0 + 61 * S, &g, &[started], &c),
            Verdict::Hung { .. }
        ));
        // One or two steps are not enough to know a step's length.
        let few = stepping(0, t0, &[(1, 0.1), (2, 0.2)]);
        assert!(matches!(
            judge(t0 + 30 * S, &g, &[few], &c),
            Verdict::Healthy { .. }
        ));
    }

    #[test]
    fn a_long_phase_is_not_a_hang_until_its_own_allowance_runs_out() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let steps: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.2 * n as f64)).collect();
        let mut saving = stepping(0, t0, &steps);
        saving.phase_begin("checkpoint", t0 + S);
        let c = cfg(HangTimeout::Auto { min: S });
        // 3× the usual step and far more: still inside the phase allowance.
        assert!(matches!(
            judge(t0 + 100 * S, &g, &[saving.clone()], &c),
            Verdict::Healthy { .. }
        ));
        match judge(t0 + 602 * S, &g, &[saving.clone()], &c) {
            Verdict::Hung { reason, .. } => assert!(reason.contains("checkpoint"), "{reason}"),
            v => panic!("{v:?}"),
        }
        saving.phase_end("checkpoint", t0 + 4 * S);
        assert!(matches!(
            judge(t0 + 5 * S, &g, &[saving], &c),
            Verdict::Healthy { .. }
        ));
    }

    #[test]
    fn once_a_worker_exited_0_the_others_get_the_finish_allowance() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let steps: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.2 * n as f64)).collect();
        let saving_at_the_end = [stepping(1, t0, &steps)];
        let c = cfg(HangTimeout::Auto { min: S });
        let last = t0 + Duration::from_secs_f64(1.0);
        // Rank 0 exited 0 right after the last step: rank 1's final save is not a step.
        let finishing = GroupTimes {
            started: t0,
            finishing: Some(last),
        };
        assert_eq!(
            judge(last + 10 * S, &finishing, &saving_at_the_end, &c),
            Verdict::Healthy {
                recheck_at: Some(last + 600 * S)
            }
        );
        match judge(last + 601 * S, &finishing, &saving_at_the_end, &c) {
            Verdict::Hung { reason, .. } => {
                assert!(reason.contains("while the group finishes"), "{reason}")
            }
            v => panic!("{v:?}"),
        }
        // Without the exit the same silence is a hang after 10 × 0.2 s.
        assert!(matches!(
            judge(last + 10 * S, &g, &saving_at_the_end, &c),
            Verdict::Hung { .. }
        ));
        // A phase of its own that runs longer than the finish allowance keeps its deadline.
        let mut c = c;
        c.phases.insert("upload".into(), 7200 * S);
        let mut uploading = stepping(1, t0, &steps);
        uploading.phase_begin("upload", last);
        assert!(matches!(
            judge(last + 3600 * S, &finishing, &[uploading], &c),
            Verdict::Healthy { .. }
        ));
    }

    #[test]
    fn the_finish_phase_reported_at_exit_has_its_own_allowance() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let steps: Vec<(u64, f64)> = (1..=5).map(|n| (n, 0.2 * n as f64)).collect();
        let mut exiting = stepping(0, t0, &steps);
        exiting.phase_begin(FINISH, t0 + S);
        let mut c = cfg(HangTimeout::Auto { min: S });
        c.phases.insert(FINISH.into(), 120 * S);
        assert!(matches!(
            judge(t0 + 100 * S, &g, &[exiting.clone()], &c),
            Verdict::Healthy { .. }
        ));
        assert!(matches!(
            judge(t0 + 122 * S, &g, &[exiting], &c),
            Verdict::Hung { .. }
        ));
    }

    #[test]
    fn off_judges_nobody() {
        let t0 = Instant::now();
        let g = GroupTimes::started(t0);
        let ranks = [stepping(0, t0, &[(1, 0.1)])];
        let v = judge(t0 + 10_000 * S, &g, &ranks, &cfg(HangTimeout::Off));
        assert_eq!(v, Verdict::Healthy { recheck_at: None });
    }
}
