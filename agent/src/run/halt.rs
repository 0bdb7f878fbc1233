//! Ending the run for every node, the driver's part: telling the others when the failure
//! policy's verdict ([`super::decide::judge`]) ends the run here, and what a node does
//! when another node ended it.

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{Halt, JobRecords, Rendezvous};
use nix::sys::signal::Signal;

use super::decide::{self, Leave};
use super::driver::{Loop, interruptible};
use super::{DEPART_PATIENCE, Phase};

impl<R: Rendezvous> Loop<'_, R> {
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
        match interruptible(self.signals, tell).await? {
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

    /// This node ended the run for `reason`: it leaves this way, the budget unspent.
    pub(super) fn leave_halted(&mut self, leave: Leave, reason: &str) -> Phase {
        self.report
            .show(Shown::Failed, format!("ended the run: {reason}"));
        leave.into()
    }

    /// Another node ended the run: this one ends with the same code.
    pub(super) fn halted(&mut self, h: &Halt) -> Phase {
        tracing::error!(node = %h.node_id, exit_code = h.exit_code, reason = %h.reason, "another node ended the run");
        self.report.show(Shown::Failed, h.to_string());
        decide::halted_by(h).into()
    }
}
