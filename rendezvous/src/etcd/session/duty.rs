//! The coordinator's duty: claiming the coordinator key in turn when it goes, looking at
//! the view and sealing a round when the rule says so, and when to look again. Also the
//! port a round this node seals as its rank 0 names for its master: the driver picks it
//! (binding a socket is I/O) and hands it in as an input (`Input::Port`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::io::{Effect, Op, Role, TxnSpec};
use super::machine::{Machine, Then};
use super::records;
use super::sync::Todo;
use crate::etcd::coordinator::{Coordinator, Observation, round_record};
use crate::etcd::placement::AHEAD_SPACING;
use crate::pace::HoldRule;
use crate::seal::{Proposal, SealConfig, SealDecision};

/// How long each member of the round waits after the one before it to claim a coordinator
/// key that went.
const CAMPAIGN_STEP: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub(super) struct Duty {
    coordinator: Coordinator,
    /// When the coordinator asked to look again.
    recheck: Option<Instant>,
    /// The coordinator key went and this node is not the first to claim it: when to claim
    /// it if nobody has by then.
    campaign_at: Option<Instant>,
    /// The churn episode ([`HoldRule::Churn`]) already said at info.
    churn_said: Option<u64>,
    /// The highest round number this agent has seen: a new round is numbered past it.
    highest_round: Option<u64>,
    /// The most restarts a round this agent saw or sealed had charged: a run's count only
    /// grows, so a new round never counts fewer (see [`Machine::seal`]).
    most_restarts: u32,
    /// The round the view holds and when this agent first saw it: how long ago a round
    /// was sealed, by this agent's own clock ([`v1::Round::charged_ago_ms`]); and whether
    /// it was seen while watching, that is sealed, not read at a sync.
    round_seen: Option<(u64, Instant, bool)>,
    /// A port free on this node's address, for the master of the next round it seals as
    /// rank 0, and when the driver found it; none until the driver gives one.
    port: Option<(u16, Instant)>,
    /// When a port was last asked for: asked again only once the one held is a TTL old
    /// (or none came within one), so a port is never much older than that when used.
    asked_at: Option<Instant>,
    /// A seal waits for the port asked for: decided again when it comes.
    seal_waits: bool,
    /// Placed seals tried by this process: each attempt's shards go under a name of
    /// their own ([`crate::etcd::placement::tag`]).
    placed_seals: u64,
    /// The round this coordinator sealed that its view does not hold yet, and when
    /// ([`Machine::awaiting_own_seal`]).
    sealed_unseen: Option<(u64, Instant)>,
}

/// What a commit in flight was for.
#[derive(Debug)]
pub(super) struct Commit {
    number: u64,
    members: usize,
    restart_count: u32,
    reason: String,
    /// The transactions still to go of a placed round whose shards are written ahead of
    /// its header: the shards', then the header's (none when the header holds them).
    ahead: std::collections::VecDeque<TxnSpec>,
}

impl Duty {
    pub(super) fn new(cfg: SealConfig, now: Instant) -> Self {
        Self {
            coordinator: Coordinator::new(cfg, now),
            recheck: None,
            campaign_at: None,
            churn_said: None,
            highest_round: None,
            most_restarts: 0,
            round_seen: None,
            port: None,
            asked_at: None,
            seal_waits: false,
            placed_seals: 0,
            sealed_unseen: None,
        }
    }

    /// The view holds round `r`, seen at `now`; `live`: while watching.
    pub(super) fn saw_round(&mut self, r: &v1::Round, now: Instant, live: bool) {
        let n = r.number;
        if self.round_seen.is_none_or(|(seen, ..)| seen != n) {
            self.round_seen = Some((n, now, live));
        }
        self.highest_round = self.highest_round.max(Some(n));
        self.most_restarts = self.most_restarts.max(r.restart_count);
    }

    /// The driver's port for the next master, found at `now` (none: it found none);
    /// whether a seal waited for it.
    pub(super) fn port(&mut self, port: Option<u16>, now: Instant) -> bool {
        if let Some(p) = port {
            self.port = Some((p, now));
        }
        std::mem::take(&mut self.seal_waits)
    }

    /// Whether to ask the driver for a port before sealing at `now`: the one held is
    /// older than `ttl` (a process that binds ports by number may have taken it since),
    /// or there is none; not twice at the same moment (the driver found none). Marks it
    /// asked.
    fn ask_port(&mut self, now: Instant, ttl: Duration) -> bool {
        let fresh = self.port.is_some_and(|(_, at)| now < at + ttl);
        let ask = !fresh && self.asked_at != Some(now);
        if ask {
            self.asked_at = Some(now);
        }
        ask
    }

    /// The earliest of the duty's timers.
    pub(super) fn next_timer(&self) -> Option<Instant> {
        self.campaign_at.into_iter().chain(self.recheck).min()
    }

    /// The timers due at `now`, cleared: whether to claim the key, whether to look again.
    pub(super) fn take_due(&mut self, now: Instant) -> (bool, bool) {
        let campaign = self.campaign_at.take_if(|at| *at <= now).is_some();
        let recheck = self.recheck.take_if(|at| *at <= now).is_some();
        (campaign, recheck)
    }

    /// Not looking again: the role changes, or the watches do.
    pub(super) fn stand_down(&mut self) {
        self.recheck = None;
        // A sync reads the run afresh: the round is there, comes through the new watches,
        // or etcd lost it.
        self.sealed_unseen = None;
    }
}

impl Machine {
    /// The coordinator key went: the round's members not seen to go claim it in rank
    /// order, the first at once and each next one [`CAMPAIGN_STEP`] later if nobody has
    /// by then (the ones before it may be gone too); a node outside the round after a
    /// lease TTL. A claim that finds the key taken writes nothing. Every member claiming
    /// at once was a transaction per node each time the coordinator died: 999 at 1,000
    /// nodes.
    pub(super) fn campaign_in_turn(&mut self) {
        let me = self.cfg.node_id.as_str();
        let v = &self.view;
        let placed = v.round.as_ref().and_then(|r| r.record.placed.as_ref());
        // A member's copy of a placed round knows its rank, not who before it went.
        let turn = placed.map(|p| p.group_rank as usize).or_else(|| {
            v.round
                .as_ref()?
                .record
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
            self.flight.then(Todo::Campaign);
        } else {
            self.duty.campaign_at = Some(self.now + wait);
        }
    }

    /// As coordinator: observe the view, and commit a round if the rule says so; counts
    /// the CPU time it took ([`crate::Counters::coordinating_ns`]).
    pub(super) fn coordinate(&mut self) {
        if self.role() != Role::Coordinator || self.watches.control_only() {
            self.duty.recheck = None;
            return;
        }
        if self.awaiting_return() || self.awaiting_own_seal() {
            return;
        }
        let began = thread_cpu_ns();
        let sealed = self.decide_and_seal();
        let spent = thread_cpu_ns().saturating_sub(began);
        let c = &self.counters;
        c.coordinating_ns.fetch_add(spent, Ordering::Relaxed);
        if sealed {
            c.sealing_ns.fetch_add(spent, Ordering::Relaxed);
        }
    }

    /// A fresh store's coordinator, within its grace, while members of the round put back
    /// are not registered yet: it waits for them (the grace's end decides, if not
    /// sooner). A c10d host restarted in place sealed at once with the first two back,
    /// declared the rest lost, and then admitted one per round: 5 to 6 rounds in 0.6 s.
    fn awaiting_return(&self) -> bool {
        if !self.cfg.fresh_store || self.watches.grace_until().is_none_or(|g| g <= self.now) {
            return false;
        }
        let v = &self.view;
        // The old host never comes back under its node id (one per process): its place
        // is this agent's.
        v.round.as_ref().is_some_and(|r| {
            r.record
                .members
                .iter()
                .any(|m| m.addr != self.cfg.addr && !v.members.contains_key(&m.node_id))
        })
    }

    /// Whether this coordinator waits for a round it sealed to come back through its
    /// watch before it decides again. Its view still holds the round before, and every
    /// seal decided from that is fenced out: at 10,000 nodes, with 50 members leaving at
    /// once, each departure seen in the 3.3 s before its own round came back was a seal of
    /// the 9,950 others sent again and refused (51 of them, each a large transaction
    /// through etcd's log, which is what made the watch that slow), and the round without
    /// the 49 came 4.3 s after the one without the first. For at most a TTL: a round key
    /// deleted meanwhile must not leave the run with nobody sealing (a seal from the view
    /// then is fenced as any other). The last-call and re-form clocks start when it looks
    /// again, at most the watch's lag late.
    fn awaiting_own_seal(&mut self) -> bool {
        let Some((number, sealed_at)) = self.duty.sealed_unseen else {
            return false;
        };
        let held = self.view.round.as_ref().map(|r| r.record.number);
        let until = sealed_at + self.cfg.ttl;
        if held.is_none_or(|h| h < number) && self.now < until {
            self.duty.recheck = Some(until);
            return true;
        }
        self.duty.sealed_unseen = None;
        false
    }

    /// [`Machine::coordinate`]'s decision; whether it sent a commit.
    fn decide_and_seal(&mut self) -> bool {
        let obs = self.duty.coordinator.observe(self.now, &self.view);
        self.say_observation(&obs);
        match obs.decision {
            SealDecision::Wait { recheck_at } | SealDecision::Reforming { recheck_at } => {
                self.duty.recheck = recheck_at;
                false
            }
            // As the round's rank 0, with no fresh port for its master: the driver finds
            // one first (it answers at once), and the seal is decided again when it comes.
            SealDecision::Seal(p)
                if p.members.first() == Some(&self.cfg.node_id)
                    && self.duty.ask_port(self.now, self.cfg.ttl) =>
            {
                self.flight.emit(Effect::PickPort);
                self.duty.seal_waits = true;
                false
            }
            SealDecision::Seal(p) => {
                self.seal(p, obs.fence, obs.reason);
                true
            }
        }
    }

    /// The log lines of an observation: a new reason, a held seal.
    fn say_observation(&mut self, obs: &Observation) {
        // Once every member finished, the members leaving is the job ending: "re-forming
        // (lost ...)" would read as a failure in the last lines of a successful run. The
        // decision itself stands (a node joining a finished job still gets a round).
        match (obs.new_reason, self.view.round_finished()) {
            (true, true) => {
                tracing::debug!(reason = %obs.reason, "coordinator (the round finished)")
            }
            (true, false) => tracing::info!(reason = %obs.reason, "coordinator"),
            (false, _) => {}
        }
        let Some((why, rule)) = &obs.held else {
            return;
        };
        self.counters.seals_held.fetch_add(1, Ordering::Relaxed);
        match rule {
            HoldRule::SameBasis => {
                tracing::error!(reason = %obs.reason, held = %why, "rounds are being sealed too fast; is a node re-forming in a loop?")
            }
            // Churn is the nodes' doing, not ours: said once an episode.
            HoldRule::Churn { episode } if self.duty.churn_said != Some(*episode) => {
                self.duty.churn_said = Some(*episode);
                tracing::info!(held = %why, "nodes are joining and leaving faster than a group can settle; each next round waits a little longer (0.5s, doubling up to 30s) until they calm down")
            }
            HoldRule::Churn { .. } => {
                tracing::debug!(held = %why, "churn goes on; holding the next round")
            }
        }
    }

    /// Commits round `p` over the round at revision `fence`.
    fn seal(&mut self, mut p: Proposal, fence: Option<i64>, reason: String) {
        // Never a number this agent has seen sealed, even when the store forgot it
        // (restored from an old snapshot, its round key deleted): keys indexed by round
        // (failures, done, detections) would collide, and a member running that number
        // would take the new round for the one it runs.
        if let Some(seen) = self.duty.highest_round {
            p.number = p.number.max(seen.saturating_add(1));
        }
        let mut record = v1::Round {
            job: self.cfg.job.clone(),
            ..round_record(
                &p,
                &self.view,
                &reason,
                self.unix_ms(),
                self.since_previous(),
            )
        };
        // Nor fewer restarts than a round it saw or sealed: etcd that came back empty
        // forgot the round that spent the budget, and a first seal from nothing counted
        // 0, so a member that had not yet taken the spent round from its view ran on
        // where the others gave up (simulator seed 208849). Raised after the record is
        // made: the charges it lists (a restart window counts those) are the ones this
        // seal made, none invented for the raise.
        record.restart_count = record.restart_count.max(self.duty.most_restarts);
        p.restart_count = record.restart_count;
        let base = self.view.round.as_ref().map(|b| (&*b.record, b.mod_rev));
        // The coordinator key's lease, which fences the seal.
        let (keys, key_lease) = (&self.cfg.keys, self.view.coordinator_lease);
        let (ahead, mut txn) = if record.members.len() > self.cfg.placement_above {
            // This process's own lease, not the key's (see `placement::tag`).
            let (own, attempt) = (self.lease.id(), self.duty.placed_seals);
            let tag = crate::etcd::placement::tag(record.number, own, attempt);
            self.duty.placed_seals += 1;
            let shape = self.cfg.placement_shape;
            match records::commit_placed(keys, fence, key_lease, &record, base, tag, shape) {
                Ok(seal) => (seal.ahead, seal.header),
                Err(why) => {
                    // Proposals are made of registrations this view accepted, whose
                    // worker counts are checked: not a state a seal can mend.
                    tracing::error!(round = p.number, %why, "the round cannot be placed");
                    return;
                }
            }
        } else {
            let txn = records::commit_round(keys, fence, key_lease, &record, base);
            (Vec::new(), txn)
        };
        if let Some(master) = self.master_of(&record) {
            let put = records::put(
                self.cfg.keys.of(&master),
                fsdp_proto::encode(&master),
                self.lease.id(),
            );
            txn.then.push(put);
        }
        // The shards first, one transaction at a time, then the header.
        let mut txns: std::collections::VecDeque<TxnSpec> = ahead.into();
        txns.push_back(txn);
        let Some(first) = txns.pop_front() else {
            return;
        };
        let commit = Commit {
            number: p.number,
            members: p.members.len(),
            restart_count: p.restart_count,
            reason,
            ahead: txns,
        };
        self.issue(Then::Commit(commit), Op::Txn(first));
    }

    /// How long ago the round the view holds was sealed: seen sealed, on this agent's own
    /// monotonic clock; else (this process started since, e.g. a c10d host restarted in
    /// place) the seal's wall-clock age, the one measure left.
    fn since_previous(&self) -> Duration {
        match (&self.view.round, self.duty.round_seen) {
            (Some(r), Some((n, at, true))) if n == r.record.number => self.now - at,
            (Some(r), _) => {
                Duration::from_millis(self.unix_ms().saturating_sub(r.record.sealed_at_ms))
            }
            (None, _) => Duration::ZERO,
        }
    }

    /// When this node is `record`'s rank 0, the master it names in the same write, on the
    /// driver's port (each used once: a round's store binds it). Otherwise every member waits
    /// for a second event, after rank 0 has seen the round through its own watch (a
    /// quarter second at 1,000 members, where etcd sends the round to every watcher
    /// first). Only from this process's own registration: one an earlier process left
    /// (sealed before it expired) is not started by this one, which would leave the
    /// members dialling a master nobody binds.
    fn master_of(&mut self, record: &v1::Round) -> Option<v1::Master> {
        let rank0 = record.members.first().is_some_and(|m| {
            m.node_id == self.cfg.node_id
                && m.lease == self.lease.id()
                && m.incarnation >= self.view.incarnation
        });
        if !rank0 {
            return None;
        }
        let (port, _) = self.duty.port.take()?;
        Some(v1::Master {
            schema: fsdp_proto::SCHEMA_VERSION,
            round: record.number,
            addr: self.cfg.addr.clone(),
            port: u32::from(port),
        })
    }

    /// The answer to a commit: sealed, or not (another commit came first).
    pub(super) fn on_commit_answer(
        &mut self,
        mut c: Commit,
        answer: Result<super::io::Answer, super::Fault>,
    ) {
        match answer {
            Ok(super::io::Answer::Txn { succeeded: true }) if !c.ahead.is_empty() => {
                // Shards are in: the next ones, or the header that names them, a backend
                // commit later ([`AHEAD_SPACING`]). (The seal counts as one of this
                // node's writes, the header's; the shards' apart.)
                self.counters.shard_txns.fetch_add(1, Ordering::Relaxed);
                if let Some(next) = c.ahead.pop_front() {
                    let at = self.now + AHEAD_SPACING;
                    self.flight.retry_at(at, Then::Commit(c), Op::Txn(next));
                }
            }
            Ok(super::io::Answer::Txn { succeeded }) => {
                self.wrote();
                if !succeeded && !c.ahead.is_empty() {
                    tracing::debug!(
                        round = c.number,
                        "the round's shards lost their fence; no header follows"
                    );
                }
                if succeeded {
                    let (number, members, restart_count) = (c.number, c.members, c.restart_count);
                    tracing::info!(round = number, members, restart_count, reason = %c.reason, "round sealed");
                    self.counters.rounds_sealed.fetch_add(1, Ordering::Relaxed);
                    // Its own seal counts before the watch brings it back: a seal that
                    // follows at once (or after etcd came back empty) never counts fewer.
                    self.duty.most_restarts = self.duty.most_restarts.max(restart_count);
                    self.duty.coordinator.sealed(self.now, number, &c.reason);
                    self.duty.sealed_unseen = Some((number, self.now));
                }
            }
            Ok(other) => self.unexpected(&other),
            Err(e) => {
                if e.kind == super::FaultKind::TooLarge {
                    // Read again and sealed again, it fails the same way: only the
                    // operator can end this, and the line must say how.
                    tracing::error!(
                        round = c.number,
                        members = c.members,
                        error = %e,
                        "the round is larger than etcd takes in one request (its --max-request-bytes: \
                         a seal's transactions stay under 1 MiB, and etcd takes 1.5 MiB by default); \
                         no round can form until etcd is started with a larger --max-request-bytes"
                    );
                }
                self.lost(e)
            }
        }
    }
}

/// This thread's CPU time in ns (0 where the clock cannot be read): what the coordinator's
/// decisions cost, apart from the time other tasks and processes had the core.
fn thread_cpu_ns() -> u64 {
    use nix::time::{ClockId, clock_gettime};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |t| {
        (t.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec() as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver that found no port once (the address did not resolve yet, say) is asked
    /// again at the next seal: a first answer of none turned the master-in-the-commit off
    /// for good in an earlier version.
    #[test]
    fn a_port_is_asked_for_until_one_comes_and_again_once_it_is_a_ttl_old() {
        let (t0, ttl) = (Instant::now(), Duration::from_secs(10));
        let cfg = SealConfig {
            min_nodes: 1,
            max_nodes: 1,
            last_call: Duration::ZERO,
            straggler_timeout: ttl,
            segment_size: 1,
        };
        let mut d = Duty::new(cfg, t0);
        assert!(d.ask_port(t0, ttl), "none held");
        assert!(!d.ask_port(t0, ttl), "the driver found none just now");
        assert!(!d.port(None, t0), "no seal waited");
        let t1 = t0 + Duration::from_millis(1);
        assert!(d.ask_port(t1, ttl), "asked again at the next seal");
        d.port(Some(20_001), t1);
        assert!(!d.ask_port(t1 + ttl / 2, ttl), "fresh");
        assert!(d.ask_port(t1 + ttl, ttl), "a TTL old");
        d.port(Some(20_002), t1 + ttl);
        assert_eq!(d.port.take(), Some((20_002, t1 + ttl)));
        assert!(
            d.ask_port(t1 + ttl + Duration::from_millis(1), ttl),
            "used once"
        );
    }
}
