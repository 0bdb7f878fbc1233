//! What each phase does with an input (watch batches, keep-alive answers, timers,
//! commands), and how an outage begins, is backed off and ends.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::io::{Command, CommandId, Effect, Input};
use super::machine::{FIRST_RETRY, LAST_RETRY, Machine, Phase, Resync};
use super::sync::Todo;
use crate::RendezvousError;

/// How long each member of the round waits after the one before it to claim a coordinator
/// key that went.
const CAMPAIGN_STEP: Duration = Duration::from_millis(200);

impl Machine {
    pub(super) fn on_input(&mut self, input: Input) {
        match (self.phase, input) {
            (Phase::Ended, _) => {}
            (_, Input::CommandsClosed) => self.phase = Phase::Ended,
            (Phase::Watching { .. }, input) => self.on_watching(input),
            (Phase::Disconnected { until }, Input::Timer) => {
                if self.now >= until {
                    self.begin_sync(Resync::Outage);
                }
            }
            (Phase::Disconnected { .. }, Input::Command(id, command)) => {
                let local = matches!(
                    command,
                    Command::Running { .. } | Command::Abandon { .. } | Command::Depart { .. }
                );
                if local {
                    self.serve(id, command);
                } else {
                    self.pending.push_back((id, command));
                }
            }
            (Phase::Syncing(_), Input::Command(id, command)) => {
                self.pending.push_back((id, command));
            }
            // Streams that closed, and timers of a phase that is over.
            (_, _) => {}
        }
    }

    pub(super) fn on_watching(&mut self, input: Input) {
        match input {
            Input::Watched(events) => {
                if self.apply(events) {
                    self.campaign_in_turn();
                }
                if self.view.round_wanted.is_some() {
                    self.todo.push_back(Todo::ReadRoster);
                }
                self.todo
                    .extend([Todo::RoleCheck, Todo::Coordinate, Todo::SayLost]);
            }
            Input::WatchEnded => self.resync_after_watching(Resync::Outage),
            // etcd went back: it lost its data between the read and the watch, which would
            // wait for a revision the new history reaches only later, and miss everything
            // before it (found by the simulator: an agent that never saw the next round).
            Input::WatchCreated { revision } if revision < self.read_rev => {
                let read = self.read_rev;
                tracing::warn!(
                    revision,
                    read,
                    "etcd is behind the revision read (its data was lost); reading again"
                );
                self.resync_after_watching(Resync::Outage);
            }
            Input::WatchCreated { .. } => {}
            Input::StreamFailed(e) => self.lost(e),
            // etcd ends a keep-alive stream when it is too busy to renew ("waiting for
            // the applied index took too long"): a new stream, the watches kept. At 4,000
            // nodes every such end was a resync of the whole node before.
            Input::KeepAliveFailed(e) if crate::etcd::connect::overloaded(&e) => {
                tracing::debug!(error = %e, "etcd ended the keep-alive stream; opening another");
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                self.keep_alive_ended = true;
                self.todo.push_back(Todo::ReopenKeepAlive);
            }
            Input::KeepAliveFailed(e) => self.lost(e),
            Input::LeaseAnswer(Some(ttl)) if ttl > 0 => {
                self.clock
                    .keep_alive_answered(Duration::from_secs(ttl.unsigned_abs()));
                self.publish_lease();
                self.probe(false);
            }
            Input::LeaseAnswer(_) => {
                tracing::warn!(
                    lease = self.lease,
                    "lease expired or revoked; registering again"
                );
                self.lease_gone();
                self.todo
                    .extend([Todo::Grant, Todo::Register, Todo::Resync(Resync::Outage)]);
            }
            Input::Timer => self.on_timer(),
            Input::Command(id, command) => self.serve(id, command),
            Input::Answer(_) | Input::CommandsClosed | Input::NoLeader { .. } => {}
        }
    }

    /// The coordinator key went: the round's members not seen to go claim it in rank
    /// order, the first at once and each next one [`CAMPAIGN_STEP`] later if nobody has
    /// by then (the ones before it may be gone too); a node outside the round after a
    /// lease TTL. A claim that finds the key taken writes nothing. Every member claiming at
    /// once was a transaction per node each time the coordinator died: 999 at 1,000
    /// nodes (issue 30).
    fn campaign_in_turn(&mut self) {
        let me = self.cfg.node_id.as_str();
        let v = &self.view;
        let turn = v.round.as_ref().and_then(|r| {
            r.record
                .members
                .iter()
                // This node lives, whatever became of the registration the round names.
                .filter(|m| {
                    m.node_id == me
                        || v.departed
                            .get(&m.node_id)
                            .is_none_or(|d| d.incarnation < m.incarnation)
                })
                .position(|m| m.node_id == me)
        });
        let wait = match (turn, v.round.is_some()) {
            (Some(k), _) => CAMPAIGN_STEP.saturating_mul(k as u32).min(self.cfg.ttl),
            // A fresh run: everyone registered claims.
            (None, false) => Duration::ZERO,
            (None, true) => self.cfg.ttl,
        };
        if wait.is_zero() {
            self.todo.push_back(Todo::Campaign);
        } else {
            self.campaign_at = Some(self.now + wait);
        }
    }

    /// The timers that are due.
    pub(super) fn on_timer(&mut self) {
        let Phase::Watching { lease, .. } = self.phase else {
            return;
        };
        let now = self.now;
        if self.keep_alive_at.is_some_and(|at| at <= now) {
            // A command replaced the lease: keep the new one alive.
            if self.lease != lease {
                return self.resync_after_watching(Resync::Outage);
            }
            self.clock.keep_alive_sent(now);
            self.keep_alive_at = Some(now + self.cfg.ttl / 3);
            self.todo.push_back(Todo::KeepAlive);
        }
        if self.answer_due().is_some_and(|at| at <= now) {
            // etcd answers a keep-alive in milliseconds: a late one is the first sign of
            // an outage that leaves the connection open (a frozen or stalled etcd, a cut
            // network, a member cut from its leader), long before the connection's own
            // keep-alive gives up on it.
            if self.cfg.several_endpoints {
                let late = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "a lease keep-alive went unanswered; trying another etcd member",
                );
                return self.lost(etcd_client::Error::IoError(late));
            }
            self.trouble();
        }
        if self.grace_until.is_some_and(|at| at <= now) {
            self.grace_until = None;
            self.todo
                .extend([Todo::CheckAbsent, Todo::Coordinate, Todo::SayLost]);
        }
        if self.campaign_at.is_some_and(|at| at <= now) {
            self.campaign_at = None;
            self.todo.push_back(Todo::Campaign);
        }
        if self.recheck.is_some_and(|at| at <= now) {
            self.recheck = None;
            self.todo
                .extend([Todo::RoleCheck, Todo::Coordinate, Todo::SayLost]);
        }
    }

    /// With several endpoints: when the oldest unanswered keep-alive is late enough to
    /// try another member. With a one-member etcd: when the fence draws near (a quarter
    /// TTL before it) without an answer, so the prober should look for its proof — not
    /// before, so that a slow but working etcd (1,000 agents on two cores) is not probed.
    pub(super) fn answer_due(&self) -> Option<Instant> {
        let (sent, safe_until) = (self.clock.oldest_unanswered(), self.clock.safe_until());
        let ttl = self.cfg.ttl;
        if self.cfg.several_endpoints {
            return Some(sent? + ttl / 4);
        }
        if self.probing || !self.single_member || !self.cfg.can_probe {
            return None;
        }
        sent?;
        safe_until?.checked_sub(self.cfg.fence_margin + ttl / 4)
    }

    /// etcd does not answer: start looking for proof that it has no leader (so the lease
    /// cannot expire and the workers need not be fenced).
    pub(super) fn trouble(&mut self) {
        if self.single_member && self.cfg.can_probe {
            self.probe(true);
        }
    }

    pub(super) fn probe(&mut self, on: bool) {
        if self.probing != on {
            self.probing = on;
            self.effects.push(Effect::Probe(on));
        }
    }

    /// Leaves [`Phase::Watching`] without an error (the backoff starts over).
    pub(super) fn resync_after_watching(&mut self, why: Resync) {
        self.failures = 0;
        self.begin_sync(why);
    }

    /// Starts a sync: whatever was left to do is dropped, and so is every stream event
    /// not handled yet (the new watches start from the read).
    pub(super) fn begin_sync(&mut self, why: Resync) {
        self.close_watches();
        self.phase = Phase::Syncing(why);
        self.whole_read = false;
        self.grace_until = match why {
            // A store this agent just started is empty: the agents of a running job come
            // back to it (after its host was restarted in place), each putting back the
            // round and registering again, in no order.
            Resync::First if self.cfg.fresh_store => {
                Some(self.now + self.cfg.ttl + Duration::from_secs(1))
            }
            Resync::First => None,
            Resync::RoleChanged { grace_until } => grace_until,
            // After an outage, give members a lease TTL to re-register before anyone is
            // declared lost (etcd may have come back empty).
            Resync::Outage => Some(self.now + self.cfg.ttl + Duration::from_secs(1)),
        };
        self.recheck = None;
        self.todo = Todo::sync(why, self.reselect, self.abandon).into();
    }

    /// Stream events queued before this moment belong to streams now closed.
    pub(super) fn close_watches(&mut self) {
        // Also when a sync failed after opening them: their events would otherwise queue
        // up behind the next sync and be read as the new watches' (found by the
        // simulator: a coordinator's old stream, without previous values, made every later
        // incarnation of two nodes look departed, and rounds were sealed in a loop).
        if !matches!(self.phase, Phase::Disconnected { .. } | Phase::Ended) {
            self.effects.push(Effect::CloseWatches);
        }
        self.keep_alive_at = None;
        self.inbox.retain(|i| {
            matches!(
                i,
                Input::Command(..) | Input::CommandsClosed | Input::NoLeader { .. }
            )
        });
    }

    /// etcd failed: back off, or give up once the outage lasted too long.
    pub(super) fn lost(&mut self, e: etcd_client::Error) {
        self.close_watches();
        self.todo.clear();
        // An op waiting to be sent again after an overloaded answer goes with the rest; a
        // command's is served after the next sync, as any command caught by an outage.
        if let Some((_, super::machine::Then::Command(s), _)) = self.retry.take() {
            self.pending.push_front(s.into_waiting());
        }
        self.view_mut().connected = false;
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let now = self.now;
        let lasted = now - *self.outage_since.get_or_insert(now);
        if lasted > self.cfg.outage_limit {
            return self.give_up(lasted, &e);
        }
        self.trouble();
        // A connection whose requests went unanswered may stay that way (HTTP/2 closed
        // under them by the client library): a fresh one, even to the same member.
        self.reselect = self.cfg.several_endpoints || crate::etcd::connect::is_unanswered(&e);
        // Retry well within the fencing margin: a refused probe keeps the lease safe only
        // for a TTL from when it was sent.
        let last = LAST_RETRY.min(self.cfg.ttl / 4);
        let delay = crate::backoff::nth(FIRST_RETRY, last, self.failures);
        // Each line stands alone in a log search: it says how long the wait can still last.
        let gives_up_in = self.cfg.outage_limit.saturating_sub(lasted);
        if self.cfg.embedded_store {
            tracing::warn!(error = %e, retry_in = ?delay, gives_up_in = ?gives_up_in, "connection to the c10d store lost; reconnecting");
        } else {
            tracing::warn!(error = %e, retry_in = ?delay, gives_up_in = ?gives_up_in, "etcd connection lost; reconnecting");
        }
        self.failures = self.failures.saturating_add(1);
        self.phase = Phase::Disconnected { until: now + delay };
    }

    /// etcd has not answered for longer than the outage bound: every waiting request
    /// gets the reason, the view says it, and the session ends.
    pub(super) fn give_up(&mut self, lasted: Duration, last: &etcd_client::Error) {
        let store = if self.cfg.embedded_store {
            "the c10d store"
        } else {
            "etcd"
        };
        let mut reason = format!(
            "{store} has not answered for {:.0}s, longer than outage_timeout ({:.0}s); last error: {last}",
            lasted.as_secs_f64(),
            self.cfg.outage_limit.as_secs_f64()
        );
        if self.cfg.embedded_store {
            reason.push_str(
                "; the agent serving the store at --rdzv-endpoint is gone, and a c10d job cannot outlive it \
                 (--rdzv-backend etcd can)",
            );
        }
        tracing::error!(%reason, "giving up on etcd");
        self.view_mut().gave_up = Some(reason);
        self.phase = Phase::Ended;
    }

    /// The session ended: whoever still waits hears why.
    pub(super) fn end_requests(&mut self) {
        self.todo.clear();
        let reason = self.view.gave_up.clone();
        let waiting: Vec<CommandId> = self
            .pending
            .drain(..)
            .map(|(id, _)| id)
            .chain(self.inbox.take().into_iter().filter_map(|i| match i {
                Input::Command(id, _) => Some(id),
                _ => None,
            }))
            .collect();
        for id in waiting {
            let e = match &reason {
                Some(r) => RendezvousError::Outage(r.clone()),
                None => RendezvousError::SessionEnded("the session ended"),
            };
            self.reply(id, Err(e));
        }
    }
}
