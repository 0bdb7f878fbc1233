//! What to do when the worker group fails: a pure function of the restart budget and the
//! root cause, tested without processes.

use crate::exit_code;
use crate::failure::WorkerExit;

/// The agent's next step after a failed group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Charge one restart and start a new group.
    Restart,
    /// The budget is spent: stop and exit with this code.
    GiveUp { exit_code: u8 },
}

/// Decides between a restart and giving up, with the reason to log.
///
/// `restarts_used` is the job-wide count before this failure. A worker's own exit code is
/// propagated when the job ends; a worker killed by a signal has no code of its own, and
/// the agent then exits with [`exit_code::BUDGET_EXHAUSTED`] rather than 128+n, which
/// would read as "the agent was stopped" and be retried by Kubernetes.
pub fn after_failure(
    restarts_used: u32,
    max_restarts: u32,
    root_cause: WorkerExit,
) -> (AfterFailure, String) {
    if restarts_used < max_restarts {
        return (
            AfterFailure::Restart,
            format!(
                "worker failed ({root_cause}); restart {} of {max_restarts}",
                restarts_used + 1
            ),
        );
    }
    let exit_code = match root_cause {
        WorkerExit::Code(c) if (1..=255).contains(&c) => c as u8,
        _ => exit_code::BUDGET_EXHAUSTED,
    };
    (
        AfterFailure::GiveUp { exit_code },
        format!("worker failed ({root_cause}) and the restart budget ({max_restarts}) is spent"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_while_the_budget_lasts() {
        let (d, why) = after_failure(0, 2, WorkerExit::Code(3));
        assert_eq!(d, AfterFailure::Restart);
        assert!(why.contains("restart 1 of 2"), "{why}");
        assert_eq!(
            after_failure(1, 2, WorkerExit::Code(3)).0,
            AfterFailure::Restart
        );
    }

    #[test]
    fn propagates_the_workers_code_when_spent() {
        let (d, why) = after_failure(2, 2, WorkerExit::Code(7));
        assert_eq!(d, AfterFailure::GiveUp { exit_code: 7 });
        assert!(why.contains("spent"), "{why}");
    }

    #[test]
    fn zero_budget_gives_up_at_once() {
        assert_eq!(
            after_failure(0, 0, WorkerExit::Code(1)).0,
            AfterFailure::GiveUp { exit_code: 1 }
        );
    }

    #[test]
    fn a_signalled_worker_gives_the_permanent_code() {
        assert_eq!(
            after_failure(0, 0, WorkerExit::Signal(9)).0,
            AfterFailure::GiveUp {
                exit_code: exit_code::BUDGET_EXHAUSTED
            }
        );
    }
}
