//! The health gate before each round ([`crate::health`]): while the check fails the node
//! stays out of the group, recorded in etcd with the reason; after too many failures in a
//! row it leaves with [`crate::exit_code::UNHEALTHY`] so the pod is replaced.

use fsdp_rendezvous::{JobRecords, Rendezvous};

use super::decide::{self, signalled};
use super::driver::{Loop, interruptible};
use super::{DEPART_PATIENCE, Phase};
use crate::health::{self, Verdict};

impl<R: Rendezvous> Loop<'_, R> {
    /// Runs the check until it passes (`None`: join) or the node must leave (`Some`).
    pub(super) async fn gate(&mut self) -> Option<Phase> {
        let check = self.cfg.health.clone()?;
        let mut failures = 0;
        loop {
            let reason = match interruptible(self.signals, health::check(&check)).await {
                Err(sig) => return Some(signalled(sig).into()),
                Ok(Ok(())) => {
                    if failures > 0 {
                        tracing::info!(failures, "the health check passes again; joining");
                    }
                    self.report.health(None);
                    return None;
                }
                Ok(Err(reason)) => reason,
            };
            failures += 1;
            tracing::warn!(%reason, failures, command = %check.command, "the health check failed; staying out of the group");
            self.report.health(Some(&reason));
            if let Some(records) = self.rdzv.records() {
                let say = tokio::time::timeout(
                    DEPART_PATIENCE,
                    records.unhealthy(reason.clone(), failures),
                );
                match interruptible(self.signals, say).await {
                    Err(sig) => return Some(signalled(sig).into()),
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => {
                        tracing::warn!(error = %e, "could not record the failed check in the rendezvous")
                    }
                    Ok(Err(_)) => tracing::warn!("recording the failed check took too long"),
                }
            }
            match health::verdict(failures, &check) {
                Verdict::GiveUp(exit_code) => {
                    tracing::error!(
                        failures,
                        exit_code,
                        "the health check failed every time; leaving so the node is replaced"
                    );
                    return Some(decide::unhealthy(exit_code, failures, &reason).into());
                }
                Verdict::RetryIn(pause) => {
                    let wait = tokio::time::sleep(pause);
                    if let Err(sig) = interruptible(self.signals, wait).await {
                        return Some(signalled(sig).into());
                    }
                }
            }
        }
    }
}
