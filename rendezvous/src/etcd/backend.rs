//! [`Rendezvous`] for [`EtcdRendezvous`]: the agent loop's calls, each a read of the view
//! or a command to the session.

use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::session::Command;
use super::waiter::Action;
use super::waiting;
use super::*;
use crate::{
    Change, Counters, Departure, Finish, JobRecords, LeftReason, Rendezvous, RendezvousError,
    Round, port,
};

impl Rendezvous for EtcdRendezvous {
    /// The records live in etcd; the handle reads them from the session's view.
    type Records = Self;

    fn records(&mut self) -> Option<&mut Self> {
        Some(self)
    }

    fn backend(&self) -> &'static str {
        "etcd"
    }

    fn node_id(&self) -> Option<&str> {
        Some(&self.cfg.node_id)
    }

    fn run_id(&self) -> &str {
        &self.cfg.run_id
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        // The last round's neighbour stays watched until a new round replaces it: a dead
        // peer often reaches the workers (a failure) before anything else, and the
        // survivors then wait for the next round, where only its eviction makes the dead
        // node's absence known before its lease runs out.
        if self.waiter.held().is_none() {
            self.same_job()?;
        }
        let deadline = tokio::time::Instant::now() + self.cfg.join_timeout;
        let mut next_word = tokio::time::Instant::now() + waiting::EVERY;
        let first = self.waiter.begin(&self.view.borrow(), Instant::now());
        let mut action = Some(first);
        loop {
            let act = match action.take() {
                Some(a) => a,
                None => {
                    let v = self.view.borrow_and_update();
                    self.waiter.on_view(&v, Instant::now())?
                }
            };
            match act {
                Action::Run { record, round } => {
                    self.tell(Command::Running {
                        round: record.clone(),
                    });
                    self.watch_neighbour(&record);
                    return Ok(round);
                }
                Action::Charged(round) => return Ok(round),
                Action::Register { wants } => {
                    self.ask(Command::Register { wants_round: wants }).await?;
                    continue;
                }
                Action::PublishMaster { round } => {
                    let port = port::free_port(&self.cfg.addr)?;
                    let master = v1::Master {
                        schema: fsdp_proto::SCHEMA_VERSION,
                        round,
                        addr: self.cfg.addr.clone(),
                        port: u32::from(port),
                    };
                    self.write(&master).await?;
                    continue;
                }
                Action::Wait => {}
            }
            let (wants, since) = self.waiter.waiting_for().unwrap_or((0, Instant::now()));
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = tokio::time::sleep_until(next_word) => {
                    next_word += waiting::EVERY;
                    let line = self.waiting(wants, false).await.progress(since.elapsed());
                    tracing::info!("{line}");
                }
                () = tokio::time::sleep_until(deadline) => return Err(self.join_timed_out(wants).await),
                e = super::handle::torchrun_seen(self.cfg.torchrun_clients.clone()) => return Err(e),
            }
        }
    }

    async fn changed(&mut self) -> Result<Change, RendezvousError> {
        // Watching the neighbour goes on into the re-form (see `next_round`).
        self.next_change().await
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        let Some(held) = self.waiter.held() else {
            return Ok(0);
        };
        let round = held.record.number;
        let restarts = held.restart_count;
        let failure = v1::Failure {
            schema: fsdp_proto::SCHEMA_VERSION,
            round,
            node_id: self.cfg.node_id.clone(),
        };
        self.write(&failure).await?;
        Ok(restarts + 1)
    }

    async fn finish(&mut self, timeout: Duration) -> Result<Finish, RendezvousError> {
        let Some(held) = self.waiter.held().cloned() else {
            return Ok(Finish::AllDone);
        };
        let round = held.record.number;
        let done = v1::Done {
            schema: fsdp_proto::SCHEMA_VERSION,
            round,
            node_id: self.cfg.node_id.clone(),
        };
        self.write(&done).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let unfinished: Vec<String> = {
                let v = self.view.borrow_and_update();
                if let Some(c) = v.corruption() {
                    return Err(RendezvousError::Corrupt(c));
                }
                let unfinished = v.unfinished(&held.record);
                if unfinished.is_empty() {
                    return Ok(Finish::AllDone);
                }
                if let Some(change) = detect(&v, &held.record, &self.cfg.node_id, held.since) {
                    return Ok(Finish::Changed(change));
                }
                unfinished
            };
            tokio::select! {
                r = self.view.changed() => r.map_err(|_| self.ended())?,
                () = tokio::time::sleep_until(deadline) => return Ok(Finish::TimedOut { unfinished }),
            }
        }
    }

    async fn depart(&mut self, how: Departure, why: LeftReason) -> Result<(), RendezvousError> {
        self.watcher = None;
        // The session revokes the lease and ends; leaving never fails the agent.
        if let Err(e) = self.ask(Command::Depart { how, why }).await {
            tracing::warn!(error = %e, ?how, "could not revoke the lease; peers will notice after its TTL");
        }
        Ok(())
    }
}

/// The shared records, each a read of the view or a command to the session.
impl JobRecords for EtcdRendezvous {
    fn coordinator(&self) -> Option<String> {
        self.view.borrow().coordinator.clone()
    }

    fn counters(&self) -> Counters {
        self.counters.clone()
    }

    fn detection(&self, node: &str, round: u64) -> crate::Detection {
        let v = self.view.borrow();
        let found = v.noticed.get(node).filter(|g| g.round == round);
        match found.map(|g| (g.how(), g.detect_ms)) {
            Some((v1::Detection::Left, _)) => crate::Detection::Left,
            Some((v1::Detection::Refused, ms)) => crate::Detection::Refused {
                detect: Duration::from_millis(u64::from(ms)),
            },
            // A member of a round another member's departure broke goes without a word
            // from anyone.
            _ if v.broken.get(&round).is_some_and(|first| first != node) => {
                crate::Detection::Unsaid
            }
            _ => crate::Detection::LeaseExpiry,
        }
    }

    async fn report_fault(&mut self, exit: String, exited_ms: u64) -> Result<(), RendezvousError> {
        let Some(held) = self.waiter.held() else {
            return Ok(());
        };
        let record = v1::Fault {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: held.record.number,
            node_id: self.cfg.node_id.clone(),
            exit: crate::text::one_line(&exit, crate::text::LINE_MAX),
            exited_ms,
        };
        self.write(&record).await
    }

    fn first_fault(&self, round: u64) -> Option<String> {
        self.view.borrow().first_fault(round)
    }

    async fn quarantine(
        &mut self,
        machine: String,
        node: Option<String>,
        reason: String,
        until_ms: u64,
    ) -> Result<(), RendezvousError> {
        let record = v1::Quarantine {
            schema: fsdp_proto::SCHEMA_VERSION,
            machine,
            node_id: node.unwrap_or_else(|| self.cfg.node_id.clone()),
            reason: crate::text::one_line(&reason, crate::text::LINE_MAX),
            until_ms,
        };
        self.write(&record).await
    }

    fn quarantined(&self, machine: &str) -> Option<(String, u64)> {
        let v = self.view.borrow();
        let q = v.quarantine.get(machine)?;
        (q.until_ms > crate::unix_ms()).then(|| (q.reason.clone(), q.until_ms))
    }

    fn quarantined_node(&self, machine: &str) -> Option<String> {
        let v = self.view.borrow();
        let q = v.quarantine.get(machine)?;
        (q.until_ms > crate::unix_ms()).then(|| q.node_id.clone())
    }

    fn quarantines(&self) -> Vec<(String, u64)> {
        let now = crate::unix_ms();
        let v = self.view.borrow();
        v.quarantine
            .values()
            .filter(|q| q.until_ms > now)
            .map(|q| (q.reason.clone(), q.until_ms))
            .collect()
    }

    async fn unhealthy(&mut self, reason: String, failures: u32) -> Result<(), RendezvousError> {
        let record = v1::Unhealthy {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            reason: crate::text::one_line(&reason, crate::text::LINE_MAX),
            failures,
            at_ms: crate::unix_ms(),
        };
        self.ask(Command::Withdraw { record }).await
    }

    async fn halt(&mut self, exit_code: u8, reason: String) -> Result<(), RendezvousError> {
        let halt = v1::Halt {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            exit_code: u32::from(exit_code),
            reason: crate::text::one_line(&reason, crate::text::LINE_MAX),
            round: self.waiter.held().map_or(0, |h| h.record.number),
        };
        self.write(&halt).await
    }

    async fn report_hang(
        &mut self,
        round: u64,
        report: crate::HangReport,
    ) -> Result<(), RendezvousError> {
        let record = v1::HangReport {
            schema: fsdp_proto::SCHEMA_VERSION,
            round,
            node_id: self.cfg.node_id.clone(),
            declared: report.declared,
            reason: crate::text::one_line(&report.reason, crate::text::LINE_MAX),
            ranks: report
                .ranks
                .into_iter()
                .map(|r| v1::RankStep {
                    rank: r.rank,
                    last_step: r.last_step,
                    phase: crate::text::one_line(
                        &r.phase.unwrap_or_default(),
                        crate::text::NAME_MAX,
                    ),
                })
                .collect(),
        };
        self.write(&record).await
    }

    async fn hang_reports(
        &mut self,
        round: u64,
        want: &[String],
        patience: Duration,
    ) -> Vec<crate::HangReport> {
        let all_in = |v: &View| {
            let have = v.hangs.get(&round);
            want.iter().all(|n| have.is_some_and(|h| h.contains_key(n)))
        };
        let _ = tokio::time::timeout(patience, self.view.wait_for(all_in)).await;
        let v = self.view.borrow();
        v.hangs
            .get(&round)
            .map(|h| h.values().map(hang_report).collect())
            .unwrap_or_default()
    }
}

/// The steps of `next_round` that are not the loop.
impl EtcdRendezvous {
    /// What this node knows while it waits for round `wants`: the round it is not in,
    /// and the registrations, counted afresh (the handle's view holds none) if this node
    /// is one that counts them, or `always` (once, when its wait ends).
    async fn waiting(&mut self, wants: u64, always: bool) -> waiting::Waiting<'_> {
        let (round, connected) = {
            let v = self.view.borrow();
            let round = v
                .round
                .as_ref()
                .filter(|r| r.record.number + 1 >= wants)
                .map(|r| (r.record.number, r.record.members.len()));
            (round, v.connected)
        };
        let counting =
            always || waiting::counts_registrations(&self.cfg.node_id, self.cfg.max_nodes);
        let count = super::token::renewing(&self.counter, || {
            let mut c = self.counter.clone();
            let only_count = etcd_client::GetOptions::new()
                .with_prefix()
                .with_count_only();
            let members = self.keys.members();
            async move { c.get(members, Some(only_count)).await }
        });
        // A count is worth a line, never a wait: a store that does not answer soon says
        // so by its absence.
        let registered = if counting {
            match tokio::time::timeout(Duration::from_secs(2), count).await {
                Ok(Ok(r)) => u64::try_from(r.count()).ok(),
                _ => None,
            }
        } else {
            None
        };
        waiting::Waiting {
            run_id: &self.cfg.run_id,
            store: self.cfg.options.store_name(),
            endpoints: self.cfg.options.endpoints.join(","),
            min_nodes: self.cfg.min_nodes,
            max_nodes: self.cfg.max_nodes,
            registered,
            counting,
            round,
            connected,
        }
    }

    /// Before this node first registers: whether the run it joins is its own job, by the
    /// running round (or, before any, by the coordinator's registration). Another job's
    /// agents would be taken in as spares and then as ranks of it ([`crate::job`]). Only a
    /// run somebody runs counts: its coordinator key lives on a lease, while the round key
    /// of a finished or failed run stays, and must never block a new job with its id.
    fn same_job(&self) -> Result<(), RendezvousError> {
        let v = self.view.borrow();
        if v.coordinator.is_none() {
            return Ok(());
        }
        let running = match &v.round {
            Some(r) => Some((r.record.job.clone(), format!("round {}", r.record.number))),
            None => v
                .coordinator
                .as_ref()
                .and_then(|c| v.members.get(c))
                .map(|m| (m.record.job.clone(), "the first node registered".to_owned())),
        };
        let Some((theirs, whose)) = running else {
            return Ok(());
        };
        let Some(what) = crate::job::differs(&self.cfg.job, &theirs) else {
            return Ok(());
        };
        Err(RendezvousError::AnotherJob(format!(
            "run '{}' on {} at {} is another job's: {what} differs from {whose}'s; give this job its own --rdzv-id (or, if its nodes differ on purpose, --rdzv-conf job_check=0 on every node)",
            self.cfg.run_id,
            self.cfg.options.store_name(),
            self.cfg.options.endpoints.join(","),
        )))
    }

    /// The join timeout's error: what the node waited for, and the fix.
    async fn join_timed_out(&mut self, wants: u64) -> RendezvousError {
        let timeout = self.cfg.join_timeout;
        RendezvousError::Timeout(self.waiting(wants, true).await.gave_up(timeout))
    }
}
