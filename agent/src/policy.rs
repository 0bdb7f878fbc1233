//! The agent's decisions about the restart budget, as pure functions tested without
//! processes.
//!
//! The budget is read from the sealed round: `restart_count` there is the job-wide count of
//! failure restarts, the same on every node, so every node reaches the same decision.

use std::time::Duration;

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
/// When the budget is spent, a node propagates its own last worker's exit code; a node
/// whose workers did not fail, or failed by a signal, exits with
/// [`exit_code::BUDGET_EXHAUSTED`] rather than 128+n, which would read as "the agent was
/// stopped" and be retried by Kubernetes.
pub fn budget(restart_count: u32, max_restarts: u32, last_failure: Option<WorkerExit>) -> Budget {
    if restart_count <= max_restarts {
        return Budget::Left;
    }
    let exit_code = match last_failure {
        Some(WorkerExit::Code(c)) if (1..=255).contains(&c) => c as u8,
        Some(WorkerExit::Hung) => exit_code::HUNG,
        _ => exit_code::BUDGET_EXHAUSTED,
    };
    Budget::Spent { exit_code }
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
        assert_eq!(
            budget(1, 0, Some(WorkerExit::Signal(9))),
            permanent,
            "a worker killed by a signal"
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
