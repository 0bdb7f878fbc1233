//! Ending the run for every node: the failure policy's verdicts after a failed attempt
//! ([`crate::policy::after_failure`]: a no-retry exit code, restarts that make no
//! progress), and what a node does when another node ended the run.

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{Departure, Halt, JobRecords, Rendezvous};
use nix::sys::signal::Signal;

use super::{AgentExit, DEPART_PATIENCE, Loop, Phase};
use crate::failure::WorkerExit;
use crate::policy::{AfterFailure, after_failure};

impl<R: Rendezvous> Loop<'_, R> {
    /// The attempt that just ended failed (here, or on a peer) with `exit` first: enters
    /// how far its ranks got and asks the policy. No I/O: the caller acts on the verdict.
    pub(super) fn judge_failure(&mut self, exit: WorkerExit) -> AfterFailure {
        let reached = self.progress.as_ref().and_then(|p| {
            p.snapshot()
                .iter()
                .filter_map(|r| r.last_step.map(|(n, _)| n))
                .max()
        });
        self.ledger.failed_attempt(reached);
        after_failure(exit, &self.ledger, &self.cfg.failure)
    }

    /// Tells every node that the run is over. Done before this node stops its own workers:
    /// the peers' workers fail as a consequence, and their failure must not be charged
    /// (etcd refuses a failure report once the run is halted).
    pub(super) async fn announce_halt(
        &mut self,
        exit_code: u8,
        reason: &str,
    ) -> Result<(), Signal> {
        tracing::error!(exit_code, %reason, "ending the run on every node");
        // A backend without records has nobody else to tell.
        let Some(records) = self.rdzv.records() else {
            return Ok(());
        };
        let tell =
            tokio::time::timeout(DEPART_PATIENCE, records.halt(exit_code, reason.to_owned()));
        match Self::interruptible(self.signals, tell).await? {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not tell the other nodes; they restart without this node")
            }
            Err(_) => tracing::warn!(
                "telling the other nodes took too long; they restart without this node"
            ),
        }
        Ok(())
    }

    /// This node ended the run: it leaves with `exit_code`, the budget unspent.
    pub(super) fn leave_halted(&mut self, exit_code: u8, reason: &str) -> Phase {
        self.report
            .show(Shown::Failed, format!("ended the run: {reason}"));
        Phase::Leave {
            how: Departure::Failed,
            exit: AgentExit::Failed { exit_code },
        }
    }

    /// Another node ended the run: this one ends with the same code.
    pub(super) fn halted(&mut self, h: &Halt) -> Phase {
        tracing::error!(node = %h.node_id, exit_code = h.exit_code, reason = %h.reason, "another node ended the run");
        self.report.show(Shown::Failed, h.to_string());
        Phase::Leave {
            how: Departure::Failed,
            exit: AgentExit::Failed {
                exit_code: h.exit_code,
            },
        }
    }
}
