//! What each phase does with an input (watch batches, keep-alive answers, timers,
//! commands), and how an outage begins, is backed off and ends.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::fault::{Fault, FaultKind};
use super::io::{Command, Effect, Input};
use super::machine::{FIRST_RETRY, LAST_RETRY, Machine, Phase, Resync, Then};
use super::sync::Todo;
use super::turn::Frontier;
use crate::RendezvousError;

impl Machine {
    pub(super) fn on_input(&mut self, input: Input) {
        match (self.phase, input) {
            (Phase::Ended, _) => {}
            (_, Input::CommandsClosed) => self.end(),
            (Phase::Watching { .. }, input) => self.on_watching(input),
            (Phase::Disconnected { until }, Input::Timer) => {
                if self.now >= until {
                    self.begin_sync(Resync::Outage);
                }
            }
            // (A departure never comes here: it goes before everything, `Flight::leave`.)
            (Phase::Disconnected { .. }, Input::Command(id, command)) => {
                let local = matches!(command, Command::Running { .. } | Command::Abandon { .. });
                if local {
                    self.serve(id, command);
                } else {
                    self.flight.wait(id, command);
                }
            }
            (Phase::Syncing(_), Input::Command(id, command)) => {
                self.flight.wait(id, command);
            }
            // The lease a joining node keeps alive from its grant, before its watches.
            (
                Phase::Syncing(Resync::First),
                input @ (Input::LeaseAnswer(_) | Input::KeepAliveFailed(_)),
            ) if self.kept_lease().is_some() => {
                self.on_lease_input(input);
            }
            // Streams that closed, and timers of a phase that is over.
            (_, _) => {}
        }
    }

    pub(super) fn on_watching(&mut self, input: Input) {
        match input {
            Input::Watched(mut events) => {
                // A placed round's shards and their deletes (in the coordinator's watch of
                // the whole run) are read apart, by whoever needs them: nothing to decide
                // again for. The shards written ahead of a header came before it, and a
                // coordinator that looked again at each, its round not yet in its view,
                // sealed it again: a write each, fenced out.
                let keys = &self.cfg.keys;
                events.retain(|e| !keys.is_placement(e.key()) && !keys.is_admission(e.key()));
                if events.is_empty() {
                    return;
                }
                if self.apply(events) {
                    self.campaign_in_turn();
                }
                if self.view.round_wanted.is_some() {
                    self.read_shard_in_turn();
                }
                self.flight.then_all([
                    Todo::RoleCheck,
                    Todo::Coordinate,
                    Todo::SayLost,
                    Todo::Admit,
                ]);
            }
            Input::WatchEnded => self.resync_after_watching(Resync::Outage),
            // etcd went back: it lost its data between the read and the watch, which would
            // wait for a revision the new history reaches only later, and miss everything
            // before it (found by the simulator: an agent that never saw the next round).
            Input::WatchCreated { revision } if revision < self.watches.read_rev() => {
                let read = self.watches.read_rev();
                tracing::warn!(
                    revision,
                    read,
                    "etcd is behind the revision read (its data was lost); reading again"
                );
                self.resync_after_watching(Resync::Outage);
            }
            Input::WatchCreated { .. } => {}
            Input::StreamFailed(e) => self.lost(e),
            input @ (Input::KeepAliveFailed(_) | Input::LeaseAnswer(_)) => {
                self.on_lease_input(input);
            }
            Input::Timer => self.on_timer(),
            Input::Command(id, command) => self.serve(id, command),
            Input::Answer(_) | Input::CommandsClosed | Input::NoLeader { .. } | Input::Port(_) => {}
        }
    }

    /// What the keep-alive stream said: an answer, or its end.
    fn on_lease_input(&mut self, input: Input) {
        let joining = self.phase == Phase::Syncing(Resync::First);
        match input {
            // etcd ends a keep-alive stream when it is too busy to renew ("waiting for
            // the applied index took too long"): a new stream, the watches kept. At 4,000
            // nodes every such end was a resync of the whole node before.
            Input::KeepAliveFailed(e) if e.kind == FaultKind::Overloaded => {
                tracing::debug!(error = %e, "etcd ended the keep-alive stream; opening another");
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                self.lease.ended(None);
                // While joining the steps of the sync come first; the next keep-alive
                // due goes on a new stream (`Todo::KeepAlive`, `keep_alive_while_waiting`).
                if !joining {
                    self.flight.then(Todo::ReopenKeepAlive);
                }
            }
            Input::KeepAliveFailed(e) => self.lost(e),
            Input::LeaseAnswer(Some(ttl)) if ttl > 0 => {
                // Timed when the machine takes the answer: one that waited behind an op
                // counts that wait as etcd's, which only slows a joiner down.
                if let Some(sent) = self.lease.clock().oldest_unanswered() {
                    self.admission.kept_alive(sent, self.now);
                    if let Some(f) = self.frontier.as_mut() {
                        f.kept_alive(sent, self.now);
                    }
                }
                self.lease
                    .answered(self.now, Duration::from_secs(ttl.unsigned_abs()));
                self.publish_lease();
                self.probe(false);
            }
            Input::LeaseAnswer(_) => self.lease_expired(),
            _ => {}
        }
    }

    /// etcd says this node's lease is gone (a keep-alive, or a time-to-live, found it so).
    pub(super) fn lease_expired(&mut self) {
        if !self.lease.first_word_of_its_end() {
            // An answer to a keep-alive sent before etcd first said so.
            return;
        }
        self.lease_gone();
        // Kept alive and expired all the same: etcd is a TTL behind, and the grant and
        // registration that follow wait the longest pause, with no keep-alive for the
        // lease gone meanwhile.
        if self.admission.active() {
            self.admission.lease_lost(self.now);
        }
        let joining = self.phase == Phase::Syncing(Resync::First);
        if joining || self.admission.active() {
            self.lease.stop();
        }
        if joining {
            // Gone before this node registered: nothing of it stands; a new lease before
            // the next step of the sync, kept alive from the watches on.
            tracing::warn!(
                lease = self.lease.id(),
                "the lease expired before this node registered; granting another"
            );
            self.flight.first(Todo::Grant);
            return;
        }
        tracing::warn!(
            lease = self.lease.id(),
            "lease expired or revoked; registering again"
        );
        self.flight
            .then_all([Todo::Grant, Todo::Register, Todo::Resync(Resync::Outage)]);
    }

    /// The timers that are due.
    pub(super) fn on_timer(&mut self) {
        let Phase::Watching { lease, .. } = self.phase else {
            return;
        };
        let now = self.now;
        if self.outage.count_due().is_some_and(|at| at <= now) {
            self.outage.counting();
            self.flight.then(Todo::CountMembers);
        }
        if self.shard_read_at.is_some_and(|at| at <= now) {
            self.shard_read_at = None;
            self.flight.then(Todo::ReadRoster);
        }
        if self.lease.keep_alive_due().is_some_and(|at| at <= now) {
            // A command replaced the lease: keep the new one alive.
            if self.lease.id() != lease {
                return self.resync_after_watching(Resync::Outage);
            }
            self.lease.sent(now, self.cfg.ttl);
            self.flight.then(Todo::KeepAlive);
        }
        if let Some(due) = self.answer_due().filter(|at| *at <= now) {
            // etcd answers a keep-alive in milliseconds: a late one is the first sign of
            // an outage that leaves the connection open (a frozen or stalled etcd, a cut
            // network, a member cut from its leader), long before the connection's own
            // keep-alive gives up on it.
            if self.cfg.several_endpoints {
                let late = "a lease keep-alive went unanswered; trying another etcd member";
                return self.lost(Fault::local(std::io::ErrorKind::TimedOut, late.into()));
            }
            // Once per late keep-alive (the trouble, `probing`, stops this timer until a
            // keep-alive is answered, etcd's word on the lease or not: `answer_due`):
            // etcd's own word on the lease first, and the look for proof that it has no
            // leader only if that word is slow to come.
            if asks_first() {
                if !self.outage.members_known() {
                    // A crowd's forming node: whether etcd is one member, with the question.
                    self.outage.counting();
                    self.flight.then(Todo::CountMembers);
                }
                self.flight.then(Todo::AskLease);
            }
            if self.holds_look() {
                // Held until the moment the look starts if etcd stays silent, whenever
                // this timer fired: a machine woken late looks at once.
                self.outage.hold_look(due + look_held(self.cfg.ttl));
                self.start_held_look();
            } else {
                self.trouble();
            }
        }
        if self.watches.grace_over(now) {
            self.flight.then_all([
                Todo::CheckAbsent,
                Todo::Coordinate,
                Todo::SayLost,
                Todo::Admit,
            ]);
        }
        if self
            .frontier
            .as_ref()
            .and_then(Frontier::wake)
            .is_some_and(|at| at <= now)
        {
            self.flight.then(Todo::Admit);
        }
        let (campaign, recheck) = self.duty.take_due(now);
        if campaign {
            self.flight.then(Todo::Campaign);
        }
        if recheck {
            self.flight.then_all([
                Todo::RoleCheck,
                Todo::Coordinate,
                Todo::SayLost,
                Todo::Admit,
            ]);
        }
    }

    /// With several endpoints: when the oldest unanswered keep-alive is late enough to
    /// try another member. With a one-member etcd: when the fence draws near without an
    /// answer, so that etcd is asked about the lease (a quarter and a sixteenth of a TTL
    /// before it, the look for proof held the sixteenth: [`look_held`]; and not before
    /// the oldest keep-alive has waited as long as the last one took and an eighth of a
    /// TTL) — not before, so that a slow but working etcd (1,000 agents on two cores) is
    /// not probed.
    pub(super) fn answer_due(&self) -> Option<Instant> {
        let clock = self.lease.clock();
        let (sent, safe_until) = (clock.oldest_unanswered(), clock.safe_until());
        let ttl = self.cfg.ttl;
        if self.cfg.several_endpoints {
            return Some(sent? + ttl / 4);
        }
        if self.outage.probing() || !self.may_ask() {
            return None;
        }
        let sent = sent?;
        // A node still forming has no workers to stop, and asks only as late as it can
        // still learn in time that its lease stands: a quarter TTL ahead, every late
        // keep-alive of a crowd on a busy etcd asked, 12,863 times a TTL by 27 s into a
        // formation of 10,000 on etcd 3.4 (one more request each while etcd was behind).
        if !self.admission.formation_over() {
            return safe_until?.checked_sub(self.cfg.fence_margin);
        }
        // A running node asks a quarter TTL ahead at the earliest, and a held look's wait
        // before it: the look, if etcd stays silent, starts a quarter TTL ahead at the
        // earliest.
        let held = if self.holds_look() {
            look_held(ttl)
        } else {
            Duration::ZERO
        };
        let due = safe_until?.checked_sub(self.cfg.fence_margin + ttl / 4 + held)?;
        // But only once the keep-alive has waited longer than the last one took, and an
        // eighth of a TTL more: one merely as slow as etcd (or this host) has been would
        // be answered as late as the question. Asked at once, every member of a crowd
        // asked at the seal, when its host was busiest (10,000 nodes on one host: 12,741
        // questions in the 18 s after the header, each answered seconds late, and the
        // leases lapsed behind them). An etcd that answered within 3% of a TTL (150 ms at
        // 5 s) and then stopped is asked at the moment it was before. One that answered
        // later than that is asked later; past 15% of a TTL (0.77 s) its look cannot end
        // before the fence, and the node fences where the look used to spare it: safe,
        // the price of not asking every time a busy etcd or host is slow.
        let slow = self.lease.last_latency().unwrap_or_default();
        Some(due.max(sent + slow + ttl / 8))
    }

    /// etcd does not answer: start looking for proof that it has no leader (so the lease
    /// cannot expire and the workers need not be fenced).
    pub(super) fn trouble(&mut self) {
        if self.may_ask() {
            self.probe(true);
        }
    }

    /// Whether a late keep-alive is asked about (etcd's word on the lease, with its
    /// member count when that is not known yet) and may lead to a look for proof that
    /// etcd has no leader: wherever etcd may be one member, for only a one-member etcd's
    /// lack of a leader is proved by looking at it. The look itself waits until etcd is
    /// counted one member ([`Machine::probe`], [`Machine::counted`]). A crowd's node that
    /// runs its first round learns the count up to 2 ms a node later
    /// (`outage::count_delay`); asking only once it knew, one whose keep-alive came back
    /// late in the seconds after the seal fenced on its lease clock without a word to
    /// etcd, and at 20,000 nodes three such fences re-formed the whole crowd on an etcd
    /// still behind (docs/bench/agents-scale.md, twenty-seventh section).
    fn may_ask(&self) -> bool {
        self.outage.may_be_single() && self.cfg.can_probe
    }

    /// Whether a look for that proof may run now: on a node that runs a round (a forming
    /// one has no workers to fence) of an etcd counted one member.
    pub(super) fn look_may_run(&self) -> bool {
        self.admission.formation_over() && self.outage.single_member()
    }

    /// etcd has `n` members. On a crowd's node that runs its round, the first count
    /// starts a look held back for it if etcd has one member, and stops it if it has
    /// more: it could prove nothing. (A count known before changes no look.)
    pub(super) fn counted(&mut self, n: usize) {
        let first = !self.outage.members_known();
        self.outage.members(n);
        if !first || !self.admission.formation_over() {
            return;
        }
        if self.outage.single_member() {
            if self.outage.looks() {
                self.flight.emit(Effect::Probe(true));
            }
        } else if self.outage.probing() {
            self.probe(false);
        }
    }

    /// Whether a late keep-alive's look waits for etcd's answer about the lease: on a
    /// node that runs a round (a forming one does not look) and asks.
    fn holds_look(&self) -> bool {
        self.may_ask() && self.admission.formation_over() && asks_first()
    }

    /// The look held while etcd was asked about the lease starts now, unless etcd spoke
    /// meanwhile; on an etcd counted one member only (a node that asked the count with
    /// the question starts it when the count comes: `counted`). A timer of its own, heard
    /// while an op is in flight too: the op is often that question, and a stopped etcd
    /// never answers it.
    pub(super) fn start_held_look(&mut self) {
        if self.outage.held_look_starts(self.now) && self.look_may_run() {
            self.flight.emit(Effect::Probe(true));
        }
    }

    /// Looks for that proof, or stops. A node still forming has no workers to fence:
    /// it looks only once it runs a round (`serve.rs`) and etcd is counted one member
    /// (`counted`), though the session counts it as looking meanwhile (a late keep-alive
    /// asks etcd once, not at every tick). Each look is a fresh connection and a status
    /// request, and in a crowd on a slow etcd thousands of joining nodes looked every
    /// quarter TTL: at 10,000 nodes, half the bench's CPU was the kernel finding ports
    /// for their connections, and the requests were more load on an etcd already behind.
    pub(super) fn probe(&mut self, on: bool) {
        if self.outage.probe(on) && (!on || self.look_may_run()) {
            self.flight.emit(Effect::Probe(on));
        }
    }

    /// etcd answered the question about the lease (that it stands, or not), so it has a
    /// leader (a one-member etcd answers for its leases only as one): a running look
    /// stops, a held one never starts, and the session stays in trouble, so that a late
    /// keep-alive is asked about once, until one is answered.
    /// Each look is two fresh connections: at the seal of 10,000 nodes on etcd 3.5, the
    /// members whose renewals were late looked every quarter TTL until a keep-alive came
    /// back, thousands of connections a second to an etcd already behind, whose renewals
    /// then fell to a third and whose leases expired.
    pub(super) fn lease_spoken_for(&mut self) {
        if self.outage.lease_spoken_for() && self.admission.formation_over() {
            self.flight.emit(Effect::Probe(false));
        }
    }

    /// Leaves [`Phase::Watching`] without an error (the backoff starts over).
    pub(super) fn resync_after_watching(&mut self, why: Resync) {
        self.outage.left_cleanly();
        self.begin_sync(why);
    }

    /// Starts a sync: whatever was left to do is dropped, and so is every stream event
    /// not handled yet (the new watches start from the read).
    pub(super) fn begin_sync(&mut self, why: Resync) {
        self.close_watches();
        self.phase = Phase::Syncing(why);
        if why != Resync::First {
            // Read before the grant, for the first sync only: any later one reads afresh.
            self.first_read = None;
        }
        let grace_until = match why {
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
        self.watches.begin(grace_until);
        // The sync reads the round anew.
        self.shard_read_at = None;
        self.duty.stand_down();
        let mut plan = Todo::sync(why, self.outage.reselect(), self.me.abandoning());
        if why == Resync::First && self.cfg.crowd {
            // Not at a crowd's join: 10,000 member lists in the seconds etcd is busiest,
            // for a count a forming node needs only when a keep-alive is late (and then
            // asks with the question). It asks once it runs a round (`serve.rs`).
            plan.retain(|t| *t != Todo::CountMembers);
        }
        if why == Resync::First && self.admission.active() {
            // A joining node's lease is kept alive from its grant: its first sync and
            // registration may wait in a crowd longer than a TTL.
            let at = plan.iter().position(|t| *t == Todo::Read).unwrap_or(0);
            plan.insert(at, Todo::KeepFromGrant);
        }
        self.flight.plan(plan);
    }

    /// Stream events queued before this moment belong to streams now closed.
    pub(super) fn close_watches(&mut self) {
        // Also when a sync failed after opening them: their events would otherwise queue
        // up behind the next sync and be read as the new watches' (found by the
        // simulator: a coordinator's old stream, without previous values, made every later
        // incarnation of two nodes look departed, and rounds were sealed in a loop).
        if !matches!(self.phase, Phase::Disconnected { .. } | Phase::Ended) {
            self.flight.emit(Effect::CloseWatches);
        }
        self.lease.stop();
        self.flight.drop_stream_events();
    }

    /// etcd failed: back off, or give up once the outage lasted too long.
    pub(super) fn lost(&mut self, e: Fault) {
        self.close_watches();
        self.flight.plan(Vec::new());
        // An op waiting to be sent again after an overloaded answer goes with the rest; a
        // command's is served after the next sync, as any command caught by an outage.
        if let Some((Then::Command(s), _)) = self.flight.take_retry() {
            self.flight.wait_first(s.into_waiting());
        }
        self.view.edit().connected = false;
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let now = self.now;
        let lasted = self.outage.failed(now);
        if lasted > self.cfg.outage_limit {
            return self.give_up(lasted, &e);
        }
        self.trouble();
        // A connection whose requests went unanswered may stay that way (HTTP/2 closed
        // under them by the client library): a fresh one, even to the same member.
        let reselect = self.cfg.several_endpoints || e.kind == FaultKind::Unanswered;
        self.outage.set_reselect(reselect);
        let delay = self.outage.next_backoff(self.cfg.ttl);
        // Each line stands alone in a log search: it says how long the wait can still last.
        let gives_up_in = self.cfg.outage_limit.saturating_sub(lasted);
        if self.cfg.embedded_store {
            tracing::warn!(error = %e, retry_in = ?delay, gives_up_in = ?gives_up_in, "connection to the c10d store lost; reconnecting");
        } else {
            tracing::warn!(error = %e, retry_in = ?delay, gives_up_in = ?gives_up_in, "etcd connection lost; reconnecting");
        }
        self.phase = Phase::Disconnected { until: now + delay };
    }

    /// etcd has not answered for longer than the outage bound: every waiting request
    /// gets the reason, the view says it, and the session ends.
    pub(super) fn give_up(&mut self, lasted: Duration, last: &Fault) {
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
        self.view.edit().gave_up = Some(reason);
        self.end();
    }

    /// The session ended: whoever still waits hears why.
    pub(super) fn end_requests(&mut self) {
        // A command held for its pace or a backoff is told too: a departure goes ahead of
        // it and ends the session.
        if let Some((Then::Command(s), _)) = self.flight.take_retry() {
            self.flight.wait_first(s.into_waiting());
        }
        let reason = self.view.gave_up.clone();
        for id in self.flight.abandon_all() {
            let e = match &reason {
                Some(r) => RendezvousError::Outage(r.clone()),
                None => RendezvousError::SessionEnded("the session ended"),
            };
            self.reply(id, Err(e));
        }
    }

    /// Into [`Phase::Watching`], with the watches opened for the role and lease they were
    /// opened for: a command served since may have replaced the lease, and the first
    /// keep-alive tick then syncs again for the new one.
    pub(super) fn enter(&mut self) {
        self.probe(false);
        self.phase = Phase::Watching {
            role: self.watches.role(),
            lease: self.watches.lease(),
        };
        // In a crowd, a stream kept from the grant goes on under the watches with its
        // keep-alives' times: the lease was granted or renewed less than a third of a TTL
        // ago. A keep-alive at once here was one renewal more per joining node, a fifth of
        // what etcd renewed while 10,000 nodes formed. Not for a lease granted again
        // since (a command served in this sync found the old one gone: the tick at once
        // syncs again for it), nor a stream etcd ended (the tick at once opens another).
        // A smaller run's node confirms its lease at once: one request, and its clock is
        // etcd's word from its first look.
        let lease = self.lease.id();
        let on_schedule = self.cfg.crowd
            && self.lease.kept_from_grant() == Some(lease)
            && self.watches.lease() == lease
            && !self.lease.stream_ended()
            && self.lease.keep_alive_due().is_some();
        self.lease.kept_from_grant_over();
        if !on_schedule {
            self.lease.start(self.now);
        }
        self.outage.over();
    }

    /// The session ends (a departure served, the handle gone, or given up).
    pub(super) fn end(&mut self) {
        self.phase = Phase::Ended;
    }

    /// The `n`-th (0-based) wait before a request etcd was too busy for goes again: from
    /// 100 ms, doubling, at most a quarter TTL (and 2 s).
    pub(super) fn retry_delay(&self, n: u32) -> Duration {
        crate::backoff::nth(FIRST_RETRY, LAST_RETRY.min(self.cfg.ttl / 4), n)
    }

    /// Whether an overloaded answer is retried in place. Not during an outage or after the
    /// end (nothing is in flight then). With several etcd members, only for a quarter
    /// TTL: a member cut from its quorum answers "request timed out" too, and then
    /// another member is the way on (the outage path picks one).
    pub(super) fn may_retry(&self, then: &Then) -> bool {
        let watching = matches!(self.phase, Phase::Watching { .. } | Phase::Syncing(_));
        let since = self.outage.slowed_since(self.now);
        let safe = match then {
            Then::Command(s) => s.retry_safe(),
            _ => true,
        };
        safe && watching && !(self.cfg.several_endpoints && self.now - since >= self.cfg.ttl / 4)
    }

    /// etcd answered the op in flight that it is overloaded: the same op goes again after
    /// a backoff, the watches stay open and the view stays; nothing else is done meanwhile
    /// (the op is as good as still in flight). A write that timed out may still have been
    /// applied: every op here is safe to send twice (a fenced or guarded transaction
    /// fails its compare the second time, and the watch brings what the first one did;
    /// a second grant only leaves a lease to expire).
    pub(super) fn slowed_down(&mut self, then: Then, e: Fault) {
        let Some(op) = self.flight.done() else {
            return self.on_answer_of(then, Err(e));
        };
        if self.flight.retry_due().is_some() {
            // A keep-alive stream's reopen sent while another op waits for its turn
            // failed the same way: it is tried again when the next keep-alive falls due
            // (the stream stays ended), never in the waiting op's place.
            debug_assert!(matches!(then, Then::Todo(Todo::ReopenKeepAlive)));
            return;
        }
        let now = self.now;
        let (before, busy_for) = self.outage.slowed(now);
        if busy_for > self.cfg.outage_limit {
            // The command being served hears why with the ones waiting.
            if let Then::Command(s) = then {
                self.flight.wait_first(s.into_waiting());
            }
            return self.give_up(busy_for, &e);
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let delay = self.retry_delay(before);
        // A joining node's pace grows with each refusal, drawn apart from the crowd's.
        let at = if self.paces(&op) {
            let at = self.admission.refused(self.flight.sent(), now, delay);
            // Beyond the backoff an unpaced request waits too.
            self.held_by_pace(now + delay, at);
            at
        } else {
            now + delay
        };
        let delay = at - now;
        if before == 0 {
            tracing::warn!(error = %e, retry_in = ?delay, "etcd is overloaded; sending the request again later (the watches stay open)");
        } else {
            tracing::debug!(error = %e, retry_in = ?delay, "etcd is still overloaded");
        }
        self.flight.retry_at(at, then, op);
    }
}

/// How long a running node's look for proof that etcd has no leader waits for etcd's
/// answer about its lease: a sixteenth of the TTL (asked that much earlier, so a silent
/// etcd that answered promptly before is looked at when it was before). At the seal of
/// 10,000 nodes on etcd 3.5, every member a second late with its renewal looked at once,
/// two fresh connections each: thousands a second to an etcd that was slow, not gone
/// (13.6% of its CPU set them up).
pub(super) fn look_held(ttl: Duration) -> Duration {
    ttl / 16
}

/// Whether a late keep-alive is asked about (not with admission switched off, which the
/// simulator must catch: the question is part of it).
fn asks_first() -> bool {
    !crate::switches::NO_ADMISSION.with(std::cell::Cell::get)
}
