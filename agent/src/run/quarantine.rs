//! Quarantine by attribution ([`crate::policy::blame`]): every node reports its own
//! workers' failures the moment it sees them; when the first report of several failed
//! rounds in a row came from one node while no member was lost, that node keeps its
//! machine out of the run for a while (a record in etcd) and leaves with
//! [`crate::exit_code::QUARANTINED`]. The others re-form without it.

use std::time::Duration;

use fsdp_proto::v1::Phase as Shown;
use fsdp_rendezvous::{JobRecords, Rendezvous, Round};

use super::decide::{self, signalled};
use super::driver::{Loop, interruptible};
use super::{DEPART_PATIENCE, Phase};
use crate::failure::Failure;

/// How long reporting a fault may hold up stopping a failed group.
const FAULT_PATIENCE: Duration = Duration::from_secs(1);

impl<R: Rendezvous> Loop<'_, R> {
    /// A worker of this node failed in `round`: say so, with when it was seen, before
    /// stopping anything (the reports are the attribution).
    pub(super) async fn report_fault(&mut self, round: &Round, first: &Failure) {
        let exit = first.exit;
        if !decide::reports_fault(round, exit, &self.rules.failure) {
            return;
        }
        let Some(records) = self.rdzv.records() else {
            return;
        };
        let exited_ms = first
            .at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let said = tokio::time::timeout(
            FAULT_PATIENCE,
            records.report_fault(exit.to_string(), exited_ms),
        )
        .await;
        if !matches!(said, Ok(Ok(()))) {
            tracing::debug!("the fault report did not reach the rendezvous in time");
        }
    }

    /// Whether this machine is quarantined: then the agent leaves at once.
    pub(super) fn kept_out(&mut self) -> Option<Phase> {
        let machine = &self.cfg.failure.machine;
        let (reason, until_ms) = self.rdzv.records()?.quarantined(machine)?;
        let left = Duration::from_millis(until_ms.saturating_sub(fsdp_rendezvous::unix_ms()));
        tracing::error!(%machine, %reason, left_s = left.as_secs(), "this machine is quarantined; not joining");
        let why = format!("machine {machine} is quarantined: {reason}");
        self.report.show(Shown::Failed, why.clone());
        Some(decide::kept_out(&why).into())
    }

    /// The round after a failed one formed: enters the failed round and, if the policy
    /// blames this node, quarantines its machine and leaves.
    pub(super) async fn judge_quarantine(&mut self, next: &Round) -> Option<Phase> {
        let me = self.rdzv.node_id().map(str::to_owned);
        let records = self.rdzv.records();
        let first_fault = |n| records.and_then(|r| r.first_fault(n));
        let reason = decide::blamed(
            &mut self.memory,
            next,
            first_fault,
            &self.rules.failure,
            me.as_deref(),
        )?;
        Some(self.quarantine(&reason).await)
    }

    /// The failure policy keeps this machine out of the run for `reason`: records it (so an
    /// agent started on it meanwhile leaves at once) and leaves. A backend without records
    /// has nowhere to keep it: the node leaves all the same.
    pub(super) async fn quarantine(&mut self, reason: &str) -> Phase {
        let machine = self.cfg.failure.machine.clone();
        let until = fsdp_rendezvous::unix_ms().saturating_add(
            u64::try_from(self.cfg.failure.quarantine_for.as_millis()).unwrap_or(u64::MAX),
        );
        tracing::error!(%machine, %reason, for_s = self.cfg.failure.quarantine_for.as_secs(), "quarantining this machine and leaving the run");
        if let Some(records) = self.rdzv.records() {
            let say = tokio::time::timeout(
                DEPART_PATIENCE,
                records.quarantine(machine.clone(), None, reason.to_owned(), until),
            );
            match interruptible(self.signals, say).await {
                Err(sig) => return signalled(sig).into(),
                Ok(Ok(Ok(()))) => {}
                Ok(_) => tracing::warn!("could not record the quarantine; leaving anyway"),
            }
        }
        self.report
            .show(Shown::Failed, format!("quarantined: {reason}"));
        decide::kept_out(&format!("machine {machine} quarantined: {reason}")).into()
    }
}
