//! The steps of a sync (a ranged read to open watches) and the other work the machine
//! queues: each a [`Todo`] that runs at once or sends one op and goes on with its answer.

use std::collections::BTreeSet;
use std::time::Duration;

use super::io::{Answer, Kv, Op, Role};
use super::machine::{Machine, Phase, Resync, Then};
use super::records;
use crate::etcd::coordinator::round_record;
use crate::etcd::session::lease_not_found;
use crate::etcd::view::{View, left_between};
use crate::pace::HoldRule;
use crate::seal::SealDecision;

/// One piece of queued work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Todo {
    /// Pin the connection to a member that answers.
    PickEndpoint,
    /// This node fenced itself: say why, for status (before the revoke, so that the
    /// coordinator never finds its registration gone without a word).
    SayFenced,
    /// This node fenced itself: revoke its lease (then [`Todo::Grant`] a new one).
    RevokeFenced,
    /// A new lease: the next incarnation.
    Grant,
    /// The ranged read of the whole run; the view is rebuilt from it.
    Read,
    CountMembers,
    /// Whether the lease lives, then what it takes to be registered again (not on the
    /// first sync: see [`Todo::sync`]).
    CheckLease,
    /// This node's registration with the current lease, if it has one to write.
    Register,
    /// etcd came back without our round: put the same round back.
    Republish,
    /// Claim the coordinator key if nobody holds it.
    Campaign,
    OpenWatches,
    Coordinate,
    /// As coordinator: a word for a member of the round lost without one, and the trim of
    /// the oldest departure records.
    SayLost,
    /// Serve the commands that waited for etcd, oldest first.
    Drain,
    /// Into [`Phase::Watching`].
    Enter,
    /// The watches were opened for another role: open them again for this one.
    RoleCheck,
    /// Members of our round not back after the outage grace are gone.
    CheckAbsent,
    /// A round came as a delta of one this view does not hold: read it whole.
    ReadRoster,
    /// The keep-alive stream ended (etcd too busy): a new one, the watches kept.
    ReopenKeepAlive,
    /// After a control-only read on a resync: this node's own registration, to tell
    /// whether it is still there.
    ReadOwn,
    KeepAlive,
    Resync(Resync),
}

impl Todo {
    /// Everything from a ranged read to open watches.
    pub fn sync(why: Resync, reselect: bool, abandon: bool) -> Vec<Todo> {
        let mut plan = Vec::new();
        if reselect {
            plan.push(Todo::PickEndpoint);
        }
        if abandon {
            // Before the read, so that the watches start after the revoke and this node
            // does not see its own departure.
            plan.extend([Todo::SayFenced, Todo::RevokeFenced]);
        }
        plan.push(Todo::Read);
        // The cluster's size rarely changes: asked at join and after an outage, not at
        // every coordinator change.
        if !matches!(why, Resync::RoleChanged { .. }) {
            plan.push(Todo::CountMembers);
        }
        if why != Resync::First {
            // Not on the first: the lease was granted just before it, and its clock runs
            // from the grant. Asked anyway, it was one of the requests every joining agent
            // made, each of which etcd 3.4 answers by copying its buffer of uncommitted
            // writes (a third of its CPU at formation; issue 30). A lease that expired
            // meanwhile is found at the registration, which grants another (`serve.rs`).
            plan.push(Todo::CheckLease);
            // On the first sync the agent's registration claims the role if it is free.
            plan.push(Todo::Campaign);
        }
        plan.extend([
            Todo::OpenWatches,
            Todo::Coordinate,
            Todo::SayLost,
            Todo::Drain,
            Todo::Enter,
            Todo::RoleCheck,
        ]);
        plan
    }
}

impl Machine {
    pub(super) fn run(&mut self, todo: Todo) {
        let keys = &self.cfg.keys;
        let op = match todo {
            Todo::PickEndpoint => Op::PickEndpoint,
            Todo::SayFenced => return self.say_fenced(),
            Todo::SayLost => return self.say_lost(),
            Todo::RevokeFenced => Op::Revoke { lease: self.lease },
            Todo::Grant => Op::Grant {
                ttl: self.cfg.ttl.as_secs().max(1) as i64,
            },
            Todo::ReadOwn => Op::Range {
                key: keys.key::<fsdp_proto::v1::Member>(&self.cfg.node_id),
                prefix: false,
                keys_only: false,
            },
            Todo::Read => Op::Range {
                // A member reads what it watches: the control keys (and then its own
                // registration). The whole run holds every registration, and N members
                // each reading it — N joiners at formation, or every node after etcd
                // was too slow for their streams — was O(N²) bytes from etcd exactly
                // when it was busiest (10,000 nodes: gigabytes; issue 30).
                key: if self.control_read() {
                    keys.ctl()
                } else {
                    keys.root().to_owned()
                },
                prefix: true,
                keys_only: false,
            },
            Todo::CountMembers => Op::MemberCount,
            Todo::CheckLease => Op::TimeToLive { lease: self.lease },
            Todo::Register => match &self.member {
                Some(m) => Op::Txn(records::registration(
                    keys,
                    &self.cfg.node_id,
                    Some(m),
                    (self.lease, self.incarnation),
                    false,
                )),
                None => return,
            },
            Todo::Republish => match self.round_to_put_back() {
                Some(r) => Op::Txn(records::first_word(
                    keys.key::<fsdp_proto::v1::Round>(""),
                    fsdp_proto::encode(r),
                    &[],
                )),
                None => return,
            },
            Todo::Campaign => {
                if self.view.coordinator.is_some() || self.member.is_none() {
                    return;
                }
                let me = &self.cfg.node_id;
                Op::Txn(records::registration(keys, me, None, (self.lease, 0), true))
            }
            Todo::OpenWatches => {
                if self.control_only && self.role() == Role::Coordinator {
                    // Elected during this sync (a campaign after an outage) on a view
                    // without registrations: read them all before watching as the
                    // coordinator (found by the simulator: a coordinator that never
                    // sealed, seed 275).
                    self.whole_read = true;
                    self.todo.push_front(Todo::OpenWatches);
                    self.todo.push_front(Todo::Read);
                    return;
                }
                self.watch_role = self.role();
                self.watch_lease = self.lease;
                Op::Watch {
                    role: self.watch_role,
                    from: self.read_rev + 1,
                    lease: self.lease,
                }
            }
            Todo::CheckAbsent => match &self.running {
                Some(_) => Op::Range {
                    key: keys.members(),
                    prefix: true,
                    keys_only: true,
                },
                None => return,
            },
            Todo::ReadRoster => {
                let Some(wanted) = self.view.round_wanted else {
                    return;
                };
                tracing::debug!(
                    wanted,
                    "a round came as a delta of one not held; reading the roster"
                );
                Op::Range {
                    key: keys.key::<fsdp_proto::v1::Roster>(""),
                    prefix: false,
                    keys_only: false,
                }
            }
            // A keep-alive queued before the stream ended goes on a new one.
            Todo::KeepAlive if self.keep_alive_ended => {
                self.todo.push_front(Todo::KeepAlive);
                let lease = self.watch_lease;
                let op = Op::ReopenKeepAlive { lease };
                return self.issue(Then::Todo(Todo::ReopenKeepAlive), op);
            }
            Todo::KeepAlive => Op::KeepAlive,
            Todo::ReopenKeepAlive => Op::ReopenKeepAlive {
                lease: self.watch_lease,
            },
            Todo::Coordinate => return self.coordinate(),
            Todo::Drain => return self.drain(),
            Todo::Enter => return self.enter(),
            Todo::RoleCheck => return self.role_check(),
            Todo::Resync(why) => return self.begin_sync(why),
        };
        self.issue(Then::Todo(todo), op);
    }

    pub(super) fn on_todo_answer(
        &mut self,
        todo: Todo,
        answer: Result<Answer, etcd_client::Error>,
    ) {
        let answer = match (todo, answer) {
            (Todo::SayFenced | Todo::SayLost, Err(e)) => return self.word_failed(todo, e),
            // A fenced lease that expired meanwhile is gone either way.
            (Todo::RevokeFenced, Err(e)) if lease_not_found(&e) => Answer::Done,
            (_, Err(e)) => return self.lost(e),
            (_, Ok(a)) => a,
        };
        match (todo, answer) {
            (Todo::PickEndpoint, _) => self.reselect = false,
            (Todo::SayFenced, Answer::Txn { .. }) => {
                self.wrote();
                self.fenced_word = None;
            }
            (Todo::SayLost, Answer::Txn { .. }) => self.said_lost(),
            (Todo::RevokeFenced, _) => {
                self.wrote();
                tracing::info!(lease = self.lease, "revoked the fenced lease");
                // Its registration went with the lease: a round sealed from it (before the
                // others saw it go) is not one this agent can run.
                let (me, went, now) = (self.cfg.node_id.clone(), self.incarnation, self.now);
                self.view_mut().depart(&me, went, now);
                self.abandon = false;
                self.todo.push_front(Todo::Grant);
            }
            (Todo::Grant, Answer::Granted { id }) => self.lease_renewed(id),
            (Todo::ReadOwn, Answer::Range { kvs, .. }) => {
                let keys = self.cfg.keys.clone();
                let v = self.view_mut();
                for kv in &kvs {
                    put_kv(v, &keys, kv);
                }
            }
            (Todo::Read, Answer::Range { revision, kvs }) => {
                let control_only = self.control_read();
                let fresh = fresh_view(self, &kvs);
                if control_only && fresh.coordinator.as_deref() == Some(&*self.cfg.node_id) {
                    // An earlier run of this node still holds the role: a coordinator
                    // needs every registration.
                    self.whole_read = true;
                    self.todo.push_front(Todo::Read);
                    return;
                }
                self.read_rev = revision;
                self.control_only = control_only;
                let voluntary = matches!(self.phase, Phase::Syncing(Resync::RoleChanged { .. }));
                self.install(fresh, voluntary);
                if control_only && self.phase != Phase::Syncing(Resync::First) {
                    // Whether this node is still registered decides what the sync does
                    // next (a joining node registers when it joins).
                    self.todo.push_front(Todo::ReadOwn);
                }
                if control_only && self.view.round_wanted.is_some() {
                    // The round key holds a difference: the whole round is at the roster,
                    // outside the control keys.
                    self.todo.push_front(Todo::ReadRoster);
                }
            }
            (Todo::CountMembers, Answer::MemberCount(n)) => self.single_member = n == 1,
            (Todo::CheckLease, Answer::TimeToLive { ttl }) => self.ensure_registered(ttl),
            (Todo::Register, Answer::Txn { .. }) => {
                self.wrote();
                self.written = Some((self.lease, self.incarnation));
            }
            (Todo::Republish, Answer::Txn { succeeded }) => {
                self.wrote();
                if succeeded {
                    // The field only when there is a number: `round=Some(0)` is Rust's
                    // text, not a person's.
                    match self.round_to_put_back().map(|r| r.number) {
                        Some(round) => tracing::info!(
                            round,
                            "etcd lost the round record; put the newest round it knew back"
                        ),
                        None => tracing::info!(
                            "etcd lost the round record; put the newest round it knew back"
                        ),
                    }
                }
            }
            (Todo::Campaign, Answer::Txn { succeeded }) => {
                self.wrote();
                if succeeded {
                    self.elected();
                }
            }
            (Todo::OpenWatches, Answer::Done) => {
                self.keep_alive_ended = false;
                self.clock.stream_closed();
            }
            (Todo::CheckAbsent, Answer::Range { kvs, .. }) => self.check_absent(&kvs),
            (Todo::ReadRoster, Answer::Range { kvs, .. }) => self.read_roster(&kvs),
            (Todo::KeepAlive, Answer::Done) => {}
            (Todo::ReopenKeepAlive, Answer::Done) => {
                // The keep-alives sent on the ended stream will never be answered: the
                // next answer must be matched with a keep-alive sent on this one.
                self.keep_alive_ended = false;
                self.clock.stream_closed();
            }
            (_, other) => self.unexpected(&other),
        }
    }

    /// Replaces the view with `fresh`, keeping the departures already seen. When
    /// `voluntary` (nothing was lost in between), a member we knew of that the snapshot
    /// lacks left while we were switching watches.
    fn install(&mut self, mut fresh: View, voluntary: bool) {
        let now = self.now;
        if let Some(r) = &self.view.round {
            if self
                .known_round
                .as_ref()
                .is_none_or(|k| k.number < r.record.number)
            {
                self.known_round = Some((*r.record).clone());
            }
        }
        let left = if voluntary {
            left_between(&self.view, self.running.as_deref(), &fresh)
        } else {
            Vec::new()
        };
        let v = &mut self.view;
        fresh.departed = std::mem::take(&mut v.departed);
        fresh.lease_safe_until = v.lease_safe_until;
        fresh.incarnation = v.incarnation;
        fresh.connected = true;
        for (id, incarnation) in left {
            // An earlier sighting of this incarnation's departure keeps its time.
            if fresh
                .departed
                .get(&id)
                .is_none_or(|d| d.incarnation < incarnation)
            {
                fresh.depart(&id, incarnation, now);
            }
        }
        *self.view_mut() = fresh;
    }

    /// After a read: make sure our lease lives and our registration is there; put back
    /// our round if etcd lost it.
    fn ensure_registered(&mut self, ttl: i64) {
        let alive = ttl > 0;
        if alive {
            let left = Duration::from_secs(ttl.unsigned_abs());
            self.clock.confirmed(self.sent, left);
            self.publish_lease();
        }
        let v = &self.view;
        let present = v.members.contains_key(&self.cfg.node_id);
        let mine = self.running.as_ref();
        let round_missing = self.round_to_put_back().is_some() && v.round.is_none();
        // Our key is gone while our lease lives and our round is still there: someone
        // deleted it, and the others saw us leave. (A lost lease is judged by the clock,
        // in `lease_gone`.)
        let evicted = alive
            && !present
            && mine.is_some_and(|r| {
                v.round
                    .as_ref()
                    .is_some_and(|cur| cur.record.number >= r.number)
            });
        if evicted {
            // The incarnation the round names went; this node registers again below, as
            // the next one, whose registration that departure does not concern.
            if let Some(went) = self.my_incarnation() {
                let (me, now) = (self.cfg.node_id.clone(), self.now);
                self.view_mut().depart(&me, went, now);
            }
            self.next_incarnation();
        }
        let mut next = Vec::new();
        if !alive {
            self.lease_gone();
            next.extend([Todo::Grant, Todo::Register]);
        } else if !present {
            next.push(Todo::Register);
        }
        if round_missing {
            next.push(Todo::Republish);
        }
        for t in next.into_iter().rev() {
            self.todo.push_front(t);
        }
    }

    /// The newest round this agent knows (the one it runs, or a later one it saw).
    fn round_to_put_back(&self) -> Option<&fsdp_proto::v1::Round> {
        [self.running.as_deref(), self.known_round.as_ref()]
            .into_iter()
            .flatten()
            .max_by_key(|r| r.number)
    }

    /// By node, not by incarnation: after etcd came back empty every member registers
    /// again as a new incarnation, and the round goes on.
    fn check_absent(&mut self, present: &[Kv]) {
        let Some(mine) = self.running.clone() else {
            return;
        };
        let prefix = self.cfg.keys.members();
        let present: BTreeSet<&str> = present
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&prefix))
            .collect();
        let now = self.now;
        let v = self.view_mut();
        for m in mine
            .members
            .iter()
            .filter(|m| !present.contains(m.node_id.as_str()))
        {
            v.depart(&m.node_id, m.incarnation, now);
        }
    }

    /// The whole round, for a view that could not apply a delta. A roster older than the
    /// round wanted (a newer seal came between the event and the read, so the next event
    /// brings its delta) leaves the view waiting; none at all means the run's keys are not
    /// as any agent writes them: read everything again.
    fn read_roster(&mut self, kvs: &[Kv]) {
        let keys = self.cfg.keys.clone();
        let v = self.view_mut();
        for kv in kvs {
            put_kv(v, &keys, kv);
        }
        if kvs.is_empty() && self.view.round_wanted.is_some() {
            tracing::warn!(
                "a round came as a delta and no roster holds it whole; reading the run again"
            );
            self.resync_after_watching(Resync::Outage);
        }
    }

    fn drain(&mut self) {
        if let Some((id, command)) = self.pending.pop_front() {
            self.todo.push_front(Todo::Drain);
            self.serve(id, command);
        }
    }

    fn enter(&mut self) {
        self.probe(false);
        // The lease the keep-alive stream was opened for: a command served since may have
        // replaced it, and the first keep-alive tick then syncs again for the new one.
        self.phase = Phase::Watching {
            role: self.watch_role,
            lease: self.watch_lease,
        };
        self.keep_alive_at = Some(self.now);
        self.reset_outage();
    }

    pub(super) fn role_check(&mut self) {
        if let Phase::Watching { role, .. } = self.phase {
            if role != self.role() {
                let grace_until = self.grace_until;
                self.resync_after_watching(Resync::RoleChanged { grace_until });
            }
        }
    }

    /// The read of this sync takes the control keys alone: a member's, at join or after
    /// an outage. A change of role reads the whole run: a new coordinator seals from
    /// every registration, and a former one compares what it knew with the snapshot.
    fn control_read(&self) -> bool {
        matches!(self.phase, Phase::Syncing(Resync::First | Resync::Outage))
            && !self.whole_read
            && self.role() == Role::Member
    }

    /// As coordinator: observe the view, and commit a round if the rule says so; counts
    /// the CPU time it took ([`crate::Counters::coordinating_ns`]).
    fn coordinate(&mut self) {
        if self.role() != Role::Coordinator || self.control_only {
            self.recheck = None;
            return;
        }
        if self.awaiting_return() {
            return;
        }
        let began = thread_cpu_ns();
        let sealed = self.decide_and_seal();
        let spent = thread_cpu_ns().saturating_sub(began);
        let c = &self.counters;
        c.coordinating_ns
            .fetch_add(spent, std::sync::atomic::Ordering::Relaxed);
        if sealed {
            c.sealing_ns
                .fetch_add(spent, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A fresh store's coordinator, within its grace, while members of the round put back
    /// are not registered yet: it waits for them (the grace's end decides, if not
    /// sooner). A c10d host restarted in place sealed at once with the first two back,
    /// declared the rest lost, and then admitted one per round: 5 to 6 rounds in 0.6 s.
    fn awaiting_return(&self) -> bool {
        if !self.cfg.fresh_store || self.grace_until.is_none_or(|g| g <= self.now) {
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

    /// [`Machine::coordinate`]'s decision; whether it sent a commit.
    fn decide_and_seal(&mut self) -> bool {
        let obs = self.coordinator.observe(self.now, &self.view);
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
        if let Some((why, rule)) = &obs.held {
            self.counters
                .seals_held
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match rule {
                HoldRule::SameBasis => {
                    tracing::error!(reason = %obs.reason, held = %why, "rounds are being sealed too fast; is a node re-forming in a loop?")
                }
                // Churn is the nodes' doing, not ours: said once an episode.
                HoldRule::Churn { episode } if self.churn_said != Some(*episode) => {
                    self.churn_said = Some(*episode);
                    tracing::info!(held = %why, "nodes are joining and leaving faster than a group can settle; each next round waits a little longer (0.5s, doubling up to 30s) until they calm down")
                }
                HoldRule::Churn { .. } => {
                    tracing::debug!(held = %why, "churn goes on; holding the next round")
                }
            }
        }
        match obs.decision {
            SealDecision::Wait { recheck_at } | SealDecision::Reforming { recheck_at } => {
                self.recheck = recheck_at;
            }
            SealDecision::Seal(mut p) => {
                // Never a number this agent has seen sealed, even when the store forgot it
                // (restored from an old snapshot, its round key deleted): keys indexed by
                // round (failures, done, gone) would collide, and a member running that
                // number would take the new round for the one it runs.
                if let Some(seen) = self.highest_round {
                    p.number = p.number.max(seen.saturating_add(1));
                }
                // Seen sealed, on this agent's own monotonic clock; else (this process
                // started since, e.g. a c10d host restarted in place) the seal's wall-clock
                // age, the one measure left.
                let since_previous = match (&self.view.round, self.round_seen) {
                    (Some(r), Some((n, at, true))) if n == r.record.number => self.now - at,
                    (Some(r), _) => {
                        Duration::from_millis(self.unix_ms().saturating_sub(r.record.sealed_at_ms))
                    }
                    (None, _) => Duration::ZERO,
                };
                let record = fsdp_proto::v1::Round {
                    job: self.cfg.job.clone(),
                    ..round_record(&p, &self.view, &obs.reason, self.unix_ms(), since_previous)
                };
                let base = self.view.round.as_ref();
                let mut txn = records::commit_round(
                    &self.cfg.keys,
                    obs.fence,
                    self.view.coordinator_lease,
                    &record,
                    base.map(|b| (&*b.record, b.mod_rev)),
                );
                // This node is the round's rank 0: the round names its master in the same
                // write. Otherwise every member waits for a second event, after rank 0
                // has seen the round through its own watch (a quarter second at 1,000
                // members, where etcd sends the round to every watcher first).
                // Only from this process's own registration: one an earlier process left
                // (sealed before it expired) is not started by this one, which would
                // leave the members dialling a master nobody binds.
                let rank0 = record.members.first().is_some_and(|m| {
                    m.node_id == self.cfg.node_id
                        && m.lease == self.lease
                        && m.incarnation >= self.view.incarnation
                });
                if let Some(port) = rank0
                    .then(|| (self.cfg.pick_port)(&self.cfg.addr))
                    .flatten()
                {
                    let master = fsdp_proto::v1::Master {
                        schema: fsdp_proto::SCHEMA_VERSION,
                        round: p.number,
                        addr: self.cfg.addr.clone(),
                        port: u32::from(port),
                    };
                    txn.then.push(records::put(
                        self.cfg.keys.of(&master),
                        fsdp_proto::encode(&master),
                        self.lease,
                    ));
                }
                let then = Then::Commit {
                    number: p.number,
                    members: p.members.len(),
                    restart_count: p.restart_count,
                    reason: obs.reason,
                };
                self.issue(then, Op::Txn(txn));
                return true;
            }
        }
        false
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

/// The view a ranged read of the run gives.
fn fresh_view(m: &Machine, kvs: &[Kv]) -> View {
    // The refusals already said stay said: each re-read of the run (every re-sync) logged
    // every refused record once more.
    let mut fresh = View {
        allowed: m.view.allowed.clone(),
        refused: m.view.refused.clone(),
        ..View::default()
    };
    for kv in kvs {
        put_kv(&mut fresh, &m.cfg.keys, kv);
    }
    let present: std::collections::HashSet<&str> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    fresh.refused.retain(|k, _| present.contains(k.as_str()));
    fresh
}

/// Applies a stored key and value to `v`.
pub(super) fn put_kv(v: &mut View, keys: &crate::etcd::keys::Keys, kv: &Kv) {
    v.put(
        keys,
        &kv.key,
        &kv.value,
        kv.create_rev,
        kv.mod_rev,
        kv.lease,
    );
}
