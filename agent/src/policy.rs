//! The failure policy: the restart budget and the rules that judge a failed attempt, as
//! pure functions tested without processes. The loop's other decisions, which apply these,
//! are in `run/decide.rs`.
//!
//! The budget is read from the sealed round: `restart_count` there is the job-wide count of
//! failure restarts, the same on every node, so every node reaches the same decision.
//!
//! The rules are one table, [`RULES`]: each entry says when its rule ends an attempt
//! otherwise than by a restart and which records that makes this node write. What this
//! node accepts from its peers' records is derived from the same entries ([`writes`]), so
//! a rule added to the table cannot be refused by the peers that must obey it.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::config::FailurePolicy;
use crate::exit_code;
use crate::failure::WorkerExit;

/// Whether a round may start its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Left,
    /// More failure restarts than allowed: stop with this code.
    Spent {
        exit_code: u8,
    },
}

/// Decides whether a round with `restart_count` failure restarts may run.
///
/// When the budget is spent, a node passes on how its own last worker ended, as a shell
/// would: its exit code, or 128+n for a worker killed by signal n (a SIGSEGV gives 139).
/// A node whose workers did not fail (a peer's did) exits
/// [`exit_code::BUDGET_EXHAUSTED`]; one whose last failure was a hang,
/// [`exit_code::HUNG`].
pub fn budget(restart_count: u32, max_restarts: u32, last_failure: Option<WorkerExit>) -> Budget {
    if restart_count <= max_restarts {
        return Budget::Left;
    }
    let exit_code = match last_failure {
        Some(WorkerExit::Code(c)) if (1..=255).contains(&c) => c as u8,
        Some(WorkerExit::Hung) => exit_code::HUNG,
        Some(WorkerExit::Signal(s)) => exit_code::signalled(s),
        _ => exit_code::BUDGET_EXHAUSTED,
    };
    Budget::Spent { exit_code }
}

/// A round that ended in a failure, as quarantine looks at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedRound {
    pub round: u64,
    /// The node whose failure was reported first (`None`: nobody's was, e.g. a hang).
    pub first: Option<String>,
    /// The round lost a member: its workers' failures may all be that loss.
    pub lost_member: bool,
}

/// Whom to quarantine after the failed rounds `history` (oldest first): the node whose
/// failure came first in each of the last `after` of them, provided no member was lost
/// in any — a peer's death surfaces as failures everywhere, and the first of those is
/// nobody's fault. `None`: nobody.
pub fn blame(history: &[FailedRound], after: u32) -> Option<(String, String)> {
    let k = after as usize;
    if k == 0 || history.len() < k {
        return None;
    }
    let last = &history[history.len() - k..];
    if last.iter().any(|r| r.lost_member) {
        return None;
    }
    let node = last[0].first.clone()?;
    if last
        .iter()
        .any(|r| r.first.as_deref() != Some(node.as_str()))
    {
        return None;
    }
    let rounds: Vec<String> = last.iter().map(|r| r.round.to_string()).collect();
    let reason = format!(
        "the first failure of rounds {} came from node {node} while the others were fine",
        rounds.join(", ")
    );
    Some((node, reason))
}

/// The failure restarts `--max-restarts` is held against in `round`: all of them, or those
/// charged within `window` before the round was sealed. Every node reads the same record,
/// so every node counts the same.
pub fn restarts_counted(round: &fsdp_rendezvous::Round, window: Option<Duration>) -> u32 {
    let Some(w) = window else {
        return round.restart_count;
    };
    let from = round
        .sealed_at_ms
        .saturating_sub(u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
    let within = round.charged_at_ms.iter().filter(|t| **t > from).count();
    u32::try_from(within).unwrap_or(u32::MAX)
}

/// What the failure policy says about a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Charge the budget and restart (the budget decides at the next round).
    Restart,
    /// End the run for every node with this code.
    Halt { exit_code: u8, reason: String },
    /// Keep this node's machine out of the run for `--quarantine-for` and leave with
    /// [`exit_code::QUARANTINED`], charging nothing: the fault is the machine's, not the
    /// job's, and the others re-form without it.
    Quarantine { reason: String },
}

/// The records a rule can make this node write for its peers to obey.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writes {
    /// The exit codes its halts (`ctl/halt`) can carry.
    pub halt_codes: BTreeSet<u8>,
    /// Whether it can quarantine a machine (`ctl/quarantine/<machine>`).
    pub quarantine: bool,
}

impl Writes {
    fn halts(codes: impl IntoIterator<Item = u8>) -> Self {
        Self {
            halt_codes: codes.into_iter().collect(),
            quarantine: false,
        }
    }

    fn quarantines(when: bool) -> Self {
        Self {
            halt_codes: BTreeSet::new(),
            quarantine: when,
        }
    }
}

/// One rule of the failure policy. A rule is its entry in [`RULES`] and nothing else: the
/// loop asks every entry for a verdict, and derives from every entry what a peer's record
/// may say, so the two cannot disagree.
pub struct Rule {
    /// The flag that sets it (documented in docs/failure-policy.md, checked by a test).
    pub flag: &'static str,
    /// Its verdict on a failed attempt whose first failure was the exit given, the ledger
    /// already updated; `None`: the next rule judges.
    pub verdict: fn(WorkerExit, &ProgressLedger, &FailurePolicy) -> Option<AfterFailure>,
    /// The records its verdicts can make this node write, under `policy`. Every agent of a
    /// run is given the same flags, so a node accepts from its peers only what its own
    /// rules could write: a forged or stray record is refused.
    pub writes: fn(&FailurePolicy) -> Writes,
}

/// The failure policy's rules, asked in this order after a failed attempt; the first with a
/// verdict decides, and with none the attempt is charged and restarted.
pub const RULES: &[Rule] = &[
    Rule {
        flag: "--no-retry-exit-codes",
        verdict: no_retry,
        writes: |p| Writes::halts(p.no_retry_codes.iter().copied()),
    },
    Rule {
        flag: "--quarantine-on-exit",
        verdict: quarantine_on_exit,
        writes: |p| Writes::quarantines(!p.quarantine_on_exit.is_empty()),
    },
    Rule {
        flag: "--no-progress-restarts",
        verdict: no_progress,
        writes: |p| Writes::halts((p.no_progress_restarts > 0).then_some(exit_code::NO_PROGRESS)),
    },
    Rule {
        flag: "--quarantine-after",
        // Judged when the next round forms ([`blame`]): only then is it known whose failure
        // came first in the round, and whether a member was lost.
        verdict: |_, _, _| None,
        writes: |p| Writes::quarantines(p.quarantine_after > 0),
    },
    Rule {
        flag: "--straggler-policy",
        // Judged while the group runs, by its rank 0 (`run/straggler.rs`): no failure.
        verdict: |_, _, _| None,
        writes: |p| Writes::quarantines(p.straggler == crate::straggler::Policy::Replace),
    },
];

/// What this node's own rules can make it write under `policy`: what it accepts from its
/// peers (every agent of a run is given the same flags).
pub fn writes(policy: &FailurePolicy) -> Writes {
    RULES
        .iter()
        .map(|r| (r.writes)(policy))
        .fold(Writes::default(), |mut all, w| {
            all.halt_codes.extend(w.halt_codes);
            all.quarantine |= w.quarantine;
            all
        })
}

/// `--no-retry-exit-codes`: a listed exit code halts the run with it.
fn no_retry(exit: WorkerExit, _: &ProgressLedger, policy: &FailurePolicy) -> Option<AfterFailure> {
    let code = listed(exit, &policy.no_retry_codes)?;
    Some(AfterFailure::Halt {
        exit_code: code,
        reason: format!(
            "a worker exited {code}, which --no-retry-exit-codes marks as not worth a retry"
        ),
    })
}

/// `--quarantine-on-exit`: a listed exit code says the machine is at fault, so no restart
/// on it would help: it is kept out, and the others go on without it.
fn quarantine_on_exit(
    exit: WorkerExit,
    _: &ProgressLedger,
    policy: &FailurePolicy,
) -> Option<AfterFailure> {
    let code = listed(exit, &policy.quarantine_on_exit)?;
    Some(AfterFailure::Quarantine {
        reason: format!(
            "a worker exited {code}, which --quarantine-on-exit marks as this machine's fault"
        ),
    })
}

/// `--no-progress-restarts`: `k` failed attempts in a row that never got past the best step
/// halt the run with [`exit_code::NO_PROGRESS`].
fn no_progress(
    _: WorkerExit,
    ledger: &ProgressLedger,
    policy: &FailurePolicy,
) -> Option<AfterFailure> {
    let k = policy.no_progress_restarts;
    (k > 0 && ledger.stalled >= k).then(|| AfterFailure::Halt {
        exit_code: exit_code::NO_PROGRESS,
        reason: format!(
            "{} attempts in a row never got past step {} (--no-progress-restarts {k})",
            ledger.stalled,
            ledger.best.unwrap_or_default()
        ),
    })
}

/// The exit code of `exit` if it is one of `codes`.
fn listed(exit: WorkerExit, codes: &[u8]) -> Option<u8> {
    match exit {
        WorkerExit::Code(c) => u8::try_from(c).ok().filter(|c| codes.contains(c)),
        _ => None,
    }
}

/// The best step this node's ranks reached over the run's attempts, and how many failed
/// attempts in a row did not get past it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgressLedger {
    pub best: Option<u64>,
    pub stalled: u32,
}

impl ProgressLedger {
    /// A failed attempt whose ranks reached `reached` at best (`None`: they reported no
    /// step, so nothing is known and nothing is judged).
    pub fn failed_attempt(&mut self, reached: Option<u64>) {
        let Some(r) = reached else {
            self.stalled = 0;
            return;
        };
        if self.best.is_none_or(|b| r > b) {
            self.best = Some(r);
            self.stalled = 0;
        } else {
            self.stalled += 1;
        }
    }
}

/// Decides, after a failed attempt (already entered in `ledger`) whose first failure was
/// `exit`, whether to restart or to end the run.
pub fn after_failure(
    exit: WorkerExit,
    ledger: &ProgressLedger,
    policy: &FailurePolicy,
) -> AfterFailure {
    RULES
        .iter()
        .find_map(|r| (r.verdict)(exit, ledger, policy))
        .unwrap_or(AfterFailure::Restart)
}

/// Pause before re-forming after the `n`-th failure (0-based): 100 ms doubling to 5 s,
/// with up to ±50 % jitter so nodes that failed together do not retry in lockstep.
pub fn restart_backoff(n: u32) -> Duration {
    let base = fsdp_rendezvous::backoff::nth(Duration::from_millis(100), Duration::from_secs(5), n);
    let jitter = (uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 1000.0; // 0..1
    base.mul_f64(0.5 + jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_no_retry_code_halts_at_once_and_others_restart() {
        let policy = FailurePolicy {
            no_retry_codes: vec![2, 3],
            ..FailurePolicy::default()
        };
        let ledger = ProgressLedger::default();
        match after_failure(WorkerExit::Code(3), &ledger, &policy) {
            AfterFailure::Halt { exit_code, reason } => {
                assert_eq!(exit_code, 3);
                assert!(reason.contains("--no-retry-exit-codes"), "{reason}");
            }
            a => panic!("{a:?}"),
        }
        for other in [
            WorkerExit::Code(1),
            WorkerExit::Code(259),
            WorkerExit::Signal(2),
            WorkerExit::Hung,
        ] {
            assert_eq!(
                after_failure(other, &ledger, &policy),
                AfterFailure::Restart,
                "{other:?}"
            );
        }
    }

    #[test]
    fn a_quarantine_code_keeps_the_machine_out_and_others_restart() {
        let policy = FailurePolicy {
            quarantine_on_exit: vec![74],
            no_retry_codes: vec![3],
            ..FailurePolicy::default()
        };
        let ledger = ProgressLedger::default();
        match after_failure(WorkerExit::Code(74), &ledger, &policy) {
            AfterFailure::Quarantine { reason } => {
                assert!(reason.contains("--quarantine-on-exit"), "{reason}");
            }
            a => panic!("{a:?}"),
        }
        assert!(matches!(
            after_failure(WorkerExit::Code(3), &ledger, &policy),
            AfterFailure::Halt { exit_code: 3, .. }
        ));
        for other in [
            WorkerExit::Code(1),
            WorkerExit::Signal(74),
            WorkerExit::Lost,
        ] {
            assert_eq!(
                after_failure(other, &ledger, &policy),
                AfterFailure::Restart,
                "{other:?}"
            );
        }
        // Peers accept this node's quarantine record, though it never blames.
        let only = FailurePolicy {
            quarantine_on_exit: vec![74],
            quarantine_after: 0,
            ..FailurePolicy::default()
        };
        assert!(writes(&only).quarantine);
    }

    #[test]
    fn what_peers_may_write_is_what_the_rules_here_would() {
        let policy = FailurePolicy {
            no_retry_codes: vec![2, 3],
            no_progress_restarts: 3,
            quarantine_after: 0,
            ..FailurePolicy::default()
        };
        assert_eq!(
            writes(&policy),
            Writes {
                halt_codes: [2, 3, exit_code::NO_PROGRESS].into(),
                quarantine: false,
            }
        );
        let blames = FailurePolicy {
            quarantine_after: 3,
            ..FailurePolicy::default()
        };
        assert_eq!(
            writes(&blames),
            Writes {
                halt_codes: BTreeSet::new(),
                quarantine: true,
            },
            "rules turned off write nothing"
        );
    }

    #[test]
    fn every_rule_is_a_flag_of_the_agent_and_documented() {
        let command = crate::cli::command();
        let doc = include_str!("../../docs/failure-policy.md");
        for rule in RULES {
            let long = rule.flag.trim_start_matches("--");
            assert!(
                command.get_arguments().any(|a| a.get_long() == Some(long)),
                "{} is no flag of the agent",
                rule.flag
            );
            assert!(
                doc.contains(&format!("`{}", rule.flag)),
                "{} is not in docs/failure-policy.md",
                rule.flag
            );
        }
    }

    #[test]
    fn restarts_that_never_pass_the_best_step_halt_after_k() {
        let policy = FailurePolicy {
            no_progress_restarts: 3,
            ..FailurePolicy::default()
        };
        let mut l = ProgressLedger::default();
        let exit = WorkerExit::Code(1);
        // Reaches 10, then resumes from 5 and dies at 10 again, and again.
        for (reached, verdict_halts) in [(10, false), (10, false), (9, false), (10, true)] {
            l.failed_attempt(Some(reached));
            let halts = matches!(
                after_failure(exit, &l, &policy),
                AfterFailure::Halt {
                    exit_code: exit_code::NO_PROGRESS,
                    ..
                }
            );
            assert_eq!(halts, verdict_halts, "{l:?}");
        }
        // Getting past the best step starts the count again; so does not knowing.
        l.failed_attempt(Some(11));
        assert_eq!(
            l,
            ProgressLedger {
                best: Some(11),
                stalled: 0
            }
        );
        l.failed_attempt(Some(11));
        l.failed_attempt(None);
        assert_eq!(l.stalled, 0);
        // 0 turns the rule off.
        let off = FailurePolicy::default();
        let stuck = ProgressLedger {
            best: Some(1),
            stalled: 100,
        };
        assert_eq!(after_failure(exit, &stuck, &off), AfterFailure::Restart);
    }

    #[test]
    fn a_restart_window_forgives_old_failures_and_counts_alike_everywhere() {
        let mut round = fsdp_rendezvous::Round::new(
            4,
            vec![fsdp_rendezvous::RoundMember::unranked(
                "a".into(),
                "a".into(),
                1,
            )],
            0,
            ("a".into(), 1),
            3,
            String::new(),
        )
        .unwrap();
        let h = 3_600_000;
        round.sealed_at_ms = 10 * h;
        round.charged_at_ms = vec![h, 8 * h, 9 * h + 1];
        assert_eq!(restarts_counted(&round, None), 3);
        let hour = Duration::from_secs(3600);
        assert_eq!(restarts_counted(&round, Some(hour)), 1);
        assert_eq!(restarts_counted(&round, Some(3 * hour)), 2);
        assert_eq!(restarts_counted(&round, Some(100 * hour)), 3);
    }

    fn failed(round: u64, first: Option<&str>, lost_member: bool) -> FailedRound {
        FailedRound {
            round,
            first: first.map(str::to_owned),
            lost_member,
        }
    }

    #[test]
    fn the_node_first_to_fail_round_after_round_is_blamed() {
        let h = [
            failed(1, Some("a"), false),
            failed(2, Some("c"), false),
            failed(3, Some("c"), false),
            failed(5, Some("c"), false),
        ];
        let (node, reason) = blame(&h, 3).unwrap();
        assert_eq!(node, "c");
        assert!(reason.contains("rounds 2, 3, 5"), "{reason}");
        assert_eq!(blame(&h, 4), None, "a was first once");
        assert_eq!(blame(&h[..3], 3), None);
        assert_eq!(blame(&h, 0), None, "0 turns it off");
    }

    #[test]
    fn nobody_is_blamed_for_a_round_that_lost_a_member_or_had_no_first() {
        // A SIGKILLed peer: the survivors' workers fail, one of them first; not its fault.
        let killed = [
            failed(1, Some("a"), true),
            failed(2, Some("a"), true),
            failed(3, Some("a"), true),
        ];
        assert_eq!(blame(&killed, 1), None);
        assert_eq!(blame(&killed, 3), None);
        let hang = [failed(1, None, false)];
        assert_eq!(blame(&hang, 1), None);
    }

    #[test]
    fn rounds_within_the_budget_run() {
        assert_eq!(budget(0, 0, None), Budget::Left);
        assert_eq!(budget(2, 2, Some(WorkerExit::Code(3))), Budget::Left);
    }

    #[test]
    fn a_spent_budget_propagates_the_workers_code() {
        assert_eq!(
            budget(3, 2, Some(WorkerExit::Code(7))),
            Budget::Spent { exit_code: 7 }
        );
        assert_eq!(
            budget(1, 0, Some(WorkerExit::Code(1))),
            Budget::Spent { exit_code: 1 }
        );
    }

    #[test]
    fn no_code_of_its_own_gives_the_permanent_code() {
        let permanent = Budget::Spent {
            exit_code: exit_code::BUDGET_EXHAUSTED,
        };
        assert_eq!(budget(1, 0, None), permanent, "a node whose peer failed");
        assert_eq!(budget(1, 0, Some(WorkerExit::Lost)), permanent);
    }

    #[test]
    fn a_worker_killed_by_a_signal_gives_128_plus_n_as_a_shell_does() {
        assert_eq!(
            budget(1, 0, Some(WorkerExit::Signal(11))),
            Budget::Spent { exit_code: 139 }
        );
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        for n in 0..20 {
            let d = restart_backoff(n);
            assert!(
                d >= Duration::from_millis(50) && d <= Duration::from_millis(7500),
                "{n}: {d:?}"
            );
        }
        assert!(restart_backoff(10) > Duration::from_secs(2));
    }
}
